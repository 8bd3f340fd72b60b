"""Prediction with whichever parties answer: in process, or for a list of IDs across a federation.

:func:`run_predict` is what ``partialvfl predict`` runs and what a prediction service calls per request::

    fed = GrpcFederation.from_config("federation.toml", allow_absent=True)
    model = VFLMethod.load("model", federation=fed)
    pred = run_predict(model, ["c001", "c002"], PredictOptions(chunk=1000))
    pred.output, pred.parties   # (N, C) probabilities; (N, K) the parties each row's prediction used

A party that fails while a chunk of rows is predicted is treated as absent from then on: the chunk is predicted
again without it, so every row's output comes from exactly the parties its row of :attr:`Prediction.parties`
names.  Passive parties unreachable from the start are missing blocks; the active party missing is an error, and
so are rows no party holds (their prediction would be the training label prior alone) unless
``allow_prior_only``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from partialvfl.data.dataset import VerticalDataset
from partialvfl.data.ids import show_id
from partialvfl.federation.wire.transport import PartyUnavailable

if TYPE_CHECKING:
    from partialvfl.data.dataset import CoordinatorView
    from partialvfl.methods.base import VFLMethod

__all__ = ["PredictOptions", "Prediction", "PriorOnlyRows", "predict_reporting_parties", "require_active_party",
           "run_predict"]


@dataclass(frozen=True)
class PredictOptions:
    """How :func:`run_predict` predicts.

    ``chunk``: rows per prediction request (``None``: all at once; a party lost mid-request costs at most one
    chunk); ``table_set``: across a federation, predict from the parties' prediction tables of this name (new
    users, never trained on) instead of their training tables; ``allow_prior_only``: predict rows no party holds
    from the training label prior instead of refusing them (:class:`PriorOnlyRows`).
    """

    chunk: int | None = None
    table_set: str | None = None
    allow_prior_only: bool = False

    def __post_init__(self) -> None:
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"chunk must be a number of rows >= 1, got {self.chunk}")


@dataclass(frozen=True)
class Prediction:
    """The output of :func:`run_predict`, row by row in the order of ``ids``.

    ``output``: class probabilities ``(N, C)`` (columns in the model's class order) or values ``(N,)``;
    ``parties``: ``(N, K)``, the parties whose blocks each row's prediction used; ``held``: ``(N, K)``, the
    reachable parties that hold each row; ``failed``: parties that failed during this prediction (treated as
    missing from then on); ``absent``: parties unreachable before it started.
    """

    ids: np.ndarray
    output: np.ndarray
    parties: np.ndarray
    held: np.ndarray
    party_names: tuple[str, ...]
    failed: tuple[int, ...] = ()
    absent: tuple[int, ...] = ()

    @property
    def prior_only(self) -> np.ndarray:
        """Rows predicted from the training label prior alone (no party's block was used)."""
        return ~self.parties.any(axis=1)


class PriorOnlyRows(ValueError):  # reads as the condition it names
    """Rows no party holds, refused: their prediction would be the training label prior alone."""

    def __init__(self, n_rows: int, n_ids: int, first: Any) -> None:
        self.n_rows, self.n_ids, self.first = n_rows, n_ids, first
        super().__init__(f"{n_rows} of {n_ids} IDs (first: {show_id(first)}) are held by no party: their prediction "
                         "would be the training label prior alone (PredictOptions(allow_prior_only=True) predicts "
                         "them)")


def require_active_party(fed: Any, what: str) -> None:
    """Raise :class:`PartyUnavailable` if the active party (the label holder's own features) is absent."""
    if fed.active_party in getattr(fed, "absent", ()):
        name = fed.party_names[fed.active_party]
        raise PartyUnavailable(fed.active_party, f"the active party {name!r} (the label holder's own features) {what}: "
                                                 "start it and predict again")


def run_predict(model: VFLMethod, data: VerticalDataset | Sequence[Any] | np.ndarray,
                options: PredictOptions | None = None) -> Prediction:
    """Predict ``data`` with ``model``: a :class:`~partialvfl.data.dataset.VerticalDataset` (conformed to the
    model, attached at its parties), or IDs that the parties of the model's federation look up in their tables
    (a model loaded with ``VFLMethod.load(directory, federation=fed)``)."""
    options = options if options is not None else PredictOptions()
    fed = model.federation_
    failures = len(fed.transport.failures)
    absent = tuple(sorted(getattr(fed, "absent", ())))
    if isinstance(data, VerticalDataset):
        with model.attached(data) as (conformed, handle):
            view = conformed.coordinator_view()
            _refuse_prior_only(view, options)
            output, used = predict_reporting_parties(model, fed, view, handle, chunk=options.chunk)
    else:
        require_active_party(fed, "is unreachable")
        idx = model.index_
        view, handle = fed.attach_ids(data, task=idx.task, feature_dims=idx.feature_dims,
                                      feature_shapes=idx.feature_shapes, table=options.table_set)
        try:
            require_active_party(fed, "failed while the IDs were attached")
            _refuse_prior_only(view, options)
            output, used = predict_reporting_parties(model, fed, view, handle, chunk=options.chunk)
        finally:
            fed.release(handle)
    failed = sorted({party for _, party, _ in fed.transport.failures[failures:]})
    used = np.asarray(model.parties_used(dataclasses.replace(view, observed=used)), dtype=bool)  # as it reports
    return Prediction(ids=np.asarray(view.ids, dtype=object), output=output, parties=used,
                      held=np.array(view.observed, dtype=bool), party_names=tuple(model.index_.party_names),
                      failed=tuple(failed), absent=absent)


def _refuse_prior_only(view: CoordinatorView, options: PredictOptions) -> None:
    none = ~np.asarray(view.observed).any(axis=1)
    if none.any() and not options.allow_prior_only:
        first = view.ids[np.flatnonzero(none)[0]]
        raise PriorOnlyRows(int(none.sum()), len(view.ids), first.item() if isinstance(first, np.generic) else first)


def predict_reporting_parties(model: VFLMethod, fed: Any, view: CoordinatorView, handle: str,
                              chunk: int | None = None, diagnostics: dict[str, np.ndarray] | None = None
                              ) -> tuple[np.ndarray, np.ndarray]:
    """Predict ``view``'s rows, attached under ``handle`` (in chunks of ``chunk`` rows; default: all at once,
    exactly as the model's own ``predict_output_federated``); returns the outputs and which parties each row's
    prediction used.  ``diagnostics``: filled with the method's per-row prediction diagnostics, as
    :meth:`~partialvfl.methods.base.VFLMethod.predict_output` does.

    A party that fails while a chunk is predicted is treated as absent from then on: the chunk is predicted again
    without it, so every row's output comes from exactly the parties its row of the returned mask names.
    """
    n = view.n_samples
    used = np.array(view.observed, dtype=bool)
    lost: set[int] = set(getattr(fed, "absent", ()))
    out: np.ndarray | None = None
    size = max(1, chunk or n)
    for start in range(0, n, size):
        rows = np.arange(start, min(n, start + size))
        while True:
            observed = np.zeros_like(used)
            observed[rows] = used[rows]
            observed[:, sorted(lost)] = False
            before = len(fed.transport.failures)
            found: dict[str, np.ndarray] | None = {} if diagnostics is not None else None
            try:
                res = model.predict_output_federated(dataclasses.replace(view, observed=observed), handle,
                                                     diagnostics=found)
            except PartyUnavailable as e:
                if e.party in lost:  # the method needs a party even when its blocks are missing: cannot go on
                    raise
                lost.add(e.party)
                continue
            failed = {party for _, party, _ in fed.transport.failures[before:]} - lost
            if failed:  # part of this chunk went without them: predict it again without them
                lost |= failed
                continue
            break
        used[rows] = observed[rows]
        out = res if out is None else out
        out[rows] = res[rows]
        for name, values in (found or {}).items():
            diagnostics.setdefault(name, np.full(n, np.nan))[rows] = values[rows]  # type: ignore[union-attr]
    if hasattr(fed, "absent"):
        fed.absent |= lost
    return (out if out is not None else model.predict_output_federated(view, handle, diagnostics=diagnostics)), used
