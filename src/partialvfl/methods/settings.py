"""Typed parameters: a method's resolved parameters as one frozen object, read as attributes.

:func:`settings_class` generates, from a method's :class:`~partialvfl.methods.params.ParamSpace`, a frozen
dataclass with one field per parameter, typed by its kind: ``int``, ``float``, ``bool``, ``str`` (a ``Literal`` of
the choices where there are some), ``ints`` -> ``tuple[int, ...]``, ``range`` -> ``tuple[float, float]``, ``any``
-> ``Any`` (taken as given), optional ones ``| None``.  Each declared group (``ParamSpace.groups``) is a read-only
attribute holding a typed sub-object (e.g. an optimiser's ``name``, ``lr``, ``weight_decay``, ``momentum``).

Values are checked and converted once, when the object is built (:meth:`Settings._of`), so methods read
``settings.lr`` (already a float) and never re-cast.  :meth:`Settings._asdict` gives back the plain JSON-able dict
(lists, not tuples) that model files, reports and checkpoints keep as ``model.params_``; :meth:`Settings._pick` the
part of it that a party's setup config carries.  Reading a name that is not a parameter raises an
``AttributeError`` naming the method and the name.  (Underscored method names, as ``namedtuple``'s, cannot clash
with a parameter's.)

Torch-free, like :mod:`partialvfl.methods.params`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import keyword
from collections.abc import Collection, Mapping
from typing import Any, ClassVar, Literal, Self

from partialvfl.methods.params import Param, ParamSpace

__all__ = ["Group", "ParamsDict", "Settings", "TypedParams", "field_type", "settings_class"]

_TYPES: dict[str, Any] = {"int": int, "float": float, "bool": bool, "str": str, "ints": tuple[int, ...],
                          "range": tuple[float, float], "any": Any}


def field_type(param: Param) -> Any:
    """The attribute type of ``param``: by kind, a ``Literal`` of its choices, ``| None`` when optional."""
    kind = Literal[tuple(param.choices)] if param.choices is not None else _TYPES[param.kind]
    return kind | None if param.optional and param.kind != "any" else kind


def _frozen(kind: str, value: Any) -> Any:
    """A checked value as the typed object holds it (lists of the list kinds become tuples)."""
    return tuple(value) if kind in ("ints", "range") and value is not None else value


def _plain(kind: str, value: Any) -> Any:
    """A held value as ``params_`` and the wire carry it (JSON-able: tuples of the list kinds become lists)."""
    if kind in ("ints", "range") and value is not None:
        return list(value)
    return list(value) if isinstance(value, list) else value  # ``any``: as given (a list copied)


class Group:
    """Base of the typed sub-objects of a method's settings (one per declared group)."""

    __slots__ = ()
    _kinds: ClassVar[Mapping[str, str]] = {}

    def _asdict(self) -> dict[str, Any]:
        """The fields as a plain JSON-able dict, in declaration order."""
        return {f: _plain(k, getattr(self, f)) for f, k in self._kinds.items()}


