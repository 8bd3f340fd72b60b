"""Missingness mechanisms: which party blocks each sample keeps.

A mechanism is a small frozen object with a canonical, parseable ``name`` and
``sample(blocks, rng) -> observed``: from K fully observed, already standardised blocks (each ``(N, d_k)``) it
returns the ``(N, K)`` boolean observed matrix (``True`` = observed; the FALSE-VFL paper's mask ``m`` is its
negation).  :func:`parse_mechanism` turns names into mechanisms; ``parse_mechanism(m.name) == m``.

Mechanisms (FALSE-VFL paper, section 5.1 and Appendix D.3, unless noted):

* ``none``: every block observed.
* ``mcar:P``: each block missing independently with probability P.  The paper's ``mcar0``, ``mcar2``, ``mcar5``
  are P = 0.0, 0.2, 0.5.
* ``mar1`` (Algorithm 1, "stop at the first highly informative piece"): blocks are visited in a random order,
  drawn independently per sample; with threshold T = 1.1 and decrement 0.15, a visited block with variance
  v > T stops the walk, otherwise T <- T - 0.15 and the next block is visited.  Visited blocks (including the one
  that stopped the walk) are observed, the rest missing; if nothing stops the walk every block is visited.
  Override as ``mar1:threshold=1.1,decrement=0.15``.
* ``mar2`` (Algorithm 2, "accumulate moderately informative pieces"): T = 0.5, budget B = 0.7, decrement 0.15;
  at each visited block, if v > T then B <- B - (v - T); if B <= 0 the walk stops, else T <- T - 0.15.  The paper
  uses ``mar2:budget=0.5`` for ModelNet10.  Override as ``mar2:threshold=0.5,budget=0.7,decrement=0.15``.
* ``mnar:P``: with xbar the mean of the sample's (standardised) features in a block, the block is dropped with
  probability P if xbar < 0 and with probability 1 - P otherwise.  ``mnar7``, ``mnar9`` are P = 0.7, 0.9.
* ``beta`` (LASER-VFL, appendix): a per-block missing probability p_k ~ Beta(2, 2) is drawn once per application
  (once per call of ``sample``), then each block k is missing independently with probability p_k.
  ``beta:a=2.0,b=2.0`` sets the Beta parameters.
* ``absent:K`` (``absent:0,3``): the listed parties are missing for every sample, all others observed.

The block variance v of MAR is the variance (ddof = 0) of the sample's own standardised features within that
party's block: the paper computes "the variance v of the chosen piece" after "all datasets are normalized to ensure
scale consistency across features" (Appendix D.3), i.e. the spread of the piece's values, not a variance across
samples.  A single-feature block therefore has v = 0.

Samples may end with no observed party (MCAR, MNAR, beta and absent can produce that; MAR always observes the first
visited block).  They are kept and counted (``VerticalDataset.summary()["all_missing"]``), never re-drawn: the paper
is silent on this, and re-drawing would change the mechanism's distribution.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "AbsentParties",
    "BetaMCAR",
    "Complete",
    "MAR1",
    "MAR2",
    "MCAR",
    "MNAR",
    "Mechanism",
    "MechanismError",
    "PAPER_TEST_MECHANISMS",
    "PAPER_TRAIN_MECHANISMS",
    "block_means",
    "block_variances",
    "parse_mechanism",
    "random_visit_order",
]


class MechanismError(ValueError):
    """A mechanism name or parameter is invalid, or the blocks it is applied to are; the message says which."""


@runtime_checkable
class Mechanism(Protocol):
    """Anything with a canonical ``name`` and ``sample(blocks, rng) -> (N, K) bool observed matrix``."""

    @property
    def name(self) -> str:
        """The canonical name, as :func:`parse_mechanism` reads it back."""

    def sample(self, blocks: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
        """Draw the ``(N, K)`` boolean observed matrix of the party ``blocks`` from ``rng``."""


# ---------------------------------------------------------------------- block statistics
def _check_blocks(blocks: Sequence[np.ndarray]) -> tuple[list[np.ndarray], int]:
    arrs = [np.asarray(b) for b in blocks]
    if not arrs:
        raise MechanismError("a mechanism needs at least one party block")
    n = arrs[0].shape[0]
    out = []
    for k, b in enumerate(arrs):
        if b.ndim < 1 or b.shape[0] != n:
            raise MechanismError(f"party {k}'s block has shape {b.shape}; every block needs the same {n} rows")
        b = b.reshape(n, -1)
        if b.shape[1] == 0:
            raise MechanismError(f"party {k}'s block has no features")
        if not np.all(np.isfinite(b)):
            raise MechanismError(
                f"party {k}'s block has NaN or infinite values; mechanisms are applied to fully observed blocks"
            )
        out.append(b)
    return out, n


def block_variances(blocks: Sequence[np.ndarray]) -> np.ndarray:
    """``(N, K)``: the variance (ddof 0) of each sample's own features within each party block."""
    arrs, _ = _check_blocks(blocks)
    return np.stack([b.var(axis=1, dtype=np.float64) for b in arrs], axis=1)


