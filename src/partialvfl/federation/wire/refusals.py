"""A party's refusal: :class:`PolicyViolation`, raised wherever a party declines a request (its policy, its
differential-privacy budget, its lookup budget, a guard), in process and behind the gRPC server (``PERMISSION_DENIED``
on the wire)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["PolicyViolation", "toml_value"]


def toml_value(value: Any) -> str:
    """A ``[policy]`` value as a party file writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if "e" in f"{value:g}" else f"{value:g}"
    if isinstance(value, str | int):
        return json.dumps(value)
    return json.dumps(list(value))


class PolicyViolation(PermissionError):
    """A request the party's policy refuses; ``rule`` is the policy key, ``value`` what the request asked for.

    ``accept``: the ``[policy]`` values of the party's ``party.toml`` that would accept the request (empty where no
    policy value would, e.g. a config that disagrees with the party's own table); ``also``: further rules the same
    setup breaks (all are named, so that one attempt shows everything there is to change).
    """

    def __init__(self, rule: str, message: str, value: Any = None, accept: Mapping[str, Any] | None = None, *,
                 also: Sequence[PolicyViolation] = ()) -> None:
        self.rule = rule
        self.value = value
        self.detail = message
        self.also = tuple(also)
        self.accept = dict(accept or {})
        for v in self.also:
            self.accept.update(v.accept)
        parts = [f"policy rule {rule!r}: {message}", *(f"policy rule {v.rule!r}: {v.detail}" for v in self.also)]
        hint = ", ".join(f"{k} = {toml_value(v)}" for k, v in self.accept.items())
        super().__init__("; ".join(parts) + (f" (this party would accept it with [policy] {hint} in its party.toml)"
                                             if hint else ""))

    @property
    def rules(self) -> tuple[str, ...]:
        """Every rule the request breaks, the first one first."""
        return (self.rule, *(v.rule for v in self.also))
