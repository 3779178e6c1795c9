"""TreeDrafter: the draft model's forwards for SSD: the glue forward, the branch tree and on-demand chains.

Cache construction for one round (docs/THEORY.md §2), per sequence with committed tokens x_1..x_n and the
chain s_1..s_K under verification:
  1. glue: ONE forward of the draft over [every committed token its KV lacks (normally just x_n),
     s_1..s_K]. The logits at depth j (after s_1..s_j) rank the bonus candidates of verdict (j, ·), and
     the KV it writes is exactly the draft's context for whatever prefix gets accepted.
  2. candidates: at depth j the top-F_j tokens of the draft's logits, skipping s_{j+1} (a rejected token
     has zero residual, so it can never be the bonus); at depth K nothing is skipped. We rank by logits
     rather than by q so greedy rows (q a point mass) and truncated laws (top-k/top-p) still get F_j
     distinct, sensible candidates; on q's support the two rankings agree. Ties: lower token id first.
  3. tree: for every branch (j, t) of every sequence, K draft tokens after t, all branches of all
     sequences in ONE forward per step (K forwards). A sequence's branches share its KV slot: the glue
     ends at cache position G, and step i's tokens are appended as one block of N (branch count) at
     G + i·N, branch r at G + i·N + r. Branch r of depth j sees cache positions [0, n + j) (the committed
     context and s_1..s_j) plus its own earlier tokens {G + i'·N + r : i' <= i}; its RoPE positions are
     n + j + i, as if the branch were the sequence. What a query sees goes to the attention backend
     as key spans, [0, n + j) and one span per own token (`tree_spans`), not as a mask: the Triton
     backend reads them directly, SDPA turns them into its mask. (The step-major layout is what
     `ModelRunner.extend` appends, so own tokens are N apart; kernels/reference.py's packed layout is
     branch-major.)
  Afterwards the slot is cut back to G: the branch region is scratch.

Sampling: every chain token (tree or on demand) at absolute index i is drawn from q = the row's
temperature/top-k/top-p law of the draft logits (greedy rows: argmax, no draw), by inverse CDF with the
counter-based uniform draft_uniforms(key, i) (ssd/rng.py), independent of batch and branch composition.
Saguaro (Definition 14): at chain position i the draft samples from q_C, which down-weights by C the
top-F_i tokens of that position's logits, F_i being the fan-out that depth i will get when this chain is
itself verified and cached. Every chain position is bent, the first and the deeper ones alike, because
every position is a potential rejection depth next round; depth K (all accepted) draws its bonus from p,
not from a residual, so nothing there is bent. The q returned (and verified) is q_C itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from rollout_ssd.models.decoder import Decoder
from rollout_ssd.runner import ModelRunner
from rollout_ssd.sampling import sample_from_probs, target_probs
from rollout_ssd.spec.chain_drafter import draft_chains
from rollout_ssd.spec.draft_kv import kept_length
from rollout_ssd.ssd.cache import CacheEntries
from rollout_ssd.ssd.rng import draft_uniforms
from rollout_ssd.ssd.saguaro import adaptive_c, entropy, saguaro_probs, top_f_mask


@dataclass
class DraftSeq:
    """The draft side's view of one sequence. Its KV slot holds committed[:base] + spec."""

    seq_id: int
    slot: int
    key: int  # counter-based RNG key (ssd/rng.py)
    temperature: float
    top_k: int
    top_p: float
    committed: list[int]
    base: int = 0
    spec: list[int] = field(default_factory=list)
    chain: list[int] = field(default_factory=list)  # the chain under verification


@dataclass(frozen=True)
class SaguaroRule:
    """C fixed (1.0 = off) or adaptive (C = adaptive_c(entropy(q), c_min) per row)."""

    C: Optional[float] = 1.0  # None: adaptive
    c_min: float = 0.3

    def values(self, q: torch.Tensor) -> Optional[torch.Tensor]:
        """[N] C per row, or None when nothing is bent."""
        if self.C is None:
            return adaptive_c(entropy(q), self.c_min)
        if self.C >= 1.0:
            return None
        return torch.full((q.shape[0],), float(self.C), device=q.device)


@dataclass
class BuildStats:
    glue_seconds: float = 0.0
    seconds: float = 0.0
    branches: int = 0


