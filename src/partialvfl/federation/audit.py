"""Audits over a message log: prove that no message carried a raw feature row of any party."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partialvfl.data.dataset import VerticalDataset
from partialvfl.federation.messages import MessageLog

__all__ = ["Leak", "find_raw_feature_leaks"]


@dataclass(frozen=True)
class Leak:
    entry: int
    kind: str
    tensor: str
    party: int
    sample_row: int

    def __str__(self) -> str:
        return (f"message {self.entry} ({self.kind}) tensor {self.tensor!r} carries raw features of party "
                f"{self.party} (row {self.sample_row})")


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
