"""bench/gpu_check.py's own logic on tiny CPU shapes (`--cpu-smoke`): every part runs, the greedy
equality holds, and the last line is the JSON record a device session reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cpu_smoke_runs_every_part_and_ends_with_json():
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-smoke"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "gpu_check" and result["cpu_smoke"] is True
    for part in ("env", "tests", "equality", "steps", "overlap", "predict"):
        assert "error" not in result[part], (part, result[part])
    assert result["tests"]["rc"] == 0, result["tests"]
    assert result["equality"]["all_equal"] is True, result["equality"]
    for shape in ("tiny-target", "tiny-draft"):
        steps = result["steps"][shape]["steps"]
        assert set(steps) == {"b1_t1", "b1_t5", "b4_t1", "b4_t5"}
        assert all(v["eager_ms"] > 0 and v["graphed_ms"] > 0 for v in steps.values())
    predict = result["predict"]
    assert predict["SSD_over_SD"] == pytest.approx(predict["SSD_over_AR"] / predict["SD_over_AR"])
