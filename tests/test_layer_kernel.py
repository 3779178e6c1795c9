"""The decoder layer kernel (kernels/layer_kernel.py, csrc/decoder_layer.c): as accurate as the
module layers against a float32 model on every model family, a row's results independent of its batch and
of the thread count (bitwise), the cache written where the module layers write it and nowhere else, and
taken only for the forwards it computes (every other one runs the module layers, with the same results)."""

from __future__ import annotations

import pytest
import torch

from rollout_ssd.kernels import bf16_rows, cpu, layer_kernel
from rollout_ssd.models import cpu_backend, loader
from rollout_ssd.models.loader import build_decoder, load_pretrained
from rollout_ssd.runner import ModelRunner
from tests.support.models import FAMILIES, build_tiny

pytestmark = pytest.mark.skipif(not layer_kernel.available(), reason="the layer kernel does not run here (no AVX-512)")


@pytest.fixture(autouse=True)
def every_step_fits(monkeypatch):
    """The kernel takes up to LIMIT tokens here whatever this CPU's speed choice
    (`cpu_backend.layer_kernel_rows()`: 2 where an AMX CPU runs the dot code), so that every path of its code
    runs on every CPU that has it."""
    monkeypatch.setattr(cpu_backend, "_LAYER_ROWS", layer_kernel.LIMIT)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    """(bf16 model, float32 model with the bf16 model's weights) of a 3-layer tiny `family`."""
    directory = tmp_path_factory.mktemp(request.param)
    build_tiny(directory, family=request.param, seed=7, num_hidden_layers=3, max_position_embeddings=256)
    bf16 = load_pretrained(str(directory), dtype="bfloat16", with_tokenizer=False)
    f32 = build_decoder(bf16.hf_config, {k: v.float() for k, v in bf16.model.hf_parameters().items()}, torch.float32)
    return bf16.model, f32


# prompts short enough for the kernel too (each row prefilled alone), so no step depends on another form
PROMPTS = [[3 + (7 * i) % 90 for i in range(8)], [5 + (11 * i) % 90 for i in range(6)]]
# (tokens per row) of the steps after the prompts: decode, a ragged verify, one row alone, a last decode
STEPS = [([40], [41]), ([42, 43, 44], [45, 46]), ([47, 48, 49, 50],), ([51], [52])]


def run(model, kernel: bool, monkeypatch, threads: int = 2, rows=(0, 1), steps=STEPS):
    """The logits of each step's real tokens (a list per step) and the runner, the kernel on or off."""
    monkeypatch.setattr(layer_kernel, "_ON", kernel)
    torch.set_num_threads(threads)
    runner = ModelRunner(model, num_slots=3, max_len=128)
    slots = [runner.allocate() for _ in range(3)]
    out = []
    with torch.inference_mode():
        for r in rows:
            runner.prefill([slots[r]], [PROMPTS[r]])
        for step in steps:
            toks = [step[r] for r in rows if r < len(step)]
            logits = runner.extend([slots[r] for r in rows if r < len(step)], toks)
            out.append(torch.cat([logits[i, : len(t)] for i, t in enumerate(toks)]))
    return out, runner


def builds():
    """This CPU's build, and the rows kernel's builds below it that this CPU also runs (the dot one where it
    has AMX; the widened one, the avx512 kind's, where it has avx512_bf16)."""
    return ["native"] + {"amx": ["dot", "widened"], "dot": ["widened"]}.get(bf16_rows.variant(), [])


