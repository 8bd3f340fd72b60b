"""The coordinator's side of one FALSE-VFL mini-batch on the wire: encode, fuse, decode, and the gradient rounds.

Rounds per batch (``docs/false-vfl.md`` has the tables and what a party learns):

1. ``encode`` to every party observing some batch rows (skipped for parties whose encode rode with the previous
   step's last message, see ``next_rows``);
2. fusion at the coordinator (one scatter of all parties' posteriors, no per-party zero-fill), then ``decode``:
   under the ``lean`` wire each party gets the fused posterior's mean and scale of its rows and draws the batch's
   shared noise itself; under ``samples`` it gets the S latent samples;
3. training: ``decode_grad`` returns the gradient w.r.t. what each party got, and ``update`` sends each party the
   gradient of its posterior parameters.

The coordinator back-propagates once: the loss graph is cut at the fused posterior (mean, log-variance), so the
first pass (its own terms, the log-likelihood leaves) and the second (the parties' latent gradients through the
fusion) never traverse a node twice and nothing is retained.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

from partialvfl.federation.wire.messages import Reply, Request
from partialvfl.methods.false_vfl.adaptive import Proposal
from partialvfl.methods.false_vfl.formulas import (
    after_latent_noise,
    bound_noise,
    fuse_posteriors,
    latent_log_weights,
    latent_noise,
    latent_prior_terms,
    reparameterize,
)
from partialvfl.methods.false_vfl.party import as_rows
from partialvfl.methods.false_vfl.rowwise import row_bound_noise, row_latent_noise
from partialvfl.nn.blocks import RowBlocks
from partialvfl.nn.compiled import compiled
from partialvfl.utils.devices import to_device
from partialvfl.utils.seeding import derive_seed

if TYPE_CHECKING:
    from partialvfl.data.dataset import CoordinatorView
    from partialvfl.federation.wire.transport import Transport

__all__ = ["LatentSide", "Pass", "Prefetch", "Rounds"]

#: the coordinator's share of a step, compiled with ``compile=True`` (:mod:`partialvfl.nn.compiled`)
_LATENT = compiled(latent_log_weights, True, "FALSE-VFL's latent log-weights")


@dataclass
class Prefetch:
    """Posteriors of the next batch's rows that rode with the previous step's last round."""

    handle: str
    rows: np.ndarray
    replies: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def matches(self, handle: str, rows: np.ndarray) -> bool:
        """Whether this prefetch answered the same rows of the same dataset."""
        return self.handle == handle and np.array_equal(self.rows, rows)


@dataclass
class Pass:
    """One batch's forward pass: who answered, the fused posterior, the latents and the (S, B) log-weights."""

    rows: np.ndarray
    observed: np.ndarray  # (B, K) what the data says
    avail: np.ndarray  # (B, K) observed and answered
    h: torch.Tensor
    log_w: torch.Tensor
    eps: torch.Tensor
    mean_h: torch.Tensor  # fused posterior (graph back to the parties' mu/logvar)
    logvar_h: torch.Tensor
    mean_leaf: torch.Tensor  # the same values, cut from that graph (training)
    logvar_leaf: torch.Tensor
    mu: dict[int, torch.Tensor] = field(default_factory=dict)
    logvar: dict[int, torch.Tensor] = field(default_factory=dict)
    loglik: dict[int, torch.Tensor] = field(default_factory=dict)
    mask_loglik: dict[int, torch.Tensor] = field(default_factory=dict)
    held: dict[int, np.ndarray] = field(default_factory=dict)
    missing: dict[int, np.ndarray] = field(default_factory=dict)
    sent: dict[int, tuple[bool, bool]] = field(default_factory=dict)  # party -> (held rows sent, lacked rows sent)
    decoded: set[int] = field(default_factory=set)
    seeds: np.ndarray | None = None  # prediction: each row's own noise seed (:mod:`.rowwise`); None: the batch's
    eps_z: torch.Tensor | None = None  # the noise of z given each latent sample (not trained through)
    log_parties: torch.Tensor | None = None  # (S, B) the parties' terms of the log-weights
    log_prior: torch.Tensor | None = None  # (S, B) prediction: log p(h|z) + log p(z) - log q(z|h), once computed

    @property
    def keep(self) -> np.ndarray:
        """Samples with at least one answering party (the others are skipped / predicted from the prior)."""
        return self.avail.any(axis=1)


