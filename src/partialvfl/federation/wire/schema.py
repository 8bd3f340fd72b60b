"""Typed messages: what a party program accepts and answers, per message kind, checked on every exchange.

A party program declares, for every kind it answers, the request and reply tensors and the metadata keys::

    class FalseVFLParty(PartyProgram):
        messages: ClassVar[Messages] = {
            "encode": MessageSpec(
                request=[TensorSpec("rows", "int64", ("B",))],
                reply=[TensorSpec("mu", "float32", ("B", "d_h")), TensorSpec("logvar", "float32", ("B", "d_h"))],
                meta={"data": HANDLE}, optional_meta={"train": FLAG}),
        }

A shape is a tuple of dimensions (``None``: any rank).  A dimension is a fixed size (``32``), a *symbol* (``"B"``)
or a sum of symbols (``"B+M"``).  A symbol takes its size from the first tensor of the exchange that has it (request
first, then reply) and every other occurrence must match; a symbol naming an integer key of the program's config
(``d_h``, ``feature_dim``, ...) must equal that value; a sum is checked once all its symbols are known.

A tensor name may be a pattern: ``rows:{model}`` matches ``rows:f``, ``rows:g``... and its symbols are scoped per
placeholder value (``rows:f`` and ``emb:f`` share a ``B``, ``rows:g`` and ``emb:g`` another); ``top.*`` matches any
name that starts with ``top.``.  A required reply pattern whose placeholder appears in the request must answer every
value the request used (``rows:f`` -> ``emb:f``).  ``when={"variant": 2}`` admits a tensor only if the program's
config has those values.  The transports' stamps ``step`` and ``round`` are always accepted as metadata.

Each metadata key has a type (:mod:`.meta_keys`: ``meta={"data": HANDLE}``, ``optional_meta={"samples":
MetaKey(int, low=1)}``; a key named in a list, ``meta=["data"]``, takes any value): the request's metadata is read
once, on arrival, and the handler gets the typed values; a value its key does not admit (``"32"`` for an integer,
``1`` for a flag, ``nan``) is refused naming the program, the kind and the key.  The stamps are integers >= 0.

A program's message also says what it is for (``role``, read by the party's policy, never a method name):
``"trains"`` (it changes the program's state: the default, the safe assumption), ``"infers"`` (it computes from rows
without learning unless its request sets ``train``: the only kinds a prediction table's rows may be used for) or
``"shares_weights"`` (its reply carries the party's own parameters: refused unless the party allows weight sharing).
``releases`` names the reply tensors that carry values per row computed from the party's features (what a privacy
budget meters), ``learning_rates`` the request metadata holding learning rates (dotted paths, e.g.
``"simsiam.lr"``; the policy holds them within its floor and ceiling), ``weight_decays`` and ``momenta`` the metadata
holding those optimiser settings (bounded by the policy: a huge weight decay zeroes every weight in one step), and
``gradients`` the request tensors that are gradients per row (the party clips each row's norm to its policy's
``max_grad_norm`` before the handler sees it, so that no gradient scaling undoes the learning-rate bounds).

:func:`check_request` / :func:`check_reply` raise :class:`MessageError`, naming the program, the kind, the
direction and the tensor; :meth:`~partialvfl.federation.runtime.party.PartyRuntime.handle` calls them for every message,
in process and behind the gRPC server alike.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from partialvfl.federation.wire.meta_keys import ANY, MetaKey, MetaValueError

__all__ = [
    "DTYPES", "INFERS", "ROLES", "SHARES_WEIGHTS", "STAMPS", "TRAINS", "MessageError", "MessageSpec", "Messages",
    "TensorSpec", "UnknownKindError", "check_reply", "check_request", "kinds_with_role", "messages_markdown",
    "meta_path", "tensor_names",
]

#: dtype names a declaration may use (those the wire carries)
DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8", "bool")
#: metadata keys every request may carry: the transports stamp them
STAMPS = ("step", "round")
#: what a program's message is for (see the module docstring)
TRAINS, INFERS, SHARES_WEIGHTS = "trains", "infers", "shares_weights"
ROLES = (TRAINS, INFERS, SHARES_WEIGHTS)
Direction = Literal["request", "reply"]
Dim = int | str
_PLACEHOLDER = re.compile(r"\{([A-Za-z_]\w*)\}")
_SYMBOL = re.compile(r"^[A-Za-z_]\w*$")


#: the transports' stamps: integers >= 0 (``None``: a request a server builds itself, such as a carried attach)
_STAMP = MetaKey(int | None, low=0)


class MessageError(ValueError):
    """A request or reply that does not match its kind's declaration (the same text in process and on the wire)."""

    def __init__(self, where: str, kind: str, direction: Direction | None, detail: str,
                 tensor: str | None = None) -> None:
        head = f"{where}, kind {kind!r}" + (f", {direction}" if direction else "")
        super().__init__(f"{head}: {detail}")
        self.where = where
        self.kind = kind
        self.direction = direction
        self.tensor = tensor
        self.detail = detail


