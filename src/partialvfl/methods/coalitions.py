"""Predictions of a fitted model from coalitions of its parties: the same rows, the other parties treated as missing.

Every method here predicts from whichever parties hold a row (the observed matrix), so the prediction of a row from a
coalition S of parties is the prediction with the row's observed pattern cut to S: no retraining, no background data.
:func:`coalition_outputs` is what explanations (:mod:`partialvfl.methods.explain`) and party values
(:mod:`partialvfl.methods.party_value`) are computed from.

* A coalition is a bit mask over the model's parties (:mod:`partialvfl.methods.shapley`).  For a row, coalition S
  means ``S ∩ U`` where ``U`` are the parties whose features the row's prediction uses
  (:meth:`~partialvfl.methods.base.VFLMethod.parties_used`): a party the row lacks, or the method does not use for
  it, changes nothing, exactly (its Shapley value is 0 by definition).  The empty coalition is the model's
  prediction from no party: the training label prior.
* Each distinct ``S ∩ U`` is predicted once per row, through the method's
  :meth:`~partialvfl.methods.base.VFLMethod._coalition_predictions` (by default one masked prediction per coalition;
  a method may share what does not depend on the coalition, e.g. each party's representation).  Calibration
  (:mod:`partialvfl.methods.calibration`) applies per coalition, as to any prediction.
* The extra predictions are extra queries of the parties' blocks: before any is made, each party is told how many
  it will answer (``explain`` request, :meth:`~partialvfl.federation.runtime.coordinator.Federation.
  request_explanation`) and may refuse (its ``[policy] allow_explanations``) or charge them to its lookup budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from partialvfl.data.dataset import UNLABELED, CoordinatorView
from partialvfl.methods.shapley import mask_bits
from partialvfl.methods.training import check_finite_output
from partialvfl.utils.progress import progress as progress_bar

__all__ = ["SubsetPredictionRefused", "coalition_outputs", "masked_predictions", "prediction_view", "require_subsets"]


class SubsetPredictionRefused(ValueError):
    """A method that cannot predict from a subset of its parties was asked to (explanations, party values)."""


def require_subsets(model: Any, what: str) -> None:
    """Raise :class:`SubsetPredictionRefused` naming the method and why, if it cannot predict from a subset."""
    why = getattr(model, "subset_refusal", None)
    if why is None:
        return
    from partialvfl.methods.registry import method_names

    able = [n for n in method_names() if _registered_refusal(n) is None]
    raise SubsetPredictionRefused(f"{model.name} cannot {what}: {why}. Party contributions need predictions from "
                                  f"every subset of the parties; these methods make them: {', '.join(able)}")


def _registered_refusal(name: str) -> str | None:
    from partialvfl.methods.registry import get_method

    try:
        return getattr(get_method(name), "subset_refusal", None)
    except Exception:  # a plug-in that fails to load is not listed
        return "unavailable"


def prediction_view(model: Any, view: CoordinatorView) -> CoordinatorView:
    """``view`` without its labels (a model predicts with its own task), as ``predict_output_federated`` uses it."""
    n = view.n_samples
    task = model.index_.task
    no_labels = np.full(n, UNLABELED, dtype=np.int64) if task.is_classification else np.full(n, np.nan)
    return dataclasses.replace(view, task=task, y=no_labels, labeled=np.zeros(n, dtype=bool))


def masked_predictions(model: Any, view: CoordinatorView, handle: str, masks: np.ndarray, wanted: np.ndarray
                       ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """The default of :meth:`~partialvfl.methods.base.VFLMethod._coalition_predictions`: coalition by coalition,
    the rows that want it predicted with the observed matrix cut to it (one prediction per coalition)."""
    observed = np.asarray(view.observed, dtype=bool)
    for m, mask in enumerate(np.asarray(masks, dtype=bool)):
        cut = observed & mask
        rows = np.flatnonzero(wanted[m] & cut.any(axis=1))
        if rows.size:
            yield m, rows, model._predict(dataclasses.replace(view, observed=cut), handle, rows)


def coalition_outputs(model: Any, view: CoordinatorView, handle: str, coalitions: np.ndarray, *,
                      rows: np.ndarray | None = None, what: str = "explain its predictions",
                      progress: bool = False) -> np.ndarray:
    """The model's output for ``rows`` of ``view`` (attached under ``handle``; default every row) from each
    coalition: ``(M, len(rows), C)`` probabilities (classification) or ``(M, len(rows))`` values (regression),
    coalition ``coalitions[m]`` (bit masks over the parties) cut to each row's used parties; the empty coalition is
    the training label prior.

    The parties are told first how many extra predictions of their blocks this makes (and may refuse:
    :class:`~partialvfl.federation.runtime.coordinator.ExplanationRefused`)."""
    model._check_fitted()
    require_subsets(model, what)
    view = prediction_view(model, view)
    n_all, k = view.n_samples, view.n_parties
    rows = np.arange(n_all) if rows is None else np.asarray(rows, dtype=np.int64)
    n = len(rows)
    used = np.asarray(model.parties_used(view), dtype=bool)[rows]
    used_bits = mask_bits(used)
    coalitions = np.asarray(coalitions, dtype=np.int64)
    effective = coalitions[:, None] & used_bits[None, :]  # (M, n): what each row's prediction from S uses
    needed = np.unique(effective[effective != 0])
    masks = ((needed[:, None] >> np.arange(k)) & 1).astype(bool)
    position = np.searchsorted(needed, effective)
    live = effective != 0
    local_wanted = np.zeros((len(needed), n), dtype=bool)
    local_wanted[position[live], np.nonzero(live)[1]] = True
    wanted = np.zeros((len(needed), n_all), dtype=bool)
    wanted[:, rows] = local_wanted
    _announce(model, handle, masks, local_wanted, used)

    classification = model.index_.task.is_classification
    shape = (len(needed), n, len(model.label_prior_)) if classification else (len(needed), n)
    computed = np.full(shape, np.nan)
    filled = np.zeros((len(needed), n), dtype=bool)
    local = np.full(n_all, -1, dtype=np.int64)
    local[rows] = np.arange(n)
    total = int(local_wanted.sum())
    calibration = getattr(model, "calibration_", None)
    bar = progress_bar(model._coalition_predictions(view, handle, masks, wanted),
                       f"{model.name}: coalition predictions ({len(needed)} coalitions, {total:,} row predictions)",
                       progress)
    for m, at, raw in bar:
        out = np.asarray(raw, dtype=np.float64)
        mine = local[at]
        if calibration is not None:
            out = calibration.apply(out, used[mine] & masks[m])
        computed[m, mine] = out
        filled[m, mine] = True
    if (local_wanted & ~filled).any():  # a method's hook left a wanted row unpredicted: its bug, never a silent NaN
        m, row = np.argwhere(local_wanted & ~filled)[0]
        raise RuntimeError(f"{model.name}: no prediction of row {rows[row]} from the coalition of parties "
                           f"{np.flatnonzero(masks[m]).tolist()}")
    prior = np.asarray(model.label_prior_, dtype=np.float64)
    result = np.empty((len(coalitions), *shape[1:]))
    result[~live] = prior if classification else prior[0]
    result[live] = computed[position[live], np.nonzero(live)[1]]
    for m in range(len(coalitions)):
        check_finite_output(model.name, result[m], np.asarray(view.ids)[rows])
    return result


def _announce(model: Any, handle: str, masks: np.ndarray, wanted: np.ndarray, used: np.ndarray) -> None:
    """Tell each party how many extra predictions of its block the coalitions make (beyond each row's own
    prediction from all its parties) over how many rows; a party may refuse, or charge its lookup budget."""
    uses = wanted.T.astype(np.int64) @ masks.astype(np.int64)  # (N, K): predictions of each row using each party
    extra = np.maximum(uses - used.astype(np.int64), 0)
    charges = {k: (int((extra[:, k] > 0).sum()), int(extra[:, k].sum())) for k in range(masks.shape[1])
               if extra[:, k].any()}
    if charges:
        model.federation_.request_explanation(handle, charges)
