"""A party's own differential-privacy budget for its rows: the Gaussian mechanism on everything it releases, DP-SGD
on its own updates, a ledger per row, and the accountant (Google's ``dp-accounting``).

**Privacy unit**: one row of the party's table, i.e. the feature values of one user it holds.  Neighbouring tables
differ in the values of one row (*replace-one*): which users a party holds is revealed by the alignment (the
observed matrix) and is not protected.

**Mechanisms.**  Each is a Gaussian mechanism whose sensitivity under replace-one is ``2 C`` for a clip norm ``C``:

* *release*: every reply tensor a program declares in ``releases``
  (:class:`~partialvfl.federation.wire.schema.MessageSpec`) is clipped per row to L2 norm ``C`` (the plan's clip for
  that tensor) and gets ``N(0, (2 z C)^2)`` noise on every value; each (row, tensor) pair costs the row ``1 / z^2``;
* *update* (DP-SGD): the program's own parameter update is the sum of per-row gradients clipped to ``C_g`` plus
  ``N(0, (2 z C_g)^2)`` noise (:meth:`PartyPrivacy.private_sum`); it costs every row of the batch ``1 / z^2``.

**Composition.**  A row's privacy loss after Gaussian mechanisms with noise multipliers ``z_1, z_2, ...`` is exactly
that of one Gaussian mechanism with ``mu^2 = sum_j 1 / z_j^2`` (mu-GDP composition; Dong, Roth & Su, 2022), also
when the coordinator chooses adaptively which rows to ask for and the party stops at its budget (fully adaptive
composition of Gaussian DP with a privacy filter; Smith & Thakurta, 2022).  The ledger therefore keeps ``mu^2`` per
row, and a request that would take any row beyond the budget's ``mu`` is refused before anything is released
(:class:`~partialvfl.federation.wire.refusals.PolicyViolation`, rule ``dp_epsilon``).  ``(epsilon, delta)`` and ``mu``
are converted with the exact curve of the Gaussian mechanism in ``dp-accounting`` (its privacy-loss-distribution module:
Balle & Wang's analytic Gaussian mechanism); nothing here computes a privacy loss of its own.  No amplification by
subsampling is claimed (batches are shuffled epochs, not Poisson samples).

**Calibration.**  The coordinator's ``setup`` carries a plan (:class:`PrivacyPlan`): how many mechanisms per row the
method will use (``charges``) and the clip norms.  The party picks ``z = sqrt(charges / remaining mu^2)`` of its
most-charged row, so the plan fits its remaining budget; a coordinator that understates the plan gets less noise and
is refused earlier, one that overstates it gets more noise.  Either way no row exceeds the budget.

**Other mechanisms.**  The ledger, the plan, the clipping and the refusals are the party's whatever mechanism it
runs; what noises a release or an update, how the noise is calibrated and what one application costs are the
declared hooks of the release mechanism its policy names (``[policy] dp_mechanism``, default ``gaussian``: the
functions of this module are its hooks; :mod:`partialvfl.federation.dp.mechanism`).  torch is imported where noise
is drawn, so that the declaration imports without it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from partialvfl.federation.dp.mechanism import MechanismParam, PrivacyMechanism, ReleaseHooks, register_mechanism
from partialvfl.federation.wire.refusals import PolicyViolation

if TYPE_CHECKING:
    import torch

__all__ = ["GAUSSIAN", "DPBudget", "PartyPrivacy", "PrivacyLedger", "PrivacyPlan", "budget_mu", "clip_rows",
           "clip_together", "gaussian_epsilon", "private_reply"]

RULE = "dp_epsilon"


@lru_cache(maxsize=64)
def budget_mu(epsilon: float, delta: float) -> float:
    """The largest ``mu`` (sensitivity / noise standard deviation) of one Gaussian mechanism that is
    ``(epsilon, delta)``-DP, from ``dp-accounting``'s exact Gaussian privacy loss."""
    from dp_accounting.pld.common import DifferentialPrivacyParameters
    from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss

    loss = GaussianPrivacyLoss.from_privacy_guarantee(DifferentialPrivacyParameters(float(epsilon), float(delta)),
                                                      sensitivity=1.0)
    return 1.0 / float(loss.standard_deviation)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """``epsilon`` at ``delta`` of one Gaussian mechanism with ``sensitivity / sigma = mu`` (0 for ``mu = 0``): the
    root of ``dp-accounting``'s exact ``delta(epsilon)`` curve."""
    from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss
    from scipy.optimize import brentq

    if mu <= 0:
        return 0.0
    loss = GaussianPrivacyLoss(standard_deviation=1.0 / float(mu), sensitivity=1.0)

    def excess(eps: float) -> float:
        return float(loss.get_delta_for_epsilon(eps)) - float(delta)

    if excess(0.0) <= 0:
        return 0.0
    hi = 1.0
    while excess(hi) > 0:
        hi *= 2.0
    return float(brentq(excess, 0.0, hi, xtol=1e-10))


