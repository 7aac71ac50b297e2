"""OutputMemory bounds and scopes, ids_for_text, and the tokenizer's splice of remembered ids."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from radixkv.model.loader import LoadedModel, embedded_tokenizer_dir
from radixkv.model.tokenizer import ChatTokenizer
from radixkv.server.output_memory import OutputMemory, ids_for_text

IM_START, IM_END = 1, 2


@pytest.fixture(scope="module")
def tok(tiny_model: LoadedModel) -> ChatTokenizer:
    return tiny_model.tokenizer  # SmolLM2's tokenizer and ChatML template


def test_memory_scopes_replace_and_lru_bounds():
    mem = OutputMemory(max_entries=3, max_tokens=10)
    mem.record("a", "x", [1, 2])
    mem.record("b", "x", [3])
    assert mem.lookup("a", "x") == [1, 2] and mem.lookup("b", "x") == [3]
    assert mem.lookup("c", "x") is None and mem.lookup("a", "y") is None
    mem.record("a", "x", [4, 5, 6])  # replaced, now most recent
    assert (len(mem), mem.num_tokens, mem.lookup("a", "x")) == (2, 4, [4, 5, 6])
    mem.record("a", "y", [7])
    mem.lookup("b", "x")  # touch: ("a", "x") is now the least recently used
    mem.record("a", "z", [8])  # 4 entries > 3: evicts ("a", "x")
    assert mem.lookup("a", "x") is None and len(mem) == 3 and mem.num_tokens == 3
    mem.record("a", "w", list(range(9)))  # 12 tokens > 10: evicts the two oldest
    assert [mem.lookup("a", t) is not None for t in ("y", "z", "w")] == [False, True, True]
    assert mem.lookup("b", "x") is None and mem.num_tokens == 10
    mem.record("a", "long", list(range(11)))  # longer than the whole budget: ignored
    mem.record("a", "", [1])  # empty text: ignored
    assert mem.lookup("a", "long") is None and mem.lookup("a", "") is None and len(mem) == 2
    for bad in ({"max_entries": 0}, {"max_tokens": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            OutputMemory(**bad)


def test_ids_for_text_keeps_sampled_ids(tok):
    sampled = [46719, 420, 743, 317, 319, 40113]  # "Je ne" + " sa" "ra" "ce" + " pas"
    text = tok.decode(sampled)
    assert text == "Je ne sarace pas" and tok.encode(text) != sampled  # non-canonical
    assert ids_for_text(tok, sampled + [IM_END], text, {IM_END}) == sampled
    # A stop string cut the text inside "ra": the sampled ids up to " sa", then "r" encoded.
    assert ids_for_text(tok, sampled, "Je ne sar", {IM_END}) == sampled[:3] + tok.encode("r")
    # A special token the text does not show (decoded with skip_special_tokens) ends the
    # kept prefix: the ids must decode to the text with special tokens kept.
    out = ids_for_text(tok, sampled[:3] + [IM_START] + sampled[3:], text, {IM_END})
    assert out == sampled[:3] + tok.encode("race pas")
    assert tok.decode(out, skip_special_tokens=False) == text


def test_ids_for_text_with_a_cut_character(tok):
    ids = tok.encode("ok 🍎")
    pieces = [tok.decode(ids[:j]) for j in range(len(ids) + 1)]
    partial = next(j for j, p in enumerate(pieces) if p.endswith("\ufffd"))
    text = pieces[partial]  # what the client got when max_tokens cut the emoji
    out = ids_for_text(tok, ids[:partial], text)
    assert tok.decode(out, skip_special_tokens=False) == text
    assert out[:partial - 1] == ids[:partial - 1]  # up to the cut character: as sampled


def test_splice_is_token_exact_where_plain_tokenization_merges(tok):
    first = [{"role": "user", "content": "hi"}]
    reply = "\n\nHello"
    sampled = tok.encode("\n") + tok.encode("\nHello")  # as generated after "assistant\n"
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "x"}]
    prompt = tok.apply_chat_template(first)
    known = {reply: sampled}.get
    spliced = tok.apply_chat_template(second, known_outputs=known)
    assert spliced == (prompt + sampled + [IM_END] + tok.encode("\n") + [IM_START]
                       + tok.encode("user\nx") + [IM_END] + tok.encode("\n") + [IM_START]
                       + tok.encode("assistant\n"))
    plain = tok.apply_chat_template(second)
    assert plain[:len(prompt)] != prompt  # "\n" of the header merged with the reply's "\n\n"
    # Unknown replies and other roles tokenize plainly.
    assert tok.apply_chat_template(second, known_outputs=lambda text: None) == plain
    as_user = [{"role": "user", "content": reply}]
    assert tok.apply_chat_template(as_user, known_outputs=known) == tok.apply_chat_template(as_user)


def test_splice_falls_back_when_the_template_rewrites_content(tok):
    hf = AutoTokenizer.from_pretrained(embedded_tokenizer_dir())
    hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
                        "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    trimming = ChatTokenizer(hf, max_model_len=8192)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " yes "},
            {"role": "user", "content": "ok"}]
    plain = trimming.apply_chat_template(chat)
    assert trimming.apply_chat_template(chat, known_outputs={" yes ": [9, 9]}.get) == plain
    # A chat that already holds a marker character is tokenized plainly too.
    marked = [{"role": "user", "content": "\ue000"}, *chat[1:]]
    assert (tok.apply_chat_template(marked, known_outputs={" yes ": [9, 9]}.get)
            == tok.apply_chat_template(marked))


def test_splice_applies_to_tool_calls_rendered_by_the_fallback(tok):
    # A client that parsed the model's "<tool_call>..." text into tool_calls sends it back as
    # such; the fallback renders it to the same text, so the remembered ids still apply.
    text = '<tool_call>{"arguments":{},"name":"f"}</tool_call>'
    sampled = tok.encode('<tool_call>{"arguments":{},') + tok.encode('"name":"f"}</tool_call>')
    assert sampled != tok.encode(text)
    first = [{"role": "user", "content": "call f"}]
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    second = first + [call, {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    spliced = tok.apply_chat_template(second, known_outputs={text: sampled}.get)
    prompt = tok.apply_chat_template(first)
    assert spliced[:len(prompt) + len(sampled) + 1] == prompt + sampled + [IM_END]


def test_template_kwargs_reach_the_template_on_both_paths():
    """``chat_template_kwargs`` become template variables, in plain and spliced tokenization."""
    hf = AutoTokenizer.from_pretrained(embedded_tokenizer_dir())
    hf.chat_template = ("{% if greeting is defined %}{{ greeting }}\n{% endif %}"
                        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                        "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    tok = ChatTokenizer(hf, max_model_len=8192)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"},
            {"role": "user", "content": "ok"}]
    plain = tok.apply_chat_template(chat)
    greeted = tok.apply_chat_template(chat, template_kwargs={"greeting": "Ahoy"})
    assert greeted == tok.encode("Ahoy\n") + plain
    assert tok.apply_chat_template(chat, template_kwargs={}) == plain
    reply_ids = tok.encode("y") + tok.encode("es")  # not the canonical ids of "yes"
    assert reply_ids != tok.encode("yes")
    spliced = tok.apply_chat_template(chat, known_outputs={"yes": reply_ids}.get,
                                      template_kwargs={"greeting": "Ahoy"})
    start = greeted.index(tok.encode("yes")[0])
    assert spliced == greeted[:start] + reply_ids + greeted[start + len(tok.encode("yes")):]
