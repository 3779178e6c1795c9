"""Corollary 9's cap on this CPU: how far SSD can get over SD and AR when its draft takes a core (issue 15).

On a CPU the SSD engine verifies on the target's own core while its draft worker builds the next
speculation cache on another (ssd/cores.py); SD verifies on every core and drafts between verifies. So at
best (every verdict a hit, the cache build hidden) SSD / SD <= v (1 + T_SD) (docs/THEORY.md, Corollary 9
with the verify on other hardware), v = SD's verify / SSD's verify, T_SD = SD's drafting / SD's verify.
With the default pair in the engine's dtype, `--batch` sequences (default 1) after chat prompts of the
held-out templates, this times (medians):
  - a verify of K+1 tokens a sequence on every core, on one core, and on one core while a process pinned
    to another core runs the draft's tree steps (4 rows, one thread: what an SSD round's verify sits beside);
  - AR's step on every core;
  - SD's drafting of K-token chains on every core (K draft steps, each with its softmax, no early stop:
    the engine's chains stop early, so this T_SD is if anything high), and the same chains on one core (a
    K-deep cache needs at least that of the worker, so an SSD round costs at least the larger of it and
    its verify);
  - one core's read speed (the better of a float32 `sum()` over 512 MiB and one over the target's
    weights in their dtype), so the fastest a one-core verify could be: the weight bytes a step reads
    (bench_ar.bytes_per_step) over that speed, or the verify on every core where that is slower (a batch
    whose verify is compute-bound), and v at best = SD's verify / that;
and prints the cap as measured and at the best v, the T_SD a draft would need for SSD >= 1.3x SD there
(issue 15's batch-1 target), the cap with the worker's chain, and the tokens per round E(a, K) (and the
per-token acceptance a) that SSD and SD would need for `--ar-target` x AR (default 2: the batch-1 target)
with their rounds' least costs as measured (SSD: the larger of its verify and the worker's chain). The
neighbour runs 4-row steps at every `--batch`: at larger batches the worker's real load is more, so the
verify beside it is a lower bound there. Table, then a JSON last line.

    .venv/bin/python bench/two_core_cap.py
    .venv/bin/python bench/two_core_cap.py --draft target-int4 --k 3
    .venv/bin/python bench/two_core_cap.py --batch 4 --ar-target 1.5     # the main job's batch size
    .venv/bin/python bench/two_core_cap.py --batch 24 --ar-target 1.15   # a GRPO batch's 24 sequences
    .venv/bin/python bench/two_core_cap.py --quick                       # a smoke run
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import torch
from bench_ar import bytes_per_step, step_weights
from common import (
    add_repo_to_path,
    bench_prompts,
    load_default_pair,
    machine_note,
    median_seconds,
    memory_bandwidth,
    print_json_line,
    print_table,
)

add_repo_to_path()

from rollout_ssd.kernels.cpu import cpu_kind  # noqa: E402
from rollout_ssd.models.cpu_dtype import describe_auto_dtype  # noqa: E402
from rollout_ssd.runner import ModelRunner  # noqa: E402
from rollout_ssd.ssd.rule import expected_tokens_per_round  # noqa: E402

TREE_ROWS = 4  # the neighbour's tree step (a fan-out of a few branches at batch 1)
SSD_TARGET = 1.3  # issue 15: batch 1 greedy SSD >= 1.3x SD
AR_TARGET = 2.0  # ... and >= 2x AR (a GRPO batch's target: >= 1.15x AR, `--batch 24 --ar-target 1.15`)


def pin(cores: set[int], threads: int) -> None:
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


def rollback(runner: ModelRunner, slots: list[int], prompts: list[list[int]]) -> None:
    """Each slot back to its prompt (a timed step's tokens undone)."""
    for slot, p in zip(slots, prompts):
        runner.rollback(slot, len(p))


def tree_steps(core: int, draft: str, prompt: list[int], ready, stop, parent: int) -> None:
    """The neighbour process: the draft's TREE_ROWS-row steps on one core, in a loop until `stop` (or its
    parent is gone: killed, the parent cannot set it)."""
    pin({core}, 1)
    _, loaded = load_default_pair(draft, dtype="auto")
    runner = ModelRunner(loaded.model, num_slots=TREE_ROWS, max_len=len(prompt) + 16)
    slots = [runner.allocate() for _ in range(TREE_ROWS)]
    runner.prefill(slots, [prompt] * TREE_ROWS)
    ready.set()
    while not stop.is_set() and os.getppid() == parent:
        runner.extend(slots, [[prompt[-1]]] * TREE_ROWS, last_only=True)
        rollback(runner, slots, [prompt] * TREE_ROWS)


def verify_ms(runner: ModelRunner, slots: list[int], prompts: list[list[int]], k: int, repeats: int) -> float:
    def verify():
        runner.extend(slots, [p[-k - 1:] for p in prompts])  # K+1 tokens a row, logits at each (a verify)
        rollback(runner, slots, prompts)
    return 1e3 * median_seconds(verify, repeats)


def drafting_ms(runner: ModelRunner, slots: list[int], prompts: list[list[int]], k: int, repeats: int) -> float:
    def chain():
        tokens = [[p[-1]] for p in prompts]
        for _ in range(k):
            q = torch.softmax(runner.extend(slots, tokens, last_only=True), dim=-1)
            tokens = [[t] for t in q.argmax(dim=-1).tolist()]
        rollback(runner, slots, prompts)
    return 1e3 * median_seconds(chain, repeats)


def acceptance_for(tokens: float, k: int) -> float:
    """The per-token acceptance a at which a K-token chain emits `tokens` a round, E(a, K) (inf where that
    is more than K + 1, which no acceptance gives)."""
    if tokens > k + 1:
        return float("inf")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_round(mid, k) < tokens else (lo, mid)
    return hi


def weights_read_gbps(model) -> float:
    """One pass of `sum()` over the weights a decode step reads, at the current thread count: GB/s."""
    touched = step_weights(model)
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
    p.add_argument("--batch", type=int, default=1, help="sequences (prompts of the held-out templates)")
    p.add_argument("--ar-target", type=float, default=AR_TARGET, help="the speedup over AR asked of SSD and SD")
    p.add_argument("--repeats", type=int, default=41)
    p.add_argument("--quick", action="store_true", help="5 repeats")
    args = p.parse_args(argv)
    repeats = 5 if args.quick else args.repeats
    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    if len(cores) < 2:
        raise SystemExit("needs two or more CPU cores (the target's and the worker's)")
    wide, own, other = set(cores), {cores[0]}, cores[-1]
    target, draft = load_default_pair(args.draft, dtype="auto")
    prompts = bench_prompts(target.tokenizer, "templates", args.batch)
    longest = max(map(len, prompts)) + args.k + 16
    runner, draft_runner = ModelRunner(target.model, args.batch, longest), ModelRunner(draft.model, args.batch, longest)
    slots, draft_slots = [runner.allocate() for _ in prompts], [draft_runner.allocate() for _ in prompts]
    runner.prefill(slots, prompts)
    draft_runner.prefill(draft_slots, prompts)

    pin(wide, threads)
    verify_wide = verify_ms(runner, slots, prompts, args.k, repeats)
    decode_wide = verify_ms(runner, slots, prompts, 0, repeats)  # one token a row: AR's step
    drafting = drafting_ms(draft_runner, draft_slots, prompts, args.k, repeats)
    bw_wide = memory_bandwidth()["read_gbps"]
    pin(own, 1)
    verify_own = verify_ms(runner, slots, prompts, args.k, repeats)
    chain_own = drafting_ms(draft_runner, draft_slots, prompts, args.k, repeats)  # the worker's chain, its one core
    bw_own = max(memory_bandwidth()["read_gbps"], weights_read_gbps(target.model))
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    neighbour = ctx.Process(target=tree_steps, args=(other, args.draft, prompts[0], ready, stop, os.getpid()),
                            daemon=True)
    neighbour.start()
    try:
        while not ready.wait(timeout=1):
            if not neighbour.is_alive():
                raise SystemExit(f"the neighbour process exited before its first step (code {neighbour.exitcode})")
        verify_beside = verify_ms(runner, slots, prompts, args.k, repeats)
    finally:
        stop.set()
        neighbour.join(timeout=30)
        if neighbour.is_alive():
            neighbour.kill()
    pin(wide, threads)

    step_bytes = bytes_per_step(target.model, args.batch)
    floor_own = max(1e3 * step_bytes / (bw_own * 1e9), verify_wide)  # (nor faster than on every core)
    t_sd = drafting / verify_wide
    v_now, v_best = verify_wide / verify_beside, verify_wide / floor_own
    rows = [
        {"what": f"verify of {args.k + 1} tokens a sequence, {len(cores)} cores (SD)", "ms": verify_wide},
        {"what": "verify, 1 core", "ms": verify_own},
        {"what": f"verify, 1 core beside {TREE_ROWS}-row draft steps on another (SSD)", "ms": verify_beside},
        {"what": f"AR's decode step, {len(cores)} cores", "ms": decode_wide},
        {"what": f"SD's drafting of {args.k} tokens, {len(cores)} cores", "ms": drafting},
        {"what": "the same drafting on 1 core (the worker's least for a K-deep cache)", "ms": chain_own},
        {"what": f"best 1-core verify: {step_bytes / 1e6:.0f} MB at 1 core's {bw_own:.1f} GB/s (or the all-core verify)",
         "ms": floor_own},
    ]
    caps = {"T_SD": t_sd, "v measured": v_now, "cap measured v (1 + T_SD)": v_now * (1 + t_sd),
            "v at best": v_best, "cap at best v": v_best * (1 + t_sd),
            f"T_SD needed for {SSD_TARGET}x at best v": SSD_TARGET / v_best - 1,
            # an SSD round also waits for the worker's cache, at least K one-row draft steps on its core:
            # SSD / SD <= (SD's verify + drafting) / max(SSD's verify, that chain) (the cap above where the
            # chain fits the verify)
            "cap with the worker's chain, measured verify": (verify_wide + drafting) / max(verify_beside, chain_own),
            "cap with the worker's chain, best verify": (verify_wide + drafting) / max(floor_own, chain_own)}
    # a round emits at most E(a, K) tokens a sequence; an SSD round costs at least the larger of its verify
    # and the worker's chain, an SD round at least its verify: so SSD / AR <= E(a, K) * AR's step / that
    # larger one, SD / AR <= E(a, K) * AR's step / SD's verify (drafting free): the E (and a) a speedup of
    # --ar-target needs
    x = args.ar_target
    for label, verify in (("SSD, measured 1-core verify", max(verify_beside, chain_own)),
                          ("SSD, best 1-core verify", max(floor_own, chain_own)), ("SD, free drafting", verify_wide)):
        tokens = x * verify / decode_wide
        caps[f"E(a, K) needed for {x}x AR: {label}"] = tokens
        caps[f"acceptance a needed for it ({label})"] = acceptance_for(tokens, args.k)
    note = machine_note()
    print(f"CPU {cpu_kind()}; dtype auto: {describe_auto_dtype()}; batch {args.batch}; "
          f"draft {args.draft}, K {args.k}; read GB/s {len(cores)} cores {bw_wide:.1f}, 1 core {bw_own:.1f}")
    print_table(rows, floatfmt=".2f")
    print()
    print_table([{"quantity": k, "value": v} for k, v in caps.items()], floatfmt=".3f")
    print_json_line({"bench": "two_core_cap", "machine": note, "cpu_kind": cpu_kind(), "args": vars(args),
                     "times_ms": {r["what"]: r["ms"] for r in rows}, "read_gbps": {"wide": bw_wide, "one_core": bw_own},
                     "step_bytes": step_bytes, **caps})


if __name__ == "__main__":
    main()
