"""Re-measure FALSE-VFL's rows of a grid with today's estimator, each fitted model also predicted with the paper's.

FALSE-VFL's prediction is a Monte Carlo estimate; until the adaptive estimator it rested on an effective sample
size of about 2 (docs/false-vfl.md, "Prediction estimators"), so every FALSE-VFL figure of the results pages carried
that noise.  This reruns the FALSE-VFL fits of a shipped grid (``cpu``: FashionMNIST and hapt-raw, 6 training x 7
test mechanisms, seeds 0-2; ``ablation-labels``: FALSE-VFL-I at 50-4,000 labels, seed 0) exactly as the grid
configures them, and scores every fitted model on every test mechanism twice: with the default (adaptive) estimator
and with the paper's (``predict_estimator=paper``: SNIS, L = 50), with the ESS of each.  The fits themselves use the
default estimator where they validate (early stopping).

Which FALSE-VFL variant (I or II) a configuration of the ``cpu`` grid uses is the one the published run chose on
validation data (docs/results/gaps.md); ``--variants both`` fits both.  The report sets the new figures beside the
published ones and the other methods' (whose code did not change), and recomputes the gap summary.

    python benchmarks/false_vfl_rerun.py --store runs/fvl-rerun.jsonl                 # the cpu grid (hours)
    python benchmarks/false_vfl_rerun.py --store runs/fvl-rerun.jsonl --shard 1/2     # half of it, resumable
    python benchmarks/false_vfl_rerun.py --store runs/fvl-labels.jsonl --grid ablation-labels
    python benchmarks/false_vfl_rerun.py --store runs/fvl-rerun.jsonl --report        # the tables
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GRIDS = {"cpu": "cpu", "ablation-labels": str(ROOT / "benchmarks" / "grids" / "ablation-labels-defaults.toml")}
ESTIMATORS = ("adaptive", "paper")
MECH_TITLES = {"mcar0": "MCAR 0", "mcar2": "MCAR 2", "mcar5": "MCAR 5", "mar1": "MAR 1", "mar2": "MAR 2",
               "mnar7": "MNAR 7", "mnar9": "MNAR 9"}
TITLE_MECHS = {v: k for k, v in MECH_TITLES.items()}


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True, help="JSON-lines file of results (appended; finished fits skipped)")
    ap.add_argument("--grid", choices=sorted(GRIDS), default="cpu")
    ap.add_argument("--variants", choices=["published", "both"], default="published",
                    help="cpu grid: the FALSE-VFL variant the published run chose per configuration, or I and II")
    ap.add_argument("--shard", default="1/1", help="I/N: run every N-th fit starting at the I-th (for 2 processes)")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds (default: the grid's)")
    ap.add_argument("--report", action="store_true", help="print the tables of the store instead of fitting")
    return ap.parse_args(argv)


def published_choices(gaps: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The published gap table (docs/results/gaps.md, "Every configuration"): per (dataset, training, test) the
    chosen FALSE-VFL variant and figure, the other method (chosen on validation) and its figure, and the best other
    method of the column and its figure."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    row = re.compile(r"^\| (\S+) \| ([A-Z]+ \d) \| ([A-Z]+ \d) \| (FALSE-VFL-I+) ([\d.]+) \| (.+?) ([\d.]+) \| "
                     r"(-?[\d.]+) \| (.+?) \((-?[\d.]+)\) \|$")
    for line in gaps.read_text().splitlines():
        m = row.match(line)
        if m:
            dataset, train, test = m.group(1), TITLE_MECHS[m.group(2)], TITLE_MECHS[m.group(3)]
            fvl = float(m.group(5))
            out[(dataset, train, test)] = {
                "variant": "false-vfl-1" if m.group(4) == "FALSE-VFL-I" else "false-vfl-2", "published": fvl,
                "other": m.group(6), "other_value": float(m.group(7)), "best_other": m.group(9),
                "best_other_value": round(fvl - float(m.group(10)), 1)}
    return out


def cells_to_run(args: argparse.Namespace) -> list[Any]:
    from partialvfl.bench.grid_file import load_grid

    grid = load_grid(GRIDS[args.grid])
    cells = [c for c in grid.cells() if c.method.name in ("false-vfl-1", "false-vfl-2") and c.role == "test"]
    if args.grid == "cpu" and args.variants == "published":
        chosen = published_choices(ROOT / "docs" / "results" / "gaps.md")
        keep = {(d, t): v["variant"] for (d, t, _), v in chosen.items()}
        cells = [c for c in cells if keep.get((c.dataset.display, c.train_mechanism)) == c.method.name]
    if args.seeds:
        seeds = {int(s) for s in args.seeds.split(",")}
        cells = [c for c in cells if c.seed in seeds]
    i, n = (int(v) for v in args.shard.split("/"))
    return [c for k, c in enumerate(sorted(cells, key=lambda c: c.key)) if k % n == i - 1]


def run(args: argparse.Namespace) -> int:
    import torch

    from partialvfl.data.protocol import ProtocolConfig, make_protocol, with_test_mechanism
    from partialvfl.data.sources import load_source
    from partialvfl.methods import get_method
    from partialvfl.methods.evaluation import ESS, evaluate

    torch.set_num_threads(1)
    store = Path(args.store)
    store.parent.mkdir(parents=True, exist_ok=True)
    done = {json.loads(line)["cell"] for line in store.read_text().splitlines()} if store.exists() else set()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    cells = [c for c in cells_to_run(args) if c.key not in done]
    print(f"{len(cells)} fits to run (commit {commit}, {platform.processor() or platform.machine()}, 1 torch thread, "
          f"load {os.getloadavg()[0]:.1f})", flush=True)
    sources: dict[str, Any] = {}
    for n, cell in enumerate(cells, 1):
        name = cell.dataset.name
        if name not in sources:
            sources[name] = load_source(name)
        source = sources[name]
        config = ProtocolConfig(**cell.dataset.protocol_kwargs(), train_missing=cell.train_mechanism,
                                test_missing="mcar0", seed=cell.seed)
        train, _ = make_protocol(config, source)
        model = get_method(cell.method.name)(cell.method.preset, seed=cell.seed, **cell.overrides)
        t0 = time.perf_counter()
        model.fit(train)
        fit_seconds = time.perf_counter() - t0
        rows = []
        for mech in cell.test_mechanisms:
            data = with_test_mechanism(config, mech, source)
            for estimator in ESTIMATORS:
                model.set_prediction_params(predict_estimator=estimator)
                res = evaluate(model, data)
                rows.append({"cell": cell.key, "dataset": cell.dataset.display, "method": cell.method.name,
                             "train": cell.train_mechanism, "seed": cell.seed, "test": mech, "estimator": estimator,
                             "rounds": model.params_["predict_rounds"] if estimator == "adaptive" else 1,
                             "accuracy": res["accuracy"], "ess": res.get(ESS), "predict_seconds":
                             res["predict_seconds"], "fit_seconds": fit_seconds, "commit": commit,
                             "load": os.getloadavg()[0]})
        with store.open("a") as f:  # one cell at a time: an interrupted run resumes at the next cell
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        acc = {e: np.mean([r["accuracy"] for r in rows if r["estimator"] == e]) for e in ESTIMATORS}
        print(f"[{n}/{len(cells)}] {cell.describe()}: fit {fit_seconds:.0f} s; mean accuracy over the tests "
              f"{100 * acc['adaptive']:.1f} (adaptive) / {100 * acc['paper']:.1f} (paper)", flush=True)
    return 0


def _mean_std(values: list[float]) -> tuple[float, float]:
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def _gap_summary(by: dict[tuple[str, str, str, str, str], list[float]], published: dict[tuple[str, str], Any],
                 estimator: str, tests: list[str]) -> None:
    """Print FALSE-VFL's gap to the other methods' published figures over the configurations re-run: with the
    given estimator's new accuracy, or (``published``) the published FALSE-VFL figure of the same configurations."""
    gaps, best_gaps, wins = [], [], 0
    per_test: dict[str, list[float]] = defaultdict(list)
    for (dataset, train, test), p in published.items():
        vals = by.get((dataset, p["variant"], train, test, "adaptive"))
        if not vals:
            continue
        new = p["published"] if estimator == "published" else float(np.mean(
            by[(dataset, p["variant"], train, test, estimator)]))
        gaps.append(new - p["other_value"])
        best_gaps.append(new - p["best_other_value"])
        per_test[test].append(new - p["other_value"])
        wins += new > p["other_value"]
    if not gaps:
        return
    what = "as published" if estimator == "published" else f"re-run, {estimator} estimator"
    print(f"Gap over {len(gaps)} configurations, FALSE-VFL {what}, against the other method chosen on validation "
          f"(published figures): FALSE-VFL ahead in {wins}; mean gap {np.mean(gaps):+.1f} points; against the best "
          f"other method of each column {np.mean(best_gaps):+.1f}")
    print("  per test mechanism: " + ", ".join(
        f"{MECH_TITLES[t]} {np.mean(v):+.1f}" for t, v in sorted(per_test.items(), key=lambda kv: tests.index(kv[0]))))


