"""The contract of a party program: the party-local half of a method, one ``on_<kind>`` handler per message kind.

A method is a :class:`PartyProgram` (registered by name with :func:`register_program`) plus coordinator code that
talks to the programs through a :class:`~partialvfl.federation.wire.transport.Transport`.  A party builds a program
when a ``setup`` request names it and its policy agrees (:class:`~partialvfl.federation.runtime.party.PartyRuntime`);
:data:`RUNTIME_MESSAGES` are the kinds every party answers itself, which no program may declare.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from partialvfl.data.dataset import PartyView
from partialvfl.federation.wire.messages import Reply, Request
from partialvfl.federation.wire.meta_keys import COUNT, FLAG, HANDLE, SEED, MetaKey
from partialvfl.federation.wire.schema import Messages, MessageSpec
from partialvfl.federation.wire.setup_config import SetupConfig, wire_config
from partialvfl.federation.wire.setup_shape import SetupShape
from partialvfl.utils.devices import to_device

__all__ = ["PACKAGE_PROGRAMS", "PROGRAMS", "RUNTIME_MESSAGES", "NotSetUp", "PartyProgram", "StateFileError",
           "register_program", "state_file"]

#: In a policy's ``programs``: every registered program whose class is defined in the ``partialvfl`` package.
PACKAGE_PROGRAMS = "builtin"

PROGRAMS: dict[str, type[PartyProgram]] = {}

_DIR = MetaKey(str, doc="a state directory")
_MODEL = MetaKey(str | None, doc="the model's digest")

#: The runtime's own message kinds.
RUNTIME_MESSAGES: dict[str, MessageSpec] = {
    "ping": MessageSpec(doc="Is the party there? Replies its index and name as metadata."),
    "setup": MessageSpec(meta={"program": MetaKey(str, doc="a registered party program"), "seed": SEED},
                         optional_meta={"config": MetaKey(dict, doc="the program's set-up config"),
                                        "privacy": MetaKey(dict | None, doc="the method's privacy plan"),
                                        "fit": FLAG, "label_dp": MetaKey(float | None, low=0, doc="epsilon")},
                         doc="Build the named party program with this config and seed. `privacy`: the method's plan "
                             "for a party with a differential-privacy budget (charges per row, clip norms); such a "
                             "party refuses a setup without one. `fit`: the setup is for a fit (it will train), "
                             "`label_dp`: the epsilon of the fit's label DP; a party that requires label protection "
                             "refuses a fit without it, and trains nothing after a setup that is not such a fit. "
                             "Replies `privacy` (the party's budget, what it spent, the noise it will add) where the "
                             "party has a budget."),
    "privacy": MessageSpec(doc="The party's differential-privacy budget and what its most-charged row has spent "
                               "(`enabled` false where it keeps none)."),
    "preprocess": MessageSpec(meta={"data": HANDLE, "standardize": FLAG},
                              doc="Fit this party's own preprocessing on its rows attached under `data` (with "
                                  "`standardize`: per-column mean and scale; else none). The statistics stay at the "
                                  "party, are saved with its state and applied to every dataset it is handed."),
    "save": MessageSpec(meta={"dir": _DIR}, optional_meta={"model": _MODEL},
                        doc="Save the program's state and preprocessing (`party-<k>.pt` in `dir`), tagged with the "
                            "digest of the model it belongs to (`model`)."),
    "load": MessageSpec(meta={"dir": _DIR}, optional_meta={"model": _MODEL},
                        doc="Restore the state saved in `dir`; refused if it belongs to another model than `model`."),
    "forget": MessageSpec(meta={"dir": _DIR}, doc="Delete the state saved in `dir` (a pruned checkpoint)."),
    "explain": MessageSpec(meta={"data": HANDLE, "rows": COUNT, "predictions": COUNT}, optional_meta={"check": FLAG},
                           doc="An explanation (or a party value) is about to predict `rows` of `data` from "
                               "coalitions of parties: `predictions` predictions that use this party's block "
                               "beyond each row's own. Refused unless the party's policy allows explanations; a "
                               "party server charges `predictions` to the coordinator's lookup budget first "
                               "(refused past it). `check`: only say whether it would be accepted, charge nothing "
                               "(the coordinator asks every party so before it charges any)."),
}

class NotSetUp(RuntimeError):
    """A program's message kind arrived before any ``setup`` (e.g. at a party restarted since)."""


