"""Party contributions, party values and calibration, measured (docs/explain.md, docs/results.md).

Three parts, each printing Markdown tables (and JSON lines with ``--json``); fitted models are kept in ``--work``
(a second run reuses them):

* ``timing``: exact explanations of a protocol test set against one prediction of the same rows, in one process,
  each timed ``--repeats`` times (the median; one torch thread): digits with 4 parties (16 coalitions) for LASER-VFL
  and FALSE-VFL-I at their ``fast`` defaults, and the cpu grid's FashionMNIST entry with 8 parties (256 coalitions:
  LASER-VFL; FALSE-VFL-I on ``--fashion-rows`` rows);
* ``values``: each party's Shapley value of the accuracy (with its standard error) beside leave-one-party-out and
  the party alone, on digits, the own-data example (its new customers with their outcomes) and the cpu grid's
  FashionMNIST entry, for LASER-VFL and FALSE-VFL-I;
* ``calibration``: the cpu grid's FashionMNIST entry (training MCAR 0.2, seed 0, every method of the grid without
  SimSiam pretraining): expected calibration error, Brier score and log-loss at test MCAR 0 and 0.5, before and after
  temperature scaling fitted on the protocol's validation set (the training samples whose labels the protocol
  erased, under the training mechanism): one temperature, and per pattern (``calibrate --per-pattern``).

    python benchmarks/explain_cost.py timing values calibration --work runs/explain   # ~40 minutes on 2 cores
    python benchmarks/explain_cost.py timing --quick                                  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from partialvfl.bench.grid_file import load_grid
from partialvfl.bench.tables import md_table
from partialvfl.data.protocol import ProtocolConfig, make_protocol, validation_set, with_test_mechanism
from partialvfl.data.sources import load_source
from partialvfl.methods import VFLMethod, get_method
from partialvfl.methods.calibration import Calibration, calibration_metrics
from partialvfl.methods.evaluation import true_in_model_classes
from partialvfl.methods.party_value import value_attached

DIGITS = ProtocolConfig("digits", parties=4, n_labels=500, n_aligned=100, train_missing="mcar2", seed=0)
FASHION = ProtocolConfig("fashion-mnist", parties=8, n_labels=1000, n_aligned=200, train_missing="mcar2", seed=0,
                         max_train=4000, max_test=2000)
GRID_METHODS = ("vanilla-vfl", "laser-vfl", "plug-vfl", "fedhssl", "x-vfl", "false-vfl-1", "false-vfl-2")


def grid_method(name: str) -> tuple[str, dict[str, Any]]:
    """The cpu grid's FashionMNIST entry of ``name`` without SimSiam pretraining: (preset, parameters)."""
    entry = next(m for m in load_grid("cpu").methods if m.name == name and not m.overrides.get("pretrain"))
    return entry.preset, dict(entry.overrides, **entry.dataset_overrides.get("fashion-mnist", {}))


