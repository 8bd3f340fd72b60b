"""Numerically safe log-space helpers and log-densities, shapes ``[samples, batch, dim]`` throughout."""

from __future__ import annotations

import math

import torch

__all__ = ["bernoulli_log_prob", "gaussian_log_prob", "log_mean_exp", "normalized_weights", "standard_normal_log_prob"]

LOG_2PI = math.log(2 * math.pi)


def log_mean_exp(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """log(mean(exp(x))) along ``dim`` without overflow or underflow (log-sum-exp minus log n)."""
    return torch.logsumexp(x, dim=dim) - math.log(x.shape[dim])


def normalized_weights(log_w: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Self-normalised importance weights softmax(log_w) along ``dim``."""
    return torch.softmax(log_w, dim=dim)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """Elementwise log N(x; mean, exp(logvar)) (sum over the last axis yourself)."""
    return -0.5 * (LOG_2PI + logvar + (x - mean) ** 2 * torch.exp(-logvar))


def standard_normal_log_prob(x: torch.Tensor) -> torch.Tensor:
    return -0.5 * (LOG_2PI + x**2)


def bernoulli_log_prob(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Elementwise log Bernoulli(target; sigmoid(logits)), stable for large |logits|."""
    return -torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="none")
