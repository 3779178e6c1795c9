"""Where a small request's time to first token goes while a big one runs (issue 51).

    .venv/bin/python bench/bench_serve.py --workload mixed --methods sd --big-requests 1 --trace /tmp/trace
    .venv/bin/python bench/probes/serve_trace.py /tmp/trace [--policy fair] [--top 10]

Reads the server's per-round trace (scheduler.RoundTrace) and the small requests' records that
`bench_serve.py --trace` wrote, and splits each loaded small request's TTFT into: waiting for the round
in flight when it arrived, rounds that ran before its admission (and what they did), its own admission
round up to the end of its prefill, and what is left (the HTTP path: tokenizing, the event loop, the
stream). Prints the slowest requests one by one and a summary over all of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def split(req: dict, rounds: list[dict]) -> dict:
    """The parts of one request's TTFT, from the rounds that overlap [send, first token]."""
    send, first = req["t"], req["t"] + req["ttft"]
    overlap = [r for r in rounds if r["t"] < first and r["t"] + r["round_s"] > send]
    in_flight = next((r for r in overlap if r["t"] <= send), None)
    wait_in_flight = (in_flight["t"] + in_flight["round_s"] - send) if in_flight else 0.0
    # its admission round: the first one starting after the send that admitted exactly one short request
    later = [r for r in overlap if r["t"] > send]
    admitted = next((r for r in later if r["admitted"] >= 1 and r["admitted_tokens"] <= 64), None)
    before = [r for r in later if admitted is None or r["t"] < admitted["t"]]
    own = (admitted["prefill_s"]) if admitted else 0.0
    gaps = 0.0
    prev_end = (in_flight["t"] + in_flight["round_s"]) if in_flight else send
    for r in before + ([admitted] if admitted else []):
        gaps += max(0.0, r["t"] - prev_end)
        prev_end = r["t"] + r["round_s"]
    rounds_before = sum(r["round_s"] for r in before)
    rest = req["ttft"] - wait_in_flight - rounds_before - own - gaps
    return {"ttft": req["ttft"], "wait_in_flight": wait_in_flight, "rounds_before": rounds_before,
            "n_before": len(before), "own_prefill": own, "gaps": gaps, "rest": rest,
            "in_flight": in_flight, "before": before, "admitted": admitted}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace_dir")
    p.add_argument("--policy", default="fair")
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args(argv)
    d = Path(args.trace_dir)
    rounds = sorted(load(d / f"{args.policy}_rounds.jsonl"), key=lambda r: r["t"])
    reqs = [r for r in load(d / f"{args.policy}_small.jsonl") if r["phase"] == "loaded"]
    parts = sorted((split(r, rounds) for r in reqs), key=lambda x: -x["ttft"])
    keys = ("ttft", "wait_in_flight", "rounds_before", "own_prefill", "gaps", "rest")
    print(f"{len(reqs)} loaded small requests, {len(rounds)} rounds; seconds (mean / max):")
    for k in keys:
        xs = [x[k] for x in parts]
        print(f"  {k:15s} {statistics.mean(xs):7.3f} {max(xs):7.3f}")
    stepped = [r for r in rounds if r["stepped"]]
    print("round seconds by rows stepped (count, mean, max):")
    for lo, hi in ((1, 8), (9, 16), (17, 32), (33, 64), (65, 10**6)):
        xs = [r["round_s"] for r in stepped if lo <= r["stepped"] <= hi]
        if xs:
            print(f"  {lo:3d}-{hi:<7d} {len(xs):5d} {statistics.mean(xs):7.3f} {max(xs):7.3f}")
    big = [r for r in rounds if r["admitted_tokens"] > 64 or r["admitted"] > 4]
    shown = [(r["admitted"], r["admitted_tokens"], round(r["prefill_s"], 3), round(r["round_s"], 3)) for r in big]
    print(f"big admissions (sequences, prompt tokens, prefill s, round s): {shown[:10]}")
    for x in parts[: args.top]:
        print(f"\nTTFT {x['ttft']:.3f}: in flight {x['wait_in_flight']:.3f}, {x['n_before']} rounds before "
              f"{x['rounds_before']:.3f}, own prefill {x['own_prefill']:.3f}, gaps {x['gaps']:.3f}, rest {x['rest']:.3f}")
        for r in ([x["in_flight"]] if x["in_flight"] else []) + x["before"] + ([x["admitted"]] if x["admitted"] else []):
            print(f"   round {r['round_s']:.3f} s: admitted {r['admitted']} ({r['admitted_tokens']} tok, prefill "
                  f"{r['prefill_s']:.3f} s), stepped {r['stepped']}, running {r['running']}, waiting {r['waiting']}")


if __name__ == "__main__":
    main()
