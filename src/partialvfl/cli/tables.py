"""Your own tables in one process: ``fit --table``, ``predict --table`` and ``evaluate --table``.

Each party's table is read with :func:`~partialvfl.data.builders.from_tables` (one rule for IDs, numeric columns
only, the canonical sample order).  ``predict`` and ``evaluate`` take the ID, label and feature columns the model
was fitted on unless told otherwise, so tables of new users need no label column; their columns may come in any
order and other columns are ignored (and named).  :func:`prediction_frame` writes what ``predict`` writes, in
process and across a federation alike.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.cli.common import emit, parse_tables, threads_for
from partialvfl.cli.params import load_for_prediction
from partialvfl.data.ids import show_id

__all__ = ["fit_tables", "evaluate_tables", "predict_tables", "prediction_frame", "refuse_prior_only",
           "used_parties", "write_predictions"]


def _say(text: str) -> None:
    print(text, file=sys.stderr)


def _federated_fit(model_dir: str) -> dict[str, Any]:
    """``model.json`` of the federated fit ``--order-of`` names."""
    import json

    f = Path(model_dir) / "model.json"
    if not f.is_file():
        raise FileNotFoundError(f"--order-of: {f} not found")
    return json.loads(f.read_text())


def _parties_of_federated_fit(tables: dict[str, str], active: str, meta: dict[str, Any], model_dir: str
                              ) -> dict[str, str]:
    """The ``--table`` files in the party order of the federated fit (``--order-of``): one rule for the order of a
    model's parties, its federation file's, whatever order the flags come in; tables of other parties, or another
    label holder, are refused, naming the fit's."""
    index = meta.get("index", {})
    parties, holder = list(index.get("party_names", [])), index.get("active_party")
    if sorted(tables) != sorted(parties):
        raise ValueError(f"--order-of {model_dir}: the federated fit's parties are {parties}, in that order; the "
                         f"--table flags name {list(tables)}")
    if holder is not None and parties[int(holder)] != active:
        raise ValueError(f"--order-of {model_dir}: the federated fit's label holder is {parties[int(holder)]!r}, "
                         f"not --active {active!r}")
    if list(tables) != parties:
        _say(f"note: parties in the federated fit's order (--order-of): {', '.join(parties)} (the --table flags "
             f"named {', '.join(tables)})")
    return {p: tables[p] for p in parties}


def _order_of_federated_fit(data: Any, meta: dict[str, Any], model_dir: str, args: argparse.Namespace) -> Any:
    """``data`` in the sample order of the federated fit saved in ``model_dir`` (``--order-of``): its private set
    union's order (the passive parties' ``--alignment-key`` and the fit's salt) or, for a fit aligned by HMAC, the
    order ``--hmac-key`` gives ``data`` already."""
    from partialvfl.federation.trust.psu import read_alignment_key, session_order

    alignment = meta.get("data_info", {}).get("alignment", {})
    if alignment.get("mode") == "hmac":
        if not args.hmac_key:
            raise ValueError(f"--order-of {model_dir}: a fit aligned by HMAC; give the federation's key with "
                             "--hmac-key FILE")
        return data
    if not args.alignment_key:
        raise ValueError("--order-of needs --alignment-key FILE (the passive parties' alignment key)")
    salt = alignment.get("salt")
    if not salt:
        raise ValueError(f"--order-of: {model_dir} is not a federated fit aligned by private set union")
    return data.subset(session_order(data.ids, read_alignment_key(args.alignment_key), salt))


def fit_tables(args: argparse.Namespace, model: Any) -> int:
    """Fit ``model`` on ``--table`` files joined on ``--id``, labels in ``--active``'s ``--label`` column."""
    from partialvfl.data.builders import from_tables
    from partialvfl.data.tables import MissingLabelColumn

    if not args.id_column or not args.label_column or not args.active:
        raise ValueError("fit --table needs --id-column COLUMN, --label COLUMN and --active PARTY")
    tables = parse_tables(args.table)
    if args.active not in tables:
        raise ValueError(f"--active {args.active!r} is not one of the --table parties {list(tables)}")
    federated = _federated_fit(args.order_of) if getattr(args, "order_of", None) else None
    if federated is not None:
        tables = _parties_of_federated_fit(tables, args.active, federated, args.order_of)
    try:
        data = from_tables(tables, id_column=args.id_column, label_column=args.label_column,
                           active_party=args.active, order_key=args.hmac_key)
    except MissingLabelColumn as e:
        raise ValueError(f"active party {e.party!r}: its --table has no label column {e.column!r} ({e.hint}); name "
                         "the label column with --label COLUMN") from None
    if federated is not None:
        data = _order_of_federated_fit(data, federated, args.order_of, args)
    held = ", ".join(f"{p} {int(n)}" for p, n in zip(data.party_names, data.observed.sum(axis=0)))
    _say(f"data: {data.n_samples} samples ({data.n_labeled} labelled); rows held per party: {held}")
    from partialvfl.cli.checkpoints import fit_options
    from partialvfl.cli.privacy import check_privacy, print_privacy
    from partialvfl.cli.stopping import fit_command

    budgets = check_privacy(args, model, data)
    fitted = fit_command(args, fit_options(args), model, data, party_dp=budgets)  # SIGINT/SIGTERM: checkpoint, stop
    if isinstance(fitted, int):
        return fitted
    out = model.save(args.out)
    how = model.preprocessing_["how"]
    _say(f"fit {model.name} in {fitted.seconds:.1f} s (standardisation: {how}); saved to {out}")
    print_privacy(model)
    return 0


