"""The coordinator's gRPC transport, :class:`GrpcTransport` (its messages framed by :mod:`.frames`).

One gRPC method carries everything, ``/partialvfl.Party/Call`` (a stream of request chunks in, one reply out,
bytes), registered with gRPC's generic handlers so no protoc step is needed.  A request frame travels in chunks of
at most :data:`CHUNK_BYTES` (the first holds the whole header, so the party knows the frame's length before it
allocates anything and reads the rest into one buffer whose tensors it uses in place, :func:`frame_length`,
:func:`decode_request`): a party's memory per request is about the request's size, and gRPC refuses any single
message larger than a chunk.  :class:`GrpcTransport` is a drop-in
:class:`~partialvfl.federation.wire.transport.Transport`: it keeps one mutually-authenticated TLS channel per party,
puts a deadline on every call, issues the requests of ``call_many`` concurrently, and turns a party that is down,
too slow or crashed into :class:`~partialvfl.federation.wire.transport.PartyUnavailable` (so ``tolerate=True`` callers
treat it as missing).  A party that *refuses* a request (bad input, wrong peer, replay) raises :class:`PartyError`.
"""

from __future__ import annotations

import copy
import logging
import secrets
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from partialvfl.federation.grpc.frames import (
    CALL_METHOD,
    CALL_ONE_METHOD,
    CHUNK_BYTES,
    MAX_LANES,
    SECONDS_KEY,
    WireError,
    chunks,
    decode_reply,
    encode_request,
)
from partialvfl.federation.wire.messages import MessageLog, Reply, Request
from partialvfl.federation.wire.transport import PartyUnavailable, Transport

__all__ = ["ATTACH_PREFIX", "DEFAULT_MAX_MESSAGE_BYTES", "CallSpan", "GrpcTransport", "PartyEndpoint", "PartyError",
           "RECONNECT_BACKOFF_MS", "RECONNECT_OPTIONS", "TlsFiles"]

#: the names of an ``attach``'s tensors carried inside another request (:meth:`GrpcTransport.carry_attach`)
ATTACH_PREFIX = "attach."
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: the longest a channel waits between two attempts to reach a party it lost (gRPC's exponential backoff, from 100 ms,
#: capped here instead of at 120 s): a restarted party is reached at most this long after it listens (a prediction
#: service uses it again then), and an attempt at a party that is down costs one refused connection
RECONNECT_BACKOFF_MS = 250
RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS))
# gRPC status codes that mean "the party is not there for this step" (treated as missing) rather than "the party
# said no": down, too slow, or restarted after a crash (its runtime lost this session: FAILED_PRECONDITION)
_UNAVAILABLE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                      grpc.StatusCode.FAILED_PRECONDITION}
log = logging.getLogger("partialvfl.grpc")


class PartyError(RuntimeError):
    """A party answered but refused the request (bad input, unknown kind, peer not allowed, replay, ...)."""

    def __init__(self, party: int, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"party {party} refused the request ({code.name}): {details}")
        self.party = party
        self.code = code
        self.details = details


# ---------------------------------------------------------------------- transport
@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one identity: the CA that signs the federation's certificates, this identity's cert and key."""

    ca: Path
    cert: Path
    key: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        """The CA certificate, certificate and private key as bytes; a missing file is named."""
        out = []
        for what, p in (("CA certificate", self.ca), ("certificate", self.cert), ("private key", self.key)):
            if not Path(p).is_file():
                raise FileNotFoundError(f"TLS {what} not found at {p} (make development ones with "
                                        "`partialvfl certs init DIR --parties ...`)")
            out.append(Path(p).read_bytes())
        return out[0], out[1], out[2]


@dataclass(frozen=True)
class PartyEndpoint:
    """Where a party listens, the identity (certificate CN/SAN) its server must present and, if pinned, the one PEM
    file (the CA that issues its certificate, or the certificate itself) the channel to it trusts."""

    name: str
    address: str
    identity: str
    pin: Path | None = None


@dataclass(frozen=True)
class CallSpan:
    """One call to a party, timed (``time.perf_counter()``): issued at ``start``, its reply (or failure) in at
    ``end``; ``party_seconds``: the party's own handling time (its compute, as it reports it; 0 for a failed call),
    the rest is the wire (framing, TLS, gRPC, the network, scheduling on both sides)."""

    party: int
    kind: str
    step: int
    round: int  # the transport's count of call_many rounds: calls with the same number were issued together
    start: float
    end: float
    party_seconds: float
    ok: bool = True

    @property
    def seconds(self) -> float:
        """The call's wall time."""
        return self.end - self.start

    @property
    def wire_seconds(self) -> float:
        """The part of the call's time not spent computing at the party (the wire and queues)."""
        return max(0.0, self.seconds - self.party_seconds)


