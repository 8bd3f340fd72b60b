"""``fit --label-dp EPS`` and ``fit --party-dp PARTY=EPS[:DELTA]``: differential privacy from the command line.

``--label-dp``: the label holder's label DP (randomized response on every training label; the same key as ``[labels]
label_dp`` of a federation file and ``label_dp=`` in Python).  ``--party-dp``: an in-process party's own budget
(``[policy] dp_epsilon``/``dp_delta`` of a deployed party's ``party.toml``, which no coordinator flag can change).
The fit prints what each mechanism spent.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_privacy_options", "federated_label_dp", "party_dp", "print_privacy"]

DEFAULT_DELTA = 1e-5


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_privacy_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--label-dp", type=_positive, default=None, metavar="EPS",
                   help="label differential privacy: randomized response at EPS on every training label (the "
                        "label holder's choice; classification, methods that support it: docs/privacy.md)")
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
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        eps, _, delta = value.partition(":")
        try:
            out[name.strip()] = (_positive(eps), _positive(delta) if delta else DEFAULT_DELTA)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--party-dp {item!r}: {e} (PARTY=EPS or PARTY=EPS:DELTA)") from None
        if not sep or not name.strip():
            raise ValueError(f"--party-dp takes PARTY=EPS[:DELTA], got {item!r}")
    return out


def federated_label_dp(args: argparse.Namespace, method: Any, from_file: float | None) -> None:
    """A federated fit's label DP: ``--label-dp`` or ``[labels] label_dp`` (they must agree), with a seed the parties
    cannot know (drawn from :mod:`secrets`, kept in ``OUT/checkpoints`` so that ``--resume`` randomizes alike)."""
    eps = args.label_dp if args.label_dp is not None else from_file
    if args.label_dp is not None and from_file is not None and float(args.label_dp) != float(from_file):
        raise ValueError(f"--label-dp {args.label_dp:g} disagrees with [labels] label_dp = {from_file:g} in "
                         f"{args.federation}")
    if eps is None:
        return
    path = Path(args.out) / "checkpoints" / "label-dp-seed"
    if path.exists():
        seed = int(path.read_text().strip())
    else:
        seed = secrets.randbits(63)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{seed}\n")
    method.label_dp, method.label_dp_seed = float(eps), seed


def print_privacy(model: Any) -> None:
    """The fit's privacy lines (label DP, each budget-keeping party's own account), on stderr."""
    from partialvfl.methods.private_fit import describe_privacy

    for line in describe_privacy(getattr(model, "privacy_", None)):
        print(line, file=sys.stderr)
