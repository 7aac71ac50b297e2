"""``radixkv chat``: an interactive terminal chat against a radixkv (or any OpenAI) server.

Each line typed is a user message; the whole history is sent with ``stream: true`` and
``stream_options.include_usage``, the reply is printed as its tokens arrive, and a status line
shows what the prefix cache did for the turn::

    [turn 2: prompt 412 tok, cached 400 (97%), 23 tok out, TTFT 85 ms, 41.2 tok/s]

The reply goes back into the history verbatim, so the next turn re-sends exactly the text the
server generated (the server then reuses the reply's own token ids: the whole history hits).
Commands: ``/reset`` (forget the history, keep the system prompt), ``/stats`` (the server's
cache counters), ``/help``, ``/quit`` (also ``/exit`` or end of input); any other line starting
with ``/`` is refused as an unknown command (``//text`` sends ``/text``). Ctrl-C during a reply
stops it (the request is cancelled, nothing is added to the history); at the prompt it quits.

``--url`` may omit the scheme (``http://`` is assumed) and may end in ``/v1`` (an OpenAI
``base_url``). A ``--model`` the server does not list in ``GET /v1/models`` is refused at start.

The history is never truncated: cutting old turns would change the prompt's head and defeat
the prefix cache. When the server refuses a prompt past the context, the chat says so and
``/reset`` starts over. Input lines are limited to ``MAX_INPUT_CHARS``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, TextIO

import aiohttp

from radixkv.tools.chat_args import (
    DEFAULT_TEMPERATURE,
    add_arguments,  # noqa: F401 - the CLI's flags, re-exported
)

MAX_INPUT_CHARS = 100_000
HELP = "commands: /reset  /stats  /help  /quit  (//text sends /text)"


@dataclass
class Turn:
    """What one exchange cost; token counts from the server's ``usage``, times in ms."""

    reply: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    total_ms: float
    finish_reason: str | None


class ChatError(RuntimeError):
    """The server refused or failed a request (message from its error body)."""


def normalise_url(url: str) -> str:
    """The server's base URL from ``--url``: ``http://`` when no scheme is given, no trailing
    ``/`` or ``/v1`` (an OpenAI-style ``base_url`` names the same server).

    Raises:
        ValueError: a scheme other than http or https.
    """
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    scheme = url.split("://", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"URL must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")].rstrip("/")
    return url


