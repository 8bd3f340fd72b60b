"""The hand-written decoder log-density equals autograd's formula, in value and in gradient."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from partialvfl.nn.stats import feature_gaussian_log_density, gaussian_log_prob


def _reference(x: torch.Tensor, mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    if mean.dim() == 4:  # a leading party axis: x and logvar broadcast over samples (and rows)
        return gaussian_log_prob(x.unsqueeze(1), mean, logvar[:, None, None]).sum(-1)
    return gaussian_log_prob(x, mean, logvar).sum(-1)


@settings(max_examples=30, deadline=None)
@given(k=st.integers(0, 3), s=st.integers(1, 4), b=st.integers(1, 6), d=st.integers(1, 7), seed=st.integers(0, 99))
def test_value_and_gradients_equal_the_autograd_formula(k: int, s: int, b: int, d: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    lead = (k,) if k else ()  # k = 0: the single-party shapes (S, B, d)
    x = torch.randn(*lead, b, d, generator=gen, dtype=torch.float64)
    mean = torch.randn(*lead[:1], s, b, d, generator=gen, dtype=torch.float64, requires_grad=True)
    logvar = (torch.randn(*lead, d, generator=gen, dtype=torch.float64) * 2).requires_grad_(True)
    weights = torch.randn(*lead, s, b, generator=gen, dtype=torch.float64)

    got = feature_gaussian_log_density(x, mean, logvar)
    want = _reference(x, mean, logvar)
    assert got.shape == want.shape == (*lead, s, b)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad((got * weights).sum(), (mean, logvar))
    g_want = torch.autograd.grad((want * weights).sum(), (mean, logvar))
    for a, w in zip(g_got, g_want):
        torch.testing.assert_close(a, w)


def test_second_backward_through_a_retained_graph_gives_the_same_gradient() -> None:
    """The party-axis form back-propagated one party at a time through a retained graph gives each its own."""
    x, mean = torch.randn(2, 5, 3), torch.randn(2, 4, 5, 3, requires_grad=True)
    logvar = torch.zeros(2, 3, requires_grad=True)
    out = feature_gaussian_log_density(x, mean, logvar)
    first = torch.autograd.grad(out[0].sum(), mean, retain_graph=True)[0]
    second = torch.autograd.grad(out[0].sum(), mean)[0]
    torch.testing.assert_close(first, second)
    assert first[1].abs().max() == 0  # the other party's rows get nothing


def test_a_differentiable_x_or_other_shapes_use_the_plain_formula() -> None:
    x = torch.randn(5, 3, requires_grad=True)
    mean, logvar = torch.randn(4, 5, 3), torch.randn(3)
    out = feature_gaussian_log_density(x, mean, logvar)
    (grad,) = torch.autograd.grad(out.sum(), x)  # a gradient for x exists: the plain formula ran
    torch.testing.assert_close(out, gaussian_log_prob(x, mean, logvar).sum(-1))
    assert grad.shape == x.shape
    per_row_logvar = torch.randn(4, 5, 3)  # not a per-feature log-variance: broadcast as usual
    torch.testing.assert_close(feature_gaussian_log_density(x.detach(), mean, per_row_logvar),
                               gaussian_log_prob(x.detach(), mean, per_row_logvar).sum(-1))
