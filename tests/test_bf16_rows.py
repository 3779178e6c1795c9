"""The bf16 rows kernel (kernels/bf16_rows.py, csrc/bf16_rows.c), in each build this CPU runs (avx512_bf16's
dot instruction; bf16 widened to float32 on any AVX-512 CPU): its error bounded against float64 at the
decoder's shapes, a row's result independent of the batch it is in and of the thread count, the forms
cpu_backend routes to it, its op inside a compiled function, the build's cache and failure path, and
SmolLM2's bf16 decode and verify steps through it against transformers' float32 logits.

Runs where the CPU has AVX-512 (F, BW, VL) and a C compiler is found; elsewhere the kernel is off (its
availability test says so) and the rest skips."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rollout_ssd.kernels import bf16_rows, cpu
from rollout_ssd.models import cpu_backend, cpu_dtype
from rollout_ssd.models.cpu_backend import packed_linear, rows_kernel_rows
from rollout_ssd.models.weight_copies import WeightCopies

needs_kernel = pytest.mark.skipif(not bf16_rows.available(), reason="no AVX-512 or no C compiler: the kernel is off")


def builds() -> list:
    """The kernel's builds this CPU runs: its own (`variant()`), and those below it: the dot and widened ones
    where that is "amx", the widened one where it is "dot"."""
    kind = bf16_rows.variant()
    return {"amx": ["amx", "dot", "widened"], "dot": ["dot", "widened"], "widened": ["widened"]}.get(kind, [])


def kernel_fn(kind: str):
    """The `kind` build's function (`bf16_rows.load`), or a skip where it does not build here."""
    if not bf16_rows.available():
        pytest.skip("the bf16 rows kernel is off here")
    try:
        return bf16_rows.load(kind)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.fail(f"the {kind} build of the bf16 rows kernel does not build or load: {getattr(exc, 'stderr', exc)}")


def case(n: int, k: int, m: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    return w, x, bias


def error_bound(x: torch.Tensor, w: torch.Tensor, bias, ref: torch.Tensor) -> torch.Tensor:
    """Per element: the bf16 output's rounding (unit roundoff 2^-8 of |ref|) plus float32 accumulation over
    k / 2 pair steps and the bias (bf16 products are exact in float32; each step rounds at most twice: at
    most (k + 2) * 2^-24 of the sum of magnitudes), with 1% slack for the bounds' second-order terms."""
    k = x.shape[1]
    mags = x.double().abs() @ w.double().abs().T
    if bias is not None:
        mags = mags + bias.double().abs()
    return (2.0 ** -8 * ref.abs() + (k + 2) * 2.0 ** -24 * mags * (1 + 2.0 ** -8)) * 1.01


def test_available_exactly_where_the_cpu_has_avx512_and_a_compiler_builds_it(monkeypatch):
    """Off without AVX-512 (F, BW, VL); with it and a C compiler the kernel must build and be on (a compile
    error fails here with the compiler's output rather than skipping every kernel test), in the dot build
    exactly where the CPU has avx512_bf16, the amx build where it has AMX too (and it loads: this suite's
    compiler has AMX intrinsics); off when turned off."""
    flags = cpu.cpu_flags()
    dot = {"avx512_bf16", "avx512bw", "avx512vl"} <= flags
    expected = "amx" if dot and {"amx_bf16", "amx_tile"} <= flags else "dot" if dot else \
        "widened" if {"avx512f", "avx512bw", "avx512vl", "fma"} <= flags else None
    assert bf16_rows.variant() == expected
    if expected is None:
        assert not bf16_rows.available()
        with pytest.raises(ValueError, match="no build for None"):
            bf16_rows.build()
    elif shutil.which(bf16_rows.default_compiler()):
        try:
            bf16_rows.build()
        except subprocess.CalledProcessError as exc:
            pytest.fail(f"the bf16 rows kernel does not compile: {exc.stderr}")
        assert bf16_rows.available() or os.environ.get("ROLLOUT_SSD_BF16_ROWS") == "0"
        assert bf16_rows.loaded_variant() in (expected, None)
    monkeypatch.setattr(bf16_rows, "_ON", False)
    assert not bf16_rows.available()


@needs_kernel
@pytest.mark.parametrize("kind", ["amx", "dot", "widened"])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (3072, 576), (8192, 576), (49, 34), (200, 2)])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 13, 16])
def test_kernel_is_within_its_rounding_bound_of_float64(kind, shape, rows):
    if kind not in builds():
        pytest.skip(f"the {kind} build does not run on this CPU")
    fn = kernel_fn(kind)
    w, x, bias = case(*shape, rows, seed=rows * 1000 + shape[0])
    packed = bf16_rows.pack(w)
    for b in (None, bias):
        out = bf16_rows.linear(x, packed, shape[0], b, kernel=fn)
        assert out.shape == (rows, shape[0]) and out.dtype == torch.bfloat16
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        assert ((out.double() - ref).abs() <= error_bound(x, w, b, ref)).all()


