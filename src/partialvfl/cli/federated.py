"""Commands across a federation's party processes: ``fit --federation`` and ``predict --federation``.

:func:`run_federated_fit` aligns the parties' hashed IDs, trains (checkpointing and resuming) and saves the model;
:func:`run_federated_predict` predicts for a list of IDs and writes the same file as ``predict --table``.  A party
that cannot be reached during a fit, or the active party during a prediction, ends the command with exit code 3.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.cli.checkpoints import checkpointer, report_checkpoints
from partialvfl.cli.params import method_from_args

__all__ = ["cmd_predict", "federated", "read_id_list", "run_federated_fit", "run_federated_predict"]


def cmd_predict(args: argparse.Namespace) -> int:
    if not args.federation:
        raise ValueError("predict here needs --federation FILE")
    return federated(run_federated_predict, args)


def federated(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a federated command; an unreachable or failing party is exit code 3."""
    from partialvfl.federation.grpc_transport import PartyError
    from partialvfl.federation.transport import PartyUnavailable

    try:
        return command(args)
    except (PartyUnavailable, PartyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 3


def run_federated_fit(args: argparse.Namespace) -> int:
    """Align the parties' hashed IDs, train ``--method`` across them, save the model (parties keep their state)."""
    from partialvfl.federation.grpc_federation import GrpcFederation
    from partialvfl.utils.progress import report_line

    verbose = not args.quiet
    out = Path(args.out)
    method = method_from_args(args)
    ck = checkpointer(args)
    fed = GrpcFederation.from_config(args.federation)
    try:
        view, handle = fed.align(handle="train")
        report_line(f"aligned {view.n_samples} samples over {fed.n_parties} parties "
                    f"({int(view.labeled.sum())} labelled); observed per party: "
                    f"{view.observed.sum(axis=0).tolist()}", verbose)
        labels = fed.config.labels if fed.config is not None else None
        info = {"federation": str(args.federation), "n_samples": view.n_samples,
                "id_column": labels and labels.id_column, "label_column": labels and labels.label_column}
        method.fit_federated(fed, view, handle, data_info=info, checkpointer=ck)
        report_checkpoints(args, ck, verbose)
        fed.release(handle)
        method.save(out)
        if fed.transport.failures:
            report_line(f"{len(fed.transport.failures)} call(s) to absent parties were treated as missing", verbose)
        report_line(f"model saved to {out} (each party keeps its state in its own state directory)", verbose)
    finally:
        fed.close()
    return 0


def read_id_list(path: str | Path, column: str | None = None) -> tuple[np.ndarray, str | None]:
    """IDs from a CSV/Parquet table (``column``, default its first column) or a text file with one ID per line,
    normalised by the one ID rule; returns them and the column's name (``None`` for a text file)."""
    from partialvfl.data.ids import normalize_ids
    from partialvfl.data.tables import read_table

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"ID file not found: {p}")
    if p.suffix.lower() in (".parquet", ".pq", ".csv"):
        fmt = "csv" if p.suffix.lower() == ".csv" else "parquet"
        df, _ = read_table(f"ID file {p}", p, column or "", fmt)
        col = column or str(df.columns[0])
        if col not in df.columns:
            raise ValueError(f"{p} has no column {col!r}")
        raw: Any = df[col].to_numpy(dtype=object)
    else:
        col, raw = None, [line for line in p.read_text().splitlines() if line.strip()]
    return np.array(normalize_ids(raw, f"ID file {p}"), dtype=object), col


def run_federated_predict(args: argparse.Namespace) -> int:
    """Predict for ``--ids`` with a saved model across the parties; write the prediction CSV.

    A passive party that is unreachable is a missing block (said on stderr); the active party unreachable, or IDs
    no reachable party holds (predicted from the label prior alone), are errors unless ``--allow-prior-only``.
    """
    from partialvfl.cli.tables import prediction_frame, refuse_prior_only, write_predictions
    from partialvfl.federation.grpc_federation import GrpcFederation
    from partialvfl.methods.base import VFLMethod

    if not args.ids:
        raise ValueError("predict --federation needs --ids FILE")
    ids, column = read_id_list(args.ids, getattr(args, "id_column", None))
    fed = GrpcFederation.from_config(args.federation, allow_absent=True)
    try:
        n_failures = len(fed.transport.failures)  # those so far are the parties unreachable from the start
        _refuse_missing_active(fed, "is unreachable")
        if fed.absent:
            print(f"parties {[fed.party_names[k] for k in sorted(fed.absent)]} are unreachable: predicting without "
                  "them", file=sys.stderr)
        model = VFLMethod.load(args.model, federation=fed)
        idx = model.index_
        view, handle = fed.attach_ids(ids, task=idx.task, feature_dims=idx.feature_dims,
                                      feature_shapes=idx.feature_shapes)
        _refuse_missing_active(fed, "failed while the IDs were attached")
        refuse_prior_only(view.observed, ids, args.allow_prior_only)
        out = model.predict_output_federated(view, handle)
        fed.release(handle)
        failed = sorted({f[1] for f in fed.transport.failures[n_failures:]})
        if failed:
            print(f"parties {[fed.party_names[k] for k in failed]} failed during prediction; their blocks were "
                  "treated as missing", file=sys.stderr)
        id_column = column or model.data_info_.get("id_column") or "id"
        write_predictions(prediction_frame(model, out, view.observed, ids, id_column), args.out)
    finally:
        fed.close()
    return 0


def _refuse_missing_active(fed: Any, what: str) -> None:
    from partialvfl.federation.transport import PartyUnavailable

    if fed.active_party in fed.absent:
        name = fed.party_names[fed.active_party]
        raise PartyUnavailable(fed.active_party, f"the active party {name!r} (the label holder's own features) {what}: "
                                                 "start it and predict again")
