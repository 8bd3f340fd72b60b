"""The coordinator's side of a real deployment: :class:`GrpcFederation` and its federation file.

The coordinator is the active party's label-side role.  It reaches every party's server (the active party's own
feature block included: it runs its own party process) through one :class:`GrpcTransport`, and aligns samples
without a central table: the parties' IDs become per-session tokens of a private set union
(:mod:`partialvfl.federation.grpc.psu_session`; the coordinator's own IDs join through the same protocol, and it can
test
no guessed ID offline) or, with the explicit ``alignment = "hmac"``, HMAC hashes; the coordinator builds the
observed matrix from them and tells each party where its own rows sit in the shared order (``attach``).  Three ways
to fix that order:

* :meth:`GrpcFederation.align` (``partialvfl fit --federation``): the union of the parties' ID tokens and of the
  labelled IDs, sorted by token; labels come from the coordinator's own label table (a new random order in every
  session, unless the parties keep their alignment nonces for ``alignment_id``, as a resumed fit asks);
* :meth:`GrpcFederation.attach_ids` (``partialvfl predict --federation --ids``): the given IDs, in that order, from
  the parties' training tables or from a *table set*: the prediction tables of that name the parties serve beside
  their training tables (new users; their rows are only predicted, never trained on);
* :meth:`GrpcFederation.attach` (the :class:`~partialvfl.federation.runtime.coordinator.Federation` contract, used by
  ``method.fit(data, federation=...)`` in tests and benchmarks): the order and observed matrix of a
  :class:`VerticalDataset` the coordinator holds for simulation; every party must hold the rows the dataset says it
  observes (it reads them from its own file) and no feature leaves the coordinator.

``save``/``load`` send each party a directory *relative to its own state directory*; the model directory on the
coordinator records it in ``party_states.json``.  :meth:`GrpcFederation.rejoin` waits for every party to answer a
``hello`` again (a party restarted after a crash), so a fit can continue from its last checkpoint.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from partialvfl.data.dataset import UNLABELED, CoordinatorView, DataValidationError, Task, VerticalDataset
from partialvfl.data.ids import normalize_ids, show_id
from partialvfl.data.labels import encode_labels
from partialvfl.data.tables import columns_hint, read_table, table_ids
from partialvfl.federation.grpc.party_config import TRAINING_TABLE
from partialvfl.federation.grpc.psu_session import ALIGNMENT_MODES, AlignmentError, make_alignment
from partialvfl.federation.grpc.sessions import AlignmentTickets, SessionSecrets
from partialvfl.federation.grpc.transport import DEFAULT_MAX_MESSAGE_BYTES, GrpcTransport, PartyEndpoint, TlsFiles
from partialvfl.federation.runtime.checkpoint import LATEST
from partialvfl.federation.runtime.coordinator import Federation, model_tag
from partialvfl.federation.trust.alignment import hex_ids, load_key, observed_from_hashes, positions_in
from partialvfl.federation.trust.pins import require_pins
from partialvfl.federation.wire.messages import MessageLog, Request
from partialvfl.federation.wire.transport import PartyUnavailable
from partialvfl.utils.tomlfile import check_keys, read_toml

__all__ = ["FederationConfig", "GrpcFederation", "LabelSource", "load_federation_config", "read_labels"]

PARTY_STATES_FILE = "party_states.json"
log = logging.getLogger("partialvfl.federation")

#: every section and key of a federation file (docs/deployment.md); anything else is an error naming it
FEDERATION_KEYS: dict[str, tuple[str, ...]] = {
    "coordinator": ("identity", "active_party", "alignment", "hmac_key_file", "deadline_seconds", "max_message_mb",
                    "state_dir"),
    "tls": ("ca", "cert", "key"),
    "labels": ("path", "id_column", "label_column", "task", "classes", "label_dp"),
    "parties": ("name", "address", "identity", "ca", "certificate"),
}
#: where a coordinator keeps its session secrets and the parties' alignment tickets (in its state directory, or with a
#: fit's checkpoints)
SESSIONS_FILE = "sessions.json"
TICKETS_FILE = "alignment-tickets.json"


@dataclass(frozen=True)
class LabelSource:
    """The active party's label table: a CSV/Parquet file with an ID column and a label column."""

    path: Path
    id_column: str
    label_column: str
    task: str = "classification"
    classes: tuple[Any, ...] | None = None
    label_dp: float | None = None  # the label holder's label DP (randomized response at this epsilon)


