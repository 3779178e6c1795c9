"""Every RL step's time made visible (issue 49): per phase, and the rollout phase per live batch.

- The `--tiny` GRPO recipe (in process) logs the per-phase `time/*` names and the per-live-batch
  `rollout/*_by_batch/*` names to metrics.jsonl; the buckets' seconds sum to the engine's
  `rollout/seconds`, their tokens to `rollout/tokens` exactly, and the phases to `time/step_s`.
- The accounting holds in AR, SD and SSD engines (it sits in the scheduler's round loop).
- Several actors' per-bucket metrics merge so that the sums still hold.
- Drift telemetry runs on the configured subset, and the subset path equals the full one when the subset
  is every rollout.
"""

from __future__ import annotations

import json
import math

import pytest

from rollout_ssd import metric_names as names
from rollout_ssd.metrics import EngineMetrics, batch_bucket_label
from rollout_ssd.rl.config import load_config
from rollout_ssd.rl.recipe import main as recipe_main
from rollout_ssd.rl.trainer import RLTrainer, merge_engine_metrics
from rollout_ssd.ssd.plans import batch_bucket
from tests.support.ran import assert_ran

# Sums of float64 seconds: each of the R < 10^4 additions rounds by at most 2^-53 relative to the running
# total, so two orders of summing the same terms differ by less than R * 2^-53 < 1e-12 of it.
SUM_RTOL = 1e-12


def tiny(tmp_path, *overrides):
    return load_config(None, [f"tracking.out_dir={tmp_path}", "tracking.wandb_mode=disabled", "ray.enabled=false",
                              *overrides], tiny=True, algorithm="grpo")


def family(row: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in row.items() if k.startswith(prefix)}


def check_live_batch_sums(row: dict) -> None:
    seconds = family(row, names.SECONDS_BY_BATCH)
    tokens = family(row, names.TOKENS_BY_BATCH)
    rounds = family(row, names.ROUNDS_BY_BATCH)
    assert seconds and set(seconds) == set(tokens), row
    assert set(seconds) == {key.split("/")[0] for key in rounds}
    assert math.isclose(sum(seconds.values()), row[names.ROLLOUT_SECONDS], rel_tol=SUM_RTOL)
    assert sum(tokens.values()) == row[names.ROLLOUT_TOKENS]
    assert all(v > 0 for v in seconds.values()) and all(v >= 1 for v in rounds.values())


