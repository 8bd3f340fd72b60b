"""Test-wide settings: one torch thread per test process (the suite runs on 2 cores), the costliest modules
collected first, so that the full suite's parallel workers (CONTRIBUTING.md: running the tests) end together, and the
fixtures several modules share (one deployment of party processes for the tiny gRPC fits); party processes are forked
from a preloaded interpreter (below)."""

import os
import sys
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
# party processes of LocalDeployment forked from one interpreter that imported torch once (about 3 CPU-seconds saved
# per party start, several hundred starts in the suite); each is still its own process running `party serve`
# (partialvfl.federation.grpc.launcher).  test_grpc's deployment, test_party_launcher and the tests that run
# `partialvfl party serve` themselves start fresh interpreters.
os.environ.setdefault("PARTIALVFL_LOCAL_LAUNCHER", "fork")

import pytest
import torch

torch.set_num_threads(1)

# dp-accounting imports absl, whose logging handler (on the root logger) keeps the sys.stderr of the moment it is made
# (under pytest: a capture) and closes that stream when logging is configured again unless it is the sys.stderr of
# that moment (uvicorn's dictConfig in the serving tests): pytest's capture then failed with "I/O operation on closed
# file" at every later test of that process.  Its stream is the process's own stderr here, which absl never closes.
try:
    import absl.logging as absl_logging
except ImportError:  # pragma: no cover - absl comes with dp-accounting
    pass
else:
    absl_logging.get_absl_handler().python_handler.stream = sys.__stderr__

#: the modules that cost the most, costliest first (seconds on one worker of the whole suite, the other one busy, on the
#: 2-core AMD VM, 2026-11-28, after party processes and the doc tests' commands were forked from a preloaded
#: interpreter): handed out first, they do not leave one worker running alone at the end.  A module missing here only
#: runs later; the order changes no result (each module has its own fixtures, or session-wide ones that no test
#: changes).
COSTLIEST_MODULES = (
    "test_bench",  # 93 s
    "test_devices",  # 81 s
    "test_own_data_doc",  # 74 s (141 s while each of its commands started a fresh interpreter)
    "test_schedule",  # 62 s
    "test_false_vfl",  # 60 s
    "test_lookup_budget",  # 58 s
    "test_contract",  # 58 s
    "test_kill_resume",  # 78 s before its killed coordinators were forked
    "test_explain_doc",  # 65 s (docs/explain.md: fits in process and across party processes, two services)
    "test_serving_doc",  # 45 s
    "test_party_failure",  # 43 s
    "test_grpc",  # 42 s
    "test_serving_federated",  # 30 s
    "test_alignment",  # 30 s
    "test_privacy_attacks",  # 28 s
    "test_compiled",  # 26 s
    "test_orchestration",  # 25 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the modules of :data:`COSTLIEST_MODULES` first, in that order; every other module after them, as collected
    (a stable sort: the tests of one module keep their order)."""
    rank = {name: i for i, name in enumerate(COSTLIEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


@pytest.fixture(scope="session")
def tiny_deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Party processes whose tables hold :func:`helpers.tiny_train`'s and :func:`helpers.tiny_test`'s rows, started
    once per test process for the modules that fit the tiny models over gRPC (test_contract, test_schedule: with
    ``--dist loadfile`` a worker that runs both starts one deployment, not two).  Each fit is a session of its own
    and keeps its state under its own model directory; no test stops or restarts these parties."""
    from helpers import PATIENCE, tiny_test, tiny_train
    from partialvfl.federation.grpc.local import LocalDeployment

    with LocalDeployment(tmp_path_factory.mktemp("tiny"), tiny_train(), extra=(tiny_test(),), deadline=PATIENCE,
                         start_timeout=600.0) as dep:
        dep.start()
        yield dep
