"""Commands across a federation's party processes: ``fit --federation`` and ``predict --federation``.

:func:`run_federated_fit` aligns the parties' IDs, trains (checkpointing and resuming, waiting for a lost
party with ``--party-timeout``) and saves the model; :func:`run_federated_predict` predicts for a list of IDs, from
the parties' training tables or from a table set of their prediction tables (``--table-set``), and writes the same
file as ``predict --table``.  The fit is :func:`partialvfl.orchestration.run_fit`; predictions go on without a
party lost mid-way by the library's :func:`~partialvfl.orchestration.predict_reporting_parties`.  A party that
cannot be reached ends a fit with exit code 3 and the command that resumes it (the active party unreachable in a
prediction too); SIGINT/SIGTERM end a fit with 130/143 after a checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.cli.params import load_for_prediction, method_from_args

__all__ = ["cmd_predict", "federated", "read_id_list", "run_federated_evaluate", "run_federated_fit",
           "run_federated_predict"]


def cmd_predict(args: argparse.Namespace) -> int:
    """``predict --federation``: predict a list of IDs across the federation's parties."""
    if not args.federation:
        raise ValueError("predict here needs --federation FILE")
    return federated(run_federated_predict, args)


def federated(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a federated command; an unreachable, failing or refusing party is exit code 3 (``EXIT_PARTY_LOST``;
    parties that refuse a setup are all named at once, before anything is trained)."""
    from partialvfl.cli.stopping import EXIT_PARTY_LOST
    from partialvfl.federation.grpc.transport import PartyError
    from partialvfl.federation.wire.transport import PartiesRefused, PartyUnavailable

    try:
        return command(args)
    except (PartyUnavailable, PartyError, PartiesRefused) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_PARTY_LOST


def run_federated_fit(args: argparse.Namespace) -> int:
    """Align the parties' IDs, train ``--method`` across them, save the model (parties keep their state).

    A party that stops answering during training stops the fit (exit 3, with the resume command) or, with
    ``--party-timeout``, is waited for and the fit continues from the last checkpoint once every party answers again.
    SIGINT/SIGTERM checkpoint where the fit is and stop (exit 130/143, with the resume command).
    """
    from partialvfl.cli.checkpoints import fit_options
    from partialvfl.cli.privacy import federated_label_dp, party_dp, print_privacy
    from partialvfl.cli.stopping import fit_command, report_party_lost
    from partialvfl.federation.grpc.federation import GrpcFederation
    from partialvfl.federation.wire.transport import PartyUnavailable
    from partialvfl.utils.progress import report_line

    out = Path(args.out)
    party_dp(args)  # refused with --federation: a deployed party sets its own budget
    method = method_from_args(args)
    options = fit_options(args)
    fed = GrpcFederation.from_config(args.federation, connect=False)
    labels = fed.config.labels if fed.config else None
    federated_label_dp(args, method, labels.label_dp if labels else None, labels.mechanism_params() if labels else None)
    try:
        fitted = fit_command(args, options, method, fed, data_info={"federation": str(args.federation)})
        if isinstance(fitted, int):
            return fitted
        method.save(out)
        report_line(f"fit {method.name} in {fitted.seconds:.1f} s across {fed.n_parties} parties; model saved to "
                    f"{out} (each party keeps its state in its own state directory)", not args.quiet)
        print_privacy(method)
    except PartyUnavailable as e:
        return report_party_lost(args, fed.party_names, e)
    finally:
        fed.close()
    return 0


def read_id_list(path: str | Path, column: str | None = None) -> tuple[np.ndarray, str | None]:
    """IDs from a CSV/Parquet table (``column``, default its first column) or a text file with one ID per line,
    normalised by the one ID rule; returns them and the column's name (``None`` for a text file)."""
    from partialvfl.data.ids import normalize_ids
    from partialvfl.data.tables import read_table, table_format

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"ID file not found: {p}")
    if table_format(p) is not None:
        df, _ = read_table(f"ID file {p}", p, column or "")
        col = column or str(df.columns[0])
        if col not in df.columns:
            raise ValueError(f"{p} has no column {col!r}")
        raw: Any = df[col].to_numpy(dtype=object)
    else:
        col, raw = None, _text_id_lines(p)
    return np.array(normalize_ids(raw, f"ID file {p}"), dtype=object), col


_NOT_TEXT_SUFFIXES = (".tsv", ".tab", ".gz", ".bz2", ".xz", ".zip", ".zst", ".xls", ".xlsx", ".json",
                      ".jsonl", ".feather", ".arrow", ".orc", ".avro", ".pkl", ".pickle")


def _text_id_lines(p: Path) -> list[str]:
    """The non-blank lines of a text ID file, one ID each (stripped of surrounding spaces).

    Refuses what would silently become wrong IDs: a file named as another format (a ``.tsv`` header would become an
    ID), bytes that are not UTF-8 text, and lines holding a tab or comma (a table row, not an ID)."""
    if p.name.lower().endswith(_NOT_TEXT_SUFFIXES):
        raise ValueError(f"ID file {p}: {p.suffix!r} is not a format --ids reads; give a .csv (.csv.gz, ...) or "
                         ".parquet/.pq table (with --id-column), or a text file with one ID per line")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"ID file {p} is not UTF-8 text (byte {e.start}); a table must be named .csv (.csv.gz, "
                         "...) or .parquet/.pq") from None
    lines = [line.strip() for line in text.splitlines()]
    for number, line in enumerate(lines, 1):
        if "\t" in line or "," in line:
            raise ValueError(f"ID file {p}, line {number}: {line[:60]!r} holds a tab or comma; a text ID file has "
                             "one ID per line (for a table, name it .csv and choose the column with --id-column)")
    return [line for line in lines if line]


