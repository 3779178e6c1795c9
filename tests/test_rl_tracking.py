"""RunLogger (JSONL + offline wandb), read_jsonl, plot_drift and the `plot-drift` CLI. No network: wandb
runs offline with its dirs in tmp, and any non-local socket connect from this process fails the test."""

import json
import math
import socket

import pytest

from rollout_ssd.cli import main
from rollout_ssd.rl.tracking import RunLogger, plot_drift, read_jsonl

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
    home = tmp_path / "wandb_home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(home))
    for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # should it ever try, it fails locally
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    real_connect = socket.socket.connect

    def local_only(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"network access to {address}")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)


def _version_rows(draft_mode: str, n: int = 4):
    drop = 0.1 if draft_mode == "frozen" else 0.02
    return [{"version": v, "draft_mode": draft_mode, "ssd/hit_rate": 0.8 - drop * v, "spec/accept_rate": 0.7 - drop * v,
             "spec/accept_length": 2.5, "drift/kl_target_draft": drop * v, "mismatch/token_mult_prob_error": 1e-3,
             "sync/bytes": 1024 * v, "sync/seconds": 0.01} for v in range(n)]


def _write_run(path, draft_mode: str, wandb_mode: str = "disabled"):
    with RunLogger(path, {"draft_mode": draft_mode}, wandb_mode=wandb_mode) as run:
        for step in range(3):
            run.log(step, {"rollout/tokens_per_s": 100.0 + step, "ssd/fanout": [3, 2, 1]})
        for row in _version_rows(draft_mode):
            run.log_version(row)
    return path


def test_jsonl_round_trip_lists_and_nan(tmp_path):
    with RunLogger(tmp_path / "run", {"lr": 1e-5, "path": tmp_path}, wandb_mode="disabled") as run:
        run.log(0, {"spec/accept_rate": 0.75, "ssd/fanout": [4, 2, 1], "ssd/strategy": "saguaro",
                    "drift/kl_target_draft": float("nan"), "ssd/T_b": float("inf"), "pair": (1, float("-inf"))})
        run.log(1, {"spec/accept_rate": 0.5})
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(isinstance(r["time"], float) for r in rows)
    first = rows[0]
    assert first["spec/accept_rate"] == 0.75 and first["ssd/fanout"] == [4, 2, 1] and first["ssd/strategy"] == "saguaro"
    assert first["drift/kl_target_draft"] is None and first["ssd/T_b"] is None and first["pair"] == [1, None]
    assert "NaN" not in (tmp_path / "run" / "metrics.jsonl").read_text()
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"lr": 1e-5, "path": str(tmp_path)}


def test_numpy_and_torch_values_become_plain(tmp_path):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    with RunLogger(tmp_path, {}, wandb_mode="disabled") as run:
        run.log(0, {"a": np.float32(0.5), "b": np.array([1, 2]), "c": torch.tensor(3), "d": torch.tensor([0.25, math.nan])})
    row = read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert (row["a"], row["b"], row["c"], row["d"]) == (0.5, [1, 2], 3, [0.25, None])


def test_truncated_last_line_tolerated(tmp_path):
    _write_run(tmp_path / "run", "follow")
    path = tmp_path / "run" / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 3, "rollout/tokens_per_s": 1')  # a killed writer
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]
    path.write_text('{"step": 0}\n{"step": 1, "x":\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2"):
        read_jsonl(path)
    path.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match="JSON object"):
        read_jsonl(path)


def test_versions_jsonl_rows(tmp_path):
    _write_run(tmp_path / "run", "frozen")
    rows = read_jsonl(tmp_path / "run" / "versions.jsonl")
    expected = _version_rows("frozen")
    assert [{k: v for k, v in r.items() if k != "time"} for r in rows] == expected
    with RunLogger(tmp_path / "bad", {}, wandb_mode="disabled") as run:
        with pytest.raises(ValueError, match="version"):
            run.log_version({"ssd/hit_rate": 0.5})
        with pytest.raises(ValueError, match="version"):
            run.log_version({"version": "3"})


