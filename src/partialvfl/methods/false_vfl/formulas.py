"""FALSE-VFL's formulas, in log space (the party program is :mod:`.party`, the coordinator :mod:`.coordinator`).

The formulas follow the FALSE-VFL paper (sections 3.3-3.4, Appendix A.2 and B; see ``docs/false-vfl.md``):

* fusion of the observed parties' Gaussian posteriors over ``h`` (eq. 1: mean of the observed means, precision =
  sum of the observed precisions; or a product of experts, precision-weighted mean);
* the latent part of the importance log-weight, ``log p(h|z) + log p(z) - log q(h|x_obs) - log q(z|h)``;
* the party-side terms ``log p(x^k | h)`` (diagonal Gaussian with a learned per-feature log-variance) and, for
  FALSE-VFL-II, ``log p(m^k | x^k)`` with ``x^k`` sampled from the decoder when the party lacks the sample.

Shapes follow ``[samples, batch, dim]``; everything is computed in log space.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from partialvfl.methods.false_vfl.rowwise import samples_last
from partialvfl.methods.false_vfl.spec import FUSION_RULES
from partialvfl.nn.stats import gaussian_log_prob, normalized_weights, standard_normal_log_prob
from partialvfl.utils.devices import to_device
from partialvfl.utils.seeding import torch_generator

__all__ = ["after_latent_noise", "bound_noise", "effective_sample_size", "fuse_posteriors", "gaussian_log_density",
           "latent_log_weights", "latent_noise", "latent_noise_generator", "latent_prior_terms", "predictive_log_probs",
           "predictive_mean", "reparameterize", "snis_weights", "split_gaussian"]


def fuse_posteriors(
    mu: torch.Tensor, logvar: torch.Tensor, observed: torch.Tensor, rule: str = "mean-precision", *,
    any_unobserved: bool | None = None, rowwise: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fuse K local Gaussian posteriors over ``h`` into ``q(h | x_obs)``.

    ``mu``/``logvar``: ``(K, B, d)`` (values of unobserved parties are ignored); ``observed``: ``(K, B)`` bool.
    ``mean-precision`` is eq. 1 of the paper: mean = average of the observed means, precision = sum of the observed
    precisions (an absent party counts as infinite variance, Appendix B).  ``poe`` is the product of experts: the
    same precision, mean weighted by precision.  A sample with no observed party gets N(0, I) (callers skip it).
    Returns ``(mean, logvar)`` of shape ``(B, d)``.  ``any_unobserved``: whether some sample has no observed party,
    if the caller knows (it saves reading a device tensor back); ``None``: looked up.  ``rowwise`` (prediction):
    reduce over the parties along a row-major last axis, so each row's floats do not depend on the batch
    (:func:`~.rowwise.samples_last`); training keeps the leading-axis reductions it was fitted with.
    """
    if rule not in FUSION_RULES:
        raise ValueError(f"unknown fusion rule {rule!r}; choose one of {', '.join(FUSION_RULES)}")
    observed = observed.to(torch.bool)
    none = ~observed.any(0)
    if any_unobserved if any_unobserved is not None else bool(none.any()):
        observed = observed.clone()
        observed[0, none] = True
        mu = torch.where(none[None, :, None], torch.zeros_like(mu), mu)
        logvar = torch.where(none[None, :, None], torch.zeros_like(logvar), logvar)
    obs = observed.unsqueeze(-1)
    log_prec_parts = torch.where(obs, -logvar, torch.full_like(logvar, -float("inf")))
    held_mu = torch.where(obs, mu, torch.zeros_like(mu))
    if rowwise:
        log_prec = torch.logsumexp(samples_last(log_prec_parts), dim=-1)
    else:
        log_prec = torch.logsumexp(log_prec_parts, dim=0)
    if rule == "mean-precision":
        n = observed.sum(0).to(mu.dtype).unsqueeze(-1)
        mean = (samples_last(held_mu).sum(-1) if rowwise else held_mu.sum(0)) / n
    elif rowwise:
        mean = (torch.softmax(samples_last(log_prec_parts), dim=-1) * samples_last(held_mu)).sum(-1)
    else:
        w = torch.softmax(log_prec_parts, dim=0)
        mean = (w * held_mu).sum(0)
    return mean, -log_prec


def latent_noise_generator(noise_seed: int) -> torch.Generator:
    """The generator of a batch's reparameterisation noise: ``eps_h`` ``(S, B, d_h)`` first, then ``eps_z``.

    The coordinator and (under the lean wire protocol) every party derive it from the batch's noise seed, so the
    noise of ``h = mean + scale * eps_h`` is shared without ever crossing.
    """
    return torch_generator(noise_seed, "coordinator")


@dataclass
class _Draw:
    """One batch's ``eps_h`` (on the CPU, where it is drawn), the generator's state after it, its device copies."""

    eps: torch.Tensor
    state_after: torch.Tensor
    on: dict[torch.device, tuple[torch.Tensor, Any]] = field(default_factory=dict)  # device -> (copy, its event)


