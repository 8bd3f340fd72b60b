"""Ablation reports: accuracy against the number of parties K or the feature heterogeneity alpha, and who wins where.

A store is an ablation when one data source appears under several dataset labels whose protocols differ in the
party count (axis ``K``) or in the importance split's alpha (axis ``alpha``; ``importance:alpha=A`` splitters).
For each training mechanism the report gives

* a table of every method's accuracy averaged over the test mechanisms (per seed, then mean and std over seeds),
  one column per axis value, the best of each column in bold and FALSE-VFL's rank among the methods;
* a figure with one panel per test mechanism plus the average, accuracy against the axis, mean and +-1 std band;
* a "who wins where" map: per axis value and test mechanism the winning method, its margin over the runner-up, and
  FALSE-VFL's rank;
* (axis K) the observed-pattern statistics of the training data: distinct observed patterns among the labelled rows
  and the mean batch size that LASER-VFL's pattern batching gets, against the mixed batch size.

Each method label shows the variant chosen on validation data (:func:`~partialvfl.bench.aggregate.aggregate`).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partialvfl.bench.aggregate import Aggregate, entry_key, is_validation, mean_std
from partialvfl.bench.figures import label_styles, method_labels, new_figure, plot_band, save_figure
from partialvfl.bench.naming import is_false_vfl, mech_key, mechanism_title, method_key
from partialvfl.bench.tables import estimator_note, md_table, mean_std_text, tests_of
from partialvfl.methods.registry import get_spec

__all__ = ["Axis", "ablation_axes", "ablation_axis", "ablation_markdown", "axis_curves", "write_ablation_figures",
           "winners"]

_ALPHA = re.compile(r"importance:alpha=(inf|[0-9.e-]+)")


@dataclass(frozen=True)
class Axis:
    """The ablated quantity: its name, and the value of every dataset label of the store."""

    name: str
    values: dict[str, float]
    source: str = ""

    def ordered(self) -> list[str]:
        """Dataset labels in axis order (K ascending; alpha from inf, the equal split, down to the most unequal)."""
        sign = -1.0 if self.name == "alpha" else 1.0
        return sorted(self.values, key=lambda d: sign * self.values[d])

    def show(self, dataset: str) -> str:
        """The axis value of ``dataset`` as a report prints it (``inf`` for infinity)."""
        v = self.values[dataset]
        return "inf" if math.isinf(v) else f"{v:g}"


def ablation_axis(rows: Sequence[dict[str, Any]]) -> Axis | None:
    """The store's ablation axis (of the source with the most protocols), or ``None`` when no source appears under
    several protocols."""
    axes = ablation_axes(rows)
    return max(axes, key=lambda a: len(a.values)) if axes else None


def ablation_axes(rows: Sequence[dict[str, Any]]) -> list[Axis]:
    """One axis per data source that appears under several protocols differing in the party count (``K``), the
    importance split's alpha (``alpha``) or the number of labels (``labels``)."""
    configs: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.get("status", "done") == "done" and not is_validation(r):
            source = r.get("source") or r["dataset"]
            configs.setdefault(r["dataset"], dict(r.get("dataset_config") or {}, source=source))
    by_source: dict[str, list[str]] = defaultdict(list)
    for label, cfg in configs.items():
        by_source[cfg["source"]].append(label)
    out = []
    for source, labels in sorted(by_source.items()):
        if len(labels) >= 2 and (axis := _axis_of(labels, configs)) is not None:
            out.append(Axis(axis.name, axis.values, source))
    return out


def _axis_of(labels: list[str], configs: dict[str, dict[str, Any]]) -> Axis | None:
    parties = {d: configs[d].get("parties") for d in labels}
    if len(set(parties.values())) == len(labels):
        return Axis("K", {d: float(parties[d]) for d in labels})
    alphas = {d: _ALPHA.fullmatch(str(configs[d].get("splitter") or "")) for d in labels}
    if all(alphas.values()):
        return Axis("alpha", {d: float(m.group(1)) for d, m in alphas.items()})  # type: ignore[union-attr]
    n_labels = {d: configs[d].get("labels") for d in labels}
    if len(set(n_labels.values())) == len(labels):
        return Axis("labels", {d: float(n_labels[d]) for d in labels})
    return None


def _accuracy(row: dict[str, Any]) -> float | None:
    v = row.get("accuracy")
    return None if v is None or row.get("status", "done") != "done" else 100.0 * float(v)


