"""The privacy-utility report of issue 25: accuracy and attack success against epsilon.

For each dataset, method and seed: no DP; label DP (randomized response at the label holder) at epsilon 0.5, 1, 2,
4, 8; and a budget of (epsilon, 1e-5) at every passive party for epsilon 1, 4, 8, 16.  Each fit runs in process with
one passive party's runtime recorded (:class:`partialvfl.privacy.Recorder`) and is then attacked:

* accuracy on the test set's true labels;
* label inference by that passive party from its gradients: direction scoring (accuracy over the fit, majority vote
  over epochs, best cluster-to-class assignment) and norm scoring (ROC AUC, binary labels only);
* which rows are labelled: the AUC of how often a row appears in what the party receives;
* known-row regression by the coordinator on what the party released during training (25 known rows, the rows'
  last release; RMSE/std, median over features);
* FALSE-VFL's decode oracle (feature DP settings and no DP): a coordinator that sets the program up with a plan of
  nothing but its attack and spends the party's whole budget on it (25 known rows).

Results go to a JSON-lines store, one line per cell, and the script skips cells already there (resumable; run it in
chunks, ``--max-minutes``).  ``--report`` writes the tables (markdown) and one figure per dataset.

    python benchmarks/privacy.py --dataset own-data --store runs/privacy.jsonl --max-minutes 14
    python benchmarks/privacy.py --dataset digits --store runs/privacy.jsonl --max-minutes 14
    python benchmarks/privacy.py --dataset fashion-mnist --store runs/privacy.jsonl --seeds 0
    python benchmarks/privacy.py --report --store runs/privacy.jsonl --out docs/results/privacy
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("vanilla-vfl", "laser-vfl", "false-vfl-1")
LABEL_EPS = (0.5, 1.0, 2.0, 4.0, 8.0)
FEATURE_EPS = (1.0, 4.0, 8.0, 16.0)
DELTA = 1e-5
KNOWN = 25
RECORDED = ("embed", "grad_embedding", "encode", "decode", "update")


# ---------------------------------------------------------------------- data
def own_data(seed: int) -> tuple[Any, Any, int]:
    """The own-data example (scripts/make_example_tables.py, docs/own-data.md): train and the new users with their
    outcomes; the attacked passive party is the shop (1).  The tables are the documented ones (seed 0); ``seed``
    seeds the methods."""
    sys.path.insert(0, str(ROOT / "tests"))
    from example_tables import write_example
    from partialvfl.data.builders import from_tables

    d = Path(tempfile.gettempdir()) / "partialvfl-privacy-own-data"
    if not (d / "train" / "bank.csv").exists():
        write_example(d, seed=0, n_train=1500, n_new=300)
    parties = ("bank", "shop", "telco")
    train = from_tables({p: d / "train" / f"{p}.csv" for p in parties}, id_column="customer_id",
                        label_column="defaulted", active_party="bank")
    test = from_tables({"bank": d / "outcomes" / "bank.csv", "shop": d / "new" / "shop.csv",
                        "telco": d / "new" / "telco.csv"}, id_column="customer_id", label_column="defaulted",
                       active_party="bank")
    return train, test, 1


def digits(seed: int) -> tuple[Any, Any, int]:
    """Digits under the protocol of docs/deployment.md's settings table (4 parties of 4x4 pixels, 500 labels, 100
    aligned, MCAR 0.2 in training); data seed ``seed``; the attacked passive party is 0 (the active party is 3)."""
    from partialvfl.data.protocol import ProtocolConfig, make_protocol

    return (*make_protocol(ProtocolConfig(dataset="digits", parties=4, n_labels=500, n_aligned=100,
                                          train_missing="mcar:0.2", test_missing="none", seed=seed)), 0)


def fashion_mnist(seed: int) -> tuple[Any, Any, int]:
    """FashionMNIST at CPU scale (4 parties of 14x14 tiles, 4,000 training images of which 1,000 labelled, 200
    aligned, MCAR 0.2 in training; 2,000 test images); data seed ``seed``; the attacked passive party is 0."""
    from partialvfl.data.protocol import ProtocolConfig, make_protocol

    return (*make_protocol(ProtocolConfig(dataset="fashion-mnist", parties=4, n_labels=1000, n_aligned=200,
                                          train_missing="mcar:0.2", test_missing="none", seed=seed, max_train=4000,
                                          max_test=2000)), 0)


DATASETS = {"own-data": own_data, "digits": digits, "fashion-mnist": fashion_mnist}
CLASSES = {"own-data": 2, "digits": 10, "fashion-mnist": 10}


# ---------------------------------------------------------------------- cells
SETTINGS = ("none", "label", "feature", "decode")


def cells(dataset: str, methods: tuple[str, ...], seeds: list[int], *, label_eps: tuple[float, ...] = LABEL_EPS,
          feature_eps: tuple[float, ...] = FEATURE_EPS, settings: tuple[str, ...] = SETTINGS
          ) -> Iterator[dict[str, Any]]:
    """Every cell, the cheap ones first (split networks and the decode oracle for every seed, then FALSE-VFL), so
    that a run cut short has whole seeds of them; ``label_eps``, ``feature_eps`` and ``settings`` narrow the grid
    (the decode oracle runs with ``false-vfl-1`` among the methods)."""
    def one(method: str, seed: int) -> Iterator[dict[str, Any]]:
        grid = {"none": (None,), "label": label_eps, "feature": feature_eps}
        for setting in ("none", "label", "feature"):
            if setting in settings:
                for eps in grid[setting]:
                    yield {"dataset": dataset, "method": method, "seed": seed, "setting": setting, "epsilon": eps}

    for method in (m for m in methods if m != "false-vfl-1"):
        for seed in seeds:
            yield from one(method, seed)
    if "false-vfl-1" in methods and "decode" in settings:
        for seed in seeds:
            for eps in (None, *feature_eps):
                yield {"dataset": dataset, "method": "false-vfl-1", "seed": seed, "setting": "decode",
                       "epsilon": eps}
    if "false-vfl-1" in methods:
        for seed in seeds:
            yield from one("false-vfl-1", seed)


def key(cell: dict[str, Any]) -> tuple[Any, ...]:
    return cell["dataset"], cell["method"], cell["seed"], cell["setting"], cell["epsilon"]


def _features_by_row(train: Any, party: int) -> dict[int, np.ndarray]:
    view = train.party(party)
    x = view.features.reshape(len(view.rows), -1)
    return {int(r): x[i] for i, r in enumerate(view.rows)}


def run_fit(cell: dict[str, Any], train: Any, test: Any, party: int) -> dict[str, Any]:
    """One fit, recorded at ``party``, and every attack on what was recorded."""
    from partialvfl.federation.runtime.coordinator import LocalFederation
    from partialvfl.methods import get_method
    from partialvfl.methods.evaluation import evaluate
    from partialvfl.privacy import (
        Recorder,
        gradient_observations,
        known_row_attack,
        label_attack,
        labeled_rows_attack,
        released_per_row,
        row_counts,
    )

    eps, setting = cell["epsilon"], cell["setting"]
    budgets = ({k: (eps, DELTA) for k in range(train.n_parties) if k != train.active_party}
               if setting == "feature" else None)
    fed = LocalFederation.for_dataset(train, party_dp=budgets)
    rec = Recorder(fed, parties=[party], kinds=RECORDED)
    t0 = time.perf_counter()
    model = get_method(cell["method"])("fast", seed=cell["seed"],
                                       label_dp=eps if setting == "label" else None).fit(train, federation=fed)
    out: dict[str, Any] = {"fit_seconds": time.perf_counter() - t0, "accuracy": evaluate(model, test)["accuracy"]}
    n_classes = train.task.n_classes
    labels = label_attack(gradient_observations(rec, party), train.y, train.labeled, n_classes, seed=cell["seed"])
    out["direction_accuracy"] = labels.get("direction_accuracy_fit")
    out["direction_accuracy_epoch1"] = labels["direction_accuracy"][0] if labels["direction_accuracy"] else None
    out["norm_auc"] = labels.get("norm_auc_fit")
    out["norm_auc_epoch1"] = labels["norm_auc"][0] if labels["norm_auc"] else None
    counts = row_counts(rec, party, train.n_samples)
    out["labelled_rows_auc"] = labeled_rows_attack(counts, train.observed[:, party], train.labeled)["auc"]
    released = released_per_row(rec, party, ["emb:f", "mu"])
    if len(released) > KNOWN + 1:
        out["known_row_rmse_std"] = known_row_attack(released, _features_by_row(train, party), KNOWN,
                                                     seed=cell["seed"])["median_rmse_std"]
    if model.privacy_ and "parties" in model.privacy_:
        out["epsilon_spent"] = max(r["epsilon_spent"] for r in model.privacy_["parties"].values())
    return out


def run_decode(cell: dict[str, Any], train: Any, party: int) -> dict[str, Any]:
    """The decode oracle against ``party`` (FALSE-VFL-I set up, untrained: the oracle needs no training), its whole
    budget spent on it."""
    from partialvfl.federation.runtime.coordinator import LocalFederation
    from partialvfl.methods import get_method
    from partialvfl.privacy import decode_oracle, relative_rmse, ridge

    eps = cell["epsilon"]
    fed = LocalFederation.for_dataset(train, party_dp=None if eps is None else {party: (eps, DELTA)})
    h = fed.attach(train, "train")
    model = get_method("false-vfl-1")("fast", seed=cell["seed"], pretrain_epochs=0, epochs=0, dp_predictions=1)
    model.fit_federated(fed, train.coordinator_view(), h)
    view = train.party(party)
    ll, answered = decode_oracle(fed, party, h, view.rows, samples=8, repeats=3)
    x = view.features.reshape(len(view.rows), -1).astype(np.float64)
    known = np.sort(np.random.default_rng(cell["seed"]).choice(len(x), KNOWN, replace=False))
    err = relative_rmse(x, ridge(ll - ll[:, :1], x, known), np.setdiff1d(np.arange(len(x)), known))
    return {"decode_rmse_std": float(np.median(err)), "decode_calls": answered}


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    store = Path(args.store)
    store.parent.mkdir(parents=True, exist_ok=True)
    done = {key(json.loads(line)) for line in store.read_text().splitlines() if line.strip()} \
        if store.exists() else set()
    seeds = [int(s) for s in args.seeds.split(",")]
    methods = tuple(m for m in args.methods.split(",") if m)
    t_end = time.monotonic() + 60 * args.max_minutes
    data: dict[int, tuple[Any, Any, int]] = {}
    grid = cells(args.dataset, methods, seeds, label_eps=_floats(args.label_eps), feature_eps=_floats(args.feature_eps),
                 settings=tuple(x for x in args.settings.split(",") if x))
    todo = [c for c in grid if key(c) not in done]
    print(f"{len(todo)} cells to run ({len(done)} in the store)", file=sys.stderr)
    for cell in todo:
        if time.monotonic() > t_end:
            print("time is up: run again to continue", file=sys.stderr)
            return 0
        if cell["seed"] not in data:
            data[cell["seed"]] = DATASETS[args.dataset](cell["seed"])
        train, test, party = data[cell["seed"]]
        t0 = time.perf_counter()
        result = run_decode(cell, train, party) if cell["setting"] == "decode" else run_fit(cell, train, test, party)
        row = {**cell, **result, "seconds": time.perf_counter() - t0}
        with store.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), file=sys.stderr)
    return 0


# ---------------------------------------------------------------------- report
def _mean_std(values: list[float]) -> str:
    v = [x for x in values if x is not None]
    if not v:
        return ""
    return _fmt(np.mean(v)) + (f" ± {_fmt(np.std(v))}" if len(v) > 1 else "")


def _fmt(x: float) -> str:
    return f"{x:.3f}" if abs(x) >= 0.01 or abs(x) < 1e-12 else f"{x:.2g}"


def report(args: argparse.Namespace) -> int:
    rows = [json.loads(line) for line in Path(args.store).read_text().splitlines() if line.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for dataset in sorted({r["dataset"] for r in rows}):
        mine = [r for r in rows if r["dataset"] == dataset]
        lines += [f"## {dataset}", "", *_tables(mine), ""]
        _figure(mine, out / f"{dataset}.png", dataset)
    (out / "privacy.md").write_text("\n".join(lines))
    print((out / "privacy.md").read_text())
    return 0


def _group(rows: list[dict[str, Any]], method: str, setting: str, eps: float | None, field: str) -> list[float]:
    return [r.get(field) for r in rows if r["method"] == method and r["setting"] == setting and r["epsilon"] == eps]


def _tables(rows: list[dict[str, Any]]) -> list[str]:
    methods = [m for m in METHODS if any(r["method"] == m and r["setting"] != "decode" for r in rows)]
    seeds = sorted({r["seed"] for r in rows})
    out = [f"Seeds {seeds}; mean ± standard deviation over the seeds a cell ran (n).", "",
           "| method | setting | epsilon | n | accuracy | direction attack | norm AUC | labelled rows AUC | "
           "known-row RMSE/std | epsilon spent |", "|---|---|---|---|---|---|---|---|---|---|"]
    for m in methods:
        for setting, grid in (("none", (None,)), ("label", LABEL_EPS), ("feature", FEATURE_EPS)):
            for eps in grid:
                cells_ = [_mean_std(_group(rows, m, setting, eps, f)) for f in
                          ("accuracy", "direction_accuracy", "norm_auc", "labelled_rows_auc", "known_row_rmse_std",
                           "epsilon_spent")]
                if any(cells_):
                    label = {"none": "no DP", "label": "label DP", "feature": f"feature DP (delta {DELTA:g})"}
                    n = len(_group(rows, m, setting, eps, "accuracy"))
                    out.append(f"| {m} | {label[setting]} | {'' if eps is None else f'{eps:g}'} | {n} | "
                               + " | ".join(cells_) + " |")
    dec = [(eps, _mean_std(_group(rows, "false-vfl-1", "decode", eps, "decode_rmse_std")))
           for eps in (None, *FEATURE_EPS)]
    bound = _direct_bound(rows)
    if bound:
        out += ["", "The strongest release a budget permits (the attacked party's row itself, standardised, clipped "
                "at the median row norm, in one Gaussian mechanism spending the whole budget), then known-row "
                "regression with 25 known rows (RMSE/std, 5 draws):", "",
                "| epsilon | " + " | ".join(f"{e:g}" for e in FEATURE_EPS) + " |", "|---" * (len(FEATURE_EPS) + 1)
                + "|", "| RMSE/std | " + " | ".join(f"{v:.3f}" for v in bound) + " |"]
    if any(v for _, v in dec):
        out += ["", "FALSE-VFL decode oracle (the party's whole budget spent on it; 25 known rows; RMSE/std):", "",
                "| epsilon | " + " | ".join("no DP" if e is None else f"{e:g}" for e, _ in dec) + " |",
                "|---" * (len(dec) + 1) + "|", "| RMSE/std | " + " | ".join(v for _, v in dec) + " |"]
    return out


def _direct_bound(rows: list[dict[str, Any]]) -> list[float]:
    """:func:`~partialvfl.privacy.direct_release_attack` on the attacked party's training rows, per epsilon."""
    from partialvfl.privacy import direct_release_attack

    dataset = rows[0]["dataset"]
    train, _, party = DATASETS[dataset](0)
    view = train.party(party)
    x = view.features.reshape(len(view.rows), -1)
    return [float(np.mean([direct_release_attack(x, e, DELTA, KNOWN, seed=s) for s in range(5)]))
            for e in FEATURE_EPS]


