"""Reports from a results store, in the FALSE-VFL paper's layout.

* Tables 12-17: one table per training mechanism, a section per dataset, methods x test mechanisms, "mean (std)"
  over seeds, the best of each column in bold, ``*`` where the entry shown is a labelled-only variant (grid entries
  that share a ``label`` are variants of one method; per column the better one is shown, as the paper did).
* Table 2: the gap between the best FALSE-VFL variant and the best other method per configuration (dataset,
  training mechanism, test mechanism), averaged per dataset, per training and per test mechanism, and the number of
  configurations FALSE-VFL wins.
* Table 18: robustness ratios, mean metric when trained under MCAR 5 over mean metric when trained under MCAR 2 (%).
* Figure 2: metric vs. test mechanism, one line per method, mean and a +-1 std band; one figure per training
  mechanism with a panel per dataset (the paper's Figure 2 is the MNAR 7 one).
* For the paper's datasets: our numbers beside the paper's (:mod:`.paper_results`) and the difference.

Conventions: accuracy is reported in % (the store keeps it in [0, 1]); regression cells report RMSE, lower is
better, and their gaps are "best other RMSE minus best FALSE-VFL RMSE" (positive favours FALSE-VFL, as for
accuracy).  The std is the sample standard deviation over seeds (ddof = 1; blank with one seed).  FALSE-VFL means
every method whose registry name starts with ``false-vfl``; "other methods" are all the others in the store.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from partialvfl.bench.grid import stable_hash
from partialvfl.bench.paper_results import PAPER_DATASETS, PAPER_METHODS, paper_accuracy, paper_ratio

__all__ = [
    "Aggregate",
    "GapSummary",
    "WrittenReport",
    "aggregate",
    "gap_summary",
    "headline",
    "mechanism_title",
    "method_title",
    "robustness_ratios",
    "write_report",
]

_PAPER_NAME = {v: k for k, v in PAPER_METHODS.items()}
#: Display names: the FALSE-VFL paper's, plus those of the methods it does not compare with.
_DISPLAY_NAME = _PAPER_NAME | {"x-vfl": "X-VFL", "local": "Local", "ensemble": "Ensemble",
                               "combinatorial": "Combinatorial"}
_PAPER_DATASET_NAME = {v: k for k, v in PAPER_DATASETS.items()}
_METHOD_ORDER = ["vanilla-vfl", "laser-vfl", "plug-vfl", "fedhssl", "x-vfl", "local", "ensemble", "combinatorial",
                 "false-vfl-1", "false-vfl-2"]
_MECH_ORDER = ["mcar0", "mcar2", "mcar5", "mar1", "mar2", "mnar7", "mnar9"]
LABELLED_ONLY = "labelled-only"


def mechanism_title(name: str) -> str:
    """``mcar2`` -> ``MCAR 2``, ``mar1`` -> ``MAR 1``, ``mnar7`` -> ``MNAR 7``; other names unchanged."""
    for prefix in ("mnar", "mcar", "mar"):
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return f"{prefix.upper()} {name[len(prefix):]}"
    return name


def method_title(label: str, method: str) -> str:
    """The paper's name for a method shown under its registry name (``false-vfl-1`` -> ``FALSE-VFL-I``)."""
    return _DISPLAY_NAME.get(method, label) if label == method else label


def is_false_vfl(method: str) -> bool:
    return method.startswith("false-vfl")


def _mech_key(name: str) -> tuple[int, str]:
    return (_MECH_ORDER.index(name) if name in _MECH_ORDER else len(_MECH_ORDER), name)


def _method_key(method: str, label: str) -> tuple[float, str]:
    """The paper's row order: baselines, then methods it does not know, then FALSE-VFL."""
    i = _METHOD_ORDER.index(method) if method in _METHOD_ORDER else _METHOD_ORDER.index("false-vfl-1") - 0.5
    return (float(i), label)


