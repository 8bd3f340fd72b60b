"""Deterministic seeding without global state: derived seeds, torch generators, seeded module construction."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

__all__ = ["derive_seed", "numpy_rng", "torch_generator", "torch_seeded"]


def derive_seed(seed: int, *keys: object) -> int:
    """A 63-bit seed derived from ``seed`` and any keys (strings or ints), stable across runs and platforms."""
    words = [int(seed) & 0xFFFFFFFF, (int(seed) >> 32) & 0xFFFFFFFF]
    for key in keys:
        words.append(zlib.crc32(str(key).encode()) if not isinstance(key, int) else int(key) & 0xFFFFFFFF)
    state = np.random.SeedSequence(words).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


def numpy_rng(seed: int, *keys: object) -> np.random.Generator:
    """A NumPy generator seeded from ``seed`` and ``keys`` (one independent stream per key path)."""
    return np.random.default_rng(derive_seed(seed, *keys))


def torch_generator(seed: int, *keys: object) -> torch.Generator:
    """A torch CPU generator seeded from ``seed`` and ``keys`` (one independent stream per key path)."""
    g = torch.Generator()
    g.manual_seed(derive_seed(seed, *keys))
    return g


@contextmanager
def torch_seeded(seed: int, *keys: object) -> Iterator[None]:
    """Run a block (e.g. building modules) under a derived torch seed, restoring the global RNG afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, *keys))
        yield
