"""What a party receives and what it sends, recorded in process by wrapping its runtime (nothing on the wire changes).

:class:`Recorder` wraps the :class:`~partialvfl.federation.runtime.party.PartyRuntime` objects of a
:class:`~partialvfl.federation.runtime.coordinator.LocalFederation`: every request a party is handed (what a curious
*party* sees) and every reply it answers (what a curious *coordinator* sees, after the party's own privacy
mechanisms) is kept as numpy copies, in order, with its step, round, kind and metadata.  The in-process batched
path checks each request and reply through the same runtime, so it is recorded too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partialvfl.federation.runtime.coordinator import LocalFederation
from partialvfl.federation.wire.messages import Reply, Request

__all__ = ["Recorded", "Recorder"]


@dataclass
class Recorded:
    """One message at a party: ``direction`` ``"request"`` (received) or ``"reply"`` (sent), its kind, step, round,
    tensors (numpy copies) and metadata (a request's)."""

    direction: str
    kind: str
    step: int
    round: int
    tensors: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)


class Recorder:
    """Records the messages of ``parties`` (default: all) of ``federation``; ``kinds`` limits which kinds are kept
    (default: every program kind; the runtime's built-ins are never kept)."""

    def __init__(self, federation: LocalFederation, parties: Iterable[int] | None = None,
                 kinds: Iterable[str] | None = None) -> None:
        self.federation = federation
        self.kinds = None if kinds is None else set(kinds)
        self.messages: dict[int, list[Recorded]] = {}
        for k in (range(federation.n_parties) if parties is None else parties):
            self.messages[k] = []
            self._wrap(k)

    def _keep(self, party: int, kind: str) -> bool:
        rt = self.federation.runtimes[party]
        return kind not in rt.builtins and (self.kinds is None or kind in self.kinds)

    def _add(self, party: int, direction: str, kind: str, request: Request, tensors: dict[str, Any]) -> None:
        meta = dict(request.meta)
        self.messages[party].append(Recorded(
            direction, kind, int(meta.pop("step", -1)), int(meta.pop("round", -1)),
            {n: t.detach().cpu().numpy().copy() for n, t in tensors.items()}, meta if direction == "request" else {}))

    def _wrap(self, party: int) -> None:
        rt = self.federation.runtimes[party]
        handle: Callable[..., Reply] = rt.handle
        check: Callable[..., Request] = rt.check

        def recording_handle(request: Request, accepted: Callable[[], None] | None = None, **kw: Any) -> Reply:
            reply = handle(request, accepted, **kw)  # kw: the runtime's own options (reply_device), passed through
            if self._keep(party, request.kind):
                self._add(party, "request", request.kind, request, request.tensors)
                self._add(party, "reply", request.kind, request, reply.tensors)
            return reply

        def recording_check(request: Request, reply: Reply | None = None) -> Request:
            admitted = check(request, reply)  # the request as the party's program gets it (gradients clipped)
            if self._keep(party, request.kind):
                if reply is None:
                    self._add(party, "request", request.kind, admitted, admitted.tensors)
                else:
                    self._add(party, "reply", request.kind, request, reply.tensors)
            return admitted

        rt.handle = recording_handle  # type: ignore[method-assign]
        rt.check = recording_check  # type: ignore[method-assign]

    def received(self, party: int) -> list[Recorded]:
        """The requests ``party`` was handed, in order."""
        return [m for m in self.messages[party] if m.direction == "request"]

    def sent(self, party: int) -> list[Recorded]:
        """The replies ``party`` answered (what the coordinator received from it), in order."""
        return [m for m in self.messages[party] if m.direction == "reply"]

    def exchanges(self, party: int) -> list[tuple[Recorded, Recorded]]:
        """(request, reply) pairs of ``party``, in order."""
        out, pending = [], None
        for m in self.messages[party]:
            if m.direction == "request":
                pending = m
            elif pending is not None and pending.kind == m.kind:
                out.append((pending, m))
                pending = None
        return out
