"""The party process: start its gRPC server (``serve``) and run it until a signal (``run``, what
``partialvfl party serve --config FILE`` does).

The server answers over mutual TLS with the one-method service of :mod:`partialvfl.federation.grpc.transport`, its
requests handled by :class:`~partialvfl.federation.grpc.party.PartyServer`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import grpc
import torch

from partialvfl.federation.grpc.frames import CALL_METHOD, CALL_ONE_METHOD, MAX_WIRE_MESSAGE, SERVICE_NAME
from partialvfl.federation.grpc.party import PartyServer
from partialvfl.federation.grpc.party_config import PartyConfig, load_party_config
from partialvfl.federation.trust.lookups import SPANS

__all__ = ["EXIT_WITH_PARENT_ENV", "exit_now", "generic_handler", "import_plugins", "run", "serve"]

log = logging.getLogger("partialvfl.party")
EXIT_WITH_PARENT_ENV = "PARTIALVFL_EXIT_WITH_PARENT"
#: how long a stopping party lets calls in flight finish before it cancels them (SIGTERM: out within a second)
STOP_GRACE_SECONDS = 0.25
#: how often the serving loop wakes up (to see a stop request or a vanished parent)
STOP_POLL_SECONDS = 0.1


def generic_handler(fn: Callable[[Iterator[bytes], grpc.ServicerContext], bytes]) -> grpc.GenericRpcHandler:
    """The service, bytes in and out (no protoc): one handler behind two methods.

    ``Call`` is stream-unary, so the handler runs when the call starts and checks the peer before it reads the body
    (a request of several chunks); ``CallOne`` carries a request of one chunk as one message (gRPC reads it, at most
    :data:`~partialvfl.federation.grpc.frames.MAX_WIRE_MESSAGE` bytes, before the handler checks the peer), at a
    third of the streaming call's CPU.
    """
    stream, one = CALL_METHOD.rsplit("/", 1)[1], CALL_ONE_METHOD.rsplit("/", 1)[1]
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        stream: grpc.stream_unary_rpc_method_handler(fn),
        one: grpc.unary_unary_rpc_method_handler(lambda request, context: fn(iter((request,)), context))})


def import_plugins(cfg: PartyConfig) -> None:
    """Import the party's plugin modules (party programs outside the package), naming any that fails."""
    failed = []
    for name in cfg.plugins:
        try:
            importlib.import_module(name)
        except Exception as e:  # report every broken plugin at once
            log.warning("could not import %s: %s", name, e)
            failed.append(name)
    if failed:
        raise ImportError(f"party {cfg.name!r}: plugin module(s) {failed} failed")


def serve(cfg: PartyConfig) -> tuple[grpc.Server, int, PartyServer]:
    """Start the party's server (not blocking); returns the server, its bound port and the handler.

    The party runs the programs registered in :data:`~partialvfl.federation.wire.program.PROGRAMS` when a ``setup``
    arrives (and its policy agrees): those its caller registered before (``partialvfl party serve`` registers every
    method's) and those of the plugin modules in ``cfg.plugins``, imported here.  An address already in use is an
    error (:class:`OSError`): the port is never shared with another process (``SO_REUSEPORT`` off).
    """
    torch.set_num_threads(max(1, cfg.threads))
    import_plugins(cfg)
    handler = PartyServer(cfg)
    ca, cert, key = cfg.tls.read()
    creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    server = grpc.server(
        handler.workers,
        handlers=[generic_handler(handler.handle_stream)],
        options=[("grpc.max_receive_message_length", min(cfg.max_message_bytes, MAX_WIRE_MESSAGE)),  # a chunk
                 ("grpc.max_send_message_length", cfg.max_message_bytes),
                 ("grpc.so_reuseport", 0), ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1 << 20)],
        maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
    )
    try:
        port = server.add_secure_port(cfg.address, creds)
    except RuntimeError:
        port = 0
    if port == 0:
        handler.close()
        raise OSError(f"party {cfg.name!r}: cannot listen on {cfg.address}: the address is in use (is another "
                      "party serving there?) or not an address of this host")
    server.start()
    if cfg.port_file is not None:
        cfg.port_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cfg.port_file.with_suffix(".tmp")
        tmp.write_text(f"{port}\n")
        os.replace(tmp, cfg.port_file)
    log.info("party %d (%s) serving %d rows on port %d; %s", cfg.index, cfg.name, len(handler.table.ids), port,
             cfg.policy.describe())
    if cfg.alignment == "hmac":
        log.warning("party %s aligns with the shared HMAC key (alignment = 'hmac'): whoever holds the key can test "
                    "any ID it can enumerate against this party's hashes; for one trust domain only", cfg.name)
    else:
        log.info("party %s aligns by private set union (%s)", cfg.name, "holds the passive parties' alignment key"
                 if handler.aligner.keyed else "no alignment key: its tokens come through a keyed party")
        if handler.aligner.keyed:
            limits = handler.lookups.limits
            log.info("party %s answers at most %s per coordinator (its lookup budget, kept in %s)", cfg.name,
                     ", ".join(f"{v:,} lookups {SPANS[k]}" for k, v in limits.items()) or "any number of lookups",
                     handler.lookups.path)
    if cfg.policy.seed == "coordinator":
        log.warning("party %s builds its parameters from the coordinator's seed ([policy] seed = 'coordinator'): "
                    "for research only, a coordinator knowing the initial weights can invert embeddings", cfg.name)
    return server, port, handler


def run(config: str | Path | PartyConfig) -> int:
    """Serve until SIGTERM/SIGINT (the caller has registered the programs to run and configured logging)."""
    cfg = config if isinstance(config, PartyConfig) else load_party_config(config)
    server, port, handler = serve(cfg)
    print(f"party {cfg.name} listening on port {port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # a party started by a test or benchmark (LocalDeployment) must not outlive it, however it ends
    parent = os.getppid() if os.environ.get(EXIT_WITH_PARENT_ENV) == "1" else None
    while not stop.wait(STOP_POLL_SECONDS):  # short waits: a signal's handler runs between them at the latest
        if parent is not None and os.getppid() != parent:
            log.warning("parent process %d is gone: stopping", parent)
            break
    log.info("party %d (%s) stopping", cfg.index, cfg.name)
    server.stop(grace=STOP_GRACE_SECONDS).wait()  # calls in flight get the grace, then are cancelled
    handler.close()  # a call still computing finishes its writes; the access log is closed
    log.info("party %d (%s) stopped", cfg.index, cfg.name)
    return 0


def exit_now(rc: int) -> NoReturn:
    """End the party's process with ``rc`` once :func:`run` returned, skipping the interpreter's teardown.

    Everything the party must leave behind is written by then (:meth:`PartyServer.close`: calls finished, ledgers and
    state files written atomically, the access log closed); what is left is Python freeing torch and every method's
    modules, which took about a second (measured: a party exited 1.1-1.2 s after SIGTERM, the wait after its
    'stopping' line).  Logging and the standard streams are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(rc)
