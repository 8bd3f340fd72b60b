"""Commands across a federation's party processes: ``fit --federation`` and ``predict --federation``.

:func:`run_federated_fit` aligns the parties' IDs, trains (checkpointing and resuming, waiting for a lost
party with ``--party-timeout``) and saves the model; :func:`run_federated_predict` predicts for a list of IDs, from
the parties' training tables or from a table set of their prediction tables (``--table-set``), and writes the same
file as ``predict --table``.  Both are thin: :mod:`partialvfl.orchestration` does the work.  A party that cannot
be reached ends a fit with exit code 3 and the command that resumes it (the active party unreachable in a
prediction too); SIGINT/SIGTERM end a fit with 130/143 after a checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.cli.params import method_from_args

__all__ = ["cmd_predict", "federated", "read_id_list", "run_federated_fit", "run_federated_predict"]


def cmd_predict(args: argparse.Namespace) -> int:
    if not args.federation:
        raise ValueError("predict here needs --federation FILE")
    return federated(run_federated_predict, args)


def federated(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a federated command; an unreachable, failing or refusing party is exit code 3 (``EXIT_PARTY_LOST``;
    parties that refuse a setup are all named at once, before anything is trained)."""
    from partialvfl.cli.stopping import EXIT_PARTY_LOST
    from partialvfl.federation.grpc_transport import PartyError
    from partialvfl.federation.transport import PartiesRefused, PartyUnavailable

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
    from partialvfl.cli.stopping import fit_command, report_party_lost
    from partialvfl.federation.grpc_federation import GrpcFederation
    from partialvfl.federation.transport import PartyUnavailable
    from partialvfl.utils.progress import report_line

    out = Path(args.out)
    method = method_from_args(args)
    options = fit_options(args)
    fed = GrpcFederation.from_config(args.federation, connect=False)
    try:
        fitted = fit_command(args, options, method, fed, data_info={"federation": str(args.federation)})
        if isinstance(fitted, int):
            return fitted
        method.save(out)
        report_line(f"model saved to {out} (each party keeps its state in its own state directory)", not args.quiet)
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
    from partialvfl.cli.tables import predict_command, prediction_frame, write_predictions
    from partialvfl.federation.grpc_federation import GrpcFederation
    from partialvfl.methods.base import VFLMethod
    from partialvfl.orchestration import require_active_party

    if not args.ids:
        raise ValueError("predict --federation needs --ids FILE")
    ids, column = read_id_list(args.ids, getattr(args, "id_column", None))
    fed = GrpcFederation.from_config(args.federation, allow_absent=True)
    try:
        n_failures = len(fed.transport.failures)  # those so far are the parties unreachable from the start
        require_active_party(fed, "is unreachable")
        if fed.absent:
            print(f"parties {[fed.party_names[k] for k in sorted(fed.absent)]} are unreachable: predicting without "
                  "them", file=sys.stderr)
        model = VFLMethod.load(args.model, federation=fed)
        pred = predict_command(args, model, ids, table_set=getattr(args, "table_set", None))
        failed = sorted({f[1] for f in fed.transport.failures[n_failures:]})
        if failed:
            print(f"parties {[fed.party_names[k] for k in failed]} failed during prediction; their blocks were "
                  "treated as missing", file=sys.stderr)
        id_column = column or model.data_info_.get("id_column") or "id"
        # the parties whose blocks each row's prediction actually used (a party lost mid-prediction is not named)
        write_predictions(prediction_frame(model, pred.output, pred.parties, ids, id_column), args.out)
    finally:
        fed.close()
    return 0
