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
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partialvfl.bench.ablation import ablation_axes, ablation_markdown, axis_curves, write_ablation_figures
from partialvfl.bench.aggregate import (
    Aggregate,
    GapSummary,
    aggregate,
    best,
    gap_summary,
    is_validation,
    robustness_ratios,
)
from partialvfl.bench.figures import write_figures
from partialvfl.bench.naming import dataset_key, mech_key, mechanism_title, method_title
from partialvfl.bench.tables import (
    comparison_markdown,
    cost_markdown,
    estimator_note,
    gaps_markdown,
    headline,
    md_table,
    paper_comparison,
    ratios_markdown,
    table_markdown,
    tuning_markdown,
)

__all__ = [
    "Aggregate",
    "GapSummary",
    "WrittenReport",
    "aggregate",
    "gap_summary",
    "headline",
    "mechanism_title",
    "method_title",
    "paper_comparison",
    "pipeline_check_notice",
    "robustness_ratios",
    "write_report",
]


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


class _Writer:
    """Collects the report's sections and the files written beside it."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.sections: list[str] = []
        self.written: list[Path] = []

    def part(self, name: str, title: str, text: str) -> None:
        """A section of ``report.md`` that is also written alone as ``name``."""
        (self.out / name).write_text(text + ("" if text.endswith("\n") else "\n"))
        self.written.append(self.out / name)
        self.sections += [f"## {title}", "", text.rstrip(), ""]

    def csv(self, name: str, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
        self.written.append(_write_csv(self.out / name, rows, columns))


#: grids that check the pipeline (grid -> fits -> store -> report), too small for their numbers to mean anything
PIPELINE_CHECK_GRIDS = ("smoke",)


def pipeline_check_notice(rows: Sequence[dict[str, Any]]) -> str | None:
    """What a report must say first when its rows come from a pipeline-check grid (:data:`PIPELINE_CHECK_GRIDS`)."""
    grids = sorted({str(r["grid"]) for r in rows} & set(PIPELINE_CHECK_GRIDS))
    if not grids:
        return None
    return (f"**Smoke run: these numbers are not results.** The {', '.join(repr(g) for g in grids)} grid checks that "
            "the pipeline runs (grid, fits, store, report) in about a minute: a few hundred digits, 100 labels, short "
            "training, 2 seeds. Its accuracies are rough and its gaps and win counts say nothing about the methods; "
            "the project's results are the cpu grid's (docs/results.md).")


def _summary_line(store: str | Path, rows: Sequence[dict[str, Any]], failed: Sequence[dict[str, Any]]) -> str:
    return (f"{len(rows)} results ({len({r['cell_hash'] for r in rows})} fits) from the store `{store}`; "
            f"datasets: {', '.join(sorted({r['dataset'] for r in rows}, key=dataset_key))}; code version(s): "
            f"{', '.join(sorted({str(r['code_version']) for r in rows}))}; grid(s): "
            f"{', '.join(sorted({str(r['grid']) for r in rows}))}."
            + (f" {len({r['cell_hash'] for r in failed})} fit(s) failed and are left out." if failed else ""))


def _tables(w: _Writer, aggs: Sequence[Aggregate], figures: bool, note: str = "") -> None:
    for train in sorted({a.train for a in aggs}, key=mech_key):
        w.part(f"table-{train}.md", f"Trained under {mechanism_title(train)}", table_markdown(aggs, train, note))
        if figures:
            w.sections += [f"![trained under {mechanism_title(train)}](figure-{train}.png)", ""]
    columns: dict[tuple[str, str, str], list[Aggregate]] = defaultdict(list)
    for a in aggs:
        columns[(a.dataset, a.train, a.test)].append(a)
    top = {k: best(v) for k, v in columns.items()}
    # the column keeps its published name (labelled_only) whatever the attribute's spelling
    w.csv("tables.csv", [{**a.__dict__, "labelled_only": a.labeled_only,
                          "best": a is top[(a.dataset, a.train, a.test)], "starred": a.starred,
                          "seeds": " ".join(map(str, a.seeds))} for a in aggs],
          ["train", "dataset", "label", "method", "test", "metric", "mean", "std", "n", "labelled_only", "variants",
           "starred", "best", "seeds", "validation", "selected_on"])


def _ablation(w: _Writer, rows: Sequence[dict[str, Any]], aggs: Sequence[Aggregate], figures: bool) -> None:
    axes = ablation_axes(rows)
    for axis in axes:  # one per data source that varies (file names carry the source when there are several)
        stem = f"ablation-{axis.name}" + (f"-{axis.source}" if len(axes) > 1 else "")
        curves = axis_curves(rows, aggs, axis)  # once, for the tables and the figures
        title = f"Ablation over {axis.name}" + (f" ({axis.source})" if len(axes) > 1 else "")
        w.part(f"{stem}.md", title, ablation_markdown(rows, aggs, axis, curves))
        if figures:
            w.written += write_ablation_figures(rows, aggs, axis, w.out, curves, stem=stem)
            w.sections += [f"![accuracy against {axis.name}, trained under {mechanism_title(t)}]"
                           f"({stem}-{t}.png)" for t in sorted({a.train for a in aggs}, key=mech_key)]
            w.sections.append("")


def _failures(failed: Sequence[dict[str, Any]]) -> list[str]:
    if not failed:
        return []
    seen: dict[str, dict[str, Any]] = {}
    for r in failed:
        seen.setdefault(r["cell_hash"], r)
    return ["## Failed fits", "", md_table(
        ["Dataset", "Method", "Train", "Seed", "Error"],
        [[r["dataset"], r["label"], r["train_mechanism"], str(r["seed"]),
          (r["error"] or "").strip().splitlines()[-1][:200] if r["error"] else ""] for r in seen.values()],
    ), ""]


def write_report(store: str | Path, out: str | Path, *, figures: bool = True) -> WrittenReport:
    """Write the whole report of a store into ``out``: ``report.md`` plus per-part Markdown, CSV and figures."""
    from partialvfl.bench.store import ResultStore

    with ResultStore(store, create=False) as s:
        rows = s.rows(status="done")
        failed = s.rows(status="failed")
    if not rows:
        raise ValueError(f"the store in {store} has no finished results to report")
    w = _Writer(Path(out))
    w.out.mkdir(parents=True, exist_ok=True)
    aggs = aggregate(rows)
    gaps = gap_summary(aggs)
    ratios = robustness_ratios(aggs)
    comparison = paper_comparison(aggs, ratios)
    notice = pipeline_check_notice(rows)
    w.sections += ["# Benchmark report", "", *([notice, ""] if notice else []), _summary_line(store, rows, failed), ""]
    _tables(w, aggs, figures, estimator_note(rows))
    w.part("gaps.md", "Gap summary (Table 2 layout)", (notice + "\n\n" if notice else "") + gaps_markdown(gaps))
    w.csv("gaps.csv", gaps.configs, ["dataset", "train", "test", "metric", "false_vfl", "false_vfl_mean",
                                     "best_other", "best_other_mean", "gap", "oracle_other", "oracle_gap",
                                     "selected_on"])
    w.part("ratios.md", "Robustness to severe missingness (Table 18 layout)", ratios_markdown(ratios))
    w.csv("ratios.csv", ratios, ["dataset", "label", "method", "test", "metric", "ratio"])
    w.part("paper_comparison.md", "Beside the paper's numbers", comparison_markdown(comparison))
    w.csv("paper_comparison.csv", comparison, ["table", "dataset", "train", "method", "test", "ours", "ours_std",
                                               "paper", "paper_std", "diff", "ours_labelled_only",
                                               "paper_labelled_only"])
    _ablation(w, rows, aggs, figures)
    if tuned := tuning_markdown(rows):
        w.part("tuning.md", "Tuning (the same search for every method)", tuned)
    n_val = len({r["cell_hash"] for r in rows if is_validation(r)})
    w.sections += ["## Cost", "", cost_markdown(rows), ""] + ([
        f"The {n_val} validation fits (selection fits on 80 % of the labels) are part of the total above; the "
        "table counts the fits scored on test sets.", ""] if n_val else [])
    w.sections += _failures(failed)
    if figures:
        w.written += write_figures(aggs, w.out)
    report = w.out / "report.md"
    report.write_text("\n".join(w.sections))
    line = headline(gaps, len({r["cell_hash"] for r in rows}))
    if notice:
        line = "smoke run, not results (a pipeline check: see the top of report.md): " + line
    return WrittenReport([report, *w.written], line)
