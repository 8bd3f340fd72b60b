"""The party's own tables at its gRPC server: the training table and tables of users to predict, read from its
own files only, and the built-in kinds that serve them (``ids``, ``attach``, ``release``).

:class:`PartyTable` reads one table; :class:`TableBuiltins` is the part of the
:class:`~partialvfl.federation.grpc.party.PartyServer` that holds the tables, reads a prediction table again when its
file changed (at a new session only) and attaches rows, named by their alignment tokens, under a handle.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import grpc
import numpy as np
import torch

from partialvfl.data.chunked import read_party_table, release_arrow_memory
from partialvfl.data.dataset import PartyView
from partialvfl.data.id_column import IdColumn
from partialvfl.federation.grpc.limits import Refused
from partialvfl.federation.grpc.party_config import TRAINING_TABLE, PartyConfig, PredictTable
from partialvfl.federation.runtime.party import PartyRuntime
from partialvfl.federation.trust.alignment import hash_ids
from partialvfl.federation.trust.policy import PartyPolicy
from partialvfl.federation.trust.psu import PartyAligner
from partialvfl.federation.trust.token_index import TokenIndex
from partialvfl.federation.wire.messages import Reply, Request
from partialvfl.federation.wire.refusals import PolicyViolation

__all__ = ["PartyTable", "TableBuiltins", "file_stamp"]

log = logging.getLogger("partialvfl.party")
#: rows of an attach after which the party hands Arrow's spare memory back (a training handle, not a served batch)
LARGE_ATTACH = 100_000


class PartyTable:
    """The party's rows: IDs, their HMAC hashes and the float32 feature matrix, read from its own file (or a
    directory of files) only, in chunks (:func:`~partialvfl.data.chunked.read_party_table`: a table larger than
    memory as text or as a DataFrame is read as long as its IDs and float32 features fit).

    Read by the same rules as :func:`~partialvfl.data.builders.from_tables` (:mod:`partialvfl.data.tables`):
    IDs normalised by the one rule (:mod:`partialvfl.data.ids`; empty and colliding IDs refused, naming them),
    numeric feature columns only (a text or categorical column refused, naming it), every value of a held row given.
    """

    def __init__(self, cfg: PartyConfig, key: bytes | None, *, training: bool = True) -> None:
        where = f"party {cfg.index} ({cfg.name!r}), {cfg.data_path.name}"
        if not cfg.data_path.exists():
            raise FileNotFoundError(f"party {cfg.index} ({cfg.name!r}): data file not found: {cfg.data_path}")
        data = read_party_table(where, cfg.data_path, cfg.id_column, columns=cfg.feature_columns,
                                exclude=cfg.exclude_columns)
        if not len(data.ids) and training:
            raise ValueError(f"{where}: the training table {cfg.data_path} has no rows")
        cols = data.feature_names
        shape = cfg.feature_shape or (len(cols),)
        if int(np.prod(shape)) != len(cols):
            raise ValueError(f"party {cfg.index} ({cfg.name!r}): feature_shape {shape} does not match its "
                             f"{len(cols)} columns")
        self.ids = data.ids
        self.features = data.features
        self.feature_names = tuple(cols)
        self.feature_shape = tuple(int(s) for s in shape)
        self.keyed = key is not None  # alignment = "hmac": the rows' HMAC hashes, kept as the index only
        self.index = TokenIndex(np.zeros((0, 32), np.uint8) if key is None
                                else hash_ids(self.ids, key, normalized=True))  # normalised already

    @property
    def hashes(self) -> np.ndarray | None:
        """The rows' HMAC hashes in row order (``alignment = "hmac"``; ``None`` otherwise), from the index."""
        if not self.keyed:
            return None
        place = np.empty(len(self.index.rows), dtype=np.int64)
        place[self.index.rows] = np.arange(len(self.index.rows))
        return self.index.sorted_tokens()[place]


def _repeats(rows: np.ndarray, n: int) -> bool:
    """Whether ``rows`` (positions in ``[0, n)``) holds a position twice (a bitmap of ``n`` bytes, no sort)."""
    seen = np.zeros(n, dtype=bool)
    seen[rows] = True
    return int(seen.sum()) != rows.size


