"""What the strategy rule measured, kept per machine, so that a new engine starts from it.

A fresh SSD engine knows nothing of this machine: at each batch size it first runs AR, plain SD and
SSD to time them (ssd/chooser.py, `_explore`), and a short first `sample` call (the main job's, a
restarted RL actor's first step) spends much of itself there. Like a compiler's autotuning cache,
`RuleCache` keeps the live estimates' times per batch size (with how often each was measured), hit
rate, acceptance and tokens per round (ssd/estimates.py, `snapshot`), and the plan the rule chose at
each batch bucket (ssd/chooser.py, `kept_choices`) in a JSON file; an engine with the same key restores
them: the times as measurements and the choices as its own, so at those buckets the rule decides at
once, keeping a choice by the hysteresis as a long-running engine would; the rates as priors, which
its own rounds outweigh within a few rounds. The rule goes on measuring as always (probes of close
plans, AR's calibrations), and a close plan it knows only from the cache at a batch size is run there for
a few rounds and the batch size decided again (ssd/chooser.py, `_recheck`), so a cache from a slower or
faster hour of a shared host, or another workload, is corrected as the engine runs.

The key is everything the times depend on: the CPU (model name, kind, cores), torch's threads, the
device, the target's and draft's architecture and dtype (and for a bf16 CPU model the linear kernels it
runs on: the bf16 rows kernel, which $ROLLOUT_SSD_BF16_ROWS=0 turns off, and oneDNN's packed linear),
compiled steps' kind (and whether frozen ones autotune, $ROLLOUT_SSD_AUTOTUNE), the SSD settings that
shape a round, and the torch and package versions. Not the weights' values (an RL policy changes them
every step; their shapes set the cost). A file with another key, a format it does not know, or bad
values is ignored, with a warning: the cache can only save measuring rounds, never change what is
generated (every plan is lossless; the cache moves only which plan runs first). Files are written whole
(a temporary file renamed over the old one), so concurrent engines on one machine never read half a file.

Where: SpecConfig.rule_cache (True: $ROLLOUT_SSD_CACHE/rule, default ~/.cache/rollout_ssd/rule;
$ROLLOUT_SSD_RULE_CACHE=0 turns that off; a path: that directory; False: off).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch

import rollout_ssd
from rollout_ssd.gpu.graphs import compile_mode
from rollout_ssd.gpu.inductor import autotune
from rollout_ssd.kernels import bf16_rows, few_attention, layer_kernel
from rollout_ssd.kernels.cpu import cpu_kind, cpu_model
from rollout_ssd.models import attention
from rollout_ssd.models.cpu_backend import f32_rows_kernel_rows, layer_kernel_rows, packed_bf16
from rollout_ssd.models.decoder import Decoder
from rollout_ssd.models.disk_cache import cache_root
from rollout_ssd.runner import ModelRunner
from rollout_ssd.ssd.chooser import Chooser

log = logging.getLogger(__name__)

FORMAT = 4  # 2: float32 few-row GEMMs by CPU kind, the int4 draft's kernel in bf16 (what rounds cost changed);
# 3: the cap's one-core verify kept with SD's verify of that moment ("narrow_ref"; a file without it would keep v stale)
# 4: SD's drafting time leaves out a round whose draft caught up on rounds it sat out (older files hold those)
# SSDConfig fields that do not change what a round costs (failure handling, the cache itself)
UNKEYED = ("worker_timeout", "startup_timeout", "fallback", "max_restarts", "rule_cache")


def cache_directory(setting: Union[bool, str]) -> Optional[Path]:
    """The directory SpecConfig.rule_cache names, or None (off)."""
    if setting is False:
        return None
    if setting is True:
        if os.environ.get("ROLLOUT_SSD_RULE_CACHE", "1") == "0":
            return None
        return cache_root() / "rule"
    return Path(setting)


def engine_key(runner: ModelRunner, draft: Decoder, config) -> dict:
    """What the rule's times depend on (module docstring), as plain JSON data."""
    target, static = runner.model, runner.static
    device = target.embed.device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_model()} ({cpu_kind()})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in UNKEYED}
    return {"format": FORMAT, "rollout_ssd": rollout_ssd.__version__, "torch": torch.__version__,
            "device": f"{device.type}: {where}", "cores": cores, "threads": torch.get_num_threads(),
            "target": _model_key(target), "draft": _model_key(draft),
            "static_steps": None if static is None else [static.graphs, str(static.compiled), static.pad_t,
                                                         compile_mode(static.compiled) == "frozen" and autotune()],
            "ssd": _plain(settings)}


