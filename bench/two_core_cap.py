"""Corollary 9's cap on this CPU: how far SSD can get over SD at batch 1 when the draft takes a core (issue 15).

On a CPU the SSD engine verifies on the target's own core while its draft worker builds the next
speculation cache on another (ssd/cores.py); SD verifies on every core and drafts between verifies. So at
best (every verdict a hit, the cache build hidden) SSD / SD <= v (1 + T_SD) (docs/THEORY.md, Corollary 9
with the verify on other hardware), v = SD's verify / SSD's verify, T_SD = SD's drafting / SD's verify.
With the default pair in the engine's dtype, batch 1, after a chat prompt of the held-out templates, this
times (medians):
  - a verify of K+1 tokens on every core, on one core, and on one core while a process pinned to another
    core runs the draft's tree steps (4 rows, one thread: what an SSD round's verify sits beside);
  - SD's drafting of a K-token chain on every core (K draft steps, each with its softmax, no early stop:
    the engine's chains stop early, so this T_SD is if anything high), and the same chain on one core (a
    K-deep cache needs at least that of the worker, so an SSD round costs at least the larger of it and
    its verify);
  - one core's read speed (the better of a float32 `sum()` over 512 MiB and one over the target's
    weights in their dtype), so the fastest a one-core verify could be: the weight bytes a step reads
    (bench_ar.bytes_per_step) over that speed, and v at best = SD's verify / that;
and prints the cap as measured and at the best v, and the T_SD a draft would need for SSD >= 1.3x SD
there (issue 15's batch-1 target). Table, then a JSON last line.

    .venv/bin/python bench/two_core_cap.py
    .venv/bin/python bench/two_core_cap.py --draft target-int4 --k 3
    .venv/bin/python bench/two_core_cap.py --quick          # a smoke run
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import torch
from bench_ar import bytes_per_step
from common import (
    add_repo_to_path,
    bench_prompts,
    load_default_pair,
    machine_note,
    memory_bandwidth,
    print_json_line,
    print_table,
)

add_repo_to_path()

from rollout_ssd.models.cpu_backend import cpu_kind, describe_auto_dtype  # noqa: E402
from rollout_ssd.runner import ModelRunner  # noqa: E402
from rollout_ssd.ssd.rule import expected_tokens_per_round  # noqa: E402

TREE_ROWS = 4  # the neighbour's tree step (a fan-out of a few branches at batch 1)
SSD_TARGET = 1.3  # issue 15: batch 1 greedy SSD >= 1.3x SD
AR_TARGET = 2.0  # ... and >= 2x AR


def pin(cores: set[int], threads: int) -> None:
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def tree_steps(core: int, draft: str, prompt: list[int], ready, stop) -> None:
    """The neighbour process: the draft's TREE_ROWS-row steps on one core, in a loop until `stop`."""
    pin({core}, 1)
    _, loaded = load_default_pair(draft, dtype="auto")
    runner = ModelRunner(loaded.model, num_slots=TREE_ROWS, max_len=len(prompt) + 16)
    slots = [runner.allocate() for _ in range(TREE_ROWS)]
    runner.prefill(slots, [prompt] * TREE_ROWS)
    ready.set()
    while not stop.is_set():
        runner.extend(slots, [[prompt[-1]]] * TREE_ROWS, last_only=True)
        for s in slots:
            runner.rollback(s, len(prompt))


def verify_ms(runner: ModelRunner, slot: int, prompt: list[int], k: int, repeats: int) -> float:
    def verify():
        runner.extend([slot], [prompt[-k - 1:]])  # K+1 tokens, logits at each (a verify's forward)
        runner.rollback(slot, len(prompt))
    return median_ms(verify, repeats)


def drafting_ms(runner: ModelRunner, slot: int, prompt: list[int], k: int, repeats: int) -> float:
    def chain():
        token = prompt[-1]
        for _ in range(k):
            q = torch.softmax(runner.extend([slot], [[token]], last_only=True)[0], dim=-1)
            token = int(q.argmax())
        runner.rollback(slot, len(prompt))
    return median_ms(chain, repeats)


def acceptance_for(tokens: float, k: int) -> float:
    """The per-token acceptance a at which a K-token chain emits `tokens` a round, E(a, K) (>1: none)."""
    if tokens > k + 1:
        return float("inf")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_round(mid, k) < tokens else (lo, mid)
    return hi


