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

from partialvfl.bench.ablation import ablation_axis, ablation_markdown, write_ablation_figures
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
from partialvfl.bench.naming import mech_key, mechanism_title, method_title
from partialvfl.bench.tables import (
    comparison_markdown,
    cost_markdown,
    gaps_markdown,
    headline,
    md_table,
    paper_comparison,
    ratios_markdown,
    table_markdown,
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
    trains = sorted({a.train for a in aggs}, key=mech_key)
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
    top = {k: best(v) for k, v in columns.items()}
    written.append(_write_csv(
        out / "tables.csv",
        [{**a.__dict__, "best": a is top[(a.dataset, a.train, a.test)], "starred": a.starred,
          "seeds": " ".join(map(str, a.seeds))}
         for a in aggs],
        ["train", "dataset", "label", "method", "test", "metric", "mean", "std", "n", "labelled_only", "variants",
         "starred", "best", "seeds", "validation", "selected_on"],
    ))
    gaps_md = gaps_markdown(gaps)
    (out / "gaps.md").write_text(gaps_md + "\n")
    written.append(out / "gaps.md")
    written.append(_write_csv(out / "gaps.csv", gaps.configs,
                              ["dataset", "train", "test", "metric", "false_vfl", "false_vfl_mean", "best_other",
                               "best_other_mean", "gap", "oracle_other", "oracle_gap", "selected_on"]))
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
    axis = ablation_axis(rows)
    if axis is not None:
        abl_md = ablation_markdown(rows, aggs, axis)
        (out / f"ablation-{axis.name}.md").write_text(abl_md)
        written.append(out / f"ablation-{axis.name}.md")
        sections += [f"## Ablation over {axis.name}", "", abl_md, ""]
        if figures:
            written += write_ablation_figures(rows, aggs, axis, out)
            sections += [f"![accuracy against {axis.name}, trained under {mechanism_title(t)}]"
                         f"(ablation-{axis.name}-{t}.png)" for t in sorted({a.train for a in aggs}, key=mech_key)]
            sections.append("")
    n_val = len({r["cell_hash"] for r in rows if is_validation(r)})
    sections += ["## Cost", "", cost_markdown(rows), ""] + ([
        f"The {n_val} validation fits (selection fits on 80 % of the labels) are part of the total above; the "
        "table counts the fits scored on test sets.", ""] if n_val else [])
    if failed:
        seen = {}
        for r in failed:
            seen.setdefault(r["cell_hash"], r)
        sections += ["## Failed fits", "", md_table(
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
