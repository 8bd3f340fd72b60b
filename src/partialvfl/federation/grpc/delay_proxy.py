"""A loopback TCP proxy that delays what a coordinator sends one party (tests and benchmarks of a slow party).

:class:`DelayProxy` listens on 127.0.0.1 and forwards every connection to the party's address; bytes towards the
party arrive ``delay`` seconds late (in order), replies come back at once.  TLS passes through untouched (the
coordinator checks the party's certificate by its identity, not its address).  ``delay`` may change while it runs:
``0`` is a party that is on time again.  :meth:`DelayProxy.close` cancels every connection's tasks and waits for them
and for the sockets to close before it closes its event loop, so nothing is left pending for the interpreter to
complain about at exit.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

__all__ = ["DelayProxy"]


class DelayProxy:
    """Forward ``127.0.0.1:<port>`` to ``target`` (``host:port``), delaying the way there by :attr:`delay` s."""

    def __init__(self, target: str, delay: float = 0.0) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host or "127.0.0.1", int(port))
        self.delay = float(delay)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: Any = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True, name="delay-proxy")
        self._thread.start()
        started.wait(10)

    @property
    def address(self) -> str:
        """The address clients connect to (``127.0.0.1:PORT``)."""
        return f"127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        started.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def read_client() -> None:
            while data := await reader.read(65536):
                await queue.put((time.monotonic() + self.delay, data))
            await queue.put((0.0, b""))

        async def write_party() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                up_writer.write(data)
                await up_writer.drain()

        async def replies() -> None:
            while data := await up_reader.read(65536):
                writer.write(data)
                await writer.drain()

        tasks = [asyncio.ensure_future(t()) for t in (read_client, write_party, replies)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in (writer, up_writer):
                w.close()

    async def _shutdown(self) -> None:
        """Stop accepting, cancel every connection's tasks and wait for them (their ``finally`` closes the sockets),
        then let the transports finish closing."""
        if self._server is not None:
            self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(3):  # the closed transports' connection_lost callbacks
            await asyncio.sleep(0)

    def close(self) -> None:
        """Stop forwarding: every connection closed, the thread ended, the event loop closed (idempotent)."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(5)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
