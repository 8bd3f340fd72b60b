"""Commands across a federation's party processes: ``fit --federation`` and ``predict --federation``.

:func:`run_federated_fit` aligns the parties' hashed IDs, trains (checkpointing and resuming) and saves the model;
:func:`run_federated_predict` predicts for a list of IDs.  A party that cannot be reached ends the command with exit
code 3.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

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
        method.fit_federated(fed, view, handle, data_info={"federation": str(args.federation),
                                                           "n_samples": view.n_samples}, checkpointer=ck)
        report_checkpoints(args, ck, verbose)
        fed.release(handle)
        method.save(out)
        if fed.transport.failures:
            report_line(f"{len(fed.transport.failures)} call(s) to absent parties were treated as missing", verbose)
        report_line(f"model saved to {out} (each party keeps its state in its own state directory)", verbose)
    finally:
        fed.close()
    return 0


def read_id_list(path: str | Path, column: str | None = None) -> np.ndarray:
    """IDs from a CSV/Parquet table (``column`` or its first column) or a text file with one ID per line."""
    import pandas as pd

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"ID file not found: {p}")
    if p.suffix.lower() in (".parquet", ".pq"):
        df = pd.read_parquet(p)
        col = column or df.columns[0]
        if col not in df.columns:
            raise ValueError(f"{p} has no column {col!r}")
        return df[col].astype(str).to_numpy()
    if p.suffix.lower() == ".csv":
        df = pd.read_csv(p, dtype=str)
        col = column or df.columns[0]
        if col not in df.columns:
            raise ValueError(f"{p} has no column {col!r}")
        return df[col].to_numpy()
    return np.array([line.strip() for line in p.read_text().splitlines() if line.strip()], dtype=object)


def run_federated_predict(args: argparse.Namespace) -> int:
    """Predict for ``--ids`` with a saved model; absent parties count as missing blocks. Writes a CSV."""
    import pandas as pd

    from partialvfl.federation.grpc_federation import GrpcFederation
    from partialvfl.methods.base import VFLMethod

    if not args.ids:
        raise ValueError("predict --federation needs --ids FILE")
    fed = GrpcFederation.from_config(args.federation, allow_absent=True)
    try:
        n_failures = len(fed.transport.failures)  # those so far are the parties unreachable from the start
        if fed.absent:
            print(f"parties {[fed.party_names[k] for k in sorted(fed.absent)]} are unreachable: predicting without "
                  "them", file=sys.stderr)
        model = VFLMethod.load(args.model, federation=fed)
        ids = read_id_list(args.ids, getattr(args, "id_column", None))
        idx = model.index_
        view, handle = fed.attach_ids(ids, task=idx.task, feature_dims=idx.feature_dims,
                                      feature_shapes=idx.feature_shapes)
        out = model.predict_output_federated(view, handle)
        fed.release(handle)
        df = pd.DataFrame({"id": ids})
        if idx.task.is_classification:
            classes = list(idx.task.classes)
            df["prediction"] = [classes[i] for i in out.argmax(axis=1)]
            for j, c in enumerate(classes):
                df[f"p_{c}"] = out[:, j]
        else:
            df["prediction"] = out
        df["n_parties"] = view.observed.sum(axis=1)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(args.out, index=False)
        failed = sorted({f[1] for f in fed.transport.failures[n_failures:]})
        if failed:
            print(f"parties {[fed.party_names[k] for k in failed]} failed during prediction; their blocks were "
                  "treated as missing", file=sys.stderr)
        print(f"{len(df)} predictions written to {args.out}", file=sys.stderr)
    finally:
        fed.close()
    return 0