@dataclass(frozen=True)
class DPBudget:
    """``(epsilon, delta)``-DP for every row of a party's table, over everything it ever releases."""

    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"dp_epsilon must be a positive number, got {self.epsilon!r}")
        if not 0 < self.delta < 1:
            raise ValueError(f"dp_delta must lie strictly between 0 and 1, got {self.delta!r}")

    @property
    def mu(self) -> float:
        """The budget as the mu of Gaussian differential privacy (what the ledger adds up in mu squared)."""
        return budget_mu(self.epsilon, self.delta)

    def describe(self) -> str:
        """The budget in words."""
        return f"epsilon {self.epsilon:g}, delta {self.delta:g} per row"


class PrivacyLedger:
    """``mu^2`` spent by every row the party ever released something about, keyed by the row's ID (its own table's
    ID), across every program, fit and prediction; written to ``path`` (if given) before each charged reply leaves."""

    def __init__(self, budget: DPBudget, path: str | Path | None = None, where: str = "this party") -> None:
        self.budget = budget
        self.where = where
        self.limit = budget.mu ** 2
        self.path = Path(path) if path is not None else None
        self._slot: dict[str, int] = {}
        self._mu2 = np.zeros(0)
        self._eps_cache: tuple[float, float] | None = None
        if self.path is not None and self.path.exists():
            with np.load(self.path, allow_pickle=False) as saved:
                ids, mu2 = saved["ids"].astype(str), saved["mu2"].astype(np.float64)
            self._slot = {k: i for i, k in enumerate(ids.tolist())}
            self._mu2 = mu2

    @property
    def n_rows(self) -> int:
        """The number of rows the ledger accounts for."""
        return len(self._slot)

    def max_mu2(self) -> float:
        """The largest mu squared any row has spent."""
        return float(self._mu2.max()) if self._mu2.size else 0.0

    def remaining_mu2(self) -> float:
        """What the most-spent row has left, in mu squared (never negative)."""
        return max(self.limit - self.max_mu2(), 0.0)

    def epsilon_spent(self) -> float:
        """The epsilon of the most-charged row (every other row has spent at most this)."""
        mu2 = self.max_mu2()
        if self._eps_cache is None or self._eps_cache[0] != mu2:
            self._eps_cache = (mu2, gaussian_epsilon(math.sqrt(mu2), self.budget.delta))
        return self._eps_cache[1]

    def _slots(self, keys: Sequence[str]) -> np.ndarray:
        new = [k for k in dict.fromkeys(keys) if k not in self._slot]
        if new:
            start = len(self._slot)
            self._slot.update({k: start + i for i, k in enumerate(new)})
            self._mu2 = np.concatenate([self._mu2, np.zeros(len(new))])
        return np.fromiter((self._slot[k] for k in keys), dtype=np.int64, count=len(keys))

    def after(self, keys: Sequence[str], cost: float) -> tuple[np.ndarray, np.ndarray]:
        """The slots of ``keys`` and their ``mu^2`` once each occurrence is charged ``cost``."""
        slots = self._slots([str(k) for k in keys])
        total = self._mu2.copy()
        np.add.at(total, slots, float(cost))
        return slots, total

    def charge(self, keys: Sequence[str], cost: float, what: str) -> None:
        """Charge ``cost`` (``1 / z^2``) for every occurrence of ``keys``; refuse, charging nothing, if a row would
        exceed the budget."""
        if len(keys) == 0:
            return
        slots, total = self.after(keys, cost)
        worst = int(slots[np.argmax(total[slots])])
        if total[worst] > self.limit * (1 + 1e-9):
            self._refuse(what, worst, total[worst])
        self._mu2 = total
        self.save()

    def _refuse(self, what: str, slot: int, mu2: float) -> None:
        row = next(k for k, s in self._slot.items() if s == slot)
        need = gaussian_epsilon(math.sqrt(mu2), self.budget.delta)
        raise PolicyViolation(RULE, f"{self.where}: its differential-privacy budget ({self.budget.describe()}) is "
                              f"spent: {what} would bring row {row!r} to epsilon {need:.3g}", need,
                              {"dp_epsilon": float(f"{need:.3g}")})

    def save(self) -> None:
        """Write the ledger to its file (nothing for a ledger without one)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp.npz")
        ids = np.array(sorted(self._slot, key=self._slot.__getitem__), dtype=str)
        np.savez(tmp, ids=ids, mu2=self._mu2)
        os.replace(tmp, self.path)


@dataclass(frozen=True)
class PrivacyPlan:
    """What a setup asks of a party with a budget: ``charges`` mechanisms per row at most (releases and updates), the
    clip norm per released tensor (as its message declares it; ``default_clip`` for the others) and the per-row
    gradient clip of the party's own updates."""

    charges: int
    clip: Mapping[str, float] = field(default_factory=dict)
    default_clip: float = 1.0
    grad_clip: float = 1.0

    @classmethod
    def from_meta(cls, meta: Any) -> PrivacyPlan:
        """The plan a setup message carries (a table; malformed values are a ``ValueError``)."""
        if not isinstance(meta, Mapping):
            raise ValueError(f"the privacy plan must be a table, got {type(meta).__name__}")
        try:
            plan = cls(int(meta["charges"]), {str(k): float(v) for k, v in dict(meta.get("clip", {})).items()},
                       float(meta.get("default_clip", 1.0)), float(meta.get("grad_clip", 1.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed privacy plan {dict(meta)!r} ({type(e).__name__}: {e})") from None
        clips = [plan.default_clip, plan.grad_clip, *plan.clip.values()]
        if plan.charges < 1 or not all(math.isfinite(c) and c > 0 for c in clips):
            raise ValueError(f"a privacy plan needs charges >= 1 and positive clip norms, got {dict(meta)!r}")
        return plan


def clip_rows(t: torch.Tensor, clip: float, axis: int = 0) -> torch.Tensor:
    """``t`` with every slice along ``axis`` (a row) scaled down to L2 norm at most ``clip`` (differentiable)."""
    import torch

    moved = t.movedim(axis, 0)
    flat = moved.reshape(moved.shape[0], -1)
    norm = flat.norm(dim=1, keepdim=True)
    scale = torch.clamp(clip / norm.clamp_min(1e-12), max=1.0)
    return (flat * scale).reshape(moved.shape).movedim(0, axis)


def clip_together(parts: Sequence[tuple[torch.Tensor, float]], axis: int = 0) -> list[torch.Tensor]:
    """Tensors about the same rows (along ``axis``) clipped as the party releases them: each row's slices, divided by
    their clip norms, scaled jointly to norm at most 1 (differentiable; :func:`private_reply` then finds nothing to
    clip)."""
    import torch

    sq = None
    for t, clip in parts:
        moved = t.movedim(axis, 0)
        term = (moved.reshape(moved.shape[0], -1) / clip).pow(2).sum(dim=1)
        sq = term if sq is None else sq + term
    assert sq is not None
    scale = torch.clamp(1.0 / sq.clamp_min(1e-24).sqrt(), max=1.0)
    out = []
    for t, _ in parts:
        shape = [1] * t.dim()
        shape[axis] = -1
        out.append(t * scale.view(shape))
    return out


class PartyPrivacy:
    """A party's budget at work: the ledger, the current setup's noise multiplier and clips, the noise generator, and
    the release mechanism that noises (``mechanism``: a declared release mechanism, default :data:`GAUSSIAN`)."""

    def __init__(self, budget: DPBudget, where: str, path: str | Path | None = None,
                 mechanism: PrivacyMechanism | None = None) -> None:
        mechanism = mechanism if mechanism is not None else GAUSSIAN
        if mechanism.where != "release" or mechanism.release is None:
            raise ValueError(f"{where}: privacy mechanism {mechanism.name!r} is not a release mechanism")
        self.mechanism = mechanism
        self.hooks: ReleaseHooks = mechanism.release
        self.budget = budget
        self.where = where
        self.ledger = PrivacyLedger(budget, path, where)
        self.plan: PrivacyPlan | None = None
        self.z = math.inf
        self._gen: torch.Generator | None = None

    def configure(self, plan_meta: Any, seed: int) -> dict[str, Any]:
        """Calibrate the noise of a new setup to its plan and the remaining budget; refuse if none is left."""
        if plan_meta is None:
            raise PolicyViolation(RULE, f"{self.where} releases its rows only under its differential-privacy budget "
                                  f"({self.budget.describe()}): the setup must carry a privacy plan (the charges per "
                                  "row and clip norms it needs), which methods that support differential privacy send")
        plan = PrivacyPlan.from_meta(plan_meta)
        remaining = self.ledger.remaining_mu2()
        if remaining <= 0:
            raise PolicyViolation(RULE, f"{self.where}: its differential-privacy budget ({self.budget.describe()}) is "
                                  "spent; it releases nothing more about its rows", self.budget.epsilon)
        z = float(self.hooks.calibrate(plan.charges, remaining))
        if not (math.isfinite(z) and z > 0):
            raise ValueError(f"{self.where}: privacy mechanism {self.mechanism.name!r} calibrated a noise multiplier "
                             f"{z!r} (it must be a positive number)")
        from partialvfl.utils.seeding import torch_generator

        self.plan, self.z = plan, z
        self._gen = torch_generator(seed, "dp-noise")
        return self.report()

    @property
    def cost(self) -> float:
        """``mu^2`` one mechanism of the current setup costs a row (the mechanism's declared cost)."""
        return float(self.hooks.cost(self.z))

    def clip_for(self, declared: str) -> float:
        """The clipping bound of the declared release ``declared`` (the plan's default if it names none)."""
        assert self.plan is not None
        return float(self.plan.clip.get(declared, self.plan.default_clip))

    def joint_noisy(self, parts: Sequence[tuple[str, torch.Tensor, float, int, list[str]]], keys: list[str]
                    ) -> dict[str, torch.Tensor]:
        """Every part ``(name, tensor, clip, axis, row keys)`` with each row's slices, over all parts and divided by
        their clips, clipped jointly to norm 1, then noised by the mechanism (Gaussian: standard deviation ``2 z`` in
        those units)."""
        import torch

        assert self._gen is not None
        slot = {k: i for i, k in enumerate(keys)}
        norms = torch.zeros(len(keys), dtype=torch.float64)
        flat = []
        for _, t, clip, axis, ks in parts:
            rows = _as_rows(t, axis) / clip
            index = torch.as_tensor([slot[k] for k in ks], dtype=torch.long)
            norms.index_add_(0, index, (rows ** 2).sum(dim=1))
            flat.append((rows, index))
        scale = torch.clamp(1.0 / norms.sqrt().clamp_min(1e-12), max=1.0)
        out = {}
        for (name, t, clip, axis, _), (rows, index) in zip(parts, flat):
            noisy = self.hooks.noise_release(rows * scale[index, None], self.z, self._gen) * clip
            moved = t.movedim(axis, 0)
            out[name] = noisy.reshape(moved.shape).movedim(0, axis).to(t.dtype)
        return out

    def private_sum(self, keys: Sequence[str], per_row: torch.Tensor, what: str) -> torch.Tensor:
        """DP-SGD: the sum over rows of ``per_row`` ``(B, P)`` gradients, each clipped to the plan's ``grad_clip``,
        plus the mechanism's noise (Gaussian: ``N(0, (2 z grad_clip)^2)``); charges every row of ``keys`` (one per row
        of ``per_row``) once."""
        import torch

        assert self.plan is not None and self._gen is not None
        if len(keys) != per_row.shape[0]:
            raise ValueError(f"{self.where}: {len(keys)} row keys for {per_row.shape[0]} per-row gradients")
        self.ledger.charge(list(keys), self.cost, what)
        c = self.plan.grad_clip
        g = per_row.detach()
        scale = torch.clamp(c / g.norm(dim=1, dtype=torch.float64).clamp_min(1e-12), max=1.0)
        total = (scale.to(g.dtype) @ g).double()  # the clipped rows' sum
        return self.hooks.noise_sum(total, self.z, c, self._gen).to(per_row.dtype)

    def report(self) -> dict[str, Any]:
        """What the party tells the coordinator: its budget, what its most-charged row spent, the current noise."""
        out = {"epsilon": self.budget.epsilon, "delta": self.budget.delta,
               "epsilon_spent": self.ledger.epsilon_spent(), "rows_charged": self.ledger.n_rows,
               "mechanism": self.mechanism.name}
        if self.plan is not None:
            out.update(noise_multiplier=self.z, charges=self.plan.charges)
        return out


def private_reply(privacy: PartyPrivacy, spec: Any, kind: str, tensors: Mapping[str, torch.Tensor],
                  meta: Mapping[str, Any], rows: Mapping[str, tuple[Sequence[str], int]]) -> dict[str, torch.Tensor]:
    """The reply tensors of ``kind`` as the party releases them under its budget.

    Each tensor must be one the kind declares in ``releases`` (nothing else leaves: no other tensor, no metadata).
    Everything the reply says about one row (its slices of every released tensor, each divided by that tensor's clip
    norm) is one vector, clipped to norm 1 and noised by the party's mechanism (Gaussian: ``N(0, (2 z)^2)``, then
    scaled back: tensor ``t`` gets noise ``2 z C_t``): one mechanism per row and reply, charged its cost (Gaussian:
    ``1 / z^2``) before anything is returned.
    ``rows[name]``: the row keys of tensor ``name`` and the axis they run along (the program says which rows its
    replies are about).
    """
    declared = [t for t in spec.reply if t.name in spec.releases]
    if meta:
        raise PolicyViolation(RULE, f"{privacy.where}: the {kind!r} reply carries metadata {sorted(meta)}; under a "
                              "differential-privacy budget only declared per-row releases leave the party")
    parts: list[tuple[str, torch.Tensor, float, int, list[str]]] = []
    for name, t in tensors.items():
        match = next((s for s in declared if s.match(name) is not None), None)
        if match is None:
            raise PolicyViolation(RULE, f"{privacy.where}: the {kind!r} reply tensor {name!r} is not declared as "
                                  "released per row; under a differential-privacy budget nothing else leaves the party")
        if name not in rows:
            raise RuntimeError(f"{privacy.where}: the program did not say which rows its {kind!r} reply {name!r} is "
                               "about; nothing was released")
        row_keys, axis = rows[name]
        if t.shape[axis] != len(row_keys):
            raise RuntimeError(f"{privacy.where}: {kind!r} reply {name!r} has {t.shape[axis]} rows along axis {axis}, "
                               f"the program named {len(row_keys)}")
        parts.append((name, t, privacy.clip_for(match.name), axis, [str(k) for k in row_keys]))
    keys = list(dict.fromkeys(k for *_, ks in parts for k in ks))
    privacy.ledger.charge(keys, privacy.cost, f"answering {kind!r}")
    return privacy.joint_noisy(parts, keys)


def _as_rows(t: torch.Tensor, axis: int) -> torch.Tensor:

    moved = t.detach().double().movedim(axis, 0)
    return moved.reshape(moved.shape[0], -1)


def _gaussian_event(params: Mapping[str, Any]) -> Any:
    """One release or update to one row at noise multiplier ``z`` (``params["noise_multiplier"]``): noise ``2 z C``
    for a clip norm ``C``, i.e. ``dp-accounting``'s Gaussian event of noise multiplier ``2 z`` (its replace-one
    relation takes the sensitivity to ``2 C``)."""
    import dp_accounting as dpa

    return dpa.GaussianDpEvent(2.0 * float(params["noise_multiplier"]))


def _calibrate(charges: int, remaining_mu2: float) -> float:
    """``z = sqrt(charges / remaining mu^2)``: ``charges`` applications at ``1 / z^2`` each spend what is left."""
    return math.sqrt(charges / remaining_mu2)


def _cost(z: float) -> float:
    """One Gaussian mechanism of noise ``2 z C`` against sensitivity ``2 C``: ``mu = 1 / z``."""
    return 1.0 / z ** 2


def _noise_release(rows: torch.Tensor, z: float, generator: torch.Generator) -> torch.Tensor:
    """Rows clipped to norm 1 (sensitivity 2) plus ``N(0, (2 z)^2)`` on every value."""
    import torch

    return rows + torch.randn(tuple(rows.shape), generator=generator, dtype=torch.float64) * (2.0 * z)


def _noise_sum(total: torch.Tensor, z: float, clip: float, generator: torch.Generator) -> torch.Tensor:
    """DP-SGD's sum of gradients clipped to ``clip`` (sensitivity ``2 clip``) plus ``N(0, (2 z clip)^2)``."""
    import torch

    return total + torch.randn(tuple(total.shape), generator=generator, dtype=torch.float64) * (2.0 * z * clip)


#: The party-side Gaussian mechanism (releases and DP-SGD updates under a party's own budget, this module).
GAUSSIAN = register_mechanism(PrivacyMechanism(
    name="gaussian",
    where="release",
    summary="Gaussian mechanism on every declared release and DP-SGD on the party's own updates, under the party's "
            "own (epsilon, delta) budget per row",
    params=(
        MechanismParam("dp_epsilon", "float", None, "the party's budget per row ([policy] dp_epsilon; fit "
                       "--party-dp PARTY=EPS)"),
        MechanismParam("dp_delta", "float", None, "the budget's delta ([policy] dp_delta; fit --party-dp "
                       "PARTY=EPS:DELTA)"),
        MechanismParam("dp_clip", "float", 1.0, "a factor on the method's clip norms of released values"),
        MechanismParam("dp_grad_clip", "float", 1.0, "the per-row gradient clip of the parties' DP-SGD"),
        MechanismParam("dp_predictions", "int", 2, "predictions per row to keep budget for after a fit"),
    ),
    dp_event=_gaussian_event,
    release=ReleaseHooks(calibrate=_calibrate, cost=_cost, noise_release=_noise_release, noise_sum=_noise_sum),
), __name__)
