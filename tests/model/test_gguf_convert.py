"""GGUF conversion on a tiny written-here GGUF: bit-exact dequantization, header parsing, the
converted cache's reuse and invalidation, and the fast tokenizer path (no SmolLM2 needed)."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from radixkv.model import loader
from radixkv.model.gguf_loader import dequantize, read_gguf, read_gguf_header, unpermute_qk
from radixkv.model.loader import load_model

Q = gguf.GGMLQuantizationType
HIDDEN, NUM_HEADS, NUM_KV_HEADS, FFN = 64, 2, 1, 96  # head_dim 32: every row is one or more blocks
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# One tensor per path through dequantize(): F32, F16, the numpy fast paths and a gguf fallback.
TENSOR_TYPES = {"token_embd.weight": Q.Q8_0, "output_norm.weight": Q.F32, "blk.0.attn_norm.weight": Q.F32,
                "blk.0.attn_q.weight": Q.Q4_1, "blk.0.attn_k.weight": Q.Q4_0, "blk.0.attn_v.weight": Q.F16,
                "blk.0.attn_output.weight": Q.Q4_1, "blk.0.ffn_norm.weight": Q.F32,
                "blk.0.ffn_gate.weight": Q.Q4_1, "blk.0.ffn_up.weight": Q.Q5_0, "blk.0.ffn_down.weight": Q.Q8_0}


def _vocab() -> list[str]:
    # Byte-level BPE (like SmolLM2's "gpt2" tokenizer): specials, the 256 byte symbols, one merge.
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return SPECIALS + list(bytes_to_unicode().values()) + ["Ġt"]


def _float_tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    vocab = len(_vocab())
    shapes = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
              "blk.0.attn_k.weight": (HIDDEN // NUM_HEADS, HIDDEN), "blk.0.attn_v.weight": (HIDDEN // NUM_HEADS, HIDDEN),
              "blk.0.attn_output.weight": (HIDDEN, HIDDEN), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_tiny_gguf(path: Path, seed: int) -> None:
    """A 1-layer llama GGUF with a byte-level BPE tokenizer; ``seed`` picks the weights."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    vocab = _vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(vocab)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, values in _float_tensors(seed).items():
        qtype = TENSOR_TYPES[name]
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _reference_state(path: Path) -> dict[str, torch.Tensor]:
    """The converted state dict computed by gguf itself: GGUFReader + gguf.quants.dequantize."""
    reader = gguf.GGUFReader(str(path))
    state = {}
    for tensor in reader.tensors:
        weight = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                                           dtype=np.float32, copy=True))
        if tensor.name.endswith("attn_q.weight"):
            weight = unpermute_qk(weight, NUM_HEADS)
        elif tensor.name.endswith("attn_k.weight"):
            weight = unpermute_qk(weight, NUM_KV_HEADS)
        state[tensor.name] = weight.contiguous()
    return state


def _assert_bit_equal(ours: torch.Tensor, theirs: torch.Tensor, name: str) -> None:
    assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape, name
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), name


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0])
def test_dequantize_is_bit_identical_to_gguf(qtype) -> None:
    rng = np.random.default_rng(int(qtype))
    values = (rng.standard_normal((7, 96)) * 3).astype(np.float32)
    values[0, :32] = 0.0  # an all-zero block (scale 0)
    raw = np.ascontiguousarray(gguf.quants.quantize(values, qtype)).view(np.uint8)
    expected = np.array(gguf.quants.dequantize(raw.reshape(7, -1), qtype), dtype=np.float32)
    ours = dequantize(raw.reshape(-1).copy(), int(qtype), (7, 96))
    _assert_bit_equal(ours, torch.from_numpy(expected.reshape(7, 96)), qtype.name)


def test_header_matches_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, seed=0)
    header = read_gguf_header(path)
    reader = gguf.GGUFReader(str(path))
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors):
        assert ours.ggml_type == int(theirs.tensor_type)
        assert ours.offset_bytes == theirs.data_offset and ours.num_bytes == theirs.n_bytes
        assert ours.shape == tuple(int(d) for d in reversed(theirs.shape.tolist()))
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):  # the reader's own pseudo-fields (version, counts)
            assert header.metadata[key] == field.contents(), key
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match="^model: GGUF header is truncated or corrupt"):
        read_gguf_header(truncated)
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="^model: not a GGUF file"):
        read_gguf_header(not_gguf)


def test_conversion_is_cached_and_redone_when_the_file_changes(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path / "cache"))
    conversions: list[Path] = []
    convert = loader._convert_gguf

    def counting_convert(path: Path, target: Path) -> None:
        conversions.append(target)
        convert(path, target)

    monkeypatch.setattr(loader, "_convert_gguf", counting_convert)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, seed=1)
    first = load_model(path)
    assert len(conversions) == 1 and conversions[0].name == f"gguf-v1-{first.revision}"
    reference = read_gguf(path)[1]
    old_way = _reference_state(path)
    assert len(first.state_dict) == len(reference) == len(old_way) == 11  # tied: no output.weight
    for name, tensor in first.state_dict.items():
        _assert_bit_equal(tensor, reference[name], name)
    gguf_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
                  "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
                  "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
                  "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight"}
    for hf_name, gguf_name in gguf_names.items():
        _assert_bit_equal(first.state_dict[hf_name], old_way[gguf_name], hf_name)
    assert first.shape.num_q_heads == 2 and first.shape.num_kv_heads == 1 and first.shape.tie_word_embeddings
    assert first.tokenizer.eos_token_ids == frozenset({2})
    assert first.tokenizer.encode(" t") == [len(_vocab()) - 1]  # the one merge "Ġ t"

    second = load_model(path)
    assert len(conversions) == 1, "a second load must reuse the converted cache"
    assert second.revision == first.revision
    for name, tensor in first.state_dict.items():
        _assert_bit_equal(second.state_dict[name], tensor, name)

    # Same path, different bytes: re-hashed (a new revision) and converted again.
    stat = path.stat()
    write_tiny_gguf(path, seed=2)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a later mtime, even on coarse clocks
    third = load_model(path)
    assert len(conversions) == 2 and third.revision != first.revision
    assert conversions[1].name == f"gguf-v1-{third.revision}"
    for name, tensor in read_gguf(path)[1].items():
        _assert_bit_equal(third.state_dict[name], tensor, name)
    assert not torch.equal(third.state_dict["model.layers.0.mlp.up_proj.weight"],
                           first.state_dict["model.layers.0.mlp.up_proj.weight"])


def test_fast_tokenizer_path_saves_what_auto_tokenizer_saves(tmp_path: Path) -> None:
    if loader._tokenizers_backend() is None:
        pytest.skip("transformers < 5 always takes the AutoTokenizer path")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, seed=0)
    fast = loader._gguf_tokenizer(path, read_gguf_header(path).metadata)
    slow = loader._load_tokenizer(path.parent, gguf_file=path.name)
    fast.save_pretrained(str(tmp_path / "fast"))
    slow.save_pretrained(str(tmp_path / "slow"))
    names = sorted(p.name for p in (tmp_path / "slow").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "fast").iterdir())
    assert "tokenizer.json" in names
    for name in names:
        assert (tmp_path / "fast" / name).read_bytes() == (tmp_path / "slow" / name).read_bytes(), name
    reloaded = loader._load_cached_tokenizer(tmp_path / "fast")
    assert type(reloaded).__name__ == "TokenizersBackend"
    assert reloaded.encode("a tt") == slow.encode("a tt")
