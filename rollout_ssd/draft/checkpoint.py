"""A draft checkpoint on disk: config.json + model.safetensors, weights in bfloat16, no embedding.

A draft ships inside the package, so its checkpoint has a size limit (MAX_CHECKPOINT_BYTES). The limit
is checked twice: up front, from the draft's config alone (`check_checkpoint_size`: what `save_draft`
would write, before any data is sampled or any step trained, so a run is never spent on a draft that
cannot be saved), and again on the real bytes at save time. A save refused there still keeps the
weights, in a sibling `<path>.oversize` folder, so a trained draft is never thrown away.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from rollout_ssd.models.config import ModelConfig
from rollout_ssd.models.decoder import Decoder

MAX_CHECKPOINT_BYTES = 25_000_000
# An upper bound on one tensor's entry in the safetensors JSON header (name, dtype, shape, offsets).
_HEADER_BYTES_PER_TENSOR = 160


class CheckpointTooLarge(ValueError):
    """A draft checkpoint over the size limit; `kept_at` is where a refused save left the weights."""

    def __init__(self, message: str, kept_at: Optional[Path] = None):
        super().__init__(message)
        self.kept_at = kept_at


def _stored_params(cfg: ModelConfig) -> list[tuple[int, bool]]:
    """(element count, is the head's int64 token ids) of each tensor `save_draft` stores for `cfg`."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    nq, nkv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    layer = [h, h, nq * h, nkv * h, nkv * h, h * nq, inter * h, inter * h, h * inter]  # norms, q k v o, mlp
    if cfg.attention_bias:
        layer += [nq, nkv, nkv]
    if cfg.qk_norm:
        layer += [d, d]
    out = [(n, False) for n in layer] * cfg.num_layers + [(h, False)]  # + the final norm
    if cfg.head_vocab_size is not None:
        out += [(cfg.head_vocab_size * h, False), (cfg.head_vocab_size, True)]
    elif not cfg.tie_word_embeddings:
        out.append((cfg.vocab_size * h, False))
    return out  # the embedding is never stored (a draft shares its target's)


def tensor_bytes(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """The bytes of the tensors `save_draft` stores for a draft of config `cfg`: parameter count x
    dtype bytes (the head's token ids as int64), the shared embedding left out."""
    item = torch.empty((), dtype=dtype).element_size()
    return sum(n * (8 if token_ids else item) for n, token_ids in _stored_params(cfg))


def checkpoint_bytes(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """An upper bound on the model.safetensors size `save_draft` writes for a draft of config `cfg`:
    `tensor_bytes` plus a bound on the file's header."""
    return tensor_bytes(cfg, dtype) + 8 + _HEADER_BYTES_PER_TENSOR * (len(_stored_params(cfg)) + 1)


def check_checkpoint_size(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                          max_bytes: Optional[int] = MAX_CHECKPOINT_BYTES) -> int:
    """Raise CheckpointTooLarge now if a draft of config `cfg` would be refused at save time (call it
    before sampling data or training). Returns `checkpoint_bytes(cfg, dtype)`."""
    size = checkpoint_bytes(cfg, dtype)
    if max_bytes is not None and size > max_bytes:
        head = cfg.head_vocab_size or cfg.vocab_size
        raise CheckpointTooLarge(f"a draft of {cfg.num_layers} layers and a {head}-token head saves about {size} "
                                 f"bytes in {dtype}, over the {max_bytes}-byte limit: use fewer layers or a "
                                 f"smaller head")
    return size


def save_draft(draft: Decoder, hf_config: dict, path, dtype: torch.dtype = torch.bfloat16,
               max_bytes: Optional[int] = MAX_CHECKPOINT_BYTES) -> int:
    """config.json + model.safetensors (weights in `dtype`, no embedding) in `path`. Returns the file
    size. Over `max_bytes`, writes them to `<path>.oversize` instead and raises CheckpointTooLarge."""
    from safetensors.torch import save

    state = {}
    for name, t in draft.hf_parameters().items():
        if name == "model.embed_tokens.weight":
            continue
        state[name] = t.detach().clone().contiguous() if name == "lm_head.token_ids" else t.detach().to(dtype).contiguous()
    blob = save(state, metadata={"format": "pt"})
    path = Path(path)
    refused = max_bytes is not None and len(blob) > max_bytes
    where = path.with_name(path.name + ".oversize") if refused else path
    where.mkdir(parents=True, exist_ok=True)
    (where / "model.safetensors").write_bytes(blob)
    (where / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if refused:
        raise CheckpointTooLarge(f"draft checkpoint is {len(blob)} bytes, over the {max_bytes}-byte limit; "
                                 f"its weights are kept in {where}", kept_at=where)
    return len(blob)
