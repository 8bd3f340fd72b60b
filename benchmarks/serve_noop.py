"""The floor of ``benchmarks/serve_load.py``: a no-op ``POST /v1/predict`` on the service's HTTP stack.

FastAPI on uvicorn, started as ``partialvfl serve`` starts its app (the same uvicorn settings: loopback, no access
log, log level warning), with one route that reads the body and answers a fixed one-customer answer of the
service's shape.  No validation, no batching, no model: what the stack alone costs per request on this machine, so
that the service's rows can be read as a fraction of it.

    python benchmarks/serve_noop.py --port-file noop.port
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

#: what every request gets: one customer, answered (the service's answer shape, with its usual size)
ANSWER = json.dumps({"model_version": "noop", "parties_timed_out": [], "parties_failed": [], "results": [
    {"id": 0, "status": "ok", "parties": ["bank", "shop", "telco"], "prediction": 0,
     "probabilities": {"0": 0.9, "1": 0.1}}]}).encode()


def noop_app() -> FastAPI:
    app = FastAPI(title="no-op floor")

    @app.post("/v1/predict")
    async def predict(request: Request) -> Response:
        await request.body()
        return Response(ANSWER, media_type="application/json")

    return app


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file", required=True)
    args = p.parse_args()
    server = uvicorn.Server(uvicorn.Config(noop_app(), host="127.0.0.1", port=args.port, access_log=False,
                                           log_level="warning", timeout_graceful_shutdown=30))

    def announce() -> None:
        while not server.started:
            time.sleep(0.05)
        Path(args.port_file).write_text(f"{server.servers[0].sockets[0].getsockname()[1]}\n")

    threading.Thread(target=announce, daemon=True).start()
    server.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