#: the last few batches' draws, by (noise seed, shape): a memo of a pure function (see :func:`latent_noise`)
_DRAWS: OrderedDict[tuple[int, tuple[int, ...]], _Draw] = OrderedDict()
_DRAWS_LOCK = threading.Lock()
_DRAWS_KEPT = 2


def _draw(noise_seed: int, shape: tuple[int, ...]) -> _Draw:
    key = (int(noise_seed), tuple(int(s) for s in shape))
    with _DRAWS_LOCK:
        hit = _DRAWS.get(key)
        if hit is not None:
            _DRAWS.move_to_end(key)
            return hit
    gen = latent_noise_generator(noise_seed)
    drawn = _Draw(torch.randn(key[1], generator=gen), gen.get_state())
    with _DRAWS_LOCK:
        drawn = _DRAWS.setdefault(key, drawn)
        while len(_DRAWS) > _DRAWS_KEPT:
            _DRAWS.popitem(last=False)
    return drawn


def latent_noise(noise_seed: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The batch's shared noise ``eps_h`` (shape ``(S, B, d_h)``: the first draw of
    :func:`latent_noise_generator`), on ``device``.  Read only: never write into it.

    The coordinator and every party of a batch compute this same draw from the batch's seed (under the lean wire each
    party draws it itself; nothing crosses).  In one process (a simulation: K parties and the coordinator) they would
    draw it K + 1 times, the same numbers each time, and on a GPU copy it K + 1 times: a large host-side cost of a
    step (FashionMNIST's cpu grid: 0.5 M normal draws, 7 ms each on a 2-core VM; the paper configuration 2 M, 22 ms).
    So the draw, and its copy on each device, is kept for the last two (seed, shape) keys and handed to everyone
    who asks: a memo of a pure function, the same numbers as drawing again, in a simulation and in a deployment alike.
    """
    drawn = _draw(noise_seed, shape)
    with _DRAWS_LOCK:
        kept = drawn.on.get(device)
    if kept is None:
        out = to_device(drawn.eps, device)
        made = None
        if out.device.type == "cuda":  # queued on this stream: another stream must wait for the copy
            made = torch.cuda.Event()
            made.record(torch.cuda.current_stream(out.device))
        with _DRAWS_LOCK:
            kept = drawn.on.setdefault(device, (out, made))
    out, made = kept
    if made is not None:  # parties answering concurrently compute on their own streams (federation.wire.concurrent)
        stream = torch.cuda.current_stream(out.device)
        stream.wait_event(made)
        out.record_stream(stream)  # its memory is not reused while this stream may still read it
    return out


def after_latent_noise(noise_seed: int, shape: tuple[int, ...]) -> torch.Generator:
    """:func:`latent_noise_generator` positioned after the ``eps_h`` draw of ``shape`` (the coordinator's ``eps_z``
    comes next)."""
    gen = torch.Generator()
    gen.set_state(_draw(noise_seed, shape).state_after)
    return gen


def bound_noise(noise_seed: int, pos: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor,
                samples: int) -> torch.Tensor:
    """The ``bound`` wire's noise ``(S, B, d_h)``: for each row, ``S`` standard normal draws from a generator seeded
    by SHA-256 of the batch's noise seed, the row's position in the batch and the exact bytes of the mean and scale
    sent for it (as they cross: their wire dtype).

    Coordinator and parties compute the same numbers; but a row's latents ``mean + scale * eps`` are fixed only
    once its mean and scale are, so a coordinator cannot aim them (it would need a SHA-256 preimage): it learns them
    after choosing.  Positions must be distinct, so no two rows share their draws.
    """
    b, d_h = int(mean.shape[0]), int(mean.shape[-1])
    raw_mean = mean.detach().contiguous().view(torch.uint8).numpy()
    raw_scale = scale.detach().contiguous().view(torch.uint8).numpy()
    out = torch.empty(samples, b, d_h)
    head = int(noise_seed).to_bytes(8, "little", signed=False)
    for i in range(b):
        digest = hashlib.sha256(head + int(pos[i]).to_bytes(8, "little") + raw_mean[i].tobytes()
                                + raw_scale[i].tobytes()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        out[:, i] = torch.randn((samples, d_h), generator=gen)
    return out


def reparameterize(mean: torch.Tensor, logvar: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``mean + exp(logvar / 2) * eps`` (``eps`` may carry extra leading sample axes)."""
    return mean + torch.exp(0.5 * logvar) * eps


def gaussian_log_density(x: torch.Tensor, mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, diag(exp(logvar))) summed over the last axis."""
    return gaussian_log_prob(x, mean, logvar).sum(-1)


def split_gaussian(out: torch.Tensor, logvar_range: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a network output ``(..., 2d)`` into a mean and a clamped log-variance."""
    mean, logvar = out.chunk(2, dim=-1)
    return mean, logvar.clamp(float(logvar_range[0]), float(logvar_range[1]))


def latent_log_weights(
    h: torch.Tensor,
    mean_h: torch.Tensor,
    logvar_h: torch.Tensor,
    global_encoder: nn.Module,
    global_decoder: nn.Module,
    eps_z: torch.Tensor,
    logvar_range: Sequence[float] = (-8.0, 6.0),
) -> torch.Tensor:
    """``log p(h|z) + log p(z) - log q(h|x_obs) - log q(z|h)`` for samples ``h`` ``(S, B, d_h)``, z from ``eps_z``.

    ``q(z|h)`` is the global encoder gamma_s, ``p(h|z)`` the global decoder theta_s, ``p(z) = N(0, I)``.  Adding
    the parties' ``log p(x^k|h)`` (and, in II, the mask terms) gives the full importance log-weight.
    """
    log_q_h = gaussian_log_density(h, mean_h, logvar_h)
    mean_z, logvar_z = split_gaussian(global_encoder(h), logvar_range)
    z = reparameterize(mean_z, logvar_z, eps_z)
    log_q_z = gaussian_log_density(z, mean_z, logvar_z)
    log_p_z = standard_normal_log_prob(z).sum(-1)
    mean_hz, logvar_hz = split_gaussian(global_decoder(z), logvar_range)
    log_p_h = gaussian_log_density(h, mean_hz, logvar_hz)
    return log_p_h + log_p_z - log_q_h - log_q_z


def latent_prior_terms(
    h: torch.Tensor,
    global_encoder: nn.Module,
    global_decoder: nn.Module,
    eps_z: torch.Tensor,
    logvar_range: Sequence[float] = (-8.0, 6.0),
) -> torch.Tensor:
    """``log p(h|z) + log p(z) - log q(z|h)`` for samples ``h`` ``(S, B, d_h)``, z from ``eps_z``: a one-sample
    estimate of ``log p(h)``, the latent part of an importance log-weight without the proposal's density (the
    adaptive estimator divides by a mixture of proposals, :mod:`.adaptive`)."""
    mean_z, logvar_z = split_gaussian(global_encoder(h), logvar_range)
    z = reparameterize(mean_z, logvar_z, eps_z)
    log_q_z = gaussian_log_density(z, mean_z, logvar_z)
    log_p_z = standard_normal_log_prob(z).sum(-1)
    mean_hz, logvar_hz = split_gaussian(global_decoder(z), logvar_range)
    return gaussian_log_density(h, mean_hz, logvar_hz) + log_p_z - log_q_z


def snis_weights(log_w: torch.Tensor, *, rowwise: bool = True) -> torch.Tensor:
    """Self-normalised importance weights ``(L, B)`` over the sample axis 0 (label-free: ``log_w`` holds no
    ``p(y|h)``).  ``rowwise``: computed along each row's last axis of a row-major copy, the same floats whatever else
    is in the batch (:func:`~.rowwise.samples_last`); ``False``: along axis 0, as before per-row predictions (a fit's
    validation keeps it)."""
    if not rowwise:
        return normalized_weights(log_w, dim=0)
    return normalized_weights(samples_last(log_w), dim=-1).t()


def predictive_log_probs(log_w: torch.Tensor, log_py: torch.Tensor, *, rowwise: bool = True) -> torch.Tensor:
    """``log sum_l w_l p(y|h_l)`` for every class: ``log_w`` ``(L, B)``, ``log_py`` ``(L, B, C)`` -> ``(B, C)``;
    ``rowwise`` as in :func:`snis_weights`."""
    if not rowwise:
        return torch.logsumexp(torch.log_softmax(log_w, dim=0).unsqueeze(-1) + log_py, dim=0)
    log_w_rows = torch.log_softmax(samples_last(log_w), dim=-1)  # (B, L)
    return torch.logsumexp(log_w_rows.unsqueeze(1) + samples_last(log_py), dim=-1)


def predictive_mean(log_w: torch.Tensor, values: torch.Tensor, *, rowwise: bool = True) -> torch.Tensor:
    """``sum_l w_l values_l``: ``log_w`` and ``values`` ``(L, B)`` -> ``(B,)``; ``rowwise`` as in
    :func:`snis_weights`."""
    if not rowwise:
        return (normalized_weights(log_w, dim=0) * values).sum(0)
    return (normalized_weights(samples_last(log_w), dim=-1) * samples_last(values)).sum(-1)


def effective_sample_size(log_w: torch.Tensor) -> torch.Tensor:
    """``(sum w)^2 / sum w^2 = 1 / sum w^2`` of each row's self-normalised weights: ``(L, B)`` -> ``(B,)`` (float64,
    row by row)."""
    w = normalized_weights(samples_last(log_w).double(), dim=-1)
    return 1.0 / (w * w).sum(-1)