@needs_kernel
@pytest.mark.parametrize("kind", ["amx", "dot", "widened"])
def test_the_output_is_rounded_to_bf16_as_torchs_cast(kind):
    """x = 0, so each output is its bias, rounded once to bf16: bitwise torch's float -> bf16 cast (round to
    nearest, ties to even, overflow to inf) for random float32 bit patterns, ties both ways, the largest
    finite values, infinities and (widened build) subnormals; NaN stays NaN. The dot and amx builds'
    vcvtneps2bf16 treats subnormals as zeros (Intel's definition of the instruction), so there they are left out."""
    if kind not in builds():
        pytest.skip(f"the {kind} build does not run on this CPU")
    fn = kernel_fn(kind)
    gen = torch.Generator().manual_seed(5)
    special = [0x3F808000, 0x3F818000, 0x3F80C000, 0xBF818000, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF,
               0x7F800000, 0xFF800000, 0x00008000, 0x00018000, 0x007FFFFF, 0x80008001, 0x00000001, 0x3F800000]
    bits = torch.cat([torch.tensor(special, dtype=torch.int64),
                      torch.randint(0, 1 << 32, (4000,), generator=gen, dtype=torch.int64)])
    bias = (bits - ((bits >= 1 << 31).long() << 32)).to(torch.int32).view(torch.float32)  # the patterns as floats
    bias = torch.where(bias == 0, torch.ones_like(bias), bias)  # no zeros: 0 + (-0) is +0, the cast keeps -0
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    w = (torch.randn(bias.numel(), 64, generator=gen) * 0.05).to(torch.bfloat16)
    out = bf16_rows.linear(x, bf16_rows.pack(w), bias.numel(), bias, kernel=fn)
    nan, subnormal = bias.isnan(), bias.abs() < torch.finfo(torch.float32).tiny
    assert nan.any() and out.isnan()[:, nan].all()
    exact = ~nan & ~subnormal if kind in ("amx", "dot") else ~nan
    assert subnormal.sum() >= 5 and exact.sum() > 3900
    assert torch.equal(out[:, exact].view(torch.int16), bias[exact].to(torch.bfloat16).expand(2, -1).view(torch.int16))


