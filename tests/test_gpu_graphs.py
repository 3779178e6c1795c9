"""Static-shape steps (rollout_ssd/gpu/graphs.py): bucket routing, static buffers, and the step's
results against the eager `ModelRunner` path on a CPU (the CUDA capture itself is GPU-only)."""

from __future__ import annotations

import pytest
import torch

from rollout_ssd.gpu.graphs import BUCKETS, GraphedSteps, StaticStep, StepKey, bucket_for
from rollout_ssd.models.loader import load_pretrained
from rollout_ssd.runner import ModelRunner
from tests.support.models import hf_config, randomize
from tests.support.ran import assert_ran
from tests.support.toolchain import needs_cxx


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaForCausalLM

    d = tmp_path_factory.mktemp("graphs")
    model = LlamaForCausalLM(hf_config("llama-gqa-untied"))
    randomize(model, seed=3)
    model.save_pretrained(d)
    return load_pretrained(str(d), dtype="float32").model


def test_bucket_for_picks_the_smallest_bucket_that_holds_the_batch():
    assert [bucket_for(b) for b in (1, 2, 3, 5, 16, 17, 512)] == [1, 2, 4, 8, 16, 32, 512]
    assert bucket_for(3, (8, 2)) == 8
    with pytest.raises(ValueError, match="largest graph bucket 512"):
        bucket_for(513)
    with pytest.raises(ValueError, match="at least one row"):
        bucket_for(0)
    assert BUCKETS == tuple(sorted(BUCKETS))


def test_graphs_are_refused_off_cuda_and_bad_buckets_named(tiny):
    runner = ModelRunner(tiny, num_slots=2, max_len=16)
    with pytest.raises(ValueError, match="CUDA device"):
        GraphedSteps(tiny, runner.cache, graphs=True)
    with pytest.raises(ValueError, match="positive integers"):
        GraphedSteps(tiny, runner.cache, buckets=(0, 2))
    with pytest.raises(ValueError, match="CUDA"):
        StaticStep(tiny, runner.cache, 1, 1).capture()


def test_padded_rows_go_to_the_scratch_slot(tiny):
    runner = ModelRunner(tiny, num_slots=3, max_len=16)
    step = StaticStep(tiny, runner.cache, rows=4, t=2)
    step.load([2, 0], [[5, 6], [7, 8]], [3, 1])
    assert step.slot.tolist() == [2, 0, 3, 3]  # scratch slot = num_slots
    assert step.positions.tolist() == [[3, 4], [1, 2], [0, 1], [0, 1]]
    assert step.tokens.tolist() == [[5, 6], [7, 8], [0, 0], [0, 0]]
    with pytest.raises(ValueError, match="past the KV cache"):
        step.load([0], [[1, 2]], [15])
    with pytest.raises(ValueError, match="got 1 rows of lengths \\[3\\]"):
        step.load([0], [[1, 2, 3]], [0])


@pytest.mark.parametrize("t", [1, 3])
def test_static_steps_match_the_eager_runner(tiny, t):
    """Ragged cache lengths, slots out of order, a padded bucket (3 rows in a bucket of 4): the static
    step's logits equal the eager forward's within float32 reordering error (it reads the whole cache
    with a mask instead of the visible prefix; 1e-5 on logits of order 1), its greedy tokens are equal,
    and both leave the same cache lengths and the same K/V at every visible position."""
    eager = ModelRunner(tiny, num_slots=4, max_len=32)
    static = ModelRunner(tiny, num_slots=4, max_len=32)
    steps = GraphedSteps(tiny, static.cache, buckets=(1, 4))
    prompts = {0: [1, 2, 3, 4, 5], 2: [9, 8], 3: [7, 7, 7]}
    for runner in (eager, static):
        runner.prefill(list(prompts), list(prompts.values()))
    slots = [3, 0, 2]
    feed = [[11 + i + j for j in range(t)] for i in range(len(slots))]
    for _ in range(4):
        want = eager.extend(slots, feed, last_only=True)
        got = steps.run(slots, feed)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert [static.length(s) for s in slots] == [eager.length(s) for s in slots]
        feed = [[int(x)] * t for x in want.argmax(-1)]
    for layer in range(tiny.cfg.num_layers):
        for s in slots:
            n = eager.length(s)
            torch.testing.assert_close(static.cache.keys[layer][s, :, :n], eager.cache.keys[layer][s, :, :n],
                                       atol=1e-5, rtol=0)
    assert set(steps.steps) == {StepKey(4, t)}


