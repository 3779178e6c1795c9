"""models/quant.py: the target's own weights in int4 as a draft.

The int4 linear against the float64 product with the dequantized weight (the same codes, scales and
offsets; bounds from the dtype's rounding, not from the CPU); the int4 draft shares every tensor with
the target and follows its updates; SD and SSD (worker process) with it give exactly AR's greedy tokens,
before and after a target update; bad settings are refused by name."""

from __future__ import annotations

import pytest
import torch

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
from rollout_ssd.kernels import int4_rows
from rollout_ssd.models import loader, quant
from rollout_ssd.models.loader import load_pretrained
from rollout_ssd.models.weight_copies import WeightCopies
from rollout_ssd.ssd.draft_server import weights_digest
from tests.support.models import tiny_model
from tests.support.ran import assert_ran
from tests.support.toolchain import needs_cxx

pytestmark = pytest.mark.skipif(not quant.available(), reason="this torch build has no CPU int4 kernels")

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14]]
EPS = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7}


def test_codes_round_each_weight_to_its_groups_nearest_level():
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    for group in quant.INT4_GROUPS:
        codes, sz = quant.int4_codes(w, group)
        assert codes.min() >= 0 and codes.max() <= 15 and sz.shape == (128 // group, 48, 2)
        scale = sz[..., 0].t().repeat_interleave(group, dim=1)  # [N, K]
        err = (quant.dequantize(codes, sz, group) - w).abs()
        assert (err <= scale / 2 * (1 + 1e-5) + 1e-7).all()  # half a level, up to float32 rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int4_linear_is_the_product_with_the_dequantized_weight(dtype, rows, monkeypatch):
    """torch's int4 kernel (where csrc/int4_rows.c does not run, and in compiled steps) against float64
    x @ dequantized(w).T, with x, the scales and the offsets in the dtype the kernel reads them in (bf16,
    whatever the model's dtype): within bf16's rounding of the output, plus float32 accumulation over K
    (bound: (K + 2) eps(float32) sum |x||w| + eps(bf16) |ref|, with a factor 4); the result comes back in
    the model's dtype."""
    from rollout_ssd.kernels import layer_kernel

    monkeypatch.setattr(layer_kernel, "int4_available", lambda: False)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(80, 96, generator=g).to(dtype)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    bias = torch.randn(80, generator=g).to(dtype)
    copies = WeightCopies()
    copies.int4_group = 32
    out = quant.linear(x, w, copies, "w", bias)
    q = copies.get("w:int4", w, None)  # the copy the call made (a hit: nothing is made again)
    codes, sz = quant.int4_codes(w, 32)
    kernel = quant.KERNEL_DTYPE
    deq = quant.dequantize(codes, sz.to(kernel).float(), 32).double()
    product = x.to(kernel).double() @ deq.t()
    ref = product + bias.double()
    bound = 4 * ((96 + 2) * EPS[torch.float32] * (x.to(kernel).double().abs() @ deq.abs().t())
                 + EPS[kernel] * product.abs() + EPS[dtype] * ref.abs()) + 1e-30
    assert out.dtype == dtype and out.shape == (rows, 80) and q.rows == 80
    assert q.scales_zeros.dtype == kernel  # the kernel's fast path: fed float32 it runs many times slower
    assert ((out.double() - ref).abs() <= bound).all()
    strided = x.t().contiguous().t()  # the same x, column-major (as a compiled step may hand it over)
    assert (rows == 1 or not strided.is_contiguous()) and torch.equal(quant.linear(strided, w, copies, "w", bias), out)


def test_rows_codes_round_each_weight_to_its_groups_nearest_level():
    """`pack_int4_rows`: codes in 0..15 whose dequantized weight (on the bf16 step and minimum) is within half
    a step of w, plus the minimum's bf16 rounding; partial tiles (n not a multiple of 64) come back cut."""
    w = torch.randn(100, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    codes, scales = int4_rows.pack(w)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 48, 64) and scales.shape == (2, 3, 2, 64)
    deq = int4_rows.dequantize(codes, scales, 100)
    step = scales[:, :, 0].permute(0, 2, 1).reshape(128, 3)[:100].float().repeat_interleave(32, dim=1)
    lo = scales[:, :, 1].permute(0, 2, 1).reshape(128, 3)[:100].float().repeat_interleave(32, dim=1)
    assert (deq - w.float()).abs().le(step / 2 * (1 + 2.0 ** -7) + lo.abs() * 2.0 ** -8 + 1e-7).all()
    with pytest.raises(ValueError, match="multiple of 32 columns"):
        int4_rows.pack(torch.zeros(4, 40))


def _int4_rows_kernel():
    from rollout_ssd.kernels import layer_kernel

    if not layer_kernel.int4_available():
        pytest.skip("csrc/int4_rows.c does not run here (it needs avx512_bf16)")
    return layer_kernel


@pytest.mark.parametrize("shape", [(960, 576), (100, 64), (576, 1536), (49152 // 64, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 32])
def test_int4_rows_kernel_is_the_product_with_its_dequantized_weight(shape, rows):
    """csrc/int4_rows.c against float64 x @ int4_rows.dequantize(w).T (+ bias): its sum runs over
    x (128 + q) and takes 128 s x off per group, so besides the output's bf16 rounding (eps(bf16) |ref|)
    its float32 error is bounded by (K + 8) eps(float32) times sum |x| (143 s + |lo - 128 s|) per group,
    with a factor 2; the same bound on every CPU."""
    layer_kernel = _int4_rows_kernel()
    n, k = shape
    g = torch.Generator().manual_seed(rows * 7 + n)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    codes, scales = int4_rows.pack(w)
    deq = int4_rows.dequantize(codes, scales, n).double()
    tiles = codes.shape[0]
    step, lo = (scales[:, :, i].permute(0, 2, 1).reshape(tiles * 64, -1)[:n].double().repeat_interleave(32, dim=1)
                for i in (0, 1))
    mags = x.double().abs() @ (143 * step + (lo - 128 * step).abs()).t()
    for b in (None, bias):
        out = layer_kernel.int4_linear(x, codes, scales, n, b)
        ref = x.double() @ deq.t() + (0 if b is None else b.double())
        bound = 2 * ((k + 8) * EPS[torch.float32] * mags + 2.0 ** -8 * ref.abs()) + 1e-30
        assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
        assert ((out.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("seed", range(6))
def test_int4_rows_kernel_row_results_do_not_depend_on_the_batch_or_threads(seed):
    """Within each path (one row: the dot instructions; 2+ rows: the tile unit in the amx build, else the dot
    instructions too) a row's result is the same bits whatever rows are beside it and at 1-3 threads: each
    row against the same row in pairs with another (2+ rows), and single rows at every thread count."""
    layer_kernel = _int4_rows_kernel()
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(130, 1024, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(21, 1024, generator=g).to(torch.bfloat16)
    codes, scales = int4_rows.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = torch.cat([layer_kernel.int4_linear(x[i:i + 1], codes, scales, 130) for i in range(21)])
        paired = torch.cat([layer_kernel.int4_linear(x[[i, (i + 1) % 21]], codes, scales, 130)[:1] for i in range(21)])
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            assert torch.equal(torch.cat([layer_kernel.int4_linear(x[i:i + 1], codes, scales, 130)
                                          for i in range(21)]), single), t
            for m in (2, 3, 4, 7, 17, 21):  # 17, 21: past a tile's 16 rows
                assert torch.equal(layer_kernel.int4_linear(x[:m], codes, scales, 130), paired[:m]), (t, m)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="does not fit"):
        layer_kernel.int4_linear(x[:, :64], codes, scales, 130)


def test_int4_rows_kernel_refuses_what_does_not_fit():
    layer_kernel = _int4_rows_kernel()
    codes, scales = int4_rows.pack(torch.zeros(130, 96, dtype=torch.bfloat16))
    x = torch.zeros(2, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not fit"):
        layer_kernel.int4_linear(x[:, :64], codes, scales, 130)  # other columns than the codes'
    with pytest.raises(ValueError, match="bias has 129 elements"):
        layer_kernel.int4_linear(x, codes, scales, 130, torch.zeros(129))


def test_bad_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="multiple of 32 columns, got 40"):
        quant.int4_codes(torch.zeros(8, 40), 32)
    _, loaded = tiny_model(tmp_path / "m", hidden_size=64, intermediate_size=96, vocab_size=64)
    with pytest.raises(ValueError, match="int4 group must be one of"):
        quant.quantize_int4(loaded.model, 48)
    with pytest.raises(ValueError, match=r"int4 group 64 does not divide .* \[64, 96\]; groups that do: \[32\]"):
        quant.quantize_int4(loaded.model, 64)
    assert loaded.model.copies.int4_group is None  # refused before anything changed


@pytest.fixture()
def pair(tmp_path):
    hf, loaded = tiny_model(tmp_path / "m", init="transformers", logit_scale=8.0, vocab_size=64, hidden_size=64,
                            intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    return hf, loaded, loader.int4_draft(loaded)


def _greedy(engine, n=14):
    params = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    return [r.token_ids for r in engine.sample(PROMPTS, params)]


def _perturbed(loaded, seed):
    g = torch.Generator().manual_seed(seed)
    return [(n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in loaded.model.hf_parameters().items()]


def test_the_draft_is_the_targets_tensors_in_int4(pair):
    _, loaded, draft = pair
    target_params, draft_params = loaded.model.hf_parameters(), draft.model.hf_parameters()
    assert target_params.keys() == draft_params.keys()
    assert all(draft_params[n] is target_params[n] or draft_params[n].data_ptr() == target_params[n].data_ptr()
               for n in target_params)
    hidden = torch.randn(2, 64)
    before = draft.model.head_logits(hidden)
    assert not torch.equal(before, loaded.model.head_logits(hidden))  # int4, not the target's head
    with torch.no_grad():
        loaded.model.lm_head.mul_(1.5)  # a target write: the draft's int4 copy is made again from it
    after = draft.model.head_logits(hidden)
    assert not torch.equal(before, after)
    assert torch.allclose(after, loaded.model.head_logits(hidden), rtol=0.3, atol=0.3 * after.abs().max().item())


@pytest.mark.parametrize("method", ["sd", "ssd"])
def test_sd_and_ssd_with_the_int4_draft_give_ar_greedy_tokens_across_an_update(pair, method):
    """Exact: the same greedy tokens as AR, before and after a target update that the draft follows
    (under SSD the worker process is sent the changed tensors)."""
    _, loaded, draft = pair
    cfg = EngineConfig(max_batch_size=4, max_model_len=64)
    extra = {"strategy_rule": False} if method == "ssd" else {}
    ar = RolloutEngine(loaded, SpecConfig(method="ar"), cfg)
    spec = RolloutEngine(loaded, SpecConfig(method=method, k=3, **extra), cfg, draft=draft)
    # SD verified proposals; SSD ran its rounds with the draft side in a worker process that never failed
    ran = {"plan": "spec"} if method == "sd" else {"plan": "ssd", "worker": True}
    try:
        assert _greedy(spec) == _greedy(ar)
        accepted = assert_ran(spec, **ran)["spec/accept_rate"]
        spec.metrics(reset=True)
        assert accepted > 0.5  # the target's own weights: most drafted tokens are accepted
        spec.update_weights(_perturbed(loaded, 3), version=1)  # the engines share the target: both see it
        assert _greedy(spec) == _greedy(ar)
        assert assert_ran(spec, **ran)["spec/accept_rate"] > 0.5  # the draft took the new weights
        if method == "ssd":  # the worker holds the target's new weights (asked of the worker itself)
            assert spec.draft_sync.digest() == weights_digest(loaded.model.hf_parameters())
    finally:
        spec.close()
        ar.close()


@needs_cxx
@pytest.mark.parametrize("mode", ["frozen", "live"])
def test_compiled_sd_with_the_int4_draft_gives_the_eager_engines_tokens_across_an_update(pair, mode):
    """EngineConfig(compile=...): the draft's steps are compiled with its int4 copies (listed for the
    trace by quant.pack_live); greedy tokens equal the eager engine's, before and after a target update
    (a frozen step is dropped after the write, a live one reads the copies made again)."""
    _, loaded, draft = pair
    original = [(n, t.clone()) for n, t in loaded.model.hf_parameters().items()]
    update = _perturbed(loaded, 5)
    out = {}
    for compiled in (False, mode):
        engine = RolloutEngine(loaded, SpecConfig(method="sd", k=2), EngineConfig(
            max_batch_size=4, max_model_len=64, compile=compiled), draft=draft)
        try:
            first = _greedy(engine, n=10)
            engine.update_weights(update, version=1)
            out[compiled] = (first, _greedy(engine, n=10))
            assert_ran(engine, "spec", accepted=True)
            static = engine.strategy.speculator.runner.static
            assert any(step.compiled is not None for step in (static.steps.values() if static else [])) == bool(compiled)
            assert not (static and static.retired)  # no compile failed over to eager
            engine.update_weights(original, version=2)  # the shared target back as it was, for the next engine
        finally:
            engine.close()
    assert out[mode] == out[False]
    assert out[mode][0] != out[mode][1]  # the update changed the tokens: the second call is a check of its own


@pytest.mark.slow
def test_from_pretrained_makes_the_int4_draft_of_the_default_target():
    """`RolloutEngine.from_pretrained(draft="target-int4")` on SmolLM2 (float32, so that SD's verify and
    AR's decode round alike): the draft is the target's tensors in int4, and SD's greedy tokens are AR's."""
    engine = RolloutEngine.from_pretrained("smollm2-135m-instruct", draft="target-int4", dtype="float32",
                                           spec=SpecConfig(method="sd", k=2), max_batch_size=2, max_model_len=128)
    ar = RolloutEngine(engine.target, SpecConfig(method="ar"), EngineConfig(max_batch_size=2, max_model_len=128))
    try:
        model = engine.strategy.speculator.model
        assert model.int4_group == quant.DEFAULT_GROUP and model.embed is engine.target.model.embed
        prompts = [engine.target.tokenizer("The capital of France is").input_ids, [1, 2, 3, 4]]
        params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
        assert [r.token_ids for r in engine.sample(prompts, params)] == [r.token_ids for r in ar.sample(prompts, params)]
        assert assert_ran(engine, "spec")["spec/accept_rate"] > 0.5
    finally:
        engine.close()
        ar.close()


def test_sd_drops_the_int4_drafts_kv_when_the_target_changes_mid_call(pair):
    """An update applied between two rounds of a call: SD's draft, being the target's tensors, drops the
    draft KV the old weights built once (a draft of its own tensors keeps it); every rollout reports
    both versions."""
    _, loaded, draft = pair
    cfg = EngineConfig(max_batch_size=4, max_model_len=64)
    engine = RolloutEngine(loaded, SpecConfig(method="sd", k=2), cfg, draft=draft)
    update, dropped, rounds = _perturbed(loaded, 9), [], {"n": 0}
    real_step, real_drop = engine.strategy.step, engine.strategy.speculator.weights_changed

    def step(running):
        emitted = real_step(running)
        rounds["n"] += 1
        if rounds["n"] == 3:
            engine.update_weights(update, version=1)
        return emitted

    engine.strategy.step = step
    engine.strategy.speculator.weights_changed = lambda: (dropped.append(True), real_drop())
    try:
        assert engine.strategy._shares_target
        rollouts = engine.sample(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
        assert dropped == [True] and all(r.extra["weight_versions"] == [0, 1] for r in rollouts)
        assert_ran(engine, "spec", accepted=True)
        own = RolloutEngine(loaded, SpecConfig(method="sd", k=2), cfg, draft=load_pretrained(loaded.source, dtype="float32"))
        assert not own.strategy._shares_target  # its own tensors: the target's updates leave its KV be
        own.close()
    finally:
        engine.close()
