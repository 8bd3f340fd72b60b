"""Which rows the coordinator's federation works on: the parties' ID tokens (asked once per session), and the
three ways to fix the shared order and tell each party where its own rows sit in it (``attach``): :meth:`align`
(the union of the parties' tokens and the labelled IDs), :meth:`attach_ids` (given IDs, from the training tables or
a table set of new users) and :meth:`attach` (a simulation's dataset).  A part of
:class:`~partialvfl.federation.grpc.federation.GrpcFederation`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from partialvfl.data.dataset import UNLABELED, CoordinatorView, DataValidationError, Task, VerticalDataset
from partialvfl.data.ids import normalize_ids, show_id
from partialvfl.federation.grpc.federation_file import LabelSource, read_labels
from partialvfl.federation.grpc.party_config import TRAINING_TABLE
from partialvfl.federation.trust.alignment import hex_ids, observed_from_hashes, positions_in
from partialvfl.federation.trust.token_index import TokenIndex
from partialvfl.federation.wire.messages import Request

__all__ = ["RowAlignment"]


class RowAlignment:
    """The row-aligning part of :class:`~partialvfl.federation.grpc.federation.GrpcFederation` (which holds the
    session's parties, ``party_info``, ``absent``, the aligner and the token caches it uses)."""

    def _rows(self, k: int, table: str | None) -> int | None:
        info = self.party_info.get(k, {})
        return info.get("n_rows") if table is None else info.get("tables", {}).get(table)

    def _tokens(self, own: Sequence[str] | None = None) -> tuple[list[np.ndarray | None], np.ndarray | None]:
        """Every present party's training-table tokens (asked once per session) and those of the coordinator's own
        (normalised) IDs ``own``, in the same rounds where possible."""
        missing = [k for k in self._present() if k not in self._hashes]
        own_tokens = None
        if missing:
            replies, own_tokens = self.aligner.party_tokens(
                missing, None, own, tolerate=self.allow_absent, expected={k: self._rows(k, None) for k in missing})
            self.absent |= set(missing) - set(replies)
            self._hashes.update(replies)
        if own is not None and own_tokens is None:
            own_tokens = self.aligner.id_tokens(own)
        return [self._hashes.get(k) if k not in self.absent else None for k in range(self.n_parties)], own_tokens

    def party_hashes(self) -> list[np.ndarray | None]:
        """Every present party's ID tokens (``None`` for an absent party); asked once per session."""
        return self._tokens()[0]

    def id_tokens(self, ids: Sequence[Any] | np.ndarray) -> np.ndarray:
        """The tokens of the coordinator's own IDs in this session (a lookup the keyed parties answer and log)."""
        self._tokens()
        return self.aligner.id_tokens(normalize_ids(ids, "the IDs to look up", unique=False))

    def _attach_order(self, order: np.ndarray, observed: np.ndarray, handle: str,
                      y: np.ndarray | None = None, labeled: np.ndarray | None = None, table: str | None = None,
                      sources: tuple[list[str], np.ndarray] | None = None,
                      given: tuple[np.ndarray, np.ndarray, list[str]] | None = None, carry: bool = False) -> None:
        """``attach`` at every present party: its rows of ``order`` (``observed``), read from ``table`` (``None``:
        the training table) or, with ``sources`` = (table names, ``(N, K)`` index of each row's table per party),
        row by row; ``given`` = (positions, values, IDs): the active party's own values of rows it holds in no
        table, sent to it (its policy must accept them).  ``carry``: no round of its own; each attach travels
        with the party's next request of the batch (:meth:`GrpcTransport.carry_attach`)."""
        if not carry:
            self.transport.new_step()
        n = int(order.shape[0])
        requests = {}
        for k in self._present():
            rows = np.flatnonzero(observed[:, k]).astype(np.int64)
            meta: dict[str, Any] = {"handle": handle, "n_samples": n}
            tensors = {}
            if given is not None and k == self.active_party and len(given[0]):
                rows = np.setdiff1d(rows, given[0]).astype(np.int64)
                tensors.update(features=torch.from_numpy(np.ascontiguousarray(given[1])),
                               feature_rows=torch.from_numpy(np.asarray(given[0], dtype=np.int64)))
                meta["feature_ids"] = list(given[2])
            tensors.update(hashes=torch.from_numpy(order[rows].copy()), rows=torch.from_numpy(rows))
            if k == self.active_party and y is not None and labeled is not None:
                tensors["labels"] = torch.from_numpy(np.array(y))
                tensors["labeled"] = torch.from_numpy(np.array(labeled, dtype=bool))
            if sources is not None:
                names, index = sources
                used = np.unique(index[rows, k])
                if len(used) > 1:
                    meta["tables"] = [names[t] for t in used]
                    tensors["table_of"] = torch.from_numpy(np.searchsorted(used, index[rows, k]).astype(np.int64))
                elif len(used) == 1 and names[used[0]] != TRAINING_TABLE:
                    meta["table"] = names[used[0]]
            elif table is not None and table in self.party_info.get(k, {}).get("tables", {}):
                meta["table"] = table  # a party without this table set holds none of its rows (an empty handle)
            requests[k] = Request("attach", tensors, meta)
        if carry:
            for k, request in requests.items():
                self.grpc_transport.carry_attach(k, request)
            return
        replies = self.transport.call_many(requests, tolerate=self.allow_absent)
        self.absent |= set(requests) - set(replies)

    def attach(self, data: VerticalDataset, handle: str | None = None) -> str:
        """Attach ``data``'s samples (its order and observed matrix) at the parties, which read their own rows."""
        if data.n_parties != self.n_parties:
            raise ValueError(f"data has {data.n_parties} parties, the federation {self.n_parties}")
        handle = handle or self.new_handle()
        held, order = self._tokens(normalize_ids(data.ids, "the dataset's IDs"))
        assert order is not None
        observed = np.array(data.observed, dtype=bool)
        for k, hashes in enumerate(held):
            if hashes is None:
                observed[:, k] = False
                continue
            holds = np.zeros(len(order), dtype=bool)
            pos = positions_in(order, hashes)
            holds[pos[pos >= 0]] = True
            lacking = observed[:, k] & ~holds
            if lacking.any():
                i = int(np.flatnonzero(lacking)[0])
                raise DataValidationError(f"party {k} ({self.party_names[k]!r}) holds no row for ID "
                                          f"{show_id(data.ids[i])} that the data marks observed "
                                          f"({int(lacking.sum())} such IDs)")
        self._attach_order(order, observed, handle, np.asarray(data.y), np.asarray(data.labeled))
        return handle

    def align(self, labels: LabelSource | None = None, handle: str = "train") -> tuple[CoordinatorView, str]:
        """Build the shared order and observed matrix from the parties' hashed IDs, attach, and return the view.

        Labels are read from ``labels`` (default: the federation file's ``[labels]``); IDs that carry a label but
        that no party holds are kept as all-missing samples.
        """
        src = labels or (self.config.labels if self.config is not None else None)
        if src is None:
            raise ValueError("align needs the label table ([labels] in the federation file)")
        lab_ids, lab_y, task = read_labels(src)
        held, lab_hashes = self._tokens(list(lab_ids))  # read_labels normalised them
        assert lab_hashes is not None
        order, observed = observed_from_hashes([*held, lab_hashes])
        observed = observed[:, :-1]
        n = len(order)
        y = np.full(n, UNLABELED, dtype=np.int64) if task.is_classification else np.full(n, np.nan)
        labeled = np.zeros(n, dtype=bool)
        pos = positions_in(order, lab_hashes)
        y[pos] = lab_y
        labeled[pos] = True
        self._attach_order(order, observed, handle, y, labeled)
        observed[:, sorted(self.absent)] = False
        dims, shapes = self.feature_dims()
        view = CoordinatorView(ids=hex_ids(order), observed=observed, y=y, labeled=labeled, task=task,
                               active_party=self.active_party, party_names=self.party_names, feature_dims=dims,
                               feature_shapes=shapes, feature_names=self.feature_names())
        return view, handle

    def table_hashes(self, table: str, own: Sequence[str] | None = None,
                     ) -> tuple[list[np.ndarray | None], np.ndarray | None]:
        """Every present party's ID tokens of its prediction table ``table`` (``None``: it serves no such table),
        and those of the coordinator's own IDs ``own``.  A table's tokens are asked once per session (its parties
        read it again only when a new session opens)."""
        serving = [k for k in self._present() if table in self.party_info.get(k, {}).get("tables", {})]
        if not serving:
            raise ValueError(f"no party serves a prediction table {table!r} (configure [[data.predict]] with "
                             f"name = {table!r} in the parties' files)")
        own_tokens = None
        missing = [k for k in serving if k not in self._table_tokens.get(table, {})]
        if missing:
            if self.alignment_mode == "psu":  # the keyed parties answer the lookups even without such a table
                self.aligner.open(self._present(), tolerate=self.allow_absent)
            replies, own_tokens = self.aligner.party_tokens(missing, table, own, tolerate=self.allow_absent,
                                                            expected={k: self._rows(k, table) for k in missing})
            self.absent |= set(missing) - set(replies)
            self._table_tokens.setdefault(table, {}).update(replies)
        if own is not None and own_tokens is None:
            self._tokens()  # the session's alignment is open (the training tables' tokens, once per session)
            own_tokens = self.aligner.id_tokens(list(own))
        cached = self._table_tokens.get(table, {})
        return [cached.get(k) if k not in self.absent else None for k in range(self.n_parties)], own_tokens

    def served_table_sets(self) -> list[str]:
        """The prediction table sets the present parties serve (sorted by name)."""
        return sorted({t for k in self._present() for t in self.party_info.get(k, {}).get("tables", {})})

    def attach_ids(self, ids: Sequence[Any] | np.ndarray, handle: str | None = None, *, task: Task | None = None,
                   feature_dims: Sequence[int] | None = None, feature_shapes: Sequence[Sequence[int]] | None = None,
                   table: str | None = None, tables: Sequence[str | None] | None = None,
                   features: Mapping[int, np.ndarray] | None = None, carry: bool = False,
                   ) -> tuple[CoordinatorView, str]:
        """Attach exactly ``ids`` (in that order, e.g. a prediction request): each party holds those it has, in its
        training table or, with ``table``, in its prediction table of that name (only predicted, never trained on).

        ``tables``: instead of ``table``, where each party looks an ID up, in order of preference (``None``: the
        training table): a party holding an ID in several of them attaches the row of the first.  ``features``:
        position in ``ids`` -> the active party's own feature values (its columns, in order) for that ID, used
        instead of any row of its tables; sent to the active party only, whose policy must accept them
        (``accept_coordinator_features``).  ``carry``: each party's attach travels with its first request of the
        prediction that follows (one round less: the split-network methods predict in one round), so a party that
        does not answer is found then, not here.
        """
        if table is not None and tables is not None:
            raise ValueError("attach_ids takes table or tables, not both")
        handle = handle or self.new_handle("predict")
        ids = np.asarray(normalize_ids(ids, "the IDs to predict"), dtype=object)  # empty or repeated: refused
        sources = [table] if tables is None else list(tables)
        if not sources or len(set(sources)) != len(sources):
            raise ValueError(f"tables must name each table once, got {sources}")
        held_by: list[list[np.ndarray | None]] = []
        order = None
        for t in sources:  # the own IDs' tokens come with the first table's (one round where possible)
            held, own = self._tokens(list(ids) if order is None else None) if t is None else self.table_hashes(
                t, list(ids) if order is None else None)
            held_by.append(held)
            order = own if order is None else order
        assert order is not None
        if len({bytes(h) for h in order}) != len(order):
            raise DataValidationError("the ID list has duplicates")
        n = len(order)
        observed = np.zeros((n, self.n_parties), dtype=bool)
        source = np.zeros((n, self.n_parties), dtype=np.int64)
        for s, held in reversed(list(enumerate(held_by))):  # the first table that holds a row wins
            for k, hashes in enumerate(held):
                if hashes is not None:
                    at = self._held_positions(order, hashes)
                    observed[at, k] = True
                    source[at, k] = s
        given = None
        if features:
            a = self.active_party
            at = np.array(sorted(features), dtype=np.int64)
            values = np.stack([np.asarray(features[int(i)], dtype=np.float32).reshape(-1) for i in at])
            given = (at, values, [str(ids[i]) for i in at])
            if a not in self.absent:
                observed[at, a] = True
        names = [TRAINING_TABLE if t is None else t for t in sources]
        self._attach_order(order, observed, handle, table=table,
                           sources=None if tables is None else (names, source), given=given, carry=carry)
        self.last_held = observed.copy()  # which party holds which of the IDs, answering or not
        self._unlisted_of: tuple[Any, Any] | None = (held, order)  # counted when asked (last_unlisted)
        observed[:, sorted(self.absent)] = False
        dims, shapes = self.feature_dims()
        if feature_dims is not None:
            dims = tuple(int(d) for d in feature_dims)
            shapes = tuple(tuple(s) for s in feature_shapes) if feature_shapes is not None else tuple(
                (d,) for d in dims)
        view = CoordinatorView(ids=ids, observed=observed, y=np.full(n, UNLABELED, dtype=np.int64),
                               labeled=np.zeros(n, dtype=bool), task=task or Task.classification([0, 1]),
                               active_party=self.active_party, party_names=self.party_names, feature_dims=dims,
                               feature_shapes=shapes)
        return view, handle

    def _held_positions(self, order: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        """The positions of ``order``'s tokens that ``hashes`` (a party's table's tokens, kept for the session)
        holds: a batch's tokens searched in the table's sorted tokens (sorted once per table and session), not the
        table's searched in the batch's."""
        cache: dict[int, tuple[np.ndarray, TokenIndex]] = self.__dict__.setdefault("_held_index", {})
        entry = cache.get(id(hashes))
        if entry is None or entry[0] is not hashes:
            if len(cache) > 64:  # tables of earlier sessions
                cache.clear()
            entry = cache[id(hashes)] = (hashes, TokenIndex(np.asarray(hashes)))
        return np.flatnonzero(entry[1].lookup(np.asarray(order)) >= 0)

    @property
    def last_unlisted(self) -> dict[str, Any]:
        """Of the last :meth:`attach_ids`: how many users of the parties' tables were not among its IDs (see
        :func:`_unlisted`; counted when asked, not at every batch of a prediction service)."""
        pending = self.__dict__.get("_unlisted_of")
        if pending is not None:
            self._last_unlisted = _unlisted(*pending)
            self._unlisted_of = None
        return self.__dict__.get("_last_unlisted", {"users": 0, "parties": {}})

    @last_unlisted.setter
    def last_unlisted(self, value: dict[str, Any]) -> None:
        self._last_unlisted, self._unlisted_of = value, None

    def release(self, handle: str) -> None:
        """Have the parties forget the data attached as ``handle``."""
        self.transport.new_step()
        self.transport.broadcast(self._present(), "release", tolerate=True, handle=handle)


def _unlisted(held: Sequence[np.ndarray | None], order: np.ndarray) -> dict[str, Any]:
    """How many users of the parties' tables (their tokens ``held``; ``None``: no answer) are not among the IDs
    attached (``order``): ``{"users": n, "parties": {k: n_k}}``, a user several parties hold counted once in
    ``users``.  Counts only: the coordinator has the parties' tokens, never their IDs."""
    per_party: dict[int, int] = {}
    outside: list[np.ndarray] = []
    for k, hashes in enumerate(held):
        if hashes is None:
            continue
        rows = np.asarray(hashes)[positions_in(order, hashes) < 0]
        per_party[k] = len(rows)
        outside.append(rows)
    everyone = np.concatenate(outside) if outside else np.zeros((0, 1), dtype=np.uint8)
    return {"users": int(len(np.unique(everyone, axis=0))) if len(everyone) else 0, "parties": per_party}
