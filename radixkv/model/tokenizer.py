"""Chat tokenizer: a thin, validated layer over a Hugging Face tokenizer and its chat template."""

from __future__ import annotations

import copy
import functools
import json
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import structlog

from radixkv.model.tool_render import (
    fallback_num_bytes,
    render_tools_fallback,
    template_handles_tools,
)

__all__ = ["ChatTokenizer"]

log = structlog.get_logger(__name__)

# Markers that locate spliced assistant contents in a rendered chat (Unicode private use area;
# a chat whose text already holds one is tokenized plainly instead).
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARKER = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")
# Roles whose content chat templates render in full (assistant turns may be trimmed, e.g. of
# their reasoning; a template may not know 'developer'), so their bytes count towards a
# prompt's lower bound on tokens.
_BOUND_ROLES = frozenset({"system", "user", "tool"})
# Normalizers and how much they can shrink UTF-8 text (bytes out >= bytes in / factor). NFC and
# the compatibility forms turn up to 3 bytes into 1 (fullwidth 'A' -> 'A', jamo -> syllable);
# so does lower-casing (KELVIN SIGN -> 'k'). Any other normalizer disables the bound.
_SHRINK = {"Prepend": 1, "NFD": 3, "NFC": 3, "NFKD": 3, "NFKC": 3, "Lowercase": 3, "Strip": 1}