def test_device_timer_measures_cpu_work_and_refuses_misuse():
    import time

    from rollout_ssd.gpu.timing import DeviceTimer

    timer = DeviceTimer("cpu")
    with timer:
        time.sleep(0.02)
    assert 0.015 < timer.seconds < 2.0
    with pytest.raises(RuntimeError, match="before start"):
        timer.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_equals_the_eager_static_step(tiny):
    model = tiny.to("cuda")
    try:
        runner = ModelRunner(model, num_slots=4, max_len=32)
        runner.prefill([0, 1], [[1, 2, 3], [4, 5]])
        lengths = list(runner.cache.lengths)
        eager = StaticStep(model, runner.cache, rows=2, t=1)
        eager.load([0, 1], [[6], [7]], lengths[:2])
        want = eager.run().clone()
        steps = GraphedSteps(model, runner.cache, buckets=(2,))
        got = steps.run([0, 1], [[6], [7]])
        assert steps.steps[StepKey(2, 1)].graph is not None
        assert torch.equal(got, want)  # same kernels on the same inputs: bitwise
    finally:
        tiny.to("cpu")


@pytest.mark.parametrize("method", ["ar", "sd", "ssd"])
def test_engine_with_static_steps_gives_the_same_greedy_tokens(method, tmp_path):
    """EngineConfig(cuda_graphs=True) routes equal-length decode and verify forwards through the static
    steps (eager on a CPU): greedy tokens equal the default engine's, and the steps were used."""
    from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
    from tests.support.models import tiny_pair

    target, draft = tiny_pair(tmp_path, vocab=48)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, n=2)
    spec = SpecConfig(method=method, k=3, worker=False, strategy_rule=False)
    out = {}
    for graphs in (False, True):
        engine = RolloutEngine(target, spec, EngineConfig(max_batch_size=4, max_model_len=64, cuda_graphs=graphs),
                               draft=None if method == "ar" else draft)
        out[graphs] = [r.token_ids for r in engine.sample([[1, 2, 3], [4, 5]], params)]
        if method != "ar":  # SD verified proposals; SSD ran its rounds (the rule is off)
            assert_ran(engine, {"sd": "spec", "ssd": "ssd"}[method])
        used = engine.runner.static is not None and len(engine.runner.static.steps) > 0
        engine.close()
        assert used == graphs
    assert out[True] == out[False]


def test_graphed_steps_refuse_a_shape_they_have_no_step_for(tiny):
    runner = ModelRunner(tiny, num_slots=2, max_len=64)
    steps = GraphedSteps(tiny, runner.cache, buckets=(1,))
    with pytest.raises(ValueError, match="no static step for 2 rows"):
        steps.run([0, 1], [[1], [2]])
    with pytest.raises(ValueError, match="at most 16 tokens"):
        steps.run([0], [list(range(17))])


def _eager_and_static(tiny, **steps_options):
    eager = ModelRunner(tiny, num_slots=3, max_len=32)
    static = ModelRunner(tiny, num_slots=3, max_len=32)
    static.use_static_steps(buckets=(2,), **steps_options)
    for runner in (eager, static):
        runner.prefill([0, 2], [[1, 2, 3, 4, 5], [9, 8]])
    return eager, static


def _same_valid_logits(got, want, num_new):
    """Rows' own positions only (a ragged eager forward's padded positions are garbage): within float32
    reordering error (1e-5 on logits of order 1) and the same greedy token."""
    for b, n in enumerate(num_new):
        torch.testing.assert_close(got[b, :n], want[b, :n], atol=1e-5, rtol=0)
        assert torch.equal(got[b, :n].argmax(-1), want[b, :n].argmax(-1))


