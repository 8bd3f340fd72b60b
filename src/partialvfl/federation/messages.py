"""What crosses between parties: named tensors plus small metadata, and the log that counts every message."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = ["LogEntry", "MessageLog", "Reply", "Request", "TensorDict"]

TensorDict = dict[str, torch.Tensor]


@dataclass
class Request:
    """A call from the coordinator to a party: a message kind, named tensors, and JSON-able metadata."""

    kind: str
    tensors: TensorDict = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Reply:
    """A party's answer to a :class:`Request`."""

    tensors: TensorDict = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LogEntry:
    """One message as the log records it: who, what kind, which tensors, how many bytes."""

    step: int
    round: int
    sender: int
    receiver: int
    kind: str
    direction: Literal["request", "reply"]
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    nbytes: int

    @property
    def crosses_boundary(self) -> bool:
        """False for the coordinator talking to its own (active) party: nothing leaves the institution."""
        return self.sender != self.receiver


def tensor_nbytes(tensors: TensorDict) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))


class MessageLog:
    """Every message a transport carried, in order. With ``keep_payloads`` it also keeps the tensors, for audits."""

    def __init__(self, keep_payloads: bool = False) -> None:
        self.keep_payloads = keep_payloads
        self.entries: list[LogEntry] = []
        self.payloads: list[TensorDict | None] = []

    def record(
        self,
        *,
        step: int,
        round: int,
        sender: int,
        receiver: int,
        kind: str,
        direction: Literal["request", "reply"],
        tensors: TensorDict,
    ) -> None:
        names = tuple(tensors)
        self.entries.append(
            LogEntry(
                step=step,
                round=round,
                sender=sender,
                receiver=receiver,
                kind=kind,
                direction=direction,
                names=names,
                shapes=tuple(tuple(int(s) for s in tensors[n].shape) for n in names),
                dtypes=tuple(str(tensors[n].dtype).removeprefix("torch.") for n in names),
                nbytes=tensor_nbytes(tensors),
            )
        )
        self.payloads.append({k: v.detach().clone() for k, v in tensors.items()} if self.keep_payloads else None)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[LogEntry]:
        return iter(self.entries)

    def crossing(self) -> list[LogEntry]:
        """Entries that leave one party for another."""
        return [e for e in self.entries if e.crosses_boundary]

    def total_bytes(self, crossing_only: bool = True) -> int:
        return sum(e.nbytes for e in self.entries if e.crosses_boundary or not crossing_only)

    def bytes_by_kind(self, crossing_only: bool = True) -> dict[str, int]:
        c: Counter[str] = Counter()
        for e in self.entries:
            if e.crosses_boundary or not crossing_only:
                c[f"{e.kind}:{e.direction}"] += e.nbytes
        return dict(c)

    def tensor_names(self, crossing_only: bool = True) -> set[str]:
        return {n for e in self.entries if e.crosses_boundary or not crossing_only for n in e.names}

    def clear(self) -> None:
        self.entries.clear()
        self.payloads.clear()
