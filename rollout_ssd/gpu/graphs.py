"""Static-shape forwards per batch bucket, captured as CUDA graphs where the device allows.

An eager forward (`Decoder.forward`) picks its shape from the batch: the read length, a contiguous
block write or a gather, a mask or none. A CUDA graph needs the opposite: fixed shapes and fixed
buffer addresses, with the data changing in place between replays. A `StaticStep` is one such shape:
`rows` (a batch bucket) x `t` new tokens, whose keys are described to the attention backend from
device tensors only (the rows' slots and write positions: `KeyLayout` over every slot's whole cache),
so nothing about it depends on the batch's values.

`GraphedSteps` holds one `StaticStep` per (bucket, t) and routes a call to the smallest bucket that
holds the batch; unused rows write into the KV cache's scratch slot and are dropped from the output.
On CUDA each step is captured once (warm-up on a side stream, then `torch.cuda.graph`, all buckets
sharing one memory pool, largest first as in nano-vllm) and replayed; on a CPU the same function runs
eagerly, which is how its results are tested against `Decoder.forward`, or, with `compiled`
(EngineConfig.compile), as one inductor graph per step: there the per-op cost of ~120 small calls per
eager step goes, and attention reads only the used cache length (the one dynamic size). Two kinds:
- "frozen": the weights folded into the graph as constants, packed by inductor, the batch-1 GEMMs on
  its C++ templates where they measure faster (a bf16 model's linears of at most `rows_kernel_rows()` rows
  on the bf16 rows kernel where it runs, over its copies, held by the graph): the fastest step, for fixed
  weights. A write to any weight turns the frozen steps into live ones (compiled anew, once);
- "live": the weights stay the graph's inputs, so a step follows every update (RL) with no recompile;
  bf16 linears run cpu_backend's kernels (the bf16 rows kernel, oneDNN's packed linear) as ops over
  copies `cpu_backend.pack_live` repacks after a write, a one-row linear as a reduction inductor fuses
  where the rows kernel does not run (F.linear where the CPU has no native bf16).
Compiled steps run one at a time in a process (`_COMPILED`): inductor's options and the live flag they
are compiled under are process-wide.

Costs of the static form under SDPA: attention reads the full `max_len` of each slot (masked) and
gathers the batch's slots per layer, so it pays off where launch overhead dominates (small batches,
short contexts). Under the Triton backend (EngineConfig.attention) each query reads only its own keys
[0, start + j + 1) of its slot, from spans built on the device: no gather and no masked tail.
"""

from __future__ import annotations

import logging
import threading
import types
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from rollout_ssd.config import COMPILE
from rollout_ssd.gpu.devices import CUDA_CAPTURE_LOCK
from rollout_ssd.gpu.inductor import compile_options, guard_filter
from rollout_ssd.kv_cache import KVCache
from rollout_ssd.models.attention import KeyLayout
from rollout_ssd.models.cpu_backend import live_steps, pack_live
from rollout_ssd.models.decoder import Decoder, rms_norm

log = logging.getLogger(__name__)

BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MAX_STEP_TOKENS = 16  # new tokens per row a static step takes: decode (1) and verify (K+1)


def bucket_for(batch: int, buckets: Sequence[int] = BUCKETS) -> int:
    """The smallest bucket holding `batch` rows (ValueError beyond the largest)."""
    if batch < 1:
        raise ValueError(f"a step needs at least one row, got {batch}")
    for size in sorted(buckets):
        if size >= batch:
            return size
    raise ValueError(f"batch {batch} exceeds the largest graph bucket {max(buckets)}")


@dataclass(frozen=True)
class StepKey:
    rows: int
    t: int
    last_only: bool = True
    threads: int = 0  # a compiled step's thread count (inductor fixes it at compile time); 0: not compiled
    head_only: bool = False  # logits over the LM head's rows (a draft's restricted head)


