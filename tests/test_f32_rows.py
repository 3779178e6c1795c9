"""The float32 rows kernel (kernels/f32_rows.py, csrc/f32_rows.c): its error bounded against float64 at the
decoder's shapes for each build this CPU runs (AVX-512F, AVX2+FMA), a row's result independent of the
batch it is in and of the thread count, the forms cpu_backend routes to it (layers and LM head), its
copies following weight writes, engines' greedy tokens through it, and the kernel cache's build path
(kernels/kernel_build.py, shared with the bf16 rows kernel).

The bound does not depend on the CPU: the kernel's arithmetic is one fused multiply-add per k in a fixed
order on every build, so each output's error is at most k float32 roundings of the running sum
(Higham's gamma_k over the sum of |x||w|), whatever vector width ran it."""

from __future__ import annotations

import shutil
import subprocess
import tempfile

import pytest
import torch
import torch.nn.functional as F

from rollout_ssd.kernels import cpu, f32_rows, kernel_build
from rollout_ssd.models import cpu_backend, quant
from rollout_ssd.models.weight_copies import WeightCopies

needs_kernel = pytest.mark.skipif(not f32_rows.available(), reason="no AVX-512F / AVX2+FMA or no C compiler")


def runnable_builds() -> list[str]:
    """The builds this CPU can run: AVX2 wherever AVX2+FMA is, AVX-512F where that is too."""
    flags = cpu.cpu_flags()
    kinds = ["avx2"] if {"avx2", "fma"} <= flags else []
    return kinds + (["avx512"] if "avx512f" in flags else [])


def kernel_of(kind: str):
    if not shutil.which(kernel_build.default_compiler()):
        pytest.skip("no C compiler here")
    return f32_rows.load(kind), f32_rows.TILES[kind]


def case(n: int, k: int, m: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * k ** -0.5, torch.randn(m, k, generator=gen),
            torch.randn(n, generator=gen))


def error_bound(x: torch.Tensor, w: torch.Tensor, bias) -> torch.Tensor:
    """Per element: k multiply-adds each rounding once (fused) plus the bias's addition: at most
    gamma_{k+1} = (k + 1) u / (1 - (k + 1) u) of the sum of magnitudes, u = 2^-24."""
    k = x.shape[1]
    mags = x.double().abs() @ w.double().abs().T
    if bias is not None:
        mags = mags + bias.double().abs()
    u = 2.0 ** -24
    return (k + 1) * u / (1 - (k + 1) * u) * mags


def test_available_where_the_cpu_has_avx2_fma_or_avx512f_and_a_compiler_builds_it(monkeypatch):
    """With a vector extension and a C compiler the kernel must build and be on (a compile error fails
    here with the compiler's output, rather than skipping every kernel test); off when turned off."""
    kind = f32_rows.isa()
    if kind is None:
        assert not f32_rows.available()
    elif shutil.which(kernel_build.default_compiler()):
        try:
            f32_rows.build(kind)
        except subprocess.CalledProcessError as exc:
            pytest.fail(f"the float32 rows kernel does not compile: {exc.stderr}")
        assert f32_rows.available() and f32_rows.tile() == f32_rows.TILES[kind]
    monkeypatch.setattr(f32_rows, "_ON", False)
    assert not f32_rows.available()


@pytest.mark.parametrize("kind", ["avx512", "avx2"])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (100, 64), (33, 8)])
def test_within_the_float32_bound_of_float64_at_every_row_count(kind, n, k):
    """1..9 rows (across the row groups of 7 and 3), outputs off the tile width, with and without bias."""
    if kind not in runnable_builds():
        pytest.skip(f"this CPU cannot run the {kind} build")
    kernel = kernel_of(kind)
    for m in range(1, 10):
        w, x, bias = case(n, k, m, seed=m)
        packed = f32_rows.pack(w, kernel[1])
        for b in (None, bias):
            out = f32_rows.linear(x, packed, n, b, kernel=kernel)
            ref = x.double() @ w.double().T + (0 if b is None else b.double())
            err = (out.double() - ref).abs()
            assert out.shape == (m, n) and out.dtype == torch.float32
            assert bool((err <= error_bound(x, w, b)).all()), f"m={m}: max error {err.max():.3g}"


