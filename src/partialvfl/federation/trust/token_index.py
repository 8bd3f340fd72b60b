"""Token -> row of a party's table, as two arrays (sorted 32-byte tokens and their rows), not a dict.

A party names its rows by their alignment tokens (``attach``); a million-row table held as a dict of bytes keys
costs about 150 bytes per row in Python objects, this index 40 (the token and an int64 row) and looks a whole
request's tokens up at once (:meth:`TokenIndex.lookup`).  It reads like a mapping (``index[token]``, ``get``,
``items``, iteration in token order) for callers that want one token.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

__all__ = ["TokenIndex", "as_keys", "first_repeat"]

TOKEN_BYTES = 32
LOOKUP_CHUNK = 1 << 18


def as_keys(tokens: np.ndarray) -> np.ndarray:
    """An ``(n, 32)`` uint8 array as ``n`` fixed-width byte strings (``S32``): sorted, searched and compared as
    whole tokens, in the byte order Python's ``sorted`` gives ``bytes``."""
    a = np.ascontiguousarray(tokens, dtype=np.uint8)
    if a.ndim != 2 or a.shape[1] != TOKEN_BYTES:
        raise ValueError(f"expected an (n, {TOKEN_BYTES}) uint8 array of tokens, got shape {a.shape}")
    return a.view(f"S{TOKEN_BYTES}").reshape(len(a))


def first_repeat(tokens: np.ndarray) -> int | None:
    """The position of a token that appears earlier in ``tokens`` too (``None``: all distinct)."""
    keys = as_keys(tokens)
    if len(keys) < 2:
        return None
    order = np.argsort(keys, kind="stable")
    same = np.flatnonzero(keys[order[1:]] == keys[order[:-1]])
    return None if not same.size else int(order[same[0] + 1])


class TokenIndex(Mapping[bytes, int]):
    """Rows of a table by token.  ``tokens``: ``(n, 32)`` uint8, distinct; ``rows``: their rows (default
    ``0..n-1``)."""

    def __init__(self, tokens: np.ndarray, rows: np.ndarray | None = None) -> None:
        keys = as_keys(tokens)
        order = np.argsort(keys, kind="stable")
        self.keys = keys[order]
        base = np.arange(len(keys), dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
        if base.shape != (len(keys),):
            raise ValueError(f"{len(keys)} tokens but {base.shape} rows")
        self.rows = base[order]
        if len(self.keys) > 1 and bool((self.keys[1:] == self.keys[:-1]).any()):
            raise ValueError("the tokens are not distinct")

    def sorted_tokens(self) -> np.ndarray:
        """The tokens in order, as an ``(n, 32)`` uint8 array (a view of the index: not to be written to)."""
        return self.keys.view(np.uint8).reshape(len(self.keys), TOKEN_BYTES)

    def lookup(self, tokens: np.ndarray) -> np.ndarray:
        """The row of each token of an ``(m, 32)`` uint8 array, ``-1`` for a token not in the index."""
        want = as_keys(tokens)
        out = np.full(len(want), -1, dtype=np.int64)
        if not len(self.keys):
            return out
        for a in range(0, len(want), LOOKUP_CHUNK):  # a chunk at a time: temporaries of a chunk's size
            part = want[a:a + LOOKUP_CHUNK]
            at = np.minimum(np.searchsorted(self.keys, part), len(self.keys) - 1)
            found = self.keys[at] == part
            out[a:a + LOOKUP_CHUNK][found] = self.rows[at[found]]
        return out

    # -- the mapping
    def __getitem__(self, token: bytes) -> int:
        row = int(self.lookup(np.frombuffer(bytes(token), dtype=np.uint8).reshape(1, -1))[0]) \
            if len(token) == TOKEN_BYTES else -1
        if row < 0:
            raise KeyError(token)
        return row

    def __iter__(self) -> Iterator[bytes]:
        return (bytes(k).ljust(TOKEN_BYTES, b"\x00") for k in self.keys)

    def __len__(self) -> int:
        return len(self.keys)
