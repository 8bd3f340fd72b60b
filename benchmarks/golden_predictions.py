"""Golden predictions: every method's predictions on a fixed small problem, to compare two versions of the code.

A restructuring or a speed-up that must not change any answer (issues 36 and 37) is checked by writing the golden
predictions with the old code and with the new one, on the same machine, and comparing them bitwise:

    PYTHONPATH=/path/to/old/src python benchmarks/golden_predictions.py write runs/golden-old
    python benchmarks/golden_predictions.py write runs/golden-new
    python benchmarks/golden_predictions.py compare runs/golden-old runs/golden-new

``write`` fits every registered method (or ``--methods``) with tiny settings on the own-data example's tables
(``scripts/make_example_tables.py``, seed 0, 300 training customers) in this process, and, with ``--grpc``, across
real party processes as well (each party's ``[policy] seed`` pinned, HMAC alignment so that both sides see the
samples in one order), then predicts the training customers and the new customers (the in-process model also the
new customers' tables); the in-process model's weights are saved too (``<method>.in-process.weights``: a change to
training shows there even when a change to prediction moves the predictions).  It saves each array as
``<method>.<where>.<what>.npy`` with a manifest of SHA-256 digests.
``compare`` prints, per array, ``identical`` or the largest difference and how many predicted classes differ, and
exits 1 when any array differs (or is missing on one side).

Bitwise equality holds only between runs on the same machine with the same torch build and thread count (one
thread here): the golden files are never committed, and never compared across machines.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
PARTIES = ("bank", "shop", "telco")
KEYS = {"id_column": "customer_id", "label_column": "defaulted", "active_party": "bank"}
SEED = 0
_SPLIT = {"latent_dim": 8, "encoder_hidden": [16], "epochs": 3, "batch_size": 32}
_FALSE = {"d_h": 8, "d_z": 4, "encoder_hidden": [16], "decoder_hidden": [16], "global_hidden": [16],
          "discriminator_hidden": [16], "mask_hidden": [8], "importance_samples": 3, "predict_importance_samples": 5,
          "pretrain_epochs": 3, "epochs": 3, "pretrain_batch_size": 32, "batch_size": 32}
#: per method: a short fit that still moves every parameter (both stages where a method has two)
TINY: dict[str, dict[str, Any]] = {
    "false-vfl-1": _FALSE,
    "false-vfl-2": {**_FALSE, "wire": "samples"},
    "laser-vfl": {**_SPLIT, "pretrain": True, "pretrain_epochs": 2, "pretrain_batch_size": 32},
    "vanilla-vfl": _SPLIT,
    "plug-vfl": _SPLIT,
    "local": _SPLIT,
    "ensemble": _SPLIT,
    "combinatorial": _SPLIT,
    "x-vfl": {"latent_dim": 8, "encoder_hidden": [16], "xcom_hidden": [16], "top_hidden": [16], "epochs": 3,
              "batch_size": 32},
    "fedhssl": {"latent_dim": 8, "encoder_hidden": [16, 16], "proj_dim": 8, "proj_hidden": 16, "pred_hidden": 8,
                "pretrain_epochs": 2, "pretrain_batch_size": 32, "epochs": 3, "batch_size": 32},
}
#: the HMAC key that orders the samples (a public benchmark constant, not a secret)
ORDER_KEY = "60" * 32
#: what a party's policy must allow for the in-process fit to be the federated one (docs/own-data.md, same model)
POLICY = {"seed": SEED, "max_width_ratio": 16, "max_setup_width_ratio": 64, "allow_weight_sharing": True,
          "allow_likelihood_release": True}


def write_tables(directory: Path) -> Path:
    """The example's tables (training, new customers, outcomes) under ``directory``."""
    spec = importlib.util.spec_from_file_location("make_example_tables", ROOT / "scripts" / "make_example_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write(directory, seed=0, n_train=300, n_new=60)
    return directory


def tables(directory: Path, part: str) -> dict[str, Path]:
    return {p: directory / part / f"{p}.csv" for p in PARTIES}


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def write(out: Path, methods: list[str], grpc: bool) -> int:
    from partialvfl.data.builders import from_tables
    from partialvfl.methods import get_method

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"torch": torch.__version__, "threads": 1, "arrays": {}}

    def save(name: str, array: np.ndarray) -> None:
        array = np.asarray(array)
        np.save(out / f"{name}.npy", array)
        manifest["arrays"][name] = digest(array)

    with tempfile.TemporaryDirectory() as tmp:
        example = write_tables(Path(tmp) / "example")
        raw = from_tables(tables(example, "train"), **KEYS)
        new = from_tables(tables(example, "new"), id_column="customer_id")
        order_key = Path(tmp) / "order.key"
        order_key.write_text(ORDER_KEY + "\n")  # fixed: the same sample order in every run, in process and federated
        deployment = None
        if grpc:
            from partialvfl.federation.grpc.local import LocalDeployment

            deployment = LocalDeployment(Path(tmp) / "fed", raw, deadline=600.0, start_timeout=600.0,
                                         policy=POLICY, alignment="hmac")
            deployment.key_file.write_text(ORDER_KEY + "\n")  # before the parties start and read it
            deployment.start()
        try:
            local = from_tables(tables(example, "train"), order_key=order_key, **KEYS)
            for method in methods:
                t0 = time.perf_counter()
                model = get_method(method)("fast", seed=SEED, **TINY[method]).fit(local)
                save(f"{method}.in-process.train", model.predict_proba(local))
                save(f"{method}.in-process.new", model.predict_proba(new))
                save(f"{method}.in-process.weights", weights(model, Path(tmp) / f"model-{method}"))
                line = f"{method}: in process {time.perf_counter() - t0:.1f} s"
                if deployment is not None:
                    t1 = time.perf_counter()
                    save(f"{method}.grpc.train", federated(deployment, method, local.ids))
                    line += f", over gRPC {time.perf_counter() - t1:.1f} s"
                print(line, flush=True)
        finally:
            if deployment is not None:
                deployment.close()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{len(manifest['arrays'])} arrays written to {out}")
    return 0