def _compact_table(by: dict[tuple[str, str, str, str, str], list[float]], published: dict[tuple[str, str], Any],
                   tests: list[str]) -> None:
    """One line per (dataset, variant, training mechanism) re-run: the mean over its test mechanisms with each
    estimator (the same fits), the published FALSE-VFL figure, and the seeds re-run."""
    print("| Dataset | FALSE-VFL | trained under | seeds | adaptive | paper | adaptive - paper | published |")
    print("|---|---|---|---|---|---|---|---|")
    keys = sorted({(k[0], k[1], k[2]) for k in by}, key=lambda k: (k[0], list(MECH_TITLES).index(k[2]), k[1]))
    for dataset, method, train in keys:
        means = {e: np.mean([np.mean(by[(dataset, method, train, t, e)]) for t in tests]) for e in ESTIMATORS}
        runs = len(by[(dataset, method, train, tests[0], "adaptive")])
        pub = [published.get((dataset, train, t), {}).get("published") for t in tests]
        pub_mean = f"{np.mean(pub):.1f}" if pub and None not in pub else ""
        label = "FALSE-VFL-I" if method == "false-vfl-1" else "FALSE-VFL-II"
        print(f"| {dataset} | {label} | {MECH_TITLES[train]} | {runs} | {means['adaptive']:.1f} | "
              f"{means['paper']:.1f} | {means['adaptive'] - means['paper']:+.1f} | {pub_mean} |")
    print()


