"""The decoder's fused small ops against the written-out reference forms, bit for bit (issue 17 part B).

RMSNorm: `decoder.rms_norm` runs the float32 normalisation as torch's fused `F.rms_norm` and keeps the
weight multiply after the cast back (HF Llama's order). It must equal HF's written-out ops exactly, in
float32, bfloat16 and float16, at the decoder's shapes (hidden sizes of SmolLM2, Llama-3-1B and -8B,
and the per-head q/k norm of Qwen3). SiLU * up stays two ops: torch has no public fused form.
"""

from __future__ import annotations

import pytest
import torch

from rollout_ssd.models.decoder import rms_norm

SHAPES = [(1, 1, 64), (3, 7, 576), (2, 5, 2048), (1, 3, 4096), (2, 3, 4, 128)]  # the last: q/k norm per head


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, op for op."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_rms_norm_is_bitwise_hf(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (3.0 * torch.randn(shape, generator=g)).to(dtype)
    x[..., 0] = 0.0  # a zero entry
    weight = (1.0 + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype)
    for eps in (1e-5, 1e-6):
        assert torch.equal(rms_norm(x, weight, eps), hf_rms_norm(x, weight, eps))
    tiny = torch.zeros(shape, dtype=dtype)  # an all-zero row: eps alone keeps the rsqrt finite
    assert torch.equal(rms_norm(tiny, weight, 1e-6), hf_rms_norm(tiny, weight, 1e-6))
