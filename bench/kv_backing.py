"""What a fresh CPU KV cache's pages cost a first call (issue 15; kv_cache.py's `zeroed` and `back`).

One AR engine, the GRPO-shaped call (6 prompts of the held-out templates x n=4, T=1, up to 160 new
tokens), the cache's pages dropped (MADV_DONTNEED: as a fresh engine's) before each timed call, in three
modes taking turns:
  - backed: as the engine runs (each slot backed a chunk of positions ahead of its writes, `KVCache.back`);
  - faulted: `back` off, so the forwards' writes fault each page in as they reach it;
  - present: every page of the cache written before the call (what torch.zeros at start-up gave).
Also the minor page faults of the call. Table and JSON last line.

    .venv/bin/python bench/kv_backing.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import statistics
import time

from common import add_repo_to_path, bench_prompts, machine_note, print_json_line, print_table

add_repo_to_path()

from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig  # noqa: E402
from rollout_ssd.models.cpu_backend import cpu_kind, describe_auto_dtype  # noqa: E402

MADV_DONTNEED = 4
MODES = ("backed", "faulted", "present")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    engine = RolloutEngine.from_pretrained(draft=None, spec=SpecConfig(method="ar", rule_cache=False))
    cache = engine.runner.cache
    tensors = [*cache.keys, *cache.values]
    prompts = bench_prompts(engine.target.tokenizer, "templates", 6)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=160, seed=0)
    runs = {m: [] for m in MODES}
    with engine:
        for r in range(args.repeats):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                for t in tensors:  # a fresh cache: no page present
                    if libc.madvise(t.data_ptr(), t.numel() * t.element_size(), MADV_DONTNEED) != 0:
                        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")
                cache._backed = [0] * len(cache._backed)
                cache.backs_ahead = mode == "backed"
                if mode == "present":
                    for t in tensors:
                        t.zero_()
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                tokens = sum(len(o.token_ids) for o in engine.sample(prompts, params))
                seconds = time.perf_counter() - t0
                runs[mode].append({"seconds": seconds, "tokens": tokens,
                                   "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults})
    rows = [{"mode": m, "call s (median)": statistics.median(x["seconds"] for x in runs[m]),
             "each run": " ".join(f"{x['seconds']:.2f}" for x in runs[m]),
             "minor faults in the call": statistics.median(x["faults"] for x in runs[m]),
             "tokens": runs[m][0]["tokens"]} for m in MODES]
    print(f"CPU {cpu_kind()}; dtype auto: {describe_auto_dtype()}; AR engine, GRPO-shaped call, "
          f"{args.repeats} runs per mode, modes taking turns")
    print_table(rows)
    print_json_line({"bench": "kv_backing", "machine": machine_note(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
