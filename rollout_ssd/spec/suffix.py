"""Suffix speculation: propose what followed the longest matching suffix elsewhere (SPEC-RL, SuffixDecoding).

Sources. Every text that shares the sequence's prompt (a *group*, keyed by the prompt's token tuple):
  (a) the prompt itself, (b) the sequence so far, (c) its sibling samples running or finished in this
  engine (GRPO draws n samples per prompt, and they share much text), (d) earlier rollouts of the same
  prompt from earlier calls and steps, kept in a bounded LRU memory: at most `max_prompts` prompts and the
  newest `max_rollouts_per_prompt` completions of each, as compact token arrays.

Index. While a group has running sequences it owns one n-gram table: for every position t of each of its
texts and every n in [min_match, max_match], context text[t-n:t] -> counts of the continuation text[t].
The table is built once when the group becomes live (the prompt, then its remembered completions, oldest
first) and then grows by exactly the new tokens of each round, D = max_match - min_match + 1 updates per
token: a round costs O(new tokens · D + k · D) table operations whatever the length. The table is dropped
when the group's last running sequence is released; the texts stay in the memory. Cost ~100 B per
(token, order) while live; the memory holds 4 B per token.

Proposal. Find the longest suffix of the context (n from max_match down to min_match) that is a key, take
its most frequent continuation (ties: the most recently seen one, i.e. the freshest source), append it to
the context and repeat, up to k tokens; a stop token ends the chain (nothing after it can be emitted).

Confidence rule. Step i is estimated right with probability
    c_i = count(top) / (total + prior_count / n)          (n: the matched context length)
a Dirichlet pseudo-count for "a continuation not seen yet" that shrinks as the shared context grows (a
long shared context is strong evidence that the texts go on alike, as in variable-order Markov models).
Tokens are accepted only as a prefix, so under this model token i is accepted with probability
C_i = c_1 · ... · c_i, and it adds C_i expected tokens for one verify slot. We propose token i only while
C_i >= min_confidence: the threshold is the cost of a verify slot in tokens, and long chains of
disagreeing or weakly supported continuations no longer waste verify width.

Exactness. Proposals are point masses (`PointDraft`) chosen without looking at the verifier's uniforms,
so verification stays exact (verify.py): nothing here changes the output law, only the speed. That is
also why table keys are hashes of the n-grams: a collision can only make a proposal worse.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from rollout_ssd.sequence import Sequence
from rollout_ssd.spec.speculator import Proposal, Speculator, check_ks
from rollout_ssd.spec.verify import PointDraft


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SuffixConfig:
    """min_match, max_match: matched context lengths n indexed and tried (longest first).
    min_confidence: propose token i only while the chain's estimated acceptance C_i is at least this.
    prior_count: pseudo-count of an unseen continuation at n = 1 (prior_count / n at length n).
    max_rollouts_per_prompt (M), max_prompts (P): the cross-call memory's bounds (0 turns it off)."""

    min_match: int = 2
    max_match: int = 6
    min_confidence: float = 0.3
    prior_count: float = 1.0
    max_rollouts_per_prompt: int = 8
    max_prompts: int = 1024

    def __post_init__(self):
        if not _is_int(self.min_match) or self.min_match < 1:
            raise ValueError(f"SuffixConfig.min_match must be an integer >= 1, got {self.min_match!r}")
        if not _is_int(self.max_match) or self.max_match < self.min_match:
            raise ValueError(f"SuffixConfig.max_match must be an integer >= min_match, got {self.max_match!r}")
        if not isinstance(self.min_confidence, (int, float)) or not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"SuffixConfig.min_confidence must be in [0, 1], got {self.min_confidence!r}")
        if not isinstance(self.prior_count, (int, float)) or not 0.0 <= self.prior_count < float("inf"):
            raise ValueError(f"SuffixConfig.prior_count must be a finite number >= 0, got {self.prior_count!r}")
        for name in ("max_rollouts_per_prompt", "max_prompts"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"SuffixConfig.{name} must be an integer >= 0, got {value!r}")


