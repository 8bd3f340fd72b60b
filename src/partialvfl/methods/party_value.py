"""What each party is worth to a model: its Shapley value of a score over the coalitions of parties.

The game: the players are the model's parties; the value of a coalition S is the model's score on labelled rows when
every row is predicted from the parties of S alone (:mod:`partialvfl.methods.coalitions`), measured as a gain over
the empty coalition (the label prior): accuracy and AUC as they are, log-loss and (regression) mean squared error as
their reduction.  So the parties' values add up to the whole model's gain over the prior.  Beside them, the simple
alternatives from the same coalition scores: leave one party out (the score lost without it) and the party alone
(its score on its own).

Standard errors (the rows are a sample): accuracy, log-loss and MSE are means over rows, so each party's value is
the mean of its per-row Shapley values and its standard error that mean's; AUC is not, and is bootstrapped
(``bootstrap`` resamples of the rows, seeded).  A permutation estimate (above ``max_exact_parties``) adds the
permutations' own standard error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from partialvfl.data.dataset import CoordinatorView
from partialvfl.methods.coalitions import coalition_outputs
from partialvfl.methods.evaluation import true_in_model_classes
from partialvfl.methods.explain import EXACT_MAX_PARTIES
from partialvfl.methods.shapley import exact_shapley, permutation_sample
from partialvfl.utils.seeding import numpy_rng

if TYPE_CHECKING:
    import pandas as pd


__all__ = ["SCORES", "PartyValues", "value_attached"]

#: the scores a party's value is measured in, per task
SCORES = {"classification": ("accuracy", "log_loss", "auc"), "regression": ("mse",)}
_GAIN = {"accuracy": "accuracy gained", "log_loss": "log-loss reduced", "auc": "AUC gained",
         "mse": "mean squared error reduced"}


@dataclass(frozen=True)
class PartyValues:
    """Each party's value of ``score`` (``values``, with ``standard_errors``) and the alternatives
    (``leave_one_out``, ``alone``), all as gains; ``coalitions`` (bit masks) with their raw ``scores``; ``full`` and
    ``empty``: the raw score of every party and of none."""

    score: str
    party_names: tuple[str, ...]
    values: np.ndarray
    standard_errors: np.ndarray
    leave_one_out: np.ndarray
    alone: np.ndarray
    coalitions: np.ndarray
    scores: np.ndarray
    full: float
    empty: float
    n_rows: int
    estimate: str
    method: str

    @property
    def gain(self) -> str:
        """What a value measures, in words."""
        return _GAIN[self.score]

    def table(self) -> pd.DataFrame:
        """One row per party: its Shapley value and standard error, leave-one-out and alone, and its share of the
        whole gain."""
        import pandas as pd

        total = self.values.sum()
        return pd.DataFrame({"party": list(self.party_names), "shapley": self.values,
                             "standard_error": self.standard_errors, "leave_one_out": self.leave_one_out,
                             "alone": self.alone,
                             "share": self.values / total if total else np.full(len(self.values), np.nan)})

    def coalition_table(self) -> pd.DataFrame:
        """Every coalition predicted: its parties (``+``-joined, ``none``), size and raw score."""
        import pandas as pd

        names = ["+".join(p for k, p in enumerate(self.party_names) if c >> k & 1) or "none" for c in self.coalitions]
        sizes = [bin(int(c)).count("1") for c in self.coalitions]
        return pd.DataFrame({"coalition": names, "parties": sizes, self.score: self.scores})


def _per_row(outputs: np.ndarray, true: np.ndarray, score: str) -> np.ndarray:
    """``(M, N)`` per-row values whose mean over rows is the score (as a gain up to the empty coalition's)."""
    if score == "accuracy":
        return (outputs.argmax(axis=2) == true[None, :]).astype(np.float64)
    if score == "log_loss":
        p = np.clip(outputs[:, np.arange(len(true)), np.clip(true, 0, None)], 1e-15, 1.0)
        return np.where(true[None, :] >= 0, -np.log(p), -np.log(1e-15))
    if score == "mse":
        return (outputs - true[None, :]) ** 2
    raise ValueError(f"score {score!r} is not a mean over rows")


def _weighted_auc(scores: np.ndarray, positive: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted ROC AUC ``(B,)`` of ``scores`` ``(N,)`` for each row of ``weights`` ``(B, N)`` (ties count half)."""
    order = np.argsort(scores, kind="stable")
    s, pos, w = scores[order], positive[order], weights[:, order]
    wp, wn = w * pos, w * ~pos
    _, start, count = np.unique(s, return_index=True, return_counts=True)
    neg_below = np.concatenate([np.zeros((w.shape[0], 1)), np.cumsum(wn, axis=1)], axis=1)
    group_neg = np.add.reduceat(wn, start, axis=1)
    group_pos = np.add.reduceat(wp, start, axis=1)
    wins = (group_pos * (neg_below[:, start] + 0.5 * group_neg)).sum(axis=1)
    denominator = wp.sum(axis=1) * wn.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, wins / denominator, np.nan)


def _auc(outputs: np.ndarray, true: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``(B, M)`` AUC of each coalition's outputs under each weighting of the rows: binary, the second class's
    probability; more classes, the mean of one-vs-rest AUCs over the classes present."""
    n_classes = outputs.shape[2]
    classes = [1] if n_classes == 2 else [c for c in range(n_classes) if (true == c).any() and (true != c).any()]
    out = np.zeros((weights.shape[0], outputs.shape[0]))
    for m in range(outputs.shape[0]):
        out[:, m] = np.mean([_weighted_auc(outputs[m, :, c], true == c, weights) for c in classes], axis=0)
    return out


def value_attached(model: Any, view: CoordinatorView, handle: str, *, score: str | None = None,
                   permutations: int | None = None, max_exact_parties: int = EXACT_MAX_PARTIES, seed: int = 0,
                   bootstrap: int = 200, progress: bool = False) -> PartyValues:
    """Each party's value to ``model`` on the labelled rows of ``view`` (attached under ``handle``): see the module
    docstring.  ``score``: one of :data:`SCORES` for the model's task (default accuracy, regression MSE)."""
    task = model.index_.task
    kind = "classification" if task.is_classification else "regression"
    score = score or SCORES[kind][0]
    if score not in SCORES[kind]:
        raise ValueError(f"score {score!r} is not one for a {kind} model; choose one of {', '.join(SCORES[kind])}")
    if view.task is None or not np.asarray(view.labeled).any():
        raise ValueError("a party's value is measured on labelled rows: the data has none (give the outcomes)")
    rows = np.flatnonzero(view.labeled)
    if task.is_classification:
        true, _ = true_in_model_classes(view, task.classes)
        true = true[rows]
    else:
        true = np.asarray(view.y, dtype=np.float64)[rows]
    k = view.n_parties
    if permutations is None and k > max_exact_parties:
        permutations = 64
    sample = None if permutations is None else permutation_sample(k, int(permutations),
                                                                 numpy_rng(seed, "value", "permutations"))
    coalitions = np.arange(2 ** k) if sample is None else np.unique(np.concatenate(
        [sample.coalitions.ravel(), [1 << j for j in range(k)], [(2 ** k - 1) ^ (1 << j) for j in range(k)]]))
    outputs = coalition_outputs(model, view, handle, coalitions, rows=rows, what="value its parties",
                                progress=progress)
    if score == "auc":
        weights = np.ones((1, len(rows)))
        raw = _auc(outputs, true, weights)[0]
        resampled = _auc(outputs, true, numpy_rng(seed, "value", "bootstrap").multinomial(
            len(rows), np.full(len(rows), 1 / len(rows)), size=bootstrap).astype(np.float64))
        per_row = None
    else:
        per_row = _per_row(outputs, true, score)
        raw = per_row.mean(axis=1)
        resampled = None
    sign = -1.0 if score in ("log_loss", "mse") else 1.0
    gain = sign * (raw - raw[0])  # coalition 0 (none) is first: the coalitions are sorted bit masks
    values, errors = _shapley_of(gain, coalitions, sample, k)
    if per_row is not None:  # the rows' sampling error: each value is a mean of per-row Shapley values
        row_values, _ = _shapley_of(sign * (per_row - per_row[:1]), coalitions, sample, k)
        row_error = row_values.std(axis=0, ddof=1) / np.sqrt(len(rows)) if len(rows) > 1 else np.zeros(k)
    else:
        boot, _ = _shapley_of((sign * (resampled - resampled[:, :1])).T, coalitions, sample, k)
        row_error = np.nanstd(boot, axis=0, ddof=1)
    errors = row_error if errors is None else np.sqrt(row_error ** 2 + errors.mean(axis=0) ** 2)
    full = len(coalitions) - 1
    at = {int(c): i for i, c in enumerate(coalitions)}
    everyone = 2 ** k - 1
    leave_one_out = np.array([gain[full] - gain[at[everyone ^ (1 << j)]] for j in range(k)])
    alone = np.array([gain[at[1 << j]] for j in range(k)])
    return PartyValues(score, tuple(model.index_.party_names), values.mean(axis=0) if values.ndim == 2 else values,
                       np.asarray(errors, dtype=np.float64), leave_one_out, alone, np.asarray(coalitions),
                       np.asarray(raw), float(raw[full]), float(raw[0]), int(len(rows)),
                       "exact" if sample is None else "permutation", model.name)


def _shapley_of(values: np.ndarray, coalitions: np.ndarray, sample: Any, k: int
                ) -> tuple[np.ndarray, np.ndarray | None]:
    """Shapley values of ``values`` ``(M,)`` or ``(M, N)`` over ``coalitions``: ``(N, K)`` (``(1, K)`` for one game)
    and, for a permutation sample, its standard errors."""
    v = values if values.ndim == 2 else values[:, None]
    if sample is None:
        assert len(coalitions) == 2 ** k and (coalitions == np.arange(2 ** k)).all()
        return exact_shapley(v), None
    visited = v[np.searchsorted(coalitions, sample.coalitions)]
    return sample.shapley(visited)

