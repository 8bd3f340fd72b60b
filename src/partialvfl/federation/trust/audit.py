"""Audits over a message log: no message carried a raw feature row of any party, nor a party's own parameters or
optimiser state (:func:`find_party_state_leaks`; FedHSSL's model aggregation, which sends a party's local top
encoder when the party's policy allows weight sharing, is the one documented exception).

:func:`disclosed_state` is the same comparison for one reply: a deployed party runs it on every reply it sends.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from partialvfl.data.dataset import VerticalDataset
from partialvfl.federation.wire.messages import MessageLog

__all__ = ["Leak", "PartyStateRecorder", "StateLeak", "disclosed_state", "find_party_state_leaks",
           "find_raw_feature_leaks", "state_tensors"]


@dataclass(frozen=True)
class _Finding:
    """A tensor of a logged message that carries something of party ``party``."""

    entry: int
    kind: str
    tensor: str
    party: int

    def where(self) -> str:
        return f"message {self.entry} ({self.kind}) tensor {self.tensor!r}"


@dataclass(frozen=True)
class Leak(_Finding):
    """A raw feature row of ``party`` (its position ``sample_row`` in the shared order) in a message."""

    sample_row: int

    def __str__(self) -> str:
        return f"{self.where()} carries raw features of party {self.party} (row {self.sample_row})"


def find_raw_feature_leaks(log: MessageLog, *datasets: VerticalDataset, decimals: int = 5) -> list[Leak]:
    """Every place where a boundary-crossing message contains a raw feature row of some party.

    Each tensor is viewed as rows of every party's width ``d_k`` (whatever its shape, whenever its size is a
    multiple of ``d_k``); a row equal (to ``decimals``) to any observed raw row of party ``k`` is a leak.  Needs a
    log built with ``keep_payloads=True``.  Parties' rows that are constant (e.g. all zero) are ignored: they carry
    no information and would match any zero tensor.
    """
    if not log.keep_payloads:
        raise ValueError("the message log kept no payloads: build it with MessageLog(keep_payloads=True)")
    raw: dict[int, dict[bytes, int]] = {}
    for data in datasets:
        for k in range(data.n_parties):
            view = data.party(k)
            table = raw.setdefault(k, {})
            rounded = np.round(view.features.astype(np.float64), decimals) + 0.0  # no -0.0
            for r, row in zip(view.rows, rounded):
                if np.ptp(row) > 0:
                    table[row.tobytes()] = int(r)
    dims = {k: datasets[0].feature_dims[k] for k in raw}
    leaks: list[Leak] = []
    for i, (entry, payload) in enumerate(zip(log.entries, log.payloads)):
        if not entry.crosses_boundary or payload is None:
            continue
        for name, t in payload.items():
            if not t.is_floating_point():
                continue
            flat = np.round(t.detach().double().reshape(-1).numpy(), decimals) + 0.0
            for k, d in dims.items():
                if flat.size == 0 or flat.size % d:
                    continue
                for row in flat.reshape(-1, d):
                    hit = raw[k].get(row.tobytes())
                    if hit is not None:
                        leaks.append(Leak(i, entry.kind, name, k, hit))
                        break
    return leaks


# ---------------------------------------------------------------------- party weights and optimiser state
def state_tensors(program: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter, buffer and optimiser-state tensor a party program holds (by attribute name, no copies)."""
    seen: set[int] = set()

    def walk(name: str, obj: Any, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
        if depth > 3 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            for n, t in obj.named_parameters():
                yield f"{name}.{n}", t
            for n, t in obj.named_buffers():
                yield f"{name}.{n}", t
        elif isinstance(obj, torch.optim.Optimizer):
            for i, state in enumerate(obj.state.values()):
                for n, t in state.items():
                    if isinstance(t, torch.Tensor):
                        yield f"{name}.state[{i}].{n}", t
        elif isinstance(obj, dict):
            for k, v in obj.items():
                yield from walk(f"{name}[{k!r}]", v, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type) and depth < 3:
            for k, v in vars(obj).items():
                if k != "runtime":
                    yield from walk(f"{name}.{k}" if name else k, v, depth + 1)

    yield from walk("", program, 0)


def _informative(t: torch.Tensor) -> bool:
    """Tensors worth matching: at least 2 values that are not all equal (zeros, ones, step counters are not)."""
    if t.numel() < 2:
        return False
    flat = t.detach().reshape(-1)
    return bool((flat != flat[0]).any())


def _values(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values in sorted order (as float64): equal for any reshape, transpose or permutation of it."""
    return torch.sort(t.detach().reshape(-1).double()).values


def _fingerprint(t: torch.Tensor) -> bytes:
    return hashlib.sha256(_values(t).contiguous().numpy().tobytes()).digest()


def disclosed_state(tensors: Mapping[str, torch.Tensor], program: Any) -> tuple[str, str] | None:
    """``(reply tensor, party state tensor)`` if a reply tensor holds exactly the values of one of the program's
    state tensors (in any shape or order)."""
    if program is None:
        return None
    replies = {name: t for name, t in tensors.items() if _informative(t)}  # a state tensor is informative too
    if not replies:
        return None
    sizes = {t.numel() for t in replies.values()}
    sorted_replies: dict[str, torch.Tensor] = {}  # each reply tensor sorted once, when first compared
    for state_name, s in state_tensors(program):
        if s.numel() in sizes and _informative(s):
            values = _values(s)
            for name, t in replies.items():
                if t.numel() == s.numel():
                    if name not in sorted_replies:
                        sorted_replies[name] = _values(t)
                    if torch.equal(sorted_replies[name], values):
                        return name, state_name
    return None


class PartyStateRecorder:
    """Fingerprints of every party's state tensors before and after each round of messages (in process).

    Use as a context manager around a fit on a :class:`~partialvfl.federation.runtime.coordinator.LocalFederation`, then
    :func:`find_party_state_leaks` on the fit's ``MessageLog(keep_payloads=True)``.  It wraps the transport's
    ``call_many``, through which every request goes, answered party by party or as one batched round.
    """

    def __init__(self, federation: Any) -> None:
        self.transport = federation.transport
        self.runtimes = list(federation.runtimes)
        self.fingerprints: dict[bytes, tuple[int, str]] = {}

    def _record(self, parties: Iterable[int]) -> None:
        for k in parties:
            for name, t in state_tensors(self.runtimes[k].program):
                if _informative(t):
                    self.fingerprints.setdefault(_fingerprint(t), (k, name))

    def __enter__(self) -> PartyStateRecorder:
        original = self.transport.call_many

        def call_many(requests: Mapping[int, Any], **kw: Any) -> Any:
            parties = [k for k in requests if 0 <= k < len(self.runtimes)]
            self._record(parties)
            try:
                return original(requests, **kw)
            finally:
                self._record(parties)

        self.transport.call_many = call_many
        return self

    def __exit__(self, *exc: object) -> None:
        self.transport.__dict__.pop("call_many", None)


@dataclass(frozen=True)
class StateLeak(_Finding):
    """One of ``party``'s parameters, buffers or optimiser tensors (``state``) in a reply."""

    state: str

    def __str__(self) -> str:
        return f"{self.where()} carries party {self.party}'s state tensor {self.state}"


def find_party_state_leaks(log: MessageLog, recorder: PartyStateRecorder) -> list[StateLeak]:
    """Every boundary-crossing reply tensor equal to a party parameter, buffer or optimiser-state tensor."""
    if not log.keep_payloads:
        raise ValueError("the message log kept no payloads: build it with MessageLog(keep_payloads=True)")
    leaks = []
    for i, (entry, payload) in enumerate(zip(log.entries, log.payloads)):
        if entry.direction != "reply" or not entry.crosses_boundary or payload is None:
            continue
        for name, t in payload.items():
            if _informative(t):
                hit = recorder.fingerprints.get(_fingerprint(t))
                if hit is not None and hit[0] == entry.sender:
                    leaks.append(StateLeak(i, entry.kind, name, hit[0], hit[1]))
    return leaks
