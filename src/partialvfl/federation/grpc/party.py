"""The party process: one long-lived gRPC server per institution (``partialvfl party serve --config FILE``).

It reads the party's own tables (CSV or Parquet with an ID column: its training table and, separately, tables of
users to predict) and nothing else, keeps one :class:`~partialvfl.federation.runtime.party.PartyRuntime` (so a program's
forward state lives between the calls of a step), and answers the coordinator over mutual TLS.  Before a request
reaches the runtime the server checks, in order:

1. the peer's certificate identity (CN or a DNS SAN) is on the allowlist -> else ``PERMISSION_DENIED``, and its
   certificate is the one the party pins for that name (``[peers.NAME]``: key fingerprint or CA,
   :mod:`partialvfl.federation.trust.pins`) -> else ``UNAUTHENTICATED``; this is checked when the call starts, *before*
   the request body is read;
2. the peer's bounds (:mod:`partialvfl.federation.grpc.limits`): calls in flight, the request's length (its header
   states it; gRPC refuses any wire message over a chunk), request bytes held -> else ``RESOURCE_EXHAUSTED``; the
   request is read into one buffer its tensors use in place, and it is a well-formed frame of allowed dtypes -> else
   ``INVALID_ARGUMENT``;
3. the message belongs to the current coordinator session (:mod:`partialvfl.federation.grpc.sessions`: a ``hello``
   while another session is live is refused, ``ABORTED``, unless it carries that session's secret), its sequence
   number is new, its step is not older than the last one and its ``(step, round, kind)`` was not served yet ->
   else ``FAILED_PRECONDITION`` (stale), ``ABORTED`` (another session's) or ``ALREADY_EXISTS`` (replay); a ``hello``
   changes the session only once it passed every check;
4. the party's policy (:mod:`partialvfl.federation.trust.policy`) admits it: the program and its architecture at
   ``setup``, learning rates, weight sharing, the number of data sets held, and that rows of a prediction table
   are only predicted -> else ``PERMISSION_DENIED`` naming the rule;
5. the kind is declared (a built-in or one of the program's ``messages``) -> else ``UNIMPLEMENTED``
   (``FAILED_PRECONDITION`` before any setup), and its tensors and metadata match the declaration -> else
   ``INVALID_ARGUMENT`` (the runtime checks, as in process: :mod:`partialvfl.federation.wire.schema`).

A handler that raises on bad input (``ValueError``, ``KeyError``, shape errors...) becomes ``INVALID_ARGUMENT``
with the party's message; a reply that does not match its declaration (the program's own bug) ``INTERNAL``; a reply
that would carry one of the party's own parameters or optimiser-state tensors is not sent (``PERMISSION_DENIED``)
unless the policy allows weight sharing.  Every request, served or refused, is written to the party's access log
(:mod:`partialvfl.federation.trust.access_log`), and the server keeps serving.

Built-in kinds of the server (besides the runtime's ``ping``/``setup``/``save``/``load``/``forget``): ``hello``
(open a coordinator session), ``bye`` (end it), the alignment kinds ``psu_*`` (:mod:`partialvfl.federation.trust.psu`,
the default) or, with ``alignment = "hmac"``, ``ids`` (the IDs of a table as HMAC hashes), ``attach`` (hold the rows
of a table, named by their alignment tokens, at the given positions of the shared order under a handle),
``release``.  ``save``/``load`` directories are resolved inside the party's own state directory: a party's model
state stays on its own disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path, PurePosixPath
from typing import Any

import grpc
import numpy as np
import torch

from partialvfl.data.dataset import PartyView
from partialvfl.data.tables import feature_values, read_table, select_features, table_ids
from partialvfl.federation.grpc.limits import PeerLimits, Refused, read_request
from partialvfl.federation.grpc.party_config import TRAINING_TABLE, PartyConfig, PredictTable, load_party_config
from partialvfl.federation.grpc.sessions import SessionGuard
from partialvfl.federation.grpc.transport import (
    ATTACH_PREFIX,
    CALL_METHOD,
    MAX_WIRE_MESSAGE,
    SECONDS_KEY,
    SERVICE_NAME,
    WireError,
    WireRequest,
    decode_request,
    encode_reply,
)
from partialvfl.federation.runtime.party import PartyRuntime
from partialvfl.federation.trust.access_log import AccessLog, AccessLogConfig, tensor_summary
from partialvfl.federation.trust.alignment import hash_ids, load_key
from partialvfl.federation.trust.audit import disclosed_state
from partialvfl.federation.trust.lookups import LOOKUP_LEDGER, SPANS, LookupLedger
from partialvfl.federation.trust.pins import spki_sha256
from partialvfl.federation.trust.policy import InferenceGuard
from partialvfl.federation.trust.psu import PartyAligner, read_alignment_key
from partialvfl.federation.wire.messages import Reply, Request
from partialvfl.federation.wire.program import NotSetUp
from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.federation.wire.schema import INFERS, MessageError, MessageSpec, TensorSpec, UnknownKindError

__all__ = ["PartyConfig", "PartyServer", "PartyTable", "PredictTable", "Refused", "SessionGuard", "TRAINING_TABLE",
           "import_plugins", "load_party_config", "run", "serve"]

log = logging.getLogger("partialvfl.party")
EXIT_WITH_PARENT_ENV = "PARTIALVFL_EXIT_WITH_PARENT"
#: how long a stopping party lets calls in flight finish before it cancels them (SIGTERM: out within a second)
STOP_GRACE_SECONDS = 0.25
#: how often the serving loop wakes up (to see a stop request or a vanished parent)
STOP_POLL_SECONDS = 0.1
#: Request metadata copied into the access log (what was asked for, never a value the party computed).
LOGGED_META = ("data", "handle", "table", "program", "train", "dir", "n_samples")
#: The party's differential-privacy ledger in its state directory (mu^2 spent per row, kept across restarts).
PRIVACY_LEDGER = "privacy-ledger.npz"

#: The server's own message kinds (besides the runtime's ``ping``/``setup``/``save``/``load``/``forget``).
SERVER_MESSAGES: dict[str, MessageSpec] = {
    "hello": MessageSpec(optional_meta=["resume"],
                         doc="Open a coordinator session (refused while another one is live, unless `resume` is "
                             "that session's secret); replies the party's name, index, row count, feature shape, the "
                             "names and row counts of its prediction tables and the session's secret as metadata "
                             "(and `dp`, its differential-privacy budget, where it keeps one)."),
    "bye": MessageSpec(doc="End this coordinator session (another coordinator may then say hello)."),
    "ids": MessageSpec(reply=[TensorSpec("hashes", "uint8", ("N", 32))], optional_meta=["table"],
                       doc="alignment = 'hmac' only: the IDs of the training table (or of prediction table `table`) "
                           "as HMAC-SHA256 hashes."),
    "attach": MessageSpec(
        request=[TensorSpec("hashes", "uint8", ("R", 32)), TensorSpec("rows", "int64", ("R",)),
                 TensorSpec("table_of", "int64", ("R",), optional=True),
                 TensorSpec("labels", ("int64", "float64"), ("N",), optional=True),
                 TensorSpec("labeled", "bool", ("N",), optional=True),
                 TensorSpec("features", ("float32", "float64"), ("F", "D"), optional=True),
                 TensorSpec("feature_rows", "int64", ("F",), optional=True)],
        meta=["handle", "n_samples"], optional_meta=["table", "tables", "feature_ids"],
        doc="Hold the rows with these alignment tokens (or HMAC hashes) at these positions of the shared order (of "
            "`n_samples`) under "
            "`handle`, from the training table or from prediction table `table` (then only predicted, never "
            "trained on), or row by row from the tables `tables` (`table_of`: each row's index into that list); "
            "the active party also gets the labels (training table only). `features`/`feature_rows`/`feature_ids`: "
            "the coordinator's own values of this party's features for rows it holds in no table (the label "
            "holder's new users; only predicted), accepted only under `[policy] accept_coordinator_features`."),
    "release": MessageSpec(meta=["handle"], doc="Drop the data attached under `handle`."),
}


# ---------------------------------------------------------------------- the party's own table
class PartyTable:
    """The party's rows: IDs, their HMAC hashes and the float32 feature matrix, read from its own file only.

    Read by the same functions as :func:`~partialvfl.data.builders.from_tables` (:mod:`partialvfl.data.tables`):
    IDs normalised by the one rule (:mod:`partialvfl.data.ids`; empty and colliding IDs refused, naming them),
    numeric feature columns only (a text or categorical column refused, naming it), every value of a held row given.
    """

    def __init__(self, cfg: PartyConfig, key: bytes | None, *, training: bool = True) -> None:
        where = f"party {cfg.index} ({cfg.name!r}), {cfg.data_path.name}"
        if not cfg.data_path.is_file():
            raise FileNotFoundError(f"party {cfg.index} ({cfg.name!r}): data file not found: {cfg.data_path}")
        df, _ = read_table(where, cfg.data_path, cfg.id_column)
        if not len(df) and training:
            raise ValueError(f"{where}: the training table {cfg.data_path} has no rows")
        ids, _ = table_ids(where, df, cfg.id_column)
        cols = select_features(where, df, id_column=cfg.id_column, columns=cfg.feature_columns,
                               exclude=cfg.exclude_columns)
        shape = cfg.feature_shape or (len(cols),)
        if int(np.prod(shape)) != len(cols):
            raise ValueError(f"party {cfg.index} ({cfg.name!r}): feature_shape {shape} does not match its "
                             f"{len(cols)} columns")
        self.ids = np.array(ids, dtype=object)
        self.features = feature_values(where, df, cols, ids)
        self.feature_names = tuple(cols)
        self.feature_shape = tuple(int(s) for s in shape)
        self.hashes = None if key is None else hash_ids(self.ids, key, normalized=True)  # normalised already
        self.index = {} if self.hashes is None else {bytes(h): i for i, h in enumerate(self.hashes)}


def _stamp(path: Path) -> tuple[int, int] | None:
    """A file's modification time and size (``None``: not there), to tell whether it changed."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


