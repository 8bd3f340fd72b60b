"""Typed message metadata: what each metadata key of a message declaration holds, checked once on arrival.

A message declaration (:class:`~partialvfl.federation.wire.schema.MessageSpec`) names its request's metadata keys
with their types, the way a program's set-up config types its keys (:mod:`.setup_config`)::

    MessageSpec(..., meta={"data": HANDLE}, optional_meta={"train": FLAG, "samples": MetaKey(int, low=1)})

A key's type is ``int``, ``float`` (an integer is taken as a number; never ``nan`` or infinite), ``bool``, ``str``,
``tuple[int, ...]`` / ``tuple[str, ...]`` (a JSON list), ``dict`` (a JSON object, its keys read by the handler through
a declaration of its own), a nested :class:`~.setup_config.SetupConfig` (a JSON object with typed keys, handed to
the handler as that typed object), ``object`` (any JSON value: the type of a key a declaration names without one,
``meta=["data"]``), any of them ``| None``; ``low``/``high`` bound a number (inclusive) or every element of a list,
``choices`` names the admitted values.  Values are checked strictly, as JSON carries them: ``"32"`` is not an
integer and ``true`` is not ``1``.

The party runtime reads a request's metadata once, on arrival (:func:`~.schema.check_request`, called by
:meth:`~partialvfl.federation.runtime.party.PartyRuntime.handle`), and hands the handler the typed values (a number
key as a ``float``, a list as a list); a value that does not match is refused in one line naming the party, the
program, the kind and the key (:class:`~.schema.MessageError`).  The handlers then read typed values and never cast
a metadata value.  The wire is unchanged: the same JSON as before.

Torch-free.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from partialvfl.federation.wire.setup_config import SetupConfig, SetupConfigError, check_value, describe, split_optional

__all__ = ["ANY", "COUNT", "FLAG", "HANDLE", "OBJECT", "SEED", "MetaKey", "MetaValueError"]


class MetaValueError(ValueError):
    """A metadata value that its key's declaration does not admit (``detail``: what it must be, what it is)."""


@dataclass(frozen=True)
class MetaKey:
    """One metadata key's type (``int``, ``float``, ``bool``, ``str``, ``tuple[int, ...]``, ``tuple[str, ...]``,
    ``dict``, a nested set-up config, ``object``: any value; ``| None`` admits null), its inclusive bounds, its
    choices and a line of documentation."""

    type: Any = object
    low: float | None = None
    high: float | None = None
    choices: tuple[Any, ...] | None = None
    doc: str = ""
    _plain: Any = field(init=False, repr=False, compare=False, default=None)  # the type without ``| None``
    _optional: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        if self.choices is not None:
            object.__setattr__(self, "choices", tuple(self.choices))
        tp, optional = split_optional(self.type)
        object.__setattr__(self, "_plain", tp)
        object.__setattr__(self, "_optional", optional)
        if tp not in (object, dict, int, float, bool, str) and typing.get_origin(tp) is not tuple \
                and not (isinstance(tp, type) and issubclass(tp, SetupConfig)):
            raise TypeError(f"unsupported metadata type {self.type!r}")
        if self.choices is not None:  # every choice must itself be a value of the type
            plain = MetaKey(self.type, self.low, self.high)
            for c in self.choices:
                plain.read(c, "choice")

    @property
    def typed(self) -> bool:
        """Whether the key declares a type (``object``: any value, the type of a key named without one)."""
        return self._plain is not object

    def _bounds(self) -> dict[str, Any]:
        return {"low": self.low, "high": self.high, "choices": self.choices}

    def describe(self) -> str:
        """The values the key accepts, in words (for errors and docs/messages.md)."""
        tp, optional = self._plain, self._optional
        if tp is object:
            what = "any value"
        elif tp is dict:
            what = "an object"
        else:
            return describe(self.type, self._bounds())
        return what + (" or null" if optional and tp is not object else "")

    def read(self, value: Any, key: str) -> Any:
        """``value`` as the handler gets it: checked against the type and range (a number as a ``float``, a list as
        a list, a nested config as its typed object); :class:`MetaValueError` naming ``key`` otherwise."""
        tp = self._plain
        if tp is object or (value is None and self._optional):
            return value
        if self._admits(value):  # every message passes here: the common cases without building an error
            return float(value) if tp is float else value
        if tp is dict:
            if isinstance(value, Mapping):
                return dict(value)
            raise MetaValueError(f"meta key {key!r} must be {self.describe()}, got {value!r}")
        try:
            out = check_value(self.type, self._bounds(), value, key)
        except SetupConfigError as e:  # a nested key's detail names its dotted path
            raise MetaValueError(f"meta {e.detail}" if e.detail.startswith("key ")
                                 else f"meta key {key!r} {e.detail}") from None
        return list(out) if isinstance(out, tuple) else out

    def _admits(self, value: Any) -> bool:
        """Whether a scalar ``value`` is admitted as it is (``False``: take the full check, which says why)."""
        tp, kind = self._plain, type(value)
        if tp is bool:
            ok = kind is bool
        elif tp is str:
            ok = kind is str
        elif tp is int:
            ok = kind is int and (self.low is None or value >= self.low) and (self.high is None or value <= self.high)
        elif tp is float:
            ok = (kind is float or kind is int) and math.isfinite(value) \
                and (self.low is None or value >= self.low) and (self.high is None or value <= self.high)
        else:
            return False
        return ok and (self.choices is None or value in self.choices)


#: a flag (``train``, ``predict``, ``fit``...)
FLAG = MetaKey(bool)
#: a count of rows, samples... (an integer >= 0)
COUNT = MetaKey(int, low=0)
#: a seed the party draws from (an integer >= 0)
SEED = MetaKey(int, low=0, doc="a seed")
#: the handle of a data set attached at the party
HANDLE = MetaKey(str, doc="a data set attached at the party")
#: a JSON object its handler reads through a declaration of its own
OBJECT = MetaKey(dict)
#: any JSON value (a key declared without a type)
ANY = MetaKey(object)
