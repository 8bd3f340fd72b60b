"""The round trips of split learning: one per training step, or one per ``stale_steps`` steps.

A training step of a split-network method needs the parties' representations of the batch (``embed``) and then sends
them the loss gradient of those representations (``grad_embedding``).  Three schedules (parameter ``rounds``):

* ``piggyback`` (the default): the ``grad_embedding`` of step t also carries the rows of step t+1 (``next:<model>``,
  the training loop draws that batch ahead, :meth:`~partialvfl.methods.training.TrainingLoop.peek`); each party
  updates, then computes and returns the next representations in the same message, so a step is one round trip
  (and the first step of a stage, or after a validation check, one more).  The parties compute exactly what they
  computed in two rounds, in the same order: the weights are bit-identical to ``sequential``;
* ``sequential``: two round trips per step, representations out, gradients back (the schedule before piggy-backing);
* ``stale``: FedBCD-style local updates (Liu et al. 2019, "A communication efficient collaborative learning
  framework for distributed features"): one step of the loop is ``stale_steps`` (Q) batches.  The parties compute
  the representations of all Q at once (at the weights of the round's start); the coordinator takes Q steps of its
  heads, each batch's loss from those representations; the Q gradients then go back in one message (with the next Q
  batches' rows riding on it), and each party takes Q steps, running its model again on each batch's rows at its
  current weights and back-propagating that batch's (stale) gradient.  One round trip per Q steps; what the parties
  learn from is up to Q - 1 of their own updates old.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from partialvfl.federation.wire.messages import Request
from partialvfl.methods.splitnn.spec import ROUNDS
from partialvfl.utils.devices import scalar

__all__ = ["ROUNDS", "Prefetch", "StepPlan", "grouped", "merge_plans", "representations", "ride_next",
           "stale_group"]

Wanted = dict[int, dict[str, np.ndarray]]


@dataclass
class StepPlan:
    """What a training step asks for: its rows (after the method's own choices, e.g. PlugVFL's dropout), their
    observed pattern, the representations it wants (``wanted[k][model]``: party k's rows, sorted positions) and what
    else the method's loss needs (``extra``)."""

    rows: np.ndarray
    obs: np.ndarray
    wanted: Wanted
    extra: Any = None


@dataclass
class Prefetch:
    """The representations of the next step that rode with the previous step's gradients: for the item ``key`` (a
    batch, or a group of batches), its plans and each party's ``emb:<model>`` replies."""

    handle: str
    key: list[np.ndarray]
    plans: list[StepPlan | None]
    replies: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    def matches(self, handle: str, key: list[np.ndarray]) -> bool:
        """Whether this prefetch answered the same rows of the same dataset."""
        return (self.handle == handle and len(self.key) == len(key)
                and all(np.array_equal(a, b) for a, b in zip(self.key, key)))


def grouped(batches: Iterable[np.ndarray], size: int) -> Iterator[list[np.ndarray]]:
    """Consecutive groups of ``size`` batches (the last one may be shorter)."""
    group: list[np.ndarray] = []
    for b in batches:
        group.append(b)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def merge_plans(plans: list[StepPlan]) -> tuple[Wanted, dict[tuple[int, str], list[int]]]:
    """The representations of several steps asked at once: each party's rows of each model, step after step, and
    the row count of each step (``sections``); parties and models in the order the plans name them (one plan: its
    own ``wanted``)."""
    keys = list(dict.fromkeys((k, m) for p in plans for k, models in p.wanted.items() for m in models))
    wanted: Wanted = {}
    sections: dict[tuple[int, str], list[int]] = {}
    for k, m in keys:
        parts = [p.wanted.get(k, {}).get(m, np.zeros(0, dtype=np.int64)) for p in plans]
        wanted.setdefault(k, {})[m] = np.concatenate(parts).astype(np.int64)
        sections[(k, m)] = [len(r) for r in parts]
    return wanted, sections


def ride_next(requests: Mapping[int, Request], handle: str, wanted: Wanted, *, train: bool) -> dict[int, Request]:
    """This round's requests with the next step's ``embed`` riding on them: ``next:<model>`` rows on each party's
    ``grad_embedding``, or an ``embed`` of its own (same round) for a party that gets no gradient; in party order."""
    out = dict(requests)
    for k, models in wanted.items():
        rows = {m: torch.as_tensor(np.asarray(r, dtype=np.int64)) for m, r in models.items()}
        if not rows:
            continue
        if k in out:
            req = out[k]
            out[k] = Request(req.kind, {**req.tensors, **{f"next:{m}": t for m, t in rows.items()}},
                             {**req.meta, "data": handle, "train": bool(train)})
        else:
            out[k] = Request("embed", {f"rows:{m}": t for m, t in rows.items()}, {"data": handle, "train": bool(train)})
    return dict(sorted(out.items()))


def representations(replies: Mapping[int, Any], wanted: Wanted) -> dict[tuple[int, str], torch.Tensor]:
    """``(party, model) -> representations`` from replies carrying ``emb:<model>``."""
    return {(k, m): r.tensors[f"emb:{m}"] for k, r in replies.items() for m in wanted.get(k, {})
            if f"emb:{m}" in r.tensors}


def stale_group(method: Any, handle: str, plans: list[StepPlan],
                prefetched: Mapping[tuple[int, str], torch.Tensor] | None,
                loss_of: Callable[[StepPlan, dict[tuple[int, str], torch.Tensor]], torch.Tensor],
                send: Callable[[dict[int, Request]], None]) -> tuple[float, int]:
    """One loop step of the ``stale`` schedule: the group's representations (``prefetched``, or one ``embed``
    round), one head step per batch, then every batch's gradients in one ``grad_embedding`` per party (with its
    ``sections``), handed to ``send`` (which adds the next group's rows).  Returns (sum of losses x rows, rows)."""
    wanted, sections = merge_plans(plans)
    embs = prefetched if prefetched is not None else method._embed(handle, wanted, train=True, leaves=False)
    grads = {key: torch.zeros_like(e) for key, e in embs.items()}
    offsets = {key: np.concatenate([[0], np.cumsum(n)]) for key, n in sections.items()}
    total, count = 0.0, 0
    opt = method.head_optimizer_
    for j, plan in enumerate(plans):
        parts = {key: embs[key][offsets[key][j]:offsets[key][j + 1]].detach().requires_grad_()
                 for key in embs if sections[key][j]}
        loss = loss_of(plan, parts)
        if opt is not None:
            opt.zero_grad()
        loss.backward()
        if opt is not None:
            opt.step()
        for key, e in parts.items():
            if e.grad is not None:
                grads[key][offsets[key][j]:offsets[key][j + 1]] = e.grad
        total += scalar(loss.detach()) * len(plan.rows)
        count += len(plan.rows)
    by_party: dict[int, dict[str, torch.Tensor]] = {}
    for (k, m), g in grads.items():
        by_party.setdefault(k, {}).update({f"grad:{m}": g, f"sections:{m}": torch.as_tensor(sections[(k, m)])})
    method.transport.new_round()
    send({k: Request("grad_embedding", t) for k, t in sorted(by_party.items())})
    return total, count
