"""`plot_run`: one run's PNG from its metrics.jsonl (and versions.jsonl), without wandb.

Six panels: the mean reward and the KL to the initial policy (`learner/kl_initial`) against the step; the
step's seconds by phase (`time/*_s`, stacked: they sum to `time/step_s`) and the rollout phase's engine
seconds by live batch (`rollout/seconds_by_batch/*`, stacked, large batches at the bottom: a step's head
under its tail); acceptance and SSD hit rate against the policy weight version. The line panels are
tracking.py's (`_draw_panel`, as `plot_drift` draws them); a panel without its metric says so.
"""

from __future__ import annotations

from pathlib import Path

from rollout_ssd import metric_names as names
from rollout_ssd.rl.tracking import _draw_panel, _load_run, _version_of

STEP_LINES = ((names.LEARNER_KL_INITIAL, "KL to the initial policy"),)
PHASE_LABELS = {names.TIME_ROLLOUT_S: "rollout", names.TIME_LEARN_S: "learn", names.TIME_SYNC_S: "sync",
                names.TIME_FOLLOW_S: "draft follow", names.TIME_DRIFT_S: "drift"}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _draw_stacked(ax, rows: list, keys: list, labels: list, title: str) -> None:
    """One bar per step, stacked over `keys` (absent: 0), bottom first."""
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    rows = sorted((r for r in rows if any(_number(r.get(k)) for k in keys)), key=lambda r: r["step"])
    if not rows:
        ax.text(0.5, 0.5, f"no data\n({title})", ha="center", va="center", transform=ax.transAxes)
        return
    steps = [r["step"] for r in rows]
    bottom = [0.0] * len(rows)
    for key, label in zip(keys, labels):
        heights = [float(r[key]) if _number(r.get(key)) else 0.0 for r in rows]
        ax.bar(steps, heights, bottom=bottom, label=label, width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3, axis="y")


def _buckets(rows: list) -> list[str]:
    """The live-batch buckets the run logged, largest first."""
    found = {k[len(names.SECONDS_BY_BATCH):] for r in rows for k in r if k.startswith(names.SECONDS_BY_BATCH)}
    return sorted(found, key=lambda b: -int(b.split("-")[0]))


def plot_run(run, output=None) -> Path:
    """Draw `run` (a run directory, or its metrics.jsonl) to `output` (default: run_dir/run.png)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state; savefig uses Agg

    loaded = _load_run(run, None)
    if not loaded.step_rows:
        raise ValueError(f"{run}: no per-step rows (metrics.jsonl rows with a 'step')")
    run = Path(run)
    output = Path(output) if output is not None else (run if run.is_dir() else run.parent) / "run.png"
    fig = Figure(figsize=(16, 8))
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.07, top=0.9, hspace=0.4, wspace=0.25)
    fig.suptitle(f"{loaded.label}: {len(loaded.step_rows)} steps")
    axes = fig.subplots(2, 3).flatten()
    steps, step_of = (lambda r: r.step_rows), (lambda row: row["step"])
    _draw_panel(axes[0], [loaded], steps, step_of, "reward/mean", "mean reward", "step")
    _draw_panel(axes[1], [loaded], steps, step_of, STEP_LINES[0][0], STEP_LINES[0][1], "step")
    phases = list(PHASE_LABELS)
    _draw_stacked(axes[2], loaded.step_rows, phases, [PHASE_LABELS[k] for k in phases], "step time by phase")
    buckets = _buckets(loaded.step_rows)
    _draw_stacked(axes[3], loaded.step_rows, [names.rollout_seconds_by_batch(b) for b in buckets],
                  [f"{b} live" for b in buckets], "rollout time by live batch")
    versions = lambda r: r.version_rows  # noqa: E731
    _draw_panel(axes[4], [loaded], versions, _version_of, names.SPEC_ACCEPT_RATE, "acceptance", "policy weight version")
    _draw_panel(axes[5], [loaded], versions, _version_of, names.SSD_HIT_RATE, "SSD hit rate", "policy weight version")
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, format="png", dpi=100)
    return output