@needs_kernel
@pytest.mark.parametrize("kind", ["amx", "dot", "widened"])
def test_a_rows_result_does_not_depend_on_its_batch_or_the_thread_count(kind):
    if kind not in builds():
        pytest.skip(f"the {kind} build does not run on this CPU")
    fn = kernel_fn(kind)
    w, x, bias = case(1000, 576, 16, seed=7)  # 1000: the last tile of 64 is partial
    packed = bf16_rows.pack(w)
    alone = torch.cat([bf16_rows.linear(x[i:i + 1], packed, 1000, bias, kernel=fn) for i in range(16)])
    for m in range(1, 17):  # groups of up to 7 (dot), 5 (widened) or 16 (amx) rows: 8 = 4 + 4, 13 = 7 + 6, ...
        assert torch.equal(bf16_rows.linear(x[:m], packed, 1000, bias, kernel=fn), alone[:m]), m
        assert torch.equal(bf16_rows.linear(x[16 - m:], packed, 1000, bias, kernel=fn), alone[16 - m:]), m
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            assert torch.equal(bf16_rows.linear(x, packed, 1000, bias, kernel=fn), alone)
    finally:
        torch.set_num_threads(threads)
    if kind == "widened":  # past its block of 256 rows widened at a time: the same sums
        w, x, bias = case(100, 64, 600, seed=8)
        packed = bf16_rows.pack(w)
        alone = torch.cat([bf16_rows.linear(x[i:i + 3], packed, 100, bias, kernel=fn) for i in range(0, 600, 3)])
        assert torch.equal(bf16_rows.linear(x, packed, 100, bias, kernel=fn), alone)
    if kind == "amx":  # past a tile's 16 rows: groups of equal size, x padded with zero rows where m is not a multiple
        w, x, bias = case(130, 96, 45, seed=9)
        packed = bf16_rows.pack(w)
        alone = torch.cat([bf16_rows.linear(x[i:i + 1], packed, 130, bias, kernel=fn) for i in range(45)])
        for m in (17, 32, 33, 45):
            assert torch.equal(bf16_rows.linear(x[:m], packed, 130, bias, kernel=fn), alone[:m]), m


@needs_kernel
def test_packed_linear_routes_every_row_count_to_the_widened_kernel():
    """Without bf16 units (the widened build) the kernel serves every row count, also past oneDNN's limit:
    oneDNN there emulates bf16 and is the slower at every row count measured."""
    if bf16_rows.variant() != "widened":
        pytest.skip("this CPU runs the dot build: oneDNN serves the rows past rows_kernel_rows()")
    assert rows_kernel_rows() > 10 ** 6 and not cpu_backend.packed_bf16()
    w, x, bias = case(130, 64, cpu_backend.PACKED_BF16_MAX_ROWS + 3, seed=3)
    copies = WeightCopies()
    for m in (1, 5, x.shape[0]):
        got = packed_linear(x[None, :m], w, copies, "w", bias)
        assert torch.equal(got[0], bf16_rows.linear(x[:m], bf16_rows.pack(w), 130, bias)), m
    assert set(copies._copies) == {"w:rows"}
    odd = case(40, 33, 2, seed=4)  # an odd k: the kernel's pairs do not apply, and no oneDNN copy: F.linear's
    assert packed_linear(odd[1], odd[0], copies, "odd") is None


@needs_kernel
def test_packed_linear_routes_few_rows_to_the_kernel_and_more_to_onednn():
    """Up to rows_kernel_rows() rows (32; 2 where an AMX CPU runs the dot code) the kernel, above it oneDNN."""
    if bf16_rows.variant() not in ("amx", "dot"):
        pytest.skip("the widened build serves every row count (the test above)")
    dot_on_amx = bf16_rows.variant() == "amx" and not bf16_rows.amx_tiles()  # the tiles not lent: the dot code
    assert rows_kernel_rows() == (bf16_rows.DOT_ON_AMX_MAX_ROWS if dot_on_amx else 32)
    w, x, bias = case(130, 64, rows_kernel_rows() + 1, seed=3)
    copies = WeightCopies()
    few = x[:rows_kernel_rows()]
    got = packed_linear(few[None], w, copies, "w", bias)  # [1, M, K] as the decoder passes it
    assert set(copies._copies) == {"w:rows"}
    assert torch.equal(got[0], bf16_rows.linear(few, bf16_rows.pack(w), 130, bias))
    assert torch.equal(packed_linear(x, w, copies, "w", bias), F.linear(x, w, bias))  # oneDNN: bitwise F.linear
    assert set(copies._copies) == {"w:rows", "w:packed"}
    with torch.no_grad():
        w.mul_(-2)  # an update_weights-style write: the kernel's copy is remade
    assert torch.equal(packed_linear(few, w, copies, "w"), bf16_rows.linear(few, bf16_rows.pack(w), 130))
    odd = case(40, 33, 2, seed=4)  # an odd k: the kernel's pairs do not apply, oneDNN serves it
    assert torch.equal(packed_linear(odd[1], odd[0], copies, "odd"), F.linear(odd[1], odd[0]))


