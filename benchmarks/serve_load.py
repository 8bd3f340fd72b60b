"""Load on the prediction service (issue 26): loopback only, bounded in time and count.

The own-data example tables (``scripts/make_example_tables.py``, 1500 training customers) are served by three
``partialvfl party serve`` processes (mutual TLS, a :class:`LocalDeployment`); each method is fitted across them and
saved, then ``partialvfl serve --federation`` runs as its own process and this process sends it requests of one ID
each (drawn, seeded, from the bank's customers) from C concurrent clients (threads with keep-alive connections) for
``--seconds`` or ``--max-requests``, whichever ends first.  Reported per method and case: requests, errors (not HTTP
200, or no answer), IDs not predicted (HTTP 200 with a per-ID status: e.g. a customer only the slow party holds), p50
and p99 latency seen by the client, predictions per second, answers with a party timed out.  For the slow case also
the accuracy of the answers that went without the slow party (labelled customers) beside the accuracy of the same
customers predicted offline with that party's blocks missing.

Cases: concurrency 1 / 16 / 64 with every party on time; one party (the shop) killed (SIGKILL) a quarter of the way
into a run at concurrency 16 and started again at half-time (failed requests; seconds from the new process
listening to the first answer that used it); then one party (the telco) reached through a proxy that holds back
every byte sent to it by ``--delay-ms`` (200 ms), at concurrency 16 with each request's ``deadline_ms`` at
``--deadline-ms`` (50 ms); last, the same method fitted in process and served with ``--table`` (no party processes,
no gRPC) at concurrency 16: what HTTP and micro-batching alone cost on the same machine.  First of all, once per run,
the floor: a no-op ``POST /v1/predict`` on the same HTTP stack (``benchmarks/serve_noop.py``: FastAPI on uvicorn,
started alike), driven by the same load generator at 1 and 16 clients; the summary gives each target's ratio
(in process against the floor, federated against in process, the late party's p99 against the deadline plus the
in-process p99), every figure of one run.

    python benchmarks/serve_load.py --seconds 10 --json serve_load.json
    python benchmarks/serve_load.py --methods laser-vfl --seconds 3          # a quick look
    # another version's service (its own checkout and Python) under the same load generator, beside the floor:
    python benchmarks/serve_load.py --methods laser-vfl --cases floor in-process \
        --service-root ../old-checkout --service-python ../old-checkout/.venv/bin/python
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.data.builders import from_tables
from partialvfl.federation.grpc.delay_proxy import DelayProxy
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.methods import get_method

ROOT = Path(__file__).resolve().parents[1]
PARTIES = ("bank", "shop", "telco")
CASES = ("floor", "on-time", "killed", "delayed", "in-process")
SLOW = 2  # the telco
KILLED = 1  # the shop


def example_tables(d: Path, seed: int) -> Path:
    spec = importlib.util.spec_from_file_location("make_example_tables", ROOT / "scripts" / "make_example_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write(d, seed=seed, n_train=1500, n_new=300)
    return d


def fit_federated(dep: LocalDeployment, method: str, out: Path, seed: int) -> float:
    fed = dep.federation()
    try:
        t0 = time.perf_counter()
        view, handle = fed.align()
        get_method(method)("fast", seed=seed).fit_federated(fed, view, handle).save(out)
        fed.release(handle)
        return time.perf_counter() - t0
    finally:
        fed.close()


class ServiceProcess:
    """``partialvfl serve --federation`` (or, with ``tables``, ``--table PARTY=FILE ...``: every party in the
    service's process) in a process of its own, run from ``root`` (a checkout: its ``src``) with ``python``; with
    ``command``, that command instead (the no-op floor); stopped with SIGTERM."""

    def __init__(self, model: Path | None, federation: Path | None, work: Path,
                 tables: dict[str, Path] | None = None, *, root: Path = ROOT, python: str = sys.executable,
                 command: list[str] | None = None, name: str | None = None, extra: list[str] | None = None) -> None:
        name = name or (model.name if model is not None else "service")
        port_file = work / f"serve-{name}.port"
        port_file.unlink(missing_ok=True)
        if command is None:
            assert model is not None
            where = ["--federation", str(federation)] if tables is None else [
                a for p, f in tables.items() for a in ("--table", f"{p}={f}")] + ["--id-column", "customer_id"]
            command = [python, "-m", "partialvfl", "serve", "--model", str(model), *where, "--port", "0",
                       "--deadline", "5", "--max-ids", "100", *(extra or [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
            [str(root / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        self.log = open(work / f"serve-{name}.log", "ab")  # noqa: SIM115 - closed in stop
        self.proc = subprocess.Popen([*command, "--port-file", str(port_file)], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env)
        limit = time.monotonic() + 300
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > limit:
                raise RuntimeError(f"the service did not start: {(work / f'serve-{name}.log').read_text()}")
            time.sleep(0.1)
        self.port = int(port_file.read_text())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()

    def wait_ready(self, probe: str, timeout: float = 60.0) -> None:
        """Wait until ``/readyz`` reports every party ``ok`` (predicting meanwhile: a rejoin happens between
        batches)."""
        limit = time.monotonic() + timeout
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            while time.monotonic() < limit:
                conn.request("GET", "/readyz")
                state = json.loads(conn.getresponse().read())
                if all(s == "ok" for s in state["parties"].values()):
                    return
                conn.request("POST", "/v1/predict", json.dumps({"ids": [probe]}),
                             {"Content-Type": "application/json"})
                conn.getresponse().read()
                time.sleep(0.2)
        finally:
            conn.close()
        raise RuntimeError(f"the service's parties did not all become ready within {timeout} s")

    def errors(self) -> list[str]:
        """The service's log lines about failed batches (for the report when a case had errors)."""
        text = Path(self.log.name).read_text(errors="replace")
        return [line for line in text.splitlines() if '"status": 5' in line or "failed" in line][-5:]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The service's ``/metrics`` as {(name, labels): value} (an old service without the span metrics: fewer)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = tuple(sorted(tuple(kv.split("=", 1)) for kv in rest.rstrip("}").split(",") if kv)) if rest else ()
        out[(name, tuple((k, v.strip('"')) for k, v in labels))] = float(value)
    return out


def _quantile(delta: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, q: float,
              **labels: str) -> float | None:
    """The ``q`` quantile of a histogram's observations in ``delta`` (linear within a bucket, as Prometheus'
    histogram_quantile does)."""
    want = tuple(sorted(labels.items()))
    buckets = sorted((float(dict(lab)["le"]), v) for (n, lab), v in delta.items() if n == f"{name}_bucket"
                     and tuple((k, x) for k, x in lab if k != "le") == want)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def breakdown(before: dict, after: dict, parties: tuple[str, ...]) -> dict[str, Any]:
    """Where the batches of one case spent their time (the difference of two scrapes): per batch, the mean of each
    part and the median batch, in ms; each party's mean compute and wire per call; the mean queue wait."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}

    def mean(name: str, **labels: str) -> float | None:
        want = tuple(sorted(labels.items()))
        count = delta.get((f"{name}_count", want), 0.0)
        return None if not count else 1000 * delta[(f"{name}_sum", want)] / count

    batch = mean("partialvfl_serve_batch_seconds")
    if batch is None:
        return {}
    out: dict[str, Any] = {"batches": int(delta[("partialvfl_serve_batch_seconds_count", ())]),
                           "batch_ms_mean": round(batch, 2),
                           "batch_ms_p50": round(1000 * (_quantile(delta, "partialvfl_serve_batch_seconds", 0.5)
                                                         or 0.0), 2),
                           "queue_ms_mean": round(mean("partialvfl_serve_queue_seconds") or 0.0, 2)}
    for part in ("coordinator", "party_compute", "wire"):
        value = mean("partialvfl_serve_batch_part_seconds", part=part)
        if value is not None:
            out[f"{part}_ms_mean"] = round(value, 2)
    for p in parties:
        for part in ("compute", "wire"):
            value = mean("partialvfl_serve_party_call_seconds", party=p, part=part)
            if value is not None:
                out[f"{p}_{part}_ms_per_call"] = round(value, 2)
    return out


def load(port: int, ids: list[str], concurrency: int, seconds: float, max_requests: int,
         deadline_ms: float | None, seed: int, record: list[tuple[str, Any, list[str]]] | None = None,
         timeline: list[tuple[float, bool, list[str]]] | None = None) -> dict[str, Any]:
    """``concurrency`` clients, one ID per request, until ``seconds`` pass or ``max_requests`` are sent; with
    ``record``, every answer's (ID, predicted class, parties used) is appended to it; with ``timeline`` every
    request's (``time.monotonic()`` at its answer, failed, parties used)."""
    lock = threading.Lock()
    latencies: list[float] = []
    counts = {"requests": 0, "errors": 0, "not_predicted": 0, "timed_out": 0}
    stop_at = time.monotonic() + seconds

    def client(c: int) -> None:
        rng = random.Random(seed * 1000 + c)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while time.monotonic() < stop_at:
            with lock:
                if counts["requests"] >= max_requests:
                    break
                counts["requests"] += 1
            body: dict[str, Any] = {"ids": [rng.choice(ids)]}
            if deadline_ms is not None:
                body["deadline_ms"] = deadline_ms
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/v1/predict", json.dumps(body), {"Content-Type": "application/json"})
                resp = conn.getresponse()
                answer = json.loads(resp.read())
                failed = resp.status != 200
                ok = not failed and answer["results"][0]["status"] == "ok"
                late = bool(answer.get("parties_timed_out"))
                if ok and record is not None:
                    r = answer["results"][0]
                    with lock:
                        record.append((body["ids"][0], r["prediction"], r["parties"]))
            except (OSError, http.client.HTTPException, ValueError, KeyError):
                failed, ok, late = True, False, False
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            dt = time.perf_counter() - t0
            if timeline is not None:
                used = answer["results"][0]["parties"] if ok else []
                with lock:
                    timeline.append((time.monotonic(), failed, used))
            with lock:
                latencies.append(dt)
                counts["errors"] += failed
                counts["not_predicted"] += not failed and not ok
                counts["timed_out"] += late
        conn.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = np.asarray(latencies) * 1000
    return {"concurrency": concurrency, "deadline_ms": deadline_ms, "seconds": round(wall, 2), **counts,
            "p50_ms": round(float(np.percentile(lat, 50)), 2) if lat.size else None,
            "p99_ms": round(float(np.percentile(lat, 99)), 2) if lat.size else None,
            "predictions_per_s": round((counts["requests"] - counts["errors"] - counts["not_predicted"]) / wall, 1)}


def service_kw(args: argparse.Namespace) -> dict[str, Any]:
    """Where the service processes run from (``--service-root``, ``--service-python``)."""
    return {"root": Path(args.service_root).resolve(), "python": args.service_python}


def run_method(method: str, dep: LocalDeployment | None, work: Path, ids: list[str], labels: dict[str, Any],
               args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    federated = [c for c in ("on-time", "killed", "delayed") if c in args.cases]
    if federated:
        assert dep is not None
        rows += federated_cases(method, dep, work, ids, labels, args, federated)
    if "in-process" in args.cases:
        rows.append({"method": method, "case": IN_PROCESS, **in_process(method, work, ids, args)})
        print(rows[-1], file=sys.stderr)
    return rows


def federated_cases(method: str, dep: LocalDeployment, work: Path, ids: list[str], labels: dict[str, Any],
                    args: argparse.Namespace, cases: list[str]) -> list[dict[str, Any]]:
    model = work / f"model-{method}"
    fit_s = fit_federated(dep, method, model, args.seed)
    print(f"{method}: fitted across the parties in {fit_s:.1f} s", file=sys.stderr)
    rows = []
    answers: list[tuple[str, Any, list[str]]] = []
    with DelayProxy(f"127.0.0.1:{dep.ports[SLOW]}") as proxy:
        fed_file = work / f"federation-{method}.toml"
        fed_file.write_text(dep.federation_file.read_text().replace(f"127.0.0.1:{dep.ports[SLOW]}", proxy.address))
        service = ServiceProcess(model, fed_file, work, **service_kw(args))
        try:
            load(service.port, ids, 4, 2.0, 200, None, args.seed)  # warm-up, not reported
            for c in args.concurrency if "on-time" in cases else ():
                before = scrape(service.port)
                rows.append({"method": method, "case": "all parties on time",
                             **load(service.port, ids, c, args.seconds, args.max_requests, None, args.seed)})
                rows[-1]["spans"] = breakdown(before, scrape(service.port), PARTIES)
                print(rows[-1], file=sys.stderr)
            if "killed" in cases:
                rows.append({"method": method, "case": f"{PARTIES[KILLED]} killed and restarted",
                             **killed_and_restarted(dep, service.port, ids, args)})
                print(rows[-1], file=sys.stderr)
                service.wait_ready(ids[0])  # the next case starts with every party in the service's session
            if "delayed" in cases:
                proxy.delay = args.delay_ms / 1000
                before = scrape(service.port)
                rows.append({"method": method, "case": f"{PARTIES[SLOW]} delayed {args.delay_ms:g} ms",
                             **load(service.port, ids, args.slow_concurrency, args.seconds, args.max_requests,
                                    args.deadline_ms, args.seed, answers)})
                rows[-1]["spans"] = breakdown(before, scrape(service.port), PARTIES)
                if rows[-1]["errors"]:
                    print("errors in the service's log:", *service.errors(), sep="\n  ", file=sys.stderr)
        finally:
            proxy.delay = 0.0
            service.stop()
            # the service's goodbye to the telco went through the proxy behind bytes it still holds back: let them
            # arrive (else the telco still serves the service's session and refuses the offline check's hello)
            time.sleep(args.delay_ms / 1000 + 1.0)
    if "delayed" in cases:
        rows[-1].update(accuracy_without_slow(dep, model, answers, labels))
        print(rows[-1], file=sys.stderr)
    return rows


IN_PROCESS = "in process (--table): HTTP and batching only"
FLOOR = "no-op endpoint (FastAPI on uvicorn): the floor"


def in_process(method: str, work: Path, ids: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The same method fitted in process on the same tables and served with ``--table`` (no party processes, no
    gRPC): what the HTTP stack and the micro-batching cost on this machine, at ``--slow-concurrency`` clients."""
    train = work / "example" / "train"
    tables = {p: train / f"{p}.csv" for p in PARTIES}
    data = from_tables(tables, id_column="customer_id", label_column="defaulted", active_party="bank")
    model = work / f"model-{method}-in-process"
    get_method(method)("fast", seed=args.seed).fit(data).save(model)
    service = ServiceProcess(model, None, work, tables=tables, **service_kw(args))
    try:
        load(service.port, ids, 4, 2.0, 200, None, args.seed)  # warm-up, not reported
        before = scrape(service.port)
        row = load(service.port, ids, args.slow_concurrency, args.seconds, args.max_requests, None, args.seed)
        return {**row, "spans": breakdown(before, scrape(service.port), PARTIES)}
    finally:
        service.stop()


def floor(work: Path, ids: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The no-op endpoint (:mod:`serve_noop`) under the same load generator, at 1 and ``--slow-concurrency``
    clients."""
    service = ServiceProcess(None, None, work, name="noop", command=[
        sys.executable, str(Path(__file__).resolve().parent / "serve_noop.py")])
    rows = []
    try:
        load(service.port, ids, 4, 2.0, 200, None, args.seed)  # warm-up, not reported
        for c in sorted({1, args.slow_concurrency}):
            rows.append({"method": "-", "case": FLOOR, **load(service.port, ids, c, args.seconds, args.max_requests,
                                                               None, args.seed)})
            print(rows[-1], file=sys.stderr)
    finally:
        service.stop()
    return rows


def targets(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """The issue's targets as ratios of this run's rows (issue 34): in process against the floor, federated against
    in process, the late party's p99 against the deadline plus the in-process p99."""
    c = args.slow_concurrency

    def row(method: str, case: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["method"] == method and r["case"] == case and r["concurrency"] == c), None)

    out = []
    base = row("-", FLOOR)
    for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "-"):
        local = row(method, IN_PROCESS)
        fed = row(method, "all parties on time")
        late = row(method, f"{PARTIES[SLOW]} delayed {args.delay_ms:g} ms")
        if local and base:
            share, p99 = local["predictions_per_s"] / base["predictions_per_s"], local["p99_ms"] / base["p99_ms"]
            out.append(f"{method}, in process at {c} clients: {share:.0%} of the floor's throughput (target >= 60 %), "
                       f"p99 {p99:.2f}x the floor's (target <= 2x)")
        if local and fed:
            share, p50 = fed["predictions_per_s"] / local["predictions_per_s"], fed["p50_ms"] / local["p50_ms"]
            out.append(f"{method}, federated at {c} clients: {share:.0%} of the in-process throughput (target >= "
                       f"60 %), p50 {p50:.2f}x the in-process p50 (target <= 1.5x)")
        if local and late:
            bound = args.deadline_ms + local["p99_ms"]
            out.append(f"{method}, {late['case']} with a {args.deadline_ms:g} ms deadline: p99 {late['p99_ms']} ms "
                       f"against deadline + in-process p99 = {bound:.1f} ms (target: at most that)")
    return out


def killed_and_restarted(dep: LocalDeployment, port: int, ids: list[str], args: argparse.Namespace
                         ) -> dict[str, Any]:
    """Load at ``--slow-concurrency`` for ``--seconds`` (at least 20 s: a restarted process takes seconds to listen,
    and the rejoin seconds more) while the shop's party process is killed
    (SIGKILL) a quarter of the way in and started again (the same port, a new process) at half-time; reports the
    load's figures, the failed requests, and how long after the restarted process listened the first answer used
    it again."""
    seconds = max(args.seconds, 20.0)
    timeline: list[tuple[float, bool, list[str]]] = []
    marks: dict[str, float] = {}

    def chaos() -> None:
        time.sleep(seconds / 4)
        dep.kill(KILLED)
        marks["killed"] = time.monotonic()
        time.sleep(seconds / 4)
        dep.start([KILLED])  # returns once the new process listens
        marks["listening"] = time.monotonic()

    t = threading.Thread(target=chaos)
    t.start()
    figures = load(port, ids, args.slow_concurrency, seconds, args.max_requests, None, args.seed,
                   timeline=timeline)
    t.join()
    name = PARTIES[KILLED]
    back = marks.get("listening")
    after = sorted(when for when, failed, used in timeline if back is not None and when >= back and name in used)
    last_before = max((when for when, _, used in timeline if name in used and when < marks.get("killed", 0)),
                      default=None)
    return {**figures, "failed_while_down": sum(f for when, f, _ in timeline
                                                if marks.get("killed", 0) <= when < (back or 0)),
            "used_again_after_s": round(after[0] - back, 3) if after else None,
            "last_use_before_kill_s": None if last_before is None else round(marks["killed"] - last_before, 3)}


def accuracy_without_slow(dep: LocalDeployment, model_dir: Path, answers: list[tuple[str, Any, list[str]]],
                          labels: dict[str, Any]) -> dict[str, Any]:
    """Accuracy of the service's answers that went without the slow party, over the labelled IDs, beside the
    accuracy of the same IDs predicted offline (``predict --federation``'s path) with the slow party's blocks
    missing; and how many answers differ from the offline class."""
    served = {i: (c, p) for i, c, p in answers if i in labels and PARTIES[SLOW] not in p}
    if not served:
        return {"labelled_answers": 0}
    fed = dep.federation(allow_absent=True)
    try:
        model = get_method(json.loads((model_dir / "model.json").read_text())["method"]).load(model_dir,
                                                                                              federation=fed)
        id_list = sorted(served)
        view, handle = fed.attach_ids(id_list, task=model.index_.task)
        view.observed[:, SLOW] = False
        out = model.predict_output_federated(view, handle)
        fed.release(handle)
    finally:
        fed.close()
    classes = list(model.index_.task.classes)
    offline = {i: classes[int(np.argmax(out[j]))] for j, i in enumerate(id_list)}
    mask = view.observed.any(axis=1)
    kept = [i for j, i in enumerate(id_list) if mask[j]]
    return {"labelled_answers": sum(1 for i, _, p in answers if i in labels and PARTIES[SLOW] not in p),
            "labelled_ids": len(kept),
            "accuracy_served": round(float(np.mean([served[i][0] == labels[i] for i in kept])), 4),
            "accuracy_offline_without_slow": round(float(np.mean([offline[i] == labels[i] for i in kept])), 4),
            "differ_from_offline": sum(served[i][0] != offline[i] for i in kept)}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| method | case | concurrency | deadline | requests | errors | not predicted | slow party timed out | "
            "p50 ms | p99 ms | predictions/s |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        deadline = "-" if r["deadline_ms"] is None else f"{r['deadline_ms']:g} ms"
        lines.append(f"| {r['method']} | {r['case']} | {r['concurrency']} | {deadline} | {r['requests']} | "
                     f"{r['errors']} | {r['not_predicted']} | {r['timed_out']} | {r['p50_ms']} | {r['p99_ms']} | "
                     f"{r['predictions_per_s']} |\n")
    return head + "".join(lines)


def spans_table(rows: list[dict[str, Any]]) -> str:
    """Where each case's batches spent their time (the service's span metrics; empty for a service without
    them)."""
    head = ("| method | case | batches | queue ms (mean) | batch ms (p50 / mean) | coordinator ms | party compute ms | "
            "wire ms | wire / batch | " + " | ".join(f"{p} compute / wire ms per call" for p in PARTIES) + " |\n|"
            + "---|" * (9 + len(PARTIES)) + "\n")
    lines = []
    for r in rows:
        sp = r.get("spans") or {}
        if not sp:
            continue
        def get(key: str, sp: dict[str, Any] = sp) -> Any:
            return sp.get(key, "-")

        share = f"{sp['wire_ms_mean'] / sp['batch_ms_mean']:.0%}" if "wire_ms_mean" in sp else "-"
        per_party = " | ".join(f"{get(f'{p}_compute_ms_per_call')} / {get(f'{p}_wire_ms_per_call')}"
                               for p in PARTIES)
        lines.append(f"| {r['method']} | {r['case']} | {sp['batches']} | {sp['queue_ms_mean']} | "
                     f"{sp['batch_ms_p50']} / {sp['batch_ms_mean']} | {get('coordinator_ms_mean')} | "
                     f"{get('party_compute_ms_mean')} | {get('wire_ms_mean')} | {share} | {per_party} |\n")
    return head + "".join(lines) if lines else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["laser-vfl", "false-vfl-1"])
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                   help="which cases to run (default: all): the no-op floor, every party on time, a party killed and "
                        "restarted, a party delayed, in process")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--slow-concurrency", type=int, default=16)
    p.add_argument("--seconds", type=float, default=10.0, help="per case (default: %(default)s)")
    p.add_argument("--max-requests", type=int, default=200_000, help="per case (default: %(default)s)")
    p.add_argument("--delay-ms", type=float, default=200.0)
    p.add_argument("--deadline-ms", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-kill", action="store_true", help="skip the case that kills a party and restarts it")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="work in DIR and keep it (the parties' and the service's logs, the models)")
    p.add_argument("--no-in-process", action="store_true", help="skip the in-process (--table) case")
    p.add_argument("--service-root", default=str(ROOT), metavar="DIR",
                   help="run `partialvfl serve` from this checkout's src (default: this one): another version under "
                        "the same load generator")
    p.add_argument("--service-python", default=sys.executable, metavar="PYTHON",
                   help="... with this Python (default: this one)")
    p.add_argument("--json", default=None, help="write the rows and the machine here")
    args = p.parse_args()
    args.cases = [c for c in args.cases if not (c == "killed" and args.no_kill)
                  and not (c == "in-process" and args.no_in_process)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        d = example_tables(work / "example", args.seed)
        data = from_tables({k: d / "train" / f"{k}.csv" for k in PARTIES}, id_column="customer_id",
                           label_column="defaulted", active_party="bank")
        ids = [str(i) for i in data.ids]
        classes = list(data.task.classes)
        labels = {str(i): classes[int(y)] for i, y, lab in zip(data.ids, data.y, data.labeled) if lab}
        rows = floor(work, ids, args) if "floor" in args.cases else []
        if any(c in args.cases for c in ("on-time", "killed", "delayed")):
            with LocalDeployment(work / "fed", data, deadline=120.0, start_timeout=600.0) as dep:
                dep.start()
                rows += [r for m in args.methods for r in run_method(m, dep, work, ids, labels, args)]
        else:
            rows += [r for m in args.methods for r in run_method(m, None, work, ids, labels, args)]
    machine = {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
               "python": platform.python_version(), "load_average": os.getloadavg()}
    print(table(rows))
    spans = spans_table(rows)
    if spans:
        print("Where the batches spent their time (the service's span metrics; ms per batch along its critical "
              "path: coordinator + party compute + wire = batch):\n")
        print(spans)
    for r in rows:
        if "accuracy_served" in r:
            print(f"{r['method']}, {r['case']}: accuracy of the answers without {PARTIES[SLOW]} "
                  f"{r['accuracy_served']} over {r['labelled_ids']} labelled customers; offline without "
                  f"{PARTIES[SLOW]} {r['accuracy_offline_without_slow']}; answers that differ: "
                  f"{r['differ_from_offline']}")
    for r in rows:
        if "used_again_after_s" in r:
            print(f"{r['method']}, {r['case']}: {r['errors']} failed requests ({r['failed_while_down']} while it was "
                  f"down); the first answer using it again came {r['used_again_after_s']} s after the new process "
                  "listened")
    for line in targets(rows, args):
        print(line)
    print(f"machine: {machine}; service from {args.service_root} ({args.service_python})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "machine": machine, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
