"""Raw-data extraction by a coordinator, before (research policy) and after (a party's default policy).

Two real ``partialvfl party serve`` processes hold the *same* table (a block of a dataset's columns): one with the
permissive research policy (the coordinator's seed builds the party's weights, any architecture: what every party
did before the policy existed), one with the default policy of a deployed party (``party.toml`` without
``[policy]``).  An attacking coordinator with the federation's certificate runs every attack of
:mod:`partialvfl.bench.extraction` against each and reports the reconstruction error per feature in units of that
feature's standard deviation (median and best feature over the rows it did not know; 1.0 = guessing the mean).

    python benchmarks/extraction_attack.py                      # digits, columns 16-31 (1,797 rows x 16)
    python benchmarks/extraction_attack.py --dataset optdigits --columns 16:32 --json results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from partialvfl import Task, VerticalDataset
from partialvfl.bench.attacks import run_attacks
from partialvfl.data.sources import load_source
from partialvfl.federation.grpc.local import LocalDeployment


def party_block(dataset: str, columns: str, max_rows: int | None) -> np.ndarray:
    src = load_source(dataset)
    x = src.X_train.reshape(len(src.X_train), -1).astype(np.float64)
    lo, hi = (int(v) for v in columns.split(":"))
    return x[: max_rows or len(x), lo:hi]


def twin_deployment(block: np.ndarray) -> VerticalDataset:
    """Two parties holding the same block (party 0 research policy, party 1 default), every row labelled."""
    n = len(block)
    return VerticalDataset([block.copy(), block.copy()], np.ones((n, 2), bool), ids=[f"u{i:05d}" for i in range(n)],
                           y=np.arange(n) % 2, labeled=np.ones(n, bool), task=Task.classification([0, 1]),
                           active_party=0, party_names=["research", "default"])


def plan(d: int, widths: list[int]) -> list[tuple[str, dict[str, Any]]]:
    """Every attack: the seed attack at several widths (and with a hidden layer, invertible when the weights are
    known), several probes, a freeze, then known rows (a few to many) at twice the feature count; issue 23's:
    FALSE-VFL's decode (the same latents for every row; the bound wire around one centre), 16 models in one setup,
    scaled gradients, a huge weight decay, rewinds."""
    steps: list[tuple[str, dict[str, Any]]] = [("seed", {"width": w}) for w in widths]
    steps += [("seed", {"width": max(widths), "min_hidden": 1})]
    steps += [("probes", {"width": 1, "probes": 4}), ("freeze", {"width": 1})]
    steps += [("known-rows", {"width": 2, "n_known": k}) for k in (5, 10, d + 1, 4 * d)]
    steps += [("known-rows", {"width": 2, "n_known": d + 1, "probes": 4})]
    steps += [("decode", {"wire": "lean"}), ("decode", {"wire": "lean", "n_known": 0}),
              ("decode", {"wire": "samples"}), ("decode-bound", {"centre": 0.0}),
              ("decode-bound", {"centre": 0.0, "n_known": 0}), ("decode-bound", {"centre": 5.0})]
    steps += [("known-rows", {"width": 2, "n_known": 25}), ("width", {"models": 16, "n_known": 25})]
    steps += [("gradient-scale", {}), ("weight-decay", {}), ("rewind", {})]
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--columns", default="16:32", help="the party's block: columns LO:HI of the flattened features")
    ap.add_argument("--max-rows", type=int, default=None)
    ap.add_argument("--widths", default="1,2,4", help="encoder widths of the seed attack, in feature counts")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    block = party_block(args.dataset, args.columns, args.max_rows)
    data = twin_deployment(block)
    steps = plan(block.shape[1], [int(w) for w in args.widths.split(",")])
    print(f"{args.dataset} columns {args.columns}: {block.shape[0]} rows x {block.shape[1]} features; "
          f"{int((block.std(0) > 0).sum())} vary", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dep = LocalDeployment(Path(tmp), data, deadline=600.0, start_timeout=600.0)
        dep.policy[1] = "default"
        with dep:
            dep.start()
            for label, k in (("research (before)", 0), ("default (after)", 1)):
                t0 = time.perf_counter()
                for outcome in run_attacks(dep.federation_file, k, block, steps, data.ids):
                    rows.append({"policy": label, **outcome.row()})
                print(f"{label}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    _print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _print_table(rows: list[dict[str, Any]]) -> None:
    """One line per attack and policy: the result (reconstruction error per feature: median and best feature; or
    the attack's own measure), the rules that refused the attacker's first choice, what the party accepted."""
    print("| attack | policy | result | refused | accepted |")
    print("|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: list(dict.fromkeys(x["attack"] for x in rows)).index(r["attack"])):
        result = (f"{r['median_rmse_std']:.2g} ({r['min_rmse_std']:.2g})" if r["metric"] == "rmse/std"
                  else f"{r['median_rmse_std']:.3g} ({r['metric']})")
        print(f"| {r['attack']} | {r['policy']} | {result} | {_rules(r['refused'])} | {r['accepted']} |")


def _rules(refused: str) -> str:
    rules = [part.split("'")[1] for part in refused.split("; ") if part.startswith("policy rule")]
    return ", ".join(dict.fromkeys(rules)) or "-"


if __name__ == "__main__":
    raise SystemExit(main())
