"""A run's checkpoints, its analysis and the replay benches built on them (issue 49).

- `checkpoint_steps` saves the policy and the following draft bitwise as the learner holds them, with
  meta.json; an engine loads a checkpoint and runs SD on it.
- rl/analysis.py: the reward gain with its bootstrap interval, the threshold step, time to reward and the
  rollout-share projection, on numbers worked out by hand.
- Ray actors' thread counts (a count of 1 left a core idle in every phase of a step).
- bench/bench_rl_steps.py and bench/rl_drift.py --quick: each engine ran the plan it is named after, and
  the head/tail split covers every token.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig
from rollout_ssd.rl import analysis
from rollout_ssd.rl.checkpoints import DRAFT, POLICY, list_checkpoints, save_checkpoint
from rollout_ssd.rl.config import RayConfig, load_config
from rollout_ssd.rl.trainer import RLTrainer, StepWorkload
from tests.support.ran import assert_ran

BENCH = Path(__file__).resolve().parents[1] / "bench"


def tiny(tmp_path, *overrides):
    return load_config(None, [f"tracking.out_dir={tmp_path}", "tracking.wandb_mode=disabled", "ray.enabled=false",
                              *overrides], tiny=True, algorithm="grpo")


def test_checkpoints_hold_the_learners_weights_and_load_into_an_engine(tmp_path):
    cfg = tiny(tmp_path, "steps=2", "checkpoint_steps=[0, 2]", "follow.mode=follow", "follow.every_n_steps=1",
               "task=digits")  # graded rewards: the arithmetic ones of a random tiny model are all 0
    with RLTrainer(cfg) as trainer:
        trainer.run()
        learner = trainer.learner
        policy = {k: v.detach() for k, v in learner.learner.model.hf_parameters().items()}
        draft = {k: v.detach() for k, v in learner.follower.draft.hf_parameters().items()}
    found = list_checkpoints(tmp_path)
    assert sorted(found) == [0, 2]
    meta = json.loads((found[2] / "meta.json").read_text())
    assert meta == {"step": 2, "policy_version": 2, "draft_version": 2, "follow_mode": "follow", "has_draft": True}
    assert json.loads((found[0] / "meta.json").read_text())["policy_version"] == 0
    saved = load_file(str(found[2] / POLICY / "model.safetensors"))
    for name, tensor in saved.items():
        assert torch.equal(tensor, policy[name]), name
    assert set(saved) == set(policy)
    saved_draft = load_file(str(found[2] / DRAFT / "model.safetensors"))
    assert set(saved_draft) == set(draft)  # the tiny draft has an embedding of its own
    for name, tensor in saved_draft.items():
        assert torch.equal(tensor, draft[name]), name
    step0 = load_file(str(found[0] / POLICY / "model.safetensors"))
    assert any(not torch.equal(step0[k], saved[k]) for k in saved), "two updates changed nothing"
    prompts = StepWorkload(cfg).batch(0)[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    with RolloutEngine.from_pretrained(str(found[2] / POLICY), draft=str(found[2] / DRAFT),
                                       spec=SpecConfig(method="sd", k=3), dtype=cfg.dtype) as sd, \
            RolloutEngine.from_pretrained(str(found[2] / POLICY), spec=SpecConfig(method="ar"), dtype=cfg.dtype) as ar:
        assert [r.token_ids for r in sd.sample(prompts, greedy)] == [r.token_ids for r in ar.sample(prompts, greedy)]
        assert_ran(sd, "sd", accepted=True)


def test_the_default_pair_saves_and_reloads_bitwise(tmp_path):
    """SmolLM2 (tied head) and its built-in draft (the target's embedding, a restricted head): every
    tensor back as it was, the draft's embedding taken from the reloaded policy."""
    from rollout_ssd.models.loader import load_draft, load_pretrained

    target = load_pretrained("smollm2-135m-instruct", dtype="float32")
    draft = load_draft("default", target, "smollm2-135m-instruct", dtype="float32")
    assert target.model.cfg.tie_word_embeddings and draft.model.cfg.shares_target_embedding
    where = save_checkpoint(tmp_path, 7, target.model, target.hf_config, target.tokenizer, policy_version=7,
                            draft=draft.model, draft_config=draft.hf_config, draft_version=3)
    assert "model.embed_tokens.weight" not in load_file(str(where / DRAFT / "model.safetensors"))
    policy = load_pretrained(str(where / POLICY), dtype="float32")
    reloaded = load_pretrained(str(where / DRAFT), dtype="float32", with_tokenizer=False,
                               share_embedding_from=policy.model)
    for before, after in ((target.model, policy.model), (draft.model, reloaded.model)):
        old, new = before.hf_parameters(), after.hf_parameters()
        assert set(old) == set(new)
        for name in old:
            assert torch.equal(old[name], new[name]), name
    assert policy.tokenizer is not None and policy.tokenizer("2 + 2").input_ids == target.tokenizer("2 + 2").input_ids
    assert list_checkpoints(tmp_path) == {7: where}


def test_checkpoint_steps_are_checked():
    with pytest.raises(ValueError, match="checkpoint_steps"):
        load_config(None, ["steps=3", "checkpoint_steps=[0, 4]"], tiny=True)
    with pytest.raises(ValueError, match="checkpoint_steps"):
        load_config(None, ["checkpoint_steps=[true]"], tiny=True)
    assert load_config(None, ["steps=3", "checkpoint_steps=[0, 3]"], tiny=True).checkpoint_steps == (0, 3)


def test_ray_actor_threads():
    assert RayConfig().actor_threads(2) == (2, 2)  # the phases of a step run one after another
    assert RayConfig(rollout_actors=2).actor_threads(8) == (4, 8)
    assert RayConfig(rollout_actors=4).actor_threads(2) == (1, 2)
    assert RayConfig(threads=1).actor_threads(16) == (1, 1)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="ray.threads"):
            RayConfig(threads=bad)


