"""Method parameters from the command line: ``--param NAME=VALUE`` (repeatable) and ``--epochs N``.

The one place that turns them into a method: ``fit`` in process and ``fit --federation`` both go through
:func:`method_from_args`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

__all__ = ["epoch_params", "method_from_args", "parse_params", "parse_value"]


def parse_value(text: str) -> Any:
    """JSON when ``text`` parses as JSON (numbers, booleans, lists, quoted strings), else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_params(items: Sequence[str] | None) -> dict[str, Any]:
    """``NAME=VALUE`` pairs; ``-`` in a name becomes ``_`` (``--param batch-train=32`` is ``batch_train``)."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--param takes KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip().replace("-", "_")] = parse_value(v.strip())
    return out


def epoch_params(method_cls: Any, epochs: int) -> dict[str, Any]:
    """``--epochs N``: every epoch count of the method (:meth:`~partialvfl.methods.base.VFLMethod.epoch_param_names`,
    pretraining included) set to ``N``."""
    keys = method_cls.epoch_param_names()
    if not keys:
        raise ValueError(f"method {method_cls.name!r} has no epoch parameter; use --param")
    return {k: epochs for k in keys}


def method_from_args(args: argparse.Namespace) -> Any:
    """The method ``fit`` trains: ``--method``, ``--preset``, ``--seed``, ``--param`` and ``--epochs`` (which wins
    over a ``--param`` of the same name), with per-epoch progress unless ``--quiet``."""
    from partialvfl.methods import get_method

    method_cls = get_method(args.method)
    params = parse_params(args.param)
    if args.epochs is not None:
        params.update(epoch_params(method_cls, args.epochs))
    return method_cls(args.preset, seed=args.seed, progress=not args.quiet,
                      label_dp=getattr(args, "label_dp", None), **params)
