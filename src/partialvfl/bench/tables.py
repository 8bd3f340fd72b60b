"""The report's text: paper-layout tables (12-17), the gap summary (2), robustness ratios (18), our numbers beside
the paper's, and the cost of the fits, in Markdown."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from partialvfl.bench.aggregate import Aggregate, GapSummary, best, is_validation
from partialvfl.bench.naming import (
    PAPER_DATASET_NAME,
    PAPER_NAME,
    dataset_key,
    mech_key,
    mechanism_title,
    method_key,
    method_title,
)
from partialvfl.bench.paper_results import paper_accuracy, paper_ratio

__all__ = ["comparison_markdown", "cost_markdown", "cost_rows", "estimator_note", "gaps_markdown", "headline",
           "md_table", "mean_std_text", "paper_comparison", "ratios_markdown", "rows_by_label", "table_markdown",
           "tests_of", "tuning_markdown"]


def mean_std_text(mean: float, std: float, digits: int = 1) -> str:
    """``mean (std)``, or the mean alone where the std is ``nan`` (one seed)."""
    if math.isnan(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({std:.{digits}f})"


def _num(v: float, digits: int = 1) -> str:
    return "-" if math.isnan(v) else f"{v:.{digits}f}"


def _digits(metric: str) -> int:
    return 1 if metric == "accuracy" else 3


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table of ``header`` and ``rows`` (cells already formatted)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def tests_of(aggs: Sequence[Aggregate]) -> list[str]:
    """The test mechanisms of ``aggs``, in the paper's order."""
    return sorted({a.test for a in aggs}, key=mech_key)


def rows_by_label(aggs: Sequence[Aggregate]) -> list[tuple[str, str, dict[str, Aggregate]]]:
    """One table row per method label, in the paper's order: ``(label, method, {test: aggregate})``."""
    by: dict[str, dict[str, Aggregate]] = defaultdict(dict)
    methods: dict[str, str] = {}
    for a in aggs:
        by[a.label][a.test] = a
        methods[a.label] = a.method
    order = sorted(by, key=lambda lab: method_key(methods[lab], lab))
    return [(lab, methods[lab], by[lab]) for lab in order]


def estimator_note(rows: Sequence[dict[str, Any]]) -> str:
    """Which estimator made the FALSE-VFL figures of ``rows`` (their fits' ``predict_*`` parameters; a row from before
    the estimator was a parameter predicted with the paper's), as a sentence for every table ('' without FALSE-VFL)."""
    kinds = set()
    for r in rows:
        params = r.get("params") or {}
        if not str(r.get("method", "")).startswith("false-vfl"):
            continue
        samples = params.get("predict_importance_samples", "?")
        if params.get("predict_estimator", "paper") == "paper":
            kinds.add(f"the paper's estimator (self-normalised importance sampling, L = {samples})")
        else:
            kinds.add(f"the adaptive estimator ({params.get('predict_rounds')} rounds of L = {samples} per row)")
    return f"FALSE-VFL predicted with {' and '.join(sorted(kinds))}." if kinds else ""


