"""Layer 3: parties and the wire. Everything that crosses between parties goes through a Transport.

Sub-packages by job, each importing only those before it: :mod:`.wire` (messages, declarations, the party-program
contract, transports), :mod:`.dp` (a party's differential privacy), :mod:`.trust` (policy, guards, pins, alignment,
lookups, audit), :mod:`.runtime` (the party runtime, the coordinator's federation, checkpoints) and :mod:`.grpc`
(the deployment over gRPC with mutual TLS).  This face re-exports what a method or a test of one needs."""

from partialvfl.federation.runtime.coordinator import Federation, LocalFederation
from partialvfl.federation.runtime.party import PartyRuntime
from partialvfl.federation.trust.audit import find_raw_feature_leaks
from partialvfl.federation.wire.messages import LogEntry, MessageLog, Reply, Request
from partialvfl.federation.wire.meta_keys import MetaKey
from partialvfl.federation.wire.program import PartyProgram, register_program
from partialvfl.federation.wire.schema import MessageError, Messages, MessageSpec, TensorSpec, tensor_names
from partialvfl.federation.wire.transport import LocalTransport, PartyUnavailable, Transport

__all__ = [
    "Federation", "LocalFederation", "LocalTransport", "LogEntry", "MessageError", "MessageLog", "MessageSpec",
    "Messages", "MetaKey", "PartyProgram", "PartyRuntime", "PartyUnavailable", "Reply", "Request", "TensorSpec",
    "Transport", "find_raw_feature_leaks", "register_program", "tensor_names",
]