@needs_kernel
def test_the_op_compiled_steps_call_equals_the_eager_kernel():
    """The op runs its C++ kernel where a C++ compiler builds it (a compile error fails here with the
    compiler's output), bitwise the ctypes path's results, with and without a bias, at 1..9 rows; its
    checks name what was wrong; inside a compiled function too."""
    if os.environ.get("ROLLOUT_SSD_BF16_ROWS_OP") != "0" and shutil.which(bf16_rows.default_compiler(op=True)):
        try:
            bf16_rows.build(op=True)
        except subprocess.CalledProcessError as exc:
            pytest.fail(f"the bf16 rows op's C++ kernel does not compile: {exc.stderr}")
        assert bf16_rows.op_in_cpp()
        assert torch._C._dispatch_has_kernel_for_dispatch_key("rollout_ssd::bf16_rows", "CPU")
    for rows in (1, 2, 5, 7, 9):
        w, x, bias = case(100, 64, rows, seed=rows)
        packed = bf16_rows.pack(w)
        for b in (bias, None):
            assert torch.equal(torch.ops.rollout_ssd.bf16_rows.default(x, packed, b, 100), bf16_rows.linear(x, packed, 100, b))
    if bf16_rows.op_in_cpp():
        with pytest.raises(RuntimeError, match="does not fit"):
            torch.ops.rollout_ssd.bf16_rows(x[:, :62], packed, None, 100)
        with pytest.raises(RuntimeError, match="bias has 3 elements"):
            torch.ops.rollout_ssd.bf16_rows(x, packed, bias[:3], 100)
        with pytest.raises(RuntimeError, match="64-byte aligned"):
            torch.ops.rollout_ssd.bf16_rows(x, packed.transpose(1, 2).contiguous().transpose(1, 2), None, 100)
        with pytest.raises(RuntimeError, match="64-byte aligned"):  # contiguous, at an offset of one element
            torch.ops.rollout_ssd.bf16_rows(x, _at_offset(packed), None, 100)
        with pytest.raises(RuntimeError, match="n must be >= 0"):
            torch.ops.rollout_ssd.bf16_rows(x, packed, None, -1)
    op = torch.ops.rollout_ssd.bf16_rows.default
    assert op(x[:0], packed, bias, 100).shape == (0, 100)
    wide = torch.cat([x, x], dim=1)[:, ::2]  # not contiguous: copied first
    assert torch.equal(op(wide, packed, bias, 100), bf16_rows.linear(wide.contiguous(), packed, 100, bias))
    odd = _at_offset(x)  # contiguous at an odd bf16 offset: the kernel's 4-byte reads of x need a copy
    assert odd.data_ptr() % 4 and torch.equal(op(odd, packed, bias, 100), bf16_rows.linear(x, packed, 100, bias))
    assert torch.equal(bf16_rows.linear(odd, packed, 100, bias), bf16_rows.linear(x, packed, 100, bias))
    expected = bf16_rows.linear(x, packed, 100, bias)
    compiled = torch.compile(lambda x, p, b: torch.ops.rollout_ssd.bf16_rows(x, p, b, 100) * 2, fullgraph=True)
    assert torch.equal(compiled(x, packed, bias), expected * 2)