def test_tiny_recipe_logs_each_phase_and_each_live_batch(tmp_path):
    recipe_main("grpo", ["--tiny", "--no-progress", "--set", f"tracking.out_dir={tmp_path}",
                         "--set", "tracking.wandb_mode=disabled", "--set", "ray.enabled=false",
                         "--set", "spec.strategy_rule=false", "--set", "steps=2"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert_ran(row, "ssd")
        for name in (*names.STEP_PHASES, names.TIME_STEP_S, names.TIME_DRIFT_SHARE, names.TIME_KL_INITIAL_S,
                     names.LEARNER_KL_INITIAL, names.LEARNER_AUTOCAST, names.DRIFT_KL_TARGET_DRAFT):
            assert name in row, f"{name} missing from metrics.jsonl"
        check_live_batch_sums(row)
        # the engine's time lies inside the driver's rollout phase
        assert sum(family(row, names.SECONDS_BY_BATCH).values()) <= row[names.TIME_ROLLOUT_S]
        # the trainer's own count of the rollouts' tokens
        assert row["rollout/tokens"] == sum(family(row, names.TOKENS_BY_BATCH).values())
        assert math.isclose(sum(row[p] for p in names.STEP_PHASES), row[names.TIME_STEP_S], rel_tol=SUM_RTOL)
        # 2 prompts x n=4 start together: the step's head runs at the 8-15 bucket
        assert "8-15" in family(row, names.SECONDS_BY_BATCH)
        plans = {key.split("/", 1)[1] for key in family(row, names.ROUNDS_BY_BATCH)}
        assert plans <= {"prefill", "ssd+neural", "ssd+suffix", "ssd+random", "sd", "suffix", "ar"}, plans
        assert row[names.LEARNER_KL_INITIAL] >= 0  # k3 is non-negative term by term


@pytest.mark.parametrize("method", ["ar", "sd", "ssd"])
def test_live_batch_accounting_in_every_engine(method, tmp_path):
    cfg = tiny(tmp_path, f"spec.method={method}", "steps=1", "spec.strategy_rule=false", "drift_every=0")
    with RLTrainer(cfg) as trainer:
        row = trainer.step(0)
    if method != "ar":
        assert_ran(row, "ssd" if method == "ssd" else "spec")
    check_live_batch_sums(row)
    plans = {key.split("/", 1)[1] for key in family(row, names.ROUNDS_BY_BATCH)}
    assert plans - {"prefill"} == ({"ar"} if method == "ar" else {"sd"} if method == "sd" else plans - {"prefill"})
    if method == "ssd":
        assert plans & {"ssd+neural", "ssd+suffix", "ssd+random"}


def test_bucket_labels_match_the_plan_buckets():
    for live in range(1, 200):
        label = batch_bucket_label(live)
        low, high = (int(x) for x in (label.split("-") * 2)[:2])
        assert low <= live <= high and batch_bucket(low) == batch_bucket(high) == batch_bucket(live)
    with pytest.raises(ValueError):
        batch_bucket_label(0)


def test_rounds_without_a_step_and_the_call_remainder():
    m = EngineMetrics()
    m.add_prefill(0.5, 3)  # a round that only prefilled three sequences
    m.end_round(1.0, 3)
    m.add_rounds(2, 2)  # a decode round at two live sequences
    m.end_round(2.0, 2)
    m.end_round(0.25, 0)  # a round in which nothing ran
    m.add_time(4.0, 5)  # the call: 0.75 s between and after the rounds
    out = m.as_dict()
    assert out[names.rollout_seconds_by_batch("2-3")] == 1.0 + 2.0 + 0.75
    assert out[names.rollout_tokens_by_batch("2-3")] == 5
    assert out[names.rollout_rounds_by_batch("2-3", "prefill")] == 1
    assert out[names.rollout_rounds_by_batch("2-3", "ar")] == 1


def test_merging_actors_keeps_the_sums():
    a = {names.ROLLOUT_SECONDS: 3.0, names.ROLLOUT_TOKENS: 30, names.rollout_seconds_by_batch("4-7"): 2.0,
         names.rollout_seconds_by_batch("1"): 1.0, names.rollout_tokens_by_batch("4-7"): 25,
         names.rollout_tokens_by_batch("1"): 5, names.rollout_rounds_by_batch("4-7", "ar"): 5,
         names.rollout_rounds_by_batch("1", "ar"): 5}
    b = {names.ROLLOUT_SECONDS: 5.0, names.ROLLOUT_TOKENS: 40, names.rollout_seconds_by_batch("8-15"): 5.0,
         names.rollout_tokens_by_batch("8-15"): 40, names.rollout_rounds_by_batch("8-15", "ar"): 4}
    merged = merge_engine_metrics([a, b])
    assert merged[names.ROLLOUT_SECONDS] == 4.0 and merged[names.ROLLOUT_TOKENS] == 70
    check_live_batch_sums(merged)
    assert merged[names.rollout_rounds_by_batch("8-15", "ar")] == 4  # a key only the second actor has


def test_drift_runs_on_the_configured_subset(tmp_path):
    cfg = tiny(tmp_path, "spec.method=ar", "drift_max_rollouts=3")  # ran-check: never samples; the learner's drift
    with RLTrainer(cfg) as trainer:
        rollouts = [{"prompt_token_ids": [5, 6, 7], "token_ids": [8 + i, 9, 10 + i % 3]} for i in range(8)]
        rollouts[2]["token_ids"] = []  # an empty rollout is never drawn
        subsets = [trainer.drift_subset(step, rollouts) for step in range(6)]
        assert all(len(s) == 3 and 2 not in s and s == sorted(s) for s in subsets)
        assert subsets == [trainer.drift_subset(step, rollouts) for step in range(6)]  # fixed by (seed, step)
        assert len({tuple(s) for s in subsets}) > 1  # and redrawn from step to step
        everything = trainer.learner.drift(rollouts, 1.0)
        trainer.cfg = tiny(tmp_path, "spec.method=ar", "drift_max_rollouts=0")
        assert trainer.drift_subset(0, rollouts) == [i for i in range(8) if i != 2]
        chosen = [rollouts[i] for i in trainer.drift_subset(0, rollouts)]
        assert trainer.learner.drift(chosen, 1.0) == everything  # the same pairs, the same arithmetic
    for bad in ("drift_max_rollouts=-1", "drift_max_rollouts=true", "drift_every=1.5"):
        with pytest.raises(ValueError):
            tiny(tmp_path, bad)
