"""What a ``setup`` would build, as a party program describes it for the party's policy.

A party program says, from the config the coordinator sent, which networks it would build (their families and
widths, what leaves the party per row), the learning rates it sets and whether it shares weights:
:meth:`~partialvfl.federation.wire.program.PartyProgram.describe_setup` returns a :class:`SetupShape`.  The policy
checks that description (:meth:`~partialvfl.federation.trust.policy.PartyPolicy.check_setup`), never a method's
config keys; the program reads its own config, typed by its declaration
(:mod:`partialvfl.federation.wire.setup_config`), which refused a malformed one on arrival.  :func:`optimiser_settings`
turns declared optimisers into a description's settings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from partialvfl.federation.wire.setup_config import OptimiserSetup

__all__ = ["Network", "SetupShape", "optimiser_settings"]


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
        """Whether the network's output is sent across the party boundary."""
        return self.sent_width is not None

    @property
    def in_width(self) -> int:
        """The width of the network's flattened input."""
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
    """What a ``setup`` would build: its networks, the optimiser settings it uses (learning rates, weight decays,
    momenta, by the config key they come from), whether it shares weights, and whether it answers
    ``likelihood_oracle`` queries: the likelihood of the party's rows under a model evaluated at points (latents)
    the coordinator chooses freely (e.g. FALSE-VFL's ``decode`` with the ``lean`` or ``samples`` wire), an exact
    oracle on the party's raw rows that a party releases only if its policy allows it."""

    networks: tuple[Network, ...]
    learning_rates: Mapping[str, float] = field(default_factory=dict)
    shares_weights: bool = False
    feature_shape: tuple[int, ...] | None = None
    weight_decays: Mapping[str, float] = field(default_factory=dict)
    momenta: Mapping[str, float] = field(default_factory=dict)
    likelihood_oracle: bool = False
    latent_scale_floor: float | None = None  # a program drawing its own latents: the smallest scale it evaluates

    @property
    def sent_width(self) -> int:
        """Values per row the whole setup can send: the sum over its networks (several models are several
        outputs)."""
        return sum(n.sent_width or 0 for n in self.networks)


def optimiser_settings(**optimisers: OptimiserSetup) -> dict[str, dict[str, float]]:
    """``SetupShape`` keyword arguments for declared optimisers by config key: their learning rates, weight decays
    and, for SGD, momenta (Adam does not use one)."""
    out: dict[str, dict[str, float]] = {"learning_rates": {}, "weight_decays": {}, "momenta": {}}
    for key, opt in optimisers.items():
        out["learning_rates"][f"{key}.lr"] = opt.lr
        out["weight_decays"][f"{key}.weight_decay"] = opt.weight_decay
        if opt.name == "sgd":
            out["momenta"][f"{key}.momentum"] = opt.momentum
    return out
