"""How LocalDeployment starts its parties: a fresh interpreter (``exec``) or a process forked from a preloaded one
(``fork``, the suite's default): either way each party is its own process in its own session that serves, stops on
SIGTERM after saying so, dies on SIGKILL and comes back on its port."""

import os
import signal

import pytest

from helpers import PATIENCE, tiny_test, tiny_train
from partialvfl.federation.grpc.launcher import LAUNCHER_ENV, default_launcher
from partialvfl.federation.grpc.local import LocalDeployment


def test_the_launcher_comes_from_the_environment_and_an_unknown_one_is_refused(monkeypatch):
    monkeypatch.setenv(LAUNCHER_ENV, "exec")
    assert default_launcher() == "exec"
    monkeypatch.delenv(LAUNCHER_ENV)
    assert default_launcher() == "exec"
    monkeypatch.setenv(LAUNCHER_ENV, "spawn")
    with pytest.raises(ValueError, match="PARTIALVFL_LOCAL_LAUNCHER must be one of"):
        default_launcher()
    with pytest.raises(ValueError, match="launcher must be one of"):
        LocalDeployment("unused", tiny_train(), launcher="thread")


@pytest.mark.slow  # real party processes, as the fast tier leaves out
@pytest.mark.parametrize("launcher", ["exec", "fork"])
def test_a_party_is_its_own_process_that_stops_on_sigterm_dies_on_sigkill_and_restarts_on_its_port(
        tmp_path, launcher):
    with LocalDeployment(tmp_path, tiny_train(), extra=(tiny_test(),), deadline=PATIENCE, start_timeout=600.0,
                         launcher=launcher) as dep:
        ports = dep.start()
        pids = {k: p.pid for k, p in dep.procs.items()}
        assert len(set(pids.values())) == len(pids) and os.getpid() not in pids.values()
        assert all(os.getsid(pid) == pid for pid in pids.values())  # each leads its own session
        assert all(dep.procs[k].poll() is None for k in pids)
        log = (tmp_path / "party-0.log").read_text()
        assert f"listening on port {ports[0]}" in log

        dep.kill(0, signal.SIGTERM)
        assert dep.procs[0].returncode == 0
        assert "stopped" in (tmp_path / "party-0.log").read_text()
        dep.kill(1, signal.SIGKILL)
        assert dep.procs[1].returncode == -signal.SIGKILL
        assert dep.procs[2].poll() is None  # the others keep serving

        again = dep.start([0, 1])
        assert again == {0: ports[0], 1: ports[1]}
        assert dep.procs[0].pid != pids[0] and dep.procs[0].poll() is None
