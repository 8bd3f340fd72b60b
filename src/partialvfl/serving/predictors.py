"""What the prediction service asks of the library: one batch of IDs in, per-ID outputs and the parties used out.

* :class:`TablePredictor` (``partialvfl serve --table PARTY=FILE ...``): every party's table in this process (one
  institution's tests and demos); the active party's own feature values may be given for users not in its table.
* :class:`FederationPredictor` (``partialvfl serve --federation FILE``): the parties' servers over long-lived
  mutual-TLS connections, as training uses.  Each batch has a deadline: a party that has not answered by then is a
  missing block for that batch (the method's any-subset prediction), and the batch says which parties timed out.  A
  party that went down (its process restarted) is joined again as soon as its server accepts connections: a new
  session at every party and the model loaded again, between two batches.

Each predicts one batch at a time (:mod:`partialvfl.serving.batcher`: in process on the service's event loop,
across a federation on one thread per lane of batches in flight).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.data.dataset import VerticalDataset
from partialvfl.data.ids import normalize_ids
from partialvfl.data.tables import from_tables
from partialvfl.federation.wire.messages import MessageLog
from partialvfl.methods.base import VFLMethod
from partialvfl.methods.evaluation import ESS, predict_with_diagnostics
from partialvfl.methods.model_files import read_model_meta

__all__ = ["BatchOutcome", "ExplainOutcome", "FeatureError", "counts_only", "TablePredictor", "model_version"]

#: per-ID status values of a response
OK, UNKNOWN, NO_ANSWER = "ok", "unknown_id", "no_party_answered"


def _some_names(columns: Sequence[str], shown: int = 5) -> str:
    """A party's feature names for an error message: all of a few, else the count and the first ``shown``."""
    if len(columns) <= shown:
        return f"its features are {list(columns)}"
    return f"its {len(columns)} features begin {list(columns[:shown])}"


class FeatureError(ValueError):
    """Feature values in a request that do not fit the active party's columns; ``field`` names the JSON field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class BatchOutcome:
    """One batch's answer: per ID (normalised text) its output row (``None``: not predicted), status, parties used."""

    output: dict[str, np.ndarray | None]
    status: dict[str, str]
    parties: dict[str, list[str]]
    timed_out: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    #: the batch's calls to parties (:class:`~partialvfl.federation.grpc.transport.CallSpan`), when it made any
    calls: list[Any] = field(default_factory=list)
    #: where its time went (:class:`~partialvfl.serving.spans.BatchTiming`, set by the batcher)
    timing: Any = None
    #: the importance weights' effective sample size of each predicted row (methods that report one, FALSE-VFL)
    ess: np.ndarray | None = None
    #: the model's threshold under which a prediction rests on few samples (``predict_low_ess``)
    low_ess: float = 10.0


def ess_fields(model: VFLMethod, diagnostics: dict[str, np.ndarray]) -> dict[str, Any]:
    """A batch outcome's ``ess`` and ``low_ess`` from a prediction's diagnostics (none for most methods)."""
    if ESS not in diagnostics:
        return {}
    values = diagnostics[ESS]
    return {"ess": values[np.isfinite(values)], "low_ess": float(model.params_.get("predict_low_ess", 10.0))}


@dataclass
class ExplainOutcome:
    """An explanation request's answer: the explanation of the IDs some party holds (``None``: none), each such
    ID's row in it, and the parties that were unreachable (missing from every coalition)."""

    explanation: Any
    row_of: dict[str, int]
    absent: list[str]


def counts_only() -> MessageLog:
    """A message log that keeps counts, not entries: a service sends messages for as long as it runs."""
    return MessageLog(keep_entries=False)


def model_version(directory: str | Path) -> str:
    """``<folder name>@<first 12 hex digits of the model digest>`` (the folder name alone for an old model)."""
    d = Path(directory)
    digest = read_model_meta(d).get("digest")
    return f"{d.name}@{str(digest)[:12]}" if digest else d.name


