"""Figure 2-style plots of a report: metric against test mechanism, one line per method (mean and a +-1 std band)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from partialvfl.bench.aggregate import Aggregate
from partialvfl.bench.naming import PAPER_DATASET_NAME, mech_key, mechanism_title, method_key
from partialvfl.bench.tables import rows_by_label, tests_of

__all__ = ["write_figures"]


def write_figures(aggs: Sequence[Aggregate], out: Path) -> list[Path]:
    """Figure 2-style plots: per training mechanism, a panel per dataset; PNG and SVG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    written = []
    labels = sorted({(a.method, a.label) for a in aggs}, key=lambda ml: method_key(*ml))
    colour = {label: f"C{i % 10}" for i, (_, label) in enumerate(labels)}  # one colour per method in every figure
    for train in sorted({a.train for a in aggs}, key=mech_key):
        sel = [a for a in aggs if a.train == train]
        datasets = sorted({a.dataset for a in sel})
        fig = Figure(figsize=(max(5.5, 4.2 * len(datasets)), 3.8), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, len(datasets), squeeze=False)[0]
        for ax, dataset in zip(axes, datasets):
            ds = [a for a in sel if a.dataset == dataset]
            tests = tests_of(ds)
            x = list(range(len(tests)))
            for label, _, cells in rows_by_label(ds):
                pts = [(i, cells[t]) for i, t in enumerate(tests) if t in cells]
                xs = [i for i, _ in pts]
                mean = [a.mean for _, a in pts]
                std = [0.0 if math.isnan(a.std) else a.std for _, a in pts]
                title = pts[0][1].title
                ax.plot(xs, mean, marker="o", markersize=3, label=title, color=colour[label])
                ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                color=colour[label], alpha=0.2, linewidth=0)
            ax.set_xticks(x, [mechanism_title(t) for t in tests], rotation=45, ha="right", fontsize=8)
            ax.set_title(PAPER_DATASET_NAME.get(dataset, dataset))
            metric = ds[0].metric
            ax.set_ylabel("accuracy (%)" if metric == "accuracy" else "RMSE")
            ax.grid(alpha=0.3)
        axes[-1].legend(fontsize=7, loc="best")
        fig.suptitle(f"Trained under {mechanism_title(train)}; mean and \u00b11 std over seeds", fontsize=10)
        for ext in ("png", "svg"):
            path = out / f"figure-{train}.{ext}"
            fig.savefig(path, dpi=120)
            written.append(path)
    return written