class StaticStep:
    """A forward of `rows` x `t` new tokens over `cache` with persistent inputs (see module doc).

    Inputs (written in place by `load`): tokens, positions [rows, t]; slot [rows] (padded rows: the
    scratch slot); start [rows] (cache length before the step). Output: float32 logits [rows, t, V] or,
    with last_only, [rows, V] at position t - 1; with head_only, over the LM head's rows
    (`Decoder.head_logits`: a draft's restricted head) rather than the vocabulary."""

    def __init__(self, model: Decoder, cache: KVCache, rows: int, t: int, last_only: bool = True,
                 head_only: bool = False):
        if t < 1 or rows < 1:
            raise ValueError(f"StaticStep needs rows >= 1 and t >= 1, got {rows}, {t}")
        if t > cache.max_len:
            raise ValueError(f"StaticStep t={t} exceeds the cache length {cache.max_len}")
        device = model.embed.device
        self.model, self.cache, self.rows, self.t, self.last_only = model, cache, rows, t, last_only
        self.head_only = head_only
        self.tokens = torch.zeros(rows, t, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, t, dtype=torch.long, device=device)
        self.slot = torch.full((rows,), cache.scratch_slot, dtype=torch.long, device=device)
        self.output: Optional[torch.Tensor] = None
        self.graph = None  # a torch.cuda.CUDAGraph once captured
        self.compiled = None  # `forward` compiled by inductor (CPU: `compile`)
        self.mode: Optional[str] = None  # "frozen" | "live": how the compiled step holds the weights
        self._modules: list = []  # a live step's model modules, listed once (`weights_key`)
        self._packed_for: Optional[tuple] = None  # the weights a live step's packed copies were made for; frozen: ()
        self.ran = False  # whether `run` has completed once (a compiled step's compile is in its first run)

    def load(self, slots: Sequence[int], tokens: Sequence[Sequence[int]], starts: Sequence[int]) -> None:
        """Copy one batch (len(slots) <= rows, each row exactly t tokens) into the static inputs."""
        b = len(slots)
        if b > self.rows or any(len(row) != self.t for row in tokens):
            raise ValueError(f"a {self.rows}x{self.t} step got {b} rows of lengths {[len(r) for r in tokens]}")
        if any(s + self.t > self.cache.max_len for s in starts):
            raise ValueError(f"a step would write past the KV cache length {self.cache.max_len}")
        host = torch.zeros(3, self.rows, self.t, dtype=torch.long)
        host[0, :b] = torch.as_tensor([list(r) for r in tokens], dtype=torch.long)
        host[1, :b] = torch.as_tensor(list(starts), dtype=torch.long)[:, None] + torch.arange(self.t)
        host[1, b:] = torch.arange(self.t)
        host[2, :, 0] = self.cache.scratch_slot
        host[2, :b, 0] = torch.as_tensor(list(slots), dtype=torch.long)
        host = host.to(self.tokens.device, non_blocking=True)
        self.tokens.copy_(host[0])
        self.positions.copy_(host[1])
        self.slot.copy_(host[2, :, 0])

    def forward(self) -> torch.Tensor:
        """The step on the current inputs (what a graph captures). Writes K/V; leaves `cache.lengths`
        to the caller."""
        return self.step(self.tokens, self.positions, self.slot, self.cache.keys, self.cache.values,
                         self.cache.max_len)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor, k_caches: list,
             v_caches: list, read_len) -> torch.Tensor:
        """`forward` over explicit tensors (a compiled step must receive every tensor it writes or that
        changes between calls as an input: read through the object, freezing would fold them in as
        constants). read_len: how far into the cache attention reads."""
        model = self.model
        write_pos = positions  # [R, T]: row r's new tokens go to start[r] + j
        write_slot = slot[:, None].expand(-1, self.t)
        layout = KeyLayout(slot, False, read_len, write_pos, None, None, None, slot.device)
        keys = model.backend.prepare(layout)  # causal: query j of row r sees [0, start[r] + j + 1)
        x = torch.nn.functional.embedding(tokens, model.embed)
        cos, signed_sin = model.rope_tables(positions)
        for layer, kc, vc in zip(model.layers, k_caches, v_caches):

            def attend(q, k, v, kc=kc, vc=vc):
                kc[write_slot, :, write_pos] = k
                vc[write_slot, :, write_pos] = v
                return model.backend(q, kc, vc, keys, model.scale)

            x = layer(x, cos, signed_sin, attend)
        hidden = rms_norm(x, model.norm, model.cfg.rms_norm_eps)
        if self.last_only:
            hidden = hidden[:, -1]
        return model.head_logits(hidden) if self.head_only else model.logits(hidden)

    def capture(self, pool=None) -> None:
        """Capture `forward` as a CUDA graph (CUDA only): warm up on a side stream, then record."""
        if self.tokens.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        with CUDA_CAPTURE_LOCK:  # no other thread's CUDA work while capturing (devices.CUDA_CAPTURE_LOCK)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.inference_mode(), torch.cuda.stream(stream):
                for _ in range(2):
                    self.forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
                self.output = self.forward()
        self.graph = graph

    def compile(self, mode: str = "frozen") -> None:
        """Compile `forward` with inductor (CPU) as one graph (`compile_options`); the compile itself
        runs on the first `run`. mode "frozen": the weights folded in as constants (module docstring);
        the graph holds its own copies of the weights, so `GraphedSteps` drops it once any weight is
        written. mode "live": the weights are read on every call (the bf16 linears through
        `cpu_backend.pack_live`'s copies).
        Each step compiles its own copy of the module's code: dynamo keeps its graphs per code object and
        does not guard the weights' content (nor, frozen, their identity: `guard_filter`), so a step sharing
        the code would reuse another step's graph (a dynamic row count serves every bucket), stale weights
        included, and keep it alive."""
        if mode not in COMPILE:
            raise ValueError(f"compile mode must be one of {COMPILE}, got {mode!r}")
        name = f"{mode}_{self.rows}x{self.t}"
        code = _StepModule.forward.__code__.replace(co_name=f"step_{name}")
        own = type(f"_Step_{name}", (_StepModule,),
                   {"forward": types.FunctionType(code, _StepModule.forward.__globals__)})
        guards = guard_filter(mode)
        self.compiled = torch.compile(own(self), fullgraph=True, options=guards and {"guard_filter_fn": guards})
        self.mode = mode
        self._modules = list(self.model.modules()) if mode == "live" else []

    @torch.inference_mode()
    def run(self, read_len: Optional[int] = None) -> torch.Tensor:
        """The step on the loaded inputs. read_len (a compiled step): the cache length attention must
        read, the loaded rows' start + t at most; one compiled graph serves every length (dynamic)."""
        if self.graph is not None:
            self.graph.replay()
            return self.output
        if self.compiled is not None:
            read = torch.empty(self.cache.max_len if read_len is None else read_len, dtype=torch.int8)
            torch._dynamo.mark_dynamic(read, 0)
            # inductor reads these at compile time, which is inside a call (the first, or the recompile
            # for a read length of 1: dynamo specialises sizes 0 and 1; each step's own code object
            # holds its graphs, far below dynamo's limit per code object);
            # torch.compile's `options` did not reach freezing in this torch (2.13): the step then ran
            # unfrozen, no faster than eager
            live = self.mode == "live"
            with _COMPILED:
                # packed copies remade where a weight was written since (the key: 3x cheaper to check);
                # frozen: the rows kernel's copies listed once, before the first trace reads them
                key = weights_key(self._modules) if live else ()
                if key != self._packed_for:
                    pack_live(self.model)
                    self._packed_for = key
                with torch._inductor.config.patch(compile_options(self.t, self.mode)), live_steps(live):
                    return self.compiled(read, self.tokens, self.positions, self.slot, self.cache.keys,
                                         self.cache.values)
        return self.forward()


