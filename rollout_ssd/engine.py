"""RolloutEngine: the public entry point (DESIGN.md).

The engine owns the scheduler loop, the target runner and a decode strategy ("ar" here; "sd"/"ssd"
plug in behind the same `DecodeStrategy` interface). It knows tokenization only at its edges:
prompts in, text out. Everything in between is token ids.

Loop (continuous batching, scheduler.py): admit waiting sequences into free KV slots and prefill them
in one ragged batch (sampling each one's first token from the prefill logits), then advance every
running sequence by one round of the decode strategy; finished sequences free their slot at once.
`sample` is one blocking call; `submit` queues a request that joins the running batch at the next
round (the server's path), with its own sampling parameters, seed, progress listener and cancel.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import queue
import threading
import time
from typing import Callable, Iterable, Optional, Union
from typing import Sequence as Seq

import torch

from rollout_ssd.config import EngineConfig, SpecConfig, reject_unknown
from rollout_ssd.decode import ARDecode, DecodeStrategy, sample_rows
from rollout_ssd.draft_sync import DraftSync
from rollout_ssd.kv_cache import KVCache
from rollout_ssd.metrics import EngineMetrics
from rollout_ssd.models.loader import LoadedModel, load_pretrained
from rollout_ssd.named_update import NamedUpdate
from rollout_ssd.params import Rollout, SamplingParams
from rollout_ssd.runner import ModelRunner
from rollout_ssd.sampling import sequence_generator
from rollout_ssd.scheduler import Request, Scheduler
from rollout_ssd.sequence import Sequence

log = logging.getLogger(__name__)

Prompt = Union[str, list[int]]


class RolloutEngine:
    def __init__(self, target: LoadedModel, spec: SpecConfig = SpecConfig(), engine: EngineConfig = EngineConfig(),
                 draft: Optional[LoadedModel] = None):
        self.target = target
        self.spec = spec
        self.config = engine
        cfg = target.model.cfg
        if engine.max_model_len is not None and engine.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"EngineConfig.max_model_len={engine.max_model_len} exceeds the model's context "
                             f"(max_position_embeddings={cfg.max_position_embeddings})")
        max_len = engine.max_model_len or min(cfg.max_position_embeddings, 2048)
        slots = engine.max_batch_size
        if engine.kv_cache_bytes is not None:
            per_slot = KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, target.model.dtype) * max_len
            slots = min(slots, engine.kv_cache_bytes // per_slot)
            if slots < 1:
                raise ValueError(
                    f"EngineConfig.kv_cache_bytes={engine.kv_cache_bytes} cannot hold one sequence of "
                    f"max_model_len={max_len} ({per_slot} bytes)"
                )
        self.max_model_len = max_len
        self.runner = ModelRunner(target.model, num_slots=slots, max_len=max_len)
        self.weight_version = 0
        self.stats = EngineMetrics()
        self._pending: queue.Queue = queue.Queue()
        self._apply_lock = threading.Lock()
        self._sync_rejected = 0
        self._receiver_threads: list = []
        self.strategy: DecodeStrategy = self._make_strategy(spec, draft)
        self.scheduler = Scheduler(self.runner, between_rounds=self._apply_pending, prefill=self._prefill,
                                   step=lambda running: self.strategy.step(running), release=self._release,
                                   version=lambda: self.weight_version, add_time=self.stats.add_time)
        # draft weight sync (draft_sync.py): draft updates, applied between rounds like target updates
        self.draft_sync = DraftSync(lambda: self.strategy, self.target.model.hf_parameters,
                                    lambda: self.scheduler.driving)
        self._closed = False

    @classmethod
    def from_pretrained(cls, target: str = "smollm2-135m-instruct", draft: Optional[str] = None,
                        spec: Optional[SpecConfig] = None, dtype: str = "auto", device: str = "cpu",
                        **engine_options) -> "RolloutEngine":
        """Load the target (and draft) and build an engine. engine_options are EngineConfig fields."""
        if device != "cpu" and not (device.startswith("cuda") and torch.cuda.is_available()):
            raise ValueError(f"device {device!r} is not available on this machine")
        reject_unknown(EngineConfig, engine_options)
        loaded = load_pretrained(target, dtype=dtype)
        if device != "cpu":
            loaded.model.to(device)
        draft_loaded = None
        if draft is not None:
            from rollout_ssd.models.registry import resolve_draft

            draft_loaded = load_pretrained(resolve_draft(draft, target), dtype=dtype, with_tokenizer=False,
                                           share_embedding_from=loaded.model)
        return cls(loaded, spec or SpecConfig(), EngineConfig(**engine_options), draft_loaded)

    def _make_strategy(self, spec: SpecConfig, draft: Optional[LoadedModel]) -> DecodeStrategy:
        if spec.method == "ar":
            return ARDecode(self.runner, self.stats)
        if spec.method == "sd":
            from rollout_ssd.spec.sd import SDDecode

            return SDDecode(self.runner, self._make_speculator(spec, draft), spec.k, self.stats)
        if draft is None:
            raise ValueError("SpecConfig.method='ssd' needs a draft model (draft=...)")
        self._check_draft(draft)
        from rollout_ssd.ssd.round import SSDDecode

        ssd = spec.ssd_config()
        backup = None
        if ssd.backup != "neural":
            backup = self._make_speculator(dataclasses.replace(spec, method="sd", speculator=ssd.backup), draft)
        return SSDDecode(self.runner, draft.model, ssd, self.stats, backup=backup, max_model_len=self.max_model_len)

    def _check_draft(self, draft: LoadedModel) -> None:
        if draft.model.cfg.vocab_size != self.target.model.cfg.vocab_size:
            raise ValueError(f"draft vocab_size {draft.model.cfg.vocab_size} differs from the target's "
                             f"{self.target.model.cfg.vocab_size}: they must share a tokenizer")

    def _make_speculator(self, spec: SpecConfig, draft: Optional[LoadedModel]):
        if spec.speculator == "draft":
            if draft is None:
                raise ValueError("SpecConfig.speculator='draft' needs a draft model (draft=...)")
            self._check_draft(draft)
            from rollout_ssd.spec.draft_model import DraftModelSpeculator

            return DraftModelSpeculator(draft.model, self.runner.cache.num_slots, self.max_model_len,
                                        stop_prob=float(spec.stop_prob))
        if spec.speculator == "suffix":
            from rollout_ssd.spec.suffix import SuffixSpeculator

            return SuffixSpeculator()
        if spec.speculator == "random":
            from rollout_ssd.spec.random_spec import RandomConfig, RandomSpeculator

            return RandomSpeculator(RandomConfig(vocab_size=self.target.model.cfg.vocab_size))
        raise ValueError(f"SpecConfig.speculator {spec.speculator!r} is not available in this build")

    # ------------------------------------------------------------------ public API
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
        `sample` does (ValueError before anything is queued). Returns a `scheduler.Request`: `result()`
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

    def _request(self, prompts, params, prompt_indices, listener=None, bar=None) -> Request:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt_ids = self._tokenize(prompts, params)
        if prompt_indices is None:
            indices = list(range(len(prompt_ids)))
        else:
            indices = list(prompt_indices)
            if len(indices) != len(prompt_ids):
                raise ValueError(f"prompt_indices has {len(indices)} entries for {len(prompt_ids)} prompts")
            if any(not isinstance(i, numbers.Integral) or isinstance(i, bool) or i < 0 for i in indices):
                raise ValueError("prompt_indices must be non-negative integers")
            if len(set(indices)) != len(indices):
                raise ValueError("prompt_indices must be distinct")
            indices = [int(i) for i in indices]
        seqs = [self._new_sequence(idx, j, ids, params) for idx, ids in zip(indices, prompt_ids) for j in range(params.n)]
        return Request(seqs, listener=listener, bar=bar, build=self._rollouts)

    @staticmethod
    def _bar(prompts, params):
        from tqdm.auto import tqdm

        return tqdm(total=len(prompts) * params.n, desc="rollouts", unit="seq")

    def _rollouts(self, seqs: list[Sequence]) -> list[Rollout]:
        return [
            Rollout(
                prompt_index=s.prompt_index, sample_index=s.sample_index, prompt_token_ids=s.prompt_token_ids,
                token_ids=s.token_ids, logprobs=s.logprobs, text=self._text(s),
                finish_reason=s.finish_reason, weight_version=max(s.versions, default=self.weight_version),
                extra=self._extra(s),
            )
            for s in seqs
        ]

    @staticmethod
    def _extra(seq: Sequence) -> dict:
        extra = {}
        if len(seq.versions) > 1:
            extra["weight_versions"] = sorted(seq.versions)
        if seq.stop_string is not None:
            extra["stop_string"] = seq.stop_string
        return extra

    def _text(self, seq: Sequence) -> Optional[str]:
        """The rollout's text; with a stop string, the text before its first occurrence (as vLLM)."""
        tok = self.target.tokenizer
        if tok is None:
            return None
        text = tok.decode(seq.token_ids, skip_special_tokens=True)
        cut = text.find(seq.stop_string) if seq.stop_string is not None else -1
        return text if cut < 0 else text[:cut]

    def tokenize(self, prompts: Seq[Prompt], params: Optional[SamplingParams] = None) -> list[list[int]]:
        """The token ids `sample` would generate from (chat template applied if params.chat), with
        every check it makes; raises ValueError naming the bad prompt's index."""
        return self._tokenize(prompts, params or SamplingParams())

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace target weights (HF names). Everything is validated before anything is written, so a
        bad update raises ValueError and the engine keeps serving the old version. Called while
        `sample` runs (from another thread), the update is applied between rounds, never inside one."""
        self._check_open()
        update = NamedUpdate(named_tensors, version, what="update_weights")
        update.validate(self.target.model.hf_parameters(), self.weight_version)
        self._pending.put(update)
        self.scheduler.when_idle(lambda: self._apply_pending([]))

    def attach_receiver(self, receiver) -> None:
        """Serve a `weight_sync.WeightReceiver`: a background thread receives and verifies transfers;
        each verified update is applied between rounds. A rejected transfer is logged and counted
        (`sync/rejected`), and the engine keeps serving the version it has."""
        import threading

        def loop():
            from rollout_ssd.weight_sync import TransportError, WeightSyncError

            while not self._closed:
                try:
                    staged = receiver.receive(timeout=None)
                except WeightSyncError as err:
                    if isinstance(err, TransportError) and self._closed:
                        return
                    self._sync_rejected += 1
                    log.warning("weight sync: transfer rejected, still serving version %d: %s", self.weight_version, err)
                    if isinstance(err, TransportError):
                        return
                    continue
                self._pending.put(staged)
                self.scheduler.when_idle(lambda: self._apply_pending([]))

        thread = threading.Thread(target=loop, name="rollout-ssd-weight-receiver", daemon=True)
        thread.start()
        self._receiver_threads.append(thread)

    # ------------------------------------------------------------------ draft weights (draft_sync.py)
    def update_draft_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace draft weights (HF names of the draft; SD's neural draft or SSD's draft, worker
        included). Validated before anything is queued (ValueError: the draft keeps its version); applied
        between rounds, never inside one; outputs stay exactly lossless."""
        self._check_open()
        self.draft_sync.submit(named_tensors, version)

    def attach_draft_receiver(self, receiver) -> None:
        """Serve a `weight_sync.WeightReceiver` for the draft (see `attach_receiver`); rejected
        transfers are counted in `sync/draft_rejected` and the draft keeps its version."""
        self._check_open()
        self.draft_sync.attach_receiver(receiver, closed=lambda: self._closed)

    @property
    def draft_version(self) -> int:
        return self.draft_sync.version

    def _apply_pending(self, running: list[Sequence]) -> None:
        """Apply queued weight updates (between rounds only). Running sequences' target KV was computed
        under the old weights, so it is recomputed under the new ones: each later token is then verified
        under exactly the version its rollout reports."""
        self.draft_sync.apply_pending()
        applied = False
        with self._apply_lock:
            while not self._pending.empty():
                update = self._pending.get()
                t0 = time.perf_counter()
                try:
                    update.apply_to(self.target.model.hf_parameters())
                except ValueError as err:
                    self._sync_rejected += 1
                    log.warning("weight sync: update %s rejected, still serving version %d: %s",
                                getattr(update, "version", "?"), self.weight_version, err)
                    continue
                self.weight_version = update.version
                self.stats.add_sync(time.perf_counter() - t0, getattr(getattr(update, "stats", None), "bytes_received", 0))
                applied = True
        if applied:
            self.strategy.on_weights_changed()
            if running:
                for seq in running:
                    self.runner.rollback(seq.slot, 0)
                self.runner.prefill([s.slot for s in running], [s.all_token_ids[:-1] for s in running])

    def metrics(self, reset: bool = False) -> dict:
        out = self.stats.as_dict()
        out["sync/version"] = self.weight_version
        out["sync/rejected"] = self._sync_rejected
        out.update(self.draft_sync.metrics())
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

    # ------------------------------------------------------------------ internals
    def _check_open(self):
        if self._closed:
            raise RuntimeError("RolloutEngine is closed")

    def _tokenize(self, prompts: Seq[Prompt], params: SamplingParams) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Seq):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")
        vocab = self.target.model.cfg.vocab_size
        tok = self.target.tokenizer
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if tok is None:
                    raise ValueError(f"prompts[{i}] is text but the model has no tokenizer; pass token ids")
                if not p:
                    raise ValueError(f"prompts[{i}] is empty")
                if params.chat:
                    ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                  tokenize=True)
                    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
                else:
                    ids = tok(p).input_ids
            elif isinstance(p, Seq):
                if params.chat:
                    raise ValueError(f"prompts[{i}]: chat=True needs text prompts, got token ids")
                if any(not isinstance(t, numbers.Integral) or isinstance(t, bool) for t in p):
                    raise ValueError(f"prompts[{i}] must hold integer token ids")
                ids = [int(t) for t in p]
            else:
                raise ValueError(f"prompts[{i}] must be a string or a list of token ids, got {type(p).__name__}")
            if not ids:
                raise ValueError(f"prompts[{i}] is empty")
            if not all(0 <= t < vocab for t in ids):
                raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab})")
            if len(ids) >= self.max_model_len:
                raise ValueError(f"prompts[{i}] has {len(ids)} tokens; the context holds {self.max_model_len} "
                                 f"(prompt plus at least one generated token)")
            out.append(ids)
        return out

    def _new_sequence(self, i: int, j: int, ids: list[int], params: SamplingParams) -> Sequence:
        stop = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop |= set(self.target.model.cfg.eos_token_ids)
        return Sequence(prompt_index=i, sample_index=j, prompt_token_ids=ids, params=params,
                        generator=sequence_generator(params.seed, i, j), stop_ids=frozenset(stop),
                        max_total_len=self.max_model_len, stop_text=self._stop_text(params.stop))

    def _stop_text(self, stops: Optional[tuple[str, ...]]):
        """A check for stop strings: decodes the last few tokens (enough to hold the longest stop string's
        bytes, since a string that just completed ends inside them) and names the stop string found."""
        if not stops:
            return None
        tok = self.target.tokenizer
        if tok is None:
            raise ValueError("SamplingParams.stop needs a tokenizer; this model has none (use stop_token_ids)")
        window = max(len(x.encode("utf-8")) for x in stops) + 8  # every token decodes to >= 1 byte

        def check(token_ids: list[int]) -> Optional[str]:
            text = tok.decode(token_ids[-window:], skip_special_tokens=True)
            hits = [(text.find(x), x) for x in stops if x in text]
            return min(hits)[1] if hits else None

        return check

    def _prefill(self, seqs: list[Sequence]) -> int:
        t0 = time.perf_counter()
        self.strategy.before_prefill(seqs)
        logits = self.runner.prefill([s.slot for s in seqs], [s.prompt_token_ids for s in seqs])
        self.strategy.on_admit(seqs)
        tokens, logprobs = sample_rows(seqs, logits)
        produced = sum(s.append([t], [lp]) for s, t, lp in zip(seqs, tokens, logprobs))
        self.stats.add_prefill(time.perf_counter() - t0, produced)
        return produced

    def _release(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self.strategy.on_release(seq)
            self.runner.free(seq.slot)
            seq.slot = -1
