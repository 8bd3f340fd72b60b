"""FALSE-VFL prediction against the number of importance samples L (the FALSE-VFL paper uses L = 50).

One FALSE-VFL fit on the cpu grid's FashionMNIST configuration (8 parties of 14 x 7 pixels, 4,000 training images,
1,000 labels of which 200 aligned, trained under MCAR 2; the grid's MLP parties of width 128 and its epochs), then
prediction of the same test images with L in {1, 10, 50, 200, 500} under each of the paper's 7 test mechanisms:
accuracy, prediction time, and the effective sample size (ESS) of the self-normalised importance weights,
``(sum w)^2 / sum w^2`` per test row (its median and its mean as a fraction of L).  Prediction draws its noise from
the model's seed, so every L sees the same fitted model; the spread over L at one seed is what L changes.

    python benchmarks/importance_samples.py                          # the cpu-grid setting, ~15 minutes on 2 cores
    python benchmarks/importance_samples.py --quick                  # a smoke run in about a minute
    python benchmarks/importance_samples.py --json out.json --method false-vfl-2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from partialvfl.bench.grid_file import load_grid
from partialvfl.bench.tables import md_table
from partialvfl.data.mechanisms import PAPER_TEST_MECHANISMS as TEST_MECHANISMS
from partialvfl.data.protocol import ProtocolConfig, make_protocol, with_test_mechanism
from partialvfl.data.sources import load_source
from partialvfl.methods import evaluate, get_method


def cpu_grid_params(method: str) -> dict[str, Any]:
    """The cpu grid's FashionMNIST configuration of ``method`` (src/partialvfl/bench/grids/cpu.toml), without L."""
    entry = next(m for m in load_grid("cpu").methods if m.name == method)
    params = dict(entry.overrides, **entry.dataset_overrides.get("fashion-mnist", {}))
    params.pop("predict_importance_samples", None)  # this benchmark sets L itself
    return params


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="false-vfl-1", choices=["false-vfl-1", "false-vfl-2"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", default="1,10,50,200,500", help="comma-separated L values")
    ap.add_argument("--train-missing", default="mcar2")
    ap.add_argument("--max-test", type=int, default=1000, help="test images per mechanism (the grid uses 2,000)")
    ap.add_argument("--quick", action="store_true", help="1,000 training images and 2 + 2 epochs (a smoke run)")
    ap.add_argument("--json", default=None, help="also write the results here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    config = ProtocolConfig(dataset="fashion-mnist", parties=8, n_labels=1000, n_aligned=200,
                            max_train=1000 if args.quick else 4000, max_test=500 if args.quick else args.max_test,
                            train_missing=args.train_missing, test_missing="mcar0", seed=args.seed)
    source = load_source(config.dataset)  # read once: every test mechanism's set is cut from it
    train, _ = make_protocol(config, source)
    params = dict(cpu_grid_params(args.method), **({"pretrain_epochs": 2, "epochs": 2} if args.quick else {}))
    model = get_method(args.method)("paper", seed=args.seed, **params)
    t0 = time.perf_counter()
    model.fit(train)
    fit_s = time.perf_counter() - t0
    print(f"{args.method} fit in {fit_s:.0f} s on {train!r}; {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, load {os.getloadavg()[0]:.1f}", flush=True)
    samples = [int(s) for s in args.samples.split(",")]
    rows: list[dict[str, Any]] = []
    for mech in TEST_MECHANISMS:
        test = with_test_mechanism(config, mech, source)
        for n in samples:
            model.params_ = {**model.params_, "predict_importance_samples": n}
            res = evaluate(model, test)
            ess = model.importance_ess(test)
            ess = ess[np.isfinite(ess)]
            rows.append({"test": mech, "L": n, "accuracy": res["accuracy"], "predict_seconds": res["predict_seconds"],
                         "ess_median": float(np.median(ess)), "ess_fraction": float(np.mean(ess) / n)})
            r = rows[-1]
            print(f"  {mech:6s} L={n:4d}: accuracy {100 * r['accuracy']:5.1f}  ESS median {r['ess_median']:6.1f} "
                  f"(mean {100 * r['ess_fraction']:5.1f} % of L)  predict {r['predict_seconds']:6.2f} s", flush=True)
    print("\naccuracy (%) by test mechanism and L; last rows: mean accuracy, ESS mean as % of L, predict s")
    table = [[mech] + [f"{100 * next(r for r in rows if r['test'] == mech and r['L'] == n)['accuracy']:.1f}"
                       for n in samples] for mech in TEST_MECHANISMS]
    for label, key, fmt in (("mean", "accuracy", "{:.1f}"), ("ESS % of L", "ess_fraction", "{:.1f}"),
                            ("predict s", "predict_seconds", "{:.2f}")):
        scale = 1 if key == "predict_seconds" else 100
        table.append([label] + [fmt.format(np.mean([r[key] for r in rows if r["L"] == n]) * scale) for n in samples])
    print(md_table(["test"] + [f"L={n}" for n in samples], table))
    if args.json:
        Path(args.json).write_text(json.dumps({"fit_seconds": fit_s, "rows": rows, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
