"""``radixkv verify``: run prompts through every KV cache path of a model and find where they part.

For a model and settings, each prompt runs as

- ``recompute`` (a): no KV cache at all. Every step is a fresh forward of the whole sequence so
  far (reference attention over the step's own K/V); its greedy choices are the reference
  continuation;
- ``contiguous`` (b): a contiguous per-sequence cache (one ``[S, Hkv, D]`` tensor per layer,
  reference attention reading the prefix back from it), prefill then one token per step;
- ``paged`` (c): the paged pool of the configured attention backend (``ModelRunner``: prefill,
  then decode steps), with a block table that is not the identity;
- ``prefix-hit`` / ``prefix-hit+1`` (d): the same pool entered through a prefix hit: an earlier
  request prefills the first ``h`` tokens (``h`` a block boundary near the prompt's middle, or
  one token past it), the prompt's request reuses its full blocks (and a copy of the partial
  one, as copy-on-write does) and computes the rest as a suffix;
- ``kv-int8`` / ``kv-fp8_e4m3`` (e): the paged pool at each quantized ``--kv-cache-dtype``
  (plus ``kv-int8+prefix-hit``, entered through a prefix hit at the block boundary);
- ``model-<dtype>`` (``--compare-dtype``): the model at another weight dtype, paged.

Teacher-forced: every variant is fed the same tokens, the prompt plus the reference greedy
continuation of ``--max-new-tokens`` tokens, so the logits compare position by position (every
prompt position and every generated step). Each pair reports the first generation step where the
chosen (argmax) token differs, the first layer whose K or V (read back from the cache,
dequantized) differs beyond tolerance, top-1 agreement, max |Δlogit|, mean KL(baseline ‖ variant)
in nats over all teacher-forced positions, and the greedy continuation agreement (the variant's
own greedy continuation follows the baseline's until its first differing choice).

Pairs (b)-(d) against (a), at the model dtype, must be exact: every chosen token the same and
max |Δlogit| within the dtype's stated tolerance (:data:`LOGIT_ATOL`). A position whose two
candidate tokens the baseline itself scores within that tolerance of each other is a tie: it is
counted and shown, not failed (a last-bit difference may pick either). The other pairs are
reported, not gated. ``main`` returns 0 when every exact pair holds, 1 when one does not, 2 for
a usage error (bad flag value, model path, prompt file).

Building the parser imports no torch (``radixkv --help`` stays fast); :func:`main` imports what
it runs.

Modules: :mod:`.flags` (the parser's flags, no torch), :mod:`.prompts`, :mod:`.variants` (the
cache paths a-e), :mod:`.compare` (metrics and tolerances), :mod:`.report` (the table),
:mod:`.cli` (:func:`run`, :func:`main`).
"""

from radixkv.tools.verify.cli import main, run
from radixkv.tools.verify.compare import KV_ATOL, KV_RTOL, LOGIT_ATOL, Pair, Tolerances, compare, compare_kv
from radixkv.tools.verify.flags import QUANTIZED_KV_DTYPES, SOURCES, VerifyError, add_arguments, kv_dtypes_arg
from radixkv.tools.verify.prompts import Prompt, read_prompt_file, tokenize_prompts, transcript_prompts
from radixkv.tools.verify.report import render_table
from radixkv.tools.verify.variants import (
    StepHook,
    Trace,
    hit_points,
    run_contiguous,
    run_paged,
    run_recompute,
    runner_blocks_needed,
)

__all__ = ["KV_ATOL", "KV_RTOL", "LOGIT_ATOL", "QUANTIZED_KV_DTYPES", "SOURCES", "Pair", "Prompt",
           "StepHook", "Tolerances", "Trace", "VerifyError", "add_arguments", "compare", "compare_kv",
           "hit_points", "kv_dtypes_arg", "main", "read_prompt_file", "render_table", "run",
           "run_contiguous", "run_paged", "run_recompute", "runner_blocks_needed", "tokenize_prompts",
           "transcript_prompts"]
