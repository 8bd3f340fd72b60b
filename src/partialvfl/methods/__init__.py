"""Layer 4: methods behind one estimator contract, and their registry.

The package's face is lazy: ``import partialvfl.methods`` (and the torch-free ``registry``, ``params`` and
families' ``spec`` modules) does not import torch; the estimator classes are imported on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "METHODS", "VFLMethod", "evaluate", "fit_best_of_pretraining", "get_method", "load_all", "method_names",
    "register_spec",
]

_WHERE = {
    "METHODS": "partialvfl.methods.registry", "get_method": "partialvfl.methods.registry",
    "load_all": "partialvfl.methods.registry", "method_names": "partialvfl.methods.registry",
    "register_spec": "partialvfl.methods.registry", "VFLMethod": "partialvfl.methods.base",
    "evaluate": "partialvfl.methods.evaluation", "fit_best_of_pretraining": "partialvfl.methods.splitnn.coordinator",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'partialvfl.methods' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)
