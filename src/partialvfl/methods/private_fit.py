"""The coordinator's side of differential privacy in a fit: label DP of the label holder, the privacy plans it sends
to parties that keep their own budget, and the privacy report printed with the fit.

* ``label_dp=EPS`` (Python API, ``fit --label-dp EPS``, ``[labels] label_dp`` of a federation file): the labels the
  coordinator trains with are randomized once (:mod:`partialvfl.methods.label_dp`), seeded by ``label_dp_seed``
  (default: derived from the method's seed, which the parties are told; a deployment draws a secret one).
* A party that keeps a budget (``[policy] dp_epsilon``, ``dp_delta``; in process ``fit(..., party_dp=...)``) is sent
  a plan (:class:`~partialvfl.federation.dp.gaussian.PrivacyPlan`) at ``setup``: how many mechanisms per row the
  method will
  use, the clip norms.  The party calibrates its noise to it and enforces its budget itself; the coordinator cannot
  turn it off, only decline to send a plan (the party then refuses the setup).
* A method's declaration says whether it supports both (``MethodSpec.private``: ``supports_privacy``); any other
  method refuses both settings, naming itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from partialvfl.methods.label_dp import (
    RANDOMIZED_RESPONSE,
    RR_WITH_PRIOR,
    debiased_frequencies,
    randomize_labels,
    rr_with_prior,
)
from partialvfl.methods.params import PRIVACY_PARAMS
from partialvfl.methods.registry import get_spec, private_methods
from partialvfl.utils.seeding import derive_seed, numpy_rng

if TYPE_CHECKING:
    from partialvfl.data.dataset import CoordinatorView
    from partialvfl.federation.runtime.coordinator import Federation

VFLMethod = Any  # a method (partialvfl.methods.base imports this module)

__all__ = ["DP_OPTIONS", "PrivacyHooks", "check_dp_options", "describe_privacy", "label_dp_view",
           "label_prior", "plans_for", "privacy_report", "private_methods_text", "private_parties", "restore_privacy"]

#: Options of the plans a method sends (``dp_options_``, as ``model.json`` keeps them): a factor on the method's clip
#: norms of released values, the per-row gradient clip of the parties' DP-SGD, and how many predictions per row to
#: keep budget for after a fit; set by the declared parameters ``dp_clip``, ``dp_grad_clip``, ``dp_predictions``
#: (:data:`~partialvfl.methods.params.PRIVACY_PARAMS`).
DP_OPTIONS: dict[str, float] = {k: PRIVACY_PARAMS.param(f"dp_{k}").default
                                for k in ("clip", "grad_clip", "predictions")}


def private_methods_text() -> str:
    """The methods that support differential privacy, in words (for error messages), read from their declarations."""
    return ", ".join(private_methods()) or "none"


class PrivacyHooks:
    """What a method says about differential privacy (:class:`~partialvfl.methods.base.VFLMethod` inherits it)."""

    @property
    def supports_privacy(self) -> bool:
        """Whether the method runs with label DP and at parties that keep a differential-privacy budget (what its
        declaration says: ``MethodSpec.private``)."""
        spec = get_spec(self.name)
        return spec is not None and spec.private

    #: what the passive parties' messages in a fit reveal about the labels without label DP: ``"labels"`` (gradients
    #: of a supervised loss: their rows' labels, and which rows are labelled), ``"labelled rows"`` (only which rows
    #: are labelled) or ``"nothing"`` (they are sent nothing); the fit's first line says it (docs/privacy.md)
    label_exposure: ClassVar[str] = "labels"
    name: ClassVar[str] = ""

    def _privacy_charges(self, party: int, purpose: str) -> int:
        """Mechanisms per row party ``party`` will apply: a whole fit and its predictions (``fit``), or predictions
        only (``predict``: a loaded model)."""
        raise NotImplementedError(f"{self.name} does not support differential privacy")

    def _privacy_clips(self, party: int) -> dict[str, float]:
        """Clip norms of the released tensors, by the name their message declares (others: ``dp_options['clip']``)."""
        return {}

    def _privacy_refusal(self) -> str | None:
        """Why these parameters cannot run at a party with a budget (``None``: they can)."""
        return None


def restore_privacy(method: VFLMethod, meta: Mapping[str, Any]) -> None:
    """A loaded model's privacy settings and report, from its ``model.json``."""
    privacy = meta.get("privacy") or {}
    method.privacy_ = {k: v for k, v in privacy.items() if k != "dp_options"} or None
    method.label_dp = privacy.get("labels", {}).get("epsilon")
    method.dp_options_ = check_dp_options(privacy.get("dp_options"))


