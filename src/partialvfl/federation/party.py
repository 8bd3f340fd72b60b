"""A party: its own data and the party-local half of a method (a *program*), reachable only through messages.

A :class:`PartyRuntime` is what runs at one institution.  It holds the data views it was given (only its own block,
see :class:`~partialvfl.data.dataset.PartyView`), and after a ``setup`` request the party program of the method in
use.  Every method is written as a :class:`PartyProgram` (party-local steps, one ``on_<kind>`` handler per message
kind) plus coordinator code that talks to the programs through a Transport; the same programs serve in-process and
behind a gRPC server.

Built-in message kinds handled by the runtime itself: ``setup`` (build the program named in ``meta['program']``
with ``meta['config']`` and ``meta['seed']``), ``save``/``load`` (the program's state file in ``meta['dir']``,
``party-<k>.pt``), ``ping``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ClassVar

import torch

from partialvfl.data.dataset import PartyView
from partialvfl.federation.messages import Reply, Request

__all__ = ["PROGRAMS", "PartyProgram", "PartyRuntime", "register_program", "state_file"]

PROGRAMS: dict[str, type[PartyProgram]] = {}


def register_program(cls: type[PartyProgram]) -> type[PartyProgram]:
    """Class decorator: make a party program constructible by name in a ``setup`` request."""
    name = cls.program_name
    if not name:
        raise ValueError(f"{cls.__name__} has no program_name")
    if name in PROGRAMS and PROGRAMS[name] is not cls:
        raise ValueError(f"party program {name!r} registered twice")
    PROGRAMS[name] = cls
    return cls


def state_file(directory: str | Path, party: int) -> Path:
    return Path(directory) / f"party-{party}.pt"


class PartyProgram:
    """The party-local half of a method.  Subclasses define ``on_<kind>(request) -> Reply`` handlers.

    ``self.runtime`` gives the party's index, name and data views; ``self.config`` is the JSON-able configuration
    the coordinator sent (it includes this party's ``feature_dim``/``feature_shape``); ``self.seed`` the seed.
    """

    program_name: ClassVar[str] = ""

    def __init__(self, runtime: PartyRuntime, config: dict[str, Any], seed: int) -> None:
        self.runtime = runtime
        self.config = config
        self.seed = seed

    @property
    def party(self) -> int:
        return self.runtime.index

    def data(self, handle: str) -> PartyView:
        return self.runtime.data(handle)

    def handle(self, request: Request) -> Reply:
        fn = getattr(self, f"on_{request.kind.replace('-', '_')}", None)
        if fn is None:
            raise ValueError(f"party program {self.program_name!r} has no handler for message kind {request.kind!r}")
        return fn(request)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to restore the trained program (tensors and plain values only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional
        """Restore :meth:`state_dict`."""


class PartyRuntime:
    """One party: its data views (its own block only) and its program."""

    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.name = name
        self._data: dict[str, PartyView] = {}
        self.program: PartyProgram | None = None

    def attach(self, handle: str, view: PartyView) -> None:
        """Give this party a dataset view under ``handle`` (in-process: the party's own slice of that dataset)."""
        if view.party != self.index:
            raise ValueError(f"party {self.index} ({self.name!r}) was handed the view of party {view.party}")
        self._data[handle] = view

    def release(self, handle: str) -> None:
        self._data.pop(handle, None)

    def data(self, handle: str) -> PartyView:
        try:
            return self._data[handle]
        except KeyError:
            raise KeyError(
                f"party {self.index} ({self.name!r}) has no data attached as {handle!r}; has {sorted(self._data)}"
            ) from None

    def handle(self, request: Request) -> Reply:
        kind = request.kind
        if kind == "ping":
            return Reply(meta={"party": self.index, "name": self.name})
        if kind == "setup":
            name = request.meta["program"]
            if name not in PROGRAMS:
                raise ValueError(f"unknown party program {name!r}; known: {sorted(PROGRAMS)}")
            self.program = PROGRAMS[name](self, dict(request.meta.get("config", {})), int(request.meta["seed"]))
            return Reply(meta={"ok": True})
        if self.program is None:
            raise RuntimeError(f"party {self.index} ({self.name!r}) got {kind!r} before any setup")
        if kind == "save":
            path = state_file(request.meta["dir"], self.index)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"program": self.program.program_name, "state": self.program.state_dict()}, path)
            return Reply(meta={"path": str(path)})
        if kind == "forget":  # delete a state saved earlier (a pruned checkpoint)
            path = state_file(request.meta["dir"], self.index)
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # other parties' files may share the directory (in process)
                path.parent.rmdir()
            return Reply(meta={"ok": True})
        if kind == "load":
            path = state_file(request.meta["dir"], self.index)
            if not path.exists():
                raise FileNotFoundError(f"party {self.index} ({self.name!r}): no state file at {path}")
            saved = torch.load(path, weights_only=True)
            if saved["program"] != self.program.program_name:
                raise ValueError(f"{path} holds a {saved['program']!r} state, not {self.program.program_name!r}")
            self.program.load_state_dict(saved["state"])
            return Reply(meta={"ok": True})
        return self.program.handle(request)
