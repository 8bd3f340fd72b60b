"""The party's access log: one JSON line per request it answered or refused, so an institution can audit what it
disclosed.

Each line holds the time (UTC, ISO 8601), the peer (certificate names and address), the message kind, step, round,
the coordinator session (first 8 characters), the request's and the reply's tensors (name -> [shape, dtype]) and
their sizes in bytes, the outcome (``served`` or ``refused``), the gRPC status and, for a refusal, the reason.  The
file is rotated by size (``max_mb``, ``backups`` older files kept as ``access.log.1`` ...).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import Any

import torch

__all__ = ["AccessLog", "AccessLogConfig", "read_access_log", "tensor_summary"]


@dataclass(frozen=True)
class AccessLogConfig:
    """Where the access log goes and when it rotates (``[access_log]`` of ``party.toml``)."""

    path: Path
    max_bytes: int = 10 * 2**20
    backups: int = 5


def tensor_summary(tensors: dict[str, torch.Tensor] | None) -> dict[str, list[Any]]:
    """``{name: [shape, dtype]}`` of a message's tensors."""
    return {name: [list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in (tensors or {}).items()}


class AccessLog:
    """Appends one JSON object per line to a size-rotated file (thread-safe)."""

    def __init__(self, config: AccessLogConfig) -> None:
        config.path.parent.mkdir(parents=True, exist_ok=True)
        self.config = config
        self._handler = RotatingFileHandler(config.path, maxBytes=max(1, config.max_bytes),
                                            backupCount=max(0, config.backups), encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._lock = threading.Lock()

    def write(self, **entry: Any) -> None:
        """Record one request; ``entry`` holds the fields listed in the module docstring."""
        line = json.dumps({"time": datetime.now(UTC).isoformat(timespec="milliseconds"), **entry}, default=str)
        record = logging.makeLogRecord({"msg": line, "levelno": logging.INFO, "levelname": "INFO"})
        with self._lock:
            self._handler.emit(record)

    def close(self) -> None:
        """Close the log file."""
        self._handler.close()


def read_access_log(path: str | Path) -> list[dict[str, Any]]:
    """Every entry of an access log file (the current one; rotated files are ``path.1``, ``path.2``...)."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
