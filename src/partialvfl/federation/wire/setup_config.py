"""Typed set-up configs: what a party program accepts in its ``setup`` request, declared beside its messages.

A party program declares its set-up config as a frozen dataclass (a subclass of :class:`SetupConfig`), one typed
field per key, with its range, its choices and, for an optional key, its default::

    @dataclass(frozen=True, kw_only=True)
    class SplitSetup(SetupConfig):
        feature_shape: tuple[int, ...] = setting(low=1, doc="the party's feature shape")
        latent_dim: int = setting(low=1)
        encoder: str = setting("auto", choices=("auto", "mlp", "cnn", "resnet18"))
        optimizer: OptimiserSetup = setting()

    class SplitParty(PartyProgram):
        setup_config = SplitSetup

(``kw_only``: required and optional keys in any order.)  Field types: ``int``, ``float`` (an integer is taken as
a number; never ``nan`` or infinite), ``bool``, ``str``, ``tuple[int, ...]``, ``tuple[str, ...]``,
``tuple[float, float]`` (a pair; ``increasing=True``: low < high), a nested :class:`SetupConfig` (a JSON object),
any of them ``| None``.  ``low``/``high`` bound a number or every element of a list (inclusive).  Values are checked
strictly, as JSON carries them: ``"3"`` is not an integer and ``1`` is not ``true``.

The party reads the config once, on arrival at set-up (:meth:`SetupConfig.read`, called by
:meth:`~partialvfl.federation.runtime.party.PartyRuntime.handle` through
:meth:`~partialvfl.federation.wire.program.PartyProgram.read_config`): an unknown or missing key, a value of the
wrong type or out of its range is refused with one line naming the program, the key and the value
(:class:`SetupConfigError`).  The program, its policy description (``describe_setup``) and its privacy refusal then
read typed attributes, never casting a config value.  A coordinator builds the same object (constructing one checks
every field) and sends :meth:`SetupConfig.to_wire`, the JSON-able dict the ``setup`` message carries.

Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from partialvfl.nn.optim import OPTIMIZERS

__all__ = ["FeatureSetup", "OptimiserSetup", "SetupConfig", "SetupConfigError", "check_value", "describe", "setting",
           "setup_config_markdown", "split_optional", "wire_config"]

_NO_DEFAULT: Any = dataclasses.MISSING


class SetupConfigError(ValueError):
    """A set-up config that does not match its program's declaration: ``key`` (a dotted path) and ``value``."""

    def __init__(self, where: str, key: str, detail: str, value: Any = None) -> None:
        super().__init__(f"{where + ': ' if where else ''}setup config {detail}")
        self.where, self.key, self.value, self.detail = where, key, value, detail


def setting(default: Any = _NO_DEFAULT, *, low: float | None = None, high: float | None = None,
            choices: tuple[Any, ...] | None = None, increasing: bool = False, doc: str = "") -> Any:
    """A declared key of a set-up config: its default (none: the key is required), bounds (``low``/``high``,
    inclusive, on a number or every element of a list), ``choices``, ``increasing`` (a pair: low < high) and a
    line of documentation."""
    meta = {"low": low, "high": high, "choices": None if choices is None else tuple(choices),
            "increasing": increasing, "doc": doc}
    return dataclasses.field(default=default, metadata=meta)


def _typename(tp: Any) -> str:
    return {int: "integer", float: "number", bool: "true | false", str: "text"}.get(tp, getattr(tp, "__name__", "?"))


def _bounds(meta: Mapping[str, Any]) -> str:
    low, high = meta.get("low"), meta.get("high")
    if low is not None and high is not None:
        return f" in [{low:g}, {high:g}]"
    if low is not None:
        return f" >= {low:g}"
    return f" <= {high:g}" if high is not None else ""