def test_padded_verify_rows_run_as_one_step_and_match_the_eager_runner(tiny):
    """pad_t: ragged verify rows (chains that stopped early) run as one pad_t-token step; each row's own
    logits and its cache length are the eager forward's, the padding's K/V are overwritten by the next
    forward, and a decode (one token per row) keeps its own one-token step."""
    eager, static = _eager_and_static(tiny, pad_t=4)
    slots = [2, 0]
    for rows in ([[11, 12, 13], [14]], [[15, 16], [17, 18, 19, 20]]):
        num_new = [len(r) for r in rows]
        _same_valid_logits(static.extend(slots, rows), eager.extend(slots, rows), num_new)
        assert [static.length(s) for s in slots] == [eager.length(s) for s in slots]
        torch.testing.assert_close(static.extend(slots, rows, last_only=True)[:, None],
                                   eager.extend(slots, rows, last_only=True)[:, None], atol=1e-5, rtol=0)
        for runner in (eager, static):  # undo the last_only forward
            for s, n in zip(slots, num_new):
                runner.rollback(s, runner.length(s) - n)
    decode = [[3], [4]]
    _same_valid_logits(static.extend(slots, decode), eager.extend(slots, decode), [1, 1])
    assert set(static.static.steps) == {StepKey(2, 4, False), StepKey(2, 1, False)}
    assert static.static.step_tokens([0], [2]) == 4
    static.cache.lengths[0] = 30  # 30 + 4 > 32: the padded step would write past the cache: eager runs it
    assert static.static.step_tokens([0], [2]) is None and static.static.step_tokens([0], [1]) == 1


@needs_cxx
def test_frozen_steps_match_the_eager_runner_and_turn_live_when_a_weight_is_written(tiny, monkeypatch):
    """EngineConfig.compile's frozen steps (inductor, weights folded in; the decode step's GEMMs autotuned
    as by default, which the rest of the suite turns off): decode and padded verify logits equal the eager
    forward's within float32 reordering error, over several steps (the K/V cache is written and read as
    data, not frozen). A write to one weight (an update) drops the frozen steps, whose copies would be
    stale: live steps replace them and follow the new weights."""
    monkeypatch.setenv("ROLLOUT_SSD_AUTOTUNE", "1")
    eager = ModelRunner(tiny, num_slots=3, max_len=32)
    static = ModelRunner(tiny, num_slots=3, max_len=32)
    static.use_static_steps(buckets=(1, 2, 4), compiled=True, pad_t=4)
    for runner in (eager, static):
        runner.prefill([0, 2], [[1, 2, 3, 4, 5], [9, 8]])
    slots = [2, 0]
    # two steps (t = 1 and 4 at bucket 2): each more is tens of seconds of compiling with a cold inductor
    # cache (bench/RESULTS.md, "The suite on this CPU kind")
    for rows in ([[3], [4]], [[11, 12, 13], [14]], [[5], [6]]):
        num_new = [len(r) for r in rows]
        _same_valid_logits(static.extend(slots[:len(rows)], rows), eager.extend(slots[:len(rows)], rows), num_new)
    steps = list(static.static.steps.values())
    assert len(steps) == 2 and all(step.compiled is not None for step in steps)
    # each step its own code object: dynamo would otherwise serve one step's graph (its frozen weights
    # included) to another of another shape
    assert len({type(step.compiled._orig_mod).forward.__code__ for step in steps}) == 2
    try:
        with torch.no_grad():
            tiny.layers[0].wo.mul_(1.5)
        _same_valid_logits(static.extend(slots, [[7], [8]]), eager.extend(slots, [[7], [8]]), [1, 1])
        for runner in (eager, static):  # a third sequence: a bucket (4) no step was made for before the write
            runner.prefill([1], [[4]])
        rows = [[1], [2], [3]]
        _same_valid_logits(static.extend([2, 0, 1], rows), eager.extend([2, 0, 1], rows), [1, 1, 1])
        assert static.static.compiled == "live" and not static.static.retired
        assert {step.mode for step in static.static.steps.values()} == {"live"}
        assert any(key.rows == 4 for key in static.static.steps)  # the bucket first met after the write
    finally:
        with torch.no_grad():
            tiny.layers[0].wo.div_(1.5)