def _model_tables(args: argparse.Namespace, model: Any, *, labels: bool) -> tuple[Any, dict[str, str], str]:
    """The ``--table`` files as the model's dataset (its ID, (label) and feature columns, its parties), with the
    parsed ``{party: file}`` and the ID column, resolved here once for the caller."""
    from partialvfl.data.builders import from_tables

    info = model.data_info_
    tables = parse_tables(args.table)
    parties = list(model.index_.party_names)
    lacking = [p for p in parties if p not in tables]
    unknown = [p for p in tables if p not in parties]
    if lacking or unknown:
        raise ValueError(f"the model's parties are {parties}; " + "; ".join(filter(None, [
            f"no --table for {lacking} (give a table with only the header row for a party that holds none of these "
            "users)" if lacking else "", f"{unknown} are not parties of the model" if unknown else ""])))
    id_column = args.id_column or info.get("id_column")
    if not id_column:
        raise ValueError("say which column holds the IDs: --id-column COLUMN")
    label = (args.label_column or info.get("label_column")) if labels else None
    if labels and not label:
        raise ValueError("say which column holds the labels: --label COLUMN")
    names = model.index_.feature_names
    columns = None if names is None else {p: [c.split(":", 1)[1] for c in names[k]] for k, p in enumerate(parties)}
    seen: dict[str, list[Any]] = {}
    data = from_tables({p: tables[p] for p in parties}, id_column=id_column, label_column=label,
                       active_party=model.index_.active_party, feature_columns=columns, _columns=seen)
    _note_ignored(seen, tables, id_column, label, columns)
    return data, tables, id_column


def _note_ignored(seen: dict[str, list[Any]], tables: dict[str, str], id_column: str, label: str | None,
                  columns: dict[str, list[str]] | None) -> None:
    """Name the columns of the tables the model does not use (a label column of new users' tables included), from
    the columns ``from_tables`` saw when it read them (``seen``: no second read)."""
    if columns is None:
        return
    for party in tables:
        extra = [str(c) for c in seen[party] if c not in (id_column, label) and c not in columns[party]]
        if extra:
            _say(f"note: party {party!r}: columns {extra} are not used by the model")


def refuse_prior_only(observed: np.ndarray, ids: np.ndarray, allow: bool) -> None:
    """Rows no party holds would be predicted from the training label prior alone: an error unless ``allow``."""
    none = ~np.asarray(observed).any(axis=1)
    if not none.any():
        return
    what = f"{int(none.sum())} of {len(ids)} IDs (first: {show_id(ids[np.flatnonzero(none)[0]])}) are held by no party"
    if not allow:
        raise ValueError(f"{what}: their prediction would be the training label prior alone; pass "
                         "--allow-prior-only to write such rows")
    _say(f"note: {what}; predicted from the training label prior (--allow-prior-only)")


def used_parties(model: Any, view: Any) -> np.ndarray:
    """Which parties each row's prediction used, as the method reports it.

    From :meth:`~partialvfl.methods.base.VFLMethod.parties_used`; says on stderr how many rows some party holds
    were nevertheless predicted without any.
    """
    used = np.asarray(model.parties_used(view), dtype=bool)
    fell = np.asarray(view.observed, dtype=bool).any(axis=1) & ~used.any(axis=1)
    if fell.any():
        first = np.asarray(view.ids)[np.flatnonzero(fell)[0]]
        _say(f"note: {model.name}: {int(fell.sum())} of {len(fell)} rows (first: {show_id(first)}) are predicted from "
             f"{model.fallback()}, without any party's features (n_parties 0)")
    return used


def prediction_frame(model: Any, output: np.ndarray, used: np.ndarray, ids: np.ndarray, id_column: str) -> Any:
    """One row per ID: the ID (under its own column name), ``prediction`` (the class label as the model saw it, or
    the value), ``p_<class>`` per class, ``n_parties`` and ``parties``: the parties whose features the row's
    prediction used (``used``, from :func:`used_parties`; none: ``n_parties`` 0, ``parties`` empty)."""
    import pandas as pd

    df = pd.DataFrame({id_column: list(ids)})
    task = model.index_.task
    if task.is_classification:
        classes = list(task.classes)
        df["prediction"] = pd.Series([classes[i] for i in output.argmax(axis=1)], dtype=object)
        for j, c in enumerate(classes):
            df[f"p_{c}"] = output[:, j]
    else:
        df["prediction"] = output
    names = model.index_.party_names
    df["n_parties"] = used.sum(axis=1).astype(int)
    df["parties"] = [";".join(names[k] for k in np.flatnonzero(row)) for row in used]
    return df


