"""Part 1's sweep: SD and SSD at batch 1 for each candidate draft, temperature and K (issue 15).

Runs bench/profile_ssd_round.py once per cell (SD against SSD with the rule off, one thread per process,
the worker on its own core; its table per cell is printed as it goes), then one table of the cells:
tokens/s of SD and SSD, their ratio, SD's acceptance, SSD's hit rate, T_SD and T_p, a miss's wait, SD's
and SSD's verify times and Theorem 7's prediction with SSD's verify converted to SD's (the two run on
different core counts on a CPU). JSON last line.

    .venv/bin/python bench/sweep_pairs.py --drafts default,/work/drafts/d6 --temperatures 0,1 --ks 4
"""

from __future__ import annotations

import argparse

from common import machine_note, print_json_line, print_table
from profile_ssd_round import main as profile


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafts", default="default", help="comma-separated: default, or checkpoint directories")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--ks", default="4")
    p.add_argument("--prompt-set", default="templates", choices=("templates", "unseen"))
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--quick", action="store_true", help="a smoke run of each cell")
    args = p.parse_args(argv)
    rows = []
    for draft in [d for d in args.drafts.split(",") if d]:
        for temperature in [float(t) for t in args.temperatures.split(",")]:
            for k in [int(x) for x in args.ks.split(",")]:
                argv_cell = ["--draft", draft, "--temperature", str(temperature), "--k", str(k),
                             "--prompt-set", args.prompt_set, "--new-tokens", str(args.new_tokens)]
                out = profile(argv_cell + (["--quick"] if args.quick else []))
                s = out["summary"]
                rows.append({"draft": draft, "layers": out["draft_layers"], "T": temperature, "K": k,
                             "SD tok/s": s["SD tok/s"], "SSD tok/s": s["SSD tok/s"], "SSD/SD": s["SSD/SD measured"],
                             "SD accept": s["SD accept"], "hit": s["hit (warm)"], "T_SD": s["T_SD"], "T_p": s["T_p"],
                             "miss wait": s.get("T_b (miss wait)"), "SD verify ms": s["SD verify ms"],
                             "SSD verify ms": s["SSD verify ms"],
                             "predicted": s.get("... x SD verify / SSD verify")})
    print()
    print_table(rows, floatfmt=".3f")
    print_json_line({"bench": "sweep_pairs", "machine": machine_note(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