def _plain(value):
    """`value` as it reads back from JSON (tuples as lists, other objects as their str)."""
    return json.loads(json.dumps(value, default=str))


def _model_key(model: Decoder) -> dict:
    return {"config": _plain(dataclasses.asdict(model.cfg)), "dtype": str(model.dtype),
            "attention": type(model.backend).__name__, "cpu_kernels": _cpu_kernels(model)}


def _cpu_kernels(model: Decoder) -> Optional[dict]:
    """Which kernels a CPU model's steps run on: a bf16 model's (cpu_backend.packed_linear: the bf16 rows
    kernel and whether compiled steps call it in C++, oneDNN's packed linear; the form its few-query
    attention takes: attention.SDPA_FEW_QUERIES, the few_attention kernel; the most tokens a step runs
    through the one-call layer kernel, 0 where it does not run: layer_kernel_rows()), a float16 model's
    attention form, a float32 model's (the float32 rows kernel's most rows where it runs, 0 where not:
    cpu_backend.f32_rows_kernel_rows), an int4 draft's (csrc/int4_rows.c or torch's int4 kernel, the layer
    kernel); None for a GPU's: such a key neither asks for a kernel (its build) nor changes when one is
    turned off."""
    if not model.embed.is_cpu:
        return None
    if model.copies.int4_group is not None:  # an int4 draft: int4_rows.c (and the layer kernel) or torch's kernel
        return {"int4_rows": layer_kernel.int4_available(), "layer_kernel": layer_kernel.available()}
    if model.dtype == torch.float32:
        return {"f32_rows": f32_rows_kernel_rows()}
    form = {"sdpa_few_queries": attention.SDPA_FEW_QUERIES}  # a 16-bit cache's few-query attention
    if model.dtype != torch.bfloat16:
        return form if model.dtype == torch.float16 else None
    return {"bf16_rows": bf16_rows.available(), "bf16_rows_op_cpp": bf16_rows.op_in_cpp(), "packed_bf16": packed_bf16(),
            "few_attention": few_attention.available(),
            "layer_kernel": layer_kernel_rows() if layer_kernel.available() else 0, **form}


class RuleCache:
    """One engine's file in the cache directory, named by a digest of its key; `load` into the
    estimates at start, `save` them when the engine goes idle (after each call) and at close."""

    def __init__(self, directory: Path, key: dict):
        self.key = key
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        self.path = Path(directory) / f"rule-{digest}.json"

    def load(self, chooser: Chooser) -> int:
        """Restore the chooser's estimates and its choice per batch bucket from the file; the times
        restored (0: no file, or one ignored)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as err:
            log.warning("strategy rule cache %s not read (%s): measuring anew", self.path, err)
            return 0
        if not isinstance(data, dict) or data.get("key") != self.key:
            log.warning("strategy rule cache %s is for another engine or format: measuring anew", self.path)
            return 0
        try:
            choices = chooser.parse_choices(data["choices"])  # checked first: a bad file changes nothing
            restored = chooser.estimates.restore(data["estimates"])
            chooser.restore_choices(choices)
        except (KeyError, TypeError, ValueError) as err:
            log.warning("strategy rule cache %s has bad values (%s): measuring anew", self.path, err)
            return 0
        log.info("strategy rule: %d measured times restored from %s", restored, self.path)
        return restored

    def save(self, chooser: Chooser) -> bool:
        """Write the chooser's estimates and choices (nothing when nothing was timed); False when it could
        not be written (a warning: the engine runs on, measuring anew next time)."""
        state = chooser.estimates.snapshot()
        if not state["times"]:
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        except OSError as err:
            log.warning("strategy rule cache %s not written: %s", self.path, err)
            return False
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"key": self.key, "estimates": state, "choices": chooser.kept_choices()}, f)
            os.replace(tmp, self.path)
        except OSError as err:
            log.warning("strategy rule cache %s not written: %s", self.path, err)
            Path(tmp).unlink(missing_ok=True)
            return False
        return True
