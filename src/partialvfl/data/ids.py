"""Sample IDs, one rule everywhere: how an ID is normalised, which IDs are refused, and the canonical sample order.

Every place that reads or compares IDs uses this module: :func:`~partialvfl.data.builders.from_tables` (joining
the parties' tables in one process), the party server's table and the alignment of a deployment
(:mod:`partialvfl.federation.trust.psu`, or the explicit HMAC mode of :mod:`partialvfl.federation.trust.alignment`), the
label table of a federation and the ID lists given to ``predict``.

**Normalisation** (:func:`normalize_id`).  An ID is compared as text: integers (and integral floats such as
``12.0``, which is how a number column with gaps comes back from pandas) as their decimal digits, bytes decoded as
UTF-8, text in Unicode NFC form with the surrounding white space removed.  Nothing else changes: case and leading
zeros are significant (``"007"`` and ``"7"`` are different users, ``7`` and ``"7"`` the same one).

**Refused.**  A missing ID (NaN, None), an ID that is empty after normalisation, a boolean, and two rows of one
table whose IDs normalise to the same text (``"12"`` and ``" 12"``, or ``12`` and ``12.0``): each is an error naming
the party or file and the row.

**Per-row seeds** (:func:`id_seeds`).  Whatever a prediction draws at random for a row (Monte Carlo samples, a
tie-break) comes from a seed derived from the model's seed and the row's normalised ID, so that a row's prediction
depends only on the model, its data and its ID: never on the other rows of its request, their order or their number.

**Canonical order** (:func:`sample_order`).  Samples are ordered by ``HMAC-SHA256(key, normalised ID)``, the order a
deployment can build from the parties' keyed hashes alone.  In one process the key is the federation's HMAC key
when given (``from_tables(..., order_key=...)``), else :data:`DEFAULT_ORDER_KEY`; so the same tables give the same
sample order, and with the same seed the same model, in one process and across a federation.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.data.checks import show_id
from partialvfl.data.dataset import DataValidationError

__all__ = ["DEFAULT_ORDER_KEY", "MIN_KEY_BYTES", "hash_ids", "id_seeds", "normalize_id", "normalize_ids",
           "order_key", "read_key", "sample_order", "show_id"]

#: The key of the canonical sample order in one process when no federation key is given (public, not a secret).
DEFAULT_ORDER_KEY = b"partialvfl canonical sample order, v1"
MIN_KEY_BYTES = 16
HASH_BYTES = 32


class _Refused(ValueError):
    """An ID that cannot be normalised (the caller adds where it was)."""


def normalize_id(value: Any) -> str:
    """The text an ID is compared, joined and hashed as (see the module docstring); raises for a refused ID."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None:
        raise _Refused("is missing")
    if isinstance(value, bool):
        raise _Refused(f"is a boolean ({value!r}); use integers or text")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _Refused("is missing (NaN)" if math.isnan(value) else f"is not finite ({value!r})")
        text = str(int(value)) if value.is_integer() else repr(value)
    elif isinstance(value, int):
        text = str(value)
    elif isinstance(value, bytes):
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            raise _Refused(f"is not UTF-8 text ({value!r})") from None
    elif isinstance(value, str):
        text = value
    else:
        raise _Refused(f"is a {type(value).__name__} ({value!r}); use integers or text")
    text = unicodedata.normalize("NFC", text).strip()
    if not text:
        raise _Refused(f"is empty ({value!r})")
    return text


def normalize_ids(values: Sequence[Any] | np.ndarray, where: str, *, unique: bool = True,
                  first_row: int = 0) -> list[str]:
    """Every ID of ``values`` normalised; an error names ``where`` (a party, a file) and the row of a refused ID
    (counted from ``first_row``: a chunk of a larger table), and with ``unique`` the two rows whose IDs normalise to
    the same text."""
    out: list[str] = []
    first: dict[str, int] = {}
    for row, value in enumerate(values):
        try:
            text = normalize_id(value)
        except _Refused as e:
            raise DataValidationError(f"{where}: the ID at row {first_row + row} {e}") from None
        if unique:
            seen = first.setdefault(text, row)
            if seen != row:
                a, b = show_id(values[seen]), show_id(value)
                same = f"ID {a}" if a == b else f"IDs {a} and {b}, the same ID once normalised ({text!r}),"
                raise DataValidationError(f"{where}: {same} at rows {seen} and {row}; IDs must be unique")
        out.append(text)
    return out