def test_offline_wandb_run_records_logged_keys(tmp_path):
    out = tmp_path / "run"
    run = RunLogger(out, {"recipe": "grpo_unique_cfg", "k": 4}, wandb_mode="offline", run_name="frozen-run",
                    group="drift", tags=("test",))
    run.log(0, {"spec/accept_rate": 0.75, "ssd/fanout": [4, 2], "ssd/strategy": "saguaro", "ssd/T_b": float("nan")})
    for row in _version_rows("frozen", 2):
        run.log_version(row)
    run.close()
    run.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        run.log(1, {"x": 1.0})
    offline_runs = list((out / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1
    records = list(offline_runs[0].glob("run-*.wandb"))
    assert len(records) == 1
    data = records[0].read_bytes()  # protobuf records: keys and string values appear verbatim
    for key in (b"spec/accept_rate", b"ssd/fanout/0", b"ssd/fanout/1", b"ssd/strategy", b"saguaro",
                b"drift_version/version", b"drift_version/ssd/hit_rate", b"drift/versions", b"grpo_unique_cfg"):
        assert key in data, key
    assert json.loads((out / "config.json").read_text()) == {"recipe": "grpo_unique_cfg", "k": 4}
    assert len(read_jsonl(out / "metrics.jsonl")) == 1 and len(read_jsonl(out / "versions.jsonl")) == 2


def test_disabled_mode_writes_jsonl_but_no_wandb_dir(tmp_path):
    out = _write_run(tmp_path / "run", "follow", wandb_mode="disabled")
    assert not (out / "wandb").exists()
    assert not (tmp_path / "wandb_home").exists()
    assert len(read_jsonl(out / "metrics.jsonl")) == 3 and len(read_jsonl(out / "versions.jsonl")) == 4


def test_bad_logger_input(tmp_path):
    with pytest.raises(ValueError, match="wandb_mode"):
        RunLogger(tmp_path, {}, wandb_mode="dryrun")
    with pytest.raises(ValueError, match="config"):
        RunLogger(tmp_path, [("lr", 1)], wandb_mode="disabled")
    with RunLogger(tmp_path, {}, wandb_mode="disabled") as run:
        with pytest.raises(ValueError, match="step"):
            run.log(1.5, {"x": 1.0})
        with pytest.raises(ValueError, match="reserved"):
            run.log(0, {"time": 1.0})
        with pytest.raises(ValueError, match="'obj'"):
            run.log(0, {"obj": object()})


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000


def test_plot_drift_two_runs(tmp_path):
    frozen = _write_run(tmp_path / "frozen", "frozen")
    follow = _write_run(tmp_path / "follow", "follow")
    out = plot_drift([frozen, follow], tmp_path / "plots" / "drift.png")
    assert out == tmp_path / "plots" / "drift.png"
    _assert_png(out)


def test_plot_drift_falls_back_to_metrics_and_skips_missing(tmp_path):
    run = tmp_path / "run"
    with RunLogger(run, {}, wandb_mode="disabled") as logger:  # no log_version: versions.jsonl stays empty
        for step in range(3):
            logger.log(step, {"sync/version": step, "ssd/hit_rate": 0.5 + 0.1 * step})
    only_steps = tmp_path / "steps.jsonl"
    only_steps.write_text("".join(json.dumps({"step": s, "rollout/tokens_per_s": 10.0 * s}) + "\n" for s in range(3)))
    _assert_png(plot_drift([run, only_steps], tmp_path / "fallback.png"))


def test_plot_drift_bad_input(tmp_path):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(ValueError, match="missing.jsonl"):
        plot_drift([missing], tmp_path / "x.png")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.jsonl"):
        plot_drift([empty], tmp_path / "x.png")
    unusable = tmp_path / "unusable.jsonl"
    unusable.write_text('{"note": "no step or version"}\n')
    with pytest.raises(ValueError, match="unusable.jsonl"):
        plot_drift([unusable], tmp_path / "x.png")
    bare_dir = tmp_path / "bare"
    bare_dir.mkdir()
    with pytest.raises(ValueError, match="bare"):
        plot_drift([bare_dir], tmp_path / "x.png")
    empty_run = tmp_path / "empty_run"
    RunLogger(empty_run, {}, wandb_mode="disabled").close()
    with pytest.raises(ValueError, match="empty_run"):
        plot_drift([empty_run], tmp_path / "x.png")
    good = _write_run(tmp_path / "good", "frozen")
    with pytest.raises(ValueError, match="labels"):
        plot_drift([good], tmp_path / "x.png", labels=["a", "b"])
    with pytest.raises(ValueError, match="runs"):
        plot_drift([], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_cli_plot_drift(tmp_path, capsys):
    frozen = _write_run(tmp_path / "frozen", "frozen")
    follow = _write_run(tmp_path / "follow", "follow")
    out = tmp_path / "drift.png"
    argv = ["plot-drift", str(frozen / "versions.jsonl"), str(follow), "--output", str(out), "--labels", "frozen", "follow"]
    assert main(argv) == 0
    _assert_png(out)
    assert str(out) in capsys.readouterr().out
    assert main(["plot-drift", str(tmp_path / "nope"), "--output", str(out)]) == 2
    assert "nope" in capsys.readouterr().err


def test_closing_the_last_logger_leaves_no_wandb_process(tmp_path, monkeypatch):
    """wandb's service process (wandb-core) outlives its runs until the interpreter exits unless torn
    down: after the last RunLogger closes, no wandb child of this process is left."""
    import psutil

    from rollout_ssd.rl.tracking import RunLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    first = RunLogger(tmp_path / "a", {"x": 1})
    second = RunLogger(tmp_path / "b", {"x": 2})

    def wandb_children():
        return [p for p in psutil.Process().children(recursive=True) if "wandb" in " ".join(p.cmdline() or [p.name()])]

    assert wandb_children(), "no wandb service seen: the check would be vacuous"
    first.close()
    second.log(1, {"a": 1.0})  # the other run still works after the first closed
    second.close()
    psutil.wait_procs(wandb_children(), timeout=30)
    assert wandb_children() == []
