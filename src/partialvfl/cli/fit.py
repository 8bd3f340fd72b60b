"""Fitting and using a model: ``fit``, ``evaluate`` and ``predict``, in process or across a federation.

``fit`` trains under the paper's protocol in this process, or with ``--federation FILE`` across the federation's
party processes (:func:`run_federated_fit`: align the parties' hashed IDs, train, checkpoint and resume);
``evaluate`` scores a saved in-process model under a test mechanism; ``predict --federation FILE`` predicts for a
list of IDs across the parties (:func:`run_federated_predict`).  A party that cannot be reached ends a federated
command with exit code 3.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.cli.common import add_protocol_options, emit, protocol_config
from partialvfl.cli.params import method_from_args

__all__ = [
    "add_commands", "add_predict_command", "cmd_evaluate", "cmd_fit", "read_id_list", "run_federated_fit",
    "run_federated_predict",
]


# ---------------------------------------------------------------------- parsers
def add_commands(sub: Any) -> None:
    """Add ``fit`` (in process, or with ``--federation``) and ``evaluate`` to the ``partialvfl`` sub-parsers."""
    p = sub.add_parser("fit", help="fit a method under the paper's protocol and save it")
    add_protocol_options(p, test=False)
    p.add_argument("--method", default="false-vfl-1", help="method name (see `partialvfl methods`)")
    p.add_argument("--preset", default="fast", help="fast (CPU) or paper; default: %(default)s")
    p.add_argument("--epochs", type=int, default=None,
                   help="set every epoch count of the method (pretraining included)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="override one method parameter (JSON value; '-' in KEY reads as '_'), repeatable")
    p.add_argument("--out", required=True, help="directory to save the model in")
    p.add_argument("--quiet", action="store_true", help="no per-epoch progress")
    p.add_argument("--federation", help="the coordinator's federation file: train across party processes")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="checkpoint coordinator and parties every N training steps (every method)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in OUT/checkpoints")
    p.set_defaults(func=cmd_fit)

    p = sub.add_parser("evaluate", help="evaluate a saved model under a test mechanism")
    p.add_argument("--model", required=True, help="directory of a saved model")
    p.add_argument("--test-missing", default="none", help="mechanism applied to every test sample")
    p.add_argument("--seed", type=int, default=None, help="must equal the training seed (the default)")
    p.add_argument("--data-dir", default=None, help="where the dataset's files are, if not where they were")
    p.add_argument("--mode", choices=("collaborative", "local"), default="collaborative",
                   help="collaborative (any observed parties) or local (one party alone, methods that support it)")
    p.add_argument("--party", type=int, default=None, help="the party predicting alone in --mode local")
    p.add_argument("--json", action="store_true", help="one JSON object (with at least `accuracy` or `rmse`)")
    p.set_defaults(func=cmd_evaluate)


def add_predict_command(sub: Any) -> None:
    """Add ``predict`` (across a federation) to the ``partialvfl`` sub-parsers."""
    p = sub.add_parser("predict", help="predict for a list of IDs across a federation's parties")
    p.add_argument("--model", required=True, help="a model directory written by fit --federation")
    p.add_argument("--out", required=True, help="CSV of predictions")
    p.add_argument("--federation", help="the coordinator's federation file: predict across party processes")
    p.add_argument("--ids", help="CSV/Parquet (or text, one per line) with the IDs to predict")
    p.add_argument("--id-column", default=None, help="ID column of --ids (default: its first column)")
    p.set_defaults(func=cmd_predict)


# ---------------------------------------------------------------------- in process
def cmd_fit(args: argparse.Namespace) -> int:
    """``fit``: across the federation with ``--federation``, else in process under the paper's protocol."""
    if args.federation:
        return _federated(run_federated_fit, args)
    from partialvfl.data.protocol import make_protocol
    from partialvfl.federation.messages import MessageLog
    from partialvfl.methods.evaluation import evaluate

    model = method_from_args(args)
    ck = _checkpointer(args)
    config = protocol_config(args, test_missing="none")
    train, test = make_protocol(config)
    print(f"data: {train!r}", file=sys.stderr)
    log = MessageLog(keep_entries=False)
    t0 = time.perf_counter()
    model.fit(train, log=log, checkpointer=ck)
    fit_s = time.perf_counter() - t0
    _report_checkpoints(args, ck, not args.quiet)
    out = model.save(args.out)
    res = evaluate(model, test)
    print(f"fit {args.method} in {fit_s:.1f} s; {log.total_bytes() / 1e6:.1f} MB crossed between parties; "
          f"saved to {out}", file=sys.stderr)
    metric = "accuracy" if "accuracy" in res else "rmse"
    print(f"test ({config.test_missing}): {metric} {res[metric]:.4f}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from partialvfl.data.protocol import ProtocolConfig, make_protocol
    from partialvfl.methods import VFLMethod
    from partialvfl.methods.evaluation import metrics_from_predictions

    model = VFLMethod.load(args.model)
    info = model.data_info_.get("protocol")
    if not info:
        raise ValueError(f"the model in {args.model} does not record the protocol it was trained under")
    cfg = dict(info)
    cfg["test_missing"] = args.test_missing
    if args.seed is not None and args.seed != cfg.get("seed"):
        raise ValueError(
            f"the model was trained with seed {cfg.get('seed')}; its test split is tied to that seed "
            "(pass the same --seed or leave it out)"
        )
    if args.data_dir:
        cfg["data_dir"] = args.data_dir
    _, test = make_protocol(ProtocolConfig(**cfg))
    t0 = time.perf_counter()
    if args.mode == "local":
        if args.party is None:
            raise ValueError("--mode local needs --party K")
        if not hasattr(model, "predict_output_local"):
            raise ValueError(f"method {model.name!r} has no locally independent inference")
        output = model.predict_output_local(test, args.party)
    else:
        output = model.predict_output(test)
    res = metrics_from_predictions(output, test)
    res.update({
        "method": model.name, "test_missing": args.test_missing, "mode": args.mode, "party": args.party,
        "predict_seconds": time.perf_counter() - t0, "params": model.params_,
        "pretrained": model.params_.get("pretrain"),
    })
    metric = "accuracy" if "accuracy" in res else "rmse"
    alone = f", party {args.party} predicting alone" if args.mode == "local" else ""
    lines = [f"{model.name} on {cfg.get('dataset')} under test mechanism {args.test_missing}{alone}: "
             f"{metric} {res[metric]:.4f} over {res['n_samples']} samples"]
    if res["pretrained"] is not None:
        how = "pretrained with SimSiam" if res["pretrained"] else "trained on labelled data only"
        lines.append(f"  local encoders {how}")
    for k, v in res["by_observed_parties"].items():
        lines.append(f"  {k} observed parties: {metric} {v[metric]:.4f} (n={v['n']})")
    if res["all_missing"]:
        lines.append(f"  ({res['all_missing']} samples with no observed party were predicted from the label prior)")
    emit(res, args.json, "\n".join(lines))
    return 0


# ---------------------------------------------------------------------- across a federation
def cmd_predict(args: argparse.Namespace) -> int:
    if not args.federation:
        raise ValueError("predict here needs --federation FILE")
    return _federated(run_federated_predict, args)


def _federated(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
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
    ck = _checkpointer(args)
    fed = GrpcFederation.from_config(args.federation)
    try:
        view, handle = fed.align(handle="train")
        report_line(f"aligned {view.n_samples} samples over {fed.n_parties} parties "
                    f"({int(view.labeled.sum())} labelled); observed per party: "
                    f"{view.observed.sum(axis=0).tolist()}", verbose)
        method.fit_federated(fed, view, handle, data_info={"federation": str(args.federation),
                                                           "n_samples": view.n_samples}, checkpointer=ck)
        _report_checkpoints(args, ck, verbose)
        fed.release(handle)
        method.save(out)
        if fed.transport.failures:
            report_line(f"{len(fed.transport.failures)} call(s) to absent parties were treated as missing", verbose)
        report_line(f"model saved to {out} (each party keeps its state in its own state directory)", verbose)
    finally:
        fed.close()
    return 0


def _checkpointer(args: argparse.Namespace) -> Any:
    """The checkpointer of ``--checkpoint-every N`` / ``--resume`` (in ``OUT/checkpoints``), or ``None``."""
    from partialvfl.federation.checkpoint import LATEST, Checkpointer

    if args.checkpoint_every < 0:
        raise ValueError("--checkpoint-every must be a positive number of steps")
    ck_dir = Path(args.out) / "checkpoints"
    if not args.resume and (ck_dir / LATEST).exists():
        raise ValueError(f"{ck_dir} holds a checkpoint of an earlier run: pass --resume to continue from it, "
                         "or remove it")
    if not (args.checkpoint_every or args.resume):
        return None
    return Checkpointer(ck_dir, every=args.checkpoint_every or 10**12)


def _report_checkpoints(args: argparse.Namespace, ck: Any, verbose: bool) -> None:
    from partialvfl.utils.progress import report_line

    if ck is None:
        return
    if args.resume:
        report_line(f"resumed from the checkpoint after step {ck.restored_step}" if ck.restored_step else
                    "no checkpoint to resume from: trained from the start", verbose)
    if args.checkpoint_every and not ck.saved_steps:
        report_line(f"note: {args.method} trained fewer than {args.checkpoint_every} steps: no checkpoint was taken",
                    verbose)


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
