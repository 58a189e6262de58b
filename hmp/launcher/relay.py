"""A Unix socket forwarded to a TCP address inside an emulated host: ``python -m hmp.launcher.relay PATH ADDRESS``.

The launcher stays in the machine's own network namespace, which cannot reach the emulated hosts' addresses; a Unix
socket in the file system can be reached from every namespace, and ZeroMQ speaks the same protocol over both
(``ipc://PATH``, ``tcp://HOST:PORT``; CURVE too, end to end). So the launcher's client dials ``ipc://PATH`` and this
process copies the bytes both ways, one TCP connection to ``ADDRESS`` per Unix connection. Standard library only;
it exits at the end of its stdin (the launcher closed it, or died).
"""

from __future__ import annotations

import asyncio
import sys


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()  # the other direction then ends too


async def relay(path: str, address: str) -> None:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)

    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream = await asyncio.open_connection(host.strip("[]"), int(port))
        except OSError as exc:  # the daemon does not serve yet: ZeroMQ dials again
            print(f"relay: {address}: {exc}", file=sys.stderr, flush=True)
            writer.close()
            return
        await asyncio.gather(_copy(reader, upstream[1]), _copy(upstream[0], writer))

    server = await asyncio.start_unix_server(forward, path)
    stdin = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    await stdin.read()
    server.close()


if __name__ == "__main__":
    asyncio.run(relay(*sys.argv[1:3]))