def _at_offset(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t that starts one element into its storage (misaligned for 4 and 64 bytes
    where the storage is aligned, as torch's CPU allocator makes it)."""
    out = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
    out.copy_(t)
    return out


def test_shape_errors_name_what_was_wrong():
    with pytest.raises(ValueError, match="even number of columns"):
        bf16_rows.pack(torch.zeros(4, 3, dtype=torch.bfloat16))
    packed = bf16_rows.pack(torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not fit"):
        bf16_rows.linear(torch.zeros(2, 6, dtype=torch.bfloat16), packed, 4)
    with pytest.raises(ValueError, match="does not fit"):
        bf16_rows.linear(torch.zeros(2, 8), packed, 4)
    with pytest.raises(ValueError, match="does not fit"):  # more outputs than the packed tiles hold
        bf16_rows.linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, 65)
    with pytest.raises(ValueError, match="contiguous, 64-byte aligned"):
        bf16_rows.linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed.transpose(1, 2).contiguous().transpose(1, 2), 4)
    with pytest.raises(ValueError, match="bias has 3 elements"):
        bf16_rows.linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, 4, torch.zeros(3))
    with pytest.raises(ValueError, match="contiguous, 64-byte aligned"):  # contiguous, misaligned
        bf16_rows.linear(torch.zeros(2, 8, dtype=torch.bfloat16), _at_offset(packed), 4)
    with pytest.raises(ValueError, match="n must be >= 0"):
        bf16_rows.linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, -1)


@needs_kernel
def test_no_rows_and_a_column_major_weight():
    w, x, bias = case(128, 64, 3, seed=9)
    packed = bf16_rows.pack(w)
    assert bf16_rows.linear(x[:0], packed, 128, bias).shape == (0, 128)
    column_major = w.t().contiguous().t()  # a float32 model's layer layout, cast to bf16 as is
    assert torch.equal(bf16_rows.pack(column_major), packed)
    assert packed_linear(x[:0], w, WeightCopies(), "w").shape == (0, 128)


