"""The sandboxed harness's only network: 127.0.0.1:PORT forwarded to the gateway's socket.

Runs inside the harness sandbox (sao_jax/serve/harness_sandbox.py), as the sandbox's
first process, with the standard library only:

  python forwarder.py --socket=/run/sao/gateway.sock --port=8000 -- <harness argv...>

It listens on the sandbox's own loopback (a new network namespace has nothing else),
pipes every connection byte for byte to the Unix socket the gateway serves on (bound
into the sandbox), starts the harness once it listens, and exits with the harness's
exit status (128 + N when a signal N ended it). So an unmodified harness, in any
language, talks HTTP to `http://127.0.0.1:PORT/...`; nothing in the sandbox can reach
any other address.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


def _handler(socket_path: str):
    async def handle(reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(socket_path)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    return handle


async def main(socket_path: str, port: int, argv: list[str]) -> int:
    server = await asyncio.start_server(_handler(socket_path), "127.0.0.1", port)
    proc = await asyncio.create_subprocess_exec(*argv)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # pass a stop on to the harness
        loop.add_signal_handler(sig, lambda s=sig: proc.returncode is None and proc.send_signal(s))
    code = await proc.wait()
    server.close()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    sys.exit(asyncio.run(main(args.socket, args.port, argv)))
