"""The lookup enumeration (issue 35): a label holder that asks for predictions of candidate IDs instead of new users
learns which parties hold each one, one lookup per ID.

:func:`enumerate_memberships` is the attack as the stock tools run it (``partialvfl predict --ids candidates.txt
--allow-prior-only``: attach a batch of IDs, read which parties hold each, release), persistent against a budget
(a refused batch is tried smaller, then at another keyed party, until every keyed party refuses a single ID);
:func:`issue_federation` is the federation the issue attacked (bank 1,497 and shop 1,097 customers, the passive,
keyed parties; the insurer, the label holder, 1,200, of which 1,000 labelled; IDs ``C`` + 6 digits below 100,000;
597 customers only the bank holds and 597 only the shop).  ``tests/test_lookup_budget.py`` asserts what it learns
under the permissive and the default policy; ``benchmarks/lookup_enumeration.py`` measures it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partialvfl.data.dataset import Task, VerticalDataset
from partialvfl.federation.grpc.transport import PartyError

__all__ = ["CANDIDATES", "Enumeration", "enumerate_memberships", "issue_federation", "outsiders"]

#: the candidate customer numbers of the issue: ``C000000`` ... ``C099999``
CANDIDATES = 100_000


@dataclass(frozen=True)
class Enumeration:
    """What the attack learned: ``held`` (candidate -> the indices of the parties that hold it, for every candidate
    answered), how many candidates were answered, the last refusal (``None``: every batch was answered) and the
    seconds it took."""

    held: dict[str, tuple[int, ...]]
    tested: int
    refusal: str | None
    seconds: float


def enumerate_memberships(fed: Any, candidates: Sequence[str], batch: int = 10_000) -> Enumeration:
    """Look ``candidates`` up through ``fed`` as predictions do, in batches.

    ``fed`` is a connected :class:`~partialvfl.federation.grpc.federation.GrpcFederation`; the lookup goes on until
    all are answered or every keyed party refuses one ID.
    """
    held: dict[str, tuple[int, ...]] = {}
    tested, refusal, size = 0, None, batch
    t0 = time.perf_counter()
    while tested < len(candidates):
        ids = list(candidates[tested:tested + size])
        try:
            _, handle = fed.attach_ids(ids)
        except PartyError as e:
            if size > 1:  # squeeze out what is left of the budget
                size = max(1, size // 4)
                continue
            avoid = getattr(fed.aligner, "avoid", None)
            if avoid is not None and len(avoid) + 1 < len(getattr(fed.aligner, "keyed", ())):
                avoid.add(e.party)  # that party's budget is spent: ask another
                size = 2048  # one party at a time (a set of 4,096 or more is split over every keyed party)
                continue
            refusal = e.details
            break
        fed.release(handle)
        held.update((i, tuple(int(k) for k in np.flatnonzero(row))) for i, row in zip(ids, fed.last_held,
                                                                                    strict=True))
        tested += len(ids)
    return Enumeration(held, tested, refusal, time.perf_counter() - t0)


def outsiders(data: VerticalDataset) -> set[str]:
    """The IDs of ``data`` its label holder's institution does not hold (neither its own party's block nor its
    labels): what the enumeration is after."""
    mine = data.observed[:, data.active_party] | data.labeled
    return {str(i) for i in data.ids[data.observed.any(axis=1) & ~mine]}


def issue_federation(seed: int = 0) -> VerticalDataset:
    """The issue's three tables (module docstring), two feature columns each, binary labels."""
    rng = np.random.default_rng(seed)
    pool = rng.choice(CANDIDATES, 597 + 597 + 500 + 400 + 300, replace=False)
    bank_only, shop_only, everyone, bank_insurer, insurer_only = np.split(pool, np.cumsum([597, 597, 500, 400]))
    held = {"bank": np.concatenate([bank_only, everyone, bank_insurer]),
            "shop": np.concatenate([shop_only, everyone]),
            "insurer": np.concatenate([everyone, bank_insurer, insurer_only])}
    observed = np.stack([np.isin(pool, held[n]) for n in ("bank", "shop", "insurer")], axis=1)
    labeled = np.zeros(len(pool), dtype=bool)
    labeled[rng.choice(np.flatnonzero(observed[:, 2]), 1000, replace=False)] = True
    blocks = [np.where(observed[:, [k]], rng.normal(size=(len(pool), 2)), np.nan).astype(np.float32) for k in range(3)]
    return VerticalDataset(blocks, observed, ids=np.array([f"C{i:06d}" for i in pool], dtype=object),
                           y=np.where(labeled, rng.integers(0, 2, len(pool)), -1), labeled=labeled,
                           task=Task.classification([0, 1]), active_party=2, party_names=["bank", "shop", "insurer"])
