"""Holds a private network namespace for a test deployment and relays a Unix socket into it.

Run as `unshare -n -- python tests/dynamo/relay.py SOCKET PORT`: brings the namespace's loopback
up, then forwards every connection on the Unix socket SOCKET (a path: it crosses network
namespaces) to 127.0.0.1:PORT inside the namespace (Dynamo's frontend). Other processes join the
namespace with `nsenter -t <this pid> -n`. Nothing of the deployment is reachable from outside:
the namespace has loopback only. Prints "ready" once listening; ends on SIGTERM.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def main(path: str, port: int) -> None:
    async def handle(reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_unix_server(handle, path)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
