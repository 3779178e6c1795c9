"""A draft model as a speculator: any small model sharing the target's tokenizer.

The draft runs on our own runtime with its own KV cache. For each sequence it remembers how many of
the sequence's tokens its cache holds (`cached`); a round feeds every token it has not seen yet
(the last emitted token, plus the last accepted draft token when a whole chain was accepted) in one
multi-token forward, then drafts autoregressively. After verification it rolls its cache back to the
longest prefix that still matches the sequence, so the draft's KV stays in step with rollbacks.

Draft tokens are sampled from q = the same temperature/top-k/top-p processing applied to the
draft's logits (a close q accepts more; any q is exact because verification uses this very q), with
a generator stream of the sequence's own (stream 2) that verification never touches. Greedy rows
take argmax q. A restricted-head draft (head_token_ids) reports q on that support (`SparseDraft`).

Early stop (`stop_prob`): a sequence's chain ends before k tokens once the draft gave its drawn token
a probability below stop_prob (q of the drawn token; greedy rows: softmax of the draft logits at T=1,
whose argmax they take). The draft's own numbers decide the chain's length before the target sees it,
so verification stays exact; an unsure draft stops paying draft forwards for tokens it would lose.

New draft weights (`apply_draft_update`, between rounds) cut every sequence's draft KV to zero: the next
round's catch-up forward recomputes it from the whole sequence under the new weights.
"""

from __future__ import annotations

from typing import Optional

import torch

from rollout_ssd.models.decoder import Decoder
from rollout_ssd.runner import ModelRunner
from rollout_ssd.sampling import draw_tokens, row_params, sequence_generator, target_probs
from rollout_ssd.sequence import Sequence
from rollout_ssd.spec.chain_drafter import draft_chains
from rollout_ssd.spec.draft_kv import kept_length
from rollout_ssd.spec.speculator import Proposal, Speculator
from rollout_ssd.spec.verify import DenseDraft, SparseDraft

DRAFT_STREAM = 2
CATCH_UP_TOKENS = 2  # the most tokens a round's catch-up forward feeds after the first round


