"""SSDConfig: every knob of speculative speculative decoding, in one small frozen dataclass.

The public surface is `SpecConfig` (rollout_ssd/config.py): every field here is a SpecConfig field of
the same name, whose default SpecConfig reads from here, so the two cannot drift. This module imports
nothing of the package: config.py imports it, never the other way.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

BACKUPS = ("neural", "suffix", "random")  # "neural": the draft model drafts a chain on a miss
FALLBACKS = ("sd", "ar")


@dataclass(frozen=True)
class SSDConfig:
    """How SSD runs (docs/THEORY.md §2-3).

    k: draft tokens per chain. fanout: manual F_0..F_k (the reference engine's hand-set fan-out), or
    None for the Theorem 12 planner (`FanoutPlanner`) with budget B = `budget` if set, else sized from
    timings within [k+1, max_budget]. C: Saguaro constant in (0, 1] (1 = plain draft sampling) or
    "adaptive" (per-context C from the draft's entropy, `adaptive_c`, floor c_min).
    backup: what covers a cache miss: "neural" (the draft model on demand), "suffix" or "random" (a
    fast speculator passed to SSDDecode). strategy_rule: pick per batch among ssd+neural, ssd+<fast>, sd,
    suffix, ar from live estimates (`StrategyRule`); off = always "ssd+<backup>". hysteresis: the rule
    keeps its current strategy unless another scores this fraction higher (two strategies within
    the estimates' noise would otherwise swap back and forth, each swap costing a cold round), and
    only once it has scored higher on switch_after decisions in a row (one slow round cannot move it).
    decide_after: timed SSD rounds the rule measures at a batch size before it decides there (after one
    timed AR round and one of SD: ssd/chooser.py; a decision on one round's timings, noisy on a shared
    CPU (bench/RESULTS.md), could settle on a plan after which the others are measured only by probes);
    SSD is measured for fewer when its first timed rounds score decide_margin (a fraction) below the
    best other plan, beyond that noise. With the rule off, the first decide_after speculating rounds
    run the default as before the fixed plan.
    worker: run the draft in its own process (its own core on a CPU, pinned when pin_cores). worker_timeout:
    seconds a reply may take before the worker is declared dead; startup_timeout: the same for start-up.
    fallback: what finishes the rollouts after a worker failure ("sd": the draft model in process, "ar").
    max_restarts: automatic worker restarts (at the next admission) after failures.
    draft_device: where the draft side runs (None: where the draft model is). On a CPU the concurrent
    draft side is the worker process; on any other device it is a thread with its own stream
    (ssd/thread_client.py), since the process's shared-memory path is host memory only.
    rule_cache: where the rule's measurements are kept per machine for the next engine (ssd/rule_cache.py).
    """

    k: int = 4
    fanout: Optional[tuple[int, ...]] = None
    budget: Optional[int] = None
    max_budget: int = 32
    C: Union[float, str] = 1.0
    c_min: float = 0.3
    backup: str = "neural"
    strategy_rule: bool = True
    hysteresis: float = 0.10
    switch_after: int = 2
    decide_after: int = 3
    decide_margin: float = 0.3
    worker: bool = True
    worker_timeout: float = 30.0
    startup_timeout: float = 180.0
    pin_cores: bool = True
    fallback: str = "sd"
    max_restarts: int = 1
    draft_device: Optional[str] = None
    stop_prob: float = 0.3  # SD rounds' early stop (the SD engine's; SpecConfig)
    rule_cache: Union[bool, str, os.PathLike] = True

    def __post_init__(self):
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ValueError(f"SSDConfig.k must be an integer >= 1, got {self.k!r}")
        if self.fanout is not None:
            fanout = tuple(self.fanout)
            if len(fanout) != self.k + 1 or any(not isinstance(f, int) or f < 0 for f in fanout) or not sum(fanout):
                raise ValueError(f"SSDConfig.fanout must be k+1={self.k + 1} integers >= 0 with a positive sum, "
                                 f"got {self.fanout!r}")
            object.__setattr__(self, "fanout", fanout)
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < 1):
            raise ValueError(f"SSDConfig.budget must be an integer >= 1 or None, got {self.budget!r}")
        if not isinstance(self.max_budget, int) or self.max_budget < self.k + 1:
            raise ValueError(f"SSDConfig.max_budget must be an integer >= k+1={self.k + 1}, got {self.max_budget!r}")
        if self.budget is not None and self.budget > self.max_budget:
            raise ValueError(f"SSDConfig.budget {self.budget} exceeds max_budget {self.max_budget}")
        if isinstance(self.C, str):
            if self.C != "adaptive":
                raise ValueError(f"SSDConfig.C must be a number in (0, 1] or 'adaptive', got {self.C!r}")
        elif not (isinstance(self.C, (int, float)) and 0.0 < self.C <= 1.0):
            raise ValueError(f"SSDConfig.C must be a number in (0, 1] or 'adaptive', got {self.C!r}")
        if not 0.0 < self.c_min <= 1.0:
            raise ValueError(f"SSDConfig.c_min must be in (0, 1], got {self.c_min!r}")
        if self.backup not in BACKUPS:
            raise ValueError(f"SSDConfig.backup must be one of {BACKUPS}, got {self.backup!r}")
        if isinstance(self.hysteresis, bool) or not isinstance(self.hysteresis, (int, float)) \
                or not 0.0 <= self.hysteresis < math.inf:
            raise ValueError(f"SSDConfig.hysteresis must be a number >= 0, got {self.hysteresis!r}")
        if not isinstance(self.switch_after, int) or isinstance(self.switch_after, bool) or self.switch_after < 1:
            raise ValueError(f"SSDConfig.switch_after must be an integer >= 1, got {self.switch_after!r}")
        if not isinstance(self.decide_after, int) or isinstance(self.decide_after, bool) or self.decide_after < 1:
            raise ValueError(f"SSDConfig.decide_after must be an integer >= 1, got {self.decide_after!r}")
        if isinstance(self.decide_margin, bool) or not isinstance(self.decide_margin, (int, float)) \
                or not 0.0 <= self.decide_margin < math.inf:
            raise ValueError(f"SSDConfig.decide_margin must be a number >= 0, got {self.decide_margin!r}")
        for name in ("worker_timeout", "startup_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"SSDConfig.{name} must be a positive number of seconds, got {value!r}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"SSDConfig.fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"SSDConfig.max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if not isinstance(self.rule_cache, (bool, str, os.PathLike)) or self.rule_cache == "":
            raise ValueError(f"SSDConfig.rule_cache must be True, False or a directory, got {self.rule_cache!r}")
        if self.draft_device is not None:
            try:
                torch.device(self.draft_device)
            except (RuntimeError, TypeError):
                raise ValueError(f"SSDConfig.draft_device must name a torch device, got {self.draft_device!r}") from None

    @property
    def max_branches(self) -> int:
        """Most branches one sequence's cache can hold (sizes the draft KV)."""
        return sum(self.fanout) if self.fanout is not None else self.max_budget

    @property
    def saguaro_c(self) -> Optional[float]:
        """The fixed C, or None when C is adaptive."""
        return None if isinstance(self.C, str) else float(self.C)
