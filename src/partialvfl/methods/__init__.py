"""Layer 4: methods behind one estimator contract, and their registry."""

from partialvfl.methods._splitnn import fit_best_of_pretraining
from partialvfl.methods.base import METHODS, VFLMethod, get_method, load_all, method_names, register_method
from partialvfl.methods.evaluation import evaluate

__all__ = [
    "METHODS", "VFLMethod", "evaluate", "fit_best_of_pretraining", "get_method", "load_all", "method_names",
    "register_method",
]
