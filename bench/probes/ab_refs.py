"""One timing over two or more git revisions of this repository, in turns (a change's before and after in one
run, so the machine's drift falls on both). Each revision is checked out in a temporary git worktree and
timed in its own process (its own kernel builds), revision after revision, `--repeats` times over:

  - steps: one eager `runner.extend` of the default target (dtype auto) of R rows x T tokens after
    `--prompt-len`-token prompts, median ms of 35 (after 5 untimed);
  - attention: `few_attention.attend` over 30 layers' bf16 caches of B rows x L keys (SmolLM2's heads: 9
    query heads, 3 KV heads, head dim 64), caches too large for L2 as in a step, median ms of 7 passes.

Table (per shape, each revision's times, one per repeat), then one JSON line.

    .venv/bin/python bench/probes/ab_refs.py --refs 4372f65,HEAD                          # steps 1x1 .. 128x1
    .venv/bin/python bench/probes/ab_refs.py --refs HEAD~1,HEAD --what attention --shapes 128x250,24x250
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common.py (a probe lives in bench/probes/)
from common import REPO_ROOT, machine_note, print_json_line, print_table  # noqa: E402

STEPS = '''
import json, sys, time, torch
from rollout_ssd.models.loader import load_pretrained
from rollout_ssd.runner import ModelRunner
shapes, prompt_len = json.loads(sys.argv[1]), int(sys.argv[2])
model = load_pretrained("smollm2-135m-instruct", dtype="auto").model
out = {}
with torch.inference_mode():
    for rows, tokens in shapes:
        runner = ModelRunner(model, rows, prompt_len + tokens + 8)
        slots = [runner.allocate() for _ in range(rows)]
        for s in slots:
            runner.prefill([s], [[100 + i for i in range(prompt_len)]])
        times = []
        for i in range(40):
            t0 = time.perf_counter()
            runner.extend(slots, [[5] * tokens] * rows, last_only=True)
            times.append(time.perf_counter() - t0)
            for s in slots:
                runner.rollback(s, prompt_len)
        times = sorted(times[5:])
        out[f"{rows}x{tokens}"] = times[len(times) // 2] * 1e3
print(json.dumps(out))
'''

ATTENTION = '''
import json, sys, time, torch
from rollout_ssd.kernels import few_attention
shapes = json.loads(sys.argv[1])
torch.manual_seed(0)
out = {}
for b, keys in shapes:
    q = [torch.randn(b, 9, 1, 64).bfloat16() for _ in range(30)]
    k = [torch.randn(b, 3, keys, 64).bfloat16() for _ in range(30)]
    v = [torch.randn(b, 3, keys, 64).bfloat16() for _ in range(30)]
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        for i in range(30):
            few_attention.attend(q[i], k[i], v[i], None, 64 ** -0.5)
        times.append(time.perf_counter() - t0)
    out[f"{b}x{keys}"] = sorted(times)[3] * 1e3
print(json.dumps(out))
'''

DEFAULT_SHAPES = {"steps": "1x1,1x5,4x1,8x1,16x1,24x1,32x1,64x1,128x1", "attention": "128x250,24x250"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--refs", required=True, help="comma list of git revisions (HEAD, a hash, a tag ...)")
    p.add_argument("--what", choices=("steps", "attention"), default="steps")
    p.add_argument("--shapes", default=None, help="steps: RxT (rows x tokens); attention: BxL (rows x keys)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=150)
    args = p.parse_args(argv)
    refs = [r for r in args.refs.split(",") if r]
    shapes = [[int(n) for n in s.split("x")] for s in (args.shapes or DEFAULT_SHAPES[args.what]).split(",")]
    root = tempfile.mkdtemp(prefix="ab_refs_")
    trees = {}
    try:
        for i, ref in enumerate(refs):
            trees[ref] = os.path.join(root, str(i))
            subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", "-q", trees[ref], ref], check=True)
        times: dict[str, list[dict]] = {ref: [] for ref in refs}
        for _ in range(args.repeats):
            for ref in refs:
                code = STEPS if args.what == "steps" else ATTENTION
                env = {**os.environ, "PYTHONPATH": trees[ref]}
                done = subprocess.run([sys.executable, "-c", code, json.dumps(shapes), str(args.prompt_len)],
                                      env=env, cwd=trees[ref], check=True, capture_output=True, text=True)
                times[ref].append(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", tree], check=False)
        shutil.rmtree(root, ignore_errors=True)
    rows = [{"revision": ref, **{shape: " / ".join(f"{run[shape]:.2f}" for run in times[ref]) for shape in times[ref][0]}}
            for ref in refs]
    print(f"{args.what}, ms, one time per repeat (revisions in turns)")
    print_table(rows)
    print_json_line({"bench": "ab_refs", "machine": machine_note(), "args": vars(args), "times": times})


if __name__ == "__main__":
    main()
