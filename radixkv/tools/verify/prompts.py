"""``radixkv verify``'s prompts: a ``--prompt-file`` read and checked before the model loads, or
turns of a shipped agent transcript; each tokenized with the model's chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixkv.tools.verify.flags import VerifyError

if TYPE_CHECKING:
    from radixkv.model.tokenizer import ChatTokenizer


@dataclass
class Prompt:
    """One prompt to verify: where it came from and its token ids."""

    label: str
    token_ids: list[int]


def _check_record(record: Any, where: str) -> None:
    """A ``--prompt-file`` JSONL record's shape, checked before the model loads."""
    if isinstance(record, str):
        return
    if not isinstance(record, dict):
        raise VerifyError(f"--prompt-file: {where}: expected an object with messages, prompt or "
                          f"prompt_token_ids, got {type(record).__name__}")
    if "prompt_token_ids" in record:
        ids = record["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise VerifyError(f"--prompt-file: {where}: prompt_token_ids must be a list of ints")
    elif "messages" in record:
        if not isinstance(record["messages"], list) or not record["messages"]:
            raise VerifyError(f"--prompt-file: {where}: messages must be a non-empty list")
    elif not isinstance(record.get("prompt"), str):
        raise VerifyError(f"--prompt-file: {where}: expected a key messages, prompt (a string) or "
                          f"prompt_token_ids")


def read_prompt_file(path: str) -> list[tuple[str, Any]]:
    """The prompts of ``--prompt-file`` (see its help) as ``(label, record)`` in file order,
    read and checked before the model loads: a record is a JSONL line's value, or the whole
    text of a non-JSONL file.

    Raises:
        VerifyError: naming ``--prompt-file`` when it cannot be read, holds no prompt, or a line
            is not JSON or not a prompt.
    """
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise VerifyError(f"--prompt-file: cannot read {file}: {exc}") from exc
    records: list[tuple[str, Any]] = []
    if file.suffix in (".jsonl", ".ndjson"):
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{file} line {number}"
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise VerifyError(f"--prompt-file: {where}: not JSON: {exc}") from exc
            _check_record(record, where)
            records.append((f"{file.name}:{number}", record))
    elif text.strip():
        records.append((file.name, text))
    if not records:
        raise VerifyError(f"--prompt-file: {file} holds no prompt")
    return records


def tokenize_prompts(records: Sequence[tuple[str, Any]], tokenizer: ChatTokenizer) -> list[Prompt]:
    """Token ids of :func:`read_prompt_file`'s records: text encoded as ``/v1/completions``
    encodes it by default (behind the tokenizer's BOS, where it has one:
    ``ChatTokenizer.encode_prompt``), messages rendered with the model's chat template
    (generation prompt appended), token ids checked against the vocabulary.

    Raises:
        VerifyError: naming ``--prompt-file`` for a prompt with no tokens, an id outside the
            vocabulary or messages the template cannot render.
    """
    prompts: list[Prompt] = []
    for label, record in records:
        if isinstance(record, str):
            ids = tokenizer.encode_prompt(record)
        elif "prompt_token_ids" in record:
            ids = list(record["prompt_token_ids"])
            bad = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
            if bad:
                raise VerifyError(f"--prompt-file: {label}: token id {bad[0]} outside the "
                                  f"vocabulary [0, {tokenizer.vocab_size})")
        elif "messages" in record:
            try:
                ids = tokenizer.apply_chat_template(record["messages"], tools=record.get("tools"))
            except ValueError as exc:
                raise VerifyError(f"--prompt-file: {label}: {exc}") from exc
        else:
            ids = tokenizer.encode_prompt(record["prompt"])
        if not ids:
            raise VerifyError(f"--prompt-file: {label}: the prompt has no tokens")
        prompts.append(Prompt(label, ids))
    return prompts


def transcript_prompts(source: str, *, shared: bool, tokenizer: ChatTokenizer, num_prompts: int,
                       min_tokens: int, max_tokens: int) -> list[Prompt]:
    """``num_prompts`` turns of a transcript source whose rendered prompts have
    ``min_tokens..max_tokens`` tokens, spread evenly over the source's requests (every k-th
    request first, then the ones after them), each rendered with the model's chat template.

    Raises:
        VerifyError: naming ``--shared`` when the shared data is missing, or
            ``--min-prompt-tokens`` when no turn fits the range.
    """
    from radixkv.tools.data import SharedDataMissing, require_shared
    from radixkv.tools.transcripts import SOURCE_PATHS, TRANSCRIPTS, load_source

    try:
        path = require_shared(TRANSCRIPTS / SOURCE_PATHS[source]) if shared else None
    except SharedDataMissing as exc:
        raise VerifyError(f"--shared: {exc}") from exc
    requests = [r for session in load_source(source, path) for r in session]
    stride = max(1, len(requests) // num_prompts)
    order = [i for offset in range(stride) for i in range(offset, len(requests), stride)]
    prompts: list[Prompt] = []
    for i in order:
        request = requests[i]
        try:
            ids = tokenizer.apply_chat_template(request["messages"], tools=request.get("tools"))
        except ValueError:
            continue  # a turn this template cannot render is not a prompt to verify
        if min_tokens <= len(ids) <= max_tokens:
            prompts.append(Prompt(f"{source} {request['session_id']} turn {request['turn']}", ids))
            if len(prompts) == num_prompts:
                break
    if not prompts:
        raise VerifyError(f"--min-prompt-tokens/--max-prompt-tokens: no {source} turn has "
                          f"{min_tokens}..{max_tokens} tokens")
    return prompts