@pytest.mark.skipif(bf16_rows.variant() is None, reason="the builds target AVX-512")
def test_build_is_cached_by_source_and_a_failed_build_leaves_the_kernel_off(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_SSD_KERNEL_CACHE", str(tmp_path))
    if not shutil.which(bf16_rows.default_compiler()):
        pytest.skip("no C compiler here")
    first = bf16_rows.build()  # a compile error fails here
    assert first.parent == tmp_path and first.exists()
    stamp = first.stat().st_mtime_ns
    assert bf16_rows.build() == first and first.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left
    if shutil.which(bf16_rows.default_compiler(op=True)):  # the op's C++ kernel: its own key, which holds torch's version
        op = bf16_rows.build(op=True)
        assert op.parent == tmp_path and op.name.startswith(f"bf16_rows_op_{bf16_rows.variant()}-")
        assert bf16_rows.build(op=True) == op
        op.unlink()
        compiles = []

        def fake_compile(cmd, **kwargs):  # writes an empty "library" where the compiler would
            compiles.append(cmd)
            Path(cmd[-1]).write_bytes(b"")

        with monkeypatch.context() as m:
            m.setattr(subprocess, "run", fake_compile)  # kernel_build runs the compiler through it
            m.setattr(torch, "__version__", "0.0.0+another")
            other = bf16_rows.build(op=True)
        assert len(compiles) == 1 and other.name != op.name and other.name.startswith("bf16_rows_op_")
        other.unlink()
    with pytest.raises(subprocess.CalledProcessError):
        bf16_rows.build(compiler="false")  # a compiler that fails: a new key, nothing written
    assert [p.name for p in tmp_path.iterdir()] == [first.name]

    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv("ROLLOUT_SSD_KERNEL_CACHE", str(blocked / "kernels"))  # cannot be made: a read-only home
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    fallback = bf16_rows.build()
    assert fallback.parent.parent == tmp_path / "tmp" and fallback.name == first.name
    fallback.parent.chmod(0o777)  # a shared folder others can write to: nothing in it is loaded or built
    try:
        with pytest.raises(OSError, match="no writable folder"):
            bf16_rows.build()
    finally:
        fallback.parent.chmod(0o700)

    def failing(compiler=None, op=False, kind=None):
        raise subprocess.CalledProcessError(1, ["cc"], stderr="cc: error: bad flags")

    monkeypatch.setattr(bf16_rows, "build", failing)
    bf16_rows._kernel.cache_clear()
    try:
        assert not bf16_rows.available()
    finally:
        monkeypatch.undo()
        bf16_rows._kernel.cache_clear()


def test_the_ops_cpp_kernel_is_not_built_on_an_older_torch_and_any_load_failure_falls_back(monkeypatch, caplog):
    """Below the stable ABI version the source targets, no build is tried; a build or load that fails in
    any way (not only a compiler error) leaves the op on its Python fallback, logged, instead of raising
    out of the kernel's loading."""
    builds = []

    def failing_build(compiler=None, op=False, kind=None):
        builds.append(op)
        raise RuntimeError("a library torch cannot load")

    monkeypatch.setattr(bf16_rows, "build", failing_build)
    monkeypatch.delenv("ROLLOUT_SSD_BF16_ROWS_OP", raising=False)
    try:
        bf16_rows._op_library.cache_clear()
        monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.9.1"))
        assert bf16_rows._op_library() is None and builds == []
        monkeypatch.undo()
        monkeypatch.setattr(bf16_rows, "build", failing_build)
        bf16_rows._op_library.cache_clear()
        with caplog.at_level("WARNING", logger=bf16_rows.__name__):
            assert bf16_rows._op_library() is None
        assert builds == [True] and "a library torch cannot load" in caplog.text
    finally:
        monkeypatch.undo()
        bf16_rows._op_library.cache_clear()  # the next caller loads the real library again (already loaded: a no-op)


@needs_kernel
def test_where_the_ops_cpp_kernel_does_not_build_the_op_falls_back_to_the_same_results(tmp_path):
    """A C++ compiler that fails (in a fresh process, as a loaded library stays for the process): the
    kernel stays on, the op runs through Python, bitwise the C++ kernel's results here."""
    w, x, bias = case(70, 64, 3, seed=11)
    packed = bf16_rows.pack(w)
    torch.save({"x": x, "w": packed, "b": bias}, tmp_path / "case.pt")
    script = ("import sys, torch\nfrom rollout_ssd.kernels import bf16_rows\n"
              "c = torch.load(sys.argv[1], weights_only=True)\n"
              "assert bf16_rows.available() and not bf16_rows.op_in_cpp()\n"
              "torch.save(torch.ops.rollout_ssd.bf16_rows(c['x'], c['w'], c['b'], 70), sys.argv[2])\n")
    env = {**os.environ, "CXX": "false", "ROLLOUT_SSD_KERNEL_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "case.pt"), str(tmp_path / "out.pt")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "C++ kernel not built" in done.stderr
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True), torch.ops.rollout_ssd.bf16_rows(x, packed, bias, 70))