def table_markdown(aggs: Sequence[Aggregate], train: str, note: str = "") -> str:
    """One of Tables 12-17: every dataset's section for training mechanism ``train`` (``note``: a sentence for its
    head, e.g. which estimator made the FALSE-VFL figures)."""
    sel = [a for a in aggs if a.train == train]
    tests = tests_of(sel)
    out_rows = []
    for dataset in sorted({a.dataset for a in sel}, key=dataset_key):
        ds = [a for a in sel if a.dataset == dataset]
        top = {t: best(a for a in ds if a.test == t) for t in tests}
        first = True
        for _, _, cells in rows_by_label(ds):
            any_cell = next(iter(cells.values()))
            row = [dataset if first else "", any_cell.title]
            first = False
            for t in tests:
                a = cells.get(t)
                if a is None:
                    row.append("")
                    continue
                d = _digits(a.metric)
                text = mean_std_text(a.mean, a.std, d)
                b = top[t]
                if b is not None and round(a.mean, d) == round(b.mean, d):
                    text = f"**{text}**"
                if a.starred:
                    text += "*"
                row.append(text)
            out_rows.append(row)
    metric = "accuracy (%)" if all(a.metric == "accuracy" for a in sel) else "accuracy (%) / RMSE"
    seeds = sorted({a.n for a in sel})
    chosen = {a.selected_on for a in sel if a.variants > 1}
    how = ("" if not chosen else " Where a method has variants (with or without SimSiam, ...), the one shown was "
           + ("chosen on validation data." if chosen == {"validation"} else "chosen on TEST data (no validation "
              "rows in this store)."))
    head = (f"Trained under {mechanism_title(train)}: mean {metric} and std (in parentheses) over "
            f"{'/'.join(map(str, seeds))} seed(s); best of each column in bold; * = labelled data only.{how}"
            + (f" {note}" if note else ""))
    return head + "\n\n" + md_table(["Dataset", "Method"] + [mechanism_title(t) for t in tests], out_rows)


def headline(g: GapSummary, n_fits: int) -> str:
    """One line for the terminal: how many fits, how often FALSE-VFL wins, the mean gap."""
    if not g.configs:
        return f"{n_fits} fits; no configuration has both a FALSE-VFL method and another method"
    how = "chosen on validation data" if g.selected_on == "validation" else "chosen on TEST data (no validation rows)"
    return (f"{n_fits} fits; FALSE-VFL beats the other method ({how}) in {g.wins} of {g.total} configurations "
            f"(mean gap {_num(g.mean_gap())} points); beats the best other method per test column in "
            f"{g.oracle_wins} (mean gap {_num(g.mean_gap(key='oracle_gap'))})")


def gaps_markdown(g: GapSummary) -> str:
    """The gap summary in words and a table: how often and by how much FALSE-VFL beats each method."""
    if not g.configs:
        return "No configuration has both a FALSE-VFL method and another method: no gap summary."
    how = ("both chosen on validation data (each entry fitted on 80 % of the labels, scored on the other 20 %)"
           if g.selected_on == "validation" else "chosen on the test means: this store has no validation rows")
    lines = [
        f"FALSE-VFL beats the other method in **{g.wins} of {g.total}** configurations, {how}; mean gap "
        f"{_num(g.mean_gap())} points over all, "
        + (f"{_num(g.mean_gap(wins_only=True))} over the wins" if g.wins else "no wins")
        + f". Against the best other method of each test column (an oracle in the other methods' favour): "
        f"{g.oracle_wins} of {g.total}, mean gap {_num(g.mean_gap(key='oracle_gap'))} (paper: 160 of 168, 9.1 and "
        "9.6, against the best other method).",
        "",
    ]
    for axis, title in (("dataset", "dataset"), ("train", "training mechanism"), ("test", "test mechanism")):
        by = g.by(axis)
        names = [mechanism_title(k) if axis != "dataset" else k for k in by]
        lines += [f"Mean gap per {title}:", "", md_table(names, [[_num(v) for v in by.values()]]), ""]
    rows = [[c["dataset"], mechanism_title(c["train"]), mechanism_title(c["test"]),
             f"{c['false_vfl']} {c['false_vfl_mean']:.1f}", f"{c['best_other']} {c['best_other_mean']:.1f}",
             f"{c['gap']:+.1f}", f"{c['oracle_other']} ({c['oracle_gap']:+.1f})"] for c in g.configs]
    lines += ["Every configuration:", "",
              md_table(["Dataset", "Train", "Test", "FALSE-VFL", "other method", "gap", "best other (gap)"], rows)]
    return "\n".join(lines)


