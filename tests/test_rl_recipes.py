"""RL in practice (issue 6): the GRPO and PPO recipes end to end on the `--tiny` preset.

- GRPO and PPO run 3 steps through local Ray (2 rollout actors + the learner actor, SSD with its draft
  worker, weight sync over gloo) and log docs/DESIGN.md's metric names to metrics.jsonl.
- GRPO raises the mean reward on a trivially learnable task (fixed seeds, stated margin).
- Greedy rollouts: one learner step on SSD rollouts and one on AR rollouts give bitwise-identical weights.
- pi_old comes from the rollout logprobs when configured (the clipped ratio sees them).
- Bad configs fail before any work.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from rollout_ssd.draft.follow import FollowConfig
from rollout_ssd.rl.config import load_config
from rollout_ssd.rl.learner import LearnerConfig
from rollout_ssd.rl.recipe import main as recipe_main
from rollout_ssd.rl.tiny import TinyConfig
from rollout_ssd.rl.trainer import RLTrainer
from tests.support.ran import assert_ran

DESIGN_NAMES = ("rollout/tokens_per_s", "rollout/tokens_per_round", "spec/accept_rate", "spec/accept_length",
                "spec/accepted_per_proposed", "ssd/hit_rate", "ssd/strategy", "ssd/T_p", "ssd/predicted_speedup",
                "sync/version", "sync/bytes", "sync/seconds", "drift/kl_target_draft",
                "mismatch/token_mult_prob_error")


def tiny(tmp_path, *overrides, **defaults):
    return load_config(None, [f"tracking.out_dir={tmp_path}", "tracking.wandb_mode=disabled", *overrides],
                       tiny=True, **defaults)


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield ray
    ray.shutdown()




def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("algorithm, extra", [
    ("grpo", []),
    # PPO's learner runs DeepSpeed ZeRO-2 inside the Ray learner actor, whose torch.distributed world
    # also holds the rollout actors (DeepSpeed's data-parallel group is the learner alone)
    ("ppo", ["--set", "learner.optim.deepspeed={zero_optimization: {stage: 2}}"]),
])
@pytest.mark.slow
def test_recipe_tiny_three_steps_over_ray(algorithm, extra, tmp_path, local_ray):
    # the SSD path forced (no rule: on two cores it would rightly run AR or SD), fixed lengths (no EOS)
    recipe_main(algorithm, ["--tiny", "--no-progress", "--set", f"tracking.out_dir={tmp_path}",
                            "--set", "ray.rollout_actors=2", "--set", "follow.mode=follow",
                            "--set", "spec.strategy_rule=false", "--set", "sampling.ignore_eos=true",
                            "--set", "task=digits", *extra])
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for name in DESIGN_NAMES:
        assert all(name in r for r in rows), f"{name} missing from the logged metrics"
    # the learner's new weights reached the engines each step, and the draft followed
    assert [r["sync/version"] for r in rows] == [1, 2, 3]
    assert [r["rollout/weight_version"] for r in rows] == [0, 1, 2]
    assert all(r["sync/draft_version"] == r["step"] for r in rows)
    assert all(r["rollout/tokens"] == 2 * 4 * 12 for r in rows)  # prompts_per_step x n x max_new_tokens
    for r in rows:  # each step's rollouts ran SSD rounds in both actors' engines, through their workers
        assert_ran(r, "ssd")
        assert r["ssd/worker_failures"] == 0
    versions = _rows(tmp_path / "versions.jsonl")
    assert [v["version"] for v in versions] == [0, 1, 2] and all(v["draft_mode"] == "follow" for v in versions)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["algorithm"] == algorithm and config["ray"]["rollout_actors"] == 2
    # task "digits" rewards vary within a prompt's group (the default task's are all 0 for a random tiny
    # model): every step has a non-zero advantage, so a real gradient
    assert all(r["reward/std"] > 0 for r in rows)
    assert all(math.isfinite(r["learner/grad_norm"]) and r["learner/grad_norm"] > 0 for r in rows)
    if algorithm == "ppo":
        assert config["learner"]["optim"]["deepspeed"]["zero_optimization"]["stage"] == 2
        assert all("learner/value_loss" in r for r in rows)
    assert list(tmp_path.glob("wandb/offline-run-*")), "wandb (offline) wrote no run"


def test_tiny_pair_built_once_under_concurrent_callers(tmp_path, monkeypatch):
    """Rollout actors build the tiny pair concurrently (a CI run once read a config.json another actor
    was rewriting). The build runs under a file lock: two callers at once write it once, and neither
    returns before the files are complete."""
    import threading
    import time

    from rollout_ssd.rl import tiny as tiny_mod
    from rollout_ssd.rl.tasks import ALPHABET

    real_write, writes, active, overlap = tiny_mod._write_tiny_pair, [], [0], [0]

    def slow_write(*args):
        active[0] += 1
        overlap[0] = max(overlap[0], active[0])
        time.sleep(0.3)  # widen the window the race needs
        real_write(*args)
        writes.append(1)
        active[0] -= 1

    monkeypatch.setattr(tiny_mod, "_write_tiny_pair", slow_write)
    results, errors = [], []

    def call():
        try:
            target, _ = tiny_mod.build_tiny_pair(tmp_path / "tiny_models", ALPHABET, TinyConfig(seed=3))
            results.append(json.loads((target / "config.json").read_text())["vocab_size"])
        except Exception as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 3
    assert overlap[0] == 1 and len(writes) == 1
    # a different recipe rebuilds; the same one is reused
    tiny_mod.build_tiny_pair(tmp_path / "tiny_models", ALPHABET, TinyConfig(seed=4))
    tiny_mod.build_tiny_pair(tmp_path / "tiny_models", ALPHABET, TinyConfig(seed=4))
    assert len(writes) == 2


def test_grpo_raises_reward_on_a_learnable_task(tmp_path):
    """Task "digits" (reward = share of digits in the completion; ~10/75 for a random tiny model).
    Deterministic (fixed seeds, in process): the mean reward of the last 3 of 12 steps must beat the
    first 3 by at least 0.15 (measured: 0.137 -> 0.344, +0.21)."""
    cfg = tiny(tmp_path, "task=digits", "steps=12", "prompts_per_step=4", "ray.enabled=false", "spec.method=ar",
               "learner.optim.lr=0.003", "sampling.max_new_tokens=8")
    with RLTrainer(cfg) as trainer:
        rewards = [m["reward/mean"] for m in trainer.run()]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last - first >= 0.15, f"reward did not rise enough: {rewards}"


def test_greedy_ssd_and_ar_rollouts_give_bitwise_identical_updates(tmp_path):
    digests, tokens = {}, {}
    for method in ("ar", "ssd"):
        cfg = tiny(tmp_path / method, "steps=1", "ray.enabled=false", f"spec.method={method}",
                   "sampling.temperature=0", "sampling.n=2", "task=digits", "spec.strategy_rule=false")
        with RLTrainer(cfg) as trainer:
            prompts, _, indices = trainer.batch(0)
            tokens[method] = [r["token_ids"] for r in trainer.sample(prompts, indices)]
            metrics = trainer.step(0)
            digests[method] = trainer.learner_digest()
        assert metrics["learner/old_logprobs_from_rollout"] == 0.0  # greedy: pi_old recomputed
        if method == "ssd":  # the SSD path really ran (the rule off: on two cores it would run AR or SD)
            assert_ran(metrics, "ssd", hits=True)
    assert tokens["ar"] == tokens["ssd"]
    assert digests["ar"] == digests["ssd"]


def test_pi_old_from_rollout_logprobs(tmp_path):
    """With old_logprobs="rollout" the ratio uses the engine's logprobs: shifting them by log 2 makes
    every ratio 2, so the row with positive advantage is clipped (clip_frac 1/2: the negative-advantage
    row keeps the unclipped, smaller term); with "learner" every ratio is 1 and nothing is clipped."""
    import math

    from rollout_ssd.rl.actors import LearnerWorker
    from rollout_ssd.rl.learner import RolloutBatch

    fracs = {}
    for source in ("rollout", "learner"):
        cfg = tiny(tmp_path, "spec.method=ar", f"learner.old_logprobs={source}", "learner.optim.lr=1e-9")
        worker = LearnerWorker(cfg)
        batch = RolloutBatch([[5, 6, 7]] * 2, [[8, 9], [10, 11]], [[0.0, 0.0]] * 2, [1.0, 0.0], 2, 1.0)
        exact = worker.learner.logprobs(batch)
        batch.logprobs = [[float(x) - math.log(2) for x in row] for row in exact.tolist()]
        metrics = worker.learner.step(batch)
        fracs[source] = (metrics["learner/clip_frac"], round(metrics["learner/ratio_mean"], 5))
    assert fracs == {"rollout": (0.5, 2.0), "learner": (0.0, 1.0)}


@pytest.mark.parametrize("override, needle", [
    ("learner.bogus=1", "learner.bogus"),
    ("sampling.temprature=1", "sampling.temprature"),
    ("spec.method=fast", "SpecConfig.method"),
    ("wandb=1", "wandb"),
    ("steps=0", "steps"),
    ("tracking.wandb_mode=cloud", "wandb_mode"),
    ("learner.optim.deepspeed={zero_optimization: {stage: 3}}", "stage"),
    ("task=chess", "chess"),
    ("task_options={max_operands: 5}", "max_operands"),
    ("device=tpu", "device"),
    ("device=cuda", "ray.rollout_gpus"),
    ("ray.rollout_gpus=-1", "ray.rollout_gpus"),
])
def test_bad_config_is_refused_before_any_work(override, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        recipe_main("grpo", ["--tiny", "--set", f"tracking.out_dir={tmp_path}", "--set", override])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tiny_models").exists()


def test_the_int4_draft_is_the_policys_own_and_refuses_follow_mode(tmp_path, capsys):
    """draft="target-int4": the engine makes it of the policy, the learner keeps no draft of its own
    (nothing to distil or send), and a follow mode is refused by name before any work."""
    from rollout_ssd.rl.actors import has_draft, resolve_models
    from rollout_ssd.rl.config import RLConfig

    cfg = RLConfig(draft="target-int4")
    assert resolve_models(cfg) == (cfg.model, "target-int4") and has_draft(cfg)
    with pytest.raises(SystemExit) as exc:
        recipe_main("grpo", ["--set", f"tracking.out_dir={tmp_path}", "--set", "draft=target-int4",
                             "--set", "follow.mode=follow"])
    assert exc.value.code == 2 and "follow.mode must be 'frozen' with draft='target-int4'" in capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1, 2\n")
    with pytest.raises(ValueError, match="unreadable"):
        load_config(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    wrong = tmp_path / "ppo.yaml"
    wrong.write_text("algorithm: ppo\n")
    with pytest.raises(SystemExit):
        recipe_main("grpo", ["--config", str(wrong)])


def test_shipped_configs_validate():
    for name in ("grpo", "ppo"):
        cfg = load_config(f"recipes/configs/{name}.yaml")
        assert cfg.algorithm == name and cfg.spec.method == "ssd" and cfg.tracking.wandb_mode == "offline"


def _join_and_report(rank, store, queue):
    import torch.distributed as dist

    from rollout_ssd.rl.actors import _join

    _join(f"file://{store}", rank, 2, 30)
    dist.barrier()
    queue.put((rank, os.getpid(), _listeners(os.getpid())))
    dist.barrier()  # stay alive until both reported
    dist.destroy_process_group()


def _listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets process `pid` has in LISTEN state (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:
                    addr, port = cols[1].split(":")
                    out.add((addr, int(port, 16)))
    return out


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc/net/tcp writes them


@pytest.mark.slow
def test_weight_sync_group_listens_on_loopback_only(tmp_path):
    """The learner/rollout weight-sync group (gloo over a file rendezvous) opens no TCP listener
    beyond loopback (Ray's own servers are Ray's: token auth guards them)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_join_and_report, args=(r, tmp_path / "store", queue)) for r in range(2)]
    for p in procs:
        p.start()
    reports = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert any(listeners for _, _, listeners in reports), "no gloo listener seen: the check would be vacuous"
    for rank, _pid, listeners in reports:
        exposed = {(a, port) for a, port in listeners if a not in LOOPBACK}
        assert not exposed, f"rank {rank} listens beyond loopback: {exposed}"


