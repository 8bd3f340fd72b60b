"""The party process: one long-lived gRPC server per institution (``partialvfl party serve --config FILE``).

It reads the party's own table (CSV or Parquet with an ID column) and nothing else, keeps one
:class:`~partialvfl.federation.party.PartyRuntime` (so a program's forward state lives between the calls of a step),
and answers the coordinator over mutual TLS.  Before a request reaches the runtime the server checks, in order:

1. the peer's certificate identity (CN or a DNS SAN) is on the allowlist -> else ``PERMISSION_DENIED``;
2. the bytes are a well-formed frame of allowed dtypes within the size limit -> else ``INVALID_ARGUMENT``
   (gRPC itself refuses frames over the maximum message size with ``RESOURCE_EXHAUSTED``);
3. the message belongs to the current coordinator session, its sequence number is new, its step is not older
   than the last one and its ``(step, round, kind)`` was not served yet -> else ``FAILED_PRECONDITION`` (stale)
   or ``ALREADY_EXISTS`` (replay);
4. the kind is declared (a built-in or one of the program's ``messages``) -> else ``UNIMPLEMENTED``
   (``FAILED_PRECONDITION`` before any setup), and its tensors and metadata match the declaration -> else
   ``INVALID_ARGUMENT`` (the runtime checks, as in process: :mod:`partialvfl.federation.schema`).

A handler that raises on bad input (``ValueError``, ``KeyError``, shape errors...) becomes ``INVALID_ARGUMENT``
with the party's message; a reply that does not match its declaration (the program's own bug) ``INTERNAL``.  Every
refusal is logged and the server keeps serving.

Built-in kinds of the server (besides the runtime's ``ping``/``setup``/``save``/``load``): ``hello`` (open a
coordinator session), ``ids`` (the party's IDs as HMAC hashes), ``attach`` (hold the rows at the given positions
of the shared order under a handle), ``release``.  ``save``/``load`` directories are resolved inside the party's
own state directory: a party's model state stays on its own disk.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import grpc
import numpy as np
import torch

from partialvfl.data.dataset import PartyView
from partialvfl.data.tables import feature_values, read_table, select_features, table_ids
from partialvfl.federation.alignment import hash_ids, load_key
from partialvfl.federation.grpc_transport import (
    CALL_METHOD,
    DEFAULT_MAX_MESSAGE_BYTES,
    SECONDS_KEY,
    SERVICE_NAME,
    TlsFiles,
    WireError,
    decode_request,
    encode_reply,
)
from partialvfl.federation.messages import Reply, Request
from partialvfl.federation.party import NotSetUp, PartyRuntime
from partialvfl.federation.schema import MessageError, MessageSpec, TensorSpec, UnknownKindError
from partialvfl.utils.tomlfile import check_keys, read_toml

__all__ = ["PartyConfig", "PartyServer", "PartyTable", "import_plugins", "load_party_config", "run", "serve"]

log = logging.getLogger("partialvfl.party")
EXIT_WITH_PARENT_ENV = "PARTIALVFL_EXIT_WITH_PARENT"

#: The server's own message kinds (besides the runtime's ``ping``/``setup``/``save``/``load``/``forget``).
SERVER_MESSAGES: dict[str, MessageSpec] = {
    "hello": MessageSpec(doc="Open a coordinator session; replies the party's name, index, row count and feature "
                             "shape as metadata."),
    "ids": MessageSpec(reply=[TensorSpec("hashes", "uint8", ("N", 32))],
                       doc="The party's IDs as HMAC-SHA256 hashes."),
    "attach": MessageSpec(
        request=[TensorSpec("hashes", "uint8", ("R", 32)), TensorSpec("rows", "int64", ("R",)),
                 TensorSpec("labels", ("int64", "float64"), ("N",), optional=True),
                 TensorSpec("labeled", "bool", ("N",), optional=True)],
        meta=["handle", "n_samples"],
        doc="Hold the rows with these hashed IDs at these positions of the shared order (of `n_samples`) under "
            "`handle`; the active party also gets the labels."),
    "release": MessageSpec(meta=["handle"], doc="Drop the data attached under `handle`."),
}


class Refused(Exception):
    """A request the server refuses with a given gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class PartyConfig:
    """A party process's configuration file, paths resolved against the file's folder."""

    name: str
    index: int
    address: str
    data_path: Path
    id_column: str
    tls: TlsFiles
    state_dir: Path
    hmac_key_file: Path
    allowed_peers: tuple[str, ...] = ("coordinator",)
    feature_columns: tuple[str, ...] | None = None
    exclude_columns: tuple[str, ...] = ()
    feature_shape: tuple[int, ...] | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    port_file: Path | None = None
    plugins: tuple[str, ...] = ()
    threads: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


