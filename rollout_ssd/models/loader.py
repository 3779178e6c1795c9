"""Loading a decoder from an HF checkpoint directory (config.json + safetensors) or a GGUF file.

GGUF files are dequantized on load with the `gguf` package; llama.cpp stores Llama q/k projections
with rows permuted for its interleaved RoPE, which we undo so the weights are in HF layout. The
tokenizer of a GGUF file is converted by transformers once and cached, and so is the GGUF's tensor index
(models/gguf_loader.py): in `$ROLLOUT_SSD_CACHE` (default ~/.cache/rollout_ssd), keyed by the file's path,
size and mtime.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from rollout_ssd.models.config import model_config_from_hf, rope_inv_freq
from rollout_ssd.models.cpu_dtype import auto_dtype
from rollout_ssd.models.decoder import Decoder
from rollout_ssd.models.disk_cache import cache_root, file_key
from rollout_ssd.models.quant import DEFAULT_GROUP, quantize_int4
from rollout_ssd.models.registry import INT4_DRAFT, resolve_builtin, resolve_draft

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# Tensors some checkpoints carry that the decoder derives instead of reading.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: Decoder
    hf_config: object
    tokenizer: Optional[object]
    source: str


def parse_dtype(dtype) -> torch.dtype:
    """A torch dtype from its name; "auto" is the CPU backend's pick for this machine
    (`cpu_dtype.auto_dtype`: bfloat16 where bf16 matmuls run natively or at memory speed through the bf16
    rows kernel's widened build, else float32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype()
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (supported: auto, {sorted(DTYPES)})")
    return DTYPES[dtype]


def resolve_source(name_or_path: str) -> Path:
    """A built-in name, an HF checkpoint directory or a .gguf file -> its path."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ValueError(f"model must be a built-in name or a path, got {name_or_path!r}")
    builtin = resolve_builtin(str(name_or_path))
    if builtin is not None:
        return builtin
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ValueError(
        f"model {str(name_or_path)!r} is neither a built-in name, an HF checkpoint directory with "
        f"config.json, nor a .gguf file"
    )


def build_decoder(hf_config, state: dict[str, torch.Tensor], dtype: torch.dtype,
                  share_embedding_from: Optional[Decoder] = None) -> Decoder:
    """A decoder with `state` (HF names) copied in; every tensor checked by name and shape.
    A draft whose config says `shares_target_embedding` takes `share_embedding_from`'s embedding."""
    cfg = model_config_from_hf(hf_config)
    inv_freq, scaling = rope_inv_freq(hf_config)
    model = Decoder(cfg, inv_freq, scaling, dtype=dtype)
    if cfg.shares_target_embedding:
        if share_embedding_from is None:
            raise ValueError("this draft shares its target's embedding: load it with its target")
        target_embed = share_embedding_from.embed
        if target_embed.shape != model.embed.shape:
            raise ValueError(f"draft embedding shape {tuple(model.embed.shape)} does not match the target's "
                             f"{tuple(target_embed.shape)}")
        model.embed = nn.Parameter(target_embed.detach().to(dtype), requires_grad=False)
        state = {**state, "model.embed_tokens.weight": model.embed}
    load_state(model, state)
    return model


def load_state(model: Decoder, state: dict[str, torch.Tensor]) -> None:
    params = model.hf_parameters()
    state = {k: v for k, v in state.items() if not k.endswith(IGNORED_SUFFIXES)}
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied checkpoints sometimes store it anyway
    missing = sorted(set(params) - set(state))
    if missing:
        raise ValueError(f"checkpoint is missing tensor(s): {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unknown = sorted(set(state) - set(params))
    if unknown:
        raise ValueError(f"checkpoint has unknown tensor(s): {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)


def load_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint directory {str(path)!r} has no .safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_pretrained(name_or_path: str, dtype="auto", with_tokenizer: bool = True,
                    share_embedding_from: Optional[Decoder] = None) -> LoadedModel:
    dtype = parse_dtype(dtype)
    path = resolve_source(name_or_path)
    if path.suffix == ".gguf":
        from rollout_ssd.models.gguf_loader import load_gguf

        hf_config, state = load_gguf(path)
        tokenizer = gguf_tokenizer(path) if with_tokenizer else None
    else:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        state = load_safetensors_dir(path)
        tokenizer = dir_tokenizer(path) if with_tokenizer else None
    model = build_decoder(hf_config, state, dtype, share_embedding_from)
    return LoadedModel(model=model, hf_config=hf_config, tokenizer=tokenizer, source=str(path))


def load_draft(draft: str, target: LoadedModel, target_name: str, dtype="auto") -> LoadedModel:
    """The draft named `draft` for `target` (loaded from `target_name`): "target-int4" is made of the
    target (models/quant.py); anything else is `resolve_draft(draft, target_name)` loaded in `dtype`
    without a tokenizer, sharing the target's embedding where its config says so."""
    if draft == INT4_DRAFT:
        return int4_draft(target)
    return load_pretrained(resolve_draft(draft, target_name), dtype=dtype, with_tokenizer=False,
                           share_embedding_from=target.model)


def int4_draft(target: LoadedModel, group: int = DEFAULT_GROUP) -> LoadedModel:
    """A draft made of the target (a LoadedModel): a Decoder over the target's own parameter tensors
    (nothing copied), its linears in int4 (models/quant.py, `quantize_int4`), as a LoadedModel without a tokenizer.
    Sharing every tensor makes it follow the target: a target update writes its weights, its int4
    copies are made again on their next use, and under SSD the draft side is sent the changed tensors
    (ssd/draft_side.py, as for a built-in draft's shared embedding); draft updates naming them are
    refused (draft_sync.py)."""
    src = target.model
    model = Decoder(src.cfg, src.inv_freq, src.rope_scaling, dtype=src.dtype).to(src.embed.device)
    model.load_state_dict(src.state_dict(keep_vars=True), assign=True)  # the target's Parameters themselves
    return LoadedModel(quantize_int4(model.eval(), group), target.hf_config, None, f"{target.source} (int4 draft)")


def dir_tokenizer(path: Path):
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def gguf_tokenizer(path: Path):
    """The GGUF file's tokenizer (and chat template), converted by transformers and cached."""
    from transformers import AutoTokenizer

    cached = cache_root() / "tokenizers" / file_key(path)
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        cached.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(cached))
        (cached / "source.json").write_text(json.dumps({"gguf": str(path.resolve())}))
    except OSError as err:  # a read-only home still works, just slower next time
        log.warning("could not cache the GGUF tokenizer in %s: %s", cached, err)
    return tok
