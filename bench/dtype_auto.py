"""float32 against bfloat16 on this CPU: is `dtype="auto"`'s pick the faster one here?

The target (SmolLM2-135M-Instruct) is loaded in both dtypes from the same GGUF, and the runner-level
steps a rollout is made of are timed in one process, the two dtypes interleaved repeat by repeat so
machine noise hits both alike: a prefill of B prompts of --prompt-len tokens, a decode step (one token
per row) and a verify-shaped step (K+1 tokens per row) after that prefill, at each batch size and
thread count asked. Medians over --repeats after a warm-up. The last column says which dtype was
faster; the JSON last line carries every figure, what "auto" picks here and the machine note.
`--bf16-caches bfloat16,float32` times the bf16 model over each KV cache dtype named (its runner's cache
replaced; `attention.cache_dtype` picks one per CPU kind), each against float32.

    .venv/bin/python bench/dtype_auto.py                      # batches 1,8; threads 1,2
    .venv/bin/python bench/dtype_auto.py --quick              # batch 1, one thread, 3 repeats
    .venv/bin/python bench/dtype_auto.py --bf16-caches bfloat16,float32 --batches 1,8,24
"""

from __future__ import annotations

import argparse

import common  # bench/common.py (the script's folder is on sys.path)
import torch

common.add_repo_to_path()

from rollout_ssd.kv_cache import KVCache  # noqa: E402
from rollout_ssd.models import cpu_backend, cpu_dtype  # noqa: E402
from rollout_ssd.models.attention import cache_dtype  # noqa: E402
from rollout_ssd.models.loader import load_pretrained  # noqa: E402
from rollout_ssd.runner import ModelRunner  # noqa: E402


def step_times(runners: dict, batch: int, prompt_len: int, k: int, repeats: int) -> dict:
    """Median seconds of prefill / decode / verify per dtype, interleaved repeat by repeat."""
    slots = list(range(batch))
    prompts = [[(7 * i + 13 * j) % 4000 + 10 for j in range(prompt_len)] for i in range(batch)]
    times = {name: {"prefill": [], "decode": [], "verify": []} for name in runners}

    def once(runner, record):
        def timed(key, fn):
            _, s = common.timed(fn)
            if record is not None:
                record[key].append(s)

        timed("prefill", lambda: runner.prefill(slots, prompts))
        for key, t in (("decode", 1), ("verify", k + 1)):
            timed(key, lambda t=t: runner.extend(slots, [[5] * t] * batch, last_only=False))
            for s in slots:
                runner.rollback(s, prompt_len)
        for s in slots:
            runner.rollback(s, 0)

    for runner in runners.values():  # warm-up: first-use packing, allocator, kernels
        for _ in range(2):
            once(runner, None)
    for _ in range(repeats):
        for name, runner in runners.items():
            once(runner, times[name])
    return {name: {key: common.median(v) for key, v in row.items()} for name, row in times.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--threads", default="1,2", help="comma list of torch intra-op thread counts")
    p.add_argument("--prompt-len", type=int, default=120)
    p.add_argument("--k", type=int, default=3, help="the verify step feeds K+1 tokens per row")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="batch 1, one thread, 3 repeats")
    p.add_argument("--bf16-caches", default="", help="comma list of KV cache dtypes for the bf16 model "
                   "(bfloat16, float32); default: the one attention.cache_dtype picks")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.threads, args.repeats = "1", "1", 3
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    models = {name: load_pretrained("smollm2-135m-instruct", dtype=dt).model for name, dt in dtypes.items()}
    max_len = args.prompt_len + args.k + 2
    runners = {name: ModelRunner(m, num_slots=max(batches), max_len=max_len) for name, m in models.items()}
    cfg = models["bfloat16"].cfg
    picked = str(cache_dtype(models["bfloat16"])).removeprefix("torch.")
    caches = [c for c in args.bf16_caches.split(",") if c]
    if set(caches) - {"bfloat16", "float32"}:
        p.error(f"--bf16-caches takes bfloat16 and float32, got {args.bf16_caches!r}")
    for cache in caches:
        runner = ModelRunner(models["bfloat16"], num_slots=max(batches), max_len=max_len)
        runner.cache = KVCache(cfg.num_layers, max(batches), max_len, cfg.num_kv_heads, cfg.head_dim,
                               dtype=getattr(torch, cache), device=runner.device)
        runners[f"bfloat16+{cache}_cache"] = runner
    print(f"the bf16 model's cache here: {picked} (attention.cache_dtype)")
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for b in batches:
            med = step_times(runners, b, args.prompt_len, args.k, args.repeats)
            row = {"threads": threads, "batch": b}
            for key in ("prefill", "decode", "verify"):
                f32, bf16 = med["float32"][key], med["bfloat16"][key]
                row[f"{key}_f32_ms"], row[f"{key}_bf16_ms"] = 1e3 * f32, 1e3 * bf16
                row[f"{key}_bf16_over_f32"] = bf16 / f32
                for name in [n for n in med if n.startswith("bfloat16+")]:
                    row[f"{key}_{name.removeprefix('bfloat16+')}_over_f32"] = med[name][key] / f32
            rows.append(row)
    common.print_table(rows)
    auto = cpu_dtype.auto_dtype()
    verdict = {key: sum(r[f"{key}_bf16_over_f32"] < 1 for r in rows) / len(rows) for key in ("prefill", "decode", "verify")}
    print(f"CPU kind {cpu_backend.cpu_kind()}; dtype auto = {auto} ({cpu_dtype.describe_auto_dtype()}); "
          f"share of rows where bf16 was faster: {verdict}")
    result = {"bench": "dtype_auto", "cpu_kind": cpu_backend.cpu_kind(), "auto": str(auto),
              "auto_reason": cpu_dtype.describe_auto_dtype(), "bf16_cache_picked": picked,
              "prompt_len": args.prompt_len, "k": args.k,
              "repeats": args.repeats, "rows": rows, "bf16_faster_share": verdict, "machine": common.machine_note()}
    common.print_json_line(result)
    return result


if __name__ == "__main__":
    main()
