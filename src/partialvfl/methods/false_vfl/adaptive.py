"""FALSE-VFL's adaptive prediction estimator: adaptive multiple importance sampling (AMIS) of ``p(y | x_obs)``.

The paper predicts by self-normalised importance sampling (SNIS) with ``L`` samples from the fused encoder posterior
``q(h | x_obs)``.  That proposal is far wider than the posterior ``p(h | x_obs)`` in some directions and narrower in
others, so the importance weights are nearly degenerate: an effective sample size (ESS) of about 2 of ``L = 50``, and
a row's answer rests on one or two samples.  AMIS (Cornuet, Marin, Mira & Robert, "Adaptive multiple importance
sampling", Scand. J. Stat. 2012) draws ``R`` rounds of ``L`` samples per row, each round from a Gaussian fitted to the
row's weighted samples so far, and weighs every sample against the mixture of all the row's proposals (the
deterministic-mixture weight of Veach & Guibas / Owen & Zhou):

    w_i = p(x_obs, h_i, z_i) / q(z_i | h_i) / ( sum_t (n_t / N) g_t(h_i) ),    g_0 = q(h | x_obs),

so the estimate stays the model's ``p(y | x_obs) = sum_i w_i p(y | h_i) / sum_i w_i`` (consistent as the samples
grow, whatever the proposals), and round 0 is the paper's own draw.

**Fitting a proposal.**  Round ``t``'s Gaussian (diagonal, as the wire carries a mean and a scale per row) is the
weighted mean and variance of the row's samples so far under *tempered* weights ``w^beta``: ``beta`` is the largest
in ``(0, 1]`` that keeps the tempered ESS at least :data:`TEMPERED_ESS_FRACTION` of the samples drawn (bisection),
so that a proposal is fitted to a dozen samples rather than to the one or two that carry the raw weight (the
sequence of tempered targets of adaptive importance sampling and of annealed SMC).  Its scale is kept within
``[1/20, 2]`` of the encoder posterior's, the latent log-variance clamp and, under the ``bound`` wire, the parties'
scale floor.

**What crosses.**  Each round is one more ``decode`` of the same rows with the round's mean and scale in place of the
fused posterior's; a party draws the round's noise from the row's round seed (:func:`round_seeds`, or under the
``bound`` wire from a hash of that seed and the exact bytes of the mean and scale it is sent), so the coordinator
still cannot choose the latents a party evaluates.  A party answers ``R`` decodes per row instead of one; a party
with a privacy budget is charged for each (the method's plan says so).

Every reduction runs along a row-major last axis (:func:`~.rowwise.samples_last`), so each row's numbers do not
depend on the other rows of its batch.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from partialvfl.methods.false_vfl.rowwise import as_seeds, samples_last
from partialvfl.nn.stats import gaussian_log_prob

__all__ = ["TEMPERED_ESS_FRACTION", "Estimate", "MixtureSamples", "Proposal", "component_log_density", "fit_proposal",
           "mixture_log_density", "round_seeds", "tempered_weights"]

#: a proposal is fitted under tempered weights whose ESS is at least this share of the samples drawn so far
TEMPERED_ESS_FRACTION = 0.2
#: a fitted proposal's scale stays within these multiples of the encoder posterior's scale
SCALE_RANGE = (0.05, 2.0)
_BISECTION_STEPS = 20


def round_seeds(seeds: np.ndarray | Sequence[int], round_index: int) -> np.ndarray:
    """Each row's noise seed for AMIS round ``round_index`` >= 1 (round 0 uses the row's own seed): SHA-256 of the
    round and the row's seed, 63 bits (int64 >= 0), so the rounds' draws are distinct and a row's alone."""
    tag = b"amis-round" + int(round_index).to_bytes(4, "little")
    return np.array([int.from_bytes(hashlib.sha256(tag + s.to_bytes(8, "little")).digest()[:8], "little") >> 1
                     for s in as_seeds(np.asarray(seeds, dtype=np.int64))], dtype=np.int64)


@dataclass(frozen=True)
class Estimate:
    """A prediction batch's importance samples: ``h`` ``(S, B, d_h)`` and their label-free log-weights ``log_w``
    ``(S, B)``; ``keep`` the rows with an answering party (the others are predicted from the label prior)."""

    keep: np.ndarray
    h: torch.Tensor
    log_w: torch.Tensor