class TreeDrafter:
    def __init__(self, model: Decoder, runner: ModelRunner, k: int, saguaro: SaguaroRule):
        self.model = model
        self.runner = runner
        self.k = k
        self.saguaro = saguaro
        self.vocab = model.cfg.vocab_size

    # ------------------------------------------------------------------ bookkeeping
    def sync(self, st: DraftSeq) -> None:
        """Cut the KV back to the longest prefix that is still committed, keeping the last committed
        token out (every forward re-feeds it, so its logits come out)."""
        st.base = kept_length(st.base, st.spec, st.committed)
        st.spec = []
        self.runner.rollback(st.slot, st.base)

    # ------------------------------------------------------------------ sampling
    def sample(self, seqs: Sequence[DraftSeq], logits: torch.Tensor, index: torch.Tensor,
               bend: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one draft token per row. logits: [N, V]; index: [N] absolute token index being drawn;
        bend: Saguaro's F at this chain position (0: nothing bent). Returns tokens [N], q [N, V]."""
        temperature = torch.tensor([s.temperature for s in seqs], dtype=torch.float32)
        top_k = torch.tensor([s.top_k for s in seqs], dtype=torch.long)
        top_p = torch.tensor([s.top_p for s in seqs], dtype=torch.float32)
        q = target_probs(logits, temperature, top_k, top_p)
        greedy = temperature <= 0  # on the host, like the rows' keys: uniforms are made there, then moved
        tokens = logits.argmax(dim=-1)
        sampled = (~greedy).nonzero().squeeze(1)
        if sampled.numel():
            on = sampled.to(logits.device)
            qs = q[on]
            c = self.saguaro.values(qs) if bend > 0 else None
            if c is not None:
                qs = saguaro_probs(qs, top_f_mask(logits[on], bend), c)
                q[on] = qs
            keys = torch.tensor([seqs[i].key for i in sampled.tolist()], dtype=torch.long)
            u = draft_uniforms(keys, index.cpu()[sampled]).to(logits.device)
            tokens[on] = sample_from_probs(qs, u)
        return tokens, q

    # ------------------------------------------------------------------ on demand (SD / the draft as backup)
    @torch.inference_mode()
    def draft(self, seqs: Sequence[DraftSeq], lengths: Sequence[int], fanout: Sequence[int]
              ) -> list[tuple[list[int], torch.Tensor]]:
        """Serial chains: lengths[b] tokens after each sequence's committed context, as an SD draft
        would (one catch-up forward, then one decode per token). Returns (tokens, q [len, V]) per row."""
        empty = torch.zeros(0, self.vocab, device=self.model.embed.device)
        out: list[tuple[list[int], torch.Tensor]] = [([], empty) for _ in seqs]
        rows = [b for b, n in enumerate(lengths) if n > 0]
        if not rows:
            return out
        for b in rows:
            self.sync(seqs[b])
        sub = [seqs[b] for b in rows]
        sub_lengths = [lengths[b] for b in rows]
        catch_up = [s.committed[s.base:] for s in sub]
        for s in sub:
            s.base = len(s.committed)
        qs: list[list[torch.Tensor]] = [[] for _ in rows]

        def sample(step: int, live: list[int], logits: torch.Tensor) -> list[int]:
            index = torch.tensor([len(sub[r].committed) + step for r in live], dtype=torch.long)
            drawn, q = self.sample([sub[r] for r in live], logits, index, _at(fanout, step))
            drawn_list = drawn.tolist()
            for n, r in enumerate(live):
                qs[r].append(q[n])
                if sub_lengths[r] > step + 1:  # fed back: the draft KV holds it after committed
                    sub[r].spec.append(drawn_list[n])
            return drawn_list

        chains = draft_chains(self.runner, [s.slot for s in sub], catch_up, sub_lengths, sample)
        for r, b in enumerate(rows):
            out[b] = (chains[r], torch.stack(qs[r]))
        return out

    # ------------------------------------------------------------------ cache construction
    @torch.inference_mode()
    def build(self, seqs: Sequence[DraftSeq], fanout: Sequence[int], stats: Optional[BuildStats] = None
              ) -> dict[int, CacheEntries]:
        """Glue forward + tree decode for each sequence's `chain`; returns seq_id -> its CacheEntries.
        fanout: F_0..F_k (depth j of a shorter chain K_b uses F_j, and its all-accepted depth uses F_k)."""
        t0 = time.perf_counter()
        if not seqs:
            return {}
        for st in seqs:
            self.sync(st)
        catchup = [len(st.committed) - st.base for st in seqs]  # >= 1
        glue = [st.committed[st.base:] + st.chain for st in seqs]
        logits = self.runner.extend([st.slot for st in seqs], glue)  # [B, T, V]
        glue_end = []
        for st in seqs:
            st.spec = list(st.chain)
            st.base = len(st.committed)
            glue_end.append(self.runner.length(st.slot))
        t_glue = time.perf_counter()

        # candidates (depth j, token t) per sequence
        branches: list[list[tuple[int, int]]] = []
        depth_counts: list[tuple[int, ...]] = []
        f_max = max(fanout) if len(fanout) else 0
        for b, st in enumerate(seqs):
            K = len(st.chain)
            rows = logits[b, catchup[b] - 1: catchup[b] + K]  # [K+1, V]: depth 0..K
            order = top_candidates(rows, min(f_max + 1, self.vocab))
            mine, counts = [], []
            for j in range(K + 1):
                f = fanout[j] if j < K else fanout[-1]
                excluded = st.chain[j] if j < K else -1
                picked = [t for t in order[j] if t != excluded][:f]
                mine += [(j, t) for t in picked]
                counts.append(len(picked))
            branches.append(mine)
            depth_counts.append(tuple(counts))

        out: dict[int, CacheEntries] = {}
        live = [b for b in range(len(seqs)) if branches[b]]
        if live:
            out = self._tree(seqs, live, branches, depth_counts, glue_end, fanout)
        for b, st in enumerate(seqs):
            self.runner.rollback(st.slot, glue_end[b])
        if stats is not None:
            stats.glue_seconds += t_glue - t0
            stats.seconds += time.perf_counter() - t0
            stats.branches += sum(len(x) for x in branches)
        return out

    def _tree(self, seqs, live, branches, depth_counts, glue_end, fanout) -> dict[int, CacheEntries]:
        K = self.k
        sub = [seqs[b] for b in live]
        counts = torch.tensor([len(branches[b]) for b in live])  # [R] N_b
        n_max = int(counts.max())
        R = len(live)
        depth = torch.zeros(R, n_max, dtype=torch.long)
        for i, b in enumerate(live):
            depth[i, : counts[i]] = torch.tensor([j for j, _ in branches[b]])
        n_ctx = torch.tensor([len(st.committed) for st in sub])[:, None]  # [R, 1]
        visible = n_ctx + depth  # [R, Nmax]: the branch sees cache positions [0, n + j)
        ends = torch.tensor([glue_end[b] for b in live])[:, None]  # [R, 1]
        col = torch.arange(n_max)[None, :]
        valid = col < counts[:, None]  # [R, Nmax]
        flat_rows = valid.nonzero()  # [Ntot, 2] (row, branch), row-major
        flat_seq = [sub[int(i)] for i in flat_rows[:, 0]]
        flat_ctx = (n_ctx[:, 0][flat_rows[:, 0]] + depth[flat_rows[:, 0], flat_rows[:, 1]])  # index of t

        dev = self.model.embed.device  # the tree's tokens and q stay where the draft runs
        # every step writes every valid branch; padding (branch >= N_b) is never read: no fill needed
        tokens = torch.empty(R, n_max, K, dtype=torch.long, device=dev)
        q = torch.empty(R, n_max, K, self.vocab, device=dev)
        at_row, at_branch = flat_rows[:, 0].to(dev), flat_rows[:, 1].to(dev)
        feed = [[t for _, t in branches[b]] for b in live]
        for step in range(K):
            spans = tree_spans(visible, ends, counts, step, K)
            positions = visible + step  # [R, Nmax]
            logits = self.runner.extend([st.slot for st in sub], feed, positions=positions, spans=spans)
            drawn, qs = self.sample(flat_seq, logits[at_row, at_branch], flat_ctx + step + 1, _at(fanout, step))
            tokens[at_row, at_branch, step] = drawn
            q[at_row, at_branch, step] = qs
            grid = tokens[:, :, step].tolist()
            feed = [grid[i][: int(counts[i])] for i in range(R)]

        out = {}
        for i, b in enumerate(live):
            n = int(counts[i])
            index = {jt: r for r, jt in enumerate(branches[b])}
            # views, not copies: nothing writes these tensors again (the next build makes new ones)
            out[seqs[b].seq_id] = CacheEntries(tokens[i, :n], q[i, :n], index, depth_counts[b])
        return out


def top_candidates(rows: torch.Tensor, width: int) -> list[list[int]]:
    """Each row's `width` largest entries' indices, largest first, ties by lower index: the first `width`
    of a stable descending sort, without sorting the whole vocabulary (a full sort of a few rows of a
    49k vocabulary costs more than the draft forward that made them). Entries at or above the row's
    width-th largest value are the only ones that can be among them; only those are sorted."""
    if width <= 0:
        return [[] for _ in range(rows.shape[0])]
    cut = torch.topk(rows, width, dim=-1).values[:, -1:]  # [N, 1] the width-th largest value
    out = []
    for row, c in zip(rows, cut):
        idx = (row >= c).nonzero().squeeze(1)  # ascending index: the stable sort keeps ties in this order
        out.append(idx[torch.sort(row[idx], descending=True, stable=True).indices][:width].tolist())
    return out


def tree_spans(visible: torch.Tensor, ends: torch.Tensor, counts: torch.Tensor, step: int, k: int) -> torch.Tensor:
    """Key spans of tree step `step` (0-based): [R, Nmax, k + 1, 2] int64, half-open. Branch c of row r
    sees [0, visible[r, c]) (its context and glue prefix) and its own tokens so far, one span each at
    ends[r] + s * counts[r] + c for s <= step (the step-major layout); the remaining k - 1 - step spans
    are empty. visible [R, Nmax]; ends [R, 1] (the slot length after the glue); counts [R] (branches N_r).
    Columns c >= counts[r] are padding (the forward gives them key 0 only)."""
    r, n_max = visible.shape
    spans = torch.zeros(r, n_max, k + 1, 2, dtype=torch.long)
    spans[:, :, 0, 1] = visible
    col = torch.arange(n_max)[None, :]
    for s in range(step + 1):
        own = ends + s * counts[:, None] + col  # [R, Nmax]
        spans[:, :, 1 + s, 0] = own
        spans[:, :, 1 + s, 1] = own + 1
    return spans


def _at(fanout: Sequence[int], i: int) -> int:
    return int(fanout[i]) if 0 <= i < len(fanout) else 0
