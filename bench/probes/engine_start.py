"""A new engine, as an RL actor or a user's script starts one: seconds to make it, resident memory, and
its first call: the main job's demo prompts (greedy, 96 new tokens, EOS on), or `--workload grpo` (6 prompts
of the held-out templates x n=4, T=1, EOS on, up to 160 new tokens: bench/fresh_engines.py's).

Each engine runs in a fresh interpreter of its own (nothing cached in the process, as at an actor's
start); the methods take turns, `--repeats` times over. Columns: seconds to import the package and to
make the engine (`RolloutEngine.from_pretrained`: target, draft, KV caches, the SSD draft worker), the
resident memory of the engine's process (and, SSD, its draft worker's) after making it and after the
call, the first call's seconds. `--repo` measures another checkout (its own package, this script).

    .venv/bin/python bench/engine_start.py
    .venv/bin/python bench/engine_start.py --methods ssd --repeats 3 --repo /tmp/before
    .venv/bin/python bench/engine_start.py --workload grpo --methods ar
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common.py (a probe lives in bench/probes/)
from common import REPO_ROOT, machine_note, print_json_line, print_table  # noqa: E402

from rollout_ssd.kernels.cpu import cpu_kind  # noqa: E402
from rollout_ssd.models.cpu_dtype import describe_auto_dtype  # noqa: E402

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[1])
from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig
from rollout_ssd.cli import DEMO_PROMPTS
from rollout_ssd.draft.prompts import chat_prompt_ids, eval_texts
imported = time.perf_counter() - t0

def resident_mb(pid="self"):
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

method = sys.argv[2]
t0 = time.perf_counter()
engine = RolloutEngine.from_pretrained(draft=None if method == "ar" else "default",
                                       spec=SpecConfig(method=method, k=4, rule_cache=False))
made = time.perf_counter() - t0
client = getattr(engine.strategy, "client", None)
worker = getattr(client, "pid", None)
rss = [resident_mb(), resident_mb(worker) if worker else 0.0]
if sys.argv[3] == "grpo":
    prompts = chat_prompt_ids(engine.target.tokenizer, eval_texts("templates", 6))
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=160, seed=0)
else:
    prompts, params = DEMO_PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=96, seed=0, chat=True)
t0 = time.perf_counter()
tokens = sum(len(r.token_ids) for r in engine.sample(prompts, params))
call = time.perf_counter() - t0
rss += [resident_mb(), resident_mb(worker) if worker else 0.0]
engine.close()
print(json.dumps({"import_s": imported, "make_s": made, "call_s": call, "tokens": tokens, "rss_made": rss[0],
                  "worker_made": rss[1], "rss_called": rss[2], "worker_called": rss[3]}))
"""


def child(repo: str, method: str, workload: str) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "ROLLOUT_SSD_RULE_CACHE": "0"}
    out = subprocess.run([sys.executable, "-c", CHILD, repo, method, workload], env=env, capture_output=True, text=True,
                         check=True, cwd=repo)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="ar,sd,ssd")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workload", choices=("demo", "grpo"), default="demo")
    p.add_argument("--repo", default=str(REPO_ROOT), help="the checkout whose package is measured")
    args = p.parse_args(argv)
    repo = str(Path(args.repo).resolve())
    methods = [m for m in args.methods.split(",") if m]
    runs = {m: [] for m in methods}
    for r in range(args.repeats):
        for m in methods if r % 2 == 0 else methods[::-1]:
            runs[m].append(child(repo, m, args.workload))
    rows = []
    for m in methods:
        med = {k: statistics.median(run[k] for run in runs[m]) for k in runs[m][0]}
        rows.append({"method": m, "import s": med["import_s"], "make s": med["make_s"],
                     "MB after make": med["rss_made"], "worker MB after make": med["worker_made"],
                     "first call s": med["call_s"], "tokens": int(med["tokens"]), "MB after call": med["rss_called"],
                     "worker MB after call": med["worker_called"],
                     "make s, each run": " ".join(f"{run['make_s']:.2f}" for run in runs[m])})
    print(f"CPU {cpu_kind()}; dtype auto: {describe_auto_dtype()}; checkout {repo}; workload {args.workload}; "
          f"medians of {args.repeats} fresh interpreters per method")
    print_table(rows)
    print_json_line({"bench": "engine_start", "machine": machine_note(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
