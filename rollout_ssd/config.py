"""Engine-level configs: small frozen dataclasses, validated on construction."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Optional, Union

from rollout_ssd.ssd.config import SSDConfig

METHODS = ("ar", "sd", "ssd")
SPECULATORS = ("draft", "suffix", "random")  # what drafts: the draft model, suffix matching, random tokens


def reject_unknown(cls, options: dict) -> None:
    """Raise a ValueError naming options that `cls` does not have (never drop them silently)."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"{cls.__name__} has no option(s) {unknown}; known: {sorted(known)}")


def require_positive_ints(config, names, label: Optional[str] = None) -> None:
    """Raise a ValueError naming the first of `names` (fields of `config`) that is not an integer >= 1
    (a bool is not an integer here). label: the prefix of the name in the message (default: the class)."""
    label = type(config).__name__ if label is None else label
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{label}.{name} must be an integer >= 1, got {value!r}")


_SSD = {f.name: f.default for f in fields(SSDConfig)}  # the SSD knobs' defaults (SSDConfig owns them)


@dataclass(frozen=True)
class SpecConfig:
    """How to speculate. method "ar" (none), "sd" (speculative decoding) or "ssd" (SSD).

    k: draft tokens per round. speculator (SD): what proposes ("draft" = the draft model,
    "suffix" = suffix/n-gram matching over the prompt, the sequence and its siblings, "random").
    stop_prob (SD, draft model): a sequence's chain ends before k tokens once the draft drew a token
    it gave probability below stop_prob (greedy: its T=1 softmax); 0 always drafts k. Lossless for
    any value (the draft alone decides the length). A larger k then costs little when the draft is
    unsure (measured: bench/RESULTS.md).
    SSD knobs (method "ssd"; meaning, defaults and validation: `rollout_ssd.ssd.config.SSDConfig`, whose
    defaults these fields read, k and stop_prob included): fanout (None = Theorem 12 from live estimates,
    or a manual F_0..F_k), budget, max_budget, C (Saguaro, or "adaptive"), c_min, backup ("neural" = the draft model on demand,
    "suffix", "random"), strategy_rule (pick SSD/SD/suffix/AR per batch by Theorem 17), hysteresis,
    switch_after, decide_after, decide_margin, worker (the draft side concurrent with the target: its
    own process on a CPU, its own thread and CUDA stream on a GPU), worker_timeout, startup_timeout,
    pin_cores, fallback ("sd" | "ar"), max_restarts, draft_device (where the draft side runs: None = the
    device of the draft model handed to the engine; `from_pretrained` picks the next GPU, or the target's
    own GPU when there is one), rule_cache (SSD: where the strategy rule keeps what it measured on this
    machine so that a new engine starts from it, `rollout_ssd.ssd.rule_cache`: True = $ROLLOUT_SSD_CACHE/rule,
    a directory, or False = every engine measures anew).
    """

    method: str = "ar"
    k: int = _SSD["k"]
    speculator: str = "draft"
    stop_prob: float = _SSD["stop_prob"]
    fanout: Optional[tuple[int, ...]] = _SSD["fanout"]
    budget: Optional[int] = _SSD["budget"]
    max_budget: int = _SSD["max_budget"]
    C: Union[float, str] = _SSD["C"]
    c_min: float = _SSD["c_min"]
    backup: str = _SSD["backup"]
    strategy_rule: bool = _SSD["strategy_rule"]
    hysteresis: float = _SSD["hysteresis"]
    switch_after: int = _SSD["switch_after"]
    decide_after: int = _SSD["decide_after"]
    decide_margin: float = _SSD["decide_margin"]
    worker: bool = _SSD["worker"]
    worker_timeout: float = _SSD["worker_timeout"]
    startup_timeout: float = _SSD["startup_timeout"]
    pin_cores: bool = _SSD["pin_cores"]
    fallback: str = _SSD["fallback"]
    max_restarts: int = _SSD["max_restarts"]
    draft_device: Optional[str] = _SSD["draft_device"]
    rule_cache: Union[bool, str, os.PathLike] = _SSD["rule_cache"]

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"SpecConfig.method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ValueError(f"SpecConfig.k must be an integer >= 1, got {self.k!r}")
        if isinstance(self.stop_prob, bool) or not isinstance(self.stop_prob, (int, float)) \
                or not 0.0 <= self.stop_prob < 1.0:
            raise ValueError(f"SpecConfig.stop_prob must be a number in [0, 1), got {self.stop_prob!r}")
        if self.speculator not in SPECULATORS:
            raise ValueError(f"SpecConfig.speculator must be one of {SPECULATORS}, got {self.speculator!r}")
        if self.method == "ssd":
            self.ssd_config()  # validates the SSD knobs now, naming the field

    def ssd_config(self):
        """The SSD knobs as an SSDConfig (every SSDConfig field is a SpecConfig field of the same name)."""
        try:
            return SSDConfig(**{f.name: getattr(self, f.name) for f in fields(SSDConfig)})
        except ValueError as err:
            raise ValueError(str(err).replace("SSDConfig.", "SpecConfig.")) from None


ATTENTION = ("auto", "sdpa", "triton")
ADMISSION = ("fair", "fifo")  # EngineConfig.admission's policies (rollout_ssd/admission.py)
COMPILE = ("frozen", "live")  # EngineConfig.compile's modes (rollout_ssd/gpu/graphs.py)


CPU_MAX_BATCH = 128  # EngineConfig.max_batch_size=None on a CPU ...
CPU_KV_MEMORY_SHARE = 0.5  # ... as far as this share of the memory available holds their KV at full length
GPU_MAX_BATCH = 32  # ... and on a GPU (then lowered to what its free memory holds)


