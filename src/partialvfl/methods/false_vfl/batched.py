"""FALSE-VFL parties answering one round together: the in-process simulation's batched path.

:class:`~partialvfl.federation.transport.LocalTransport` hands a round's requests to
:meth:`FalseVFLParty.handle_batch <partialvfl.methods.false_vfl.party.FalseVFLParty.handle_batch>`, which lands here.
Parties whose modules are plain MLPs of one shape (the usual simulation) run each round as one computation: their
inputs padded to the round's largest row count, one batched matmul per layer (:func:`~partialvfl.nn.stacked.
stacked_mlp`), one backward pass for all of them.  What stays per party:

* the modules, their gradients and the optimiser: the stacked weights are built from each party's own parameters
  for every pass, autograd puts each party's gradient into its own ``.grad``, and each party's own optimiser steps;
* the data: each party reads its own rows from its own view;
* the messages: each party answers its own request with exactly the tensors its own handler would (the transport
  checks and logs them per party).

A party whose modules cannot be stacked (convolutional encoders or decoders) answers alone, as over gRPC.  The
graph of a batched round is shared by its members; a member that is asked alone later (a fault elsewhere) is
answered through the same group, keeping the graph until every member is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from partialvfl.federation.messages import Reply, Request
from partialvfl.methods.false_vfl.formulas import reparameterize, split_gaussian
from partialvfl.nn.stacked import mlp_signature, pad_rows, stacked_mlp
from partialvfl.nn.stats import feature_gaussian_log_density
from partialvfl.utils.seeding import torch_generator

if TYPE_CHECKING:
    from partialvfl.federation.party import PartyProgram, PartyRuntime

__all__ = ["Member", "handle_batch", "signature"]


class Member(Protocol):
    """What a batched round uses of a party program (:class:`~.party.FalseVFLParty`): its declared networks and
    optimiser, its settings, its own data and noise, and its pending encode/decode (``_enc``, ``_dec``), which
    its own handlers share with this module."""

    party: int
    variant: int
    wire: str
    logvar_range: tuple[float, ...]
    decoder_logvar_range: tuple[float, ...]
    config: dict[str, Any]
    optimizer: torch.optim.Optimizer
    runtime: PartyRuntime
    _enc: dict[str, Any]
    _dec: dict[str, Any]

    @property
    def device(self) -> torch.device:
        """Where its networks and tables are."""
        ...

    @property
    def modules(self) -> nn.Module:
        """Its ``encoder``, ``decoder`` and (II) ``indicator`` (``None`` under I)."""
        ...

    def features(self, handle: str, rows: torch.Tensor) -> torch.Tensor: ...

    def to_wire(self, t: torch.Tensor) -> torch.Tensor: ...

    def decoder_logvar(self) -> torch.Tensor: ...

    def shared_noise(self, meta: dict[str, Any], d_h: int) -> torch.Tensor: ...

    def missing_noise_seed(self, meta: dict[str, Any]) -> int: ...

    def _draw(self, gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor: ...


def signature(program: Member) -> tuple[Any, ...] | None:
    """What must agree for parties to share a batched computation; ``None`` if its modules cannot be stacked."""
    net = program.modules
    parts = [mlp_signature(net.encoder), mlp_signature(net.decoder)]
    if net.indicator is not None:
        parts.append(mlp_signature(net.indicator))
    if any(p is None for p in parts):
        return None
    return (*parts, program.variant, program.wire, program.wire_dtype, program.logvar_range,
            program.decoder_logvar_range)


@dataclass(eq=False)
class _Group:
    """The shared graph of one batched round: padded outputs (or leaves) and the members still to back-propagate."""

    tensors: dict[str, torch.Tensor]
    sizes: dict[str, list[int]] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)

    def backward(self, slots: set[int], outputs: list[str], grads: list[torch.Tensor]) -> None:
        """One backward pass for ``slots`` (zero gradients for the other members, whose graph is kept)."""
        later = bool(self.pending - slots)
        self.pending -= slots
        if outputs:
            torch.autograd.backward([self.tensors[n] for n in outputs], grads, retain_graph=later)


def handle_batch(items: Sequence[tuple[PartyProgram, Request]]) -> list[Reply]:
    """The replies to one round's requests, each as the party's own handler would answer it."""
    replies: dict[int, dict[str, torch.Tensor]] = {}
    by_kind: dict[str, list[int]] = {}
    for i, (program, request) in enumerate(items):
        alone = signature(program) is None or (  # type: ignore[arg-type]
            request.kind == "decode_grad" and not program.in_group(request.kind))  # type: ignore[attr-defined]
        if alone:  # modules that cannot be stacked, or a graph of its own: as its own handler answers
            replies[i] = dict(program.handle(request).tensors)
        else:
            by_kind.setdefault(request.kind, []).append(i)
    encodes: list[tuple[int, str, torch.Tensor, bool]] = [
        (i, items[i][1].meta["data"], items[i][1].tensors["rows"], bool(items[i][1].meta.get("train", False)))
        for i in by_kind.get("encode", [])]
    if "update" in by_kind:
        _update([items[i] for i in by_kind["update"]])
        for i in by_kind["update"]:
            replies[i] = {}
            if "next_rows" in items[i][1].tensors:
                encodes.append((i, items[i][1].meta["data"], items[i][1].tensors["next_rows"], True))
    if "decode_grad" in by_kind:
        replies.update(zip(by_kind["decode_grad"], _decode_grad([items[i] for i in by_kind["decode_grad"]])))
    if "decode" in by_kind:
        replies.update(zip(by_kind["decode"], _decode([items[i] for i in by_kind["decode"]])))
        for i in by_kind["decode"]:
            if "next_rows" in items[i][1].tensors:
                encodes.append((i, items[i][1].meta["data"], items[i][1].tensors["next_rows"], False))
    if encodes:
        encodes.sort(key=lambda e: e[0])  # party order, as in an encode round of its own: the same stacked pass
        for i, out in _encode([(items[i][0], handle, rows, train) for i, handle, rows, train in encodes]):
            replies.setdefault(encodes[i][0], {}).update(out)
    return [Reply(replies[i]) for i in range(len(items))]


def _partition(keys: Sequence[Any]) -> list[list[int]]:
    """Indices grouped by key, in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


