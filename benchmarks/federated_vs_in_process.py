"""Is the federated model the in-process one?  The own-data example fitted both ways, method by method.

The worked example of ``docs/own-data.md`` (``scripts/make_example_tables.py``: a bank holding the labels, a shop
and a telco, partly overlapping customers) is fitted twice with the same seed: in this process on the tables
ordered by the federation's key (what ``partialvfl fit --table ... --hmac-key`` does), and across real party
processes (one ``partialvfl party serve`` per table, mutual TLS, each party's ``[policy] seed`` pinned to the same
seed, as in the doc).  Every training customer is then predicted by both models.  Printed per method: how many
customers get the same class, the largest difference of a class probability, and the first epoch whose loss
differs (relative 1e-6), if any.

    python benchmarks/federated_vs_in_process.py                       # false-vfl-1 and laser-vfl, 1500 customers
    python benchmarks/federated_vs_in_process.py --methods false-vfl-2 x-vfl fedhssl --json out.json
    python benchmarks/federated_vs_in_process.py --per-party           # in process without batched parties

Issue 21 (item 4) reported FALSE-VFL-I at 393 of 400 classes equal and a largest difference of 0.47; this command
gives the figure on the doc's example before and after its fix (``docs/false-vfl.md``, "In process, each party
answers alone").  The parties align by HMAC (``alignment = "hmac"``), whose sample order ``from_tables(...,
order_key=...)`` reproduces in process; the default private set union orders by its session's tokens instead.
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
import torch

from partialvfl.data.builders import from_tables
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.runtime.coordinator import LocalFederation
from partialvfl.methods import get_method
from partialvfl.orchestration.predict import PredictOptions, run_predict

ROOT = Path(__file__).resolve().parents[1]
PARTIES = ("bank", "shop", "telco")
KEYS = {"id_column": "customer_id", "label_column": "defaulted", "active_party": "bank"}


def write_tables(directory: Path, seed: int, n_train: int) -> dict[str, Path]:
    """The example's training tables (``scripts/make_example_tables.py``), one CSV per institution."""
    spec = importlib.util.spec_from_file_location("make_example_tables", ROOT / "scripts" / "make_example_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write(directory, seed=seed, n_train=n_train, n_new=max(1, n_train // 5))
    return {p: directory / "train" / f"{p}.csv" for p in PARTIES}


def first_differing_epoch(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int | None:
    """Index of the first history entry whose loss differs by more than 1e-6 relative, ``None`` if none does."""
    for i, (x, y) in enumerate(zip(a, b)):
        lx, ly = x.get("loss"), y.get("loss")
        if (lx is None) != (ly is None) or (lx is not None and abs(lx - ly) > 1e-6 * max(1.0, abs(lx))):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(method: str, params: dict[str, Any], seed: int, local: Any, dep: LocalDeployment,
            per_party: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    fed_local = LocalFederation.for_dataset(local, batched=False) if per_party else None
    m_local = get_method(method)("fast", seed=seed, **params).fit(local, federation=fed_local)
    p_local = m_local.predict_proba(local)
    t1 = time.perf_counter()
    fed = dep.federation()
    try:
        view, handle = fed.align()
        m_fed = get_method(method)("fast", seed=seed, **params).fit_federated(fed, view, handle)
        fed.release(handle)
        p_fed = run_predict(m_fed, local.ids, PredictOptions(allow_prior_only=True)).output
    finally:
        fed.close()
    t2 = time.perf_counter()
    rows = local.observed.any(axis=1)  # customers some party holds (the others get the label prior on both sides)
    same = int((p_local[rows].argmax(1) == p_fed[rows].argmax(1)).sum())
    return {"method": method, "classes_equal": same, "customers": int(rows.sum()),
            "largest_probability_difference": float(np.abs(p_local - p_fed).max()),
            "first_epoch_loss_differs": first_differing_epoch(m_local.history_, m_fed.history_),
            "epochs": len(m_local.history_), "seconds_in_process": round(t1 - t0, 1),
            "seconds_federated": round(t2 - t1, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["false-vfl-1", "laser-vfl"])
    ap.add_argument("--train", type=int, default=1500, help="training customers of the example (default 1500)")
    ap.add_argument("--table-seed", type=int, default=0, help="seed of the example tables")
    ap.add_argument("--seed", type=int, default=0, help="the fits' seed (and every party's pinned seed)")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=JSON",
                    help="a method parameter for every method, e.g. --param pretrain_epochs=10")
    ap.add_argument("--per-party", action="store_true", help="in process, answer each party alone (no batching)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    params = {k: json.loads(v) for k, v in (p.split("=", 1) for p in a.param)}
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        tables = write_tables(Path(tmp) / "example", a.table_seed, a.train)
        raw = from_tables(tables, **KEYS)  # each party standardises its own columns on both sides
        with LocalDeployment(Path(tmp) / "fed", raw, deadline=600.0, start_timeout=600.0,
                             policy={"seed": a.seed, "max_width_ratio": 16, "max_setup_width_ratio": 64,
                                     "allow_weight_sharing": True, "allow_likelihood_release": True},
                             alignment="hmac") as dep:
            dep.start()
            local = from_tables(tables, order_key=dep.key_file, **KEYS)  # the federation's sample order
            for method in a.methods:
                r = compare(method, params, a.seed, local, dep, a.per_party)
                out.append(r)
                print(f"{method}: classes equal {r['classes_equal']}/{r['customers']}, largest probability difference "
                      f"{r['largest_probability_difference']:.3g}, first epoch whose loss differs: "
                      f"{r['first_epoch_loss_differs']} of {r['epochs']} (fits {r['seconds_in_process']} s in "
                      f"process, {r['seconds_federated']} s federated)", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"argv": sys.argv[1:], "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
