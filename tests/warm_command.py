"""A ``partialvfl`` command for the doc tests that starts in milliseconds: each call is forked from a server process
that imported torch, NumPy, pandas and PyArrow once (about 4 CPU-seconds of imports per call otherwise; the
documents run about forty commands).

The command on the doc script's ``PATH`` is a small client (standard library only): it hands the server its
standard streams, arguments, environment and working directory; the server forks; the child takes them over and runs
``partialvfl.cli.main`` exactly as the installed script would (importing partialvfl from the client's
``PYTHONPATH``); the client forwards SIGTERM, SIGINT and SIGHUP to it, stops it if its own parent (the doc's shell)
goes away while ``PARTIALVFL_EXIT_WITH_PARENT`` is set (what a party process does itself), and exits with its status.
The server is single-threaded (a fork never copies another thread's locks); it reaps its children on SIGCHLD and
kills those still running when it stops.  Only third-party modules are preloaded, so every call imports the
repository's code afresh.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

CLIENT = r'''#!{python} -S
import json, os, select, signal, socket, sys
conn = socket.socket(socket.AF_UNIX)
conn.connect({socket_path!r})
request = json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}}).encode()
socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
reply = b""
while not reply.endswith(b"\n"):
    chunk = conn.recv(64)
    if not chunk:
        sys.exit(70)
    reply += chunk
lines = reply.decode().split("\n")
child = int(lines[0])
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda s, _f: os.kill(child, s))
parent = os.getppid() if os.environ.get("PARTIALVFL_EXIT_WITH_PARENT") == "1" else None
status = lines[1] if len(lines) > 2 else ""
while not status:
    try:
        ready, _, _ = select.select([conn], [], [], 0.2)
    except InterruptedError:
        continue
    if ready:
        reply += conn.recv(64) or b"70\n"
        lines = reply.decode().split("\n")
        status = lines[1] if len(lines) > 2 else ""
    elif parent is not None and os.getppid() != parent:
        os.kill(child, signal.SIGTERM)
        parent = None
code = int(status)
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
'''


def _run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: take over the client's streams, environment and directory, then run the command."""
    for std, fd in enumerate(fds[:3]):
        os.dup2(fd, std)
    for fd in fds:
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own streams
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:0] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.argv = ["partialvfl", *request["argv"]]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    code = 1
    try:
        from partialvfl.cli import main

        code = main(request["argv"])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # reported as the interpreter would, then status 1
        import traceback

        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):
            stream.flush()
    os._exit(code or 0)


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    import json

    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    size = int.from_bytes(data[:8], "big")
    body = data[8:]
    while len(body) < size:
        body += conn.recv(size - len(body))
    return json.loads(body), list(fds)


def serve(socket_path: str, preload: list[str]) -> None:
    """The server: import the modules ``preload``, listen on ``socket_path``, fork a child per request, report each
    child's status."""
    import importlib
    import selectors

    for name in preload:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(socket_path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    print("ready", flush=True)
    while not stopping:
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                request, fds = _recv_request(conn)
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    for own in (listener, conn, *children.values()):
                        own.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    _run_child(request, fds)
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                conn.sendall(f"{pid}\n".encode())
            else:
                with suppress(BlockingIOError):
                    os.read(wake_r, 4096)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                with suppress(OSError):
                    conn.sendall(f"{code}\n".encode())
                conn.close()
    for pid in children:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextmanager
def warm_partialvfl(directory: Path) -> Iterator[Path]:
    """A directory holding the warm ``partialvfl`` command (put it first on the doc script's ``PATH``), served until
    the block ends."""
    import tempfile

    directory.mkdir(parents=True, exist_ok=True)
    # the party launcher's list, imported here: the server runs this file and imports no partialvfl itself
    from partialvfl.federation.grpc.launcher import PRELOAD

    socket_path = os.path.join(tempfile.mkdtemp(prefix="pvw"), "s")  # a socket's path is at most 107 bytes

    server = subprocess.Popen([sys.executable, __file__, socket_path, *PRELOAD], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the warm partialvfl server did not start (exit {server.wait(60)})")
        command = directory / "partialvfl"
        command.write_text(CLIENT.format(python=sys.executable, socket_path=socket_path))
        command.chmod(0o755)
        yield directory
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
        Path(socket_path).unlink(missing_ok=True)
        Path(socket_path).parent.rmdir()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
