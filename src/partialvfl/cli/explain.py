"""Which party drove each prediction and what each party is worth: ``explain`` and ``value`` (docs/explain.md).

Both read their rows from one of three places, as ``predict`` and ``evaluate`` do: your own tables in this process
(``--table PARTY=FILE ...``), a list of IDs across a federation's party processes (``--federation FILE``; ``explain
--ids FILE``, ``value --truth FILE``; ``--table-set NAME`` for the parties' prediction tables), or, for a model fitted
under the benchmark protocol, its test set (``--test-missing``).  The library does the work
(:mod:`partialvfl.methods.explain`, :mod:`partialvfl.methods.party_value`, across a federation
:mod:`partialvfl.orchestration.explain`); these commands read, write and say what they did.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.cli.common import add_device_options, add_table_options, device_options, emit, seed_form

__all__ = ["add_commands", "protocol_data", "rows_across"]


def _say(text: str) -> None:
    print(text, file=sys.stderr)


def _add_sources(p: argparse.ArgumentParser, *, ids: bool) -> None:
    add_table_options(p, fit=False, ids=ids)
    g = p.add_argument_group("across a federation")
    g.add_argument("--federation", metavar="FILE", help="the coordinator's federation file: across party processes")
    if ids:
        g.add_argument("--ids", metavar="FILE", help="with --federation: the IDs to explain (as predict --ids)")
    g.add_argument("--table-set", default=None, metavar="NAME",
                   help="with --federation: the parties' prediction tables of this name ([[data.predict]])")
    g = p.add_argument_group("a model fitted under the benchmark protocol (--dataset): its test set")
    g.add_argument("--test-missing", default="none", help="mechanism applied to every test sample")
    g.add_argument("--seed", type=seed_form, default=None, metavar="N", help="must equal the training seed")
    g.add_argument("--data-dir", default=None, help="where the dataset's files are, if not where they were")
    g.add_argument("--max-rows", type=int, default=None, metavar="N", help="the first N test rows only")
    g = p.add_argument_group("how")
    g.add_argument("--permutations", type=int, default=None, metavar="N",
                   help="a permutation estimate with N orders of the parties (with standard errors) instead of exact "
                        "Shapley values (exact by default up to --max-exact-parties parties, 64 orders above)")
    g.add_argument("--max-exact-parties", type=int, default=10, metavar="K",
                   help="exact Shapley values (2^K coalitions) up to this many parties; default: %(default)s")
    g.add_argument("--permutation-seed", type=seed_form, default=0, metavar="N",
                   help="seed of the permutations; default: %(default)s")
    g.add_argument("--quiet", action="store_true", help="no progress bar (one is shown on a terminal)")
    add_device_options(p, compile_option=False)


def add_commands(sub: Any) -> None:
    """Add ``explain`` and ``value`` to the ``partialvfl`` sub-parsers."""
    p = sub.add_parser("explain", help="each party's contribution to each prediction (Shapley values)",
                       description="Explain predictions: for each row, each party's exact Shapley value of the "
                                   "predicted class's probability and log-odds (regression: of the value), the base "
                                   "value (the prediction from no party: the label prior) and the prediction; base + "
                                   "contributions = prediction. A party the row lacks contributes 0.")
    p.add_argument("--model", required=True, help="a saved model directory")
    p.add_argument("--out", required=True, help="CSV of explanations, one row per ID")
    p.add_argument("--class", dest="explained_class", default=None, metavar="LABEL",
                   help="explain the probability of this class instead of each row's predicted class")
    p.add_argument("--allow-prior-only", action="store_true",
                   help="with --federation: explain IDs no party holds too (all contributions 0)")
    _add_sources(p, ids=True)
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("value", help="what each party is worth to a model (Shapley value of a score)",
                       description="Each party's Shapley value of a score (accuracy, log-loss reduction, AUC) over "
                                   "the coalitions of parties, on labelled rows, beside leave-one-party-out and the "
                                   "party alone; --out writes the table, every coalition's score and a bar chart.")
    p.add_argument("--model", required=True, help="a saved model directory")
    p.add_argument("--score", default=None, choices=("accuracy", "log_loss", "auc", "mse"),
                   help="accuracy (default), log_loss or auc; mse for a regression model")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write values.csv, coalitions.csv, values.json and the bar chart values.png / values.svg")
    p.add_argument("--truth", metavar="FILE", help="outcomes keyed by ID (as evaluate --truth)")
    p.add_argument("--bootstrap", type=int, default=200, metavar="N",
                   help="resamples of the rows for the standard errors of AUC; default: %(default)s")
    p.add_argument("--json", action="store_true", help="one JSON object")
    _add_sources(p, ids=False)
    p.set_defaults(func=cmd_value)


# ---------------------------------------------------------------------- where the rows come from
def protocol_data(args: argparse.Namespace, model: Any) -> Any:
    """The test set of a model fitted under the protocol, under ``--test-missing`` (``--max-rows``: the first N)."""
    from partialvfl.data.protocol import ProtocolConfig, make_protocol

    info = model.data_info_.get("protocol")
    if not info:
        raise ValueError(f"the model in {args.model} was not fitted under the protocol: give its rows as tables "
                         "(--table PARTY=FILE ...) or across a federation (--federation FILE)")
    cfg = dict(info)
    cfg["test_missing"] = args.test_missing
    if args.seed is not None and args.seed != cfg.get("seed"):
        raise ValueError(f"the model was trained with seed {cfg.get('seed')}; its test split is tied to that seed "
                         "(pass the same --seed or leave it out)")
    if args.data_dir:
        cfg["data_dir"] = args.data_dir
    test = make_protocol(ProtocolConfig(**cfg))[1]
    if args.max_rows is not None:
        if args.max_rows < 1:
            raise ValueError(f"--max-rows must be at least 1, got {args.max_rows}")
        test = test.subset(np.arange(min(args.max_rows, test.n_samples)))
    return test


def rows_across(args: argparse.Namespace, ids: np.ndarray, then: Callable[[Any, Any, str], Any],
                check: Callable[[Any, Any], None] | None = None) -> Any:
    """Load ``--model`` across ``--federation``'s parties, attach ``ids`` (``--table-set``'s tables or the training
    tables), ``check(federation, view)`` if given, and return ``then(model, view, handle)``; the parties are let go
    after.  Parties unreachable from the start are missing blocks (said on stderr); the label holder's own party
    unreachable is an error."""
    from partialvfl.federation.grpc.federation import GrpcFederation
    from partialvfl.methods.base import VFLMethod
    from partialvfl.orchestration import require_active_party

    fed = GrpcFederation.from_config(args.federation, allow_absent=True)
    try:
        require_active_party(fed, "is unreachable")
        if fed.absent:
            _say(f"parties {[fed.party_names[k] for k in sorted(fed.absent)]} are unreachable: they are missing from "
                 "every coalition (their contributions are 0)")
        model = VFLMethod.load(args.model, federation=fed, **device_options(args))
        idx = model.index_
        view, handle = fed.attach_ids(ids, task=idx.task, feature_dims=idx.feature_dims,
                                      feature_shapes=idx.feature_shapes, table=args.table_set)
        require_active_party(fed, "failed while the IDs were attached")
        if check is not None:
            check(fed, view)
        out = then(model, view, handle)
        fed.release(handle)
        return out
    finally:
        fed.close()


def _options(args: argparse.Namespace) -> dict[str, Any]:
    from partialvfl.utils.progress import stderr_is_terminal

    return {"permutations": args.permutations, "max_exact_parties": args.max_exact_parties,
            "seed": args.permutation_seed, "progress": not args.quiet and stderr_is_terminal()}


def _refuse_mixed(args: argparse.Namespace) -> None:
    if args.federation and args.table:
        raise ValueError(f"{args.command} takes --table files (in process) or --federation, not both")
    if not args.federation and args.table_set:
        raise ValueError("--table-set goes with --federation")


# ---------------------------------------------------------------------- explain
def cmd_explain(args: argparse.Namespace) -> int:
    _refuse_mixed(args)
    if args.federation:
        from partialvfl.cli.federated import federated

        return federated(_explain_across, args)
    from partialvfl.cli.tables import _model_tables, refuse_prior_only
    from partialvfl.methods.base import VFLMethod

    model = VFLMethod.load(args.model, **device_options(args))
    if args.table:
        data, _, id_column = _model_tables(args, model, labels=False)
        refuse_prior_only(data.observed, data.ids, True)
    else:
        data, id_column = protocol_data(args, model), "id"
    t0 = time.perf_counter()
    explanation = model.explain(data, explained_class=args.explained_class, **_options(args))
    _write(model, explanation, id_column, args.out, time.perf_counter() - t0)
    return 0


def _explain_across(args: argparse.Namespace) -> int:
    from partialvfl.cli.federated import read_id_list
    from partialvfl.cli.tables import refuse_prior_only
    from partialvfl.orchestration.explain import explain_across

    if not args.ids:
        raise ValueError("explain --federation needs --ids FILE: the IDs whose predictions to explain")
    ids, column = read_id_list(args.ids, args.id_column)
    t0 = time.perf_counter()

    def then(model: Any, view: Any, handle: str) -> Any:
        refuse_prior_only(view.observed, ids, args.allow_prior_only)
        return model, explain_across(model, view, handle, explained_class=args.explained_class, **_options(args))

    model, explanation = rows_across(args, ids, then)
    _write(model, explanation, column or model.data_info_.get("id_column") or "id", args.out,
           time.perf_counter() - t0)
    return 0


def _write(model: Any, explanation: Any, id_column: str, out: str, seconds: float) -> None:
    """The CSV (rows by ID), then a summary: how it was estimated, the efficiency check, each party's mean
    contribution."""
    frame = explanation.to_frame(id_column)
    try:  # rows by ID, as predict writes them, whatever the canonical sample order
        order = np.argsort(explanation.ids, kind="stable")
    except TypeError:  # IDs of mixed types: by their text
        order = np.argsort(np.array([str(i) for i in explanation.ids], dtype=object), kind="stable")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.iloc[order].to_csv(path, index=False)
    k = len(explanation.party_names)
    how = (f"exact Shapley values over the {2 ** k} coalitions of {k} parties" if explanation.estimate == "exact"
           else f"a permutation estimate over {explanation.permutations} orders of {k} parties (standard errors "
                "in se_* columns)")
    _say(f"{model.name}: {explanation.n_rows} predictions explained ({how}) in {seconds:.1f} s; written to {path}")
    scale = "probability" if explanation.classes is not None else "value"
    print(f"{model.name}: {explanation.n_rows} predictions; base + contributions = prediction within "
          f"{explanation.efficiency_gap():.1e}")
    print(f"  {'party':<12} {'rows':>6} {'mean ' + scale + ' contribution':>30} {'mean |contribution|':>20}")
    for j, party in enumerate(explanation.party_names):
        held = explanation.parties[:, j]
        c = explanation.contributions[held, j]
        mean = f"{c.mean():+.4f}" if held.any() else "-"
        size = f"{np.abs(c).mean():.4f}" if held.any() else "-"
        print(f"  {party:<12} {int(held.sum()):>6} {mean:>30} {size:>20}")


# ---------------------------------------------------------------------- value
def cmd_value(args: argparse.Namespace) -> int:
    _refuse_mixed(args)
    options = {**_options(args), "score": args.score, "bootstrap": args.bootstrap}
    if args.federation:
        from partialvfl.cli.federated import federated

        return federated(lambda a: _value_across(a, options), args)
    from partialvfl.cli.tables import _label_column, _model_tables
    from partialvfl.cli.truth import read_truth
    from partialvfl.methods.base import VFLMethod

    model = VFLMethod.load(args.model, **device_options(args))
    outcomes = None
    if args.table and args.truth:
        data, _, id_column = _model_tables(args, model, labels=False)
        truth = read_truth(args.truth, id_column, _label_column(args, model))
        outcomes = (truth.aligned(data.ids, "the --table files"), truth)
        where = f"on the given tables, outcomes from --truth {args.truth}"
    elif args.table:
        data, _, _ = _model_tables(args, model, labels=True)
        where = "on the given tables"
    else:
        if args.truth:
            raise ValueError("value --truth needs the users' features: --table PARTY=FILE ... or --federation FILE")
        data = protocol_data(args, model)
        where = f"on the protocol's test set under {args.test_missing}"
    from partialvfl.cli.truth import labeled_view
    from partialvfl.methods.party_value import value_attached

    with model.attached(data) as (conformed, handle):
        view = conformed.coordinator_view()
        if outcomes is not None:
            view = labeled_view(model, view, *outcomes)
        values = value_attached(model, view, handle, **options)
    _report_value(args, values, where)
    return 0


def _value_across(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from partialvfl.cli.truth import labeled_view, read_truth
    from partialvfl.methods.model_files import read_model_meta
    from partialvfl.orchestration.explain import value_across

    if not args.truth:
        raise ValueError("value --federation needs --truth FILE: the outcomes of the IDs to score")
    info = read_model_meta(Path(args.model)).get("data_info", {})
    id_column, label = args.id_column or info.get("id_column"), args.label_column or info.get("label_column")
    if not id_column or not label:
        raise ValueError("say which columns of --truth hold the IDs and the outcomes: "
                         "--id-column COLUMN --label COLUMN")
    truth = read_truth(args.truth, id_column, label)
    ids = np.array(truth.ids, dtype=object)
    tables = f"prediction tables {args.table_set!r}" if args.table_set else "training tables"

    def check(fed: Any, view: Any) -> None:
        truth.check_federation(fed.last_held, fed.last_unlisted, fed.party_names, sorted(fed.absent),
                               f"the parties' {tables}")

    def then(model: Any, view: Any, handle: str) -> Any:
        labeled = labeled_view(model, view, truth.aligned(ids, f"--truth {args.truth}"), truth)
        return value_across(model, labeled, handle, **options)

    _report_value(args, rows_across(args, ids, then, check), f"across the federation (the {tables})")
    return 0


def _report_value(args: argparse.Namespace, values: Any, where: str) -> None:
    table = values.table()
    how = "exact" if values.estimate == "exact" else "a permutation estimate"
    lines = [f"{values.method} {where}: each party's value ({values.gain}; {how} over "
             f"{len(values.coalitions)} coalitions, {values.n_rows} labelled rows)",
             f"  {values.score}: {values.full:.4f} with every party, {values.empty:.4f} with none (the label prior)",
             f"  {'party':<12} {'shapley':>9} {'s.e.':>8} {'leave-one-out':>14} {'alone':>8}"]
    for r in table.itertuples():
        lines.append(f"  {r.party:<12} {r.shapley:>+9.4f} {r.standard_error:>8.4f} {r.leave_one_out:>+14.4f} "
                     f"{r.alone:>+8.4f}")
    written = []
    if args.out:
        import json

        from partialvfl.bench.explain_figures import value_bar_chart

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        table.to_csv(out / "values.csv", index=False)
        values.coalition_table().to_csv(out / "coalitions.csv", index=False)
        (out / "values.json").write_text(json.dumps(_value_json(values), indent=2))
        written = [out / "values.csv", out / "coalitions.csv", out / "values.json"]
        written += [value_bar_chart(values, out / f"values.{ext}") for ext in ("png", "svg")]
        _say(f"written: {', '.join(str(w) for w in written)}")
    emit(_value_json(values), args.json, "\n".join(lines))


def _value_json(values: Any) -> dict[str, Any]:
    return {"method": values.method, "score": values.score, "gain": values.gain, "estimate": values.estimate,
            "n_rows": values.n_rows, "full": values.full, "empty": values.empty,
            "parties": values.table().to_dict(orient="records"),
            "coalitions": values.coalition_table().to_dict(orient="records")}