class Settings:
    """Base of every generated parameters class (see :func:`settings_class`)."""

    __slots__ = ()
    _owner: ClassVar[str] = ""
    _space: ClassVar[ParamSpace]
    _attrs: ClassVar[Mapping[str, str]] = {}  # parameter name -> attribute name

    @classmethod
    def _of(cls, values: Mapping[str, Any], trusted: Collection[str] = ()) -> Self:
        """The object for ``values``: every parameter (current names or aliases), each checked and converted; a
        missing, unknown or invalid one is refused with its name (``ValueError``).  ``trusted``: current names whose
        values were checked already (where they entered) and are taken as they are."""
        fresh = cls._space.validate({k: v for k, v in values.items() if k not in trusted}, owner=cls._owner)
        checked = {**{k: v for k, v in values.items() if k in trusted}, **fresh}
        missing = [n for n in cls._attrs if n not in checked]
        if missing:
            raise ValueError(f"{cls._owner}: missing parameter(s) {', '.join(missing)}")
        kinds = {p.name: p.kind for p in cls._space.params}
        return cls(**{cls._attrs[n]: _frozen(kinds[n], checked[n]) for n in cls._attrs})

    def _asdict(self) -> dict[str, Any]:
        """Every parameter under its name, as a plain JSON-able dict (what ``model.params_`` holds)."""
        return {p.name: _plain(p.kind, getattr(self, self._attrs[p.name])) for p in self._space.params}

    def _pick(self, *names: str) -> dict[str, Any]:
        """The JSON-able values of the parameters ``names``, in that order (e.g. for a party's setup config)."""
        kinds = {p.name: p.kind for p in self._space.params}
        return {n: _plain(kinds[n], getattr(self, self._attrs[n])) for n in names}

    def _replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` (parameter names), checked as when built."""
        return self._of({**self._asdict(), **changes})

    def __getattr__(self, name: str) -> Any:  # reached only for names that are no attribute
        if name.startswith("__"):
            raise AttributeError(name)
        known = list(self._attrs.values())
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise AttributeError(f"{self._owner}: no parameter {name!r}{hint} (its parameters: {', '.join(known)})")


def _attribute(param: str, owner: str) -> str:
    """The attribute name of parameter ``param`` (a keyword gets a trailing underscore, as PEP 8 does)."""
    name = param + "_" if keyword.iskeyword(param) else param
    if not name.isidentifier() or name in dir(Settings):
        raise ValueError(f"{owner}: parameter {param!r} cannot be read as an attribute; rename it")
    return name


def _group_class(space: ParamSpace, group: str, members: Mapping[str, str], cls_name: str) -> type[Group]:
    params = {p.name: p for p in space.params}
    made = dataclasses.make_dataclass(
        f"{cls_name}_{group}", [(f, field_type(params[n])) for f, n in members.items()], bases=(Group,),
        frozen=True, namespace={"_kinds": {f: params[n].kind for f, n in members.items()}})
    return made


def _group_property(group_cls: type[Group], members: Mapping[str, str], attrs: Mapping[str, str]) -> property:
    def get(self: Settings) -> Group:
        return group_cls(**{f: getattr(self, attrs[n]) for f, n in members.items()})

    return property(get, doc=f"{', '.join(members.values())} as one object")


def settings_class(space: ParamSpace, owner: str, name: str = "Settings", module: str | None = None
                   ) -> type[Settings]:
    """The frozen, typed class of ``space``'s resolved parameters (``owner``, e.g. the method's registry name,
    prefixes its errors); build an object with ``cls._of(resolved_dict)``."""
    attrs = {p.name: _attribute(p.name, owner) for p in space.params}
    namespace: dict[str, Any] = {"_owner": owner, "_space": space, "_attrs": attrs}
    for group, members in space.groups.items():
        group_cls = _group_class(space, group, members, name)
        namespace[group] = _group_property(group_cls, members, attrs)
    made = dataclasses.make_dataclass(name, [(attrs[p.name], field_type(p)) for p in space.params],
                                      bases=(Settings,), frozen=True, namespace=namespace)
    if module is not None:
        made.__module__ = module
    return made


class ParamsDict(dict):
    """A read-only ``dict`` (the plain view ``model.params_`` of the typed settings): it reads, compares and
    serialises (JSON) as a dict; changing it in place is refused, since it would not reach the typed settings
    (assign a whole new dict instead).  ``copy``, ``deepcopy`` and ``pickle`` keep it read-only; ``dict(d)`` is an
    ordinary dict."""

    __slots__ = ("_owner",)

    def __init__(self, values: Mapping[str, Any], owner: str = "") -> None:
        super().__init__(values)
        self._owner = owner

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"{self._owner + ': ' if self._owner else ''}params_ is read-only (the plain view of the "
                        "typed parameters, settings_); to change a fitted parameter assign a whole dict: "
                        "model.params_ = {**model.params_, 'name': value}")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _refuse  # type: ignore

    def __reduce__(self) -> tuple[Any, ...]:
        return ParamsDict, (dict(self), self._owner)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return self.__reduce__()

    def __copy__(self) -> ParamsDict:
        return ParamsDict(self, self._owner)

    def __deepcopy__(self, memo: dict[int, Any]) -> ParamsDict:
        return ParamsDict(copy.deepcopy(dict(self), memo), self._owner)


class TypedParams:
    """The estimators' side of typed parameters (a base of :class:`~partialvfl.methods.base.VFLMethod`):
    ``params_`` (the plain, read-only dict) and ``settings_`` (the typed object), always set together.

    Needs ``name`` and ``param_space()`` from the class it is mixed into.
    """

    name: ClassVar[str]
    _settings_type: ClassVar[type[Settings]]
    #: the resolved parameters, typed and frozen, read as attributes (set with ``params_`` by fit and load)
    settings_: Any

    @classmethod
    def settings_class(cls) -> type[Settings]:
        """The frozen, typed class of this method's resolved parameters, generated once from ``param_space()``."""
        if "_settings_type" not in cls.__dict__:
            cls._settings_type = settings_class(cls.param_space(), cls.name or cls.__name__,
                                                f"{cls.__name__}Settings", cls.__module__)
        return cls.__dict__["_settings_type"]

    @classmethod
    def settings_of(cls, values: Mapping[str, Any]) -> Settings:
        """The typed parameters of ``values`` (any parameters; the others take their defaults)."""
        return cls.settings_class()._of({**cls.param_space().defaults(), **values})

    @property
    def params_(self) -> dict[str, Any]:
        """The fitted model's parameters as a plain, read-only dict (what ``model.json``, reports and checkpoints
        keep); ``settings_`` holds the same values typed.  Assigning a dict (every parameter) sets both."""
        try:
            return self.__dict__["_params_view"]
        except KeyError:
            raise AttributeError(f"{self.name}: params_ is set by fit (or load)") from None

    @params_.setter
    def params_(self, values: Mapping[str, Any]) -> None:
        held = self.__dict__.get("_params_view", {})  # values already held were checked when they entered
        self._set_params(values, trusted=[k for k, v in values.items() if k in held and held[k] == v])

    def _set_params(self, values: Mapping[str, Any], undeclared: Mapping[str, Any] | None = None,
                    trusted: Collection[str] = ()) -> None:
        """Set ``settings_`` and ``params_`` from ``values``; ``undeclared``: values a model file holds for names
        no longer declared, kept in ``params_`` only; ``trusted``: names whose values were checked already."""
        self.settings_ = self.settings_class()._of(values, trusted)
        self._params_view = ParamsDict({**self.settings_._asdict(), **(undeclared or {})}, owner=self.name)
