"""What a privacy mechanism declares, and the registry of declared mechanisms.

A mechanism is one module with one :class:`PrivacyMechanism` passed to :func:`register_mechanism` at import: its
name, where it runs (``"label"``: at the label holder, on the labels it trains with; ``"release"``: at a party, on
what it releases about its rows), a one-line summary, its declared parameters, its accounting hook (what one
application is as a ``dp-accounting`` event, so that its epsilon is computed by that library: :func:`mechanism_epsilon`)
and the hooks the fit runs:

* a **label** mechanism declares ``apply`` (:data:`LabelApply`: the labels the coordinator trains with, from the true
  ones; a :class:`LabelContext` gives it seeded generators and, for a mechanism in two stages, a first fit's priors)
  and optionally ``debias`` (class frequencies of the true labels estimated from its output; without it the fit uses
  the plain frequencies of the labels it trained with);
* a **release** mechanism declares ``calibrate``, ``cost``, ``noise_release`` and ``noise_sum``
  (:class:`ReleaseHooks`).  A party's ledger composes in mu-GDP (``mu^2`` per row, Dong, Roth & Su), so only a
  mechanism whose every application is mu-GDP for a ``mu`` it declares (``cost``: ``mu^2``) can be a release
  mechanism; a declaration without the four hooks is refused.

Where a mechanism is found: the package's party-side mechanisms live in this folder and label mechanisms in
:mod:`partialvfl.methods.label_dp`; a plug-in is a module named by an entry point of the group
``partialvfl.mechanisms`` (``[project.entry-points."partialvfl.mechanisms"] toy = "toy_mechanism"``), which
:func:`load_mechanisms` imports (so a party process finds the mechanism its policy names), or any module imported
before the fit.  This module imports neither torch nor the federation's runtime (``partialvfl mechanisms`` lists
the registry without them).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from partialvfl.utils.plugins import import_entry_points

if TYPE_CHECKING:
    import torch

__all__ = ["ENTRY_POINT_GROUP", "LabelApply", "LabelContext", "LabelDebias", "LabelRelease", "MechanismParam",
           "PrivacyMechanism", "ReleaseHooks", "get_mechanism", "load_mechanisms", "load_plugins",
           "mechanism_epsilon", "mechanisms", "register_mechanism", "unregister_mechanism"]

WHERE = ("label", "release")

#: The entry point group of plug-in mechanisms: each entry point names a module that declares one at import.
ENTRY_POINT_GROUP = "partialvfl.mechanisms"


@dataclass(frozen=True)
class LabelContext:
    """What a label mechanism may ask of the fit.

    ``n_classes``: the task's classes (labels are ``0..K-1``); ``rng(purpose)``: a generator seeded by the fit's
    label-DP seed and ``purpose`` (the same purpose, the same draws); ``prior_fit(y, labeled)``: a first fit of the
    same method, parameters and seed on the labels ``y`` of rows ``labeled`` only, returning its predicted class
    probabilities ``(N, K)`` for every row (``None`` where the fit cannot run one).
    """

    n_classes: int
    rng: Callable[[str], np.random.Generator]
    prior_fit: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None


@dataclass(frozen=True)
class LabelRelease:
    """A label mechanism's output: the labels to train with (unlabelled rows unchanged) and the rows whose labels
    ``debias`` may estimate class frequencies from (``None``: every labelled row)."""

    y: np.ndarray
    debias_rows: np.ndarray | None = None


#: ``apply(y, labeled, params, context)``: a label mechanism on the true labels ``y`` (``(N,)`` class indices; only
#: rows ``labeled`` are read or changed) with its parameters ``params`` (its declared ones, validated).
LabelApply = Callable[[np.ndarray, np.ndarray, Mapping[str, Any], LabelContext], LabelRelease]
#: ``debias(noisy, n_classes, params)``: class frequencies ``(K,)`` of the true labels from the mechanism's output.
LabelDebias = Callable[[np.ndarray, int, Mapping[str, Any]], np.ndarray]


@dataclass(frozen=True)
class ReleaseHooks:
    """How a release mechanism runs under a party's mu-GDP ledger.

    ``calibrate(charges, remaining_mu2)``: the noise multiplier ``z`` of a setup whose plan applies the mechanism
    ``charges`` times per row, with ``remaining_mu2`` left at the party's most-charged row; ``cost(z)``: the
    ``mu^2`` one application costs a row (the sum over a plan must stay within ``remaining_mu2``);
    ``noise_release(rows, z, generator)``: the noised release of ``rows`` ``(n, d)`` (float64, each row already
    clipped to L2 norm 1, so the replace-one sensitivity is 2); ``noise_sum(total, z, clip, generator)``: the
    noised sum of per-row gradients each clipped to ``clip`` (DP-SGD).  Noise is drawn from ``generator`` only
    (the party's seeded ``torch.Generator``).
    """

    calibrate: Callable[[int, float], float]
    cost: Callable[[float], float]
    noise_release: Callable[[torch.Tensor, float, torch.Generator], torch.Tensor]
    noise_sum: Callable[[torch.Tensor, float, float, torch.Generator], torch.Tensor]


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
    event (``dp_accounting.DpEvent``) of one application to one privacy unit (a label mechanism's also get
    ``n_classes``, a release mechanism's ``noise_multiplier``).  ``title``: how the fit's privacy report names it
    (``summary`` if empty).  ``module``: where it is implemented (filled in by the registry).  ``apply`` and
    ``debias``: what a label mechanism runs (required: ``apply``).  ``release``: what a release mechanism runs
    (required; only a mechanism that is mu-GDP per application qualifies: a party's ledger composes ``mu^2``).
    """

    name: str
    where: Literal["label", "release"]
    summary: str
    params: tuple[MechanismParam, ...]
    dp_event: Callable[[Mapping[str, Any]], Any]
    title: str = ""
    module: str = ""
    apply: LabelApply | None = None
    debias: LabelDebias | None = None
    release: ReleaseHooks | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"a privacy mechanism's name is letters, digits, '-' and '_', got {self.name!r}")
        if self.where not in WHERE:
            raise ValueError(f"privacy mechanism {self.name!r}: where must be one of {WHERE}, got {self.where!r}")
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"privacy mechanism {self.name!r} declares a parameter twice: {names}")
        if self.where == "label" and (self.apply is None or self.release is not None):
            raise ValueError(f"label mechanism {self.name!r} must declare apply (what it does to the labels) and no "
                             "release hooks")
        if self.where == "release" and (not isinstance(self.release, ReleaseHooks) or self.apply is not None
                                        or self.debias is not None):
            raise ValueError(f"release mechanism {self.name!r} must declare release=ReleaseHooks(calibrate, cost, "
                             "noise_release, noise_sum) (a party's ledger composes mu^2 per row: only a mu-GDP "
                             "mechanism can run there) and no label hooks")

    def param(self, name: str) -> MechanismParam:
        """The declared parameter ``name``."""
        for p in self.params:
            if p.name == name:
                return p
        raise ValueError(f"privacy mechanism {self.name!r} has no parameter {name!r}; it declares "
                         f"{[p.name for p in self.params]}")

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
        mechanism = dataclasses.replace(mechanism, module=module)
    _MECHANISMS[mechanism.name] = mechanism
    return mechanism


