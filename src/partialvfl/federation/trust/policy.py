"""A party's policy: which party programs it runs, within which bounds, and who seeds its parameters.

The coordinator *asks* a party to build a program (``setup``: program name, config, seed); the party decides.  Its
:class:`PartyPolicy` (the ``[policy]`` table of ``party.toml``, every key in ``docs/reference.md``) is checked on
every ``setup`` and on the requests that change how a program learns, in process and behind the gRPC server alike
(:class:`~partialvfl.federation.runtime.party.PartyRuntime` calls it).  A request outside the policy raises
:class:`PolicyViolation` (``PERMISSION_DENIED`` on the wire), naming every rule it breaks, the values, and the
``[policy]`` values of the party's ``party.toml`` that would accept it.

Two presets: :meth:`PartyPolicy.default` (a deployed party: the package's own programs only, nonlinear encoders of
bounded width and size, a learning-rate floor, no weight sharing, and a parameter-initialisation seed the party draws
itself from :mod:`secrets`) and :meth:`PartyPolicy.research` (the in-process simulation: anything, seeded by the
coordinator, so that benchmarks reproduce).

The policy knows no method.  It reads what each party program declares: what a setup would build
(:meth:`~partialvfl.federation.wire.program.PartyProgram.describe_setup`, a :class:`SetupShape`) and each message's role
(:class:`~partialvfl.federation.wire.schema.MessageSpec`: trains, infers, shares weights; the metadata holding learning
rates).  A program without a description is refused unless listed in ``unchecked_programs`` (then the party runs it
without architecture checks, its own decision).  The default allowlist, ``programs = ["builtin"]``, is every
registered program whose class is defined in the ``partialvfl`` package (where a class is defined is not inherited:
a plugin subclassing a built-in program is not on it, and a plugin cannot be on it by accident).
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from typing import Any

from partialvfl.federation.trust.policy_values import LOOKUP_RULES, check_dp_budget, check_dp_mechanism, policy_value
from partialvfl.federation.wire.program import PACKAGE_PROGRAMS
from partialvfl.federation.wire.refusals import PolicyViolation, toml_value
from partialvfl.federation.wire.schema import SHARES_WEIGHTS, MessageSpec, meta_path
from partialvfl.federation.wire.setup_config import SetupConfig
from partialvfl.federation.wire.setup_shape import Network, SetupShape

__all__ = ["LOOKUP_FLOOR", "LOOKUP_RULES", "PACKAGE_PROGRAMS", "Network", "PartyPolicy",
           "PolicyViolation", "SetupShape", "toml_value"]

SEED_MODES = ("secret", "coordinator")
#: the fewest lookups a share ("N%") of a lookup rule allows, so that a small party is not refused its federation's
#: first fits (one fit evaluates the label side's IDs once)
LOOKUP_FLOOR = 10_000


def _joined(found: Sequence[PolicyViolation | None]) -> PolicyViolation | None:
    """One violation naming every rule in ``found`` (``None``: none)."""
    hits = [v for v in found if v is not None]
    if len(hits) <= 1:
        return hits[0] if hits else None
    first = hits[0]
    return PolicyViolation(first.rule, first.detail, first.value, first.accept, also=hits[1:])


def _is_package_program(cls: type | None) -> bool:
    return cls is not None and cls.__module__.split(".")[0] == "partialvfl"


def _ceil_ratio(sent: int, d: int) -> float:
    """The smallest ratio with two decimals that lets ``sent`` values per row through for ``d`` features."""
    return math.ceil(Fraction(100 * sent, d)) / 100


# ---------------------------------------------------------------------- the policy
@dataclass(frozen=True)
class PartyPolicy:
    """What this party agrees to run (``None``: no bound).  See ``docs/reference.md`` for every key."""

    preset: str = "default"
    programs: tuple[str, ...] | None = (PACKAGE_PROGRAMS,)
    unchecked_programs: tuple[str, ...] = ()
    encoders: tuple[str, ...] | None = ("mlp", "cnn", "resnet18", "deconv")
    min_hidden_layers: int = 1
    max_width_ratio: float | None = 2.0
    min_lr: float | None = 1e-6
    max_parameters: int | None = 50_000_000
    max_handles: int | None = 8
    max_config_kb: float | None = 64.0
    max_request_mb: float = 64.0
    allow_weight_sharing: bool = False
    seed: str | int = "secret"
    max_setup_width_ratio: float | None = None  # None: twice max_width_ratio
    max_lr: float | None = 1.0
    max_weight_decay: float | None = 0.01
    max_momentum: float | None = 0.99
    max_grad_norm: float | None = 100.0
    max_rewinds: int | None = 3
    max_peer_rpcs: int = 2
    max_peer_mb: float = 64.0
    allow_likelihood_release: bool = False
    min_latent_scale: float | None = 0.3
    max_lookups: int | None = 2_000_000  # IDs this party evaluates in one coordinator session (a resume continues it)
    # ---- the lookup budget (issue 35): IDs this party evaluates (psu_eval) for one coordinator identity, counted in a
    # ledger in its state (partialvfl.federation.trust.lookups); a number, or "N%" of its training rows (at least
    # LOOKUP_FLOOR); None: no bound
    max_lookups_per_hour: int | str | None = None
    max_lookups_per_day: int | str | None = "100%"
    max_lookups_total: int | str | None = None
    lookup_warn_fraction: float = 0.5  # a warning on the party's log when a window passes this share of its limit
    persist_alignment: bool = True  # keep a session's alignment nonce when asked (resuming a fit), else always fresh
    # resume an alignment by a name the coordinator chooses (research: a fit with the same seed gets the same tokens);
    # false: only with the ticket this party handed that coordinator for that session
    resume_alignment_by_name: bool = False
    # the label holder's own party only: feature values its coordinator sends for its new users (never trained on)
    accept_coordinator_features: bool = False
    # the coordinator's explanations (partialvfl explain / value): predictions from coalitions of parties, each an
    # extra query of this party's rows, charged to its lookup budget; false: refused (rule allow_explanations)
    allow_explanations: bool = True
    # ---- label protection (issue 35): a fit this party takes part in must protect the labels by label DP at an
    # epsilon at most this (a setup that does not say it is such a fit may predict, never train); None: no requirement
    require_label_dp: float | None = None
    # ---- differential privacy (issue 25): the party's own budget for its rows; None: no budget.  Every value the
    # party releases per row is clipped and noised and every update is DP-SGD (partialvfl.federation.dp.gaussian).
    dp_epsilon: float | None = None
    dp_delta: float | None = None
    # the declared release mechanism that noises under that budget (partialvfl mechanisms; a plug-in is found through
    # the entry point group partialvfl.mechanisms): the party's choice, never the coordinator's
    dp_mechanism: str = "gaussian"

    @classmethod
    def default(cls) -> PartyPolicy:
        """A deployed party's policy when its file says nothing."""
        return cls()

    @classmethod
    def research(cls) -> PartyPolicy:
        """The in-process simulation's policy: anything, seeded by the coordinator (benchmarks reproduce)."""
        return cls(preset="research", programs=None, encoders=None, min_hidden_layers=0, max_width_ratio=None,
                   min_lr=None, max_parameters=None, max_handles=None, max_config_kb=None,
                   allow_weight_sharing=True, seed="coordinator", max_setup_width_ratio=None, max_lr=None,
                   max_weight_decay=None, max_momentum=None, max_grad_norm=None, max_rewinds=None,
                   allow_likelihood_release=True, min_latent_scale=None, max_lookups=None,
                   max_lookups_per_day=None, resume_alignment_by_name=True)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The keys a ``[policy]`` table may hold."""
        return ("preset", *sorted({f.name for f in fields(cls)} - {"preset"}))

    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str = "[policy]") -> PartyPolicy:
        """The ``[policy]`` table of a party file: a ``preset`` (default or research), then keys overriding it."""
        raw = dict(table)
        preset = raw.pop("preset", "default")
        if preset not in ("default", "research"):
            raise ValueError(f"{where}: preset must be 'default' or 'research', got {preset!r}")
        base = cls.research() if preset == "research" else cls.default()
        known = {f.name for f in fields(cls)} - {"preset"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(known | {'preset'})}")
        changes: dict[str, Any] = {}
        for key, value in raw.items():
            changes[key] = policy_value(key, value, where)
        policy = replace(base, **changes)
        if isinstance(policy.seed, str) and policy.seed not in SEED_MODES:
            raise ValueError(f"{where}: seed must be 'secret', 'coordinator' or an integer, got {policy.seed!r}")
        check_dp_budget(policy.dp_epsilon, policy.dp_delta, where)
        check_dp_mechanism(policy.dp_mechanism, policy.dp_epsilon, where)
        return policy

    def lookup_limits(self, rows: int) -> dict[str, int]:
        """The lookup budget of a party with ``rows`` training rows: ``{rule: lookups}`` for every bounded window
        (``"N%"`` is N % of ``rows``, at least :data:`LOOKUP_FLOOR`)."""
        out = {}
        for rule in LOOKUP_RULES:
            value = getattr(self, rule)
            if isinstance(value, str):
                out[rule] = max(LOOKUP_FLOOR, math.ceil(float(value[:-1]) / 100 * rows))
            elif value is not None:
                out[rule] = int(value)
        return out

    def with_dp(self, epsilon: float, delta: float, mechanism: str = "gaussian") -> PartyPolicy:
        """This policy with a differential-privacy budget for the party's rows (``[policy] dp_epsilon, dp_delta``)
        kept by the declared release mechanism ``mechanism`` (``[policy] dp_mechanism``)."""
        policy = replace(self, dp_epsilon=float(epsilon), dp_delta=float(delta), dp_mechanism=mechanism)
        check_dp_budget(policy.dp_epsilon, policy.dp_delta, "the policy")
        check_dp_mechanism(policy.dp_mechanism, policy.dp_epsilon, "the policy")
        return policy

    def changed(self) -> dict[str, Any]:
        """The keys whose values differ from the preset's (what the party's file changed)."""
        base = PartyPolicy.research() if self.preset == "research" else PartyPolicy.default()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "preset" and getattr(self, f.name) != getattr(base, f.name)}

    # ------------------------------------------------------------------ seeds
    def init_seed(self, requested: int) -> int:
        """The seed the party builds its program with: its own secret draw, its pinned value, or the coordinator's."""
        if self.seed == "secret":
            return secrets.randbits(63)
        if self.seed == "coordinator":
            return int(requested)
        return int(self.seed)

    # ------------------------------------------------------------------ setup
    def runs(self, program: str, cls: type | None) -> bool:
        """Whether ``programs`` lists ``program`` (``cls``: its registered class, if any)."""
        if self.programs is None or program in self.programs:
            return True
        return PACKAGE_PROGRAMS in self.programs and _is_package_program(cls)

    def check_setup(self, program: str, config: Any, *, registered: Mapping[str, type] | None = None,
                    n_features: int | None = None, feature_shape: Sequence[int] | None = None) -> SetupShape | None:
        """Refuse a ``setup`` outside the policy (:class:`PolicyViolation` naming the rules and the values).

        ``registered``: the party programs by name (the party's registry); a program describes its own setup
        (``describe_setup``).  ``n_features``/``feature_shape``: the party's own table (the config's widths must
        agree with them).
        """
        cls = (registered or {}).get(program)
        if not self.runs(program, cls):
            raise PolicyViolation("programs", f"program {program!r} is not one this party runs; it runs "
                                  f"{self._program_names(registered or {})}", program,
                                  {"programs": [*(self.programs or ()), program]} if cls is not None else None)
        if self.max_config_kb is not None:
            wire = config.to_wire() if isinstance(config, SetupConfig) else config
            size = len(json.dumps(wire, default=str).encode())
            if size > self.max_config_kb * 1024:
                raise PolicyViolation("max_config_kb", f"the setup config has {size / 1024:.1f} KB, more than "
                                      f"{self.max_config_kb:g} KB", size, {"max_config_kb": math.ceil(size / 1024)})
        if program in self.unchecked_programs or not self._bounds_architecture():
            return None
        shape = self._described(program, cls, config)
        if feature_shape is not None and shape.feature_shape is not None \
                and tuple(shape.feature_shape) != tuple(feature_shape):
            raise PolicyViolation("feature_shape", f"the config says feature_shape {list(shape.feature_shape)}, "
                                  f"this party's table has {list(feature_shape)}", list(shape.feature_shape))
        d = n_features if n_features is not None else (math.prod(shape.feature_shape) if shape.feature_shape
                                                        else None)
        refused = _joined([self._families(shape.networks), self._depth(shape.networks), self._width(shape.networks, d),
                           self._setup_width(program, shape, d), self._size(program, shape.networks),
                           self._rates(shape.learning_rates), *self._optimiser_settings(shape),
                           self._sharing(program, shape), self._oracle(program, shape)])
        if refused is not None:
            raise refused
        return shape

    def _program_names(self, registered: Mapping[str, type]) -> list[str]:
        names = [p for p in self.programs or () if p != PACKAGE_PROGRAMS]
        if PACKAGE_PROGRAMS in (self.programs or ()):
            names += sorted(n for n, c in registered.items() if _is_package_program(c) and n not in names)
        return names

    def _described(self, program: str, cls: type | None, config: Any) -> SetupShape:
        """What ``program`` says it would build from ``config`` (read as the program declares it, if it is not
        yet); a violation if it cannot say."""
        describe = getattr(cls, "describe_setup", None)
        read = getattr(cls, "read_config", None)
        config = read(config) if read is not None else config  # a typed config stays as it is
        try:
            shape = describe(config) if describe is not None else None
        except (KeyError, TypeError, ValueError) as e:
            raise PolicyViolation("programs", f"cannot read the {program!r} config ({type(e).__name__}: {e})") \
                from None
        if shape is None:
            raise PolicyViolation("unchecked_programs", f"program {program!r} has no description the policy can "
                                  "check; list it in unchecked_programs to run it without architecture checks",
                                  program, {"unchecked_programs": [*self.unchecked_programs, program]}
                                  if cls is not None else None)
        return shape

    def _bounds_architecture(self) -> bool:
        return (self.encoders is not None or self.min_hidden_layers > 0 or self.max_width_ratio is not None
                or self.min_lr is not None or self.max_parameters is not None or not self.allow_weight_sharing
                or self.setup_width_ratio is not None or self.max_lr is not None
                or self.max_weight_decay is not None or self.max_momentum is not None
                or not self.allow_likelihood_release or bool(self.min_latent_scale))

    # ------------------------------------------------------------------ one rule each, over every network
    def _families(self, nets: Sequence[Network]) -> PolicyViolation | None:
        if self.encoders is None:
            return None
        bad = [n for n in nets if n.family not in self.encoders]
        if not bad:
            return None
        extra = list(dict.fromkeys(n.family for n in bad))
        return PolicyViolation("encoders", f"{bad[0].role} is a {bad[0].family!r} network; allowed: "
                               f"{list(self.encoders)}", bad[0].family, {"encoders": [*self.encoders, *extra]})

    def _depth(self, nets: Sequence[Network]) -> PolicyViolation | None:
        bad = [n for n in nets if n.crosses and n.family == "mlp" and len(n.hidden) < self.min_hidden_layers]
        if not bad:
            return None
        net = bad[0]
        return PolicyViolation("min_hidden_layers", f"{net.role} is an MLP with {len(net.hidden)} hidden layer(s) "
                               f"(hidden widths {list(net.hidden)}); at least {self.min_hidden_layers} required (a "
                               "network without a nonlinearity can be inverted)", len(net.hidden),
                               {"min_hidden_layers": min(len(n.hidden) for n in bad)})

    def _width(self, nets: Sequence[Network], d: int | None) -> PolicyViolation | None:
        ratio = self.max_width_ratio
        if ratio is None or not d:
            return None
        bad = [n for n in nets if n.sent_width is not None and n.sent_width > ratio * d]
        if not bad:
            return None
        net = max(bad, key=lambda n: n.sent_width or 0)
        return PolicyViolation("max_width_ratio", f"{net.role} would send {net.sent_width} values per row computed "
                               f"from {d} features: more than {ratio:g} x {d}", net.sent_width,
                               {"max_width_ratio": _ceil_ratio(int(net.sent_width or 0), d)})

    @property
    def setup_width_ratio(self) -> float | None:
        """The cap on a whole setup's values per row: ``max_setup_width_ratio``, or twice ``max_width_ratio``."""
        if self.max_setup_width_ratio is not None:
            return self.max_setup_width_ratio
        return None if self.max_width_ratio is None else 2 * self.max_width_ratio

    def _setup_width(self, program: str, shape: SetupShape, d: int | None) -> PolicyViolation | None:
        """The values per row of a setup's networks together (16 models of 2d are 32d values per row); a setup of
        one sending network is bounded by ``max_width_ratio`` alone."""
        ratio, sent = self.setup_width_ratio, shape.sent_width
        crossing = [n for n in shape.networks if n.sent_width]
        if ratio is None or not d or len(crossing) < 2 or sent <= ratio * d:
            return None
        return PolicyViolation("max_setup_width_ratio", f"the {program!r} setup's {len(crossing)} network(s) would "
                               f"send {sent} values per row together, computed from {d} features: more than "
                               f"{ratio:g} x {d}", sent, {"max_setup_width_ratio": _ceil_ratio(sent, d)})

    def width_refusal(self, program: str, shape: SetupShape, n_features: int) -> PolicyViolation | None:
        """The width rules alone (``max_width_ratio``, ``max_setup_width_ratio``) for ``shape`` on a party with
        ``n_features`` features: what a coordinator checks while it chooses widths within announced policies."""
        return _joined([self._width(shape.networks, n_features), self._setup_width(program, shape, n_features)])

    @classmethod
    def width_caps(cls, announced: Mapping[str, Any]) -> PartyPolicy:
        """A policy holding only the width caps a party announced (``announced()``); no other rule."""
        return replace(cls.research(), max_width_ratio=announced.get("max_width_ratio"),
                                   max_setup_width_ratio=announced.get("max_setup_width_ratio"))

    def _size(self, program: str, nets: Sequence[Network]) -> PolicyViolation | None:
        total = sum(n.parameters() for n in nets)
        if self.max_parameters is None or total <= self.max_parameters:
            return None
        return PolicyViolation("max_parameters", f"the {program!r} setup would build about {total:,} parameters, "
                               f"more than {self.max_parameters:,}", total, {"max_parameters": total})

    def _rates(self, rates: Mapping[str, float]) -> PolicyViolation | None:
        bad = [v for v in (self._lr_violation(lr, name) for name, lr in rates.items()) if v is not None]
        if not bad:
            return None
        accept: dict[str, Any] = {}
        for key, pick in (("min_lr", min), ("max_lr", max)):
            values = [v.accept[key] for v in bad if key in v.accept]
            if values:
                accept[key] = pick(values)
        other = [v for v in bad if v.rule != bad[0].rule][:1]
        return PolicyViolation(bad[0].rule, bad[0].detail, bad[0].value, accept, also=other)

    def _optimiser_settings(self, shape: SetupShape) -> list[PolicyViolation | None]:
        return [self._bounded(v, f"{name} (weight decay)", "max_weight_decay")
                for name, v in shape.weight_decays.items()] + [
                self._bounded(v, f"{name} (momentum)", "max_momentum") for name, v in shape.momenta.items()]

    def _oracle(self, program: str, shape: SetupShape) -> PolicyViolation | None:
        floor, least = shape.latent_scale_floor, self.min_latent_scale
        if floor is not None and least is not None and floor < least:
            return PolicyViolation("min_latent_scale", f"{program!r} would evaluate this party's likelihood at "
                                   f"latents of scale {floor:g}, under this party's floor of {least:g}", floor,
                                   {"min_latent_scale": floor})
        if not shape.likelihood_oracle or self.allow_likelihood_release:
            return None
        return PolicyViolation("allow_likelihood_release", f"{program!r} as configured would answer the likelihood "
                               "of this party's rows at latents the coordinator chooses freely, an exact linear "
                               "oracle on the raw rows (docs/security.md, threat model); a program that draws its "
                               "latents itself is accepted", True, {"allow_likelihood_release": True})

    def _sharing(self, program: str, shape: SetupShape) -> PolicyViolation | None:
        if not shape.shares_weights or self.allow_weight_sharing:
            return None
        return PolicyViolation("allow_weight_sharing", f"{program!r} with model aggregation sends this party's "
                               "local encoder weights to the coordinator; set allow_weight_sharing = true to agree",
                               True, {"allow_weight_sharing": True})

    # ------------------------------------------------------------------ requests
    def _lr_violation(self, lr: Any, what: str) -> PolicyViolation | None:
        try:
            value = float(lr)
        except (TypeError, ValueError):
            return PolicyViolation("min_lr", f"{what} {lr!r} is not a number", lr)
        if not math.isfinite(value) or value < 0:
            floor = f"{self.min_lr:g}" if self.min_lr is not None else "0"
            return PolicyViolation("min_lr", f"{what} {value:g} is under this party's floor of {floor}", value)
        if self.min_lr is not None and value < self.min_lr:
            return PolicyViolation("min_lr", f"{what} {value:g} is under this party's floor of {self.min_lr:g}",
                                   value, {"min_lr": value})
        if self.max_lr is not None and value > self.max_lr:
            return PolicyViolation("max_lr", f"{what} {value:g} is over this party's ceiling of {self.max_lr:g} (a "
                                   "huge step replaces the weights with what the coordinator's gradients say)",
                                   value, {"max_lr": value})
        return None

    def _bounded(self, value: Any, what: str, key: str) -> PolicyViolation | None:
        """An optimiser setting within ``[0, getattr(self, key)]`` (weight decay, momentum)."""
        limit = getattr(self, key)
        try:
            v = float(value)
        except (TypeError, ValueError):
            return PolicyViolation(key, f"{what} {value!r} is not a number", value)
        if not math.isfinite(v) or v < 0:
            return PolicyViolation(key, f"{what} {v:g} must be a finite number >= 0", v)
        if limit is not None and v > limit:
            why = ("one step shrinks every weight by lr x weight decay: a large one zeroes the model"
                   if key == "max_weight_decay" else "a momentum of 1 or more never forgets a step")
            return PolicyViolation(key, f"{what} {v:g} is over this party's limit of {limit:g} ({why})", v,
                                   {key: v} if key != "max_momentum" or v < 1 else None)
        return None

    def check_request(self, spec: MessageSpec, kind: str, meta: Mapping[str, Any]) -> None:
        """Refuse a program request outside the policy, by its declaration: a kind that shares weights (its role),
        a learning rate under the floor (the metadata it declares as ``learning_rates``)."""
        if spec.role == SHARES_WEIGHTS and not self.allow_weight_sharing:
            raise PolicyViolation("allow_weight_sharing", f"{kind!r} would send this party's weights to the "
                                  "coordinator", kind, {"allow_weight_sharing": True})
        found_values = []
        for paths, check in ((spec.learning_rates, lambda v, w: self._lr_violation(v, w)),
                             (spec.weight_decays, lambda v, w: self._bounded(v, w, "max_weight_decay")),
                             (spec.momenta, lambda v, w: self._bounded(v, w, "max_momentum"))):
            for path in paths:
                found, value = meta_path(meta, path)
                if found:
                    found_values.append(check(value, f"{kind} {path.replace('.', ' ')}"))
        refused = _joined(found_values)
        if refused is not None:
            raise refused

    def check_labels(self, fit: Any, label_dp: Any) -> bool:
        """Whether a ``setup`` may train: refuse a fit (``fit`` true) whose labels are not protected as
        ``require_label_dp`` requires (:class:`PolicyViolation`, rule ``require_label_dp``); a setup that does not
        say it is a fit may only predict under that rule."""
        need = self.require_label_dp
        if need is None:
            return True
        if fit is not True:
            return False
        try:
            eps = float(label_dp) if label_dp is not None else math.inf
        except (TypeError, ValueError):
            eps = math.nan
        if not eps <= need:  # also NaN: a label_dp that is not a number
            asked = "no label DP" if label_dp is None else f"label DP at epsilon {label_dp!r}"
            raise PolicyViolation("require_label_dp", f"this party takes part only in fits whose labels are protected "
                                  f"by label DP at epsilon at most {need:g}; this fit has {asked} (fit with --label-dp "
                                  f"{need:g} or less, or [labels] label_dp in the federation file)", label_dp,
                                  {"require_label_dp": eps} if math.isfinite(eps) else None)
        return True

    def refuse_training(self, kind: str) -> None:
        """Refuse a training request after a setup that did not say it is a label-protected fit (rule
        ``require_label_dp``)."""
        raise PolicyViolation("require_label_dp", f"{kind!r} trains, and this party trains only in fits whose labels "
                              f"are protected by label DP at epsilon at most {self.require_label_dp:g}: the current "
                              "setup did not say it is one (partialvfl fit --label-dp EPS says so)", kind)

    def check_handles(self, held: int, handle: str, existing: bool) -> None:
        """Refuse one more attached data set beyond ``max_handles``."""
        if not existing and self.max_handles is not None and held >= self.max_handles:
            raise PolicyViolation("max_handles", f"attaching {handle!r} would make {held + 1} data sets held at "
                                  f"once; at most {self.max_handles}", held + 1, {"max_handles": held + 1})

    def announced(self) -> dict[str, Any]:
        """What the party tells a coordinator in its ``hello`` so that an honest one can plan within the policy
        (e.g. whether a program may release likelihoods at latents it chooses); the party still checks every
        request against the whole policy."""
        return {"allow_likelihood_release": self.allow_likelihood_release, "min_latent_scale": self.min_latent_scale,
                "max_request_mb": self.max_request_mb, "max_width_ratio": self.max_width_ratio,
                "max_setup_width_ratio": self.setup_width_ratio,
                "accept_coordinator_features": self.accept_coordinator_features,
                "allow_explanations": self.allow_explanations}

    def describe(self) -> str:
        """One line for the party's start-up log, saying which keys its file changed from the preset."""
        seed = "seeds drawn by the party (secret)" if self.seed == "secret" else (
            "the coordinator's seed (research only)" if self.seed == "coordinator" else f"pinned seed {self.seed}")
        progs = "any program" if self.programs is None else ", ".join(
            "the package's own programs" if p == PACKAGE_PROGRAMS else p for p in self.programs)
        changed = ", ".join(f"{k} = {toml_value(v)}" for k, v in self.changed().items())
        how = f" changed by party.toml ({changed})" if changed else " (the preset unchanged)"
        dp = (f"; differential privacy: epsilon {self.dp_epsilon:g}, delta {self.dp_delta:g} per row"
              + (f" ({self.dp_mechanism} mechanism)" if self.dp_mechanism != "gaussian" else "")
              if self.dp_epsilon is not None else "")
        if self.require_label_dp is not None:
            dp += f"; fits only with label DP at epsilon <= {self.require_label_dp:g}"
        return (f"policy {self.preset}{how}: {progs}; {seed}; weight sharing "
                f"{'allowed' if self.allow_weight_sharing else 'refused'}{dp}")