def id_seeds(ids: Sequence[Any] | np.ndarray, seed: int, *keys: object, secret: bytes = b"") -> np.ndarray:
    """``(n,)`` int64 seeds in ``[0, 2**63)``, one per ID: the first 8 bytes of SHA-256 over the model's ``seed``,
    ``secret``, the ``keys`` (what is drawn: a method, a purpose) and the normalised ID (see the module docstring).

    The same ID gives the same seed whatever else is in ``ids`` and in whatever order; ``7``, ``7.0`` and ``"7"``
    give the same seed (one ID once normalised).  Deterministic across runs, processes and platforms.  Seeds that
    cross to a party need a ``secret`` the party does not hold: it knows the model's seed, and could otherwise test a
    guessed ID against the seeds it gets.
    """
    head = hashlib.sha256(b"partialvfl row seed\x1f" + int(seed).to_bytes(16, "little", signed=True)
                          + hashlib.sha256(secret).digest()
                          + "\x1f".join(str(k) for k in keys).encode("utf-8") + b"\x1e")
    out = np.empty(len(ids), dtype=np.int64)
    for i, text in enumerate(normalize_ids(ids, "the IDs to seed", unique=False)):
        h = head.copy()
        h.update(text.encode("utf-8"))
        out[i] = int.from_bytes(h.digest()[:8], "little") >> 1
    return out


def read_key(path: str | Path) -> bytes:
    """An HMAC key file: hex text (as ``partialvfl certs init`` writes it) or raw bytes, at least 16 bytes."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"HMAC key file not found: {p} (make one with `partialvfl certs init`)")
    raw = p.read_bytes()
    try:
        key = bytes.fromhex(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        key = raw
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"HMAC key in {p} is {len(key)} bytes; use at least {MIN_KEY_BYTES} random bytes")
    return key


def order_key(key: bytes | str | Path | None) -> bytes:
    """The key of the canonical order: raw bytes, a key file (see :func:`read_key`), or the default key."""
    if key is None:
        return DEFAULT_ORDER_KEY
    if isinstance(key, (str, Path)):
        return read_key(key)
    if not isinstance(key, bytes) or len(key) < MIN_KEY_BYTES:
        size = f"{len(key)} bytes" if isinstance(key, bytes) else f"a {type(key).__name__}"
        raise ValueError(f"the HMAC key is {size}; use at least {MIN_KEY_BYTES} random bytes")
    return key


def hash_ids(ids: Sequence[Any] | np.ndarray, key: bytes, where: str = "IDs", *,
             normalized: bool = False) -> np.ndarray:
    """``(n, 32)`` uint8 array of ``HMAC-SHA256(key, normalised ID)`` for every ID (duplicates allowed here).

    With ``normalized`` the IDs are the texts :func:`normalize_ids` returned (e.g. by
    :func:`~partialvfl.data.tables.table_ids`) and are hashed as they are, not normalised again (normalising is
    idempotent, so the hashes are the same); anything but text is then a ``TypeError``.
    """
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the HMAC key is {len(key)} bytes; use at least {MIN_KEY_BYTES} random bytes")
    texts = ids if normalized else normalize_ids(ids, where, unique=False)
    out = np.empty((len(texts), HASH_BYTES), dtype=np.uint8)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{where}: hash_ids(normalized=True) takes normalised ID texts, got "
                            f"{type(text).__name__} at row {i}")
        out[i] = np.frombuffer(hmac.new(key, text.encode("utf-8"), hashlib.sha256).digest(), dtype=np.uint8)
    return out


def sample_order(ids: Sequence[Any] | np.ndarray, key: bytes | str | Path | None = None, *,
                 normalized: bool = False) -> np.ndarray:
    """Positions that put ``ids`` in the canonical order (by keyed hash of the normalised ID, see above);
    ``normalized``: the IDs are already normalised texts (see :func:`hash_ids`)."""
    hashes = hash_ids(ids, order_key(key), normalized=normalized)
    keys = [bytes(h) for h in hashes]
    return np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