@pytest.mark.parametrize("build", builds())
def test_as_accurate_as_the_module_layers_against_float32(pair, build, monkeypatch):
    """Every family (GQA and MHA, q/k/v biases, per-head q/k norms, rope scalings): the kernel's logits
    are within twice the module layers' bf16 error against the float32 model (flash-attention's rule, as
    tests/test_model.py's bf16 test), in the largest error and the mean, at every step, and within a
    quarter of that error of the module layers' logits; the kernel did serve the steps (the module layers
    are counted)."""
    bf16, f32 = pair
    if build != "native":
        other = layer_kernel.load(build)
        monkeypatch.setattr(layer_kernel, "_kernel", lambda: other)
    calls = module_calls(bf16, monkeypatch)
    ref, _ = run(f32, False, monkeypatch)
    eager, _ = run(bf16, False, monkeypatch)
    eager_calls = len(calls)
    fused, _ = run(bf16, True, monkeypatch)
    assert eager_calls > 0 and len(calls) == eager_calls, "the kernel ran every forward of the bf16 model"
    for s, (r, e, k) in enumerate(zip(ref, eager, fused)):
        e_err, k_err = (e - r).abs(), (k - r).abs()
        assert e_err.max() > 0, "the bf16 model differs from float32 somewhere (else the bound says nothing)"
        assert k_err.max() <= 2 * e_err.max(), (s, float(k_err.max()), float(e_err.max()))
        assert k_err.mean() <= 2 * e_err.mean(), (s, float(k_err.mean()), float(e_err.mean()))
        # the same rounding order: they may part only where two float32 values of one quantity round to
        # different bf16 (measured here: bitwise equal), far inside bf16's own error
        assert (k - e).abs().max() <= 0.25 * e_err.max(), (s, float((k - e).abs().max()), float(e_err.max()))


def module_calls(model, monkeypatch) -> list:
    """A list that grows by one at each module layer's forward of `model` (the kernel's forwards add none)."""
    calls = []
    for layer in model.layers:
        monkeypatch.setattr(layer, "forward", lambda *a, _f=layer.forward: calls.append(1) or _f(*a))
    return calls


def test_a_rows_results_do_not_depend_on_its_batch_or_the_thread_count(pair, monkeypatch):
    """Row 0 alone, beside row 1, and at one thread: the same logits and the same cache, bit for bit, every
    forward the kernel's."""
    bf16, _ = pair
    calls = module_calls(bf16, monkeypatch)
    steps = [(s[0],) for s in STEPS]
    alone, runner_a = run(bf16, True, monkeypatch, rows=(0,), steps=steps)
    beside, runner_b = run(bf16, True, monkeypatch, rows=(0, 1), steps=[(s[0], [60]) for s in STEPS])
    one_thread, runner_c = run(bf16, True, monkeypatch, threads=1, rows=(0,), steps=steps)
    torch.set_num_threads(2)
    n = len(PROMPTS[0]) + sum(len(s[0]) for s in STEPS)
    for i in range(len(steps)):
        assert torch.equal(alone[i], beside[i][: len(steps[i][0])]) and torch.equal(alone[i], one_thread[i]), i
    for a, b, c in zip(runner_a.cache.keys + runner_a.cache.values, runner_b.cache.keys + runner_b.cache.values,
                       runner_c.cache.keys + runner_c.cache.values):
        assert torch.equal(a[0, :, :n], b[0, :, :n]) and torch.equal(a[0, :, :n], c[0, :, :n])
    assert not calls


def test_writes_the_cache_where_the_module_layers_do(pair, monkeypatch):
    """A ragged verify: each row's real tokens land at its next positions (lengths advance by them), the
    padded ones nowhere (the rest of every slot, the scratch slot included, keeps its bits)."""
    bf16, _ = pair
    calls = module_calls(bf16, monkeypatch)
    monkeypatch.setattr(layer_kernel, "_ON", True)
    runner = ModelRunner(bf16, num_slots=3, max_len=128)
    slots = [runner.allocate() for _ in range(2)]
    with torch.inference_mode():
        for slot, prompt in zip(slots, PROMPTS):
            runner.prefill([slot], [prompt])
        before = [t.clone() for t in runner.cache.keys + runner.cache.values]
        starts = [runner.cache.lengths[s] for s in slots]
        runner.extend(slots, [[42, 43, 44], [45]])
    assert [runner.cache.lengths[s] for s in slots] == [starts[0] + 3, starts[1] + 1]
    for old, new in zip(before, runner.cache.keys + runner.cache.values):
        changed = (old != new).any(dim=-1)  # [slots, heads, positions]
        written = torch.zeros_like(changed)
        written[slots[0], :, starts[0]:starts[0] + 3] = True
        written[slots[1], :, starts[1]:starts[1] + 1] = True
        assert not (changed & ~written).any()
        assert changed[slots[0], :, starts[0]:starts[0] + 3].all() and changed[slots[1], :, starts[1]].all()
    assert not calls  # the kernel wrote them


