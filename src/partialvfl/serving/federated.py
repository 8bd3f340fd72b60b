"""The prediction service across a federation's party servers (:class:`FederationPredictor`).

One batch = attach the batch's IDs at the parties (under one handle, :data:`HANDLE`, replacing the previous batch)
and predict (the method's any-subset prediction); every call of the batch waits at most until the batch's deadline
(``GrpcTransport.deadline_at``); each ID is looked up once per session (the alignment's token cache).  A party that
has not answered by then is a missing block for the batch; the rest of the batch goes on without it.  Two kinds of
party trouble are told apart:

* *timed out* (``DEADLINE_EXCEEDED``): the party is slow but its session stands; the next batch asks it again, so a
  party that is on time again is used again at once;
* *down* (connection refused, or its process restarted and lost the session): it is left out of the batches until
  its server accepts connections again; then, between two batches, every party gets a new session and the model is
  loaded again (:meth:`FederationPredictor.rejoin_if_back`).

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

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from partialvfl.federation.grpc_federation import GrpcFederation
from partialvfl.federation.transport import PartyUnavailable
from partialvfl.methods.base import VFLMethod
from partialvfl.orchestration.predict import predict_reporting_parties
from partialvfl.serving.predictors import (
    NO_ANSWER,
    OK,
    UNKNOWN,
    BatchOutcome,
    FeatureError,
    _Base,
    counts_only,
    model_version,
)

__all__ = ["FederationPredictor"]

log = logging.getLogger("partialvfl.serve")
#: every batch is attached under this one handle, replacing the previous batch at each party (in order, late or not):
#: no release round per batch, and a late party never holds more than one set of the service's rows
HANDLE = "serve"


class FederationPredictor(_Base):
    """The parties of a federation file, reached from this (label holder's) process.

    ``min_timeout``: once a batch's deadline has passed (a party was late), the parties that are on time still get
    this long for each remaining round of the batch.  ``connect_timeout``: how long a (re)connection waits for a party.
    ``rejoin_timeout``: how long rejoining a returned party may take (a new session at every party, the model loaded
    again and the alignment's tokens computed again: about two seconds for a freshly started party process on this
    project's 2-core machine, during which the batches wait); a party that has not answered by then is tried again
    later.
    """

    def __init__(self, model_dir: str | Path, federation: str | Path, *, min_timeout: float = 0.02,
                 connect_timeout: float = 10.0, rejoin_interval: float = 0.5, rejoin_timeout: float = 5.0) -> None:
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
        self._ready: dict[int, Any] = {}
        self._last_rejoin = 0.0
        self._warm = False
        self._backoff = self.rejoin_interval
        #: seconds an on-time batch takes (exponential average): kept back from the parties' wait under a deadline
        self.reserve = 0.0
        self._open(self.model_dir, self.connect_timeout)

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
        finally:
            self.transport.deadline_at = None
        self.model, self.version, self.model_dir = model, model_version(model_dir), model_dir
        self.down = set(fed.absent)
        self._ready = {}
        self._warm = False
        self.state = {fed.party_names[k]: ("down" if k in self.down else "ok") for k in range(fed.n_parties)}
        self._last_rejoin = time.monotonic()

    def party_names_of(self, k: int) -> str:
        return self.fed.party_names[k]

    def reloaded(self, model_dir: str | Path) -> FederationPredictor:
        """Load another saved model at the same parties (a new session); returns ``self``."""
        self._open(Path(model_dir), self.connect_timeout)
        return self

    def rejoin_if_back(self) -> bool:
        """Join the down parties again once one of them accepts connections (checked at most every
        ``rejoin_interval`` seconds); whether it did."""
        if not self.down or time.monotonic() - self._last_rejoin < self._backoff:
            return False
        channels = self.transport._channels
        back = []
        for k in sorted(self.down):
            fut = self._ready.setdefault(k, grpc.channel_ready_future(channels[k]))
            if fut.done():
                back.append(k)
        if not back:
            return False
        log.info("parties %s accept connections again: a new session", [self.fed.party_names[k] for k in back])
        before = set(self.down)
        self._open(self.model_dir, self.rejoin_timeout)
        # a party that accepts connections but does not answer in time: ask it less and less often (up to 30 s)
        self._backoff = min(30.0, 2 * self._backoff) if self.down & before else self.rejoin_interval
        return True

    def close(self) -> None:
        """End the session at every party that is not down, including one that was late in the last batch (left
        out, it would keep serving this dead session, refusing any other coordinator for its idle timeout)."""
        for fut in self._ready.values():
            fut.cancel()
        self.fed.absent = set(self.down)
        self.transport.deadline_at = time.monotonic() + self.connect_timeout
        try:
            self.fed.release(HANDLE)
        finally:
            self.fed.close()

    # ------------------------------------------------------------------ one batch
    def predict(self, ids: Sequence[str], features: Mapping[str, np.ndarray], deadline: float | None = None
                ) -> BatchOutcome:
        """Predict the (normalised, distinct) ``ids`` within ``deadline`` seconds (``None``: the federation file's)."""
        if features:
            raise FeatureError("features", "feature values can be given with --table only; across a federation "
                                           "the label holder's features live in its own party server")
        self.rejoin_if_back()
        fed, transport = self.fed, self.transport
        transport.failures.clear()  # only this batch's are read
        fed.absent, fed.last_held = set(self.down), None
        warm = self._warm
        if not warm:  # a session's first batch: the parties build their networks lazily, give them time
            deadline = max(deadline or 0.0, self.connect_timeout)
        started = time.monotonic()
        # a party on time can answer in an on-time batch's time; one late in the previous batch gets only what is
        # left of the deadline (at least min_timeout, so that once it is on time again it is used again)
        transport.min_timeout = max(self.min_timeout, self.reserve)
        transport.late_min_timeout = self.min_timeout
        transport.late = {self.fed.party_names.index(p) for p, s in self.state.items() if s == "timed_out"}
        if deadline is not None:  # the rounds after a late party's must still end within the deadline
            transport.deadline_at = started + max(0.0, deadline - self.reserve)
        try:
            view, out, used = self._attach_and_predict(ids)
        finally:
            transport.deadline_at = None
        self._warm = True
        timed_out, failed = self._account(transport.failures)
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
        return BatchOutcome(output, status, parties, timed_out, failed)

    def _attach_and_predict(self, ids: Sequence[str]) -> tuple[Any, np.ndarray, np.ndarray]:
        """Attach and predict; a keyed party late for the ID lookup is avoided and the lookup asked again once."""
        fed, idx = self.fed, self.model.index_
        for attempt in (0, 1):
            try:
                view, handle = fed.attach_ids(list(ids), HANDLE, task=idx.task, feature_dims=idx.feature_dims,
                                              feature_shapes=idx.feature_shapes)
                break
            except PartyUnavailable as e:  # the ID lookup (one keyed party) was not answered
                avoid = getattr(fed.aligner, "avoid", None)
                if attempt or avoid is None:
                    raise
                avoid.add(e.party)
                fed.absent.add(e.party)
                if self.transport.deadline_at is not None:  # the lookup again, with an on-time round's time
                    self.transport.deadline_at = max(self.transport.deadline_at,
                                                     time.monotonic() + self.transport.min_timeout)
        out, used = predict_reporting_parties(self.model, fed, view, handle)
        return view, out, used

    def _account(self, failures: list[tuple[int, int, str]]) -> tuple[list[str], list[str]]:
        """Sort the batch's failures into timed out and failed (down) parties; update :attr:`state`."""
        names = self.fed.party_names
        timed_out, failed = set(), set()
        for _, k, reason in failures:
            (timed_out if reason.startswith("DEADLINE_EXCEEDED") else failed).add(k)
        timed_out -= failed
        self.down |= failed
        for k in range(self.fed.n_parties):
            self.state[names[k]] = ("down" if k in self.down else "timed_out" if k in timed_out else "ok")
        return [names[k] for k in sorted(timed_out)], [names[k] for k in sorted(failed)]