@pytest.mark.parametrize("cls, field, value", [
    (TinyConfig, "num_layers", True), (TinyConfig, "hidden_size", 0),
    (LearnerConfig, "epochs", 1.5), (FollowConfig, "steps", False),
])
def test_integer_fields_refuse_bools_floats_and_zero(cls, field, value):
    with pytest.raises(ValueError, match=f"{cls.__name__}.{field} must be an integer >= 1"):
        cls(**{field: value})


def test_rollout_actor_places_its_engine_and_the_learner_picks_the_device_checksum(tmp_path, monkeypatch):
    """RLConfig.device / draft_device reach from_pretrained (draft_device only under SSD), and a learner
    feeding an engine on a GPU sends sum64 checksums (checked on the GPU, no copy to the host)."""
    # ran-check: from_pretrained is a stand-in here; no engine is built or sampled
    import types

    from rollout_ssd.rl import actors

    seen = {}

    def fake_from_pretrained(target, **kwargs):
        seen.update(kwargs)
        return object()

    monkeypatch.setattr(actors, "resolve_models", lambda cfg: ("target", "draft"))
    monkeypatch.setattr(actors.RolloutEngine, "from_pretrained", staticmethod(fake_from_pretrained))
    ssd = tiny(tmp_path, "ray.enabled=false", "device=cuda:0", "draft_device=cuda:1", "engine.cuda_graphs=true",
               "engine.attention=triton", "engine.gpu_memory_utilization=0.8")
    actors.RolloutWorker(ssd)
    assert seen["device"] == "cuda:0" and seen["draft_device"] == "cuda:1"
    # every EngineConfig field reaches the engine (the GPU ones too)
    assert (seen["cuda_graphs"], seen["attention"], seen["gpu_memory_utilization"]) == (True, "triton", 0.8)
    assert seen["max_batch_size"] == ssd.engine.max_batch_size
    actors.RolloutWorker(tiny(tmp_path, "ray.enabled=false", "spec.method=sd", "device=cuda:0", "draft_device=cuda:1"))
    assert seen["draft_device"] is None  # SD's draft runs on `device`
    assert actors.LearnerWorker.sender_config(types.SimpleNamespace(cfg=ssd)).checksum == "sum64"
    on_cpu = tiny(tmp_path, "ray.enabled=false")
    assert actors.LearnerWorker.sender_config(types.SimpleNamespace(cfg=on_cpu)).checksum == "auto"