# ---------------------------------------------------------------------- encode
def _encode(items: list[tuple[Member, str, torch.Tensor, bool]]) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """Encode every member's rows, one stacked encoder pass per group of equal parties."""
    out = []
    for idx in _partition([(signature(p), handle, train) for p, handle, _, train in items]):
        members = [items[i][0] for i in idx]
        train = items[idx[0]][3]
        xs = [m.features(items[i][1], items[i][2]) for m, i in zip(members, idx)]
        for m in members:
            m.modules.train(train)
            if train:
                m.optimizer.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(train):
            enc = stacked_mlp([m.modules.encoder for m in members], pad_rows(xs), compile=members[0].runtime.compile)
            mu, logvar = split_gaussian(enc, members[0].logvar_range)
        group = _Group({"mu": mu, "logvar": logvar}, pending=set(range(len(members))) if train else set())
        for slot, (i, m, x) in enumerate(zip(idx, members, xs)):
            n = len(x)
            m._enc = {"x": x, "mu": mu[slot, :n], "logvar": logvar[slot, :n], "train": train}
            if train:
                m._enc.update(group=group, slot=slot)
            out.append((i, {"mu": m.to_wire(mu[slot, :n]), "logvar": m.to_wire(logvar[slot, :n])}))
    return out


# ---------------------------------------------------------------------- update
def _update(items: list[tuple[Member, Request]]) -> None:
    """Back-propagate every member's ``grad_mu``/``grad_logvar`` (one pass per encode group), then step each party."""
    groups: dict[int, tuple[_Group, dict[int, Request]]] = {}
    for program, request in items:
        group = program._enc.get("group")
        if group is not None:
            groups.setdefault(id(group), (group, {}))[1][program._enc["slot"]] = request
        elif "grad_mu" in request.tensors:  # an encode answered alone: its own graph
            torch.autograd.backward([program._enc["mu"], program._enc["logvar"]],
                                    [request.tensors["grad_mu"].float(), request.tensors["grad_logvar"].float()])
    for group, requests in groups.values():
        with_grads = {s: r for s, r in requests.items() if "grad_mu" in r.tensors}
        grads = []
        if with_grads:
            for name in ("mu", "logvar"):
                g = torch.zeros_like(group.tensors[name])
                for slot, r in with_grads.items():
                    t = r.tensors[f"grad_{name}"]
                    g[slot, :len(t)] = t.float()
                grads.append(g)
        group.backward(set(requests), ["mu", "logvar"] if with_grads else [], grads)
    for program, _ in items:
        program.optimizer.step()
        program._enc, program._dec = {}, {}


