"""Metrics of a fitted method on a dataset: overall and by number of observed parties."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from partialvfl.data.dataset import VerticalDataset

__all__ = ["evaluate", "metrics_from_predictions"]


def metrics_from_predictions(output: np.ndarray, data: VerticalDataset) -> dict[str, Any]:
    """Accuracy (classification) or RMSE (regression) over labelled samples, overall and per observed-party count.

    ``by_observed_parties`` maps the number of observed parties (0..K) to ``{"n": count, metric: value}``; the
    0 bucket holds the samples predicted from the label prior.
    """
    lab = data.labeled
    counts = data.n_observed_parties()
    res: dict[str, Any] = {"n_samples": int(lab.sum()), "all_missing": int((counts[lab] == 0).sum())}
    by: dict[str, dict[str, float]] = {}
    if data.task.is_classification:
        pred = output.argmax(axis=1)
        correct = (pred == data.y) & lab
        res["accuracy"] = float(correct.sum() / max(lab.sum(), 1))
        for c in range(data.n_parties + 1):
            m = lab & (counts == c)
            if m.any():
                by[str(c)] = {"n": int(m.sum()), "accuracy": float(correct[m].mean())}
    else:
        err = np.where(lab, output - np.nan_to_num(data.y), 0.0)
        res["rmse"] = float(np.sqrt((err[lab] ** 2).mean())) if lab.any() else float("nan")
        for c in range(data.n_parties + 1):
            m = lab & (counts == c)
            if m.any():
                by[str(c)] = {"n": int(m.sum()), "rmse": float(np.sqrt((err[m] ** 2).mean()))}
    res["by_observed_parties"] = by
    return res


def evaluate(method: Any, data: VerticalDataset) -> dict[str, Any]:
    """Predict ``data`` with a fitted method and return its metrics plus the prediction time."""
    t0 = time.perf_counter()
    out = method.predict_output(data)
    res = metrics_from_predictions(out, data)
    res["predict_seconds"] = time.perf_counter() - t0
    return res
