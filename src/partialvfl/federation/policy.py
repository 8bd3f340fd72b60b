"""A party's policy: which party programs it runs, within which bounds, and who seeds its parameters.

The coordinator *asks* a party to build a program (``setup``: program name, config, seed); the party decides.  Its
:class:`PartyPolicy` (the ``[policy]`` table of ``party.toml``, every key in ``docs/deployment.md``) is checked on
every ``setup`` and on the requests that change how a program learns, in process and behind the gRPC server alike
(:class:`~partialvfl.federation.party.PartyRuntime` calls it).  A request outside the policy raises
:class:`PolicyViolation` (``PERMISSION_DENIED`` on the wire), naming the rule and the value.

Two presets: :meth:`PartyPolicy.default` (a deployed party: known programs only, nonlinear encoders of bounded width
and size, a learning-rate floor, no weight sharing, and a parameter-initialisation seed the party draws itself from
:mod:`secrets`) and :meth:`PartyPolicy.research` (the in-process simulation: anything, seeded by the coordinator, so
that benchmarks reproduce).

The architecture rules read a program's config through a *describer* (:func:`describe_setup`): built-in programs are
described here; a plugin program registers one with :func:`register_describer` or is listed in
``unchecked_programs`` (then the party runs it without architecture checks, its own decision).
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

__all__ = [
    "BUILTIN_PROGRAMS", "INFERENCE_KINDS", "Network", "PartyPolicy", "PolicyViolation", "SetupShape",
    "WEIGHT_SHARING_KINDS", "describe_setup", "register_describer",
]

#: The party programs of the methods in :mod:`partialvfl.methods` (the default allowlist).
BUILTIN_PROGRAMS = ("false-vfl/party", "splitnn/party", "x-vfl/party", "fedhssl/party")
#: Kinds whose reply carries the party's own parameters (allowed only with ``allow_weight_sharing``).
WEIGHT_SHARING_KINDS: dict[str, frozenset[str]] = {"fedhssl/party": frozenset({"get_top"})}
#: Kinds that only infer (never train): all a prediction table's rows may be used for (``train`` must be false).
INFERENCE_KINDS: dict[str, frozenset[str]] = {
    "splitnn/party": frozenset({"embed"}),
    "false-vfl/party": frozenset({"encode", "decode"}),
    "x-vfl/party": frozenset({"embed", "complete", "predict_local"}),
    "fedhssl/party": frozenset({"embed", "zero_embedding"}),
}
SEED_MODES = ("secret", "coordinator")


class PolicyViolation(PermissionError):
    """A request the party's policy refuses; ``rule`` is the policy key, ``value`` what the request asked for."""

    def __init__(self, rule: str, message: str, value: Any = None) -> None:
        super().__init__(f"policy rule {rule!r}: {message}")
        self.rule = rule
        self.value = value