#: every section and key of a party file (docs/deployment.md); anything else is an error naming it
PARTY_KEYS: dict[str, tuple[str, ...]] = {
    "party": ("name", "index", "address", "port_file", "state_dir", "hmac_key_file", "allowed_peers",
              "max_message_mb", "plugins", "threads"),
    "data": ("path", "id_column", "feature_columns", "exclude_columns", "feature_shape"),
    "tls": ("ca", "cert", "key"),
}


def _need(table: dict[str, Any], key: str, where: str, path: Path) -> Any:
    if key not in table:
        raise ValueError(f"{path}: [{where}] needs '{key}'")
    return table[key]


def load_party_config(path: str | Path) -> PartyConfig:
    """Read a party's TOML configuration (see ``docs/deployment.md`` for every key)."""
    p = Path(path)
    raw = read_toml(p, "party configuration")
    check_keys(raw, PARTY_KEYS, p)
    base = p.parent

    def rel(v: str) -> Path:
        q = Path(v).expanduser()
        return q if q.is_absolute() else (base / q)

    party = _need(raw, "party", "party", p)
    data = _need(raw, "data", "data", p)
    tls = _need(raw, "tls", "tls", p)
    fc = data.get("feature_columns")
    shape = data.get("feature_shape")
    return PartyConfig(
        name=str(_need(party, "name", "party", p)),
        index=int(_need(party, "index", "party", p)),
        address=str(party.get("address", "127.0.0.1:0")),
        data_path=rel(_need(data, "path", "data", p)),
        id_column=str(_need(data, "id_column", "data", p)),
        tls=TlsFiles(rel(_need(tls, "ca", "tls", p)), rel(_need(tls, "cert", "tls", p)),
                     rel(_need(tls, "key", "tls", p))),
        state_dir=rel(party.get("state_dir", f"state-{party.get('name', 'party')}")),
        hmac_key_file=rel(_need(party, "hmac_key_file", "party", p)),
        allowed_peers=tuple(party.get("allowed_peers", ["coordinator"])),
        feature_columns=tuple(fc) if fc is not None else None,
        exclude_columns=tuple(data.get("exclude_columns", [])),
        feature_shape=tuple(int(s) for s in shape) if shape is not None else None,
        max_message_bytes=int(float(party.get("max_message_mb", DEFAULT_MAX_MESSAGE_BYTES / 2**20)) * 2**20),
        port_file=rel(party["port_file"]) if "port_file" in party else None,
        plugins=tuple(party.get("plugins", [])),
        threads=int(party.get("threads", 1)),
        extra=raw,
    )