def _normalise_content(index: int, content: Any) -> Any:
    """Content the template can render: None -> "", OpenAI text parts -> one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise ValueError(f"messages[{index}].content: only text parts are supported")
        return "\n".join(texts)
    raise ValueError(f"messages[{index}].content: must be a string, a list of text parts or null")


class ChatTokenizer:
    """Token ids for chats and text, and text for token ids.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        max_model_len: the model's context length, tokens.
        extra_eos_token_ids: more ids that end generation (e.g. from generation_config.json).

    Attributes:
        eos_token_ids: ids that end generation (tokenizer EOS plus the extra ones).
        max_model_len: context length, tokens.
        hf_tokenizer: the wrapped transformers tokenizer.
    """

    def __init__(self, tokenizer: Any, *, max_model_len: int,
                 extra_eos_token_ids: Iterable[int] = ()) -> None:
        self.hf_tokenizer = tokenizer
        self.max_model_len = int(max_model_len)
        eos = set(int(i) for i in extra_eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        if not eos:
            raise ValueError("tokenizer: no EOS token id known (tokenizer or generation_config)")
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        # HF fast tokenizers are not safe to call from several threads at once.
        self._lock = threading.Lock()

    def clone(self) -> ChatTokenizer:
        """An independent copy (its own HF tokenizer and lock) for another worker thread, so
        that threads tokenize in parallel instead of queueing on one lock (~0.2 s for SmolLM2's
        tokenizer)."""
        other = copy.copy(self)
        with self._lock:  # the engine thread may be decoding with this one right now
            other.hf_tokenizer = copy.deepcopy(self.hf_tokenizer)
        other._lock = threading.Lock()
        return other

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """Most UTF-8 bytes of text one token can stand for (computed once, ~0.1 s).

        The maximum over the vocabulary of each token's decoded text, special tokens included
        (a partial UTF-8 sequence decodes to U+FFFD, 3 bytes, never fewer than it covers).
        Unless the decoder is byte-level, the raw vocabulary string counts too: a decoder may
        drop what a token covers (Metaspace drops a leading '\u2581', i.e. a space).
        """
        hf = self.hf_tokenizer
        ids = [[i] for i in range(len(hf))]
        backend = getattr(hf, "_tokenizer", None)
        if backend is not None and hasattr(backend, "decode_batch"):
            texts = backend.decode_batch(ids, skip_special_tokens=False)
        else:
            texts = [hf.decode(i, skip_special_tokens=False) for i in ids]
        longest = max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=1)
        if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
            raw = hf.convert_ids_to_tokens(list(range(len(hf))))
            longest = max([longest, *(len(t.encode("utf-8", "surrogatepass")) for t in raw if t)])
        return max(1, longest)

    @functools.cached_property
    def _shrink_factor(self) -> int | None:
        """How many times the tokenizer's normalizer can shrink text (None: unknown)."""
        backend = getattr(self.hf_tokenizer, "_tokenizer", None)
        if backend is None:
            return None
        normalizer = json.loads(backend.to_str()).get("normalizer")
        parts = [] if normalizer is None else (normalizer.get("normalizers")
                                              if normalizer.get("type") == "Sequence"
                                              else [normalizer])
        factor = 1
        for part in parts:
            kind = part.get("type")
            if kind == "Replace":  # safe when the replacement is no shorter (' ' -> '\u2581')
                pattern = part.get("pattern", {}).get("String")
                if pattern is None or len(part.get("content", "").encode()) < len(pattern.encode()):
                    return None
            elif kind in _SHRINK:
                factor *= _SHRINK[kind]
            else:
                return None
        return factor

    def min_tokens(self, texts: Iterable[str]) -> int:
        """A lower bound on the tokens of a prompt holding ``texts``, without tokenizing.

        One token stands for at most ``longest_token_bytes`` bytes of (normalized) text, so
        ``bytes / longest_token_bytes`` tokens are needed at least; 0 when the tokenizer's
        normalizer could shrink text by an unknown amount. O(bytes), no tokenizer call.
        """
        size = sum(len(t.strip().encode("utf-8", "surrogatepass")) for t in texts)
        return self._min_tokens_for_bytes(size)

    def _min_tokens_for_bytes(self, size: int) -> int:
        factor = self._shrink_factor
        if factor is None:
            return 0
        return size // (self.longest_token_bytes * factor)

    def min_chat_tokens(self, messages: Any, tools: list[dict] | None = None) -> int:
        """``min_tokens`` over the chat contents every template renders in full (system, user
        and tool turns; strings and text parts) plus, for a template that gets tools and tool
        calls as text (``render_tools_fallback``), the tool schemas and the assistants' tool
        calls as that rendering writes them; 0 for malformed messages (the template reports
        those)."""
        if not isinstance(messages, list):
            return 0
        texts, extra_bytes = [], 0
        if (tools or any(isinstance(m, dict) and m.get("tool_calls") for m in messages)) \
                and not template_handles_tools(self.hf_tokenizer.chat_template):
            extra_bytes = fallback_num_bytes(messages, tools)
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in _BOUND_ROLES:
                continue
            content = message.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts += [p["text"] for p in content
                          if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return self._min_tokens_for_bytes(
            extra_bytes + sum(len(t.strip().encode("utf-8", "surrogatepass")) for t in texts))

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer can produce (base vocab + added tokens)."""
        return len(self.hf_tokenizer)

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template text, or None if the tokenizer has none."""
        return self.hf_tokenizer.chat_template

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True,
                            known_outputs: Callable[[str], list[int] | None] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Render chat messages with the model's template and tokenize them.

        ``content: None`` renders as empty text (assistant turns that only carry tool calls have
        it). Tools and ``tool_calls`` go to the template when it handles them; for a template
        that ignores them (e.g. SmolLM2's plain ChatML) they are rendered as text by
        :func:`radixkv.model.tool_render.render_tools_fallback`, never dropped.

        Args:
            messages: OpenAI-style ``{"role", "content", ...}`` dicts.
            tools: OpenAI tool schemas, or None.
            add_generation_prompt: append the assistant turn header.
            known_outputs: ``text → ids | None`` for the model's own recent replies
                (``OutputMemory.lookup_in``). An assistant message whose rendered content is
                known keeps those ids instead of being re-tokenized (see
                :meth:`_tokenize_spliced`), so a reply sent back verbatim extends the earlier
                prompt + generated ids exactly. None: plain tokenization.
            template_kwargs: extra variables for the Jinja template (a request's
                ``chat_template_kwargs``, e.g. ``enable_thinking``); the caller keeps out the
                names the templating binds itself (messages, tools, add_generation_prompt, ...).

        Returns:
            Token ids of the rendered prompt (special tokens as the template writes them).

        Raises:
            ValueError: if ``messages`` is malformed, the tokenizer has no template or the
                template fails to render (the message names the problem).
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list")
        if self.hf_tokenizer.chat_template is None:
            raise ValueError("messages: the model's tokenizer has no chat template")
        normalised = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}]: must be an object with a string 'role'")
            message = dict(message)
            message["content"] = _normalise_content(i, message.get("content"))
            normalised.append(message)
        extra = dict(template_kwargs or {})
        if not template_handles_tools(self.hf_tokenizer.chat_template):
            normalised = render_tools_fallback(normalised, tools)
            tools = None
        if known_outputs is not None:
            spliced = {i: ids for i, m in enumerate(normalised)
                       if m["role"] == "assistant" and isinstance(m.get("content"), str)
                       and m["content"] and (ids := known_outputs(m["content"])) is not None}
            if spliced:
                out = self._tokenize_spliced(normalised, tools, add_generation_prompt, spliced,
                                             extra)
                if out is not None:
                    return out
        try:
            with self._lock:
                ids = self.hf_tokenizer.apply_chat_template(
                    normalised, tools=tools, add_generation_prompt=add_generation_prompt,
                    tokenize=True, return_dict=False, **extra)
        except Exception as exc:  # jinja2 errors (TemplateError, UndefinedError, ...) and friends
            raise ValueError(f"messages: chat template failed: {type(exc).__name__}: {exc}") from exc
        return [int(i) for i in ids]

    def _render(self, messages: list[dict], tools: list[dict] | None,
                add_generation_prompt: bool, extra: dict[str, Any]) -> str:
        try:
            with self._lock:
                return self.hf_tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=add_generation_prompt,
                    tokenize=False, **extra)
        except Exception as exc:  # jinja2 errors, as in apply_chat_template
            raise ValueError(f"messages: chat template failed: {type(exc).__name__}: {exc}") from exc

    def _tokenize_spliced(self, messages: list[dict], tools: list[dict] | None,
                          add_generation_prompt: bool, spliced: dict[int, list[int]],
                          extra: dict[str, Any]) -> list[int] | None:
        """Tokenize the rendered chat with the contents of ``spliced`` messages replaced by ids.

        The chat is rendered twice: as is, and with each spliced content replaced by a marker
        (private-use characters). The markers locate the contents in the rendered text; the
        text between them is tokenized piece by piece and the remembered ids go in between.
        Cutting the text right before a spliced content is what makes it token-exact: the
        earlier prompt ended with this same assistant header, tokenized on its own, and the
        model generated the content's ids after it. Text without a spliced content around it
        is tokenized exactly as plain rendering would (the pieces end at the markers only).

        Args:
            messages: rendered-ready messages (string contents, tool fallback applied).
            tools: tool schemas for templates that handle them, else None.
            add_generation_prompt: as in :meth:`apply_chat_template`.
            spliced: message index → ids of its content.
            extra: template variables (``template_kwargs``), possibly empty.

        Returns:
            The token ids, or None when the template does not place those contents verbatim
            (it trims or rewrites them, or the text already holds a marker character): the
            caller then tokenizes the plain rendering.
        """
        text = self._render(messages, tools, add_generation_prompt, extra)
        if _MARK_OPEN in text or _MARK_CLOSE in text:
            return None
        marked = [dict(m, content=f"{_MARK_OPEN}{i}{_MARK_CLOSE}") if i in spliced else m
                  for i, m in enumerate(messages)]
        parts = _MARKER.split(self._render(marked, tools, add_generation_prompt, extra))
        # parts = [text, index, text, index, ..., text]; each spliced message exactly once.
        order = [int(x) for x in parts[1::2]]
        if sorted(order) != sorted(spliced) or len(set(order)) != len(order):
            return None
        pieces = parts[0::2]
        rebuilt = pieces[0] + "".join(messages[i]["content"] + piece
                                      for i, piece in zip(order, pieces[1:]))
        if rebuilt != text:
            return None
        ids = self.encode(pieces[0]) if pieces[0] else []
        for i, piece in zip(order, pieces[1:]):
            ids += spliced[i]
            if piece:
                ids += self.encode(piece)
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added (no BOS/EOS)."""
        if not isinstance(text, str):
            raise ValueError(f"text: must be a string, got {type(text).__name__}")
        with self._lock:
            return list(self.hf_tokenizer.encode(text, add_special_tokens=False))

    @functools.cached_property
    def prompt_prefix_ids(self) -> tuple[int, ...]:
        """Ids the tokenizer puts in front of a text with its special tokens on
        (transformers' ``add_special_tokens=True``): Gemma's ``<bos>`` (2), Llama 3's
        ``<|begin_of_text|>``; empty for SmolLM2, whose tokenizer adds none. Read once from the
        tokenizer itself (the leading ids a probe gains over its plain encoding); ids it would
        add at the end (an EOS) are not used: a prompt is continued, not closed."""
        with self._lock:
            plain = list(self.hf_tokenizer.encode("a", add_special_tokens=False))
            full = list(self.hf_tokenizer.encode("a", add_special_tokens=True))
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return tuple(int(i) for i in full[:start])
        return ()

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt: ``prompt_prefix_ids`` (the BOS, where the tokenizer has
        one) then ``encode(text)``; ``add_special_tokens=False`` is ``encode(text)``. A text
        that itself starts with the BOS's text gets it twice, as transformers and vLLM do.

        Raises:
            ValueError: ``text`` is not a string.
        """
        ids = self.encode(text)
        return [*self.prompt_prefix_ids, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; special tokens dropped unless ``skip_special_tokens`` is False."""
        with self._lock:
            return self.hf_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
