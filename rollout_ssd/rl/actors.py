"""Rollout and learner workers, used as Ray actors (or in process, the same classes without Ray).

A `RolloutWorker` wraps one RolloutEngine (target side; with SSD the engine starts its own draft
worker process). A `LearnerWorker` owns the policy `Learner`, the draft follower and the weight-sync
senders. A weight-sync group joins them: over Ray, a gloo torch.distributed group (learner rank 0,
rollout workers 1..R) carrying the target's transfers on the default group and the draft's on a
second group, so the two receivers in each engine never interleave; in process, InProcessTransports.
Weights never travel through Ray's object store; Ray carries only plain lists, numbers and strings
(it pickles them among the cluster's own token-authenticated processes).
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Optional, Sequence

import torch

from rollout_ssd import RolloutEngine, SamplingParams
from rollout_ssd.draft.drift import kl_target_draft
from rollout_ssd.draft.follow import DraftFollower
from rollout_ssd.models.loader import load_pretrained
from rollout_ssd.models.registry import INT4_DRAFT
from rollout_ssd.params import Rollout
from rollout_ssd.rl.config import RLConfig
from rollout_ssd.rl.learner import Learner, RolloutBatch
from rollout_ssd.weight_sync import DistributedTransport, InProcessTransport, LearnerSync, SenderConfig, WeightReceiver

ROLLOUT_FIELDS = ("prompt_index", "sample_index", "prompt_token_ids", "token_ids", "logprobs", "text",
                  "finish_reason", "weight_version")


def rollout_to_dict(r: Rollout) -> dict:
    return {name: getattr(r, name) for name in ROLLOUT_FIELDS}


def resolve_models(cfg: RLConfig) -> tuple[str, Optional[str]]:
    """(target, draft) sources: the tiny pair (built once under out_dir) or the configured ones."""
    if cfg.tiny:
        from rollout_ssd.rl.tasks import ALPHABET
        from rollout_ssd.rl.tiny import TinyConfig, build_tiny_pair

        target, draft = build_tiny_pair(os.path.join(cfg.tracking.out_dir, "tiny_models"), ALPHABET,
                                        TinyConfig(seed=cfg.seed))
        return str(target), str(draft)
    if cfg.draft is None:
        return cfg.model, None
    from rollout_ssd.models.registry import resolve_draft

    if cfg.draft == INT4_DRAFT:  # made of the target by the engine (models/quant.py)
        return cfg.model, INT4_DRAFT
    return cfg.model, str(resolve_draft(cfg.draft, cfg.model))


def has_draft(cfg: RLConfig) -> bool:
    """Whether the engine runs a neural draft (SSD, or SD with the draft speculator), which the learner
    side then keeps a copy of (drift telemetry, follow mode) and syncs."""
    if cfg.draft is None and not cfg.tiny:
        return False
    return cfg.spec.method == "ssd" or (cfg.spec.method == "sd" and cfg.spec.speculator == "draft")


def engine_dtype(cfg: RLConfig) -> torch.dtype:
    from rollout_ssd.models.loader import parse_dtype

    return parse_dtype(cfg.dtype)


def engine_options(cfg: RLConfig) -> dict:
    """Every EngineConfig field of the run, as `RolloutEngine.from_pretrained` keyword arguments."""
    return {f.name: getattr(cfg.engine, f.name) for f in dataclasses.fields(cfg.engine)}


class RolloutWorker:
    """One engine. `sample` takes prompts (text or ids) with their global indices (the seeds)."""

    def __init__(self, cfg: RLConfig, threads: Optional[int] = None):
        if threads:
            torch.set_num_threads(threads)
        target, draft = resolve_models(cfg)
        placement = dict(device=cfg.device, draft_device=cfg.draft_device if cfg.spec.method == "ssd" else None)
        self.engine = RolloutEngine.from_pretrained(target, draft=draft if has_draft(cfg) else None, spec=cfg.spec,
                                                    dtype=cfg.dtype, **placement, **engine_options(cfg))
        self.cfg = cfg

    # -- weight sync ---------------------------------------------------------------------------------
    def attach(self, target_transport, draft_transport=None) -> None:
        self.engine.attach_receiver(WeightReceiver(target_transport))
        if draft_transport is not None:
            self.engine.attach_draft_receiver(WeightReceiver(draft_transport))

    def join_sync_group(self, init_method: str, rank: int, world_size: int, timeout: float) -> bool:
        draft_group = _join(init_method, rank, world_size, timeout)
        self.attach(DistributedTransport(src=0, timeout=timeout),
                    DistributedTransport(draft_group, src=0, timeout=timeout) if has_draft(self.cfg) else None)
        return True

    # -- work ----------------------------------------------------------------------------------------
    def sample(self, prompts: Sequence, params: dict, prompt_indices: Sequence[int]) -> list[dict]:
        rollouts = self.engine.sample(list(prompts), SamplingParams(**params), prompt_indices=list(prompt_indices))
        return [rollout_to_dict(r) for r in rollouts]

    def metrics(self, reset: bool = True) -> dict:
        m = self.engine.metrics(reset=reset)
        return {k: (v if isinstance(v, (int, float, str, list)) else str(v)) for k, v in m.items()}

    def versions(self) -> tuple[int, int]:
        return self.engine.weight_version, self.engine.draft_version

    def close(self) -> None:
        self.engine.close()


class LearnerWorker:
    """The policy learner, the draft follower and the weight-sync senders."""

    def __init__(self, cfg: RLConfig, threads: Optional[int] = None):
        if threads:
            torch.set_num_threads(threads)
        self.cfg = cfg
        target, draft = resolve_models(cfg)
        loaded = load_pretrained(target, dtype="float32", with_tokenizer=bool(cfg.checkpoint_steps))
        policy = loaded.model
        self._hf_config, self._tokenizer = loaded.hf_config, loaded.tokenizer  # for checkpoints
        self._draft_config = None
        self.learner = Learner(policy, cfg.learner)
        self.follower = None
        if has_draft(cfg) and draft != INT4_DRAFT:  # the policy's own weights: nothing to distil or send
            draft_loaded = load_pretrained(draft, dtype="float32", with_tokenizer=False, share_embedding_from=policy)
            self._draft_config = draft_loaded.hf_config
            self.follower = DraftFollower(draft_loaded.model, cfg.follow)
        self.sync: Optional[LearnerSync] = None
        self.draft_version = 0

    def sender_config(self) -> SenderConfig:
        s = self.cfg.sync
        # an engine on a GPU checks what it receives where its weights are: "sum64" needs no copy to the host
        on_gpu = str(self.cfg.device).startswith("cuda")
        return SenderConfig(dtype=engine_dtype(self.cfg), bucket_bytes=s.bucket_bytes, delta=s.delta,
                            compression=s.compression, checksum="sum64" if on_gpu else "auto")

    def attach(self, target_transport, draft_transport=None) -> None:
        self.sync = LearnerSync(target_transport, draft_transport, config=self.sender_config(),
                                timeout=self.cfg.sync.timeout)
        # the engines hold the same checkpoint at version 0: the first sync may be a delta
        self.sync.seed_target(self.learner.model, 0)
        if draft_transport is not None and self.follower is not None:
            self.sync.seed_draft(self.follower.named_tensors(), 0)

    def join_sync_group(self, init_method: str, rank: int, world_size: int, timeout: float) -> bool:
        draft_group = _join(init_method, rank, world_size, timeout)
        self.attach(DistributedTransport(src=0, timeout=timeout),
                    DistributedTransport(draft_group, src=0, timeout=timeout) if has_draft(self.cfg) else None)
        return True

    def train(self, rollouts: Sequence[dict], rewards: Sequence[float], group_size: int, temperature: float) -> dict:
        batch = RolloutBatch([list(r["prompt_token_ids"]) for r in rollouts], [list(r["token_ids"]) for r in rollouts],
                             [list(r["logprobs"]) for r in rollouts], list(rewards), group_size, temperature)
        return self.learner.step(batch)

    def sync_target(self) -> dict:
        stats = self.sync.sync_target(self.learner.model, self.learner.version)
        return stats.as_metrics()

    def follow(self, step: int, rollouts: Sequence[dict]) -> dict:
        """Draft follow (if due) and its sync; returns follow/* and sync/draft_* metrics."""
        if self.follower is None:
            return {}
        pairs = [(list(r["prompt_token_ids"]), list(r["token_ids"])) for r in rollouts]
        result = self.follower.step(step, pairs, target=self.learner.model)
        out = {"follow/trained": float(result.trained)}
        if result.trained:
            out.update({"follow/first_kl": result.first_loss, "follow/last_kl": result.last_loss,
                        "follow/seconds": result.seconds})
            if self.sync is not None and self.sync.draft is not None:
                self.draft_version += 1
                stats = self.sync.sync_draft(self.follower.named_tensors(), self.draft_version)
                out.update({k.replace("sync/", "sync/draft_", 1): v for k, v in stats.as_metrics().items()})
        return out

    def drift(self, rollouts: Sequence[dict], temperature: float) -> dict:
        """drift/kl_target_draft on the given rollouts (the trainer passes its `drift_subset`), under the
        current policy and the current draft (the follower's copy, which the engine's draft equals)."""
        if self.follower is None:
            return {}
        pairs = [(list(r["prompt_token_ids"]), list(r["token_ids"])) for r in rollouts if r["token_ids"]]
        if not pairs:
            return {}
        with torch.no_grad():
            kl = kl_target_draft(self.learner.model, self.follower.draft, pairs,
                                 temperature=temperature if temperature > 0 else 1.0)
        return {"drift/kl_target_draft": kl}

    def save_checkpoint(self, step: int) -> str:
        """The policy (and the follower's draft) now, as checkpoint `step` under the run's out_dir
        (rl/checkpoints.py); returns its directory."""
        from rollout_ssd.rl.checkpoints import save_checkpoint

        draft = self.follower.draft if self.follower is not None else None
        where = save_checkpoint(self.cfg.tracking.out_dir, step, self.learner.model, self._hf_config, self._tokenizer,
                                policy_version=self.learner.version, draft=draft, draft_config=self._draft_config,
                                draft_version=self.draft_version, follow_mode=self.cfg.follow.mode)
        return str(where)

    def weights_digest(self) -> str:
        """A hash of the policy's weights (bitwise comparisons across runs)."""
        import hashlib

        h = hashlib.sha256()
        for name, t in sorted(self.learner.named_tensors().items()):
            h.update(name.encode())
            h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def version(self) -> int:
        return self.learner.version


def _join(init_method: str, rank: int, world_size: int, timeout: float):
    """Join the weight-sync world (gloo) and create the draft's group; every rank calls this.
    init_method: file:// (one machine: no TCP store) or tcp://host:port (a cluster)."""
    import torch.distributed as dist

    if init_method.startswith("file://") or "//127." in init_method or "//localhost" in init_method:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # a local group listens on loopback only
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    return dist.new_group(list(range(world_size)))


def in_process_pair(cfg: RLConfig, rollout_workers: Sequence[RolloutWorker], learner: LearnerWorker) -> None:
    """Wire the learner to in-process rollout workers with InProcessTransports."""
    target = InProcessTransport(len(rollout_workers))
    draft = InProcessTransport(len(rollout_workers)) if learner.follower is not None else None
    for i, worker in enumerate(rollout_workers):
        worker.attach(target.receiver(i), draft.receiver(i) if draft is not None else None)
    learner.attach(target, draft)
