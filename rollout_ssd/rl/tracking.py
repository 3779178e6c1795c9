"""Run tracking: `RunLogger` (wandb + JSONL), `read_jsonl` and the drift plots.

Every metric goes to two sinks. `out_dir/metrics.jsonl` is the record of truth: one flushed JSON line per
`log()` call, readable by `read_jsonl` even after a killed run (a truncated last line is skipped), and
needing no wandb to read or plot. wandb is the dashboard; it runs "offline" by default (files under
`out_dir/wandb`, no network; upload later with `wandb sync`), "online" on request, or not at all with
"disabled" (wandb is then never imported).

wandb specifics, chosen here:
- x-axes: history rows carry a `step` key (the trainer step) that every training metric is plotted
  against, and `drift_version/version` for the per-version rows; wandb's own `_step` is not used,
  so per-step and per-version rows can interleave without wandb dropping "out of order" steps.
- a list value such as `ssd/fanout` is logged element-wise as `ssd/fanout/0`, `ssd/fanout/1`, ...
  (one line per position on the dashboard); the JSONL keeps the list.
- strings (`ssd/strategy`) are logged as they are; None and non-finite floats are not sent to wandb
  (the JSONL writes null).
- per-version rows (`log_version`) are also gathered into a `wandb.Table` logged once, as
  `drift/versions`, at `close()`. Logging a Table stages an artifact under wandb's data dir
  (`WANDB_DATA_DIR`, by default in the home directory), not under `out_dir`.

`plot_drift` draws, from the JSONL files of one or more runs (typically a frozen-draft and a
following-draft run), hit rate, acceptance and target-draft KL against the policy weight version, and
tokens/s against the step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from pathlib import Path

from rollout_ssd import metric_names as names

logger = logging.getLogger(__name__)

WANDB_MODES = ("offline", "online", "disabled")
VERSION_PANELS = ((names.SSD_HIT_RATE, "SSD hit rate"), (names.SPEC_ACCEPT_RATE, f"acceptance ({names.SPEC_ACCEPT_RATE})"),
                  (names.DRIFT_KL_TARGET_DRAFT, "KL(target || draft)"))
STEP_PANEL = (names.ROLLOUT_TOKENS_PER_S, "rollout tokens/s")


def _plain(value, key: str):
    """A JSON-ready value: numpy/torch scalars and arrays become Python numbers and lists."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, list):
        return [_plain(v, key) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise ValueError(f"metric {key!r}: unsupported value {value!r} of type {type(value).__name__}")


def jsonable_config(config):
    """A JSON-ready copy of a config: dataclasses as dicts, tuples as lists, other objects (paths,
    dtypes, devices) as their readable str."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if isinstance(config, dict):
        return {str(k): jsonable_config(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [jsonable_config(v) for v in config]
    if config is None or isinstance(config, (bool, int, float, str)):
        return config
    return str(config)  # paths, dtypes, devices: their readable form


def _wandb_scalars(metrics: dict, prefix: str = "") -> dict:
    """wandb's view of one row: lists element-wise as `name/i`, None dropped, everything else as is."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, list):
            out.update(_wandb_scalars({f"{key}/{i}": v for i, v in enumerate(value)}, prefix))
        elif value is not None:
            out[prefix + key] = value
    return out


class RunLogger:
    """The recipes' metrics sink: `metrics.jsonl`, `versions.jsonl`, `config.json` in `out_dir`, plus wandb.

    Appends to existing JSONL files (a resumed run continues them). A context manager; `close()` is
    idempotent. Thread-safe: the rollout and learner threads may log concurrently.
    """

    def __init__(self, out_dir, config: dict, *, wandb_mode: str = "offline", project: str = "rollout_ssd",
                 run_name: str | None = None, group: str | None = None, tags=()):
        if wandb_mode not in WANDB_MODES:
            raise ValueError(f"wandb_mode: {wandb_mode!r} is not one of {', '.join(WANDB_MODES)}")
        if not isinstance(config, dict):
            raise ValueError(f"config: expected a dict, got {type(config).__name__}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.config = jsonable_config(config)
        self.wandb_mode = wandb_mode
        (self.out_dir / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        self._metrics_file = open(self.out_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._versions_file = open(self.out_dir / "versions.jsonl", "a", encoding="utf-8")
        self._version_rows: list[dict] = []
        self._defined: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.run = None
        if wandb_mode != "disabled":
            try:
                self.run = self._init_wandb(project, run_name, group, tags)
            except BaseException:
                self._metrics_file.close()
                self._versions_file.close()
                raise

    def _init_wandb(self, project, run_name, group, tags):
        import wandb

        settings = wandb.Settings(mode=self.wandb_mode, console="off", save_code=False, silent=True)
        _hold_wandb()
        try:
            run = wandb.init(project=project, name=run_name, group=group, tags=list(tags), config=self.config,
                             dir=str(self.out_dir), mode=self.wandb_mode, reinit="create_new", settings=settings)
        except BaseException:
            _release_wandb()
            raise
        run.define_metric("step")
        run.define_metric("drift_version/version")
        return run

    def _wandb_log(self, row: dict, step_metric: str) -> None:
        for key in row:
            if key not in self._defined and key != step_metric:
                self.run.define_metric(key, step_metric=step_metric)
                self._defined.add(key)
        self.run.log(row)

    @staticmethod
    def _write(file, row: dict) -> None:
        file.write(json.dumps(row, allow_nan=False) + "\n")
        file.flush()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"RunLogger({self.out_dir}) is closed")

    def log(self, step: int, metrics: dict) -> None:
        """One row of training/rollout metrics at trainer step `step` (docs/DESIGN.md's metric names)."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step: expected an int, got {step!r}")
        for reserved in ("step", "time"):
            if reserved in metrics:
                raise ValueError(f"metrics: key {reserved!r} is reserved")
        values = {str(k): _plain(v, str(k)) for k, v in metrics.items()}
        with self._lock:
            self._check_open()
            self._write(self._metrics_file, {"step": step, "time": time.time(), **values})
            if self.run is not None:
                self._wandb_log({"step": step, **_wandb_scalars(values)}, step_metric="step")

    def log_version(self, row: dict) -> None:
        """One row per policy weight version: `version` (int) plus e.g. `draft_mode` ("frozen" | "follow"),
        `ssd/hit_rate`, `spec/accept_rate`, `drift/kl_target_draft`, `sync/bytes`, `sync/seconds`."""
        version = row.get("version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"log_version: row needs an int 'version', got {version!r}")
        if "time" in row:
            raise ValueError("log_version: key 'time' is reserved")
        values = {str(k): _plain(v, str(k)) for k, v in row.items()}
        with self._lock:
            self._check_open()
            self._write(self._versions_file, {**values, "time": time.time()})
            self._version_rows.append(values)
            if self.run is not None:
                scalars = _wandb_scalars(values, "drift_version/")
                self._wandb_log(scalars, step_metric="drift_version/version")

    def _versions_table(self):
        import wandb

        columns: list[str] = []
        for row in self._version_rows:
            columns += [k for k in row if k not in columns]
        cell = lambda v: json.dumps(v) if isinstance(v, list) else v  # a Table column holds one type
        data = [[cell(row.get(c)) for c in columns] for row in self._version_rows]
        return wandb.Table(columns=columns, data=data)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self.run is not None:
                    if self._version_rows:
                        self.run.log({names.DRIFT_VERSIONS: self._versions_table()})
                    self.run.finish()
            finally:
                self._metrics_file.close()
                self._versions_file.close()
                if self.run is not None:
                    _release_wandb()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_OPEN_RUNS = 0  # wandb runs this process has open; guarded by _WANDB_LOCK
_WANDB_LOCK = threading.Lock()


def _hold_wandb() -> None:
    global _OPEN_RUNS
    with _WANDB_LOCK:
        _OPEN_RUNS += 1


def _release_wandb() -> None:
    """After the last open run finishes, stop wandb's service process (wandb-core), which otherwise
    outlives every run until the interpreter exits: a closed logger leaves no process behind."""
    global _OPEN_RUNS
    import wandb

    with _WANDB_LOCK:
        _OPEN_RUNS -= 1
        if _OPEN_RUNS == 0:
            wandb.teardown()


def read_jsonl(path) -> list[dict]:
    """The rows of a JSONL file. A truncated last line (a killed writer) is skipped with a warning;
    a bad line elsewhere, a non-object row or a missing file is a ValueError naming the path."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    lines = path.read_text(encoding="utf-8").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:
                logger.warning("%s: skipping a truncated last line (%s)", path, err)
                break
            raise ValueError(f"{path}:{i + 1}: not valid JSON ({err})") from err
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i + 1}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


@dataclasses.dataclass
class _RunRows:
    label: str
    version_rows: list  # rows with a version (`version` or `sync/version`)
    step_rows: list  # rows with a `step`


def _version_of(row: dict):
    v = row.get("version", row.get(names.SYNC_VERSION))
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _load_run(run, label: str | None) -> _RunRows:
    run = Path(run)
    if run.is_dir():
        versions, metrics = run / "versions.jsonl", run / "metrics.jsonl"
        if not versions.is_file() and not metrics.is_file():
            raise ValueError(f"{run}: a run directory needs versions.jsonl or metrics.jsonl")
        step_rows = read_jsonl(metrics) if metrics.is_file() else []
        version_rows = read_jsonl(versions) if versions.is_file() else []
        version_rows = [r for r in version_rows if _version_of(r) is not None] or \
            [r for r in step_rows if _version_of(r) is not None]  # fall back to metrics.jsonl
        name = run.name
    else:
        if run.is_file() and run.stat().st_size == 0:
            raise ValueError(f"{run}: empty file")
        rows = read_jsonl(run)
        version_rows = [r for r in rows if _version_of(r) is not None]
        step_rows = rows
        name = run.parent.name if run.stem in ("versions", "metrics") else run.stem
    step_rows = [r for r in step_rows if isinstance(r.get("step"), (int, float)) and not isinstance(r.get("step"), bool)]
    if not version_rows and not step_rows:
        raise ValueError(f"{run}: no usable rows (need rows with a 'version', 'sync/version' or 'step')")
    if label is None:
        modes = [r["draft_mode"] for r in version_rows + step_rows if isinstance(r.get("draft_mode"), str)]
        label = name if not modes or modes[0] == name else f"{modes[0]} ({name})"
    return _RunRows(label, version_rows, step_rows)


def _series(rows: list, x_of, key: str):
    points = []
    for row in rows:
        y = row.get(key, "")  # absent, a string or a list: not plotted
        if y is None or (isinstance(y, (int, float)) and not isinstance(y, bool)):
            points.append((x_of(row), math.nan if y is None else float(y)))  # None (non-finite) breaks the line
    points.sort(key=lambda p: p[0])
    return [p[0] for p in points], [p[1] for p in points]


def _draw_panel(ax, runs: list, rows_of, x_of, key: str, title: str, xlabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # versions and steps are whole numbers
    drawn = 0
    for run in runs:
        xs, ys = _series(rows_of(run), x_of, key)
        if xs:
            ax.plot(xs, ys, marker="o", markersize=3, label=run.label)
            drawn += 1
    if drawn:
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    else:
        ax.text(0.5, 0.5, f"no data\n({key})", ha="center", va="center", transform=ax.transAxes)


def plot_drift(runs: list, output, labels: list[str] | None = None) -> Path:
    """A PNG comparing runs: hit rate, acceptance and KL(target || draft) against the weight version, and
    `rollout/tokens_per_s` against the step. Each run is a run directory or a .jsonl file."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state; savefig uses Agg

    if not runs:
        raise ValueError("runs: need at least one run directory or .jsonl file")
    if labels is not None and len(labels) != len(runs):
        raise ValueError(f"labels: {len(labels)} labels for {len(runs)} runs")
    loaded = [_load_run(run, None if labels is None else labels[i]) for i, run in enumerate(runs)]
    output = Path(output)
    fig = Figure(figsize=(12, 8))
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.07, top=0.95, hspace=0.3, wspace=0.2)  # a layout engine draws twice
    axes = fig.subplots(2, 2).flatten()
    for ax, (key, title) in zip(axes, VERSION_PANELS):
        _draw_panel(ax, loaded, lambda r: r.version_rows, _version_of, key, title, "policy weight version")
    _draw_panel(axes[3], loaded, lambda r: r.step_rows, lambda row: row["step"], STEP_PANEL[0], STEP_PANEL[1], "step")
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, format="png", dpi=100)
    return output
