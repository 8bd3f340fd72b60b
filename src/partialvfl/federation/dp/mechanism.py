"""What a privacy mechanism declares, and the registry of declared mechanisms.

A mechanism is one module with one :class:`PrivacyMechanism` passed to :func:`register_mechanism` at import: its
name, where it runs (``"label"``: at the label holder, on the labels it trains with; ``"release"``: at a party, on
what it releases about its rows), a one-line summary, its declared parameters and its accounting hook, which says
what one application is as a ``dp-accounting`` event (:mod:`dp_accounting`), so that its epsilon is computed by
that library (:func:`mechanism_epsilon`), never here.  The privacy CLI's listing (``partialvfl mechanisms``) and its
wording read the registry.

The package's party-side mechanisms live in this folder (:func:`load_mechanisms` imports every module of it); label
mechanisms live in :mod:`partialvfl.methods.label_dp` (above this layer; imported by the code that uses them).
The declaration does not make the fit use a mechanism: which code runs is still the fit's (docs/privacy.md).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["MechanismParam", "PrivacyMechanism", "get_mechanism", "load_mechanisms", "mechanism_epsilon",
           "mechanisms", "register_mechanism", "unregister_mechanism"]

WHERE = ("label", "release")


@dataclass(frozen=True)
class MechanismParam:
    """A parameter a mechanism takes: its name (as the user sets it), type name, default and a help line."""

    name: str
    kind: Literal["float", "int", "bool"]
    default: float | int | bool | None
    help: str


@dataclass(frozen=True)
class PrivacyMechanism:
    """A privacy mechanism's declaration.

    ``dp_event``: the accounting hook, from the mechanism's parameters (``{name: value}``) to the ``dp-accounting``
    event (``dp_accounting.DpEvent``) of one application to one privacy unit.  ``title``: how the fit's privacy
    report names it (``summary`` if empty).  ``module``: where it is implemented (filled in by the registry).
    """

    name: str
    where: Literal["label", "release"]
    summary: str
    params: tuple[MechanismParam, ...]
    dp_event: Callable[[Mapping[str, Any]], Any]
    title: str = ""
    module: str = ""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"a privacy mechanism's name is letters, digits, '-' and '_', got {self.name!r}")
        if self.where not in WHERE:
            raise ValueError(f"privacy mechanism {self.name!r}: where must be one of {WHERE}, got {self.where!r}")
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"privacy mechanism {self.name!r} declares a parameter twice: {names}")

    @property
    def label(self) -> str:
        """How the fit's privacy report names the mechanism."""
        return self.title or self.summary


_MECHANISMS: dict[str, PrivacyMechanism] = {}


def register_mechanism(mechanism: PrivacyMechanism, module: str = "") -> PrivacyMechanism:
    """Declare ``mechanism`` (once per name; ``module``: where it lives, for the listing); returns it as stored."""
    if mechanism.name in _MECHANISMS:
        raise ValueError(f"privacy mechanism {mechanism.name!r} is declared twice (first in "
                         f"{_MECHANISMS[mechanism.name].module or 'an unnamed module'})")
    if module and not mechanism.module:
        mechanism = PrivacyMechanism(mechanism.name, mechanism.where, mechanism.summary, mechanism.params,
                                     mechanism.dp_event, mechanism.title, module)
    _MECHANISMS[mechanism.name] = mechanism
    return mechanism


def unregister_mechanism(name: str) -> None:
    """Forget mechanism ``name`` (a test's or a notebook's toy mechanism)."""
    _MECHANISMS.pop(name, None)


def load_mechanisms() -> None:
    """Import every module of this folder (the package's party-side mechanisms declare themselves at import)."""
    for info in pkgutil.iter_modules([str(Path(__file__).parent)], prefix=f"{__package__}."):
        importlib.import_module(info.name)


def mechanisms(where: str | None = None) -> list[PrivacyMechanism]:
    """The declared mechanisms (those running at ``where`` only, if given), in declaration order."""
    if where is not None and where not in WHERE:
        raise ValueError(f"where must be one of {WHERE}, got {where!r}")
    return [m for m in _MECHANISMS.values() if where is None or m.where == where]


def get_mechanism(name: str) -> PrivacyMechanism:
    """The mechanism declared as ``name``; an unknown name is an error listing the declared ones."""
    try:
        return _MECHANISMS[name]
    except KeyError:
        raise ValueError(f"no privacy mechanism {name!r}; declared: {sorted(_MECHANISMS) or 'none'}") from None


def mechanism_epsilon(mechanism: PrivacyMechanism, params: Mapping[str, Any], delta: float = 0.0,
                      count: int = 1) -> float:
    """The epsilon at ``delta`` of ``count`` applications of ``mechanism`` with ``params`` to one privacy unit, by
    ``dp-accounting``'s privacy-loss-distribution accountant (replace-one neighbours)."""
    import dp_accounting as dpa
    from dp_accounting.pld import pld_privacy_accountant

    event = mechanism.dp_event(params)
    accountant = pld_privacy_accountant.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE)
    accountant.compose(event if count == 1 else dpa.SelfComposedDpEvent(event, count))
    return float(accountant.get_epsilon(delta))