class ChatSession:
    """History plus the HTTP calls of one chat (use inside ``async with``).

    Args:
        url: server base URL.
        model: model id; None asks the server (``GET /v1/models``) on entry.
        system: system prompt kept across ``/reset``, or None.
        max_tokens, temperature, seed, cache_salt: sent with every request.
        api_key: bearer token, or None.
        timeout_s: seconds without data before a request fails.
    """

    def __init__(self, url: str, *, model: str | None = None, system: str | None = None,
                 max_tokens: int = 512, temperature: float = DEFAULT_TEMPERATURE, seed: int | None = None,
                 api_key: str | None = None, cache_salt: str | None = None,
                 timeout_s: float = 600.0) -> None:
        self.url = normalise_url(url)
        self.model = model
        self.system = system
        self.params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature}
        if seed is not None:
            self.params["seed"] = seed
        if cache_salt is not None:
            self.params["cache_salt"] = cache_salt
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout_s)
        self.history: list[dict[str, str]] = []
        self.turns = 0
        self._http: aiohttp.ClientSession | None = None
        self.reset()

    async def __aenter__(self) -> ChatSession:
        self._http = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)
        try:
            await self._check_model()
        except BaseException:
            await self.close()  # __aexit__ does not run when __aenter__ raises
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def _client(self) -> aiohttp.ClientSession:
        if self._http is None:
            raise RuntimeError("ChatSession: open it with `async with` before a request")
        return self._http

    async def close(self) -> None:
        if self._http is not None and not self._http.closed:
            await self._http.close()

    async def _check_model(self) -> None:
        """Pick the server's first model, or check that ``self.model`` is listed.

        Raises:
            ChatError: the model is not listed, or the server lists none.
        """
        try:
            body = await self._get("/v1/models")
        except ChatError as exc:
            if self.model is not None and str(exc).startswith("HTTP 404"):
                return  # the server has no model listing: nothing to check against
            raise
        data = body.get("data") if isinstance(body, dict) else None
        ids: list[str] = [m["id"] for m in data or [] if isinstance(m, dict) and m.get("id")]
        if self.model is None:
            if not ids:
                raise ChatError("GET /v1/models lists no model (pass --model)")
            self.model = ids[0]
        elif self.model not in ids:
            raise ChatError(f"model {self.model!r} is not served here; GET /v1/models lists: "
                            + (", ".join(ids) or "none"))

    def reset(self) -> None:
        """Forget every turn; keep the system prompt."""
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    async def _get(self, path: str) -> Any:
        async with self._client.get(self.url + path) as resp:
            body = await _json_or_text(resp)
            if resp.status != 200:
                raise ChatError(_error_message(resp.status, body))
            return body

    async def stats(self) -> dict:
        """The server's ``GET /stats``."""
        return await self._get("/stats")

    async def send(self, text: str, on_text) -> Turn:
        """Send ``text`` as the next user message, streaming the reply into ``on_text(str)``.

        The exchange enters the history only once the reply finished.

        Raises:
            ChatError: an HTTP error or an in-band stream error (message from the server).
            aiohttp.ClientError, asyncio.TimeoutError: the connection failed.
        """
        messages = self.history + [{"role": "user", "content": text}]
        body = {"model": self.model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **self.params}
        start = time.perf_counter()
        ttft_ms = None
        parts: list[str] = []
        usage: dict[str, Any] = {}
        finish = None
        async with self._client.post(self.url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                raise ChatError(_error_message(resp.status, await _json_or_text(resp)))
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise ChatError(chunk["error"].get("message", "stream error"))
                for choice in chunk.get("choices") or []:
                    delta = (choice.get("delta") or {}).get("content")
                    if delta:
                        if ttft_ms is None:
                            ttft_ms = (time.perf_counter() - start) * 1e3
                        parts.append(delta)
                        on_text(delta)
                    finish = choice.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
        reply = "".join(parts)
        self.history = messages + [{"role": "assistant", "content": reply}]
        self.turns += 1
        return Turn(reply=reply, prompt_tokens=usage.get("prompt_tokens", 0),
                    cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                    completion_tokens=usage.get("completion_tokens", 0), ttft_ms=ttft_ms,
                    total_ms=(time.perf_counter() - start) * 1e3, finish_reason=finish)


async def _json_or_text(resp: aiohttp.ClientResponse) -> Any:
    raw = await resp.text()
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _error_message(status: int, body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return f"HTTP {status}: {body['error'].get('message')}"
    return f"HTTP {status}: {str(body)[:200]}"


def status_line(number: int, turn: Turn) -> str:
    """``[turn k: prompt P tok, cached C (x%), O tok out, TTFT t ms, r tok/s]``."""
    share = f" ({100 * turn.cached_tokens / turn.prompt_tokens:.0f}%)" if turn.prompt_tokens else ""
    ttft = "-" if turn.ttft_ms is None else f"{turn.ttft_ms:,.0f} ms"
    decode_s = (turn.total_ms - (turn.ttft_ms or 0.0)) / 1e3
    rate = f", {(turn.completion_tokens - 1) / decode_s:.1f} tok/s" if (
        turn.completion_tokens > 1 and decode_s > 0) else ""
    cut = ", cut at max-tokens" if turn.finish_reason == "length" else ""
    return (f"[turn {number}: prompt {turn.prompt_tokens:,} tok, cached "
            f"{turn.cached_tokens:,}{share}, {turn.completion_tokens} tok out, TTFT {ttft}"
            f"{rate}{cut}]")


def _start_reader(stdin: TextIO) -> asyncio.Queue:
    """Lines of ``stdin`` (then None at end of input) from a daemon thread: a blocked read
    must not keep the process alive after Ctrl-C, as an executor thread would."""
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue = asyncio.Queue()

    def read() -> None:
        try:
            for line in iter(stdin.readline, ""):
                loop.call_soon_threadsafe(lines.put_nowait, line)
        finally:
            try:
                loop.call_soon_threadsafe(lines.put_nowait, None)
            except RuntimeError:  # the loop is closed: nobody is reading any more
                pass

    threading.Thread(target=read, name="radixkv-chat-stdin", daemon=True).start()
    return lines


async def chat_loop(session: ChatSession, stdin: TextIO, stdout: TextIO) -> list[Turn]:
    """Read lines from ``stdin`` until ``/quit`` or end of input; returns the turns made."""
    lines = _start_reader(stdin)
    interactive = stdin.isatty()
    turns: list[Turn] = []
    streaming: list[asyncio.Task] = []  # the reply in flight, if any

    def on_sigint() -> None:  # Ctrl-C: stop the reply in flight, or quit at the prompt
        if streaming and not streaming[0].done():
            streaming[0].cancel()
        else:
            lines.put_nowait(None)

    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread / Windows
        pass

    def write(text: str) -> None:
        stdout.write(text)
        stdout.flush()

    write(f"radixkv chat with {session.model} at {session.url}  ({HELP})\n")
    while True:
        if interactive:
            write("you> ")
        line = await lines.get()
        if line is None:
            break
        text = line.rstrip("\n")
        if not text.strip():
            continue
        command = text.strip().lower()
        if command in ("/quit", "/exit"):
            break
        if command == "/help":
            write(HELP + "\n")
            continue
        if command == "/reset":
            session.reset()
            write("(history cleared)\n")
            continue
        if command == "/stats":
            try:
                stats = await session.stats()
            except ChatError as exc:
                write(f"(error: {exc})\n")
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                write(f"(connection failed: {type(exc).__name__}: {exc})\n")
                continue
            keys = ("requests_total", "prompt_tokens_total", "cached_prompt_tokens_total",
                    "token_hit_rate")
            if isinstance(stats, dict):
                write(", ".join(f"{k} {stats[k]}" for k in keys if k in stats) + "\n")
            continue
        if text.startswith("//"):
            text = text[1:]  # an escaped message: "//x" sends "/x"
        elif text.lstrip().startswith("/"):
            write(f"unknown command: {text.split()[0]} (try /help)\n")
            continue
        if len(text) > MAX_INPUT_CHARS:
            write(f"(input longer than {MAX_INPUT_CHARS:,} characters: not sent)\n")
            continue
        if interactive:
            write("assistant> ")
        streaming[:] = [asyncio.create_task(session.send(text, write))]
        try:
            turn = await streaming[0]
        except ChatError as exc:
            hint = "  (/reset starts over)" if "context length" in str(exc) else ""
            write(f"\n(error: {exc}){hint}\n")
            continue
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            write(f"\n(connection failed: {type(exc).__name__}: {exc})\n")
            continue
        except asyncio.CancelledError:
            if not streaming[0].cancelled():
                raise  # this loop itself is being cancelled
            write("\n(interrupted: the turn is not kept)\n")
            continue
        turns.append(turn)
        write("\n" + status_line(session.turns, turn) + "\n")
    return turns


async def run_chat(args: argparse.Namespace, stdin: TextIO = sys.stdin,
                   stdout: TextIO = sys.stdout) -> list[Turn]:
    """Open a session per ``args`` (see ``add_arguments``) and run the loop."""
    async with ChatSession(args.url, model=args.model, system=args.system,
                           max_tokens=args.max_tokens, temperature=args.temperature,
                           seed=args.seed, api_key=args.api_key, cache_salt=args.cache_salt,
                           timeout_s=args.timeout) as session:
        return await chat_loop(session, stdin, stdout)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``radixkv chat``; returns the exit status."""
    if args.max_tokens < 1:
        print("radixkv chat: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        url = normalise_url(args.url)
    except ValueError as exc:
        print(f"radixkv chat: --url: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(run_chat(args))
    except KeyboardInterrupt:
        pass
    except (aiohttp.ClientError, ChatError, OSError) as exc:
        print(f"radixkv chat: cannot use the server at {url}: {exc}", file=sys.stderr)
        return 1
    return 0