@needs_kernel
@pytest.mark.slow
def test_default_bf16_decode_and_verify_steps_through_the_kernel_are_within_bf16_rounding(default_model_f32, hf_default):
    """SmolLM2 in bf16, a prompt prefilled (oneDNN: many rows; the kernel in its widened build), then one-row
    decode steps and a 5-row verify-shaped extend (the kernel; oneDNN on AMX), against transformers' float32
    logits for the same positions:
    the bounds of test_model's bf16 prefill test (max error at most 2x transformers' own bf16 max error,
    mean error <= 0.35, the argmax equal to float32's wherever float32's top-2 margin exceeds 1.0)."""
    from rollout_ssd.models.loader import build_decoder
    from rollout_ssd.runner import ModelRunner
    from tests.support.hf_reference import hf_logits

    model = build_decoder(default_model_f32.hf_config, default_model_f32.model.hf_parameters(), torch.bfloat16)
    hf_bf16 = copy.deepcopy(hf_default).to(torch.bfloat16)
    tok = default_model_f32.tokenizer
    ids = tok("Here is a short list of European countries and their capitals, as a geography teacher "
              "would write it on the board. The capital of France is Paris. The capital of Italy is").input_ids
    if bf16_rows.variant() in ("amx", "dot"):
        assert len(ids) > rows_kernel_rows()  # the prefill runs oneDNN's kernels
    cont = tok(" Rome, and the capital of Spain is Madrid; of Germany,").input_ids[:10]
    runner = ModelRunner(model, num_slots=1, max_len=64)
    mine = [runner.prefill([0], [ids]).float()]
    mine += [runner.decode([0], [t]).float() for t in cont[:5]]
    mine.append(runner.extend([0], [cont[5:10]])[0].float())  # 5 rows: a verify of K + 1 = 5
    mine = torch.cat(mine)[:-1]  # logits after ids[-1], cont[0], ..., cont[8]
    full = ids + cont
    ref = hf_logits(hf_default, full)[len(ids) - 1:len(full) - 1]
    theirs = hf_logits(hf_bf16, full)[len(ids) - 1:len(full) - 1]
    assert mine.shape == ref.shape
    ours_err, hf_err = float((mine - ref).abs().max()), float((theirs - ref).abs().max())
    assert ours_err <= 2 * hf_err, (ours_err, hf_err)
    assert float((mine - ref).abs().mean()) <= 0.35
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1.0
    assert torch.equal(mine.argmax(-1)[clear], ref.argmax(-1)[clear])
    assert any("rows" in key for key in model.layers[0].row_major._copies)  # the kernel served the steps


@needs_kernel
def test_pack_live_keeps_the_kernels_copies_while_it_runs_and_drops_them_once_it_is_off(tmp_path, monkeypatch):
    """Live compiled steps call the kernel over `pack_live`'s copies where one is listed: listed for every
    linear of a bf16 model while the kernel runs, removed once it is turned off (steps traced after that
    then take oneDNN's op or the one-row reduction)."""
    from rollout_ssd.models.cpu_backend import pack_live
    from rollout_ssd.models.loader import load_pretrained
    from tests.support.models import build_tiny

    build_tiny(tmp_path, family="qwen2-bias-tied")
    model = load_pretrained(str(tmp_path), dtype="bfloat16").model
    pack_live(model)
    names = {"wqkv:rows", "wo:rows", "w_gate_up:rows", "w_down:rows"}
    assert all(names <= set(layer.row_major.live) for layer in model.layers)
    assert "lm_head:rows" in model.copies.live
    first = model.layers[0].row_major.live["wo:rows"]
    assert torch.equal(first, bf16_rows.pack(model.layers[0].wo))
    monkeypatch.setattr(bf16_rows, "_ON", False)
    pack_live(model)
    assert not any(key.endswith(":rows") for layer in model.layers for key in layer.row_major.live)
    assert "lm_head:rows" not in model.copies.live


@needs_kernel
@pytest.mark.slow
def test_greedy_sd_and_ssd_of_a_bf16_pair_emit_ar_tokens_through_the_kernel(tmp_path):
    """A bf16 pair whose linears run this CPU's build of the kernel (the widened one where the CPU has no
    bf16 units, where dtype auto now picks bf16): greedy SD (verify of K + 1 rows) and SSD (the draft side
    in process, its tree steps and a fan-out, hits and misses both) emit AR's tokens, one-row decode steps;
    where the one-call layer kernel runs, through it (decode and verify steps alike)."""
    from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
    from rollout_ssd.models.loader import load_pretrained
    from tests.support.models import tiny_pair
    from tests.support.ran import assert_ran
    from tests.test_ssd_helpers import ar_engine, ssd_engine

    tiny_pair(tmp_path, vocab=48)
    target, draft = (load_pretrained(str(tmp_path / name), dtype="bfloat16") for name in ("target", "draft"))
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3, 3, 3, 3]]
    params = SamplingParams(temperature=0, max_new_tokens=16, n=2, ignore_eos=True)
    ar = [r.token_ids for r in ar_engine(target, 3).sample(prompts, params)]
    sd = RolloutEngine(target, SpecConfig(method="sd", k=3), EngineConfig(max_batch_size=3, max_model_len=128),
                       draft=draft)
    assert [r.token_ids for r in sd.sample(prompts, params)] == ar
    assert_ran(sd, "spec", accepted=True)
    ssd = ssd_engine(target, draft, batch=3, k=3, fanout=(1, 1, 1, 2))
    assert [r.token_ids for r in ssd.sample(prompts, params)] == ar
    assert_ran(ssd, "ssd", hits=True, misses=True)  # the rule is off: SSD rounds, hits and misses both
    ssd.close()
    assert any(key.endswith(":rows") for key in target.model.layers[0].row_major._copies)  # the kernel served them
    from rollout_ssd.kernels import layer_kernel

    if layer_kernel.available():  # and the one-call layers served AR's steps and SD's verifies (their arguments kept)
        assert layer_kernel._ARGS.get(target.model) is not None


