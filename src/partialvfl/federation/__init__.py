"""Layer 3: parties and the wire. Everything that crosses between parties goes through a Transport."""

from partialvfl.federation.audit import find_raw_feature_leaks
from partialvfl.federation.coordinator import Federation, LocalFederation
from partialvfl.federation.messages import LogEntry, MessageLog, Reply, Request
from partialvfl.federation.party import PartyProgram, PartyRuntime, register_program
from partialvfl.federation.schema import MessageError, Messages, MessageSpec, TensorSpec, tensor_names
from partialvfl.federation.transport import LocalTransport, PartyUnavailable, Transport

__all__ = [
    "Federation", "LocalFederation", "LocalTransport", "LogEntry", "MessageError", "MessageLog", "MessageSpec",
    "Messages", "PartyProgram", "PartyRuntime", "PartyUnavailable", "Reply", "Request", "TensorSpec", "Transport",
    "find_raw_feature_leaks", "register_program", "tensor_names",
]
