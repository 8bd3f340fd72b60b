"""Layer 4: methods behind one estimator contract, and their registry."""

from partialvfl.methods.base import METHODS, VFLMethod, get_method, method_names, register_method
from partialvfl.methods.evaluation import evaluate

__all__ = ["METHODS", "VFLMethod", "evaluate", "get_method", "method_names", "register_method"]
