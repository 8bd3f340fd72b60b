"""From store rows to table entries: means over seeds, the variant of each label chosen on validation data, the gap
between FALSE-VFL and the other methods (Table 2), robustness ratios (Table 18).

Selection never looks at test data: where a grid has validation rows (its validation cells: each entry fitted on
part of the labels and scored on the held-out labelled training rows), the variant shown for a label, the FALSE-VFL
variant of the gap summary and its "best other method" are those with the best validation score for the (dataset,
training mechanism); a store without validation rows falls back to the test mean, and the entry says so
(``selected_on``).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from partialvfl.bench.grid import stable_hash
from partialvfl.bench.naming import LABELED_ONLY, dataset_key, is_false_vfl, mech_key, method_key, method_title

__all__ = ["Aggregate", "GapSummary", "aggregate", "best", "entry_key", "gap_summary", "is_validation",
           "mean_std", "robustness_ratios", "select", "validation_scores"]


@dataclass(frozen=True)
class Aggregate:
    """One table entry: a method (label) on one (dataset, training, test mechanism), over its seeds.

    ``mean``/``std`` are in report units (accuracy %, or RMSE); ``labeled_only`` says the variant shown did not
    use unlabelled data; ``variants`` is how many grid entries competed for this label (the table's ``*`` needs
    both: a labelled-only variant that won over another); ``validation`` is the entry's validation score (report
    units, ``nan`` without one) and ``selected_on`` what chose it among the variants: ``validation``, ``test`` (a
    store without validation rows) or ``only`` (no other variant).
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
    labeled_only: bool
    variants: int = 1
    seeds: tuple[int, ...] = ()
    validation: float = math.nan
    selected_on: str = "only"
    entry: str = ""

    @property
    def title(self) -> str:
        """The method's name as reports print it."""
        return method_title(self.label, self.method)

    @property
    def starred(self) -> bool:
        """The paper's ``*``: a labelled-only variant shown because it beat the variant that used unlabelled data."""
        return self.labeled_only and self.variants > 1

    @property
    def higher_is_better(self) -> bool:
        """Whether a higher mean is better (accuracy; RMSE is lower-is-better)."""
        return self.metric == "accuracy"