# ---------------------------------------------------------------------- aggregation
@dataclass(frozen=True)
class Aggregate:
    """One table entry: a method (label) on one (dataset, training, test mechanism), over its seeds.

    ``mean``/``std`` are in report units (accuracy %, or RMSE); ``labelled_only`` says the variant shown did not
    use unlabelled data; ``variants`` is how many grid entries competed for this label (the table's ``*`` needs
    both: a labelled-only variant that won over another).
    """

    dataset: str
    train: str
    test: str
    label: str
    method: str
    metric: str
    mean: float
    std: float
    n: int
    labelled_only: bool
    variants: int = 1
    seeds: tuple[int, ...] = ()

    @property
    def title(self) -> str:
        return method_title(self.label, self.method)

    @property
    def starred(self) -> bool:
        """The paper's ``*``: a labelled-only variant shown because it beat the variant that used unlabelled data."""
        return self.labelled_only and self.variants > 1

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "accuracy"


def _value(row: dict[str, Any]) -> float | None:
    if row.get("metric") == "rmse":
        return None if row.get("rmse") is None else float(row["rmse"])
    return None if row.get("accuracy") is None else 100.0 * float(row["accuracy"])


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else math.nan
    return mean, std


def aggregate(rows: Iterable[dict[str, Any]]) -> list[Aggregate]:
    """Mean and std over seeds per (dataset, train, test, label), keeping each label's better variant."""
    per_entry: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
    info: dict[tuple, tuple[str, str, bool]] = {}
    for r in rows:
        if r.get("status", "done") != "done":
            continue
        v = _value(r)
        if v is None or math.isnan(v):
            continue
        entry = stable_hash([r["method"], r.get("preset"), r.get("overrides") or {}])
        key = (r["dataset"], r["train_mechanism"], r["test_mechanism"], r.get("label") or r["method"], entry)
        per_entry[key].append((int(r["seed"]), v))
        info[key] = (r["method"], r.get("metric") or "accuracy", r.get("variant") == LABELLED_ONLY)
    candidates: dict[tuple, list[Aggregate]] = defaultdict(list)
    for key, seeded in per_entry.items():
        dataset, train, test, label, _ = key
        method, metric, labelled_only = info[key]
        seeded.sort()
        mean, std = _mean_std([v for _, v in seeded])
        candidates[(dataset, train, test, label)].append(Aggregate(
            dataset, train, test, label, method, metric, mean, std, len(seeded), labelled_only,
            seeds=tuple(s for s, _ in seeded),
        ))
    out = []
    for group in candidates.values():
        # the better mean; on a tie the variant that used the unlabelled data (no *)
        best = max(group, key=lambda a: (a.mean if a.higher_is_better else -a.mean, not a.labelled_only))
        out.append(Aggregate(**{**best.__dict__, "variants": len(group)}))
    out.sort(key=lambda a: (a.dataset, _mech_key(a.train), _method_key(a.method, a.label), _mech_key(a.test)))
    return out


def _best(values: Iterable[Aggregate]) -> Aggregate | None:
    vals = list(values)
    if not vals:
        return None
    return max(vals, key=lambda a: a.mean if a.higher_is_better else -a.mean)


# ---------------------------------------------------------------------- gap summary (Table 2)
@dataclass
class GapSummary:
    """Best FALSE-VFL vs. best other method per configuration, and the means of those gaps."""

    configs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def wins(self) -> int:
        return sum(1 for c in self.configs if c["gap"] > 0)

    @property
    def total(self) -> int:
        return len(self.configs)

    def mean_gap(self, *, wins_only: bool = False, **where: str) -> float:
        vals = [c["gap"] for c in self.configs
                if all(c[k] == v for k, v in where.items()) and (c["gap"] > 0 or not wins_only)]
        return statistics.fmean(vals) if vals else math.nan

    def by(self, axis: str) -> dict[str, float]:
        keys = sorted({c[axis] for c in self.configs}, key=_mech_key if axis != "dataset" else str)
        return {k: self.mean_gap(**{axis: k}) for k in keys}


