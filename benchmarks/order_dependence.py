"""Does a customer's score depend on who else is in the request?  The same new users predicted in three orders.

The worked example of ``docs/own-data.md`` (``scripts/make_example_tables.py``) is served by real party processes
(one ``partialvfl party serve`` per institution, mutual TLS, the new customers in every party's prediction table
``new-users``, as in the doc); a model is fitted across them, then the same new customers are predicted with
``partialvfl predict --federation --table-set new-users`` semantics (:func:`~partialvfl.orchestration.predict.
run_predict`) three times: IDs sorted, reversed and shuffled.  The same model fitted in this process (on the tables
ordered by the federation's key, as ``fit --table --hmac-key`` does) predicts the same users too, in the same three
orders and in one request per user.  Printed: each run's accuracy against the outcomes
(``outcomes/defaulted.csv``), how many users get another class than in the first run, and the largest probability
difference to it.

    python benchmarks/order_dependence.py                          # false-vfl-1, 400 new users
    python benchmarks/order_dependence.py --method false-vfl-2 --param wire=bound --json out.json

Issue 34 (item 2) reported 95.25 / 94.75 / 95.00 % over three orders of 400 users on an institution's six-party
tables (FALSE-VFL drew its importance samples with one seed per batch); each row's samples now come from the model's
seed and the user's ID, so every run gives every user the same answer.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from partialvfl.data.builders import from_tables
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.methods import get_method
from partialvfl.orchestration.predict import PredictOptions, run_predict

ROOT = Path(__file__).resolve().parents[1]
PARTIES = ("bank", "shop", "telco")
KEYS = {"id_column": "customer_id", "label_column": "defaulted", "active_party": "bank"}


def write_tables(directory: Path, seed: int, n_train: int, n_new: int) -> None:
    """The example's tables (``scripts/make_example_tables.py``): train/, new/, outcomes/."""
    spec = importlib.util.spec_from_file_location("make_example_tables", ROOT / "scripts" / "make_example_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write(directory, seed=seed, n_train=n_train, n_new=n_new)


def parse_params(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def compare_runs(runs: dict[str, np.ndarray], truth: np.ndarray) -> dict[str, Any]:
    """Per run: accuracy against ``truth``; against the first run: classes that differ, largest difference."""
    first = next(iter(runs.values()))
    out = {}
    for name, p in runs.items():
        out[name] = {"accuracy": float((p.argmax(1) == truth).mean()),
                     "classes_differing": int((p.argmax(1) != first.argmax(1)).sum()),
                     "largest_difference": float(np.abs(p - first).max())}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="false-vfl-1")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="method parameters (default: pretrain_epochs=10 epochs=5)")
    parser.add_argument("--users", type=int, default=400, help="new users to predict")
    parser.add_argument("--train", type=int, default=1500, help="training customers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()
    params = {"pretrain_epochs": 10, "epochs": 5, **parse_params(args.param)}
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        write_tables(d, args.seed, args.train, int(args.users * 1.15))
        train = from_tables({p: d / "train" / f"{p}.csv" for p in PARTIES}, **KEYS)
        # the bank's new customers with their outcomes: a label column (unused) that the deployment's tables need
        new = from_tables({"bank": d / "outcomes" / "bank.csv", "shop": d / "new" / "shop.csv",
                           "telco": d / "new" / "telco.csv"}, **KEYS)
        outcomes = pd.read_csv(d / "outcomes" / "defaulted.csv").set_index("customer_id")["defaulted"]
        ids = np.array(sorted(int(i) for i in new.ids))[:args.users]
        truth = outcomes.loc[ids].to_numpy()
        rng = np.random.default_rng(args.seed)
        orders = {"sorted": np.arange(len(ids)), "reversed": np.arange(len(ids))[::-1],
                  "shuffled": rng.permutation(len(ids))}
        t0 = time.perf_counter()
        with LocalDeployment(d / "fed", train, predict={"new-users": new}, alignment="hmac",
                             deadline=600.0, start_timeout=600.0) as dep:
            dep.start()
            fed = dep.federation()
            try:
                view, handle = fed.align()
                model = get_method(args.method)("fast", seed=args.seed, **params).fit_federated(fed, view, handle)
                fed.release(handle)
                federated = {}
                for name, order in orders.items():
                    p = run_predict(model, ids[order].tolist(), PredictOptions(table_set="new-users")).output
                    federated[name] = p[np.argsort(order)]
            finally:
                fed.close()
            local_train = from_tables({p: d / "train" / f"{p}.csv" for p in PARTIES}, order_key=dep.key_file,
                                      **KEYS)
        t1 = time.perf_counter()
        local = get_method(args.method)("fast", seed=args.seed, **params).fit(local_train)
        position = {str(i): r for r, i in enumerate(new.ids)}
        rows = np.array([position[str(i)] for i in ids])
        in_process = {}
        for name, order in orders.items():
            in_process[name] = local.predict_proba(new.subset(rows[order]))[np.argsort(order)]
        in_process["one request per user"] = np.concatenate([local.predict_proba(new.subset(rows[i:i + 1]))
                                                            for i in range(len(rows))])
        t2 = time.perf_counter()

    report = {"method": args.method, "params": params, "users": len(ids),
              "federated": compare_runs(federated, truth), "in_process": compare_runs(in_process, truth),
              "federated_vs_in_process_largest_difference": float(np.abs(federated["sorted"]
                                                                         - in_process["sorted"]).max()),
              "federated_vs_in_process_classes_differing": int((federated["sorted"].argmax(1)
                                                                != in_process["sorted"].argmax(1)).sum()),
              "seconds": {"federated": round(t1 - t0, 1), "in_process": round(t2 - t1, 1)},
              "torch": torch.__version__}
    for where in ("federated", "in_process"):
        for name, r in report[where].items():
            print(f"{where:10s} {name:22s} accuracy {100 * r['accuracy']:.2f} %  classes differing from the "
                  f"first {r['classes_differing']:3d}  largest probability difference {r['largest_difference']:.3g}")
    print(f"federated vs in process (sorted): {report['federated_vs_in_process_classes_differing']} classes differ, "
          f"largest probability difference {report['federated_vs_in_process_largest_difference']:.3g}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
