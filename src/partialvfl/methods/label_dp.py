"""Label differential privacy for the label holder: randomized response on the labels the coordinator trains with.

The active party replaces every label it trains with by a randomized one, once, before training
(:func:`randomize_labels`); every message a party then receives, the fitted model and its predictions are functions
of the randomized labels and of features, so they are ``epsilon``-label-DP by post-processing.

* **Randomized response over K classes** (Warner, 1965): keep the label with probability ``e^eps / (e^eps + K - 1)``,
  else one of the other ``K - 1`` classes uniformly.  For any two labels and any output the probabilities differ
  by a factor of at most ``e^eps``: exactly ``eps``-DP for one label, and each label is used once (a user's label
  is one row of the label table: the privacy unit).
* **Randomized response with a prior** (RRWithPrior, Ghazi, Golowich, Kumar, Manurangsi & Zhang, "Deep Learning with
  Label Differential Privacy", NeurIPS 2021, Algorithm 2): given a prior over classes for the row (computed without
  its label), restrict the answer to the ``k`` most likely classes, ``k`` chosen to maximise the probability that the
  answer is right, and run randomized response over those ``k``; a true label outside them is answered uniformly
  among them.  Still ``eps``-DP (the set depends on the prior only); with a good prior far fewer labels are flipped.

Unlabelled rows have no label and are left alone; which rows are labelled is *not* protected (the label mask is
public to the coordinator's code and visible in the traffic of some methods).  Regression targets are not covered.
Evaluation uses the true labels of the evaluation data (they are never trained on).

Both declare themselves here (:class:`~partialvfl.federation.dp.mechanism.PrivacyMechanism`, ``where="label"``):
the fit runs a label mechanism through its declared ``apply`` hook and debiases the class frequencies through its
``debias`` hook (:mod:`partialvfl.methods.private_fit`); another label mechanism is one module like this one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from partialvfl.federation.dp.mechanism import (
    LabelContext,
    LabelRelease,
    MechanismParam,
    PrivacyMechanism,
    register_mechanism,
)

__all__ = ["RANDOMIZED_RESPONSE", "RR_WITH_PRIOR", "debiased_frequencies", "randomize_labels", "rr_keep_probability",
           "rr_with_prior"]


def rr_keep_probability(epsilon: float, n_classes: int) -> float:
    """The probability that randomized response over ``n_classes`` keeps the true label: ``e^eps / (e^eps + K - 1)``."""
    _check(epsilon, n_classes)
    return 1.0 / (1.0 + (n_classes - 1) * math.exp(-float(epsilon)))


def _check(epsilon: float, n_classes: int) -> None:
    if not (isinstance(epsilon, int | float) and math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"label DP: epsilon must be a positive number, got {epsilon!r}")
    if n_classes < 2:
        raise ValueError(f"label DP needs at least two classes, got {n_classes}")


def randomize_labels(y: np.ndarray, labeled: np.ndarray, n_classes: int, epsilon: float, rng: np.random.Generator
                     ) -> np.ndarray:
    """``y`` with every labelled entry (class indices ``0..K-1``) passed through randomized response over
    ``n_classes`` at ``epsilon``; unlabelled entries unchanged."""
    _check(epsilon, n_classes)
    y = np.asarray(y).copy()
    rows = np.flatnonzero(labeled)
    keep = rng.random(rows.size) < rr_keep_probability(epsilon, n_classes)
    shift = rng.integers(1, n_classes, size=rows.size)  # one of the other K - 1 classes, uniformly
    true = y[rows].astype(np.int64)
    y[rows] = np.where(keep, true, (true + shift) % n_classes)
    return y


def rr_with_prior(y: np.ndarray, prior: np.ndarray, epsilon: float, rng: np.random.Generator) -> np.ndarray:
    """RRWithPrior (Ghazi et al., 2021, Algorithm 2) for labels ``y`` ``(N,)`` with priors ``prior`` ``(N, K)``."""
    prior = np.asarray(prior, dtype=np.float64)
    n, k_classes = prior.shape
    _check(epsilon, k_classes)
    order = np.argsort(-prior, axis=1, kind="stable")
    mass = np.cumsum(np.take_along_axis(prior, order, axis=1), axis=1)  # mass of the top-k, k = 1..K
    ks = np.arange(1, k_classes + 1)
    keep = math.exp(epsilon) / (math.exp(epsilon) + ks - 1)
    k = np.argmax(mass * keep[None, :], axis=1) + 1  # first maximiser: the smallest k among ties
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        top = order[i, :k[i]]
        true = int(y[i])
        if true in top and rng.random() < keep[k[i] - 1]:
            out[i] = true
        else:
            others = top[top != true]
            out[i] = int(others[rng.integers(len(others))]) if len(others) else true
    return out


def debiased_frequencies(noisy: np.ndarray, n_classes: int, epsilon: float) -> np.ndarray:
    """Class frequencies of the true labels estimated from randomized labels ``noisy`` (post-processing: still
    label-DP): the inverse of randomized response's mixing, clipped at 0 and renormalised."""
    counts = np.bincount(np.asarray(noisy, dtype=np.int64), minlength=n_classes).astype(np.float64)
    freq = counts / max(counts.sum(), 1.0)
    q = rr_keep_probability(epsilon, n_classes)
    r = (1.0 - q) / (n_classes - 1)
    est = np.clip((freq - r) / (q - r), 0.0, None)
    return est / est.sum() if est.sum() > 0 else np.full(n_classes, 1.0 / n_classes)