@dataclass(frozen=True)
class EngineConfig:
    """Batching, memory and the GPU path. max_batch_size: sequences decoded together (= KV slots, fewer
    when the memory limits below say so); None (the default): CPU_MAX_BATCH on a CPU, fewer where
    CPU_KV_MEMORY_SHARE of the memory available would not hold their KV at max_model_len (a CPU step of
    128 rows costs far less than four of 32: bench/RESULTS.md, "The layer kernel's arithmetic on every
    thread"), GPU_MAX_BATCH on a GPU.
    max_model_len: prompt + generated tokens per sequence (default: the model's context, capped at 2048).
    kv_cache_bytes: optional cap on the KV cache; max_batch_size is lowered to fit under it.
    gpu_memory_utilization: used when the target is on a CUDA device and kv_cache_bytes is None: the KV
    cache gets what the GPU has free once the weights are placed, so that at most this fraction of the
    GPU's total memory is in use, less a reserve for the forwards' buffers (rollout_ssd/gpu/memory.py);
    max_batch_size is lowered to fit, and a ValueError names this knob when not one sequence fits.
    cuda_graphs: decode and verify steps of equal-length rows run as static-shape steps per batch bucket
    (rollout_ssd/gpu/graphs.py), captured as CUDA graphs on a CUDA device; on a CPU they run eagerly
    (correct, and slower than the default path: for tests).
    compile: (CPU target) decode and verify steps of the target and of SD's draft run as static-shape
    steps compiled by inductor (rollout_ssd/gpu/graphs.py, `StaticStep.compile`; verify rows padded to
    k + 1 tokens so that one shape per batch bucket serves every verify). False: not compiled (where the
    one-call layer kernel runs, bf16 on AVX-512, the eager steps are the faster: kernels/layer_kernel.py);
    "frozen" (or True): the weights folded into the graphs, the fastest compiled steps, for fixed weights
    (offline generation, evaluation, serving): a write to a model's weights (an update) turns its steps into live
    ones, compiled anew; "live": the weights stay the graphs' inputs, so the steps follow every update
    with no recompile (RL at small, latency-bound batches). Each shape compiles on first use, which
    takes a minute or more on a small CPU. A compile that fails leaves the forwards eager. On CUDA use
    cuda_graphs.
    attention: the attention backend of the models the engine runs (models/attention.py): "sdpa"
    (PyTorch SDPA with a dense visibility mask), "triton" (the span-based Triton kernel for decode,
    verify and SSD's tree steps; prefill stays on SDPA), or "auto" (triton for a CUDA target with
    cuda_graphs, where it measured faster on an H200; sdpa otherwise: `attention.auto_attention`). "triton" on a CPU runs under
    Triton's interpreter only (TRITON_INTERPRET=1 set before triton is first imported: for tests), and
    is a ValueError otherwise.
    admission: which waiting sequences get free KV slots (rollout_ssd/admission.py): "fair" (round-robin
    over requests: the request holding the fewest running sequences first) or "fifo" (arrival order).
    reserved_slots (fair only): the last this many free slots go only to requests holding none yet, so a
    newcomer starts within a round while large requests run; an integer >= 0, or "auto" (one slot in
    16, at least one). A single request (one `sample` call) is admitted the same under every setting,
    and a seeded request gets the same tokens whatever else runs.
    max_round_rows: the most running sequences one round steps (rollout_ssd/round_budget.py: those that
    waited longest); bounds a newcomer's wait for the round in flight at some cost in a large batch's
    throughput. None: every running sequence steps every round."""

    max_batch_size: Optional[int] = None
    max_model_len: Optional[int] = None
    kv_cache_bytes: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    cuda_graphs: bool = False
    attention: str = "auto"
    compile: Union[bool, str] = False
    admission: str = "fair"
    reserved_slots: Union[int, str] = 0
    max_round_rows: Optional[int] = None

    def __post_init__(self):
        if self.max_batch_size is not None and (not isinstance(self.max_batch_size, int) or isinstance(
                self.max_batch_size, bool) or self.max_batch_size < 1):
            raise ValueError(f"EngineConfig.max_batch_size must be an integer >= 1 or None, got {self.max_batch_size!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"EngineConfig.max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.kv_cache_bytes is not None and (not isinstance(self.kv_cache_bytes, int) or self.kv_cache_bytes < 1):
            raise ValueError(f"EngineConfig.kv_cache_bytes must be a positive integer, got {self.kv_cache_bytes!r}")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0.0 < util <= 1.0:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be a number in (0, 1], got {util!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"EngineConfig.cuda_graphs must be a bool, got {self.cuda_graphs!r}")
        if not isinstance(self.compile, bool) and self.compile not in COMPILE:
            raise ValueError(f"EngineConfig.compile must be a bool, {COMPILE[0]!r} or {COMPILE[1]!r}, "
                             f"got {self.compile!r}")
        if self.compile and self.cuda_graphs:
            raise ValueError("EngineConfig.compile and cuda_graphs exclude each other (compile: CPU; graphs: CUDA)")
        if self.admission not in ADMISSION:
            raise ValueError(f"EngineConfig.admission must be one of {ADMISSION}, got {self.admission!r}")
        r = self.reserved_slots
        if r != "auto" and (not isinstance(r, int) or isinstance(r, bool) or r < 0):
            raise ValueError(f"EngineConfig.reserved_slots must be an integer >= 0 or 'auto', got {r!r}")
        m = self.max_round_rows
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"EngineConfig.max_round_rows must be an integer >= 1 or None, got {m!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"EngineConfig.attention must be one of {ATTENTION}, got {self.attention!r}")
