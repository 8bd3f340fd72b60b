"""The gRPC wire: message framing (safetensors, never pickle) and :class:`GrpcTransport`.

Every message is one safetensors blob: the named tensors plus, in the safetensors metadata, a small JSON header
(``kind``, ``meta``, ``step``, ``round``, ``session``, ``seq`` for a request; ``meta`` for a reply).  Nothing is
unpickled and nothing executable crosses: a malformed blob is a :class:`WireError`, never code.

One gRPC method carries everything, ``/partialvfl.Party/Call`` (unary, bytes in and out), registered with gRPC's
generic handlers so no protoc step is needed.  :class:`GrpcTransport` is a drop-in
:class:`~partialvfl.federation.transport.Transport`: it keeps one mutually-authenticated TLS channel per party,
puts a deadline on every call, issues the requests of ``call_many`` concurrently, and turns a party that is down,
too slow or crashed into :class:`~partialvfl.federation.transport.PartyUnavailable` (so ``tolerate=True`` callers
treat it as missing).  A party that *refuses* a request (bad input, wrong peer, replay) raises :class:`PartyError`.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import struct
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from partialvfl.federation.messages import MessageLog, Reply, Request, TensorDict
from partialvfl.federation.transport import PartyUnavailable, Transport
from partialvfl.utils.devices import host
from partialvfl.utils.jsonable import json_default

__all__ = [
    "ALLOWED_DTYPES", "CALL_METHOD", "DEFAULT_MAX_MESSAGE_BYTES", "GrpcTransport", "PartyEndpoint", "PartyError",
    "TlsFiles", "WireError", "decode_reply", "decode_request", "encode_reply", "encode_request",
]

CALL_METHOD = "/partialvfl.Party/Call"
SECONDS_KEY = "_party_seconds"  # reply meta: the party's handling time (the transport removes it, keeps the sum)
SERVICE_NAME = "partialvfl.Party"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_HEADER_BYTES = 1 << 20
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


def _unframe(data: bytes, max_bytes: int | None = None) -> tuple[dict[str, Any], TensorDict]:
    """Parse and check a frame *before* building any tensor; then load the tensors (copying, no pickle)."""
    if max_bytes is not None and len(data) > max_bytes:
        raise WireError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    if len(data) < 8:
        raise WireError(f"message of {len(data)} bytes is too short to be a safetensors frame")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise WireError(f"frame header length {n} is out of bounds for a {len(data)}-byte message")
    try:
        table = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"frame header is not JSON: {e}") from None
    if not isinstance(table, dict):
        raise WireError("frame header is not a JSON object")
    meta = table.pop("__metadata__", None)
    if not isinstance(meta, dict) or "partialvfl" not in meta:
        raise WireError("frame carries no partialvfl header")
    try:
        header = json.loads(meta["partialvfl"])
    except (TypeError, json.JSONDecodeError) as e:
        raise WireError(f"partialvfl header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise WireError("partialvfl header is not a JSON object")
    for name, info in table.items():
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if dtype not in ALLOWED_DTYPES:
            raise WireError(f"tensor {name!r} has dtype {dtype!r}; allowed: {', '.join(sorted(ALLOWED_DTYPES))}")
    try:
        tensors = st_load(data)
    except (SafetensorError, RuntimeError, ValueError) as e:
        raise WireError(f"tensor payload is malformed: {e}") from None
    return header, tensors


def encode_request(request: Request, *, step: int, round: int, session: str, seq: int) -> bytes:
    """One request as bytes: tensors plus the header ``kind``/``meta``/``step``/``round``/``session``/``seq``."""
    header = {"kind": request.kind, "meta": request.meta, "step": int(step), "round": int(round),
              "session": session, "seq": int(seq)}
    return _frame(request.tensors, header)


@dataclass(frozen=True)
class WireRequest:
    """A decoded request with its stamps."""

    request: Request
    step: int
    round: int
    session: str
    seq: int


def decode_request(data: bytes, max_bytes: int | None = None) -> WireRequest:
    """Parse a request frame; raises :class:`WireError` naming what is wrong."""
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
    meta = {**meta, "step": stamps["step"], "round": stamps["round"]}
    return WireRequest(Request(kind, tensors, meta), stamps["step"], stamps["round"], session, stamps["seq"])


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
    """Where a party listens and the identity (certificate CN/SAN) its server must present."""

    name: str
    address: str
    identity: str


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
        self.max_message_bytes = int(max_message_bytes)
        self.session = secrets.token_hex(16)
        self._seq = 0
        self.bytes_sent = 0  # on-the-wire bytes (frames), both directions counted separately
        self.bytes_received = 0
        self.party_seconds = 0.0  # sum of the parties' handling times (compute at the parties)
        self.wait_seconds = 0.0  # time the coordinator spent waiting for replies
        ca, cert, key = tls.read()
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        self._channels = []
        self._calls = []
        for ep in self.endpoints:
            options = [
                ("grpc.ssl_target_name_override", ep.identity),
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ]
            ch = grpc.secure_channel(ep.address, creds, options=options)
            self._channels.append(ch)
            self._calls.append(ch.unary_unary(CALL_METHOD))
        # call_many runs the parties' blocking calls on these long-lived threads: gRPC's ``.future()`` starts a
        # fresh "channel spin" thread per call, which was about half of a federated step's coordinator time
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.endpoints)), thread_name_prefix="grpc-call")

    def new_session(self) -> str:
        """Start a fresh session (a resumed coordinator): parties reset their replay counters on ``hello``."""
        self.session = secrets.token_hex(16)
        self._seq = 0
        return self.session

    def _encode(self, request: Request) -> bytes:
        self._seq += 1
        return encode_request(request, step=self.step, round=self.round, session=self.session, seq=self._seq)

    def _result(self, party: int, get: Callable[[], bytes]) -> Reply:
        try:
            data = get()
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
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
            req = self._admit(party, req)
            payload = self._encode(req)
            self.bytes_sent += len(payload)
            futures[party] = req, self._pool.submit(self._calls[party], payload, timeout=self.deadline)
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
        for ch in self._channels:
            ch.close()
        self._channels.clear()
        self._pool.shutdown(wait=False)
