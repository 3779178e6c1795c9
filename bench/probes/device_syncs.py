"""Host reads of device tensors per round, by source line, for AR / SD / SSD on a tiny pair.

The engine runs on `tests/support/fake_device.py`'s stand-in device (tagged CPU tensors that report
`meta`), which counts every read back to the host (`.tolist()`, `.item()`, `bool()`, a copy to the CPU):
on a GPU each is a synchronisation the round waits for. Prints a table and one JSON line.

    .venv/bin/python bench/probes/device_syncs.py
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.common import machine_note, print_json_line, print_table  # noqa: E402


def count(method: str, spec: dict, draft_on_device: bool, temperature: float) -> dict:
    from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
    from tests.support.fake_device import FakeDevice, fake_device
    from tests.support.models import tiny_pair

    FakeDevice.record_syncs = True
    target, draft = tiny_pair(Path(tempfile.mkdtemp()), vocab=48)
    with fake_device() as device:
        target.model.to("meta")
        if draft_on_device:
            draft.model.to("meta")
        engine = RolloutEngine(target, SpecConfig(method=method, k=3, **spec),
                               EngineConfig(max_batch_size=8, max_model_len=64), draft=None if method == "ar" else draft)
        engine.sample([[1, 2, 3], [4, 5], [6]],
                      SamplingParams(temperature=temperature, max_new_tokens=16, ignore_eos=True, n=2, seed=1))
        metrics = engine.metrics()
        engine.close()
    rounds = 16 / metrics.get("rollout/tokens_per_round", 1.0)  # every sequence emits 16 tokens
    return {"syncs": device.syncs, "rounds": rounds, "per_round": device.syncs / rounds,
            "where": dict(collections.Counter(device.where).most_common(6))}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    rows = []
    ssd = {"worker": False, "strategy_rule": False}
    for name, method, spec, on_dev in (("ar", "ar", {}, False), ("sd", "sd", {}, True),
                                       ("ssd, draft on host", "ssd", ssd, False), ("ssd, draft on device", "ssd", ssd, True)):
        for t in (0.0, 1.0):
            r = count(method, spec, on_dev, t)
            top = "; ".join(f"{k} x{v}" for k, v in r["where"].items())
            rows.append({"method": name, "T": t, "syncs": r["syncs"], "rounds": round(r["rounds"], 1),
                         "syncs/round": round(r["per_round"], 2), "top lines": top})
    print_table(rows)
    print_json_line({"bench": "device_syncs", "machine": machine_note(), "rows": rows})


if __name__ == "__main__":
    main()
