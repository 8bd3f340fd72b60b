"""A party server's bounds per peer: calls in flight and request bytes held, for allowlisted peers too.

gRPC itself bounds the calls served at once (``[party] max_concurrent_rpcs``) and the size of one wire message (a
chunk, :data:`~partialvfl.federation.grpc.frames.CHUNK_BYTES`).  :class:`PeerLimits` adds, per peer certificate
name, at most ``[policy] max_peer_rpcs`` calls in flight (more are refused with ``RESOURCE_EXHAUSTED`` before their
bodies are read) and at most ``[policy] max_peer_mb`` of request frames held at once (a request that would exceed it
waits, up to its deadline, for the peer's earlier requests to finish; one larger than the budget is refused at once).
:func:`read_request` reads a request's chunks into one buffer of the length its header states, refused beyond
``max_request_mb`` before anything is allocated: a party's memory for one peer stays about ``max_peer_mb``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc

from partialvfl.federation.grpc.frames import WireError, frame_length

__all__ = ["PeerLimits", "Refused", "read_request"]

_MB = 2**20
#: how long a request waits for the peer's budget when its call has no deadline
_NO_DEADLINE_WAIT = 60.0


class Refused(Exception):
    """A request the server refuses with a given gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PeerLimits:
    """Calls in flight and request bytes held, per peer (its certificate name)."""

    def __init__(self, max_calls: int, max_bytes: int) -> None:
        self.max_calls = max(1, int(max_calls))
        self.max_bytes = int(max_bytes)
        self._cond = threading.Condition()
        self.calls: dict[str, int] = {}
        self.held: dict[str, int] = {}

    @contextmanager
    def call(self, peer: str) -> Iterator[None]:
        """One call of ``peer`` in flight (refused beyond ``max_calls``)."""
        with self._cond:
            if self.calls.get(peer, 0) >= self.max_calls:
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"peer {peer!r} has {self.calls[peer]} calls in flight at this party; at most "
                              f"{self.max_calls} ([policy] max_peer_rpcs)")
            self.calls[peer] = self.calls.get(peer, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self.calls[peer] -= 1

    @contextmanager
    def bytes(self, peer: str, size: int, wait: float | None) -> Iterator[None]:
        """Hold ``size`` request bytes for ``peer``: waits up to ``wait`` seconds for its budget."""
        if size > self.max_bytes:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"a request of {size / _MB:.1f} MB is more than peer {peer!r} may have this party hold "
                          f"({self.max_bytes / _MB:g} MB, [policy] max_peer_mb)")
        with self._cond:
            ok = self._cond.wait_for(lambda: self.held.get(peer, 0) + size <= self.max_bytes,
                                     timeout=_NO_DEADLINE_WAIT if wait is None else max(0.0, wait))
            if not ok:
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"peer {peer!r} has {self.held.get(peer, 0) / _MB:.1f} MB of requests held at this "
                              f"party; one more of {size / _MB:.1f} MB would exceed {self.max_bytes / _MB:g} MB "
                              "([policy] max_peer_mb)")
            self.held[peer] = self.held.get(peer, 0) + size
        try:
            yield
        finally:
            with self._cond:
                self.held[peer] -= size
                self._cond.notify_all()


def read_request(requests: Iterator[bytes], max_bytes: int, hold: Callable[[int], object]) -> bytearray:
    """A request's frame from its chunks: one buffer of the length the first chunk's header states.

    ``hold(size)`` is called once the size is known and before the buffer is allocated (it reserves the peer's
    budget and may raise :class:`Refused`).  Raises :class:`Refused` for a request larger than ``max_bytes``
    (``RESOURCE_EXHAUSTED``), missing, or whose chunks do not add up to its header (``INVALID_ARGUMENT``).
    """
    first = next(requests, None)
    if first is None:
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      "no request arrived (larger than the party's size limit, or cancelled)")
    try:
        total = frame_length(first)
    except WireError as e:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"malformed message: {e}") from None
    if total > max_bytes:
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"request of {total} bytes exceeds the party's limit of {max_bytes} ([policy] max_request_mb)")
    if len(first) > total:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"malformed message: {len(first)} bytes, its header describes {total}")
    hold(total)
    buf = bytearray(total)
    buf[:len(first)] = first
    pos = len(first)
    for chunk in requests:
        if pos + len(chunk) > total:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"malformed message: more than the {total} bytes its header describes")
        buf[pos:pos + len(chunk)] = chunk
        pos += len(chunk)
    if pos != total:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"malformed message: {pos} of the {total} bytes its header describes arrived")
    return buf
