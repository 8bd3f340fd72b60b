"""Fitting and using a model: ``fit``, ``evaluate`` and ``predict``, in process or across a federation.

``fit`` trains under the paper's protocol in this process, on your own tables (``--table PARTY=FILE``, see
:mod:`.tables`), or with ``--federation FILE`` across the federation's party processes (:mod:`.federated`);
``evaluate`` scores a saved model under a test mechanism of its protocol, or on labelled tables; ``predict``
predicts the users of tables (in process) or a list of IDs across a federation's parties.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from partialvfl.cli.common import (
    DEFAULT_METHOD,
    DEFAULT_PRESET,
    PRESET_HELP,
    add_device_options,
    add_protocol_options,
    add_table_options,
    add_threads_option,
    emit,
    non_negative,
    protocol_config,
    refuse_protocol_options,
    seed_form,
    threads_for,
)
from partialvfl.cli.params import add_prediction_param_option, load_for_prediction, method_from_args
from partialvfl.cli.privacy import add_privacy_options, check_privacy, party_dp, print_privacy

__all__ = ["add_commands", "add_predict_command", "cmd_evaluate", "cmd_fit"]


# ---------------------------------------------------------------------- parsers
def add_commands(sub: Any) -> None:
    """Add ``fit`` (in process, or with ``--federation``) and ``evaluate`` to the ``partialvfl`` sub-parsers."""
    p = sub.add_parser("fit",
                       help="fit a method (protocol dataset, your own tables, or a federation) and save it",
                       description="Fit a method and save it: under the paper's protocol on a dataset (--dataset), "
                                   "on your own tables in this process (--table PARTY=FILE ... --id-column "
                                   "--label --active) or across a federation's party processes (--federation FILE).")
    add_protocol_options(p, test=False)
    add_table_options(p, fit=True)
    p.add_argument("--method", default=DEFAULT_METHOD, help="method name (see `partialvfl methods`); default: "
                   "%(default)s")
    p.add_argument("--preset", default=DEFAULT_PRESET, help=PRESET_HELP)
    p.add_argument("--epochs", type=int, default=None,
                   help="set every epoch count of the method (pretraining included)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="override one method parameter (JSON value; '-' in KEY reads as '_'), repeatable")
    p.add_argument("--out", required=True, help="directory to save the model in")
    p.add_argument("--quiet", action="store_true", help="no progress at all")
    p.add_argument("--log-epochs", action="store_true",
                   help="one line per epoch on stderr (each stage's loss, bound...) instead of the progress bar; by "
                        "default a bar is shown on a terminal and nothing per epoch otherwise, then one summary line")
    p.add_argument("--federation", help="the coordinator's federation file: train across party processes")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="checkpoint coordinator and parties every N training steps (every method)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in OUT/checkpoints")
    p.add_argument("--party-timeout", type=non_negative(float), default=None, metavar="SECONDS",
                   help="with --federation: when a party stops answering, wait this long for it to come back, then "
                        "continue from the last checkpoint (default: stop at the first failure)")
    p.add_argument("--party-retries", type=non_negative(int), default=3, metavar="N",
                   help="with --party-timeout: how many party failures to wait out in one fit; default: %(default)s")
    add_privacy_options(p)
    add_threads_option(p)
    add_device_options(p)
    p.set_defaults(func=cmd_fit, parser=p)

    p = sub.add_parser("evaluate", help="evaluate a saved model under a test mechanism, on labelled tables, or "
                                        "against outcomes keyed by ID (--truth)",
                       description="Score a saved model: under a test mechanism of its protocol (--test-missing); on "
                                   "your tables when the label holder's carries the outcomes (--table PARTY=FILE "
                                   "...); or on tables without them, in process (--table ... --truth FILE) or across "
                                   "a federation (--federation FILE --truth FILE), against outcomes keyed by ID.")
    p.add_argument("--model", required=True, help="directory of a saved model")
    add_table_options(p, fit=False)
    p.add_argument("--truth", metavar="FILE",
                   help="outcomes keyed by ID (CSV/Parquet, from any source): its --id-column column "
                        "(default: the model's "
                        "ID column) and --label column (default: the model's label column); with --table its IDs "
                        "must be the tables' users, with --federation they are the users predicted")
    p.add_argument("--federation", metavar="FILE",
                   help="with --truth: predict the truth file's IDs across the federation's party processes")
    p.add_argument("--table-set", default=None, metavar="NAME",
                   help="with --federation: predict from the parties' prediction tables of this name")
    p.add_argument("--allow-prior-only", action="store_true",
                   help="with --federation: score IDs that no party holds (predicted from the training label prior) "
                        "instead of refusing them")
    p.add_argument("--test-missing", default="none", help="mechanism applied to every test sample")
    p.add_argument("--seed", type=seed_form, default=None, metavar="N",
                   help="must equal the training seed (the default)")
    p.add_argument("--data-dir", default=None, help="where the dataset's files are, if not where they were")
    p.add_argument("--mode", choices=("collaborative", "local"), default="collaborative",
                   help="collaborative (any observed parties) or local (one party alone, methods that support it)")
    p.add_argument("--party", default=None, metavar="NAME",
                   help="the party predicting alone in --mode local, by name (a party's index still works, with a "
                        "warning)")
    p.add_argument("--json", action="store_true", help="one JSON object (with at least `accuracy` or `rmse`)")
    p.add_argument("--reliability", metavar="FILE", default=None,
                   help="write a reliability diagram (accuracy against confidence; .png or .svg) of the predictions")
    add_threads_option(p, "torch threads for prediction: a number, or auto (default: as for fit)")
    add_prediction_param_option(p)
    add_device_options(p, compile_option=False)
    p.set_defaults(func=cmd_evaluate)


def add_predict_command(sub: Any) -> None:
    """Add ``predict`` (tables in process, or IDs across a federation) to the ``partialvfl`` sub-parsers."""
    p = sub.add_parser("predict", help="predict the users of tables (in process) or a list of IDs (federation)",
                       description="Write one row per user: the ID (under its own column name), the predicted class "
                                   "label, one probability column per class and the parties used. In process: "
                                   "--table PARTY=FILE for every party of the model; across a federation: "
                                   "--federation FILE --ids FILE.")
    p.add_argument("--model", required=True, help="a saved model directory")
    p.add_argument("--out", required=True, help="CSV of predictions")
    add_table_options(p, fit=False, ids=True)
    p.add_argument("--federation", help="the coordinator's federation file: predict across party processes")
    p.add_argument("--ids", help="with --federation: the IDs to predict, a .csv (.csv.gz, ...) or .parquet/.pq table, "
                   "or any other file as UTF-8 text with one ID per line (.tsv, .json, .xlsx and the like, "
                   "and lines holding a tab or comma, are refused)")
    p.add_argument("--table-set", default=None, metavar="NAME",
                   help="predict from the parties' prediction tables of this name ([[data.predict]] in party.toml: "
                        "new users, never trained on) instead of their training tables")
    p.add_argument("--allow-prior-only", action="store_true",
                   help="write rows that no party holds (or that every party failed to answer) as the training label "
                        "prior; without it such a prediction is an error")
    p.add_argument("--ess", action="store_true",
                   help="add a column importance_ess: the effective sample size of each row's importance weights "
                        "(methods that predict by importance sampling, FALSE-VFL; empty for a row predicted from the "
                        "label prior); the rows below the model's predict_low_ess are counted on stderr")
    add_privacy_options(p, labels=False)
    add_prediction_param_option(p)
    add_device_options(p, compile_option=False)
    p.set_defaults(func=_cmd_predict)


# ---------------------------------------------------------------------- in process
def cmd_fit(args: argparse.Namespace) -> int:
    """``fit``: across the federation with ``--federation``, else in process under the paper's protocol."""
    if args.federation:
        from partialvfl.cli.federated import federated, run_federated_fit

        return federated(run_federated_fit, args)
    if args.table:
        from partialvfl.cli.tables import fit_tables

        refuse_protocol_options(args.parser, args)
        return fit_tables(args, method_from_args(args))
    from partialvfl.cli.checkpoints import fit_options
    from partialvfl.cli.stopping import fit_command
    from partialvfl.data.protocol import make_protocol
    from partialvfl.federation.wire.messages import MessageLog
    from partialvfl.methods.evaluation import evaluate

    model = method_from_args(args)
    options = fit_options(args)  # --checkpoint-every/--resume checked before the data is read
    config = protocol_config(args, test_missing="none")
    train, test = make_protocol(config)
    print(f"data: {train!r}", file=sys.stderr)
    budgets = check_privacy(args, model, train)
    log = MessageLog(keep_entries=False)
    fitted = fit_command(args, options, model, train, log=log, party_dp=budgets)
    if isinstance(fitted, int):
        return fitted
    out = model.save(args.out)
    res = evaluate(model, test)
    threads = fitted.threads
    print(f"fit {args.method} in {fitted.seconds:.1f} s ({threads} torch thread{'s' * (threads > 1)}); "
          f"{log.total_bytes() / 1e6:.1f} MB crossed between parties; saved to {out}", file=sys.stderr)
    print_privacy(model)
    metric = "accuracy" if "accuracy" in res else "rmse"
    print(f"{test_set_title(config.test_missing)}: {metric} {res[metric]:.4f}")
    return 0