def gap_summary(aggs: Sequence[Aggregate]) -> GapSummary:
    """Per (dataset, train, test): gap = best FALSE-VFL mean - best other mean (sign flipped for RMSE)."""
    groups: dict[tuple[str, str, str], list[Aggregate]] = defaultdict(list)
    for a in aggs:
        groups[(a.dataset, a.train, a.test)].append(a)
    summary = GapSummary()
    for (dataset, train, test), group in groups.items():
        ours = _best(a for a in group if is_false_vfl(a.method))
        other = _best(a for a in group if not is_false_vfl(a.method))
        if ours is None or other is None:
            continue
        gap = ours.mean - other.mean if ours.higher_is_better else other.mean - ours.mean
        summary.configs.append({
            "dataset": dataset, "train": train, "test": test, "metric": ours.metric,
            "false_vfl": ours.title, "false_vfl_mean": ours.mean,
            "best_other": other.title, "best_other_mean": other.mean, "gap": gap,
        })
    summary.configs.sort(key=lambda c: (c["dataset"], _mech_key(c["train"]), _mech_key(c["test"])))
    return summary


# ---------------------------------------------------------------------- robustness ratios (Table 18)
def robustness_ratios(aggs: Sequence[Aggregate], harsh: str = "mcar5", mild: str = "mcar2") -> list[dict[str, Any]]:
    """Per (dataset, method, test): 100 * mean when trained under ``harsh`` / mean when trained under ``mild``."""
    index = {(a.dataset, a.label, a.train, a.test): a for a in aggs}
    out = []
    for (dataset, label, train, test), a in index.items():
        if train != mild:
            continue
        b = index.get((dataset, label, harsh, test))
        if b is None or a.mean == 0:
            continue
        out.append({"dataset": dataset, "label": label, "method": a.method, "title": a.title, "test": test,
                    "metric": a.metric, "ratio": 100.0 * b.mean / a.mean})
    out.sort(key=lambda r: (r["dataset"], _method_key(r["method"], r["label"]), _mech_key(r["test"])))
    return out


