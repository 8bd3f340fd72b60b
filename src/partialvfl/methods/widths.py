"""Party widths within every party's announced policy.

A party announces its width caps in its ``hello`` (``[policy] max_width_ratio``, ``max_setup_width_ratio``:
:meth:`~partialvfl.federation.trust.policy.PartyPolicy.announced`).  Before a fit sets anything up, the widths a method
declares as widths of what a party sends (``Param(width=True)``: LASER-VFL's ``latent_dim``, FALSE-VFL's ``d_h``...)
and the user did not give are narrowed to the largest values every party accepts: one width for all parties (every
built-in method sums, averages or fuses the parties' outputs), so the narrowest party's cap sets it.  The widths are
checked the way the party checks them: the program's own ``describe_setup`` of the config each party would get.  A
width the user gave is never changed: a party whose cap it exceeds refuses the ``setup``, naming the rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from partialvfl.federation.trust.policy import PartyPolicy
from partialvfl.federation.wire.program import PROGRAMS
from partialvfl.federation.wire.refusals import PolicyViolation

if TYPE_CHECKING:
    from partialvfl.federation.runtime.coordinator import Federation

__all__ = ["fit_widths"]


def fit_widths(method: Any, federation: Federation) -> str | None:  # a VFLMethod (base imports this module)
    """Narrow ``method.params_``'s free width parameters to every party's announced caps; one line saying what
    was chosen and why (``None``: nothing changed)."""
    caps = [PartyPolicy.width_caps(a) for a in federation.announced_policies()]
    program = PROGRAMS.get(method.party_program)
    describe = None if program is None else lambda config: program.describe_setup(program.read_config(config))
    if describe is None or all(c.max_width_ratio is None and c.setup_width_ratio is None for c in caps):
        return None
    given = set(method.overrides)
    free = [p for p in method.param_space().params if p.width and p.name not in given and p.name in method.params_]
    if not free:
        return None
    before = {p.name: method.params_[p.name] for p in free}
    low = {p.name: int(p.low or 1) for p in free}
    binding: tuple[int, PolicyViolation] | None = None
    while (refused := _first_refusal(method, describe, caps)) is not None:
        binding = refused
        params: dict[str, Any] = dict(method.params_)
        narrowable = [name for name in before if params[name] > low[name]]
        if not narrowable:
            method.params_ = {**params, **before}  # nothing fits: ask as given, the parties refuse naming the rule
            return None
        widest = max(narrowable, key=lambda name: params[name])
        params[widest] -= 1
        method.params_ = params
    if binding is None:
        return None
    k, violation = binding
    chosen = ", ".join(f"{name} {before[name]} -> {method.params_[name]}" for name in before
                       if method.params_[name] != before[name])
    cap = caps[k].max_width_ratio if violation.rule == "max_width_ratio" else caps[k].setup_width_ratio
    return (f"[{method.name}] widths chosen within every party's announced policy: {chosen} (party {k} "
            f"({method.index_.party_names[k]!r}): {violation.rule} {cap:g} x {method.index_.feature_dims[k]} "
            f"features; --param {', '.join(before)} asks for other widths)")


def _first_refusal(method: Any, describe: Any, caps: list[PartyPolicy]) -> tuple[int, PolicyViolation] | None:
    """The first party whose announced width caps refuse the setup ``method`` would now ask of it."""
    for k, cap in enumerate(caps):
        try:
            shape = describe(method._party_config(k))
        except (KeyError, TypeError, ValueError):
            return None  # a config the program cannot describe: the party's own check refuses it, naming why
        refusal = cap.width_refusal(method.party_program, shape, int(method.index_.feature_dims[k]))
        if refusal is not None:
            return k, refusal
    return None