# Held around every compiled step's call: inductor's config patch and cpu_backend's live flag are
# process-wide, so two engines' steps on two threads must not interleave (one step's options would be
# another's compile). A re-entrant lock: uncontended, it costs next to nothing per step.
_COMPILED = threading.RLock()


class _StepModule(torch.nn.Module):
    """A step as a module holding the model: what inductor's freezing needs to see the weights as the
    graph's parameters (folded in as constants), rather than as inputs read through a plain object."""

    def __init__(self, step: StaticStep):
        super().__init__()
        self.model = step.model
        self.step = [step]  # not a submodule: the step's buffers are inputs, the model's weights parameters

    def forward(self, read, tokens, positions, slot, k_caches, v_caches) -> torch.Tensor:
        return self.step[0].step(tokens, positions, slot, k_caches, v_caches, read.shape[0])


def compile_mode(compiled) -> Optional[str]:
    """GraphedSteps' `compiled` (EngineConfig.compile's values) as None, "frozen" or "live": False and
    None are not compiled, True is "frozen"."""
    if compiled is None or compiled is False:
        return None
    if compiled is True:
        return "frozen"
    if compiled not in COMPILE:
        raise ValueError(f"compiled must be a bool or one of {COMPILE}, got {compiled!r}")
    return compiled


