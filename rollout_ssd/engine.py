"""RolloutEngine: the public entry point (docs/DESIGN.md).

The engine puts the pieces together and is the face callers see; each piece is its own module:
  edges.py       prompts in, text out (tokenization, stop strings, rollout building)
  scheduler.py   the loop: waiting / running, admit and prefill, one round, retire, release
  methods.py     the decode strategy by name ("ar", "sd", "ssd": one `DecodeStrategy` interface)
  updates.py     target and draft weight updates, validated on arrival, applied between rounds
Everything between the edges is token ids.

`sample` is one blocking call; `submit` queues a request that joins the running batch at the next
round (the server's path), with its own sampling parameters, seed, progress listener and cancel.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional
from typing import Sequence as Seq

import torch

from rollout_ssd import metric_names as names
from rollout_ssd.admission import Admission, resolve_reserved
from rollout_ssd.config import CPU_KV_MEMORY_SHARE, CPU_MAX_BATCH, GPU_MAX_BATCH, EngineConfig, SpecConfig, reject_unknown
from rollout_ssd.decode import DecodeStrategy
from rollout_ssd.draft_sync import DraftSync
from rollout_ssd.edges import Edges
from rollout_ssd.kv_cache import KVCache
from rollout_ssd.methods import BuildContext, make_strategy
from rollout_ssd.metrics import EngineMetrics
from rollout_ssd.models import cpu_memory
from rollout_ssd.models.attention import cache_dtype, select_backend
from rollout_ssd.models.cpu_backend import warm_packed
from rollout_ssd.models.cpu_memory import keep_freed_memory
from rollout_ssd.models.loader import LoadedModel, load_draft, load_pretrained
from rollout_ssd.models.registry import INT4_DRAFT
from rollout_ssd.params import Prompt, Rollout, SamplingParams
from rollout_ssd.request import Request
from rollout_ssd.round_budget import RoundBudget
from rollout_ssd.runner import ModelRunner
from rollout_ssd.scheduler import Scheduler
from rollout_ssd.updates import TargetWeights, UpdateQueue


def _context(target: LoadedModel, engine: EngineConfig, spec: SpecConfig,
             draft: Optional[LoadedModel]) -> tuple[int, int]:
    """(max_model_len, KV slots) for this target under `engine`'s limits: max_batch_size slots (None: `_default_batch`), fewer
    when kv_cache_bytes caps the cache or, on a CUDA target without that cap, when the GPU's free memory
    holds fewer (`_slots_on_gpu`)."""
    cfg = target.model.cfg
    if engine.max_model_len is not None and engine.max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"EngineConfig.max_model_len={engine.max_model_len} exceeds the model's context "
                         f"(max_position_embeddings={cfg.max_position_embeddings})")
    max_len = engine.max_model_len or min(cfg.max_position_embeddings, 2048)
    per_slot = _kv_per_token(target) * max_len
    slots = engine.max_batch_size or _default_batch(target.model.embed.device, per_slot + _draft_kv(draft, spec, max_len))
    if engine.kv_cache_bytes is not None:
        slots = min(slots, engine.kv_cache_bytes // per_slot)
        if slots < 1:
            raise ValueError(
                f"EngineConfig.kv_cache_bytes={engine.kv_cache_bytes} cannot hold one sequence of "
                f"max_model_len={max_len} ({per_slot} bytes)"
            )
    else:
        slots = _slots_on_gpu(target, engine, spec, draft, max_len, per_slot, slots) or slots
    return max_len, slots


def _kv_per_token(loaded: LoadedModel) -> int:
    """KV cache bytes per token of a model, in its cache's dtype (`attention.cache_dtype`)."""
    cfg = loaded.model.cfg
    return KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cache_dtype(loaded.model))


def _draft_cache_len(draft: Optional[LoadedModel], spec: SpecConfig, max_len: int) -> Optional[int]:
    """Positions a sequence takes in the draft's KV cache: SD's draft model max_len, SSD's draft side its
    room for a tree (`draft_max_len`); None where no draft model drafts."""
    if draft is not None and spec.method == "sd" and spec.speculator == "draft":
        return max_len
    if draft is not None and spec.method == "ssd":
        from rollout_ssd.ssd.draft_server import draft_max_len

        ssd = spec.ssd_config()
        return draft_max_len(max_len, ssd.k, ssd.max_branches)
    return None