def test_a_float32_cache_and_more_than_a_tiles_rows(pair, monkeypatch):
    """A bf16 model over a float32 cache (the avx512 kind's, `attention.cache_dtype`) gets the logits and the
    cache values a bf16 cache gets, bit for bit; a step of 2 x 9 = 18 tokens (past one AMX tile's 16 rows:
    equal groups, x padded) gives the module layers' logits within the first test's quarter bound."""
    from rollout_ssd import runner as runner_module

    bf16, f32 = pair
    long_steps = [([40 + i for i in range(9)], [60 + i for i in range(9)])]
    ref, _ = run(f32, False, monkeypatch, steps=long_steps)
    eager, _ = run(bf16, False, monkeypatch, steps=long_steps)
    fused, bf16_runner = run(bf16, True, monkeypatch, steps=long_steps)
    assert (fused[0] - eager[0]).abs().max() <= 0.25 * (eager[0] - ref[0]).abs().max()
    monkeypatch.setattr(runner_module, "cache_dtype", lambda model: torch.float32)
    calls = module_calls(bf16, monkeypatch)
    wide, wide_runner = run(bf16, True, monkeypatch, steps=long_steps)
    assert wide_runner.cache.keys[0].dtype == torch.float32 and not calls
    assert torch.equal(wide[0], fused[0])
    for a, b in zip(bf16_runner.cache.keys + bf16_runner.cache.values, wide_runner.cache.keys + wide_runner.cache.values):
        assert torch.equal(a.float(), b)


@pytest.mark.skipif("amx_bf16" not in cpu.cpu_flags(), reason="no AMX here")
def test_amx_tiles_run_where_the_cpu_has_them_and_the_row_limit_follows():
    """On an AMX CPU the rows kernel's amx build loads (this suite's compiler has AMX intrinsics) and, where
    the OS lends the tiles, runs on them with the amx build's row limit; where it does not (an older kernel),
    the limit falls back to the dot code's and the tile tests here and in tests/test_bf16_rows.py ran the
    dot code: skipped then, saying so, rather than passing for the tiles."""
    assert bf16_rows.loaded_variant() == "amx"
    if not bf16_rows.amx_tiles():
        assert cpu_backend.rows_kernel_rows() == bf16_rows.DOT_ON_AMX_MAX_ROWS
        pytest.skip("the OS does not lend AMX tiles to this process: the amx build runs the dot code here")
    assert cpu_backend.rows_kernel_rows() == 32


