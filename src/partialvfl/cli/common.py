"""What several commands share: the protocol options (dataset, parties, labels, missingness) and output."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["PROTOCOL_DEFAULTS", "THREADS_HELP", "add_protocol_options", "add_threads_option", "emit",
           "protocol_config", "threads_for"]

PROTOCOL_DEFAULTS = {"dataset": "digits", "parties": 4, "labels": 500, "aligned": 100}


def add_protocol_options(p: argparse.ArgumentParser, *, test: bool, train: bool = True) -> None:
    """The options of :func:`protocol_config` (``--train-missing`` if ``train``, ``--test-missing`` if ``test``)."""
    g = p.add_argument_group("protocol (the FALSE-VFL paper's: labels, aligned reserve, missingness)")
    g.add_argument("--dataset", default=PROTOCOL_DEFAULTS["dataset"],
                   help="dataset name (see `partialvfl datasets`); default: %(default)s")
    g.add_argument("--data-dir", default=None, help="directory holding the dataset's original files, if needed")
    g.add_argument("--parties", type=int, default=PROTOCOL_DEFAULTS["parties"],
                   help="number of parties K; default: %(default)s")
    g.add_argument("--labels", type=int, default=PROTOCOL_DEFAULTS["labels"],
                   help="labelled training samples (paper: 500 tabular, 1000 images); default: %(default)s")
    g.add_argument("--aligned", type=int, default=PROTOCOL_DEFAULTS["aligned"],
                   help="labelled samples kept fully aligned (paper: 100 / 200); default: %(default)s")
    if train:
        g.add_argument("--train-missing", default="mcar:0.2",
                       help="mechanism for all other training samples (none, mcar:P, mar1, mar2, mnar:P, beta, "
                            "absent:K); default: %(default)s")
    if test:
        g.add_argument("--test-missing", default="none", help="mechanism for every test sample; default: %(default)s")
    g.add_argument("--splitter", default=None, help="party split: contiguous, grid, grid:RxC, columns:...")
    g.add_argument("--max-train", type=int, default=None, help="cap the training set (quick runs)")
    g.add_argument("--max-test", type=int, default=None, help="cap the test set (quick runs)")
    g.add_argument("--seed", type=int, default=0, help="seed for split, labels, mechanisms, model; default: 0")


THREADS_HELP = ("torch threads for the fit: a number, or auto (default): one thread when the method's estimated "
                "work per training step is small (under 2 GFLOP), else all cores; OpenMP's idle threads sleep "
                "instead of spinning either way, so a shared machine slows down in proportion (see "
                "docs/benchmarks.md)")


def add_threads_option(p: argparse.ArgumentParser, help_text: str = THREADS_HELP) -> None:
    """``--threads N|auto``."""
    p.add_argument("--threads", default="auto", metavar="N|auto", help=help_text)


def threads_for(args: argparse.Namespace, model: Any, data: Any) -> int:
    """The torch threads ``--threads`` gives a fit of ``model`` on ``data`` (see :mod:`partialvfl.utils.threads`)."""
    from partialvfl.utils.threads import resolve_threads, step_flops_of, thread_budget

    dataset = data.info.get("dataset") or data.name or None
    flops = step_flops_of(type(model), model.resolve_params(dataset), data.feature_shapes)
    return resolve_threads(args.threads, flops, thread_budget())


def protocol_config(args: argparse.Namespace, test_missing: str | None = None) -> Any:
    """The :class:`~partialvfl.data.protocol.ProtocolConfig` the options describe."""
    from partialvfl.data.protocol import ProtocolConfig

    return ProtocolConfig(
        dataset=args.dataset,
        parties=args.parties,
        n_labels=args.labels,
        n_aligned=args.aligned,
        train_missing=getattr(args, "train_missing", "none"),
        test_missing=test_missing if test_missing is not None else getattr(args, "test_missing", "none"),
        seed=args.seed,
        splitter=args.splitter,
        max_train=args.max_train,
        max_test=args.max_test,
        data_dir=args.data_dir,
    )


def emit(obj: Any, as_json: bool, text: str) -> None:
    """Print ``obj`` as JSON (``--json``) or ``text``."""
    if as_json:
        print(json.dumps(obj, indent=2, default=str))
    else:
        print(text)