def _draft_kv(draft: Optional[LoadedModel], spec: SpecConfig, max_len: int) -> int:
    """The draft's KV bytes per sequence, for a CPU engine's default batch: SD's draft cache; under SSD the
    draft side's and the SD speculator's beside it (ssd/round.py)."""
    length = _draft_cache_len(draft, spec, max_len)
    if length is None:
        return 0
    return _kv_per_token(draft) * (length + (max_len if spec.method == "ssd" else 0))


def _default_batch(device: torch.device, per_slot: int) -> int:
    """EngineConfig.max_batch_size=None: GPU_MAX_BATCH on a GPU; on a CPU CPU_MAX_BATCH, fewer (at least
    one) where CPU_KV_MEMORY_SHARE of the memory available does not hold that many sequences' KV (the
    target's and the draft's, `per_slot`) at full length (the CPU cache is backed as it fills, so too many
    slots would fail mid-call, not at start). SSD's tree buffers are not counted (bounded by max_budget)."""
    if device.type != "cpu":
        return GPU_MAX_BATCH
    free = cpu_memory.available_bytes()
    return CPU_MAX_BATCH if free is None else max(1, min(CPU_MAX_BATCH, int(CPU_KV_MEMORY_SHARE * free) // per_slot))


def _slots_on_gpu(target: LoadedModel, engine: EngineConfig, spec: SpecConfig, draft: Optional[LoadedModel],
                  max_len: int, per_slot: int, slots: int) -> Optional[int]:
    """KV slots that fit in the target GPU's free memory (gpu/memory.py), None off CUDA. A slot costs the
    target's KV of one full sequence plus the draft's when the draft's KV lives on the same device (SD's
    draft model; SSD's draft side unless `draft_device` puts it on another one), and the step reserve
    counts the draft's forwards too (SSD's tree: every branch's logits and q)."""
    from rollout_ssd.gpu import memory
    from rollout_ssd.gpu.devices import resolved
    from rollout_ssd.gpu.graphs import BUCKETS, MAX_STEP_TOKENS, bucket_for
    from rollout_ssd.runner import PREFILL_TOKENS_PER_FORWARD

    device = target.model.embed.device
    measured = memory.device_memory(device)
    if measured is None:
        return None
    rows = slots  # a static step pads its rows to the bucket
    rows = bucket_for(rows) if engine.cuda_graphs and rows <= BUCKETS[-1] else rows
    reserve = memory.FIXED_MARGIN_BYTES + memory.step_reserve_bytes(
        target.model.cfg, target.model.dtype, rows, MAX_STEP_TOKENS, PREFILL_TOKENS_PER_FORWARD, max_len)
    draft_len, tree_bytes = _draft_cache_len(draft, spec, max_len), 0
    draft_device = None if draft is None else draft.model.embed.device
    if draft_len is not None and spec.method == "ssd":
        ssd = spec.ssd_config()
        draft_device = torch.device(ssd.draft_device) if ssd.draft_device else draft_device
        # the tree's float32 q [R, branches, k, V] and the cache entries' copy, and one step's logits
        tree_bytes = rows * ssd.max_branches * draft.model.cfg.vocab_size * (2 * 4 * ssd.k + 8)
    if draft_len is not None and resolved(draft_device) == resolved(device):
        dcfg = draft.model.cfg
        per_slot += _kv_per_token(draft) * draft_len
        reserve += tree_bytes + memory.step_reserve_bytes(dcfg, draft.model.dtype, rows, MAX_STEP_TOKENS,
                                                          PREFILL_TOKENS_PER_FORWARD, draft_len)
    free, total = measured
    return memory.kv_slots_that_fit(free, total, per_slot, reserve, engine.gpu_memory_utilization, slots)


class RolloutEngine:
    def __init__(self, target: LoadedModel, spec: SpecConfig = SpecConfig(), engine: EngineConfig = EngineConfig(),
                 draft: Optional[LoadedModel] = None):
        self.target = target
        self.spec = spec
        self.config = engine
        for loaded in (target, draft):  # the attention backend of each model the engine runs, by its device
            if loaded is not None:  # (and, for "auto", whether its steps are captured: the target's alone),
                loaded.model.backend = select_backend(  # before the KV plan: it sets the cache's dtype
                    engine.attention, loaded.model.embed.device, static_steps=engine.cuda_graphs and loaded is target)
        self.max_model_len, slots = _context(target, engine, spec, draft)
        if target.model.embed.is_cpu:
            keep_freed_memory()  # a large batch's multi-MB tensors reused, not faulted in again each step
        for loaded in (target, draft):
            if loaded is not None:
                warm_packed(loaded.model)  # the CPU kernels its first rounds would otherwise make
        self.runner = ModelRunner(target.model, num_slots=slots, max_len=self.max_model_len)
        if engine.cuda_graphs:
            self.runner.use_static_steps()
        elif engine.compile:
            if target.model.embed.device.type != "cpu":
                raise ValueError("EngineConfig.compile is for a CPU target; on CUDA use cuda_graphs")
            from rollout_ssd.gpu.graphs import MAX_STEP_TOKENS

            verify = spec.k + 1 if spec.method != "ar" and spec.k + 1 <= MAX_STEP_TOKENS else None
            self.runner.use_static_steps(compiled=engine.compile, pad_t=verify)
        self.stats = EngineMetrics()
        self.edges = Edges(target, self.max_model_len)
        self.target_updates = UpdateQueue(TargetWeights(target.model.hf_parameters, self.stats), self._apply_when_idle)
        self.draft_sync = DraftSync(lambda: self.strategy, target.model.hf_parameters)
        self.draft_updates = UpdateQueue(self.draft_sync, self._apply_when_idle)
        self.strategy: DecodeStrategy = make_strategy(BuildContext(
            self.runner, self.stats, spec, draft, target.model.cfg.vocab_size, self.max_model_len))
        admission = Admission(engine.admission, resolve_reserved(engine.reserved_slots, slots))
        self.scheduler = Scheduler(self.runner, lambda: self.strategy, self.stats, updates=self._apply_updates,
                                   version=lambda: self.weight_version, admission=admission,
                                   budget=RoundBudget(engine.max_round_rows))
        self._closed = False

    @classmethod
    def from_pretrained(cls, target: str = "smollm2-135m-instruct", draft: Optional[str] = None,
                        spec: Optional[SpecConfig] = None, dtype: str = "auto", device: str = "cpu",
                        draft_device: Optional[str] = None, **engine_options) -> "RolloutEngine":
        """Load the target (and draft) and build an engine. engine_options are EngineConfig fields.
        device: where the target runs, and the draft model the engine holds (SD's draft; under SSD the
        copy that validates updates and serves the fallback). draft_device (SSD): where the draft side
        runs; default the next GPU when there is one, else the target's device. draft: "default" (the
        target's built-in draft), "target-int4" (the target's own weights in int4, models/quant.py: CPU
        only, following every target update), or a checkpoint."""
        from rollout_ssd.gpu.devices import check_device, default_draft_device

        dev = check_device(device)
        spec = spec or SpecConfig()
        draft_dev = check_device(draft_device, "draft_device") if draft_device is not None else None
        if draft_dev is not None:
            if spec.method != "ssd":
                raise ValueError(f"draft_device applies to SpecConfig.method='ssd' (SD's draft runs on `device`), "
                                 f"got method={spec.method!r}")
        if spec.method == "ssd" and spec.draft_device is None:
            spec = dataclasses.replace(spec, draft_device=str(draft_dev or default_draft_device(dev)))
        reject_unknown(EngineConfig, engine_options)
        if draft == INT4_DRAFT and spec.method == "ssd" and spec.draft_device not in (None, "cpu"):
            raise ValueError(f"draft='target-int4' runs on a CPU (torch's CPU int4 kernel), "
                             f"got draft_device={spec.draft_device!r}")
        worker_process = spec.method == "ssd" and spec.worker and draft is not None \
            and torch.device(spec.draft_device).type == "cpu"
        if worker_process:  # its interpreter imports on another core while the models load
            from rollout_ssd.ssd import worker_client

            worker_client.prestart()
        try:
            loaded = load_pretrained(target, dtype=dtype)
            loaded.model.to(dev)
            draft_loaded = None
            if draft is not None:
                draft_loaded = load_draft(draft, loaded, target, dtype)
                draft_loaded.model.to(dev)  # shared tensors (the embedding; an int4 draft's all) are there already
            return cls(loaded, spec, EngineConfig(**engine_options), draft_loaded)
        finally:
            if worker_process:  # taken by the engine's draft side, or not needed after all
                worker_client.dismiss_spare()

    # ------------------------------------------------------------------ generation
    def sample(self, prompts: Seq[Prompt], params: Optional[SamplingParams] = None,
               progress: bool = False, prompt_indices: Optional[Seq[int]] = None) -> list[Rollout]:
        """Generate len(prompts) * params.n rollouts, ordered by (prompt, sample).

        prompt_indices: the global index of each prompt (default 0..len-1). Sample j of a prompt with
        index i is seeded by (seed, i, j), so a job split across calls or actors reproduces the rollouts
        of one big call when each part passes its prompts' global indices."""
        self._check_open()
        params = params or SamplingParams()
        request = self._request(prompts, params, prompt_indices, bar=self._bar(prompts, params) if progress else None)
        if request.seqs:
            self.scheduler.run(request)
        return request.result()

    def submit(self, prompts: Seq[Prompt], params: Optional[SamplingParams] = None,
               prompt_indices: Optional[Seq[int]] = None, listener: Optional[Callable] = None) -> Request:
        """Queue a request without blocking; it joins the running batch at the next round. Validates as
        `sample` does (ValueError before anything is queued). Returns a `request.Request`: `result()`
        blocks for the rollouts, `cancel()` frees its slots at the next round, `listener(request,
        finished)` is called on the scheduler's thread after each round that emitted tokens for it."""
        self._check_open()
        request = self._request(prompts, params, prompt_indices, listener=listener)
        self.scheduler.start()
        if request.seqs:
            self.scheduler.submit(request)
        elif listener is not None:
            listener(request, True)
        return request

    def pause(self) -> None:
        """Stop running rounds (weight updates still apply); running sequences keep their place."""
        self.scheduler.pause()

    def resume(self) -> None:
        self.scheduler.resume()

    def tokenize(self, prompts: Seq[Prompt], params: Optional[SamplingParams] = None) -> list[list[int]]:
        """The token ids `sample` would generate from (chat template applied if params.chat), with
        every check it makes; raises ValueError naming the bad prompt's index."""
        return self.edges.tokenize(prompts, params or SamplingParams())

    def _request(self, prompts, params, prompt_indices, listener=None, bar=None) -> Request:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        seqs = self.edges.sequences(prompts, params, prompt_indices)
        return Request(seqs, listener=listener, bar=bar,
                       build=lambda done: self.edges.rollouts(done, self.weight_version))

    @staticmethod
    def _bar(prompts, params):
        from tqdm.auto import tqdm

        return tqdm(total=len(prompts) * params.n, desc="rollouts", unit="seq")

    # ------------------------------------------------------------------ weights (updates.py)
    @property
    def weight_version(self) -> int:
        """The target weight version served now."""
        return self.target_updates.version

    @property
    def draft_version(self) -> int:
        return self.draft_updates.version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace target weights (HF names). Everything is validated before anything is written, so a
        bad update raises ValueError and the engine keeps serving the old version. Called while
        `sample` runs (from another thread), the update is applied between rounds, never inside one."""
        self._check_open()
        self.target_updates.submit(named_tensors, version)

    def attach_receiver(self, receiver) -> None:
        """Serve a `weight_sync.WeightReceiver`: a background thread receives and verifies transfers;
        each verified update is applied between rounds. A rejected transfer is logged and counted
        (`sync/rejected`), and the engine keeps serving the version it has."""
        self.target_updates.attach_receiver(receiver, closed=lambda: self._closed)

    def update_draft_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace draft weights (HF names of the draft; SD's neural draft or SSD's draft, worker
        included). Validated before anything is queued (ValueError: the draft keeps its version); applied
        between rounds, never inside one; outputs stay exactly lossless."""
        self._check_open()
        self.draft_updates.submit(named_tensors, version)

    def attach_draft_receiver(self, receiver) -> None:
        """Serve a `weight_sync.WeightReceiver` for the draft (see `attach_receiver`); rejected
        transfers are counted in `sync/draft_rejected` and the draft keeps its version."""
        self._check_open()
        self.draft_updates.attach_receiver(receiver, closed=lambda: self._closed)

    def _apply_when_idle(self) -> None:
        """Apply queued updates now unless a driver is running rounds (it then applies them next)."""
        self.scheduler.when_idle(lambda: self.scheduler.apply_updates([]))

    def _apply_updates(self) -> bool:
        """The scheduler's between-rounds hook: draft updates, then target updates; True if the target's
        weights changed."""
        self.draft_updates.apply()
        return self.target_updates.apply()

    # ------------------------------------------------------------------ metrics and lifetime
    def metrics(self, reset: bool = False) -> dict:
        out = self.stats.as_dict()
        out[names.SYNC_VERSION] = self.weight_version
        out[names.SYNC_REJECTED] = self.target_updates.rejected
        out.update(self.draft_sync.metrics(self.draft_updates))
        if reset:
            self.stats.reset()
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.scheduler.close()
            self.strategy.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self._closed:
            raise RuntimeError("RolloutEngine is closed")
