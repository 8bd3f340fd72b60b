"""What a ``setup`` would build, as a party program describes it for the party's policy.

A party program says, from the config the coordinator sent, which networks it would build (their families and
widths, what leaves the party per row), the learning rates it sets and whether it shares weights:
:meth:`~partialvfl.federation.party.PartyProgram.describe_setup` returns a :class:`SetupShape`.  The policy checks
that description (:meth:`~partialvfl.federation.policy.PartyPolicy.check_setup`), never a method's config keys; the
program reads its own config.  :func:`widths` and :func:`feature_shape_of` read the values every description needs,
raising on a malformed config (which the policy refuses, naming the program).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Network", "SetupShape", "feature_shape_of", "widths"]


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
            sizes = [self.in_width, *self.hidden, self.out_width]
            return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
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


def widths(value: Any) -> tuple[int, ...]:
    """A list of layer widths from a config (``TypeError`` for anything else, e.g. a string)."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"expected a list of widths, got {value!r}")
    return tuple(int(h) for h in value)


def feature_shape_of(config: Mapping[str, Any]) -> tuple[int, ...]:
    """The party's feature shape as the config states it (every program's config carries ``feature_shape``)."""
    return tuple(int(s) for s in config["feature_shape"])
