"""bench/gpu_check.py's own logic on tiny CPU shapes (`--cpu-smoke`): every part runs, the greedy
equality holds, and the last line is the JSON record a device session reads. Run twice: as CI runs it,
and with TRITON_INTERPRET=1, where the Triton attention parts (equality with attention="triton", the
attention comparison, the Triton step times) run under the interpreter instead of being skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARTS = ("env", "tests", "equality", "fused", "attention", "steps", "overlap", "memory", "predict")


@pytest.mark.slow
@pytest.mark.parametrize("interpret", [False, True], ids=["plain", "triton-interpreted"])
def test_cpu_smoke_runs_every_part_and_ends_with_json(interpret):
    """Every part, plain; under Triton's interpreter the parts the Triton backend changes (the tests,
    fused and memory parts run no attention: the plain run covers them)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    parts = PARTS
    if interpret:
        pytest.importorskip("triton", reason="triton is not installed")
        env["TRITON_INTERPRET"] = "1"
        parts = tuple(p for p in PARTS if p not in ("tests", "fused", "memory"))
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-smoke", "--parts", ",".join(parts)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "gpu_check" and result["cpu_smoke"] is True
    assert set(result["seconds"]) == set(parts)
    for part in parts:
        assert "error" not in result[part], (part, result[part])
    assert result["equality"]["all_equal"] is True, result["equality"]
    assert ("cpu+triton" in result["equality"]["ar"]) is interpret
    if not interpret:
        assert result["tests"]["rc"] == 0, result["tests"]
        assert result["fused"]["bitwise_equal"] is True
    attention = result["attention"]
    assert attention["triton"] is interpret
    for kind in ("decode", "verify", "tree"):
        for b in (1, 4):
            row = attention[f"{kind}_b{b}"]
            assert row["sdpa_err"] < 1e-5
            assert row.get("triton_within_2x_sdpa", not interpret) is True, row
    step_keys = {"eager_ms", "graphed_ms"} | ({"triton_eager_ms", "triton_graphed_ms"} if interpret else set())
    for shape in ("tiny-target", "tiny-draft"):
        steps = result["steps"][shape]["steps"]
        assert set(steps) == {"b1_t1", "b1_t5", "b4_t1", "b4_t5"}
        assert all(set(v) == step_keys and all(x > 0 for x in v.values()) for v in steps.values())
    if not interpret:
        memory = result["memory"]
        assert memory["ran"] is True and 1 <= memory["slots"] < 512  # the pretend device holds fewer than asked for
    predict = result["predict"]
    assert predict["SSD_over_SD"] == pytest.approx(predict["SSD_over_AR"] / predict["SD_over_AR"])
