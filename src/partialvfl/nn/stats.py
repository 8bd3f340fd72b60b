"""Numerically safe log-space helpers and log-densities, shapes ``[samples, batch, dim]`` throughout."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["bernoulli_log_prob", "feature_gaussian_log_density", "float32", "gaussian_log_prob", "log_mean_exp",
           "normalized_weights", "standard_normal_log_prob"]

LOG_2PI = math.log(2 * math.pi)


def log_mean_exp(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """log(mean(exp(x))) along ``dim`` without overflow or underflow (log-sum-exp minus log n)."""
    return torch.logsumexp(x, dim=dim) - math.log(x.shape[dim])


def normalized_weights(log_w: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Self-normalised importance weights softmax(log_w) along ``dim``."""
    return torch.softmax(log_w, dim=dim)


@contextlib.contextmanager
def float32(t: torch.Tensor) -> Iterator[None]:
    """Compute in float32 even under bf16 autocast (the log-densities: a bfloat16 sum of squares keeps 3 digits)."""
    kind = t.device.type
    if kind != "meta" and torch.is_autocast_enabled(kind):
        with torch.autocast(device_type=kind, enabled=False):
            yield
    else:
        yield


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """Elementwise log N(x; mean, exp(logvar)) (sum over the last axis yourself), in float32 at least."""
    x, mean, logvar = (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t for t in (x, mean, logvar))
    return -0.5 * (LOG_2PI + logvar + (x - mean) ** 2 * torch.exp(-logvar))


class _FeatureGaussian(torch.autograd.Function):
    """``log N(x; mean, diag exp(logvar))`` summed over features, for canonical shapes (see the wrapper below).

    Written out by hand because autograd's version of the formula makes about sixteen passes over the
    ``(K, S, B, d)`` tensors (the largest elementwise work of a FALSE-VFL step); this makes six: forward
    ``mean - x``, its square and one batched matrix-vector product; backward one matrix-vector product for
    ``logvar`` and two passes for ``mean``.  ``x`` is data: no gradient flows to it.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
        k, s, b, d = mean.shape
        diff = mean - x.unsqueeze(1)  # (K, S, B, d)
        sq = diff * diff
        prec = torch.exp(-logvar)  # (K, d)
        q = torch.bmm(sq.view(k, s * b, d), prec.unsqueeze(-1)).view(k, s, b)
        ctx.save_for_backward(diff, sq, prec)
        return -0.5 * (q + (d * LOG_2PI + logvar.sum(-1)).view(k, 1, 1))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None, torch.Tensor | None]:
        diff, sq, prec = ctx.saved_tensors
        k, s, b, d = diff.shape
        grad_mean = grad_logvar = None
        with float32(grad):  # a backward pass run under bf16 autocast: the likelihood's gradient stays float32 too
            if ctx.needs_input_grad[2]:
                weighted = torch.bmm(grad.reshape(k, 1, s * b), sq.view(k, s * b, d)).view(k, d)
                grad_logvar = 0.5 * (prec * weighted - grad.sum((1, 2)).unsqueeze(-1))
            if ctx.needs_input_grad[1]:
                grad_mean = diff * (-prec).view(k, 1, 1, d)
                grad_mean.mul_(grad.unsqueeze(-1))
        return None, grad_mean, grad_logvar


def feature_gaussian_log_density(x: torch.Tensor, mean: torch.Tensor, logvar: torch.Tensor, *,
                                 rowwise: bool = False) -> torch.Tensor:
    """log N(x; mean_s, diag(exp(logvar))) summed over the last axis, for every sample s of the mean.

    The decoder likelihood of FALSE-VFL's parties: one data row per (sample, row) mean, a per-feature log-variance
    shared by every row.  Shapes: ``x (B, d)``, ``mean (S, B, d)``, ``logvar (d,)`` -> ``(S, B)``; or with a
    leading party axis, ``x (K, B, d)``, ``mean (K, S, B, d)``, ``logvar (K, d)`` -> ``(K, S, B)``.  These shapes
    (with ``x`` not requiring a gradient) take a hand-written pass at about a third of autograd's memory traffic;
    anything else (image-shaped features, a differentiable ``x``) is ``gaussian_log_prob(...).sum(-1)`` with the
    usual broadcasting, which is the same value.  ``rowwise`` (a prediction): always the latter, so that each
    (sample, row)'s sum is computed alone, the same floats whatever the batch (the hand-written pass is a matrix
    product over ``S * B`` rows, whose kernel, and so its last bits, may depend on that count: issue 33).
    """
    with float32(mean):  # bf16 autocast: the decoder ran in bfloat16, its likelihood runs in float32
        x, mean, logvar = (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t for t in (x, mean, logvar))
        if rowwise:
            return gaussian_log_prob(x, mean, logvar).sum(-1)
        if (not x.requires_grad and mean.dim() == 3 and x.shape == mean.shape[1:]
                and logvar.shape == mean.shape[-1:]):
            return _FeatureGaussian.apply(x.unsqueeze(0), mean.unsqueeze(0), logvar.unsqueeze(0)).squeeze(0)
        if (not x.requires_grad and mean.dim() == 4 and x.shape == (mean.shape[0], *mean.shape[2:])
                and logvar.shape == (mean.shape[0], mean.shape[-1])):
            return _FeatureGaussian.apply(x, mean, logvar)
        return gaussian_log_prob(x, mean, logvar).sum(-1)


def standard_normal_log_prob(x: torch.Tensor) -> torch.Tensor:
    """Elementwise log density of the standard normal at ``x``."""
    return -0.5 * (LOG_2PI + x**2)


def bernoulli_log_prob(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Elementwise log Bernoulli(target; sigmoid(logits)), stable for large |logits|."""
    return -torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="none")