class StateFileError(ValueError):
    """A party's saved state is missing, corrupted, truncated, foreign, or belongs to another model."""


def _handler_kinds(cls: type) -> set[str]:
    return {name.removeprefix("on_") for name in dir(cls) if name.startswith("on_") and callable(getattr(cls, name))}


def register_program(cls: type[PartyProgram]) -> type[PartyProgram]:
    """Class decorator: make a party program constructible by name in a ``setup`` request.

    The program must declare every kind it answers in ``messages`` (and answer every kind it declares).
    """
    name = cls.program_name
    if not name:
        raise ValueError(f"{cls.__name__} has no program_name")
    if name == PACKAGE_PROGRAMS:
        raise ValueError(f"{name!r} names the package's own programs in a policy; choose another program_name")
    if name in PROGRAMS and PROGRAMS[name] is not cls:
        raise ValueError(f"party program {name!r} registered twice")
    declared = dict(cls.messages)
    if not declared:
        raise ValueError(f"party program {name!r} declares no messages (class attribute `messages`)")
    handlers = _handler_kinds(cls)
    for kind in declared:
        if kind in RUNTIME_MESSAGES:
            raise ValueError(f"party program {name!r} declares the runtime's built-in kind {kind!r}")
        if kind.replace("-", "_") not in handlers:
            raise ValueError(f"party program {name!r} declares kind {kind!r} but has no on_{kind.replace('-', '_')}")
    undeclared = sorted(h for h in handlers if h not in {k.replace("-", "_") for k in declared})
    if undeclared:
        raise ValueError(f"party program {name!r} answers undeclared kind(s) {undeclared}: declare them in `messages`")
    PROGRAMS[name] = cls
    return cls


def state_file(directory: str | Path, party: int) -> Path:
    """The file in ``directory`` that holds party ``party``'s program state."""
    return Path(directory) / f"party-{party}.pt"


