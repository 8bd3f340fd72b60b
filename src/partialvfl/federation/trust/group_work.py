"""Where alignment's per-ID group arithmetic runs: every local core, or a Ray cluster.

The private set union (:mod:`partialvfl.federation.trust.psu`) costs one hash into ristretto255 and one to three
scalar multiplications per ID, each independent of the others.  :class:`GroupWork` runs them over chunks of
:data:`CHUNK_IDS` IDs:

* on threads of this process, by default one per usable core (libsodium is called through ``ctypes``, which lets
  go of Python's lock during the call, so the threads compute side by side; measured 1.9x on two cores);
* on a Ray cluster (``ray_address``, the ``ray`` extra) for a party whose ID list outgrows one machine: each chunk is
  a Ray task, at most a few per worker in flight, so neither this process nor the cluster holds more than a window
  of chunks besides the result.

Whatever runs them, the results are the same bytes in the same order (the operations are deterministic), and an
invalid group element is an :class:`AlignmentError` naming ``where`` and the element's position in the whole set.
The results are ``(n, 32)`` uint8 arrays (32 bytes per ID, no Python object per ID).  The Ray workers receive the
session's secret scalar: a Ray cluster runs whatever code its clients send, so it must be the party's own, inside
its trust domain (docs/security.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["CHUNK_IDS", "DOMAIN", "POINT_BYTES", "AlignmentError", "GroupWork", "local_cores", "sodium"]

#: domain separation of the hash into the group (version 1 of the protocol)
DOMAIN = b"partialvfl/psu/v1/id->ristretto255\x00"
POINT_BYTES = 32
#: IDs per chunk of work (a thread's or a Ray task's): 2 MB of points, about a second of one core
CHUNK_IDS = 16_384


class AlignmentError(ValueError):
    """Bad alignment input (an invalid group element, a wrong count, a replayed set...), naming who sent it."""


_SODIUM: Any = None


def sodium() -> Any:
    """The ``rbcl`` module (imported once; its temporary copy of libsodium is removed once loaded)."""
    global _SODIUM
    if _SODIUM is None:
        try:
            import rbcl
            from rbcl import _sodium as loaded
        except ImportError as e:  # pragma: no cover - a dependency of the grpc extra
            raise ImportError("keyless alignment needs the 'rbcl' package (libsodium's ristretto255): "
                              "pip install 'partialvfl[grpc]'") from e
        with contextlib.suppress(AttributeError, OSError):  # rbcl leaves a temporary copy of libsodium behind
            os.unlink(loaded.lib_path)
        _SODIUM = rbcl
    return _SODIUM


def local_cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


# ---------------------------------------------------------------------- one chunk (module level: Ray ships them)
def hash_chunk(texts: Sequence[str]) -> bytes:
    """``H(t)`` of each normalised ID text, concatenated (32 bytes each)."""
    from_hash = sodium().crypto_core_ristretto255_from_hash
    return b"".join(from_hash(hashlib.sha512(DOMAIN + t.encode("utf-8")).digest()) for t in texts)


def mul_chunk(scalar: bytes, raw: bytes, offset: int, where: str) -> bytes:
    """Every 32-byte point of ``raw`` raised to ``scalar``, concatenated; an invalid one names its position
    ``offset + i`` in the whole set."""
    mul = sodium().crypto_scalarmult_ristretto255
    out = []
    for i in range(0, len(raw), POINT_BYTES):
        try:
            out.append(mul(scalar, raw[i:i + POINT_BYTES]))
        except (RuntimeError, ValueError, TypeError):
            raise AlignmentError(f"{where}: element {offset + i // POINT_BYTES} is not a valid ristretto255 group "
                                 "element") from None
    return b"".join(out)


def tokens_chunk(scalar: bytes, texts: Sequence[str]) -> bytes:
    """``H(t)^scalar`` of each text (hashing cannot give an invalid element), concatenated."""
    return mul_chunk(scalar, hash_chunk(texts), 0, "hashed IDs")


def valid_chunk(raw: bytes, offset: int, where: str) -> None:
    """Refuse an encoding that is not a ristretto255 group element (or is the identity), naming its position."""
    valid = sodium().crypto_core_ristretto255_is_valid_point
    for i in range(0, len(raw), POINT_BYTES):
        if not valid(raw[i:i + POINT_BYTES]):
            raise AlignmentError(f"{where}: element {offset + i // POINT_BYTES} is not a valid ristretto255 group "
                                 "element")


def _part(texts: Sequence[str], a: int, b: int) -> list[str]:
    """IDs ``a`` to ``b`` as a list of ``str`` (from a list, an object array or an Arrow-backed ID column)."""
    part = texts[a:b]
    return part if isinstance(part, list) else list(part)


def _as_points(raw: bytes, n: int) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.uint8).reshape(n, POINT_BYTES)


# ---------------------------------------------------------------------- where the chunks run
@dataclass(frozen=True)
class GroupWork:
    """Runs alignment's group arithmetic over chunks of IDs.

    ``threads``: threads of this process (``0``, the default: one per usable core, :func:`local_cores`; ``1``: the
    single-core path).  ``ray_address``: run the chunks as tasks on this Ray cluster instead (``"auto"``, a head
    node's ``host:port`` or ``ray://host:port``; ``"local"`` starts one on this machine's cores); ``ray_window``
    tasks per cluster CPU are in flight at most.
    """

    threads: int = 0
    ray_address: str | None = None
    chunk: int = CHUNK_IDS
    ray_window: int = 2

    @property
    def workers(self) -> int:
        """The threads used here (``threads``, or every usable core when 0)."""
        return self.threads if self.threads > 0 else local_cores()

    # -- the operations
    def hashed(self, texts: Sequence[str]) -> np.ndarray:
        """``H(t)`` for normalised ID texts, as an ``(n, 32)`` array."""
        return self._map(len(texts), lambda a, b: (hash_chunk, (_part(texts, a, b),)))

    def tokens(self, texts: Sequence[str], scalar: bytes) -> np.ndarray:
        """``H(t)^scalar`` for normalised ID texts, as an ``(n, 32)`` array (a keyed party's tokens, a blinding)."""
        return self._map(len(texts), lambda a, b: (tokens_chunk, (scalar, _part(texts, a, b))))

    def evaluate(self, points: np.ndarray, scalar: bytes, where: str) -> np.ndarray:
        """Every row of an ``(n, 32)`` uint8 array raised to ``scalar``; an invalid element names ``where`` and its
        row."""
        raw = np.ascontiguousarray(points, dtype=np.uint8)
        return self._map(len(raw), lambda a, b: (mul_chunk, (scalar, raw[a:b].tobytes(), a, where)))

    def validate(self, points: np.ndarray, where: str) -> None:
        """Refuse any row that is not a ristretto255 group element (or is the identity), naming ``where`` and the
        first such row."""
        raw = np.ascontiguousarray(points, dtype=np.uint8)
        for _ in self._run(len(raw), lambda a, b: (valid_chunk, (raw[a:b].tobytes(), a, where))):
            pass

    # -- the machinery
    def _map(self, n: int, job: Callable[[int, int], tuple[Callable[..., bytes], tuple[Any, ...]]]) -> np.ndarray:
        out = np.empty((n, POINT_BYTES), dtype=np.uint8)
        for (a, b), raw in zip(self._spans(n), self._run(n, job), strict=True):
            out[a:b] = _as_points(raw, b - a)
        return out

    def _spans(self, n: int) -> list[tuple[int, int]]:
        return [(a, min(n, a + self.chunk)) for a in range(0, n, self.chunk)]

    def _run(self, n: int, job: Callable[[int, int], tuple[Callable[..., Any], tuple[Any, ...]]]) -> Iterator[Any]:
        """Each chunk's result, in order; at most a window of chunks in flight."""
        spans = self._spans(n)
        if self.ray_address is not None and len(spans) > 1:
            yield from self._run_ray(spans, job)
            return
        threads = min(self.workers, len(spans))
        if threads <= 1:
            for a, b in spans:
                fn, args = job(a, b)
                yield fn(*args)
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="alignment") as pool:
            window = 2 * threads
            pending = []
            for a, b in spans:
                fn, args = job(a, b)
                pending.append(pool.submit(fn, *args))
                if len(pending) >= window:
                    yield pending.pop(0).result()
            for f in pending:
                yield f.result()

    def _run_ray(self, spans: list[tuple[int, int]], job: Callable[[int, int], tuple[Callable[..., Any], tuple[
            Any, ...]]]) -> Iterator[Any]:
        ray = _ray(self.ray_address)
        window = max(2, self.ray_window * int(ray.cluster_resources().get("CPU", 1)))
        task = ray.remote(_catching)
        pending = []
        for a, b in spans:
            fn, args = job(a, b)
            pending.append(task.remote(fn, *args))
            if len(pending) >= window:
                yield _raised(ray.get(pending.pop(0)))
        for ref in pending:
            yield _raised(ray.get(ref))


def _ray(address: str | None) -> Any:
    """The ``ray`` module connected to ``address`` (once per process)."""
    try:
        import ray
    except ImportError as e:  # pragma: no cover - the ray extra
        raise ImportError("alignment on a Ray cluster needs the 'ray' package: pip install 'partialvfl[ray]'") from e
    if not ray.is_initialized():
        if address == "local":  # a Ray instance of this machine's cores, started here (tests, measurements)
            ray.init(num_cpus=local_cores(), log_to_driver=False, configure_logging=False, include_dashboard=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    return ray


def _catching(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a Ray task, an :class:`AlignmentError` returned (raised again by the caller, as itself)."""
    try:
        return fn(*args)
    except AlignmentError as e:
        return e


def _raised(result: Any) -> Any:
    if isinstance(result, AlignmentError):
        raise AlignmentError(str(result))
    return result
