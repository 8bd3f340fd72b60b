"""The coordinator's side of differential privacy in a fit: label DP of the label holder, the privacy plans it sends
to parties that keep their own budget, and the privacy report printed with the fit.

* ``label_dp=EPS`` (Python API, ``fit --label-dp EPS``, ``[labels] label_dp`` of a federation file): the labels the
  coordinator trains with are randomized once by the declared label mechanism ``label_dp_mechanism`` (default
  ``randomized-response``; ``label_dp_prior=true``: ``rr-with-prior``; :mod:`partialvfl.methods.label_dp`), run
  through its declared ``apply`` hook with its declared parameters, seeded by ``label_dp_seed`` (default: derived
  from the method's seed, which the parties are told; a deployment draws a secret one).
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
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from partialvfl.federation.dp.mechanism import (
    LabelContext,
    PrivacyMechanism,
    get_mechanism,
    load_plugins,
    mechanism_epsilon,
    mechanisms,
)
from partialvfl.methods.label_dp import RANDOMIZED_RESPONSE, RR_WITH_PRIOR
from partialvfl.methods.params import PRIVACY_PARAMS, Param, ParamSpace
from partialvfl.methods.registry import get_spec, private_methods
from partialvfl.utils.seeding import derive_seed, numpy_rng

if TYPE_CHECKING:
    from partialvfl.data.dataset import CoordinatorView
    from partialvfl.federation.runtime.coordinator import Federation

VFLMethod = Any  # a method (partialvfl.methods.base imports this module)

__all__ = ["DP_OPTIONS", "PrivacyHooks", "check_dp_options", "describe_privacy", "label_dp_view", "label_mechanism",
           "label_prior", "plans_for", "privacy_report", "privacy_space", "private_methods_text", "private_parties",
           "restore_privacy"]

#: Options of the plans a method sends (``dp_options``, as ``model.json`` keeps them): a factor on the method's clip
#: norms of released values, the per-row gradient clip of the parties' DP-SGD, and how many predictions per row to
#: keep budget for after a fit; set by the declared parameters ``dp_clip``, ``dp_grad_clip``, ``dp_predictions``
#: (:data:`~partialvfl.methods.params.PRIVACY_PARAMS`).
DP_OPTIONS: dict[str, float] = {k: PRIVACY_PARAMS.param(f"dp_{k}").default
                                for k in ("clip", "grad_clip", "predictions")}


def privacy_space() -> ParamSpace:
    """The privacy parameters every method takes: :data:`~partialvfl.methods.params.PRIVACY_PARAMS` and the own
    parameters of every declared label mechanism (typed as they declare them; a name another mechanism or the
    privacy parameters already declare is shared: the first declaration's type holds)."""
    load_plugins()  # a plug-in label mechanism declares itself (entry point group partialvfl.mechanisms)
    own = {}
    for m in mechanisms("label"):
        for p in m.params:
            if p.name not in PRIVACY_PARAMS.names and p.name not in own:
                own[p.name] = Param(p.name, p.default, p.kind, f"{p.help} (label mechanism {m.name})",
                                    optional=p.default is None)
    return PRIVACY_PARAMS.extend(*own.values()) if own else PRIVACY_PARAMS


def label_mechanism(method: VFLMethod) -> tuple[PrivacyMechanism, dict[str, Any]]:
    """The label mechanism ``method``'s label DP runs and its declared parameters' values; ``label_dp_prior=true``
    means ``rr-with-prior`` (an explicit ``label_dp_mechanism`` that says otherwise is an error naming both), and a
    mechanism parameter the chosen mechanism does not declare is an error naming its mechanism."""
    name = method.label_dp_mechanism
    if method.label_dp_prior:
        if name not in (None, RR_WITH_PRIOR.name):
            raise ValueError(f"{method.name}: label_dp_prior=true means label_dp_mechanism={RR_WITH_PRIOR.name!r}, "
                             f"but label_dp_mechanism={name!r} was given; set one of them")
        name = RR_WITH_PRIOR.name
    elif name is None:
        name = RANDOMIZED_RESPONSE.name
    try:
        mechanism = get_mechanism(name, "label")
    except ValueError as e:
        raise ValueError(f"{method.name}: label_dp_mechanism: {e}") from None
    declared = {p.name for p in mechanism.params}
    values = {"label_dp": method.label_dp, "label_dp_seed": method.label_dp_seed,
              "label_dp_prior": method.label_dp_prior, **method.label_dp_params}
    foreign = sorted(k for k in method.label_dp_params if k not in declared)
    if foreign:
        owners = {k: [m.name for m in mechanisms("label") if any(p.name == k for p in m.params)] for k in foreign}
        raise ValueError(f"{method.name}: label mechanism {mechanism.name!r} takes no parameter "
                         + "; ".join(f"{k!r} (declared by {', '.join(owners[k])})" for k in foreign)
                         + f"; it declares {sorted(declared)}")
    return mechanism, {p.name: values.get(p.name, p.default) for p in mechanism.params}


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
    labels = privacy.get("labels", {})
    method.label_dp = labels.get("epsilon")
    method.dp_options = check_dp_options(privacy.get("dp_options"))
    if method.label_dp is None:
        return
    # what get_params shows: the label DP the model was fitted with (a file without a mechanism's name: by its title)
    name = labels.get("name") or next((m.name for m in mechanisms("label") if m.label == labels.get("mechanism")),
                                      RANDOMIZED_RESPONSE.name)
    given = {"label_dp": float(method.label_dp), "label_dp_mechanism": name}
    for key, value in dict(labels.get("params") or {}).items():
        if key not in ("label_dp", "label_dp_mechanism"):
            given[key] = value
    method.label_dp_mechanism = name
    method.label_dp_prior = bool(given.get("label_dp_prior", name == RR_WITH_PRIOR.name))
    method.label_dp_seed = given.get("label_dp_seed")
    method.label_dp_params = {k: v for k, v in given.items() if k not in PRIVACY_PARAMS.names}
    method._given_params.update(given)


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
    """``view`` with its labelled rows' labels as the label mechanism (:func:`label_mechanism`) released them at
    ``method.label_dp`` (unchanged without label DP).

    The mechanism runs through its declared ``apply`` hook with a :class:`~partialvfl.federation.dp.mechanism.
    LabelContext`: generators seeded by the label-DP seed, and (with ``federation`` and ``handle``) a first fit of
    the same method, parameters and seed on given labels of given rows, whose predicted probabilities a mechanism in
    two stages uses as priors (RRWithPrior).  Each label is released once, so the result is label-DP at the
    mechanism's accounted epsilon.
    """
    eps = method.label_dp
    if eps is None:
        if method.label_dp_prior or method.label_dp_mechanism is not None or method.label_dp_params:
            asked = ("label_dp_prior=True" if method.label_dp_prior else
                     f"label_dp_mechanism={method.label_dp_mechanism!r}" if method.label_dp_mechanism is not None
                     else f"the label mechanism parameters {sorted(method.label_dp_params)}")
            raise ValueError(f"{method.name}: {asked} needs label_dp (the epsilon of label DP)")
        return view
    mechanism, params = label_mechanism(method)
    if not view.task.is_classification:
        raise ValueError(f"{method.name}: label DP ({mechanism.label}) is for classification; this task is "
                         f"{view.task.kind}")
    seed = method.label_dp_seed if method.label_dp_seed is not None else derive_seed(method.seed, "label-dp")
    prior_fit = None
    if federation is not None and handle is not None:
        def prior_fit(y: np.ndarray, labeled: np.ndarray) -> np.ndarray:
            run = method.run_options
            dp = {f"dp_{k}": v for k, v in method.dp_options.items()}
            prior_model = type(method)(method.preset, seed=method.seed, device=run.device, precision=run.precision,
                                       compile=run.compile, **dp, **method.overrides)
            prior_model.fit_federated(federation, dataclasses.replace(view, y=y, labeled=labeled), handle,
                                      dataset=dataset)
            return prior_model.predict_output_federated(view, handle)

    context = LabelContext(view.task.n_classes, lambda purpose: numpy_rng(seed, purpose), prior_fit)
    try:
        released = mechanism.apply(np.asarray(view.y), view.labeled, params, context)
    except ValueError as e:
        raise ValueError(f"{method.name}: {e}") from None
    y = np.asarray(released.y)
    if y.shape != view.y.shape or not np.array_equal(y[~view.labeled], view.y[~view.labeled]):
        raise ValueError(f"{method.name}: label mechanism {mechanism.name!r} returned labels of shape {y.shape} for "
                         f"{view.y.shape}, or changed unlabelled rows; it must return one label per row")
    labels = y[view.labeled]
    if labels.size and not (np.all(labels == np.round(labels)) and labels.min() >= 0
                            and labels.max() < view.task.n_classes):
        raise ValueError(f"{method.name}: label mechanism {mechanism.name!r} returned labels outside the "
                         f"{view.task.n_classes} classes")
    method.label_dp_rr_rows_ = view.labeled if released.debias_rows is None else released.debias_rows
    return dataclasses.replace(view, y=y.astype(view.y.dtype, copy=False))


def label_prior(method: VFLMethod, view: CoordinatorView) -> np.ndarray | None:
    """Under label DP, the training class frequencies debiased from the released labels by the mechanism's declared
    ``debias`` hook (``None`` without label DP or without the hook: the fit then uses the plain frequencies)."""
    if method.label_dp is None:
        return None
    mechanism, params = label_mechanism(method)
    if mechanism.debias is None:
        return None
    rows = getattr(method, "label_dp_rr_rows_", view.labeled)
    return np.asarray(mechanism.debias(view.y[rows], view.task.n_classes, params), dtype=np.float64)


def plans_for(method: VFLMethod, parties: Mapping[int, Any], purpose: str) -> dict[int, dict[str, Any]] | None:
    """The plan for each party with a budget (``purpose``: ``fit`` or ``predict``), ``None`` if there is none."""
    if not parties:
        return None
    opts = method.dp_options
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
        mechanism, params = label_mechanism(method)
        accounted = mechanism_epsilon(mechanism, {**params, "n_classes": method.index_.task.n_classes})
        out["labels"] = {"epsilon": float(method.label_dp), "mechanism": mechanism.label, "name": mechanism.name,
                         "params": {k: v for k, v in params.items() if k not in ("label_dp", "label_dp_seed")},
                         "accounted_epsilon": accounted if math.isfinite(accounted) else None}
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
        labels = report["labels"]
        accounted = labels.get("accounted_epsilon", labels["epsilon"])
        if accounted is None or not math.isclose(accounted, labels["epsilon"], rel_tol=1e-2):
            said = "not DP by its declaration" if accounted is None else f"{accounted:.3g}"
            lines.append(f"label DP: epsilon {labels['epsilon']:g} asked, {said} by the declaration of "
                         f"{labels.get('name', labels['mechanism'])!r} ({labels['mechanism']} on every training label)")
        else:
            lines.append(f"label DP: epsilon {labels['epsilon']:g} ({labels['mechanism']} on every training label; "
                         "every message to the parties is epsilon-label-DP)")
    for name, r in report.get("parties", {}).items():
        lines.append(f"party {name!r}: differential-privacy budget epsilon {r['epsilon']:g}, delta {r['delta']:g} "
                     f"per row; spent epsilon {r['epsilon_spent']:.3g} (its most-charged row, of "
                     f"{r['rows_charged']} rows charged)")
    return lines