class UnknownKindError(MessageError):
    """A message kind that neither the runtime nor the program declares."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a message: its name (or name pattern), dtype(s), shape, and whether it may be left out."""

    name: str
    dtype: str | tuple[str, ...]
    shape: tuple[Dim, ...] | None = None
    optional: bool = False
    when: tuple[tuple[str, Any], ...] | Mapping[str, Any] = ()
    _pattern: re.Pattern[str] | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        dtypes = (self.dtype,) if isinstance(self.dtype, str) else tuple(self.dtype)
        bad = [d for d in dtypes if d not in DTYPES]
        if bad or not dtypes:
            raise ValueError(f"tensor {self.name!r}: dtype {bad or dtypes} is not one of {', '.join(DTYPES)}")
        object.__setattr__(self, "dtype", dtypes)
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(self.shape))
            for d in self.shape:
                terms = d.split("+") if isinstance(d, str) else []
                if not (isinstance(d, int) and d >= 0) and not (terms and all(_SYMBOL.match(t) for t in terms)):
                    raise ValueError(f"tensor {self.name!r}: dimension {d!r} is neither a size nor a symbol")
        when = self.when.items() if isinstance(self.when, Mapping) else self.when
        object.__setattr__(self, "when", tuple(sorted(when)))
        if "{" in self.name or "*" in self.name:
            parts = re.split(r"(\{[A-Za-z_]\w*\}|\*)", self.name)
            rx = "".join(f"(?P<{p[1:-1]}>.+?)" if p.startswith("{") else "(?P<_>.+)" if p == "*" else re.escape(p)
                         for p in parts)
            object.__setattr__(self, "_pattern", re.compile(f"^{rx}$"))

    @property
    def is_pattern(self) -> bool:
        """Whether the declared name is a pattern (``grad:<model>``) rather than one name."""
        return self._pattern is not None

    def match(self, name: str) -> dict[str, str] | None:
        """The placeholder values if ``name`` is this tensor (``{}`` for an exact name), else ``None``."""
        if self._pattern is None:
            return {} if name == self.name else None
        m = self._pattern.match(name)
        return None if m is None else m.groupdict()

    def applies(self, config: Mapping[str, Any]) -> bool:
        """Whether the program's config admits this tensor (its ``when`` conditions hold; a tuple of values: any
        of them)."""
        return all(config.get(k) in v if isinstance(v, tuple) else config.get(k) == v
                   for k, v in self.when)  # type: ignore[misc]

    def describe(self) -> str:
        """The declared dtype and shape in words."""
        shape = "any shape" if self.shape is None else f"shape ({', '.join(map(str, self.shape))})"
        return f"{'/'.join(self.dtype)} {shape}"