# ---------------------------------------------------------------------- decode
def _decode(items: list[tuple[Member, Request]]) -> list[dict[str, torch.Tensor]]:
    """Every member's log-likelihoods (II: mask terms), one stacked decoder pass per group of equal parties."""
    out: dict[int, dict[str, torch.Tensor]] = {}

    def key(program: Member, request: Request) -> tuple[Any, ...]:
        m, t = request.meta, request.tensors
        held = t.get("h", t.get("h_mis"))
        samples = int(m["samples"]) if program.wire != "samples" and "samples" in m else (
            held.shape[0] if held is not None else 0)
        seed = m.get("noise_seed") if program.wire != "samples" else None
        return signature(program), bool(m.get("train", False)), samples, m.get("batch"), seed

    for idx in _partition([key(p, r) for p, r in items]):
        for i, reply in zip(idx, _decode_group([items[i] for i in idx])):
            out[i] = reply
    return [out[i] for i in range(len(items))]


def _latents(members: list[Member], requests: list[Request], train: bool
             ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[int], list[int]]:
    """The padded leaves (what the members got) and latents ``(K, S, rows, d_h)`` of held and lacked rows."""
    first = members[0]
    d_h = int(first.config["d_h"])
    leaves: dict[str, torch.Tensor] = {}
    latents: dict[str, torch.Tensor] = {}
    sizes = {}
    eps = None
    for suffix in ("", "_mis"):
        if first.wire == "samples":
            got = [r.tensors.get(f"h{suffix}") for r in requests]
            sizes[suffix] = [0 if g is None else g.shape[1] for g in got]
            if not any(sizes[suffix]):
                continue
            s = next(g for g in got if g is not None).shape[0]
            leaf = pad_rows([torch.zeros(0, s, d_h, device=first.device) if g is None else g.float().transpose(0, 1)
                             for g in got])
            leaves[f"h{suffix}"] = leaf.requires_grad_(train)
            latents[suffix] = leaf.transpose(1, 2)
            continue
        got = [(r.tensors.get(f"mean{suffix}"), r.tensors.get(f"scale{suffix}"), r.tensors.get(f"pos{suffix}"))
               for r in requests]
        sizes[suffix] = [0 if g[0] is None else len(g[0]) for g in got]
        if not any(sizes[suffix]):
            continue
        empty = torch.zeros(0, d_h, device=first.device)
        mean = pad_rows([empty if g[0] is None else g[0].float() for g in got]).requires_grad_(train)
        scale = pad_rows([empty if g[0] is None else g[1].float() for g in got]).requires_grad_(train)
        leaves[f"mean{suffix}"], leaves[f"scale{suffix}"] = mean, scale
        if first.wire == "bound":  # each row's own draw, checked and derived by its member
            noise = pad_rows([torch.zeros(0, int(requests[0].meta["samples"]), d_h) if g[0] is None
                              else m.latent_noise(r, d_h)[suffix].transpose(0, 1)
                              for m, r, g in zip(members, requests, got)])
            latents[suffix] = mean.unsqueeze(1) + scale.unsqueeze(1) * noise.transpose(1, 2)
            continue
        pos = pad_rows([torch.zeros(0, dtype=torch.int64) if g[0] is None else g[2] for g in got])
        if eps is None:
            eps = first.shared_noise(requests[0].meta, d_h)  # one draw: every member derives the same noise
        latents[suffix] = mean.unsqueeze(1) + scale.unsqueeze(1) * eps[:, pos].transpose(0, 1)
    return leaves, latents, sizes.get("", [0] * len(members)), sizes.get("_mis", [0] * len(members))


