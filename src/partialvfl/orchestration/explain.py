"""Explanations and party values across a federation: over one fixed set of parties, or not at all.

A coalition prediction treats the parties outside the coalition as missing; a party that is unreachable from the
start is missing from every coalition (its contribution is 0 for every row, and the caller says it was absent).  A
party that fails *during* an explanation would leave some coalitions predicted with it and some without: the
explanation is refused (:class:`~partialvfl.federation.wire.transport.PartyUnavailable`, naming the party) instead
of mixing them, and can be asked again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from partialvfl.federation.wire.transport import PartyUnavailable
from partialvfl.methods.explain import Explanation, explain_attached
from partialvfl.methods.party_value import PartyValues, value_attached

if TYPE_CHECKING:
    from partialvfl.data.dataset import CoordinatorView
    from partialvfl.methods.base import VFLMethod

__all__ = ["explain_across", "value_across", "without_absent"]

T = TypeVar("T")


def without_absent(fed: Any, view: CoordinatorView) -> CoordinatorView:
    """``view`` with the federation's absent parties (unreachable before anything was asked) as missing blocks."""
    absent = sorted(getattr(fed, "absent", ()))
    if not absent:
        return view
    observed = np.array(view.observed, dtype=bool)
    observed[:, absent] = False
    return dataclasses.replace(view, observed=observed)


def _over_fixed_parties(model: VFLMethod, view: CoordinatorView, compute: Callable[[CoordinatorView], T]) -> T:
    fed = model.federation_
    before = len(fed.transport.failures)
    out = compute(without_absent(fed, view))
    failed = sorted({party for _, party, _ in fed.transport.failures[before:]})
    if failed:
        names = [fed.party_names[k] for k in failed]
        raise PartyUnavailable(failed[0], f"parties {names} failed during the explanation: its coalitions would mix "
                                          "predictions with and without them; ask again once they answer")
    return out


def explain_across(model: VFLMethod, view: CoordinatorView, handle: str, **options: Any) -> Explanation:
    """:func:`~partialvfl.methods.explain.explain_attached` over the parties that answer (see the module)."""
    return _over_fixed_parties(model, view, lambda v: explain_attached(model, v, handle, **options))


def value_across(model: VFLMethod, view: CoordinatorView, handle: str, **options: Any) -> PartyValues:
    """:func:`~partialvfl.methods.party_value.value_attached` over the parties that answer (see the module)."""
    return _over_fixed_parties(model, view, lambda v: value_attached(model, v, handle, **options))