def run_federated_predict(args: argparse.Namespace) -> int:
    """Predict for ``--ids`` with a saved model across the parties; write the prediction CSV.

    A passive party that is unreachable is a missing block (said on stderr); the active party unreachable, or IDs
    no reachable party holds (predicted from the label prior alone), are errors unless ``--allow-prior-only``.
    """
    from partialvfl.cli.tables import add_ess_column, prediction_frame, write_predictions

    if not args.ids:
        raise ValueError("predict --federation needs --ids FILE")
    ids, column = read_id_list(args.ids, getattr(args, "id_column", None))

    def write(model: Any, out: np.ndarray, used: np.ndarray, view: Any, diagnostics: dict[str, np.ndarray]) -> None:
        id_column = column or model.data_info_.get("id_column") or "id"
        frame = prediction_frame(model, out, used, ids, id_column)
        if getattr(args, "ess", False):
            add_ess_column(frame, model, diagnostics)
        write_predictions(frame, args.out)

    _predict_across(args, ids, write)
    return 0


def run_federated_evaluate(args: argparse.Namespace) -> int:
    """``evaluate --federation FILE --truth FILE``: predict the truth file's IDs across the parties (from their
    training tables, or ``--table-set``'s prediction tables) and score them against its outcomes."""
    from partialvfl.cli.common import emit
    from partialvfl.cli.truth import metric_lines, read_truth, score_against_truth
    from partialvfl.methods.evaluation import add_diagnostics
    from partialvfl.methods.model_files import read_model_meta

    if not args.truth:
        raise ValueError("evaluate --federation needs --truth FILE: the outcomes of the IDs to score")
    info = read_model_meta(Path(args.model)).get("data_info", {})
    id_column = args.id_column or info.get("id_column")
    label = args.label_column or info.get("label_column")
    if not id_column or not label:
        raise ValueError("say which columns of --truth hold the IDs and the outcomes: "
                         "--id-column COLUMN --label COLUMN")
    truth = read_truth(args.truth, id_column, label)
    ids = np.array(truth.ids, dtype=object)

    tables = f"prediction tables {args.table_set!r}" if args.table_set else "training tables"
    where = f"the {tables}"

    def check(fed: Any) -> None:  # before anything is predicted
        truth.check_federation(fed.last_held, fed.last_unlisted, fed.party_names, sorted(fed.absent),
                               f"the parties' {tables}")
        if fed.absent:
            print(f"note: parties {[fed.party_names[k] for k in sorted(fed.absent)]} are unreachable: their users "
                  "were not checked against --truth", file=sys.stderr)

    def score(model: Any, out: np.ndarray, used: np.ndarray, view: Any, diagnostics: dict[str, np.ndarray]) -> None:
        from partialvfl.cli.reliability import write_reliability
        from partialvfl.cli.truth import labeled_view

        values = truth.aligned(ids, f"--truth {args.truth}")
        res = score_against_truth(model, out, view, values, truth)
        add_diagnostics(res, model, diagnostics)
        write_reliability(getattr(args, "reliability", None), model, out, labeled_view(model, view, values, truth),
                          f"{model.name} across the federation ({where})")
        res.update({"method": model.name, "federation": str(args.federation), "table_set": args.table_set})
        emit(res, args.json, "\n".join(metric_lines(f"{model.name} across the federation ({where}), scored "
                                                      f"against --truth {args.truth}", res)))

    _predict_across(args, ids, score, check)
    return 0


def _predict_across(args: argparse.Namespace, ids: np.ndarray,
                    then: Callable[[Any, np.ndarray, np.ndarray, Any, dict[str, np.ndarray]], None],
                    check: Callable[[Any], None] | None = None) -> None:
    """Load ``--model`` across ``--federation``'s parties, attach ``ids`` (``--table-set``'s tables or the training
    tables), ``check(federation)`` them if given (before anything is predicted), predict them and call
    ``then(model, outputs, parties used, view, diagnostics)`` (the method's per-row prediction diagnostics) before the
    parties are let go."""
    import dataclasses

    from partialvfl.cli.tables import refuse_prior_only, used_parties
    from partialvfl.federation.grpc.federation import GrpcFederation
    from partialvfl.orchestration import predict as orchestrated
    from partialvfl.orchestration import require_active_party

    fed = GrpcFederation.from_config(args.federation, allow_absent=True)
    try:
        n_failures = len(fed.transport.failures)  # those so far are the parties unreachable from the start
        require_active_party(fed, "is unreachable")
        if fed.absent:
            print(f"parties {[fed.party_names[k] for k in sorted(fed.absent)]} are unreachable: predicting without "
                  "them", file=sys.stderr)
        model = load_for_prediction(args, federation=fed)
        idx = model.index_
        view, handle = fed.attach_ids(ids, task=idx.task, feature_dims=idx.feature_dims,
                                      feature_shapes=idx.feature_shapes, table=getattr(args, "table_set", None))
        require_active_party(fed, "failed while the IDs were attached")
        if check is not None:
            check(fed)
        refuse_prior_only(view.observed, ids, args.allow_prior_only)
        diagnostics: dict[str, np.ndarray] = {}
        out, answered = orchestrated.predict_reporting_parties(model, fed, view, handle, diagnostics=diagnostics)
        fed.release(handle)
        failed = sorted({f[1] for f in fed.transport.failures[n_failures:]})
        if failed:
            print(f"parties {[fed.party_names[k] for k in failed]} failed during prediction; their blocks were "
                  "treated as missing", file=sys.stderr)
        # the parties whose blocks each row's prediction actually used (a party lost mid-prediction is not named)
        answered_view = dataclasses.replace(view, observed=answered)
        then(model, out, used_parties(model, answered_view), answered_view, diagnostics)
    finally:
        fed.close()
