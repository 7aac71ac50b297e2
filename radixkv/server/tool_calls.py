"""Tool calls in the model's text: ``<tool_call>{json}</tool_call>`` blocks → OpenAI ``tool_calls``.

The format is the one :mod:`radixkv.model.tool_render` asks tool-unaware templates for and that
Hermes / Qwen2.5-style templates ask for themselves: one block per call, its body a JSON object
``{"name": str, "arguments": object}``. Parsing rules (the same for one JSON reply and a
stream, because the whole-text parse is the stream parser fed once):

- a block whose body is a JSON object with a non-empty string ``name`` becomes a call;
  ``arguments`` (missing: ``{}``) is returned as a JSON string (``json.dumps``, non-ASCII
  kept; a string that already holds JSON is returned as it is);
- anything else stays text: malformed JSON, a value without a string ``name``, a block never
  closed (cut by ``max_tokens`` or a stop string; vLLM's Hermes parser would also try to read
  that one, here a cut call is never returned as if whole). Text outside the blocks is the
  content; when calls were found and nothing but whitespace is left, it is null (as OpenAI
  does);
- ``parallel_tool_calls: false`` keeps the first call and drops later well-formed blocks;
- the choice's ``finish_reason`` is ``"tool_calls"`` whenever a call is returned, also when
  generation stopped on ``max_tokens`` after a complete block (vLLM's chat server does the
  same: its finish reason is ``"tool_calls"`` whenever its Hermes parser found a call).

Forcing a call (``tool_choice: "required"`` or a named function): there is no constrained
decoding, so the server appends the start of a call to the prompt (``forced_prefix``) and
treats it as the start of the generated text. A model may still write a malformed call; it
then comes back as text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixkv.model.tool_render import render_tools_fallback, template_handles_tools

if TYPE_CHECKING:
    from radixkv.server.protocol import ChatRequest

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def new_call_id() -> str:
    """``call_<24 hex digits>``, OpenAI's shape."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


@dataclass(frozen=True)
class ParsedCall:
    """One call read from a block: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str

    def openai(self, call_id: str) -> dict:
        """The OpenAI ``tool_calls[i]`` object."""
        return {"id": call_id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def parse_call(body: str) -> ParsedCall | None:
    """The call in a block's body (the text between the tags), or None if it is not one."""
    try:
        value = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", {})
    if isinstance(args, str):
        try:
            json.loads(args, parse_constant=_reject_constant)
            return ParsedCall(value["name"], args)
        except (ValueError, RecursionError):
            pass
    try:
        return ParsedCall(value["name"], json.dumps(args, ensure_ascii=False))
    except (ValueError, RecursionError):
        return None