def weights_read_gbps(model) -> float:
    """One pass of `sum()` over the weights a decode step reads, at the current thread count: GB/s."""
    touched = [model.norm, model.lm_head, *model.layers.parameters()]  # (as bench_ar.bytes_per_step)
    for t in touched:
        t.sum()
    t0 = time.perf_counter()
    for t in touched:
        t.sum()
    seconds = time.perf_counter() - t0
    return sum(t.numel() * t.element_size() for t in touched) / seconds / 1e9


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default="default", help="default, target-int4, or a draft checkpoint directory")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=41)
    p.add_argument("--quick", action="store_true", help="5 repeats")
    args = p.parse_args(argv)
    repeats = 5 if args.quick else args.repeats
    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    if len(cores) < 2:
        raise SystemExit("needs two or more CPU cores (the target's and the worker's)")
    wide, own, other = set(cores), {cores[0]}, cores[-1]
    target, draft = load_default_pair(args.draft, dtype="auto")
    prompt = bench_prompts(target.tokenizer, "templates", 1)[0]
    runner = ModelRunner(target.model, num_slots=1, max_len=len(prompt) + 16)
    slot = runner.allocate()
    runner.prefill([slot], [prompt])
    draft_runner = ModelRunner(draft.model, num_slots=1, max_len=len(prompt) + args.k + 16)
    draft_slot = draft_runner.allocate()
    draft_runner.prefill([draft_slot], [prompt])

    pin(wide, threads)
    verify_wide = verify_ms(runner, slot, prompt, args.k, repeats)
    decode_wide = verify_ms(runner, slot, prompt, 0, repeats)  # one token: AR's step
    drafting = drafting_ms(draft_runner, draft_slot, prompt, args.k, repeats)
    bw_wide = memory_bandwidth()["read_gbps"]
    pin(own, 1)
    verify_own = verify_ms(runner, slot, prompt, args.k, repeats)
    chain_own = drafting_ms(draft_runner, draft_slot, prompt, args.k, repeats)  # the worker's chain, its one core
    bw_own = max(memory_bandwidth()["read_gbps"], weights_read_gbps(target.model))
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    neighbour = ctx.Process(target=tree_steps, args=(other, args.draft, prompt, ready, stop), daemon=True)
    neighbour.start()
    try:
        if not ready.wait(timeout=300):
            raise SystemExit("the neighbour process did not start")
        verify_beside = verify_ms(runner, slot, prompt, args.k, repeats)
    finally:
        stop.set()
        neighbour.join(timeout=30)
        if neighbour.is_alive():
            neighbour.kill()
    pin(wide, threads)

    step_bytes = bytes_per_step(target.model, 1)
    floor_own = 1e3 * step_bytes / (bw_own * 1e9)
    t_sd = drafting / verify_wide
    v_now, v_best = verify_wide / verify_beside, min(1.0, verify_wide / floor_own)
    rows = [
        {"what": f"verify of {args.k + 1} tokens, {len(cores)} cores (SD)", "ms": verify_wide},
        {"what": "verify, 1 core", "ms": verify_own},
        {"what": f"verify, 1 core beside {TREE_ROWS}-row draft steps on another (SSD)", "ms": verify_beside},
        {"what": f"AR's decode step, {len(cores)} cores", "ms": decode_wide},
        {"what": f"SD's drafting of {args.k} tokens, {len(cores)} cores", "ms": drafting},
        {"what": "the same drafting on 1 core (the worker's least for a K-deep cache)", "ms": chain_own},
        {"what": f"1-core verify at 1-core read speed ({step_bytes / 1e6:.0f} MB at {bw_own:.1f} GB/s)", "ms": floor_own},
    ]
    caps = {"T_SD": t_sd, "v measured": v_now, "cap measured v (1 + T_SD)": v_now * (1 + t_sd),
            "v at best": v_best, "cap at best v": v_best * (1 + t_sd),
            f"T_SD needed for {SSD_TARGET}x at best v": SSD_TARGET / v_best - 1,
            # an SSD round also waits for the worker's cache, at least K one-row draft steps on its core:
            # SSD / SD <= (SD's verify + drafting) / max(SSD's verify, that chain) (the cap above where the
            # chain fits the verify)
            "cap with the worker's chain, measured verify": (verify_wide + drafting) / max(verify_beside, chain_own),
            "cap with the worker's chain, best verify": (verify_wide + drafting) / max(floor_own, chain_own)}
    # SSD emits at most E(a, K) tokens a sequence per round and a round costs at least its one-core verify,
    # so SSD / AR <= E(a, K) * AR's step / that verify, whatever the draft costs: the E (and a) needed for 2x AR
    for label, verify in (("measured", verify_beside), ("best", floor_own)):
        tokens = AR_TARGET * verify / decode_wide
        caps[f"E(a, K) needed for {AR_TARGET}x AR, {label} 1-core verify"] = tokens
        caps[f"acceptance a needed for it, {label}"] = acceptance_for(tokens, args.k)
    note = machine_note()
    print(f"CPU {cpu_kind()}; dtype auto: {describe_auto_dtype()}; "
          f"draft {args.draft}, K {args.k}; read GB/s {len(cores)} cores {bw_wide:.1f}, 1 core {bw_own:.1f}")
    print_table(rows, floatfmt=".2f")
    print()
    print_table([{"quantity": k, "value": v} for k, v in caps.items()], floatfmt=".3f")
    print_json_line({"bench": "two_core_cap", "machine": note, "cpu_kind": cpu_kind(), "args": vars(args),
                     "times_ms": {r["what"]: r["ms"] for r in rows}, "read_gbps": {"wide": bw_wide, "one_core": bw_own},
                     "step_bytes": step_bytes, **caps})


if __name__ == "__main__":
    main()
