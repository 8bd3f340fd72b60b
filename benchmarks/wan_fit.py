"""Fits between institutions: every party behind a proxy that holds back what the coordinator sends it (200 ms per
round trip by default), round trips counted, before and after in one run.

The own-data example (``scripts/make_example_tables.py``, 1,500 training customers, seed 0) is served by three
``partialvfl party serve`` processes (mutual TLS, research policy: seeded by the coordinator, so that the schedules'
weights can be compared); the coordinator runs :func:`partialvfl.orchestration.run_fit` (connect, align, fit: what
``partialvfl fit --federation`` runs) once on loopback and once with each party reached through a
:class:`~partialvfl.federation.grpc.delay_proxy.DelayProxy` of ``--delay-ms``.  Per case it prints the round trips the
coordinator waited for one after another (distinct step and round of its requests; a round's requests to the
parties travel side by side), those of the training steps alone and per step, the seconds on loopback and through
the proxy, and the round trips the extra seconds stand for.  The cases of a method are the schedules of its
``rounds`` parameter: ``sequential`` (two round trips per step: the schedule before piggy-backing, the "before"),
``piggyback`` (the default, the "after", whose predictions must equal ``sequential``'s to the bit), ``stale`` with
``--stale-steps`` (opt in).  Accuracy against rounds per epoch of the opt-in schedule is measured in process (the same
arithmetic) by ``--accuracy``: on the example's new customers and on digits.

    python benchmarks/wan_fit.py                                  # LASER-VFL 5 epochs and FALSE-VFL-I 3 + 3
    python benchmarks/wan_fit.py --methods laser-vfl --delay-ms 50
    python benchmarks/wan_fit.py --accuracy --seeds 0 1 2         # the stale schedule's accuracy, in process
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.data.builders import from_tables
from partialvfl.federation import MessageLog
from partialvfl.federation.grpc.delay_proxy import DelayProxy
from partialvfl.federation.grpc.federation import GrpcFederation
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.methods import get_method
from partialvfl.orchestration import run_fit
from serve_load import example_tables  # the same tables as the serving benchmark

ROOT = Path(__file__).resolve().parents[1]
PARTIES = ("bank", "shop", "telco")
#: per method: the fit (fast preset), and the schedules compared ("before" first)
FITS: dict[str, dict[str, Any]] = {
    "laser-vfl": {"params": {"epochs": 5}, "schedules": ["sequential", "piggyback", "stale"]},
    "false-vfl-1": {"params": {"pretrain_epochs": 3, "epochs": 3}, "schedules": [None]},
}


def schedule_params(method: str, rounds: str | None, stale_steps: int) -> dict[str, Any]:
    params = dict(FITS[method]["params"])
    if rounds is not None:
        params["rounds"] = rounds
        if rounds == "stale":
            params["stale_steps"] = stale_steps
    return params


def one_fit(federation_file: Path, method: str, params: dict[str, Any], seed: int) -> dict[str, Any]:
    """``run_fit`` across the federation of ``federation_file``: seconds, round trips (all, and of the training
    steps), training steps, and the predictions of every aligned row (to compare schedules)."""
    log = MessageLog()
    fed = GrpcFederation.from_config(federation_file, log=log, connect=False)
    try:
        model = get_method(method)("fast", seed=seed, **params)
        t0 = time.perf_counter()
        result = run_fit(model, fed)
        seconds = time.perf_counter() - t0
        steps = {e.step for e in log if e.kind in ("grad_embedding", "update", "decode")}
        step_trips = len({(e.step, e.round) for e in log if e.direction == "request" and e.step in steps})
        trips = log.round_trips()
        view, handle = fed.align(handle="check")
        proba = result.model.predict_output_federated(view, handle)
        fed.release(handle)
        order = np.argsort(np.asarray([str(i) for i in view.ids], dtype=object))
        return {"seconds": round(seconds, 2), "round_trips": trips, "step_round_trips": step_trips,
                "steps": len(steps), "per_step": round(step_trips / max(len(steps), 1), 3),
                "proba": proba[order]}
    finally:
        fed.close()


def fit_cases(dep: LocalDeployment, work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    proxies = [DelayProxy(f"127.0.0.1:{dep.ports[k]}") for k in range(len(PARTIES))]
    try:
        text = dep.federation_file.read_text()
        for k, proxy in enumerate(proxies):
            text = text.replace(f"127.0.0.1:{dep.ports[k]}", proxy.address)
        wan_file = work / "federation-wan.toml"
        wan_file.write_text(text)
        for method in args.methods:
            reference, batches = None, None
            one_fit(dep.federation_file, method, schedule_params(method, None, 1), args.seed)  # warm-up, not reported
            for rounds in FITS[method]["schedules"]:
                params = schedule_params(method, rounds, args.stale_steps)
                loop = one_fit(dep.federation_file, method, params, args.seed)
                for p in proxies:
                    p.delay = args.delay_ms / 1000
                try:
                    wan = one_fit(wan_file, method, params, args.seed)
                finally:
                    for p in proxies:
                        p.delay = 0.0
                    time.sleep(args.delay_ms / 1000 + 0.5)  # the goodbyes still held back by the proxies arrive
                same = None
                batches = batches or wan["steps"]  # the first schedule's steps are batches (stale: groups of them)
                if rounds == "sequential":
                    reference = wan["proba"]
                elif reference is not None and rounds == "piggyback":
                    same = bool(np.array_equal(wan["proba"], reference))
                extra = wan["seconds"] - loop["seconds"]
                row = {"method": method, "rounds": rounds or "(its own)", **{k: v for k, v in params.items()},
                       "round_trips": wan["round_trips"], "step_round_trips": wan["step_round_trips"],
                       "steps": batches, "per_step": round(wan["step_round_trips"] / batches, 3),
                       "loopback_s": loop["seconds"],
                       "wan_s": wan["seconds"], "ratio": round(wan["seconds"] / loop["seconds"], 2),
                       "trips_from_time": round(extra / (args.delay_ms / 1000), 1),
                       "predictions_equal_sequential": same,
                       "loopback_equals_wan": bool(np.array_equal(loop["proba"], wan["proba"]))}
                rows.append(row)
                print({k: v for k, v in row.items()}, file=sys.stderr)
    finally:
        for p in proxies:
            p.close()
    return rows


def fit_table(rows: list[dict[str, Any]], delay_ms: float) -> str:
    head = (f"| method | rounds | round trips (all) | of training steps | training steps | per step | loopback s | "
            f"{delay_ms:g} ms per round trip s | ratio | round trips by the time | predictions = sequential |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        rounds = r["rounds"] + (f" ({r['stale_steps']})" if r["rounds"] == "stale" else "")
        same = "-" if r["predictions_equal_sequential"] is None else ("yes" if r["predictions_equal_sequential"]
                                                                       else "NO")
        lines.append(f"| {r['method']} | {rounds} | {r['round_trips']} | {r['step_round_trips']} | {r['steps']} | "
                     f"{r['per_step']} | {r['loopback_s']} | {r['wan_s']} | {r['ratio']} | {r['trips_from_time']} | "
                     f"{same} |\n")
    return head + "".join(lines)


# ---------------------------------------------------------------------- accuracy of the opt-in schedule
def accuracy_rows(work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """In process: LASER-VFL's test accuracy by schedule (rounds per epoch), on the example's new customers (the
    bank's outcomes) and on digits (4 parties, 500 labels, 100 aligned, MCAR 0.2; test MCAR 0)."""
    from partialvfl.methods.evaluation import evaluate

    d = work / "example"
    train = from_tables({p: d / "train" / f"{p}.csv" for p in PARTIES}, id_column="customer_id",
                        label_column="defaulted", active_party="bank")
    test = from_tables({"bank": d / "outcomes" / "bank.csv", "shop": d / "new" / "shop.csv",
                        "telco": d / "new" / "telco.csv"}, id_column="customer_id", label_column="defaulted",
                       active_party="bank")
    sets = {"own-data": (train, test, {"epochs": 5}), "digits": (*digits_split(args.seed), {})}
    rows = []
    for name, (tr, te, base) in sets.items():
        for rounds, q in [("piggyback", 1), *[("stale", q) for q in args.stale_grid]]:
            params = {**base, "rounds": rounds, **({"stale_steps": q} if rounds == "stale" else {})}
            accs, trips, steps = [], [], []
            for seed in args.seeds:
                log = MessageLog()
                model = get_method("laser-vfl")("fast", seed=seed, **params).fit(tr, log=log)
                accs.append(float(evaluate(model, te)["accuracy"]))
                train_steps = {e.step for e in log if e.kind == "grad_embedding"}
                trips.append(len({(e.step, e.round) for e in log if e.direction == "request"
                                  and (e.step in train_steps or e.kind == "embed")}))
                steps.append(len(train_steps) * q if rounds == "stale" else len(train_steps))
            epochs = model.settings_.epochs
            rows.append({"data": name, "rounds": rounds, "stale_steps": q, "epochs": epochs,
                         "round_trips_per_epoch": round(float(np.mean(trips)) / epochs, 1),
                         "accuracy_mean": round(float(np.mean(accs)), 4), "accuracy_min": round(min(accs), 4),
                         "accuracy_max": round(max(accs), 4), "seeds": list(args.seeds)})
            print(rows[-1], file=sys.stderr)
    return rows


def digits_split(seed: int) -> tuple[Any, Any]:
    """Digits as the docs' examples use it: 4 parties, 500 labels, 100 aligned, MCAR 0.2 in training, none at test."""
    from partialvfl.data.protocol import ProtocolConfig, make_protocol

    return make_protocol(ProtocolConfig(dataset="digits", parties=4, n_labels=500, n_aligned=100,
                                        train_missing="mcar:0.2", test_missing="mcar:0", seed=seed))


def accuracy_table(rows: list[dict[str, Any]]) -> str:
    head = ("| data | rounds | steps per round trip | round trips per epoch | accuracy (mean) | min | max |\n"
            "|---|---|---|---|---|---|---|\n")
    return head + "".join(f"| {r['data']} | {r['rounds']} | {r['stale_steps']} | {r['round_trips_per_epoch']} | "
                          f"{r['accuracy_mean']:.4f} | {r['accuracy_min']:.4f} | {r['accuracy_max']:.4f} |\n"
                          for r in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=list(FITS), choices=list(FITS))
    p.add_argument("--delay-ms", type=float, default=200.0, help="per round trip (default: %(default)s)")
    p.add_argument("--stale-steps", type=int, default=4, help="the stale case's steps per round trip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fits", action="store_true", help="skip the fits over the proxy")
    p.add_argument("--accuracy", action="store_true", help="also the stale schedule's accuracy, in process")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="method seeds of --accuracy")
    p.add_argument("--stale-grid", nargs="+", type=int, default=[2, 4, 8], help="stale_steps of --accuracy")
    p.add_argument("--json", default=None, help="write the rows and the machine here")
    args = p.parse_args()
    out: dict[str, Any] = {"args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        example_tables(work / "example", args.seed)
        if not args.no_fits:
            data = from_tables({k: work / "example" / "train" / f"{k}.csv" for k in PARTIES},
                               id_column="customer_id", label_column="defaulted", active_party="bank")
            with LocalDeployment(work / "fed", data, deadline=120.0, start_timeout=600.0) as dep:
                dep.start()
                out["fits"] = fit_cases(dep, work, args)
        if args.accuracy:
            out["accuracy"] = accuracy_rows(work, args)
    out["machine"] = {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                      "python": platform.python_version(), "load_average": os.getloadavg()}
    if "fits" in out:
        print(fit_table(out["fits"], args.delay_ms))
    if "accuracy" in out:
        print(accuracy_table(out["accuracy"]))
    print(f"machine: {out['machine']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