def file_stamp(path: Path) -> tuple[int, int] | None:
    """A file's modification time and size (``None``: not there), to tell whether it changed; of a directory of
    table files, the latest time and the total size of its files."""
    try:
        if path.is_dir():
            stats = [f.stat() for f in path.iterdir() if f.is_file()]
            return max((st.st_mtime_ns for st in stats), default=0), sum(st.st_size for st in stats)
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class TableBuiltins:
    """The tables a party server holds and the built-ins that serve them (a part of
    :class:`~partialvfl.federation.grpc.party.PartyServer`, which sets the attributes below)."""

    cfg: PartyConfig
    policy: PartyPolicy
    runtime: PartyRuntime
    aligner: PartyAligner
    prediction_handles: set[str]

    def _read_tables(self, key: bytes | None) -> None:
        """The training table and every prediction table of the party's config (``key``: the HMAC key, if any)."""
        cfg = self.cfg
        self.table = PartyTable(cfg, key if cfg.alignment == "hmac" else None)
        self.tables = {TRAINING_TABLE: self.table}
        self._key = key
        self._stamps: dict[str, tuple[int, int] | None] = {}  # each prediction table's file as last read
        for spec in cfg.predict_tables:
            self._stamps[spec.name] = file_stamp(spec.path)
            self.tables[spec.name] = self._predict_table(spec, key)

    def _predict_table(self, spec: PredictTable, key: bytes) -> PartyTable:
        """A prediction table, read like the training table; its feature columns must be the training table's.

        Its columns are named (the training table's features), so ``exclude_columns`` does not apply: a table of new
        users has no label column to exclude (and one it has anyway, like any other extra column, is not read)."""
        cfg = dataclasses.replace(self.cfg, data_path=spec.path, id_column=spec.id_column or self.cfg.id_column,
                                  feature_columns=self.table.feature_names, exclude_columns=())
        table = PartyTable(cfg, key, training=False)  # a party may hold none of the users to predict
        if table.feature_shape != self.table.feature_shape:
            raise ValueError(f"party {self.cfg.name!r}: prediction table {spec.name!r} has feature shape "
                             f"{table.feature_shape}, the training table {self.table.feature_shape}")
        return table

    def _table(self, req: Request) -> tuple[str, PartyTable]:
        name = req.meta.get("table", TRAINING_TABLE)
        if not isinstance(name, str) or name not in self.tables:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"party {self.cfg.name!r} serves no table {name!r}; it serves "
                                                     f"{sorted(self.tables)}")
        return name, self.tables[name]

    def _reread_prediction_tables(self) -> None:
        """Read again each prediction table whose file changed since it was read (rows added for new users): at a
        new session only, so that a session's tokens, row counts and rows stay as its ``hello`` announced them.  A
        file that no longer reads is logged and its previous rows kept serving."""
        for spec in self.cfg.predict_tables:
            stamp = file_stamp(spec.path)
            if stamp == self._stamps.get(spec.name):
                continue
            try:
                table = self._predict_table(spec, self._key)
            except (OSError, ValueError) as e:
                log.warning("party %s: prediction table %r changed but cannot be read (%s); its previous %d rows "
                            "keep serving", self.cfg.name, spec.name, e, len(self.tables[spec.name].ids))
                continue
            log.info("party %s: prediction table %r read again: %d rows (before: %d)", self.cfg.name, spec.name,
                     len(table.ids), len(self.tables[spec.name].ids))
            self.tables[spec.name], self._stamps[spec.name] = table, stamp

    def _attach(self, req: Request) -> Reply:
        handle = req.meta.get("handle")
        n = req.meta.get("n_samples")
        if not isinstance(handle, str) or not handle or not isinstance(n, int) or n < 0:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "attach needs meta 'handle' (str) and 'n_samples' (int)")
        names = self._attach_tables(req)
        attached = self.runtime.handles
        self.policy.check_handles(len(attached), handle, handle in attached)
        hashes, rows = req.tensors["hashes"].numpy(), req.tensors["rows"].numpy()  # shapes: SERVER_MESSAGES
        which = req.tensors["table_of"].numpy() if "table_of" in req.tensors else np.zeros(rows.size, np.int64)
        if which.size and (which.min() < 0 or which.max() >= len(names)):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"attach: table_of must index the {len(names)} tables "
                                                            f"{names}")
        given, given_rows, given_ids = self._given_features(req)
        every = np.concatenate([rows, given_rows])
        if every.size and (every.min() < 0 or every.max() >= n or _repeats(every, n)):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"attach: rows must be distinct positions in [0, {n})")
        feats = np.empty((every.size, self.table.features.shape[1]), dtype=self.table.features.dtype)
        pieces: list[tuple[np.ndarray, IdColumn]] = []  # (positions in ``every``, their IDs), table by table
        for t, name in enumerate(names):
            at = np.flatnonzero(which == t)
            if not at.size:
                continue
            table = self.tables[name]
            index = table.index if self.cfg.alignment == "hmac" else self.aligner.row_index(name)
            local = index.lookup(hashes[at])
            if (local < 0).any():
                h = bytes(hashes[at][int(np.argmax(local < 0))])
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"party {self.cfg.name!r} holds no row with ID "
                                                                f"token {h.hex()[:16]}... in table {name!r}")
            feats[at] = table.features[local]
            pieces.append((at, table.ids.take(local)))
        feats[rows.size:] = given
        pieces.append((np.arange(rows.size, every.size), IdColumn(given_ids.tolist())))
        in_order = bool(np.all(every[1:] > every[:-1]))  # the coordinator sends a handle's rows in order
        order = None if in_order else np.argsort(every, kind="stable")
        labels = labeled = None
        if "labels" in req.tensors or "labeled" in req.tensors:
            if names != [TRAINING_TABLE] or given_rows.size:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"attach: labels go with the training table, not "
                                                                f"with prediction table {names[-1]!r}")
            if "labels" not in req.tensors or "labeled" not in req.tensors:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "attach: send both 'labels' and 'labeled'")
            # copies: views would keep the whole request's buffer (every row's token) alive with the handle
            labels, labeled = req.tensors["labels"].numpy().copy(), req.tensors["labeled"].numpy().copy()
            if labels.shape != (n,) or labeled.shape != (n,):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"attach: labels must cover all {n} samples")
        placed = np.concatenate([at for at, _ in pieces])
        ids = IdColumn.concat([i for _, i in pieces])
        if order is not None or not np.array_equal(placed, np.arange(placed.size)):
            inverse = np.empty(every.size, dtype=np.int64)
            inverse[placed] = np.arange(placed.size)
            ids = ids.take(inverse if order is None else inverse[order])  # the IDs in the view's row order
        if order is not None:
            feats, every = feats[order], every[order]
        feats.flags.writeable = False
        view = PartyView(party=self.cfg.index, name=self.cfg.name, features=feats, rows=every,
                         ids=ids, feature_names=self.table.feature_names,
                         feature_shape=self.table.feature_shape, n_samples=n, labels=labels, labeled=labeled)
        self.runtime.attach(handle, view)
        if every.size > LARGE_ATTACH:  # Arrow keeps the memory of the IDs' gathering for reuse: hand it back
            release_arrow_memory()
        if names == [TRAINING_TABLE] and not given_rows.size:
            self.prediction_handles.discard(handle)
        else:  # rows of a prediction table, or values the coordinator gave: only ever predicted
            self.prediction_handles.add(handle)
        return Reply(meta={"n_rows": int(every.size)})

    def _attach_tables(self, req: Request) -> list[str]:
        """The tables an ``attach`` reads rows from: ``tables`` (a list, indexed by ``table_of``) or ``table``."""
        if "tables" not in req.meta:
            return [self._table(req)[0]]
        names = req.meta["tables"]
        if "table" in req.meta or not isinstance(names, list) or not names or len(set(map(str, names))) != len(names):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "attach: 'tables' must be a non-empty list of distinct "
                                                            "table names (and 'table' not given beside it)")
        return [self._table(Request("attach", {}, {"table": name}))[0] for name in names]

    def _given_features(self, req: Request) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The coordinator's own values of this party's features (rows it holds in no table), checked: the party's
        policy must accept them, one finite value per feature column, one ID per row."""
        width = self.table.features.shape[1]
        if not any(k in req.tensors for k in ("features", "feature_rows")) and "feature_ids" not in req.meta:
            return np.zeros((0, width), np.float32), np.zeros(0, np.int64), np.zeros(0, dtype=object)
        if not self.policy.accept_coordinator_features:
            raise PolicyViolation("accept_coordinator_features", f"party {self.cfg.name!r} computes only from its "
                                  "own tables; feature values from the coordinator (the label holder's new users) "
                                  "need [policy] accept_coordinator_features = true in the label holder's own party "
                                  "file", True)
        if "features" not in req.tensors or "feature_rows" not in req.tensors or "feature_ids" not in req.meta:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "attach: send 'features', 'feature_rows' and meta "
                                                            "'feature_ids' together")
        values = req.tensors["features"].numpy()
        given_rows = req.tensors["feature_rows"].numpy()
        ids = req.meta["feature_ids"]
        if not isinstance(ids, list) or len(ids) != given_rows.size or not all(isinstance(i, str) for i in ids):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"attach: 'feature_ids' must list one ID (text) per "
                                                            f"row of 'features' ({given_rows.size})")
        if values.shape[1] != width:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"attach: 'features' has {values.shape[1]} columns; "
                                                            f"party {self.cfg.name!r} has {width} features "
                                                            f"{list(self.table.feature_names)}")
        bad = ~np.isfinite(values) | (np.abs(values) > np.finfo(np.float32).max)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"attach: feature {self.table.feature_names[c]!r} of ID "
                                                            f"{ids[r]!r} is not a finite float32 value")
        return values.astype(self.table.features.dtype), given_rows, np.array(ids, dtype=object)

    def _ids(self, req: Request) -> Reply:
        if self.cfg.alignment != "hmac":
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"party {self.cfg.name!r} aligns by private set union (alignment = 'psu'): it sends no "
                          "ID hashes; set alignment = 'hmac' in the coordinator's and every party's file to use them")
        _, table = self._table(req)
        return Reply({"hashes": torch.from_numpy(table.index.sorted_tokens())})  # sorted: the order says nothing

    def _release(self, req: Request) -> Reply:
        handle: str = req.meta["handle"]
        self.runtime.release(handle)
        self.prediction_handles.discard(handle)
        return Reply()