def split_optional(tp: Any) -> tuple[Any, bool]:
    """``(type, whether None is admitted)`` of a field type ``X | None``."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"a set-up config field may be one type or that type | None, not {tp}")
        return args[0], True
    return tp, False


def describe(tp: Any, meta: Mapping[str, Any]) -> str:
    """The values a field of type ``tp`` accepts, in words (for errors and docs)."""
    tp, optional = split_optional(tp)
    choices = meta.get("choices")
    if choices is not None:
        what = "one of " + ", ".join(repr(c) for c in choices)
    elif isinstance(tp, type) and issubclass(tp, SetupConfig):
        what = "an object with keys " + ", ".join(f.name for f in dataclasses.fields(tp))
    elif typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            what = f"a list of {_typename(args[0])}s{_bounds(meta)}"
        else:
            what = f"a list of {len(args)} {_typename(args[0])}s{_bounds(meta)}"
            what += " (increasing)" if meta.get("increasing") else ""
    else:
        what = {int: "an integer", float: "a number", bool: "true or false", str: "text"}[tp] + _bounds(meta)
    return what + (" or null" if optional else "")


def _scalar(tp: Any, value: Any) -> Any:
    """``value`` as a ``tp`` holds it, or ``TypeError``."""
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"unsupported set-up config field type {tp!r}")
    raise TypeError


def _in_bounds(value: Any, meta: Mapping[str, Any]) -> bool:
    low, high = meta.get("low"), meta.get("high")
    return (low is None or value >= low) and (high is None or value <= high)


def _held(declared: Any, meta: Mapping[str, Any], value: Any, key: str) -> Any:
    """``value`` checked against the field's type and range, as the typed object holds it."""
    tp, optional = split_optional(declared)
    if value is None and optional:
        return None
    if isinstance(tp, type) and issubclass(tp, SetupConfig):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise SetupConfigError("", key, f"key {key!r} must be {describe(tp, meta)}, got {value!r}", value)
        return tp._read(value, prefix=f"{key}.")
    bad = SetupConfigError("", key, f"key {key!r} must be {describe(declared, meta)}, got {value!r}", value)
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if isinstance(value, str | bytes | Mapping) or not isinstance(value, list | tuple):
            raise bad
        element = args[0]
        if not (len(args) == 2 and args[1] is Ellipsis) and len(value) != len(args):
            raise bad
        try:
            out = tuple(_scalar(element, v) for v in value)
        except TypeError:
            raise bad from None
        if element in (int, float) and not all(_in_bounds(v, meta) for v in out):
            raise bad
        if meta.get("increasing") and any(a >= b for a, b in zip(out, out[1:])):
            raise bad
    else:
        try:
            out = _scalar(tp, value)
        except TypeError:
            raise bad from None
        if tp in (int, float) and not _in_bounds(out, meta):
            raise bad
    if meta.get("choices") is not None and out not in meta["choices"]:
        raise bad
    return out


def check_value(declared: Any, meta: Mapping[str, Any], value: Any, key: str) -> Any:
    """``value`` checked against a declared type and its ``low``/``high``/``choices`` (``meta``), as the typed
    object holds it (lists as tuples, a nested config as its object); :class:`SetupConfigError` naming ``key``
    otherwise.  The one check of set-up config keys and of typed message metadata (:mod:`.meta_keys`)."""
    return _held(declared, meta, value, key)