def _measured(xs: tuple[float, ...], ys: list[float]) -> tuple[list[float], list[float]]:
    """The points that were measured (a line joins them; a cell not run leaves no gap)."""
    pairs = [(x, y) for x, y in zip(xs, ys) if not np.isnan(y)]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _figure(rows: list[dict[str, Any]], path: Path, dataset: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for m in METHODS:
        base = np.nanmean([v for v in _group(rows, m, "none", None, "accuracy") if v is not None] or [np.nan])
        for ax, setting, grid in ((axes[0], "label", LABEL_EPS), (axes[1], "feature", FEATURE_EPS)):
            acc = [np.mean([v for v in _group(rows, m, setting, e, "accuracy") if v is not None] or [np.nan])
                   for e in grid]
            line = ax.plot(*_measured(grid, acc), marker="o", label=m)[0]
            ax.axhline(base, color=line.get_color(), ls=":", lw=1)
        att = [np.mean([v for v in _group(rows, m, "label", e, "direction_accuracy") if v is not None] or [np.nan])
               for e in LABEL_EPS]
        axes[2].plot(*_measured(LABEL_EPS, att), marker="o", label=f"{m}: direction attack")
    k = CLASSES[dataset]
    rr = [np.exp(e) / (k - 1 + np.exp(e)) for e in LABEL_EPS]
    axes[2].plot(LABEL_EPS, rr, "k--", label=f"randomized response: e^eps/({k - 1}+e^eps)")
    known = [np.mean([v for m in METHODS for v in _group(rows, m, "feature", e, "known_row_rmse_std")
                      if v is not None] or [np.nan]) for e in FEATURE_EPS]
    ax2 = axes[1].twinx()
    ax2.plot(*_measured(FEATURE_EPS, known), "k--", marker="x", label="known-row regression, RMSE/std (right)")
    ax2.set_ylim(0, 1.3)
    ax2.legend(loc="lower right", fontsize=7)
    for ax, title in zip(axes, ("accuracy vs label-DP epsilon (dotted: no DP)",
                                "accuracy vs each passive party's epsilon (delta 1e-5)",
                                "label inference by a passive party vs label-DP epsilon")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("epsilon")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"privacy and utility: {dataset}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", choices=sorted(DATASETS), default="own-data")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--label-eps", default=",".join(f"{e:g}" for e in LABEL_EPS), help="label-DP epsilons to run")
    ap.add_argument("--feature-eps", default=",".join(f"{e:g}" for e in FEATURE_EPS),
                    help="epsilons of each passive party's budget to run (delta 1e-5)")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help="which settings to run: none, label, feature, decode (FALSE-VFL's decode oracle)")
    ap.add_argument("--store", default="runs/privacy.jsonl")
    ap.add_argument("--max-minutes", type=float, default=14.0, help="start no cell after this many minutes")
    ap.add_argument("--report", action="store_true", help="write the tables and figures from the store")
    ap.add_argument("--out", default="docs/results/privacy")
    args = ap.parse_args(argv)
    return report(args) if args.report else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