# ---------------------------------------------------------------------- the party's own table
class PartyTable:
    """The party's rows: IDs, their HMAC hashes and the float32 feature matrix, read from its own file only.

    Read by the same functions as :func:`~partialvfl.data.builders.from_tables` (:mod:`partialvfl.data.tables`):
    IDs normalised by the one rule (:mod:`partialvfl.data.ids`; empty and colliding IDs refused, naming them),
    numeric feature columns only (a text or categorical column refused, naming it), every value of a held row given.
    """

    def __init__(self, cfg: PartyConfig, key: bytes) -> None:
        where = f"party {cfg.index} ({cfg.name!r}), {cfg.data_path.name}"
        if not cfg.data_path.is_file():
            raise FileNotFoundError(f"party {cfg.index} ({cfg.name!r}): data file not found: {cfg.data_path}")
        fmt = "parquet" if cfg.data_path.suffix.lower() in (".parquet", ".pq") else "csv"
        df, _ = read_table(where, cfg.data_path, cfg.id_column, fmt)
        ids, _ = table_ids(where, df, cfg.id_column)
        cols = select_features(where, df, id_column=cfg.id_column, columns=cfg.feature_columns,
                               exclude=cfg.exclude_columns)
        shape = cfg.feature_shape or (len(cols),)
        if int(np.prod(shape)) != len(cols):
            raise ValueError(f"party {cfg.index} ({cfg.name!r}): feature_shape {shape} does not match its "
                             f"{len(cols)} columns")
        self.ids = np.array(ids, dtype=object)
        self.features = feature_values(where, df, cols, ids)
        self.feature_names = tuple(cols)
        self.feature_shape = tuple(int(s) for s in shape)
        self.hashes = hash_ids(self.ids, key)
        self.index = {bytes(h): i for i, h in enumerate(self.hashes)}