def check_dp_options(options: Mapping[str, Any] | None) -> dict[str, float]:
    """A model file's ``dp_options`` with defaults (an unknown key or a non-positive value is an error naming it)."""
    out = dict(DP_OPTIONS)
    for key, value in dict(options or {}).items():
        if key not in DP_OPTIONS:
            raise ValueError(f"dp_options: unknown key {key!r}; known: {sorted(DP_OPTIONS)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"dp_options: {key} must be a positive number, got {value!r}")
        out[key] = value
    out["predictions"] = int(out["predictions"])
    return out


def private_parties(method: VFLMethod, federation: Federation) -> dict[int, dict[str, float]]:
    """The parties that keep a budget; refuses a method that supports no differential privacy, naming it."""
    parties = federation.private_parties()
    asked = [what for what, on in (("label DP (label_dp)", method.label_dp is not None),
                                   (f"a differential-privacy budget at {_names(federation, parties)}", bool(parties)))
             if on]
    if asked and not method.supports_privacy:
        raise ValueError(f"{method.name} does not support differential privacy ({'; '.join(asked)}); the methods "
                         f"that do: {private_methods_text()}")
    if parties:
        why = method._privacy_refusal()
        if why:
            raise ValueError(f"{method.name}: {why} (a party keeps a differential-privacy budget: "
                             f"{_names(federation, parties)})")
    return parties


def _names(federation: Federation, parties: Mapping[int, Any]) -> str:
    return ", ".join(f"party {k} ({federation.party_names[k]!r})" for k in sorted(parties))


def label_dp_view(method: VFLMethod, view: CoordinatorView, federation: Federation | None = None,
                  handle: str | None = None, dataset: str | None = None) -> CoordinatorView:
    """``view`` with its labelled rows' labels randomized at ``method.label_dp`` (unchanged without label DP).

    With ``method.label_dp_prior`` (RRWithPrior, two stages as Ghazi et al.): half of the labelled rows (seeded) get
    randomized response; a first fit on them alone (same method, parameters and seed, through ``federation`` on the
    data attached as ``handle``) predicts priors for the other half, whose labels then get RRWithPrior.  Each label
    is randomized once, so the result is ``epsilon``-label-DP.
    """
    eps = method.label_dp
    if eps is None:
        if method.label_dp_prior:
            raise ValueError(f"{method.name}: label_dp_prior=True needs label_dp (the epsilon of label DP)")
        return view
    if not view.task.is_classification:
        mechanism = RR_WITH_PRIOR if method.label_dp_prior else RANDOMIZED_RESPONSE
        raise ValueError(f"{method.name}: label DP ({mechanism.label}) is for classification; this task is "
                         f"{view.task.kind}")
    seed = method.label_dp_seed if method.label_dp_seed is not None else derive_seed(method.seed, "label-dp")
    k = view.task.n_classes
    if not method.label_dp_prior:
        y = randomize_labels(np.where(view.labeled, view.y, 0), view.labeled, k, eps,
                             numpy_rng(seed, "randomized response"))
        method.label_dp_rr_rows_ = view.labeled
        return dataclasses.replace(view, y=np.where(view.labeled, y, view.y))
    if federation is None or handle is None:
        raise ValueError(f"{method.name}: label_dp_prior needs the federation (its first stage is a fit)")
    rows = np.flatnonzero(view.labeled)
    second = np.zeros(view.n_samples, dtype=bool)
    second[numpy_rng(seed, "stages").permutation(rows)[: len(rows) // 2]] = True
    first = view.labeled & ~second
    y1 = randomize_labels(np.where(first, view.y, 0), first, k, eps, numpy_rng(seed, "randomized response"))
    stage1 = dataclasses.replace(view, y=np.where(first, y1, view.y), labeled=first)
    run = method.run_options
    dp = {f"dp_{k}": v for k, v in method.dp_options_.items()}
    prior_model = type(method)(method.preset, seed=method.seed, device=run.device, precision=run.precision,
                               compile=run.compile, **dp, **method.overrides)
    prior_model.fit_federated(federation, stage1, handle, dataset=dataset)
    priors = prior_model.predict_output_federated(view, handle)[second]
    y = np.where(first, y1, view.y)
    y[second] = rr_with_prior(view.y[second].astype(np.int64), priors, eps, numpy_rng(seed, "rr with prior"))
    method.label_dp_rr_rows_ = first  # the rows of plain randomized response (their frequencies can be debiased)
    return dataclasses.replace(view, y=y)


def label_prior(method: VFLMethod, view: CoordinatorView) -> np.ndarray | None:
    """Under label DP, the training class frequencies debiased from the randomized labels (``None`` otherwise)."""
    if method.label_dp is None:
        return None
    rows = getattr(method, "label_dp_rr_rows_", view.labeled)
    return debiased_frequencies(view.y[rows], view.task.n_classes, method.label_dp)


def plans_for(method: VFLMethod, parties: Mapping[int, Any], purpose: str) -> dict[int, dict[str, Any]] | None:
    """The plan for each party with a budget (``purpose``: ``fit`` or ``predict``), ``None`` if there is none."""
    if not parties:
        return None
    opts = method.dp_options_
    plans = {}
    for k in parties:
        clips = {name: float(c) * float(opts["clip"]) for name, c in method._privacy_clips(k).items()}
        plans[k] = {"charges": int(method._privacy_charges(k, purpose)), "clip": clips,
                    "default_clip": float(opts["clip"]), "grad_clip": float(opts["grad_clip"])}
    return plans


def privacy_report(method: VFLMethod, federation: Federation, parties: Mapping[int, Any]) -> dict[str, Any] | None:
    """What the fit spent: label DP's epsilon, and each budget-keeping party's own account (``None``: no DP)."""
    if method.label_dp is None and not parties:
        return None
    out: dict[str, Any] = {}
    if method.label_dp is not None:
        mechanism = RR_WITH_PRIOR if method.label_dp_prior else RANDOMIZED_RESPONSE
        out["labels"] = {"epsilon": float(method.label_dp), "mechanism": mechanism.label}
    reports = federation.privacy_reports(sorted(parties))
    if reports:
        out["parties"] = {federation.party_names[k]: {kk: v for kk, v in r.items() if kk != "enabled"}
                          for k, r in sorted(reports.items())}
    return out


def describe_privacy(report: Mapping[str, Any] | None) -> list[str]:
    """Lines for the fit's output."""
    if not report:
        return []
    lines = []
    if "labels" in report:
        lines.append(f"label DP: epsilon {report['labels']['epsilon']:g} ({report['labels']['mechanism']} on every "
                     "training label; every message to the parties is epsilon-label-DP)")
    for name, r in report.get("parties", {}).items():
        lines.append(f"party {name!r}: differential-privacy budget epsilon {r['epsilon']:g}, delta {r['delta']:g} "
                     f"per row; spent epsilon {r['epsilon_spent']:.3g} (its most-charged row, of "
                     f"{r['rows_charged']} rows charged)")
    return lines
