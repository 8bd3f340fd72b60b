"""Figure 2-style plots of a report: metric against test mechanism, one line per method (mean and a +-1 std band).

The helpers here (one colour per method label, a mean line with its band, a figure saved as PNG and SVG) also draw
the ablation figures (:mod:`.ablation`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partialvfl.bench.aggregate import Aggregate
from partialvfl.bench.naming import PAPER_DATASET_NAME, dataset_key, mech_key, mechanism_title, method_key
from partialvfl.bench.tables import rows_by_label, tests_of

__all__ = ["LineStyle", "figure_for", "label_colours", "label_styles", "method_labels", "new_figure", "plot_band",
           "save_figure", "write_figures"]


def method_labels(aggs: Sequence[Aggregate]) -> list[tuple[str, str]]:
    """Every (method, label) in method order; a label's place in it gives its colour in every figure."""
    return sorted({(a.method, a.label) for a in aggs}, key=lambda ml: method_key(*ml))


def label_colours(labels: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Colour per label (:func:`method_labels` order, cycling through matplotlib's ten)."""
    return {label: f"C{i % 10}" for i, (_, label) in enumerate(labels)}


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h")
LINESTYLES = ("-", "--", "-.", ":")


@dataclass(frozen=True)
class LineStyle:
    """How one label's line is drawn: colour, marker, dash pattern and a small x shift, all distinct per label, so
    lines that coincide (FALSE-VFL I and II often do) stay visible side by side."""

    colour: str
    marker: str
    linestyle: str
    offset: float


def label_styles(labels: Sequence[tuple[str, str]], spread: float = 0.24) -> dict[str, LineStyle]:
    """A :class:`LineStyle` per label (:func:`method_labels` order): the colours of :func:`label_colours`, markers
    and dash patterns cycling independently, x shifts spread evenly over ``spread`` (in units of one x step)."""
    n = len(labels)
    step = spread / max(n - 1, 1)
    colour = label_colours(labels)
    return {label: LineStyle(colour[label], MARKERS[i % len(MARKERS)], LINESTYLES[i % len(LINESTYLES)],
                             (i - (n - 1) / 2) * step) for i, (_, label) in enumerate(labels)}


def new_figure(figsize: tuple[float, float]) -> Any:
    """A constrained-layout figure on the Agg canvas (no pyplot, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_band(ax: Any, xs: Sequence[float], mean: Sequence[float], std: Sequence[float], *, colour: str, title: str,
              alpha: float, linestyle: str | None = None, marker: str = "o") -> None:
    """The mean as a line with markers and a +-1 std band (none where the std is nan: one seed)."""
    std = [0.0 if math.isnan(s) else s for s in std]
    ax.plot(xs, mean, linestyle=linestyle, marker=marker, markersize=4, color=colour, label=title)
    ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                    color=colour, alpha=alpha, linewidth=0)


def save_figure(fig: Any, out: Path, stem: str, dpi: int) -> list[Path]:
    """``stem``.png and ``stem``.svg in ``out``."""
    written = []
    for ext in ("png", "svg"):
        path = out / f"{stem}.{ext}"
        fig.savefig(path, dpi=dpi)
        written.append(path)
    return written


def write_figures(aggs: Sequence[Aggregate], out: Path) -> list[Path]:
    """Figure 2-style plots: per training mechanism, a panel per dataset; PNG and SVG."""
    written = []
    for train in sorted({a.train for a in aggs}, key=mech_key):
        written += save_figure(figure_for(aggs, train), out, f"figure-{train}", dpi=120)
    return written


def figure_for(aggs: Sequence[Aggregate], train: str) -> Any:
    """The Figure 2-style figure of one training mechanism: a panel per dataset, a line per method label, each label
    with its own colour, marker, dash pattern and x shift (:func:`label_styles`, the same in every figure)."""
    style = label_styles(method_labels(aggs))
    sel = [a for a in aggs if a.train == train]
    datasets = sorted({a.dataset for a in sel}, key=dataset_key)
    fig = new_figure((max(5.5, 4.2 * len(datasets)), 3.8))
    axes = fig.subplots(1, len(datasets), squeeze=False)[0]
    for ax, dataset in zip(axes, datasets):
        ds = [a for a in sel if a.dataset == dataset]
        tests = tests_of(ds)
        x = list(range(len(tests)))
        for label, _, cells in rows_by_label(ds):
            pts = [(i, cells[t]) for i, t in enumerate(tests) if t in cells]
            st = style[label]
            plot_band(ax, [i + st.offset for i, _ in pts], [a.mean for _, a in pts], [a.std for _, a in pts],
                      colour=st.colour, title=pts[0][1].title, alpha=0.2, linestyle=st.linestyle, marker=st.marker)
        ax.set_xticks(x, [mechanism_title(t) for t in tests], rotation=45, ha="right", fontsize=8)
        ax.set_title(PAPER_DATASET_NAME.get(dataset, dataset))
        metric = ds[0].metric
        ax.set_ylabel("accuracy (%)" if metric == "accuracy" else "RMSE")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="best")
    fig.suptitle(f"Trained under {mechanism_title(train)}; mean and \u00b11 std over seeds\n(lines shifted apart "
                 "a little, so that equal ones stay visible)", fontsize=9)
    return fig
