"""Whether predicted probabilities mean what they say, and post-hoc temperature scaling that makes them.

* Metrics (:func:`calibration_metrics`): the expected calibration error (top-label ECE: the rows binned by their
  predicted class's probability into ``bins`` equal-width bins; the average gap between a bin's mean confidence and
  its accuracy, weighted by its share of rows), the Brier score (mean squared distance of the probability vector to
  the one-hot truth, summed over classes) and the log-loss (mean negative log probability of the true class, the
  probability clipped to 1e-15), overall and per availability pattern (which parties a row's prediction used).
* :class:`Calibration`: temperature scaling.  A probability vector p becomes ``p^(1/T) / sum(p^(1/T))``, i.e. the
  softmax of ``log p / T``: for a softmax output, the logits divided by T (T > 1 softens overconfident
  predictions; the predicted class never changes).  One temperature for every row, and optionally (``per_pattern``)
  one per availability pattern that has at least ``min_rows`` validation rows (a pattern changes how confident a
  method is: fewer parties, other errors), else one per number of parties with at least ``min_rows`` rows (with many
  parties most patterns are rare), else the overall one.  Fitted by minimising the validation log-loss over log T (a
  bounded one-dimensional search, deterministic).
* The model keeps it (``model.calibration_``, saved in ``model.json``): ``predict``, ``evaluate``, explanations and
  the prediction service all apply it (:meth:`~partialvfl.methods.base.VFLMethod.predict_output_federated`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Calibration", "brier_score", "calibration_metrics", "expected_calibration_error", "fit_temperature",
           "log_loss", "pattern_name", "reliability_bins"]

#: equal-width confidence bins of the expected calibration error (the literature's usual 15)
BINS = 15
#: the fewest validation rows a pattern needs for a temperature of its own
MIN_PATTERN_ROWS = 100
_CLIP = 1e-15
_LOG_T = (-4.0, 4.0)  # temperatures searched: e^-4 = 0.018 to e^4 = 55


def pattern_name(used: np.ndarray, party_names: Sequence[str]) -> str:
    """An availability pattern as text: the parties of the row joined by ``+`` (``"none"`` for no party)."""
    names = [party_names[k] for k in np.flatnonzero(used)]
    return "+".join(names) if names else "none"


def _scored(probs: np.ndarray, true: np.ndarray) -> np.ndarray:
    """The rows with a class the model knows (``true >= 0``)."""
    return np.asarray(true) >= 0


def reliability_bins(probs: np.ndarray, true: np.ndarray, bins: int = BINS) -> dict[str, np.ndarray]:
    """Per equal-width confidence bin: ``count``, mean ``confidence`` and ``accuracy`` (NaN in an empty bin), and
    the bin ``edges``; rows of classes the model never saw (``true`` -1) are left out."""
    keep = _scored(probs, true)
    p, t = np.asarray(probs, dtype=np.float64)[keep], np.asarray(true)[keep]
    confidence = p.max(axis=1) if len(p) else np.zeros(0)
    correct = (p.argmax(axis=1) == t) if len(p) else np.zeros(0, dtype=bool)
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(confidence, edges[1:-1], right=True), 0, bins - 1)
    count = np.bincount(which, minlength=bins).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        conf = np.bincount(which, weights=confidence, minlength=bins) / count
        acc = np.bincount(which, weights=correct.astype(np.float64), minlength=bins) / count
    return {"edges": edges, "count": count, "confidence": conf, "accuracy": acc}


def expected_calibration_error(probs: np.ndarray, true: np.ndarray, bins: int = BINS) -> float:
    """Top-label ECE over ``bins`` equal-width bins (NaN without a scored row)."""
    r = reliability_bins(probs, true, bins)
    n = r["count"].sum()
    if n == 0:
        return float("nan")
    live = r["count"] > 0
    return float((r["count"][live] * np.abs(r["accuracy"][live] - r["confidence"][live])).sum() / n)


def brier_score(probs: np.ndarray, true: np.ndarray) -> float:
    """Mean over the scored rows of ``sum_c (p_c - [c == y])^2`` (NaN without a scored row)."""
    keep = _scored(probs, true)
    p, t = np.asarray(probs, dtype=np.float64)[keep], np.asarray(true)[keep]
    if not len(p):
        return float("nan")
    onehot = np.zeros_like(p)
    onehot[np.arange(len(t)), t] = 1.0
    return float(((p - onehot) ** 2).sum(axis=1).mean())


def log_loss(probs: np.ndarray, true: np.ndarray) -> float:
    """Mean over the scored rows of ``-log p_y`` (``p_y`` clipped to 1e-15; NaN without a scored row)."""
    keep = _scored(probs, true)
    p, t = np.asarray(probs, dtype=np.float64)[keep], np.asarray(true)[keep]
    if not len(p):
        return float("nan")
    return float(-np.log(np.clip(p[np.arange(len(t)), t], _CLIP, 1.0)).mean())


def calibration_metrics(probs: np.ndarray, true: np.ndarray, used: np.ndarray, party_names: Sequence[str],
                        bins: int = BINS) -> dict[str, Any]:
    """``{"ece", "brier", "log_loss", "n", "bins", "by_pattern": {pattern: {"n", "ece", "brier", "log_loss",
    "accuracy"}}}`` over the rows with a known class (``true`` >= 0); ``used`` ``(N, K)``: the parties each
    prediction used (its availability pattern)."""
    probs, true, used = np.asarray(probs, dtype=np.float64), np.asarray(true), np.asarray(used, dtype=bool)
    keep = _scored(probs, true)
    out: dict[str, Any] = {"n": int(keep.sum()), "bins": bins, "ece": expected_calibration_error(probs, true, bins),
                           "brier": brier_score(probs, true), "log_loss": log_loss(probs, true)}
    patterns: dict[str, dict[str, Any]] = {}
    codes, inverse = np.unique(used[keep], axis=0, return_inverse=True)
    inverse = np.asarray(inverse).reshape(-1)
    for i, code in enumerate(codes):
        rows = np.flatnonzero(keep)[inverse == i]
        p, t = probs[rows], true[rows]
        patterns[pattern_name(code, party_names)] = {
            "n": int(len(rows)), "accuracy": float((p.argmax(axis=1) == t).mean()),
            "ece": expected_calibration_error(p, t, bins), "brier": brier_score(p, t), "log_loss": log_loss(p, t)}
    out["by_pattern"] = dict(sorted(patterns.items(), key=lambda kv: (-kv[1]["n"], kv[0])))
    return out


def _scaled(probs: np.ndarray, temperature: float) -> np.ndarray:
    """``p^(1/T)`` normalised per row (in log space: the softmax of ``log p / T``)."""
    with np.errstate(divide="ignore"):
        logits = np.log(np.asarray(probs, dtype=np.float64)) / float(temperature)
    logits -= logits.max(axis=1, keepdims=True)
    e = np.exp(logits)
    return e / e.sum(axis=1, keepdims=True)


def fit_temperature(probs: np.ndarray, true: np.ndarray) -> float:
    """The temperature minimising the log-loss of ``probs`` against ``true`` (rows of unseen classes left out):
    golden-section search over log T in [-4, 4], to 1e-6."""
    keep = _scored(probs, true)
    p, t = np.asarray(probs, dtype=np.float64)[keep], np.asarray(true)[keep]
    if not len(p):
        raise ValueError("temperature scaling needs validation rows with a class the model knows")

    def loss(log_t: float) -> float:
        return log_loss(_scaled(p, float(np.exp(log_t))), t)

    lo, hi = _LOG_T
    ratio = (np.sqrt(5.0) - 1.0) / 2.0
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = loss(a), loss(b)
    while hi - lo > 1e-6:
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = loss(b)
    return float(np.exp((lo + hi) / 2.0))


@dataclass(frozen=True)
class Calibration:
    """Temperature scaling, overall, per availability pattern (by party names, ``"bank+shop"``) and per number of
    parties; a row takes its pattern's temperature, else its number of parties', else the overall one.

    ``fitted_on``: what it was fitted on (rows, data, and the validation metrics before and after)."""

    temperature: float
    by_pattern: dict[str, float] = field(default_factory=dict)
    party_names: tuple[str, ...] = ()
    fitted_on: dict[str, Any] = field(default_factory=dict)
    by_count: dict[int, float] = field(default_factory=dict)

    def temperatures(self, used: np.ndarray) -> np.ndarray:
        """The temperature of each row of ``used`` ``(n, K)`` (the parties its prediction used)."""
        used = np.asarray(used, dtype=bool)
        if not self.by_pattern and not self.by_count:
            return np.full(len(used), self.temperature)
        names = [pattern_name(u, self.party_names) for u in used]
        counts = used.sum(axis=1).tolist()
        return np.array([self.by_pattern.get(n, self.by_count.get(c, self.temperature))
                         for n, c in zip(names, counts)])

    def apply(self, probs: np.ndarray, used: np.ndarray) -> np.ndarray:
        """``probs`` ``(n, C)`` scaled by the temperature of each row (``used`` ``(n, K)``: its pattern)."""
        probs = np.asarray(probs, dtype=np.float64)
        if not self.by_pattern and not self.by_count:
            return _scaled(probs, self.temperature)
        temps = self.temperatures(used)
        out = np.empty_like(probs)
        for t in np.unique(temps):
            rows = temps == t
            out[rows] = _scaled(probs[rows], float(t))
        return out

    @classmethod
    def fit(cls, probs: np.ndarray, true: np.ndarray, used: np.ndarray, party_names: Sequence[str], *,
            per_pattern: bool = False, min_rows: int = MIN_PATTERN_ROWS, about: dict[str, Any] | None = None
            ) -> Calibration:
        """Fit on validation ``probs`` (the model's, uncalibrated) against ``true`` (class indices, -1 unseen);
        ``per_pattern``: a temperature of its own for each pattern of at least ``min_rows`` rows."""
        overall = fit_temperature(probs, true)
        by: dict[str, float] = {}
        by_count: dict[int, float] = {}
        if per_pattern:
            used = np.asarray(used, dtype=bool)
            scored = _scored(probs, true)
            names = np.array([pattern_name(u, party_names) for u in used], dtype=object)
            for name in dict.fromkeys(names.tolist()):
                rows = (names == name) & scored
                if rows.sum() >= min_rows:
                    by[str(name)] = fit_temperature(probs[rows], np.asarray(true)[rows])
            counts = used.sum(axis=1)
            for c in sorted(set(counts.tolist())):
                rows = (counts == c) & scored
                if rows.sum() >= min_rows:
                    by_count[int(c)] = fit_temperature(probs[rows], np.asarray(true)[rows])
        cal = cls(overall, by, tuple(party_names), by_count=by_count)
        after = cal.apply(probs, used)
        fitted_on = {**(about or {}), "per_pattern": bool(per_pattern), "min_rows": int(min_rows),
                     "before": calibration_metrics(probs, true, used, party_names),
                     "after": calibration_metrics(after, true, used, party_names)}
        return cls(overall, by, tuple(party_names), fitted_on, by_count)

    def to_dict(self) -> dict[str, Any]:
        """The calibration as plain values (what the model directory stores)."""
        return {"method": "temperature", "temperature": self.temperature, "by_pattern": dict(self.by_pattern),
                "by_count": {str(c): t for c, t in self.by_count.items()},
                "party_names": list(self.party_names), "fitted_on": self.fitted_on}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        """The calibration stored by :meth:`to_dict`."""
        if d.get("method") != "temperature":
            raise ValueError(f"unknown calibration {d.get('method')!r} (this version knows 'temperature')")
        return cls(float(d["temperature"]), {str(k): float(v) for k, v in d.get("by_pattern", {}).items()},
                   tuple(d.get("party_names", ())), dict(d.get("fitted_on", {})),
                   {int(k): float(v) for k, v in d.get("by_count", {}).items()})

    def describe(self) -> str:
        """One line: the temperatures."""
        parts = [f"temperature {self.temperature:.3f}"]
        if self.by_pattern:
            parts.append("per pattern " + ", ".join(f"{n} {t:.3f}" for n, t in self.by_pattern.items()))
        if self.by_count:
            parts.append("per number of parties " + ", ".join(f"{c}: {t:.3f}" for c, t in self.by_count.items()))
        return "; ".join(parts)