def ratios_markdown(ratios: Sequence[dict[str, Any]]) -> str:
    """The robustness ratios (MCAR 5 over MCAR 2 training) as Markdown tables, one per dataset."""
    if not ratios:
        return "No method was run under both MCAR 2 and MCAR 5 training: no robustness ratios."
    tests = sorted({r["test"] for r in ratios}, key=mech_key)
    rows = []
    for dataset in sorted({r["dataset"] for r in ratios}, key=dataset_key):
        ds = [r for r in ratios if r["dataset"] == dataset]
        top = {t: max((r["ratio"] for r in ds if r["test"] == t), default=math.nan) for t in tests}
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
                row.append(f"**{text}**" if round(r["ratio"], 1) == round(top[t], 1) else text)
            rows.append(row)
    return ("Ratio (%) of the mean metric when trained under MCAR 5 to that when trained under MCAR 2 (Table 18 "
            "layout; for RMSE a ratio below 100 is the better); best of each column in bold.\n\n"
            + md_table(["Dataset", "Method"] + [mechanism_title(t) for t in tests], rows))


def paper_comparison(aggs: Sequence[Aggregate], ratios: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Our mean beside the paper's for every entry the paper also reports (paper datasets and methods only)."""
    out = []
    for a in aggs:
        if a.dataset not in PAPER_DATASET_NAME or a.method not in PAPER_NAME or a.metric != "accuracy":
            continue
        p = paper_accuracy(a.dataset, a.train, a.method, a.test)
        if p is None:
            continue
        out.append({"table": "accuracy", "dataset": a.dataset, "train": a.train, "method": a.title, "test": a.test,
                    "ours": a.mean, "ours_std": a.std, "paper": p.mean, "paper_std": p.std,
                    "diff": a.mean - p.mean, "ours_labelled_only": a.starred,
                    "paper_labelled_only": p.labeled_only})
    for r in ratios:
        if r["dataset"] not in PAPER_DATASET_NAME or r["method"] not in PAPER_NAME:
            continue
        p = paper_ratio(r["dataset"], r["method"], r["test"])
        if p is not None:
            out.append({"table": "ratio", "dataset": r["dataset"], "train": "mcar5/mcar2", "method": r["title"],
                        "test": r["test"], "ours": r["ratio"], "ours_std": math.nan, "paper": p,
                        "paper_std": math.nan, "diff": r["ratio"] - p, "ours_labelled_only": False,
                        "paper_labelled_only": False})
    return out


def comparison_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Our accuracy beside the paper's Tables 12-17, as Markdown."""
    acc = [r for r in rows if r["table"] == "accuracy"]
    if not acc:
        return "None of the store's datasets and methods appear in the paper's tables: nothing to compare."
    parts = ["Ours beside the paper's Tables 12-17 (accuracy %, ours - paper in brackets; * labelled-only on either "
             "side). Our grids may use "
             "fewer seeds, smaller caps, fewer epochs and other presets than the paper: read the grid before the "
             "differences.", ""]
    for dataset in sorted({r["dataset"] for r in acc}, key=dataset_key):
        for train in sorted({r["train"] for r in acc if r["dataset"] == dataset}, key=mech_key):
            sel = [r for r in acc if r["dataset"] == dataset and r["train"] == train]
            tests = sorted({r["test"] for r in sel}, key=mech_key)
            table_rows = []
            for method in dict.fromkeys(r["method"] for r in sel):
                cells = {r["test"]: r for r in sel if r["method"] == method}
                table_rows.append([method] + [
                    (f"{c['ours']:.1f}{'*' if c['ours_labelled_only'] else ''} vs "
                     f"{c['paper']:.1f}{'*' if c['paper_labelled_only'] else ''} [{c['diff']:+.1f}]")
                    if (c := cells.get(t)) else "" for t in tests
                ])
            mad = statistics.fmean(abs(r["diff"]) for r in sel)
            parts += [f"**{PAPER_DATASET_NAME[dataset]}, trained under {mechanism_title(train)}** "
                      f"(mean |difference| {mad:.1f} points)", "",
                      md_table(["Method"] + [mechanism_title(t) for t in tests], table_rows), ""]
    rat = [r for r in rows if r["table"] == "ratio"]
    if rat:
        mad = statistics.fmean(abs(r["diff"]) for r in rat)
        parts.append(f"Robustness ratios vs. the paper's Table 18: mean |difference| {mad:.1f} points over "
                     f"{len(rat)} entries (see paper_comparison.csv).")
    return "\n".join(parts)


def cost_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per dataset and method label: fits, mean fit seconds, mean predict seconds per test set, mean MB sent."""
    fits: dict[tuple[str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        if is_validation(r):
            continue
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
    out.sort(key=lambda r: (r["dataset"], method_key(r["method"], r["label"])))
    return out


def cost_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """What the grid cost: fit time per method, the hosts and the wall-clock span, as Markdown."""
    costs = cost_rows(rows)
    starts = sorted(str(r["started_at"]) for r in rows if r.get("started_at"))
    ends = sorted(str(r["finished_at"]) for r in rows if r.get("finished_at"))
    total = sum(float(r.get("fit_seconds") or 0.0) for r in {r["cell_hash"]: r for r in rows}.values())
    hosts = ", ".join(sorted({str(r["hostname"]) for r in rows if r.get("hostname")})) or "unknown"
    head = ""
    if starts and ends:
        span = (datetime.fromisoformat(ends[-1]) - datetime.fromisoformat(starts[0])).total_seconds()
        head = (f"Fits ran from {starts[0]} to {ends[-1]} (UTC): {span / 3600:.2f} h from the first start to the "
                f"last finish, on host(s) {hosts}; total fit time {total:.0f} s = {total / 3600:.2f} h (sum over "
                "fits, all workers; an interrupted and resumed grid counts the pause in the span).")
    table = md_table(
        ["Dataset", "Method", "fits", "fit s (mean)", "predict s per test set", "MB between parties per fit"],
        [[c["dataset"], c["title"], str(c["fits"]), f"{c['fit_seconds']:.1f}", f"{c['predict_seconds']:.2f}",
          f"{c['megabytes']:.1f}"] for c in costs],
    )
    return (head + "\n\n" + table).strip()


def tuning_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The report's tuning section: per (dataset, training mechanism, label, entry) every candidate's tuned values and
    validation score, the chosen one in bold (rows carry ``tuning``: the entry, its candidate values, chosen or not)."""
    seen: dict[tuple[str, str, str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        t = r.get("tuning")
        if not t or r.get("role") != "validation" or r.get("accuracy") is None:
            continue
        key = (r["dataset"], r["train_mechanism"], r.get("label") or r["method"], str(t["entry"]))
        seen[key][r["cell_hash"]] = {"values": t["values"], "score": 100.0 * float(r["accuracy"])}
    if not seen:
        return ""
    chosen = {(r["dataset"], r["train_mechanism"], str((r.get("tuning") or {}).get("entry"))):
              (r.get("tuning") or {}).get("values") for r in rows if r.get("role") == "test" and r.get("tuning")}
    body = []
    for key in sorted(seen, key=lambda k: (dataset_key(k[0]), mech_key(k[1]), k[2], k[3])):
        dataset, train, label, entry = key
        pick = chosen.get((dataset, train, entry))
        cands = sorted(seen[key].values(), key=lambda c: (c["values"].get("lr") or 0, c["values"].get("min_steps")
                                                          or 0))
        text = []
        for c in cands:
            item = f"{_values_text(c['values'])}: {c['score']:.1f}"
            text.append(f"**{item}**" if pick is not None and c["values"] == pick else item)
        body.append([dataset, train, label, "; ".join(text)])
    return ("Every entry was tuned with the same search; each candidate's validation accuracy (%, the validation "
            "cell: 80 % of the labels for fitting, 20 % scored), the one chosen for the test fits in bold:\n\n"
            + md_table(["Dataset", "Train", "Method", "candidates (lr, min_steps): validation accuracy"], body))


def _values_text(values: Mapping[str, Any]) -> str:
    lr = values.get("lr")
    steps = values.get("min_steps")
    return f"lr {lr:.3g}, " + ("min_steps " + str(steps) if steps is not None else "min_steps as entry")
