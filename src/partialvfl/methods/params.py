"""Declared method parameters: one place for each parameter's default, type, range, choices, help and presets.

A method declares a :class:`ParamSpace` (a tuple of :class:`Param` plus its presets); the estimator, the CLI
(``--param``, ``--epochs``, ``partialvfl methods``) and the grid validator all read it.  Resolving a preset for a
dataset gives a validated, plain ``dict`` (JSON-able values); a wrong name, type or value is refused with the
parameter's name.  Old names stay accepted as aliases (mapped to the current name, with a warning).

This module does not import torch, so listing methods and validating grids stays fast.
"""

from __future__ import annotations

import difflib
import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["COMMON_PARAMS", "KINDS", "PRIVACY_PARAMS", "SEED", "Param", "ParamSpace", "PresetFn", "check_seed",
           "dataset_key", "inferred_space", "parse_seed", "with_common"]

#: Value kinds: ``int``, ``float``, ``bool``, ``str`` (with ``choices``), ``ints`` (a list of positive ints, e.g.
#: hidden widths), ``range`` (a pair ``[low, high]`` of floats with low < high) and ``any`` (taken as given: for
#: methods that list only their defaults, e.g. plugins).
KINDS = ("int", "float", "bool", "str", "ints", "range", "any")

#: A preset: the overrides it applies on top of the defaults, as a function of the dataset key ('' if none).
PresetFn = Callable[[str], Mapping[str, Any]]

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


@dataclass(frozen=True)
class Param:
    """One tunable: its default, kind, help text and constraints.

    ``low``/``high`` bound numbers (inclusive; ``low`` excluded with ``open_low``, e.g. an epsilon > 0);
    ``optional`` admits ``None`` (meaning "derive it", said in the help); ``aliases`` are former names still
    accepted; ``epochs`` marks an epoch count that ``--epochs N`` sets;
    ``width`` marks a width of what a party sends, which a fit narrows (unless it was given) to fit every party's
    announced width caps (:mod:`partialvfl.methods.widths`).
    """

    name: str
    default: Any
    kind: str
    help: str
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    optional: bool = False
    aliases: tuple[str, ...] = ()
    epochs: bool = False
    width: bool = False
    open_low: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"parameter {self.name}: unknown kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        self.check(self.default, "the default")

    def describe(self) -> str:
        """A one-line description of the accepted values."""
        if self.choices is not None:
            what = " | ".join(str(c) for c in self.choices)
        else:
            what = {"int": "integer", "float": "number", "bool": "true | false", "str": "text",
                    "ints": "list of positive integers", "range": "[low, high]", "any": "any value"}[self.kind]
            if self.low is not None or self.high is not None:
                lo = "-inf" if self.low is None else f"{self.low:g}"
                hi = "inf" if self.high is None else f"{self.high:g}"
                what += f" in {'(' if self.open_low else '['}{lo}, {hi}]"
        return what + (" or null" if self.optional else "")

    def check(self, value: Any, where: str = "") -> Any:
        """``value`` converted to this parameter's kind, or a ``ValueError`` naming the parameter."""
        if value is None:
            if self.optional:
                return None
            raise ValueError(f"parameter {self.name} must be {self.describe()}, got null{where and ' (' + where + ')'}")
        try:
            out = _convert(self.kind, value)
        except (TypeError, ValueError):
            raise ValueError(f"parameter {self.name} must be {self.describe()}, got {value!r}") from None
        if self.choices is not None and out not in self.choices:
            close = difflib.get_close_matches(str(out), [str(c) for c in self.choices], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"parameter {self.name} must be one of {', '.join(map(str, self.choices))}, got "
                             f"{value!r}{hint}")
        numbers = out if self.kind in ("ints", "range") else [out] if self.kind in ("int", "float") else []
        for v in numbers:
            below = self.low is not None and (v <= self.low if self.open_low else v < self.low)
            if below or (self.high is not None and v > self.high):
                raise ValueError(f"parameter {self.name} must be {self.describe()}, got {value!r}")
        return out


def parse_bool(value: Any, name: str) -> bool:
    """``value`` as a declared boolean reads it (``true``/``yes``/``on``/``1``, ``false``/``no``/``off``/``0``, a
    bool, 0 or 1), or a ``ValueError`` naming ``name``: never Python's truthiness (``bool("no")`` is ``True``)."""
    try:
        return bool(_convert("bool", value))
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be true | false, got {value!r}") from None


