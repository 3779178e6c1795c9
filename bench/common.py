"""Helpers shared by the benchmarks: a plain-text table, the JSON last line (CONTRIBUTING.md, "Benchmarks"),
a machine note, a timer, the memory-bandwidth probe the rooflines divide by, and the loader of the
default target/draft pair.

Benchmarks run as scripts (`python bench/bench_x.py`); the package never imports this folder.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
# SSD engines measure anew as on a machine they never ran on, unless a bench names a rule cache
# (SpecConfig.rule_cache: a directory; bench/fresh_engines.py --rule-cache warm)
os.environ.setdefault("ROLLOUT_SSD_RULE_CACHE", "0")


# The main job's prompts until issue 50 (96 new tokens, greedy): the "demo" workload of fresh_engines.py, which
# RESULTS' figures for it were measured on. The main job itself (rollout_ssd/demo.py) now asks for longer answers.
MAIN_JOB_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a neural network is.",
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
]


def add_repo_to_path() -> None:
    """Let `python bench/x.py` import `rollout_ssd` from this checkout without installing it."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


def load_default_pair(draft: str = "default", dtype: str = "float32"):
    """(target, draft) LoadedModels: SmolLM2-135M-Instruct in `dtype` (float32 unless asked; "auto" is
    the engine's default) and `draft` ("default" = the built-in draft, "target-int4" = the target's own
    weights in int4, or a checkpoint directory), the draft sharing the target's embedding."""
    add_repo_to_path()
    from rollout_ssd.models.loader import load_draft, load_pretrained

    target = load_pretrained("smollm2-135m-instruct", dtype=dtype)
    return target, load_draft(draft, target, "smollm2-135m-instruct", dtype=dtype)


add_repo_to_path()
from rollout_ssd.draft.prompts import EVAL_SETS as PROMPT_SETS  # noqa: E402  (the benches' --prompt-set choices)


def add_prompt_set_arg(parser) -> None:
    """`--prompt-set` (default "templates"), read by `bench_prompts`."""
    parser.add_argument("--prompt-set", choices=PROMPT_SETS, default="templates",
                        help="templates: held-out templates (new kinds); unseen: unseen prompts of the "
                             "training templates (common.bench_prompts)")


def bench_prompts(tokenizer, prompt_set: str, count: int) -> list[list[int]]:
    """The first `count` prompts of a benchmark prompt set (`rollout_ssd.draft.prompts.eval_texts`), as
    chat-template token ids:

    - "templates": the distillation recipe's held-out prompts, `build_prompts(8000, n, seed=0).heldout`,
      filled from one template per kind that training never uses (new kinds of prompt);
    - "unseen": training-template prompts no data cache of the default draft sampled,
      `build_prompts(8000, 0, seed=0).train[7900:8000]` (its caches stop before training prompt 2,736;
      the draft's PROVENANCE.md): new prompts of the kinds it was distilled on, as in an RL job whose
      draft is distilled on the policy's own prompt set."""
    add_repo_to_path()
    from rollout_ssd.draft.prompts import chat_prompt_ids, eval_texts

    return chat_prompt_ids(tokenizer, eval_texts(prompt_set, count))


def print_table(rows: Sequence[dict], columns: Optional[Sequence[str]] = None, floatfmt: str = ".2f") -> None:
    """Print rows (dicts) as an aligned table; columns default to the first row's keys."""
    if not rows:
        return
    columns = list(columns or rows[0].keys())

    def cell(v) -> str:
        if isinstance(v, float):
            return format(v, floatfmt)
        return "-" if v is None else str(v)

    body = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for b in body:
        print("  ".join(v.rjust(w) for v, w in zip(b, widths)))


def _finite(value):
    """NaN / inf -> None, recursively: strict JSON has no non-finite numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def print_json_line(result: dict) -> None:
    """The benchmark's machine-readable result: one strict-JSON object on the last line of stdout
    (non-finite numbers become null)."""
    print(json.dumps(_finite(result), separators=(",", ":"), default=str, allow_nan=False), flush=True)


def machine_note() -> dict:
    """What a reader needs to compare numbers across runs."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = line
                    break
    except OSError:
        model = platform.processor()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {
        "cpu": model if flags else platform.processor(),
        "cores": os.cpu_count(),
        "isa": isa,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_avg_1m": load,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def timed(fn: Callable, *args, **kwargs) -> tuple[object, float]:
    """(fn(*args, **kwargs), wall-clock seconds it took)."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def time_call(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall-clock seconds of `repeats` calls of fn (the caller warms up)."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """The median wall-clock seconds of `repeats` calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return median(time_call(fn, repeats))


def memory_bandwidth(megabytes: int = 512, repeats: int = 5) -> dict:
    """Sustained DRAM bandwidth with the current torch thread count, best of `repeats`.

    copy_gbps: dst.copy_(src) of `megabytes`, counted as 2 * size / time (one read + one write; the
    write-allocate read of dst is not counted). read_gbps: src.sum(), size / time (a pure read, the
    access pattern of streaming weights through a GEMV). GB = 1e9 bytes.
    """
    n = megabytes * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    src.sum()
    copy = min(time_call(lambda: dst.copy_(src), repeats))
    read = min(time_call(lambda: src.sum(), repeats))
    size = n * 4
    return {"bytes": size, "copy_gbps": 2 * size / copy / 1e9, "read_gbps": size / read / 1e9}


def frozen_step_timing(model, tokens: int, prompt: Sequence[int], repeats: int) -> tuple[float, float]:
    """(compile seconds, median ms) of `model`'s frozen compiled step of `tokens` tokens at one row after
    `prompt` (`ModelRunner.use_static_steps(compiled="frozen")`, steps of 2+ tokens padded to `tokens`),
    at torch's current thread count; the first call is the compile."""
    from rollout_ssd.runner import ModelRunner

    runner = ModelRunner(model, num_slots=1, max_len=512)
    runner.use_static_steps(compiled="frozen", pad_t=max(tokens, 2))
    slot = runner.allocate()
    runner.prefill([slot], [list(prompt)])

    def step():
        runner.extend([slot], [[5] * tokens], last_only=True)
        runner.rollback(slot, len(prompt))
    t0 = time.perf_counter()
    step()  # its compile
    compile_s = time.perf_counter() - t0
    return compile_s, median_seconds(step, repeats) * 1e3
