"""Does FALSE-VFL's prediction converge? The same fitted model predicted with four draw seeds, per estimator.

A FALSE-VFL prediction is a Monte Carlo estimate of ``p(y | x_obs)``; its answer should be the model's, not one draw
of its noise.  This benchmark fits a model, then predicts the same test rows four times changing only the seed of the
prediction's draws (``model.seed = s``, training untouched) and reports, per estimator and test mechanism: accuracy
per seed and their mean, how many rows change class between two seeds (fewest and most over the 6 pairs), the
importance weights' effective sample size (median and 5th percentile over rows, and the rows below the model's
``predict_low_ess``) and the seconds per prediction.

Two models per dataset: *before*, fitted and predicted with the paper's estimator (``predict_estimator=paper``:
SNIS with L = 50 samples from q(h|x_obs), also what early stopping validated with), and *after*, with the default
(the adaptive estimator, in validation and prediction); the *after* model is also predicted with the paper's estimator
(the estimator's part of the difference) and with SNIS at L = 500 and 5,000 (where more samples of the paper's
proposal lead).

* ``digits``: the README's main job (``partialvfl fit --dataset digits --method false-vfl-1``, seed 0), test rows
  at MCAR 0.5, MCAR 0 and MNAR 0.9.
* ``fashion``: the cpu grid's FashionMNIST FALSE-VFL-I entry (src/partialvfl/bench/grids/cpu.toml: 8 parties, 4,000
  training images, trained under MCAR 2, seed 0), 1,000 test images at MCAR 5.

    python benchmarks/predict_convergence.py                       # both, ~25 minutes on 2 cores
    python benchmarks/predict_convergence.py --only digits         # ~4 minutes
    python benchmarks/predict_convergence.py --models runs/conv    # keep / reuse the fitted models there
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from partialvfl.bench.grid_file import load_grid
from partialvfl.bench.tables import md_table
from partialvfl.data.protocol import ProtocolConfig, make_protocol, with_test_mechanism
from partialvfl.data.sources import load_source
from partialvfl.methods import VFLMethod, get_method
from partialvfl.methods.evaluation import metrics_from_predictions

SEEDS = (0, 1, 2, 3)
#: (label, estimator parameters, which model) for every line of a table
LINES: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("before: paper estimator (SNIS, L = 50)", {}, "before"),
    ("after, paper estimator (SNIS, L = 50)", {"predict_estimator": "paper"}, "after"),
    ("after, SNIS L = 500", {"predict_estimator": "paper", "predict_importance_samples": 500}, "after"),
    ("after, SNIS L = 5,000", {"predict_estimator": "paper", "predict_importance_samples": 5000}, "after"),
    ("after: default estimator", {}, "after"),
)


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["digits", "fashion"], default=None)
    ap.add_argument("--models", default=None, help="folder for the fitted models (reused when present)")
    ap.add_argument("--skip-large", action="store_true", help="leave out SNIS at L = 5,000")
    ap.add_argument("--method", choices=["false-vfl-1", "false-vfl-2"], default="false-vfl-1",
                    help="digits: the method of the main job (FashionMNIST's grid entry is FALSE-VFL-I)")
    ap.add_argument("--json", default=None, help="also write every figure here")
    return ap.parse_args(argv)


def _fit_digits(where: Path, estimator: str, method: str) -> VFLMethod:
    """The README's main job, as its command runs it (with the method and estimator given)."""
    if not (where / "model.json").exists():
        from partialvfl.cli import main as cli

        cli(["fit", "--dataset", "digits", "--method", method, "--out", str(where), "--quiet",
             "--param", f"predict_estimator={estimator}"])
    return VFLMethod.load(where)


def _fit_fashion(where: Path, estimator: str, config: ProtocolConfig, source: Any) -> VFLMethod:
    """The cpu grid's FashionMNIST FALSE-VFL-I entry (seed 0, trained under MCAR 2)."""
    if not (where / "model.json").exists():
        entry = next(m for m in load_grid("cpu").methods if m.name == "false-vfl-1")
        params = dict(entry.overrides, **entry.dataset_overrides.get("fashion-mnist", {}))
        train, _ = make_protocol(config, source)
        model = get_method("false-vfl-1")(entry.preset, seed=config.seed, predict_estimator=estimator, **params)
        t0 = time.perf_counter()
        model.fit(train)
        print(f"  fitted {where.name} in {time.perf_counter() - t0:.0f} s", flush=True)
        model.save(where)
    return VFLMethod.load(where)


