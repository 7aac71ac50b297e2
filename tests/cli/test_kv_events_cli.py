"""``radixkv serve``'s KV-event flags: ``--kv-events-config`` (vLLM's JSON, same keys
and defaults) and its shorthands ``--kv-events-endpoint`` / ``--kv-events-replay-endpoint``, as
``kv_events_config_from_args`` turns parsed arguments into a ``KVEventsConfig``; and two real
``radixkv serve`` processes: one advertising the port it bound, one refusing a taken port."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from radixkv.cli import build_parser, kv_events_config_from_args
from radixkv.engine.kv_events import KVEventsConfig
from tests.server.helpers import get, wait_process_healthy
from tests.server.test_lifecycle import _free_port

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
KNOWN = ("buffer_steps, enable_kv_cache_events, endpoint, hwm, max_queue_size, publisher, "
         "replay_endpoint, topic")


def config_of(*flags: str) -> KVEventsConfig | None:
    return kv_events_config_from_args(build_parser().parse_args(["serve", *flags]))


def test_no_flags_means_no_events():
    assert config_of() is None
    # vLLM's JSON with events switched off (or the null publisher) is off as well.
    assert config_of("--kv-events-config", '{"enable_kv_cache_events": false}') is None
    assert config_of("--kv-events-config",
                     '{"enable_kv_cache_events": true, "publisher": "null"}') is None


def test_endpoint_shorthand_enables_events_with_vllms_defaults():
    assert config_of("--kv-events-endpoint", "tcp://*:6000") == KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:6000",
        replay_endpoint=None, buffer_steps=10_000, hwm=100_000, max_queue_size=100_000, topic="")
    assert config_of("--kv-events-endpoint", "tcp://127.0.0.1:6000", "--kv-events-replay-endpoint",
                     "tcp://127.0.0.1:6001") == KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:6000",
        replay_endpoint="tcp://127.0.0.1:6001")
    # A replay endpoint alone would publish on vLLM's default, every interface: refused.
    with pytest.raises(ValueError, match="--kv-events-replay-endpoint: needs --kv-events-endpoint"):
        config_of("--kv-events-replay-endpoint", "tcp://127.0.0.1:6001")
    assert config_of("--kv-events-config", '{"endpoint": "tcp://127.0.0.1:1"}',
                     "--kv-events-replay-endpoint", "tcp://127.0.0.1:2").replay_endpoint == \
        "tcp://127.0.0.1:2"


def test_json_config():
    assert config_of("--kv-events-config", '{"enable_kv_cache_events": true, "topic": "kv"}') \
        == KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557", topic="kv")
    assert config_of("--kv-events-config", '{"enable_kv_cache_events": true, "hwm": 7, '
                     '"buffer_steps": 3, "replay_endpoint": "tcp://127.0.0.1:0"}') == \
        KVEventsConfig(enable_kv_cache_events=True, hwm=7, buffer_steps=3,
                       replay_endpoint="tcp://127.0.0.1:0")


def test_shorthands_override_the_json():
    json_config = ('{"enable_kv_cache_events": false, "endpoint": "tcp://*:1111", '
                   '"replay_endpoint": "tcp://*:2222", "topic": "kv"}')
    assert config_of("--kv-events-config", json_config, "--kv-events-endpoint", "tcp://*:6000") \
        == KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:6000",
                          replay_endpoint="tcp://*:2222", topic="kv")
    assert config_of("--kv-events-config", json_config, "--kv-events-endpoint", "tcp://*:6000",
                     "--kv-events-replay-endpoint", "tcp://*:6001") == KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://*:6000", replay_endpoint="tcp://*:6001",
        topic="kv")


@pytest.mark.parametrize("flags,message", [
    (("--kv-events-config", "{"), "--kv-events-config: not valid JSON: Expecting property name "
                                  "enclosed in double quotes: line 1 column 2 (char 1)"),
    (("--kv-events-config", "[1]"), "--kv-events-config: must be a JSON object"),
    (("--kv-events-config", '{"nope": 1}'),
     f"--kv-events-config: kv_events_config.nope: unknown key (known: {KNOWN})"),
    (("--kv-events-config", '{"enable_kv_cache_events": true, "hwm": 0}'),
     "--kv-events-config: kv_events_config.hwm: must be an integer >= 1, got 0"),
    (("--kv-events-config", '{"buffer_steps": 1.5}'),
     "--kv-events-config: kv_events_config.buffer_steps: must be an integer >= 1, got 1.5"),
    (("--kv-events-config", '{"enable_kv_cache_events": "yes"}'),
     "--kv-events-config: kv_events_config.enable_kv_cache_events: must be true or false"),
    (("--kv-events-config", '{"publisher": "kafka"}'),
     "--kv-events-config: kv_events_config.publisher: must be 'zmq' or 'null', got 'kafka'"),
    (("--kv-events-config", '{"topic": 5}'),
     "--kv-events-config: kv_events_config.topic: must be a string, got 5"),
    (("--kv-events-endpoint", "localhost:6000"),
     "--kv-events-endpoint: must be a ZMQ endpoint such as "
     "tcp://*:5557, got 'localhost:6000'"),
    (("--kv-events-endpoint", "tcp://127.0.0.1:70000"),
     "--kv-events-endpoint: the port must be 0-65535 or *, got 'tcp://127.0.0.1:70000'"),
    (("--kv-events-endpoint", "tcp://127.0.0.1:1", "--kv-events-replay-endpoint", "6001"),
     "--kv-events-replay-endpoint: must be a ZMQ endpoint such as "
     "tcp://*:5557, got '6001'"),
])
def test_bad_values_name_the_flag_and_key(flags, message):
    with pytest.raises(ValueError) as exc:
        config_of(*flags)
    assert str(exc.value) == message


def _serve(model_dir, port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "radixkv.cli", "serve", "--model", str(model_dir),
            "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--num-blocks", "64",
            "--log-level", "warning", *flags]


def test_serve_advertises_the_bound_events_port(tiny_model_dir):
    port = _free_port()
    proc = subprocess.Popen(_serve(tiny_model_dir, port, "--kv-events-endpoint",
                                   "tcp://127.0.0.1:0"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_process_healthy(proc, url))
        status, sources = asyncio.run(get(url, "/kv_event_sources"))
        assert status == 200 and set(sources) == {"0"}
        endpoint = sources["0"].pop("endpoint")
        assert sources["0"] == {"replay_endpoint": None, "topic": "", "hwm": 100_000,
                                "buffer_steps": 10_000, "publisher": "zmq", "encoding": "msgpack",
                                "schema_version": 1, "enable_kv_cache_events": True}
        host, _, events_port = endpoint.rpartition(":")
        assert host == "tcp://127.0.0.1" and int(events_port) > 0
        with socket.socket() as probe:  # the advertised port is really bound (by the server)
            with pytest.raises(OSError):
                probe.bind(("127.0.0.1", int(events_port)))
    finally:
        proc.terminate()
        proc.wait(30)
    assert proc.returncode == 0


def test_serve_exits_2_when_the_events_port_is_taken(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        events_port = taken.getsockname()[1]
        proc = subprocess.run(_serve(tiny_model_dir, _free_port(), "--kv-events-endpoint",
                                     f"tcp://127.0.0.1:{events_port}"),
                              capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"radixkv serve: kv_events_config.endpoint: cannot bind "
        f"'tcp://127.0.0.1:{events_port}': Address already in use "
        f"(addr='tcp://127.0.0.1:{events_port}')")