def axis_curves(rows: Sequence[dict[str, Any]], aggs: Sequence[Aggregate], axis: Axis
                ) -> dict[tuple[str, str, str], tuple[float, float, int]]:
    """Per (training mechanism, label, dataset): mean and std over seeds of the accuracy averaged over the test
    mechanisms, for the variant each label shows (the chosen entry of :class:`Aggregate`)."""
    chosen = {(a.dataset, a.train, a.label): a.entry for a in aggs}
    per_seed: dict[tuple[str, str, str], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        v = _accuracy(r)
        if v is None or is_validation(r) or r["dataset"] not in axis.values:
            continue
        label = r.get("label") or r["method"]
        if chosen.get((r["dataset"], r["train_mechanism"], label)) != entry_key(r):
            continue
        per_seed[(r["train_mechanism"], label, r["dataset"])][int(r["seed"])].append(v)
    out = {}
    for key, seeds in per_seed.items():
        means = [statistics.fmean(v) for v in seeds.values()]
        out[key] = (*mean_std(means), len(means))
    return out


def winners(aggs: Sequence[Aggregate], axis: Axis) -> list[dict[str, Any]]:
    """Per (dataset, training, test mechanism): the winner, its margin over the runner-up, FALSE-VFL's rank."""
    groups: dict[tuple[str, str, str], list[Aggregate]] = defaultdict(list)
    for a in aggs:
        if a.dataset in axis.values:
            groups[(a.dataset, a.train, a.test)].append(a)
    out = []
    for (dataset, train, test), group in groups.items():
        ranked = sorted(group, key=lambda a: -a.mean)
        ours = [i for i, a in enumerate(ranked) if is_false_vfl(a.method)]
        out.append({"dataset": dataset, "train": train, "test": test, "winner": ranked[0].title,
                    "margin": ranked[0].mean - ranked[1].mean if len(ranked) > 1 else math.nan,
                    "false_vfl_rank": ours[0] + 1 if ours else None, "methods": len(ranked),
                    "false_vfl_gap": (ranked[ours[0]].mean - ranked[0 if ours[0] else 1].mean)
                    if ours and len(ranked) > 1 else math.nan})
    return out


def _batches_by_pattern(method: str | None) -> bool:
    """Whether ``method`` declares LASER-VFL's ``batching`` parameter (pattern batching: its data statistics count
    the observed patterns)."""
    spec = get_spec(method or "")
    if spec is None or "batching" not in spec.params.names:
        return False
    return "pattern" in (spec.params.param("batching").choices or ())


def _pattern_table(rows: Sequence[dict[str, Any]], axis: Axis) -> str:
    stats: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        ds = r.get("data_stats") or {}
        if (_batches_by_pattern(r.get("method")) and not is_validation(r) and r["dataset"] in axis.values
                and (r.get("params") or {}).get("batching", "pattern") == "pattern" and "patterns" in ds):
            stats[r["dataset"]].append(ds)
    if not stats:
        return ""
    body = []
    for d in axis.ordered():
        if d not in stats:
            continue
        s = stats[d]
        body.append([axis.show(d), f"{statistics.fmean(x['patterns'] for x in s):.0f}",
                     f"{statistics.fmean(x['labelled_rows'] for x in s):.0f}",
                     f"{statistics.fmean(x.get('mean_pattern_batch', math.nan) for x in s):.1f}",
                     f"{statistics.fmean(x['labelled_rows'] / max(x.get('mixed_batches', 1), 1) for x in s):.1f}"])
    return ("Training data as LASER-VFL's pattern batching sees it (labelled rows with an observed party; mean over "
            "seeds and training mechanisms):\n\n" + md_table(
                [axis.name, "distinct observed patterns", "labelled rows", "mean pattern-batch size",
                 "mixed batch size"], body))


def ablation_markdown(rows: Sequence[dict[str, Any]], aggs: Sequence[Aggregate], axis: Axis,
                      curves: dict[tuple[str, str, str], tuple[float, float, int]] | None = None) -> str:
    """The ablation section: per training mechanism the averaged table and the who-wins-where map (``curves``:
    :func:`axis_curves` of the same data, if the caller has them)."""
    curves = axis_curves(rows, aggs, axis) if curves is None else curves
    datasets = axis.ordered()
    note = estimator_note(rows)
    parts = [f"Ablation over {axis.name} ({', '.join(axis.show(d) for d in datasets)}): accuracy (%) averaged over "
             "the test mechanisms per seed, then mean (std) over seeds; the best of each column in bold."
             + (f" {note}" if note else ""), ""]
    titles = {a.label: a.title for a in aggs}
    methods = {a.label: a.method for a in aggs}
    wins = winners(aggs, axis)
    for train in sorted({k[0] for k in curves}, key=mech_key):
        labels = sorted({k[1] for k in curves if k[0] == train}, key=lambda lab: method_key(methods[lab], lab))
        top = {d: max((curves[(train, lab, d)][0] for lab in labels if (train, lab, d) in curves), default=math.nan)
               for d in datasets}
        body = []
        for lab in labels:
            row = [titles[lab]]
            for d in datasets:
                c = curves.get((train, lab, d))
                text = "" if c is None else mean_std_text(c[0], c[1])
                row.append(f"**{text}**" if c is not None and round(c[0], 1) == round(top[d], 1) else text)
            body.append(row)
        if gap := _gap_row(curves, train, labels, methods, datasets):
            body.append(gap)
        parts += [f"**Trained under {mechanism_title(train)}**", "",
                  md_table(["Method"] + [f"{axis.name} = {axis.show(d)}" for d in datasets], body), ""]
        parts += [_winner_map(wins, axis, train), ""]
    if axis.name == "K":
        parts += [_pattern_table(rows, axis), ""]
    return "\n".join(parts).rstrip() + "\n"


def _gap_row(curves: dict[tuple[str, str, str], tuple[float, float, int]], train: str, labels: Sequence[str],
             methods: dict[str, str], datasets: Sequence[str]) -> list[str]:
    """The table's last row: the best FALSE-VFL label minus the best other label, in points (empty without both)."""
    row = ["*FALSE-VFL minus the best other*"]
    for d in datasets:
        have = [lab for lab in labels if (train, lab, d) in curves]
        ours = [curves[(train, lab, d)][0] for lab in have if is_false_vfl(methods[lab])]
        other = [curves[(train, lab, d)][0] for lab in have if not is_false_vfl(methods[lab])]
        row.append(f"{max(ours) - max(other):+.1f}" if ours and other else "")
    return row if any(row[1:]) else []


def _rank_text(w: dict[str, Any]) -> str:
    """FALSE-VFL's rank in a who-wins cell, or that the cell has no FALSE-VFL result (a grid still running)."""
    return "no FALSE-VFL" if w["false_vfl_rank"] is None else f"FALSE-VFL #{w['false_vfl_rank']}"


def _winner_map(wins: Sequence[dict[str, Any]], axis: Axis, train: str) -> str:
    sel = [w for w in wins if w["train"] == train]
    tests = sorted({w["test"] for w in sel}, key=mech_key)
    at = {(w["dataset"], w["test"]): w for w in sel}
    body = []
    for d in axis.ordered():
        row = [axis.show(d)]
        for t in tests:
            w = at.get((d, t))
            row.append("" if w is None else f"{w['winner']} +{w['margin']:.1f} ({_rank_text(w)})")
        body.append(row)
    counts: dict[str, int] = defaultdict(int)
    for w in sel:
        counts[w["winner"]] += 1
    tally = ", ".join(f"{m} {n}" for m, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return (f"Who wins where under {mechanism_title(train)} training (winner, margin over the runner-up in points, "
            f"FALSE-VFL's best variant's rank); wins: {tally}.\n\n"
            + md_table([axis.name] + [mechanism_title(t) for t in tests], body))


def write_ablation_figures(rows: Sequence[dict[str, Any]], aggs: Sequence[Aggregate], axis: Axis,
                           out: Path, curves: dict[tuple[str, str, str], tuple[float, float, int]] | None = None,
                           stem: str | None = None) -> list[Path]:
    """Per training mechanism: accuracy against the axis, one panel per test mechanism and one for the average
    (``curves``: :func:`axis_curves` of the same data, if the caller has them)."""
    curves = axis_curves(rows, aggs, axis) if curves is None else curves
    datasets = axis.ordered()
    xs = list(range(len(datasets)))
    labels = method_labels(aggs)
    style = label_styles(labels)  # colour, marker, dashes and x shift per label: coinciding lines stay visible
    titles = {a.label: a.title for a in aggs}
    written = []
    for train in sorted({a.train for a in aggs}, key=mech_key):
        tests = tests_of([a for a in aggs if a.train == train])
        fig = new_figure((16, 7))
        axes = fig.subplots(2, (len(tests) + 2) // 2, squeeze=False).ravel()
        cell = {(a.label, a.dataset, a.test): a for a in aggs if a.train == train}
        for ax, test in zip(axes, [*tests, "average"]):
            for _, label in labels:
                if test == "average":
                    pts = [(i, curves.get((train, label, d))) for i, d in enumerate(datasets)]
                    pts = [(i, c[0], c[1]) for i, c in pts if c is not None]
                else:
                    pts = [(i, a.mean, a.std) for i, d in enumerate(datasets)
                           if (a := cell.get((label, d, test))) is not None]
                if not pts:
                    continue
                px, mean, std = zip(*pts)
                st = style[label]
                plot_band(ax, [x + st.offset for x in px], mean, std, colour=st.colour, title=titles[label],
                          alpha=0.15, linestyle=st.linestyle, marker=st.marker)
            ax.set_xticks(xs, [axis.show(d) for d in datasets])
            ax.set_xlabel(axis.name)
            ax.set_title(mechanism_title(test) if test != "average" else "mean over test mechanisms", fontsize=9)
            ax.grid(alpha=0.3)
        for ax in axes[len(tests) + 1:]:
            ax.set_visible(False)
        axes[0].set_ylabel("accuracy (%)")
        axes[len(tests)].legend(fontsize=7, loc="best")
        fig.suptitle(f"Accuracy against {axis.name}, trained under {mechanism_title(train)}; mean and \u00b11 std "
                     "over seeds", fontsize=10)
        written += save_figure(fig, out, f"{stem or 'ablation-' + axis.name}-{train}", dpi=110)
    return written
