"""``radixkv chat`` driven through stdin against a real tiny-model server."""

from __future__ import annotations

import asyncio
import io
import uuid

from radixkv.chat_cli import add_arguments, run_chat, status_line
from radixkv.cli import build_parser
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
    assert (args.command, args.url, args.max_tokens, args.temperature) == ("chat", "http://h:1", 7, 0.7)