def _graphs_per_step(steps: dict) -> dict:
    """StepKey -> the graphs dynamo holds for that compiled step (each step runs its own code object)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return {key: len(_debug_get_cache_entry_list(type(step.compiled._orig_mod).forward.__code__))
            for key, step in steps.items()}


@needs_cxx
def test_live_steps_follow_weight_writes_without_a_recompile(tiny):
    """Live compiled steps (EngineConfig.compile="live") read the weights on every call: after in-place
    writes to a layer matrix and to the LM head (what an update does) their logits still equal the
    eager forward's within float32 reordering error, the same step objects serve, and dynamo compiles
    no new graph."""
    eager, static = _eager_and_static(tiny, compiled="live", pad_t=4)
    rows = ([[3], [4]], [[5, 6], [7]])
    for batch in rows:
        _same_valid_logits(static.extend([2, 0], batch), eager.extend([2, 0], batch), [len(r) for r in batch])
    steps, graphs = dict(static.static.steps), _graphs_per_step(static.static.steps)
    try:
        with torch.no_grad():
            tiny.layers[1].w_gate_up.mul_(1.5)
            tiny.lm_head.mul_(0.5)
        for batch in rows + ([[8], [9]],):
            _same_valid_logits(static.extend([2, 0], batch), eager.extend([2, 0], batch), [len(r) for r in batch])
        assert static.static.steps == steps and _graphs_per_step(steps) == graphs
        assert all(step.mode == "live" for step in steps.values())
    finally:
        with torch.no_grad():
            tiny.layers[1].w_gate_up.div_(1.5)
            tiny.lm_head.div_(0.5)


@needs_cxx
@pytest.mark.parametrize("kernel", ["bf16 rows", "onednn"])
def test_live_bf16_steps_follow_weight_writes(tmp_path, monkeypatch, kernel):
    """The bf16 live path where the CPU has native bf16, against the eager bf16 runner before and after
    in-place writes to a layer matrix and the LM head. kernel "bf16 rows": 1- and 2-row steps call
    `rollout_ssd::bf16_rows` over `pack_live`'s copies (kernels/bf16_rows.py; skipped where it does not
    run); "onednn" (that kernel off): 1-row steps are the reduction over the weight, 2-row steps
    `rollout_ssd::packed_linear` over oneDNN's copies. bf16 tolerance: the paths round differently (fused
    norms, another summation order), within 5% of the logits' range here; the writes move the eager
    logits by more than four times that, so stale weights or copies would fail it."""
    from rollout_ssd.kernels import bf16_rows
    from rollout_ssd.models import cpu_backend

    if not cpu_backend.packed_bf16():
        pytest.skip("no native bf16 on this CPU: live bf16 steps use F.linear (the float32 tests cover the step)")
    if kernel == "bf16 rows" and not bf16_rows.available():
        pytest.skip("the bf16 rows kernel does not run here")
    monkeypatch.setattr(bf16_rows, "_ON", kernel == "bf16 rows")
    bf16, eager, live = _bf16_runners(tmp_path, "live")
    step = _bf16_step
    batches = [([2], [[3]]), ([2, 0], [[4], [5]]), ([2, 0], [[6, 7], [8]])]
    before = [step(eager, slots, rows) for slots, rows in batches]
    tol = 0.05 * max(float(b.max() - b.min()) for b in before)
    for (slots, rows), want in zip(batches, before):
        assert (step(live, slots, rows) - want).abs().max() <= tol
    names = {"wqkv", "wo", "w_gate_up", "w_down"}
    assert set(bf16.layers[0].row_major.live) == names | ({n + ":rows" for n in names} if kernel == "bf16 rows" else set())
    graphs = _graphs_per_step(live.static.steps)
    with torch.no_grad():
        bf16.layers[0].wo.mul_(-1.5)
        bf16.lm_head.mul_(-2.0)
    for (slots, rows), old in zip(batches, before):
        want = step(eager, slots, rows)
        assert (want - old).abs().max() > 4 * tol
        assert (step(live, slots, rows) - want).abs().max() <= tol
    assert _graphs_per_step(live.static.steps) == graphs
    assert {key.rows for key in graphs} == {1, 2}


def test_only_frozen_one_token_steps_autotune_and_the_switch_turns_it_off(monkeypatch):
    from rollout_ssd.gpu.inductor import compile_options

    monkeypatch.delenv("ROLLOUT_SSD_AUTOTUNE")
    assert compile_options(1)["max_autotune"] and compile_options(1)["freezing"]
    assert not compile_options(4)["max_autotune"] and not compile_options(1, "live")["max_autotune"]
    monkeypatch.setenv("ROLLOUT_SSD_AUTOTUNE", "0")
    assert compile_options(1) == {"freezing": True, "max_autotune": False}


def _bf16_runners(directory, compiled: str):
    """A tiny bf16 Llama, an eager runner and one with compiled steps (buckets 1 and 2, verify rows padded
    to 4 tokens), both with the same two prompts prefilled: (model, eager, compiled)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(hf_config("llama-gqa-untied"))
    randomize(model, seed=3)
    model.save_pretrained(directory)
    bf16 = load_pretrained(str(directory), dtype="bfloat16").model
    eager = ModelRunner(bf16, num_slots=3, max_len=32)
    static = ModelRunner(bf16, num_slots=3, max_len=32)
    static.use_static_steps(buckets=(1, 2), compiled=compiled, pad_t=4)
    for runner in (eager, static):
        runner.prefill([0, 2], [[1, 2, 3, 4, 5], [9, 8]])
    return bf16, eager, static


