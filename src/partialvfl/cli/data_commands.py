"""What there is to work with: ``datasets``, ``describe`` (a protocol's missingness) and ``methods``."""

from __future__ import annotations

import argparse
from typing import Any

from partialvfl.cli.common import add_protocol_options, emit, protocol_config

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

    p = sub.add_parser("methods", help="list methods, presets and parameters")
    p.add_argument("--json", action="store_true")
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
    from partialvfl.methods import get_method, method_names

    rows = []
    for name in method_names():
        cls = get_method(name)
        rows.append({"name": name, "presets": list(cls.presets), "params": cls.default_params()})
    if args.json:
        emit(rows, True, "")
    else:
        for r in rows:
            print(f"{r['name']:<14} presets: {', '.join(r['presets'])}")
            print("    " + ", ".join(f"{k}={v}" for k, v in r["params"].items()))
    return 0