def test_a_bf16_models_float32_cache_where_bf16_is_widened_changes_no_decode_or_verify_output(tmp_path, monkeypatch):
    """Where the widened kernel runs (`cpu_dtype.widened_bf16`), a bf16 model's KV cache is float32
    (`attention.cache_dtype`): the same bf16 values, so decode and verify steps (the explicit attention, which
    works in float32) and a prefill past the explicit form's 16 queries (SDPA over the values cast back to
    bf16) are bitwise those over a bf16 cache. Elsewhere the cache keeps the model's dtype."""
    from rollout_ssd import runner as runner_module
    from rollout_ssd.models import attention
    from rollout_ssd.models.loader import load_pretrained
    from rollout_ssd.runner import ModelRunner
    from tests.support.models import build_tiny

    build_tiny(tmp_path, family="qwen2-bias-tied")
    model = load_pretrained(str(tmp_path), dtype="bfloat16").model
    widened = cpu_dtype.widened_bf16()
    assert attention.cache_dtype(model) == (torch.float32 if widened else torch.bfloat16)
    assert attention.cache_dtype(load_pretrained(str(tmp_path), dtype="float32").model) == torch.float32
    if not widened:
        return
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        monkeypatch.setattr(runner_module, "cache_dtype", lambda model, dtype=dtype: dtype)
        runner = ModelRunner(model, num_slots=3, max_len=64)
        assert runner.cache.keys[0].dtype == dtype
        out[dtype] = [runner.prefill([0, 1], [[1, 2, 3, 4, 5], [6, 7]]), runner.decode([0, 1], [8, 9]),
                      runner.extend([0, 1], [[1, 2, 3, 4], [5, 6, 7, 8]]),
                      runner.prefill([2], [list(range(1, 25))])]  # 24 queries: SDPA
    for a, b in zip(out[torch.float32], out[torch.bfloat16]):
        assert torch.equal(a, b)


def test_the_engines_kv_plan_counts_the_dtype_its_cache_gets(tmp_path):
    """kv_cache_bytes is divided by the bytes a slot's cache takes in the dtype it gets (`attention.cache_dtype`,
    float32 for a bf16 model where bf16 is widened), with the backend the engine gives the model, not the one
    an earlier engine left on it."""
    from rollout_ssd import EngineConfig, RolloutEngine, SpecConfig
    from rollout_ssd.kv_cache import KVCache
    from rollout_ssd.models.loader import load_pretrained
    from tests.support.models import build_tiny

    build_tiny(tmp_path, family="qwen2-bias-tied")
    target = load_pretrained(str(tmp_path), dtype="bfloat16")
    target.model.backend = object()  # left by an earlier engine: not the SDPA backend this one selects
    cfg = target.model.cfg
    dtype = torch.float32 if cpu_dtype.widened_bf16() else torch.bfloat16
    per_slot = KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype) * 64
    engine = RolloutEngine(target, SpecConfig(method="ar"), EngineConfig(max_batch_size=8, max_model_len=64,
                                                                         kv_cache_bytes=5 * per_slot))
    assert engine.runner.cache.num_slots == 5 and engine.runner.cache.keys[0].dtype == dtype
