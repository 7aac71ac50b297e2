"""``radixkv chat`` driven through stdin against a real tiny-model server."""

from __future__ import annotations

import asyncio
import io
import socket
import subprocess
import sys
import uuid

import pytest

from radixkv.cli import build_parser
from radixkv.tools import chat as chat_cli
from radixkv.tools.chat import add_arguments, normalise_url, run_chat, status_line
from tests.server.conftest import BLOCK_SIZE
from tests.server.helpers import post_json

SYSTEM = "You are a terse assistant who answers in one line. " * 4


def chat_args(url: str, salt: str, *extra: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--url", url, "--system", SYSTEM, "--max-tokens", "12",
                              "--temperature", "0", "--cache-salt", salt, *extra])


def tokenize(url: str, messages: list[dict], salt: str) -> list[int]:
    status, out = asyncio.run(post_json(url, "/tokenize", {"messages": messages,
                                                           "cache_salt": salt}))
    assert status == 200
    return out["tokens"]


def test_chat_turns_show_cached_tokens_and_commands(server):
    salt = uuid.uuid4().hex
    stdin = io.StringIO("Hello there\nAnd then?\n/help\n/stats\n/reset\nHello there\n"
                        "/quit\nnever sent\n")
    stdout = io.StringIO()
    turns = asyncio.run(run_chat(chat_args(server.url, salt), stdin, stdout))
    assert len(turns) == 3  # "/quit" ended the chat before "never sent"
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there"}]
    second = first + [{"role": "assistant", "content": turns[0].reply},
                      {"role": "user", "content": "And then?"}]
    p1, p2 = tokenize(server.url, first, salt), tokenize(server.url, second, salt)
    assert [t.prompt_tokens for t in turns] == [len(p1), len(p2), len(p1)]
    # Turn 2 re-sends reply 1 verbatim: the whole previous prompt and every fed reply token
    # (all sampled but the last) hit, up to the block-aligned cap.
    fed = len(p1) + turns[0].completion_tokens - 1
    assert turns[1].cached_tokens == min(fed, len(p2) - 1) // BLOCK_SIZE * BLOCK_SIZE
    # After /reset the same first message hits its own earlier prompt (capped at N - 1).
    assert turns[0].cached_tokens == 0
    assert turns[2].cached_tokens == (len(p1) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert turns[2].reply == turns[0].reply  # greedy, same prompt
    out = stdout.getvalue()
    for number, turn in enumerate(turns, 1):
        assert status_line(number, turn).split(", TTFT")[0] in out
        assert turn.reply in out  # streamed to the terminal
    assert "commands: /reset" in out and "requests_total" in out and "(history cleared)" in out
    assert "never sent" not in out


def test_chat_reports_server_errors_and_keeps_going(server):
    stdin = io.StringIO("x" * 20 + "\nhi\n")
    stdout = io.StringIO()
    # max_tokens past the tiny model's context (2048): every turn is refused with a 400.
    turns = asyncio.run(run_chat(chat_args(server.url, uuid.uuid4().hex, "--max-tokens", "5000"),
                                 stdin, stdout))
    assert turns == []
    out = stdout.getvalue()
    assert out.count("(error: HTTP 400: This model's maximum context length is 2048") == 2
    assert out.count("/reset starts over") == 2


def test_cli_registers_chat():
    args = build_parser().parse_args(["chat", "--url", "http://h:1", "--max-tokens", "7"])
    assert (args.command, args.url, args.max_tokens, args.temperature) == ("chat", "http://h:1", 7, 0.0)


def test_help_states_every_default():
    import argparse

    chat = argparse.ArgumentParser(prog="radixkv chat")
    add_arguments(chat)
    flags = [a for a in chat._actions if a.option_strings != ["-h", "--help"]]
    assert [a.dest for a in flags] == ["url", "model", "system", "max_tokens", "temperature", "seed",
                                       "api_key", "cache_salt", "timeout"]
    for action in flags:
        assert "(default: " in action.help, action.dest
    text = " ".join(chat.format_help().split())
    assert "0 is greedy, the same reply for the same history (default: 0)" in text
    assert "most output tokens per reply (default: 512)" in text
    assert "(default: http://127.0.0.1:8000)" in text


def test_default_temperature_reaches_the_engine_as_greedy(server, monkeypatch):
    """No --temperature: every request the chat sends samples at exactly 0.0 (greedy), with the
    default 512 max tokens."""
    seen = []
    generate = server.engine.generate

    def recording_generate(prompt_token_ids, params, *args, **kwargs):
        seen.append((params.temperature, params.max_tokens))
        return generate(prompt_token_ids, params, *args, **kwargs)

    monkeypatch.setattr(server.engine, "generate", recording_generate)
    args = build_parser().parse_args(["chat", "--url", server.url, "--cache-salt", uuid.uuid4().hex])
    turns = asyncio.run(run_chat(args, io.StringIO("Hello there\nAnd then?\n"), io.StringIO()))
    assert len(turns) == 2
    assert seen == [(0.0, 512), (0.0, 512)]


def run_cli_chat(*flags: str, stdin: str = "") -> subprocess.CompletedProcess:
    """``python -m radixkv.cli chat ...`` as a user runs it (its own process and stderr)."""
    return subprocess.run([sys.executable, "-m", "radixkv.cli", "chat", *flags], input=stdin,
                          capture_output=True, text=True, timeout=60)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_unknown_command_is_refused_and_double_slash_sends_a_literal(server):
    salt = uuid.uuid4().hex
    stdin = io.StringIO("/bogus\n/bogus with words\n//etc/hosts please\n")
    stdout = io.StringIO()
    turns = asyncio.run(run_chat(chat_args(server.url, salt), stdin, stdout))
    out = stdout.getvalue()
    assert out.count("unknown command: /bogus (try /help)\n") == 2
    # Only the escaped line reached the model, with one leading '/' removed.
    assert len(turns) == 1
    sent = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "/etc/hosts please"}]
    assert turns[0].prompt_tokens == len(tokenize(server.url, sent, salt))