def _straight_through(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to the wire dtype in value, identity in gradient (both sides then use the same numbers)."""
    if dtype == torch.float32:
        return t
    return t + (t.detach().to(dtype).float() - t.detach())


def _cat_index(parts: list[np.ndarray], device: torch.device) -> torch.Tensor:
    return to_device(torch.as_tensor(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)), device)


class LatentSide(Protocol):
    """What the rounds need from the coordinator they serve, besides the wire: its noise draws and the latent
    chain's global modules (read at each use, so a coordinator that rebuilds its modules needs no new rounds), its
    device and whether its share of a step is compiled."""

    torch_device: torch.device
    compile: bool

    def draw_noise(self, gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
        """Standard normal noise of ``shape`` from ``gen``."""
        ...

    def latent_modules(self) -> tuple[nn.Module, nn.Module]:
        """The global encoder ``q(z|h)`` and the global decoder ``p(h|z)``."""
        ...


class Rounds:
    """The coordinator's rounds of FALSE-VFL mini-batches: the transport they cross, the method's settings and
    variant, and the next batch's posteriors that rode with the last round (:attr:`prefetch`).

    One per stage or prediction pass (a new one starts without a prefetch); ``side`` is the coordinator.
    """

    def __init__(self, transport: Transport, settings: Any, variant: int, side: LatentSide) -> None:
        self.transport = transport
        self.settings = settings
        self.variant = int(variant)
        self.side = side
        self.prefetch: Prefetch | None = None

    @property
    def wire_dtype(self) -> torch.dtype:
        """The floating-point type of the tensors the parties send."""
        return getattr(torch, self.settings.wire_dtype)

    # ------------------------------------------------------------------ forward: encode, fuse, decode
    def encode(self, handle: str, rows: np.ndarray, observed: np.ndarray, train: bool,
               prefetch: Prefetch | None, predict: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Every observing party's posterior parameters of its rows (from the prefetch where it has them);
        ``predict``: computed row by row (:mod:`.rowwise`)."""
        answers = dict(prefetch.replies) if prefetch is not None and prefetch.matches(handle, rows) else {}
        meta = {"data": handle, "train": train, **({"predict": True} if predict else {})}
        requests = {k: Request("encode", {"rows": as_rows(rows[observed[:, k]])}, dict(meta))
                    for k in range(observed.shape[1]) if observed[:, k].any() and k not in answers}
        if requests:
            for k, r in self.transport.call_many(requests, tolerate=True).items():
                answers[k] = (r.tensors["mu"], r.tensors["logvar"])
            self.transport.new_round()
        return answers

    def _fuse(self, st: Pass, answers: dict[int, tuple[torch.Tensor, torch.Tensor]], train: bool) -> None:
        """The fused posterior of every batch row from the answering parties' posteriors (one scatter each)."""
        n_parties, b = st.observed.shape[1], len(st.rows)
        d_h = self.settings.d_h
        parties = sorted(answers)
        for k in parties:
            mu, lv = answers[k][0].float(), answers[k][1].float()
            st.mu[k], st.logvar[k] = (mu.requires_grad_(), lv.requires_grad_()) if train else (mu, lv)
        flat = _cat_index([k * b + st.held[k] for k in parties], self.side.torch_device)
        private = getattr(getattr(self.side, "federation_", None), "privacy_setups", {})
        lo, hi = self.settings.encoder_logvar_range  # noisy log-variances of a private party, clamped as its own are
        logvar = {k: v.clamp(lo, hi) if k in private else v for k, v in st.logvar.items()}
        stacked = []
        for parts in (st.mu, logvar):
            full = torch.zeros(n_parties * b, d_h, device=self.side.torch_device)
            if parties:
                full = full.index_copy(0, flat, torch.cat([parts[k] for k in parties]))
            stacked.append(full.view(n_parties, b, d_h))
        st.mean_h, st.logvar_h = fuse_posteriors(stacked[0], stacked[1],
                                                 to_device(torch.as_tensor(st.avail.T), self.side.torch_device),
                                                 self.settings.fusion, any_unobserved=not st.keep.all(),
                                                 rowwise=st.seeds is not None)
        floor = self.settings.latent_scale_floor
        if self.settings.wire == "bound" and floor > 0:  # the parties evaluate no latent of a narrower posterior
            st.logvar_h = st.logvar_h.clamp(min=2 * math.log(floor))
        if train:
            st.mean_leaf = st.mean_h.detach().requires_grad_()
            st.logvar_leaf = st.logvar_h.detach().requires_grad_()
        else:
            st.mean_leaf, st.logvar_leaf = st.mean_h, st.logvar_h

    def forward(self, view: CoordinatorView, handle: str, rows: np.ndarray, n_samples: int, *, train: bool,
                noise_seed: int, next_rows: np.ndarray | None = None, row_seeds: np.ndarray | None = None) -> Pass:
        """Rounds ``encode`` and ``decode`` for one batch: the (S, B) importance log-weights (label-free).

        Uses the prefetch where it holds this batch; ``next_rows`` (prediction and stage 2, nothing trained): the
        next batch's encode rides with this ``decode`` and its posteriors become the new :attr:`prefetch`.
        ``row_seeds`` (prediction): each row's noise from its own seed, sent with it (:mod:`.rowwise`), instead
        of the batch's from ``noise_seed``.
        """
        prefetch, self.prefetch = self.prefetch, None
        p = self.settings
        dtype = self.wire_dtype
        rows = np.asarray(rows, dtype=np.int64)
        observed = view.observed[rows]
        b, d_h, d_z = len(rows), p.d_h, p.d_z
        answers = self.encode(handle, rows, observed, train, prefetch, predict=row_seeds is not None)
        avail = observed.copy()
        avail[:, [k for k in range(observed.shape[1]) if k not in answers]] = False
        st = Pass(rows=rows, observed=observed, avail=avail, h=torch.empty(0), log_w=torch.empty(0),
                  eps=torch.empty(0), mean_h=torch.empty(0), logvar_h=torch.empty(0), mean_leaf=torch.empty(0),
                  logvar_leaf=torch.empty(0), seeds=row_seeds)
        for k in range(observed.shape[1]):
            st.held[k], st.missing[k] = np.flatnonzero(observed[:, k]), np.flatnonzero(~observed[:, k])
        self._fuse(st, answers, train)
        if row_seeds is None:
            st.eps = latent_noise(noise_seed, (n_samples, b, d_h), self.side.torch_device)  # the parties' draw too
            eps_z = self.side.draw_noise(after_latent_noise(noise_seed, (n_samples, b, d_h)), (n_samples, b, d_z))
        else:
            device = self.side.torch_device
            st.eps, eps_z = (to_device(t, device) for t in row_latent_noise(row_seeds, n_samples, d_h, d_z))
        if p.wire == "bound":  # each row's noise: a hash of the mean and scale it is sent with (the parties' own draw)
            mean = st.mean_leaf.detach().to(dtype).cpu()
            scale = torch.exp(0.5 * st.logvar_leaf.detach()).to(dtype).cpu()
            st.eps = (bound_noise(noise_seed, torch.arange(b), mean, scale, n_samples) if row_seeds is None
                      else row_bound_noise(row_seeds, mean, scale, n_samples)).to(st.mean_leaf.device)
        if p.wire != "samples" and dtype != torch.float32:
            mean = _straight_through(st.mean_leaf, dtype)
            st.h = mean + _straight_through(torch.exp(0.5 * st.logvar_leaf), dtype) * st.eps
        else:
            st.h = _straight_through(reparameterize(st.mean_leaf, st.logvar_leaf, st.eps), dtype)
        requests = self._decode_requests(st, answers, train, noise_seed)
        next_requests, next_prefetch = _next_encodes(view, requests, handle, next_rows, train=False,
                                                     predict=row_seeds is not None)
        replies = self.transport.call_many({**next_requests, **requests}, tolerate=True)
        if next_prefetch is not None:
            next_prefetch.replies = _posteriors(replies)
        st.eps_z = eps_z
        st.log_w = self._log_weights(st, {k: r for k, r in replies.items() if k in requests}, train, eps_z)
        self.prefetch = next_prefetch
        return st

    def refine(self, view: CoordinatorView, handle: str, first: Pass, proposal: Proposal, *, noise_seed: int,
               row_seeds: np.ndarray | None, next_rows: np.ndarray | None = None) -> Pass:
        """One more ``decode`` of a prediction pass's rows (an adaptive estimator's round, :mod:`.adaptive`): the
        latents drawn from ``proposal`` in place of the fused posterior, with this round's noise (``noise_seed``, or
        each row's ``row_seeds``); the parties that answered ``first``'s encode are asked again.  Returns the round's
        pass (its ``h``, ``eps_z`` and ``log_parties``; no ``log_w``); ``next_rows`` as in :meth:`forward`."""
        p = self.settings
        dtype = self.wire_dtype
        b, n, d_h, d_z = len(first.rows), proposal.samples, p.d_h, p.d_z
        device = self.side.torch_device
        st = dataclasses.replace(first, mean_leaf=proposal.mean, logvar_leaf=proposal.logvar, seeds=row_seeds,
                                 log_w=torch.empty(0), loglik={}, mask_loglik={}, sent={}, decoded=set(),
                                 log_parties=None, log_prior=None)
        if row_seeds is None:
            st.eps = latent_noise(noise_seed, (n, b, d_h), device)
            st.eps_z = self.side.draw_noise(after_latent_noise(noise_seed, (n, b, d_h)), (n, b, d_z))
        else:
            st.eps, st.eps_z = (to_device(t, device) for t in row_latent_noise(row_seeds, n, d_h, d_z))
        mean, scale = proposal.on_wire(dtype)
        if p.wire == "bound":  # the parties' own draw: a hash of the mean and scale they are sent
            sent_mean, sent_scale = proposal.mean.to(dtype).cpu(), torch.exp(0.5 * proposal.logvar).to(dtype).cpu()
            st.eps = (bound_noise(noise_seed, torch.arange(b), sent_mean, sent_scale, n) if row_seeds is None
                      else row_bound_noise(row_seeds, sent_mean, sent_scale, n)).to(device)
        if p.wire == "samples":
            st.h = _straight_through(reparameterize(proposal.mean, proposal.logvar, st.eps), dtype)
        else:
            st.h = mean + scale * st.eps
        self.transport.new_round()
        requests = self._decode_requests(st, dict.fromkeys(first.mu), False, noise_seed)
        next_requests, next_prefetch = _next_encodes(view, requests, handle, next_rows, train=False,
                                                     predict=row_seeds is not None)
        replies = self.transport.call_many({**next_requests, **requests}, tolerate=True)
        if next_prefetch is not None:
            next_prefetch.replies = _posteriors(replies)
        st.log_parties = self.party_terms(st, {k: r for k, r in replies.items() if k in requests})
        self.prefetch = next_prefetch
        return st

    def target_terms(self, st: Pass) -> torch.Tensor:
        """A prediction pass's log-weight numerators ``(S, B)``: ``log p(x_obs|h)`` (II: and the mask terms) ``+ log
        p(h|z) + log p(z) - log q(z|h)`` of its latent samples (the prior part computed once, with its ``eps_z``)."""
        if st.log_prior is None:
            global_encoder, global_decoder = self._global_modules(st)
            st.log_prior = latent_prior_terms(st.h, global_encoder, global_decoder, st.eps_z,
                                              tuple(self.settings.encoder_logvar_range))
        return st.log_parties + st.log_prior

    def common_parties(self, passes: list[Pass]) -> None:
        """Rounds of one batch weigh the same parties' terms: a party that answered some rounds' ``decode`` and not
        others (it failed or timed out) loses its terms in all of them, as if it had not answered round 0."""
        common = set.intersection(*(q.decoded for q in passes))
        for q in passes:
            if q.decoded != common:
                kept = {k: Reply({name: store[k] for name, store in (("loglik", q.loglik),
                                                                       ("mask_loglik", q.mask_loglik)) if k in store})
                        for k in sorted(common)}
                q.loglik, q.mask_loglik = {}, {}
                q.log_parties = self.party_terms(q, kept)

    def _decode_requests(self, st: Pass, answers: dict, train: bool, noise_seed: int) -> dict[int, Request]:
        """Each party's ``decode``: the latents (samples) or the fused posterior (lean) of its held / lacked rows."""
        variant2 = self.variant == 2
        dtype = self.wire_dtype
        for k in range(st.observed.shape[1]):
            lacks = variant2 and (k in answers or not st.observed[:, k].any()) and st.missing[k].size > 0
            st.sent[k] = (k in answers, bool(lacks))
        requests: dict[int, Request] = {}
        if self.settings.wire == "samples":
            h = st.h.detach().to(dtype)
            for k, (held, lacks) in st.sent.items():
                tensors = {"h": h[:, st.held[k]]} if held else {}
                if lacks:
                    tensors["h_mis"] = h[:, st.missing[k]]
                    if st.seeds is not None:  # II: the party's draws of x^k for the rows it lacks
                        tensors["seed_mis"] = torch.as_tensor(st.seeds[st.missing[k]], dtype=torch.int64)
                if tensors:
                    requests[k] = Request("decode", tensors, {"train": train,
                                                              "noise_seed": derive_seed(noise_seed, "party", k),
                                                              **({"predict": True} if st.seeds is not None else {})})
            return requests
        pieces = [(k, suffix, idx) for k, (held, lacks) in st.sent.items()
                  for suffix, on, idx in (("", held, st.held[k]), ("_mis", lacks, st.missing[k])) if on]
        index = _cat_index([idx for _, _, idx in pieces], self.side.torch_device)
        mean = st.mean_leaf.detach()[index].to(dtype)  # one gather for every party's rows
        scale = torch.exp(0.5 * st.logvar_leaf.detach())[index].to(dtype)
        meta = {"train": train, "noise_seed": int(noise_seed), "batch": len(st.rows),
                "samples": int(st.eps.shape[0]), **({"predict": True} if st.seeds is not None else {})}
        start = 0
        for k, suffix, idx in pieces:
            n = len(idx)
            tensors = requests.setdefault(k, Request("decode", {}, dict(meta))).tensors
            tensors.update({f"mean{suffix}": mean[start:start + n], f"scale{suffix}": scale[start:start + n],
                            f"pos{suffix}": torch.as_tensor(idx, dtype=torch.int64)})
            if st.seeds is not None:
                tensors[f"seed{suffix}"] = torch.as_tensor(st.seeds[idx], dtype=torch.int64)
            start += n
        return requests

    def party_terms(self, st: Pass, replies: dict, train: bool = False) -> torch.Tensor:
        """``sum_k log p(x^k|h)`` (+ II's mask terms) ``(S, B)`` from the parties' ``decode`` replies, each kind summed
        with one scatter (the tensors kept in ``st.loglik`` / ``st.mask_loglik``; ``st.decoded`` names who answered)."""
        n_samples, b = st.eps.shape[0], len(st.rows)
        sums = []
        for name, store in (("loglik", st.loglik), ("mask_loglik", st.mask_loglik)):
            idx, vals = [], []
            for k, r in replies.items():
                if name not in r.tensors:
                    continue
                t = r.tensors[name].requires_grad_() if train else r.tensors[name]
                store[k] = t
                held, lacks = st.sent[k]
                idx += ([st.held[k]] if held else []) + ([st.missing[k]] if lacks and name == "mask_loglik" else [])
                vals.append(t)
            total = torch.zeros(n_samples, b, device=self.side.torch_device)
            sums.append(total.index_add(1, _cat_index(idx, self.side.torch_device), torch.cat(vals, dim=1)) if vals
                        else total)
        st.decoded = set(replies)
        return sums[0] + sums[1]

    def _global_modules(self, st: Pass) -> tuple[nn.Module, nn.Module]:
        global_encoder, global_decoder = self.side.latent_modules()
        if st.seeds is not None:  # prediction: each row's floats whatever its batch (.rowwise)
            global_encoder, global_decoder = RowBlocks(global_encoder), RowBlocks(global_decoder)
        return global_encoder, global_decoder

    def _log_weights(self, st: Pass, replies: dict, train: bool, eps_z: torch.Tensor) -> torch.Tensor:
        """``sum_k log p(x^k|h) (+ II mask terms) + latent terms``, the per-party terms summed with one scatter
        each."""
        parties = st.log_parties = self.party_terms(st, replies, train)
        global_encoder, global_decoder = self._global_modules(st)
        latent = (_LATENT if self.side.compile and st.seeds is None else latent_log_weights)(
            st.h, st.mean_leaf, st.logvar_leaf, global_encoder, global_decoder, eps_z,
            tuple(self.settings.encoder_logvar_range))
        return parties + latent

    # ------------------------------------------------------------------ backward: decode_grad, update
    def backward(self, view: CoordinatorView, st: Pass, loss: torch.Tensor, handle: str,
                 next_rows: np.ndarray | None = None) -> None:
        """Training: back-propagate ``loss`` (one pass each side of the fused posterior), the parties' gradient
        rounds (``decode_grad``, ``update``), and the next batch's encode riding with ``update`` (the new
        :attr:`prefetch`)."""
        dtype = self.wire_dtype
        transport = self.transport
        loss.backward()  # the coordinator's own terms: gamma_s, theta_s, the log-likelihood leaves, the posterior cut
        transport.new_round()
        requests = {}
        for k in st.decoded:
            tensors = {}
            if k in st.loglik:
                tensors["grad_loglik"] = _grad_or_zeros(st.loglik[k])
            if k in st.mask_loglik:
                tensors["grad_mask_loglik"] = _grad_or_zeros(st.mask_loglik[k])
            requests[k] = Request("decode_grad", tensors)
        replies = transport.call_many(requests, tolerate=True)
        grad_mean, grad_scale = _latent_gradients(st, replies, self.side.torch_device)
        std = torch.exp(0.5 * st.logvar_leaf.detach())
        torch.autograd.backward([st.mean_h, st.logvar_h],
                                [st.mean_leaf.grad + grad_mean, st.logvar_leaf.grad + 0.5 * std * grad_scale])

        transport.new_round()
        requests = {}
        for k in set(st.mu) | st.decoded:
            tensors = {}
            if k in st.mu:
                tensors = {"grad_mu": _grad_or_zeros(st.mu[k]).to(dtype),
                           "grad_logvar": _grad_or_zeros(st.logvar[k]).to(dtype)}
            requests[k] = Request("update", tensors)
        extra, prefetch = _next_encodes(view, requests, handle, next_rows, train=True)
        replies = transport.call_many({**extra, **requests}, tolerate=True)
        if prefetch is not None:
            prefetch.replies = _posteriors(replies)
        self.prefetch = prefetch


def _posteriors(replies: dict) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The next batch's posteriors that rode with a round's replies."""
    return {k: (r.tensors["mu"], r.tensors["logvar"]) for k, r in replies.items() if "mu" in r.tensors}


def _next_encodes(view: CoordinatorView, requests: dict[int, Request], handle: str, next_rows: np.ndarray | None,
                  *, train: bool, predict: bool = False) -> tuple[dict[int, Request], Prefetch | None]:
    """Attach the next batch's rows to this round's messages (``next_rows``), or add an ``encode`` for them
    (``predict``: the encode of a prediction, :mod:`.rowwise`)."""
    if next_rows is None or len(next_rows) == 0:
        return {}, None
    next_rows = np.asarray(next_rows, dtype=np.int64)
    observed = view.observed[next_rows]
    extra = {}
    for k in range(observed.shape[1]):
        if not observed[:, k].any():
            continue
        mine = as_rows(next_rows[observed[:, k]])
        if k in requests:
            requests[k].tensors["next_rows"] = mine
            requests[k].meta["data"] = handle
            if predict:
                requests[k].meta["predict"] = True
        else:
            extra[k] = Request("encode", {"rows": mine}, {"data": handle, "train": train,
                                                         **({"predict": True} if predict else {})})
    return extra, Prefetch(handle, next_rows)


def _latent_gradients(st: Pass, replies: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The parties' gradients w.r.t. the fused posterior's mean and scale of every batch row, summed."""
    b, d_h = len(st.rows), st.eps.shape[-1]
    idx, means, scales = [], [], []
    for k, r in replies.items():
        held, lacks = st.sent[k]
        for suffix, rows, sent in (("", st.held[k], held), ("_mis", st.missing[k], lacks)):
            if not sent:
                continue
            t = r.tensors
            if f"grad_h{suffix}" in t:  # the samples wire: d/dmean = sum_j g_j, d/dscale = sum_j g_j eps_j
                g = t[f"grad_h{suffix}"].float()
                means.append(g.sum(0))
                scales.append((g * st.eps[:, rows]).sum(0))
            elif f"grad_mean{suffix}" in t:
                means.append(t[f"grad_mean{suffix}"].float())
                scales.append(t[f"grad_scale{suffix}"].float())
            else:
                continue
            idx.append(rows)
    index = _cat_index(idx, device)
    out = []
    for parts in (means, scales):
        total = torch.zeros(b, d_h, device=device)
        out.append(total.index_add_(0, index, torch.cat(parts)) if parts else total)
    return out[0], out[1]


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)