class _Base:
    model: VFLMethod
    version: str

    @property
    def party_names(self) -> tuple[str, ...]:
        return tuple(self.model.index_.party_names)

    @property
    def active_party(self) -> int:
        return int(self.model.index_.active_party)

    def active_columns(self) -> list[str]:
        """The active party's feature column names (without the ``party:`` prefix)."""
        names = self.model.index_.feature_names
        if names is None:
            return []
        return [c.split(":", 1)[1] for c in names[self.active_party]]

    def check_features(self, features: Mapping[str, Mapping[str, Any]], ids: Sequence[str]) -> dict[str, np.ndarray]:
        """The active party's values per (normalised) ID, in the model's column order; :class:`FeatureError` names
        the field of the first problem (an ID not in ``ids``, a missing, unknown or non-numeric column)."""
        columns = self.active_columns()
        party = self.party_names[self.active_party]
        if features and not columns:
            raise FeatureError("features", "this model does not record its feature names; features cannot be given")
        known = set(ids)
        out: dict[str, np.ndarray] = {}
        for raw_id, values in features.items():
            key = normalize_ids([raw_id], "features", unique=False)[0]
            where = f"features.{raw_id}"
            if key not in known:
                raise FeatureError(where, "this ID is not in 'ids'")
            unknown = [c for c in values if c not in columns]
            if unknown:
                close = difflib.get_close_matches(str(unknown[0]), columns, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise FeatureError(f"{where}.{unknown[0]}", f"party {party!r} has no feature {unknown[0]!r}; {hint}"
                                   f"{_some_names(columns)}")
            lacking = [c for c in columns if c not in values]
            if lacking:
                raise FeatureError(f"{where}.{lacking[0]}", f"missing ({len(lacking)} of the {len(columns)} "
                                   f"features party {party!r} needs are missing; {_some_names(columns)})")
            row = []
            for c in columns:
                v = values[c]
                if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(float(v)):
                    raise FeatureError(f"{where}.{c}", f"expected a finite number, got {v!r}")
                row.append(float(v))
            out[key] = np.asarray(row, dtype=np.float64)
        return out

    def prior(self) -> np.ndarray:
        return np.asarray(self.model.label_prior_, dtype=np.float64)


class TablePredictor(_Base):
    """Every party's table in this process (``--table PARTY=FILE``); nothing times out here."""

    #: its batches are computation in this process: predicted on the service's event loop
    #: (:class:`~partialvfl.serving.batcher.LoopBatcher`), not on a thread of their own
    on_event_loop = True

    def __init__(self, model_dir: str | Path, tables: Mapping[str, str | Path], id_column: str | None = None) -> None:
        self.model = VFLMethod.load(model_dir, log=counts_only())
        self.model_dir = Path(model_dir)
        self.version = model_version(model_dir)
        self.tables = dict(tables)
        idx = self.model.index_
        parties = list(idx.party_names)
        lacking, unknown = [p for p in parties if p not in tables], [p for p in tables if p not in parties]
        if lacking or unknown:
            raise ValueError(f"the model's parties are {parties}; " + "; ".join(filter(None, [
                f"no --table for {lacking}" if lacking else "", f"{unknown} are not parties of the model"
                if unknown else ""])))
        id_column = id_column or self.model.data_info_.get("id_column")
        if not id_column:
            raise ValueError("say which column of the tables holds the IDs: --id-column COLUMN")
        names = idx.feature_names
        columns = None if names is None else {p: [c.split(":", 1)[1] for c in names[k]]
                                              for k, p in enumerate(parties)}
        data = from_tables({p: tables[p] for p in parties}, id_column=id_column,
                           active_party=idx.active_party, feature_columns=columns)
        self.data = self.model.conform(data)
        self.rows = {i: r for r, i in enumerate(normalize_ids(self.data.ids, "the tables' IDs", unique=False))}

    def reloaded(self, model_dir: str | Path) -> TablePredictor:
        """The same tables with another saved model (checked against them as at start)."""
        return TablePredictor(model_dir, self.tables, self.model.data_info_.get("id_column"))

    def _batch(self, ids: Sequence[str], features: Mapping[str, np.ndarray]
               ) -> tuple[VerticalDataset | None, np.ndarray, np.ndarray]:
        """The batch of ``ids`` some party holds (``None``: none), the positions of those IDs in ``ids``, and which
        parties hold each of ``ids``."""
        data, a = self.data, self.active_party
        n = len(ids)
        blocks = [np.full((n, *b.shape[1:]), np.nan, dtype=b.dtype) for b in data.blocks]
        observed = np.zeros((n, data.n_parties), dtype=bool)
        for i, key in enumerate(ids):
            r = self.rows.get(key)
            if r is not None:
                observed[i] = data.observed[r]
                for k in np.flatnonzero(observed[i]):
                    blocks[k][i] = data.blocks[k][r]
            if key in features:
                blocks[a][i] = features[key].reshape(blocks[a].shape[1:])
                observed[i, a] = True
        rows = np.flatnonzero(observed.any(axis=1))
        if not rows.size:
            return None, rows, observed
        batch = VerticalDataset([b[rows] for b in blocks], observed[rows], ids=[ids[i] for i in rows],
                                active_party=a, feature_names=data.feature_names, party_names=data.party_names,
                                feature_shapes=data.feature_shapes)
        return batch, rows, observed

    def predict(self, ids: Sequence[str], features: Mapping[str, np.ndarray], deadline: float | None = None
                ) -> BatchOutcome:
        """Predict the (normalised, distinct) ``ids``; ``features``: the active party's values for some of them."""
        del deadline  # every party is in this process
        batch, rows, observed = self._batch(ids, features)
        out: dict[str, np.ndarray | None] = dict.fromkeys(ids)
        if batch is not None:
            res, diagnostics = predict_with_diagnostics(self.model, batch)
            for j, i in enumerate(rows):
                out[ids[i]] = res[j]
        else:
            diagnostics = {}
        names = self.party_names
        some = observed.any(axis=1)
        return BatchOutcome(out, {key: OK if some[i] else UNKNOWN for i, key in enumerate(ids)},
                            {key: [names[k] for k in np.flatnonzero(observed[i])] for i, key in enumerate(ids)},
                            **ess_fields(self.model, diagnostics))

    def explain(self, ids: Sequence[str], features: Mapping[str, np.ndarray], **options: Any) -> ExplainOutcome:
        """Each party's contribution to the predictions of ``ids`` (:meth:`VFLMethod.explain`, ``options``)."""
        batch, rows, observed = self._batch(ids, features)
        explanation = self.model.explain(batch, **options) if batch is not None else None
        return ExplainOutcome(explanation, {ids[i]: j for j, i in enumerate(rows)}, [])
