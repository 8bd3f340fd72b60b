"""The gRPC wire format: message framing (safetensors, never pickle) and the one service method.

Every message is one safetensors blob: the named tensors plus, in the safetensors metadata, a small JSON header
(``kind``, ``meta``, ``step``, ``round``, ``session``, ``seq`` for a request; ``meta`` for a reply).  Nothing is
unpickled and nothing executable crosses: a malformed blob is a :class:`WireError`, never code.  A request frame
travels in chunks of at most :data:`CHUNK_BYTES`, the first holding the whole header (:func:`frame_length`), so a
party reads it into one buffer whose tensors it uses in place (:func:`decode_request`).
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from partialvfl.federation.wire.messages import Reply, Request, TensorDict
from partialvfl.utils.devices import host
from partialvfl.utils.jsonable import json_default

__all__ = ["ALLOWED_DTYPES", "CALL_METHOD", "CALL_ONE_METHOD", "CHUNK_BYTES", "MAX_LANES", "MAX_WIRE_MESSAGE",
           "SECONDS_KEY", "SERVICE_NAME", "WireError", "WireRequest", "chunks", "decode_reply", "decode_request",
           "encode_reply", "encode_request", "frame_length"]

CALL_METHOD = "/partialvfl.Party/Call"
#: the same call for a request of one chunk, as one message (unary): gRPC's streaming call starts a thread per call
#: to feed the request's chunks, which measured about three times the CPU of a unary call of the same bytes
CALL_ONE_METHOD = "/partialvfl.Party/CallOne"
SECONDS_KEY = "_party_seconds"  # reply meta: the party's handling time (the transport removes it, keeps the sum)
SERVICE_NAME = "partialvfl.Party"
#: lanes of one session (:meth:`~partialvfl.federation.grpc.transport.GrpcTransport.lane`): lane 0 carries
#: everything, the others inference only
MAX_LANES = 16
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


class WireError(ValueError):
    """A message that is not a well-formed partialvfl frame (the receiver refuses it with INVALID_ARGUMENT)."""


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
    """A reply as one frame: its tensors (safetensors) and its metadata (JSON)."""
    return _frame(reply.tensors, {"meta": reply.meta})


def decode_reply(data: bytes) -> Reply:
    """The reply in a frame written by :func:`encode_reply` (malformed metadata is a ``WireError``)."""
    header, tensors = _unframe(data)
    meta = header.get("meta", {})
    if not isinstance(meta, dict):
        raise WireError("reply meta must be a JSON object")
    return Reply(tensors, meta)
