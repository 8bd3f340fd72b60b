"""Where a batch's time goes: the service queue, the coordinator, each party's compute and the wire.

:class:`BatchTiming` is what the batcher and the predictor record of one micro-batch (``time.perf_counter()``
instants): when each of its requests arrived, when the batch started and ended, and each call to a party
(:class:`~partialvfl.federation.grpc.transport.CallSpan`, timed by the transport; the party reports its own handling
time in the reply).  :meth:`BatchTiming.parts` splits the batch along its critical path: in each round (the calls
issued together) the slowest call counts, its party's compute as ``party_compute`` and the rest of it as ``wire``
(framing, TLS, gRPC, the network, the scheduling of both sides); what is not inside a round is ``coordinator`` (the
model's own computation at the label holder and the batch's bookkeeping: ID lookup, attach, answers).  The three add
up to the batch.  The service exports them as Prometheus histograms (:mod:`partialvfl.serving.metrics`) and, opt in,
as OpenTelemetry spans (:mod:`partialvfl.serving.tracing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BatchTiming", "PARTS"]

#: the parts of a batch, in the order they are reported
PARTS = ("coordinator", "party_compute", "wire")


@dataclass
class BatchTiming:
    """One batch's instants (``time.perf_counter()``) and its calls to parties."""

    arrivals: Sequence[float]
    started: float
    ended: float = 0.0
    calls: list[Any] = field(default_factory=list)  # CallSpan
    lane: int = 0

    @property
    def seconds(self) -> float:
        """The batch's wall time, from its start to its end."""
        return max(0.0, self.ended - self.started)

    def queue(self) -> list[float]:
        """Each request's wait in the service's queue (arrival to its batch's start)."""
        return [max(0.0, self.started - a) for a in self.arrivals]

    def rounds(self) -> list[list[Any]]:
        """The calls grouped by round (issued together), in order."""
        by: dict[tuple[int, int], list[Any]] = {}
        for c in self.calls:
            by.setdefault((c.step, c.round), []).append(c)
        return [by[k] for k in sorted(by, key=lambda k: min(c.start for c in by[k]))]

    def parts(self) -> dict[str, float]:
        """``coordinator``, ``party_compute`` and ``wire`` seconds along the critical path (they add up to the
        batch)."""
        compute = wire = inside = 0.0
        for calls in self.rounds():
            start, end = min(c.start for c in calls), max(c.end for c in calls)
            slowest = max(calls, key=lambda c: c.end)
            own = min(slowest.party_seconds, slowest.seconds)
            compute += own
            wire += (end - start) - own
            inside += end - start
        return {"coordinator": max(0.0, self.seconds - inside), "party_compute": compute, "wire": wire}

    def per_party(self, names: Sequence[str]) -> dict[str, dict[str, float]]:
        """Each party's compute and wire seconds in this batch (all its calls)."""
        out: dict[str, dict[str, float]] = {}
        for c in self.calls:
            d = out.setdefault(names[c.party], {"compute": 0.0, "wire": 0.0})
            d["compute"] += c.party_seconds
            d["wire"] += c.wire_seconds
        return out
