"""The explicit shared-key alignment (``alignment = "hmac"``) and the matching both alignments share.

The default alignment is the keyless private set union of :mod:`partialvfl.federation.trust.psu`: its tokens are matched
by :func:`observed_from_hashes` and :func:`positions_in` below like the hashes of this mode.  This mode, for parties
inside one trust domain only:

IDs are normalised by the one rule of :mod:`partialvfl.data.ids` (text, NFC, surrounding white space removed;
integral numbers as digits) before hashing, exactly as :func:`~partialvfl.data.builders.from_tables` joins them.
Each party holds the same secret key (a file given to every institution, never sent over the wire) and reports
``HMAC-SHA256(key, id)`` for every ID it holds.  The coordinator builds the shared sample order and the observed
matrix (which party holds which sample) from those hash lists alone, then tells each party the positions of *its
own* hashes in that order; a party never receives another party's hashes.

What this reveals and to whom: ``docs/security.md`` ("Alignment without a central table"). In short: the coordinator
learns, for every hashed ID, which parties hold it (the observed matrix is exactly that); whoever holds the key can
test a guessed ID against a hash, so in our setting, where the coordinator *is* the active party and holds the key,
it learns membership for every ID it can enumerate. Passive parties learn only N and where their own rows sit.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.data.ids import HASH_BYTES, hash_ids, normalize_ids, read_key

__all__ = [
    "HASH_BYTES", "canonical_id", "hash_ids", "hex_ids", "load_key", "observed_from_hashes", "positions_in",
    "write_key",
]


def canonical_id(value: Any) -> bytes:
    """The bytes an ID is hashed as: its normalised text (:func:`partialvfl.data.ids.normalize_id`), UTF-8."""
    return normalize_ids([value], "ID", unique=False)[0].encode("utf-8")


def hex_ids(hashes: np.ndarray) -> np.ndarray:
    """Hash rows as hex strings (the sample IDs the coordinator uses when it knows no raw ID)."""
    return np.array([bytes(h).hex() for h in np.asarray(hashes, dtype=np.uint8)], dtype=object)


def _rows(hashes: np.ndarray) -> np.ndarray:
    """The rows of an ``(n, 32)`` uint8 array as one 32-byte value each (numpy sorts and compares them bytewise)."""
    hashes = np.asarray(hashes)
    if hashes.ndim != 2 or hashes.shape[1] != HASH_BYTES or hashes.dtype != np.uint8:
        raise ValueError(f"hashed IDs must be a (n, {HASH_BYTES}) uint8 array, got {hashes.dtype} {hashes.shape}")
    return np.ascontiguousarray(hashes).view(f"V{HASH_BYTES}").ravel()


def observed_from_hashes(party_hashes: Sequence[np.ndarray | None]) -> tuple[np.ndarray, np.ndarray]:
    """The shared order (union of all parties' hashes, sorted bytewise) and the ``(N, K)`` observed matrix.

    A party given as ``None`` (absent) observes nothing.  Duplicate hashes within one party are an error (two rows
    with the same ID).
    """
    per_party: list[np.ndarray] = []
    for k, hashes in enumerate(party_hashes):
        if hashes is None:
            per_party.append(_rows(np.zeros((0, HASH_BYTES), dtype=np.uint8)))
            continue
        rows = _rows(hashes)
        if len(np.unique(rows)) != len(rows):
            raise ValueError(f"party {k} reported the same hashed ID twice: its ID column has duplicates")
        per_party.append(rows)
    order = np.unique(np.concatenate(per_party)) if per_party else _rows(np.zeros((0, HASH_BYTES), np.uint8))
    observed = np.zeros((len(order), len(per_party)), dtype=bool)
    for k, rows in enumerate(per_party):
        observed[np.searchsorted(order, rows), k] = True
    return order.view(np.uint8).reshape(len(order), HASH_BYTES).copy(), observed


def positions_in(order: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """For each hash row, its position in ``order`` (``-1`` where absent)."""
    keys, rows = _rows(order), _rows(hashes)
    if not len(keys):
        return np.full(len(rows), -1, dtype=np.int64)
    idx = np.argsort(keys, kind="stable")
    pos = np.minimum(np.searchsorted(keys[idx], rows), len(keys) - 1)
    return np.where(keys[idx[pos]] == rows, idx[pos], -1).astype(np.int64)


def load_key(path: str | Path) -> bytes:
    """Read an HMAC key file: hex text (as :func:`write_key` makes it) or raw bytes."""
    return read_key(path)


def write_key(path: str | Path, n_bytes: int = 32) -> Path:
    """Write a fresh random key as hex text, readable by its owner only."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(secrets.token_hex(n_bytes) + "\n")
    p.chmod(0o600)
    return p