def test_reward_gain_and_its_interval():
    flat = analysis.reward_gain([0.5] * 20, k=10)
    assert (flat.gain, flat.low, flat.high) == (0.0, 0.0, 0.0)
    rising = analysis.reward_gain([0.1] * 10 + [0.4] * 10, k=10)
    assert rising.first == pytest.approx(0.1) and rising.last == pytest.approx(0.4)
    assert rising.low == pytest.approx(0.3) and rising.high == pytest.approx(0.3)  # no spread in either window
    noisy = analysis.reward_gain([0.0, 0.2] * 5 + [0.3, 0.5] * 5, k=10)
    assert noisy.gain == pytest.approx(0.3)
    assert 0.1 < noisy.low < 0.3 < noisy.high < 0.5  # a 2-point window's mean spans 0..0.2 around 0.1
    assert analysis.reward_gain([0.0, 0.2] * 10, k=10, seed=1) == analysis.reward_gain([0.0, 0.2] * 10, k=10, seed=1)
    with pytest.raises(ValueError, match="2k"):
        analysis.reward_gain([0.1] * 19, k=10)


def test_threshold_time_to_reward_and_projection():
    assert analysis.trailing_means([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    rewards = [0.0] * 10 + [1.0] * 10
    threshold, at = analysis.threshold_step(rewards, k=10)
    assert threshold == 0.5 and at == 15  # the trailing mean of steps 6..15 is 5/10
    assert analysis.threshold_step([0.0] * 20, k=10, threshold=0.1) == (0.1, None)
    assert analysis.threshold_step([1.0] * 10 + [0.0] * 10, k=10) == (0.5, None)  # it unlearned
    assert analysis.threshold_step([0.3] * 20, k=10) == (pytest.approx(0.3), None)  # flat: no learning to time
    tokens, rest = [100, 200, 300], [1.0, 2.0, 3.0]
    rate = analysis.nearest({0: 100.0, 2: 50.0})
    assert [rate(s) for s in (0, 1, 2, 3)] == [100.0, 100.0, 50.0, 50.0]
    by_step = {1: 100.0, 2: 50.0, 3: 25.0}.__getitem__  # step i (1-based) at its own rate
    assert analysis.time_to_reward(2, tokens, rest, by_step) == pytest.approx(1 + 1 + 2 + 4)
    assert analysis.time_to_reward(3, tokens, rest, by_step) == pytest.approx(1 + 1 + 2 + 4 + 3 + 12)
    projected = analysis.projected_rest(tokens, by_step, 0.7)
    assert projected == pytest.approx([1 * 3 / 7, 4 * 3 / 7, 12 * 3 / 7])
    with pytest.raises(ValueError):
        analysis.time_to_reward(4, tokens, rest, lambda i: 1.0)


@pytest.fixture
def bench_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    yield
    for name in ("bench_rl_steps", "rl_drift", "common"):
        sys.modules.pop(name, None)


def test_bench_rl_steps_quick(bench_path, capsys):  # ran-check: asserts each row's own plans below
    import bench_rl_steps

    result = bench_rl_steps.main(["--quick"])
    rows = {(r["step"], r["method"]): r for r in result["rows"]}
    assert sorted(rows) == [(s, m) for s in (0, 2) for m in ("ar", "sd", "ssd")]
    for (_step, method), row in rows.items():
        assert row["tokens"] > 0 and row["seconds"] > 0 and row["rest_s"] > 0
        assert row["head_tokens"] + row["tail_tokens"] == row["tokens"]
        plans = set(row["head_plans"]) | set(row["tail_plans"])
        if method == "ar":
            assert plans == {"ar"}
        elif method == "sd":
            assert plans == {"sd"} and row["accept"] > 0
        else:
            assert plans <= {"ar", "sd", "ssd+neural"}
    assert {s["step"] for s in result["summary"]} == {0, 2}
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bench"] == "bench_rl_steps"


def test_rl_drift_quick(bench_path):  # ran-check: asserts forced SSD ran only SSD rounds, with hits counted
    import rl_drift

    result = rl_drift.main(["--quick"])
    assert [r["step"] for r in result["rows"]] == [0, 2]
    for row in result["rows"]:
        assert 0.0 <= row["heldout_greedy"] <= 1.0
        for kind in ("frozen", "following"):
            assert row[kind]["ssd_only"] and row[kind]["rounds"] > 0 and 0 < row[kind]["accept"] <= 1
