"""The prediction service across a federation's party servers (:class:`FederationPredictor`).

One batch = attach the batch's IDs at the parties (under one handle, :data:`HANDLE`, replacing the previous batch;
each ID from the first of the served prediction table sets that holds it at a party, else from its training table)
and predict (the method's any-subset prediction); the attach travels with each party's first prediction request of
the batch (:meth:`~partialvfl.federation.grpc.transport.GrpcTransport.carry_attach`), so a split-network method
(IDs in, representations out) takes one round per batch; every call of the batch waits at most until the batch's
deadline (``GrpcTransport.deadline_at``); each ID is looked up once per session (the alignment's token cache).  A
party that has not answered by then is a missing block for the batch; the rest of the batch goes on without it.  Two
kinds of party trouble are told apart:

* *timed out* (``DEADLINE_EXCEEDED``): the party is slow but its session stands; the batches that follow go without
  it at once (not asked), except one per :attr:`FederationPredictor.late_probe_interval` (1 s), which asks it and
  waits for it as usual, so a party that is on time again is used again within that interval, and a late party holds
  at most one batch per interval;
* *down* (connection refused, or its process restarted): it is left out of the batches until its server accepts
  connections again; then, between two batches, it continues the session if it restarted with it on disk (one
  ``hello`` to it alone: its tokens, data and model as they were), else every party gets a new session and the model
  is loaded again (:meth:`FederationPredictor.rejoin_if_back`).  The return is noticed by the party's channel itself
  (a ready future set when it is marked down; the channel tries to connect every
  :data:`~partialvfl.federation.grpc.transport.RECONNECT_BACKOFF_MS` at most), so the rejoin follows the party's
  listening, not a poll period.

The deadline bounds the whole batch, not only the wait: the parties are waited for until the deadline less the
time an on-time batch takes (a running average of a session's batches after its first, which takes seconds while
the parties build their networks: :attr:`FederationPredictor.reserve`), so the rounds that follow a
late party still end within it; every call still gets at least ``min_timeout`` or an on-time batch's time, whichever
is longer (a deadline shorter than an on-time batch cannot be kept, and the parties that are on time must still be
able to answer on a busy machine), except a party that was late in the previous batch: it gets what is left of the
deadline, at least ``min_timeout`` (so that once it is on time again it is used again at once).  The ID lookup (one
keyed party) is asked again at another keyed party, with at least that much time again, when the first one was
late: a batch whose IDs could not be looked up would fail.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from partialvfl.federation.grpc.federation import GrpcFederation
from partialvfl.federation.grpc.frames import MAX_LANES
from partialvfl.federation.wire.transport import PartyUnavailable
from partialvfl.methods.base import VFLMethod
from partialvfl.orchestration.explain import explain_across
from partialvfl.orchestration.predict import predict_reporting_parties
from partialvfl.serving.predictors import (
    NO_ANSWER,
    OK,
    UNKNOWN,
    BatchOutcome,
    ExplainOutcome,
    FeatureError,
    _Base,
    counts_only,
    ess_fields,
    model_version,
)

__all__ = ["FederationPredictor"]

log = logging.getLogger("partialvfl.serve")
#: every batch is attached under this one handle, replacing the previous batch at each party (in order, late or not):
#: no release round per batch, and a late party never holds more than one set of the service's rows
HANDLE = "serve"


@dataclass
class _Lane:
    """One batch in flight: the federation seen through one lane of the session, the model bound to it, the handle
    its batches are attached under (each replacing the lane's previous batch at the parties)."""

    fed: GrpcFederation
    model: Any
    handle: str
    warm: bool = False  # its first batch done (the parties build their networks at a session's first request)


class FederationPredictor(_Base):
    """The parties of a federation file, reached from this (label holder's) process.

    ``min_timeout``: once a batch's deadline has passed (a party was late), the parties that are on time still get
    this long for each remaining round of the batch.  ``connect_timeout``: how long a (re)connection waits for a party.
    ``rejoin_timeout``: how long rejoining a returned party may take (a new session at every party, the model loaded
    again and the alignment's tokens computed again, during which the batches wait); a party that has not answered by
    then is tried again after ``rejoin_interval`` seconds, then twice as long each time (up to 30 s).  A rejoin that
    worked is followed by no other for ``rejoin_interval`` seconds (a party that fails at once is not rejoined at
    every batch); the first rejoin after a party went down waits for nothing but the party.
    """

    def __init__(self, model_dir: str | Path, federation: str | Path, *, min_timeout: float = 0.02,
                 connect_timeout: float = 10.0, rejoin_interval: float = 0.5, rejoin_timeout: float = 5.0,
                 table_sets: Sequence[str] | None = None, lanes: int = 1, late_probe_interval: float = 1.0) -> None:
        if not 1 <= lanes < MAX_LANES:
            raise ValueError(f"batches in flight: between 1 and {MAX_LANES - 1}, got {lanes}")
        #: batches in flight at once (the service runs one batch thread per lane; lane 0 is the session's own)
        self.lanes = int(lanes)
        self._lanes: list[_Lane] = []
        self.fed = GrpcFederation.from_config(federation, allow_absent=True, connect=False, log=counts_only())
        self.transport = self.fed.grpc_transport
        self.min_timeout = float(min_timeout)
        self.transport.min_timeout = self.min_timeout
        if hasattr(self.fed.aligner, "cache_tokens"):  # each ID looked up once per session, not once per request
            self.fed.aligner.cache_tokens = True
        self.connect_timeout = float(connect_timeout)
        self.rejoin_interval = float(rejoin_interval)
        self.rejoin_timeout = float(rejoin_timeout)
        self.model_dir = Path(model_dir)
        self.down: set[int] = set()
        self.state: dict[str, str] = {}
        #: each down party's channel-ready future (done once its server accepts connections again)
        self._ready: dict[int, grpc.Future] = {}
        self._watching = threading.Lock()
        self._one_batch = threading.Lock()  # the batches of a method that cannot have several in flight
        #: a party late in its last batch is asked (and waited for) by one batch per this many seconds; the batches
        #: between go without it at once, so a late party holds at most one batch per interval
        self.late_probe_interval = float(late_probe_interval)
        self._probe_at = 0.0
        self._retry_at = 0.0  # no rejoin before this (time.monotonic()): after a rejoin, see rejoin_interval
        self._backoff = self.rejoin_interval
        self._announced = False
        #: seconds an on-time batch takes (exponential average): kept back from the parties' wait under a deadline
        self.reserve = 0.0
        #: the prediction table sets asked for (``None``: every set the parties serve, as of each session)
        self.requested_sets = None if table_sets is None else list(dict.fromkeys(table_sets))
        #: the sets this session serves, looked up before the training tables, in this order
        self.table_sets: list[str] = []
        try:
            self._open(self.model_dir, self.connect_timeout)
        except BaseException:
            self.fed.close()  # bye to the parties that said hello: they are not left serving a dead session
            raise

    # ------------------------------------------------------------------ sessions
    def _open(self, model_dir: Path, timeout: float) -> None:
        """A new session at every party (those that answer within ``timeout`` seconds) and the model loaded."""
        fed = self.fed
        self.transport.new_session()
        self.transport.deadline_at = time.monotonic() + timeout
        try:
            fed.connect()
            if fed.active_party in fed.absent:
                log.warning("the active party %r did not answer: predicting without its features",
                            self.party_names_of(fed.active_party))
            model = VFLMethod.load(model_dir, federation=fed)
            self.down = set(fed.absent)
            self._choose_table_sets()
            self._tokens_of_the_tables()
        finally:
            self.transport.deadline_at = None
        self.model, self.version, self.model_dir = model, model_version(model_dir), model_dir
        self.down = set(fed.absent)
        for fut in self._ready.values():
            fut.cancel()
        self._ready = {}
        self._watch()
        self.state = {fed.party_names[k]: ("down" if k in self.down else "ok") for k in range(fed.n_parties)}
        for old in self._lanes[1:]:
            old.fed.grpc_transport.close()
        self._lanes = [_Lane(fed, model, HANDLE)]
        for number in range(1, self.lanes):  # the same session, parties and tokens; its own order and handle
            lane_fed = fed.lane(number)
            lane_model = copy.copy(model)
            lane_model.federation_ = lane_fed
            self._lanes.append(_Lane(lane_fed, lane_model, f"{HANDLE}-{number}"))

    def _tokens_of_the_tables(self) -> None:
        """Every party's tokens of its training table and of the served prediction tables, asked when the session
        opens (on lane 0: the other lanes carry only inference requests and lookups of the requests' IDs)."""
        fed = self.fed
        fed.party_hashes()
        for t in self.table_sets:
            fed.table_hashes(t)

    def _choose_table_sets(self) -> None:
        """The prediction table sets this session serves: those asked for (each must be served by a party that
        answered), or every set the parties serve; said in the log."""
        fed = self.fed
        served = fed.served_table_sets()
        if self.requested_sets is not None:
            unknown = [t for t in self.requested_sets if t not in served]
            if unknown and not self.down:
                raise ValueError(f"--table-set {unknown[0]!r}: no party serves a prediction table of that name; "
                                 f"they serve {served or 'none'} ([[data.predict]] in their party files)")
            sets = [t for t in self.requested_sets if t in served]
        else:
            sets = served
        if sets != self.table_sets or not self._announced:
            holders = {t: [f"{fed.party_names[k]} ({fed.party_info[k]['tables'][t]} rows)" for k in sorted(
                fed.party_info) if k not in self.down and t in fed.party_info[k].get("tables", {})] for t in sets}
            log.info("serving the users of the parties' training tables and of the prediction table sets %s%s",
                     sets or "(none)", "".join(f"; {t}: {', '.join(h)}" for t, h in holders.items()))
            self._announced = True
        self.table_sets = sets

    def check_features(self, features: Mapping[str, Mapping[str, Any]], ids: Sequence[str]
                       ) -> dict[str, np.ndarray]:
        """As in process (:meth:`_Base.check_features`); refused at once if the active party's own server does not
        accept feature values from this service."""
        out = super().check_features(features, ids)
        if out and not self.accepts_features():
            raise FeatureError("features", self._features_refused())
        return out

    def _features_refused(self) -> str:
        party = self.party_names[self.active_party]
        return (f"party {party!r} (the label holder's own party server) does not accept feature values from the "
                "service: set [policy] accept_coordinator_features = true in its party file")

    def accepts_features(self) -> bool:
        """Whether the active party's own party server accepts feature values from this coordinator (its policy,
        as its ``hello`` announced it)."""
        info = self.fed.party_info.get(self.active_party, {})
        return bool((info.get("policy") or {}).get("accept_coordinator_features"))

    def party_names_of(self, k: int) -> str:
        """The name of party ``k`` in the federation file's order."""
        return self.fed.party_names[k]

    def reloaded(self, model_dir: str | Path) -> FederationPredictor:
        """Load another saved model at the same parties (a new session); returns ``self``."""
        self._open(Path(model_dir), self.connect_timeout)
        return self

    def due(self) -> bool:
        """Whether a down party accepts connections again: the service then runs :meth:`maintain` between two
        batches."""
        return bool(self._back())

    def _watch(self) -> None:
        """Watch the channel of each down party: its ready future is done as soon as the party's server accepts
        connections again (the channel retries on its own, every ``RECONNECT_BACKOFF_MS`` at most)."""
        channels = self.transport._channels
        with self._watching:  # the lanes' batch threads account their failures side by side
            for k in self.down - set(self._ready):
                self._ready[k] = grpc.channel_ready_future(channels[k])

    def _back(self) -> list[int]:
        """The down parties whose servers accept connections again (none before :attr:`_retry_at`)."""
        if not self.down or time.monotonic() < self._retry_at:
            return []
        self._watch()
        ready = dict(self._ready)
        return [k for k in sorted(self.down) if k in ready and ready[k].done()]

    def maintain(self) -> None:
        """The upkeep between batches (no batch in flight): join the down parties that came back."""
        self.rejoin_if_back()

    def rejoin_if_back(self) -> bool:
        """Join the down parties again once one of them accepts connections (checked at most every
        ``rejoin_interval`` seconds); whether it did.  No batch may be in flight (the service calls it through
        :meth:`maintain`, between batches)."""
        back = self._back()
        if not back:
            return False
        if self._continue(back):
            return True
        log.info("parties %s accept connections again: a new session", [self.fed.party_names[k] for k in back])
        before = set(self.down)
        self._open(self.model_dir, self.rejoin_timeout)
        # a party that accepts connections but does not answer in time: ask it less and less often (up to 30 s)
        self._backoff = min(30.0, 2 * self._backoff) if self.down & before else self.rejoin_interval
        self._retry_at = time.monotonic() + self._backoff
        return True

    def _continue(self, back: list[int]) -> bool:
        """The returned parties continue this session (each restarted with it on disk); whether all did (else the
        caller opens a new one)."""
        fed = self.fed
        lanes = {ln.fed.grpc_transport.lane_number: ln.fed.grpc_transport.seq for ln in self._lanes[1:]}
        fed.transport.new_step()
        if not all(fed.continue_party(k, lane_seqs=lanes) for k in back):
            return False
        for k in back:
            self.down.discard(k)
            fut = self._ready.pop(k, None)
            if fut is not None:
                fut.cancel()
            self.state[fed.party_names[k]] = "ok"
        log.info("parties %s continue the session", [fed.party_names[k] for k in back])
        return True

    def close(self) -> None:
        """End the session at every party that is not down, including one that was late in the last batch (left
        out, it would keep serving this dead session, refusing any other coordinator for its idle timeout)."""
        for fut in self._ready.values():
            fut.cancel()
        self.fed.absent = set(self.down)
        self.transport.deadline_at = time.monotonic() + self.connect_timeout
        try:
            for lane in self._lanes or [_Lane(self.fed, None, HANDLE)]:
                self.fed.release(lane.handle)
        finally:
            for lane in self._lanes[1:]:
                lane.fed.grpc_transport.close()
            self.fed.close()

    # ------------------------------------------------------------------ one batch
    def predict(self, ids: Sequence[str], features: Mapping[str, np.ndarray], deadline: float | None = None,
                lane: int = 0) -> BatchOutcome:
        """Predict the (normalised, distinct) ``ids`` within ``deadline`` seconds (``None``: the federation file's)
        on ``lane`` (each lane one batch at a time; the lanes side by side), or, for a method whose parties keep
        state between inference rounds (``parallel_inference`` false: FALSE-VFL), one batch at a time on lane 0."""
        if getattr(self.model, "parallel_inference", False):
            return self._predict(ids, features, deadline, lane)
        with self._one_batch:
            return self._predict(ids, features, deadline, 0)

    def _predict(self, ids: Sequence[str], features: Mapping[str, np.ndarray], deadline: float | None,
                 lane: int) -> BatchOutcome:
        if features and not self.accepts_features():  # a reload may have brought another policy
            raise FeatureError("features", self._features_refused())
        ln = self._lanes[lane]
        fed, transport = ln.fed, ln.fed.grpc_transport
        transport.failures.clear()  # only this batch's are read
        transport.call_spans = calls = []  # the batch's calls, timed (the service's spans)
        skipped = self._skipped_late()
        fed.absent, fed.last_held = set(self.down) | skipped, None
        warm = ln.warm
        if not warm:  # a lane's first batch: the parties build their networks lazily, give them time
            deadline = max(deadline or 0.0, self.connect_timeout)
        started = time.monotonic()
        # a party on time can answer in an on-time batch's time; one late in the previous batch gets only what is
        # left of the deadline (at least min_timeout, so that once it is on time again it is used again)
        transport.min_timeout = max(self.min_timeout, self.reserve)
        transport.late_min_timeout = self.min_timeout
        transport.late = {fed.party_names.index(p) for p, s in self.state.items() if s == "timed_out"}
        if deadline is not None:  # the rounds after a late party's must still end within the deadline
            transport.deadline_at = started + max(0.0, deadline - self.reserve)
        diagnostics: dict[str, np.ndarray] = {}
        try:
            out, used = self._attach_and_predict(ln, ids, features, diagnostics)
        finally:
            transport.deadline_at = None
        ln.warm = True
        timed_out, failed = self._account(transport.failures, skipped)
        if warm and not (timed_out or failed):  # a session's first batch (seconds) says nothing of the next ones
            took = time.monotonic() - started
            self.reserve = took if self.reserve == 0.0 else 0.8 * self.reserve + 0.2 * took
        avoid = getattr(fed.aligner, "avoid", None)
        if avoid is not None:  # the next ID lookups go to a keyed party that was on time and is not down
            avoid.clear()
            avoid.update(fed.party_names.index(p) for p in timed_out)
            avoid.update(self.down)
        held = fed.last_held
        names = fed.party_names
        status, output, parties = {}, {}, {}
        for i, key in enumerate(ids):
            ok = bool(used[i].any())
            holders = held is None or held[i].any()  # not known when the lookup itself was late
            status[key] = OK if ok else (NO_ANSWER if holders and (timed_out or failed) else UNKNOWN)
            output[key] = out[i] if ok else None
            parties[key] = [names[k] for k in np.flatnonzero(used[i])]
        return BatchOutcome(output, status, parties, timed_out, failed, calls=calls,
                            **ess_fields(ln.model, diagnostics))

    def _attach_and_predict(self, ln: _Lane, ids: Sequence[str], features: Mapping[str, np.ndarray],
                            diagnostics: dict[str, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Attach (each ID from the first of the table sets, then the training tables, that holds it at a party;
        the active party's own ``features`` sent to it) and predict on lane ``ln``; a keyed party late for the ID
        lookup is avoided and the lookup asked again once."""
        fed, idx = ln.fed, ln.model.index_
        transport = fed.grpc_transport
        given = {i: features[key] for i, key in enumerate(ids) if key in features}
        for attempt in (0, 1):
            try:
                view, handle = fed.attach_ids(list(ids), ln.handle, task=idx.task, feature_dims=idx.feature_dims,
                                              feature_shapes=idx.feature_shapes, tables=[*self.table_sets, None],
                                              features=given, carry=True)
                break
            except PartyUnavailable as e:  # the ID lookup (one keyed party) was not answered
                avoid = getattr(fed.aligner, "avoid", None)
                if attempt or avoid is None:
                    raise
                avoid.add(e.party)
                fed.absent.add(e.party)
                if transport.deadline_at is not None:  # the lookup again, with an on-time round's time
                    transport.deadline_at = max(transport.deadline_at, time.monotonic() + transport.min_timeout)
        return predict_reporting_parties(ln.model, fed, view, handle, diagnostics=diagnostics)

    def explain(self, ids: Sequence[str], features: Mapping[str, np.ndarray], **options: Any) -> ExplainOutcome:
        """Each party's contribution to the predictions of ``ids`` on lane 0, with no batch in flight (the service
        runs it between batches), over the parties that answer (the down ones missing from every coalition); a party
        failing during it fails the explanation (:func:`~partialvfl.orchestration.explain.explain_across`)."""
        if features and not self.accepts_features():
            raise FeatureError("features", self._features_refused())
        ln = self._lanes[0]
        fed, idx = ln.fed, ln.model.index_
        fed.grpc_transport.failures.clear()
        fed.absent = set(self.down)
        given = {i: features[key] for i, key in enumerate(ids) if key in features}
        view, handle = fed.attach_ids(list(ids), ln.handle, task=idx.task, feature_dims=idx.feature_dims,
                                      feature_shapes=idx.feature_shapes, tables=[*self.table_sets, None],
                                      features=given)
        try:
            explanation = explain_across(ln.model, view, handle, **options)
        finally:
            self._account(fed.grpc_transport.failures)  # a party that failed is down from now on
        held = explanation.parties.any(axis=1)
        return ExplainOutcome(explanation, {key: i for i, key in enumerate(ids) if held[i]},
                              [fed.party_names[k] for k in sorted(fed.absent)])

    def _skipped_late(self) -> set[int]:
        """The parties late in their last batch that this batch goes without, not asked (none when it is time to
        probe them again: once per :attr:`late_probe_interval`, a batch asks and waits for them as usual)."""
        names = self.fed.party_names
        late = {names.index(p) for p, s in self.state.items() if s == "timed_out"} - self.down
        now = time.monotonic()
        if not late or now >= self._probe_at:
            self._probe_at = now + self.late_probe_interval
            return set()
        return late

    def _account(self, failures: list[tuple[int, int, str]], skipped: Set[int] = frozenset()
                 ) -> tuple[list[str], list[str]]:
        """Sort the batch's failures into timed out and failed (down) parties (a late party the batch went
        without, ``skipped``, stays timed out); update :attr:`state`."""
        names = self.fed.party_names
        timed_out, failed = set(skipped), set()
        for _, k, reason in failures:
            (timed_out if reason.startswith("DEADLINE_EXCEEDED") else failed).add(k)
        timed_out -= failed
        self.down |= failed
        self._watch()  # from now on: its channel says when it is back
        for k in range(self.fed.n_parties):
            self.state[names[k]] = ("down" if k in self.down else "timed_out" if k in timed_out else "ok")
        return [names[k] for k in sorted(timed_out)], [names[k] for k in sorted(failed)]
