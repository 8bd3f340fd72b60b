"""Probabilities that mean what they say: ``calibrate`` (temperature scaling saved with the model) and ``evaluate
--reliability FILE`` (a reliability diagram).

``calibrate`` fits the temperatures on validation data (:class:`~partialvfl.methods.calibration.Calibration`): your
labelled tables (``--table``, or ``--table ... --truth FILE``), users of a federation's parties with their outcomes
(``--federation FILE --truth FILE``, ``--table-set NAME``), or, for a model fitted under the protocol, the protocol's
validation set (the training samples whose labels the protocol erased, under ``--validation-missing``).  It then saves
the model again, with its calibration, in place or in ``--out``: ``predict``, ``evaluate``, ``explain`` and the
prediction service use it from then on.  ``--remove`` saves it without.  (``evaluate --reliability``:
:mod:`.reliability`.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.cli.common import add_device_options, add_table_options, device_options

__all__ = ["add_commands"]


def _say(text: str) -> None:
    print(text, file=sys.stderr)


def add_commands(sub: Any) -> None:
    """Add ``calibrate`` to the ``partialvfl`` sub-parsers."""
    p = sub.add_parser("calibrate", help="fit temperature scaling on validation data and save it with the model",
                       description="Post-hoc calibration: fit a temperature (optionally one per availability "
                                   "pattern) that makes the model's probabilities match observed frequencies on "
                                   "validation data, and save the model with it (in place, or --out DIR); predict, "
                                   "evaluate, explain and serve apply it. The predicted class never changes.")
    p.add_argument("--model", required=True, help="a saved model directory")
    p.add_argument("--out", default=None, metavar="DIR", help="save the calibrated model here (default: in place)")
    p.add_argument("--per-pattern", action="store_true",
                   help="a temperature of its own for each availability pattern (which parties a row has) with at "
                        "least --min-rows validation rows; the others use the overall one")
    p.add_argument("--min-rows", type=int, default=100, metavar="N", help="see --per-pattern; default: %(default)s")
    p.add_argument("--remove", action="store_true", help="save the model without any calibration")
    add_table_options(p, fit=False)
    p.add_argument("--truth", metavar="FILE", help="outcomes keyed by ID (as evaluate --truth)")
    p.add_argument("--federation", metavar="FILE", help="with --truth: the validation users across the parties")
    p.add_argument("--table-set", default=None, metavar="NAME",
                   help="with --federation: the parties' prediction tables of this name")
    p.add_argument("--validation-missing", default=None, metavar="MECHANISM",
                   help="a model fitted under the protocol: the mechanism applied to its validation set (default: "
                        "the model's training mechanism)")
    p.add_argument("--data-dir", default=None, help="where the dataset's files are, if not where they were")
    add_device_options(p, compile_option=False)
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.federation:
        if args.table:
            raise ValueError("calibrate takes --table files (in process) or --federation with --truth, not both")
        from partialvfl.cli.federated import federated

        return federated(_calibrate_across, args)
    if args.table_set:
        raise ValueError("--table-set goes with --federation")
    from partialvfl.methods.base import VFLMethod

    model = VFLMethod.load(args.model, **device_options(args))
    if args.remove:
        return _save(args, model, None)
    _refuse_regression(model)
    model.calibration_ = None  # fitted on the model's own probabilities
    if args.table:
        from partialvfl.cli.tables import _label_column, _model_tables
        from partialvfl.cli.truth import labeled_view, read_truth

        data, _, id_column = _model_tables(args, model, labels=not args.truth)
        with model.attached(data) as (conformed, handle):
            view = conformed.coordinator_view()
            if args.truth:
                truth = read_truth(args.truth, id_column, _label_column(args, model))
                view = labeled_view(model, view, truth.aligned(data.ids, "the --table files"), truth)
            output = model.predict_output_federated(view, handle)
        about = {"data": "tables " + ", ".join(args.table) + (f", outcomes {args.truth}" if args.truth else "")}
    else:
        if args.truth:
            raise ValueError("calibrate --truth needs the users' features: --table PARTY=FILE ... or --federation")
        view, about = _protocol_validation(args, model)
        output = model.predict_output(view)
        view = view.coordinator_view()
    return _fit_and_save(args, model, output, view, about)


def _refuse_regression(model: Any) -> None:
    if not model.index_.task.is_classification:
        raise ValueError(f"{model.name}: a regression model has no probabilities to calibrate")


def _protocol_validation(args: argparse.Namespace, model: Any) -> tuple[Any, dict[str, Any]]:
    from partialvfl.data.protocol import ProtocolConfig, validation_set

    info = model.data_info_.get("protocol")
    if not info:
        raise ValueError(f"the model in {args.model} was not fitted under the protocol: give validation data as "
                         "labelled tables (--table PARTY=FILE ...) or across a federation (--federation FILE --truth "
                         "FILE)")
    cfg = dict(info)
    if args.data_dir:
        cfg["data_dir"] = args.data_dir
    mechanism = args.validation_missing or cfg.get("train_missing", "none")
    data = validation_set(ProtocolConfig(**cfg), mechanism)
    return data, {"data": f"the protocol's validation set ({data.n_samples} training samples whose labels the "
                          f"protocol erased) under {mechanism}"}


def _calibrate_across(args: argparse.Namespace) -> int:
    from partialvfl.cli.explain import rows_across
    from partialvfl.cli.truth import labeled_view, read_truth
    from partialvfl.methods.model_files import read_model_meta

    if not args.truth and not args.remove:
        raise ValueError("calibrate --federation needs --truth FILE: the outcomes of the validation users")
    info = read_model_meta(Path(args.model)).get("data_info", {})
    id_column, label = args.id_column or info.get("id_column"), args.label_column or info.get("label_column")
    if args.remove:
        ids = None
    elif not id_column or not label:
        raise ValueError("say which columns of --truth hold the IDs and the outcomes: "
                         "--id-column COLUMN --label COLUMN")
    else:
        truth = read_truth(args.truth, id_column, label)
        ids = np.array(truth.ids, dtype=object)
    if ids is None:
        from partialvfl.federation.grpc.federation import GrpcFederation
        from partialvfl.methods.base import VFLMethod

        fed = GrpcFederation.from_config(args.federation)
        try:
            return _save(args, VFLMethod.load(args.model, federation=fed, **device_options(args)), None)
        finally:
            fed.close()
    tables = f"prediction tables {args.table_set!r}" if args.table_set else "training tables"

    def check(fed: Any, view: Any) -> None:
        truth.check_federation(fed.last_held, fed.last_unlisted, fed.party_names, sorted(fed.absent),
                               f"the parties' {tables}")
        if fed.absent:
            raise ValueError(f"parties {[fed.party_names[k] for k in sorted(fed.absent)]} are unreachable: calibrate "
                             "once every party answers (a temperature fitted without them would be another model's)")

    def then(model: Any, view: Any, handle: str) -> int:
        _refuse_regression(model)
        model.calibration_ = None
        output = model.predict_output_federated(view, handle)
        labeled = labeled_view(model, view, truth.aligned(ids, f"--truth {args.truth}"), truth)
        return _fit_and_save(args, model, output, labeled, {"data": f"the parties' {tables}, outcomes "
                                                                     f"{args.truth}"})

    return rows_across(args, ids, then, check)


def _fit_and_save(args: argparse.Namespace, model: Any, output: np.ndarray, view: Any, about: dict[str, Any]) -> int:
    from partialvfl.methods.calibration import Calibration
    from partialvfl.methods.evaluation import true_in_model_classes

    true, _ = true_in_model_classes(view, model.index_.task.classes)
    rows = np.flatnonzero(np.asarray(view.labeled) & np.asarray(view.observed).any(axis=1))
    if rows.size == 0:
        raise ValueError("the validation data has no labelled row some party holds: nothing to calibrate on")
    used = np.asarray(model.parties_used(view), dtype=bool)
    names = model.index_.party_names
    cal = Calibration.fit(output[rows], true[rows], used[rows], names, per_pattern=args.per_pattern,
                          min_rows=args.min_rows, about={**about, "rows": int(rows.size)})
    before, after = cal.fitted_on["before"], cal.fitted_on["after"]
    print(f"{model.name}: {cal.describe()}")
    print(f"  fitted on {rows.size} validation rows: {about['data']}")
    for title, m in (("before", before), ("after", after)):
        print(f"  {title:<6} ECE {m['ece']:.4f}, Brier {m['brier']:.4f}, log-loss {m['log_loss']:.4f}")
    return _save(args, model, cal)


def _save(args: argparse.Namespace, model: Any, calibration: Any) -> int:
    model.calibration_ = calibration
    out = model.save(args.out or args.model)
    _say(f"model saved to {out} " + ("with its calibration: predict, evaluate, explain and serve apply it"
                                     if calibration is not None else "without calibration"))
    return 0
