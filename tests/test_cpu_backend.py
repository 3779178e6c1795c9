"""bf16 linears over oneDNN-packed weights (models/cpu_backend.py) on CPUs with bf16 units: bitwise
equal to F.linear at every shape and row count the engine uses, remade when the weight changes, and the
same model outputs with and without them (with the bf16 rows kernel off: where it runs it takes 1..32
rows, tests/test_bf16_rows.py). Skipped on CPUs without bf16 units (the path is off there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout_ssd.kernels import bf16_rows
from rollout_ssd.models import cpu_backend
from rollout_ssd.models.cpu_backend import packed_bf16, packed_linear
from rollout_ssd.models.weight_copies import WeightCopies

needs_packed = pytest.mark.skipif(not packed_bf16(), reason="this CPU has no bf16 units (the packed path is off)")


@pytest.fixture
def onednn_only(monkeypatch):
    """The oneDNN packed path at every row count: the bf16 rows kernel (tests/test_bf16_rows.py) off."""
    monkeypatch.setattr(bf16_rows, "_ON", False)


@needs_packed
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (3072, 576), (8192, 576), (49, 33)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 64, 256])
def test_packed_linear_is_bitwise_f_linear(shape, rows, onednn_only):
    gen = torch.Generator().manual_seed(rows * 1000 + shape[0])
    w = (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, shape[1], generator=gen).to(torch.bfloat16)
    bias = torch.randn(shape[0], generator=gen).to(torch.bfloat16)
    copies = WeightCopies()
    assert torch.equal(packed_linear(x, w, copies, "w"), F.linear(x, w))
    assert torch.equal(packed_linear(x[None], w, copies, "w", bias), F.linear(x[None], w, bias))  # [1, M, K]


def test_weight_copies_are_written_over_in_place_when_only_the_values_changed():
    """An in-place write of a weight refills its copy in the copy's own memory where the make function
    takes out=; a replaced weight, or a copy whose make does not, is made anew. Values always current."""
    calls = []

    def transposed(w, out=None):
        calls.append(out is not None)
        return w.t().contiguous() if out is None else out.copy_(w.t())

    copies = WeightCopies()
    w = torch.randn(6, 4)
    first = copies.get("t", w, transposed, in_place=True)
    assert copies.get("t", w, transposed, in_place=True) is first and calls == [False]
    w.mul_(3.0)
    again = copies.get("t", w, transposed, in_place=True)
    assert again is first and torch.equal(again, w.t()) and calls == [False, True]
    fresh = copies.get("plain", w, lambda t: t.t().contiguous())
    w.add_(1.0)
    assert copies.get("plain", w, lambda t: t.t().contiguous()) is not fresh  # no out=: made anew
    other = torch.randn(6, 4)
    replaced = copies.get("t", other, transposed, in_place=True)
    assert replaced is not first and torch.equal(replaced, other.t()) and calls[-1] is False


@needs_packed
def test_packed_copy_follows_in_place_updates_and_is_skipped_where_it_does_not_apply(onednn_only):
    w = torch.randn(64, 32).to(torch.bfloat16)
    x = torch.randn(2, 32).to(torch.bfloat16)
    copies = WeightCopies()
    first = packed_linear(x, w, copies, "w")
    w.mul_(2)  # an update_weights-style write: the packed copy must be remade
    assert torch.equal(packed_linear(x, w, copies, "w"), F.linear(x, w))
    assert not torch.equal(first, F.linear(x, w))
    assert packed_linear(x.float(), w.float(), copies, "f") is None  # float32: the MKL forms instead
    assert packed_linear(torch.randn(300, 32).to(torch.bfloat16), w, copies, "w") is None  # many rows
    trainable = torch.nn.Parameter(w.clone())
    assert packed_linear(x, trainable, copies, "t") is None


@needs_packed
def test_bf16_decoder_outputs_are_unchanged_by_packing(tmp_path, monkeypatch, onednn_only):
    from rollout_ssd.models.loader import load_pretrained
    from rollout_ssd.runner import ModelRunner
    from tests.support.models import build_tiny

    build_tiny(tmp_path, family="qwen2-bias-tied")
    model = load_pretrained(str(tmp_path), dtype="bfloat16").model
    out = {}
    for on in (True, False):
        monkeypatch.setattr(cpu_backend, "packed_bf16", lambda on=on: on)
        runner = ModelRunner(model, num_slots=3, max_len=32)
        out[on] = [runner.prefill([0, 1, 2], [[1, 2, 3, 4], [5, 6], [7]]), runner.decode([0, 1, 2], [8, 9, 10]),
                   runner.extend([0, 2], [[1, 2, 3], [4, 5, 6]])]
    assert all(torch.equal(a, b) for a, b in zip(out[True], out[False]))


def test_warm_packed_packs_every_linear_and_changes_no_output(tmp_path):
    """warm_packed (done when an engine takes a model) packs each frozen bf16 weight once per form it runs
    in (oneDNN's, and the bf16 rows kernel's where that runs), a float32 one for the float32 rows kernel
    where that runs, and a float32 head's column-major copy (one-row logits; the same object a one-row step
    then reads), and leaves the model's outputs bitwise as they were."""
    from rollout_ssd.models.cpu_backend import warm_packed
    from rollout_ssd.models.loader import load_pretrained
    from rollout_ssd.runner import ModelRunner
    from tests.support.models import build_tiny

    build_tiny(tmp_path, family="qwen2-bias-tied")
    outs = []
    for dtype, warm in (("bfloat16", False), ("bfloat16", True), ("float32", True)):
        model = load_pretrained(str(tmp_path), dtype=dtype).model
        if warm:
            warm_packed(model, rows=4)
            packed = sum(len(layer.row_major) for layer in model.layers) + len(model.copies)
            forms = int(packed_bf16()) + int(bf16_rows.available())  # oneDNN's copy, the rows kernel's
            head_t = 0
            if dtype == "float32":  # the float32 rows kernel's copy, where it runs on this CPU kind
                forms, head_t = int(cpu_backend.f32_rows_kernel_rows() > 0), 1
                made = model.copies.get("lm_head_t", model.lm_head, lambda w: None)
                assert made is not None and torch.equal(made, model.lm_head.t())
            assert packed == (4 * len(model.layers) + 1) * forms + head_t
        runner = ModelRunner(model, num_slots=2, max_len=32)
        outs.append(runner.prefill([0, 1], [[1, 2, 3, 4], [5, 6]]))
        if dtype == "float32":  # a one-row step reads the copy made above, not a new one
            before = len(model.copies)
            runner.decode([0], [7])
            assert len(model.copies) == before and model.copies.get("lm_head_t", model.lm_head, lambda w: None) is made
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,t,length", [(1, 1, 37), (4, 1, 200), (3, 5, 64), (2, 16, 50)])
def test_explicit_attention_is_gqa_masked_attention_within_its_output_rounding(dtype, b, t, length):
    """attention.explicit_attention (a few queries over a 16-bit CPU cache) against float64 SDPA with the
    same mask and GQA grouping: every element within the output dtype's rounding of the reference (the
    unit roundoff, 2^-8 / 2^-11 relative for bf16 / fp16) plus the float32 arithmetic's share (1e-5 of the
    largest magnitude); the bound is computed from the case, not from this CPU's kernels."""
    from rollout_ssd.models.attention import explicit_attention, explicit_attention_applies

    g = torch.Generator().manual_seed(b * 1000 + t * 10 + length)
    q = torch.randn(b, 9, t, 64, generator=g).to(dtype)
    k = torch.randn(b, 3, length, 64, generator=g).to(dtype)
    v = torch.randn(b, 3, length, 64, generator=g).to(dtype)
    mask = torch.rand(b, 1, t, length, generator=g) > 0.3
    mask[..., 0] = True  # every query sees a key
    assert explicit_attention_applies(q) == (cpu_backend.cpu_kind() not in cpu_backend.SDPA_FEW_QUERIES_KINDS)
    out = explicit_attention(q, k, v, mask, 0.125).double()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(3, 1), v.double().repeat_interleave(3, 1), attn_mask=mask, scale=0.125)
    half_ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11  # unit roundoff of the output dtype
    bound = half_ulp * ref.abs() * (1 + 1e-3) + 1e-5 * ref.abs().max()
    assert ((out - ref).abs() <= bound).all()
    unmasked = explicit_attention(q, k, v, None, 0.125).double()
    ref_all = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(3, 1), v.double().repeat_interleave(3, 1), scale=0.125)
    assert ((unmasked - ref_all).abs() <= half_ulp * ref_all.abs() * (1 + 1e-3) + 1e-5 * ref_all.abs().max()).all()
    assert not explicit_attention_applies(q.float()) and not explicit_attention_applies(torch.zeros(1, 9, 17, 64, dtype=dtype))


