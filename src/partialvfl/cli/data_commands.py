"""What there is to work with: ``datasets``, ``describe`` (a protocol's missingness) and ``methods``."""

from __future__ import annotations

import argparse
from typing import Any

from partialvfl.cli.common import DEFAULT_PRESET, add_protocol_options, emit, protocol_config

__all__ = ["add_commands"]


def add_commands(sub: Any) -> None:
    """Add ``datasets``, ``describe`` and ``methods`` to the ``partialvfl`` sub-parsers."""
    p = sub.add_parser("datasets", help="list datasets, whether they are available here and where they read from")
    p.add_argument("--json", action="store_true", help="one JSON list")
    p.set_defaults(func=cmd_datasets)

    p = sub.add_parser("describe", help="build the paper's protocol on a dataset and describe the missingness")
    add_protocol_options(p, test=True)
    p.add_argument("--json", action="store_true", help="one JSON object with keys train and test")
    p.set_defaults(func=cmd_describe)

    p = sub.add_parser("methods", help="list methods, their presets' values and every parameter (no torch needed)",
                       description="Each method's parameters with the values every preset actually uses, the "
                                   f"accepted values and a help line. The default preset ({DEFAULT_PRESET}) is marked "
                                   "'(default)'. Presets marked 'per dataset' depend on the dataset: pass --dataset "
                                   "to see them for one.")
    p.add_argument("--method", default=None, help="only this method")
    p.add_argument("--dataset", default=None, help="resolve dataset-dependent presets for this dataset")
    p.add_argument("--json", action="store_true", help="one JSON list: per method its presets' values and params")
    p.set_defaults(func=cmd_methods)


def cmd_datasets(args: argparse.Namespace) -> int:
    from partialvfl.data.sources import list_sources

    rows = list_sources()
    if args.json:
        emit(rows, True, "")
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        mark = "yes" if r.get("available") else "no "
        shape = r.get("shape") or ""
        classes = r.get("n_classes") or ""
        print(f"{r['name']:<{width}}  available: {mark}  {shape!s:<28} classes: {classes!s:<4} {r.get('where', '')}")
    return 0


def _summary_table(name: str, s: dict[str, Any]) -> str:
    lines = [f"{name}: {s['n_samples']} samples, {s['n_labeled']} labelled, {s['all_missing']} with no observed party"]
    lines.append("  observed fraction per party: " + ", ".join(f"{v:.3f}" for v in s["observed_fraction"]))
    hist = s["observed_parties_histogram"]
    lines.append("  samples by number of observed parties: " + ", ".join(f"{k}: {v}" for k, v in enumerate(hist)))
    return "\n".join(lines)


def cmd_describe(args: argparse.Namespace) -> int:
    from partialvfl.data.protocol import describe, make_protocol

    train, test = make_protocol(protocol_config(args))
    out = describe(train, test)
    emit(out, args.json, _summary_table("train", out["train"]) + "\n" + _summary_table("test", out["test"]))
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    """Every declared method (read from the torch-free declarations): presets' values, accepted values, help."""
    from partialvfl.methods.registry import load_specs

    specs = load_specs()
    names = sorted(specs)
    if args.method is not None:
        if args.method not in specs:
            raise ValueError(f"unknown method {args.method!r}; available: {', '.join(names)}")
        names = [args.method]
    rows = [_method_row(specs[n], args.dataset) for n in names]
    if args.json:
        emit(rows, True, "")
        return 0
    print(f"Presets: '{DEFAULT_PRESET}' is the default (fit --preset, grid entries without a preset); the others are "
          "chosen by name.\n")
    print("\n\n".join(_method_text(r, args.dataset) for r in rows))
    print("\n" + _privacy_text())
    return 0


def _privacy_text() -> str:
    """The privacy parameters every method takes (the methods without differential privacy refuse them at fit)."""
    from partialvfl.methods.params import PRIVACY_PARAMS

    width = max(len(p.name) for p in PRIVACY_PARAMS.params)
    lines = ["Privacy parameters, of every method that supports differential privacy (the others refuse them at fit; "
             "--param NAME=VALUE, label_dp: --label-dp EPS):"]
    lines += [f"  {p.name:<{width}}  {_show(p.default):<5}  {p.describe()}: {p.help}" for p in PRIVACY_PARAMS.params]
    return "\n".join(lines)


def _param_rows(params: Any) -> list[dict[str, Any]]:
    return [{"name": p.name, "default": p.default, "accepted": p.describe(), "help": p.help,
             "aliases": list(p.aliases), "epochs": p.epochs} for p in params]


def _method_row(spec: Any, dataset: str | None) -> dict[str, Any]:
    from partialvfl.methods.params import PRIVACY_PARAMS

    space = spec.params
    return {
        "name": spec.name, "summary": spec.summary, "title": spec.title, "paper_name": spec.paper_name,
        "docs": spec.docs or None, "private": spec.private, "aligned_only": spec.aligned_only,
        "presets": {p: space.resolve(p, dataset, owner=spec.name) for p in space.preset_names},
        "dataset_presets": list(space.dataset_presets),
        "default_preset": DEFAULT_PRESET if DEFAULT_PRESET in space.preset_names else None,
        "params": _param_rows(space.params),
        # the privacy parameters it takes (label DP, party DP; empty: it supports no differential privacy)
        "privacy_params": _param_rows(PRIVACY_PARAMS.params) if spec.private else [],
    }


def _method_text(row: dict[str, Any], dataset: str | None) -> str:
    presets = list(row["presets"])
    heads = [p + (" (default)" if p == row["default_preset"] else "")
             + (f" [{dataset}]" if dataset and p in row["dataset_presets"] else
                " [per dataset]" if p in row["dataset_presets"] else "") for p in presets]
    values = [[_show(row["presets"][p][q["name"]]) for p in presets] for q in row["params"]]
    name_w = max(len("parameter"), *(len(q["name"]) for q in row["params"]))
    widths = [max(len(h), *(len(v[i]) for v in values)) for i, h in enumerate(heads)]
    facts = [f"docs: {row['docs']}"] if row["docs"] else []
    facts.append("differential privacy: yes" if row["private"] else "differential privacy: no")
    if row["aligned_only"]:
        facts.append("trains on aligned rows only")
    lines = [f"{row['name']}: {row['summary']}", "  " + "; ".join(facts),
             "  " + "  ".join([f"{'parameter':<{name_w}}", *(f"{h:<{w}}" for h, w in zip(heads, widths)),
                               "accepted: help"])]
    for q, v in zip(row["params"], values):
        extra = f" (was: {', '.join(q['aliases'])})" if q["aliases"] else ""
        lines.append("  " + "  ".join([f"{q['name']:<{name_w}}", *(f"{x:<{w}}" for x, w in zip(v, widths)),
                                       f"{q['accepted']}: {q['help']}{extra}"]))
    return "\n".join(lines)


def _show(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(_show(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:g}"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
