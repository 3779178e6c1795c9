"""The strategy rule's per-machine cache (ssd/rule_cache.py): the estimates' snapshot and restore, the
choices per batch bucket, the file's key, bad or foreign files ignored (and changing nothing), and a
second engine that starts from the first one's measurements: it decides at once instead of exploring,
and generates the same tokens."""

from __future__ import annotations

import json
import logging
import math

import pytest

from rollout_ssd import SamplingParams, SpecConfig
from rollout_ssd.metrics import EngineMetrics
from rollout_ssd.ssd.chooser import Chooser, Plan
from rollout_ssd.ssd.config import SSDConfig
from rollout_ssd.ssd.estimates import EstimatesConfig, LiveEstimates, _BatchTimes
from rollout_ssd.ssd.rule_cache import RuleCache, cache_directory, engine_key
from tests.support.models import tiny_pair
from tests.support.ran import assert_ran
from tests.test_ssd_helpers import ssd_engine

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def pair48(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("rulecache"), vocab=48)


def measured_estimates() -> LiveEstimates:
    est = LiveEstimates(EstimatesConfig(k=3))
    for _ in range(5):
        est.observe_time("decode", 0.020, 4)
        est.observe_time("plain_verify", 0.030, 4)
    est.observe_time("verify", 0.050, 1)
    est.observe_cache(hits=3, misses=1)
    est.observe_round("hit", sequences=3, accepted=5, judged=9, emitted=8)
    return est


def test_snapshot_restores_times_as_measurements_and_rates_as_priors():
    old = measured_estimates()
    new = LiveEstimates(EstimatesConfig(k=3))
    assert new.restore(json.loads(json.dumps(old.snapshot()))) == 3  # three (time, batch size) entries
    for name, batch in (("decode", 4), ("plain_verify", 4), ("verify", 1)):
        assert new.seconds(name, batch) == pytest.approx(old.seconds(name, batch), rel=1e-12)
    # a count stands for at most OWN_AFTER measurements: five decode steps at 4 come back as 3
    assert new.times_measured("decode", 3) == _BatchTimes.OWN_AFTER and new.times_measured("verify", 1) == 1
    assert new.accept_rate("draft") == pytest.approx(old.accept_rate("draft"), rel=1e-12)
    assert new.p_hit == pytest.approx(old.p_hit, rel=1e-12)
    assert new.tokens_per_round("hit") == pytest.approx(old.tokens_per_round("hit"), rel=1e-12)
    # the restored rate is a prior of prior_weight (4) judged tokens, decayed as every sum is: 4
    # all-accepted tokens pull it about halfway to 1
    a, d = new.accept_rate("draft"), 0.5 ** (1 / new.config.halflife_rounds)
    new.observe_round("hit", sequences=1, accepted=4, judged=4, emitted=5)
    assert new.accept_rate("draft") == pytest.approx((d * a * 4 + 4) / (d * 4 + 4), rel=1e-9)
    # the decode estimate is a median: two new steps at 0.040 outvote the one restored value
    new.observe_time("decode", 0.040, 4)
    new.observe_time("decode", 0.040, 4)
    assert new.seconds("decode", 4) == pytest.approx(0.040)


@pytest.mark.parametrize("bad", [
    {"times": {"nonsense": {"4": [0.1, 2]}}},
    {"times": {"decode": {"4": [-0.1, 2]}}},
    {"times": {"decode": {"4": [math.nan, 2]}}},
    {"times": {"decode": {"0": [0.1, 2]}}},
    {"times": {"decode": {"4": [0.1, 0]}}},
    {"times": {"decode": {"4": [0.1, 2]}}, "p_hit": 1.5},
    {"times": {"decode": {"4": [0.1, 2]}}, "accept": {"draft": 2.0, "suffix": 0.1, "random": 0.0}},
    {"times": "decode"},
])
def test_restore_rejects_what_is_not_a_snapshot_and_changes_nothing(bad):
    good = measured_estimates().snapshot()
    est = LiveEstimates(EstimatesConfig(k=3))
    with pytest.raises((ValueError, TypeError, KeyError)):
        est.restore({**good, **bad})
    assert est.snapshot()["times"] == {} and est.accept_rate("draft") == 0.6


def chooser(estimates=None, strategy_rule: bool = True) -> Chooser:
    estimates = estimates or LiveEstimates(EstimatesConfig(k=3))
    return Chooser(SSDConfig(k=3, strategy_rule=strategy_rule), estimates, EngineMetrics(), backup=None)