def query_major(q: torch.Tensor, mask: torch.Tensor) -> tuple:
    """q [B, Hq, T, D] and mask [B, 1, T, L] as attention_error_bound's q [B * T, Hq, D], slot and visible."""
    b, hq, t, d = q.shape
    return (q.transpose(1, 2).reshape(b * t, hq, d), torch.arange(b).repeat_interleave(t),
            mask[:, 0].reshape(b * t, -1))


@pytest.mark.parametrize("sdpa_kind,kernel_on", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,t,length", [(1, 1, 37), (4, 1, 200), (3, 5, 64), (2, 16, 50)])
def test_few_query_attention_takes_the_form_asked_within_the_attention_bound(monkeypatch, sdpa_kind, kernel_on, dtype,
                                                                             b, t, length):
    """The SDPA backend on a few queries over a 16-bit CPU cache takes, bitwise: the few_attention kernel
    (bf16 queries, where it builds and is on); else PyTorch's SDPA where attention.SDPA_FEW_QUERIES holds
    (this CPU kind in cpu_backend.SDPA_FEW_QUERIES_KINDS); else the explicit form. Each is within
    tests/support/attention_bound.py's bound of float64 attention, derived from the case (it allows the
    probabilities rounded to the cache dtype, which the flash kernel does), the same on every CPU."""
    from rollout_ssd.kernels import few_attention
    from rollout_ssd.models import attention
    from rollout_ssd.models.attention import MaskedRead, SDPABackend, explicit_attention
    from tests.support.attention_bound import attention_error_bound

    assert attention.SDPA_FEW_QUERIES == (cpu_backend.cpu_kind() in cpu_backend.SDPA_FEW_QUERIES_KINDS)
    monkeypatch.setattr(attention, "SDPA_FEW_QUERIES", sdpa_kind)
    monkeypatch.setattr(few_attention, "_ON", kernel_on)
    g = torch.Generator().manual_seed(b * 1000 + t * 10 + length)
    q = torch.randn(b, 9, t, 64, generator=g).to(dtype)
    kc = torch.randn(b + 1, 3, length + 5, 64, generator=g).to(dtype)  # a cache longer than the read, a spare slot
    vc = torch.randn(b + 1, 3, length + 5, 64, generator=g).to(dtype)
    mask = torch.rand(b, 1, t, length, generator=g) > 0.3
    mask[..., 0] = True
    out = SDPABackend()(q, kc, vc, MaskedRead(mask, 0, b, None, length), 0.125)
    k, v = kc[:b, :, :length], vc[:b, :, :length]
    if kernel_on and dtype == torch.bfloat16 and few_attention.available():
        expected = few_attention.attend(q, k, v, mask, 0.125)
    elif sdpa_kind:
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
    else:
        expected = explicit_attention(q, k, v, mask, 0.125)
    assert torch.equal(out, expected)
    flat_q, slot, visible = query_major(q, mask)
    ref, bound = attention_error_bound(flat_q, k, v, slot, visible, dtype)
    assert ((query_major(out, mask)[0].double() - ref).abs() <= bound).all()
