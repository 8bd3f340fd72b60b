"""Command-line pieces of a real deployment: ``party serve``, ``certs init``, and federated ``fit``/``predict``.

``partialvfl.cli`` calls :func:`add_commands` on its subparsers, which adds the ``party`` and ``certs`` commands,
adds ``--federation``/``--checkpoint-every``/``--resume`` to its ``fit`` command (dispatching to
:func:`run_federated_fit` when ``--federation`` is given), and adds a ``predict`` command
(:func:`run_federated_predict`) or, if one exists, its federated options.  ``python -m
partialvfl.federation.grpc_cli`` offers the same commands standalone.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "add_commands", "add_federated_fit_arguments", "add_federated_predict_arguments", "build_parser", "main",
    "parse_params", "run_certs_init", "run_federated_fit", "run_federated_predict", "run_party_serve",
]


# ---------------------------------------------------------------------- parser pieces
def add_commands(subparsers: Any) -> None:
    """Add ``party serve``, ``certs init``, a (federated) ``predict``, and the federated options of ``fit``."""
    party = subparsers.add_parser("party", help="run a party of a federation")
    psub = party.add_subparsers(dest="party_command", required=True)
    serve = psub.add_parser("serve", help="serve this party over gRPC with mutual TLS until stopped")
    serve.add_argument("--config", required=True, help="the party's TOML configuration file")
    serve.set_defaults(func=run_party_serve)

    certs = subparsers.add_parser("certs", help="development certificates for a federation")
    csub = certs.add_subparsers(dest="certs_command", required=True)
    init = csub.add_parser("init", help="make a development CA, one certificate per party and the HMAC key")
    init.add_argument("directory", help="where to write ca.pem, <name>.pem/.key and hmac.key")
    init.add_argument("--parties", nargs="+", required=True, help="party identities (certificate names)")
    init.add_argument("--coordinator", default="coordinator", help="the coordinator's identity (default: %(default)s)")
    init.add_argument("--hosts", nargs="*", default=["localhost", "127.0.0.1"],
                      help="extra DNS names / IPs in every certificate (default: %(default)s)")
    init.add_argument("--no-hmac-key", action="store_true", help="do not write hmac.key")
    init.set_defaults(func=run_certs_init)

    fit = subparsers.choices.get("fit")
    if fit is not None:
        add_federated_fit_arguments(fit)
        fit.set_defaults(func=_dispatch(fit.get_default("func"), run_federated_fit, "fit"))
    pred = subparsers.choices.get("predict")
    if pred is None:
        pred = subparsers.add_parser("predict", help="predict for a list of IDs across a federation's parties")
        pred.add_argument("--model", required=True, help="a model directory written by fit --federation")
        pred.add_argument("--out", required=True, help="CSV of predictions")
    add_federated_predict_arguments(pred)
    pred.set_defaults(func=_dispatch(pred.get_default("func"), run_federated_predict, "predict"))


def _dispatch(local: Callable[[argparse.Namespace], int] | None, federated: Callable[[argparse.Namespace], int],
              command: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        if getattr(args, "federation", None):
            from partialvfl.federation.grpc_transport import PartyError
            from partialvfl.federation.transport import PartyUnavailable

            try:
                return federated(args)
            except (PartyUnavailable, PartyError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 3
        if local is None:
            raise ValueError(f"{command} here needs --federation FILE")
        return local(args)

    return run


def add_federated_fit_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``fit`` needs to run over gRPC (besides ``--method``, ``--preset``, ``--seed``, ``--out``)."""
    parser.add_argument("--federation", help="the coordinator's federation file: train across party processes")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                        help="checkpoint coordinator and parties every N training steps (methods that support it)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in OUT/checkpoints")