def _decode_group(items: list[tuple[Member, Request]]) -> list[dict[str, torch.Tensor]]:
    members = [p for p, _ in items]
    requests = [r for _, r in items]
    first = members[0]
    train = bool(requests[0].meta.get("train", False))
    for m, r in zip(members, requests):
        m.modules.train(train)
        held = _held_rows(r)
        if held and len(m._enc.get("x", ())) != held:
            raise RuntimeError(f"party {m.party}: decode of {held} held rows without their encode")
        if train and not held:  # II: a member that lacks every row of the batch decodes without encoding
            m.optimizer.zero_grad(set_to_none=True)
    leaves, latents, n_held, n_mis = _latents(members, requests, train)
    b_max, m_max = max(n_held), max(n_mis)
    h = torch.cat([latents[s] for s in ("", "_mis") if s in latents], dim=2)  # (K, S, b_max + m_max, d_h)
    k, s, rows, d_h = h.shape
    outs: dict[str, torch.Tensor] = {}
    with torch.set_grad_enabled(train):
        mean_x = stacked_mlp([m.modules.decoder for m in members], h.reshape(k, s * rows, d_h),
                             compile=first.runtime.compile).view(k, s, rows, -1)
        dec_lv = torch.stack([m.decoder_logvar() for m in members])  # (K, d)
        x = pad_rows([m._enc["x"] if n else mean_x.new_zeros(0, mean_x.shape[-1]) for m, n in zip(members, n_held)]
                     ) if b_max else None
        if b_max:
            outs["loglik"] = feature_gaussian_log_density(x, mean_x[:, :, :b_max], dec_lv)
        if first.variant == 2:
            indicators = [m.modules.indicator for m in members]
            if b_max:
                held = nn.functional.logsigmoid(-stacked_mlp(indicators, x).squeeze(-1))
                outs["mask_held"] = held.unsqueeze(1).expand(k, s, b_max)
            if m_max:
                noise = pad_rows([_missing_noise(m, r, s, n, mean_x.shape[-1]).transpose(0, 1)
                                  for m, r, n in zip(members, requests, n_mis)]).transpose(1, 2)
                x_mis = reparameterize(mean_x[:, :, b_max:], dec_lv[:, None, None], noise)
                logit = stacked_mlp(indicators, x_mis.reshape(k, s * m_max, -1)).view(k, s, m_max)
                outs["mask_mis"] = nn.functional.logsigmoid(logit)
    group = _Group({**leaves, **outs}, {"held": n_held, "mis": n_mis},
                   pending=set(range(len(members))) if train else set())
    replies = []
    for slot, m in enumerate(members):
        nb, nm = n_held[slot], n_mis[slot]
        reply: dict[str, torch.Tensor] = {}
        if nb:
            reply["loglik"] = outs["loglik"][slot, :, :nb]
        parts = ([outs["mask_held"][slot, :, :nb]] if nb and "mask_held" in outs else []) + (
            [outs["mask_mis"][slot, :, :nm]] if nm else [])
        if parts:
            reply["mask_loglik"] = torch.cat(parts, dim=1)
        m._dec = {"group": group, "slot": slot} if train else {}
        replies.append(m.release(reply))
    return replies


def _held_rows(request: Request) -> int:
    t = request.tensors
    return int(t["h"].shape[1]) if "h" in t else len(t["mean"]) if "mean" in t else 0


def _missing_noise(member: Member, request: Request, samples: int, n: int, d: int) -> torch.Tensor:
    """II: the member's own draw for the decoder samples of the rows it lacks (its own seed, as alone)."""
    if not n:
        return torch.zeros(samples, 0, d, device=member.device)
    gen = torch_generator(member.missing_noise_seed(request.meta), "party", member.party)
    return member._draw(gen, (samples, n, d))


# ---------------------------------------------------------------------- decode_grad
def _decode_grad(items: list[tuple[Member, Request]]) -> list[dict[str, torch.Tensor]]:
    """One backward pass per decode group; each member gets the gradient of what it was sent."""
    groups: dict[int, tuple[_Group, dict[int, Request]]] = {}
    for program, request in items:
        group = program._dec["group"]
        groups.setdefault(id(group), (group, {}))[1][program._dec["slot"]] = request
    for group, requests in groups.values():
        names, grads = [], []
        for name in ("loglik", "mask_held", "mask_mis"):
            if name not in group.tensors:
                continue
            g = torch.zeros_like(group.tensors[name])
            for slot, r in requests.items():
                _fill_grad(g, name, slot, r, group.sizes["held"][slot], group.sizes["mis"][slot])
            names.append(name)
            grads.append(g)
        group.backward(set(requests), names, grads)
    replies = []
    for program, _ in items:
        group, slot = program._dec["group"], program._dec["slot"]
        nb, nm = group.sizes["held"][slot], group.sizes["mis"][slot]
        reply = {}
        for name, leaf in group.tensors.items():
            if name in ("loglik", "mask_held", "mask_mis"):
                continue
            n = nm if name.endswith("_mis") else nb
            if not n:
                continue
            g = leaf.grad[slot, :n] if leaf.grad is not None else torch.zeros_like(leaf[slot, :n])
            reply[f"grad_{name}"] = program.to_wire(g.transpose(0, 1).contiguous() if name.startswith("h") else g)
        replies.append(reply)
    return replies


def _fill_grad(g: torch.Tensor, name: str, slot: int, request: Request, n_held: int, n_mis: int) -> None:
    t = request.tensors
    if name == "loglik" and "grad_loglik" in t:
        g[slot, :, :n_held] = t["grad_loglik"]
    elif name == "mask_held" and "grad_mask_loglik" in t and n_held:
        g[slot, :, :n_held] = t["grad_mask_loglik"][:, :n_held]
    elif name == "mask_mis" and "grad_mask_loglik" in t and n_mis:
        g[slot, :, :n_mis] = t["grad_mask_loglik"][:, n_held:]
