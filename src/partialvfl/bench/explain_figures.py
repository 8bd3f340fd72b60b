"""Figures of explanations and calibration: a bar chart of the parties' values, a reliability diagram.

Drawn on matplotlib's Agg canvas (no display needed); written as PNG or SVG by the file's suffix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.bench.figures import new_figure
from partialvfl.methods.calibration import BINS, expected_calibration_error, reliability_bins

__all__ = ["FIGURE_SUFFIXES", "figure_path", "reliability_diagram", "value_bar_chart"]

#: the file types a figure is written as
FIGURE_SUFFIXES = (".png", ".svg")


def figure_path(path: str | Path, option: str) -> Path:
    """``path`` if it names a PNG or SVG file, else an error naming the option."""
    p = Path(path)
    if p.suffix.lower() not in FIGURE_SUFFIXES:
        what = p.suffix or "a file without a suffix"
        raise ValueError(f"{option} {p}: a figure is written as .png or .svg, not {what}")
    return p


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    return path


def value_bar_chart(values: Any, path: str | Path, title: str | None = None) -> Path:
    """Each party's Shapley value (bars, with +-1 standard error) beside leave-one-out and alone (markers), from a
    :class:`~partialvfl.methods.party_value.PartyValues`."""
    names = list(values.party_names)
    x = np.arange(len(names))
    fig = new_figure((max(4.5, 1.1 * len(names) + 2.0), 3.6))
    ax = fig.subplots()
    ax.bar(x, values.values, width=0.55, color="C0", yerr=values.standard_errors, capsize=4,
           label="Shapley value (+-1 s.e.)")
    ax.plot(x - 0.12, values.leave_one_out, "v", color="C3", label="leave one out")
    ax.plot(x + 0.12, values.alone, "o", color="C2", label="alone")
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xticks(x, names, rotation=30 if len(names) > 5 else 0, ha="right" if len(names) > 5 else "center")
    ax.set_ylabel(values.gain)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title or f"{values.method}: each party's value ({values.score}, {values.n_rows} rows)", fontsize=9)
    return _save(fig, Path(path))


def reliability_diagram(probs: np.ndarray, true: np.ndarray, used: np.ndarray, path: str | Path, *,
                        title: str, bins: int = BINS) -> Path:
    """Accuracy against confidence per equal-width bin (left: all rows, and the rows by how many parties the
    prediction used; the diagonal is perfect calibration) and how many rows fall in each bin (right)."""
    counts = np.asarray(used, dtype=bool).sum(axis=1)
    fig = new_figure((8.0, 3.8))
    ax, hist = fig.subplots(1, 2, width_ratios=[3, 2])
    ax.plot([0, 1], [0, 1], color="grey", linewidth=0.8, linestyle="--")
    groups: list[tuple[str, np.ndarray]] = [("all rows", np.ones(len(true), dtype=bool))]
    groups += [(f"{c} part{'y' if c == 1 else 'ies'}", counts == c) for c in sorted(set(counts.tolist())) if c > 0]
    for i, (label, rows) in enumerate(groups):
        r = reliability_bins(probs[rows], true[rows], bins)
        live = r["count"] > 0
        ece = expected_calibration_error(probs[rows], true[rows], bins)
        ax.plot(r["confidence"][live], r["accuracy"][live], marker="o", markersize=3, color=f"C{i % 10}",
                linewidth=2.0 if i == 0 else 1.0, label=f"{label} (n={int(rows.sum())}, ECE {ece:.3f})")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence (probability of the predicted class)")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    r = reliability_bins(probs, true, bins)
    centres = (r["edges"][:-1] + r["edges"][1:]) / 2
    hist.bar(centres, r["count"], width=1.0 / bins, color="C0", edgecolor="white")
    hist.set_xlabel("confidence")
    hist.set_ylabel("rows")
    fig.suptitle(title, fontsize=9)
    return _save(fig, Path(path))