def block_means(blocks: Sequence[np.ndarray]) -> np.ndarray:
    """``(N, K)``: the mean of each sample's own features within each party block."""
    arrs, _ = _check_blocks(blocks)
    return np.stack([b.mean(axis=1, dtype=np.float64) for b in arrs], axis=1)


def random_visit_order(n_samples: int, n_parties: int, rng: np.random.Generator) -> np.ndarray:
    """``(N, K)`` int: an independent uniformly random permutation of the parties for every sample."""
    return np.argsort(rng.random((n_samples, n_parties)), axis=1, kind="stable")


def _fmt(x: float) -> str:
    return repr(float(x))


def _check_probability(p: float, what: str) -> float:
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise MechanismError(f"{what} must be a probability in [0, 1], got {p}")
    return p


def _check_finite(x: float, what: str) -> float:
    x = float(x)
    if not np.isfinite(x):
        raise MechanismError(f"{what} must be a finite number, got {x}")
    return x


# ---------------------------------------------------------------------- mechanisms
@dataclass(frozen=True)
class Complete:
    """Every block observed."""

    @property
    def name(self) -> str:
        """The canonical name, as :func:`parse_mechanism` reads it back."""
        return "none"

    def sample(self, blocks: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
        """Draw the ``(N, K)`` boolean observed matrix of the party ``blocks`` from ``rng``."""
        arrs, n = _check_blocks(blocks)
        return np.ones((n, len(arrs)), dtype=bool)


_PAPER_P = {0.0: "0", 0.2: "2", 0.5: "5", 0.7: "7", 0.9: "9"}


@dataclass(frozen=True)
class MCAR:
    """Each block missing independently with probability ``p``."""

    p: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "p", _check_probability(self.p, "MCAR missing probability"))

    @property
    def name(self) -> str:
        """The canonical name, as :func:`parse_mechanism` reads it back."""
        return f"mcar{_PAPER_P[self.p]}" if self.p in (0.0, 0.2, 0.5) else f"mcar:{_fmt(self.p)}"

    def sample(self, blocks: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
        """Draw the ``(N, K)`` boolean observed matrix of the party ``blocks`` from ``rng``."""
        arrs, n = _check_blocks(blocks)
        return rng.random((n, len(arrs))) >= self.p


@dataclass(frozen=True)
class MNAR:
    """Block dropped with probability ``p`` if the sample's block mean is negative, else with ``1 - p``."""

    p: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "p", _check_probability(self.p, "MNAR drop probability"))

    @property
    def name(self) -> str:
        """The canonical name, as :func:`parse_mechanism` reads it back."""
        return f"mnar{_PAPER_P[self.p]}" if self.p in (0.7, 0.9) else f"mnar:{_fmt(self.p)}"

    def sample(self, blocks: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
        """Draw the ``(N, K)`` boolean observed matrix of the party ``blocks`` from ``rng``."""
        means = block_means(blocks)
        drop_prob = np.where(means < 0, self.p, 1.0 - self.p)
        return rng.random(means.shape) >= drop_prob


@dataclass(frozen=True)
class MAR1:
    """FALSE-VFL Algorithm 1: visit blocks in random order, stop at the first with variance above the threshold."""

    threshold: float = 1.1
    decrement: float = 0.15

    def __post_init__(self) -> None:
        object.__setattr__(self, "threshold", _check_finite(self.threshold, "MAR 1 threshold"))
        object.__setattr__(self, "decrement", _check_finite(self.decrement, "MAR 1 decrement"))

    @property
    def name(self) -> str:
        """The canonical name, as :func:`parse_mechanism` reads it back."""
        return _param_name("mar1", self, MAR1())

    def thresholds(self, n_parties: int) -> np.ndarray:
        """The threshold in force at each visiting step (lowered by ``decrement`` per step, as in Algorithm 1)."""
        return _thresholds(self.threshold, self.decrement, n_parties)

    def observe_in_order(self, variances: np.ndarray, order: np.ndarray) -> np.ndarray:
        """Observed matrix given per-sample block variances ``(N, K)`` and visiting orders ``(N, K)``."""
        v_steps = _in_order(variances, order)
        stop = v_steps > self.thresholds(v_steps.shape[1])
        return _visited(stop, order)

    def sample(self, blocks: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
        """Draw the ``(N, K)`` boolean observed matrix of the party ``blocks`` from ``rng``."""
        v = block_variances(blocks)
        return self.observe_in_order(v, random_visit_order(*v.shape, rng))


@dataclass(frozen=True)
class MAR2:
    """FALSE-VFL Algorithm 2: visit blocks in random order, spend ``v - T`` of a budget per block above T."""

    threshold: float = 0.5
    budget: float = 0.7
    decrement: float = 0.15

    def __post_init__(self) -> None:
        object.__setattr__(self, "threshold", _check_finite(self.threshold, "MAR 2 threshold"))
        object.__setattr__(self, "budget", _check_finite(self.budget, "MAR 2 budget"))
        object.__setattr__(self, "decrement", _check_finite(self.decrement, "MAR 2 decrement"))

    @property
    def name(self) -> str:
        """The canonical name, as :func:`parse_mechanism` reads it back."""
        return _param_name("mar2", self, MAR2())

    def thresholds(self, n_parties: int) -> np.ndarray:
        """The threshold in force at each visiting step."""
        return _thresholds(self.threshold, self.decrement, n_parties)

    def observe_in_order(self, variances: np.ndarray, order: np.ndarray) -> np.ndarray:
        """Observed matrix given per-sample block variances ``(N, K)`` and visiting orders ``(N, K)``."""
        v_steps = _in_order(variances, order)
        excess = np.maximum(v_steps - self.thresholds(v_steps.shape[1]), 0.0)
        remaining = self.budget - np.cumsum(excess, axis=1)
        return _visited(remaining <= 0, order)

    def sample(self, blocks: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
        """Draw the ``(N, K)`` boolean observed matrix of the party ``blocks`` from ``rng``."""
        v = block_variances(blocks)
        return self.observe_in_order(v, random_visit_order(*v.shape, rng))


@dataclass(frozen=True)
class BetaMCAR:
    """LASER-VFL's non-uniform MCAR: p_k ~ Beta(a, b) per block, drawn once per call, then MCAR with p_k."""

    a: float = 2.0
    b: float = 2.0

    def __post_init__(self) -> None:
        for f in ("a", "b"):
            v = _check_finite(getattr(self, f), f"Beta parameter {f}")
            if v <= 0:
                raise MechanismError(f"Beta parameter {f} must be positive, got {v}")
            object.__setattr__(self, f, v)

    @property
    def name(self) -> str:
        """The canonical name, as :func:`parse_mechanism` reads it back."""
        return _param_name("beta", self, BetaMCAR())

    def sample(self, blocks: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
        """Draw the ``(N, K)`` boolean observed matrix of the party ``blocks`` from ``rng``."""
        arrs, n = _check_blocks(blocks)
        p_missing = rng.beta(self.a, self.b, size=len(arrs))
        return rng.random((n, len(arrs))) >= p_missing


@dataclass(frozen=True)
class AbsentParties:
    """The listed parties are missing for every sample; all others observed."""

    parties: tuple[int, ...]

    def __post_init__(self) -> None:
        parties = tuple(sorted({int(p) for p in self.parties}))
        if not parties:
            raise MechanismError("'absent' needs at least one party index, e.g. 'absent:0'")
        if parties[0] < 0:
            raise MechanismError(f"absent party indices must be >= 0, got {parties[0]}")
        object.__setattr__(self, "parties", parties)

    @property
    def name(self) -> str:
        """The canonical name, as :func:`parse_mechanism` reads it back."""
        return "absent:" + ",".join(str(p) for p in self.parties)

    def sample(self, blocks: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
        """Draw the ``(N, K)`` boolean observed matrix of the party ``blocks`` from ``rng``."""
        arrs, n = _check_blocks(blocks)
        k = len(arrs)
        if self.parties[-1] >= k:
            raise MechanismError(f"absent party {self.parties[-1]} does not exist: there are {k} parties (0..{k - 1})")
        observed = np.ones((n, k), dtype=bool)
        observed[:, list(self.parties)] = False
        return observed


# ---------------------------------------------------------------------- MAR helpers
def _thresholds(start: float, decrement: float, k: int) -> np.ndarray:
    out = np.empty(k)
    t = start
    for s in range(k):  # repeated subtraction, exactly as Algorithms 1 and 2 lower T
        out[s] = t
        t -= decrement
    return out


def _check_order(variances: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    variances = np.asarray(variances, dtype=np.float64)
    order = np.asarray(order)
    if variances.ndim != 2 or order.shape != variances.shape:
        raise MechanismError(
            f"variances and visiting orders must both be (samples, parties), got {variances.shape} and {order.shape}"
        )
    k = variances.shape[1]
    if order.size and not np.array_equal(np.sort(order, axis=1), np.broadcast_to(np.arange(k), order.shape)):
        raise MechanismError(f"every visiting order must be a permutation of the parties 0..{k - 1}")
    return variances, order.astype(np.int64)


def _in_order(variances: np.ndarray, order: np.ndarray) -> np.ndarray:
    variances, order = _check_order(variances, order)
    return np.take_along_axis(variances, order, axis=1)


def _visited(stop: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Blocks visited up to and including the first step where ``stop`` holds (all of them if it never does)."""
    n, k = stop.shape
    last = np.where(stop.any(axis=1), stop.argmax(axis=1), k - 1)
    visited_steps = np.arange(k)[None, :] <= last[:, None]
    observed = np.zeros((n, k), dtype=bool)
    np.put_along_axis(observed, np.asarray(order, dtype=np.int64), visited_steps, axis=1)
    return observed


# ---------------------------------------------------------------------- names
def _param_name(base: str, obj: object, default: object) -> str:
    changed = [f.name for f in fields(obj) if getattr(obj, f.name) != getattr(default, f.name)]  # type: ignore[arg-type]
    if not changed:
        return base
    return base + ":" + ",".join(f"{f}={_fmt(getattr(obj, f))}" for f in changed)


_FORMS = (
    "'none', 'mcar:P' (or mcar0, mcar2, mcar5), 'mnar:P' (or mnar7, mnar9), "
    "'mar1' or 'mar1:threshold=T,decrement=D', 'mar2' or 'mar2:threshold=T,budget=B,decrement=D', "
    "'beta' or 'beta:a=A,b=B', 'absent:K' or 'absent:K1,K2' (P a probability in [0, 1], K a party index)"
)

_SHORT = {
    "none": Complete(),
    "mcar0": MCAR(0.0),
    "mcar2": MCAR(0.2),
    "mcar5": MCAR(0.5),
    "mnar7": MNAR(0.7),
    "mnar9": MNAR(0.9),
}

_PARAMETRISED = {"mar1": MAR1, "mar2": MAR2, "beta": BetaMCAR}

#: The FALSE-VFL paper's six training and seven test mechanisms (section 5.1), by canonical name.
PAPER_TRAIN_MECHANISMS = ("mcar2", "mcar5", "mar1", "mar2", "mnar7", "mnar9")
PAPER_TEST_MECHANISMS = ("mcar0", "mcar2", "mcar5", "mar1", "mar2", "mnar7", "mnar9")


def _bad(text: str, why: str = "") -> MechanismError:
    return MechanismError(f"unknown missingness mechanism {text!r}{': ' + why if why else ''}; valid forms: {_FORMS}")


def _number(text: str, token: str) -> float:
    try:
        return float(token)
    except ValueError:
        raise _bad(text, f"{token!r} is not a number") from None


def parse_mechanism(text: str | Mechanism) -> Mechanism:
    """A mechanism from its name (see the module docstring); a Mechanism object is returned unchanged."""
    if not isinstance(text, str):
        if isinstance(text, Mechanism):
            return text
        raise _bad(repr(text), "expected a name")
    s = re.sub(r"\s+", "", text.lower())
    if s in _SHORT:
        return _SHORT[s]
    base, sep, args = s.partition(":")
    if base in _PARAMETRISED:
        cls = _PARAMETRISED[base]
        if not sep:
            return cls()
        allowed = [f.name for f in fields(cls)]
        kwargs: dict[str, float] = {}
        for item in args.split(","):
            key, eq, value = item.partition("=")
            if not eq or key not in allowed:
                raise _bad(text, f"{base} takes {', '.join(f'{a}=' for a in allowed)} parameters, got {item!r}")
            if key in kwargs:
                raise _bad(text, f"parameter {key} given twice")
            kwargs[key] = _number(text, value)
        try:
            return cls(**kwargs)
        except MechanismError as e:
            raise _bad(text, str(e)) from None
    if base in ("mcar", "mnar") and sep:
        p = _number(text, args)
        try:
            return MCAR(p) if base == "mcar" else MNAR(p)
        except MechanismError as e:
            raise _bad(text, str(e)) from None
    if base == "absent" and sep:
        tokens = args.split(",")
        if not all(t.isdigit() for t in tokens):
            raise _bad(text, "absent takes a comma list of party indices 0..K-1")
        return AbsentParties(tuple(int(t) for t in tokens))
    raise _bad(text)