def add_federated_predict_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``predict`` needs to run over gRPC (besides ``--model`` and ``--out``)."""
    parser.add_argument("--federation", help="the coordinator's federation file: predict across party processes")
    parser.add_argument("--ids", help="CSV/Parquet (or text, one per line) with the IDs to predict")
    parser.add_argument("--id-column", default=None, help="ID column of --ids (default: its first column)")


def build_parser() -> argparse.ArgumentParser:
    """The standalone parser (``python -m partialvfl.federation.grpc_cli``)."""
    ap = argparse.ArgumentParser(prog="python -m partialvfl.federation.grpc_cli",
                                 description="partialvfl across institutions: gRPC with mutual TLS.")
    sub = ap.add_subparsers(dest="command", required=True)
    fit = sub.add_parser("fit", help="train a method across the federation's party processes")
    fit.add_argument("--method", required=True)
    fit.add_argument("--preset", default="fast")
    fit.add_argument("--seed", type=int, default=0)
    fit.add_argument("--epochs", type=int, default=None, help="set every epoch count of the method")
    fit.add_argument("--out", required=True, help="model directory (coordinator side)")
    fit.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="method parameter override")
    fit.add_argument("--quiet", action="store_true")
    add_commands(sub)
    return ap


def parse_params(items: Sequence[str]) -> dict[str, Any]:
    """``NAME=VALUE`` pairs; values are JSON when they parse as JSON, text otherwise."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"parameter {item!r} must look like NAME=VALUE")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out


# ---------------------------------------------------------------------- commands
def run_party_serve(args: argparse.Namespace) -> int:
    from partialvfl.federation.grpc_party import run

    return run(args.config)


def run_certs_init(args: argparse.Namespace) -> int:
    from partialvfl.federation.alignment import write_key
    from partialvfl.federation.certs import init_dev_pki

    names = [*args.parties, args.coordinator]
    made = init_dev_pki(args.directory, names, hosts=args.hosts)
    d = Path(args.directory)
    print(f"development CA: {d / 'ca.pem'} (key {d / 'ca.key'}: keep it away from the parties)")
    for name, (cert, key) in made.items():
        print(f"  {name}: {cert}, {key}")
    if not args.no_hmac_key:
        print(f"HMAC key for ID hashing (give it to every party and the coordinator): {write_key(d / 'hmac.key')}")
    return 0


def run_federated_fit(args: argparse.Namespace) -> int:
    """Align the parties' hashed IDs, train ``--method`` across them, save the model (parties keep their state)."""
    from partialvfl.federation.checkpoint import LATEST, Checkpointer
    from partialvfl.federation.grpc_federation import GrpcFederation
    from partialvfl.methods.base import get_method
    from partialvfl.utils.progress import report_line

    verbose = not getattr(args, "quiet", False)
    if getattr(args, "checkpoint_every", 0) < 0:
        raise ValueError("--checkpoint-every must be a positive number of steps")
    out = Path(args.out)
    params = parse_params(getattr(args, "param", []))
    cls = get_method(args.method)
    if getattr(args, "epochs", None) is not None:
        params.update({k: args.epochs for k in cls.default_params() if k.startswith("epochs")})
    method = cls(getattr(args, "preset", "fast"), seed=int(getattr(args, "seed", 0)), progress=verbose, **params)
    ck_dir = out / "checkpoints"
    if not args.resume and (ck_dir / LATEST).exists():
        raise ValueError(f"{ck_dir} holds a checkpoint of an earlier run: pass --resume to continue from it, "
                         "or remove it")
    fed = GrpcFederation.from_config(args.federation)
    try:
        view, handle = fed.align(handle="train")
        report_line(f"aligned {view.n_samples} samples over {fed.n_parties} parties "
                    f"({int(view.labeled.sum())} labelled); observed per party: "
                    f"{view.observed.sum(axis=0).tolist()}", verbose)
        ck = None
        if args.checkpoint_every or args.resume:
            ck = Checkpointer(ck_dir, fed, every=args.checkpoint_every or 10**12)
        method.fit_federated(fed, view, handle, data_info={"federation": str(args.federation),
                                                           "n_samples": view.n_samples}, checkpointer=ck)
        if args.resume and ck is not None:
            report_line(f"resumed from the checkpoint after step {ck.restored_step}" if ck.restored_step else
                        "no checkpoint to resume from: trained from the start", verbose)
        if args.checkpoint_every and ck is not None and not ck.saved_steps:
            report_line(f"note: {args.method} trained fewer than {args.checkpoint_every} steps: no checkpoint "
                        "was taken", verbose)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
