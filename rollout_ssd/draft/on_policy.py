"""On-policy data: completions the target samples through the engine, with the teacher's top-k kept.

The target samples with the engine's own loop and law (`RolloutEngine.submit`, method "ar": the same
`target_probs`, `draw_tokens` and per-sequence generators seeded by (seed, prompt index, 0)), one
request per temperature, all joining one running batch. The logits the engine sampled each completion
token from ARE the teacher's distributions there, so `sample_with_teacher` keeps their top-k on the
fly, through a thin view of the target (`TeacherTap`) that sees every forward the engine's runner
makes, instead of running the target a second time over prompt + completion (on a CPU that second
pass costs about as much as sampling). `teacher.teacher_topk` is that second pass, for sequences made
elsewhere; the tests check that both give the same top-k.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Optional, Sequence

import torch

from rollout_ssd.config import EngineConfig, SpecConfig
from rollout_ssd.draft.teacher import TeacherSample, topk_logp
from rollout_ssd.engine import RolloutEngine
from rollout_ssd.models.decoder import Decoder, ForwardBatch
from rollout_ssd.models.loader import LoadedModel
from rollout_ssd.params import SamplingParams


class _Occupant:
    """One sequence's stay in a KV slot, as the tap saw it: the tokens fed and the top-k per logits row."""

    def __init__(self, prompt: list[int]):
        self.fed = list(prompt)
        self.prompt_len = len(prompt)
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] = []


class TeacherTap:
    """The target as the engine's runner sees it (every attribute is the target's), keeping the top-k
    log-probs of each logits row the runner asks for: one row per emitted token in an AR engine (the
    prefill's last position, then each decode step). A forward writing a slot from position 0 starts
    a new occupant of that slot; `records` then matches occupants to the sequences by the tokens fed."""

    def __init__(self, model: Decoder, top_k: int):
        self._model = model
        self._top_k = top_k
        self._slots: list[int] = []
        self._current: dict[int, _Occupant] = {}
        self._occupants: list[_Occupant] = []
        self._by_key: Optional[dict[tuple, list[_Occupant]]] = None

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, batch: ForwardBatch, cache) -> torch.Tensor:
        for b, (slot, start, n) in enumerate(zip(batch.slots, batch.starts, batch.num_new)):
            new = batch.tokens[b, :n].tolist()
            if start == 0:
                self._current[slot] = _Occupant(new)
                self._occupants.append(self._current[slot])
            else:
                self._current[slot].fed.extend(new)
        self._slots = list(batch.slots)
        return self._model(batch, cache)

    def on_copy(self, src: int, dst: int, length: int, moved: bool) -> None:
        """A KV cache's copy between slots (`KVCache.observers`), which no forward shows: a moved sequence's
        stay continues in its new slot; a prompt's KV copied into another (a repeated prompt prefilled
        once) starts a new occupant there with the same tokens and the prefill's row."""
        if moved:
            self._current[dst] = self._current.pop(src)
            return
        source = self._current[src]
        if len(source.fed) != length:
            raise RuntimeError(f"TeacherTap: a copy of {length} entries of slot {src}, which holds {len(source.fed)}")
        self._current[dst] = occupant = _Occupant(source.fed)
        occupant.rows = list(source.rows)
        self._occupants.append(occupant)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._model.logits(hidden)
        if logits.dim() != 2 or logits.shape[0] != len(self._slots):
            raise RuntimeError("TeacherTap expects one logits row per batch row (an AR engine's forwards)")
        ids, logp = topk_logp(logits, self._top_k)
        for j, slot in enumerate(self._slots):
            self._current[slot].rows.append((ids[j], logp[j]))
        return logits

    def records(self, prompt: list[int], completion: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The top-k rows of the sequence prompt + completion: one per completion token."""
        key = tuple(prompt + completion[:-1])
        if self._by_key is None:
            self._by_key = defaultdict(list)
            for occ in self._occupants:
                self._by_key[tuple(occ.fed)].append(occ)
        matches = self._by_key.get(key)
        if not matches:
            raise RuntimeError("TeacherTap saw no forward over this sequence's tokens")
        rows = matches.pop().rows
        if len(rows) != len(completion):
            raise RuntimeError(f"TeacherTap kept {len(rows)} rows for {len(completion)} completion tokens")
        return rows


def sample_continuations(target, prompt_ids: Sequence[Sequence[int]], temperatures: Sequence[float],
                         max_new_tokens: int, batch_size: int = 32, seed: int = 0,
                         deadline: Optional[float] = None) -> list[list[int]]:
    """Sample a completion per prompt through a `RolloutEngine` (method "ar") over `target` (a Decoder,
    or a `TeacherTap` over one), with temperatures[i] for prompt i and sample 0 of prompt index i
    seeded by (seed, i). After `deadline` (time.monotonic()) no new prompt starts and running ones stop
    where they are. Returns the completions in prompt order (prompts never started get [])."""
    if not prompt_ids or (deadline is not None and time.monotonic() > deadline):
        return [[] for _ in prompt_ids]
    cfg = target.cfg
    max_len = min(max(len(p) for p in prompt_ids) + max_new_tokens + 1, cfg.max_position_embeddings)
    groups: dict[float, list[int]] = defaultdict(list)
    for i, t in enumerate(temperatures):
        groups[float(t)].append(i)
    engine = RolloutEngine(LoadedModel(model=target, hf_config=None, tokenizer=None, source="teacher"),
                           SpecConfig(method="ar"), EngineConfig(max_batch_size=batch_size, max_model_len=max_len))
    if isinstance(target, TeacherTap):
        engine.runner.cache.observers.append(target.on_copy)
    requests = []

    def stop_at_deadline(_request, _finished):
        if deadline is not None and time.monotonic() > deadline:
            for r in requests:
                r.cancel()

    try:
        engine.pause()  # every group joins the first batch, as one request would
        for temperature, rows in groups.items():
            params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
            requests.append(engine.submit([list(prompt_ids[i]) for i in rows], params, prompt_indices=rows,
                                          listener=stop_at_deadline))
        engine.resume()
        for r in requests:
            r.wait()
            if r.error is not None:
                raise r.error
    finally:
        engine.close()
    completions: list[list[int]] = [[] for _ in prompt_ids]
    for r in requests:
        for s in r.seqs:
            completions[s.prompt_index] = list(s.token_ids)
    return completions


def sample_with_teacher(target: Decoder, prompt_ids: Sequence[Sequence[int]], temperatures: Sequence[float],
                        max_new_tokens: int, top_k: int = 64, batch_size: int = 32, seed: int = 0,
                        deadline: Optional[float] = None) -> list[TeacherSample]:
    """On-policy completions from `target` with the teacher's top-k log-probs recorded while sampling,
    in prompt order. Prompts cut off by the deadline before their first token are left out."""
    tap = TeacherTap(target, top_k)
    completions = sample_continuations(tap, prompt_ids, temperatures, max_new_tokens, batch_size, seed, deadline)
    out = []
    for prompt, completion in zip(prompt_ids, completions):
        if completion:
            rows = tap.records(list(prompt), completion)
            out.append(TeacherSample(list(prompt) + completion, len(prompt), torch.stack([r[0] for r in rows]),
                                     torch.stack([r[1] for r in rows])))
    return out
