"""``fit --label-dp EPS`` and ``fit --party-dp PARTY=EPS[:DELTA]``: differential privacy from the command line.

``--label-dp``: the label holder's label DP (randomized response on every training label; the same key as ``[labels]
label_dp`` of a federation file and ``label_dp=`` in Python).  ``--party-dp``: an in-process party's own budget
(``[policy] dp_epsilon``/``dp_delta`` of a deployed party's ``party.toml``, which no coordinator flag can change).
The fit prints what each mechanism spent.  ``partialvfl mechanisms`` lists the declared privacy mechanisms
(:mod:`partialvfl.federation.dp.mechanism`: where each runs, its parameters).
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["add_commands", "add_privacy_options", "check_privacy", "cmd_mechanisms", "declared_mechanisms",
           "federated_label_dp", "party_dp", "predict_federation", "print_predict_privacy", "print_privacy"]

DEFAULT_DELTA = 1e-5


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_commands(sub: Any) -> None:
    """Add ``mechanisms`` (the declared privacy mechanisms) to the ``partialvfl`` sub-parsers."""
    p = sub.add_parser("mechanisms", help="list the privacy mechanisms: where each runs, its parameters",
                       description="Every declared privacy mechanism (the package's and any imported plug-in's): "
                                   "where it runs (label: at the label holder, on its training labels; release: at "
                                   "a party, on what it releases about its rows), what it does and its parameters.")
    p.add_argument("--json", action="store_true", help="one JSON list: per mechanism its name, where, summary, "
                                                       "parameters")
    p.set_defaults(func=cmd_mechanisms)


def declared_mechanisms() -> list[Any]:
    """Every declared privacy mechanism, the package's loaded first (the listing's and the errors' source)."""
    import partialvfl.methods.label_dp  # noqa: F401  (declares the label mechanisms)
    from partialvfl.federation.dp.mechanism import load_mechanisms, mechanisms

    load_mechanisms()
    return mechanisms()


def cmd_mechanisms(args: argparse.Namespace) -> int:
    """``partialvfl mechanisms``: one block per mechanism (or ``--json``)."""
    import json

    found = declared_mechanisms()
    if args.json:
        print(json.dumps([{"name": m.name, "where": m.where, "summary": m.summary, "module": m.module,
                           "params": [{"name": p.name, "type": p.kind, "default": p.default, "help": p.help}
                                      for p in m.params]} for m in found], indent=2))
        return 0
    for m in found:
        print(f"{m.name} ({m.where}): {m.summary}")
        for p in m.params:
            default = "null" if p.default is None else str(p.default).lower()
            print(f"  {p.name} ({p.kind}, default {default}): {p.help}")
    return 0


def add_privacy_options(p: argparse.ArgumentParser, *, labels: bool = True) -> None:
    """``--label-dp`` (with ``labels``) and ``--party-dp``."""
    if labels:
        p.add_argument("--label-dp", type=_positive, default=None, metavar="EPS",
                       help="label differential privacy: randomized response at EPS on every training label (the "
                            "label holder's choice; classification, methods that support it: docs/privacy.md; "
                            "partialvfl mechanisms lists the mechanisms)")
    p.add_argument("--party-dp", action="append", default=[], metavar="PARTY=EPS[:DELTA]",
                   help="in process: party PARTY keeps a differential-privacy budget for its rows (default delta "
                        f"{DEFAULT_DELTA:g}); a deployed party sets [policy] dp_epsilon, dp_delta itself. Repeatable")


def party_dp(args: argparse.Namespace) -> dict[str, tuple[float, float]] | None:
    """``--party-dp`` as ``{party: (epsilon, delta)}`` (``None`` without it)."""
    items = getattr(args, "party_dp", None) or []
    if not items:
        return None
    if getattr(args, "federation", None):
        raise ValueError("--party-dp is for parties in this process; a deployed party sets its own budget "
                         "([policy] dp_epsilon, dp_delta in its party.toml)")
    out: dict[str, tuple[float, float]] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name or not value.strip():
            raise ValueError(f"--party-dp takes PARTY=EPS or PARTY=EPS:DELTA, got {item!r}")
        if name in out:
            raise ValueError(f"--party-dp names party {name!r} twice")
        eps, _, delta = value.partition(":")
        try:
            out[name] = (_positive(eps), _positive(delta) if delta else DEFAULT_DELTA)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--party-dp {item!r}: {e} (PARTY=EPS or PARTY=EPS:DELTA)") from None
    return out


