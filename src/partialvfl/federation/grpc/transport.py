"""The gRPC wire: message framing (safetensors, never pickle) and :class:`GrpcTransport`.

Every message is one safetensors blob: the named tensors plus, in the safetensors metadata, a small JSON header
(``kind``, ``meta``, ``step``, ``round``, ``session``, ``seq`` for a request; ``meta`` for a reply).  Nothing is
unpickled and nothing executable crosses: a malformed blob is a :class:`WireError`, never code.

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
import json
import logging
import math
import re
import secrets
import struct
import sys
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from partialvfl.federation.wire.messages import MessageLog, Reply, Request, TensorDict
from partialvfl.federation.wire.transport import PartyUnavailable, Transport
from partialvfl.utils.devices import host
from partialvfl.utils.jsonable import json_default

__all__ = [
    "ALLOWED_DTYPES", "ATTACH_PREFIX", "CALL_METHOD", "CHUNK_BYTES", "DEFAULT_MAX_MESSAGE_BYTES", "GrpcTransport",
    "MAX_LANES", "MAX_WIRE_MESSAGE", "PartyEndpoint", "RECONNECT_BACKOFF_MS", "RECONNECT_OPTIONS",
    "PartyError", "TlsFiles", "WireError", "chunks", "decode_reply", "decode_request", "encode_reply",
    "encode_request", "frame_length",
]

CALL_METHOD = "/partialvfl.Party/Call"
SECONDS_KEY = "_party_seconds"  # reply meta: the party's handling time (the transport removes it, keeps the sum)
SERVICE_NAME = "partialvfl.Party"
#: the names of an ``attach``'s tensors carried inside another request (:meth:`GrpcTransport.carry_attach`)
ATTACH_PREFIX = "attach."
#: lanes of one session (:meth:`GrpcTransport.lane`): lane 0 carries everything, the others inference only
MAX_LANES = 16
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: the longest a channel waits between two attempts to reach a party it lost (gRPC's exponential backoff, from 100 ms,
#: capped here instead of at 120 s): a restarted party is reached at most this long after it listens (a prediction
#: service uses it again then), and an attempt at a party that is down costs one refused connection
RECONNECT_BACKOFF_MS = 250
RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS))
MAX_HEADER_BYTES = 1 << 20
#: the pieces a request frame travels in (the first one holds the whole header, at most 1 MiB): small pieces keep
#: what gRPC and Python buffer per request small next to the request itself
CHUNK_BYTES = 512 << 10
#: the largest single wire message a party accepts (the first chunk with the largest header)
MAX_WIRE_MESSAGE = 8 + MAX_HEADER_BYTES + CHUNK_BYTES
#: how deep a header's JSON may nest (a setup config is a few levels deep): a deeper one is refused before any code
#: walks it recursively (a 40 KB config nested 20,000 deep once reached the party's handler as a RecursionError)
MAX_NESTING = 64
_TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
                 "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8, "BOOL": torch.bool}
KIND_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./-]{0,63}$")
# safetensors dtype codes accepted on the wire (everything a method sends: floats, indices, masks, hashes)
ALLOWED_DTYPES = {"F16", "BF16", "F32", "F64", "I32", "I64", "U8", "BOOL"}
# gRPC status codes that mean "the party is not there for this step" (treated as missing) rather than "the party
# said no": down, too slow, or restarted after a crash (its runtime lost this session: FAILED_PRECONDITION)
_UNAVAILABLE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                      grpc.StatusCode.FAILED_PRECONDITION}
log = logging.getLogger("partialvfl.grpc")


class WireError(ValueError):
    """A message that is not a well-formed partialvfl frame (the receiver refuses it with INVALID_ARGUMENT)."""


class PartyError(RuntimeError):
    """A party answered but refused the request (bad input, unknown kind, peer not allowed, replay, ...)."""

    def __init__(self, party: int, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"party {party} refused the request ({code.name}): {details}")
        self.party = party
        self.code = code
        self.details = details


# ---------------------------------------------------------------------- framing
def _frame(tensors: Mapping[str, torch.Tensor], header: dict[str, Any]) -> bytes:
    clean: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"message tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.is_sparse:
            raise TypeError(f"message tensor {name!r} is sparse; send it dense")
        clean[name] = host(t).contiguous()  # the wire carries CPU tensors, whatever device a side computes on
    return st_save(clean, metadata={"partialvfl": json.dumps(header, default=json_default)})


def _table(data: bytes | bytearray) -> tuple[int, dict[str, Any]]:
    """The safetensors header of a frame (whose first bytes ``data`` are): its length and its JSON table."""
    if len(data) < 8:
        raise WireError(f"message of {len(data)} bytes is too short to be a safetensors frame")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise WireError(f"frame header length {n} is out of bounds for a {len(data)}-byte message")
    table = _json(bytes(data[8:8 + n]), "frame header")
    if not isinstance(table, dict):
        raise WireError("frame header is not a JSON object")
    return n, table


def _nesting(value: Any) -> int:
    """How deep ``value`` (parsed JSON) nests containers, counted without recursion (a scalar: 0)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, depth)
            if depth <= MAX_NESTING:  # deeper than the limit is refused anyway: no need to walk further
                todo.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _json(text: bytes | str, what: str) -> Any:
    """``text`` parsed as JSON, refused (:class:`WireError`, one line) if it is not JSON or nests deeper than
    :data:`MAX_NESTING` levels."""
    try:
        value = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"{what} is not JSON: {e}") from None
    except RecursionError:  # the JSON decoder recurses per level: far too deep
        raise WireError(f"{what} nests deeper than {MAX_NESTING} levels") from None
    if _nesting(value) > MAX_NESTING:
        raise WireError(f"{what} nests deeper than {MAX_NESTING} levels")
    return value