def _bf16_step(runner, slots, rows):
    """The last position's float32 logits of `rows` appended to `slots`, then rolled back."""
    out = runner.extend(slots, rows, last_only=True).float()
    for s, row in zip(slots, rows):
        runner.rollback(s, runner.length(s) - len(row))
    return out


@needs_cxx
def test_frozen_bf16_steps_run_the_rows_kernel_where_it_runs(tmp_path, monkeypatch):
    """Where the bf16 rows kernel runs, frozen compiled steps of a bf16 model call it for every linear
    (over its packed copies, held by the graph) rather than inductor's own bf16 GEMMs, which are slower at
    a step's few rows (bench/RESULTS.md, "a fourth CPU kind"): 9 kernel calls per step of the 2-layer
    model (4 linears a layer and the head) at 1 row and at a 2 x 4-token verify (where 8 rows are the
    kernel's: not on AMX, whose oneDNN is faster there), and logits within the live test's bf16 bound of
    the eager runner's."""
    from rollout_ssd.kernels import bf16_rows

    if not bf16_rows.available():
        pytest.skip("the bf16 rows kernel does not run here (frozen bf16 steps use inductor's GEMMs)")
    _, eager, frozen = _bf16_runners(tmp_path, "frozen")
    from rollout_ssd.models.cpu_backend import rows_kernel_rows

    batches = [([2], [[3]]), ([2, 0], [[6, 7], [8]])]
    want = [_bf16_step(eager, slots, rows) for slots, rows in batches]
    tol = 0.05 * max(float(w.max() - w.min()) for w in want)
    for (slots, rows), expected, step_rows in zip(batches, want, (1, 8)):
        _bf16_step(frozen, slots, rows)  # the compile, on the first call
        with torch.profiler.profile() as prof:  # the op's calls, C++ kernel or Python fallback alike
            assert (_bf16_step(frozen, slots, rows) - expected).abs().max() <= tol
        calls = sum(e.name == "rollout_ssd::bf16_rows" for e in prof.events())
        assert calls == (9 if step_rows <= rows_kernel_rows() else 0), (step_rows, calls)
    assert not frozen.static.retired  # the compiled steps ran (a failed compile falls back to eager steps)
    assert {(key.rows, key.t) for key in frozen.static.steps} == {(1, 1), (2, 4)}
    assert all(step.mode == "frozen" and step.compiled is not None for step in frozen.static.steps.values())
    # the rows kernel turned off: the frozen steps keep the copies they hold (their module's guards are
    # not evaluated: `inductor.guard_filter`), compile nothing more and give the same logits
    graphs = _graphs_per_step(frozen.static.steps)
    before = [_bf16_step(frozen, slots, rows) for slots, rows in batches]

    def rows_copies() -> int:  # the kernel's copies listed for compiled steps, the head's and the layers'
        held = [frozen.model.copies.live, *(layer.row_major.live for layer in frozen.model.layers)]
        return sum(name.endswith(":rows") for copies in held for name in copies)

    assert rows_copies() == 9
    monkeypatch.setattr(bf16_rows, "_ON", False)
    from rollout_ssd.models.cpu_backend import pack_live

    pack_live(frozen.model)  # what a step first traced now would do: drop the kernel's copies
    assert rows_copies() == 0
    assert all(torch.equal(_bf16_step(frozen, slots, rows), b) for (slots, rows), b in zip(batches, before))
    assert _graphs_per_step(frozen.static.steps) == graphs