def add_ess_column(df: Any, model: Any, diagnostics: dict[str, np.ndarray], order: np.ndarray | None = None) -> None:
    """``predict --ess``: the ``importance_ess`` column (the rows in ``order``), and a note on stderr of the rows whose
    answer rests on few samples; a method that does not predict by importance sampling is refused by name."""
    from partialvfl.methods.evaluation import ESS, ess_summary

    if ESS not in diagnostics:
        raise ValueError(f"--ess: {model.name} does not predict by importance sampling (it reports no effective "
                         "sample size); leave --ess out")
    values = diagnostics[ESS] if order is None else diagnostics[ESS][order]
    df[ESS] = values
    summary = ess_summary(values, float(model.params_.get("predict_low_ess", 10.0)))
    if summary is not None and summary["below_low"]:
        _say(f"note: {summary['below_low']} of {summary['rows']} predictions have an effective sample size below "
             f"{summary['low']:g} (median {summary['median']:.1f}): their probabilities rest on few importance "
             "samples")


def write_predictions(df: Any, out: str | Path) -> None:
    """Write the prediction frame as CSV to ``out`` (its folder created) and say so on stderr."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(path, index=False)
    _say(f"{len(df)} predictions written to {path}")


def predict_tables(args: argparse.Namespace) -> int:
    """Predict every ID of the ``--table`` files with a saved model; write the prediction CSV."""
    from partialvfl.cli.privacy import predict_federation, print_predict_privacy
    from partialvfl.methods.evaluation import predict_with_diagnostics

    fed = predict_federation(args)  # --party-dp: those parties answer within their budgets
    model = load_for_prediction(args, federation=fed)
    data, _, id_column = _model_tables(args, model, labels=False)
    refuse_prior_only(data.observed, data.ids, args.allow_prior_only)
    output, diagnostics = predict_with_diagnostics(model, data)
    used = used_parties(model, data)
    order = np.argsort(data.ids, kind="stable")  # rows by ID, whatever the canonical sample order
    frame = prediction_frame(model, output[order], used[order], data.ids[order], id_column)
    if getattr(args, "ess", False):
        add_ess_column(frame, model, diagnostics, order)
    write_predictions(frame, args.out)
    if fed is not None:
        print_predict_privacy(fed)
    return 0


def evaluate_tables(args: argparse.Namespace) -> int:
    """Score a saved model on ``--table`` files that carry the label (matched by value), or, with ``--truth FILE``,
    on tables without it against outcomes keyed by ID."""
    from partialvfl.cli.reliability import write_reliability
    from partialvfl.cli.truth import labeled_view, metric_lines, read_truth, score_against_truth
    from partialvfl.data.tables import MissingLabelColumn
    from partialvfl.methods.evaluation import add_diagnostics, evaluate, predict_with_diagnostics
    from partialvfl.utils.threads import use_threads

    model = load_for_prediction(args)
    if args.truth:
        data, tables, id_column = _model_tables(args, model, labels=False)
        truth = read_truth(args.truth, id_column, _label_column(args, model))
        values = truth.aligned(data.ids, "the --table files")
        with use_threads(threads_for(args, model, data)):
            output, diagnostics = predict_with_diagnostics(model, data)
        res = score_against_truth(model, output, data.coordinator_view(), values, truth)
        add_diagnostics(res, model, diagnostics)
        title = f"{model.name} on the given tables, scored against --truth {args.truth}"
        scored = labeled_view(model, model.conform(data).coordinator_view(), values, truth)
    else:
        try:
            data, tables, _ = _model_tables(args, model, labels=True)
        except MissingLabelColumn as e:
            raise ValueError(f"active party {e.party!r}: its --table has no label column {e.column!r} ({e.hint}); "
                             "evaluate scores tables that carry the outcomes (name the column with --label COLUMN), "
                             "or tables without them against outcomes in a separate file: --truth FILE "
                             "(IDs in --id-column COLUMN)") from None
        with use_threads(threads_for(args, model, data)):
            res = evaluate(model, data, calibration=True)
            output = model.predict_output(data) if getattr(args, "reliability", None) else None  # the same floats
        title = f"{model.name} on the given tables"
        scored = model.conform(data).coordinator_view()
    write_reliability(getattr(args, "reliability", None), model, output, scored, title)
    res.update({"method": model.name, "tables": tables})
    emit(res, args.json, "\n".join(metric_lines(title, res)))
    return 0


def _label_column(args: argparse.Namespace, model: Any) -> str:
    """``--label``, else the column the model's labels came from."""
    label = args.label_column or model.data_info_.get("label_column")
    if not label:
        raise ValueError("say which column of --truth holds the outcomes: --label COLUMN")
    return str(label)
