"""Method parameters from the command line: ``--param NAME=VALUE`` (repeatable) and ``--epochs N``.

The one place that turns them into a method: ``fit`` in process and ``fit --federation`` both go through
:func:`method_from_args`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["add_prediction_param_option", "epoch_params", "load_for_prediction", "method_from_args", "parse_params",
           "parse_value", "progress_setting", "report_last_epochs"]


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


def add_prediction_param_option(p: argparse.ArgumentParser) -> None:
    """``--param NAME=VALUE`` of ``predict`` and ``evaluate``: the model's prediction parameters (``predict_*``)."""
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="change how the saved model predicts without refitting: one of its prediction parameters "
                        "(predict_*, e.g. FALSE-VFL's predict_estimator=paper or predict_rounds=2; `partialvfl "
                        "methods` lists them), repeatable; any other parameter is refused")


def load_for_prediction(args: argparse.Namespace, **kwargs: Any) -> Any:
    """The saved model ``--model`` on ``--device``, with ``--param``'s prediction parameters set (``kwargs``: to
    :meth:`~partialvfl.methods.base.VFLMethod.load`, e.g. a federation)."""
    from partialvfl.cli.common import device_options
    from partialvfl.methods import VFLMethod

    model = VFLMethod.load(args.model, **kwargs, **device_options(args))
    params = parse_params(getattr(args, "param", None))
    return model.set_prediction_params(**params) if params else model


def epoch_params(method_cls: Any, epochs: int) -> dict[str, Any]:
    """``--epochs N``: every epoch count of the method (:meth:`~partialvfl.methods.base.VFLMethod.epoch_param_names`,
    pretraining included) set to ``N``."""
    keys = method_cls.epoch_param_names()
    if not keys:
        raise ValueError(f"method {method_cls.name!r} has no epoch parameter; use --param")
    return {k: epochs for k in keys}


def method_from_args(args: argparse.Namespace) -> Any:
    """The method ``fit`` trains: ``--method``, ``--preset``, ``--seed``, ``--param`` (declared parameters only,
    read by their declared types) and ``--epochs`` (which wins over a ``--param`` of the same name), on ``--device``
    at ``--precision`` (``--compile``), with the progress :func:`progress_setting` gives."""
    from partialvfl.cli.common import device_options
    from partialvfl.methods import get_method
    from partialvfl.methods.run_options import refuse_run_option

    method_cls = get_method(args.method)
    params = parse_params(args.param)
    refuse_run_option(params)  # a run option, the preset, the seed, label DP's epsilon: each has its own flag
    if args.epochs is not None:
        params.update(epoch_params(method_cls, args.epochs))
    return method_cls(args.preset, seed=args.seed, progress=progress_setting(args), **device_options(args),
                      label_dp=getattr(args, "label_dp", None), **params)


def progress_setting(args: argparse.Namespace) -> bool | str:
    """A fit's progress: nothing with ``--quiet``, a line per epoch with ``--log-epochs``, else a bar on a terminal
    (nothing per epoch when stderr is not one; :func:`report_last_epochs` sums the fit up in one line)."""
    if args.quiet:
        return False
    return "epochs" if getattr(args, "log_epochs", False) else True


def report_last_epochs(args: argparse.Namespace, model: Any) -> None:
    """One line on stderr after a fit without ``--quiet`` or ``--log-epochs``: each stage's epochs and its last
    epoch's metrics (what the per-epoch lines would have ended with)."""
    if progress_setting(args) is not True or not getattr(model, "history_", None):
        return
    last: dict[str, dict[str, Any]] = {}
    for row in model.history_:
        last[row["stage"]] = row
    parts = [f"{stage} {row['epoch']} epochs, last: " + " ".join(
        f"{k}={v:.4f}" for k, v in row.items() if k not in ("stage", "epoch")) for stage, row in last.items()]
    print(f"[{model.name}] " + "; ".join(parts), file=sys.stderr)
