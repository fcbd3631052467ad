"""A response's bytes straight to the socket when nothing stands in the way (hypercorn, HTTP).

hypercorn (0.17, 0.18) writes every message of a connection through `TCPServer.protocol_send`:
a `trio.Lock` (one checkpoint), a shielded `CancelScope`, then `SocketStream.send_all` (a
conflict detector, a memoryview, another checkpoint) around one `send`. A streamed token is one
such message, and that machinery, not the write, was most of what the event loop spent on it:
without it, the Trio thread's CPU per token halved at 64 streams (bench.token_path, tiny model,
docs/benchmarks).

`FastSendTCPServer` keeps hypercorn's connection and changes one thing: on a plain TCP
connection (not TLS) whose send lock is free, a message's bytes are written with one
non-blocking `os.write` on the socket. That is safe because:

- nothing else writes to the connection meanwhile: every writer goes through the lock, it is
  free, and nothing runs between the check and the write (no `await` in between);
- the write cannot be cut by a cancellation (it does not yield), which is what hypercorn's
  shield is for;
- whatever the kernel does not take at once (a full send buffer: a slow reader) and any error
  (the client gone, the socket closed) go hypercorn's own way with what is left, lock, shield,
  error handling and all, so that bytes stay in order and a broken connection is reported as
  before.

What is lost is the checkpoint hypercorn's path made on every message; a streaming response
still waits for its next token at each turn of its loop (a checkpoint), and a body larger than
the socket buffer still takes the usual path. `TRIO_MLX_FAST_SEND=off` keeps hypercorn's path.
`install` puts the class where hypercorn's trio worker makes its connections, once, and only
where hypercorn is the shape it was written for (else it leaves hypercorn as it is).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import trio
from hypercorn.events import RawData
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio.tcp_server import TCPServer

log = logging.getLogger("trio_mlx.http")

ENV = "TRIO_MLX_FAST_SEND"


class FastSendTCPServer(TCPServer):
    """hypercorn's `TCPServer`, writing a message directly when it can (module docstring)."""

    async def protocol_send(self, event: Any) -> None:
        if type(event) is RawData and not self.send_lock.locked():
            stream: Any = self.stream  # typed as TLS; a plain connection's is a SocketStream
            if type(stream) is trio.SocketStream:
                data = event.data
                try:
                    sent = os.write(stream.socket.fileno(), data)
                except OSError:  # a full buffer, or an error that hypercorn's path reports
                    sent = 0
                if sent == len(data):
                    return
                if sent:
                    event = RawData(data=data[sent:], address=event.address)
        await super().protocol_send(event)


def install() -> bool:
    """Make hypercorn's trio worker serve connections with `FastSendTCPServer`; False (and
    hypercorn left as it is) when `TRIO_MLX_FAST_SEND=off` or hypercorn is not the shape this
    was written for."""
    if os.environ.get(ENV, "on").lower() in ("0", "off", "false", "no"):
        return False
    current = getattr(hypercorn_run, "TCPServer", None)
    if current is FastSendTCPServer:
        return True
    if current is not TCPServer or not _expected_shape():
        log.info("hypercorn's connection is not the expected shape: its own send path is kept")
        return False
    hypercorn_run.TCPServer = FastSendTCPServer  # type: ignore[attr-defined]
    return True


def _expected_shape() -> bool:
    """Whether `TCPServer` has the send lock, the stream and the method this class relies on."""
    import inspect

    try:
        init = inspect.getsource(TCPServer.__init__)
        send = inspect.getsource(TCPServer.protocol_send)
    except (OSError, TypeError):
        return False
    return (
        "self.send_lock" in init
        and "self.stream = stream" in init
        and "async with self.send_lock" in send
        and "send_all(event.data)" in send
    )
