"""How many KV slots fit on a GPU: the KV cache sized from the device's free memory, as nano-vllm's
`allocate_kv_cache` does, in pure arithmetic so a CPU test covers every branch.

The engine measures the device once its weights are placed (the target's, and the draft's when it
shares the GPU) and gives the KV cache what is left, keeping back

  * the part of the GPU the knob withholds: (1 - gpu_memory_utilization) x total memory, so the engine
    ends with at most that fraction of the GPU in use (other processes' memory counted as in use, as
    vLLM's knob does); and
  * a reserve for what forwards allocate beside the cache: `step_reserve_bytes` per model on the
    device, plus FIXED_MARGIN_BYTES.

slots = min(max_slots, floor(usable / per_slot) - 1): the cache holds one scratch slot beyond its
sequence slots (kv_cache.py). The reserve is an estimate, not a measurement: nano-vllm runs a
warm-up forward and reads the allocator's peak; here no forward can run before the cache exists, so
the reserve bounds the largest step's buffers from the shapes instead.
"""

from __future__ import annotations

from typing import Optional

import torch

from rollout_ssd.models.config import ModelConfig

# A forward's own buffers beyond those counted in `step_reserve_bytes`: the CUDA context's growth,
# cuBLAS workspaces, the caching allocator's rounding, graph pools' slack.
FIXED_MARGIN_BYTES = 512 * 2**20


def step_reserve_bytes(cfg: ModelConfig, dtype: torch.dtype, rows: int, step_tokens: int,
                       prefill_tokens: int, max_len: int) -> int:
    """Bytes to keep free beside the KV cache for one model's forwards:

      logits  rows x step_tokens x vocab x (element + 4): the head's output of the largest static
              step (a batch bucket of `rows` rows, `step_tokens` new tokens each), in the model dtype
              and its float32 copy;
      prefill prefill_tokens x (4 hidden + qkv + 3 intermediate) x element: one prefill forward's
              live activations (the residual, the normed input, q|k|v, gate|up and their product,
              the attention output);
      scores  prefill_tokens x heads x max_len x 4 x 2: a masked prefill's float32 attention scores
              and weights when SDPA takes its unfused path (a fused kernel needs none of it).
    The engine adds FIXED_MARGIN_BYTES once per device."""
    element = torch.empty((), dtype=dtype).element_size()
    vocab = cfg.head_vocab_size or cfg.vocab_size
    logits = rows * step_tokens * vocab * (element + 4)
    prefill = prefill_tokens * (4 * cfg.hidden_size + cfg.qkv_size + 3 * cfg.intermediate_size) * element
    scores = prefill_tokens * cfg.num_heads * max_len * 4 * 2
    return logits + prefill + scores


def kv_slots_that_fit(free_bytes: int, total_bytes: int, per_slot_bytes: int, reserve_bytes: int,
                      utilization: float, max_slots: int) -> int:
    """Sequence slots of `per_slot_bytes` each (KV of every model on the device, one sequence of full
    length) that fit in `free_bytes` of a `total_bytes` device, keeping (1 - utilization) x total and
    `reserve_bytes` back, one scratch slot included; at most max_slots. ValueError naming
    EngineConfig.gpu_memory_utilization when not even one sequence fits."""
    if per_slot_bytes < 1 or max_slots < 1:
        raise ValueError(f"per_slot_bytes and max_slots must be >= 1, got {per_slot_bytes}, {max_slots}")
    usable = free_bytes - int((1.0 - utilization) * total_bytes) - reserve_bytes
    slots = min(max_slots, max(usable, 0) // per_slot_bytes - 1)
    if slots < 1:
        raise ValueError(
            f"EngineConfig.gpu_memory_utilization={utilization}: the GPU has {free_bytes / 2**30:.2f} GiB free of "
            f"{total_bytes / 2**30:.2f} GiB after the weights; keeping {(1 - utilization) * total_bytes / 2**30:.2f} "
            f"GiB back and a {reserve_bytes / 2**30:.2f} GiB step reserve leaves room for no sequence of "
            f"{per_slot_bytes / 2**20:.1f} MiB of KV (plus the scratch slot); raise gpu_memory_utilization, "
            f"lower max_model_len, or set kv_cache_bytes")
    return slots


def device_memory(device: torch.device) -> Optional[tuple[int, int]]:
    """(free, total) bytes of a CUDA device, counting the caching allocator's reserved but unused blocks
    as free (this process can reuse them); None for any other device (no sizing from free memory)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached, total