def unregister_mechanism(name: str) -> None:
    """Forget mechanism ``name`` (a test's or a notebook's toy mechanism)."""
    _MECHANISMS.pop(name, None)


_PLUGINS_LOADED = False


def load_plugins(*, again: bool = False) -> None:
    """Import every module the entry point group ``partialvfl.mechanisms`` names, once per process (``again``: look
    again, e.g. after installing one); a broken one is an error naming it."""
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED and not again:
        return
    _PLUGINS_LOADED = True
    import_entry_points(ENTRY_POINT_GROUP, "privacy mechanism")


def load_mechanisms(*, plugins: bool = True) -> None:
    """Import every module of this folder (the package's party-side mechanisms declare themselves at import) and,
    with ``plugins``, the plug-ins (:func:`load_plugins`)."""
    for info in pkgutil.iter_modules([str(Path(__file__).parent)], prefix=f"{__package__}."):
        importlib.import_module(info.name)
    if plugins:
        load_plugins()


def mechanisms(where: str | None = None) -> list[PrivacyMechanism]:
    """The declared mechanisms (those running at ``where`` only, if given), in declaration order."""
    if where is not None and where not in WHERE:
        raise ValueError(f"where must be one of {WHERE}, got {where!r}")
    return [m for m in _MECHANISMS.values() if where is None or m.where == where]


def get_mechanism(name: str, where: str | None = None) -> PrivacyMechanism:
    """The mechanism declared as ``name`` (running at ``where``, if given); an unknown name is an error listing the
    declared ones."""
    found = _MECHANISMS.get(name)
    if found is None or (where is not None and found.where != where):
        kind = f"{where} " if where else ""
        declared = sorted(m.name for m in mechanisms(where))
        raise ValueError(f"no {kind}privacy mechanism {name!r}; declared: {', '.join(declared) or 'none'}")
    return found


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