class DraftModelSpeculator(Speculator):
    name = "draft"

    def __init__(self, model: Decoder, num_slots: int, max_len: int, stop_prob: float = 0.0,
                 compiled_k: Optional[int] = None, compile_mode: str = "frozen"):
        """compiled_k: compile the draft's decode and catch-up steps (EngineConfig.compile) as
        `compile_mode` steps ("frozen" or "live"): frozen ones turn live when the draft's weights change,
        as the target's do. A catch-up is 1 or 2 tokens after the first round (the last emitted token, and
        the last drafted one when the whole chain was accepted): a batch with a 2-token row runs one
        2-token step (`CATCH_UP_TOKENS`; shorter rows padded), one of 1-token rows the decode step, and
        a longer catch-up (after a draft update) runs eagerly. Padding to k + 1 instead would cost more
        where a step's cost grows with its rows (an int4 draft, models/quant.py)."""
        if not 0.0 <= stop_prob < 1.0:
            raise ValueError(f"stop_prob must be in [0, 1), got {stop_prob!r}")
        self.model = model
        self.stop_prob = stop_prob
        self.runner = ModelRunner(model, num_slots=num_slots, max_len=max_len)
        if compiled_k is not None:
            self.runner.use_static_steps(compiled=compile_mode, pad_t=CATCH_UP_TOKENS)
        self.slot: dict[int, int] = {}  # id(seq) -> draft slot
        self.cached: dict[int, int] = {}  # id(seq) -> tokens of the sequence in the draft cache
        self.generators: dict[int, torch.Generator] = {}
        self.drafted: dict[int, list[int]] = {}  # id(seq) -> drafted tokens written after `cached`
        self.last_catch_up = 0  # the longest catch-up (tokens) the last `propose` fed
        # ... more than a round emits (its longest chain + 1): the draft had sat out rounds (AR's, SSD's), so
        # that call's time is a one-off's, not what drafting a round costs (ssd/telemetry.py leaves it out)
        self.lagged = False

    def draft_parameters(self) -> dict[str, torch.Tensor]:
        return self.model.hf_parameters()

    def apply_draft_update(self, update, params: dict[str, torch.Tensor], names: tuple[str, ...]) -> None:
        """Apply `update` (validated by its own `apply_to`, which raises ValueError before writing) and
        drop the draft KV built with the old weights."""
        update.apply_to(params)
        self.weights_changed()

    def weights_changed(self) -> None:
        """The draft's weights were written (here, or by whoever shares the model): drop the draft KV
        they built; the next round's catch-up forward recomputes it."""
        for key, slot in self.slot.items():
            self.runner.rollback(slot, 0)
            self.cached[key] = 0
            self.drafted[key] = []

    def on_admit(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            key = id(seq)
            self.slot[key] = self.runner.allocate()
            p = seq.params
            self.generators[key] = sequence_generator(p.seed, seq.prompt_index, seq.sample_index, DRAFT_STREAM)
            self.drafted[key] = []
        self.runner.prefill([self.slot[id(s)] for s in seqs], [s.prompt_token_ids for s in seqs])
        for seq in seqs:
            self.cached[id(seq)] = len(seq.prompt_token_ids)

    def on_release(self, seq: Sequence) -> None:
        key = id(seq)
        if key in self.slot:
            self.runner.free(self.slot.pop(key))
            del self.cached[key], self.generators[key], self.drafted[key]

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], early_stop: bool = True) -> Proposal:
        """Draft ks[i] tokens for seqs[i]. A restricted head is sampled over its own rows (the law is
        the same as over the vocabulary with -inf outside the head, at 1/6 of the width for the
        default draft), and q is reported on that support. A chain ends early after a token drawn
        with probability below `stop_prob`, unless `early_stop` is off (every chain ks[i] long)."""
        tokens: list[list[int]] = [[] for _ in seqs]
        self.last_catch_up, self.lagged = 0, False
        k_max = max(ks, default=0)
        head_ids = self.model.head_token_ids
        width = head_ids.numel() if head_ids is not None else self.model.cfg.vocab_size
        q_all = torch.zeros(len(seqs), max(k_max, 1), width, device=self.model.embed.device)  # [B, K, V or head]
        active = [i for i, k in enumerate(ks) if k > 0]
        if active:
            sub = [seqs[i] for i in active]
            k_sub = [ks[i] for i in active]
            temperature, top_k, top_p = row_params(sub)
            greedy = temperature <= 0
            gens = [self.generators[id(s)] for s in sub]

            def sample(step: int, rows: list[int], logits: torch.Tensor) -> list[int]:
                q = target_probs(logits, temperature[rows], top_k[rows], top_p[rows])  # the draft law
                drawn = draw_tokens(q, greedy[rows], [gens[r] for r in rows])
                if early_stop and self.stop_prob > 0.0 and step + 1 < k_max:
                    self._stop_unsure(k_sub, rows, step, logits, q, drawn, greedy[rows])
                if head_ids is not None:
                    drawn = head_ids[drawn]
                for j, r in enumerate(rows):
                    q_all[active[r], step] = q[j]
                return drawn.tolist()

            # catch up on every token the draft has not seen (at least the last emitted one)
            catch_up = [s.all_token_ids[self.cached[id(s)]:] for s in sub]
            self.last_catch_up = max(len(c) for c in catch_up)
            self.lagged = self.last_catch_up > max(k_sub) + 1
            chains = draft_chains(self.runner, [self.slot[id(s)] for s in sub], catch_up, k_sub, sample, head_only=True)
            for r, s in enumerate(sub):
                tokens[active[r]] = chains[r]
                self.cached[id(s)] = s.num_tokens
                self.drafted[id(s)] = chains[r][: k_sub[r] - 1]  # written into the draft cache
        if head_ids is None:
            q = DenseDraft(q_all)
        else:
            q = SparseDraft(head_ids.expand(len(seqs), q_all.shape[1], width), q_all)
        return Proposal(tokens=tokens, q=q)

    def _stop_unsure(self, k_sub: list[int], rows: list[int], step: int, logits: torch.Tensor, q: torch.Tensor,
                     drawn: torch.Tensor, greedy: torch.Tensor) -> None:
        """End the chains (k_sub[r] = step + 1) of rows whose drawn token had probability < stop_prob."""
        conf = q.gather(1, drawn[:, None])[:, 0]
        if bool(greedy.any()):  # q is a point mass there: its confidence is the T=1 softmax
            on_dev = greedy.to(conf.device)
            conf[on_dev] = torch.softmax(logits[on_dev].float(), -1).amax(-1)
        for j in (conf < self.stop_prob).nonzero()[:, 0].tolist():
            k_sub[rows[j]] = step + 1

    def on_verified(self, seqs: list[Sequence], accepted: list[int]) -> None:
        """Roll the draft cache back to the longest prefix that matches the sequence, minus its last
        token (which the next round feeds)."""
        for seq in seqs:
            key = id(seq)
            if key not in self.slot:
                continue
            keep = kept_length(self.cached[key], self.drafted[key], seq.all_token_ids)
            self.runner.rollback(self.slot[key], keep)
            self.cached[key] = keep
            self.drafted[key] = []
