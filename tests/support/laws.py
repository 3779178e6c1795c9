"""The exact law of short continuations, by enumeration: what a sampling test compares its counts to.

P(t1 .. tS | prompt) = prod_s q(t_s | prompt, t1 .. t_{s-1}), with q = `target_probs` of the model's
next-token logits under the request's temperature / top-k / top-p (the law every decode method must
reproduce exactly). Every path is enumerated breadth first, V^S of them, so S and V stay small.
"""

from __future__ import annotations

from typing import Callable

import torch

from rollout_ssd.sampling import target_probs


@torch.no_grad()
def exact_law(next_logits: Callable[[torch.Tensor], torch.Tensor], prompt: list[int], steps: int, vocab: int,
              temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The joint law of the next `steps` tokens after `prompt`, float64 [V] * steps, so that
    law[t1, .., tS] = P(t1 .. tS) and law.flatten() indexes (t1, .., tS) as t1 V^(S-1) + .. + tS.

    next_logits: contexts [N, T] (the prompt, then a path) -> next-token logits [N, V], one row per
    context. Each step's conditional law is renormalised in float64 (target_probs returns float32).
    """
    prefix = torch.tensor(prompt, dtype=torch.long)
    paths = torch.empty(1, 0, dtype=torch.long)  # [N, s]
    law = torch.ones(1, dtype=torch.float64)  # [N]
    for _ in range(steps):
        n = paths.shape[0]
        contexts = torch.cat([prefix.expand(n, -1), paths], dim=1)  # [N, T]
        logits = next_logits(contexts)
        q = target_probs(logits.float(), torch.full((n,), float(temperature)), torch.full((n,), int(top_k)),
                         torch.full((n,), float(top_p))).double()  # [N, V]
        q = q / q.sum(dim=1, keepdim=True)
        law = (law[:, None] * q).reshape(-1)  # [N * V]
        tokens = torch.arange(vocab).repeat(n)[:, None]
        paths = torch.cat([paths.repeat_interleave(vocab, dim=0), tokens], dim=1)
    return law.view((vocab,) * steps)


def hf_next_logits(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """`next_logits` for a transformers causal LM: its last-position logits (float32) per context."""
    return lambda contexts: model(contexts).logits[:, -1].float()


def decoder_next_logits(decoder) -> Callable[[torch.Tensor], torch.Tensor]:
    """`next_logits` for our Decoder (a LoadedModel's `.model`), through its training-style forward."""
    return lambda contexts: decoder.logits(decoder.forward_train(contexts))[:, -1].float()
