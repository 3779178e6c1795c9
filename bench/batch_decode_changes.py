"""A GRPO step's rollouts on the AR engine with the seventeenth session's three batch changes undone one by one.

One AR engine (float32 target, `dtype="auto"` where that is float32), the `fresh_engines.py` GRPO workload
(6 prompts x n=4, T=1, EOS on, up to 160 new tokens) sampled under each configuration in turn, `--repeats`
times over, so machine noise hits them alike. Each configuration puts back what the engine did before:
  - before            all three undone: the state of the sixteenth session;
  - + wide x@W.T      float32 linears of 25+ rows as x @ W.T over the column-major storage
                      (`cpu_backend.FLOAT32_COLUMN_MAJOR_FROM`; before: W @ x.T over a row-major copy, its
                      output transposed);
  - + shared prompts  `ModelRunner.prefill` computes a prompt repeated into empty slots once (before: every
                      row of the group in the forward);
  - + no holes        `Scheduler._compact` keeps the running slots one run (before: holes, so attention
                      gathered the rows every layer of every step).
The undoing is done in this process (module attributes set back, the two new steps bypassed), so the
engine, weights and prompts are the same across rows. Table (tok/s, prefill seconds, speedup over "before")
and a JSON last line. On a CPU kind where `FLOAT32_COLUMN_MAJOR_FROM` lists nothing, the first change is a
no-op.

    .venv/bin/python bench/batch_decode_changes.py
    .venv/bin/python bench/batch_decode_changes.py --repeats 1 --max-new-tokens 64   # quick
"""

from __future__ import annotations

import argparse
import contextlib
import time

from common import add_repo_to_path, bench_prompts, machine_note, print_json_line, print_table

add_repo_to_path()

from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig  # noqa: E402
from rollout_ssd import metric_names as names  # noqa: E402
from rollout_ssd.models import cpu_backend  # noqa: E402
from rollout_ssd.models.cpu_backend import cpu_kind, describe_auto_dtype  # noqa: E402
from rollout_ssd.runner import ModelRunner  # noqa: E402
from rollout_ssd.scheduler import Scheduler  # noqa: E402

CONFIGS = ("before", "+ wide x@W.T", "+ shared prompts", "+ no holes")


@contextlib.contextmanager
def undone(config: str):
    """The engine with the changes after `config` in CONFIGS undone."""
    keep = CONFIGS.index(config)
    saved = (dict(cpu_backend.FLOAT32_COLUMN_MAJOR_FROM), ModelRunner.prefill, Scheduler._compact)
    try:
        if keep < 1:
            cpu_backend.FLOAT32_COLUMN_MAJOR_FROM.clear()
        if keep < 2:
            ModelRunner.prefill = ModelRunner._prefill
        if keep < 3:
            Scheduler._compact = lambda self: None
        yield
    finally:
        cpu_backend.FLOAT32_COLUMN_MAJOR_FROM.update(saved[0])
        ModelRunner.prefill, Scheduler._compact = saved[1], saved[2]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=160)
    args = p.parse_args(argv)
    engine = RolloutEngine.from_pretrained(spec=SpecConfig(method="ar"))
    totals = {c: {"tokens": 0, "seconds": 0.0, "prefill": 0.0} for c in CONFIGS}
    with engine:
        prompts = bench_prompts(engine.target.tokenizer, "templates", args.prompts)
        params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
        engine.sample(prompts[:1], SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=1))  # warm-up
        for _ in range(args.repeats):
            for config in CONFIGS:
                with undone(config):
                    engine.metrics(reset=True)
                    t0 = time.perf_counter()
                    tokens = sum(len(r.token_ids) for r in engine.sample(prompts, params))
                    seconds = time.perf_counter() - t0
                    prefill = engine.metrics()[names.ROLLOUT_PREFILL_SECONDS]
                t = totals[config]
                t["tokens"] += tokens
                t["seconds"] += seconds
                t["prefill"] += prefill
    base = totals["before"]["tokens"] / totals["before"]["seconds"]
    rows = [{"config": c, "tokens": t["tokens"] / args.repeats, "call s": t["seconds"] / args.repeats,
             "prefill s": t["prefill"] / args.repeats, "tok/s": t["tokens"] / t["seconds"],
             "x before": t["tokens"] / t["seconds"] / base} for c, t in totals.items()]
    print(f"CPU {cpu_kind()}; dtype auto: {describe_auto_dtype()}; AR engine, {args.prompts} prompts x n={args.n}, "
          f"T=1, up to {args.max_new_tokens} new tokens; {args.repeats} runs each, interleaved")
    print_table(rows)
    print_json_line({"bench": "batch_decode_changes", "machine": machine_note(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
