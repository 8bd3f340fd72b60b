"""Every attack of the extraction suite by name, and :func:`run_attacks` against one party of a deployment.

The split-network attacks of issue 13 (:mod:`.extraction`), FALSE-VFL's decode oracle (:mod:`.extraction_false_vfl`)
and the width and optimiser tricks of issue 23 (:mod:`.extraction_tricks`); ``benchmarks/extraction_attack.py`` runs
them against a research and a default-policy party, ``tests/test_extraction.py`` asserts what each achieves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from partialvfl.bench import extraction, extraction_false_vfl, extraction_tricks
from partialvfl.bench.extraction import AttackOutcome, Extractor

__all__ = ["ATTACKS", "run_attacks"]

ATTACKS = {**extraction.ATTACKS, **extraction_false_vfl.ATTACKS, **extraction_tricks.ATTACKS}


def run_attacks(federation_file: Any, party: int, x: np.ndarray, plan: Sequence[tuple[str, dict[str, Any]]],
                ids: Sequence[Any] | None = None) -> list[AttackOutcome]:
    """Run ``plan`` (attack name, options) against ``party`` whose rows are ``x``, with IDs ``ids`` (``x``'s order;
    without them ``x`` must be in the order of the party's ID tokens, as under HMAC alignment)."""
    ex = Extractor(federation_file, party, ids)
    try:
        if ex.n != len(x) or ex.d != x.shape[1]:
            raise ValueError(f"party {party} holds {ex.n} x {ex.d} features, the reference {x.shape}")
        return [ATTACKS[name](ex, x, **opts) for name, opts in plan]
    finally:
        ex.close()
