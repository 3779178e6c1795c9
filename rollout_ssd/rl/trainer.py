"""The RL loop the recipes run: each step is

    rollouts (SSD, split across rollout actors) -> rewards -> learner update -> weight sync
    -> draft follow (+ its sync) -> drift telemetry -> metrics (wandb + JSONL)

with the time of each phase measured by the driver (`time/*_s`, metric_names.STEP_PHASES, summing to
`time/step_s`) and the rollout phase's engine time split by live batch (`rollout/seconds_by_batch/*`).
Drift telemetry runs every `drift_every` steps on `drift_subset`'s rollouts. Prompts come from the
task's `datasets` Dataset, shuffled once by the seed and cycled; the prompt at position i of step s gets
the global index s * prompts_per_step + i, which seeds its samples (so a run reproduces whatever the
actor split).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import socket
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

from rollout_ssd import metric_names as names
from rollout_ssd.rl.actors import LearnerWorker, RolloutWorker, has_draft, in_process_pair
from rollout_ssd.rl.config import RLConfig
from rollout_ssd.rl.tasks import get_task

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def merge_engine_metrics(per_actor: list[dict]) -> dict:
    """One dict from several engines' metrics: numbers averaged (counts summed), the rest from the first
    actor that has the key. The live-batch families (metric_names.py) are sums over the actors' engines
    with an absent bucket counting 0: tokens and rounds summed, seconds summed and divided by the number of
    actors, so they still sum to the (averaged) `rollout/seconds` and the (summed) `rollout/tokens`."""
    if len(per_actor) == 1:
        return dict(per_actor[0])
    keys = list(dict.fromkeys(k for m in per_actor for k in m))
    out: dict = {}
    for key in keys:
        values = [m[key] for m in per_actor if key in m]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            if key.startswith(names.SECONDS_BY_BATCH):
                out[key] = sum(values) / len(per_actor)
                continue
            summed = key.endswith(("tokens", "rounds", "hits", "misses", "_count", "/bytes")) or \
                key.startswith((names.TOKENS_BY_BATCH, names.ROUNDS_BY_BATCH))
            out[key] = sum(values) if summed else sum(values) / len(values)
        else:
            out[key] = values[0]
    return out


def task_dataset(cfg: RLConfig, num: int, seed: int):
    """`num` rows of the run's task (with its task_options) drawn with `seed`; checked for the prompt and
    answer columns."""
    dataset_fn, _ = get_task(cfg.task)
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.task_options.items()}
    data = dataset_fn(num, seed=seed, **options)
    for column in ("prompt", "answer"):
        if column not in data.column_names:
            raise ValueError(f"task {cfg.task!r}: its dataset has no {column!r} column")
    return data


class StepWorkload:
    """The run's prompts in the order its steps take them: the task's dataset shuffled once by the seed,
    then cycled. `batch(step)` is what step `step` (0-based) samples, also past the run's last step,
    which is how a replay (bench/bench_rl_steps.py) rebuilds a run's workload without its workers."""

    def __init__(self, cfg: RLConfig):
        self.cfg = cfg
        _, self.reward_fn = get_task(cfg.task)
        data = task_dataset(cfg, cfg.dataset_size, cfg.seed)
        order = list(range(len(data)))
        random.Random(cfg.seed).shuffle(order)
        self.prompts = [data[i]["prompt"] for i in order]
        self.answers = [data[i]["answer"] for i in order]

    def batch(self, step: int) -> tuple[list[str], list[str], list[int]]:
        """(prompts, answers, global prompt indices: the sampling seeds) of step `step`."""
        k = self.cfg.prompts_per_step
        idx = [(step * k + i) % len(self.prompts) for i in range(k)]
        return [self.prompts[i] for i in idx], [self.answers[i] for i in idx], [step * k + i for i in range(k)]


