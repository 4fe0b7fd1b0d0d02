"""A TCP proxy in front of one replica that ends the gateway's connections the way an engine's server does.

A connection that carries no request for `idle_close` seconds after a response is closed (None: never), as
uvicorn's `timeout_keep_alive` does (5 s in vLLM and SGLang). With a tiny `idle_close` the replica closes its
side right after each response unless the next request is already there: Envoy may have handed the
connection to a waiting request before it reads the FIN. The replica behind it sees one connection per
gateway connection; its faults (close, reset) pass through. Runs its own event loop in a thread; `stats`
counts what it did.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass

from router_sidecar.runtime.supervise import free_port


@dataclass
class ProxyStats:
    connections: int = 0
    responses: int = 0
    closed_idle: int = 0


class _ResponseEnds:
    """Finds where each HTTP/1.1 response ends in the bytes a server writes (content-length or chunked)."""

    def __init__(self) -> None:
        self._buf = b""
        self._state = "head"
        self._left = 0  # body bytes (content-length) or bytes of the current chunk with its CRLF

    def feed(self, data: bytes) -> int:
        """How many responses ended in `data`."""
        self._buf += data
        ended = 0
        while self._step():
            if self._state == "done":
                ended += 1
                self._state = "head"
        return ended

    def _step(self) -> bool:
        if self._state == "head":
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            head, self._buf = self._buf[:end].decode("latin-1").lower(), self._buf[end + 4 :]
            lines = head.split("\r\n")
            status = int(lines[0].split()[1])
            headers = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
            if 100 <= status < 200:
                return True  # an interim answer: the response goes on
            if "chunked" in headers.get("transfer-encoding", ""):
                self._state = "size"
            else:
                self._left = int(headers.get("content-length", "0").strip() or 0)
                self._state = "body"
            return True
        if self._state == "body":
            taken = min(self._left, len(self._buf))
            self._buf, self._left = self._buf[taken:], self._left - taken
            if self._left:
                return False
            self._state = "done"
            return True
        if self._state == "size":
            end = self._buf.find(b"\r\n")
            if end < 0:
                return False
            size = int(self._buf[:end].split(b";")[0], 16)
            self._buf = self._buf[end + 2 :]
            if size == 0:
                self._state = "trailer"
            else:
                self._left, self._state = size + 2, "chunk"
            return True
        if self._state == "chunk":
            taken = min(self._left, len(self._buf))
            self._buf, self._left = self._buf[taken:], self._left - taken
            if self._left:
                return False
            self._state = "size"
            return True
        # trailer: lines until an empty one
        end = self._buf.find(b"\r\n")
        if end < 0:
            return False
        line, self._buf = self._buf[:end], self._buf[end + 2 :]
        if not line:
            self._state = "done"
        return True


class _ProxyThread:
    """A TCP proxy on loopback to `target`, its own event loop in a thread; `_handle` serves a connection."""

    def __init__(self, target: str) -> None:
        self.target_host, port = target.rsplit(":", 1)
        self.target_port = int(port)
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        name = f"{type(self).__name__}-{self.port}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"{name} did not start")

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._connection, "127.0.0.1", self.port)
        self._ready.set()
        async with server:
            await self._stop.wait()
        # Every connection's task ends here, in this loop: none is left pending for the garbage collector to
        # finalize later in another thread (its finalizer runs Python code wherever the collector happens to
        # run, e.g. inside the test runner's own `compile`).
        connections = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in connections:
            task.cancel()
        await asyncio.gather(*connections, return_exceptions=True)

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        # Cancelled only at the proxy's stop: it ends quietly (asyncio's server logs a cancelled one).
        with contextlib.suppress(asyncio.CancelledError):
            await self._handle(client_r, client_w)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class DelayingProxy(_ProxyThread):
    """Every byte reaches the other side `delay` seconds after it arrived, in order, in both directions: a
    server a long round trip away (e.g. etcd in another zone)."""

    def __init__(self, target: str, *, delay: float) -> None:
        self.delay = delay
        super().__init__(target)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            client_w.transport.abort()
            return
        loop = asyncio.get_running_loop()

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

            async def deliver() -> None:
                while True:
                    at, data = await due.get()
                    await asyncio.sleep(max(0.0, at - loop.time()))
                    if not data:
                        writer.close()
                        return
                    writer.write(data)
                    await writer.drain()

            delivering = asyncio.ensure_future(deliver())
            try:
                while data := await reader.read(65536):
                    due.put_nowait((loop.time() + self.delay, data))
                due.put_nowait((loop.time() + self.delay, b""))
                await delivering
            finally:
                delivering.cancel()

        pumps = [
            asyncio.ensure_future(pump(client_r, server_w)),
            asyncio.ensure_future(pump(server_r, client_w)),
        ]
        try:
            await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            for task in pumps:
                task.cancel()
            for w in (client_w, server_w):
                w.close()


class ClosingProxy(_ProxyThread):
    def __init__(self, target: str, *, idle_close: float | None) -> None:
        self.idle_close = idle_close  # None: connections stay open (it may change between requests)
        self.stats = ProxyStats()
        super().__init__(target)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        try:
            server_r, server_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            client_w.transport.abort()
            return
        request_waiting = asyncio.Event()  # request bytes arrived since the last response ended
        idle = asyncio.Event()  # a response ended and no request followed yet: the keep-alive timer runs
        closed = asyncio.Event()

        def close_both() -> None:
            closed.set()
            for w in (client_w, server_w):
                w.close()

        async def upstream() -> None:  # gateway -> replica
            while data := await client_r.read(65536):
                request_waiting.set()
                server_w.write(data)
                await server_w.drain()

        async def downstream() -> None:  # replica -> gateway
            ends = _ResponseEnds()
            while data := await server_r.read(65536):
                client_w.write(data)
                ended = ends.feed(data)
                if ended:
                    self.stats.responses += ended
                    request_waiting.clear()
                    idle.set()
                await client_w.drain()

        async def keep_alive() -> None:
            while not closed.is_set():
                await idle.wait()
                idle.clear()
                try:
                    await asyncio.wait_for(request_waiting.wait(), self.idle_close)  # None: no timeout
                except TimeoutError:
                    self.stats.closed_idle += 1
                    close_both()  # whatever arrives from now on is lost, as with a server's own close

        tasks = [asyncio.ensure_future(f()) for f in (upstream, downstream, keep_alive)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            if isinstance(results[1], ConnectionResetError):
                client_w.transport.abort()  # the replica reset: so does the gateway's connection
            close_both()