def _spans(table: Mapping[str, Any]) -> list[tuple[int, int, str, torch.dtype, list[int]]]:
    """Every tensor's byte range, dtype and shape, checked: sizes that match, ranges that do not overlap."""
    spans = []
    for name, info in table.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if dtype not in ALLOWED_DTYPES:
            raise WireError(f"tensor {name!r} has dtype {dtype!r}; allowed: {', '.join(sorted(ALLOWED_DTYPES))}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(v, int) and v >= 0 for v in shape)
                and isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(v, int) and v >= 0 for v in offsets) and offsets[0] <= offsets[1]):
            raise WireError(f"tensor {name!r} has a malformed shape or byte range")
        t = _TORCH_DTYPES[dtype]
        size = math.prod(shape) * torch.empty(0, dtype=t).element_size()
        if offsets[1] - offsets[0] != size:
            raise WireError(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype}")
        spans.append((offsets[0], offsets[1], name, t, shape))
    spans.sort()
    for (_, end, a, *_), (begin, _, b, *_) in zip(spans, spans[1:]):
        if begin < end:
            raise WireError(f"tensors {a!r} and {b!r} overlap")
    return spans


def frame_length(first: bytes | bytearray) -> int:
    """The length of the whole frame whose first chunk (holding the whole header) is ``first``."""
    n, table = _table(first)
    spans = _spans(table)
    return 8 + n + (spans[-1][1] if spans else 0)