@dataclass(frozen=True)
class MessageSpec:
    """One message kind: request tensors, reply tensors, required and optional metadata keys of the request; its
    ``role``, the reply tensors it ``releases`` per row, the metadata holding ``learning_rates``, ``weight_decays``
    and ``momenta`` (optimiser settings the policy bounds), and the request tensors that are ``gradients`` per row
    (a name, or ``{name: row dimension}``; the party bounds each row's norm: ``[policy] max_grad_norm``)."""

    request: Sequence[TensorSpec] = ()
    reply: Sequence[TensorSpec] = ()
    meta: Sequence[str] | Mapping[str, MetaKey] = ()
    optional_meta: Sequence[str] | Mapping[str, MetaKey] = ()
    doc: str = ""
    role: str = TRAINS
    releases: Sequence[str] = ()
    learning_rates: Sequence[str] = ()
    gradients: Sequence[str] | Mapping[str, int] = ()
    weight_decays: Sequence[str] = ()
    momenta: Sequence[str] = ()
    #: every metadata key's declared type, required keys first (``meta`` and ``optional_meta`` hold the names)
    meta_types: tuple[tuple[str, MetaKey], ...] = field(init=False, default=())
    _meta_index: dict[str, MetaKey] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        types: list[tuple[str, MetaKey]] = []
        for attr in ("meta", "optional_meta"):
            keys = getattr(self, attr)
            typed = keys.items() if isinstance(keys, Mapping) else ((k, ANY) for k in keys)
            for name, key in typed:
                if not isinstance(key, MetaKey):
                    raise TypeError(f"meta key {name!r} is declared as {key!r}, not a MetaKey")
                types.append((str(name), key))
            object.__setattr__(self, attr, tuple(str(k) for k in keys))
        object.__setattr__(self, "meta_types", tuple(types))
        object.__setattr__(self, "_meta_index", {**dict(types), **{s: _STAMP for s in STAMPS}})
        for attr in ("request", "reply", "releases", "learning_rates", "weight_decays", "momenta"):
            object.__setattr__(self, attr, tuple(getattr(self, attr)))
        grads = self.gradients.items() if isinstance(self.gradients, Mapping) else ((g, 0) for g in self.gradients)
        object.__setattr__(self, "gradients", tuple((str(n), int(d)) for n, d in grads))
        for side in (self.request, self.reply):
            names = [t.name for t in side]
            if len(set(names)) != len(names):
                raise ValueError(f"a message declares a tensor twice: {names}")
        both = set(self.meta) & set(self.optional_meta)
        if both:
            raise ValueError(f"meta keys {sorted(both)} are both required and optional")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        unknown = sorted(set(self.releases) - {t.name for t in self.reply})
        if unknown:
            raise ValueError(f"releases names {unknown}, which are not reply tensors of the message")
        keys = set(self.meta) | set(self.optional_meta)
        for attr in ("learning_rates", "weight_decays", "momenta"):
            stray = sorted(p for p in getattr(self, attr) if p.split(".", 1)[0] not in keys)
            if stray:
                raise ValueError(f"{attr} names {stray}, which are not meta keys of the message")
        requested = {t.name for t in self.request}
        stray = sorted(n for n, _ in self.gradients if n not in requested)
        if stray:
            raise ValueError(f"gradients names {stray}, which are not request tensors of the message")


Messages = Mapping[str, MessageSpec]


# ---------------------------------------------------------------------- checking
def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