def _convert(kind: str, value: Any) -> Any:
    if kind == "any":
        return value
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError
    if kind == "int":
        return _int(value)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise TypeError
        out = float(value)
        if not math.isfinite(out):
            raise ValueError
        return out
    if kind == "str":
        if not isinstance(value, str):
            raise TypeError
        return value
    if kind == "ints":
        if isinstance(value, str | bytes) or not isinstance(value, Iterable):
            raise TypeError
        out = [_int(v) for v in value]
        if any(v < 1 for v in out):
            raise ValueError
        return out
    # range
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError
    pair = [float(v) for v in value]
    if len(pair) != 2 or not pair[0] < pair[1] or not all(math.isfinite(v) for v in pair):
        raise ValueError
    return pair


def _int(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ValueError


@dataclass(frozen=True)
class ParamSpace:
    """A method's parameters and presets.

    ``presets`` maps each preset name to a :data:`PresetFn` (overrides for a dataset key); ``dataset_presets``
    names the presets whose values depend on the dataset (listed per dataset by ``partialvfl methods``);
    ``groups`` names sets of parameters that travel together (group -> {field: parameter}, e.g. an optimiser's
    ``name``/``lr``/``weight_decay``/``momentum``), read as one typed sub-object of the method's settings
    (:mod:`partialvfl.methods.settings`).
    """

    params: tuple[Param, ...]
    presets: Mapping[str, PresetFn] = field(default_factory=dict)
    dataset_presets: tuple[str, ...] = ()
    groups: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for p in self.params:
            for n in (p.name, *p.aliases):
                if n in seen:
                    raise ValueError(f"parameter name {n!r} declared twice ({seen[n]} and {p.name})")
                seen[n] = p.name
        for group, members in self.groups.items():
            if group in seen:
                raise ValueError(f"group {group!r} has the name of a parameter")
            for name in members.values():
                if name not in self.names:
                    raise ValueError(f"group {group!r} names {name!r}, which is not a declared parameter")

    # ------------------------------------------------------------------ lookups
    @property
    def names(self) -> list[str]:
        """The declared parameters' names, in declaration order."""
        return [p.name for p in self.params]

    @property
    def preset_names(self) -> tuple[str, ...]:
        """The presets' names."""
        return tuple(self.presets)

    def param(self, name: str) -> Param:
        """The declaration of parameter ``name`` (``KeyError`` for an undeclared name)."""
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def defaults(self) -> dict[str, Any]:
        """Every declared parameter's default (copies: safe to change)."""
        return {p.name: _copy(p.default) for p in self.params}

    def epoch_names(self) -> list[str]:
        """The epoch counts ``--epochs N`` sets."""
        return [p.name for p in self.params if p.epochs]

    def extend(self, *params: Param, replace: Mapping[str, Any] | None = None,
               presets: Mapping[str, PresetFn] | None = None, dataset_presets: tuple[str, ...] | None = None,
               groups: Mapping[str, Mapping[str, str]] | None = None) -> ParamSpace:
        """A new space with ``params`` added, defaults in ``replace`` changed, presets replaced and ``groups``
        added."""
        base = [p if not replace or p.name not in replace else
                Param(**{**p.__dict__, "default": replace[p.name]}) for p in self.params]
        return ParamSpace(tuple(base) + params, dict(presets if presets is not None else self.presets),
                          self.dataset_presets if dataset_presets is None else dataset_presets,
                          {**self.groups, **(groups or {})})

    # ------------------------------------------------------------------ names and values
    def canonical(self, name: str, owner: str = "") -> str:
        """The current name of ``name`` (itself, or the parameter it is an alias of); unknown names are refused."""
        key = str(name).strip().replace("-", "_")
        for p in self.params:
            if key == p.name:
                return p.name
            if key in p.aliases:
                warnings.warn(f"{owner + ': ' if owner else ''}parameter {name!r} is now called {p.name!r}",
                              DeprecationWarning, stacklevel=3)
                return p.name
        close = difflib.get_close_matches(key, self.names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{owner + ': ' if owner else ''}unknown parameter {name!r}{hint} (known: "
                         f"{', '.join(self.names)})")

    def renamed(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` under current names, silently (stored models and checkpoints written before a rename)."""
        current = {a: p.name for p in self.params for a in (p.name, *p.aliases)}
        return {current.get(k, k): v for k, v in values.items()}

    def validate(self, values: Mapping[str, Any], owner: str = "") -> dict[str, Any]:
        """``values`` with current names and converted values; every problem is named."""
        out: dict[str, Any] = {}
        for name, value in values.items():
            key = self.canonical(name, owner)
            try:
                out[key] = self.param(key).check(value)
            except ValueError as e:
                raise ValueError(f"{owner + ': ' if owner else ''}{e}") from None
        return out

    def preset(self, preset: str, dataset: str | None = None, owner: str = "") -> dict[str, Any]:
        """The overrides preset ``preset`` applies for ``dataset`` (validated)."""
        if preset not in self.presets:
            raise ValueError(f"{owner + ': ' if owner else ''}unknown preset {preset!r}; choose one of "
                             f"{', '.join(self.presets)}")
        return self.validate(self.presets[preset](dataset_key(dataset)), owner)

    def resolve(self, preset: str, dataset: str | None = None, overrides: Mapping[str, Any] | None = None,
                owner: str = "", *, checked: bool = False) -> dict[str, Any]:
        """Defaults, then the preset's values for ``dataset``, then ``overrides``: every parameter, validated
        (``checked``: ``overrides`` are :meth:`validate`'s output, e.g. a method's, checked when it was given, and
        are not checked again)."""
        out = self.defaults()
        out.update(self.preset(preset, dataset, owner))
        out.update(dict(overrides or {}) if checked else self.validate(overrides or {}, owner))
        return out


def dataset_key(dataset: str | None) -> str:
    """A dataset name as presets see it: ``"Fashion_MNIST:train"`` -> ``"fashion-mnist"`` (``''`` for none)."""
    if not dataset:
        return ""
    return str(dataset).split(":")[0].strip().lower().replace("_", "-")


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list | tuple) else value


def inferred_space(defaults: Mapping[str, Any], presets: Mapping[str, PresetFn]) -> ParamSpace:
    """A space for a method that only lists its defaults (a plugin or test method): names checked, values as given."""
    return ParamSpace(tuple(Param(name, default, "any", "(undeclared)", optional=True)
                            for name, default in defaults.items()), dict(presets))


#: The model's seed, every method's: every random draw of a fit (initial weights, batches, noise, label DP unless
#: ``label_dp_seed``) derives from it.  A keyword of the constructor and the command line's ``--seed`` (not a
#: ``--param``: :data:`~partialvfl.methods.run_options.RUN_OPTION_FLAGS`), read by this declaration in both:
#: :func:`check_seed` in Python, :func:`parse_seed` from text.
SEED = Param("seed", 0, "int", "the model's seed: every random draw of a fit derives from it", low=0)


def check_seed(value: Any, owner: str = "") -> int:
    """``value`` as :data:`SEED` holds it: an integer (numpy's too) >= 0; a float (even ``2.0``: never silently
    truncated), a bool or text refused in one line naming the parameter (and ``owner``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{owner + ': ' if owner else ''}parameter seed must be {SEED.describe()}, got {value!r}")
    try:
        return SEED.check(int(value))
    except ValueError as e:
        raise ValueError(f"{owner + ': ' if owner else ''}{e}") from None


def parse_seed(text: str) -> int:
    """``--seed``'s value, read from text by :data:`SEED`'s declared type (``"7"``; not ``"1.5"`` nor ``"-1"``)."""
    return SEED.check(text.strip() if isinstance(text, str) else text)


#: Parameters every method has, declared once here (the registry and the estimator add them to every space).
COMMON_PARAMS = (
    Param("standardize", True, "bool", "each party standardises its own features with statistics it fits on its "
          "training rows (kept at the party, applied at prediction); data already standardised by the paper's "
          "protocol passes through"),
)


def with_common(space: ParamSpace) -> ParamSpace:
    """``space`` with :data:`COMMON_PARAMS` (those it does not declare itself) added."""
    missing = [p for p in COMMON_PARAMS if p.name not in space.names]
    return space.extend(*missing) if missing else space


#: The privacy knobs every method takes as declared, typed parameters (``label_dp=1.0``, ``dp_predictions=1`` in
#: Python; a method without differential privacy refuses them at ``fit``); checked once, when given.  They describe
#: how the fit protects data, not what the model is: a model keeps them in ``model.json``'s ``privacy``, not in
#: ``params_``.
PRIVACY_PARAMS = ParamSpace((
    Param("label_dp", None, "float", "label DP: randomized response at this epsilon on every training label "
          "(null: no label DP; fit --label-dp)", low=0, open_low=True, optional=True),
    Param("label_dp_seed", None, "int", "the seed of label DP's randomization (null: derived from the seed)",
          optional=True),
    Param("label_dp_prior", False, "bool", "label DP with a prior (RRWithPrior, two stages); needs label_dp"),
    Param("label_dp_mechanism", None, "str", "label DP: the declared label mechanism to run (partialvfl "
          "mechanisms; null: randomized-response, or rr-with-prior with label_dp_prior=true); needs label_dp",
          optional=True),
    Param("dp_clip", 1.0, "float", "party DP: a factor on the method's clip norms of released values", low=0,
          open_low=True),
    Param("dp_grad_clip", 1.0, "float", "party DP: the per-row gradient clip of the parties' DP-SGD", low=0,
          open_low=True),
    Param("dp_predictions", 2, "int", "party DP: predictions per row to keep budget for after a fit", low=1),
))