def check_privacy(args: argparse.Namespace, method: Any, data: Any) -> dict[str, tuple[float, float]] | None:
    """``--label-dp``, ``--party-dp`` and ``--param label_dp_prior`` checked against the method and the data before an
    in-process fit, with errors that name the flags; returns the budgets by party name (``None`` without any)."""
    from partialvfl.methods.private_fit import private_methods_text

    budgets = party_dp(args)
    flags = [f for f, on in (("--label-dp", args.label_dp is not None), ("--party-dp", bool(budgets))) if on]
    if flags and not method.supports_privacy:
        raise ValueError(f"{' and '.join(flags)}: {method.name} does not support differential privacy; the methods "
                         f"that do: {private_methods_text()}")
    unknown = [name for name in budgets or {} if name not in data.party_names]
    if unknown:
        raise ValueError(f"--party-dp: no party {unknown[0]!r}; the parties are {list(data.party_names)}")
    if args.label_dp is not None and not data.task.is_classification:
        from partialvfl.methods.private_fit import label_mechanism

        raise ValueError(f"--label-dp: label DP ({label_mechanism(method)[0].label}) is for classification; this "
                         f"task is {data.task.kind}")
    if method.label_dp_prior and args.label_dp is None:
        raise ValueError("--param label_dp_prior=true needs --label-dp EPS")
    return budgets


def federated_label_dp(args: argparse.Namespace, method: Any, from_file: float | None,
                       mechanism: Mapping[str, Any] | None = None) -> None:
    """A federated fit's label DP: ``--label-dp`` or ``[labels] label_dp`` (they must agree), with a seed the parties
    cannot know (drawn from :mod:`secrets`, kept in ``OUT/checkpoints`` so that ``--resume`` randomizes alike);
    ``mechanism``: ``[labels] label_dp_mechanism`` and the ``label_dp_params`` table as parameters
    (:meth:`~partialvfl.federation.grpc.federation_file.LabelSource.mechanism_params`), set as ``--param`` sets them
    (checked against the mechanism's declaration)."""
    from partialvfl.methods.private_fit import private_methods_text

    if mechanism:
        try:
            method.set_params(**mechanism)
        except ValueError as e:
            raise ValueError(f"[labels] in {args.federation}: {e}") from None
    eps = args.label_dp if args.label_dp is not None else from_file
    source = "--label-dp" if args.label_dp is not None else f"[labels] label_dp in {args.federation}"
    if args.label_dp is not None and from_file is not None and float(args.label_dp) != float(from_file):
        raise ValueError(f"--label-dp {args.label_dp:g} disagrees with [labels] label_dp = {from_file:g} in "
                         f"{args.federation}")
    if eps is None:
        if method.label_dp_prior:
            raise ValueError(f"--param label_dp_prior=true needs --label-dp EPS (or [labels] label_dp in "
                             f"{args.federation})")
        return
    if not method.supports_privacy:
        raise ValueError(f"{source}: {method.name} does not support differential privacy; the methods that do: "
                         f"{private_methods_text()}")
    path = Path(args.out) / "checkpoints" / "label-dp-seed"
    if path.exists():
        seed = int(path.read_text().strip())
    else:
        seed = secrets.randbits(63)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{seed}\n")
    method.set_params(label_dp=float(eps), label_dp_seed=seed)


def predict_federation(args: argparse.Namespace) -> Any | None:
    """``predict --party-dp`` in process: the saved model's parties, those named keeping their budgets (a fresh
    ledger each: a new process is a new party); ``None`` without the flag."""
    budgets = party_dp(args)
    if not budgets:
        return None
    from partialvfl.federation.runtime.coordinator import LocalFederation
    from partialvfl.federation.trust.policy import PartyPolicy
    from partialvfl.methods.model_files import read_model_meta

    index = read_model_meta(Path(args.model))["index"]
    names = list(index["party_names"])
    unknown = [name for name in budgets if name not in names]
    if unknown:
        raise ValueError(f"--party-dp: no party {unknown[0]!r}; the model's parties are {names}")
    policies = {name: PartyPolicy.research().with_dp(eps, delta) for name, (eps, delta) in budgets.items()}
    return LocalFederation(names, int(index["active_party"]), policies=policies)


def print_predict_privacy(federation: Any) -> None:
    """What ``predict --party-dp`` spent at each budget-keeping party, on stderr."""
    from partialvfl.methods.private_fit import describe_privacy

    parties = federation.private_parties()
    reports = federation.privacy_reports(sorted(parties))
    for line in describe_privacy({"parties": {federation.party_names[k]: r for k, r in sorted(reports.items())}}):
        print(line, file=sys.stderr)


def print_privacy(model: Any) -> None:
    """The fit's privacy lines (label DP, each budget-keeping party's own account), on stderr."""
    from partialvfl.methods.private_fit import describe_privacy

    for line in describe_privacy(getattr(model, "privacy_", None)):
        print(line, file=sys.stderr)
