"""Compile slots shared fairly between clients (daemon/workers/grammar.py).

A grammar compile holds one of a few slots (its worker process and thread) for up to
grammar_compile_timeout_s. With the slots first come, first served, one client sending
two costly schemas every timeout_s holds them all and every other client's compile waits
out its deadline (a 429). So a client holds at most PER_CLIENT slots at a time; its
further compiles wait, in order of arrival, while other clients take the free slots; at
most WAITING_PER_CLIENT of them wait, the rest are refused at once. A slot that comes
free goes to the oldest waiter whose client may take it.

Who a client is: `client_of` (app.py gives it the connection; `client_of_transport` reads
both from a connection's transport, for connections.py's per-peer cap as well). Every TCP client sends the
same api_key (moed has one), so the key tells clients apart no better than nothing: a TCP
client is its peer's address (an IPv6 address by its /64, what one host is usually
given); a Unix-socket client is its peer's uid (SO_PEERCRED). One client with many
addresses or uids is many clients here.

Everything runs on the event loop: no locks.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct
from collections.abc import Hashable

PER_CLIENT = 1              # slots one client holds at a time
WAITING_PER_CLIENT = 4      # compiles of one client waiting for a slot; beyond: refused


class SlotRefused(Exception):
    """The client already has WAITING_PER_CLIENT compiles waiting."""


def client_of(peer_uid: int | None, peer_address: str | None) -> Hashable:
    """The client key of a connection: ("uid", uid) on the Unix socket, ("ip", network)
    over TCP (an IPv4 address, or an IPv6 one's /64), ("unknown",) when neither is known."""
    if peer_uid is not None:
        return ("uid", peer_uid)
    if peer_address:
        try:
            address = ipaddress.ip_address(peer_address.split("%", 1)[0])
        except ValueError:
            return ("ip", peer_address)
        if isinstance(address, ipaddress.IPv6Address):
            if address.ipv4_mapped is not None:
                return ("ip", str(address.ipv4_mapped))
            return ("ip", str(ipaddress.ip_network(f"{address}/64", strict=False)))
        return ("ip", str(address))
    return ("unknown",)


def peer_uid(transport: asyncio.BaseTransport | None) -> int | None:
    """The uid of the process at the other end of a Unix-socket connection (SO_PEERCRED),
    else None (TCP, or a transport without a socket)."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def client_of_transport(transport: asyncio.BaseTransport) -> Hashable:
    """`client_of` for a connection's transport: its peer's uid on a Unix socket, its
    peer's address over TCP."""
    uid = peer_uid(transport)
    if uid is not None:
        return client_of(uid, None)
    peer = transport.get_extra_info("peername")
    return client_of(None, peer[0] if isinstance(peer, tuple) and peer else None)


class CompileSlots:
    """`slots` compile slots; a client holds at most `per_client` of them.

    `acquire(client)` returns once the client has a slot (cancel it to stop waiting: a
    slot granted as it was cancelled is given back); `release(client)` gives it back.
    Raises SlotRefused when `waiting_per_client` of the client's compiles already wait.
    """

    def __init__(self, slots: int, *, per_client: int = PER_CLIENT,
                 waiting_per_client: int = WAITING_PER_CLIENT):
        if slots < 1 or per_client < 1 or waiting_per_client < 0:
            raise ValueError(f"slots and per_client must be >= 1 and waiting_per_client "
                             f">= 0, got {slots}, {per_client}, {waiting_per_client}")
        self._free = slots
        self._per_client = per_client
        self._waiting_per_client = waiting_per_client
        self._held: dict[Hashable, int] = {}
        self._waiters: list[tuple[Hashable, asyncio.Future]] = []     # oldest first

    def held(self, client: Hashable) -> int:
        return self._held.get(client, 0)

    def waiting(self, client: Hashable) -> int:
        return sum(c == client for c, _ in self._waiters)

    async def acquire(self, client: Hashable) -> None:
        if self._free and self.held(client) < self._per_client:
            self._take(client)
            return
        if self.waiting(client) >= self._waiting_per_client:
            raise SlotRefused(f"{self._waiting_per_client} compiles of this client wait "
                              "already")
        future = asyncio.get_running_loop().create_future()
        waiter = (client, future)
        self._waiters.append(waiter)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(client)       # granted as it was cancelled: give it back
            else:
                self._waiters.remove(waiter)
            raise

    def release(self, client: Hashable) -> None:
        held = self._held[client] - 1
        if held:
            self._held[client] = held
        else:
            del self._held[client]
        self._free += 1
        self._grant()

    def _take(self, client: Hashable) -> None:
        self._free -= 1
        self._held[client] = self.held(client) + 1

    def _grant(self) -> None:
        """Free slots to the oldest waiters whose clients may take one more."""
        i = 0
        while self._free and i < len(self._waiters):
            client, future = self._waiters[i]
            if future.done() or self.held(client) >= self._per_client:
                i += 1
                continue
            del self._waiters[i]
            self._take(client)
            future.set_result(None)