def fitted(work: Path, tag: str, name: str, preset: str, params: dict[str, Any], train: Any) -> VFLMethod:
    """The model ``tag`` from ``work``, fitted (and saved there) if it is not there yet."""
    d = work / tag
    if (d / "model.json").exists():
        return VFLMethod.load(d)
    t0 = time.perf_counter()
    model = get_method(name)(preset, seed=0, **params).fit(train)
    model.save(d)
    print(f"  fitted {tag} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return model


def timed(run: Any, repeats: int) -> tuple[float, Any]:
    """The median time of ``repeats`` runs of ``run()`` and the last run's result."""
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def timing(args: argparse.Namespace, out: list[dict[str, Any]]) -> None:
    cases = [("digits", DIGITS, "laser-vfl", "fast", {}, None), ("digits", DIGITS, "false-vfl-1", "fast", {}, None)]
    if not args.quick:
        for name in ("laser-vfl", "false-vfl-1"):
            preset, params = grid_method(name)
            cases.append(("fashion-mnist", FASHION, name, preset, params,
                          None if name == "laser-vfl" else args.fashion_rows))
    rows = []
    for dataset, cfg, name, preset, params, limit in cases:
        train, test = make_protocol(cfg if not args.quick else ProtocolConfig(**{**cfg.to_dict(), "max_train": 600}))
        if args.quick:
            params = {**params, "epochs": 2, **({"pretrain_epochs": 2} if "false" in name else {})}
        model = fitted(args.work, f"{dataset}-{name}{'-quick' if args.quick else ''}", name, preset, params, train)
        if limit is not None:
            test = test.subset(np.arange(min(limit, test.n_samples)))
        repeats = args.repeats if dataset == "digits" else 1  # a FashionMNIST explanation takes minutes
        predict, _ = timed(lambda m=model, t=test: m.predict_output(t), repeats)
        explain_s, e = timed(lambda m=model, t=test: m.explain(t), repeats)
        row = {"part": "timing", "dataset": dataset, "method": name, "parties": cfg.parties, "rows": test.n_samples,
               "coalitions": e.coalitions, "predict_s": predict, "explain_s": explain_s, "ratio": explain_s / predict,
               "efficiency_gap": e.efficiency_gap()}
        out.append(row)
        rows.append([dataset, name, str(cfg.parties), f"{test.n_samples:,}", str(e.coalitions), f"{predict:.3f}",
                     f"{explain_s:.3f}", f"{explain_s / predict:.1f}", f"{e.efficiency_gap():.1e}"])
    print(md_table(["data", "method", "K", "rows", "coalitions", "one prediction (s)", "explanation (s)",
                    "ratio", "largest efficiency gap"], rows))


def _value_rows(title: str, model: VFLMethod, data: Any) -> tuple[list[list[str]], dict[str, Any]]:
    with model.attached(data) as (conformed, handle):
        v = value_attached(model, conformed.coordinator_view(), handle)
    rows = [[title, model.name, p, f"{s:+.4f} ± {e:.4f}", f"{lo:+.4f}", f"{a:+.4f}"]
            for p, s, e, lo, a in zip(v.party_names, v.values, v.standard_errors, v.leave_one_out, v.alone)]
    rows.append([title, model.name, "(all / none)", f"{v.full:.4f} / {v.empty:.4f}", "", ""])
    return rows, {"part": "values", "data": title, "method": model.name, "values": v.values.tolist(),
                  "standard_errors": v.standard_errors.tolist(), "leave_one_out": v.leave_one_out.tolist(),
                  "alone": v.alone.tolist(), "full": v.full, "empty": v.empty, "parties": list(v.party_names)}


def values(args: argparse.Namespace, out: list[dict[str, Any]]) -> None:
    import importlib.util

    from partialvfl.data.builders import from_tables

    spec = importlib.util.spec_from_file_location(
        "make_example_tables", Path(__file__).resolve().parents[1] / "scripts" / "make_example_tables.py")
    assert spec is not None and spec.loader is not None
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)

    rows = []
    train, _ = make_protocol(DIGITS)
    for name in ("laser-vfl", "false-vfl-1"):
        model = fitted(args.work, f"digits-{name}", name, "fast", {}, train)
        for mech in ("mcar0", "mcar5"):
            r, j = _value_rows(f"digits, test {mech}", model, with_test_mechanism(DIGITS, mech))
            rows += r
            out.append(j)
    ex = args.work / "example"
    if not (ex / "train").exists():
        tables.write(ex)  # the own-data page's tables (the script's defaults)
    kw = {"id_column": "customer_id", "label_column": "defaulted", "active_party": "bank"}
    own = from_tables({p: ex / "train" / f"{p}.csv" for p in ("bank", "shop", "telco")}, **kw)
    outcomes = from_tables({"bank": ex / "outcomes" / "bank.csv", "shop": ex / "new" / "shop.csv",
                            "telco": ex / "new" / "telco.csv"}, **kw)
    for name in ("laser-vfl", "false-vfl-1"):
        model = fitted(args.work, f"own-{name}", name, "fast", {}, own)
        r, j = _value_rows("own data, the bank's new customers", model, outcomes)
        rows += r
        out.append(j)
    if not args.quick:
        train, test = make_protocol(FASHION)
        for name in ("laser-vfl", "false-vfl-1"):
            preset, params = grid_method(name)
            model = fitted(args.work, f"fashion-mnist-{name}", name, preset, params, train)
            limit = None if name == "laser-vfl" else args.fashion_rows
            r, j = _value_rows(f"FashionMNIST, test MCAR 0{f' (first {limit:,} rows)' if limit else ''}", model,
                               test if limit is None else test.subset(np.arange(limit)))
            rows += r
            out.append(j)
    print(md_table(["data", "method", "party", "Shapley value (accuracy) ± s.e.", "leave one out", "alone"], rows))


