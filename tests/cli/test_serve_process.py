"""``radixkv serve`` as a process: a busy port is reported before the model loads, and a second
SIGINT during the drain forces the exit (in-flight requests aborted)."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import orjson
import pytest

from radixkv.server.listen import bind_listeners
from tests.server.helpers import HI, get, sse_events, wait_process_healthy
from tests.server.test_lifecycle import _free_port, open_stream

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def test_a_busy_port_is_reported_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A model that does not exist: had it been loaded first, that would be the error.
        proc = subprocess.run([sys.executable, "-m", "radixkv.cli", "serve", "--port", str(port),
                               "--model", str(tmp_path / "no-such-model"), "--device", "cpu"],
                              capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (
        f"radixkv serve: cannot listen on 127.0.0.1:{port}: Address already in use")


def test_bind_listeners():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as exc:
            bind_listeners("127.0.0.1", port)
        assert exc.value.errno == errno.EADDRINUSE
    # Freed once the listener is gone (SO_REUSEADDR). Listening already: a second process
    # binding the same port (SO_REUSEADDR lets it bind on Linux) fails at once, not after
    # loading its model.
    (sock,) = bind_listeners("127.0.0.1", port)
    with sock:
        assert sock.getsockname() == ("127.0.0.1", port)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        with pytest.raises(OSError) as exc:
            bind_listeners("127.0.0.1", port)
        assert exc.value.errno == errno.EADDRINUSE
    every = bind_listeners("", 0)  # all interfaces: one port for every family
    try:
        assert len({s.getsockname()[1] for s in every}) == 1
    finally:
        for s in every:
            s.close()


@pytest.mark.slow
def test_a_second_sigint_forces_the_exit_during_the_drain(tiny_model_dir):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv.cli", "serve", "--model", str(tiny_model_dir),
         "--device", "cpu", "--port", str(port), "--num-blocks", "256",
         "--shutdown-timeout", "600", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    url = f"http://127.0.0.1:{port}"

    async def scenario() -> tuple[bytes, float]:
        await wait_process_healthy(proc, url)
        async with aiohttp.ClientSession() as http:
            body = {"messages": HI, "max_tokens": 1900, "temperature": 0, "ignore_eos": True}
            resp = await open_stream(http, url, body)
            proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 30
            while (await get(url, "/health")) != (503, {"status": "draining"}):
                assert time.monotonic() < deadline, "the server did not start draining"
                await asyncio.sleep(0.05)
            forced_at = time.monotonic()
            proc.send_signal(signal.SIGINT)
            return await resp.content.read(), forced_at

    try:
        rest, forced_at = asyncio.run(scenario())
        assert proc.wait(30) == 130
        exited_after_s = time.monotonic() - forced_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The drain allowed 600 s; the second signal ended it: the stream was aborted in-band.
    assert exited_after_s < 30
    events = [orjson.loads(e) for e in sse_events(rest)]
    assert events[-1] == {"error": {"message": "the request was aborted by the server",
                                    "type": "server_error", "param": None, "code": "aborted"}}
    assert b"shutdown_forced" in proc.stderr.read()
