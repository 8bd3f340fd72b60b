"""X-VFL against the feature missing rate, in the spirit of the X-VFL paper's Figures 6-8 (and 13-14 for k = 4).

Setting (X-VFL Sec. 4.1, on ``digits``, bundled with scikit-learn): K = 2 or 4 parties, every training sample
labelled, a fraction ``--aligned`` of the training samples aligned (all blocks complete); every other training sample
and every test sample is *non-aligned*: some parties hold its block with a fraction R_miss of their features lost
(zero-filled, the standardised mean; R_miss = 1 removes the block whole).  With 2 parties one party per non-aligned
sample is incomplete (the paper's setting); with K > 2 a uniformly drawn number 1..K-1 of them.  Which features are
lost is seeded per (seed, party, ID) (:func:`partialvfl.methods.x_vfl.within_block_mask`).

Reported per (K, R_miss), test accuracy (%):

* collaborative inference: X-VFL (missing features completed by XCom) and Vanilla VFL (trained on the aligned
  samples; lost features stay zero, removed blocks are zero-imputed);
* independent inference: X-VFL's h(f_k(x_k)) at the active party and averaged over all parties (samples a party does
  not hold count as the label prior), and Local (the active party's own model, this project's standalone baseline:
  only the active party holds labels).

    python benchmarks/x_vfl_missing_rate.py                      # K in {2, 4} x R_miss in {0, .3, .5, .7, .9, 1}
    python benchmarks/x_vfl_missing_rate.py --parties 2 --rates 0 0.9 --seeds 0 1
    python benchmarks/x_vfl_missing_rate.py --protocol           # FALSE-VFL protocol: X-VFL and FedHSSL

Results go to ``--out`` (one JSON line per fit) and a rerun resumes from there.  ``--protocol`` instead runs the
FALSE-VFL paper's protocol on digits (4 parties, 500 labels, 100 aligned, training MCAR 0.2; test MCAR 0 and 0.5)
for X-VFL and FedHSSL, with X-VFL's per-party local accuracy.
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

from partialvfl.data.dataset import VerticalDataset
from partialvfl.data.protocol import ProtocolConfig, make_protocol
from partialvfl.methods import evaluate, get_method, method_names
from partialvfl.methods.evaluation import metrics_from_predictions
from partialvfl.methods.x_vfl import x_vfl_partial_setting
from partialvfl.utils.progress import progress

DEFAULT_RATES = [0.0, 0.3, 0.5, 0.7, 0.9, 1.0]


def _digits():  # RawSource
    from partialvfl.data.sources.bundled import load_digits

    return load_digits()


def make_setting(k: int, rate: float, aligned: float, seed: int) -> tuple[VerticalDataset, VerticalDataset]:
    """The (train, test) pair of one point of the figure."""
    source = _digits()
    probe, _ = make_protocol(ProtocolConfig("digits", parties=k, n_labels=1, n_aligned=0, train_missing="mcar0",
                                            seed=seed), source=source)
    n_train = probe.n_samples
    cfg = ProtocolConfig("digits", parties=k, n_labels=n_train, n_aligned=int(round(aligned * n_train)),
                         train_missing="mcar0", test_missing="mcar0", seed=seed)
    train, test = make_protocol(cfg, source=source)
    # the aligned reserve stays complete; every other training sample and every test sample is non-aligned
    return (x_vfl_partial_setting(train, rate, seed=seed), x_vfl_partial_setting(test, rate, seed=seed + 1000))


def local_accuracy(model: Any, test: VerticalDataset, party: int) -> float:
    """Accuracy of party ``party`` predicting alone (X-VFL's locally independent inference), labels matched by value
    (the model's classes against the data's); samples the party does not hold count with the label prior."""
    return float(metrics_from_predictions(model.predict_output_local(test, party), test, model.classes_)["accuracy"])


def run_point(method: str, k: int, rate: float, aligned: float, seed: int, preset: str) -> dict[str, Any]:
    train, test = make_setting(k, rate, aligned, seed)
    t0 = time.perf_counter()
    model = get_method(method)(preset, seed=seed).fit(train)
    row: dict[str, Any] = {"method": method, "parties": k, "rate": rate, "aligned": aligned, "seed": seed,
                           "preset": preset, "fit_seconds": round(time.perf_counter() - t0, 2),
                           "collaborative": evaluate(model, test)["accuracy"]}
    if hasattr(model, "predict_output_local"):
        local = [local_accuracy(model, test, p) for p in range(k)]
        row["local_by_party"] = local
        row["independent_active"] = local[test.active_party]
        row["independent_mean"] = float(np.mean(local))
    elif method == "local":  # the active party alone: its collaborative output *is* its independent one
        row["independent_active"] = row["collaborative"]
    return row


def _key(r: dict[str, Any]) -> tuple:
    return (r["method"], r["parties"], float(r["rate"]), float(r["aligned"]), r["seed"], r["preset"])


def _load(path: Path) -> dict[tuple, dict[str, Any]]:
    done: dict[tuple, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[_key(r)] = r
    return done


def _pct(values: list[float]) -> str:
    if not values:
        return "-"
    m = 100 * float(np.mean(values))
    return f"{m:.1f}" if len(values) == 1 else f"{m:.1f}+-{100 * float(np.std(values)):.1f}"


def print_table(rows: list[dict[str, Any]], parties: list[int], rates: list[float]) -> None:
    cols = [("X-VFL collab", "x-vfl", "collaborative"), ("Vanilla VFL collab", "vanilla-vfl", "collaborative"),
            ("X-VFL indep (active)", "x-vfl", "independent_active"),
            ("X-VFL indep (mean k)", "x-vfl", "independent_mean"), ("Local (active)", "local", "independent_active")]
    for k in parties:
        print(f"\n{k} parties: test accuracy (%) against R_miss (non-aligned samples)")
        print("| R_miss | " + " | ".join(c[0] for c in cols) + " |")
        print("|---" * (len(cols) + 1) + "|")
        for rate in rates:
            cells = []
            for _, method, field in cols:
                vals = [r[field] for r in rows if r["method"] == method and r["parties"] == k
                        and float(r["rate"]) == rate and field in r]
                cells.append(_pct(vals))
            print(f"| {rate:g} | " + " | ".join(cells) + " |")


def run_protocol(seeds: list[int], preset: str) -> None:
    """FALSE-VFL protocol on digits: X-VFL and FedHSSL, test MCAR 0 and 0.5, X-VFL's per-party local accuracy."""
    source = _digits()
    res: dict[str, list[float]] = {}
    for seed in seeds:
        base = dict(dataset="digits", parties=4, n_labels=500, n_aligned=100, train_missing="mcar2", seed=seed)
        train, test0 = make_protocol(ProtocolConfig(**base, test_missing="mcar0"), source=source)
        _, test5 = make_protocol(ProtocolConfig(**base, test_missing="mcar5"), source=source)
        for method in ("x-vfl", "fedhssl"):
            t0 = time.perf_counter()
            model = get_method(method)(preset, seed=seed).fit(train)
            res.setdefault(f"{method} fit seconds", []).append(time.perf_counter() - t0)
            res.setdefault(f"{method} MCAR 0", []).append(evaluate(model, test0)["accuracy"])
            res.setdefault(f"{method} MCAR 0.5", []).append(evaluate(model, test5)["accuracy"])
            if method == "x-vfl":
                for p in range(4):
                    acc = local_accuracy(model, test0, p)
                    res.setdefault(f"x-vfl local party {p} (MCAR 0)", []).append(acc)
    print(f"digits, 4 parties, 500 labels / 100 aligned, training MCAR 0.2, preset {preset}, seeds {seeds}")
    for name, vals in res.items():
        cell = f"{np.mean(vals):.2f} s" if "seconds" in name else _pct(vals) + " %"
        print(f"  {name}: {cell}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parties", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rates", type=float, nargs="+", default=DEFAULT_RATES)
    ap.add_argument("--aligned", type=float, default=0.4, help="fraction of training samples that are aligned")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--methods", nargs="+", default=["x-vfl", "vanilla-vfl", "local"])
    ap.add_argument("--preset", default="fast")
    ap.add_argument("--out", type=Path, default=Path("results/x_vfl_missing_rate.jsonl"))
    ap.add_argument("--protocol", action="store_true", help="run the FALSE-VFL protocol comparison instead")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.protocol:
        run_protocol(args.seeds, args.preset)
        return 0
    known = set(method_names())
    methods = [m for m in args.methods if m in known]
    for m in set(args.methods) - known:
        print(f"skipping {m!r}: not a registered method", file=sys.stderr)
    done = _load(args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    grid = [(m, k, r, s) for k in args.parties for r in args.rates for s in args.seeds for m in methods]
    with args.out.open("a") as fh:
        for method, k, rate, seed in progress(grid, "x-vfl missing rate"):
            key = (method, k, float(rate), float(args.aligned), seed, args.preset)
            if key in done:
                continue
            row = run_point(method, k, rate, args.aligned, seed, args.preset)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            done[key] = row
    rows = [r for r in done.values() if r["preset"] == args.preset and float(r["aligned"]) == args.aligned]
    print_table(rows, args.parties, args.rates)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