@needs_cxx
def test_the_live_packed_linear_op_is_onednns_packed_linear_and_pack_live_repacks_after_a_write(monkeypatch):
    """The op live bf16 steps call (cpu_backend: `rollout_ssd::packed_linear`) gives exactly the eager
    packed linear's result, also inside a compiled function (it runs as an opaque kernel there); and
    `pack_live` remakes a weight's packed copy after an in-place write, and only then."""
    from rollout_ssd.kernels import bf16_rows
    from rollout_ssd.models import cpu_backend

    if not cpu_backend.packed_bf16():
        pytest.skip("no native bf16 on this CPU: live bf16 steps use F.linear over the weights")
    monkeypatch.setattr(bf16_rows, "_ON", False)  # 5 rows would take the bf16 rows kernel (tests/test_bf16_rows.py)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=gen).to(torch.bfloat16)
    b = torch.randn(48, generator=gen).to(torch.bfloat16)
    x = torch.randn(5, 32, generator=gen).to(torch.bfloat16)
    copies = cpu_backend.WeightCopies()
    with torch.inference_mode():
        expected = cpu_backend.packed_linear(x, w, copies, "w", b)
        packed = copies.get("w:packed", w, cpu_backend._pack)
        assert torch.equal(torch.ops.rollout_ssd.packed_linear(x, packed, b, 48), expected)
        compiled = torch.compile(lambda x, p, b: torch.ops.rollout_ssd.packed_linear(x, p, b, 48) * 2, fullgraph=True)
        assert torch.equal(compiled(x, packed, b), expected * 2)

    class Model:  # what pack_live reads of a Decoder
        dtype, embed = torch.bfloat16, w
        layers = [type("Layer", (), {"row_major": cpu_backend.WeightCopies(), "wqkv": w, "wo": w,
                                     "w_gate_up": w, "w_down": w, "bqkv": None})()]
        lm_head, copies = w, cpu_backend.WeightCopies()

    cpu_backend.pack_live(Model)
    first = Model.layers[0].row_major.live["wo"]
    cpu_backend.pack_live(Model)
    assert Model.layers[0].row_major.live["wo"] is first  # nothing written: not repacked
    with torch.no_grad():
        w.mul_(2)
    cpu_backend.pack_live(Model)
    again = Model.layers[0].row_major.live["wo"]
    assert again is not first and set(Model.copies.live) == {"lm_head"}
    with torch.inference_mode():
        assert torch.equal(torch.ops.rollout_ssd.packed_linear(x, again, None, 48),
                           torch.nn.functional.linear(x, w))


def test_a_failed_compile_leaves_the_forward_to_the_eager_path(tiny, monkeypatch):
    """A compile that fails (no C++ compiler, an inductor error) retires the compiled steps: that forward
    and every later one run eagerly, with the eager runner's results; nothing was advanced twice."""
    def failing(step, mode="frozen"):
        def compiled(*args):
            raise RuntimeError("no compiler")
        step.compiled = compiled

    monkeypatch.setattr(StaticStep, "compile", failing)
    eager, static = _eager_and_static(tiny, compiled=True, pad_t=4)
    for rows in ([[3], [4]], [[5, 6], [7]]):
        _same_valid_logits(static.extend([2, 0], rows), eager.extend([2, 0], rows), [len(r) for r in rows])
        assert [static.length(s) for s in (2, 0)] == [eager.length(s) for s in (2, 0)]
    assert static.static.retired and not static.static.steps