def test_set_title(mechanism: str) -> str:
    """How ``fit`` names the protocol's test set it scores: with no test mechanism, or under one."""
    if mechanism == "none":
        return "test set, no test mechanism (no block removed)"
    return f"test set under test mechanism {mechanism}"


def party_index(party: str, names: list[str]) -> int:
    """The index of ``--party``'s party among the model's ``names``: a name, or (the old spelling, with a warning)
    an index."""
    from partialvfl.cli.vocabulary import warn_old_spelling

    if party in names:
        return names.index(party)
    if party.isdigit() and int(party) < len(names):
        warn_old_spelling(f"--party {party} (an index)", f"--party {names[int(party)]} (the party's name)")
        return int(party)
    raise ValueError(f"--party {party!r} is none of the model's parties: {', '.join(names)}")


def cmd_evaluate(args: argparse.Namespace) -> int:
    """``evaluate``: score a saved model under a test mechanism of its protocol, or on labeled tables."""
    from partialvfl.cli.reliability import write_reliability
    from partialvfl.cli.truth import calibration_lines
    from partialvfl.data.protocol import ProtocolConfig, make_protocol
    from partialvfl.methods.evaluation import (
        ESS,
        add_diagnostics,
        ess_line,
        metrics_from_predictions,
        predict_with_diagnostics,
    )
    from partialvfl.utils.threads import use_threads

    if args.federation:
        if args.table:
            raise ValueError("evaluate takes --table files (in process) or --federation with --truth, not both")
        from partialvfl.cli.federated import federated, run_federated_evaluate

        return federated(run_federated_evaluate, args)
    if args.table_set or args.allow_prior_only:
        raise ValueError("--table-set and --allow-prior-only go with --federation")
    if args.table:
        from partialvfl.cli.tables import evaluate_tables

        return evaluate_tables(args)
    if args.truth:
        raise ValueError("evaluate --truth needs the users' features: --table PARTY=FILE for every party (in process) "
                         "or --federation FILE")
    model = load_for_prediction(args)
    info = model.data_info_.get("protocol")
    if not info:
        raise ValueError(f"the model in {args.model} was not fitted under the protocol: evaluate it on labelled "
                         "tables (--table PARTY=FILE ...)")
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
        raise ValueError("--mode local needs --party NAME")
    party = None if args.party is None else party_index(args.party, model.index_.party_names)
    if args.mode == "local" and not hasattr(model, "predict_output_local"):
        raise ValueError(f"method {model.name!r} has no locally independent inference")
    t0 = time.perf_counter()
    diagnostics: dict = {}
    with use_threads(threads_for(args, model, test)):
        if args.mode == "local":
            output = model.predict_output_local(test, party)
        else:
            output, diagnostics = predict_with_diagnostics(model, test)
    task = model.index_.task
    res = metrics_from_predictions(output, test, task.classes if task.is_classification else None,
                                   used=model.parties_used(test), party_names=model.index_.party_names)
    add_diagnostics(res, model, diagnostics)
    res.update({
        "method": model.name, "test_missing": args.test_missing, "mode": args.mode, "party": party,
        "party_name": None if party is None else model.index_.party_names[party],
        "predict_seconds": time.perf_counter() - t0, "params": model.params_,
        "pretrained": model.params_.get("pretrain"),
    })
    metric = "accuracy" if "accuracy" in res else "rmse"
    alone = f", party {res['party_name']} predicting alone" if args.mode == "local" else ""
    lines = [f"{model.name} on {cfg.get('dataset')} under test mechanism {args.test_missing}{alone}: "
             f"{metric} {res[metric]:.4f} over {res['n_samples']} samples"]
    if res["pretrained"] is not None:
        how = "pretrained with SimSiam" if res["pretrained"] else "trained on labelled data only"
        lines.append(f"  local encoders {how}")
    for k, v in res["by_observed_parties"].items():
        lines.append(f"  {k} observed parties: {metric} {v[metric]:.4f} (n={v['n']})")
    if res["all_missing"]:
        lines.append(f"  ({res['all_missing']} samples with no observed party were predicted from the label prior)")
    if res.get(ESS):
        lines.append("  " + ess_line(res[ESS], res[ESS].get("samples")))
    lines += calibration_lines(res)
    write_reliability(args.reliability, model, output, test.coordinator_view(),
                      f"{model.name} on {cfg.get('dataset')}, test mechanism {args.test_missing}")
    emit(res, args.json, "\n".join(lines))
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    if args.table:
        if args.federation or args.ids:
            raise ValueError("predict takes --table files (in process) or --federation with --ids, not both")
        from partialvfl.cli.tables import predict_tables

        return predict_tables(args)
    from partialvfl.cli.federated import cmd_predict

    party_dp(args)  # refused with --federation: a deployed party keeps its own budget
    return cmd_predict(args)