# ---------------------------------------------------------------------- the server
class PartyServer:
    """The party's request handler: authentication, replay checks, policy, then the runtime (declarations,
    handlers); every request is written to the access log."""

    def __init__(self, cfg: PartyConfig, key: bytes | None = None) -> None:
        self.cfg = cfg
        if key is None and cfg.alignment == "hmac":
            if cfg.hmac_key_file is None:
                raise ValueError(f"party {cfg.name!r}: alignment = 'hmac' needs hmac_key_file in [party]")
            key = load_key(cfg.hmac_key_file)
        self.table = PartyTable(cfg, key if cfg.alignment == "hmac" else None)
        self.tables = {TRAINING_TABLE: self.table}
        self._key = key
        self._stamps: dict[str, tuple[int, int] | None] = {}  # each prediction table's file as last read
        for spec in cfg.predict_tables:
            self._stamps[spec.name] = _stamp(spec.path)
            self.tables[spec.name] = self._predict_table(spec, key)
        handlers = {"hello": self._hello, "bye": self._bye, "ids": self._ids, "attach": self._attach,
                    "release": self._release}
        self.state_dir = cfg.state_dir.resolve()
        where = f"party {cfg.index} ({cfg.name!r})"
        limits = cfg.policy.lookup_limits(len(self.table.ids))
        self.lookups = LookupLedger(limits, self.state_dir / LOOKUP_LEDGER, where=where,
                                    warn_fraction=cfg.policy.lookup_warn_fraction)  # kept across sessions, restarts
        self.aligner = PartyAligner(  # the keyless alignment (unused with alignment = "hmac")
            cfg.name, read_alignment_key(cfg.alignment_key_file) if cfg.alignment_key_file else None,
            lambda name: self.tables[name].ids, self.state_dir, persist=cfg.policy.persist_alignment,
            max_lookups=cfg.policy.max_lookups, threads=cfg.threads, ledger=self.lookups if limits else None,
            resume_by_name=cfg.policy.resume_alignment_by_name)
        builtins = {k: (SERVER_MESSAGES[k], h) for k, h in handlers.items()}
        if cfg.alignment == "psu":
            builtins.update(self.aligner.handlers(lambda req: self._table(req)[0]))
        self.runtime = PartyRuntime(cfg.index, cfg.name, resolve_dir=self._state_path, builtins=builtins,
                                    policy=cfg.policy, feature_shape=self.table.feature_shape,
                                    privacy_ledger=self.state_dir / PRIVACY_LEDGER,
                                    device=cfg.device, precision=cfg.precision)
        self.policy = cfg.policy
        self._lock = threading.Lock()
        self.sessions = SessionGuard(cfg.name, cfg.session_idle_seconds)
        self._session_reply: dict[str, Any] = {}  # what the hello being served adds to its reply
        self.peers = PeerLimits(cfg.policy.max_peer_rpcs, int(cfg.policy.max_peer_mb * 2**20))
        self.inference = InferenceGuard()
        self.prediction_handles: set[str] = set()
        self.refusals = 0
        self.access = AccessLog(cfg.access_log or AccessLogConfig(self.state_dir / "access.log"))

    @property
    def session(self) -> str | None:
        return self.sessions.session

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

    # -- checks
    def _check_peer(self, context: grpc.ServicerContext, entry: dict[str, Any]) -> tuple[str, str]:
        """The peer's allowlisted name (its certificate must match the pin of that name) and its identity for the
        lookup budget (the SHA-256 of its certificate's public key); ``entry`` records who asked, refused or not."""
        auth = context.auth_context()
        names = [v.decode() for key in ("x509_common_name", "x509_subject_alternative_name")
                 for v in auth.get(key, [])]
        for n in names:
            if n in self.cfg.allowed_peers:
                pin = self.cfg.peers.get(n)
                cert = (auth.get("x509_pem_cert") or [b""])[0]
                fingerprint = spki_sha256(cert) if cert else n
                entry["peer"] = n
                if cert:
                    entry["peer_key"] = fingerprint[:16]
                why = pin.refusal(cert) if pin is not None else None
                if why is not None:  # the right name from a CA or key this party does not trust for it
                    raise Refused(grpc.StatusCode.UNAUTHENTICATED, f"party {self.cfg.name!r} refused the peer: "
                                                                   f"{why}")
                return n, fingerprint
        raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                      f"party {self.cfg.name!r} does not accept peer {names or 'without certificate'}: not on its "
                      f"allowlist {list(self.cfg.allowed_peers)}")

    def _state_path(self, rel: Any) -> str:
        if not isinstance(rel, str) or not rel:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "save/load/forget need meta 'dir', a relative path")
        pp = PurePosixPath(rel)
        if pp.is_absolute() or ".." in pp.parts:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"state directory {rel!r} must be relative and stay inside the party's state directory")
        return str(self.state_dir.joinpath(*pp.parts))

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
            stamp = _stamp(spec.path)
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

    # -- built-ins
    def _hello(self, req: Request) -> Reply:
        self.aligner.new_session(self.sessions.resumed)  # keys, blindings and tokens are per session
        self._reread_prediction_tables()
        t = self.table
        tables = {name: int(len(tb.ids)) for name, tb in self.tables.items() if name != TRAINING_TABLE}
        meta = {"name": self.cfg.name, "index": self.cfg.index, "n_rows": int(len(t.ids)),
                "feature_dim": int(t.features.shape[1]), "feature_shape": list(t.feature_shape),
                "tables": tables, "feature_names": list(t.feature_names), "alignment": self.cfg.alignment,
                "policy": self.policy.announced(), **self._session_reply}
        if self.runtime.privacy is not None:  # the coordinator learns the budget; it cannot change it
            budget = self.runtime.privacy.budget
            meta["dp"] = {"epsilon": budget.epsilon, "delta": budget.delta}
        if self.cfg.alignment == "psu" and self.aligner.budget():  # its lookup budget, and what this caller used
            meta["lookups"] = self.aligner.budget()
        return Reply(meta=meta)

    def _bye(self, req: Request) -> Reply:
        return Reply()

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
        if every.size and (every.min() < 0 or every.max() >= n or len(np.unique(every)) != every.size):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"attach: rows must be distinct positions in [0, {n})")
        feats = np.empty((every.size, self.table.features.shape[1]), dtype=self.table.features.dtype)
        ids = np.empty(every.size, dtype=object)
        for t, name in enumerate(names):
            at = np.flatnonzero(which == t)
            if not at.size:
                continue
            table = self.tables[name]
            index = table.index if self.cfg.alignment == "hmac" else self.aligner.row_index(name)
            local = np.empty(at.size, dtype=np.int64)
            for i, h in enumerate(hashes[at]):
                j = index.get(bytes(h))
                if j is None:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"party {self.cfg.name!r} holds no row with ID "
                                                                    f"token {bytes(h).hex()[:16]}... in table {name!r}")
                local[i] = j
            feats[at], ids[at] = table.features[local], table.ids[local]
        feats[rows.size:], ids[rows.size:] = given, given_ids
        order = np.argsort(every, kind="stable")
        labels = labeled = None
        if "labels" in req.tensors or "labeled" in req.tensors:
            if names != [TRAINING_TABLE] or given_rows.size:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"attach: labels go with the training table, not "
                                                                f"with prediction table {names[-1]!r}")
            if "labels" not in req.tensors or "labeled" not in req.tensors:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "attach: send both 'labels' and 'labeled'")
            labels, labeled = req.tensors["labels"].numpy(), req.tensors["labeled"].numpy()
            if labels.shape != (n,) or labeled.shape != (n,):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"attach: labels must cover all {n} samples")
        feats = feats[order]
        feats.flags.writeable = False
        view = PartyView(party=self.cfg.index, name=self.cfg.name, features=feats, rows=every[order],
                         ids=ids[order], feature_names=self.table.feature_names,
                         feature_shape=self.table.feature_shape, n_samples=n, labels=labels, labeled=labeled)
        self.runtime.attach(handle, view)
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
        return Reply({"hashes": torch.from_numpy(table.hashes.copy())})

    def _release(self, req: Request) -> Reply:
        handle = str(req.meta["handle"])
        self.runtime.release(handle)
        self.prediction_handles.discard(handle)
        return Reply()

    # -- the gRPC entry point
    def handle_stream(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """One call: the peer is checked when the call starts, the body is read only for an allowed peer, within
        the peer's bounds (:mod:`partialvfl.federation.grpc.limits`)."""
        entry: dict[str, Any] = {"peer": None, "address": context.peer(), "kind": "?"}
        try:
            peer, caller = self._check_peer(context, entry)
            with self.peers.call(peer), contextlib.ExitStack() as held:
                reply = self._answer(requests, entry, lambda size: held.enter_context(
                    self.peers.bytes(peer, size, context.time_remaining())), caller)
            payload = encode_reply(reply)
            self._log(entry, "served", grpc.StatusCode.OK, reply_bytes=len(payload),
                      reply=tensor_summary(reply.tensors))
            return payload
        except Refused as e:
            self._refuse(context, entry, e.code, str(e))
        except Exception as e:  # noqa: BLE001 - anything else is the party's own bug: report, keep serving
            self._refuse(context, entry, grpc.StatusCode.INTERNAL,
                         f"party {self.cfg.name!r} failed on {entry['kind']!r}: {type(e).__name__}: {e}")
        raise AssertionError("unreachable")  # context.abort raises

    def _answer(self, requests: Iterator[bytes], entry: dict[str, Any], hold: Callable[[int], object],
                caller: str) -> Reply:
        """Read, decode and serve one request.  Its buffer (which the request's tensors are views of) is freed
        before this returns or raises, so that the peer's byte budget is released only once the memory is: a
        failure is re-raised without the traceback that would keep the request alive."""
        data: bytearray | None = None
        wire: WireRequest | None = None
        try:
            data = read_request(requests, self.cfg.max_message_bytes, hold)
            entry["request_bytes"] = len(data)
            try:
                wire = decode_request(data, self.cfg.max_message_bytes)
            except WireError as e:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"malformed message: {e}") from None
            data = None  # the tensors are views of it: it lives as long as they do
            return self._serve(wire, entry, caller)
        except Exception as e:  # noqa: BLE001 - re-raised below, without the frames that hold the request
            if not isinstance(e, Refused):
                log.exception("internal error while serving %r", entry["kind"])
            failure = e
        data = wire = None
        failure.__context__ = failure.__cause__ = None
        failure = failure.with_traceback(None)
        if entry.get("request_bytes", 0) > MAX_WIRE_MESSAGE:
            gc.collect(1)  # the failed request's frames may sit in young reference cycles
        raise failure

    def _serve(self, wire: WireRequest, entry: dict[str, Any], caller: str) -> Reply:
        request = wire.request
        kind = request.kind
        entry.update(kind=kind, step=wire.step, round=wire.round, session=wire.session[:8],
                     request=tensor_summary(request.tensors),
                     meta={k: request.meta[k] for k in LOGGED_META if k in request.meta})
        if wire.lane:
            entry["lane"] = wire.lane
        with self._lock:
            t0 = time.perf_counter()
            self.aligner.caller, self.aligner.caller_name = caller, str(entry.get("peer") or "")
            self.sessions.check(wire)
            program = self.runtime.program
            if wire.lane:
                self._check_lane(request, wire.lane)
            try:
                request = self._carried_attach(request, entry)
                if kind not in self.runtime.builtins:
                    self.inference.check(None if program is None else program.messages, kind, request.meta,
                                         self.prediction_handles, None if program is None else program.program_name)
                reply = self.runtime.handle(request, accepted=lambda: self._accepted(wire))
            except Refused:
                raise
            except PolicyViolation as e:
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"party {self.cfg.name!r} refused {kind!r}: {e}") \
                    from None
            except UnknownKindError as e:
                raise Refused(grpc.StatusCode.UNIMPLEMENTED, str(e)) from None
            except MessageError as e:  # the same text as in process; a bad reply is the party's own bug
                code = grpc.StatusCode.INVALID_ARGUMENT if e.direction == "request" else grpc.StatusCode.INTERNAL
                raise Refused(code, str(e)) from None
            except NotSetUp as e:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
            except (ValueError, KeyError, TypeError, IndexError, RuntimeError, FileNotFoundError) as e:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"party {self.cfg.name!r} refused {kind!r}: {type(e).__name__}: {e}") from None
            self._check_disclosure(kind, reply)
            if self.runtime.privacy is not None and kind not in self.runtime.builtins:
                entry["dp_epsilon_spent"] = self.runtime.privacy.ledger.epsilon_spent()
            if kind == "psu_eval" and self.aligner.ledger is not None:  # the caller's lookups after this one
                entry["lookups"] = self.aligner.budget()["used"]
            self.sessions.touch(wire.session)
            if self.runtime.clipped_rows:
                entry["clipped_rows"] = self.runtime.clipped_rows
            return Reply(reply.tensors, {**reply.meta, SECONDS_KEY: time.perf_counter() - t0})

    def _check_lane(self, request: Request, lane: int) -> None:
        """A lane other than 0 (a prediction service's batches in flight side by side) carries inference requests
        of the program (without ``train``) and ID lookups only: whatever changes the party's state keeps the
        session's one order."""
        program = self.runtime.program
        spec = None if program is None else program.messages.get(request.kind)
        if request.kind == "psu_eval" or (spec is not None and spec.role == INFERS and not request.meta.get("train")):
            return
        raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"party {self.cfg.name!r}: lane {lane} carries inference "
                                                         f"requests and ID lookups only, not {request.kind!r}")

    def _carried_attach(self, request: Request, entry: dict[str, Any]) -> Request:
        """Serve the ``attach`` a request carries (``meta['attach']``, its tensors named ``attach.*``: one round for
        attaching a batch and predicting it) and return the request without it.  Only an inference request of the
        program, on the data set it attaches, not training, may carry one."""
        carried = request.meta.get("attach")
        if carried is None:
            return request
        program = self.runtime.program
        spec = None if program is None else program.messages.get(request.kind)
        if not isinstance(carried, dict) or spec is None or spec.role != INFERS or request.meta.get("train") \
                or request.meta.get("data") != carried.get("handle"):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"party {self.cfg.name!r}: only an inference request "
                                                            "of the program, not training, may carry the attach of "
                                                            "the data set it names (meta 'data' = the attach's "
                                                            "handle)")
        tensors = {k[len(ATTACH_PREFIX):]: t for k, t in request.tensors.items() if k.startswith(ATTACH_PREFIX)}
        attach = Request("attach", tensors, {**carried, "step": request.meta.get("step"),
                                             "round": request.meta.get("round")})
        self.runtime.handle(attach)
        entry["attach"] = {k: carried[k] for k in ("handle", "table", "tables", "n_samples") if k in carried}
        entry["attach"]["rows"] = int(tensors["rows"].shape[0]) if "rows" in tensors else 0
        meta = {k: v for k, v in request.meta.items() if k != "attach"}
        return Request(request.kind, {k: t for k, t in request.tensors.items() if not k.startswith(ATTACH_PREFIX)},
                       meta)

    def _accepted(self, wire: WireRequest) -> None:
        """A request passed every check: record it as served (and, for ``setup``, forget the old program's rows)."""
        self._session_reply = self.sessions.commit(wire)
        if wire.request.kind == "setup":
            self.inference.reset()
        elif wire.request.kind not in self.runtime.builtins:
            self.inference.accepted(wire.request.meta, self.prediction_handles)

    def _check_disclosure(self, kind: str, reply: Reply) -> None:
        """Never send the party's own parameters or optimiser state (unless its policy allows weight sharing)."""
        if self.policy.allow_weight_sharing or not reply.tensors:
            return
        hit = disclosed_state(reply.tensors, self.runtime.program)
        if hit is not None:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"party {self.cfg.name!r} did not send its reply to {kind!r}: policy rule "
                          f"'allow_weight_sharing': tensor {hit[0]!r} holds the values of its state tensor {hit[1]}")

    def _log(self, entry: dict[str, Any], outcome: str, code: grpc.StatusCode, **more: Any) -> None:
        self.access.write(**entry, outcome=outcome, status=code.name, **more)

    def _refuse(self, context: grpc.ServicerContext, entry: dict[str, Any], code: grpc.StatusCode,
                reason: str) -> None:
        self.refusals += 1
        log.warning("refused %r: %s: %s", entry["kind"], code.name, reason)
        self._log(entry, "refused", code, reason=reason)
        context.abort(code, reason)

    def close(self) -> None:
        self.access.close()