@dataclass(frozen=True)
class SetupConfig:
    """Base of a party program's declared set-up config: a frozen dataclass whose fields are its keys.

    Constructing one checks and normalises every field (lists become tuples), so a coordinator that builds its
    config as this object sends values the party accepts; :meth:`read` is the party's side (unknown and missing
    keys refused too); :meth:`to_wire` the JSON-able dict the ``setup`` message carries.
    """

    _hints: ClassVar[dict[str, Any]] = {}

    def __post_init__(self) -> None:
        hints = type(self)._field_types()
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _held(hints[f.name], f.metadata, getattr(self, f.name), f.name))

    @classmethod
    def _field_types(cls) -> dict[str, Any]:
        if "_hints" not in cls.__dict__:
            cls._hints = typing.get_type_hints(cls)
        return cls._hints

    @classmethod
    def _read(cls, values: Mapping[str, Any], prefix: str = "") -> Self:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in values if k not in fields)
        if unknown:
            raise SetupConfigError("", prefix + unknown[0], f"has unknown key {prefix + unknown[0]!r}; the program "
                                   f"reads {', '.join(prefix + n for n in fields)}", values[unknown[0]])
        missing = [n for n, f in fields.items() if n not in values
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise SetupConfigError("", prefix + missing[0], f"lacks key {prefix + missing[0]!r} "
                                   f"({describe(cls._field_types()[missing[0]], fields[missing[0]].metadata)})")
        hints = cls._field_types()
        held = {n: _held(hints[n], fields[n].metadata, v, prefix + n) for n, v in values.items()}
        return cls(**held)

    @classmethod
    def read(cls, values: Mapping[str, Any], where: str = "") -> Self:
        """The typed config of ``values`` (a ``setup`` request's ``config``); :class:`SetupConfigError` naming
        ``where`` (the party and the program), the key and the value for anything that does not match."""
        if isinstance(values, cls):
            return values
        if not isinstance(values, Mapping):
            raise SetupConfigError(where, "", f"must be an object, got {type(values).__name__}", values)
        try:
            return cls._read(values)
        except SetupConfigError as e:
            raise SetupConfigError(where, e.key, e.detail, e.value) from None

    def to_wire(self) -> dict[str, Any]:
        """Every key as the ``setup`` message carries it (JSON-able: tuples become lists, nested configs objects)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _plain(value: Any) -> Any:
    if isinstance(value, SetupConfig):
        return value.to_wire()
    return list(value) if isinstance(value, tuple) else value


def wire_config(config: SetupConfig | Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as the ``setup`` message carries it (a typed config's :meth:`~SetupConfig.to_wire`, a plain
    mapping, of a program without a declaration, copied)."""
    return config.to_wire() if isinstance(config, SetupConfig) else dict(config)


@dataclass(frozen=True, kw_only=True)
class FeatureSetup(SetupConfig):
    """The keys every package program's config starts with: the party's feature shape (which its own table must
    have: the policy checks it) and count (their product; derived when left out)."""

    feature_shape: tuple[int, ...] = setting(low=1, doc="the party's feature shape (its table's)")
    feature_dim: int = setting(None, low=1, doc="the party's feature count (the product of feature_shape; derived "
                               "when left out)")

    def __post_init__(self) -> None:
        if self.feature_dim is None and isinstance(self.feature_shape, list | tuple):
            object.__setattr__(self, "feature_dim", math.prod(self.feature_shape))
        super().__post_init__()
        if self.feature_dim != math.prod(self.feature_shape):
            raise SetupConfigError("", "feature_dim", f"key 'feature_dim' is {self.feature_dim}, but feature_shape "
                                   f"{list(self.feature_shape)} has {math.prod(self.feature_shape)} features",
                                   self.feature_dim)


@dataclass(frozen=True, kw_only=True)
class OptimiserSetup(SetupConfig):
    """An optimiser a party builds (:func:`~partialvfl.nn.optim.make_optimizer`'s arguments)."""

    name: str = setting("adam", choices=OPTIMIZERS, doc="adam or sgd")
    lr: float = setting(low=0, doc="learning rate (the party's policy holds it within its min_lr/max_lr)")
    weight_decay: float = setting(0.0, low=0, doc="weight decay")
    momentum: float = setting(0.0, low=0, high=1, doc="SGD momentum (Adam ignores it)")


def setup_config_markdown(cls: type[SetupConfig], prefix: str = "") -> list[str]:
    """The rows of a table of ``cls``'s keys (nested configs flattened to dotted keys), for docs/messages.md."""
    rows = []
    hints = cls._field_types()
    for f in dataclasses.fields(cls):
        tp = split_optional(hints[f.name])[0]
        nested = isinstance(tp, type) and issubclass(tp, SetupConfig)
        default = ("required" if f.default is dataclasses.MISSING else "optional" if f.default is None
                   else f"default `{json.dumps(_plain(f.default))}`")
        what = "an object" if nested else describe(hints[f.name], f.metadata)
        rows.append(f"| `{prefix}{f.name}` | {what} | {default} | {f.metadata.get('doc', '')} |")
        if nested:
            rows += setup_config_markdown(tp, prefix=f"{prefix}{f.name}.")
    return rows