def calibration(args: argparse.Namespace, out: list[dict[str, Any]]) -> None:
    source = load_source("fashion-mnist")
    train, _ = make_protocol(FASHION, source)
    validation = validation_set(FASHION, FASHION.train_missing, source)
    tests = {m: with_test_mechanism(FASHION, m, source) for m in ("mcar0", "mcar5")}
    rows = []
    for name in args.methods:
        preset, params = grid_method(name)
        model = fitted(args.work, f"fashion-mnist-{name}", name, preset, params, train)
        model.calibration_ = None
        names = model.index_.party_names
        vout = model.predict_output(validation)
        vtrue, _ = true_in_model_classes(validation, model.index_.task.classes)
        keep = validation.observed.any(axis=1)
        vused = model.parties_used(validation)[keep]
        fits = {how: Calibration.fit(vout[keep], vtrue[keep], vused, names, per_pattern=how == "per pattern")
                for how in ("global", "per pattern")}
        for mech, test in tests.items():
            output = model.predict_output(test)
            true, _ = true_in_model_classes(test, model.index_.task.classes)
            used = model.parties_used(test)
            some = used.any(axis=1)
            metrics = {"before": calibration_metrics(output, true, used, names)}
            for how, cal in fits.items():
                scaled = output.copy()
                scaled[some] = cal.apply(output[some], used[some])
                metrics[how] = calibration_metrics(scaled, true, used, names)
            accuracy = float((output.argmax(1) == true).mean())
            out.append({"part": "calibration", "method": name, "test": mech, "accuracy": accuracy,
                        "temperature": fits["global"].temperature, "per_count": fits["per pattern"].by_count,
                        **{how: {k: m[k] for k in ("ece", "brier", "log_loss")} for how, m in metrics.items()}})
            rows.append([name, mech, f"{100 * accuracy:.1f}", f"{fits['global'].temperature:.2f}",
                         *(f"{metrics[h]['ece']:.4f}" for h in ("before", "global", "per pattern")),
                         *(f"{metrics[h]['brier']:.4f}" for h in ("before", "per pattern")),
                         *(f"{metrics[h]['log_loss']:.3f}" for h in ("before", "per pattern"))])
    print(md_table(["method", "test", "accuracy (%)", "T (one)", "ECE before", "ECE, one T", "ECE, per pattern",
                    "Brier before", "Brier, per pattern", "log-loss before", "log-loss, per pattern"], rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="+", choices=("timing", "values", "calibration"))
    ap.add_argument("--work", type=Path, default=Path("runs/explain"), help="fitted models are kept here")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fashion-rows", type=int, default=500, help="FashionMNIST rows FALSE-VFL-I explains")
    ap.add_argument("--methods", nargs="+", default=list(GRID_METHODS), help="calibration: the methods")
    ap.add_argument("--quick", action="store_true", help="digits only, short fits")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here, one JSON line each")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread, "
          f"{time.strftime('%Y-%m-%d %H:%M')}", file=sys.stderr)
    out: list[dict[str, Any]] = []
    for part in args.parts:
        {"timing": timing, "values": values, "calibration": calibration}[part](args, out)
    if args.json:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
