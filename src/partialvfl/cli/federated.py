"""Commands across a federation's party processes: ``fit --federation`` and ``predict --federation``.

:func:`run_federated_fit` aligns the parties' hashed IDs, trains (checkpointing and resuming, waiting for a lost
party with ``--party-timeout``) and saves the model; :func:`run_federated_predict` predicts for a list of IDs, from
the parties' training tables or from a table set of their prediction tables (``--table-set``).  A party that cannot
be reached ends a fit with exit code 3 and the command that resumes it; SIGINT/SIGTERM end it with 130/143 after a
checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.cli.checkpoints import report_checkpoints
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
    """Align the parties' hashed IDs, train ``--method`` across them, save the model (parties keep their state).

    A party that stops answering during training stops the fit (exit 3, with the resume command) or, with
    ``--party-timeout``, is waited for and the fit continues from the last checkpoint once every party answers again.
    SIGINT/SIGTERM checkpoint where the fit is and stop (exit 130/143, with the resume command).
    """
    from partialvfl.cli.stopping import fit_checkpointer, report_interrupted, report_party_lost, stop_on_signals
    from partialvfl.federation.checkpoint import FitInterrupted
    from partialvfl.federation.grpc_federation import GrpcFederation
    from partialvfl.federation.transport import PartyUnavailable
    from partialvfl.utils.progress import report_line

    verbose = not args.quiet
    out = Path(args.out)
    method = method_from_args(args)
    ck = fit_checkpointer(args)
    fed = GrpcFederation.from_config(args.federation, connect=False)
    try:
        if args.party_timeout is not None:  # parties not up yet are waited for, too
            fed.rejoin(args.party_timeout)
        else:
            fed.connect()
        with stop_on_signals(ck):
            handle = _fit_rejoining(method, fed, ck, args)
        report_checkpoints(args, ck, verbose)
        fed.release(handle)
        method.save(out)
        report_line(f"model saved to {out} (each party keeps its state in its own state directory)", verbose)
    except FitInterrupted as e:
        return report_interrupted(args, e)
    except PartyUnavailable as e:
        return report_party_lost(args, fed.party_names, ck, e)
    finally:
        fed.close()
    return 0


def _fit_rejoining(method: Any, fed: Any, ck: Any, args: argparse.Namespace) -> str:
    """Align and fit; with ``--party-timeout``, wait out up to ``--party-retries`` party failures (each time: every
    party says hello again, the fit resumes from the last checkpoint).  Returns the training handle."""
    from partialvfl.federation.transport import PartyUnavailable
    from partialvfl.utils.progress import report_line

    verbose = not args.quiet
    timeout, retries = getattr(args, "party_timeout", None), int(getattr(args, "party_retries", 0) or 0)
    if timeout is not None and timeout < 0:
        raise ValueError("--party-timeout must be a number of seconds >= 0")
    attempt = 0
    while True:
        try:
            view, handle = fed.align(handle="train")
            report_line(f"aligned {view.n_samples} samples over {fed.n_parties} parties "
                        f"({int(view.labeled.sum())} labelled); observed per party: "
                        f"{view.observed.sum(axis=0).tolist()}", verbose and attempt == 0)
            method.fit_federated(fed, view, handle, data_info={"federation": str(args.federation),
                                                               "n_samples": view.n_samples}, checkpointer=ck)
            return handle
        except PartyUnavailable as e:
            if timeout is None or attempt >= retries:
                raise
            attempt += 1
            report_line(f"party {e.party} ({fed.party_names[e.party]!r}) did not answer ({e.reason}): waiting up "
                        f"to {timeout:g} s for every party (failure {attempt} of at most {retries})", True)
            fed.rejoin(timeout)
            latest = ck.latest()
            report_line("every party answers again: continuing from "
                        + (f"the checkpoint after step {latest.step}" if latest else "the start"), True)


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
                                      feature_shapes=idx.feature_shapes, table=getattr(args, "table_set", None))
        out, used = predict_reporting_parties(model, fed, view, handle)
        fed.release(handle)
        df = pd.DataFrame({"id": ids})
        if idx.task.is_classification:
            classes = list(idx.task.classes)
            df["prediction"] = [classes[i] for i in out.argmax(axis=1)]
            for j, c in enumerate(classes):
                df[f"p_{c}"] = out[:, j]
        else:
            df["prediction"] = out
        df["n_parties"] = used.sum(axis=1)  # the parties whose blocks this row's prediction actually used
        df["parties"] = [";".join(fed.party_names[k] for k in np.flatnonzero(row)) for row in used]
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


def predict_reporting_parties(model: Any, fed: Any, view: Any, handle: str, chunk: int | None = None
                              ) -> tuple[np.ndarray, np.ndarray]:
    """Predict ``view``'s rows (in chunks of ``chunk`` rows; default: all at once, exactly as the model's own
    ``predict_output_federated``); returns the outputs and which parties each row's prediction used.

    A party that fails while a chunk is predicted is treated as absent from then on: the chunk is predicted again
    without it, so every row's output comes from exactly the parties its row of the returned mask names.
    """
    import dataclasses

    from partialvfl.federation.transport import PartyUnavailable

    n = view.n_samples
    used = np.array(view.observed, dtype=bool)
    lost: set[int] = set(fed.absent)
    out: np.ndarray | None = None
    size = max(1, chunk or n)
    for start in range(0, n, size):
        rows = np.arange(start, min(n, start + size))
        while True:
            observed = np.zeros_like(used)
            observed[rows] = used[rows]
            observed[:, sorted(lost)] = False
            before = len(fed.transport.failures)
            try:
                res = model.predict_output_federated(dataclasses.replace(view, observed=observed), handle)
            except PartyUnavailable as e:
                if e.party in lost:  # the method needs a party even when its blocks are missing: cannot go on
                    raise
                lost.add(e.party)
                continue
            failed = {party for _, party, _ in fed.transport.failures[before:]} - lost
            if failed:  # part of this chunk went without them: predict it again without them
                lost |= failed
                continue
            break
        used[rows] = observed[rows]
        out = res if out is None else out
        out[rows] = res[rows]
    fed.absent |= lost
    return (out if out is not None else model.predict_output_federated(view, handle)), used