class PartyProgram:
    """The party-local half of a method.  Subclasses define ``on_<kind>(request) -> Reply`` handlers.

    ``self.runtime`` (the :class:`~partialvfl.federation.runtime.party.PartyRuntime` hosting it: typed loosely, the wire
    core does not import the runtime) gives the party's index, name and data views; ``self.config`` is the
    configuration the coordinator sent (it includes this party's ``feature_dim``/``feature_shape``), read once at
    set-up into the program's declared ``setup_config`` (typed attributes; a plain dict for a program that declares
    none); ``self.seed`` the seed.
    """

    program_name: ClassVar[str] = ""
    #: kind -> declaration of its request and reply, its role and what its reply releases per row
    #: (see :mod:`partialvfl.federation.wire.schema`)
    messages: ClassVar[Messages] = {}
    #: whether the program can run at a party with a differential-privacy budget: it says which rows its releases
    #: are about (:meth:`released_rows`) and makes its own updates DP-SGD (``runtime.privacy.private_sum``)
    supports_privacy: ClassVar[bool] = False
    #: whether ``state_dict()`` also holds what a step in progress holds (e.g. the rows of a training forward whose
    #: gradient has not arrived, run again on load), so that a party restarted in the middle of a step continues it
    resumes_mid_step: ClassVar[bool] = False
    #: the declaration of its set-up config (:mod:`partialvfl.federation.wire.setup_config`): keys, types, ranges;
    #: ``None``: the program takes the config as a plain dict, unchecked
    setup_config: ClassVar[type[SetupConfig] | None] = None
    #: whether in one process several parties running it may answer a round at the same time, each in its own thread
    #: (:mod:`partialvfl.federation.wire.concurrent`): its handlers touch no process-wide state (torch's global random
    #: generator, an unlocked module-level cache) and nothing of another party's
    answers_concurrently: ClassVar[bool] = False

    @classmethod
    def read_config(cls, config: Any, where: str = "") -> Any:
        """``config`` as the program reads it: checked against ``setup_config`` and typed (a typed config as it is),
        or, without a declaration, a plain dict; a mismatch raises
        :class:`~partialvfl.federation.wire.setup_config.SetupConfigError` naming ``where``, the key and the value."""
        if cls.setup_config is None:
            return dict(config)
        return cls.setup_config.read(config, where or f"program {cls.program_name!r}")

    @classmethod
    def private_setup_refusal(cls, config: Any) -> str | None:
        """Why ``config`` cannot run under a differential-privacy budget (``None``: it can)."""
        return None if cls.supports_privacy else (f"program {cls.program_name!r} cannot keep a differential-privacy "
                                                  "budget (its updates are not DP-SGD)")

    def released_rows(self, kind: str, request: Request, reply: Reply) -> dict[str, tuple[str, np.ndarray, int]]:
        """For each reply tensor of ``kind`` that the declaration lists in ``releases``: ``(data handle, shared-order
        rows, the axis the rows run along)`` (a party with a budget charges and noises those rows)."""
        raise NotImplementedError(f"program {self.program_name!r} does not say which rows its replies are about")

    @classmethod
    def describe_setup(cls, config: Any) -> SetupShape | None:
        """What a ``setup`` with ``config`` (as :meth:`read_config` gives it) would build, for the party's policy:
        the networks (families, widths, what each sends per row), the learning rates, whether it shares weights.
        Read from the program's own config; a malformed config raises ``KeyError``/``TypeError``/``ValueError``
        (the policy refuses it).
        ``None`` (the default): the program cannot say, and a party runs it only if its policy lists it in
        ``unchecked_programs``."""
        return None

    def __init__(self, runtime: Any, config: Any, seed: int) -> None:
        self.runtime = runtime
        self.config = config
        self.seed = seed
        #: the config as the message checks read it (symbols such as ``d_h``, ``when`` conditions): plain values
        self.wire_config = wire_config(config)

    @property
    def party(self) -> int:
        """The party's index in the federation."""
        return self.runtime.index

    @property
    def device(self) -> torch.device:
        """Where this party computes (its own choice: ``device`` in its party.toml, or the simulation's)."""
        return self.runtime.device

    def data(self, handle: str) -> PartyView:
        """The party's view of the data attached as ``handle``."""
        return self.runtime.data(handle)

    def rows_features(self, handle: str, rows: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Its own features (float32, on its device) of ``rows``, shared-order positions, in the data attached as
        ``handle``: gathered from the table the party moved to its device once."""
        pos = self.data(handle).position_of_rows(np.asarray(rows))
        return self.runtime.table(handle)[to_device(torch.as_tensor(pos), self.device)]

    def handle(self, request: Request) -> Reply:
        """Answer ``request`` with its ``on_<kind>`` handler (an unknown kind is a ``ValueError``)."""
        fn = getattr(self, f"on_{request.kind.replace('-', '_')}", None)
        if fn is None:
            raise ValueError(f"party program {self.program_name!r} has no handler for message kind {request.kind!r}")
        return fn(request)

    @classmethod
    def handle_batch(cls, items: Sequence[tuple[PartyProgram, Request]]) -> list[Reply] | None:
        """Answer one round's requests to several parties running this program in one batched computation.

        Only the in-process transport calls this (a simulation's fast path); each item is one party's program and
        its (checked) request, and the replies must be what each party's own handler would have answered, with every
        party's weights, gradients and optimiser kept its own.  ``None`` (the default): answer them one by one.
        """
        return None

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to restore the trained program (tensors and plain values only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # optional
        """Restore :meth:`state_dict`."""