def weights_key(modules: list) -> tuple:
    """Every parameter and buffer of these modules (a model's `modules()`, listed once: walking the module
    tree on every step costs several times more: a probe in git history, bench/weights_check_cost.py) by identity, storage and
    version counter, and each module's children by identity: an in-place write or a replacement of a
    parameter or buffer, or a submodule replaced, changes it."""
    return tuple((id(t), t.data_ptr(), t._version) for m in modules
                 for t in (*m._parameters.values(), *m._buffers.values()) if t is not None) + \
        tuple(id(c) for m in modules for c in m._modules.values())


class GraphedSteps:
    """Static steps per (bucket, t) over one model and cache; `run` routes a batch to its bucket.

    graphs: capture on CUDA (None = capture exactly when the model is on a CUDA device). compiled (CPU):
    compile each step (`StaticStep.compile`), "frozen" (True) or "live"; a write to any weight turns
    frozen steps into live ones. pad_t: rows of 2..pad_t new tokens, ragged or not (a
    verify of chains that stopped early), run as one pad_t-token step, each row padded with copies of
    its last token: a compiled shape per bucket for every verify, at the cost of computing the padding.
    A padded query is causal like the others, so the rows' own queries see exactly what they would
    unpadded; the padding's K/V land past the row's length, where the next forward overwrites them. A
    step is built (and captured) on first use, or up front with `prepare`."""

    def __init__(self, model: Decoder, cache: KVCache, buckets: Sequence[int] = BUCKETS,
                 graphs: Optional[bool] = None, compiled=False, pad_t: Optional[int] = None):
        if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(f"graph buckets must be positive integers, got {tuple(buckets)!r}")
        on_cuda = model.embed.device.type == "cuda"
        if graphs and not on_cuda:
            raise ValueError("graphs=True needs the model on a CUDA device")
        compiled = compile_mode(compiled)
        if compiled and on_cuda:
            raise ValueError("compiled steps are for a CPU model; on CUDA, steps are captured as graphs")
        if pad_t is not None and not 2 <= pad_t <= MAX_STEP_TOKENS:
            raise ValueError(f"pad_t must be in [2, {MAX_STEP_TOKENS}], got {pad_t!r}")
        self.model, self.cache = model, cache
        self.buckets = tuple(sorted(set(buckets)))
        self.graphs = on_cuda if graphs is None else graphs
        self.compiled, self.pad_t = compiled, pad_t
        self.retired = False  # compiled steps given up (a compile failed)
        self.steps: dict[StepKey, StaticStep] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._modules = list(model.modules()) if compiled == "frozen" else []
        self._weights = weights_key(self._modules)  # what the frozen steps fold in

    def _retire(self, why: str) -> None:
        """Drop every compiled step and leave every forward to the runner's eager path from now on."""
        log.warning("compiled steps dropped (%s): the engine runs eagerly from now on", why)
        self.retired, self.steps = True, {}

    def _thaw(self) -> None:
        """A weight was written under frozen steps (their graphs hold the old weights): drop them, and
        compile live steps from now on (they follow every later write)."""
        log.warning("the model's weights changed: frozen compiled steps dropped, live ones compile from now on")
        self.compiled, self.steps, self._modules = "live", {}, []

    def prepare(self, t: int, buckets: Optional[Sequence[int]] = None) -> None:
        """Build (and capture) the steps of `t` tokens for these buckets, largest first so smaller
        graphs reuse the largest one's pool."""
        for rows in sorted(buckets or self.buckets, reverse=True):
            self._step(StepKey(rows, t))

    def _step(self, key: StepKey) -> StaticStep:
        step = self.steps.get(key)
        if step is None:
            step = StaticStep(self.model, self.cache, key.rows, key.t, last_only=key.last_only,
                              head_only=key.head_only)
            if self.graphs:
                step.capture(self._pool)
            elif self.compiled:
                log.info("compiling the %s %dx%d step (inductor, on its first run)", self.compiled, key.rows, key.t)
                step.compile(self.compiled)
            self.steps[key] = step
        return step

    def fits(self, batch: int, t: int) -> bool:
        """Whether a batch of `batch` rows of `t` new tokens has a step here: a bucket holds it, and t is a
        decode or verify length (a prefill's length varies per call: a graph per length would not pay)."""
        return 1 <= batch <= self.buckets[-1] and 1 <= t <= min(MAX_STEP_TOKENS, self.cache.max_len)

    def step_tokens(self, slots: Sequence[int], num_new: Sequence[int]) -> Optional[int]:
        """The t of the step that runs rows of these lengths (pad_t for padded rows), None where none
        does: ragged rows without padding, a padded step that would write past the cache, and (compiled)
        any length but 1 and pad_t, and every row once a compile failed (`retired`). Frozen: a weight
        written since the steps were made turns them into live steps (`_thaw`)."""
        if self.retired:
            return None
        if self.compiled == "frozen" and weights_key(self._modules) != self._weights:
            self._thaw()
        t = max(num_new)
        if self.pad_t is not None and 1 < t <= self.pad_t:
            t = self.pad_t
            if any(self.cache.lengths[s] + t > self.cache.max_len for s in slots):
                return None
        elif min(num_new) != t or (self.compiled and t != 1):  # compiled: decode and pad_t only (a compile
            return None                                         # per other length would cost minutes)
        return t if self.fits(len(slots), t) else None

    def run(self, slots: Sequence[int], tokens: Sequence[Sequence[int]], last_only: bool = True,
            head_only: bool = False, t: Optional[int] = None) -> Optional[torch.Tensor]:
        """Append tokens[b] to slot b (rows of one length, or rows `pad_t` covers); returns logits [B, V]
        at each row's last new token ([B, T, V] with last_only=False, T the longest row), and advances
        the cache lengths as `ModelRunner.extend` does. t: `step_tokens`' answer, when the caller has it.
        None (nothing advanced) where a step's compile failed: the compiled steps are retired and the
        caller runs the forward eagerly."""
        if not slots:
            raise ValueError("a step needs at least one row")
        num_new = [len(row) for row in tokens]
        if t is None:
            t = self.step_tokens(slots, num_new) if min(num_new) >= 1 else None
        if t is None:
            raise ValueError(f"no static step for {len(slots)} rows of {num_new} tokens (buckets "
                             f"{self.buckets}, at most {MAX_STEP_TOKENS} tokens, padding to {self.pad_t})")
        padded = any(n != t for n in num_new)
        starts = [self.cache.lengths[s] for s in slots]
        # a compiled step per thread count: on a CPU beside an SSD worker the target runs on one core in
        # SSD rounds and on every core in the others (ssd/cores.py)
        threads = torch.get_num_threads() if self.compiled else 0
        step = self._step(StepKey(bucket_for(len(slots), self.buckets), t, last_only and not padded, threads,
                                  head_only))
        step.load(slots, [list(row) + [row[-1]] * (t - len(row)) for row in tokens], starts)
        try:
            logits = step.run(max(starts) + t)[: len(slots)]
        except Exception as err:  # noqa: BLE001 (a compile's failure: no C++ compiler, an inductor error)
            if step.compiled is None or step.ran:
                raise
            self._retire(f"compiling the {step.rows}x{step.t} step failed: {type(err).__name__}: {err}")
            return None
        step.ran = True
        for slot, start, n in zip(slots, starts, num_new):
            self.cache.lengths[slot] = start + n
        if padded:
            rows = torch.arange(len(slots), device=logits.device)
            logits = logits[rows, torch.tensor(num_new, device=logits.device) - 1] if last_only \
                else logits[:, :max(num_new)]
        return logits.clone() if step.graph is not None else logits
