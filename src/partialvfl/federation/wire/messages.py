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
    """Every message a transport carried, in order, with running byte counts.

    ``keep_entries=False`` keeps only the counts (long trainings send hundreds of thousands of messages);
    ``keep_payloads=True`` also keeps the tensors, for audits.
    """

    def __init__(self, keep_payloads: bool = False, keep_entries: bool = True) -> None:
        if keep_payloads and not keep_entries:
            raise ValueError("a log that keeps payloads must keep its entries")
        self.keep_payloads = keep_payloads
        self.keep_entries = keep_entries
        self.entries: list[LogEntry] = []
        self.payloads: list[TensorDict | None] = []
        self.n_messages = 0
        self._bytes: Counter[tuple[str, bool]] = Counter()  # (kind:direction, crosses boundary) -> bytes

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
        """Record one message: its step, round, sender, receiver, kind, direction and tensors' sizes."""
        names = tuple(tensors)
        entry = LogEntry(
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
        self.n_messages += 1
        self._bytes[(f"{kind}:{direction}", entry.crosses_boundary)] += entry.nbytes
        if self.keep_entries:
            self.entries.append(entry)
            self.payloads.append({k: v.detach().clone() for k, v in tensors.items()} if self.keep_payloads else None)

    def __len__(self) -> int:
        """Messages recorded (also when entries are not kept)."""
        return self.n_messages

    def _need_entries(self) -> None:
        if not self.keep_entries:
            raise ValueError("this message log keeps counts only: build it with MessageLog() to inspect messages")

    def __iter__(self) -> Iterator[LogEntry]:
        self._need_entries()
        return iter(self.entries)

    def crossing(self) -> list[LogEntry]:
        """Entries that leave one party for another."""
        self._need_entries()
        return [e for e in self.entries if e.crosses_boundary]

    def total_bytes(self, crossing_only: bool = True) -> int:
        """The bytes of every message (crossing a party boundary only, by default)."""
        return sum(b for (_, crosses), b in self._bytes.items() if crosses or not crossing_only)

    def bytes_by_kind(self, crossing_only: bool = True) -> dict[str, int]:
        """The bytes per message kind (crossing a party boundary only, by default)."""
        c: Counter[str] = Counter()
        for (kind, crosses), b in self._bytes.items():
            if crosses or not crossing_only:
                c[kind] += b
        return dict(c)

    def round_trips(self) -> int:
        """Rounds of requests sent (distinct step and round): the round trips the transport waited for one after
        another (a round's requests travel concurrently)."""
        self._need_entries()
        return len({(e.step, e.round) for e in self.entries if e.direction == "request"})

    def tensor_names(self, crossing_only: bool = True) -> set[str]:
        """The names of every tensor sent (crossing a party boundary only, by default)."""
        self._need_entries()
        return {n for e in self.entries if e.crosses_boundary or not crossing_only for n in e.names}

    def clear(self) -> None:
        """Forget every message recorded."""
        self.entries.clear()
        self.payloads.clear()
        self.n_messages = 0
        self._bytes.clear()