def measure(model: VFLMethod, test: Any, params: dict[str, Any]) -> dict[str, Any]:
    """Four predictions of ``test`` with draw seeds 0-3: accuracy, class changes, ESS, seconds."""
    seed, saved = model.seed, dict(model.params_)
    model.params_ = {**saved, **params}
    classes, accs, seconds, ess = [], [], [], None
    try:
        for s in SEEDS:
            model.seed = s
            diagnostics: dict[str, np.ndarray] = {}
            t0 = time.perf_counter()
            out = model.predict_output(test, diagnostics=diagnostics)
            seconds.append(time.perf_counter() - t0)
            classes.append(out.argmax(axis=1))
            accs.append(metrics_from_predictions(out, test, model.index_.task.classes)["accuracy"])
            if ess is None:
                ess = diagnostics["importance_ess"][np.isfinite(diagnostics["importance_ess"])]
        low = float(model.params_.get("predict_low_ess", 10.0))
    finally:
        model.seed, model.params_ = seed, saved
    changes = [int(np.sum(a != b)) for a, b in itertools.combinations(classes, 2)]
    return {"accuracy": accs, "mean_accuracy": float(np.mean(accs)), "changes_min": min(changes),
            "changes_max": max(changes), "ess_median": float(np.median(ess)), "ess_p5": float(np.percentile(ess, 5)),
            "low_ess_rows": int(np.sum(ess < low)), "low_ess": low, "rows": int(len(test.y)),
            "seconds": float(np.median(seconds))}


def report(title: str, models: dict[str, VFLMethod], tests: dict[str, Any], skip_large: bool) -> list[dict[str, Any]]:
    """One table per test mechanism: every line of :data:`LINES`."""
    rows = []
    for mech, test in tests.items():
        table = []
        for label, params, which in LINES:
            if skip_large and params.get("predict_importance_samples", 0) >= 5000:
                continue
            r = measure(models[which], test, params)
            est = models[which].params_.get("predict_estimator") if not params else params.get("predict_estimator")
            rounds = models[which].params_.get("predict_rounds")
            r.update(dataset=title, test=mech, line=label, estimator=est, rounds=rounds)
            rows.append(r)
            table.append([label, " / ".join(f"{a:.4f}" for a in r["accuracy"]), f"{r['mean_accuracy']:.4f}",
                          f"{r['changes_min']}-{r['changes_max']}", f"{r['ess_median']:.1f} / {r['ess_p5']:.1f}",
                          f"{r['low_ess_rows']}", f"{r['seconds']:.2f}"])
            print(f"  {mech} {label}: {table[-1][1:]}", flush=True)
        n = rows[-1]["rows"]
        print(f"\n{title}, test {mech} ({n} rows)\n")
        print(md_table(["prediction", "accuracy, draw seeds 0-3", "mean", "rows that change class",
                        "ESS median / 5th pct", f"rows ESS < {rows[-1]['low_ess']:g}", "s per prediction"], table))
        print(flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, 1 torch thread, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    base = Path(args.models) if args.models else Path(os.environ.get("TMPDIR", "/tmp")) / "predict-convergence"
    out: list[dict[str, Any]] = []
    if args.only in (None, "digits"):
        suffix = "" if args.method == "false-vfl-1" else f"-{args.method}"
        models = {which: _fit_digits(base / f"digits{suffix}-{which}", "paper" if which == "before" else "adaptive",
                                     args.method) for which in ("before", "after")}
        cfg = dict(models["after"].data_info_["protocol"])
        tests = {mech: make_protocol(ProtocolConfig(**{**cfg, "test_missing": mech}))[1]
                 for mech in ("mcar:0.5", "mcar:0", "mnar:0.9")}
        out += report(f"digits (README main job, {args.method})", models, tests, args.skip_large)
    if args.only in (None, "fashion"):
        config = ProtocolConfig(dataset="fashion-mnist", parties=8, n_labels=1000, n_aligned=200, max_train=4000,
                                max_test=1000, train_missing="mcar2", test_missing="mcar5", seed=0)
        source = load_source(config.dataset)
        models = {which: _fit_fashion(base / f"fashion-{which}", "paper" if which == "before" else "adaptive",
                                      config, source) for which in ("before", "after")}
        out += report("FashionMNIST (cpu-grid entry)", models, {"mcar5": with_test_mechanism(config, "mcar5", source)},
                      args.skip_large)
    print(f"load at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"commit": commit, "rows": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
