"""Fitting and using a model: ``fit``, ``evaluate`` and ``predict``, in process or across a federation.

``fit`` trains under the paper's protocol in this process, or with ``--federation FILE`` across the federation's
party processes (:mod:`.federated`); ``evaluate`` scores a saved in-process model under a test mechanism;
``predict --federation FILE`` predicts for a list of IDs across the parties (:mod:`.federated`).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from partialvfl.cli.checkpoints import checkpointer, report_checkpoints
from partialvfl.cli.common import add_protocol_options, add_threads_option, emit, protocol_config, threads_for
from partialvfl.cli.params import method_from_args

__all__ = ["add_commands", "add_predict_command", "cmd_evaluate", "cmd_fit"]


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
    add_threads_option(p)
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
    add_threads_option(p, "torch threads for prediction: a number, or auto (default: as for fit)")
    p.set_defaults(func=cmd_evaluate)


def add_predict_command(sub: Any) -> None:
    """Add ``predict`` (across a federation) to the ``partialvfl`` sub-parsers."""
    p = sub.add_parser("predict", help="predict for a list of IDs across a federation's parties")
    p.add_argument("--model", required=True, help="a model directory written by fit --federation")
    p.add_argument("--out", required=True, help="CSV of predictions")
    p.add_argument("--federation", help="the coordinator's federation file: predict across party processes")
    p.add_argument("--ids", help="CSV/Parquet (or text, one per line) with the IDs to predict")
    p.add_argument("--id-column", default=None, help="ID column of --ids (default: its first column)")
    p.set_defaults(func=_cmd_predict)


# ---------------------------------------------------------------------- in process
def cmd_fit(args: argparse.Namespace) -> int:
    """``fit``: across the federation with ``--federation``, else in process under the paper's protocol."""
    if args.federation:
        from partialvfl.cli.federated import federated, run_federated_fit

        return federated(run_federated_fit, args)
    from partialvfl.data.protocol import make_protocol
    from partialvfl.federation.messages import MessageLog
    from partialvfl.methods.evaluation import evaluate
    from partialvfl.utils.threads import use_threads

    model = method_from_args(args)
    ck = checkpointer(args)
    config = protocol_config(args, test_missing="none")
    train, test = make_protocol(config)
    print(f"data: {train!r}", file=sys.stderr)
    log = MessageLog(keep_entries=False)
    threads = threads_for(args, model, train)
    t0 = time.perf_counter()
    with use_threads(threads):
        model.fit(train, log=log, checkpointer=ck)
    fit_s = time.perf_counter() - t0
    report_checkpoints(args, ck, not args.quiet)
    out = model.save(args.out)
    res = evaluate(model, test)
    print(f"fit {args.method} in {fit_s:.1f} s ({threads} torch thread{'s' * (threads > 1)}); "
          f"{log.total_bytes() / 1e6:.1f} MB crossed between parties; saved to {out}", file=sys.stderr)
    metric = "accuracy" if "accuracy" in res else "rmse"
    print(f"test ({config.test_missing}): {metric} {res[metric]:.4f}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from partialvfl.data.protocol import ProtocolConfig, make_protocol
    from partialvfl.methods import VFLMethod
    from partialvfl.methods.evaluation import metrics_from_predictions
    from partialvfl.utils.threads import use_threads

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
    if args.mode == "local" and args.party is None:
        raise ValueError("--mode local needs --party K")
    if args.mode == "local" and not hasattr(model, "predict_output_local"):
        raise ValueError(f"method {model.name!r} has no locally independent inference")
    t0 = time.perf_counter()
    with use_threads(threads_for(args, model, test)):
        output = model.predict_output_local(test, args.party) if args.mode == "local" else model.predict_output(test)
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


def _cmd_predict(args: argparse.Namespace) -> int:
    from partialvfl.cli.federated import cmd_predict

    return cmd_predict(args)