# ---------------------------------------------------------------------- formatting
def _fmt(mean: float, std: float, digits: int = 1) -> str:
    if math.isnan(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({std:.{digits}f})"


def _num(v: float, digits: int = 1) -> str:
    return "-" if math.isnan(v) else f"{v:.{digits}f}"


def _digits(metric: str) -> int:
    return 1 if metric == "accuracy" else 3


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _tests_of(aggs: Sequence[Aggregate]) -> list[str]:
    return sorted({a.test for a in aggs}, key=_mech_key)


def _rows_by_label(aggs: Sequence[Aggregate]) -> list[tuple[str, str, dict[str, Aggregate]]]:
    by: dict[str, dict[str, Aggregate]] = defaultdict(dict)
    methods: dict[str, str] = {}
    for a in aggs:
        by[a.label][a.test] = a
        methods[a.label] = a.method
    order = sorted(by, key=lambda lab: _method_key(methods[lab], lab))
    return [(lab, methods[lab], by[lab]) for lab in order]


def table_markdown(aggs: Sequence[Aggregate], train: str) -> str:
    """One of Tables 12-17: every dataset's section for training mechanism ``train``."""
    sel = [a for a in aggs if a.train == train]
    tests = _tests_of(sel)
    out_rows = []
    for dataset in sorted({a.dataset for a in sel}):
        ds = [a for a in sel if a.dataset == dataset]
        best = {t: _best(a for a in ds if a.test == t) for t in tests}
        first = True
        for _, _, cells in _rows_by_label(ds):
            any_cell = next(iter(cells.values()))
            row = [dataset if first else "", any_cell.title]
            first = False
            for t in tests:
                a = cells.get(t)
                if a is None:
                    row.append("")
                    continue
                d = _digits(a.metric)
                text = _fmt(a.mean, a.std, d)
                b = best[t]
                if b is not None and round(a.mean, d) == round(b.mean, d):
                    text = f"**{text}**"
                if a.starred:
                    text += "*"
                row.append(text)
            out_rows.append(row)
    metric = "accuracy (%)" if all(a.metric == "accuracy" for a in sel) else "accuracy (%) / RMSE"
    seeds = sorted({a.n for a in sel})
    head = (f"Trained under {mechanism_title(train)}: mean {metric} and std (in parentheses) over "
            f"{'/'.join(map(str, seeds))} seed(s); best of each column in bold; * = labelled data only.")
    return head + "\n\n" + _md_table(["Dataset", "Method"] + [mechanism_title(t) for t in tests], out_rows)


def headline(g: GapSummary, n_fits: int) -> str:
    """One line for the terminal: how many fits, how often FALSE-VFL wins, the mean gap."""
    if not g.configs:
        return f"{n_fits} fits; no configuration has both a FALSE-VFL method and another method"
    return (f"{n_fits} fits; FALSE-VFL beats the best other method in {g.wins} of {g.total} configurations "
            f"(mean gap {_num(g.mean_gap())} points)")


def gaps_markdown(g: GapSummary) -> str:
    if not g.configs:
        return "No configuration has both a FALSE-VFL method and another method: no gap summary."
    lines = [
        f"FALSE-VFL (best variant) beats the best other method in **{g.wins} of {g.total}** configurations; "
        f"mean gap {_num(g.mean_gap())} points over all, "
        + (f"{_num(g.mean_gap(wins_only=True))} over the wins" if g.wins else "no wins")
        + " (paper: 160 of 168, 9.1 and 9.6).",
        "",
    ]
    for axis, title in (("dataset", "dataset"), ("train", "training mechanism"), ("test", "test mechanism")):
        by = g.by(axis)
        names = [mechanism_title(k) if axis != "dataset" else k for k in by]
        lines += [f"Mean gap per {title}:", "", _md_table(names, [[_num(v) for v in by.values()]]), ""]
    rows = [[c["dataset"], mechanism_title(c["train"]), mechanism_title(c["test"]),
             f"{c['false_vfl']} {c['false_vfl_mean']:.1f}", f"{c['best_other']} {c['best_other_mean']:.1f}",
             f"{c['gap']:+.1f}"] for c in g.configs]
    lines += ["Every configuration:", "",
              _md_table(["Dataset", "Train", "Test", "best FALSE-VFL", "best other", "gap"], rows)]
    return "\n".join(lines)


def ratios_markdown(ratios: Sequence[dict[str, Any]]) -> str:
    if not ratios:
        return "No method was run under both MCAR 2 and MCAR 5 training: no robustness ratios."
    tests = sorted({r["test"] for r in ratios}, key=_mech_key)
    rows = []
    for dataset in sorted({r["dataset"] for r in ratios}):
        ds = [r for r in ratios if r["dataset"] == dataset]
        best = {t: max((r["ratio"] for r in ds if r["test"] == t), default=math.nan) for t in tests}
        labels = list(dict.fromkeys(r["label"] for r in ds))
        for i, label in enumerate(labels):
            cells = {r["test"]: r for r in ds if r["label"] == label}
            title = next(iter(cells.values()))["title"]
            row = [dataset if i == 0 else "", title]
            for t in tests:
                r = cells.get(t)
                if r is None:
                    row.append("")
                    continue
                text = f"{r['ratio']:.1f}"
                row.append(f"**{text}**" if round(r["ratio"], 1) == round(best[t], 1) else text)
            rows.append(row)
    return ("Ratio (%) of the mean metric when trained under MCAR 5 to that when trained under MCAR 2 (Table 18 "
            "layout; for RMSE a ratio below 100 is the better); best of each column in bold.\n\n"
            + _md_table(["Dataset", "Method"] + [mechanism_title(t) for t in tests], rows))


def paper_comparison(aggs: Sequence[Aggregate], ratios: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Our mean beside the paper's for every entry the paper also reports (paper datasets and methods only)."""
    out = []
    for a in aggs:
        if a.dataset not in _PAPER_DATASET_NAME or a.method not in _PAPER_NAME or a.metric != "accuracy":
            continue
        p = paper_accuracy(a.dataset, a.train, a.method, a.test)
        if p is None:
            continue
        out.append({"table": "accuracy", "dataset": a.dataset, "train": a.train, "method": a.title, "test": a.test,
                    "ours": a.mean, "ours_std": a.std, "paper": p.mean, "paper_std": p.std,
                    "diff": a.mean - p.mean, "ours_labelled_only": a.starred,
                    "paper_labelled_only": p.labelled_only})
    for r in ratios:
        if r["dataset"] not in _PAPER_DATASET_NAME or r["method"] not in _PAPER_NAME:
            continue
        p = paper_ratio(r["dataset"], r["method"], r["test"])
        if p is not None:
            out.append({"table": "ratio", "dataset": r["dataset"], "train": "mcar5/mcar2", "method": r["title"],
                        "test": r["test"], "ours": r["ratio"], "ours_std": math.nan, "paper": p,
                        "paper_std": math.nan, "diff": r["ratio"] - p, "ours_labelled_only": False,
                        "paper_labelled_only": False})
    return out


def comparison_markdown(rows: Sequence[dict[str, Any]]) -> str:
    acc = [r for r in rows if r["table"] == "accuracy"]
    if not acc:
        return "None of the store's datasets and methods appear in the paper's tables: nothing to compare."
    parts = ["Ours beside the paper's Tables 12-17 (accuracy %, ours - paper in brackets; * labelled-only on either "
             "side). Our grids may use "
             "fewer seeds, smaller caps, fewer epochs and other presets than the paper: read the grid before the "
             "differences.", ""]
    for dataset in sorted({r["dataset"] for r in acc}):
        for train in sorted({r["train"] for r in acc if r["dataset"] == dataset}, key=_mech_key):
            sel = [r for r in acc if r["dataset"] == dataset and r["train"] == train]
            tests = sorted({r["test"] for r in sel}, key=_mech_key)
            table_rows = []
            for method in dict.fromkeys(r["method"] for r in sel):
                cells = {r["test"]: r for r in sel if r["method"] == method}
                table_rows.append([method] + [
                    (f"{c['ours']:.1f}{'*' if c['ours_labelled_only'] else ''} vs "
                     f"{c['paper']:.1f}{'*' if c['paper_labelled_only'] else ''} [{c['diff']:+.1f}]")
                    if (c := cells.get(t)) else "" for t in tests
                ])
            mad = statistics.fmean(abs(r["diff"]) for r in sel)
            parts += [f"**{_PAPER_DATASET_NAME[dataset]}, trained under {mechanism_title(train)}** "
                      f"(mean |difference| {mad:.1f} points)", "",
                      _md_table(["Method"] + [mechanism_title(t) for t in tests], table_rows), ""]
    rat = [r for r in rows if r["table"] == "ratio"]
    if rat:
        mad = statistics.fmean(abs(r["diff"]) for r in rat)
        parts.append(f"Robustness ratios vs. the paper's Table 18: mean |difference| {mad:.1f} points over "
                     f"{len(rat)} entries (see paper_comparison.csv).")
    return "\n".join(parts)


# ---------------------------------------------------------------------- cost
def cost_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per dataset and method label: fits, mean fit seconds, mean predict seconds per test set, mean MB sent."""
    fits: dict[tuple[str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        fits[(r["dataset"], r.get("label") or r["method"])].setdefault(r["cell_hash"], {"predict": [], **r})
        fits[(r["dataset"], r.get("label") or r["method"])][r["cell_hash"]]["predict"].append(
            r.get("predict_seconds") or 0.0)
    out = []
    for (dataset, label), cells in fits.items():
        vals = list(cells.values())
        out.append({
            "dataset": dataset, "label": label, "method": vals[0]["method"],
            "title": method_title(label, vals[0]["method"]), "fits": len(vals),
            "fit_seconds": statistics.fmean(float(v.get("fit_seconds") or 0.0) for v in vals),
            "predict_seconds": statistics.fmean(statistics.fmean(v["predict"]) for v in vals),
            "megabytes": statistics.fmean(float(v.get("bytes_communicated") or 0) for v in vals) / 1e6,
        })
    out.sort(key=lambda r: (r["dataset"], _method_key(r["method"], r["label"])))
    return out


def cost_markdown(rows: Sequence[dict[str, Any]]) -> str:
    costs = cost_rows(rows)
    starts = sorted(str(r["started_at"]) for r in rows if r.get("started_at"))
    ends = sorted(str(r["finished_at"]) for r in rows if r.get("finished_at"))
    total = sum(c["fit_seconds"] * c["fits"] for c in costs)
    hosts = ", ".join(sorted({str(r["hostname"]) for r in rows if r.get("hostname")})) or "unknown"
    head = ""
    if starts and ends:
        span = (datetime.fromisoformat(ends[-1]) - datetime.fromisoformat(starts[0])).total_seconds()
        head = (f"Fits ran from {starts[0]} to {ends[-1]} (UTC): {span / 3600:.2f} h from the first start to the "
                f"last finish, on host(s) {hosts}; total fit time {total:.0f} s = {total / 3600:.2f} h (sum over "
                "fits, all workers; an interrupted and resumed grid counts the pause in the span).")
    table = _md_table(
        ["Dataset", "Method", "fits", "fit s (mean)", "predict s per test set", "MB between parties per fit"],
        [[c["dataset"], c["title"], str(c["fits"]), f"{c['fit_seconds']:.1f}", f"{c['predict_seconds']:.2f}",
          f"{c['megabytes']:.1f}"] for c in costs],
    )
    return (head + "\n\n" + table).strip()


# ---------------------------------------------------------------------- figures
def write_figures(aggs: Sequence[Aggregate], out: Path) -> list[Path]:
    """Figure 2-style plots: per training mechanism, a panel per dataset; PNG and SVG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    written = []
    labels = sorted({(a.method, a.label) for a in aggs}, key=lambda ml: _method_key(*ml))
    colour = {label: f"C{i % 10}" for i, (_, label) in enumerate(labels)}  # one colour per method in every figure
    for train in sorted({a.train for a in aggs}, key=_mech_key):
        sel = [a for a in aggs if a.train == train]
        datasets = sorted({a.dataset for a in sel})
        fig = Figure(figsize=(max(5.5, 4.2 * len(datasets)), 3.8), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, len(datasets), squeeze=False)[0]
        for ax, dataset in zip(axes, datasets):
            ds = [a for a in sel if a.dataset == dataset]
            tests = _tests_of(ds)
            x = list(range(len(tests)))
            for label, _, cells in _rows_by_label(ds):
                pts = [(i, cells[t]) for i, t in enumerate(tests) if t in cells]
                xs = [i for i, _ in pts]
                mean = [a.mean for _, a in pts]
                std = [0.0 if math.isnan(a.std) else a.std for _, a in pts]
                title = pts[0][1].title
                ax.plot(xs, mean, marker="o", markersize=3, label=title, color=colour[label])
                ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                color=colour[label], alpha=0.2, linewidth=0)
            ax.set_xticks(x, [mechanism_title(t) for t in tests], rotation=45, ha="right", fontsize=8)
            ax.set_title(_PAPER_DATASET_NAME.get(dataset, dataset))
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


# ---------------------------------------------------------------------- the report
def _write_csv(path: Path, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()})
    return path


