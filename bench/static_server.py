"""A server that answers every GET with the same small JSON document at once, without parsing anything
else: used to measure how many requests per second the load generator itself can push (it must be far more
than any server under test achieves). uvloop when installed.

    python bench/static_server.py --port 8099
"""

from __future__ import annotations

import argparse
import asyncio
from typing import cast

BODY = b'{"identifier":"+12122000000","fields":{},"expires_at":null,"blacklisted":false}'
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(BODY),
    BODY,
)


class Static(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        self.pending = b""

    def data_received(self, data: bytes) -> None:
        data = self.pending + data
        count = data.count(b"\r\n\r\n")
        self.pending = data[data.rfind(b"\r\n\r\n") + 4 :] if count else data
        if count:
            self.transport.write(ANSWER * count)


async def serve(host: str, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Static, host, port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