def test_compile_is_a_bool_or_a_mode_and_excludes_cuda_graphs(tiny):
    from rollout_ssd import EngineConfig

    with pytest.raises(ValueError, match="EngineConfig.compile must be a bool, 'frozen' or 'live', got 'yes'"):
        EngineConfig(compile="yes")
    assert EngineConfig(compile="live").compile == "live"
    with pytest.raises(ValueError, match="compiled must be a bool or one of"):
        GraphedSteps(tiny, ModelRunner(tiny, num_slots=1, max_len=8).cache, compiled="warm")
    with pytest.raises(ValueError, match="compile mode must be one of"):
        StaticStep(tiny, ModelRunner(tiny, num_slots=1, max_len=8).cache, 1, 1).compile("warm")
    with pytest.raises(ValueError, match="exclude each other"):
        EngineConfig(compile=True, cuda_graphs=True)


@needs_cxx
def test_sd_engine_with_compiled_steps_gives_the_default_engines_greedy_tokens(tmp_path):
    """SD with EngineConfig(compile=True): the target's verify (rows padded to k + 1) and decode steps
    and the draft's drafting steps are compiled, and the greedy tokens equal the default engine's."""
    from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
    from tests.support.models import tiny_pair

    target, draft = tiny_pair(tmp_path, vocab=48)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, n=2)
    out = {}
    for compiled in (False, True):
        engine = RolloutEngine(target, SpecConfig(method="sd", k=3), EngineConfig(
            max_batch_size=4, max_model_len=64, compile=compiled), draft=draft)
        out[compiled] = [r.token_ids for r in engine.sample([[1, 2, 3], [4, 5]], params)]
        assert_ran(engine, "spec", accepted=True)
        draft_static = engine.strategy.speculator.runner.static  # the draft's steps, compiled with the target's
        for static in (engine.runner.static, draft_static):
            steps = static.steps.values() if static is not None else []
            assert any(step.compiled is not None for step in steps) == compiled
        if compiled:
            assert any(key.head_only for key in draft_static.steps)  # the restricted head's own steps
        engine.close()
    assert out[True] == out[False]


@needs_cxx
def test_live_compiled_sd_engine_follows_update_weights_with_the_eager_engines_tokens(tmp_path):
    """An RL-shaped use of EngineConfig(compile="live"): SD with compiled target and draft steps, a call,
    a target update through `update_weights`, another call. Both calls give the eager engine's greedy
    tokens under the same weights, and the steps compiled before the update serve after it with no
    recompile (a shape first met after it compiles once, as before any update)."""
    from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
    from tests.support.models import tiny_pair

    target, draft = tiny_pair(tmp_path, vocab=48)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5]]
    engines = {mode: RolloutEngine(target, SpecConfig(method="sd", k=3), EngineConfig(
        max_batch_size=2, max_model_len=64, compile=mode), draft=draft) for mode in (False, "live")}
    loaded = {name: t.detach().clone() for name, t in target.model.hf_parameters().items()}
    drifted = [(name, t * 1.3 if t.dim() == 2 else t) for name, t in loaded.items()]
    try:
        before = {mode: [r.token_ids for r in e.sample(prompts, params)] for mode, e in engines.items()}
        engines["live"].update_weights(drifted, version=1)  # the engines share the target: both see it
        runners = (engines["live"].runner, engines["live"].strategy.speculator.runner)  # target, draft
        steps = [dict(runner.static.steps) for runner in runners]
        graphs = [_graphs_per_step(s) for s in steps]
        after = {mode: [r.token_ids for r in e.sample(prompts, params)] for mode, e in engines.items()}
        for runner, before_steps, before_graphs in zip(runners, steps, graphs):
            assert all(runner.static.steps[key] is step for key, step in before_steps.items())
            assert _graphs_per_step(before_steps) == before_graphs
        assert before[False] == before["live"] and after[False] == after["live"]
        for engine in engines.values():
            assert_ran(engine, "spec", accepted=True)
        assert after[False] != before[False]  # the update changed what is generated
        assert all(step.mode == "live" for step in engines["live"].runner.static.steps.values())
    finally:
        engines["live"].update_weights(list(loaded.items()), version=2)
        for engine in engines.values():
            engine.close()