def test_cache_file_round_trip_key_and_bad_files(tmp_path, caplog):
    key = {"format": 1, "device": "cpu: test", "ssd": {"k": 3}}
    cache = RuleCache(tmp_path / "rule", key)
    assert cache.load(chooser()) == 0  # no file yet: silently nothing
    assert not cache.save(chooser())  # nothing measured: nothing written
    old = chooser(measured_estimates())
    old.restore_choices({3: Plan.SD, 1: Plan.AR})
    assert cache.save(old) and cache.path.is_file()
    assert [p.name for p in cache.path.parent.iterdir()] == [cache.path.name]  # no temporary file left
    new = chooser()
    assert cache.load(new) == 3 and new.kept_choices() == {"3": "sd", "1": "ar"}
    assert new.budget_cap(4) is None and new.budget_cap(2) is not None  # bucket 3 decided, bucket 2 not
    fixed = chooser(strategy_rule=False)  # the rule off: the times only (no choice to make)
    assert cache.load(fixed) == 3 and fixed.kept_choices() == {}
    other = RuleCache(tmp_path / "rule", {**key, "ssd": {"k": 4}})
    assert other.path != cache.path and other.load(chooser()) == 0
    good = json.loads(cache.path.read_text())
    with caplog.at_level(logging.WARNING, logger="rollout_ssd.ssd.rule_cache"):
        other.path.write_text(cache.path.read_text())  # another key's contents under this key's name
        assert other.load(chooser()) == 0
        cache.path.write_text("{not json")
        assert cache.load(chooser()) == 0
        for bad in ({"estimates": {"times": {"decode": {"4": [-1, 1]}}}}, {"choices": {"3": "warp"}},
                    {"choices": {"x": "ar"}}, {"estimates": []}):
            cache.path.write_text(json.dumps({**good, **bad}))
            untouched = chooser()
            assert cache.load(untouched) == 0
            assert untouched.kept_choices() == {} and untouched.estimates.snapshot()["times"] == {}
    assert [r.message.split(" ")[4] for r in caplog.records] == ["is", "not", "has", "has", "has", "has"]
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert not RuleCache(blocked / "rule", key).save(old)  # a file where the folder goes


def test_key_holds_the_cpu_linear_kernels(tmp_path, monkeypatch):
    """Turning the bf16 rows kernel off ($ROLLOUT_SSD_BF16_ROWS=0) changes every linear's cost of a bf16
    CPU model, so it changes the key (and the file): times measured with the kernel are not restored
    without it; so does its op's C++ kernel, which compiled steps call. A float32 model's linears never
    run it: its part of the key is the same either way; the float32 rows kernel is its part. The form a
    16-bit model's few-query attention takes (SDPA or not, the few_attention kernel) is in its part too, and
    the most tokens the one-call layer kernel takes (0 where it does not run)."""
    from rollout_ssd.kernels import bf16_rows, few_attention, layer_kernel
    from rollout_ssd.models import attention, cpu_backend
    from rollout_ssd.models.loader import load_pretrained
    from rollout_ssd.runner import ModelRunner
    from rollout_ssd.ssd import rule_cache

    tiny_pair(tmp_path, vocab=48)
    target = load_pretrained(str(tmp_path / "target"), dtype="bfloat16").model
    draft = load_pretrained(str(tmp_path / "draft"), dtype="float32").model
    runner = ModelRunner(target, num_slots=2, max_len=32)
    keys = []
    for on in (True, False):
        monkeypatch.setattr(bf16_rows, "available", lambda on=on: on)
        keys.append(engine_key(runner, draft, SSDConfig()))
    assert [k["target"]["cpu_kernels"]["bf16_rows"] for k in keys] == [True, False]
    assert keys[0]["target"]["cpu_kernels"]["packed_bf16"] == rule_cache.packed_bf16()
    assert keys[0]["draft"] == keys[1]["draft"] and set(keys[0]["draft"]["cpu_kernels"]) == {"f32_rows"}
    f32 = []
    monkeypatch.setitem(cpu_backend.F32_ROWS_KERNEL_ROWS, cpu_backend.cpu_kind(), 8)
    for on in (True, False):  # the float32 rows kernel: the float32 draft's part changes, the bf16 target's not
        monkeypatch.setattr(cpu_backend.f32_rows, "available", lambda on=on: on)
        f32.append(engine_key(runner, draft, SSDConfig()))
    assert [k["draft"]["cpu_kernels"]["f32_rows"] for k in f32] == [8, 0]
    assert f32[0]["target"] == f32[1]["target"] and RuleCache("d", f32[0]).path != RuleCache("d", f32[1]).path
    assert RuleCache("d", keys[0]).path != RuleCache("d", keys[1]).path
    ops = []
    for cpp in (True, False):  # the op compiled steps call: its C++ kernel, or the Python fallback
        monkeypatch.setattr(bf16_rows, "op_in_cpp", lambda cpp=cpp: cpp)
        ops.append(engine_key(runner, draft, SSDConfig()))
    assert [k["target"]["cpu_kernels"]["bf16_rows_op_cpp"] for k in ops] == [True, False]
    assert RuleCache("d", ops[0]).path != RuleCache("d", ops[1]).path
    for name, module, attr in (("sdpa_few_queries", attention, "SDPA_FEW_QUERIES"),  # the few-query attention form
                               ("few_attention", few_attention, "available")):
        forms = []
        for on in (True, False):
            monkeypatch.setattr(module, attr, on if attr.isupper() else (lambda on=on: on))
            forms.append(engine_key(runner, draft, SSDConfig()))
        assert [k["target"]["cpu_kernels"][name] for k in forms] == [True, False], name
        assert forms[0]["draft"] == forms[1]["draft"] and RuleCache("d", forms[0]).path != RuleCache("d", forms[1]).path
    layers = []
    for on in (True, False):  # the one-call layer kernel: its row limit, 0 where off
        monkeypatch.setattr(layer_kernel, "available", lambda on=on: on)
        layers.append(engine_key(runner, draft, SSDConfig()))
    assert [k["target"]["cpu_kernels"]["layer_kernel"] for k in layers] == [cpu_backend.layer_kernel_rows(), 0]
    assert RuleCache("d", layers[0]).path != RuleCache("d", layers[1]).path


