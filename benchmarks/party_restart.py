"""A party killed (SIGKILL) and started again: how long after its new process listens it is used again, in the
prediction service and in the middle of a fit, before (the party rejoins: a new session at every party, tokens and
model again) and after (it continues its session from its own disk), in one run.

The own-data example's three parties (``scripts/make_example_tables.py``, 1,500 training customers) run as
``partialvfl party serve`` processes (mutual TLS).  "Before" restarts the killed party with ``[party]
resume_sessions = false`` (it keeps nothing, as every party did before sessions were kept on disk), "after" with the
default.  Each case is repeated ``--repeats`` times; reported: seconds from the restarted process listening to the
first answer that used it (serving: a prediction that used its block; fit: its first training reply), from the kill
to that answer, the time the restarted process took to start (and of it, to restore its session, before it
listens), and how the other parties fared (new ``hello`` at them: a rejoin).

* serving: a LASER-VFL model fitted across the parties, a :class:`~partialvfl.serving.federated.FederationPredictor`
  predicting batches of 12 customers back to back (its upkeep between batches, as the service runs it); the shop is
  killed, started again, and the batches go on;
* fit: LASER-VFL, ``--party-timeout`` (the fit waits for a lost party), a checkpoint every 5 steps; the telco is
  killed after the first epoch and started again while the fit waits.

    python benchmarks/party_restart.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.data.builders import from_tables
from partialvfl.federation.grpc.federation import GrpcFederation
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.grpc.transport import GrpcTransport
from partialvfl.federation.trust.access_log import read_access_log
from partialvfl.federation.wire.messages import Reply
from partialvfl.methods import get_method
from partialvfl.orchestration import FitOptions, run_fit
from serve_load import example_tables  # the same tables as the serving benchmark

ROOT = Path(__file__).resolve().parents[1]
PARTIES = ("bank", "shop", "telco")
TRAINING_KINDS = ("embed", "grad_embedding")


def hellos(dep: LocalDeployment) -> dict[str, int]:
    return {name: sum(1 for e in read_access_log(dep.dir / "state" / name / "access.log")
                      if e["kind"] == "hello" and e["outcome"] == "served") for name in dep.names}


def start_again(dep: LocalDeployment, k: int, resume: bool, marks: dict[str, float]) -> None:
    """Start the killed party ``k`` again (``resume``: keeping its session), noting when it listens."""
    dep.resume_sessions = resume
    try:
        dep.start([k])
    finally:
        dep.resume_sessions = True
    marks["listening"] = time.monotonic()


def kill(dep: LocalDeployment, k: int, resume: bool, marks: dict[str, float]) -> threading.Thread:
    """Kill party ``k`` (SIGKILL) and start it again in a thread."""
    log = dep.dir / f"party-{k}.log"
    marks["log_size"] = log.stat().st_size if log.is_file() else 0
    dep.kill(k, signal.SIGKILL)
    marks["killed"] = time.monotonic()
    t = threading.Thread(target=start_again, args=(dep, k, resume, marks))
    t.start()
    return t


def restored_seconds(dep: LocalDeployment, k: int, since: int) -> float | None:
    """What the restarted party's log (from byte ``since``: this process's lines) says its session took to read
    back (None: it restored nothing)."""
    for line in reversed((dep.dir / f"party-{k}.log").read_bytes()[since:].decode(errors="replace").splitlines()):
        if "restored its coordinator session" in line:
            return float(line.split(" in ")[1].split(" s")[0])
    return None


def serving_case(dep: LocalDeployment, model: Path, ids: list[str], resume: bool) -> dict[str, Any]:
    from partialvfl.serving.federated import FederationPredictor

    k = 1  # the shop
    predictor = FederationPredictor(model, dep.federation_file, rejoin_interval=3600.0)
    try:
        predictor.predict(ids, {}, 30.0)  # the session's first batch (the parties build their networks)
        before = hellos(dep)
        marks: dict[str, float] = {}
        t = kill(dep, k, resume, marks)
        used_at = None
        limit = time.monotonic() + 120
        while used_at is None and time.monotonic() < limit:
            if predictor.due():
                predictor.maintain()
            out = predictor.predict(ids, {}, 30.0)
            if "listening" in marks and any("shop" in p for p in out.parties.values()):
                used_at = time.monotonic()
        t.join()
        after = hellos(dep)
    finally:
        predictor.close()
    return {"case": "serving", "resume": resume,
            "used_again_after_s": None if used_at is None else round(used_at - marks["listening"], 3),
            "out_s": None if used_at is None else round(used_at - marks["killed"], 2),
            "start_s": round(marks["listening"] - marks["killed"], 2),
            "restore_s": restored_seconds(dep, k, int(marks["log_size"])),
            "other_parties_new_hello": sum(after[n] - before[n] for n in dep.names if n != "shop")}


def fit_case(dep: LocalDeployment, work: Path, resume: bool) -> dict[str, Any]:
    k = 2  # the telco
    marks: dict[str, float] = {}
    replies: list[tuple[float, int, str]] = []
    original = GrpcTransport._deliveries

    def deliveries(self: GrpcTransport, requests: Any, **kw: Any) -> Any:
        for party, req, outcome in original(self, requests, **kw):
            if isinstance(outcome, Reply):
                replies.append((time.monotonic(), party, req.kind))
            yield party, req, outcome

    GrpcTransport._deliveries = deliveries  # type: ignore[method-assign]
    threads: list[threading.Thread] = []

    def on_epoch(stage: str, epoch: int, metrics: dict[str, float]) -> None:
        if stage == "train" and epoch == 1 and not threads:
            threads.append(kill(dep, k, resume, marks))  # the fit's next request finds it gone

    fed = GrpcFederation.from_config(dep.federation_file, connect=False)
    before = hellos(dep)
    try:
        model = get_method("laser-vfl")("fast", seed=0, epochs=5)
        checkpoints = work / f"ck-{resume}-{time.monotonic_ns()}"
        result_ = run_fit(model, fed, FitOptions(party_timeout=300.0, checkpoint_dir=checkpoints,
                                                 checkpoint_every=5), on_epoch=on_epoch)
    finally:
        fed.close()
        GrpcTransport._deliveries = original  # type: ignore[method-assign]
        for t in threads:
            t.join()
    after = hellos(dep)
    used = [when for when, party, kind in replies if party == k and kind in TRAINING_KINDS
            and when >= marks.get("listening", float("inf"))]
    return {"case": "fit", "resume": resume, "party_failures": result_.party_failures,
            "used_again_after_s": round(used[0] - marks["listening"], 3) if used else None,
            "out_s": round(used[0] - marks["killed"], 2) if used else None,
            "start_s": round(marks["listening"] - marks["killed"], 2),
            "restore_s": restored_seconds(dep, k, int(marks["log_size"])),
            "other_parties_new_hello": sum(after[n] - before[n] for n in dep.names if n != "telco") - 2}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cases", nargs="+", choices=("serving", "fit"), default=["serving", "fit"])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        d = example_tables(work / "example", 0)
        data = from_tables({n: d / "train" / f"{n}.csv" for n in PARTIES}, id_column="customer_id",
                           label_column="defaulted", active_party="bank")
        ids = [str(i) for i in data.ids[:12]]
        with LocalDeployment(work / "fed", data, deadline=120.0, start_timeout=600.0) as dep:
            dep.start()
            if "serving" in args.cases:
                fed = dep.federation()
                try:
                    view, handle = fed.align()
                    get_method("laser-vfl")("fast", seed=0, epochs=2).fit_federated(fed, view, handle).save(
                        work / "model")
                    fed.release(handle)
                finally:
                    fed.close()
            for _ in range(args.repeats):
                for resume in (False, True):
                    if "serving" in args.cases:
                        rows.append(serving_case(dep, work / "model", ids, resume))
                        print(rows[-1], file=sys.stderr)
                        if not resume:  # the shop runs with its sessions kept again (it keeps one to continue)
                            dep.kill(1)
                            dep.start([1])
                    if "fit" in args.cases:
                        rows.append(fit_case(dep, work, resume))
                        print(rows[-1], file=sys.stderr)
                        if not resume:
                            dep.kill(2)
                            dep.start([2])
    machine = {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
               "python": platform.python_version(), "load_average": os.getloadavg()}
    print("| case | restarted party | used again after it listens, s (each run) | median | killed to used again, s "
          "| start to listening, s | of which restore, s | new hellos at the other parties |\n"
          "|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        for resume in (False, True):
            sel = [r for r in rows if r["case"] == case and r["resume"] == resume]
            used = [r["used_again_after_s"] for r in sel]
            med = np.median([u for u in used if u is not None]) if any(u is not None for u in used) else None
            print(f"| {case} | {'continues its session (after)' if resume else 'rejoins (before)'} | "
                  f"{', '.join(str(u) for u in used)} | {med} | {', '.join(str(r['out_s']) for r in sel)} | "
                  f"{', '.join(str(r['start_s']) for r in sel)} | "
                  f"{', '.join(str(r['restore_s']) for r in sel)} | "
                  f"{', '.join(str(r['other_parties_new_hello']) for r in sel)} |")
    print(f"machine: {machine}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "machine": machine}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
