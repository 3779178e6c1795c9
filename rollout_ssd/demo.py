"""`rollout-ssd demo` (`make run`): each decoding method on the embedded default, timed the same way.

Every engine does the same work twice. The first call pays what is paid once per process or engine (the C
kernels built or loaded, oneDNN's kernels made per shape, memory touched for the first time, and for SSD
its strategy rule measuring each plan); the second is what a long rollout job sees, and is what the table
reports, with the first call's seconds in a column of their own. Under the table one sentence says what
the SSD engine ran and why (`ssd_choice`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

from rollout_ssd import metric_names as names

# Prompts that ask for a few paragraphs: each engine's call then decodes some hundreds of tokens per prompt,
# seconds of work, so that its time means something.
DEMO_PROMPTS = [
    "Explain in a few paragraphs how a neural network learns from data.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List ten tips for learning a new language, with a sentence on each.",
    "Describe the water cycle step by step, for a ten-year-old.",
]
PLAIN = {"ar": "AR", "sd": "SD", "suffix": "suffix speculation"}  # the strategy rule's plans, in words


@dataclass
class MethodRun:
    """One method's engine: the metrics of its first call and of the timed (second) call."""

    method: str
    first: dict
    timed: dict


def run(args) -> int:
    """The demo: each method in `args.methods` on `args.model`, the rollouts shown once, then the table."""
    from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig
    from rollout_ssd.models.registry import resolve_draft

    params = SamplingParams(n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                            seed=args.seed, chat=True)
    runs, shown, model, notes = [], False, None, []
    for method in args.methods:
        try:
            draft = None if method == "ar" else args.draft
            if draft == "default":
                resolve_draft("default", args.model)  # a ValueError where the model has no built-in draft
            spec = SpecConfig(method=method, k=args.k)
            engine = RolloutEngine.from_pretrained(args.model, draft=draft, dtype=args.dtype, spec=spec)
        except ValueError as err:
            print(f"[{method}] skipped: {err}")
            continue
        with engine:
            engine.sample(DEMO_PROMPTS, params, progress=True)  # the first call: one-time costs
            first = engine.metrics(reset=True)
            rollouts = engine.sample(DEMO_PROMPTS, params, progress=True)  # the same work again: timed
            runs.append(MethodRun(method, first, engine.metrics()))
            note = rule_cache_note(method, engine.strategy)
            notes += [] if note is None else [note]
        if not shown:
            for r in rollouts:
                print(f"--- prompt {r.prompt_index} sample {r.sample_index} ({len(r.token_ids)} tokens, {r.finish_reason})")
                print(f"Q: {DEMO_PROMPTS[r.prompt_index]}")
                print(f"A: {r.text.strip()}")
            shown = True
        model = engine.target.model
    if model is not None:
        print_table(runs, model.dtype, model.embed.device)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for r in runs:
        choice = ssd_choice(r, cores)
        if choice is not None:
            print(choice)
    for note in notes:
        print(note)
    return 0


def print_table(runs: list[MethodRun], dtype, device) -> None:
    """The methods side by side, under a line saying what they ran on (the target's device: its GPU, or the
    CPU's kind; dtype; threads) and what each row times."""
    import torch

    from rollout_ssd.kernels.cpu import cpu_kind

    device = torch.device(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {cpu_kind()}"
    print(f"\n{where}, {str(dtype).replace('torch.', '')}, {torch.get_num_threads()} threads")
    print("Each row is an engine's second call on the same prompts; its first call, which also paid the one-time "
          "costs, is the last column but one.")
    print(f"{'method':<6} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'accept':>7} {'len/round':>9} {'hit rate':>8} "
          f"{'1st call s':>10}  rounds by strategy")
    for r in runs:
        m = r.timed
        accept, hit = m.get(names.SPEC_ACCEPT_RATE), m.get(names.SSD_HIT_RATE)
        rounds = m.get(names.SSD_STRATEGY_ROUNDS)  # SSD's engine picks per round; AR and SD run themselves
        chosen = ", ".join(f"{k} {v}" for k, v in rounds.items()) if rounds else f"{r.method} (every round)"
        print(f"{r.method:<6} {m[names.ROLLOUT_TOKENS]:>7} {m[names.ROLLOUT_SECONDS]:>8.1f} "
              f"{m[names.ROLLOUT_TOKENS_PER_S]:>9.1f} {'-' if accept is None else f'{accept:.2f}':>7} "
              f"{m[names.ROLLOUT_TOKENS_PER_ROUND]:>9.2f} {'-' if hit is None else f'{hit:.2f}':>8} "
              f"{r.first[names.ROLLOUT_SECONDS]:>10.1f}  {chosen}")


def _state(run: MethodRun, name: str) -> Optional[float]:
    """ssd/<name> of the timed call, else of the first (the rule sets it when it decides at a batch size)."""
    for m in (run.timed, run.first):
        value = m.get(names.ssd_state(name))
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            return value
    return None


def ssd_choice(run: MethodRun, cores: int) -> Optional[str]:
    """One plain sentence: which plans an SSD engine ran over both calls and why; None for AR and SD engines."""
    rounds: dict[str, int] = {}
    for m in (run.first, run.timed):
        for plan, n in (m.get(names.SSD_STRATEGY_ROUNDS) or {}).items():
            rounds[plan] = rounds.get(plan, 0) + n
    if not rounds:
        return None
    total, ssd = sum(rounds.values()), sum(n for plan, n in rounds.items() if plan.startswith("ssd"))
    if 2 * ssd >= total:
        return (f"Over both calls the SSD engine ran SSD in {ssd} of its {total} rounds: its strategy rule "
                f"measured SSD as the fastest plan on this machine.")
    others = sorted(((n, plan) for plan, n in rounds.items() if not plan.startswith("ssd")), reverse=True)
    ran = " and ".join(f"{PLAIN.get(plan, plan)} ({n} rounds)" for n, plan in others)
    tried = f", SSD in {ssd} while measuring it" if ssd else ""
    head = f"Over both calls the SSD engine ran {ran}{tried}"
    cap, v = _state(run, "cap"), _state(run, "v")
    if cap is not None and cap < 1 and v is not None and v < 1:
        return (f"{head}: on this machine's {cores} CPU cores SSD's draft would take a core the target needs (the "
                f"target's verify ran {1 / v:.1f}x slower without it), so SSD could reach at most {cap:.2f}x the "
                f"speed of the best other plan; on a machine with a device for the draft (a second GPU) it runs SSD.")
    if cap is not None and cap < 1:
        return (f"{head}: drafting is too small a share of a round here for SSD to pay (at most {cap:.2f}x the "
                f"speed of the best other plan).")
    return f"{head}: its strategy rule measured those faster than SSD on this machine."


def rule_cache_note(method: str, strategy) -> Optional[str]:
    """What an SSD engine's strategy rule started from (ssd/rule_cache.py), or None (no cache: AR, SD, or the
    cache off)."""
    cache = getattr(strategy, "rule_cache", None)
    if cache is None:
        return None
    if strategy.restored_times:
        return (f"{method}: the strategy rule started from {strategy.restored_times} times measured on this "
                f"machine by earlier runs ({cache.path})")
    return f"{method}: the strategy rule measured each plan anew (kept for the next run: {cache.path})"
