"""``partialvfl serve``: the prediction service at the label holder (:mod:`partialvfl.serving`).

In process over every party's table (``--table PARTY=FILE ...``) or across a federation's party servers
(``--federation FILE``).  SIGTERM/SIGINT stop it gracefully (in-flight requests finish); SIGHUP reloads the model
directory (a new version saved there) between two batches.  Exit codes: 0 stopped, 2 bad input, 3 the parties
cannot be reached.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_commands", "run_serve", "uvicorn_tls"]


def add_commands(sub: Any) -> None:
    """Add ``serve`` (also ``serve-http``) to the ``partialvfl`` sub-parsers."""
    from partialvfl.cli.vocabulary import add_old_spelling

    p = sub.add_parser("serve", aliases=["serve-http"],
                       help="the label holder's HTTP prediction service, from the parties that answer in time "
                            "(a party's gRPC server is `party serve`)",
                       description="Serve a saved model over HTTP: POST /v1/predict, /healthz, /readyz, /metrics, "
                                   "/docs (OpenAPI). In process over every party's table (--table PARTY=FILE ...) "
                                   "or across a federation's party servers (--federation FILE). This is the label "
                                   "holder's HTTP service; each party's gRPC server is `partialvfl party serve`.")
    p.add_argument("--model", required=True, help="the saved model directory")
    p.add_argument("--table", action="append", default=[], metavar="PARTY=FILE",
                   help="a party's table (in process); one per party of the model")
    p.add_argument("--id-column", dest="id_column", default=None, metavar="COLUMN",
                   help="with --table: the tables' ID column (default: the one the model was fitted on)")
    add_old_spelling(p, "--id", dest="id_column", new="--id-column COLUMN")
    p.add_argument("--federation", default=None, metavar="FILE", help="the coordinator's federation file")
    p.add_argument("--table-set", action="append", default=None, metavar="NAME",
                   help="with --federation: serve the users of the parties' prediction tables of this name "
                        "([[data.predict]]) beside those of their training tables; repeat for several, the first "
                        "listed wins where a party holds a user in several (default: every set the parties serve, "
                        "said at start)")
    p.add_argument("--batches-in-flight", type=int, default=None, metavar="N",
                   help="with --federation: micro-batches predicted at once, side by side (default: 2); each "
                        "party's [policy] max_peer_rpcs must allow that many calls at a time (its default: 2)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free one; default: %(default)s)")
    p.add_argument("--port-file", default=None, metavar="FILE",
                   help="write the port here once the service accepts requests")
    p.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="default per-request deadline: parties not answering within it are missing blocks for the "
                        "request (default: the federation file's deadline_seconds); a request's deadline_ms wins")
    p.add_argument("--min-round", type=float, default=0.02, metavar="SECONDS",
                   help="once a request's deadline has passed, each further round of it still gives the parties "
                        "that are on time this long (default: %(default)s)")
    p.add_argument("--batch-window", type=float, default=None, metavar="SECONDS",
                   help="wait this long after a request for others to batch with it (default: in process 0.002 s "
                        "once requests arrive together, none while they come one at a time; across a federation "
                        "none: batch what queued while the previous batch ran)")
    for unit in ("deadline", "min-round", "batch-window"):  # the old spellings, in milliseconds
        add_old_spelling(p, f"--{unit}-ms", dest=unit.replace("-", "_"), new=f"--{unit} SECONDS", type=float,
                         convert=lambda ms: ms / 1000)
    p.add_argument("--otel-traces", default=None, metavar="otlp|console|FILE",
                   help="export each batch's spans (queue, coordinator, each party's compute and wire) as "
                        "OpenTelemetry traces: to an OTLP collector (OTEL_* environment variables), to stderr, or "
                        "to FILE as JSON lines (needs the otel extra)")
    p.add_argument("--max-ids", type=int, default=1000, help="IDs per request at most (default: %(default)s)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body size at most "
                                                                        "(default: %(default)s)")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="require 'Authorization: Bearer <the file's text>' on /v1 and /admin")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="serve HTTPS with this certificate")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="... and this key")
    p.add_argument("--tls-client-ca", default=None, metavar="PEM",
                   help="require client certificates signed by this CA (with --tls-cert)")
    p.set_defaults(func=run_serve)


def _predictor(args: argparse.Namespace) -> Any:
    from partialvfl.cli.common import parse_tables

    if bool(args.table) == bool(args.federation):
        raise ValueError("serve takes --table PARTY=FILE ... (in process) or --federation FILE, one of them")
    if args.table:
        if args.table_set:
            raise ValueError("--table-set goes with --federation (in process, --table names every table served)")
        if args.batches_in_flight is not None:
            raise ValueError("--batches-in-flight goes with --federation (in process, one batch at a time)")
        from partialvfl.serving.predictors import TablePredictor

        return TablePredictor(args.model, parse_tables(args.table), args.id_column)
    from partialvfl.serving.federated import FederationPredictor

    lanes = 2 if args.batches_in_flight is None else args.batches_in_flight
    return FederationPredictor(args.model, args.federation, min_timeout=args.min_round,
                               table_sets=args.table_set, lanes=lanes)


def _config(args: argparse.Namespace) -> Any:
    from partialvfl.serving.app import ServiceConfig

    for flag, v in (("--max-ids", args.max_ids), ("--max-body-bytes", args.max_body_bytes)):
        if v < 1:
            raise ValueError(f"{flag} must be at least 1, got {v}")
    if args.batch_window is not None and args.batch_window < 0:
        raise ValueError(f"--batch-window must be at least 0 seconds, got {args.batch_window:g}")
    if args.deadline is not None and args.deadline <= 0:
        raise ValueError(f"--deadline must be a positive number of seconds, got {args.deadline:g}")
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_client_ca and not args.tls_cert):
        raise ValueError("HTTPS needs --tls-cert and --tls-key together (and --tls-client-ca only with them)")
    token = None
    if args.token_file:
        f = Path(args.token_file)
        if not f.is_file():
            raise FileNotFoundError(f"--token-file: {f} not found")
        token = f.read_text().strip()
        if len(token) < 16:
            raise ValueError(f"--token-file: {f} holds {len(token)} characters; use at least 16 random ones")
    return ServiceConfig(token=token, max_ids=args.max_ids, max_body_bytes=args.max_body_bytes,
                         deadline=args.deadline, batch_window=args.batch_window,
                         otel_traces=args.otel_traces)


def run_serve(args: argparse.Namespace) -> int:
    """Start the service and serve until SIGTERM/SIGINT (graceful: in-flight requests finish)."""
    import logging
    import signal

    import uvicorn

    from partialvfl.cli.federated import federated
    from partialvfl.serving.app import create_app, reload_model

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = _config(args)
    holder: dict[str, Any] = {}

    def load(_: argparse.Namespace) -> int:
        holder["predictor"] = _predictor(args)
        return 0

    code = federated(load, args)  # an unreachable or refusing party: exit 3
    if code:
        return code
    predictor = holder["predictor"]
    app = create_app(predictor, cfg)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, access_log=False,
                                           log_level="warning", timeout_graceful_shutdown=30,
                                           **uvicorn_tls(args.tls_cert, args.tls_key, args.tls_client_ca)))
    signal.signal(signal.SIGHUP, lambda *_: reload_model(app.state.batcher, None))
    _announce(server, args)
    server.run()
    return 0


def uvicorn_tls(cert: str | None, key: str | None, client_ca: str | None) -> dict[str, Any]:
    """uvicorn's TLS settings for ``--tls-cert``/``--tls-key`` (HTTPS) and ``--tls-client-ca`` (client certificates
    required, signed by that CA); none without a certificate."""
    import ssl

    if not cert:
        return {}
    for flag, f in (("--tls-cert", cert), ("--tls-key", key), ("--tls-client-ca", client_ca)):
        if f and not Path(f).is_file():
            raise FileNotFoundError(f"{flag}: {f} not found")
    out: dict[str, Any] = {"ssl_certfile": cert, "ssl_keyfile": key}
    if client_ca:
        out.update(ssl_ca_certs=client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return out


def _announce(server: Any, args: argparse.Namespace) -> None:
    """Print the address (and write ``--port-file``) once uvicorn listens."""
    import threading
    import time

    def wait() -> None:
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
        scheme = "https" if args.tls_cert else "http"
        print(f"serving {args.model} on {scheme}://{args.host}:{port} (POST /v1/predict; /docs)", file=sys.stderr,
              flush=True)
        if args.port_file:
            Path(args.port_file).write_text(f"{port}\n")

    threading.Thread(target=wait, daemon=True, name="announce").start()
