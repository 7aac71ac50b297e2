"""Inputs and timed cases of ``bench/kernels.py`` (paged inputs, roofs, extend / decode / KV-write
cases, the launch-config sweep). Loaded by path like its caller: only torch and triton are needed.
"""

# No ``from __future__ import annotations``: the CLI loads bench/kernels.py (and so this) by path.
import sys
import time
from typing import Any, Callable

#: The private package name the kernels/ folder is loaded under (never a top-level ``kernels``).
_PKG = "_radixkv_bench_kernels"

# ----------------------------------------------------------------------------- inputs


def _paged_inputs(torch, seqs, block_size, heads, dtype, device, seed, poison):
    """Random paged batch: q/k/v of the suffixes, pools holding the prefixes, metadata.

    ``poison``: unused pool slots are NaN (checks) instead of random (timing, faster to build).
    Returns a dict; ``prefix_slots[i]`` (int64 ``[P]``) locates sequence i's prefix in the pools.
    """
    hq, hkv, d = heads["num_q_heads"], heads["num_kv_heads"], heads["head_dim"]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks = [-(-(p + ln) // block_size) for p, ln in seqs]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks)
    tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start:start + n].to(torch.int32)
        start += n
    tables = tables.to(device)
    shape = (num_blocks, block_size, hkv, d)
    if poison:
        k_pool = torch.full(shape, float("nan"), dtype=dtype, device=device)
        v_pool = torch.full(shape, float("nan"), dtype=dtype, device=device)
    else:
        k_pool = torch.randn(shape, dtype=dtype, device=device)
        v_pool = torch.randn(shape, dtype=dtype, device=device)
    prefix_slots = []
    for i, (p, _) in enumerate(seqs):
        pos = torch.arange(p, device=device)
        slots = tables[i].long()[pos // block_size] * block_size + pos % block_size
        if poison:
            k_pool.view(-1, hkv, d)[slots] = torch.randn(p, hkv, d, dtype=dtype, device=device)
            v_pool.view(-1, hkv, d)[slots] = torch.randn(p, hkv, d, dtype=dtype, device=device)
        prefix_slots.append(slots)
    num_tokens = sum(ln for _, ln in seqs)
    indptr = [0]
    for _, ln in seqs:
        indptr.append(indptr[-1] + ln)
    return {
        "q": torch.randn(num_tokens, hq, d, dtype=dtype, device=device),
        "k": torch.randn(num_tokens, hkv, d, dtype=dtype, device=device),
        "v": torch.randn(num_tokens, hkv, d, dtype=dtype, device=device),
        "k_pool": k_pool, "v_pool": v_pool, "block_tables": tables,
        "prefix_lens": torch.tensor([p for p, _ in seqs], dtype=torch.int32, device=device),
        "qo_indptr": torch.tensor(indptr, dtype=torch.int32, device=device),
        "max_q_len": max(ln for _, ln in seqs), "prefix_slots": prefix_slots, "indptr": indptr,
    }


def _extend_args(x):
    return (x["q"], x["k"], x["v"], x["k_pool"], x["v_pool"], x["block_tables"], x["prefix_lens"],
            x["qo_indptr"])


def _max_err(torch, got, want) -> float:
    return float((got.float() - want.float()).abs().max()) if got.numel() else 0.0



# ----------------------------------------------------------------------------- timing


def _make_timer(torch, smoke: bool) -> Callable[[Callable[[], Any]], float]:
    if smoke:
        def timer(fn):  # one warm call, one timed call: exercises the path, not a measurement
            fn()
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return timer
    import triton.testing

    def timer(fn):
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    return timer


def run_roofs(torch, device, dtype, timer, smoke: bool) -> dict:
    roofs = {}
    try:
        n = 256 if smoke else 8192
        a = torch.randn(n, n, dtype=torch.bfloat16 if not smoke else torch.float32, device=device)
        b = torch.randn(n, n, dtype=a.dtype, device=device)
        ms = timer(lambda a=a, b=b: a @ b)
        roofs["matmul"] = {"shape": [n, n, n], "dtype": str(a.dtype)[6:], "ms": ms,
                           "tflops": 2 * n ** 3 / ms / 1e9}
        del a, b
    except Exception as exc:  # noqa: BLE001
        roofs["matmul"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        nbytes = (1 << 20) if smoke else (1 << 31)
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
        dst = torch.empty_like(src)
        ms = timer(lambda src=src, dst=dst: dst.copy_(src))
        roofs["copy"] = {"bytes": nbytes, "ms": ms, "gbps": 2 * nbytes / ms / 1e6}
        del src, dst
    except Exception as exc:  # noqa: BLE001
        roofs["copy"] = {"error": f"{type(exc).__name__}: {exc}"}
    return roofs


def _gather_dense(torch, x, i, hq):
    """``(q, k, v)`` of sequence i as contiguous ``[1, Hq, L|S, D]`` (K/V expanded to Hq heads)."""
    lo, hi = x["indptr"][i], x["indptr"][i + 1]
    slots = x["prefix_slots"][i]
    k = torch.cat([x["k_pool"].flatten(0, 1)[slots], x["k"][lo:hi]])
    v = torch.cat([x["v_pool"].flatten(0, 1)[slots], x["v"][lo:hi]])
    group = hq // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    return tuple(t.transpose(0, 1).unsqueeze(0).contiguous() for t in (x["q"][lo:hi], k, v))


def _sdpa_extend(torch, backend: str, q4, k4, v4, prefix_len: int):
    """SDPA over dense ``[N, Hq, L|S, D]`` with a bottom-right causal mask on one backend."""
    F = torch.nn.functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "flash":
        if prefix_len == 0:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)
        # Flash's own is_causal is bottom-right: what causal_lower_right dispatches to.
        return torch.ops.aten._scaled_dot_product_flash_attention(q4, k4, v4, 0.0, is_causal=True)[0]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        if prefix_len == 0:
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)
        num_q, num_k = q4.shape[2], k4.shape[2]
        mask = torch.ones(num_q, num_k, dtype=torch.bool, device=q4.device).tril(num_k - num_q)
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask)


