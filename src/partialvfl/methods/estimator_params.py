"""The parameter side of a method's estimator contract (a base of :class:`~partialvfl.methods.base.VFLMethod`).

A method's parameters are declared once (:class:`~partialvfl.methods.params.ParamSpace`, in its family's ``spec``
module); this mixin reads them: the declared space and its presets, the values a fit resolves, and scikit-learn's
``get_params``/``set_params`` and estimator tags.  Needs ``name``, ``params``, ``presets`` and what ``__init__`` keeps
(``_run_given``, ``_given_params``, ``preset``, ``overrides``) from the class it is mixed into.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

from partialvfl.methods.params import PRIVACY_PARAMS, ParamSpace, inferred_space, with_common
from partialvfl.methods.private_fit import privacy_space
from partialvfl.methods.run_options import RunOptions
from partialvfl.methods.schedule import resolve_min_steps

__all__ = ["EstimatorParams"]


class EstimatorParams:
    """Declared parameters, presets, ``get_params``/``set_params`` and estimator tags of a method."""

    name: ClassVar[str]
    params: ClassVar[ParamSpace | None]
    presets: ClassVar[tuple[str, ...]]
    _run_given: dict[str, Any]
    _given_params: dict[str, Any]
    preset: str
    overrides: dict[str, Any]

    @classmethod
    def param_space(cls) -> ParamSpace:
        """The declared parameters (or, for a method without a declaration, its defaults with names checked)."""
        if cls.params is not None:
            return with_common(cls.params)
        legacy = cls.preset_params.__func__ is not EstimatorParams.preset_params.__func__  # type: ignore[attr-defined]
        return with_common(inferred_space(cls.default_params(), {
            p: (lambda ds, p=p: cls.preset_params(p, ds or None)) if legacy else (lambda ds: {}) for p in cls.presets}))

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        """Every tunable of the method with its default."""
        if cls.params is None:
            raise NotImplementedError(f"{cls.__name__} declares no parameters (params) and lists no defaults")
        return with_common(cls.params).defaults()

    @classmethod
    def preset_params(cls, preset: str, dataset: str | None) -> dict[str, Any]:
        """Overrides the preset applies on top of the defaults (may depend on the dataset)."""
        return cls.param_space().preset(preset, dataset, owner=cls.name) if cls.params is not None else {}

    @classmethod
    def epoch_param_names(cls) -> list[str]:
        """The parameters that count training epochs (what the CLI's ``--epochs N`` sets, all of them)."""
        if cls.params is not None:
            return cls.params.epoch_names()
        return [k for k in cls.default_params() if k in ("epochs", "pretrain_epochs") or k.startswith("epochs_")]

    def resolve_params(self, dataset: str | None) -> dict[str, Any]:
        """Defaults, then the preset's values for ``dataset``, then this instance's overrides (checked when given); a
        schedule's ``min_steps = null`` resolved (:func:`~partialvfl.methods.schedule.resolve_min_steps`)."""
        resolved = self.param_space().resolve(self.preset, dataset, self.overrides, owner=self.name, checked=True)
        return resolve_min_steps(resolved, self.overrides)

    #: the keywords of ``__init__`` that are not declared parameters: the preset, the seed and the run options
    RUN_OPTIONS: ClassVar[tuple[str, ...]] = ("preset", "seed", *RunOptions.names())

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """scikit-learn's ``get_params``: the preset, the seed, every run option (``RUN_OPTIONS``), every privacy
        parameter (:data:`~partialvfl.methods.params.PRIVACY_PARAMS`) and every declared parameter this model
        was given, as given (``type(self)(**model.get_params())`` is the same unfitted model, so
        ``sklearn.base.clone`` works).  A method's declared parameter not given is absent: it follows the preset,
        which is resolved per dataset at ``fit`` (``param_space().names`` lists every name ``set_params`` accepts).
        ``deep`` is accepted for scikit-learn; a method holds no nested estimator."""
        return {**self._run_given, **PRIVACY_PARAMS.defaults(), **self._given_params}

    def set_params(self, **params: Any) -> Self:
        """scikit-learn's ``set_params``: change run options and declared parameters (by name or alias), validated
        as ``__init__`` validates them (nothing is changed if one is refused); returns ``self``.  A fitted model
        keeps what it learnt; the new values apply to the next ``fit``."""
        options = {k: v for k, v in params.items() if k in self.RUN_OPTIONS}
        declared = {k: v for k, v in params.items() if k not in self.RUN_OPTIONS}
        given = dict(self._given_params)
        space = self._given_space()
        for name in declared:  # a new value for a parameter given under another name (an alias) replaces it
            canonical = space.canonical(name, owner=self.name)
            given = {k: v for k, v in given.items() if space.canonical(k, owner=self.name) != canonical}
        fresh = type(self)(**{**self._run_given, **options}, **given, **declared)  # validated, or raises
        vars(self).update({k: v for k, v in vars(fresh).items() if k != "history_"})  # fitted state kept
        return self

    def __sklearn_tags__(self) -> Any:
        """scikit-learn's estimator tags: a classifier or a regressor once fitted (the data's task decides), the input
        a :class:`VerticalDataset` (not an array), missing party blocks allowed, labels inside the data."""
        from sklearn.utils import InputTags, Tags, TargetTags

        task = self.index_.task if hasattr(self, "index_") else None
        kind = None if task is None else "classifier" if task.is_classification else "regressor"
        return Tags(estimator_type=kind, target_tags=TargetTags(required=False),
                    input_tags=InputTags(two_d_array=False, allow_nan=True), transformer_tags=None,
                    classifier_tags=None, regressor_tags=None)

    def set_prediction_params(self, **params: Any) -> Self:
        """Change how a fitted model predicts, without refitting: its declared ``predict_*`` parameters (FALSE-VFL's
        estimator, rounds and samples, the prediction batch size, ...), validated by their declared types; returns
        ``self``.  Any other parameter is refused, naming it: it would change what the model learnt (refit with it)."""
        self._check_fitted()
        space = self.param_space()
        canonical = {}
        for name, value in params.items():
            key = space.canonical(name, owner=self.name)  # an unknown name is refused here, naming the known ones
            if not key.startswith("predict_"):
                raise ValueError(f"{self.name}: {name!r} is not a prediction parameter (predict_*): it changes what "
                                 "the model learnt; refit with it")
            canonical[key] = value
        self.params_ = {**self.params_, **canonical}
        return self

    @classmethod
    def _given_space(cls) -> ParamSpace:
        """Every declared parameter ``__init__`` takes: the method's and the privacy parameters (with every declared
        label mechanism's own; one that a method's parameter shadows is an error naming both)."""
        space = cls.param_space()
        private = privacy_space()
        clash = sorted(set(space.names) & (set(private.names) - set(PRIVACY_PARAMS.names)))
        if clash:
            raise ValueError(f"{cls.name}: its parameter(s) {clash} have the name of a label mechanism's parameter "
                             "(partialvfl mechanisms); rename the mechanism's")
        return space.extend(*private.params)

