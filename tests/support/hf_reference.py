"""transformers as the reference: its logits and greedy generation for one unpadded sequence, the
relative error we compare against, and the built-in SmolLM2 as transformers loads it.

The SmolLM2 reference is transformers' own GGUF loader. It spends most of its load time parsing the
GGUF metadata (twice), so it is loaded once per test process (`hf_default_model`; the `hf_default`
fixture in tests/conftest.py).
"""

from __future__ import annotations

import functools

import torch


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|, over every element compared."""
    ref = ref.double()
    return float((ours.double() - ref).abs().max() / ref.abs().max())


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits [T, V] for one unpadded sequence."""
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, ids: list[int], max_new_tokens: int, eos_token_id=None, with_logits: bool = False):
    """transformers' greedy generate (batch 1, unpadded): the new tokens, and with_logits also their
    float32 logits [n, V]. eos_token_id=None: the model's generation config decides (a tiny model
    without EOS runs to max_new_tokens)."""
    kwargs = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=with_logits, **kwargs)
    tokens = out.sequences[0, len(ids):].tolist()
    if not with_logits:
        return tokens
    return tokens, torch.cat(out.logits, dim=0).float()


@functools.cache
def hf_default_model():
    """transformers' own GGUF loading of the built-in SmolLM2 (float32, eval), once per process."""
    from transformers import AutoModelForCausalLM

    from rollout_ssd.models.registry import resolve_builtin

    path = resolve_builtin("smollm2-135m-instruct")
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