class _Caller:
    """A party's two call methods (:data:`CALL_ONE_METHOD` for a request of one chunk, :data:`CALL_METHOD`'s stream
    of chunks for a larger one); a party that does not know the first (an older version) is asked by the second."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.stream = channel.stream_unary(CALL_METHOD)
        self.one: Any = channel.unary_unary(CALL_ONE_METHOD)

    def __call__(self, payload: bytes, timeout: float) -> tuple[bytes, float]:
        """The reply to ``payload``, with the instant it arrived."""
        one = self.one
        if one is not None and len(payload) <= CHUNK_BYTES:
            try:
                return one(payload, timeout=timeout), time.perf_counter()
            except grpc.RpcError as e:  # gRPC's own answer for a method the server lacks (not a party's refusal)
                if e.code() != grpc.StatusCode.UNIMPLEMENTED or e.details() != "Method not found!":
                    raise
                self.one = None
        return self.stream(chunks(payload), timeout=timeout), time.perf_counter()


class GrpcTransport(Transport):
    """A :class:`Transport` over gRPC with mutual TLS: one channel per party, a deadline on every call.

    Its requests go through :meth:`Transport.call_many` (the one admission path: once per round, stamped, logged)
    and are issued concurrently; every reply of a round is awaited before a refusal or a lost party is raised.
    """

    gathers = True

    def __init__(
        self,
        endpoints: Sequence[PartyEndpoint],
        coordinator: int,
        tls: TlsFiles,
        *,
        deadline: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        log: MessageLog | None = None,
    ) -> None:
        super().__init__(len(endpoints), coordinator, log)
        if deadline <= 0:
            raise ValueError(f"deadline must be positive, got {deadline}")
        self.endpoints = list(endpoints)
        self.deadline = float(deadline)
        # a caller with its own time budget (the prediction service: one request's deadline) sets an absolute
        # ``time.monotonic()`` instant here; every call then waits at most until it, but never less than
        # ``min_timeout`` seconds (so the parties that are on time still get a round after one was late)
        self.deadline_at: float | None = None
        self.min_timeout = 0.001
        # parties the caller expects to be late (the service: late in its previous batch) get only
        # ``late_min_timeout`` as their floor, so that waiting for them does not stretch a round past its deadline
        self.late: set[int] = set()
        self.late_min_timeout = 0.001
        #: attaches that travel with a party's next request naming their handle (``meta['data']``) instead of in a
        #: round of their own (:meth:`carry_attach`): party -> the attach request
        self.carried: dict[int, Request] = {}
        self.max_message_bytes = int(max_message_bytes)
        self.session = secrets.token_hex(16)
        self._seq = 0
        self.lane_number = 0  # lane 0: the session's own order (everything); others: lane()
        self._owns_channels = True
        self.bytes_sent = 0  # on-the-wire bytes (frames), both directions counted separately
        self.bytes_received = 0
        self.party_seconds = 0.0  # sum of the parties' handling times (compute at the parties)
        self.wait_seconds = 0.0  # time the coordinator spent waiting for replies
        #: with a list here, every call is timed into it (:class:`CallSpan`: the prediction service's spans)
        self.call_spans: list[CallSpan] | None = None
        self._delivery = 0
        ca, cert, key = tls.read()
        self._channels = []
        self._calls = []
        for ep in self.endpoints:
            root = ca if ep.pin is None else Path(ep.pin).read_bytes()  # a pinned party: only its own anchor
            creds = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=cert)
            options = [
                ("grpc.ssl_target_name_override", ep.identity),
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes),
                *RECONNECT_OPTIONS,
            ]
            ch = grpc.secure_channel(ep.address, creds, options=options)
            self._channels.append(ch)
            self._calls.append(_Caller(ch))
        # call_many runs the parties' blocking calls on these long-lived threads: gRPC's ``.future()`` starts a
        # fresh "channel spin" thread per call, which was about half of a federated step's coordinator time
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.endpoints)), thread_name_prefix="grpc-call")
        #: called with a party that did not answer a request (down, or restarted): ``True`` once the party continues
        #: this session (a restarted party that kept it on disk), and the request is then sent to it again in the
        #: same round (:meth:`GrpcFederation.continue_party`); ``None``: the party is unavailable for the round
        self.on_lost: Callable[[int], bool] | None = None

    def new_session(self) -> str:
        """Start a fresh session (a resumed coordinator): parties reset their replay counters on ``hello``."""
        self.session = secrets.token_hex(16)
        self._seq = 0
        return self.session

    def call_timeout(self, party: int | None = None) -> float:
        """The timeout of a call issued now (to ``party``): :attr:`deadline`, shortened to :attr:`deadline_at` when
        one is set, but at least :attr:`min_timeout` (:attr:`late_min_timeout` for a party in :attr:`late`)."""
        if self.deadline_at is None:
            return self.deadline
        floor = self.late_min_timeout if party in self.late else self.min_timeout
        return min(self.deadline, max(floor, self.deadline_at - time.monotonic()))

    def carry_attach(self, party: int, attach: Request) -> None:
        """Send ``attach`` to ``party`` inside the next request that names its handle as ``data`` (an inference
        request of the same batch), not in a round of its own: the party attaches, then answers that request
        (:data:`ATTACH_PREFIX` names its tensors there, ``meta['attach']`` its metadata).  A later attach for the
        party replaces one not sent yet (it had no request of its batch: it holds none of the batch's rows)."""
        self.carried[party] = attach

    def _with_carried(self, party: int, request: Request) -> Request:
        attach = self.carried.get(party)
        if attach is None or request.meta.get("data") != attach.meta.get("handle"):
            return request
        del self.carried[party]
        tensors = {**request.tensors, **{ATTACH_PREFIX + k: t for k, t in attach.tensors.items()}}
        return Request(request.kind, tensors, {**request.meta, "attach": dict(attach.meta)})

    def _encode(self, request: Request) -> bytes:
        self._seq += 1
        return encode_request(request, step=self.step, round=self.round, session=self.session, seq=self._seq,
                              lane=self.lane_number)

    def lane(self, number: int) -> GrpcTransport:
        """Another lane of this transport's current session: the same channels, its own steps, rounds and sequence
        numbers (a party keeps a lane's order apart from the others'), its own failures and deadline, and its own
        counts-only message log.  Lanes carry inference requests (and ID lookups) only, so that several batches of
        a prediction service can be in flight at once; a new session (:meth:`new_session`) needs new lanes."""
        if not 0 < number < MAX_LANES:
            raise ValueError(f"a lane number is in [1, {MAX_LANES}), got {number}")
        other = copy.copy(self)
        Transport.__init__(other, self.n_parties, self.coordinator, MessageLog(keep_entries=False))
        other.device = self.device
        other.lane_number, other._seq = number, 0
        other.deadline_at, other.late, other.carried, other.on_lost = None, set(), {}, None
        other.bytes_sent = other.bytes_received = 0
        other.party_seconds = other.wait_seconds = 0.0
        other.call_spans = None
        other._pool = ThreadPoolExecutor(max_workers=max(1, len(self.endpoints)),
                                         thread_name_prefix=f"grpc-lane{number}")
        other._owns_channels = False
        return other

    def _result(self, party: int, get: Callable[[], tuple[bytes, float]], req: Request, start: float) -> Reply:
        try:
            data, end = get()
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            if "CERTIFICATE_VERIFY_FAILED" in details:  # the server is not the party this coordinator trusts
                ep = self.endpoints[party]
                trusted = f"its pinned {ep.pin}" if ep.pin is not None else "the CA bundle"
                raise PartyError(party, grpc.StatusCode.UNAUTHENTICATED,
                                 f"the server at {ep.address} presented a certificate for {ep.identity!r} that "
                                 f"{trusted} does not vouch for: not party {ep.name!r} (TLS handshake refused)") \
                    from None
            self._span(party, req, start, time.perf_counter(), 0.0, ok=False)
            if code in _UNAVAILABLE_CODES:
                raise PartyUnavailable(party, f"{code.name}: {details}") from None
            raise PartyError(party, code, details) from None
        self.bytes_received += len(data)
        try:
            reply = decode_reply(data)
        except WireError as e:
            raise PartyError(party, grpc.StatusCode.DATA_LOSS, f"malformed reply: {e}") from None
        seconds = reply.meta.pop(SECONDS_KEY, 0.0)
        seconds = float(seconds) if isinstance(seconds, int | float) else 0.0
        self.party_seconds += seconds
        self._span(party, req, start, end, seconds)
        return reply

    @property
    def seq(self) -> int:
        """The last sequence number this transport (lane) sent."""
        return self._seq

    def wait_ready(self, party: int, timeout: float) -> bool:
        """Whether ``party``'s server accepts connections within ``timeout`` seconds (the channel connects again by
        itself, every :data:`RECONNECT_BACKOFF_MS` at most)."""
        try:
            grpc.channel_ready_future(self._channels[party]).result(timeout=max(0.0, timeout))
            return True
        except grpc.FutureTimeoutError:
            return False

    def side_call(self, party: int, request: Request, timeout: float | None = None) -> Reply:
        """One request to ``party`` outside the rounds' bookkeeping (a ``hello`` that continues the session in the
        middle of a round): stamped with the current step and round and a new sequence number, logged, its reply
        checked as every reply is."""
        req = self._stamp(request)
        self.log.record(step=self.step, round=self.round, sender=self.coordinator, receiver=party, kind=req.kind,
                        direction="request", tensors=req.tensors)
        start = time.perf_counter()
        payload = self._encode(req)
        self.bytes_sent += len(payload)
        reply = self._result(party, lambda: self._calls[party](payload, timeout or self.deadline), req, start)
        return self._answered(party, req, reply)

    def _again(self, party: int, req: Request) -> Reply | None:
        """``req`` sent again to ``party`` once it continues this session (:attr:`on_lost`), or ``None``."""
        if self.on_lost is None or not self.on_lost(party):
            return None
        start = time.perf_counter()
        payload = self._encode(req)
        self.bytes_sent += len(payload)
        return self._result(party, lambda: self._calls[party](payload, self.call_timeout(party)), req, start)

    def _span(self, party: int, req: Request, start: float, end: float, seconds: float, ok: bool = True) -> None:
        if self.call_spans is not None:
            self.call_spans.append(CallSpan(party, req.kind, self.step, self._delivery, start, end, seconds, ok))

    def _deliveries(self, requests: Mapping[int, Request], *, tolerate: bool,
                    gather: bool) -> Generator[tuple[int, Request, Reply | Exception], None, None]:
        """Issue every request at once (one pooled thread per party), then gather the replies in party order; a
        party that did not answer is asked again once it continues the session (:attr:`on_lost`)."""
        futures: dict[int, tuple[Request, Any, float]] = {}
        self._delivery += 1
        for party, req in requests.items():
            req = self._admit(party, self._with_carried(party, req))
            start = time.perf_counter()
            payload = self._encode(req)
            self.bytes_sent += len(payload)
            futures[party] = req, self._pool.submit(self._calls[party], payload, self.call_timeout(party)), start
        t0 = time.perf_counter()
        try:
            for party, (req, fut, start) in futures.items():
                try:
                    try:
                        reply = self._result(party, fut.result, req, start)
                    except PartyUnavailable:
                        again = self._again(party, req)
                        if again is None:
                            raise
                        reply = again
                except PartyUnavailable as e:
                    log.warning("step %d: party %d (%s) unavailable for %r: %s", self.step, party,
                                self.endpoints[party].name, req.kind, e.reason)
                    yield party, req, e
                    continue
                except PartyError as e:
                    yield party, req, e
                    continue
                yield party, req, reply
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Close the channels this transport owns."""
        if self._owns_channels:  # a lane shares its channels with the transport it came from
            for ch in self._channels:
                ch.close()
            self._channels.clear()
        self._pool.shutdown(wait=False)
