"""Listening sockets bound before the model loads, and the shutdown signals.

``radixkv serve`` binds its address first (``bind_listeners``), so a port already in use is
reported at once, not after the model has loaded; the bound sockets are handed to aiohttp
(``web.SockSite``), which starts listening on them once the engine is up (until then a client
is refused, as before). This module imports no aiohttp, so the CLI can bind cheaply.

``ShutdownSignals``: the first SIGINT or SIGTERM starts a graceful drain, a second one during
the drain forces the exit (in-flight requests are aborted at once).
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
from collections.abc import Awaitable

import structlog

log = structlog.get_logger(__name__)

_BACKLOG = 128  # aiohttp's default


def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """Bind and listen on one TCP socket per address ``host`` resolves to, as asyncio's
    ``create_server`` would (``SO_REUSEADDR``; IPv6 sockets IPv6-only; backlog 128).

    Listening here, before the model loads, is what makes a busy port fail now: with
    ``SO_REUSEADDR`` two processes can both bind one port on Linux and only ``listen`` tells
    them apart. Clients that connect while the model loads wait in the backlog.

    Args:
        host: interface name or address ("0.0.0.0": all IPv4 interfaces; "": all interfaces).
        port: TCP port; 0 picks a free one (shared by all addresses of ``host``).

    Raises:
        OSError: the address cannot be resolved or bound, e.g. ``EADDRINUSE``; no socket is
            left open. An address of a family the host has not enabled (``EADDRNOTAVAIL``,
            e.g. ``::1`` without IPv6) is skipped unless it is the only one.
    """
    infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM,
                               0, socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # every address on the port the first one got
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
                sock.listen(_BACKLOG)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                sockets.pop().close()  # that family is not enabled here (asyncio skips it too)
        if not sockets:
            raise OSError(errno.EADDRNOTAVAIL, os.strerror(errno.EADDRNOTAVAIL))
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class ShutdownSignals:
    """SIGINT/SIGTERM handlers on the running loop: the first sets ``stop``, any later one sets
    ``force``. ``close`` removes them."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, stop: asyncio.Event, force: asyncio.Event) -> None:
        self.stop = stop
        self.force = force
        self._loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            self._loop.add_signal_handler(sig, self._received, sig)

    def _received(self, sig: signal.Signals) -> None:
        if not self.stop.is_set():
            log.warning("shutdown_requested", signal=sig.name,
                        hint="draining in-flight requests; send it again to exit at once")
            self.stop.set()
        elif not self.force.is_set():
            log.warning("shutdown_forced", signal=sig.name)
            self.force.set()

    def close(self) -> None:
        for sig in self.SIGNALS:
            self._loop.remove_signal_handler(sig)


async def unless_forced(work: Awaitable[None], force: asyncio.Event) -> bool:
    """Await ``work`` (a drain) unless ``force`` is set first, then cancel it.

    Returns:
        True when ``work`` finished, False when it was cut short by ``force``.
    """
    task = asyncio.ensure_future(work)
    forced = asyncio.ensure_future(force.wait())
    try:
        await asyncio.wait({task, forced}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        forced.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    return False
