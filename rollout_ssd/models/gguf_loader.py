"""GGUF -> (transformers config, HF-named float32 state dict), dequantizing with the `gguf` package.

`gguf.GGUFReader` parses every metadata field when it opens a file, the tokenizer's ~100k strings
included, which is most of a GGUF load's time. What the weights need of it (the config's fields and each
tensor's type, shape and byte range) is kept after the first load as a small JSON index in
`$ROLLOUT_SSD_CACHE/gguf` (models/loader.py's cache_root), keyed by the file's path, size and mtime; later loads
read the tensors straight from a memory map of the file. An index that is missing, of another format or
one that does not fit the file (a byte range outside it or of the wrong size, a name twice) is rebuilt from
the reader; nothing but JSON is read from the cache. The file's identity is its path, size and mtime, as
for the tokenizer cache: an index is trusted to describe the file it was built from.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import torch

from rollout_ssd.models.disk_cache import cache_root, file_key

ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
INDEX_FORMAT = 1  # raise it whenever gguf_config_fields or the tensor table change: older indexes are rebuilt
# numpy dtype of a tensor's stored items: these types as themselves, every quantized type as raw bytes
PLAIN_TYPES = {"F32": "float32", "F16": "float16", "F64": "float64", "I8": "int8", "I16": "int16",
               "I32": "int32", "I64": "int64"}

log = logging.getLogger(__name__)


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's half-split layout)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config_fields(reader) -> tuple[str, dict]:
    """(transformers model_type, config kwargs) of an open GGUF file."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCH_TO_MODEL_TYPE:
        raise ValueError(f"GGUF general.architecture {arch!r} is not supported (supported: {sorted(ARCH_TO_MODEL_TYPE)})")
    f = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    names = {t.name for t in reader.tensors}
    vocab = f("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    heads = int(f("attention.head_count"))
    hidden = int(f("embedding_length"))
    kwargs = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(f("feed_forward_length")),
        num_hidden_layers=int(f("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(f("attention.head_count_kv", heads)),
        head_dim=int(f("attention.key_length", hidden // heads)),
        max_position_embeddings=int(f("context_length", 2048)),
        rms_norm_eps=float(f("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        rope_parameters={"rope_type": "default", "rope_theta": float(f("rope.freq_base", 10000.0))},
    )
    scaling = f("rope.scaling.type")
    if scaling == "linear":
        kwargs["rope_parameters"].update(rope_type="linear", factor=float(f("rope.scaling.factor")))
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF {arch}.rope.scaling.type {scaling!r} is not supported")
    return ARCH_TO_MODEL_TYPE[arch], kwargs


def load_gguf(path: Path):
    from transformers import AutoConfig

    path = Path(path)
    index = gguf_index(path)
    hf_config = AutoConfig.for_model(index["model_type"], **index["config"])
    return hf_config, _dequantized_state(path, index, hf_config)


def _dequantized_state(path: Path, index: dict, hf_config) -> dict[str, torch.Tensor]:
    import gguf

    permute = hf_config.model_type == "llama"
    data = np.memmap(path, dtype=np.uint8, mode="r")
    state: dict[str, torch.Tensor] = {}
    for entry in index["tensors"]:
        name = entry["name"]
        match = BLOCK_RE.match(name)
        if match:
            suffix = BLOCK_NAMES.get(match.group(2))
            hf_name = suffix and f"model.layers.{match.group(1)}.{suffix}"
        else:
            hf_name = TENSOR_NAMES.get(name)
        if hf_name is None:
            if name == "rope_freqs.weight":
                raise ValueError("GGUF rope_freqs (llama3-style rope scaling) is not supported yet")
            raise ValueError(f"GGUF tensor {name!r} has no known HF name")
        start = entry["offset"]
        stored = data[start: start + entry["nbytes"]].view(entry["dtype"]).reshape(entry["shape"])
        w = np.asarray(gguf.quants.dequantize(stored, gguf.GGMLQuantizationType(entry["type"])), dtype=np.float32)
        if permute and match and match.group(2) in ("attn_q.weight", "attn_q.bias"):
            w = _unpermute(w, hf_config.num_attention_heads)
        elif permute and match and match.group(2) in ("attn_k.weight", "attn_k.bias"):
            w = _unpermute(w, hf_config.num_key_value_heads)
        state[hf_name] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    return state


def gguf_index(path: Path) -> dict:
    """The file's config fields and tensor table: from the cache where a sound index of this very file
    (path, size, mtime) is kept, else parsed with `gguf.GGUFReader` and kept for the next load."""
    st = path.stat()
    stamp = {"format": INDEX_FORMAT, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    cached = cache_root() / "gguf" / f"{file_key(path)}.json"
    try:
        index = json.loads(cached.read_text())
        _check_index(index, stamp)
        return index
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:  # unreadable or unsound: parse again
        log.warning("rebuilding the GGUF index %s: %s", cached, err)
    index = {**stamp, "source": str(path.resolve()), **_read_index(path)}
    _check_index(index, stamp)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(index, f)
            os.replace(tmp, cached)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as err:  # a read-only cache still loads, just slower next time
        log.warning("could not keep the GGUF index in %s: %s", cached, err)
    return index


def _read_index(path: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(path))
    model_type, config = gguf_config_fields(reader)
    tensors = []
    for t in reader.tensors:
        kind = t.tensor_type.name
        tensors.append({"name": t.name, "type": int(t.tensor_type), "dtype": PLAIN_TYPES.get(kind, "uint8"),
                        "shape": [int(d) for d in t.data.shape], "offset": int(t.data_offset),
                        "nbytes": int(t.data.nbytes)})
    return {"model_type": model_type, "config": config, "tensors": tensors}


def _check_index(index: dict, stamp: dict) -> None:
    """ValueError unless `index` is of this format and file, names each tensor once, and every tensor's bytes
    lie in the file and fill its shape (a stale or damaged index must not read outside the file or fail
    later, at the load)."""
    if not isinstance(index, dict):
        raise ValueError(f"index is a {type(index).__name__}, not an object")
    for key, value in stamp.items():
        if index.get(key) != value:
            raise ValueError(f"index {key} {index.get(key)!r} is not the file's {value!r}")
    if index.get("model_type") not in ARCH_TO_MODEL_TYPE.values() or not isinstance(index.get("config"), dict):
        raise ValueError("index has no model_type or config")
    import gguf

    def integer(x) -> bool:
        return type(x) is int and x >= 0

    names = [entry["name"] for entry in index["tensors"]]
    if len(set(names)) != len(names):
        raise ValueError("index names a tensor twice")
    for entry in index["tensors"]:
        gguf.GGMLQuantizationType(entry["type"])  # ValueError if it names no type
        if entry["dtype"] not in (*PLAIN_TYPES.values(), "uint8") or not isinstance(entry["name"], str) \
                or not all(integer(d) for d in entry["shape"]) or not integer(entry["offset"]) \
                or not integer(entry["nbytes"]):
            raise ValueError(f"index entry {entry!r} is malformed")
        itemsize = np.dtype(entry["dtype"]).itemsize
        if entry["offset"] + entry["nbytes"] > stamp["size"] or int(np.prod(entry["shape"])) * itemsize != entry["nbytes"]:
            raise ValueError(f"index entry {entry['name']!r} does not fit the file")