def chunks(payload: bytes, size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """``payload`` in pieces of at most ``size`` bytes, the first one holding the whole header."""
    first = max(size, 8 + struct.unpack("<Q", payload[:8])[0]) if len(payload) >= 8 else size
    yield payload[:first]
    for start in range(first, len(payload), size):
        yield payload[start:start + size]


def _in_place(data: bytearray, base: int, spans: list[tuple[int, int, str, torch.dtype, list[int]]]) -> TensorDict:
    """The tensors as views of ``data`` (no copy; ``data`` is the request's own buffer)."""
    out: TensorDict = {}
    for begin, end, name, dtype, shape in spans:
        size = torch.empty(0, dtype=dtype).element_size()
        numel = (end - begin) // size
        if numel == 0:
            t = torch.empty(shape, dtype=dtype)
        elif (base + begin) % size == 0 and sys.byteorder == "little":
            t = torch.frombuffer(data, dtype=dtype, count=numel, offset=base + begin).view(shape)
        else:  # unaligned (not what safetensors writes): copy this one
            t = torch.frombuffer(bytearray(data[base + begin:base + end]), dtype=dtype).view(shape)
        if dtype == torch.bool and bool((t.view(torch.uint8) > 1).any()):
            raise WireError(f"tensor {name!r} holds bytes that are not booleans")
        out[name] = t
    return out


def _unframe(data: bytes | bytearray, max_bytes: int | None = None) -> tuple[dict[str, Any], TensorDict]:
    """Parse and check a frame *before* building any tensor; then load the tensors (no pickle): as views of
    ``data`` when it is a ``bytearray`` (a request assembled by the party), else copied by safetensors."""
    if max_bytes is not None and len(data) > max_bytes:
        raise WireError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    n, table = _table(data)
    meta = table.pop("__metadata__", None)
    if not isinstance(meta, dict) or "partialvfl" not in meta:
        raise WireError("frame carries no partialvfl header")
    if not isinstance(meta["partialvfl"], str):
        raise WireError("partialvfl header is not JSON text")
    header = _json(meta["partialvfl"], "partialvfl header")
    if not isinstance(header, dict):
        raise WireError("partialvfl header is not a JSON object")
    spans = _spans(table)
    if 8 + n + (spans[-1][1] if spans else 0) != len(data):
        raise WireError(f"the frame's header describes {8 + n + (spans[-1][1] if spans else 0)} bytes, the message "
                        f"has {len(data)}")
    if isinstance(data, bytearray):
        return header, _in_place(data, 8 + n, spans)
    try:
        tensors = st_load(data)
    except (SafetensorError, RuntimeError, ValueError) as e:
        raise WireError(f"tensor payload is malformed: {e}") from None
    return header, tensors


def encode_request(request: Request, *, step: int, round: int, session: str, seq: int, lane: int = 0) -> bytes:
    """One request as bytes: tensors plus the header ``kind``/``meta``/``step``/``round``/``session``/``seq`` (and
    ``lane``, when not 0: :meth:`GrpcTransport.lane`)."""
    header = {"kind": request.kind, "meta": request.meta, "step": int(step), "round": int(round),
              "session": session, "seq": int(seq), **({"lane": int(lane)} if lane else {})}
    return _frame(request.tensors, header)


@dataclass(frozen=True)
class WireRequest:
    """A decoded request with its stamps."""

    request: Request
    step: int
    round: int
    session: str
    seq: int
    lane: int = 0


def decode_request(data: bytes | bytearray, max_bytes: int | None = None) -> WireRequest:
    """Parse a request frame; raises :class:`WireError` naming what is wrong.  From a ``bytearray`` the tensors are
    views of it (the party assembled the request there; nothing is copied)."""
    header, tensors = _unframe(data, max_bytes)
    kind = header.get("kind")
    if not isinstance(kind, str) or not KIND_PATTERN.match(kind):
        raise WireError(f"message kind {kind!r} is not a valid kind name")
    meta = header.get("meta", {})
    if not isinstance(meta, dict):
        raise WireError("message meta must be a JSON object")
    stamps = {}
    for key in ("step", "round", "seq"):
        v = header.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise WireError(f"message {key} must be a non-negative integer, got {v!r}")
        stamps[key] = v
    session = header.get("session")
    if not isinstance(session, str) or not 0 < len(session) <= 64:
        raise WireError("message carries no session identifier")
    lane = header.get("lane", 0)
    if not isinstance(lane, int) or isinstance(lane, bool) or not 0 <= lane < MAX_LANES:
        raise WireError(f"message lane must be an integer in [0, {MAX_LANES}), got {lane!r}")
    meta = {**meta, "step": stamps["step"], "round": stamps["round"]}
    return WireRequest(Request(kind, tensors, meta), stamps["step"], stamps["round"], session, stamps["seq"], lane)


def encode_reply(reply: Reply) -> bytes:
    return _frame(reply.tensors, {"meta": reply.meta})


def decode_reply(data: bytes) -> Reply:
    header, tensors = _unframe(data)
    meta = header.get("meta", {})
    if not isinstance(meta, dict):
        raise WireError("reply meta must be a JSON object")
    return Reply(tensors, meta)


# ---------------------------------------------------------------------- transport
@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one identity: the CA that signs the federation's certificates, this identity's cert and key."""

    ca: Path
    cert: Path
    key: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
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
            self._calls.append(ch.stream_unary(CALL_METHOD))
        # call_many runs the parties' blocking calls on these long-lived threads: gRPC's ``.future()`` starts a
        # fresh "channel spin" thread per call, which was about half of a federated step's coordinator time
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.endpoints)), thread_name_prefix="grpc-call")

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
        other.deadline_at, other.late, other.carried = None, set(), {}
        other.bytes_sent = other.bytes_received = 0
        other.party_seconds = other.wait_seconds = 0.0
        other._pool = ThreadPoolExecutor(max_workers=max(1, len(self.endpoints)),
                                         thread_name_prefix=f"grpc-lane{number}")
        other._owns_channels = False
        return other

    def _result(self, party: int, get: Callable[[], bytes]) -> Reply:
        try:
            data = get()
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            if "CERTIFICATE_VERIFY_FAILED" in details:  # the server is not the party this coordinator trusts
                ep = self.endpoints[party]
                trusted = f"its pinned {ep.pin}" if ep.pin is not None else "the CA bundle"
                raise PartyError(party, grpc.StatusCode.UNAUTHENTICATED,
                                 f"the server at {ep.address} presented a certificate for {ep.identity!r} that "
                                 f"{trusted} does not vouch for: not party {ep.name!r} (TLS handshake refused)") \
                    from None
            if code in _UNAVAILABLE_CODES:
                raise PartyUnavailable(party, f"{code.name}: {details}") from None
            raise PartyError(party, code, details) from None
        self.bytes_received += len(data)
        try:
            reply = decode_reply(data)
        except WireError as e:
            raise PartyError(party, grpc.StatusCode.DATA_LOSS, f"malformed reply: {e}") from None
        seconds = reply.meta.pop(SECONDS_KEY, 0.0)
        self.party_seconds += float(seconds) if isinstance(seconds, int | float) else 0.0
        return reply

    def _deliveries(self, requests: Mapping[int, Request], *, tolerate: bool,
                    gather: bool) -> Generator[tuple[int, Request, Reply | Exception], None, None]:
        """Issue every request at once (one pooled thread per party), then gather the replies in party order."""
        futures: dict[int, tuple[Request, Any]] = {}
        for party, req in requests.items():
            req = self._admit(party, self._with_carried(party, req))
            payload = self._encode(req)
            self.bytes_sent += len(payload)
            futures[party] = req, self._pool.submit(self._calls[party], chunks(payload),
                                                    timeout=self.call_timeout(party))
        t0 = time.perf_counter()
        try:
            for party, (req, fut) in futures.items():
                try:
                    reply = self._result(party, fut.result)
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
        if self._owns_channels:  # a lane shares its channels with the transport it came from
            for ch in self._channels:
                ch.close()
            self._channels.clear()
        self._pool.shutdown(wait=False)