def _rr_event(params: Mapping[str, Any]) -> Any:
    """One label through randomized response over ``n_classes`` at ``label_dp``: ``dp-accounting``'s event that
    answers uniformly over all ``K`` classes with the probability giving the same output distribution."""
    import dp_accounting as dpa

    k = int(params["n_classes"])
    keep = rr_keep_probability(float(params["label_dp"]), k)
    return dpa.RandomizedResponseDpEvent(noise_parameter=k * (1 - keep) / (k - 1), num_buckets=k)


def _rr_apply(y: np.ndarray, labeled: np.ndarray, params: Mapping[str, Any], context: LabelContext
              ) -> LabelRelease:
    """Randomized response on every labelled row (seeded by the purpose ``randomized response``)."""
    out = randomize_labels(np.where(labeled, y, 0), labeled, context.n_classes, float(params["label_dp"]),
                           context.rng("randomized response"))
    return LabelRelease(np.where(labeled, out, y))


def _rr_prior_apply(y: np.ndarray, labeled: np.ndarray, params: Mapping[str, Any], context: LabelContext
                    ) -> LabelRelease:
    """RRWithPrior in two stages (Ghazi et al.): half of the labelled rows (seeded) get randomized response; a first
    fit on them alone predicts priors for the other half, whose labels then get RRWithPrior.  Each label is
    randomized once; only the first half's frequencies can be debiased."""
    if context.prior_fit is None:
        raise ValueError("label DP with a prior (rr-with-prior) needs the federation: its first stage is a fit")
    eps, k = float(params["label_dp"]), context.n_classes
    rows = np.flatnonzero(labeled)
    second = np.zeros(len(y), dtype=bool)
    second[context.rng("stages").permutation(rows)[: len(rows) // 2]] = True
    first = labeled & ~second
    y1 = randomize_labels(np.where(first, y, 0), first, k, eps, context.rng("randomized response"))
    priors = context.prior_fit(np.where(first, y1, y), first)[second]
    out = np.where(first, y1, y)
    out[second] = rr_with_prior(y[second].astype(np.int64), priors, eps, context.rng("rr with prior"))
    return LabelRelease(out, debias_rows=first)


def _rr_debias(noisy: np.ndarray, n_classes: int, params: Mapping[str, Any]) -> np.ndarray:
    return debiased_frequencies(noisy, n_classes, float(params["label_dp"]))


_LABEL_PARAMS = (
    MechanismParam("label_dp", "float", None, "the epsilon of label DP (fit --label-dp EPS; [labels] label_dp)"),
    MechanismParam("label_dp_seed", "int", None, "the seed of the randomization (null: derived from the seed)"),
)

#: Randomized response over the K classes on every training label (Warner, 1965).
RANDOMIZED_RESPONSE = register_mechanism(PrivacyMechanism(
    name="randomized-response",
    where="label",
    summary="randomized response over the K classes on every training label (label_dp=EPS)",
    params=_LABEL_PARAMS,
    dp_event=_rr_event,
    title="randomized response",
    apply=_rr_apply,
    debias=_rr_debias,
), __name__)

#: RRWithPrior (Ghazi et al., 2021): randomized response within each label's most likely classes under a prior
#: from a first fit; per label it is at most randomized response over all K classes at the same epsilon.
RR_WITH_PRIOR = register_mechanism(PrivacyMechanism(
    name="rr-with-prior",
    where="label",
    summary="randomized response with a prior (RRWithPrior, two stages: a first fit's prior narrows each label's "
            "answers; label_dp=EPS, label_dp_prior=true)",
    params=(*_LABEL_PARAMS,
            MechanismParam("label_dp_prior", "bool", False, "use the prior (a second fit); needs label_dp")),
    dp_event=_rr_event,
    title="randomized response with a prior (two stages)",
    apply=_rr_prior_apply,
    debias=_rr_debias,
), __name__)