def weights(model: Any, directory: Path) -> np.ndarray:
    """Every floating-point tensor of a fitted model (coordinator and parties, as ``save`` writes them), flattened
    in a fixed order: a change of training numerics shows here even where predictions draw their noise anew."""
    model.save(directory)
    parts: list[np.ndarray] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point():
                parts.append(obj.detach().to(torch.float64).reshape(-1).numpy())
        elif isinstance(obj, dict):
            for key in sorted(obj, key=str):
                walk(obj[key])
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)

    for file in sorted(directory.glob("*.pt")):
        walk(torch.load(file, map_location="cpu", weights_only=False))
    return np.concatenate(parts) if parts else np.zeros(0)


def federated(deployment: Any, method: str, ids: Any) -> np.ndarray:
    """``method`` fitted across ``deployment``'s party processes; its predictions of ``ids``."""
    from partialvfl.methods import get_method
    from partialvfl.orchestration.predict import PredictOptions, run_predict

    fed = deployment.federation()
    try:
        view, handle = fed.align()
        model = get_method(method)("fast", seed=SEED, **TINY[method]).fit_federated(fed, view, handle)
        fed.release(handle)
        return run_predict(model, ids, PredictOptions(allow_prior_only=True)).output
    finally:
        fed.close()


def compare(old: Path, new: Path) -> int:
    a = json.loads((old / "manifest.json").read_text())["arrays"]
    b = json.loads((new / "manifest.json").read_text())["arrays"]
    differ = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {old if name in a else new}")
            differ += 1
            continue
        if a[name] == b[name]:
            print(f"{name}: identical")
            continue
        x, y = np.load(old / f"{name}.npy"), np.load(new / f"{name}.npy")
        differ += 1
        if x.shape != y.shape:
            print(f"{name}: shapes differ {x.shape} vs {y.shape}")
            continue
        classes = int((x.argmax(1) != y.argmax(1)).sum())
        print(f"{name}: DIFFERS, largest difference {np.abs(x - y).max():.3g}, {classes} of {len(x)} classes differ")
    print(f"{differ} of {len(set(a) | set(b))} arrays differ")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="fit every method and save its predictions")
    w.add_argument("out", type=Path)
    w.add_argument("--methods", nargs="+", default=list(TINY), choices=list(TINY))
    w.add_argument("--grpc", action="store_true", help="also fit across real party processes (slower)")
    w.add_argument("--false-vfl-estimator", choices=["adaptive", "paper"], default=None,
                   help="FALSE-VFL's prediction estimator (default: the method's default; 'paper' for a comparison "
                        "with code from before the estimator was a parameter)")
    c = sub.add_parser("compare", help="compare two folders of golden predictions bitwise")
    c.add_argument("old", type=Path)
    c.add_argument("new", type=Path)
    a = ap.parse_args(argv)
    if a.command == "write":
        if a.false_vfl_estimator:
            for method in ("false-vfl-1", "false-vfl-2"):
                TINY[method] = {**TINY[method], "predict_estimator": a.false_vfl_estimator}
        return write(a.out, a.methods, a.grpc)
    return compare(a.old, a.new)


if __name__ == "__main__":
    sys.exit(main())
