"""How long a ``partialvfl party serve`` process takes to exit after SIGTERM (issue 37: within a second).

Writes loopback templates (``certs init --local``) and a small table into a temporary folder, then starts the
party ``--runs`` times; each time, once it listens (and a second later), sends SIGTERM and times the exit.
Prints every run and the median::

    OMP_NUM_THREADS=1 python benchmarks/party_exit.py --runs 5
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from partialvfl.cli import main as cli


def _setup(root: Path) -> Path:
    pki = root / "pki"
    assert cli(["certs", "init", str(pki), "--parties", "bank", "shop", "--local"]) == 0
    rng = np.random.default_rng(0)
    ids = [f"c{i:03d}" for i in range(40)]
    for name in ("bank", "shop"):
        frame = pd.DataFrame(rng.normal(size=(40, 3)), columns=["a", "b", "c"])
        frame.insert(0, "id", ids)
        frame.to_csv(pki / f"{name}.csv", index=False)
    pd.DataFrame({"id": ids, "label": rng.integers(0, 2, 40)}).to_csv(pki / "labels.csv", index=False)
    return pki


def exit_seconds(pki: Path, log: Path) -> float:
    """One run: start the party, wait until it listens (plus a second), SIGTERM it, time the exit."""
    port = pki / "bank.port"
    port.unlink(missing_ok=True)
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "partialvfl", "party", "serve", "--config",
                                 str(pki / "bank.party.toml")], stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "PARTIALVFL_EXIT_WITH_PARENT": "1"})
        while not port.exists():
            if proc.poll() is not None:
                raise RuntimeError(log.read_text()[-3000:])
            time.sleep(0.05)
        time.sleep(1.0)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        seconds = time.monotonic() - t
    if rc != 0:
        raise RuntimeError(f"the party exited with {rc}: {log.read_text()[-3000:]}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pki = _setup(Path(tmp))
        times = []
        for r in range(args.runs):
            times.append(exit_seconds(pki, Path(tmp) / f"party{r}.log"))
            print(f"run {r}: exit {times[-1]:.3f} s after SIGTERM", flush=True)
    print(f"median {statistics.median(times):.3f} s, min {min(times):.3f} s, max {max(times):.3f} s "
          f"over {args.runs} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
