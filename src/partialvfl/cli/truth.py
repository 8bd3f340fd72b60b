"""``evaluate --truth FILE``: score a model's predictions against outcomes keyed by ID, kept anywhere.

The outcomes of users to score often arrive later and elsewhere than the tables the model predicted from (a table
of new users has no label column).  ``--truth FILE`` is a CSV/Parquet table with the ID column (``--id``, default
the model's) and the outcome column (``--label``, default the model's label column); any other column is ignored.
One rule, in process and across a federation: the users of the tables scored (the ``--table`` files; across a
federation the parties' training tables, or their prediction tables ``--table-set NAME``) and the IDs of the truth
file must be the same set.  Either side's extra IDs are refused, with their count and the first of them, so a
mismatch of ID formats never scores a silent subset.  Across a federation the coordinator sees the parties' users
only as alignment tokens: users of their tables without an outcome are counted (per party), not named.  Classes
are matched by value: an outcome the model never saw in training counts as an error and is named.  An empty outcome
cell is not scored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.methods.evaluation import ESS, ess_line

__all__ = ["Truth", "calibration_lines", "labeled_view", "metric_lines", "read_truth", "score_against_truth"]


@dataclasses.dataclass(frozen=True)
class Truth:
    """The outcomes of a ``--truth`` file: normalised IDs (file order) and their raw values."""

    path: str
    ids: list[str]
    values: np.ndarray
    label_column: str

    def aligned(self, ids: Any, what: str) -> np.ndarray:
        """The outcomes of ``ids`` (in their order); refuses users without an outcome and outcomes of users not in
        ``ids``, with counts and the first examples (``what`` names where ``ids`` come from)."""
        from partialvfl.data.ids import normalize_ids

        keys = normalize_ids(np.asarray(ids, dtype=object), what)
        index = {k: i for i, k in enumerate(self.ids)}
        lacking = sorted(k for k in keys if k not in index)
        if lacking:
            raise ValueError(f"{len(lacking)} of {len(keys)} users of {what} have no outcome in --truth {self.path} "
                             f"(first: {lacking[:3]}); give an outcome for every user (an empty cell is not scored) "
                             "or tables of only the users to score")
        held = set(keys)
        extra = [k for k in self.ids if k not in held]
        if extra:
            raise ValueError(f"{len(extra)} of {len(self.ids)} IDs of --truth {self.path} are not among the users of "
                             f"{what} (first: {extra[:3]}); check that both use the same IDs (--id-column COLUMN)")
        return self.values[[index[k] for k in keys]]

    def check_federation(self, held: np.ndarray, unlisted: dict[str, Any], party_names: Sequence[str],
                         absent: Sequence[int], what: str) -> None:
        """The rule of :meth:`aligned` across a federation, for this file's IDs attached at the parties: ``held``
        ``(N, K)``, which parties' tables hold each ID; ``unlisted``: how many users of those tables are not among
        the IDs (``GrpcFederation.last_unlisted``: in all, and per party).  Refuses outcomes of IDs that no party's
        table holds (count and first IDs; not checked while a party is ``absent``: it may hold them) and users of
        the tables without an outcome (count per party: the coordinator cannot name them)."""
        held = np.asarray(held, dtype=bool)
        none = ~held.any(axis=1)
        if none.any() and not absent:
            first = [self.ids[i] for i in np.flatnonzero(none)[:3]]
            raise ValueError(f"{int(none.sum())} of {len(self.ids)} IDs of --truth {self.path} are not among the "
                             f"users of {what} (first: {first}); check that both use the same IDs (--id-column COLUMN)")
        users = int(unlisted.get("users", 0))
        if users:
            per_party = ", ".join(f"{party_names[k]!r} holds {n}" for k, n in sorted(unlisted["parties"].items()) if n)
            total = users + int((~none).sum())
            raise ValueError(f"{users} of {total} users of {what} have no outcome in --truth {self.path} "
                             f"({per_party}; the coordinator sees other parties' users only as alignment tokens, so "
                             "it cannot name them); give an outcome for every user (an empty cell is not scored) or "
                             "score a table set of only the users to score (--table-set)")


def read_truth(path: str | Path, id_column: str, label_column: str) -> Truth:
    """The ID and outcome columns of a CSV/Parquet file (IDs normalised by the one ID rule, duplicates refused)."""
    from partialvfl.data.tables import columns_hint, read_table, table_ids

    where = f"--truth {path}"
    df, _ = read_table(where, path, id_column)
    if label_column not in df.columns:
        raise ValueError(f"{where}: outcome column {label_column!r} not found; {columns_hint(df)}; name it with "
                         "--label COLUMN")
    ids, _ = table_ids(where, df, id_column)
    return Truth(str(path), ids, df[label_column].to_numpy(dtype=object), label_column)


def labeled_view(model: Any, view: Any, values: np.ndarray, truth: Truth) -> Any:
    """``view`` (a coordinator's view or a dataset's) labelled with ``values``, the outcomes of its rows: classes by
    value (an outcome the model never saw in training is a class of its own, an error when scored); an empty outcome
    is no label."""
    from partialvfl.data.dataset import Task
    from partialvfl.data.labels import encode_labels, is_missing_label, plain_labels

    task = model.index_.task
    where = f"--truth {truth.path}, column {truth.label_column!r}"
    ids = np.asarray(view.ids)
    if task.is_classification:
        present = np.array([not is_missing_label(v) for v in values], dtype=bool)
        labels = plain_labels(values, present)
        known = list(task.classes)
        unseen = [v for v in dict.fromkeys(labels[present].tolist()) if v not in known]
        out_task, y, labeled = encode_labels(labels, None, known + unseen, ids, where)
    else:
        out_task, y, labeled = encode_labels(values, Task.regression(), None, ids, where)
    return dataclasses.replace(view, task=out_task, y=y, labeled=labeled)


def score_against_truth(model: Any, output: np.ndarray, view: Any, values: np.ndarray, truth: Truth
                        ) -> dict[str, Any]:
    """Accuracy (or RMSE) of ``output`` (rows of ``view``, which says which parties hold each row) against
    ``values``, by observed-party count, and a classifier's calibration; classes matched by value (an unseen one is
    an error, named)."""
    from partialvfl.methods.evaluation import metrics_from_predictions

    task = model.index_.task
    scored = labeled_view(model, view, values, truth)
    res = metrics_from_predictions(output, scored, task.classes if task.is_classification else None,
                                   used=model.parties_used(view), party_names=model.index_.party_names)
    res["unscored_empty_outcomes"] = int((~scored.labeled).sum())
    return res


def metric_lines(title: str, res: dict[str, Any]) -> list[str]:
    """The text of an evaluation: the title's metric line, then one line per observed-party count and notes."""
    metric = "accuracy" if "accuracy" in res else "rmse"
    lines = [f"{title}: {metric} {res[metric]:.4f} over {res['n_samples']} labelled samples"]
    for k, v in res["by_observed_parties"].items():
        lines.append(f"  {k} observed parties: {metric} {v[metric]:.4f} (n={v['n']})")
    if res.get("unseen_classes"):
        lines.append(f"  classes never seen in training (counted as errors): {res['unseen_classes']}")
    if res.get("all_missing"):
        lines.append(f"  ({res['all_missing']} samples no party holds were predicted from the label prior)")
    if res.get("unscored_empty_outcomes"):
        lines.append(f"  ({res['unscored_empty_outcomes']} users with an empty outcome were not scored)")
    if res.get(ESS):
        lines.append("  " + ess_line(res[ESS], res[ESS].get("samples")))
    return lines + calibration_lines(res)


#: availability patterns listed one per line in the text of an evaluation (more: --json lists them all)
SHOWN_PATTERNS = 16


def calibration_lines(res: dict[str, Any]) -> list[str]:
    """A classifier's calibration: expected calibration error, Brier score and log-loss, overall and per
    availability pattern (up to :data:`SHOWN_PATTERNS` of them)."""
    cal = res.get("calibration")
    if not cal:
        return []
    lines = [f"  calibration: ECE {cal['ece']:.4f} ({cal['bins']} bins), Brier {cal['brier']:.4f}, log-loss "
             f"{cal['log_loss']:.4f}"]
    patterns = cal["by_pattern"]
    if len(patterns) > SHOWN_PATTERNS:
        return lines + [f"    ({len(patterns)} availability patterns: --json lists each one's)"]
    for name, p in patterns.items():
        lines.append(f"    {name}: ECE {p['ece']:.4f}, Brier {p['brier']:.4f}, log-loss {p['log_loss']:.4f} "
                     f"(n={p['n']})")
    return lines
