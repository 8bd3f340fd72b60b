"""Honest fits under a deployed party's default policy against the research policy (issue 23).

Every method on digits (4 parties of 16 features, 500 labels, 100 aligned, MCAR 0.2 in training, the fast preset,
method seed 0), in process: once with the research policy (the simulation's), once with every party on the default
policy of a deployed party except that it takes the coordinator's seed (``[policy] seed = "coordinator"``), so the
two fits start from the same weights and differ only by what the default policy bounds.  Per method: test accuracy
(MCAR 0 and MCAR 0.5) under each, the largest gradient row norm a party received (against ``max_grad_norm``), how
many gradient rows were clipped, and what had to change for the default policy to accept the setup (FALSE-VFL:
``wire = auto`` picks the bound wire; combinatorial and FedHSSL: narrower widths for ``max_setup_width_ratio``;
FedHSSL: ``allow_weight_sharing``, which its aggregation needs).

    python benchmarks/policy_accuracy.py                       # every method, about 10 minutes on one core
    python benchmarks/policy_accuracy.py --methods false-vfl-1 --floors 0,0.1,0.3   # FALSE-VFL's floor
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import partialvfl.federation.runtime.party as party_module
from partialvfl.data.protocol import ProtocolConfig, make_protocol, with_test_mechanism
from partialvfl.federation import LocalFederation, guards
from partialvfl.federation.trust.policy import PartyPolicy
from partialvfl.methods import get_method, method_names

#: what a fast preset must narrow to fit the default policy at 16 features (tests/test_policy.py)
WITHIN_DEFAULT = {"combinatorial": {"latent_dim": 8}, "fedhssl": {"latent_dim": 16, "proj_dim": 16}}
GRADIENTS: dict[str, float] = {"max": 0.0, "clipped": 0.0}


def _watch_gradients() -> None:
    """Record the largest gradient row norm a party gets and how many rows its policy clipped."""
    clip = guards.clip_gradient_rows

    def watched(spec: Any, tensors: Any, max_norm: float | None, kind: str) -> Any:
        decls = {d.name: d for d in spec.request}
        for name, t in tensors.items():
            dim = next((dim for g, dim in spec.gradients if decls[g].match(name) is not None), None)
            if dim is not None and t.numel():
                GRADIENTS["max"] = max(GRADIENTS["max"], float(guards._row_norms(t, dim).max()))
        out, n = clip(spec, tensors, max_norm, kind)
        GRADIENTS["clipped"] += n
        return out, n

    party_module.clip_gradient_rows = watched  # type: ignore[assignment]


def fit(name: str, train: Any, policy: PartyPolicy | None, params: dict[str, Any], seed: int = 0) -> Any:
    fed = LocalFederation.for_dataset(train)
    if policy is not None:
        for rt in fed.runtimes:
            rt.policy = policy
    GRADIENTS.update(max=0.0, clipped=0.0)
    return get_method(name)("fast", seed=seed, **params).fit(train, federation=fed)


def accuracy(model: Any, test: Any) -> float:
    return float(model.score(test))  # by class value (the model's classes), not index


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=",".join(method_names()))
    ap.add_argument("--floors", default="", help="FALSE-VFL only: also fit under the default policy with these "
                    "[policy] min_latent_scale values (comma-separated)")
    ap.add_argument("--seeds", default="0", help="method seeds (comma-separated); the data split is seed 0")
    ap.add_argument("--no-default", action="store_true", help="only the research policy and the --floors")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    _watch_gradients()
    config = ProtocolConfig(dataset="digits", parties=4, n_labels=500, n_aligned=100, train_missing="mcar:0.2",
                            seed=0)
    train, test = make_protocol(config)
    test_half = with_test_mechanism(config, "mcar:0.5")
    rows = []
    for name in args.methods.split(","):
        settings: list[tuple[str, PartyPolicy | None, dict[str, Any]]] = [("research", None, {})]
        default = {"seed": "coordinator", "allow_weight_sharing": name == "fedhssl"}
        if not args.no_default:
            settings.append(("default", PartyPolicy.from_table(default), WITHIN_DEFAULT.get(name, {})))
        if name.startswith("false-vfl"):
            for floor in [float(f) for f in args.floors.split(",") if f]:
                settings.append((f"default, min_latent_scale {floor:g}",
                                 PartyPolicy.from_table({**default, "min_latent_scale": floor}), {}))
        for (label, policy, params), seed in [(s, int(v)) for s in settings for v in args.seeds.split(",")]:
            t0 = time.perf_counter()
            model = fit(name, train, policy, params, seed)
            row = {"method": name, "policy": label, "seed": seed, "params": params, "acc_mcar0": accuracy(model, test),
                   "acc_mcar05": accuracy(model, test_half), "max_grad_row_norm": GRADIENTS["max"],
                   "clipped_rows": int(GRADIENTS["clipped"]), "seconds": time.perf_counter() - t0}
            if name.startswith("false-vfl"):
                row["wire"] = model.params_["wire"]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print("| method | policy | seed | changed for the default policy | accuracy MCAR 0 | MCAR 0.5 | largest gradient "
          "row | rows clipped |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        change = ", ".join(f"{k}={v}" for k, v in r["params"].items()) or (f"wire {r['wire']}" if "wire" in r else "-")
        print(f"| {r['method']} | {r['policy']} | {r['seed']} | {change} | {r['acc_mcar0']:.3f} | "
              f"{r['acc_mcar05']:.3f} | {r['max_grad_row_norm']:.3g} | {r['clipped_rows']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