@dataclass(frozen=True)
class FederationConfig:
    """The coordinator's federation file, paths resolved against the file's folder."""

    identity: str
    parties: tuple[PartyEndpoint, ...]
    active_party: int
    tls: TlsFiles
    hmac_key_file: Path | None
    labels: LabelSource | None
    deadline: float = 30.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    state_dir: Path | None = None
    alignment: str = "psu"


def load_federation_config(path: str | Path) -> FederationConfig:
    """Read a federation TOML file (see ``docs/deployment.md``)."""
    p = Path(path)
    raw = read_toml(p, "federation file")
    check_keys(raw, FEDERATION_KEYS, p)

    def rel(v: str) -> Path:
        q = Path(v).expanduser()
        return q if q.is_absolute() else p.parent / q

    coord = raw.get("coordinator", {})
    tls = raw.get("tls")
    if not tls or not all(k in tls for k in ("ca", "cert", "key")):
        raise ValueError(f"{p}: [tls] needs 'ca', 'cert' and 'key'")
    parties = raw.get("parties")
    if not parties:
        raise ValueError(f"{p}: list the parties as [[parties]] tables with 'name' and 'address'")
    eps = []
    for i, t in enumerate(parties):
        if "name" not in t or "address" not in t:
            raise ValueError(f"{p}: party {i} needs 'name' and 'address'")
        if "ca" in t and "certificate" in t:
            raise ValueError(f"{p}: party {t['name']!r}: pin its CA (ca) or its certificate (certificate), not both")
        pin = t.get("ca", t.get("certificate"))
        eps.append(PartyEndpoint(str(t["name"]), str(t["address"]), str(t.get("identity", t["name"])),
                                 rel(str(pin)) if pin is not None else None))
    tls_files = TlsFiles(rel(tls["ca"]), rel(tls["cert"]), rel(tls["key"]))
    for ep in eps:
        if ep.pin is not None and not ep.pin.is_file():
            raise FileNotFoundError(f"{p}: party {ep.name!r}: pinned file not found: {ep.pin}")
    if tls_files.ca.is_file():
        require_pins([e.name for e in eps], [e.name for e in eps if e.pin is not None], tls_files.ca, str(p),
                     "ca = the CA file that issues its certificate, or certificate = its certificate, in its "
                     "[[parties]] table; partialvfl certs init writes them")
    names = [e.name for e in eps]
    active = coord.get("active_party")
    if active is None:
        raise ValueError(f"{p}: [coordinator] needs 'active_party' (the name or index of the label holder)")
    if isinstance(active, str):
        if active not in names:
            raise ValueError(f"{p}: active_party {active!r} is not one of the parties {names}")
        active = names.index(active)
    if not 0 <= int(active) < len(eps):
        raise ValueError(f"{p}: active_party index {active} out of range for {len(eps)} parties")
    lab = raw.get("labels")
    labels = None
    if lab is not None:
        for k in ("path", "id_column", "label_column"):
            if k not in lab:
                raise ValueError(f"{p}: [labels] needs '{k}'")
        if lab.get("task", "classification") not in ("classification", "regression"):
            raise ValueError(f"{p}: [labels] task must be 'classification' or 'regression', got {lab['task']!r}")
        label_dp = lab.get("label_dp")
        if label_dp is not None and (isinstance(label_dp, bool) or not isinstance(label_dp, int | float)
                                     or not 0 < label_dp < float("inf")):
            raise ValueError(f"{p}: [labels] label_dp must be a positive number (an epsilon), got {label_dp!r}")
        labels = LabelSource(rel(lab["path"]), str(lab["id_column"]), str(lab["label_column"]),
                             str(lab.get("task", "classification")),
                             tuple(lab["classes"]) if "classes" in lab else None,
                             None if label_dp is None else float(label_dp))
    alignment = coord.get("alignment", "psu")
    if alignment not in ALIGNMENT_MODES:
        raise ValueError(f"{p}: [coordinator] alignment must be one of {list(ALIGNMENT_MODES)}, got {alignment!r}")
    if alignment == "hmac" and "hmac_key_file" not in coord:
        raise ValueError(f"{p}: [coordinator] alignment = 'hmac' needs 'hmac_key_file'")
    return FederationConfig(
        alignment=str(alignment),
        identity=str(coord.get("identity", "coordinator")),
        parties=tuple(eps),
        active_party=int(active),
        tls=tls_files,
        hmac_key_file=rel(coord["hmac_key_file"]) if alignment == "hmac" else None,
        labels=labels,
        deadline=float(coord.get("deadline_seconds", 30.0)),
        max_message_bytes=int(float(coord.get("max_message_mb", DEFAULT_MAX_MESSAGE_BYTES / 2**20)) * 2**20),
        state_dir=rel(coord["state_dir"]) if "state_dir" in coord else None,
    )