def _value(row: dict[str, Any]) -> float | None:
    if row.get("metric") == "rmse":
        return None if row.get("rmse") is None else float(row["rmse"])
    return None if row.get("accuracy") is None else 100.0 * float(row["accuracy"])


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (ddof = 1; ``nan`` for a single value)."""
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else math.nan
    return mean, std


def is_validation(row: dict[str, Any]) -> bool:
    """Whether a results row is a validation cell (used to choose variants), not a test cell."""
    return row.get("role") == "validation" or row.get("test_mechanism") == "validation"


def entry_key(row: dict[str, Any]) -> str:
    """Which grid entry a row comes from: method, preset and overrides."""
    return stable_hash([row["method"], row.get("preset"), row.get("overrides") or {}])


def validation_scores(rows: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str, str], float]:
    """Mean validation score per (dataset, training mechanism, label, entry), in report units."""
    acc: dict[tuple[str, str, str, str], list[float]] = defaultdict(list)
    for r in rows:
        v = _value(r)
        if r.get("status", "done") == "done" and is_validation(r) and v is not None and not math.isnan(v):
            acc[(r["dataset"], r["train_mechanism"], r.get("label") or r["method"], entry_key(r))].append(v)
    return {k: statistics.fmean(v) for k, v in acc.items()}


def aggregate(rows: Iterable[dict[str, Any]]) -> list[Aggregate]:
    """Mean and std over seeds per (dataset, train, test, label), showing each label's variant chosen on
    validation data (or, in a store without validation rows, on the test mean: ``selected_on`` says which)."""
    rows = list(rows)
    val = validation_scores(rows)
    per_entry: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
    info: dict[tuple, tuple[str, str, bool]] = {}
    for r in rows:
        v = _value(r)
        if r.get("status", "done") != "done" or is_validation(r) or v is None or math.isnan(v):
            continue
        key = (r["dataset"], r["train_mechanism"], r["test_mechanism"], r.get("label") or r["method"], entry_key(r))
        per_entry[key].append((int(r["seed"]), v))
        info[key] = (r["method"], r.get("metric") or "accuracy", r.get("variant") == LABELED_ONLY)
    candidates: dict[tuple, list[Aggregate]] = defaultdict(list)
    for key, seeded in per_entry.items():
        dataset, train, test, label, entry = key
        method, metric, labeled_only = info[key]
        seeded.sort()
        mean, std = mean_std([v for _, v in seeded])
        candidates[(dataset, train, test, label)].append(Aggregate(
            dataset, train, test, label, method, metric, mean, std, len(seeded), labeled_only,
            seeds=tuple(s for s, _ in seeded), validation=val.get((dataset, train, label, entry), math.nan),
            entry=entry,
        ))
    out = []
    for group in candidates.values():
        # the variant shown for a label; those that used the unlabelled data (no *) come first, so they win a tie
        chosen = select(sorted(group, key=lambda a: a.labeled_only))
        assert chosen is not None
        how = "only" if len(group) == 1 else "validation" if _validated(group) else "test"
        out.append(replace(chosen, variants=len(group), selected_on=how))
    out.sort(key=lambda a: (dataset_key(a.dataset), mech_key(a.train), method_key(a.method, a.label), mech_key(a.test)))
    return out


def _validated(values: Sequence[Aggregate]) -> bool:
    return all(not math.isnan(a.validation) for a in values)


def select(values: Iterable[Aggregate]) -> Aggregate | None:
    """The entry with the best validation score, or, if any lacks one, the best test mean (a practitioner's choice,
    not an oracle's); on a tie the first.  Picks the variant shown for a label (:func:`aggregate`) and, among the
    entries of one configuration (different labels), the two sides of a gap (:func:`gap_summary`)."""
    vals = list(values)
    if not vals:
        return None
    sign = 1.0 if vals[0].higher_is_better else -1.0
    if _validated(vals):
        return max(vals, key=lambda a: sign * a.validation)
    return best(vals)


def best(values: Iterable[Aggregate]) -> Aggregate | None:
    """The aggregate with the best mean (highest or lowest, as its metric says); ``None`` for none."""
    vals = list(values)
    if not vals:
        return None
    return max(vals, key=lambda a: a.mean if a.higher_is_better else -a.mean)


@dataclass
class GapSummary:
    """FALSE-VFL vs. the other methods per configuration (both chosen on validation data; and vs. the best other
    method on each test column, the oracle), and the means of those gaps."""

    configs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def wins(self) -> int:
        """How many configurations FALSE-VFL wins."""
        return sum(1 for c in self.configs if c["gap"] > 0)

    @property
    def total(self) -> int:
        """How many configurations are compared."""
        return len(self.configs)

    @property
    def oracle_wins(self) -> int:
        """Configurations FALSE-VFL wins even against the other method that is best on that test column."""
        return sum(1 for c in self.configs if c["oracle_gap"] > 0)

    @property
    def selected_on(self) -> str:
        """``validation`` when every configuration's two sides were chosen on validation data, else ``test``."""
        return "validation" if all(c["selected_on"] == "validation" for c in self.configs) else "test"

    def mean_gap(self, *, wins_only: bool = False, key: str = "gap", **where: str) -> float:
        """The mean of ``key`` over the configurations matching ``where`` (with ``wins_only``, the wins only).

        NaN when no configuration matches.
        """
        vals = [c[key] for c in self.configs
                if all(c[k] == v for k, v in where.items()) and (c[key] > 0 or not wins_only)]
        return statistics.fmean(vals) if vals else math.nan

    def by(self, axis: str) -> dict[str, float]:
        """The mean gap per value of ``axis`` (a key of the configurations, such as ``dataset``), in report order."""
        keys = sorted({c[axis] for c in self.configs}, key=mech_key if axis != "dataset" else dataset_key)
        return {k: self.mean_gap(**{axis: k}) for k in keys}


def gap_summary(aggs: Sequence[Aggregate]) -> GapSummary:
    """Per (dataset, train, test): gap = chosen FALSE-VFL mean - chosen other mean (sign flipped for RMSE).

    Both sides are chosen on validation data (:func:`select`); ``oracle_gap`` compares with the other method that
    is best *on this test column* instead, an upper bound in the other methods' favour.
    """
    groups: dict[tuple[str, str, str], list[Aggregate]] = defaultdict(list)
    for a in aggs:
        groups[(a.dataset, a.train, a.test)].append(a)
    summary = GapSummary()
    for (dataset, train, test), group in groups.items():
        ours_side = [a for a in group if is_false_vfl(a.method)]
        other_side = [a for a in group if not is_false_vfl(a.method)]
        ours, other, oracle = select(ours_side), select(other_side), best(other_side)
        if ours is None or other is None or oracle is None:
            continue
        sign = 1.0 if ours.higher_is_better else -1.0
        summary.configs.append({
            "dataset": dataset, "train": train, "test": test, "metric": ours.metric,
            "false_vfl": ours.title, "false_vfl_mean": ours.mean,
            "best_other": other.title, "best_other_mean": other.mean, "gap": sign * (ours.mean - other.mean),
            "oracle_other": oracle.title, "oracle_gap": sign * (ours.mean - oracle.mean),
            # validation only if every choice behind the two sides was: each side's entry, and each entry's variant
            "selected_on": "validation" if _validated(ours_side) and _validated(other_side) and {
                ours.selected_on, other.selected_on} <= {"validation", "only"} else "test",
        })
    summary.configs.sort(key=lambda c: (dataset_key(c["dataset"]), mech_key(c["train"]), mech_key(c["test"])))
    return summary


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
    out.sort(key=lambda r: (r["dataset"], method_key(r["method"], r["label"]), mech_key(r["test"])))
    return out
