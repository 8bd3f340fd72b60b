"""Layer 3: parties and the wire. Everything that crosses between parties goes through a Transport.

Sub-packages by job, each importing only those before it: :mod:`.wire` (messages, declarations, the party-program
contract, transports), :mod:`.dp` (a party's differential privacy), :mod:`.trust` (policy, guards, pins, alignment,
lookups, audit), :mod:`.runtime` (the party runtime, the coordinator's federation, checkpoints) and :mod:`.grpc`
(the deployment over gRPC with mutual TLS).  This face re-exports what a method or a test of one needs,
imported on first use (PEP 562), so that a light sub-module (the privacy mechanisms' declarations,
:mod:`.dp.mechanism`) imports without the runtime and torch."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Federation": "runtime.coordinator", "LocalFederation": "runtime.coordinator", "PartyRuntime": "runtime.party",
    "find_raw_feature_leaks": "trust.audit", "LogEntry": "wire.messages", "MessageLog": "wire.messages",
    "Reply": "wire.messages", "Request": "wire.messages", "PartyProgram": "wire.program",
    "register_program": "wire.program", "MessageError": "wire.schema", "Messages": "wire.schema",
    "MessageSpec": "wire.schema", "TensorSpec": "wire.schema", "tensor_names": "wire.schema",
    "LocalTransport": "wire.transport", "PartyUnavailable": "wire.transport", "Transport": "wire.transport",
    "MetaKey": "wire.meta_keys",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
