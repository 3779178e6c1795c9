"""Teacher data: prompt + completion token ids with the teacher's top-k log-probs at each completion token.

A `TeacherSample`'s row j is the full-vocabulary log-softmax (T = 1) of the distribution token
token_ids[prompt_len + j] was drawn from, cut to its top k. It comes either from sampling
(on_policy.sample_with_teacher keeps the logits the engine sampled from) or from a separate teacher
pass over sequences made elsewhere (`teacher_topk`, e.g. engine rollouts in RL). The data cache holds
plain lists and tensors only, so it loads with torch.load(weights_only=True).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from rollout_ssd.models.decoder import Decoder


@dataclass
class TeacherSample:
    """prompt + completion token ids, and the teacher's top-k log-probs (full-vocabulary log-softmax,
    T = 1) for each completion token: row j is the distribution token_ids[prompt_len + j] was drawn from."""

    token_ids: list[int]
    prompt_len: int
    topk_ids: torch.Tensor      # [n, k] int32
    topk_logp: torch.Tensor     # [n, k] float16

    @property
    def num_completion(self) -> int:
        return len(self.token_ids) - self.prompt_len


@torch.no_grad()
def save_samples(path, samples: Sequence[TeacherSample], next_prompt: int, prompt_set: Optional[dict] = None) -> None:
    """A data cache of plain lists, ints and host tensors (loadable with torch.load(weights_only=True) on
    any machine: tensors made on a GPU are copied to the host). `prompt_set`: plain values naming the
    prompt list that `next_prompt` indexes (a run that samples more from the cache must have the same)."""
    torch.save({"format": "teacher-samples-v1", "next_prompt": int(next_prompt), "prompt_set": dict(prompt_set or {}),
                "token_ids": [list(s.token_ids) for s in samples], "prompt_len": [int(s.prompt_len) for s in samples],
                "topk_ids": [s.topk_ids.cpu() for s in samples], "topk_logp": [s.topk_logp.cpu() for s in samples]},
               path)


@dataclass
class DataCache:
    samples: list[TeacherSample]
    next_prompt: int
    prompt_set: dict  # what `save_samples` was told of the prompt list ({} for a cache from before the record)


def load_cache(path) -> DataCache:
    """`save_samples`'s file, unpickling nothing but tensors and plain data."""
    data = torch.load(path, weights_only=True)
    if not isinstance(data, dict) or data.get("format") != "teacher-samples-v1":
        raise ValueError(f"{path}: not a teacher-samples-v1 data cache")
    fields = zip(data["token_ids"], data["prompt_len"], data["topk_ids"], data["topk_logp"])
    return DataCache([TeacherSample(list(t), int(p), ids, logp) for t, p, ids, logp in fields], int(data["next_prompt"]),
                     dict(data.get("prompt_set") or {}))


def check_prompt_set(path, recorded: dict, prompt_set: dict) -> None:
    """ValueError where a cache records another prompt list than a run that samples on from it: its
    next_prompt would index the other list (a cache without a record passes)."""
    if recorded and recorded != prompt_set:
        differ = sorted(k for k in set(recorded) | set(prompt_set) if recorded.get(k) != prompt_set.get(k))
        said = "; ".join(f"{k}: cache {recorded.get(k)!r}, this run {prompt_set.get(k)!r}" for k in differ)
        raise ValueError(f"{path}: sampled from another prompt list ({said}); sampling on from its next_prompt "
                         f"would take other prompts. Use another --data-cache or the same prompt options")


def load_samples(path) -> tuple[list[TeacherSample], int]:
    """(samples, next_prompt) of `load_cache`."""
    cache = load_cache(path)
    return cache.samples, cache.next_prompt


def topk_logp(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k of log_softmax(logits) per row: (ids [N, k] int32, log-probs [N, k] float16)."""
    values, ids = logits.float().topk(k, dim=-1)
    return ids.to(torch.int32), (values - torch.logsumexp(logits.float(), dim=-1, keepdim=True)).half()


@torch.no_grad()
def teacher_topk(target: Decoder, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                 top_k: int = 64) -> list[TeacherSample]:
    """The teacher's top-k log-probs over the completion part of existing sequences (one
    `forward_train` per sequence; for rollouts made elsewhere, e.g. by the engine in RL). The token ids go
    to the target's device; the samples' tensors stay there."""
    device = target.embed.device
    out = []
    for seq, plen in zip(sequences, prompt_lens):
        if len(seq) <= plen or plen < 1:
            continue
        hidden = target.forward_train(torch.tensor([list(seq[:-1])], device=device))[0, plen - 1:]
        ids, logp = topk_logp(target.logits(hidden), top_k)
        out.append(TeacherSample(list(seq), plen, ids, logp))
    return out