def generic_handler(fn: Callable[[Iterator[bytes], grpc.ServicerContext], bytes]) -> grpc.GenericRpcHandler:
    """The one-method service, bytes in and out (no protoc).

    Registered as stream-unary so the handler runs when the call starts and checks the peer before it reads the
    body; on the wire it is the same as the unary call the coordinator makes.
    """
    method = CALL_METHOD.rsplit("/", 1)[1]
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {method: grpc.stream_unary_rpc_method_handler(fn)})


def import_plugins(cfg: PartyConfig) -> None:
    """Import the party's plugin modules (party programs outside the package), naming any that fails."""
    failed = []
    for name in cfg.plugins:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - report every broken plugin at once
            log.warning("could not import %s: %s", name, e)
            failed.append(name)
    if failed:
        raise ImportError(f"party {cfg.name!r}: plugin module(s) {failed} failed")


def serve(cfg: PartyConfig) -> tuple[grpc.Server, int, PartyServer]:
    """Start the party's server (not blocking); returns the server, its bound port and the handler.

    The party runs the programs registered in :data:`~partialvfl.federation.wire.program.PROGRAMS` when a ``setup``
    arrives (and its policy agrees): those its caller registered before (``partialvfl party serve`` registers every
    method's) and those of the plugin modules in ``cfg.plugins``, imported here.  An address already in use is an
    error (:class:`OSError`): the port is never shared with another process (``SO_REUSEPORT`` off).
    """
    torch.set_num_threads(max(1, cfg.threads))
    import_plugins(cfg)
    handler = PartyServer(cfg)
    ca, cert, key = cfg.tls.read()
    creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=cfg.max_concurrent_rpcs),
        handlers=[generic_handler(handler.handle_stream)],
        options=[("grpc.max_receive_message_length", min(cfg.max_message_bytes, MAX_WIRE_MESSAGE)),  # a chunk
                 ("grpc.max_send_message_length", cfg.max_message_bytes),
                 ("grpc.so_reuseport", 0), ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1 << 20)],
        maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
    )
    try:
        port = server.add_secure_port(cfg.address, creds)
    except RuntimeError:
        port = 0
    if port == 0:
        handler.close()
        raise OSError(f"party {cfg.name!r}: cannot listen on {cfg.address}: the address is in use (is another "
                      "party serving there?) or not an address of this host")
    server.start()
    if cfg.port_file is not None:
        cfg.port_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cfg.port_file.with_suffix(".tmp")
        tmp.write_text(f"{port}\n")
        os.replace(tmp, cfg.port_file)
    log.info("party %d (%s) serving %d rows on port %d; %s", cfg.index, cfg.name, len(handler.table.ids), port,
             cfg.policy.describe())
    if cfg.alignment == "hmac":
        log.warning("party %s aligns with the shared HMAC key (alignment = 'hmac'): whoever holds the key can test "
                    "any ID it can enumerate against this party's hashes; for one trust domain only", cfg.name)
    else:
        log.info("party %s aligns by private set union (%s)", cfg.name, "holds the passive parties' alignment key"
                 if handler.aligner.keyed else "no alignment key: its tokens come through a keyed party")
        if handler.aligner.keyed:
            limits = handler.lookups.limits
            log.info("party %s answers at most %s per coordinator (its lookup budget, kept in %s)", cfg.name,
                     ", ".join(f"{v:,} lookups {SPANS[k]}" for k, v in limits.items()) or "any number of lookups",
                     handler.lookups.path)
    if cfg.policy.seed == "coordinator":
        log.warning("party %s builds its parameters from the coordinator's seed ([policy] seed = 'coordinator'): "
                    "for research only, a coordinator knowing the initial weights can invert embeddings", cfg.name)
    return server, port, handler


def run(config: str | Path | PartyConfig) -> int:
    """Serve until SIGTERM/SIGINT (the caller has registered the programs to run and configured logging)."""
    cfg = config if isinstance(config, PartyConfig) else load_party_config(config)
    server, port, handler = serve(cfg)
    print(f"party {cfg.name} listening on port {port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # a party started by a test or benchmark (LocalDeployment) must not outlive it, however it ends
    parent = os.getppid() if os.environ.get(EXIT_WITH_PARENT_ENV) == "1" else None
    while not stop.wait(STOP_POLL_SECONDS):  # short waits: a signal's handler runs between them at the latest
        if parent is not None and os.getppid() != parent:
            log.warning("parent process %d is gone: stopping", parent)
            break
    log.info("party %d (%s) stopping", cfg.index, cfg.name)
    server.stop(grace=STOP_GRACE_SECONDS).wait()
    handler.close()
    return 0
