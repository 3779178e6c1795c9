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
eagerly, which is how its results are tested against `Decoder.forward`.

Costs of the static form under SDPA: attention reads the full `max_len` of each slot (masked) and
gathers the batch's slots per layer, so it pays off where launch overhead dominates (small batches,
short contexts). Under the Triton backend (EngineConfig.attention) each query reads only its own keys
[0, start + j + 1) of its slot, from spans built on the device: no gather and no masked tail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from rollout_ssd.kv_cache import KVCache
from rollout_ssd.models.attention import KeyLayout
from rollout_ssd.models.decoder import Decoder, rms_norm

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


class StaticStep:
    """A forward of `rows` x `t` new tokens over `cache` with persistent inputs (see module doc).

    Inputs (written in place by `load`): tokens, positions [rows, t]; slot [rows] (padded rows: the
    scratch slot); start [rows] (cache length before the step). Output: float32 logits [rows, t, V] or,
    with last_only, [rows, V] at position t - 1."""

    def __init__(self, model: Decoder, cache: KVCache, rows: int, t: int, last_only: bool = True):
        if t < 1 or rows < 1:
            raise ValueError(f"StaticStep needs rows >= 1 and t >= 1, got {rows}, {t}")
        if t > cache.max_len:
            raise ValueError(f"StaticStep t={t} exceeds the cache length {cache.max_len}")
        device = model.embed.device
        self.model, self.cache, self.rows, self.t, self.last_only = model, cache, rows, t, last_only
        self.tokens = torch.zeros(rows, t, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, t, dtype=torch.long, device=device)
        self.slot = torch.full((rows,), cache.scratch_slot, dtype=torch.long, device=device)
        self.output: Optional[torch.Tensor] = None
        self.graph = None  # a torch.cuda.CUDAGraph once captured

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
        model = self.model
        write_pos = self.positions  # [R, T]: row r's new tokens go to start[r] + j
        write_slot = self.slot[:, None].expand(-1, self.t)
        layout = KeyLayout(self.slot, False, self.cache.max_len, write_pos, None, None, None, self.slot.device)
        keys = model.backend.prepare(layout)  # causal: query j of row r sees [0, start[r] + j + 1)
        x = torch.nn.functional.embedding(self.tokens, model.embed)
        cos, signed_sin = model.rope_tables(self.positions)
        for i, layer in enumerate(model.layers):
            kc, vc = self.cache.keys[i], self.cache.values[i]

            def attend(q, k, v, kc=kc, vc=vc):
                kc[write_slot, :, write_pos] = k
                vc[write_slot, :, write_pos] = v
                return model.backend(q, kc, vc, keys, model.scale)

            x = layer(x, cos, signed_sin, attend)
        hidden = rms_norm(x, model.norm, model.cfg.rms_norm_eps)
        if self.last_only:
            hidden = hidden[:, -1]
        return model.logits(hidden)

    def capture(self, pool=None) -> None:
        """Capture `forward` as a CUDA graph (CUDA only): warm up on a side stream, then record."""
        if self.tokens.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
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

    @torch.inference_mode()
    def run(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
            return self.output
        return self.forward()


class GraphedSteps:
    """Static steps per (bucket, t) over one model and cache; `run` routes a batch to its bucket.

    graphs: capture on CUDA (None = capture exactly when the model is on a CUDA device). A step is
    built (and captured) on first use, or up front with `prepare`."""

    def __init__(self, model: Decoder, cache: KVCache, buckets: Sequence[int] = BUCKETS,
                 graphs: Optional[bool] = None):
        if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(f"graph buckets must be positive integers, got {tuple(buckets)!r}")
        on_cuda = model.embed.device.type == "cuda"
        if graphs and not on_cuda:
            raise ValueError("graphs=True needs the model on a CUDA device")
        self.model, self.cache = model, cache
        self.buckets = tuple(sorted(set(buckets)))
        self.graphs = on_cuda if graphs is None else graphs
        self.steps: dict[StepKey, StaticStep] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None

    def prepare(self, t: int, buckets: Optional[Sequence[int]] = None) -> None:
        """Build (and capture) the steps of `t` tokens for these buckets, largest first so smaller
        graphs reuse the largest one's pool."""
        for rows in sorted(buckets or self.buckets, reverse=True):
            self._step(StepKey(rows, t))

    def _step(self, key: StepKey) -> StaticStep:
        step = self.steps.get(key)
        if step is None:
            step = StaticStep(self.model, self.cache, key.rows, key.t, last_only=key.last_only)
            if self.graphs:
                step.capture(self._pool)
            self.steps[key] = step
        return step

    def fits(self, batch: int, t: int) -> bool:
        """Whether a batch of `batch` rows of `t` new tokens has a step here: a bucket holds it, and t is a
        decode or verify length (a prefill's length varies per call: a graph per length would not pay)."""
        return 1 <= batch <= self.buckets[-1] and 1 <= t <= min(MAX_STEP_TOKENS, self.cache.max_len)

    def run(self, slots: Sequence[int], tokens: Sequence[Sequence[int]], last_only: bool = True) -> torch.Tensor:
        """Append tokens[b] (all rows the same length t) to slot b; returns logits [B, V] at each
        row's last new token ([B, t, V] with last_only=False), and advances the cache lengths as
        `ModelRunner.extend` does."""
        if not slots:
            raise ValueError("a step needs at least one row")
        t = len(tokens[0])
        if not self.fits(len(slots), t):
            raise ValueError(f"no static step for {len(slots)} rows of {t} tokens (buckets {self.buckets}, "
                             f"at most {MAX_STEP_TOKENS} tokens)")
        starts = [self.cache.lengths[s] for s in slots]
        step = self._step(StepKey(bucket_for(len(slots), self.buckets), t, last_only))
        step.load(slots, tokens, starts)
        logits = step.run()[: len(slots)]
        for slot, start in zip(slots, starts):
            self.cache.lengths[slot] = start + t
        return logits.clone() if step.graph is not None else logits