# ---------------------------------------------------------------------- what a setup would build
@dataclass(frozen=True)
class Network:
    """One network a program builds from its config: what it computes from, its family and widths.

    ``sent_width``: how many values per row derived from it are sent to the coordinator (its output, or a gradient
    through it); ``None`` if nothing derived from it leaves the party.  The depth and width rules apply to networks
    that send something.
    """

    role: str
    family: str
    hidden: tuple[int, ...]
    in_shape: tuple[int, ...]
    out_width: int
    sent_width: int | None = None
    resnet_width: int = 64

    @property
    def crosses(self) -> bool:
        return self.sent_width is not None

    @property
    def in_width(self) -> int:
        return math.prod(self.in_shape)

    def parameters(self) -> int:
        """Estimated parameter count (exact for MLPs), computed before anything is built."""
        if self.family == "mlp":
            widths = [self.in_width, *self.hidden, self.out_width]
            return sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))
        if self.family in ("cnn", "deconv"):
            h, w = (self.in_shape[-2:] if len(self.in_shape) >= 2 else (self.in_width, 1))
            return 20_000 + 64 * ((h + 1) // 2) * ((w + 1) // 2) * (self.out_width + self.in_width)
        if self.family == "resnet18":
            return int(11_200_000 * (self.resnet_width / 64) ** 2) + 8 * self.resnet_width * (self.out_width + 1)
        return 0


@dataclass(frozen=True)
class SetupShape:
    """What a ``setup`` would build: its networks, the learning rates it sets, whether it shares weights."""

    networks: tuple[Network, ...]
    learning_rates: Mapping[str, float] = field(default_factory=dict)
    shares_weights: bool = False
    feature_shape: tuple[int, ...] | None = None


Describer = Callable[[Mapping[str, Any]], SetupShape]
_DESCRIBERS: dict[str, Describer] = {}


def register_describer(program: str, describer: Describer) -> None:
    """Let the policy check a plugin program's setups: ``describer(config)`` says what it would build."""
    _DESCRIBERS[program] = describer


def describe_setup(program: str, config: Mapping[str, Any]) -> SetupShape | None:
    """What ``program`` would build from ``config`` (``None``: no describer); a malformed config is a violation."""
    fn = _DESCRIBERS.get(program)
    if fn is None:
        return None
    try:
        return fn(config)
    except (KeyError, TypeError, ValueError) as e:
        raise PolicyViolation("programs", f"cannot read the {program!r} config ({type(e).__name__}: {e})") from None


def _shape(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    return tuple(int(s) for s in cfg["feature_shape"])


def _family(arch: Any, shape: tuple[int, ...]) -> str:
    arch = str(arch)
    if arch == "auto":
        return "mlp" if len(shape) == 1 else "cnn"
    return arch


def _decoder_family(arch: Any, shape: tuple[int, ...]) -> str:
    arch = str(arch)
    if arch == "auto":
        return "mlp" if len(shape) == 1 else "deconv"
    return arch


def _ints(v: Any) -> tuple[int, ...]:
    if isinstance(v, str | bytes) or not isinstance(v, Sequence):
        raise TypeError(f"expected a list of widths, got {v!r}")
    return tuple(int(h) for h in v)


def _splitnn(cfg: Mapping[str, Any]) -> SetupShape:
    shape = _shape(cfg)
    fam = _family(cfg.get("encoder", "auto"), shape)
    hidden = _ints(cfg.get("encoder_hidden", (256, 256)))
    latent = int(cfg["latent_dim"])
    nets = tuple(Network(f"model {name!r}", fam, hidden, shape, latent, latent,
                         resnet_width=int(cfg.get("resnet_width", 64))) for name in cfg["models"])
    return SetupShape(nets, {"optimizer.lr": float(cfg["optimizer"]["lr"])}, feature_shape=shape)


def _false_vfl(cfg: Mapping[str, Any]) -> SetupShape:
    shape = _shape(cfg)
    d_h, width = int(cfg["d_h"]), int(cfg["resnet_width"])
    nets = [Network("encoder", _family(cfg["encoder"], shape), _ints(cfg["encoder_hidden"]), shape, 2 * d_h, 2 * d_h,
                    resnet_width=width),
            # the decoder's log-likelihood of the party's rows, and its gradient (d_h per row), are sent
            Network("decoder", _decoder_family(cfg["decoder"], shape), _ints(cfg["decoder_hidden"]), (d_h,),
                    math.prod(shape), d_h)]
    if int(cfg["variant"]) == 2:
        nets.append(Network("missing indicator", "mlp", _ints(cfg["mask_hidden"]), shape, 1, 1))
    return SetupShape(tuple(nets), {"pretrain_lr": float(cfg["pretrain_lr"])}, feature_shape=shape)


def _x_vfl(cfg: Mapping[str, Any]) -> SetupShape:
    shape = _shape(cfg)
    e = int(cfg["embed_dim"])
    nets = (Network("bottom", _family(cfg["encoder"], shape), _ints(cfg["encoder_hidden"]), shape, e, e,
                    resnet_width=int(cfg["resnet_width"])),
            # the completer works on averaged embeddings; its output is re-encoded by the bottom model
            Network("xcom", _decoder_family(cfg["xcom"], shape), _ints(cfg["xcom_hidden"]), (e,), math.prod(shape)))
    return SetupShape(nets, {"optimizer.lr": float(cfg["optimizer"]["lr"])}, feature_shape=shape)


def _fedhssl(cfg: Mapping[str, Any]) -> SetupShape:
    shape = _shape(cfg)
    fam, hidden, latent = _family(cfg["encoder"], shape), _ints(cfg["encoder_hidden"]), int(cfg["latent_dim"])
    width = int(cfg["resnet_width"])
    proj = int(cfg["simsiam"]["proj_dim"])
    nets = (Network("cross-party encoder", fam, hidden, shape, latent, latent, resnet_width=width),
            Network("local encoder", fam, hidden, shape, latent, latent, resnet_width=width),
            Network("SimSiam projection", "mlp", (int(cfg["simsiam"]["proj_hidden"]),), (latent,), proj, proj))
    lrs = {"pretrain_optimizer.lr": float(cfg["pretrain_optimizer"]["lr"]),
           "finetune_optimizer.lr": float(cfg["finetune_optimizer"]["lr"])}
    return SetupShape(nets, lrs, shares_weights=str(cfg.get("aggregate", "top+head")) != "none", feature_shape=shape)


for _name, _fn in (("splitnn/party", _splitnn), ("false-vfl/party", _false_vfl), ("x-vfl/party", _x_vfl),
                   ("fedhssl/party", _fedhssl)):
    register_describer(_name, _fn)


# ---------------------------------------------------------------------- the policy
@dataclass(frozen=True)
class PartyPolicy:
    """What this party agrees to run (``None``: no bound).  See ``docs/deployment.md`` for every key."""

    preset: str = "default"
    programs: tuple[str, ...] | None = BUILTIN_PROGRAMS
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
    max_lookups: int | None = 2_000_000  # IDs this party blinds for others per session (keyless alignment)
    persist_alignment: bool = True  # keep a session's alignment nonce when asked (resuming a fit), else always fresh

    @classmethod
    def default(cls) -> PartyPolicy:
        """A deployed party's policy when its file says nothing."""
        return cls()

    @classmethod
    def research(cls) -> PartyPolicy:
        """The in-process simulation's policy: anything, seeded by the coordinator (benchmarks reproduce)."""
        return cls(preset="research", programs=None, encoders=None, min_hidden_layers=0, max_width_ratio=None,
                   min_lr=None, max_parameters=None, max_handles=None, max_config_kb=None,
                   allow_weight_sharing=True, seed="coordinator", max_lookups=None)

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
            changes[key] = _policy_value(key, value, where)
        policy = replace(base, **changes)
        if isinstance(policy.seed, str) and policy.seed not in SEED_MODES:
            raise ValueError(f"{where}: seed must be 'secret', 'coordinator' or an integer, got {policy.seed!r}")
        return policy

    # ------------------------------------------------------------------ seeds
    def init_seed(self, requested: int) -> int:
        """The seed the party builds its program with: its own secret draw, its pinned value, or the coordinator's."""
        if self.seed == "secret":
            return secrets.randbits(63)
        if self.seed == "coordinator":
            return int(requested)
        return int(self.seed)

    # ------------------------------------------------------------------ setup
    def check_setup(self, program: str, config: Mapping[str, Any], *, n_features: int | None = None,
                    feature_shape: Sequence[int] | None = None) -> SetupShape | None:
        """Refuse a ``setup`` outside the policy (:class:`PolicyViolation` naming the rule and the value).

        ``n_features``/``feature_shape``: the party's own table (the config's widths must agree with them).
        """
        if self.programs is not None and program not in self.programs:
            raise PolicyViolation("programs", f"program {program!r} is not one this party runs; it runs "
                                  f"{list(self.programs)}", program)
        if self.max_config_kb is not None:
            size = len(json.dumps(config, default=str).encode())
            if size > self.max_config_kb * 1024:
                raise PolicyViolation("max_config_kb", f"the setup config has {size / 1024:.1f} KB, more than "
                                      f"{self.max_config_kb:g} KB", size)
        if program in self.unchecked_programs or not self._bounds_architecture():
            return None
        shape = describe_setup(program, config)
        if shape is None:
            raise PolicyViolation("unchecked_programs", f"program {program!r} has no description the policy can "
                                  "check; list it in unchecked_programs to run it without architecture checks",
                                  program)
        self._check_shape(program, shape, n_features, feature_shape)
        return shape

    def _bounds_architecture(self) -> bool:
        return (self.encoders is not None or self.min_hidden_layers > 0 or self.max_width_ratio is not None
                or self.min_lr is not None or self.max_parameters is not None or not self.allow_weight_sharing)

    def _check_shape(self, program: str, shape: SetupShape, n_features: int | None,
                     feature_shape: Sequence[int] | None) -> None:
        if feature_shape is not None and shape.feature_shape is not None \
                and tuple(shape.feature_shape) != tuple(feature_shape):
            raise PolicyViolation("feature_shape", f"the config says feature_shape {list(shape.feature_shape)}, "
                                  f"this party's table has {list(feature_shape)}", list(shape.feature_shape))
        d = n_features if n_features is not None else (math.prod(shape.feature_shape) if shape.feature_shape
                                                        else None)
        total = 0
        for net in shape.networks:
            self._check_network(net, d)
            total += net.parameters()
        if self.max_parameters is not None and total > self.max_parameters:
            raise PolicyViolation("max_parameters", f"the {program!r} setup would build about {total:,} parameters, "
                                  f"more than {self.max_parameters:,}", total)
        for name, lr in shape.learning_rates.items():
            self.check_lr(lr, name)
        if shape.shares_weights and not self.allow_weight_sharing:
            raise PolicyViolation("allow_weight_sharing", f"{program!r} with model aggregation sends this party's "
                                  "local encoder weights to the coordinator; set allow_weight_sharing = true to "
                                  "agree", True)

    def _check_network(self, net: Network, d: int | None) -> None:
        if self.encoders is not None and net.family not in self.encoders:
            raise PolicyViolation("encoders", f"{net.role} is a {net.family!r} network; allowed: "
                                  f"{list(self.encoders)}", net.family)
        if net.crosses and net.family == "mlp" and len(net.hidden) < self.min_hidden_layers:
            raise PolicyViolation("min_hidden_layers", f"{net.role} is an MLP with {len(net.hidden)} hidden "
                                  f"layer(s) (hidden widths {list(net.hidden)}); at least {self.min_hidden_layers} "
                                  "required (a network without a nonlinearity can be inverted)", len(net.hidden))
        ratio = self.max_width_ratio
        if net.sent_width is not None and ratio is not None and d and net.sent_width > ratio * d:
            raise PolicyViolation("max_width_ratio", f"{net.role} would send {net.sent_width} values per row "
                                  f"computed from {d} features: more than {ratio:g} x {d}", net.sent_width)

    # ------------------------------------------------------------------ requests
    def check_lr(self, lr: Any, what: str = "lr") -> None:
        """Refuse a learning rate under the floor (a frozen model is a fixed, probeable function of the data)."""
        try:
            value = float(lr)
        except (TypeError, ValueError):
            raise PolicyViolation("min_lr", f"{what} {lr!r} is not a number", lr) from None
        if not math.isfinite(value) or value < 0 or (self.min_lr is not None and value < self.min_lr):
            floor = f"{self.min_lr:g}" if self.min_lr is not None else "0"
            raise PolicyViolation("min_lr", f"{what} {value:g} is under this party's floor of {floor}", value)

    def check_request(self, program: str | None, kind: str, meta: Mapping[str, Any]) -> None:
        """Refuse a program request outside the policy: weight sharing, learning rates under the floor."""
        if program is None:
            return
        if kind in WEIGHT_SHARING_KINDS.get(program, ()) and not self.allow_weight_sharing:
            raise PolicyViolation("allow_weight_sharing", f"{kind!r} would send this party's weights to the "
                                  "coordinator", kind)
        if self.min_lr is None:
            return
        if kind == "set_lr":
            self.check_lr(meta.get("lr"), "set_lr lr")
        simsiam = meta.get("simsiam")
        if isinstance(simsiam, Mapping) and "lr" in simsiam:
            self.check_lr(simsiam["lr"], f"{kind} simsiam lr")

    def check_handles(self, held: int, handle: str, existing: bool) -> None:
        """Refuse one more attached data set beyond ``max_handles``."""
        if not existing and self.max_handles is not None and held >= self.max_handles:
            raise PolicyViolation("max_handles", f"attaching {handle!r} would make {held + 1} data sets held at "
                                  f"once; at most {self.max_handles}", held + 1)

    def describe(self) -> str:
        """One line for the party's start-up log."""
        seed = "seeds drawn by the party (secret)" if self.seed == "secret" else (
            "the coordinator's seed (research only)" if self.seed == "coordinator" else f"pinned seed {self.seed}")
        progs = "any program" if self.programs is None else ", ".join(self.programs)
        return (f"policy {self.preset}: {progs}; {seed}; weight sharing "
                f"{'allowed' if self.allow_weight_sharing else 'refused'}")


_INT_KEYS = {"min_hidden_layers", "max_parameters", "max_handles", "max_lookups"}
_FLOAT_KEYS = {"max_width_ratio", "min_lr", "max_config_kb", "max_request_mb"}
_LIST_KEYS = {"programs", "unchecked_programs", "encoders"}


def _policy_value(key: str, value: Any, where: str) -> Any:
    """One ``[policy]`` value, type-checked (a wrong type names the key)."""
    if key in _LIST_KEYS:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where}: {key} must be a list of names, got {value!r}")
        return tuple(value)
    if key in ("allow_weight_sharing", "persist_alignment"):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
        return value
    if key == "seed":
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"{where}: seed must be 'secret', 'coordinator' or an integer, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{where}: {key} must be a non-negative number, got {value!r}")
    if key in _INT_KEYS:
        if int(value) != value:
            raise ValueError(f"{where}: {key} must be an integer, got {value!r}")
        return int(value)
    if key in _FLOAT_KEYS:
        return float(value)
    raise ValueError(f"{where}: unknown key {key!r}")  # pragma: no cover - from_table checks the names first