# ---------------------------------------------------------------------- the server
class PartyServer:
    """The party's request handler: authentication, replay checks, then the runtime (declarations, handlers)."""

    def __init__(self, cfg: PartyConfig, key: bytes | None = None) -> None:
        self.cfg = cfg
        self.table = PartyTable(cfg, key if key is not None else load_key(cfg.hmac_key_file))
        handlers = {"hello": self._hello, "ids": self._ids, "attach": self._attach, "release": self._release}
        self.runtime = PartyRuntime(cfg.index, cfg.name, resolve_dir=self._state_path,
                                    builtins={k: (SERVER_MESSAGES[k], h) for k, h in handlers.items()})
        self.state_dir = cfg.state_dir.resolve()
        self._lock = threading.Lock()
        self.session: str | None = None
        self.last_seq = 0
        self.last_step = -1
        self.served: set[tuple[int, int, str]] = set()
        self.refusals = 0

    # -- checks
    def _check_peer(self, context: grpc.ServicerContext) -> str:
        auth = context.auth_context()
        names = [v.decode() for key in ("x509_common_name", "x509_subject_alternative_name")
                 for v in auth.get(key, [])]
        for n in names:
            if n in self.cfg.allowed_peers:
                return n
        raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                      f"party {self.cfg.name!r} does not accept peer {names or 'without certificate'}: not on its "
                      f"allowlist {list(self.cfg.allowed_peers)}")

    def _check_fresh(self, wire: Any) -> None:
        kind = wire.request.kind
        if kind == "hello":
            self.session, self.last_seq, self.last_step = wire.session, wire.seq, wire.step
            self.served.clear()
            return
        if self.session is None or wire.session != self.session:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          "stale session: this message is not from the coordinator session in progress "
                          "(a coordinator must say hello first)")
        if wire.seq <= self.last_seq:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS,
                          f"replayed message: sequence number {wire.seq} already seen (last {self.last_seq})")
        if wire.step < self.last_step:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"stale message: step {wire.step} is older than the current step {self.last_step}")
        if wire.step == self.last_step and (wire.step, wire.round, kind) in self.served:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS,
                          f"replayed message: {kind!r} was already served in step {wire.step} round {wire.round} "
                          "(a method calling the same kind twice must start a new round in between)")

    def _commit(self, wire: Any) -> None:
        """Record a message that passed every check as served."""
        if wire.request.kind == "hello":
            return
        if wire.step > self.last_step:
            self.served.clear()
        self.last_seq, self.last_step = wire.seq, wire.step
        self.served.add((wire.step, wire.round, wire.request.kind))

    def _state_path(self, rel: Any) -> str:
        if not isinstance(rel, str) or not rel:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "save/load/forget need meta 'dir', a relative path")
        pp = PurePosixPath(rel)
        if pp.is_absolute() or ".." in pp.parts:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"state directory {rel!r} must be relative and stay inside the party's state directory")
        return str(self.state_dir.joinpath(*pp.parts))

    # -- built-ins
    def _hello(self, req: Request) -> Reply:
        t = self.table
        return Reply(meta={"name": self.cfg.name, "index": self.cfg.index, "n_rows": int(len(t.ids)),
                           "feature_dim": int(t.features.shape[1]), "feature_shape": list(t.feature_shape),
                           "feature_names": list(t.feature_names)})

    def _attach(self, req: Request) -> Reply:
        handle = req.meta.get("handle")
        n = req.meta.get("n_samples")
        if not isinstance(handle, str) or not handle or not isinstance(n, int) or n < 0:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "attach needs meta 'handle' (str) and 'n_samples' (int)")
        hashes, rows = req.tensors["hashes"], req.tensors["rows"].numpy()  # shapes: declared in SERVER_MESSAGES
        if rows.size and (rows.min() < 0 or rows.max() >= n or len(np.unique(rows)) != rows.size):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"attach: rows must be distinct positions in [0, {n})")
        local = np.empty(rows.size, dtype=np.int64)
        for i, h in enumerate(hashes.numpy()):
            j = self.table.index.get(bytes(h))
            if j is None:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"party {self.cfg.name!r} holds no row with hashed ID {bytes(h).hex()[:16]}...")
            local[i] = j
        order = np.argsort(rows, kind="stable")
        rows, local = rows[order], local[order]
        labels = labeled = None
        if "labels" in req.tensors or "labeled" in req.tensors:
            if "labels" not in req.tensors or "labeled" not in req.tensors:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "attach: send both 'labels' and 'labeled'")
            labels, labeled = req.tensors["labels"].numpy(), req.tensors["labeled"].numpy()
            if labels.shape != (n,) or labeled.shape != (n,):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"attach: labels must cover all {n} samples")
        feats = self.table.features[local]
        feats.flags.writeable = False
        view = PartyView(party=self.cfg.index, name=self.cfg.name, features=feats, rows=rows,
                         ids=self.table.ids[local], feature_names=self.table.feature_names,
                         feature_shape=self.table.feature_shape, n_samples=n, labels=labels, labeled=labeled)
        self.runtime.attach(handle, view)
        return Reply(meta={"n_rows": int(rows.size)})

    def _ids(self, req: Request) -> Reply:
        return Reply({"hashes": torch.from_numpy(self.table.hashes.copy())})

    def _release(self, req: Request) -> Reply:
        self.runtime.release(str(req.meta["handle"]))
        return Reply()

    # -- the gRPC entry point
    def handle_bytes(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        kind = "?"
        try:
            peer = self._check_peer(context)
            try:
                wire = decode_request(data, self.cfg.max_message_bytes)
            except WireError as e:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"malformed message: {e}") from None
            kind = wire.request.kind
            with self._lock:
                t0 = time.perf_counter()
                self._check_fresh(wire)
                try:
                    reply = self.runtime.handle(wire.request, accepted=lambda: self._commit(wire))
                except Refused:
                    raise
                except UnknownKindError as e:
                    raise Refused(grpc.StatusCode.UNIMPLEMENTED, str(e)) from None
                except MessageError as e:  # the same text as in process; a bad reply is the party's own bug
                    code = grpc.StatusCode.INVALID_ARGUMENT if e.direction == "request" else grpc.StatusCode.INTERNAL
                    raise Refused(code, str(e)) from None
                except NotSetUp as e:
                    raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
                except (ValueError, KeyError, TypeError, IndexError, RuntimeError, FileNotFoundError) as e:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"party {self.cfg.name!r} refused {kind!r}: {type(e).__name__}: {e}") from None
                reply = Reply(reply.tensors, {**reply.meta, SECONDS_KEY: time.perf_counter() - t0})
            log.debug("served %s for %s (step %d round %d)", kind, peer, wire.step, wire.round)
            return encode_reply(reply)
        except Refused as e:
            self.refusals += 1
            log.warning("refused %r: %s: %s", kind, e.code.name, e)
            context.abort(e.code, str(e))
        except Exception as e:  # noqa: BLE001 - anything else is the party's own bug: report, keep serving
            self.refusals += 1
            log.exception("internal error while serving %r", kind)
            context.abort(grpc.StatusCode.INTERNAL, f"party {self.cfg.name!r} failed on {kind!r}: "
                                                    f"{type(e).__name__}: {e}")
        raise AssertionError("unreachable")  # context.abort raises


