"""Metrics of a fitted method on a dataset: overall and by number of observed parties.

Labels are compared **by value**: a predicted class is the model's class label, a true class the data's, and the two
are equal only if the labels are.  A test set that lacks some class, lists its classes in another order, or holds a
class the model never saw in training is scored correctly (a sample of an unseen class is an error).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from partialvfl.data.dataset import CoordinatorView, DataValidationError, VerticalDataset

__all__ = ["ESS", "add_diagnostics", "ess_line", "ess_summary", "evaluate", "metrics_from_predictions",
           "predict_with_diagnostics", "r2_score", "samples_per_row", "true_in_model_classes"]

#: the per-row diagnostic of an importance-sampling prediction: the effective sample size of its weights
ESS = "importance_ess"


def true_in_model_classes(data: VerticalDataset | CoordinatorView,
                           classes: Sequence[Any] | None) -> tuple[np.ndarray, list[Any]]:
    """The data's labels as indices into the model's ``classes`` (-1: a class the model does not know), and the
    data's classes the model does not know."""
    if classes is None:
        return np.asarray(data.y, dtype=np.int64), []
    index = {c: i for i, c in enumerate(classes)}
    mapping = np.array([index.get(c, -1) for c in data.task.classes], dtype=np.int64)
    y = np.asarray(data.y, dtype=np.int64)
    true = np.where(data.labeled, mapping[np.clip(y, 0, None)], -1)
    unseen = [c for j, c in enumerate(data.task.classes) if mapping[j] < 0 and np.any(data.labeled & (y == j))]
    return true, unseen


def metrics_from_predictions(output: np.ndarray, data: VerticalDataset | CoordinatorView,
                             classes: Sequence[Any] | None = None, *, used: np.ndarray | None = None,
                             party_names: Sequence[str] | None = None) -> dict[str, Any]:
    """Accuracy (classification) or RMSE (regression) over labelled samples, overall and per observed-party count.

    ``output`` holds the model's probabilities (columns in the order of the model's ``classes``; without
    ``classes`` the data's and the model's classes are taken to be the same list).  ``by_observed_parties`` maps
    the number of observed parties (0..K) to ``{"n": count, metric: value}``; the 0 bucket holds the samples
    predicted from the label prior.  ``unseen_classes`` lists the data's classes the model never saw.  With ``used``
    (``(N, K)``, the parties each prediction used, in the order of ``party_names``, default the data's), a
    classifier's ``calibration`` too: expected calibration error, Brier score and log-loss, overall and per
    availability pattern (:func:`~partialvfl.methods.calibration.calibration_metrics`).
    """
    if data.task is None:
        raise DataValidationError("the data carries no labels to score (give the label column)")
    lab = data.labeled
    counts = np.asarray(data.observed, dtype=bool).sum(axis=1)  # a dataset or a coordinator's view
    res: dict[str, Any] = {"n_samples": int(lab.sum()), "all_missing": int((counts[lab] == 0).sum())}
    by: dict[str, dict[str, float]] = {}
    if data.task.is_classification:
        if output.ndim != 2:
            raise DataValidationError("the data's labels are classes but the model predicts values (regression)")
        true, unseen = true_in_model_classes(data, classes)
        correct = (output.argmax(axis=1) == true) & lab & (true >= 0)
        res["accuracy"] = float(correct.sum() / max(lab.sum(), 1))
        res["unseen_classes"] = unseen
        if used is not None:
            from partialvfl.methods.calibration import calibration_metrics

            res["calibration"] = calibration_metrics(output[lab], true[lab], np.asarray(used, dtype=bool)[lab],
                                                     party_names or data.party_names)
        for c in range(data.n_parties + 1):
            m = lab & (counts == c)
            if m.any():
                by[str(c)] = {"n": int(m.sum()), "accuracy": float(correct[m].mean())}
    else:
        if output.ndim != 1:
            raise DataValidationError("the data's labels are values (regression) but the model predicts classes")
        err = np.where(lab, output - np.nan_to_num(data.y), 0.0)
        res["rmse"] = float(np.sqrt((err[lab] ** 2).mean())) if lab.any() else float("nan")
        for c in range(data.n_parties + 1):
            m = lab & (counts == c)
            if m.any():
                by[str(c)] = {"n": int(m.sum()), "rmse": float(np.sqrt((err[m] ** 2).mean()))}
    res["by_observed_parties"] = by
    return res