def report(args: argparse.Namespace) -> int:
    rows = [json.loads(line) for line in Path(args.store).read_text().splitlines()]
    by: dict[tuple[str, str, str, str, str], list[float]] = defaultdict(list)
    ess: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        by[(r["dataset"], r["method"], r["train"], r["test"], r["estimator"])].append(100 * r["accuracy"])
        if r.get("ess"):
            ess[(r["dataset"], r["estimator"])].append(r["ess"]["median"])
    seeds = sorted({r["seed"] for r in rows})
    print(f"{len(rows)} results, seeds {seeds}, commits {sorted({r['commit'] for r in rows})}\n")
    tests = list(MECH_TITLES)
    published = published_choices(ROOT / "docs" / "results" / "gaps.md") if args.grid == "cpu" else {}
    for train in sorted({k[2] for k in by}, key=list(MECH_TITLES).index):
        print(f"### Trained under {MECH_TITLES[train]}\n")
        print("| Dataset | FALSE-VFL | estimator | " + " | ".join(MECH_TITLES[t] for t in tests) + " |")
        print("|---|---|---|" + "---|" * len(tests))
        for dataset, method in sorted({(k[0], k[1]) for k in by if k[2] == train}):
            for estimator in ESTIMATORS:
                cells = []
                for t in tests:
                    vals = by.get((dataset, method, train, t, estimator))
                    cells.append("" if not vals else "{:.1f} ({:.1f})".format(*_mean_std(vals)))
                label = "FALSE-VFL-I" if method == "false-vfl-1" else "FALSE-VFL-II"
                print(f"| {dataset} | {label} | {estimator} | " + " | ".join(cells) + " |")
            if published:
                pub = [published.get((dataset, train, t), {}).get("published") for t in tests]
                print(f"| {dataset} | published | paper, older code | "
                      + " | ".join("" if v is None else f"{v:.1f}" for v in pub) + " |")
        print()
    _compact_table(by, published, tests)
    if published:
        for estimator in (*ESTIMATORS, "published"):
            _gap_summary(by, published, estimator, tests)
    for (dataset, estimator), v in sorted(ess.items()):
        print(f"ESS median over rows, {dataset}, {estimator}: median over results {np.median(v):.1f} "
              f"(range {min(v):.1f}-{max(v):.1f})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return report(args) if args.report else run(args)


if __name__ == "__main__":
    sys.exit(main())
