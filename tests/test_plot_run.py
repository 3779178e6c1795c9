"""`rollout-ssd plot-run OUT` (rl/plots.py) draws one run's PNG from OUT/metrics.jsonl, without wandb."""

from __future__ import annotations

import json
import struct

import pytest

from rollout_ssd import metric_names as names
from rollout_ssd.cli import main as cli_main
from rollout_ssd.rl.plots import plot_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(out, steps: int = 5) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows, versions = [], []
    for s in range(1, steps + 1):
        row = {"step": s, "reward/mean": 0.1 * s, names.LEARNER_KL_INITIAL: 0.002 * s * s,
               names.TIME_ROLLOUT_S: 8.0, names.TIME_LEARN_S: 20.0 - s, names.TIME_SYNC_S: 1.0,
               names.TIME_FOLLOW_S: 0.0, names.TIME_DRIFT_S: 0.5 if s % 2 else 0.0,
               names.rollout_seconds_by_batch("16-31"): 5.0, names.rollout_seconds_by_batch("8-15"): 2.0,
               names.rollout_seconds_by_batch("1"): 1.0, "ssd/strategy_rounds": "{'ar': 3}",
               "rollout/weight_version": s - 1}
        rows.append(row)
        versions.append({"version": s - 1, "step": s, names.SPEC_ACCEPT_RATE: 0.6 - 0.01 * s,
                         names.SSD_HIT_RATE: 0.5, "draft_mode": "frozen"})
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "versions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in versions))


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, "not a PNG"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk's width and height


def test_cli_plot_run_draws_a_png(tmp_path, capsys):
    write_run(tmp_path / "run")
    assert cli_main(["plot-run", str(tmp_path / "run")]) == 0
    png = tmp_path / "run" / "run.png"
    assert f"wrote {png}" in capsys.readouterr().out
    assert png_size(png) == (1600, 800)
    # six drawn panels (bars, lines, legends, ticks): far more than a blank canvas of that size compresses to
    assert png.stat().st_size > 40_000, png.stat().st_size


def test_plot_run_from_the_metrics_file_alone(tmp_path):
    write_run(tmp_path / "run", steps=3)
    (tmp_path / "run" / "versions.jsonl").unlink()  # acceptance and hit rate then come from metrics rows
    output = plot_run(tmp_path / "run" / "metrics.jsonl", tmp_path / "elsewhere" / "p.png")
    assert output == tmp_path / "elsewhere" / "p.png" and png_size(output) == (1600, 800)


def test_plot_run_refuses_what_it_cannot_draw(tmp_path, capsys):
    assert cli_main(["plot-run", str(tmp_path / "missing")]) == 2
    assert "plot-run: error" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError):
        plot_run(tmp_path / "empty")
