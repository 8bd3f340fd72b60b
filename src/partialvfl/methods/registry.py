"""The method registry: names -> declarations (torch-free) -> implementations (imported on first use).

A method is declared once, by a :class:`MethodSpec` that its family folder's ``spec`` module registers
(``methods/<family>/spec.py``, e.g. ``methods/false_vfl/spec.py``; a module whose name ends in ``_spec`` also
counts): its registry name, summary, display names, declared parameters and presets, the facts reports and schedules
need about it, and the ``module:Class`` that implements it.  :func:`load_specs` finds every such module of this
package, then imports the modules of the ``partialvfl.methods`` entry point group (a plugin family installed as a
package, see docs/baselines.md "Adding a method"), so listing methods, checking parameters and validating grids
never imports torch; :func:`get_method` imports the implementation of the one method asked for and checks that its
class carries the declared name.  A module imported by other means (a grid's ``imports``, a party's ``plugins``, a
test) registers its families the same way, with :func:`register_spec`.  :func:`load_all` imports every
implementation, which also registers every party program (what a party server needs before it serves).
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partialvfl.methods.params import ParamSpace, with_common
from partialvfl.utils.plugins import import_entry_points

#: a method class (a :class:`~partialvfl.methods.base.VFLMethod` subclass; not imported here, which would be a cycle)
VFLMethod = Any

__all__ = ["DEFAULT_METHOD", "ENTRY_POINT_GROUP", "METHODS", "SPECS", "MethodSpec", "get_method", "get_spec",
           "load_all", "load_specs", "method_names", "package_methods", "private_methods", "register_spec",
           "unregister"]

#: the entry point group a plugin package lists its families' ``spec`` modules under (``pyproject.toml``:
#: ``[project.entry-points."partialvfl.methods"] toy = "toy_family.spec"``)
ENTRY_POINT_GROUP = "partialvfl.methods"

#: the method ``partialvfl fit`` runs without ``--method`` and the scikit-learn estimators run by default: a promise to
#: users (README), so a constant here, not a flag a method's declaration (or a plugin's) could take over
DEFAULT_METHOD = "false-vfl-1"

#: where a method without a declared ``report_order`` sorts in reports: after the baselines, before FALSE-VFL
UNORDERED = 85.0


@dataclass(frozen=True)
class MethodSpec:
    """What a method is, without importing it: name, summary, parameters, where its class lives, and the facts that
    reports, schedules and error messages need about it.

    ``title``: the name reports show (default: ``paper_name``, else ``name``); ``paper_name``: the name the FALSE-VFL
    paper's tables print for it (``None``: not in them); ``report_order``: its row in report tables (the paper's
    order: baselines, then FALSE-VFL); ``aligned_only``: its supervised stage trains on the rows every party observes
    only (not every labelled row); ``unset_batch_size``: the batch size a schedule assumes when ``batch_size`` is
    null (the method derives one at fit time); ``private``: it runs with label DP and at parties that keep a
    differential-privacy budget (its family holds the private variant); ``proposed``: a method this project
    proposes (FALSE-VFL), the side reports compare with the rest; ``docs``: the page that documents it.
    """

    name: str
    summary: str
    implementation: str  # "package.module:ClassName"
    params: ParamSpace
    title: str = ""
    paper_name: str | None = None
    report_order: float = UNORDERED
    aligned_only: bool = False
    unset_batch_size: int = 64
    private: bool = False
    proposed: bool = False
    docs: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", with_common(self.params))  # every method's common parameters
        object.__setattr__(self, "title", self.title or self.paper_name or self.name)
        if ":" not in self.implementation:
            raise ValueError(f"method {self.name!r}: implementation must be 'package.module:ClassName', got "
                             f"{self.implementation!r}")


SPECS: dict[str, MethodSpec] = {}
#: the implementations imported so far (a cache of :func:`get_method`; :data:`SPECS` is the registry)
METHODS: dict[str, type[VFLMethod]] = {}
_LOADED = False


def register_spec(spec: MethodSpec) -> MethodSpec:
    """Declare a method (from its family's ``spec`` module)."""
    if spec.name in SPECS and SPECS[spec.name] != spec:
        raise ValueError(f"method {spec.name!r} declared twice")
    SPECS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Forget method ``name``: its declaration and its imported class (a test's or a notebook's toy method)."""
    SPECS.pop(name, None)
    METHODS.pop(name, None)


def _modules() -> list[str]:
    # the package's folder, not ``import partialvfl.methods``: no import cycle with the package's face
    return [info.name for info in pkgutil.walk_packages([str(Path(__file__).parent)], prefix=f"{__package__}.")]


def load_specs(*, plugins: bool = False) -> dict[str, MethodSpec]:
    """Import every ``spec``/``*_spec`` module of the methods package and every module of the ``partialvfl.methods``
    entry point group (torch-free), once, and return the declarations.

    ``plugins``: look for entry points again (a plugin installed, or put on ``sys.path``, since the first call).
    """
    global _LOADED
    if not _LOADED:
        for name in _modules():
            last = name.rsplit(".", 1)[-1]
            if last == "spec" or last.endswith("_spec"):
                importlib.import_module(name)
    if plugins or not _LOADED:
        import_entry_points(ENTRY_POINT_GROUP, "method")
        _LOADED = True
    return SPECS


def load_all(*, skip_broken: bool = False) -> list[str]:
    """Import every method's implementation, which registers its party program (what ``party serve`` needs before a
    party serves).

    ``skip_broken``: log an implementation that fails to import and go on (a party keeps serving the other methods)
    instead of raising; returns the names of the methods that failed.
    """
    failed = []
    for spec in list(load_specs().values()):
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
    if spec.name in METHODS:
        return METHODS[spec.name]
    module, _, attr = spec.implementation.partition(":")
    cls: Any = getattr(importlib.import_module(module), attr)
    if getattr(cls, "name", None) != spec.name:
        raise ValueError(f"{spec.implementation} implements {getattr(cls, 'name', None)!r}, not {spec.name!r}")
    METHODS[spec.name] = cls
    return cls


def method_names() -> list[str]:
    """Every registered method's name (plugins and test methods included), sorted."""
    return sorted(load_specs())


def package_methods() -> list[str]:
    """The methods this package ships (its docs and tables list these; plugins and test toys are left out)."""
    return sorted(n for n, s in load_specs().items() if s.implementation.startswith(f"{__package__}."))


def get_spec(name: str) -> MethodSpec | None:
    """The declaration of ``name`` (``None`` for a name nothing declares)."""
    return load_specs().get(name)


def get_method(name: str) -> type[VFLMethod]:
    """The class of method ``name`` (its implementation is imported now)."""
    spec = get_spec(name)
    if spec is None:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(method_names())}")
    return _implementation(spec)


def private_methods() -> list[str]:
    """The methods that run with differential privacy (label DP, parties' budgets), in report order."""
    return [s.name for s in sorted(load_specs().values(), key=lambda s: (s.report_order, s.name)) if s.private]