def test_serves_only_the_forwards_it_computes(pair, monkeypatch):
    """Not for: a mask or spans (tree steps), more tokens than `max_rows`, slots out of order of a batch
    that is not a run of consecutive ones, a float32 model, the kernel turned off. Those run the module
    layers, and their logits are the module layers' (the kernel turned off) bit for bit."""
    bf16, f32 = pair
    from rollout_ssd.models.decoder import ForwardBatch

    class Cache:
        keys = values = [torch.zeros(3, 2, 8, bf16.cfg.head_dim, dtype=torch.bfloat16)] * len(bf16.layers)

    def batch(b, t, mask=None):
        return ForwardBatch(torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.long), [t] * b,
                            list(range(b)), [0] * b, mask)

    monkeypatch.setattr(layer_kernel, "_ON", True)
    assert cpu_backend.one_call_layers(bf16, batch(2, 3), Cache, True)
    assert not cpu_backend.one_call_layers(bf16, batch(2, 3), Cache, False)
    assert not cpu_backend.one_call_layers(bf16, batch(1, 3, torch.ones(1, 3, 3, dtype=torch.bool)), Cache, True)
    assert not cpu_backend.one_call_layers(bf16, batch(1, cpu_backend.layer_kernel_rows() + 1), Cache, True)
    assert not cpu_backend.one_call_layers(f32, batch(1, 1), Cache, True)
    monkeypatch.setattr(layer_kernel, "_ON", False)
    assert not cpu_backend.one_call_layers(bf16, batch(1, 1), Cache, True)

    # a tree-shaped step (mask) and a step of slots 2, 0 (not consecutive): the module layers' logits
    def masked_and_gapped(kernel):
        monkeypatch.setattr(layer_kernel, "_ON", kernel)
        runner = ModelRunner(bf16, num_slots=3, max_len=128)
        slots = [runner.allocate() for _ in range(3)]
        with torch.inference_mode():
            runner.prefill([slots[0], slots[2]], PROMPTS)
            n = len(PROMPTS[0])
            mask = torch.ones(1, 2, n + 2, dtype=torch.bool)
            mask[0, 1, n] = False  # the second token does not see the first: siblings in a tree
            tree = runner.extend([slots[0]], [[30, 31]], mask=mask,
                                 positions=torch.tensor([[n, n]]))
            gapped = runner.extend([slots[2], slots[0]], [[32], [33]])
        return tree, gapped

    on, off = masked_and_gapped(True), masked_and_gapped(False)
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])


