"""Party tables of many users (issue 46): how long a fit and a prediction take and how much memory a party holds.

The own-data example's three institutions (``scripts/make_example_tables.py``: the bank 90 % of the users with
three features and the label for 30 % of them, the shop 70 % with two, the telco 60 % with three) at ``--users``
users, written as one Parquet table per party.  Two modes, each printing one JSON line:

* ``in-process``: ``partialvfl fit --table ... --method M`` then ``partialvfl predict`` on the same tables, each as
  its own process: seconds and peak resident memory (``ru_maxrss``) of each;
* ``federated``: the tables served by three ``partialvfl party serve`` processes (a :class:`LocalDeployment`, mutual
  TLS on loopback), aligned, fitted across them and every user predicted: seconds of each step and every party
  process's peak resident memory (``VmHWM``) after the fit and after the prediction.

``--epochs`` and ``--batch-size`` bound the training (the figure that matters here is memory; a default fit of
millions of users takes many thousands of steps); ``--alignment hmac`` aligns by keyed hashes (fast) instead of the
private set union (whose cost is measured by ``benchmarks/alignment.py``).  Before and after a change: run it with
``PYTHONPATH=OLD/src`` (the parties and the commands run that code too), then with this checkout.

    PYTHONPATH=src python benchmarks/large_table.py --users 300000 --mode in-process
    PYTHONPATH=src python benchmarks/large_table.py --users 5000000 --mode federated --alignment hmac --epochs 1 \\
        --batch-size 4096
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from alignment import peak_rss_mb  # benchmarks/alignment.py: a process's VmHWM

ROOT = Path(__file__).resolve().parents[1]
PARTIES = ("bank", "shop", "telco")


def example_module() -> Any:
    spec = importlib.util.spec_from_file_location("make_example_tables", ROOT / "scripts" / "make_example_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_tables(d: Path, users: int, seed: int) -> dict[str, Path]:
    """One Parquet table per party, the example's columns, ``users`` users in all (row groups of 256k rows)."""
    ex = example_module()
    rng = np.random.default_rng(seed)
    tables = ex.party_tables(rng, ex.customers(rng, users, 100_000), label="some")
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for party, df in tables.items():
        out[party] = d / f"{party}.parquet"
        df.to_parquet(out[party], index=False, row_group_size=262_144)
    return out


def timed_command(argv: list[str], log: Path) -> tuple[float, float]:
    """Run a command; its seconds and peak resident memory in MB (its own ``ru_maxrss``)."""
    t0 = time.perf_counter()
    with log.open("wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    if status:
        raise RuntimeError(f"{argv[:4]} failed: {log.read_text()[-2000:]}")
    return seconds, round(usage.ru_maxrss / 1024, 1)


def in_process(tables: dict[str, Path], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    cli = [sys.executable, "-m", "partialvfl"]
    where = [a for p, f in tables.items() for a in ("--table", f"{p}={f}")]
    extra = [] if args.epochs is None else ["--epochs", str(args.epochs)]
    extra += [] if args.batch_size is None else ["--param", f"batch_size={args.batch_size}"]
    fit_s, fit_rss = timed_command([*cli, "fit", *where, "--id-column", "customer_id", "--label", "defaulted",
                                    "--active", "bank", "--method", args.method, "--seed", "0",
                                    "--out", str(work / "model"), "--quiet", *extra], work / "fit.log")
    predict_s, predict_rss = timed_command([*cli, "predict", "--model", str(work / "model"), *where, "--out",
                                            str(work / "predictions.csv")], work / "predict.log")
    return {"fit_seconds": round(fit_s, 1), "fit_peak_rss_mb": fit_rss, "predict_seconds": round(predict_s, 1),
            "predict_peak_rss_mb": predict_rss}


def federated(tables: dict[str, Path], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from partialvfl.data.builders import from_tables
    from partialvfl.federation.grpc.local import LocalDeployment
    from partialvfl.methods import get_method

    t0 = time.perf_counter()
    data = from_tables(tables, id_column="customer_id", label_column="defaulted", active_party="bank")
    out: dict[str, Any] = {"build_seconds": round(time.perf_counter() - t0, 1)}
    kw: dict[str, Any] = {} if args.epochs is None else {"epochs": args.epochs}
    if args.batch_size is not None:
        kw["batch_size"] = args.batch_size
    # a party's attach of all its rows is one request of about 40 bytes per row (its token and its row, with the
    # label holder's labels): beyond the default [policy] max_peer_mb of 64, a party of millions of rows raises it
    limit_mb = max(64.0, 64.0 * (1 + args.users // 1_000_000))
    policy = {"preset": "research", "max_peer_mb": limit_mb}
    with LocalDeployment(work / "fed", data, deadline=1800.0, start_timeout=1800.0, max_message_mb=limit_mb,
                         alignment=args.alignment, policy=policy) as dep:
        del data  # the parties read their own tables
        t0 = time.perf_counter()
        dep.start()
        out["parties_start_seconds"] = round(time.perf_counter() - t0, 1)
        out["party_rss_after_start_mb"] = [peak_rss_mb(dep.procs[k].pid) for k in sorted(dep.procs)]
        fed = dep.federation()
        try:
            t0 = time.perf_counter()
            view, handle = fed.align()
            out["align_seconds"] = round(time.perf_counter() - t0, 1)
            t0 = time.perf_counter()
            model = get_method(args.method)("fast", seed=0, **kw).fit_federated(fed, view, handle)
            out["fit_seconds"] = round(time.perf_counter() - t0, 1)
            out["party_peak_rss_after_fit_mb"] = [peak_rss_mb(dep.procs[k].pid) for k in sorted(dep.procs)]
            t0 = time.perf_counter()
            proba = model.predict_output_federated(view, handle)
            out["predict_seconds"] = round(time.perf_counter() - t0, 1)
            out["predicted_rows"] = int(len(proba))
            out["party_peak_rss_after_predict_mb"] = [peak_rss_mb(dep.procs[k].pid) for k in sorted(dep.procs)]
            fed.release(handle)
        finally:
            fed.close()
    out["coordinator_peak_rss_mb"] = peak_rss_mb()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=300_000)
    ap.add_argument("--mode", choices=["in-process", "federated"], default="in-process")
    ap.add_argument("--method", default="laser-vfl")
    ap.add_argument("--alignment", choices=["psu", "hmac"], default="psu")
    ap.add_argument("--epochs", type=int, default=None, help="every epoch count of the method (default: its own)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", default=None, metavar="DIR", help="work in DIR and keep it")
    args = ap.parse_args()
    try:
        run(args)
    except BaseException:
        import traceback

        print(json.dumps({"users": args.users, "mode": args.mode, "failed": traceback.format_exc()[-3000:]}),
              flush=True)
        raise


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        t0 = time.perf_counter()
        tables = write_tables(work / "tables", args.users, args.seed)
        out: dict[str, Any] = {"users": args.users, "mode": args.mode, "method": args.method,
                               "rows": {p: pq.ParquetFile(f).metadata.num_rows for p, f in tables.items()},
                               "write_seconds": round(time.perf_counter() - t0, 1),
                               "load_before": round(os.getloadavg()[0], 2), "cpu_cores": os.cpu_count()}
        if args.mode == "in-process":
            out.update(in_process(tables, work, args))
        else:
            out.update(alignment=args.alignment, epochs=args.epochs, batch_size=args.batch_size,
                       **federated(tables, work, args))
        out["load_after"] = round(os.getloadavg()[0], 2)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