def test_key_holds_whether_compiled_steps_autotune(tmp_path, monkeypatch):
    """Frozen compiled steps that autotune their GEMMs run at another speed than ones that do not
    ($ROLLOUT_SSD_AUTOTUNE=0), so the switch is in a frozen engine's key; an eager engine's key holds
    no such steps, and a live engine's (whose steps never autotune) does not change with it."""
    from rollout_ssd.models.loader import load_pretrained
    from rollout_ssd.runner import ModelRunner

    tiny_pair(tmp_path, vocab=48)
    target = load_pretrained(str(tmp_path / "target"), dtype="float32").model
    draft = load_pretrained(str(tmp_path / "draft"), dtype="float32").model
    eager, compiled, live = (ModelRunner(target, num_slots=2, max_len=32) for _ in range(3))
    compiled.use_static_steps(buckets=(1, 2), compiled="frozen", pad_t=4)  # compiles nothing until a step runs
    live.use_static_steps(buckets=(1, 2), compiled="live", pad_t=4)
    keys = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("ROLLOUT_SSD_AUTOTUNE", switch)
        keys[switch] = [engine_key(runner, draft, SSDConfig()) for runner in (eager, compiled, live)]
    assert keys["1"][0] == keys["0"][0] and keys["1"][0]["static_steps"] is None
    assert keys["1"][2] == keys["0"][2]
    assert keys["1"][1]["static_steps"][-1] is True and keys["0"][1]["static_steps"][-1] is False
    assert RuleCache("d", keys["1"][1]).path != RuleCache("d", keys["0"][1]).path


def test_cache_directory_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_SSD_CACHE", str(tmp_path))
    monkeypatch.setenv("ROLLOUT_SSD_RULE_CACHE", "1")
    assert cache_directory(True) == tmp_path / "rule"
    assert cache_directory(str(tmp_path / "x")) == tmp_path / "x" and cache_directory(False) is None
    monkeypatch.setenv("ROLLOUT_SSD_RULE_CACHE", "0")
    assert cache_directory(True) is None
    with pytest.raises(ValueError, match="SpecConfig.rule_cache"):
        SpecConfig(method="ssd", rule_cache=3)


def test_second_engine_decides_at_once_from_the_first_ones_measurements(pair48, tmp_path, monkeypatch):
    """Engine 1 explores (AR, SD, SSD rounds at 3 sequences; AR scores 1.5 against 1.0, so each other
    plan is left after its first timed round whatever the host's timings) and saves; engine 2, same
    models and settings, restores those times: at 3 sequences it has nothing to explore, so its first
    round is the rule's decision; the tokens are the same (greedy; every plan is lossless). A third
    engine with another k has another key and explores anew."""
    import rollout_ssd.ssd.rule as strategy_module

    monkeypatch.setattr(strategy_module, "strategy_scores",
                        lambda inputs, names: {n: 1.5 if n == "ar" else 1.0 for n in names})
    target, draft = pair48
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)  # more rounds than exploring takes

    def run(k: int):
        """The tokens, (batch, plan, decided) of each round at 3 sequences, and the engine's metrics."""
        engine = ssd_engine(target, draft, 3, k=k, strategy_rule=True, rule_cache=str(tmp_path))
        chooser, plans = engine.strategy.chooser, []
        choose = chooser.choose

        def recording(batch, fallback=None, tail=False, cold=False):
            plans.append((batch, choose(batch, fallback, tail, cold), chooser.decided))
            return plans[-1][1]

        chooser.choose = recording
        tokens = [r.token_ids for r in engine.sample(PROMPTS, params)]
        metrics = engine.metrics()
        engine.close()
        return tokens, [p for p in plans if p[0] == 3], metrics

    runs = [run(k) for k in (3, 3, 2)]
    (tokens1, first, explored), (tokens2, second, _), (_, third, _) = runs
    assert_ran(explored, "sd")  # engine 1 measured SD and SSD rounds: the times engine 2 decides from
    assert_ran(explored, "ssd")
    assert [p.label for _, p, _ in first[:2]] == ["ar", "ar"] and not first[0][2]  # exploring: not decided
    assert second[0][2], "the second engine explored instead of deciding from the cache"
    assert {p.label for _, p, _ in second} == {"ar"}  # the first engine's choice at 3 sequences, kept
    assert not third[0][2] and [p.label for _, p, _ in third[:2]] == ["ar", "ar"]
    assert tokens2 == tokens1
    assert len(list(tmp_path.glob("rule-*.json"))) == 2  # one file per key