def _held_tail(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolCallStream:
    """Incremental parser for one choice: feed text pieces, get content and call events.

    ``feed`` returns ``[("content", str) | ("call", (k, ParsedCall)), ...]`` decided so far
    (``k``: the call's index in the choice); text that may still become part of a block (a
    partial ``<tool_call>``, an open block, leading whitespace while no other content was
    seen) is held back until decided. ``finish`` flushes what is held. The concatenated
    content events and the calls do not depend on how the text was cut into pieces.

    Args:
        parallel: False = only the first call is emitted (later well-formed blocks dropped).
    """

    parallel: bool = True
    calls: list[ParsedCall] = field(default_factory=list)
    dropped: int = 0  # well-formed calls dropped because parallel is False
    # Held text. Outside a block: a possible start of <tool_call> (shorter than the tag).
    # Inside one: the body so far as pieces (joined once, when the block closes, so a long
    # block costs linear time), and its last characters, where a </tool_call> cut by a piece
    # boundary starts.
    _buf: str = ""
    _in_block: bool = False
    _body: list[str] = field(default_factory=list)
    _tail: str = ""
    _spaces: list[str] = field(default_factory=list)  # whitespace-only content, none other yet
    _content_seen: bool = False

    def _content(self, text: str, out: list) -> None:
        if not text:
            return
        if not self._content_seen and not text.strip():
            self._spaces.append(text)
            return
        self._content_seen = True
        out.append(("content", "".join(self._spaces) + text))
        self._spaces.clear()

    def _close(self, body: str, out: list) -> None:
        call = parse_call(body)
        if call is None:
            self._content(OPEN + body + CLOSE, out)
        elif self.parallel or not self.calls:
            self.calls.append(call)
            out.append(("call", (len(self.calls) - 1, call)))
        else:
            self.dropped += 1

    def feed(self, text: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        while True:
            if not self._in_block:
                buf, self._buf = self._buf + text, ""
                at = buf.find(OPEN)
                if at < 0:
                    keep = _held_tail(buf, OPEN)
                    self._content(buf[:len(buf) - keep], out)
                    self._buf = buf[len(buf) - keep:]
                    return out
                self._content(buf[:at], out)
                text = buf[at + len(OPEN):]
                self._in_block, self._body, self._tail = True, [], ""
            else:
                window = self._tail + text
                end = window.find(CLOSE)
                if end < 0:
                    self._body.append(text)
                    self._tail = window[-(len(CLOSE) - 1):]
                    return out
                held = "".join(self._body)
                cut = len(held) - len(self._tail) + end  # the tail is the end of held
                body, text = (held + text)[:cut], window[end + len(CLOSE):]
                self._in_block, self._body, self._tail = False, [], ""
                self._close(body, out)

    def finish(self) -> list[tuple[str, object]]:
        """Flush held text as content (an open block with its opening tag)."""
        out: list[tuple[str, object]] = []
        rest = OPEN + "".join(self._body) if self._in_block else self._buf
        self._buf, self._in_block, self._body, self._tail = "", False, [], ""
        self._content(rest, out)
        if not self.calls and self._spaces:  # no call: whitespace-only content is kept as is
            out.append(("content", "".join(self._spaces)))
            self._spaces.clear()
        return out


@dataclass(frozen=True)
class ParsedReply:
    """A whole reply: its content (None: only calls and whitespace) and its calls."""

    content: str | None
    calls: list[ParsedCall]
    dropped: int = 0


def parse_reply(text: str, parallel: bool = True) -> ParsedReply:
    """Parse a whole reply (the stream parser fed once, so streaming gives the same)."""
    stream = ToolCallStream(parallel=parallel)
    events = stream.feed(text) + stream.finish()
    content = "".join(str(v) for k, v in events if k == "content")
    if not stream.calls:
        return ParsedReply(text, [])
    return ParsedReply(content or None, list(stream.calls), stream.dropped)


@dataclass(frozen=True)
class ToolCallOptions:
    """How a chat request's replies are read for tool calls.

    Attributes:
        parallel: ``parallel_tool_calls``.
        prefix: the forced start of every choice's text ("" unless a call is forced).
        hermes_template: the model's template renders tool calls itself (Hermes / Qwen2.5
            style) rather than through radixkv's fallback rendering.
    """

    parallel: bool = True
    prefix: str = ""
    hermes_template: bool = False


def forced_prefix(tool_choice: str, function: str | None, hermes_template: bool) -> str:
    """The text a forced call starts with: ``<tool_call>`` for "required", up to the
    ``"arguments": `` of the named function for "function", "" otherwise.

    The spacing is the one each format asks for: the fallback rendering's instruction line
    (``<tool_call>{"name": ..., "arguments": ...}``), or Hermes / Qwen2.5 templates' (a newline
    after ``<tool_call>``)."""
    start = OPEN + ("\n" if hermes_template else "")
    if tool_choice == "required":
        return start
    if tool_choice == "function" and function:
        return start + '{"name": ' + json.dumps(function, ensure_ascii=False) + ', "arguments": '
    return ""


def options_for(req: ChatRequest, chat_template: str | None) -> ToolCallOptions | None:
    """The parsing options of a chat request (a ``ChatRequest``: ``tools``, ``tool_choice``,
    ``tool_choice_function``, ``parallel_tool_calls``) for a model with ``chat_template``, or
    None when its replies are plain text (no tools, or ``tool_choice: "none"``)."""
    if not req.tools or req.tool_choice == "none":
        return None
    hermes = template_handles_tools(chat_template)
    return ToolCallOptions(parallel=req.parallel_tool_calls, hermes_template=hermes,
                           prefix=forced_prefix(req.tool_choice, req.tool_choice_function, hermes))


def memory_key(text: str, options: ToolCallOptions | None) -> str | None:
    """The assistant content that the message returned for ``text`` (a choice's whole text,
    forced prefix included) renders as when a client sends it back, or None when that cannot
    be matched to the generated ids.

    Without calls that is the text itself. With calls, for a tool-unaware template it is
    :func:`~radixkv.model.tool_render.render_tools_fallback`'s rendering of the message
    (content, then one ``<tool_call>`` line per call), which ``ChatTokenizer`` looks up as the
    message's content: the generated ids (the calls as the model wrote them and the text
    around them) then stand in for it. None for a template that renders calls itself (its
    rendering is not one content string) and for a reply whose extra calls were dropped
    (``parallel_tool_calls: false``: the ids hold calls the client never saw).
    """
    if options is None:
        return text
    reply = parse_reply(text, options.parallel)
    if not reply.calls:
        return text
    if options.hermes_template or reply.dropped:
        return None
    message = {"role": "assistant", "content": reply.content or "",
               "tool_calls": [call.openai("") for call in reply.calls]}
    return render_tools_fallback([message], None)[0]["content"]