class _Exchange:
    """Symbol bindings of one request/reply exchange, checked tensor by tensor."""

    def __init__(self, spec: MessageSpec, where: str, kind: str, config: Mapping[str, Any] | None) -> None:
        self.spec, self.where, self.kind = spec, where, kind
        self.config_all = dict(config or {})  # ``when`` conditions may name any key
        self.config = {k: v for k, v in self.config_all.items() if isinstance(v, int) and not isinstance(v, bool)}
        self.bound: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[int, str]] = {}
        self.sums: list[tuple[Direction, str, int, str, tuple[tuple[str, str], ...], int]] = []
        self.values: dict[str, set[str]] = {}  # placeholder -> values seen in the request

    def fail(self, direction: Direction, detail: str, tensor: str | None = None) -> MessageError:
        return MessageError(self.where, self.kind, direction, detail, tensor)

    def lookup(self, symbol: str, scope: tuple[tuple[str, str], ...]) -> tuple[int, str] | None:
        if symbol in self.config:
            return self.config[symbol], "the program's config"
        return self.bound.get((symbol, scope))

    def side(self, direction: Direction, specs: Sequence[TensorSpec], tensors: Mapping[str, torch.Tensor]) -> None:
        specs = [s for s in specs if s.applies(self.config_all)]
        matched: dict[str, tuple[TensorSpec, dict[str, str]]] = {}
        exact_first = sorted(specs, key=lambda s: s.is_pattern)
        for name in sorted(tensors):  # a canonical order: the wire does not keep the sender's
            for s in exact_first:
                groups = s.match(name)
                if groups is not None:
                    matched[name] = (s, groups)
                    break
        unexpected = sorted(n for n in tensors if n not in matched)
        if unexpected:
            name = unexpected[0]
            excluded = [s for s in self.all_specs(direction) if s.match(name) is not None and s not in specs]
            why = f" (only when {_when(excluded[0])})" if excluded else ""
            declared = ", ".join(s.name for s in specs) or "none"
            raise self.fail(direction, f"unexpected tensor {name!r}{why}; declared: {declared}", name)
        for s in specs:
            hits = [g for n, (m, g) in matched.items() if m is s]
            if s.optional:
                continue
            if not s.is_pattern and not hits:
                raise self.fail(direction, f"missing tensor {s.name!r} ({s.describe()})", s.name)
            if s.is_pattern:
                self._check_family(direction, s, hits)
        for name in sorted(matched, key=lambda n: (specs.index(matched[n][0]), n)):  # in declaration order
            s, groups = matched[name]
            self._check_tensor(direction, name, tensors[name], s, groups)
            if direction == "request":
                for key, value in groups.items():
                    self.values.setdefault(key, set()).add(value)

    def _check_family(self, direction: Direction, s: TensorSpec, hits: list[dict[str, str]]) -> None:
        keys = [k for k in _PLACEHOLDER.findall(s.name) if k in self.values] if direction == "reply" else []
        if not keys and not hits:
            raise self.fail(direction, f"missing tensor {s.name!r}: at least one is required ({s.describe()})",
                            s.name)
        for key in keys:
            got = {g[key] for g in hits}
            for value in sorted(self.values[key] - got):
                name = s.name.replace(f"{{{key}}}", value)
                raise self.fail(direction, f"missing tensor {name!r} (the request has {key} {value!r})", name)

    def _check_tensor(self, direction: Direction, name: str, t: torch.Tensor, s: TensorSpec,
                      groups: dict[str, str]) -> None:
        if not isinstance(t, torch.Tensor):
            raise self.fail(direction, f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor", name)
        if _dtype(t) not in s.dtype:
            raise self.fail(direction, f"tensor {name!r} must be {'/'.join(s.dtype)}, got {_dtype(t)}", name)
        if s.shape is None:
            return
        shape = tuple(int(v) for v in t.shape)
        if len(shape) != len(s.shape):
            raise self.fail(direction, f"tensor {name!r} must have rank {len(s.shape)} "
                                       f"({', '.join(map(str, s.shape))}), got shape {shape}", name)
        scope = tuple(sorted(groups.items()))
        for i, (dim, size) in enumerate(zip(s.shape, shape)):
            if isinstance(dim, int):
                if size != dim:
                    raise self.fail(direction, f"tensor {name!r} dimension {i} must be {dim}, got {size}", name)
            elif "+" in dim:
                self.sums.append((direction, name, i, dim, scope, size))
            elif (known := self.lookup(dim, scope)) is None:
                self.bound[(dim, scope)] = (size, f"tensor {name!r}")
            elif known[0] != size:
                raise self.fail(direction, f"tensor {name!r} dimension {i} ({dim}) is {size}, but {dim} = "
                                           f"{known[0]} from {known[1]}", name)

    def check_sums(self) -> None:
        for direction, name, i, dim, scope, size in self.sums:
            known = [self.lookup(sym, scope) for sym in dim.split("+")]
            if all(k is not None for k in known) and sum(k[0] for k in known if k) != size:
                parts = ", ".join(f"{sym} = {k[0]}" for sym, k in zip(dim.split("+"), known) if k)
                raise self.fail(direction, f"tensor {name!r} dimension {i} ({dim}) is {size}, but {parts}", name)

    def all_specs(self, direction: Direction) -> Sequence[TensorSpec]:
        return self.spec.request if direction == "request" else self.spec.reply


def _when(s: TensorSpec) -> str:
    return ", ".join(f"{k} in {list(v)!r}" if isinstance(v, tuple) else f"{k}={v!r}" for k, v in s.when)


def _read_meta(ex: _Exchange, spec: MessageSpec, meta: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(meta, Mapping):
        raise ex.fail("request", f"metadata must be an object, got {type(meta).__name__}")
    types = spec._meta_index  # the declared keys and the stamps
    for key in spec.meta:
        if key not in meta:
            raise ex.fail("request", f"missing meta key {key!r} ({types[key].describe()})")
    unknown = sorted(str(k) for k in meta if k not in types)
    if unknown:
        accepted = ", ".join([*spec.meta, *spec.optional_meta]) or "none"
        raise ex.fail("request", f"unknown meta key {unknown[0]!r}; accepted: {accepted} (and the stamps "
                                 f"{', '.join(STAMPS)})")
    try:
        return {k: types[k].read(v, k) for k, v in meta.items()}
    except MetaValueError as e:
        raise ex.fail("request", str(e)) from None


def check_request(spec: MessageSpec, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], *,
                  where: str, kind: str, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The request's metadata as its handler reads it (every key's declared type, :mod:`.meta_keys`); raise
    :class:`MessageError` unless the metadata and the tensors match ``spec``."""
    ex = _Exchange(spec, where, kind, config)
    typed = _read_meta(ex, spec, meta)
    ex.side("request", spec.request, tensors)
    ex.check_sums()
    return typed


def check_reply(spec: MessageSpec, request: Mapping[str, torch.Tensor], reply: Mapping[str, torch.Tensor], *,
                where: str, kind: str, config: Mapping[str, Any] | None = None) -> None:
    """Raise :class:`MessageError` unless the reply's tensors match ``spec`` (dimensions bound by the request)."""
    ex = _Exchange(spec, where, kind, config)
    ex.side("request", spec.request, request)
    ex.side("reply", spec.reply, reply)
    ex.check_sums()


# ---------------------------------------------------------------------- derived views
def _messages(source: Any) -> Messages:
    return source if isinstance(source, Mapping) else source.messages


def tensor_names(source: Any, config: Mapping[str, Any] | None = None,
                 kinds: Iterable[str] | None = None) -> frozenset[str]:
    """Every tensor name (patterns as written) a program class or a ``{kind: MessageSpec}`` mapping declares.

    With ``config``, only tensors that config admits (``when``); with ``kinds``, only those kinds.
    """
    msgs = _messages(source)
    wanted = set(msgs) if kinds is None else set(kinds)
    unknown = wanted - set(msgs)
    if unknown:
        raise ValueError(f"no message kind(s) {sorted(unknown)}; declared: {sorted(msgs)}")
    return frozenset(t.name for k in wanted for t in (*msgs[k].request, *msgs[k].reply)
                     if config is None or t.applies(config))


def kinds_with_role(source: Any, role: str) -> frozenset[str]:
    """The kinds a program class (or a ``{kind: MessageSpec}`` mapping) declares with ``role``."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return frozenset(k for k, spec in _messages(source).items() if spec.role == role)


def meta_path(meta: Mapping[str, Any], path: str) -> tuple[bool, Any]:
    """``(found, value)`` of the dotted ``path`` in request metadata (``"simsiam.lr"``: ``meta["simsiam"]["lr"]``)."""
    value: Any = meta
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return False, None
        value = value[key]
    return True, value


def _shape(t: TensorSpec) -> str:
    return "any" if t.shape is None else "(" + ", ".join(map(str, t.shape)) + (",)" if len(t.shape) == 1 else ")")


def _role_markdown(spec: MessageSpec) -> str:
    released = ", ".join(f"`{n}`" for n in spec.releases) or "nothing"
    line = f"Role: {spec.role}. Released per row: {released}."
    if spec.learning_rates:
        line += (" Learning rates (held within the party's `min_lr`/`max_lr`): "
                 f"{', '.join(f'`{p}`' for p in spec.learning_rates)}.")
    for attr, key in (("weight_decays", "max_weight_decay"), ("momenta", "max_momentum")):
        if getattr(spec, attr):
            line += (f" {attr.replace('_', ' ').capitalize()} (held to the party's `{key}`): "
                     f"{', '.join(f'`{p}`' for p in getattr(spec, attr))}.")
    if spec.gradients:
        line += (" Gradients per row (each row's norm clipped to the party's `max_grad_norm`): "
                 f"{', '.join(f'`{n}`' for n, _ in spec.gradients)}.")
    return line


def _kind_markdown(kind: str, spec: MessageSpec, program: bool) -> list[str]:
    lines = [f"#### `{kind}`", ""]
    if spec.doc:
        lines += [spec.doc, ""]
    if program:
        lines += [_role_markdown(spec), ""]
    rows = [(d, t) for d, side in (("request", spec.request), ("reply", spec.reply)) for t in side]
    if rows:
        lines += ["| | tensor | dtype | shape | notes |", "|---|---|---|---|---|"]
        for d, t in rows:
            notes = ", ".join(n for n in ("optional" if t.optional else "", f"when {_when(t)}" if t.when else "") if n)
            lines.append(f"| {d} | `{t.name}` | {'/'.join(t.dtype)} | {_shape(t)} | {notes} |")
    else:
        lines.append("No tensors.")
    required = set(spec.meta)
    if spec.meta_types:
        lines += ["", "| meta | accepts | presence | meaning |", "|---|---|---|---|"]
        for k, key in spec.meta_types:
            lines.append(f"| `{k}` | {key.describe()} | {'required' if k in required else 'optional'} | {key.doc} |")
        lines.append("")
    else:
        lines += ["", "Meta: none.", ""]
    return lines


def messages_markdown(sections: Sequence[tuple[str, str, Messages, bool]]) -> str:
    """``docs/messages.md``: one section per ``(title, description, messages, program)``, one table per kind
    (``program``: a party program's messages, whose roles are shown)."""
    lines = [
        "# Party messages",
        "",
        "Generated from the declarations (`messages` and `setup_config` of each party program, the runtime's and "
        "the gRPC server's built-ins) by `scripts/message_docs.py`; `tests/test_schema.py` fails when this file is "
        "out of date.",
        "Both transports check every request and reply against these declarations "
        "(`partialvfl.federation.wire.schema`).",
        "",
        "Shapes: a number is a fixed size; a name is a symbol that must have the same size wherever it appears in "
        "one request and its reply (a name that is an integer key of the program's config, such as `d_h`, must "
        "equal that value); `B+M` is the sum of two symbols; `any` is any rank. `rows:{model}` names a family of "
        "tensors, one per model, each with its own symbols; `top.*` any name starting with `top.`. "
        "Every request may also carry the transports' stamps `step` and `round` (integers >= 0).",
        "",
        "Each metadata key has a type, checked strictly as JSON carries it when the request arrives (`\"32\"` is "
        "not an integer, `1` is not `true`, never `NaN`); the party refuses a request whose metadata does not "
        "match in one line naming the party, the program, the kind and the key, and its handler reads the typed "
        "values (`partialvfl.federation.wire.meta_keys`).",
        "",
        "Each program message has a role, which the party's policy reads (never a method's name): `trains` (it "
        "changes the program's state), `infers` (it computes from rows without learning unless its request sets "
        "`train`: the only kinds a prediction table's rows may be used for) or `shares_weights` (its reply carries "
        "the party's own parameters: refused unless the party sets `allow_weight_sharing`). \"Released per row\" "
        "names the reply tensors that carry values computed from the party's features, one per row.",
        "",
    ]
    for title, description, msgs, program in sections:
        lines += [f"## {title}", ""]
        if description:
            lines += [description, ""]
        for kind in msgs:  # declaration order: the order of a protocol
            lines += _kind_markdown(kind, msgs[kind], program)
    return "\n".join(lines).rstrip() + "\n"
