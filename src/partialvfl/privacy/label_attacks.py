"""Label inference by a curious passive party, from the gradients it receives, and which rows are labelled.

A passive party of a split network receives, per training step, the gradient of the loss with respect to each
representation it sent.  For cross-entropy the gradient of row ``i`` is ``(p_i - onehot(y_i))`` pushed back through
the fusion head: its *direction* depends on the label (for two classes it flips sign) and its *norm* is larger for
the rows the model gets wrong, which are more often of the minority class.

* **norm scoring** (Li et al., "Label Leakage and Protection in Two-party Split Learning", ICLR 2022): the gradient
  norm as a score for class 1; reported as the ROC AUC against the true labels (binary tasks).
* **direction scoring**: the gradients of one epoch, normalised, clustered into K groups (k-means); the accuracy of
  the best assignment of groups to classes (an upper bound on an attacker who knows a handful of labels or the class
  sizes).  Over the fit: each row's majority vote over epochs.

A row's ``e``-th gradient is its epoch ``e`` (every row is in one batch per epoch).  Which rows are labelled: the
number of times a row appears in what the party receives, as a score (labelled rows take part in more steps), its AUC
and the accuracy of splitting the counts in two (k-means).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from partialvfl.privacy.recording import Recorded, Recorder

__all__ = ["GradientObservation", "gradient_observations", "label_attack", "labeled_rows_attack", "row_counts"]

#: request tensors that carry the loss gradient of what the party sent last (by the programs' declarations)
GRADIENT_TENSORS = ("grad", "grad_mu", "grad_logvar")


@dataclass
class GradientObservation:
    """The gradients one party received in one step: its shared-order ``rows`` and ``grads`` ``(rows, d)``."""

    step: int
    rows: np.ndarray
    grads: np.ndarray


def _row_tensors(m: Recorded) -> dict[str, np.ndarray]:
    """Model -> rows of a request (``rows``, ``rows:<model>``; the next training batch's that ride with a gradient:
    an update's ``next_rows``, a ``grad_embedding``'s ``next:<model>``)."""
    out = {}
    for name, t in m.tensors.items():
        if name == "rows" or name.startswith("rows:"):
            out[name.removeprefix("rows").removeprefix(":")] = t
        elif name == "next_rows" and m.kind == "update":
            out[""] = t
        elif name.startswith("next:") and m.kind == "grad_embedding":
            out[name.removeprefix("next:")] = t
    return out


def _gradient_tensors(m: Recorded) -> dict[str, np.ndarray]:
    """Model -> the gradient rows of a request (several gradient tensors of one model side by side)."""
    out: dict[str, list[np.ndarray]] = {}
    for name, t in sorted(m.tensors.items()):
        base, _, model = name.partition(":")
        if base in GRADIENT_TENSORS and t.ndim == 2:
            out.setdefault(model, []).append(t.reshape(len(t), -1))
    return {k: np.concatenate(v, axis=1) for k, v in out.items()}


def gradient_observations(recorder: Recorder, party: int) -> list[GradientObservation]:
    """Every (rows, gradient) pair ``party`` received: a gradient request answers the party's last training forward
    of the same model (``train`` set, or an update's next batch)."""
    pending: dict[str, np.ndarray] = {}
    out = []
    for m in recorder.received(party):  # (prediction requests never set train: only training forwards are pending)
        for model, g in _gradient_tensors(m).items():
            rows = pending.pop(model, None)
            if rows is not None and len(rows) == len(g) and len(rows):
                out.append(GradientObservation(m.step, rows.astype(np.int64), g.astype(np.float64)))
        if m.meta.get("train") or m.kind == "update":
            pending.update(_row_tensors(m))
    return out


def _by_epoch(observations: Iterable[GradientObservation]) -> list[dict[int, np.ndarray]]:
    """Epoch ``e`` -> {row: its ``e``-th gradient}."""
    epochs: list[dict[int, np.ndarray]] = []
    seen: dict[int, int] = {}
    for ob in observations:
        for r, g in zip(ob.rows.tolist(), ob.grads):
            e = seen.get(r, 0)
            seen[r] = e + 1
            while len(epochs) <= e:
                epochs.append({})
            epochs[e][r] = g
    return epochs


def _best_accuracy(pred: np.ndarray, y: np.ndarray, k: int) -> tuple[float, np.ndarray]:
    """Accuracy of the best one-to-one assignment of clusters to classes, and the mapped predictions."""
    from scipy.optimize import linear_sum_assignment

    conf = np.zeros((k, k))
    np.add.at(conf, (pred, y), 1)
    rows, cols = linear_sum_assignment(-conf)
    mapping = np.zeros(k, dtype=np.int64)
    mapping[rows] = cols
    mapped = mapping[pred]
    return float((mapped == y).mean()), mapped


def _auc(score: np.ndarray, positive: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    if positive.all() or not positive.any():
        return float("nan")
    return float(roc_auc_score(positive, score))


def label_attack(observations: list[GradientObservation], y: np.ndarray, labeled: np.ndarray, n_classes: int,
                 seed: int = 0) -> dict[str, Any]:
    """Norm and direction scoring against the true labels ``y`` (shared order) of the labelled rows: per epoch
    (``norm_auc``, ``direction_accuracy`` lists) and over the fit (``*_fit``); ``n`` rows scored."""
    from sklearn.cluster import KMeans

    epochs = _by_epoch(observations)
    norm_auc, dir_acc, votes = [], [], {}
    norm_sum: dict[int, float] = {}
    for e, rows_g in enumerate(epochs):
        rows = np.array(sorted(r for r in rows_g if labeled[r]), dtype=np.int64)
        if len(rows) < n_classes:
            continue
        g = np.stack([rows_g[r] for r in rows])
        norms = np.linalg.norm(g, axis=1)
        for r, v in zip(rows.tolist(), norms):
            norm_sum[r] = norm_sum.get(r, 0.0) + float(v)
        truth = y[rows].astype(np.int64)
        if n_classes == 2:
            norm_auc.append(_auc(norms, truth == 1))
        unit = g / np.maximum(norms[:, None], 1e-12)
        clusters = KMeans(n_clusters=n_classes, n_init=4, random_state=seed + e).fit_predict(unit)
        acc, mapped = _best_accuracy(clusters, truth, n_classes)
        dir_acc.append(acc)
        for r, p in zip(rows.tolist(), mapped.tolist()):
            votes.setdefault(r, []).append(p)
    out: dict[str, Any] = {"epochs": len(dir_acc), "norm_auc": norm_auc, "direction_accuracy": dir_acc}
    voted = np.array(sorted(votes), dtype=np.int64)
    out["n"] = int(len(voted))
    if len(voted):
        majority = np.array([np.bincount(votes[r], minlength=n_classes).argmax() for r in voted.tolist()])
        out["direction_accuracy_fit"] = float((majority == y[voted]).mean())
        if n_classes == 2:
            mean_norm = np.array([norm_sum[r] / len(votes[r]) for r in voted.tolist()])
            out["norm_auc_fit"] = _auc(mean_norm, y[voted] == 1)
    return out


def row_counts(recorder: Recorder, party: int, n_samples: int, handle: str | None = "train") -> np.ndarray:
    """How many times each shared-order row of the data set attached as ``handle`` (``None``: any) appears in the
    rows of the requests ``party`` received."""
    counts = np.zeros(n_samples, dtype=np.int64)
    for m in recorder.received(party):
        if handle is not None and m.meta.get("data", handle) != handle:
            continue
        for t in _row_tensors(m).values():
            np.add.at(counts, t.astype(np.int64), 1)
        if "next_rows" in m.tensors and m.kind != "update":
            np.add.at(counts, m.tensors["next_rows"].astype(np.int64), 1)
    return counts


def labeled_rows_attack(counts: np.ndarray, held: np.ndarray, labeled: np.ndarray, seed: int = 0) -> dict[str, Any]:
    """Which of the rows a party holds (``held``) are labelled, from how often each appeared: the AUC of the count
    as a score, and the accuracy of splitting the counts in two groups (the larger counts called labelled)."""
    from sklearn.cluster import KMeans

    rows = np.flatnonzero(held)
    c = counts[rows].astype(np.float64)
    truth = labeled[rows]
    if len(np.unique(c)) < 2:
        return {"auc": 0.5, "accuracy": float(max(truth.mean(), 1 - truth.mean())), "n": int(len(rows))}
    groups = KMeans(n_clusters=2, n_init=4, random_state=seed).fit_predict(c[:, None])
    high = int(np.argmax([c[groups == g].mean() for g in (0, 1)]))
    return {"auc": _auc(c, truth), "accuracy": float(((groups == high) == truth).mean()), "n": int(len(rows))}
