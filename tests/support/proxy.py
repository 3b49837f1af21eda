"""A TCP proxy that can lose or delay answers.

Losing an answer is the hardest case for an at-most-once write: the service applied it, the client cannot
know. Delaying answers stands in for a slow store or network (this kernel has no netem).
"""

from __future__ import annotations

import asyncio
import contextlib


class LossyProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        #: Number of upcoming answers to drop: the connection is cut when the service starts answering.
        self.drop_answers = 0
        #: Seconds every chunk of an answer is held back (a slow network or a slow server).
        self.delay = 0.0
        #: Set when an answer is first held back: a request is then in flight in the service (wait on this
        #: rather than sleeping until it probably is).
        self.holding = asyncio.Event()
        self.connections = 0
        self.open_connections = 0
        self.most_open_connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_connections += 1
        self.most_open_connections = max(self.most_open_connections, self.open_connections)
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answers: bool) -> None:
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                while data := await reader.read(65536):
                    if answers and self.drop_answers > 0:
                        self.drop_answers -= 1
                        break  # the service answered: lose the answer
                    if answers and self.delay:
                        self.holding.set()
                        await asyncio.sleep(self.delay)  # the fault itself: a slow store or network
                    writer.write(data)
                    await writer.drain()
            for w in (client_writer, server_writer):
                w.close()

        tasks = [
            asyncio.create_task(pipe(client_reader, server_writer, False)),
            asyncio.create_task(pipe(server_reader, client_writer, True)),
        ]
        for task in tasks:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await asyncio.gather(*tasks, return_exceptions=True)
        self.open_connections -= 1
