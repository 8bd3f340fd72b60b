"""Layer 4: methods behind one estimator contract, and their registry.

The package's face is lazy: ``import partialvfl.methods`` (and the torch-free ``registry``, ``params`` and
families' ``spec`` modules) does not import torch; the estimator classes are imported on first use.  Every
registered method's class is importable by its name (``from partialvfl.methods import FalseVFL1, LaserVFL``; a
plugin's too), as is ``get_method("false-vfl-1")``; :class:`VFLClassifier` and :class:`VFLRegressor` run a method as
a scikit-learn estimator on a table whose column groups are the parties.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "METHODS", "Combinatorial", "Ensemble", "FalseVFL1", "FalseVFL2", "FedHSSL", "LaserVFL", "Local", "NotFittedError",
    "PlugVFL", "VFLClassifier", "VFLMethod", "VFLRegressor", "VanillaVFL", "XVFL", "evaluate",
    "fit_best_of_pretraining", "get_method", "load_all", "method_names", "register_spec",
]

_WHERE = {
    "METHODS": "partialvfl.methods.registry", "get_method": "partialvfl.methods.registry",
    "load_all": "partialvfl.methods.registry", "method_names": "partialvfl.methods.registry",
    "register_spec": "partialvfl.methods.registry", "VFLMethod": "partialvfl.methods.base",
    "NotFittedError": "partialvfl.methods.base", "evaluate": "partialvfl.methods.evaluation",
    "fit_best_of_pretraining": "partialvfl.methods.splitnn.coordinator",
    "VFLClassifier": "partialvfl.methods.frame_estimators", "VFLRegressor": "partialvfl.methods.frame_estimators",
}


def method_classes() -> dict[str, str]:
    """Each registered method's class name -> its registry name (``{"FalseVFL1": "false-vfl-1", ...}``)."""
    from partialvfl.methods.registry import load_specs

    return {spec.implementation.rpartition(":")[2]: name for name, spec in load_specs().items()}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    classes = method_classes() if name[:1].isupper() else {}
    if name in classes:
        from partialvfl.methods.registry import get_method

        return get_method(classes[name])
    raise AttributeError(f"module 'partialvfl.methods' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *method_classes()})