class InferenceGuard:
    """Rows of a prediction table never reach training.

    A request naming a prediction-only data set (``meta['data']``) must be one of the program's inference kinds
    (:data:`INFERENCE_KINDS`) without ``train``; after it, the party accepts only such requests until one names a
    training data set again (so a later training message cannot use what the program computed from those rows).
    """

    def __init__(self) -> None:
        self.tainted_by: str | None = None

    def check(self, program: str | None, kind: str, meta: Mapping[str, Any], prediction_handles: set[str]) -> None:
        """Raise :class:`PolicyViolation` (rule ``prediction_tables``) for a request that could train on them."""
        handle = meta.get("data")
        named = handle if isinstance(handle, str) else None
        on_prediction = named is not None and named in prediction_handles
        if not on_prediction and (self.tainted_by is None or named is not None):
            return
        allowed = INFERENCE_KINDS.get(program or "", frozenset())
        if kind not in allowed or meta.get("train"):
            source = named if on_prediction else self.tainted_by
            what = f"{kind!r} with train=true" if kind in allowed else f"{kind!r}"
            raise PolicyViolation("prediction_tables", f"{what} after rows of the prediction-only data set "
                                  f"{source!r}: those rows are only predicted, never trained on (inference kinds of "
                                  f"{program!r}: {sorted(allowed)})", kind)

    def accepted(self, meta: Mapping[str, Any], prediction_handles: set[str]) -> None:
        """Record a request that passed: which kind of data set it last named."""
        handle = meta.get("data")
        if isinstance(handle, str):
            self.tainted_by = handle if handle in prediction_handles else None

    def reset(self) -> None:
        """A new program (``setup``) holds nothing computed from earlier rows."""
        self.tainted_by = None