def predict_with_diagnostics(method: Any, data: VerticalDataset) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``method.predict_output(data)`` and the per-row diagnostics the method reports beside it (its
    ``prediction_diagnostics``: e.g. :data:`ESS`; none for most methods)."""
    diagnostics: dict[str, np.ndarray] = {}
    if getattr(method, "prediction_diagnostics", ()):
        return method.predict_output(data, diagnostics=diagnostics), diagnostics
    return method.predict_output(data), diagnostics


def ess_summary(ess: np.ndarray, low: float) -> dict[str, Any] | None:
    """The importance weights' effective sample sizes of a prediction's rows summarised: median, 5th percentile,
    how many rows fall below ``low`` (their answers rest on few samples), over the rows that have one (``None`` if
    none has: every row was predicted from the label prior)."""
    values = np.asarray(ess, dtype=np.float64)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return None
    return {"median": float(np.median(values)), "p5": float(np.percentile(values, 5)), "low": float(low),
            "below_low": int(np.sum(values < low)), "rows": int(values.size)}


def ess_line(summary: dict[str, Any], samples: int | None = None) -> str:
    """One line for a report: the ESS summary of :func:`ess_summary` (and the samples each row drew)."""
    of = f" of {samples} samples per row" if samples else ""
    return (f"importance weights: effective sample size median {summary['median']:.1f}, 5th percentile "
            f"{summary['p5']:.1f}{of}; {summary['below_low']} of {summary['rows']} rows below {summary['low']:g} "
            "(their answers rest on few samples)")


def evaluate(method: Any, data: VerticalDataset, *, calibration: bool = False) -> dict[str, Any]:
    """Predict ``data`` with a fitted method and return its metrics (labels matched by value) and the time taken;
    ``calibration``: a classifier's calibration metrics too (by the parties each prediction used); for an
    importance-sampling method, the ESS of its weights (``importance_ess``: :func:`ess_summary`)."""
    t0 = time.perf_counter()
    out, diagnostics = predict_with_diagnostics(method, data)  # conforms the data's parties and columns to the model
    task = getattr(getattr(method, "index_", None), "task", None)
    classes = task.classes if task is not None and task.is_classification else None
    used = method.parties_used(method.conform(data)) if calibration else None
    res = metrics_from_predictions(out, data, classes, used=used, party_names=method.index_.party_names)
    res["predict_seconds"] = time.perf_counter() - t0
    add_diagnostics(res, method, diagnostics)
    return res


def r2_score(method: Any, data: VerticalDataset) -> float:
    """The coefficient of determination R^2 of a fitted regression ``method`` over the labelled samples of ``data``
    (1 - residual sum of squares / total sum of squares about their mean; 1 is perfect, 0 predicts the mean).

    Raises:
        DataValidationError: ``data`` has no labels, labels of classes, or fewer than two labelled samples.
    """
    if data.task is None or data.task.is_classification:
        raise DataValidationError("R^2 scores a regression: the data carries no values to score (give the label "
                                  "column)" if data.task is None else "R^2 scores a regression, the data holds classes")
    lab = np.asarray(data.labeled, dtype=bool)
    if lab.sum() < 2:
        raise DataValidationError(f"R^2 needs at least two labelled samples, the data has {int(lab.sum())}")
    out = method.predict_output(data)
    true = np.asarray(data.y, dtype=np.float64)[lab]
    residual = float(((true - out[lab]) ** 2).sum())
    total = float(((true - true.mean()) ** 2).sum())
    return 1.0 - residual / total if total > 0 else (1.0 if residual == 0 else 0.0)


def add_diagnostics(res: dict[str, Any], method: Any, diagnostics: dict[str, np.ndarray]) -> None:
    """Put the summary of a prediction's diagnostics into an evaluation's results (``res[ESS]``)."""
    if ESS in diagnostics:
        summary = ess_summary(diagnostics[ESS], float(method.params_.get("predict_low_ess", 10.0)))
        if summary is not None:
            res[ESS] = {**summary, "samples": samples_per_row(method)}


def samples_per_row(method: Any) -> int | None:
    """How many importance samples each row of a prediction draws (``None`` for a method that draws none)."""
    if not getattr(method, "prediction_diagnostics", ()):
        return None
    rounds = getattr(method, "_prediction_rounds", lambda: 1)()
    return int(method.params_.get("predict_importance_samples", 0)) * int(rounds)
