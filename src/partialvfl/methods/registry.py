"""The method registry: names -> declarations (torch-free) -> implementations (imported on first use).

Each method declares a :class:`MethodSpec` in a torch-free module whose name is ``spec`` or ends in ``_spec``
(e.g. ``methods/false_vfl_spec.py``): its registry name, one-line summary, declared parameters and presets, and the
``module:Class`` that implements it.  :func:`load_specs` finds every such module, so listing methods, checking
parameters and validating grids never imports torch; :func:`get_method` imports the implementation of the one
method asked for.  A method defined elsewhere (a plugin, a test) can also register its class directly
(:func:`register_method`).  :func:`load_all` imports every implementation, which also registers every party program
(what a party server needs before it serves).
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partialvfl.methods.params import ParamSpace, with_common

#: a method class (a :class:`~partialvfl.methods.base.VFLMethod` subclass; not imported here, which would be a cycle)
VFLMethod = Any

__all__ = ["METHODS", "SPECS", "MethodSpec", "get_method", "get_spec", "load_all", "load_specs", "method_names",
           "register_method", "register_spec"]


@dataclass(frozen=True)
class MethodSpec:
    """What a method is, without importing it: name, summary, parameters, and where its class lives."""

    name: str
    summary: str
    implementation: str  # "package.module:ClassName"
    params: ParamSpace

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", with_common(self.params))  # every method's common parameters


SPECS: dict[str, MethodSpec] = {}
METHODS: dict[str, type[VFLMethod]] = {}
_LOADED = False


def register_spec(spec: MethodSpec) -> MethodSpec:
    """Declare a method (from its ``*_spec`` module)."""
    if spec.name in SPECS and SPECS[spec.name] != spec:
        raise ValueError(f"method {spec.name!r} declared twice")
    SPECS[spec.name] = spec
    return spec


def register_method(cls: type[VFLMethod]) -> type[VFLMethod]:
    """Class decorator: make a method class available by name (CLI ``--method NAME``, bench grids)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no registry name")
    if cls.name in METHODS and METHODS[cls.name] is not cls:
        raise ValueError(f"method {cls.name!r} registered twice")
    METHODS[cls.name] = cls
    return cls


def _modules() -> list[str]:
    # the package's folder, not ``import partialvfl.methods``: no import cycle with the package's face
    return [info.name for info in pkgutil.walk_packages([str(Path(__file__).parent)], prefix=f"{__package__}.")]


def load_specs() -> dict[str, MethodSpec]:
    """Import every ``spec``/``*_spec`` module of the methods package (torch-free) and return the declarations."""
    global _LOADED
    if not _LOADED:
        for name in _modules():
            last = name.rsplit(".", 1)[-1]
            if last == "spec" or last.endswith("_spec"):
                importlib.import_module(name)
        _LOADED = True
    return SPECS


def load_all(*, skip_broken: bool = False) -> list[str]:
    """Import every method's implementation, which registers its class and its party program (what ``party
    serve`` needs before a party serves).

    ``skip_broken``: log an implementation that fails to import and go on (a party keeps serving the other methods)
    instead of raising; returns the names of the methods that failed.
    """
    failed = []
    for spec in load_specs().values():
        try:
            _implementation(spec)
        except Exception as e:
            if not skip_broken:
                raise
            logging.getLogger(__package__).warning("could not import method %s (%s): %s", spec.name,
                                                   spec.implementation, e)
            failed.append(spec.name)
    return failed


def _implementation(spec: MethodSpec) -> type[VFLMethod]:
    module, _, attr = spec.implementation.partition(":")
    cls: Any = getattr(importlib.import_module(module), attr)
    if getattr(cls, "name", None) != spec.name:
        raise ValueError(f"{spec.implementation} implements {getattr(cls, 'name', None)!r}, not {spec.name!r}")
    METHODS.setdefault(spec.name, cls)
    return cls


def method_names() -> list[str]:
    return sorted(set(load_specs()) | set(METHODS))


def get_spec(name: str) -> MethodSpec | None:
    """The declaration of ``name`` (``None`` for a method registered only as a class)."""
    return load_specs().get(name)


def get_method(name: str) -> type[VFLMethod]:
    """The class of method ``name`` (its implementation is imported now)."""
    spec = get_spec(name)
    if spec is not None:
        return _implementation(spec)
    if name in METHODS:
        return METHODS[name]
    raise ValueError(f"unknown method {name!r}; available: {', '.join(method_names())}")