@pytest.mark.parametrize("kind", ["avx512", "avx2"])
def test_a_rows_result_does_not_depend_on_its_batch_nor_the_thread_count(kind):
    """Row r computed alone, among 2..9 rows (other groupings) and with 1 or 2 threads: bitwise equal. A
    verify's rows then get exactly what decode steps of the same rows would from these linears."""
    if kind not in runnable_builds():
        pytest.skip(f"this CPU cannot run the {kind} build")
    kernel = kernel_of(kind)
    w, x, bias = case(3072, 576, 9, seed=0)
    packed = f32_rows.pack(w, kernel[1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [f32_rows.linear(x[r:r + 1], packed, 3072, bias, kernel=kernel) for r in range(9)]
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in range(2, 10):
                out = f32_rows.linear(x[:m], packed, 3072, bias, kernel=kernel)
                assert all(torch.equal(out[r], alone[r][0]) for r in range(m)), (t, m)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_pack_layout_and_refused_inputs():
    tile = f32_rows.tile()
    w = torch.arange(12.0 * 5).view(12, 5)
    packed = f32_rows.pack(w)
    assert packed.shape == (1, 5, tile) and packed.data_ptr() % 64 == 0
    assert torch.equal(packed[0, :, :12], w.T) and not packed[0, :, 12:].any()  # zero rows past n
    assert torch.equal(f32_rows.pack(w.t().contiguous().t()), packed)  # column-major storage packs alike
    x = torch.randn(2, 5)
    with pytest.raises(ValueError, match="does not fit"):
        f32_rows.linear(x[:, :4], packed, 12)  # wrong k
    with pytest.raises(ValueError, match="does not fit"):
        f32_rows.linear(x, packed, tile + 1)  # more outputs than packed
    with pytest.raises(ValueError, match="does not fit"):
        f32_rows.linear(x.double(), packed, 12)
    with pytest.raises(ValueError, match="bias"):
        f32_rows.linear(x, packed, 12, torch.zeros(11))
    with pytest.raises(ValueError, match="bias"):
        f32_rows.linear(x, packed, 12, torch.zeros(12, device="meta"))
    with pytest.raises(ValueError, match="aligned"):
        f32_rows.linear(x, torch.zeros(2 * 5 * tile + 1)[1:].view(2, 5, tile), 12)
    # written over in place: the same layout as a fresh pack, for whole and partial last tiles and both storages
    for n in (tile, 2 * tile + 3, 5):
        old, new = torch.randn(n, 7), torch.randn(n, 7)
        for storage in (new, new.t().contiguous().t()):
            out = f32_rows.pack(old)
            assert f32_rows.pack(storage, out=out) is out and torch.equal(out, f32_rows.pack(new))
    with pytest.raises(ValueError, match="is not the pack"):
        f32_rows.pack(torch.randn(tile + 1, 7), out=f32_rows.pack(torch.randn(tile, 7)))


@needs_kernel
def test_cpu_backend_routes_2_to_n_rows_of_frozen_float32_weights_to_it(monkeypatch):
    """Where F32_ROWS_KERNEL_ROWS lists the CPU kind: 2..N-row linears and LM-head products run the
    kernel over a copy that follows in-place writes of the weight; one row, N+1 rows, weights that
    require grad and the int4 path do not. Results stay within the float32 bound of float64."""
    monkeypatch.setitem(cpu_backend.F32_ROWS_KERNEL_ROWS, cpu_backend.cpu_kind(), 4)
    calls = []
    real = f32_rows.linear
    monkeypatch.setattr(f32_rows, "linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    w, x, bias = case(200, 64, 5, seed=3)
    w = cpu_backend.layer_weight(200, 64, torch.float32)
    with torch.no_grad():
        w.copy_(case(200, 64, 1, seed=4)[0])
    copies = WeightCopies()
    for m in range(1, 6):
        out = cpu_backend.linear(x[:m], w, copies, "w", bias)
        ref = x[:m].double() @ w.double().T + bias.double()
        assert bool(((out.double() - ref).abs() <= error_bound(x[:m], w, bias) * 4 + 1e-6).all())
    assert calls == [2, 3, 4]
    head = case(300, 64, 1, seed=5)[0]
    head_out = cpu_backend.head_matmul(x[:3], head, copies)
    assert calls[-1] == 3 and torch.allclose(head_out, F.linear(x[:3], head), atol=1e-5)
    packed_before = copies.get("w:f32rows", w, f32_rows.pack)
    with torch.no_grad():
        w.mul_(2.0)  # an update's in-place write: the copy is written again, into its own memory
    out = cpu_backend.linear(x[:2], w, copies, "w")
    assert torch.allclose(out, F.linear(x[:2], w), atol=1e-5)
    assert copies.get("w:f32rows", w, f32_rows.pack) is packed_before
    calls.clear()
    trainable = torch.nn.Parameter(w.detach().clone())
    cpu_backend.linear(x[:3], trainable, WeightCopies(), "t")
    trainable_bias = torch.nn.Parameter(bias.clone())  # bias-only fine-tuning keeps its gradient
    out = cpu_backend.linear(x[:3], w, copies, "w", trainable_bias)
    out.sum().backward()
    assert trainable_bias.grad is not None and torch.equal(trainable_bias.grad, torch.full((200,), 3.0))
    if quant.available():  # an int4 draft's linears run int4, never this kernel
        int4 = WeightCopies()
        int4.int4_group = 32
        cpu_backend.linear(x[:3], torch.randn(192, 64), int4, "w")  # (int4 packs 16 rows at a time)
    monkeypatch.setattr(f32_rows, "_ON", False)
    cpu_backend.linear(x[:3], w, copies, "w")
    assert calls == []


@needs_kernel
def test_engines_greedy_tokens_through_the_kernel_equal_ar(monkeypatch, tmp_path):
    """A tiny random pair with the kernel taking 2..8-row float32 linears (checked: it ran, on nothing
    else): SD's and SSD's greedy tokens (their verifies' rows through it) equal AR's (its batch-2 decode
    through it, its one-row steps through MKL), as on every other path."""
    from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
    from tests.support.models import tiny_model
    from tests.support.ran import assert_ran

    monkeypatch.setitem(cpu_backend.F32_ROWS_KERNEL_ROWS, cpu_backend.cpu_kind(), 8)
    calls = []
    real = f32_rows.linear
    monkeypatch.setattr(f32_rows, "linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    tiny = dict(init="transformers", max_position_embeddings=256, vocab_size=48)
    _, target = tiny_model(tmp_path / "target", seed=0, logit_scale=8.0, intermediate_size=64, **tiny)
    _, draft = tiny_model(tmp_path / "draft", seed=1, logit_scale=8.0, hidden_size=16, intermediate_size=32,
                          num_hidden_layers=1, **tiny)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    prompts = [[1, 5, 9, 14], [3, 3, 8]]
    tokens = {}
    for method in ("ar", "sd", "ssd"):
        # the rule off: SSD's rounds, not whichever plan this host's timings pick (AR or SD on a small CPU)
        spec = SpecConfig(method=method, k=3, worker=False, strategy_rule=False)
        with RolloutEngine(target, spec, EngineConfig(max_batch_size=2, max_model_len=128),
                           draft=None if method == "ar" else draft) as engine:
            tokens[method] = [r.token_ids for r in engine.sample(prompts, params)]
            if method != "ar":  # SD verified proposals; SSD ran its rounds
                assert_ran(engine, {"sd": "spec", "ssd": "ssd"}[method])
    assert tokens["sd"] == tokens["ar"] and tokens["ssd"] == tokens["ar"]
    assert calls and max(calls) <= 8 and min(calls) >= 2


def test_library_builds_are_cached_and_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    """kernel_build: one library per source and flags, reused; a failing compiler raises and writes
    nothing; an unwritable cache falls back to a private folder of the temporary directory."""
    if f32_rows.isa() is None or not shutil.which(kernel_build.default_compiler()):
        pytest.skip("no vector extension or no C compiler here")
    monkeypatch.setenv("ROLLOUT_SSD_KERNEL_CACHE", str(tmp_path))
    kind = f32_rows.isa()
    first = f32_rows.build(kind)
    stamp = first.stat().st_mtime_ns
    assert first.parent == tmp_path and f32_rows.build(kind) == first
    assert first.stat().st_mtime_ns == stamp and [p.name for p in tmp_path.iterdir()] == [first.name]
    with pytest.raises(subprocess.CalledProcessError):
        f32_rows.build(kind, compiler="false")
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv("ROLLOUT_SSD_KERNEL_CACHE", str(blocked / "kernels"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    fallback = f32_rows.build(kind)
    assert fallback.parent.parent == tmp_path / "tmp" and fallback.name == first.name
    fallback.parent.chmod(0o777)  # a folder others can write to: nothing in it is loaded or built
    try:
        with pytest.raises(OSError, match="no writable folder"):
            f32_rows.build(kind)
    finally:
        fallback.parent.chmod(0o700)