def test_causal_mask():
    """Token j of row i sees positions up to starts[i] + j (a padded token: its row's last real one); no
    mask where one token a row ends every row at the read length."""
    mask = layer_kernel.causal_mask([2, 4], [3, 1], 3, 5)
    want = torch.tensor([[[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],
                         [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]], dtype=torch.uint8)
    assert torch.equal(mask, want)
    assert layer_kernel.causal_mask([4, 4], [1, 1], 1, 5) is None
    assert layer_kernel.causal_mask([4, 3], [1, 1], 1, 5) is not None


@pytest.mark.parametrize("kind", ["avx512", "amx"])
def test_a_long_prefill_is_not_the_kernels_whatever_the_row_limit(pair, kind, monkeypatch):
    """A row of more than LIMIT tokens is a prefill, never the kernel's (its attention is SDPA's, and
    few_attention.c's scratch grows with queries x keys), even where the kernel takes many more rows of a
    few tokens: the avx512 kind's rows kernel serves every row count (the layer kernel stops at LIMIT), the
    amx kind's layer kernel takes LAYER_KERNEL_ROWS["amx"] tokens in rows of up to LIMIT each."""
    bf16, _ = pair
    from rollout_ssd.models.decoder import ForwardBatch

    limit = cpu_backend.LAYER_KERNEL_ROWS.get(kind, layer_kernel.LIMIT)

    class Cache:
        keys = values = [torch.zeros(limit + 1, 2, 64, bf16.cfg.head_dim, dtype=torch.bfloat16)] * len(bf16.layers)

    monkeypatch.setattr(cpu_backend, "_ROWS_KERNEL_ROWS", 1 << 30 if kind == "avx512" else layer_kernel.LIMIT)
    monkeypatch.setattr(cpu_backend, "cpu_kind", lambda: kind)
    monkeypatch.setattr(cpu_backend, "_LAYER_ROWS", None)  # the computed limit, not the fixture's
    monkeypatch.setattr(layer_kernel, "_ON", True)
    assert cpu_backend.layer_kernel_rows() == limit and limit >= layer_kernel.LIMIT

    def batch(b, t):
        return ForwardBatch(torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.long), [t] * b,
                            list(range(b)), [0] * b)
    assert cpu_backend.one_call_layers(bf16, batch(1, layer_kernel.LIMIT), Cache, True)
    assert not cpu_backend.one_call_layers(bf16, batch(1, layer_kernel.LIMIT + 1), Cache, True)
    assert not cpu_backend.one_call_layers(bf16, batch(1, 4000), Cache, True)
    assert cpu_backend.one_call_layers(bf16, batch(limit, 1), Cache, True)
    assert not cpu_backend.one_call_layers(bf16, batch(limit + 1, 1), Cache, True)
    assert cpu_backend.one_call_layers(bf16, batch(limit // layer_kernel.LIMIT, layer_kernel.LIMIT), Cache, True)
    # where the rows kernel runs the dot code on an AMX CPU (no tiles lent), the limit falls with it
    monkeypatch.setattr(cpu_backend, "_ROWS_KERNEL_ROWS", 2)
    assert cpu_backend.layer_kernel_rows() == 2 and not cpu_backend.one_call_layers(bf16, batch(3, 1), Cache, True)


@pytest.fixture(scope="module")
def int4_pair(tmp_path_factory):
    """(bf16 tiny Qwen3 with q/k norms, its int4 draft in int4_rows.c's groups): every width a multiple of 32."""

    if not layer_kernel.int4_available():
        pytest.skip("int4_rows.c does not run here (it needs avx512_bf16)")
    directory = tmp_path_factory.mktemp("int4")
    build_tiny(directory, family="qwen3-qknorm-yarn", seed=5, num_hidden_layers=3, intermediate_size=64,
               hidden_size=64, max_position_embeddings=256)
    target = load_pretrained(str(directory), dtype="bfloat16", with_tokenizer=False)
    return target.model, loader.int4_draft(target).model


def test_an_int4_draft_runs_through_the_kernel_as_its_module_layers_do(int4_pair, monkeypatch):
    """An int4 draft (its linears on int4_rows.c either way): the kernel's logits within a quarter of the
    draft's own error against its bf16 target of the module layers' logits, at every step; the kernel
    served every step (no module layer ran)."""
    target, draft = int4_pair
    calls = module_calls(draft, monkeypatch)
    ref, _ = run(target, True, monkeypatch)
    modules, _ = run(draft, False, monkeypatch)
    before = len(calls)
    fused, _ = run(draft, True, monkeypatch)
    assert before > 0 and len(calls) == before
    for s, (r, e, k) in enumerate(zip(ref, modules, fused)):
        assert (k - e).abs().max() <= 0.25 * (e - r).abs().max(), s
    # past LIMIT tokens its linears are the shared bf16 weights' (quant.linear), so its steps the module layers'
    from rollout_ssd.models.decoder import ForwardBatch

    class Cache:
        keys = values = [torch.zeros(64, draft.cfg.num_kv_heads, 8, draft.cfg.head_dim, dtype=torch.bfloat16)
                         ] * len(draft.layers)

    monkeypatch.setattr(cpu_backend, "_LAYER_ROWS", None)
    monkeypatch.setattr(cpu_backend, "cpu_kind", lambda: "amx")
    monkeypatch.setattr(cpu_backend, "_ROWS_KERNEL_ROWS", layer_kernel.LIMIT)
    rows = layer_kernel.LIMIT + 1
    many = ForwardBatch(torch.zeros(rows, 1, dtype=torch.long), torch.zeros(rows, 1, dtype=torch.long), [1] * rows,
                        list(range(rows)), [0] * rows)
    assert cpu_backend.one_call_layers(target, many, Cache, True) and not cpu_backend.one_call_layers(draft, many, Cache, True)


def test_a_weight_written_after_a_step_is_the_next_steps(pair, monkeypatch):
    """The kernel keeps its per-layer arguments between steps (`_layer_args`): a weight written in place
    (an RL update), and alone a weight given other storage (`.data =`: its address moves, not its version),
    must be read by the next step, as the module layers read it."""
    bf16, _ = pair
    layer = bf16.layers[1]
    saved = (layer.w_down.detach().clone(), layer.input_norm.detach().clone(), layer.post_attn_norm.data)

    def in_place():
        with torch.no_grad():
            layer.w_down.mul_(-1.5)
            layer.input_norm.add_(0.25)

    def other_storage():
        layer.post_attn_norm.data = layer.post_attn_norm.data * 1.5

    try:
        for write in (in_place, other_storage):
            before, _ = run(bf16, True, monkeypatch)
            write()
            after, _ = run(bf16, True, monkeypatch)
            modules, _ = run(bf16, False, monkeypatch)
            for b_, a, m in zip(before, after, modules):  # stale weights would leave `after` near `before`
                moved = (b_ - m).abs().max()
                assert moved > 0 and (a - m).abs().max() <= 0.05 * moved, write.__name__
    finally:
        with torch.no_grad():
            layer.w_down.copy_(saved[0])
            layer.input_norm.copy_(saved[1])
        layer.post_attn_norm.data = saved[2]


def test_silu_past_the_float32_range_of_its_exponential(tmp_path, monkeypatch):
    """SwiGLU's gates far past +-88 (where e^-x overflows float32: the kernel's own vectorised exponential
    clamps there) give the module layers' logits: finite, and within the accuracy test's quarter of the
    module layers' bf16 error of them. The gates of the first layer are scaled until some pass +-300."""
    build_tiny(tmp_path, family="llama-gqa-untied", seed=3, num_hidden_layers=2, max_position_embeddings=256)
    bf16 = load_pretrained(str(tmp_path), dtype="bfloat16", with_tokenizer=False).model
    gate = bf16.hf_parameters()["model.layers.0.mlp.gate_proj.weight"]
    gate.copy_(gate.float() * 2000)
    f32 = build_decoder(load_pretrained(str(tmp_path), dtype="bfloat16", with_tokenizer=False).hf_config,
                        {k: v.float() for k, v in bf16.hf_parameters().items()}, torch.float32)
    gates, silu = [], torch.nn.functional.silu
    monkeypatch.setattr(torch.nn.functional, "silu", lambda x: gates.append(x.float().aminmax()) or silu(x))
    eager, _ = run(bf16, False, monkeypatch, rows=(0,), steps=[(s[0],) for s in STEPS])
    monkeypatch.setattr(torch.nn.functional, "silu", silu)
    assert min(g.min for g in gates) < -300 and max(g.max for g in gates) > 300, "past the exponential's range"
    calls = module_calls(bf16, monkeypatch)
    fused, _ = run(bf16, True, monkeypatch, rows=(0,), steps=[(s[0],) for s in STEPS])
    assert not calls, "the kernel ran every step"
    ref, _ = run(f32, False, monkeypatch, rows=(0,), steps=[(s[0],) for s in STEPS])
    for s, (r, e, k) in enumerate(zip(ref, eager, fused)):
        assert torch.isfinite(k).all(), s
        assert (k - e).abs().max() <= 0.25 * (e - r).abs().max(), (s, float((k - e).abs().max()))


def test_a_step_of_more_rows_than_32(pair, monkeypatch):
    """A decode step of 40 rows of ragged lengths (the amx kind takes steps of up to 256 tokens, past the
    rows kernel's groups of 32): the kernel served it, its logits are within a quarter of the module layers'
    bf16 error against float32 of the module layers', and a row's logits are the same alone, bit for bit."""
    bf16, f32 = pair
    monkeypatch.setattr(cpu_backend, "_LAYER_ROWS", 64)
    rows = 40

    def step(model, kernel, which):
        monkeypatch.setattr(layer_kernel, "_ON", kernel)
        runner = ModelRunner(model, num_slots=rows, max_len=32)
        slots = [runner.allocate() for _ in range(rows)]
        with torch.inference_mode():
            for i in which:
                runner.prefill([slots[i]], [[3 + (5 * i + 7 * j) % 90 for j in range(3 + i % 6)]])
            return runner.extend([slots[i] for i in which], [[10 + i % 50] for i in which])[:, 0]

    ref, eager = step(f32, False, range(rows)), step(bf16, False, range(rows))
    calls = module_calls(bf16, monkeypatch)
    fused = step(bf16, True, range(rows))
    assert not calls, "the kernel ran the 40-row step (and the prefills)"
    err = (eager - ref).abs().max()
    assert err > 0 and (fused - eager).abs().max() <= 0.25 * err, (float((fused - eager).abs().max()), float(err))
    assert torch.equal(step(bf16, True, [0])[0], fused[0]) and torch.equal(step(bf16, True, [39])[0], fused[39])
