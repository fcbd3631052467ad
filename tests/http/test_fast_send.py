"""`FastSendTCPServer`: a message written straight to the socket when the connection's send lock
is free, hypercorn's own path for what the kernel does not take at once and for errors. Bytes
arrive whole and in order whatever the mix, a message sent while another waits for a slow
reader queues behind it, and a connection the client closed is reported as hypercorn reports it.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, RawData
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio.tcp_server import TCPServer

from servers import running_server
from trio_mlx.http import fast_send
from trio_mlx.http.fast_send import FastSendTCPServer


class Protocol:
    """What hypercorn's protocol is told (the events `protocol_send` hands it)."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    async def handle(self, event: Any) -> None:
        self.events.append(event)


@contextlib.asynccontextmanager
async def connection(
    sndbuf: int | None = None,
) -> AsyncIterator[tuple[FastSendTCPServer, socket.socket, Protocol]]:
    """A server-side connection over a socket pair (its peer returned, blocking); both closed
    on exit."""
    ours, peer = socket.socketpair()
    if sndbuf is not None:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
    server = FastSendTCPServer(None, Config(), None, {}, stream)
    protocol = Protocol()
    server.protocol = protocol
    with peer:
        async with stream:
            yield server, peer, protocol


async def read_all(peer: socket.socket, size: int) -> bytes:
    def read() -> bytes:
        got = b""
        while len(got) < size:
            chunk = peer.recv(1 << 16)
            if not chunk:
                break
            got += chunk
        return got

    return await trio.to_thread.run_sync(read)


async def test_small_messages_go_straight_to_the_socket() -> None:
    async with connection() as (server, peer, protocol):
        messages = [f"data: {i}\n\n".encode() for i in range(50)]
        for message in messages:
            await server.protocol_send(RawData(data=message))
        expected = b"".join(messages)
        assert await read_all(peer, len(expected)) == expected
        assert protocol.events == []


async def test_what_the_kernel_does_not_take_goes_the_usual_way_in_order() -> None:
    """Messages far larger than the socket buffers, sent from two tasks at once while the
    reader is slow: each arrives whole, in the order the sends began, none interleaved."""
    size = 1 << 20
    first, second, third = (bytes([65 + i]) * size for i in range(3))
    received: list[bytes] = []
    async with connection(sndbuf=4096) as (server, peer, protocol):

        async def reader() -> None:
            await trio.sleep(0.2)  # the first write fills the buffers, waits in hypercorn's path
            received.append(await read_all(peer, 3 * size))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            nursery.start_soon(server.protocol_send, RawData(data=first))
            await trio.sleep(0.05)
            assert server.send_lock.locked()  # the rest of the first message is being written
            nursery.start_soon(server.protocol_send, RawData(data=second))
            await trio.sleep(0.05)
            await server.protocol_send(RawData(data=third))
        assert received == [first + second + third]
        assert protocol.events == []


async def test_a_message_waits_while_another_writer_holds_the_lock() -> None:
    message = b"data: later\n\n"
    async with connection() as (server, peer, _):
        peer.setblocking(False)
        async with trio.open_nursery() as nursery:
            async with server.send_lock:  # another write of this connection is under way
                nursery.start_soon(server.protocol_send, RawData(data=message))
                await trio.sleep(0.05)
                with pytest.raises(BlockingIOError):
                    peer.recv(100)
        peer.setblocking(True)
        assert await read_all(peer, len(message)) == message


async def test_a_closed_peer_is_reported_as_hypercorn_reports_it() -> None:
    async with connection() as (server, peer, protocol):
        peer.close()
        for _ in range(3):  # the first write may still land in the kernel's buffer
            await server.protocol_send(RawData(data=b"data: x\n\n" * 1000))
        assert any(isinstance(event, Closed) for event in protocol.events)


async def test_a_closed_socket_is_reported_as_hypercorn_reports_it() -> None:
    async with connection() as (server, _, protocol):
        await server.stream.aclose()
        await server.protocol_send(RawData(data=b"data: x\n\n"))
        assert [type(event) for event in protocol.events] == [Closed]


def test_install_is_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hypercorn_run, "TCPServer", TCPServer)
    monkeypatch.setenv(fast_send.ENV, "off")
    assert not fast_send.install()
    assert hypercorn_run.TCPServer is TCPServer
    monkeypatch.delenv(fast_send.ENV)
    assert fast_send.install()
    assert hypercorn_run.TCPServer is FastSendTCPServer


async def test_the_server_serves_its_connections_with_it(tiny_model_dir: Path) -> None:
    """The installed hypercorn has the shape the class was written for (a hypercorn upgrade
    that changes it fails here; the server would then keep hypercorn's own path)."""
    assert fast_send._expected_shape()
    async with running_server(tiny_model_dir):
        assert hypercorn_run.TCPServer is FastSendTCPServer
    assert os.environ.get(fast_send.ENV, "on") == "on"
