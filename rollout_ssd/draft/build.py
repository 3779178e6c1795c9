"""Building a draft from its target: the first L layers, a shared embedding, a restricted head.

The draft is the target's first L layers and final norm, the target's embedding shared and frozen
(not stored), and an LM head restricted to the N most frequent completion tokens, initialised from the
target's output rows of those tokens. Verification stays exact with a restricted head: q is the
distribution the draft sampled from, and it is 0 outside the head.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch
from torch import nn

from rollout_ssd.draft.teacher import TeacherSample
from rollout_ssd.models.config import ModelConfig
from rollout_ssd.models.decoder import Decoder


def select_head_tokens(samples: Sequence[TeacherSample], size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` most frequent completion tokens (plus `always`, e.g. EOS), sorted ids [size]."""
    counts = torch.zeros(max(max(s.token_ids) for s in samples) + 1, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(torch.tensor(s.token_ids[s.prompt_len:]), minlength=len(counts))
    for t in always:
        if t < len(counts):
            counts[t] = counts.max() + 1
    order = counts.argsort(descending=True, stable=True)
    return order[:size].sort().values


def coverage(head_token_ids: torch.Tensor, samples: Sequence[TeacherSample]) -> float:
    """Share of completion tokens the head can produce."""
    head = set(head_token_ids.tolist())
    toks = [t for s in samples for t in s.token_ids[s.prompt_len:]]
    return sum(t in head for t in toks) / max(len(toks), 1)


def draft_hf_config(target_hf_config, num_layers: int, head_size: int) -> dict:
    """The draft's config.json: the target's (rope, norms, heads, ...) with fewer layers, a restricted
    head and a shared embedding. Quantization entries of a GGUF source are dropped."""
    cfg = target_hf_config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "architectures", "dtype",
                "torch_dtype"):
        cfg.pop(key, None)
    cfg.update(model_type="llama" if cfg.get("model_type") == "llama" else cfg["model_type"],
               architectures=["LlamaForCausalLM"] if cfg.get("model_type") == "llama" else None,
               num_hidden_layers=num_layers, head_vocab_size=int(head_size), shares_target_embedding=True,
               tie_word_embeddings=False, dtype="bfloat16")
    return {k: v for k, v in cfg.items() if v is not None}


def draft_config(target_cfg: ModelConfig, num_layers: int, head_size: int) -> ModelConfig:
    """The config of a draft `make_draft` builds: the target's with fewer layers, a `head_size`-token
    head and the target's embedding shared (known before any data exists: checkpoint.check_checkpoint_size)."""
    return replace(target_cfg, num_layers=num_layers, head_vocab_size=int(head_size), shares_target_embedding=True,
                   tie_word_embeddings=False)


def make_draft(target: Decoder, head_token_ids: torch.Tensor, num_layers: int = 2) -> Decoder:
    """A float32 draft: target layers 0..num_layers-1 and final norm, the target's embedding shared
    (frozen), LM head = the target's output rows of `head_token_ids`. Trainable parameters have
    requires_grad=True (everything but the embedding)."""
    cfg = draft_config(target.cfg, num_layers, len(head_token_ids))
    draft = Decoder(cfg, target.inv_freq.clone(), target.rope_scaling, dtype=torch.float32)
    src = target.hf_parameters()
    state = {name: src[name] for name in draft.hf_parameters() if name in src and not name.startswith("lm_head")}
    full_head = target.lm_head
    state["lm_head.weight"] = full_head[head_token_ids]
    state["lm_head.token_ids"] = head_token_ids
    with torch.no_grad():
        params = draft.hf_parameters()
        draft.embed = (target.embed if target.embed.dtype == torch.float32 else
                       nn.Parameter(target.embed.detach().float(), requires_grad=False))
        for name, tensor in state.items():
            if name != "model.embed_tokens.weight":
                params[name].copy_(tensor)
    for p in trainable_parameters(draft):
        p.requires_grad_(True)
    return draft


def rehead(draft: Decoder, target: Decoder, head_token_ids: torch.Tensor) -> Decoder:
    """A trained draft with its restricted head over other tokens (`head_token_ids`, sorted): a token
    the old head had keeps its trained row, a new one starts from the target's output row (as
    `make_draft` starts every row). Returns a new float32 draft; `draft` is left as it was."""
    if draft.head_token_ids is None:
        raise ValueError("rehead: the draft has a full head (no head_token_ids)")
    old_ids, old_rows = draft.head_token_ids.detach(), draft.lm_head.detach().float()
    out = make_draft(target, head_token_ids, draft.cfg.num_layers)
    with torch.no_grad():
        src, dst = draft.hf_parameters(), out.hf_parameters()
        for name, tensor in src.items():
            if not name.startswith("lm_head") and name != "model.embed_tokens.weight":
                dst[name].copy_(tensor)
        device = old_ids.device
        where = torch.full((max(int(old_ids.max()), int(head_token_ids.max())) + 1,), -1, dtype=torch.long,
                           device=device)
        where[old_ids] = torch.arange(len(old_ids), device=device)
        at = where[head_token_ids.to(device)]
        kept = at >= 0
        dst["lm_head.weight"][kept] = old_rows[at[kept]]
    return out


def check_grow(draft_layers: int, num_layers: int, target_layers: int) -> None:
    """ValueError unless a draft of `draft_layers` can `grow` to `num_layers`: deeper than it is, and at
    most the target's depth (the layers it takes are the target's)."""
    if not draft_layers < num_layers <= target_layers:
        raise ValueError(f"grow: num_layers must be in ({draft_layers}, {target_layers}] (the draft's layers, the "
                         f"target's), got {num_layers}")


def grow(draft: Decoder, target: Decoder, num_layers: int) -> Decoder:
    """A trained draft made deeper without changing what it computes: its layers, norm and head, then
    the target's layers len(draft.layers)..num_layers-1 with their output projections (attention's o_proj,
    the MLP's down_proj) zeroed, so that each new layer adds nothing to the residual stream until
    trained. The new layers' other weights start from the target's, so once their outputs move off zero
    they read features the target computes at that depth. Returns a new float32 draft; `draft` is left
    as it was."""
    if draft.head_token_ids is None:
        raise ValueError("grow: the draft has a full head (no head_token_ids)")
    old = len(draft.layers)
    check_grow(old, num_layers, len(target.layers))
    out = make_draft(target, draft.head_token_ids.detach().clone(), num_layers)
    with torch.no_grad():
        src, dst = draft.hf_parameters(), out.hf_parameters()
        for name, tensor in src.items():
            if name not in ("model.embed_tokens.weight", "lm_head.token_ids"):
                dst[name].copy_(tensor)
        for i in range(old, num_layers):
            for part in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                dst[f"model.layers.{i}.{part}"].zero_()
    return out


def trainable_parameters(draft: Decoder) -> list[nn.Parameter]:
    return [p for name, p in draft.named_parameters() if name not in ("embed", "head_token_ids")]


def round_weights(draft: Decoder, dtype: torch.dtype = torch.bfloat16) -> None:
    """Round trainable weights to `dtype` in place (kept in float32): the draft then computes exactly
    what the checkpoint saved in `dtype` computes after loading in float32."""
    with torch.no_grad():
        for p in trainable_parameters(draft):
            p.copy_(p.to(dtype).float())

