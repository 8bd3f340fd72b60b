"""Split-network parties answering one round together: the in-process simulation's batched path.

``embed`` and ``grad_embedding`` of every party whose representation model is a plain MLP of one shape run as one
computation: rows padded to the round's largest count, one batched matmul per layer
(:func:`~partialvfl.nn.stacked.stacked_mlp`), one backward pass.  Each party keeps its models and optimisers (the
stacked weights are rebuilt from them for every pass, autograd fills each party's own ``.grad``, each party's own
optimiser steps) and answers its own request with what its own handler would.  Models that cannot be stacked
(convolutional encoders) and the other kinds (``pretrain``, ``set_lr``) are answered party by party.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from partialvfl.federation.wire.messages import Reply, Request
from partialvfl.nn.stacked import mlp_signature, pad_rows, stacked_mlp

if TYPE_CHECKING:
    from partialvfl.federation.wire.program import PartyProgram

__all__ = ["handle_batch"]


@dataclass(eq=False)
class _Group:
    """One stacked forward pass in training: the padded output and the (party, model) units still to update."""

    output: torch.Tensor
    pending: set[int] = field(default_factory=set)


def handle_batch(items: Sequence[tuple[PartyProgram, Request]]) -> list[Reply]:
    """The replies to one round's requests, each as the party's own handler would answer it.

    Every update of the round comes first, then every forward pass (an ``embed``, or the next step's that rides with
    a ``grad_embedding``) as one stacked computation: the computations of a round of gradients followed by a round of
    ``embed`` requests, in the same order.
    """
    replies: dict[int, Reply] = {}
    embeds: list[tuple[int, Any, Request]] = []
    grads, alone = [], []
    for i, (program, request) in enumerate(items):
        if request.kind == "embed":
            embeds.append((i, program, request))
        elif request.kind == "grad_embedding":
            nxt = program.next_embed(request)  # type: ignore[attr-defined]
            stacked = program._groups and not any(k.startswith("sections:") for k in request.tensors)  # type: ignore[attr-defined]
            (grads if stacked else alone).append(i)
            replies[i] = Reply()
            if nxt is not None:
                embeds.append((i, program, nxt))
        else:
            replies[i] = program.handle(request)
    if grads:
        _grad_embedding([items[i] for i in grads])
    for i in alone:
        program, request = items[i]
        for name in list(program._groups):  # type: ignore[attr-defined]
            program._groups.pop(name)  # type: ignore[attr-defined]
        program.apply_gradients(request)  # type: ignore[attr-defined]
    if embeds:
        for (i, _, _), reply in zip(embeds, _embed([(p, r) for _, p, r in embeds])):
            replies[i] = Reply({**replies[i].tensors, **reply.tensors}) if i in replies else reply
    return [replies[i] for i in range(len(items))]


def _embed(items: list[tuple[Any, Request]]) -> list[Reply]:
    """Every (party, model) pair's representations, one stacked pass per group of equal models."""
    outs: list[dict[str, torch.Tensor]] = [{} for _ in items]
    units: dict[tuple[Any, ...], list[tuple[int, str, torch.Tensor]]] = {}
    for i, (program, request) in enumerate(items):
        train = request.meta.get("train", False)
        for key, rows in request.tensors.items():
            if not key.startswith("rows:"):
                raise ValueError(f"party {program.party}: unexpected tensor {key!r} in an embed request")
            name = key.removeprefix("rows:")
            model = program._model(name)
            x = program._features(request.meta["data"], rows)
            sig = mlp_signature(model)
            if sig is None or not len(x):  # answered alone, as its own handler does
                h = program.forward_model(name, x, train, (request.meta["data"], rows))
                outs[i][f"emb:{name}"] = h
                continue
            units.setdefault((sig, train), []).append((i, name, x))
    for (_, train), group_units in units.items():
        members: list[Any] = [items[i][0] for i, _, _ in group_units]
        models = [m._model(name) for m, (_, name, _) in zip(members, group_units)]
        for model in models:
            model.train(train)
        with torch.set_grad_enabled(train):
            out = stacked_mlp(models, pad_rows([x for _, _, x in group_units]), compile=members[0].runtime.compile)
        group = _Group(out, set(range(len(group_units)))) if train else None
        for slot, (member, (i, name, x)) in enumerate(zip(members, group_units)):
            h = out[slot, :len(x)]
            if group is not None:
                member.keep_buffers(name, (items[i][1].meta["data"], _rows_of(items[i][1], name)))
                member._pending[name] = h
                member._inputs[name] = x
                member._groups[name] = (group, slot)
            outs[i][f"emb:{name}"] = h
    return [Reply(o) for o in outs]


def _rows_of(request: Request, name: str) -> torch.Tensor:
    return request.tensors[f"rows:{name}"]


def _grad_embedding(items: list[tuple[Any, Request]]) -> None:
    """Back-propagate every unit's gradient (one pass per stacked group), then step each unit's own optimiser."""
    groups: dict[int, tuple[_Group, dict[int, torch.Tensor]]] = {}
    stepped: list[tuple[Any, str]] = []
    alone: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
    for program, request in items:
        for key, grad in request.tensors.items():
            if not key.startswith("grad:"):
                continue
            name = key.removeprefix("grad:")
            h, _ = program._pending_forward(name)
            if h is None:
                raise RuntimeError(f"party {program.party}: gradient for {name!r} without a pending training forward")
            stepped.append((program, name))
            entry = program._groups.pop(name, None)
            if entry is None:
                if h.requires_grad and h.numel():
                    alone.append((program, h, grad))
                continue
            group, slot = entry
            groups.setdefault(id(group), (group, {}))[1][slot] = grad
    for program, name in stepped:
        program.optimizers[name].zero_grad()
    for group, by_slot in groups.values():
        g = torch.zeros_like(group.output)
        for slot, grad in by_slot.items():
            g[slot, :len(grad)] = grad
        later = bool(group.pending - set(by_slot))
        group.pending -= set(by_slot)
        torch.autograd.backward(group.output, g, retain_graph=later)
    for _, h, grad in alone:
        torch.autograd.backward(h, grad)
    for program, name in stepped:
        program.optimizers[name].step()
