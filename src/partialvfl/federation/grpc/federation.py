"""The coordinator's side of a real deployment: :class:`GrpcFederation` (its federation file:
:mod:`.federation_file`; which rows it attaches: :mod:`.federation_rows`).

The coordinator is the active party's label-side role.  It reaches every party's server (the active party's own
feature block included: it runs its own party process) through one :class:`GrpcTransport`, and aligns samples
without a central table: the parties' IDs become per-session tokens of a private set union
(:mod:`partialvfl.federation.grpc.psu_session`; the coordinator's own IDs join through the same protocol, and it can
test no guessed ID offline) or, with the explicit ``alignment = "hmac"``, HMAC hashes; the coordinator builds the
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
coordinator records it in ``party_states.json``.  :meth:`GrpcFederation.continue_party` continues the session at a
party that restarted with it on disk (its alignment, data and program as they were, nothing computed again
elsewhere: :mod:`.party_resume`); :meth:`GrpcFederation.rejoin`, what is left when it cannot, waits for every party to
answer a ``hello`` again, so a fit can continue from its last checkpoint.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.federation.grpc.federation_file import (
    FederationConfig,
    load_federation_config,
)
from partialvfl.federation.grpc.federation_rows import RowAlignment
from partialvfl.federation.grpc.psu_session import AlignmentError, make_alignment
from partialvfl.federation.grpc.sessions import AlignmentTickets, SessionSecrets
from partialvfl.federation.grpc.transport import (
    DEFAULT_MAX_MESSAGE_BYTES,
    GrpcTransport,
    PartyEndpoint,
    PartyError,
    TlsFiles,
)
from partialvfl.federation.runtime.checkpoint import LATEST
from partialvfl.federation.runtime.coordinator import Federation, model_tag
from partialvfl.federation.trust.alignment import load_key
from partialvfl.federation.wire.messages import MessageLog, Request
from partialvfl.federation.wire.transport import PartyUnavailable

__all__ = ["GrpcFederation"]

PARTY_STATES_FILE = "party_states.json"
log = logging.getLogger("partialvfl.federation")

#: where a coordinator keeps its session secrets and the parties' alignment tickets (in its state directory, or with a
#: fit's checkpoints)
SESSIONS_FILE = "sessions.json"
TICKETS_FILE = "alignment-tickets.json"


def _budget_left(lookups: Mapping[str, Any]) -> float:
    """The lookups a party's budget has left for this coordinator, by its ``hello`` (its tightest window)."""
    limits, used = lookups.get("limits") or {}, lookups.get("used") or {}
    try:
        return min((float(v) - float(used.get(rule, 0)) for rule, v in limits.items()), default=float("inf"))
    except (TypeError, ValueError):
        return float("inf")


class GrpcFederation(RowAlignment, Federation):
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
        """The federation's transport, as the gRPC transport it is."""
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
        except Exception as e:  # closing: a party that refuses or is gone keeps its session
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

    def continue_party(self, k: int, timeout: float = 0.0, *, mid_step: bool = False, handles: Sequence[str] = (),
                       lane_seqs: Mapping[int, int] | None = None) -> bool:
        """Continue this session at party ``k`` (restarted with its session on disk, :mod:`.party_resume`): wait up
        to ``timeout`` seconds for its server, then one ``hello`` with the session's secret and ``continue_session``
        (and where each lane's sequence numbers stand).  Whether the party continues it, holding a program (and,
        with ``mid_step``, one that continues a step in progress) and the data sets ``handles``;
        ``False`` leaves the other parties as they are (the caller then opens a new session: :meth:`rejoin`)."""
        name = self.party_names[k]
        secret = self.sessions.get(name)
        transport = self.grpc_transport
        if secret is None or (timeout > 0 and not transport.wait_ready(k, timeout)):
            return False
        meta: dict[str, Any] = {"resume": secret, "continue_session": True}
        if lane_seqs:
            meta["lane_seqs"] = {str(lane): int(seq) for lane, seq in lane_seqs.items()}
        try:
            reply = transport.side_call(k, Request("hello", {}, meta))
        except (PartyUnavailable, PartyError) as e:
            log.info("party %d (%s) did not continue the session: %s", k, name, e)
            return False
        self.sessions.set(name, reply.meta.get("session_secret"))
        holds = reply.meta.get("holds") or {}
        ok = bool(reply.meta.get("continued")) and holds.get("program") is not None \
            and (not mid_step or bool(holds.get("mid_step"))) and set(handles) <= set(holds.get("handles", ()))
        log.info("party %d (%s) %s the session (%s)", k, name, "continues" if ok else "cannot continue", holds)
        if ok:
            self.absent.discard(k)
        return ok

    def announced_policies(self) -> list[dict[str, Any]]:
        """Each party's policy as it announced it in its hello (empty for an absent party)."""
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

    def feature_dims(self) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """Each party's feature width and feature shape, as the parties reported them."""
        dims = tuple(int(self.party_info.get(k, {}).get("feature_dim", 0)) for k in range(self.n_parties))
        shapes = tuple(tuple(self.party_info.get(k, {}).get("feature_shape", [d])) for k, d in enumerate(dims))
        return dims, shapes

    def feature_names(self) -> tuple[tuple[str, ...], ...] | None:
        """Every party's column names as its ``hello`` reported them (``None`` unless every party did)."""
        names = [self.party_info.get(k, {}).get("feature_names") for k in range(self.n_parties)]
        if any(n is None for n in names):
            return None
        return tuple(tuple(f"{self.party_names[k]}:{c}" for c in n) for k, n in enumerate(names))

    # ------------------------------------------------------------------ programs and their state
    def setup(self, program: str, configs: Sequence[dict[str, Any]], seed: int,
              plans: Mapping[int, dict[str, Any]] | None = None) -> None:
        """Set up ``program`` at every party present, each with its config (and privacy plan), from ``seed``."""
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
        """Have every party present fit its own preprocessing on the data attached as ``handle``."""
        self.transport.new_step()
        replies = self.transport.broadcast(self._present(), "preprocess", tolerate=self.allow_absent, data=handle,
                                           standardize=bool(standardize))
        self.absent |= set(self._present()) - set(replies)

    def save(self, directory: str | Path, *, model: str | None = None) -> None:
        """Have every party save its state under ``directory`` (each on its own disk); record where."""
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
        """The directory the parties saved a model in ``directory`` under (relative to their state)."""
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
        """Have every party load the state it saved for the model in ``directory``."""
        rel = self.saved_party_dir(directory)
        self.transport.new_step()
        replies = self.transport.broadcast(self._present(), "load", tolerate=self.allow_absent, dir=rel,
                                           **model_tag(model))
        self.absent |= set(self._present()) - set(replies)
