"""Training metrics: one JSON line per step, and a PNG of the four curves that say whether
a run is healthy (reward, KL to the reference, staleness, throughput).

Metric names are namespaced as in CleanRL (``rollout/...``, ``losses/...``); each is
documented in docs/rl.md ("## Trainer", metrics table), which a test checks. Only rank 0
writes. Appending makes a resumed run continue the same file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

PLOTTED = {
    "reward": "rollout/reward_mean",
    "KL to reference": "kl/ref",
    "staleness (versions)": "staleness/mean",
    "throughput (samples/s)": "perf/samples_per_second",
}


class MetricsLog:
    """Appends ``{"step": N, name: value, ...}`` lines to ``<out>/metrics.jsonl``."""

    def __init__(self, out: str | Path, enabled: bool = True) -> None:
        self.path = Path(out) / "metrics.jsonl"
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in values.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def _plain(v) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


def read(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl; a resumed run's repeated steps keep the last row."""
    rows: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]


def plot(jsonl: str | Path, png: str | Path, title: str = "") -> Path:
    """Draw PLOTTED against step into ``png`` (matplotlib's Agg backend: no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read(jsonl)
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    for ax, (label, key) in zip(axes.flat, PLOTTED.items()):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), lw=1.2)
        else:  # kl/ref needs a reference model (kl_coef > 0)
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{label}  [{key}]", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return Path(png)