def generic_handler(fn: Callable[[bytes, grpc.ServicerContext], bytes]) -> grpc.GenericRpcHandler:
    """The one-method service, bytes in and out (no protoc)."""
    method = CALL_METHOD.rsplit("/", 1)[1]
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {method: grpc.unary_unary_rpc_method_handler(fn)})


def import_plugins(cfg: PartyConfig) -> None:
    """Import the party's plugin modules (party programs outside the package), naming any that fails."""
    failed = []
    for name in cfg.plugins:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - report every broken plugin at once
            log.warning("could not import %s: %s", name, e)
            failed.append(name)
    if failed:
        raise ImportError(f"party {cfg.name!r}: plugin module(s) {failed} failed")


def serve(cfg: PartyConfig) -> tuple[grpc.Server, int, PartyServer]:
    """Start the party's server (not blocking); returns the server, its bound port and the handler.

    The party runs the programs registered in :data:`~partialvfl.federation.party.PROGRAMS` when a ``setup``
    arrives: those its caller registered before (``partialvfl party serve`` registers every method's) and those of
    the plugin modules in ``cfg.plugins``, imported here.
    """
    torch.set_num_threads(max(1, cfg.threads))
    import_plugins(cfg)
    handler = PartyServer(cfg)
    ca, cert, key = cfg.tls.read()
    creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        handlers=[generic_handler(handler.handle_bytes)],
        options=[("grpc.max_receive_message_length", cfg.max_message_bytes),
                 ("grpc.max_send_message_length", cfg.max_message_bytes)],
    )
    port = server.add_secure_port(cfg.address, creds)
    if port == 0:
        raise OSError(f"party {cfg.name!r}: cannot listen on {cfg.address}")
    server.start()
    if cfg.port_file is not None:
        cfg.port_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cfg.port_file.with_suffix(".tmp")
        tmp.write_text(f"{port}\n")
        os.replace(tmp, cfg.port_file)
    log.info("party %d (%s) serving %d rows on port %d", cfg.index, cfg.name, len(handler.table.ids), port)
    return server, port, handler


def run(config: str | Path | PartyConfig) -> int:
    """Serve until SIGTERM/SIGINT (the caller has registered the programs to run and configured logging)."""
    cfg = config if isinstance(config, PartyConfig) else load_party_config(config)
    server, port, _ = serve(cfg)
    print(f"party {cfg.name} listening on port {port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # a party started by a test or benchmark (LocalDeployment) must not outlive it, however it ends
    parent = os.getppid() if os.environ.get(EXIT_WITH_PARENT_ENV) == "1" else None
    while not stop.wait(1.0):
        if parent is not None and os.getppid() != parent:
            log.warning("parent process %d is gone: stopping", parent)
            break
    log.info("party %d (%s) stopping", cfg.index, cfg.name)
    server.stop(grace=1.0).wait()
    return 0