def test_normalise_url():
    assert normalise_url("http://h:1") == "http://h:1"
    assert normalise_url("http://h:1/v1") == "http://h:1"
    assert normalise_url(" https://h:1/v1/ ") == "https://h:1"
    assert normalise_url("127.0.0.1:8100") == "http://127.0.0.1:8100"
    assert normalise_url("localhost:8100/v1") == "http://localhost:8100"
    assert normalise_url("http://h/api/v1x") == "http://h/api/v1x"
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        normalise_url("ftp://h:1")


@pytest.mark.parametrize("form", ["{url}/v1", "{url}/v1/", "{hostport}", "{hostport}/v1"])
def test_chat_accepts_openai_base_url_and_missing_scheme(server, form):
    url = form.format(url=server.url, hostport=server.url.removeprefix("http://"))
    salt = uuid.uuid4().hex
    stdout = io.StringIO()
    turns = asyncio.run(run_chat(chat_args(url, salt), io.StringIO("Hello there\n"), stdout))
    assert len(turns) == 1 and turns[0].prompt_tokens > 0
    assert f"at {server.url} " in stdout.getvalue()


def test_cli_refuses_a_non_http_url():
    proc = run_cli_chat("--url", "ftp://127.0.0.1:1")
    assert proc.returncode == 2
    assert "URL must start with http:// or https://" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_model_exits_non_zero_at_start(server):
    proc = run_cli_chat("--url", server.url, "--model", "nope", stdin="hi\n")
    assert proc.returncode == 1
    model = server.engine.model_name
    assert f"model 'nope' is not served here; GET /v1/models lists: {model}" in proc.stderr
    assert "radixkv chat with" not in proc.stdout  # refused before the first prompt
    assert "Unclosed" not in proc.stderr and "Traceback" not in proc.stderr


def test_listed_model_is_accepted(server):
    model = server.engine.model_name
    stdout = io.StringIO()
    turns = asyncio.run(run_chat(chat_args(server.url, uuid.uuid4().hex, "--model", model),
                                 io.StringIO("hi\n"), stdout))
    assert len(turns) == 1 and f"radixkv chat with {model} at" in stdout.getvalue()


def test_unreachable_server_exits_cleanly_without_unclosed_session_warnings():
    url = closed_port_url()
    proc = run_cli_chat("--url", url)
    assert proc.returncode == 1
    assert f"radixkv chat: cannot use the server at {url}:" in proc.stderr
    assert "Unclosed" not in proc.stderr and "Traceback" not in proc.stderr


def test_http_session_is_closed_on_every_exit(server, monkeypatch):
    opened: list = []

    class Recording(chat_cli.aiohttp.ClientSession):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            opened.append(self)

    monkeypatch.setattr(chat_cli.aiohttp, "ClientSession", Recording)
    salt = uuid.uuid4().hex
    with pytest.raises(chat_cli.aiohttp.ClientError):  # unreachable
        asyncio.run(run_chat(chat_args(closed_port_url(), salt), io.StringIO(""), io.StringIO()))
    with pytest.raises(chat_cli.ChatError, match="not served"):  # unknown model
        asyncio.run(run_chat(chat_args(server.url, salt, "--model", "nope"), io.StringIO(""),
                             io.StringIO()))
    asyncio.run(run_chat(chat_args(server.url, salt), io.StringIO("/quit\n"), io.StringIO()))
    assert len(opened) == 3 and all(s.closed for s in opened)


def test_a_session_used_outside_async_with_says_so():
    # Before: AttributeError on None (the HTTP client is made on entry).
    session = chat_cli.ChatSession("http://127.0.0.1:9")
    with pytest.raises(RuntimeError, match="async with"):
        asyncio.run(session.stats())
