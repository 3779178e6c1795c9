"""The few-query attention kernel (kernels/few_attention.py, csrc/few_attention.c): within the
attention bound of float64 attention on every path of the C code (the AVX-512 blocks and the plain loops,
head dims in and out of the fast path, key counts off a multiple of 16), a row's result independent of
the batch and the thread count, a float32 cache equal to the bf16 cache it holds, and bad calls refused."""

from __future__ import annotations

import pytest
import torch

from rollout_ssd.kernels import f32_rows, few_attention
from tests.support.attention_bound import attention_error_bound

pytestmark = pytest.mark.skipif(not few_attention.available(), reason="few-query attention kernel not built here")


def case(b: int, hq: int, hkv: int, t: int, length: int, d: int, seed: int, masked: bool = True):
    """q, k and v views into longer caches (a spare slot, spare positions), and a mask whose padded query
    rows (every other query of the last row) see key 0 only, as the decoder makes them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=g).bfloat16()
    kc = torch.randn(b + 1, hkv, length + 7, d, generator=g).bfloat16()
    vc = torch.randn(b + 1, hkv, length + 3, d, generator=g).bfloat16()  # other strides than k's
    mask = None
    if masked:
        mask = torch.rand(b, 1, t, length, generator=g) > 0.3
        mask[..., 0] = True
        mask[-1, 0, 1::2] = False
        mask[-1, 0, 1::2, 0] = True
    return q, kc[1:, :, :length], vc[1:, :, :length], mask


def within_bound(out, q, k, v, mask):
    b, hq, t, d = q.shape
    visible = torch.ones(b, 1, t, k.shape[2], dtype=torch.bool) if mask is None else mask
    flat = lambda x: x.transpose(1, 2).reshape(b * t, hq, d)  # noqa: E731
    ref, bound = attention_error_bound(flat(q), k, v, torch.arange(b).repeat_interleave(t),
                                       visible[:, 0].reshape(b * t, -1), torch.bfloat16)
    return bool(((flat(out).double() - ref).abs() <= bound).all())


def kernels():
    """This CPU's build, and the AVX2 build where this CPU has AVX-512 (its plain loops run everywhere)."""
    out = [("native", None)]
    if f32_rows.isa() == "avx512":
        out.append(("avx2", few_attention.load("avx2")))
    return out


@pytest.mark.parametrize("build,kernel", kernels(), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("b,hq,hkv,t,length,d", [
    (1, 9, 3, 1, 37, 64), (4, 9, 3, 1, 200, 64), (3, 9, 3, 5, 64, 64), (2, 9, 3, 16, 50, 64),  # SmolLM2's heads
    (2, 8, 2, 4, 5, 128), (2, 4, 4, 3, 33, 48), (2, 6, 2, 2, 17, 40), (1, 4, 1, 2, 19, 256), (2, 3, 1, 1, 1, 64)])
def test_within_the_attention_bound_of_float64(build, kernel, b, hq, hkv, t, length, d):
    """Every element within tests/support/attention_bound.py's bound (derived from the case, the same on
    every CPU; its scale is head_dim ** -0.5, which the calls pass), masked and unmasked, over the bf16
    cache and a float32 one holding its values; head dims 16..128 in steps of 16 take the AVX-512 blocks,
    40 and 256 the plain loops, as does the AVX2 build; key counts off a multiple of 16, and one."""
    for masked in (True, False):
        q, k, v, mask = case(b, hq, hkv, t, length, d, seed=b + 10 * t + 100 * length + d, masked=masked)
        out = few_attention.attend(q, k, v, mask, d ** -0.5, kernel=kernel)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        assert within_bound(out, q, k, v, mask), (build, masked)
        assert torch.equal(few_attention.attend(q, k.float(), v.float(), mask, d ** -0.5, kernel=kernel), out)


def test_a_rows_result_does_not_depend_on_the_batch_or_the_threads():
    """One task per (row, KV head), each summing in one order: bitwise the same alone, in a batch, on one
    thread or two; a float32 cache holding the same bf16 values gives the same bits; no mask and an
    all-visible mask too."""
    q, k, v, mask = case(5, 9, 3, 4, 70, 64, seed=3)
    batch = few_attention.attend(q, k, v, mask, 0.125)
    for i in range(5):
        alone = few_attention.attend(q[i:i + 1], k[i:i + 1], v[i:i + 1], mask[i:i + 1], 0.125)
        assert torch.equal(alone, batch[i:i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(few_attention.attend(q, k, v, mask, 0.125), batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(few_attention.attend(q, k.float(), v.float(), mask, 0.125), batch)
    everything = torch.ones_like(mask)
    assert torch.equal(few_attention.attend(q, k, v, everything, 0.125), few_attention.attend(q, k, v, None, 0.125))


def test_a_nan_score_gives_nan_as_the_other_forms_do():
    """A query whose scores are all NaN (a blown-up activation) gives NaN, not the zeros of a query that
    sees no key; one NaN key among finite ones makes every query that sees it NaN."""
    for d in (64, 40):  # the AVX-512 blocks and the plain loops
        q, k, v, _ = case(1, 3, 1, 2, 20, d, seed=9)
        q[0, 0, 0] = float("nan")  # query head 0, query 0: every score NaN
        out = few_attention.attend(q, k, v, None, d ** -0.5)
        assert out[0, 0, 0].isnan().all() and not out[0, 1:].isnan().any() and not out[0, 0, 1].isnan().any()
        q, k, v, _ = case(1, 3, 1, 2, 20, d, seed=9)
        k[0, 0, 3, 0] = float("nan")  # key 3: a NaN score for every query
        assert few_attention.attend(q, k, v, None, d ** -0.5).isnan().all()


def test_bad_calls_are_refused_and_serves_says_which():
    q, k, v, mask = case(2, 9, 3, 2, 20, 64, seed=5)
    wide = torch.zeros(1, 1, 1, 512, dtype=torch.bfloat16)
    for bad in ((q, k[:, :2], v, mask), (q.half(), k, v, mask), (q[:, :8], k, v, mask),  # 8 query heads over 3
                (q, k, v, mask[:, :, :1]), (q, k, v, mask.float()), (wide, k, v, None)):
        with pytest.raises(ValueError, match="needs"):
            few_attention.attend(*bad, 0.125)
        assert not few_attention.serves(*bad)
    assert few_attention.serves(q, k, v, mask) and few_attention.serves(q, k.float(), v.float(), None)
    few_attention.set_enabled(False)
    try:
        assert not few_attention.available() and not few_attention.serves(q, k, v, mask)
    finally:
        few_attention.set_enabled(True)