@dataclass(frozen=True)
class Proposal:
    """One round's Gaussian proposal of every row: ``mean`` and ``logvar`` ``(B, d_h)`` as the coordinator holds them,
    and the number of samples drawn from it."""

    mean: torch.Tensor
    logvar: torch.Tensor
    samples: int

    def on_wire(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean and scale the samples are drawn with: as a ``decode`` carries them (``exp(logvar / 2)``, in the
        wire's dtype), back in float32."""
        return self.mean.to(dtype).float(), torch.exp(0.5 * self.logvar).to(dtype).float()


def component_log_density(h: torch.Tensor, proposal: Proposal, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``log N(h; mean, scale^2)`` ``(S, B)`` of samples ``h`` ``(S, B, d_h)`` under one proposal, with its mean and
    scale as the wire carried them (:meth:`Proposal.on_wire`); each (sample, row) alone."""
    mean, scale = proposal.on_wire(dtype)
    return gaussian_log_prob(h, mean, 2.0 * torch.log(scale)).sum(-1)


def _mixture(parts: Sequence[torch.Tensor], proposals: Sequence[Proposal]) -> torch.Tensor:
    total = sum(p.samples for p in proposals)
    weighted = [part + math.log(p.samples / total) for part, p in zip(parts, proposals, strict=True)]
    return weighted[0] if len(weighted) == 1 else torch.logsumexp(torch.stack(weighted, dim=-1), dim=-1)


def mixture_log_density(h: torch.Tensor, proposals: Sequence[Proposal], dtype: torch.dtype = torch.float32
                        ) -> torch.Tensor:
    """``log sum_t (n_t / N) N(h; mean_t, scale_t^2)`` of samples ``h`` ``(S, B, d_h)`` -> ``(S, B)``, with each
    proposal's mean and scale as the wire carried them (:meth:`Proposal.on_wire`); each (sample, row) alone."""
    return _mixture([component_log_density(h, p, dtype) for p in proposals], proposals)


class MixtureSamples:
    """A batch's samples round by round, each round's drawn from its own proposal, and their deterministic-mixture
    log-densities: every sample's density under every proposal is computed once, when the later of the two
    arrives."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.proposals: list[Proposal] = []
        self.rounds: list[torch.Tensor] = []  # each round's samples (S_t, B, d_h)
        self._densities: list[list[torch.Tensor]] = []  # [round][proposal] (S_t, B)

    def add(self, proposal: Proposal, h: torch.Tensor) -> None:
        """A round's samples ``h``, drawn from ``proposal``."""
        for t, samples in enumerate(self.rounds):
            self._densities[t].append(component_log_density(samples, proposal, self.dtype))
        self.proposals.append(proposal)
        self.rounds.append(h)
        self._densities.append([component_log_density(h, p, self.dtype) for p in self.proposals])

    @property
    def h(self) -> torch.Tensor:
        """Every sample so far ``(S, B, d_h)``, round after round."""
        return torch.cat(self.rounds)

    def log_weights(self, targets: Sequence[torch.Tensor]) -> torch.Tensor:
        """Every sample's importance log-weight ``(S, B)``: its round's log-target (``targets``, one ``(S_t, B)`` per
        round) minus the log-density of the mixture of all the proposals so far."""
        mixture = torch.cat([_mixture(parts, self.proposals) for parts in self._densities])
        return torch.cat(list(targets)) - mixture


def _ess_rows(log_w_rows: torch.Tensor) -> torch.Tensor:
    w = torch.softmax(log_w_rows, dim=-1)
    return 1.0 / (w * w).sum(-1)


def tempered_weights(log_w: torch.Tensor, fraction: float = TEMPERED_ESS_FRACTION) -> torch.Tensor:
    """Normalised weights ``(B, S)`` proportional to ``w^beta`` per row (``log_w`` ``(S, B)``), ``beta`` the largest in
    ``[0, 1]`` whose ESS is at least ``fraction * S`` (found by bisection; ``beta = 1`` when the raw weights already
    reach it)."""
    rows = samples_last(log_w.double())  # (B, S)
    target = fraction * rows.shape[-1]
    lo = torch.zeros(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
    hi = torch.ones_like(lo)
    done = _ess_rows(rows) >= target
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        good = (_ess_rows(mid * rows) >= target).unsqueeze(-1)
        lo, hi = torch.where(good, mid, lo), torch.where(good, hi, mid)
    beta = torch.where(done.unsqueeze(-1), torch.ones_like(lo), lo)
    return torch.softmax(beta * rows, dim=-1)


def fit_proposal(h: torch.Tensor, log_w: torch.Tensor, base_scale: torch.Tensor, *, min_scale: float,
                 logvar_range: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The next round's Gaussian (``mean``, ``logvar``, ``(B, d_h)``, float32) fitted to each row's samples ``h``
    ``(S, B, d_h)`` under their log-weights ``log_w`` ``(S, B)``: the tempered weighted mean and standard deviation
    (:func:`tempered_weights`), the scale kept within :data:`SCALE_RANGE` of ``base_scale`` (the encoder
    posterior's), the latent log-variance clamp ``logvar_range`` and ``min_scale`` (the bound wire's floor)."""
    w = tempered_weights(log_w).unsqueeze(1)  # (B, 1, S)
    rows = samples_last(h.double())  # (B, d_h, S)
    mean = (w * rows).sum(-1)
    var = (w * (rows - mean.unsqueeze(-1)) ** 2).sum(-1)
    base = base_scale.double()
    lo = torch.clamp(base * SCALE_RANGE[0], min=max(float(min_scale), math.exp(0.5 * float(logvar_range[0]))))
    hi = torch.clamp(base * SCALE_RANGE[1], max=math.exp(0.5 * float(logvar_range[1])))
    scale = torch.minimum(torch.maximum(torch.sqrt(var), lo), torch.maximum(hi, lo))
    return mean.float(), (2.0 * torch.log(scale)).float()