class _NgramTable:
    """hash(context n-gram) -> its continuations. An entry is an int (one continuation, seen once: the
    common case, kept small) or a list [top token, top count, total, {token: count} or None]."""

    def __init__(self, min_match: int, max_match: int):
        self.min_match, self.max_match = min_match, max_match
        self._table: dict[int, int | list] = {}

    def add(self, window: list[int], start: int) -> int:
        """Index the continuations window[t] for t >= start; contexts may reach back into window[:start].
        Returns the number of table operations."""
        table, lo, hi = self._table, self.min_match, self.max_match
        ops = 0
        for t in range(max(start, lo), len(window)):
            tok = window[t]
            for n in range(lo, min(hi, t) + 1):
                key = hash(tuple(window[t - n : t]))
                entry = table.get(key)
                if entry is None:
                    table[key] = tok
                elif type(entry) is int:  # a second sighting: ties go to the fresher token
                    table[key] = [tok, 2, 2, None] if entry == tok else [tok, 1, 2, {entry: 1, tok: 1}]
                else:
                    _count(entry, tok)
                ops += 1
        return ops

    def lookup(self, context: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(top continuation, its count, total count) of a context, or None if never seen."""
        entry = self._table.get(hash(context))
        if entry is None:
            return None
        if type(entry) is int:
            return entry, 1, 1
        return entry[0], entry[1], entry[2]

    def __len__(self) -> int:
        return len(self._table)


def _count(entry: list, tok: int) -> None:
    entry[2] += 1
    counts = entry[3]
    if counts is None:
        if tok == entry[0]:
            entry[1] += 1
            return
        counts = entry[3] = {entry[0]: entry[1]}
    c = counts[tok] = counts.get(tok, 0) + 1
    if c >= entry[1]:  # >=: among equal counts the freshest continuation wins
        entry[0], entry[1] = tok, c


def _text_slice(prompt: tuple[int, ...] | list[int], completion: list[int], lo: int, hi: int) -> list[int]:
    """(prompt + completion)[lo:hi] without building the whole text."""
    p = len(prompt)
    if hi <= p:
        return list(prompt[lo:hi])
    if lo >= p:
        return completion[lo - p : hi - p]
    return list(prompt[lo:]) + completion[: hi - p]


@dataclass
class _Group:
    key: tuple[int, ...]  # the prompt's tokens
    table: _NgramTable
    members: dict[int, _Member] = field(default_factory=dict)  # id(seq) -> its running member


@dataclass
class _Member:
    seq: Sequence
    group: _Group
    indexed: int = 0  # completion tokens already in the group's table


class SuffixSpeculator(Speculator):
    """Suffix/n-gram speculation over the prompt, the sequence, its siblings and earlier rollouts of the
    same prompt (see the module docstring). Proposals are `PointDraft`s."""

    name = "suffix"

    def __init__(self, config: SuffixConfig | None = None):
        self.config = config if config is not None else SuffixConfig()
        self._memory: OrderedDict[tuple[int, ...], deque[array]] = OrderedDict()  # LRU: oldest first
        self._groups: dict[tuple[int, ...], _Group] = {}  # live groups
        self._members: dict[int, _Member] = {}  # id(seq) -> member
        self.index_ops = 0  # n-gram table updates + lookups so far: a cost counter for tests and benchmarks

    # ---- the Speculator interface --------------------------------------------------------------------

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Proposal:
        check_ks(seqs, ks)
        tokens = [self.chain(seq, k)[0] if k > 0 else [] for seq, k in zip(seqs, ks)]
        return Proposal(tokens=tokens, q=PointDraft())

    def on_admit(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._member(seq)

    def on_verified(self, seqs: list[Sequence], accepted: list[int]) -> None:
        for seq in seqs:
            self._sync(self._member(seq))

    def on_release(self, seq: Sequence) -> None:
        """Keep the finished text for its siblings (the group's table) and for later calls (the memory)."""
        member = self._members.get(id(seq))
        if member is None:
            self.remember(seq.prompt_token_ids, seq.token_ids)
            return
        self._sync(member)
        self._detach(member)
        self._store(member.group.key, seq.token_ids)  # already in the group's table

    def close(self) -> None:
        self._memory.clear()
        self._groups.clear()
        self._members.clear()

    # ---- memory --------------------------------------------------------------------------------------

    def remember(self, prompt_ids: list[int], completion_ids: list[int]) -> None:
        """Feed a rollout of `prompt_ids` explicitly: kept in the memory, and used at once if that prompt's
        group is live."""
        key, completion = tuple(prompt_ids), [int(t) for t in completion_ids]
        if not completion:
            return
        self._store(key, completion)
        group = self._groups.get(key)
        if group is not None:
            self._index(group, key, completion, 0)

    def forget_all(self) -> None:
        """Forget every earlier rollout (after a big policy change). Running sequences keep their prompt
        and their own texts; finished siblings of live groups are forgotten too."""
        self._memory.clear()
        for group in self._groups.values():
            group.table = self._new_table(group.key)
            for member in group.members.values():
                member.indexed = 0
                self._sync(member)

    def remembered(self, prompt_ids: list[int]) -> list[list[int]]:
        """The completions kept for a prompt, oldest first (does not count as a use for the LRU)."""
        return [list(c) for c in self._memory.get(tuple(prompt_ids), ())]

    @property
    def num_remembered_prompts(self) -> int:
        return len(self._memory)

    @property
    def num_live_groups(self) -> int:
        return len(self._groups)

    # ---- proposing -----------------------------------------------------------------------------------

    def chain(self, seq: Sequence, k: int) -> tuple[list[int], list[float]]:
        """Up to k proposed tokens for `seq` and their cumulative confidences C_1 >= C_2 >= ... (each C_i
        >= min_confidence): the estimated probability that token i is accepted (module docstring)."""
        cfg = self.config
        member = self._member(seq)
        self._sync(member)
        table = member.group.table
        completion = seq.token_ids
        total_len = len(seq.prompt_token_ids) + len(completion)
        context = _text_slice(seq.prompt_token_ids, completion, max(0, total_len - cfg.max_match), total_len)
        tokens: list[int] = []
        confidences: list[float] = []
        confidence, longest = 1.0, cfg.max_match
        while len(tokens) < k:
            hit = None
            # A match after appending the top continuation of an n-gram is at most n + 1 long.
            for n in range(min(longest, len(context)), cfg.min_match - 1, -1):
                self.index_ops += 1
                hit = table.lookup(tuple(context[len(context) - n :]))
                if hit is not None:
                    break
            if hit is None:
                break
            tok, top, total = hit
            confidence *= top / (total + cfg.prior_count / n)
            if confidence < cfg.min_confidence:
                break
            tokens.append(tok)
            confidences.append(confidence)
            if tok in seq.stop_ids:
                break
            context.append(tok)
            if len(context) > cfg.max_match:
                del context[0]
            longest = min(n + 1, cfg.max_match)
        return tokens, confidences

    # ---- bookkeeping ---------------------------------------------------------------------------------

    def _new_table(self, prompt: tuple[int, ...]) -> _NgramTable:
        table = _NgramTable(self.config.min_match, self.config.max_match)
        self.index_ops += table.add(prompt, 0)
        return table

    def _index(self, group: _Group, prompt: tuple[int, ...] | list[int], completion: list[int], done: int) -> None:
        """Add completion[done:] to the group's table; contexts reach back max_match tokens."""
        p, n = len(prompt), len(completion)
        lo = max(0, p + done - self.config.max_match)
        window = _text_slice(prompt, completion, lo, p + n)
        self.index_ops += group.table.add(window, p + done - lo)

    def _member(self, seq: Sequence) -> _Member:
        """The sequence's member, admitting it (and building its group if needed) on first sight.
        Members hold their sequence, so id(seq) cannot be reused while it is a key."""
        member = self._members.get(id(seq))
        if member is not None:
            return member
        key = tuple(seq.prompt_token_ids)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(key, self._new_table(key))
            if key in self._memory:
                self._memory.move_to_end(key)
                for completion in self._memory[key]:  # oldest first: fresher texts win ties
                    self._index(group, key, completion.tolist(), 0)
        member = _Member(seq, group)
        group.members[id(seq)] = member
        self._members[id(seq)] = member
        self._sync(member)
        return member

    def _sync(self, member: _Member) -> None:
        """Index the tokens the sequence emitted since the last call (only those)."""
        seq = member.seq
        if len(seq.token_ids) > member.indexed:
            self._index(member.group, seq.prompt_token_ids, seq.token_ids, member.indexed)
            member.indexed = len(seq.token_ids)

    def _detach(self, member: _Member) -> None:
        del self._members[id(member.seq)]
        group = member.group
        del group.members[id(member.seq)]
        if not group.members and self._groups.get(group.key) is group:
            del self._groups[group.key]

    def _store(self, key: tuple[int, ...], completion: list[int]) -> None:
        cfg = self.config
        if not completion or cfg.max_prompts == 0 or cfg.max_rollouts_per_prompt == 0:
            return
        rollouts = self._memory.get(key)
        if rollouts is None:
            rollouts = self._memory[key] = deque(maxlen=cfg.max_rollouts_per_prompt)
        else:
            self._memory.move_to_end(key)
        rollouts.append(array("i", completion))
        while len(self._memory) > cfg.max_prompts:
            self._memory.popitem(last=False)
