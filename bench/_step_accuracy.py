"""``radixkv bench step --accuracy``: what a reduced dtype (``--dtype bfloat16``) costs against fp32.

On a real agent prompt (the first request of the tau-bench sample shipped in the package,
rendered with the model's chat template), both models prefill the whole prompt and then
decode greedily. Reported:

* ``top1_agreement``: fraction of prompt positions whose argmax next token is the same;
* ``max_abs_logit_diff`` / ``mean_abs_logit_diff`` over every prompt position and vocab entry;
* ``mean_kl``: mean over positions of KL(fp32 ‖ other) of the next-token distributions, nats;
* ``greedy_same_tokens``: how many of ``greedy_tokens`` greedily decoded tokens are identical
  before the first difference (the first token comes from the prompt's last logits).
"""

import torch

from radixkv.model.loader import LoadedModel
from radixkv.model.runner import ModelRunner


def _prompt_ids(model: LoadedModel, max_tokens: int) -> list[int]:
    from radixkv.tools.transcripts import load_source

    sessions = load_source("tau-bench")
    request = sessions[0][-1]
    ids = model.tokenizer.apply_chat_template(request["messages"], tools=request.get("tools"))
    return list(ids)[:max_tokens]


def _run(model: LoadedModel, ids: list[int], greedy_tokens: int, block_size: int):
    """``([len(ids), vocab]`` fp32 prompt logits, greedy continuation ids)."""
    total = len(ids) + greedy_tokens
    num_blocks = -(-total // block_size)
    table = list(range(num_blocks))
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size)
    logits = runner.forward(runner.build_batch([(ids, 0, table)]), all_logits=True).float()
    out = [int(logits[-1].argmax())]
    for pos in range(len(ids), total - 1):
        step = runner.forward(runner.build_batch([([out[-1]], pos, table)]))
        out.append(int(step[0].argmax()))
    return logits, out


def dtype_accuracy(reference: LoadedModel, other: LoadedModel, *, max_prompt_tokens: int = 2048,
                   greedy_tokens: int = 64, block_size: int = 16) -> dict:
    """Compare ``other`` (e.g. bf16) with ``reference`` (fp32) on one real prompt; see the
    module docstring for the fields."""
    ids = _prompt_ids(reference, max_prompt_tokens)
    ref_logits, ref_out = _run(reference, ids, greedy_tokens, block_size)
    got_logits, got_out = _run(other, ids, greedy_tokens, block_size)
    diff = (ref_logits - got_logits).abs()
    ref_logp = torch.log_softmax(ref_logits, -1)
    got_logp = torch.log_softmax(got_logits, -1)
    kl = (ref_logp.exp() * (ref_logp - got_logp)).sum(-1)
    same = next((i for i, (a, b) in enumerate(zip(ref_out, got_out)) if a != b), len(ref_out))
    return {"dtype": str(other.dtype).removeprefix("torch."), "prompt_tokens": len(ids),
            "top1_agreement": float((ref_logits.argmax(-1) == got_logits.argmax(-1)).float().mean()),
            "max_abs_logit_diff": float(diff.max()), "mean_abs_logit_diff": float(diff.mean()),
            "mean_kl": float(kl.mean()), "greedy_tokens": greedy_tokens, "greedy_same_tokens": same}