def _budget_left(lookups: Mapping[str, Any]) -> float:
    """The lookups a party's budget has left for this coordinator, by its ``hello`` (its tightest window)."""
    limits, used = lookups.get("limits") or {}, lookups.get("used") or {}
    try:
        return min((float(v) - float(used.get(rule, 0)) for rule, v in limits.items()), default=float("inf"))
    except (TypeError, ValueError):
        return float("inf")


def read_labels(src: LabelSource) -> tuple[np.ndarray, np.ndarray, Task]:
    """The label table as (normalised IDs, labels (class indices or floats), task); rows without a label dropped.

    Read and encoded exactly as :func:`~partialvfl.data.builders.from_tables` reads the active party's label column
    (:mod:`partialvfl.data.labels`): integer labels stay integers (``0``..``9``, never ``0.0``..``9.0``), classes are
    sorted unless ``classes`` lists them, IDs follow the one rule of :mod:`partialvfl.data.ids`.
    """
    where = f"label table {src.path}"
    if not src.path.is_file():
        raise FileNotFoundError(f"label table not found: {src.path}")
    df, _ = read_table(where, src.path, src.id_column)
    ids, _ = table_ids(where, df, src.id_column)
    if src.label_column not in df.columns:
        raise DataValidationError(f"{where}: label column {src.label_column!r} not found; {columns_hint(df)}")
    task = Task.regression() if src.task == "regression" else None
    ids_arr = np.array(ids, dtype=object)
    out_task, y, labeled = encode_labels(df[src.label_column].to_numpy(dtype=object), task, src.classes, ids_arr,
                                         f"{where}, column {src.label_column!r}")
    return ids_arr[labeled], np.asarray(y)[labeled], out_task


