"""Per-prediction party contributions: each party's exact Shapley value of a row's prediction.

The game of a row: the players are the model's parties, the value of a coalition S is the model's prediction of the
row from the parties of S alone (the others treated as missing: :mod:`partialvfl.methods.coalitions`), and the
empty coalition's value is the prediction from no party (the training label prior).  A party's contribution is its
Shapley value: its marginal effect on the prediction averaged over every order in which the parties could join.
They add up, with the base value, to the prediction (the efficiency identity, to float rounding).

* Classification: the value is the probability of the explained class (by default the predicted class), and again
  its log-odds ``log(p / (1 - p))`` with ``p`` clipped to ``[PROBABILITY_FLOOR, 1 - PROBABILITY_FLOOR]``;
  regression: the predicted value.
* A party the row lacks (or that the method does not use for the row, e.g. a passive party under ``local``)
  contributes exactly 0: adding it to a coalition changes nothing.
* Exact for K <= ``max_exact_parties`` (2^K coalitions); above it, or when ``permutations`` is given, a permutation
  estimate (independent uniform orders of the parties, the same orders for every row) with its standard error per
  row and party.  Nothing is truncated silently: :attr:`Explanation.estimate` says which.

A party's contribution says how much the prediction moved because that institution's data about the row was there;
it is not a feature importance (it does not say which of its columns mattered, nor that the columns cause the
outcome).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from partialvfl.data.dataset import CoordinatorView
from partialvfl.methods.coalitions import coalition_outputs, prediction_view
from partialvfl.methods.shapley import exact_shapley, permutation_sample
from partialvfl.utils.seeding import numpy_rng

if TYPE_CHECKING:
    import pandas as pd


__all__ = ["EXACT_MAX_PARTIES", "PROBABILITY_FLOOR", "Explanation", "explain_attached", "log_odds"]

#: exact Shapley values up to this many parties (2^10 = 1,024 coalitions); a permutation estimate above
EXACT_MAX_PARTIES = 10
#: probabilities are clipped to [floor, 1 - floor] before their log-odds are taken (a probability of 1 has none)
PROBABILITY_FLOOR = 1e-6
#: rows explained per block (the coalition outputs of a block are held in memory at once)
_BLOCK_VALUES = 1 << 24


def log_odds(p: np.ndarray) -> np.ndarray:
    """``log(p / (1 - p))`` of ``p`` clipped to ``[PROBABILITY_FLOOR, 1 - PROBABILITY_FLOOR]``."""
    q = np.clip(np.asarray(p, dtype=np.float64), PROBABILITY_FLOOR, 1.0 - PROBABILITY_FLOOR)
    return np.log(q) - np.log1p(-q)


@dataclass(frozen=True)
class Explanation:
    """The party contributions of a model's predictions, row by row (``N`` rows, ``K`` parties).

    ``value``/``base``/``contributions``: the prediction (probability of ``explained`` class, or the regression
    value), the empty-coalition value (the training label prior) and each party's Shapley value, with
    ``base + contributions.sum(1) == value`` to float rounding; ``log_odds_*`` the same on the log-odds scale
    (``None`` for regression).  ``parties``: the parties whose features each row's prediction uses (the others
    contribute 0).  ``estimate``: ``"exact"`` or ``"permutation"`` (then ``standard_errors``, ``(N, K)``, and
    ``log_odds_standard_errors``).  ``coalitions``: how many coalitions were predicted per row at most.
    """

    ids: np.ndarray
    party_names: tuple[str, ...]
    method: str
    classes: tuple[Any, ...] | None
    predicted: np.ndarray
    explained: np.ndarray
    value: np.ndarray
    base: np.ndarray
    contributions: np.ndarray
    parties: np.ndarray
    estimate: str
    coalitions: int
    log_odds_value: np.ndarray | None = None
    log_odds_base: np.ndarray | None = None
    log_odds_contributions: np.ndarray | None = None
    standard_errors: np.ndarray | None = None
    log_odds_standard_errors: np.ndarray | None = None
    permutations: int | None = None

    @property
    def n_rows(self) -> int:
        """The number of rows explained."""
        return len(self.ids)

    def efficiency_gap(self) -> float:
        """The largest ``|base + sum of contributions - value|`` over every row (and both scales)."""
        gaps = [np.abs(self.base + self.contributions.sum(axis=1) - self.value)]
        if self.log_odds_value is not None:
            gaps.append(np.abs(self.log_odds_base + self.log_odds_contributions.sum(axis=1) - self.log_odds_value))
        return float(max(g.max(initial=0.0) for g in gaps))

    def to_frame(self, id_column: str = "id") -> pd.DataFrame:
        """One row per ID: ``prediction`` (the predicted class or value), ``explained`` (the class explained),
        ``probability`` / ``probability_base`` / ``probability_<party>``, the same with ``log_odds``
        (classification; regression: ``value`` / ``value_base`` / ``value_<party>``), ``se_<scale>_<party>`` for a
        permutation estimate, and ``parties`` (those whose features the prediction used, ``;``-separated)."""
        import pandas as pd

        df = pd.DataFrame({id_column: list(self.ids)})
        df["prediction"] = pd.Series(list(self.predicted), dtype=object if self.classes else float)
        scales = [("value", self.value, self.base, self.contributions, self.standard_errors)]
        if self.classes is not None:
            df["explained"] = pd.Series(list(self.explained), dtype=object)
            scales = [("probability", self.value, self.base, self.contributions, self.standard_errors),
                      ("log_odds", self.log_odds_value, self.log_odds_base, self.log_odds_contributions,
                       self.log_odds_standard_errors)]
        for name, value, base, contrib, errors in scales:
            df[name] = value
            df[f"{name}_base"] = base
            for k, party in enumerate(self.party_names):
                df[f"{name}_{party}"] = contrib[:, k]
            if errors is not None:
                for k, party in enumerate(self.party_names):
                    df[f"se_{name}_{party}"] = errors[:, k]
        df["parties"] = [";".join(self.party_names[k] for k in np.flatnonzero(row)) for row in self.parties]
        return df

    def row(self, i: int) -> dict[str, Any]:
        """Row ``i`` as JSON-able values (what the prediction service returns per ID)."""
        def per_party(values: np.ndarray, errors: np.ndarray | None) -> dict[str, Any]:
            out: dict[str, Any] = {"value": float(values[0]), "base": float(values[1]),
                                   "contributions": {p: float(v) for p, v in zip(self.party_names, values[2])}}
            if errors is not None:
                out["standard_errors"] = {p: float(v) for p, v in zip(self.party_names, errors[i])}
            return out

        item: dict[str, Any] = {"prediction": _plain(self.predicted[i]),
                                "parties": [self.party_names[k] for k in np.flatnonzero(self.parties[i])]}
        if self.classes is None:
            item["value"] = per_party((self.value[i], self.base[i], self.contributions[i]), self.standard_errors)
            return item
        item["explained"] = _plain(self.explained[i])
        item["probability"] = per_party((self.value[i], self.base[i], self.contributions[i]), self.standard_errors)
        item["log_odds"] = per_party((self.log_odds_value[i], self.log_odds_base[i],
                                      self.log_odds_contributions[i]), self.log_odds_standard_errors)
        return item


def _plain(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


def explain_attached(model: Any, view: CoordinatorView, handle: str, *, explained_class: Any = None,
                     permutations: int | None = None, max_exact_parties: int = EXACT_MAX_PARTIES, seed: int = 0,
                     progress: bool = False) -> Explanation:
    """Explain every row of ``view`` (attached at the parties under ``handle``): see the module docstring.

    ``explained_class``: a class label to explain instead of each row's predicted class; ``permutations``: a
    permutation estimate with this many orders (default: exact up to ``max_exact_parties`` parties, else 64
    orders); ``seed``: the orders' seed."""
    k = view.n_parties
    if permutations is None and k > max_exact_parties:
        permutations = 64
    task = model.index_.task
    target_index = None
    if explained_class is not None:
        if not task.is_classification:
            raise ValueError(f"{model.name}: a regression model has no class to explain")
        target_index = _class_index(task.classes, explained_class)
    if permutations is None:
        sample, coalitions = None, np.arange(2 ** k, dtype=np.int64)
    else:
        sample = permutation_sample(k, int(permutations), numpy_rng(seed, "explain", "permutations"))
        coalitions = np.unique(sample.coalitions)
    prepared = prediction_view(model, view)
    used = np.asarray(model.parties_used(prepared), dtype=bool)
    n = view.n_samples
    width = len(model.label_prior_) if task.is_classification else 1
    block = max(1, _BLOCK_VALUES // max(1, len(coalitions) * width))
    value, base, contrib, errors = [], [], [], []
    lvalue, lbase, lcontrib, lerrors = [], [], [], []
    predicted_index = np.zeros(n, dtype=np.int64)
    predicted_value = np.zeros(n)
    for start in range(0, n, block):
        rows = np.arange(start, min(n, start + block))
        out = coalition_outputs(model, view, handle, coalitions, rows=rows, progress=progress)
        full_out = out[-1]  # the coalitions are sorted bit masks: the last is every party, the first none
        if task.is_classification:
            predicted_index[rows] = full_out.argmax(axis=1)
            target = predicted_index[rows] if target_index is None else np.full(len(rows), target_index)
            scales = [out[:, np.arange(len(rows)), target], log_odds(out[:, np.arange(len(rows)), target])]
        else:
            predicted_value[rows] = full_out
            scales = [out]
        for s, (v_out, b_out, c_out, e_out) in enumerate(((value, base, contrib, errors),
                                                         (lvalue, lbase, lcontrib, lerrors))[:len(scales)]):
            values = scales[s]
            phi, se = _shapley(values, coalitions, sample)
            v_out.append(values[-1])
            b_out.append(values[0])
            c_out.append(phi)
            e_out.append(se)
    classes = tuple(task.classes) if task.is_classification else None
    class_array = np.array(list(task.classes), dtype=object) if classes else None
    explained = (class_array[predicted_index] if target_index is None else np.full(n, class_array[target_index],
                                                                                     dtype=object)) if classes else None
    return Explanation(
        ids=np.asarray(view.ids, dtype=object), party_names=tuple(model.index_.party_names), method=model.name,
        classes=classes, predicted=class_array[predicted_index] if classes else predicted_value,
        explained=explained if explained is not None else np.full(n, None, dtype=object),
        value=_joined(value), base=_joined(base), contributions=_joined(contrib), parties=used,
        estimate="exact" if sample is None else "permutation", coalitions=int(len(coalitions)),
        log_odds_value=_joined(lvalue) if classes else None, log_odds_base=_joined(lbase) if classes else None,
        log_odds_contributions=_joined(lcontrib) if classes else None,
        standard_errors=_joined(errors) if sample is not None else None,
        log_odds_standard_errors=_joined(lerrors) if sample is not None and classes else None,
        permutations=None if sample is None else sample.n_permutations)


def _joined(parts: list[np.ndarray]) -> np.ndarray | None:
    """The row blocks' arrays joined (``None`` for a scale not computed)."""
    return np.concatenate(parts) if parts else None


def _shapley(values: np.ndarray, coalitions: np.ndarray, sample: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """Shapley values ``(n, K)`` (and standard errors for a permutation sample) from ``values`` ``(M, n)``, the value
    of each of ``coalitions`` (all 2^K in order, or the sample's distinct prefix coalitions, sorted)."""
    if sample is None:
        return exact_shapley(values), None
    visited = values[np.searchsorted(coalitions, sample.coalitions)]  # (P, K + 1, n)
    return sample.shapley(visited)


def _class_index(classes: Any, label: Any) -> int:
    """The index of class ``label`` among ``classes``, matched by value (``"1"`` matches ``1``); an unknown one is
    an error naming the classes."""
    for i, c in enumerate(classes):
        if c == label or str(c) == str(label):
            return i
    raise ValueError(f"class {label!r} is not one of the model's classes {list(classes)}")

