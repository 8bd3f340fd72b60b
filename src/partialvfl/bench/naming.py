"""How reports name and order things: mechanisms, methods (the paper's names), FALSE-VFL or not."""

from __future__ import annotations

import re

from partialvfl.bench.paper_results import PAPER_DATASETS, PAPER_METHODS
from partialvfl.data.mechanisms import PAPER_TEST_MECHANISMS
from partialvfl.methods.registry import UNORDERED, get_spec

__all__ = ["LABELED_ONLY", "PAPER_DATASET_NAME", "PAPER_NAME", "dataset_key", "is_false_vfl", "mech_key",
           "mechanism_title", "method_key", "method_title"]

PAPER_NAME = {v: k for k, v in PAPER_METHODS.items()}
PAPER_DATASET_NAME = {v: k for k, v in PAPER_DATASETS.items()}
_MECH_ORDER = list(PAPER_TEST_MECHANISMS)
LABELED_ONLY = "labelled-only"


def mechanism_title(name: str) -> str:
    """``mcar2`` -> ``MCAR 2``, ``mar1`` -> ``MAR 1``, ``mnar7`` -> ``MNAR 7``; other names unchanged."""
    for prefix in ("mnar", "mcar", "mar"):
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return f"{prefix.upper()} {name[len(prefix):]}"
    return name


def method_title(label: str, method: str) -> str:
    """The paper's name for a method shown under its registry name (``false-vfl-1`` -> ``FALSE-VFL-I``)."""
    spec = get_spec(method)
    return (spec.title if spec is not None else label) if label == method else label


def is_false_vfl(method: str) -> bool:
    """Whether ``method`` is a FALSE-VFL variant (its declaration says ``proposed``: the side reports compare)."""
    spec = get_spec(method)
    return spec is not None and spec.proposed


def dataset_key(name: str) -> tuple[tuple[int, float, str], ...]:
    """Datasets in natural order: numbers in a label compare as numbers (``K=4`` < ``K=12``, ``alpha=0.1`` < ``1`` <
    ``inf``), the rest as text."""
    parts = re.split(r"(\d+(?:\.\d+)?|\binf\b)", name)  # "inf" as a word only: "info" stays text
    return tuple((0, float(p), "") if i % 2 else (1, 0.0, p) for i, p in enumerate(parts) if p)


def mech_key(name: str) -> tuple[int, str]:
    """Sort key of a test mechanism: the paper's order, unknown names after it by name."""
    return (_MECH_ORDER.index(name) if name in _MECH_ORDER else len(_MECH_ORDER), name)


def method_key(method: str, label: str) -> tuple[float, str]:
    """The paper's row order (each method's declared ``report_order``): baselines, then methods it does not know,
    then FALSE-VFL."""
    spec = get_spec(method)
    return (float(spec.report_order if spec is not None else UNORDERED), label)
