"""How far do FALSE-VFL's figures move with per-row importance samples (issue 34, item 2)?

A FALSE-VFL prediction drew its importance samples with one seed per batch; it now draws each row's from the model's
seed and the row's ID (``partialvfl.methods.false_vfl.rowwise``).  Training is unchanged, so every figure that comes
from a FALSE-VFL prediction moves only by the Monte Carlo noise of those samples.  This measures it on a sample of the
results grid's cells: digits (4 parties of 16 features, 500 labels, 100 aligned, MCAR 0.2 in training, ``fast``
preset), FALSE-VFL I and II, each wire protocol, a few method seeds; every fitted model predicts the test set under
three test mechanisms both ways, in the same process:

* per batch, as before: the path a fit's validation still takes (``_validating``: the same seeds, batches and sums
  as the prediction code before the change, so these are the old figures exactly);
* per row: the prediction now.

    python benchmarks/row_seeds_accuracy.py                   # 2 variants x 2 wires x 3 seeds: ~14 min, 2-core VM
    python benchmarks/row_seeds_accuracy.py --seeds 0 --wires lean --json out.json  # 2 fits, ~2 minutes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from partialvfl.data.protocol import ProtocolConfig, make_protocol, with_test_mechanism
from partialvfl.methods import get_method

WIRES = {"lean": {}, "bound": {"wire": "bound", "latent_scale_floor": 0.3}}  # bound: the default policy's floor
MECHANISMS = ("mcar:0", "mcar:0.5", "mnar:0.9")


def predictions(model: Any, data: Any, per_row: bool) -> np.ndarray:
    model._validating = not per_row  # the batch-seeded path that a fit's validation keeps
    try:
        return model.predict_proba(data)
    finally:
        model._validating = False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="false-vfl-1,false-vfl-2")
    ap.add_argument("--wires", default="lean,bound")
    ap.add_argument("--seeds", default="0,1,2", help="method seeds (comma-separated); the data split is seed 0")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    config = ProtocolConfig(dataset="digits", parties=4, n_labels=500, n_aligned=100, train_missing="mcar:0.2",
                            seed=0)
    train, _ = make_protocol(config)
    tests = {m: with_test_mechanism(config, m) for m in MECHANISMS}
    rows = []
    for name in args.methods.split(","):
        for wire in args.wires.split(","):
            for seed in [int(s) for s in args.seeds.split(",")]:
                t0 = time.perf_counter()
                model = get_method(name)("fast", seed=seed, **WIRES[wire]).fit(train)
                row: dict[str, Any] = {"method": name, "wire": wire, "seed": seed,
                                       "fit_seconds": round(time.perf_counter() - t0, 1),
                                       "predict_seconds": {"before": 0.0, "after": 0.0}}
                for mech, test in tests.items():
                    y = np.asarray(test.task.classes)[np.asarray(test.y)]  # labels by value, as model.score does
                    classes = np.asarray(model.classes_)
                    t1 = time.perf_counter()
                    before = predictions(model, test, False)
                    t2 = time.perf_counter()
                    after = predictions(model, test, True)
                    row["predict_seconds"]["before"] += t2 - t1
                    row["predict_seconds"]["after"] += time.perf_counter() - t2
                    row[mech] = {"before": float((classes[before.argmax(1)] == y).mean()),
                                 "after": float((classes[after.argmax(1)] == y).mean()),
                                 "classes_differing": int((before.argmax(1) != after.argmax(1)).sum()),
                                 "largest_difference": float(np.abs(before - after).max()), "n": len(y)}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print("| method | wire | seed | " + " | ".join(f"{m}: before / after (classes moved)" for m in MECHANISMS) + " |")
    print("|---|---|---|" + "---|" * len(MECHANISMS))
    for r in rows:
        cells = [f"{100 * r[m]['before']:.1f} / {100 * r[m]['after']:.1f} ({r[m]['classes_differing']})"
                 for m in MECHANISMS]
        print(f"| {r['method']} | {r['wire']} | {r['seed']} | " + " | ".join(cells) + " |")
    before, after = (sum(r["predict_seconds"][k] for r in rows) for k in ("before", "after"))
    print(f"prediction time, all models and mechanisms: {before:.1f} s per batch, {after:.1f} s per row "
          f"({after / before:.2f}x)")
    moves = [100 * (r[m]["after"] - r[m]["before"]) for r in rows for m in MECHANISMS]
    print(f"accuracy moved by {np.mean(moves):+.2f} points on average, {np.mean(np.abs(moves)):.2f} in absolute value, "
          f"at most {np.max(np.abs(moves)):.2f} ({len(moves)} figures)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