@dataclass(frozen=True)
class WrittenReport:
    """What :func:`write_report` wrote (``report.md`` first) and the report's one-line :func:`headline`."""

    paths: list[Path]
    headline: str


def write_report(store: str | Path, out: str | Path, *, figures: bool = True) -> WrittenReport:
    """Write the whole report of a store into ``out``: ``report.md`` plus per-part Markdown, CSV and figures."""
    from partialvfl.bench.store import ResultStore

    with ResultStore(store, create=False) as s:
        rows = s.rows(status="done")
        failed = s.rows(status="failed")
    if not rows:
        raise ValueError(f"the store in {store} has no finished results to report")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    aggs = aggregate(rows)
    gaps = gap_summary(aggs)
    ratios = robustness_ratios(aggs)
    comparison = paper_comparison(aggs, ratios)
    written: list[Path] = []

    sections = [
        "# Benchmark report",
        "",
        f"{len(rows)} results ({len({r['cell_hash'] for r in rows})} fits) from the store `{store}`; "
        f"datasets: {', '.join(sorted({r['dataset'] for r in rows}))}; code version(s): "
        f"{', '.join(sorted({str(r['code_version']) for r in rows}))}; grid(s): "
        f"{', '.join(sorted({str(r['grid']) for r in rows}))}."
        + (f" {len({r['cell_hash'] for r in failed})} fit(s) failed and are left out." if failed else ""),
        "",
    ]
    trains = sorted({a.train for a in aggs}, key=_mech_key)
    for train in trains:
        md = table_markdown(aggs, train)
        path = out / f"table-{train}.md"
        path.write_text(md + "\n")
        written.append(path)
        sections += [f"## Trained under {mechanism_title(train)}", "", md, ""]
        if figures:
            sections += [f"![trained under {mechanism_title(train)}](figure-{train}.png)", ""]
    columns: dict[tuple[str, str, str], list[Aggregate]] = defaultdict(list)
    for a in aggs:
        columns[(a.dataset, a.train, a.test)].append(a)
    best = {k: _best(v) for k, v in columns.items()}
    written.append(_write_csv(
        out / "tables.csv",
        [{**a.__dict__, "best": a is best[(a.dataset, a.train, a.test)], "starred": a.starred,
          "seeds": " ".join(map(str, a.seeds))}
         for a in aggs],
        ["train", "dataset", "label", "method", "test", "metric", "mean", "std", "n", "labelled_only", "variants",
         "starred", "best", "seeds"],
    ))
    gaps_md = gaps_markdown(gaps)
    (out / "gaps.md").write_text(gaps_md + "\n")
    written.append(out / "gaps.md")
    written.append(_write_csv(out / "gaps.csv", gaps.configs,
                              ["dataset", "train", "test", "metric", "false_vfl", "false_vfl_mean", "best_other",
                               "best_other_mean", "gap"]))
    sections += ["## Gap summary (Table 2 layout)", "", gaps_md, ""]
    ratios_md = ratios_markdown(ratios)
    (out / "ratios.md").write_text(ratios_md + "\n")
    written.append(out / "ratios.md")
    written.append(_write_csv(out / "ratios.csv", ratios, ["dataset", "label", "method", "test", "metric", "ratio"]))
    sections += ["## Robustness to severe missingness (Table 18 layout)", "", ratios_md, ""]
    comp_md = comparison_markdown(comparison)
    (out / "paper_comparison.md").write_text(comp_md + "\n")
    written.append(out / "paper_comparison.md")
    written.append(_write_csv(out / "paper_comparison.csv", comparison,
                              ["table", "dataset", "train", "method", "test", "ours", "ours_std", "paper",
                               "paper_std", "diff", "ours_labelled_only", "paper_labelled_only"]))
    sections += ["## Beside the paper's numbers", "", comp_md, ""]
    sections += ["## Cost", "", cost_markdown(rows), ""]
    if failed:
        seen = {}
        for r in failed:
            seen.setdefault(r["cell_hash"], r)
        sections += ["## Failed fits", "", _md_table(
            ["Dataset", "Method", "Train", "Seed", "Error"],
            [[r["dataset"], r["label"], r["train_mechanism"], str(r["seed"]),
              (r["error"] or "").strip().splitlines()[-1][:200] if r["error"] else ""] for r in seen.values()],
        ), ""]
    if figures:
        written += write_figures(aggs, out)
    report = out / "report.md"
    report.write_text("\n".join(sections))
    written.insert(0, report)
    return WrittenReport(written, headline(gaps, len({r["cell_hash"] for r in rows})))