def time_extend(torch, ops, case, heads, dtype, device, timer, roofs, baselines=True) -> dict:
    p, ln, b, n = case["P"], case["L"], case["block_size"], case["N"]
    x = _paged_inputs(torch, [(p, ln)] * n, b, heads, dtype, device, seed=1, poison=False)
    hq, d = heads["num_q_heads"], heads["head_dim"]
    flops = 4 * d * hq * n * (ln * p + ln * (ln + 1) // 2)
    out = torch.empty_like(x["q"])
    ms = timer(lambda: ops.extend_attention(*_extend_args(x), max_q_len=ln, out=out))
    row = dict(case, ms=ms, tflops=flops / ms / 1e9)
    if "tflops" in roofs.get("matmul", {}):
        row["ratio_matmul"] = row["tflops"] / roofs["matmul"]["tflops"]
    if not baselines:
        return row
    dense = [_gather_dense(torch, x, i, hq) for i in range(n)]
    q4, k4, v4 = (torch.cat([t[j] for t in dense]) for j in range(3))
    del dense
    ours = out.view(n, ln, hq, d).transpose(1, 2)
    for backend in ("flash", "cudnn"):
        try:
            base = _sdpa_extend(torch, backend, q4, k4, v4, p)
            diff = _max_err(torch, base, ours)
            base_ms = timer(lambda backend=backend: _sdpa_extend(torch, backend, q4, k4, v4, p))
            row[f"sdpa_{backend}_tflops"] = flops / base_ms / 1e9
            row[f"ratio_{backend}"] = row["tflops"] / row[f"sdpa_{backend}_tflops"]
            row[f"max_abs_diff_{backend}"] = diff
        except Exception as exc:  # noqa: BLE001 - a refusing backend is "n/a"
            row[f"sdpa_{backend}_tflops"] = None
            row[f"ratio_{backend}"] = None
            row[f"sdpa_{backend}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def time_decode(torch, ops, case, heads, dtype, device, timer, roofs, baselines=True) -> dict:
    n, kv, b = case["N"], case["kv"], case["block_size"]
    x = _paged_inputs(torch, [(kv, 1)] * n, b, heads, dtype, device, seed=2, poison=False)
    hkv, d = heads["num_kv_heads"], heads["head_dim"]
    kv_lens = torch.full((n,), kv, dtype=torch.int32, device=device)
    nbytes = 2 * n * kv * hkv * d * x["k_pool"].element_size()
    out = torch.empty_like(x["q"])
    splits = case.get("num_kv_splits")
    ms = timer(lambda: ops.decode_attention(x["q"], x["k_pool"], x["v_pool"], x["block_tables"], kv_lens,
                                            out=out, num_kv_splits=splits))
    row = dict(case, ms=ms, gbps=nbytes / ms / 1e6)
    if "gbps" in roofs.get("copy", {}):
        row["ratio_copy"] = row["gbps"] / roofs["copy"]["gbps"]
    if not baselines:
        return row
    q4 = x["q"].unsqueeze(2)  # [N, Hq, 1, D]
    slots = torch.cat(x["prefix_slots"])
    k4 = x["k_pool"].flatten(0, 1)[slots].view(n, kv, hkv, d).transpose(1, 2).contiguous()  # [N, Hkv, S, D]
    v4 = x["v_pool"].flatten(0, 1)[slots].view(n, kv, hkv, d).transpose(1, 2).contiguous()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional
    for backend, kind in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def call(kind=kind):
            with sdpa_kernel([kind]):
                return F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)
        try:
            diff = _max_err(torch, call()[:, :, 0], out)
            base_ms = timer(call)
            row[f"sdpa_{backend}_gbps"] = nbytes / base_ms / 1e6
            row[f"ratio_{backend}"] = row["gbps"] / row[f"sdpa_{backend}_gbps"]
            row[f"max_abs_diff_{backend}"] = diff
        except Exception as exc:  # noqa: BLE001
            row[f"sdpa_{backend}_gbps"] = None
            row[f"ratio_{backend}"] = None
            row[f"sdpa_{backend}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def time_kv_write(torch, ops, case, heads, dtype, device, timer, roofs) -> dict:
    t, b = case["T"], case["block_size"]
    hkv, d = heads["num_kv_heads"], heads["head_dim"]
    num_blocks = -(-t // b) + 1
    k_pool = torch.empty(num_blocks, b, hkv, d, dtype=dtype, device=device)
    v_pool = torch.empty_like(k_pool)
    slots = torch.randperm(num_blocks * b, device=device)[:t]
    k = torch.randn(t, hkv, d, dtype=dtype, device=device)
    v = torch.randn_like(k)
    nbytes = 2 * 2 * k.numel() * k.element_size()  # K and V, each read once and written once
    ms = timer(lambda: ops.paged_kv_write(k, v, k_pool, v_pool, slots))
    row = dict(case, ms=ms, gbps=nbytes / ms / 1e6)
    if "gbps" in roofs.get("copy", {}):
        row["ratio_copy"] = row["gbps"] / roofs["copy"]["gbps"]
    return row


def build_cases(quick: bool, smoke: bool) -> list[dict]:
    if smoke:
        return [{"kind": "extend", "P": 0, "L": 20, "block_size": 16, "N": 1},
                {"kind": "extend", "P": 24, "L": 9, "block_size": 4, "N": 2},
                {"kind": "decode", "N": 2, "kv": 40, "block_size": 16},
                {"kind": "kv_write", "T": 33, "block_size": 16}]
    k = 1024
    cases = []
    no_prefix = [4 * k] if quick else [k, 4 * k, 8 * k, 16 * k]
    prefix = [(4 * k, 512)] if quick else [(p, ln) for p in (k, 4 * k, 16 * k) for ln in (128, 512, 2 * k)]
    for ln in no_prefix:
        cases.append({"kind": "extend", "P": 0, "L": ln, "block_size": 16, "N": max(1, 4 * k // ln)})
    for p, ln in prefix:
        cases.append({"kind": "extend", "P": p, "L": ln, "block_size": 16, "N": max(1, 4 * k // ln)})
    if not quick:
        for b in (1, 64):
            cases.append({"kind": "extend", "P": 4 * k, "L": 512, "block_size": b, "N": 8})
    decode = [(32, 32 * k)] if quick else [(n, kv) for n in (1, 32, 128) for kv in (k, 8 * k, 32 * k)]
    for n, kv in decode:
        cases.append({"kind": "decode", "N": n, "kv": kv, "block_size": 16})
    if not quick:
        for b in (1, 64):
            cases.append({"kind": "decode", "N": 32, "kv": 32 * k, "block_size": b})
    cases.append({"kind": "kv_write", "T": 16 * k, "block_size": 16})
    return cases


def run_sweep(torch, ops, heads, dtype, device, timer, roofs, smoke: bool) -> list[dict]:
    """Goal cases over launch configs (``LAUNCH_OVERRIDE`` of the kernel modules), no baselines."""
    extend_mod, decode_mod = sys.modules[f"{_PKG}.extend"], sys.modules[f"{_PKG}.decode"]
    if smoke:
        ext_case = {"kind": "extend", "P": 24, "L": 9, "block_size": 4, "N": 2}
        dec_case = {"kind": "decode", "N": 2, "kv": 40, "block_size": 16}
        ext_grid = [{"block_m": 16, "block_n": 16}, {"block_m": 32, "block_n": 32}]
        dec_grid = [{"block_n": 16}, {"num_kv_splits": 1}]
    else:
        ext_case = {"kind": "extend", "P": 4096, "L": 512, "block_size": 16, "N": 8}
        dec_case = {"kind": "decode", "N": 32, "kv": 32768, "block_size": 16}
        ext_grid = [{"block_m": m, "block_n": n, "num_warps": w, "num_stages": st}
                    for m, n, w, st in ((128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 2), (128, 32, 4, 3),
                                        (64, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 4))]
        dec_grid = [{"block_n": n, "num_warps": w, "num_stages": st}
                    for n in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
        dec_grid += [{"num_kv_splits": k} for k in (1, 2, 4, 8, 16, 32)]
    rows = []
    for module, fn, case, grid in ((extend_mod, time_extend, ext_case, ext_grid),
                                   (decode_mod, time_decode, dec_case, dec_grid)):
        for config in grid:
            launch = {k: v for k, v in config.items() if k != "num_kv_splits"}
            splits = {"num_kv_splits": config["num_kv_splits"]} if "num_kv_splits" in config else {}
            full = dict(case, **splits)
            module.LAUNCH_OVERRIDE = launch or None
            try:
                row = fn(torch, ops, full, heads, dtype, device, timer, roofs, baselines=False)
            except Exception as exc:  # noqa: BLE001 - e.g. a config that exceeds shared memory
                row = dict(full, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            finally:
                module.LAUNCH_OVERRIDE = None
            row["config"] = config
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- quantized KV

#: Quantized KV formats timed and checked against the unquantized kernels (kernels/kv_quant.py).
KV_QUANT_NAMES = ("int8", "fp8_e4m3")


def load_kv_quant():
    """``kernels/kv_quant.py`` of the privately loaded kernels package (torch only)."""
    import importlib

    return importlib.import_module(f"{_PKG}.kv_quant")


def quantize_pools(torch, kvq, k_pool, v_pool, name):
    """``(k_pool, v_pool, k_scales, v_scales)``: the pools quantized by ``kv_quant`` (copies)."""
    fmt = kvq.resolve_kv_format(name, torch.float32)
    m, b, hkv, d = k_pool.shape
    out = []
    for pool in (k_pool, v_pool):
        q, s = kvq.quantize_kv(pool.reshape(m * b, hkv, d), fmt)
        out.append((q.view(m, b, hkv, d), s.view(m, b, hkv)))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def kvquant_cases(smoke: bool) -> list[dict]:
    """The cases timed per KV format: the two goal cases and the 16k-token write."""
    if smoke:
        return [{"kind": "extend", "P": 24, "L": 9, "block_size": 4, "N": 2},
                {"kind": "decode", "N": 2, "kv": 40, "block_size": 16},
                {"kind": "kv_write", "T": 33, "block_size": 16}]
    return [{"kind": "extend", "P": 0, "L": 4096, "block_size": 16, "N": 1},
            {"kind": "extend", "P": 4096, "L": 512, "block_size": 16, "N": 8},
            {"kind": "decode", "N": 32, "kv": 32768, "block_size": 16},
            {"kind": "decode", "N": 1, "kv": 8192, "block_size": 16},
            {"kind": "kv_write", "T": 16384, "block_size": 16}]


def time_kvquant(torch, ops, kvq, case, heads, dtype, device, timer) -> list[dict]:
    """One case timed with unquantized pools (``dtype``) and each of :data:`KV_QUANT_NAMES`, on the
    same inputs; each row carries ``ratio`` = its time over the unquantized time. Decode GB/s
    counts the bytes the kernel reads from the pools (values plus fp32 scales)."""
    hkv, d = heads["num_kv_heads"], heads["head_dim"]
    kind = case["kind"]
    if kind == "kv_write":
        t, b = case["T"], case["block_size"]
        num_blocks = -(-t // b) + 1
        k_pool = torch.zeros(num_blocks, b, hkv, d, dtype=dtype, device=device)
        v_pool = torch.zeros_like(k_pool)
        slots = torch.randperm(num_blocks * b, device=device)[:t]
        k = torch.randn(t, hkv, d, dtype=dtype, device=device)
        v = torch.randn_like(k)
        x = None
    else:
        seqs = [(case["P"], case["L"])] * case["N"] if kind == "extend" else [(case["kv"], 1)] * case["N"]
        x = _paged_inputs(torch, seqs, case["block_size"], heads, dtype, device, seed=3, poison=False)
        k_pool, v_pool = x["k_pool"], x["v_pool"]
    variants: list[tuple[str, Any]] = [("auto", (k_pool, v_pool, None, None))]
    for name in KV_QUANT_NAMES:
        try:
            variants.append((name, quantize_pools(torch, kvq, k_pool, v_pool, name)))
        except Exception as exc:  # noqa: BLE001 - e.g. a torch without float8
            variants.append((name, exc))
    rows = []
    base_ms = None
    for name, pools in variants:
        row = dict(case, kv_cache_dtype=name)
        try:
            if isinstance(pools, Exception):
                raise pools
            if kind == "kv_write":
                ms = timer(_kvquant_call(torch, ops, case, pools, device, write=(k, v, slots)))
            else:
                ms = timer(_kvquant_call(torch, ops, case, pools, device, inputs=x))
            if kind == "decode":
                kp, ks = pools[0], pools[2]
                per_token = 2 * hkv * (d * kp.element_size() + (4 if ks is not None else 0))
                row["gbps"] = case["N"] * case["kv"] * per_token / ms / 1e6
            row["ms"] = ms
            if name == "auto":
                base_ms = ms
            row["ratio"] = ms / base_ms if base_ms else None
        except Exception as exc:  # noqa: BLE001 - one failing format must not end the run
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
    return rows


def _kvquant_call(torch, ops, case, pools, device, inputs=None, write=None) -> Callable[[], Any]:
    """The timed call of :func:`time_kvquant` for one case and one ``(kp, vp, ks, vs)`` pool set."""
    kp, vp, ks, vs = pools
    scales = {"k_scale_pool": ks, "v_scale_pool": vs}
    if write is not None:
        k, v, slots = write
        return lambda: ops.paged_kv_write(k, v, kp, vp, slots, **scales)
    x = inputs
    out = torch.empty_like(x["q"])
    if case["kind"] == "extend":
        args = (x["q"], x["k"], x["v"], kp, vp, x["block_tables"], x["prefix_lens"], x["qo_indptr"])
        return lambda: ops.extend_attention(*args, max_q_len=case["L"], out=out, **scales)
    kv_lens = torch.full((case["N"],), case["kv"], dtype=torch.int32, device=device)
    return lambda: ops.decode_attention(x["q"], kp, vp, x["block_tables"], kv_lens, out=out, **scales)