class RLTrainer:
    """Owns the workers (Ray actors or in-process objects), the dataset and the logger."""

    def __init__(self, cfg: RLConfig, logger=None):
        self.cfg = cfg
        self.workload = StepWorkload(cfg)
        self.reward_fn = self.workload.reward_fn
        self.prompts, self.answers = self.workload.prompts, self.workload.answers
        self.logger = logger
        self._ray = None
        self._store: Optional[Path] = None
        self._start_workers()

    # ------------------------------------------------------------------ workers
    def _start_workers(self) -> None:
        cfg = self.cfg
        if not cfg.ray.enabled:
            self.rollout = [RolloutWorker(cfg)]
            self.learner = LearnerWorker(cfg)
            in_process_pair(cfg, self.rollout, self.learner)
            return
        import os

        import ray

        if not ray.is_initialized():
            if os.environ.get("RAY_AUTH_MODE", "token") != "token":
                log.warning("RAY_AUTH_MODE=%s: Ray's token authentication is off", os.environ["RAY_AUTH_MODE"])
            # Ray >= 2.59 starts local clusters with token auth (a token in ~/.ray/auth_token). The node
            # address is 127.0.0.1, but Ray 2.60's own gRPC servers still listen on every interface
            # (seen with `ss -ltnp`); the token guards them. Our weight-sync group is loopback-only.
            kwargs = dict(include_dashboard=False, log_to_driver=True)
            if cfg.ray.address is None:
                kwargs.update(_node_ip_address="127.0.0.1", num_cpus=cfg.ray.num_cpus)
            ray.init(address=cfg.ray.address, **kwargs)
            self._ray = ray
        rollout_cls = ray.remote(num_cpus=cfg.ray.rollout_cpus, num_gpus=cfg.ray.rollout_gpus)(RolloutWorker)
        learner_cls = ray.remote(num_cpus=cfg.ray.learner_cpus, num_gpus=cfg.ray.learner_gpus)(LearnerWorker)
        rollout_threads, learner_threads = cfg.ray.actor_threads(len(os.sched_getaffinity(0)))
        self.rollout = [rollout_cls.remote(cfg, threads=rollout_threads) for _ in range(cfg.ray.rollout_actors)]
        self.learner = learner_cls.remote(cfg, threads=learner_threads)
        if cfg.ray.address is None:  # one machine: rendezvous through a file, gloo on loopback
            self._store = Path(cfg.tracking.out_dir).resolve() / f".sync-store-{uuid.uuid4().hex}"
            self._store.parent.mkdir(parents=True, exist_ok=True)
            init_method = f"file://{self._store}"
        else:
            host = cfg.ray.sync_host
            init_method = f"tcp://{host}:{free_port(host)}"
        world = 1 + len(self.rollout)
        joins = [self.learner.join_sync_group.remote(init_method, 0, world, cfg.sync.timeout)]
        joins += [a.join_sync_group.remote(init_method, i + 1, world, cfg.sync.timeout) for i, a in enumerate(self.rollout)]
        ray.get(joins)

    def _call(self, worker, method: str, *args):
        if not self.cfg.ray.enabled:
            return getattr(worker, method)(*args)
        return getattr(worker, method).remote(*args)

    def _get(self, handles):
        if not self.cfg.ray.enabled:
            return handles
        import ray

        return ray.get(handles)

    # ------------------------------------------------------------------ one step
    def batch(self, step: int) -> tuple[list[str], list[str], list[int]]:
        return self.workload.batch(step)

    def sample(self, prompts: list[str], indices: list[int], params: Optional[dict] = None) -> list:
        """Split the prompts over the rollout workers; rollouts come back in prompt order."""
        params = params or dataclasses.asdict(self.cfg.sampling)
        parts = len(self.rollout)
        bounds = [round(i * len(prompts) / parts) for i in range(parts + 1)]
        handles = [self._call(w, "sample", prompts[a:b], params, indices[a:b])
                   for w, a, b in zip(self.rollout, bounds, bounds[1:]) if b > a]
        return [d for part in self._get(handles) for d in part]

    def drift_subset(self, step: int, rollouts: list) -> list[int]:
        """Indices of the rollouts drift is measured on at `step`: those with tokens, all of them when
        `drift_max_rollouts` is 0 or covers them, else that many drawn at random by (seed, step), in order."""
        live = [i for i, r in enumerate(rollouts) if r["token_ids"]]
        k = self.cfg.drift_max_rollouts
        if k == 0 or k >= len(live):
            return live
        return sorted(random.Random(self.cfg.seed * 1_000_003 + step).sample(live, k))

    def step(self, step: int) -> dict:
        cfg = self.cfg
        prompts, answers, indices = self.batch(step)
        t0 = time.perf_counter()
        rollouts = self.sample(prompts, indices)
        t1 = time.perf_counter()
        n = cfg.sampling.n
        texts = [r["text"] if r["text"] is not None else "" for r in rollouts]
        rewards = [float(self.reward_fn(t, answers[i // n])) for i, t in enumerate(texts)]
        learn = self._get(self._call(self.learner, "train", rollouts, rewards, n, cfg.sampling.temperature))
        t2 = time.perf_counter()
        sync = self._get(self._call(self.learner, "sync_target"))
        t3 = time.perf_counter()
        follow = self._get(self._call(self.learner, "follow", step + 1, rollouts))
        t4 = time.perf_counter()
        drift = {}
        if cfg.drift_every and (step + 1) % cfg.drift_every == 0 and has_draft(cfg):
            subset = [rollouts[i] for i in self.drift_subset(step, rollouts)]
            drift = self._get(self._call(self.learner, "drift", subset, cfg.sampling.temperature))
            if drift:
                drift[names.DRIFT_ROLLOUTS] = len(subset)
        t5 = time.perf_counter()
        engine = merge_engine_metrics(self._get([self._call(w, "metrics", True) for w in self.rollout]))
        tokens = sum(len(r["token_ids"]) for r in rollouts)
        total = t5 - t0
        metrics = dict(engine)
        metrics.update(learn)
        metrics.update(sync)
        metrics.update(follow)
        metrics.update(drift)
        metrics.update({
            "step": step + 1,
            "rollout/tokens": tokens,
            "rollout/tokens_per_s": tokens / max(t1 - t0, 1e-9),
            "rollout/weight_version": max(r["weight_version"] for r in rollouts),
            names.TIME_ROLLOUT_S: t1 - t0, names.TIME_LEARN_S: t2 - t1, names.TIME_SYNC_S: t3 - t2,
            names.TIME_FOLLOW_S: t4 - t3, names.TIME_DRIFT_S: t5 - t4, names.TIME_STEP_S: total,
            "time/rollout_share": (t1 - t0) / total, "time/learn_share": (t2 - t1) / total,
            "time/sync_share": (t3 - t2 + t4 - t3) / total, names.TIME_DRIFT_SHARE: (t5 - t4) / total,
            "draft/mode": cfg.follow.mode,
        })
        return metrics

    def run(self, on_step: Optional[Callable[[dict], None]] = None) -> list[dict]:
        history = []
        if 0 in self.cfg.checkpoint_steps:
            self.save_checkpoint(0)
        for s in range(self.cfg.steps):
            metrics = self.step(s)
            history.append(metrics)
            if s + 1 in self.cfg.checkpoint_steps:
                self.save_checkpoint(s + 1)
            if self.logger is not None:
                self.logger.log(s + 1, {k: v for k, v in metrics.items() if k != "step"})
                self.logger.log_version(version_row(metrics))
            if on_step is not None:
                on_step(metrics)
            log.info("step %d: reward %.3f, %.1f tok/s, hit %.3f, accept %.3f", s + 1, metrics.get("reward/mean", 0),
                     metrics["rollout/tokens_per_s"], metrics.get("ssd/hit_rate", float("nan")),
                     metrics.get("spec/accept_rate", float("nan")))
        return history

    def save_checkpoint(self, step: int) -> str:
        """Checkpoint `step` (rl/checkpoints.py), outside the step's timed phases."""
        t = time.perf_counter()
        where = self._get(self._call(self.learner, "save_checkpoint", step))
        log.info("checkpoint of step %d in %s (%.1f s)", step, where, time.perf_counter() - t)
        return where

    def learner_digest(self) -> str:
        return self._get(self._call(self.learner, "weights_digest"))

    def close(self) -> None:
        for w in getattr(self, "rollout", []):
            try:
                self._get(self._call(w, "close"))
            except Exception as err:  # a dead actor must not stop the others from closing
                log.warning("closing a rollout worker failed: %s", err)
        if self.cfg.ray.enabled:
            import ray

            for actor in [*getattr(self, "rollout", []), getattr(self, "learner", None)]:
                if actor is not None:
                    ray.kill(actor)
            if self._ray is not None:
                ray.shutdown()
                self._ray = None
        if self._store is not None:
            self._store.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


VERSION_KEYS = ("ssd/hit_rate", "spec/accept_rate", "spec/accept_length", "drift/kl_target_draft",
                "mismatch/token_mult_prob_error", "sync/bytes", "sync/seconds", "rollout/tokens_per_s",
                "ssd/strategy", "reward/mean")


def version_row(metrics: dict) -> dict:
    """The per-version row of the drift dashboard: the policy version these rollouts were made under."""
    row = {"version": metrics["rollout/weight_version"], "step": metrics["step"], "draft_mode": metrics["draft/mode"]}
    row.update({k: metrics[k] for k in VERSION_KEYS if k in metrics})
    return row

