"""The coordinator's calls to a party: one unary message for a request of one chunk, the stream of chunks for a
larger one or for a party that only knows the stream (an older version), and a party's own refusal never mistaken
for a missing method (issue 46: the streaming call cost about three times the CPU of a unary one)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from partialvfl.federation.grpc.frames import CALL_METHOD, CHUNK_BYTES, SERVICE_NAME
from partialvfl.federation.grpc.party_process import generic_handler
from partialvfl.federation.grpc.transport import _Caller


class Server:
    """An in-process gRPC server whose handler echoes the request's bytes, counting how each call came."""

    def __init__(self, *, only_stream: bool = False, refuse: bool = False) -> None:
        self.calls: list[int] = []  # the number of chunks of each call

        def echo(chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
            got = list(chunks)
            self.calls.append(len(got))
            if refuse:
                context.abort(grpc.StatusCode.UNIMPLEMENTED, "party 0 ('bank') has no handler for kind 'x'")
            return b"".join(got)

        handler = (grpc.method_handlers_generic_handler(SERVICE_NAME, {
            CALL_METHOD.rsplit("/", 1)[1]: grpc.stream_unary_rpc_method_handler(echo)}) if only_stream
                   else generic_handler(echo))
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        self.server.add_generic_rpc_handlers((handler,))
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")

    def close(self) -> None:
        self.channel.close()
        self.server.stop(None)


def frame(n: int) -> bytes:
    """A payload ``chunks`` can split: an 8-byte header length (0) and ``n`` bytes."""
    return (0).to_bytes(8, "little") + b"x" * n


def test_one_chunk_goes_as_one_message_a_larger_request_as_chunks() -> None:
    server = Server()
    try:
        caller = _Caller(server.channel)
        small, large = frame(100), frame(2 * CHUNK_BYTES)
        assert caller(small, 10)[0] == small and caller(large, 10)[0] == large
        assert server.calls == [1, 3] and caller.one is not None
    finally:
        server.close()


def test_a_party_that_only_knows_the_stream_is_asked_by_the_stream_from_then_on() -> None:
    server = Server(only_stream=True)
    try:
        caller = _Caller(server.channel)
        assert caller(frame(10), 10)[0] == frame(10) and caller(frame(20), 10)[0] == frame(20)
        assert server.calls == [1, 1] and caller.one is None
    finally:
        server.close()


def test_a_partys_own_unimplemented_refusal_is_not_retried() -> None:
    server = Server(refuse=True)
    try:
        caller = _Caller(server.channel)
        with pytest.raises(grpc.RpcError) as e:
            caller(frame(10), 10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "no handler for kind" in e.value.details()
        assert server.calls == [1] and caller.one is not None
    finally:
        server.close()