class GrpcFederation(Federation):
    """K party processes reached over gRPC with mutual TLS, driven by this (coordinator) process."""

    def __init__(
        self,
        endpoints: Sequence[PartyEndpoint],
        active_party: int,
        tls: TlsFiles,
        *,
        key: bytes | None = None,
        deadline: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        log: MessageLog | None = None,
        allow_absent: bool = False,
        session_file: str | Path | None = None,
        alignment: str = "psu",
    ) -> None:
        transport = GrpcTransport(endpoints, active_party, tls, deadline=deadline,
                                  max_message_bytes=max_message_bytes, log=log)
        super().__init__(transport, [e.name for e in endpoints], active_party)
        self.key = key
        self.sessions = SessionSecrets(session_file)  # what proves this coordinator holds its sessions
        # the tickets under which keyed parties keep a fit's alignment (beside the session secrets)
        self.tickets = AlignmentTickets(Path(session_file).with_name(TICKETS_FILE) if session_file else None)
        self._tickets_with: Path | None = None  # the checkpoint directory holding the tickets (keep_sessions_with)
        self.alignment_mode = alignment
        self.aligner = make_alignment(alignment, transport, self.party_names, key=key, tickets=self.tickets)
        self.allow_absent = allow_absent
        self.absent: set[int] = set()
        self.party_info: dict[int, dict[str, Any]] = {}
        self.config: FederationConfig | None = None
        self.last_held: np.ndarray | None = None
        #: of the last attach_ids: how many users of the parties' tables were not among its IDs (see _unlisted)
        self.last_unlisted: dict[str, Any] = {"users": 0, "parties": {}}
        self._hashes: dict[int, np.ndarray] = {}
        self._table_tokens: dict[str, dict[int, np.ndarray]] = {}  # prediction tables' tokens, per session

    @classmethod
    def from_config(cls, config: FederationConfig | str | Path, *, log: MessageLog | None = None,
                    allow_absent: bool = False, connect: bool = True,
                    session_file: str | Path | None = None) -> GrpcFederation:
        """The federation of a federation file.  ``session_file``: where this coordinator keeps the parties'
        session secrets (default: ``sessions.json`` in ``[coordinator] state_dir``, if given; ``fit`` keeps them
        with its checkpoints), so that a restarted coordinator resumes its sessions."""
        cfg = config if isinstance(config, FederationConfig) else load_federation_config(config)
        key = load_key(cfg.hmac_key_file) if cfg.hmac_key_file is not None else None
        if session_file is None and cfg.state_dir is not None:
            session_file = cfg.state_dir / SESSIONS_FILE
        fed = cls(cfg.parties, cfg.active_party, cfg.tls, key=key, deadline=cfg.deadline,
                  max_message_bytes=cfg.max_message_bytes, log=log, allow_absent=allow_absent,
                  session_file=session_file, alignment=cfg.alignment)
        fed.config = cfg
        if connect:
            try:
                fed.connect()
            except BaseException:
                fed.close()  # bye to the parties whose hello went through: they are not left waiting
                raise
        return fed

    def lane(self, number: int) -> GrpcFederation:
        """This federation through lane ``number`` of its session (:meth:`GrpcTransport.lane`): the same parties,
        session, tokens and their caches, with its own transport (steps, sequence numbers, failures, deadline) and
        its own record of the absent parties.  A lane carries inference requests and ID lookups only; a new session
        (:meth:`connect`) needs new lanes."""
        other = copy.copy(self)
        other.transport = self.grpc_transport.lane(number)
        other.aligner = copy.copy(self.aligner)  # its caches (the tokens looked up) shared, its transport the lane's
        other.aligner.transport = other.transport
        other.absent = set(self.absent)
        return other

    @property
    def grpc_transport(self) -> GrpcTransport:
        assert isinstance(self.transport, GrpcTransport)
        return self.transport

    # ------------------------------------------------------------------ session
    def connect(self) -> dict[int, dict[str, Any]]:
        """Open a session at every party (``hello``) and check each is the party the file says it is."""
        self.transport.new_step()
        requests = {}
        for k, name in enumerate(self.party_names):
            secret = self.sessions.get(name)
            requests[k] = Request("hello", {}, {"resume": secret} if secret else {})
        replies = self.transport.call_many(requests, tolerate=self.allow_absent)
        self.absent = set(range(self.n_parties)) - set(replies)
        self._hashes.clear()
        self._table_tokens.clear()
        self.aligner.reset()
        for k, r in replies.items():
            self.sessions.set(self.party_names[k], r.meta.pop("session_secret", None))
            if r.meta.get("alignment", "hmac") != self.alignment_mode:
                raise AlignmentError(f"party {k} ({self.party_names[k]!r}) aligns with alignment = "
                                     f"{r.meta.get('alignment', 'hmac')!r}, the federation file with "
                                     f"{self.alignment_mode!r}: every file must name the same")
            if r.meta.get("index") != k or r.meta.get("name") != self.party_names[k]:
                raise ValueError(f"the server at {self.grpc_transport.endpoints[k].address} says it is party "
                                 f"{r.meta.get('index')} ({r.meta.get('name')!r}), the federation file says party "
                                 f"{k} ({self.party_names[k]!r})")
            self.party_info[k] = dict(r.meta)
        if hasattr(self.aligner, "remaining"):  # each keyed party's lookup budget left for this coordinator
            self.aligner.remaining = {k: _budget_left(info["lookups"]) for k, info in self.party_info.items()
                                      if isinstance(info.get("lookups"), dict)}
        return self.party_info

    def keep_sessions_with(self, directory: str | Path) -> None:
        """Keep the session secrets and alignment tickets in ``directory`` (a fit's checkpoints) unless the
        federation file's ``[coordinator] state_dir`` keeps them; a restarted coordinator finds them there
        (``fit --resume``)."""
        if self.sessions.path is None:
            self.sessions = SessionSecrets(Path(directory) / SESSIONS_FILE)
            self.tickets = AlignmentTickets(Path(directory) / TICKETS_FILE)
            self._tickets_with = Path(directory)  # kept there only while it holds a checkpoint to resume
            if hasattr(self.aligner, "tickets"):
                self.aligner.tickets = self.tickets

    def close(self) -> None:
        """End the sessions (``bye``: the parties then accept another coordinator at once) and the channels."""
        try:
            self.transport.new_step()
            replies = self.transport.broadcast(self._present(), "bye", tolerate=True)
            if self._tickets_with is not None and not (self._tickets_with / LATEST).exists():
                self.tickets.discard()  # no checkpoint to resume: a fit that stopped early leaves nothing behind
            if len(replies) == len(self._present()):
                self.sessions.forget()
        except Exception as e:  # noqa: BLE001 - closing: a party that refuses or is gone keeps its session
            log.info("bye was not answered by every party (%s): their sessions end at their idle timeout", e)
        finally:
            super().close()

    def rejoin(self, timeout: float, poll: float = 1.0) -> dict[int, dict[str, Any]]:
        """Open a new session and wait (up to ``timeout`` seconds) until every party answers ``hello`` again.

        A party restarted with the same configuration and state directory is then set up again by the fit, which
        loads its last checkpoint there.  Raises the last :class:`PartyUnavailable` after ``timeout``.
        """
        limit = time.monotonic() + max(0.0, timeout)
        self.grpc_transport.new_session()
        while True:
            try:
                return self.connect()
            except PartyUnavailable as e:
                if time.monotonic() >= limit:
                    raise
                log.info("waiting for party %d (%s) to come back: %s", e.party, self.party_names[e.party], e.reason)
                time.sleep(poll)

    def announced_policies(self) -> list[dict[str, Any]]:
        return [dict(self.party_info.get(k, {}).get("policy") or {}) for k in range(self.n_parties)]

    def _present(self) -> list[int]:
        return [k for k in range(self.n_parties) if k not in self.absent]

    @property
    def alignment_id(self) -> str | None:
        """A name under which the parties keep this fit's alignment nonces (so a resumed fit gets the same tokens
        and sample order), if their policy allows; ``None``: fresh tokens every session."""
        return getattr(self.aligner, "alignment_id", None)

    @alignment_id.setter
    def alignment_id(self, value: str | None) -> None:
        if hasattr(self.aligner, "alignment_id"):
            self.aligner.alignment_id = value

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

    def feature_dims(self) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        dims = tuple(int(self.party_info.get(k, {}).get("feature_dim", 0)) for k in range(self.n_parties))
        shapes = tuple(tuple(self.party_info.get(k, {}).get("feature_shape", [d])) for k, d in enumerate(dims))
        return dims, shapes

    def feature_names(self) -> tuple[tuple[str, ...], ...] | None:
        """Every party's column names as its ``hello`` reported them (``None`` unless every party did)."""
        names = [self.party_info.get(k, {}).get("feature_names") for k in range(self.n_parties)]
        if any(n is None for n in names):
            return None
        return tuple(tuple(f"{self.party_names[k]}:{c}" for c in n) for k, n in enumerate(names))

    # ------------------------------------------------------------------ attaching data
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
                    pos = positions_in(order, hashes)
                    at = pos[pos >= 0]
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
        self.last_unlisted = _unlisted(held, order)
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

    def release(self, handle: str) -> None:
        self.transport.new_step()
        self.transport.broadcast(self._present(), "release", tolerate=True, handle=handle)

    # ------------------------------------------------------------------ programs and their state
    def setup(self, program: str, configs: Sequence[dict[str, Any]], seed: int,
              plans: Mapping[int, dict[str, Any]] | None = None) -> None:
        if len(configs) != self.n_parties:
            raise ValueError(f"{len(configs)} configs for {self.n_parties} parties")
        replies = self._setup_at(program, configs, seed, self._present(), tolerate=self.allow_absent, plans=plans)
        self.absent |= set(self._present()) - set(replies)

    def private_parties(self) -> dict[int, dict[str, float]]:
        """The parties whose ``hello`` said they keep a differential-privacy budget (``[policy] dp_epsilon``)."""
        return {k: dict(info["dp"]) for k, info in self.party_info.items() if info.get("dp")}

    @staticmethod
    def party_dir_for(directory: str | Path) -> str:
        """The directory, relative to each party's state directory, where parties keep the state of ``directory``."""
        d = Path(directory).resolve()
        return f"models/{d.name}-{hashlib.sha256(str(d).encode()).hexdigest()[:10]}"

    def preprocess(self, handle: str, *, standardize: bool) -> None:
        self.transport.new_step()
        replies = self.transport.broadcast(self._present(), "preprocess", tolerate=self.allow_absent, data=handle,
                                           standardize=bool(standardize))
        self.absent |= set(self._present()) - set(replies)

    def save(self, directory: str | Path, *, model: str | None = None) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        rel = self.party_dir_for(d)
        # recorded first: if a party fails, the others' files can still be found and deleted (``forget``)
        (d / PARTY_STATES_FILE).write_text(json.dumps({"party_dir": rel, "parties": list(self.party_names)}))
        self.transport.new_step()
        self.transport.broadcast(range(self.n_parties), "save", dir=rel, **model_tag(model))

    @staticmethod
    def saved_party_dir(directory: str | Path) -> str:
        """Where the parties keep the state saved into ``directory`` (as :meth:`save` recorded it)."""
        f = Path(directory) / PARTY_STATES_FILE
        if not f.exists():
            raise FileNotFoundError(f"{directory} has no {PARTY_STATES_FILE}: it was not saved by a gRPC federation")
        return json.loads(f.read_text())["party_dir"]

    def party_dir(self, directory: str | Path) -> str:
        return self.saved_party_dir(directory)

    def forget(self, directory: str | Path) -> bool:
        """Have every party delete its state of ``directory`` (a pruned checkpoint); whether all of them did (an
        unreachable party keeps its file until it is asked again)."""
        try:
            rel = self.saved_party_dir(directory)
        except FileNotFoundError:  # nothing was saved there at the parties
            return True
        self.transport.new_step()
        replies = self.transport.broadcast(range(self.n_parties), "forget", tolerate=True, dir=rel)
        return len(replies) == self.n_parties

    def load(self, directory: str | Path, *, model: str | None = None) -> None:
        rel = self.saved_party_dir(directory)
        self.transport.new_step()
        replies = self.transport.broadcast(self._present(), "load", tolerate=self.allow_absent, dir=rel,
                                           **model_tag(model))
        self.absent |= set(self._present()) - set(replies)


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
