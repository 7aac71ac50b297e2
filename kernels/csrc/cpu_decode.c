/* radixkv CPU decode kernels (OpenMP): small-batch linear, paged decode attention and a whole
 * decoder layer per call, with fp32 or bf16 weights and KV pool, fp32 arithmetic throughout.
 *
 * Written against rk_vec.h: kernels/native.py compiles this one source into an AVX-512 build
 * (RK_VL = 16 fp32 lanes) and an AVX2 build (RK_VL = 8), and calls through ctypes with raw
 * pointers of contiguous tensors; torch stays the owner of every buffer. Linked against
 * libgomp.so.1 by soname, so inside a process that imported torch it shares torch's OpenMP
 * runtime (one thread pool, no two runtimes spinning against each other).
 *
 * Why these: a decode step at batch 1-16 is bound by memory bandwidth (every weight is read
 * once per step, every cached key and value once per layer), but MKL's sgemm on this build takes
 * a path for small M that runs at a third of the copy bandwidth on AMD CPUs, and attention over
 * the paged pool through torch needs a gather of each sequence's blocks before SDPA reads them
 * again. Here each weight row is streamed once and reused from L1 for every row of the batch,
 * and attention reads each key and value straight from its pool block (flash-decoding: the
 * keys of a sequence are split into chunks processed in parallel, each with its own softmax
 * statistics, then merged; Dao et al., "Flash-Decoding for long-context inference", 2023,
 * https://crfm.stanford.edu/2023/10/12/flashdecoding.html).
 *
 * bf16 (the *_bf16 entry points): weights and K/V are stored as bf16 (uint16, the upper half of
 * an fp32) and widened to fp32 in registers (rkv_load_bf16), K/V written with rkv_store_bf16
 * (round to nearest even): half the bytes of the memory-bound step; activations, the residual
 * stream, accumulations and softmax stay fp32.
 *
 * Quantized KV (the *_q entry points; kernels/kv_quant.py): int8 or float8_e4m3fn pools with one
 * fp32 scale per (slot, KV head) in [slots, hkv] scale pools. Attention reads the stored bytes
 * (a quarter of fp32's) and widens them in registers (rk_vec.h), each key's scale folded into
 * its score and each value's into its softmax weight; the decode layer quantizes the new K/V
 * with rk_quantize_head (torch's quantize_kv bit for bit) before attending over them.
 */
#define _POSIX_C_SOURCE 199309L  /* clock_gettime under -std=c11 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rk_vec.h"

#define RK_MAX_GROUP 16   /* query heads per KV head */
#define RK_MAX_HEADS 64   /* query heads */
#define RK_MAX_DIM 256    /* head dim */
#define RK_SUB 8          /* keys scored at once */
#define RK_MAX_CHUNK 256  /* keys per task */
/* score row stride: a chunk padded to a whole vector, plus a sub-block's 8-score store that
 * may start at its last key; a multiple of 16 floats keeps rows 64-byte aligned */
#define RK_ROW (RK_MAX_CHUNK + 16)

#define RK_INLINE static inline __attribute__((always_inline))

const char *rk_isa(void) { return RK_ISA_NAME; }

/* cpuid probes, for kernels/native.py where /proc/cpuinfo is unreadable: called only in the
 * AVX2 build, whose code any AVX2 CPU runs. */
int rk_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

int rk_cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
           && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
           && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* ---- width-generic helpers missing from rk_vec.h ---- */

/* bf16 loads of the first n lanes (0 <= n <= RK_VL), the rest 0. */
static inline rkv load_bf16_n(const uint16_t *p, int n) {
#if RK_AVX512
    const __m256i h = _mm256_maskz_loadu_epi16(rk_mask_n(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
    uint16_t tmp[RK_VL] = {0};
    memcpy(tmp, p, sizeof(uint16_t) * (size_t)n);
    return rkv_load_bf16(tmp);
#endif
}

static inline rkv vdiv(rkv a, rkv b) {
#if RK_AVX512
    return _mm512_div_ps(a, b);
#else
    return _mm256_div_ps(a, b);
#endif
}

/* RK_VL elements from element i of an array of kind RK_KV_* (rk_vec.h: fp32, bf16, int8,
 * float8_e4m3fn; weights are fp32 or bf16, so their bf16 flag is the kind), as fp32: quantized
 * values unscaled. `kind` is a constant at every inlined call site. */
RK_INLINE rkv load_el(const void *p, int64_t i, int kind) {
    if (kind == RK_KV_I8) return rkv_load_i8((const int8_t *)p + i);
    if (kind == RK_KV_FP8) return rkv_load_fp8((const uint8_t *)p + i);
    return kind == RK_KV_BF16 ? rkv_load_bf16((const uint16_t *)p + i) : rkv_load((const float *)p + i);
}

/* Bytes per pool element of a kind. */
static inline int64_t kind_bytes(int kind) {
    return kind == RK_KV_F32 ? 4 : kind == RK_KV_BF16 ? 2 : 1;
}

RK_INLINE rkv load_el_n(const void *p, int64_t i, int n, int bf16) {
    return bf16 ? load_bf16_n((const uint16_t *)p + i, n) : rkv_load_n((const float *)p + i, n);
}

/* The sums of eight vectors, times scale[t], as scores dst[0..8); dst[t] for t >= cnt is -inf.
 * Eight keys' dot products reduced together: a horizontal-add tree over 8-lane halves
 * (ISA-specific: the AVX-512 build first folds each 16-lane vector to 8 lanes). */
static inline void store_scores8(rkv x0, rkv x1, rkv x2, rkv x3, rkv x4, rkv x5, rkv x6, rkv x7,
                                 __m256 scale, int cnt, float *dst) {
#if RK_AVX512
#define RK_FOLD(v) _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))
    const __m256 y0 = RK_FOLD(x0), y1 = RK_FOLD(x1), y2 = RK_FOLD(x2), y3 = RK_FOLD(x3);
    const __m256 y4 = RK_FOLD(x4), y5 = RK_FOLD(x5), y6 = RK_FOLD(x6), y7 = RK_FOLD(x7);
#undef RK_FOLD
#else
    const __m256 y0 = x0, y1 = x1, y2 = x2, y3 = x3, y4 = x4, y5 = x5, y6 = x6, y7 = x7;
#endif
    const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(y0, y1), _mm256_hadd_ps(y2, y3));
    const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(y4, y5), _mm256_hadd_ps(y6, y7));
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                                      _mm256_permute2f128_ps(h0123, h4567, 0x31));
    const __m256 valid = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    _mm256_storeu_ps(dst, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                           _mm256_mul_ps(sums, scale), valid));
}

/* Reads [p, p + num_bytes) once in address order, one vector load per 64-byte line (values
 * dropped: the compute loop then reads from L1 in its own order), and requests [next, next +
 * next_bytes). For weights this took the whole model's batch-1 projections from 36 to 32 ms on
 * 2 cores (538 MB); for pool rows see stream_rows. Vector loads, not scalar ones: one scalar
 * load per line made decode attention 3-5% slower on Zen 4. */
static inline void stream_bytes(const char *p, int64_t num_bytes, const char *next, int64_t next_bytes) {
    rkv s0 = rkv_zero(), s1 = s0;
    int64_t b = 0;
    for (; b + 128 <= num_bytes; b += 128) {
        s0 = rkv_or(s0, rkv_load((const float *)(p + b)));
        s1 = rkv_or(s1, rkv_load((const float *)(p + b + 64)));
    }
    for (; b + 4 * RK_VL <= num_bytes; b += 64) s0 = rkv_or(s0, rkv_load((const float *)(p + b)));
    uint32_t last = 0;  /* the last line (a short rest, or p not line-aligned) */
    if (num_bytes >= 4) memcpy(&last, p + num_bytes - 4, sizeof last);
    __asm__ volatile("" ::"x"(rkv_or(s0, s1)), "r"(last));
    if (next != NULL)
        for (int64_t b2 = 0; b2 < next_bytes; b2 += 64) _mm_prefetch(next + b2, _MM_HINT_T0);
}

/* ---- few-row linear ---- */

/* One tile of nr <= 4 weight rows [j0, j0 + nr) against every row of x: each pair of input
 * rows reads the tile from L1 (RK_VL lanes per step, a masked step for k % RK_VL). */
RK_INLINE void linear_tile(const float *x, int64_t m, int64_t k, const void *w, int64_t n,
                           int64_t j0, int nr, const float *bias, float *y, int accumulate,
                           const int bf16) {
    const int64_t el = bf16 ? 2 : 4;
    const char *wb = (const char *)w;
    const void *w0 = wb + j0 * k * el;
    const void *w1 = wb + (j0 + (nr > 1 ? 1 : 0)) * k * el;
    const void *w2 = wb + (j0 + (nr > 2 ? 2 : 0)) * k * el;
    const void *w3 = wb + (j0 + (nr > 3 ? 3 : 0)) * k * el;
    const int64_t k_main = k - k % RK_VL;
    const int rem = (int)(k - k_main);
    float b[4] = {0, 0, 0, 0};
    if (bias)
        for (int r = 0; r < nr; r++) b[r] = bias[j0 + r];
    int64_t i = 0;
    for (; i + 1 < m; i += 2) {
        const float *xa = x + i * k, *xb = xa + k;
        rkv a0 = rkv_zero(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
#define RK_LIN_FMA2                                                                  \
    a0 = rkv_fma(v0, va, a0); c0 = rkv_fma(v0, vb, c0);                             \
    a1 = rkv_fma(v1, va, a1); c1 = rkv_fma(v1, vb, c1);                             \
    a2 = rkv_fma(v2, va, a2); c2 = rkv_fma(v2, vb, c2);                             \
    a3 = rkv_fma(v3, va, a3); c3 = rkv_fma(v3, vb, c3);
        for (int64_t kk = 0; kk < k_main; kk += RK_VL) {
            const rkv va = rkv_load(xa + kk), vb = rkv_load(xb + kk);
            const rkv v0 = load_el(w0, kk, bf16), v1 = load_el(w1, kk, bf16);
            const rkv v2 = load_el(w2, kk, bf16), v3 = load_el(w3, kk, bf16);
            RK_LIN_FMA2
        }
        if (rem) {
            const rkv va = rkv_load_n(xa + k_main, rem), vb = rkv_load_n(xb + k_main, rem);
            const rkv v0 = load_el_n(w0, k_main, rem, bf16), v1 = load_el_n(w1, k_main, rem, bf16);
            const rkv v2 = load_el_n(w2, k_main, rem, bf16), v3 = load_el_n(w3, k_main, rem, bf16);
            RK_LIN_FMA2
        }
#undef RK_LIN_FMA2
        const float sa[4] = {rkv_hsum(a0), rkv_hsum(a1), rkv_hsum(a2), rkv_hsum(a3)};
        const float sb[4] = {rkv_hsum(c0), rkv_hsum(c1), rkv_hsum(c2), rkv_hsum(c3)};
        float *ya = y + i * n + j0, *yb = ya + n;
        for (int r = 0; r < nr; r++) {
            ya[r] = sa[r] + b[r] + (accumulate ? ya[r] : 0.0f);
            yb[r] = sb[r] + b[r] + (accumulate ? yb[r] : 0.0f);
        }
    }
    if (i < m) {
        const float *xa = x + i * k;
        rkv a0 = rkv_zero(), a1 = a0, a2 = a0, a3 = a0;
#define RK_LIN_FMA1                                                                  \
    a0 = rkv_fma(v0, va, a0); a1 = rkv_fma(v1, va, a1);                             \
    a2 = rkv_fma(v2, va, a2); a3 = rkv_fma(v3, va, a3);
        for (int64_t kk = 0; kk < k_main; kk += RK_VL) {
            const rkv va = rkv_load(xa + kk);
            const rkv v0 = load_el(w0, kk, bf16), v1 = load_el(w1, kk, bf16);
            const rkv v2 = load_el(w2, kk, bf16), v3 = load_el(w3, kk, bf16);
            RK_LIN_FMA1
        }
        if (rem) {
            const rkv va = rkv_load_n(xa + k_main, rem);
            const rkv v0 = load_el_n(w0, k_main, rem, bf16), v1 = load_el_n(w1, k_main, rem, bf16);
            const rkv v2 = load_el_n(w2, k_main, rem, bf16), v3 = load_el_n(w3, k_main, rem, bf16);
            RK_LIN_FMA1
        }
#undef RK_LIN_FMA1
        const float sa[4] = {rkv_hsum(a0), rkv_hsum(a1), rkv_hsum(a2), rkv_hsum(a3)};
        float *ya = y + i * n + j0;
        for (int r = 0; r < nr; r++) ya[r] = sa[r] + b[r] + (accumulate ? ya[r] : 0.0f);
    }
}

/* y[m, n] = x[m, k] . w[n, k]^T (+ bias[n]) (+ y[m, n] when `accumulate`): row-major,
 * contiguous, k % 8 == 0, w fp32 or (bf16) bf16. Tiles of 4 weight rows are shared out among
 * the threads of the enclosing parallel region (an orphaned `omp for`); each tile is read from
 * memory once and reused from L1 by every pair of input rows. */
static void linear_for(const float *x, int64_t m, int64_t k, const void *w, int64_t n,
                       const float *bias, float *y, int accumulate, int bf16) {
    const int64_t num_tiles = (n + 3) / 4, el = bf16 ? 2 : 4;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tiles; t++) {
        const int64_t j0 = t * 4;
        const int nr = n - j0 < 4 ? (int)(n - j0) : 4;
        const char *tile = (const char *)w + j0 * k * el;
        stream_bytes(tile, (int64_t)nr * k * el, t + 1 < num_tiles ? tile + 4 * k * el : NULL,
                     (n - j0 - 4 < 4 ? n - j0 - 4 : 4) * k * el);
        if (bf16)
            linear_tile(x, m, k, w, n, j0, nr, bias, y, accumulate, 1);
        else
            linear_tile(x, m, k, w, n, j0, nr, bias, y, accumulate, 0);
    }
}

static int linear_entry(const float *x, int64_t m, int64_t k, const void *w, int64_t n,
                        const float *bias, float *y, int num_threads, int bf16) {
    if (k % 8 != 0 || m < 1 || n < 1) return 1;
#pragma omp parallel num_threads(num_threads)
    linear_for(x, m, k, w, n, bias, y, 0, bf16);
    return 0;
}

/* y = x . w^T (+ bias), fp32 weights: see linear_for. Returns 0, or 1 on an unsupported k. */
int rk_linear_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
                  const float *bias, float *y, int num_threads) {
    return linear_entry(x, m, k, w, n, bias, y, num_threads, 0);
}

/* As rk_linear_f32 with bf16 weights (x, bias and y fp32). */
int rk_linear_bf16(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                   const float *bias, float *y, int num_threads) {
    return linear_entry(x, m, k, w, n, bias, y, num_threads, 1);
}

/* ---- paged decode attention ---- */

/* The pool slot of key pos of a sequence, and in *cnt how many keys from it share its block:
 * cnt <= RK_SUB, not past t1. */
static inline int64_t sub_slot(const int32_t *table, int block_size, int64_t pos, int64_t t1, int *cnt) {
    const int64_t blk_idx = pos / block_size;
    const int off = (int)(pos - blk_idx * block_size);
    int n = block_size - off;
    if (n > RK_SUB) n = RK_SUB;
    if (n > t1 - pos) n = (int)(t1 - pos);
    *cnt = n;
    return (int64_t)table[blk_idx] * block_size + off;
}

/* The pool rows of keys [pos, pos + cnt) of a sequence: cnt <= RK_SUB, not crossing a block. */
static inline int64_t sub_block(const int32_t *table, int block_size, int64_t pos, int64_t t1,
                                int64_t stride, int *cnt) {
    return sub_slot(table, block_size, pos, t1, cnt) * stride;
}

#ifndef RK_PF_DIST
#define RK_PF_DIST 4
#endif
/* Streams a sequence's pool rows ahead of the compute loops, which read them strided (eight
 * keys' rows per head, head after head): reads the rows of keys [pos, pos + RK_SUB) once in
 * address order (a sequential read the hardware prefetcher follows), and requests those
 * RK_PF_DIST sub-blocks further on. Measured on 2 cores, 30 layers at 2k context from DRAM:
 * 8 GB/s with neither, 8 GB/s with either alone, 11-14 GB/s with both. `el`: bytes per
 * element (4 fp32, 2 bf16). */
static inline void stream_rows(const void *pool, int64_t el, const int32_t *table, int block_size,
                               int64_t pos, int64_t t1, int64_t stride) {
    int cnt;
    const int64_t off = sub_block(table, block_size, pos, t1, stride, &cnt);
    const int64_t ahead = pos + RK_PF_DIST * RK_SUB;
    const char *next = NULL;
    int64_t next_bytes = 0;
    if (ahead < t1) {
        int next_cnt;
        next = (const char *)pool + sub_block(table, block_size, ahead, t1, stride, &next_cnt) * el;
        next_bytes = (int64_t)next_cnt * stride * el;
    }
    stream_bytes((const char *)pool + off * el, (int64_t)cnt * stride * el, next, next_bytes);
}

/* Quantized pools: requests the K and V scales ([slots, hkv] fp32) of the keys RK_PF_DIST
 * sub-blocks after pos (a block's scales are 4 hkv B bytes, scattered with its block). */
static inline void prefetch_scales(const float *k_scales, const float *v_scales, const int32_t *table,
                                   int block_size, int64_t pos, int64_t t1, int hkv) {
    const int64_t ahead = pos + RK_PF_DIST * RK_SUB;
    if (ahead >= t1) return;
    int cnt;
    const int64_t first = sub_slot(table, block_size, ahead, t1, &cnt) * hkv;
    const int64_t last = first + (int64_t)cnt * hkv - 1;
    _mm_prefetch((const char *)(k_scales + first), _MM_HINT_T0);
    _mm_prefetch((const char *)(k_scales + last), _MM_HINT_T0);
    _mm_prefetch((const char *)(v_scales + first), _MM_HINT_T0);
    _mm_prefetch((const char *)(v_scales + last), _MM_HINT_T0);
}

/* P.V for three query heads (score rows s0, s1, s2) over the keys of one sub-block, dims
 * [jb, jb + nv * RK_VL) of head dim: 3 x nv accumulators in registers, each V row read once. */
RK_INLINE void pv_block(const void *vb, int64_t stride, int cnt, const float *s0, const float *s1,
                        const float *s2, float *A0, float *A1, float *A2, int jb, const int nv,
                        const int kind) {
    rkv r0[4], r1[4], r2[4];
    for (int v = 0; v < nv; v++) {
        r0[v] = rkv_load(A0 + jb + v * RK_VL);
        r1[v] = rkv_load(A1 + jb + v * RK_VL);
        r2[v] = rkv_load(A2 + jb + v * RK_VL);
    }
    for (int t = 0; t < cnt; t++) {
        const int64_t row = t * stride + jb;
        const rkv p0 = rkv_set1(s0[t]), p1 = rkv_set1(s1[t]), p2 = rkv_set1(s2[t]);
        for (int v = 0; v < nv; v++) {
            const rkv x = load_el(vb, row + v * RK_VL, kind);
            r0[v] = rkv_fma(p0, x, r0[v]);
            r1[v] = rkv_fma(p1, x, r1[v]);
            r2[v] = rkv_fma(p2, x, r2[v]);
        }
    }
    for (int v = 0; v < nv; v++) {
        rkv_store(A0 + jb + v * RK_VL, r0[v]);
        rkv_store(A1 + jb + v * RK_VL, r1[v]);
        rkv_store(A2 + jb + v * RK_VL, r2[v]);
    }
}

/* One chunk [t0, t1) (at most RK_MAX_CHUNK keys) of one sequence's keys, for all its query
 * heads, in two passes: every score of the chunk first (eight q.k dot products reduced at
 * once, into an L1-resident [heads, chunk] array), then per head one max, one vector exp and
 * one sum over the chunk, then P.V with 3 heads x (4 vectors of dims) of accumulators in
 * registers. An online softmax per group of keys instead chained every group's max, exp and
 * rescale behind the previous one and ran at a third of this speed. Written per query head as
 * (max, sum, unnormalised acc[d]). d % 32 == 0; k/v pools of `kind` (rk_vec.h's RK_KV_*).
 *
 * Quantized pools (int8, fp8) with k_scales / v_scales [slots, hkv] fp32: a sub-block's keys of
 * one KV head are widened once (unscaled) into an L1 buffer that every query head of the group
 * reads, and the key's scale is folded into its score (q.k = s_k (q.k_q)); the value scales
 * are folded into the softmax weights after their sum is taken (p_t s_v,t multiplies the
 * widened v_q,t in P.V), so no dequantized K or V is ever stored. */
RK_INLINE void decode_chunk(const float *q, int hq, int hkv, int d, const void *k_pool,
                            const void *v_pool, const float *k_scales, const float *v_scales,
                            const int32_t *table, int block_size, int64_t t0, int64_t t1, float scale,
                            float *part, const int kind) {
    const int64_t el = kind_bytes(kind);
    const int quant = kind == RK_KV_I8 || kind == RK_KV_FP8;
    /* the keys the dot products read: the pool itself, or (quantized) the widened buffer */
    const int src_kind = quant ? RK_KV_F32 : kind;
    const int group = hq / hkv;
    const int64_t stride = (int64_t)hkv * d;
    const int n = (int)(t1 - t0);
    const int n_pad = (n + RK_VL - 1) / RK_VL * RK_VL;
    static const float zero_p[RK_ROW] __attribute__((aligned(64))) = {0};
    float s[RK_MAX_HEADS * RK_ROW] __attribute__((aligned(64)));
    float acc[3 * RK_MAX_DIM] __attribute__((aligned(64)));
    /* quantized only: one sub-block of one KV head's keys widened; each KV head's value scales */
    float kbuf[RK_SUB * RK_MAX_DIM] __attribute__((aligned(64)));
    float vsc[RK_MAX_HEADS * RK_ROW] __attribute__((aligned(64)));
    const __m256 sm_scale = _mm256_set1_ps(scale);
    /* pass 1: scores */
    for (int64_t pos = t0; pos < t1;) {
        int cnt;
        const int64_t slot = sub_slot(table, block_size, pos, t1, &cnt);
        const int64_t base = slot * stride;
        const int tl = (int)(pos - t0);
        stream_rows(k_pool, el, table, block_size, pos, t1, stride);
        if (quant) prefetch_scales(k_scales, v_scales, table, block_size, pos, t1, hkv);
        for (int kvh = 0; kvh < hkv; kvh++) {
            const int64_t kb = base + (int64_t)kvh * d;
            const void *src = k_pool;
            int64_t kt[RK_SUB];
            __m256 key_scale = sm_scale;
            if (quant) {
                float ks[RK_SUB];
                for (int t = 0; t < RK_SUB; t++) {
                    if (t < cnt) {
                        for (int j = 0; j < d; j += RK_VL)
                            rkv_store_aligned(kbuf + t * d + j, load_el(k_pool, kb + t * stride + j, kind));
                        const int64_t sc = (slot + t) * hkv + kvh;
                        ks[t] = k_scales[sc] * scale;
                        vsc[kvh * RK_ROW + tl + t] = v_scales[sc];
                    } else {
                        ks[t] = 0.0f;
                    }
                    kt[t] = (int64_t)(t < cnt ? t : 0) * d;
                }
                key_scale = _mm256_loadu_ps(ks);
                src = kbuf;
            } else {
                for (int t = 0; t < RK_SUB; t++) kt[t] = kb + (t < cnt ? t : 0) * stride;
            }
            for (int g = 0; g < group; g++) {
                const int h = kvh * group + g;
                const float *qh = q + (int64_t)h * d;
                rkv a0 = rkv_zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
                for (int j = 0; j < d; j += RK_VL) {
                    const rkv qv = rkv_load(qh + j);
                    a0 = rkv_fma(qv, load_el(src, kt[0] + j, src_kind), a0);
                    a1 = rkv_fma(qv, load_el(src, kt[1] + j, src_kind), a1);
                    a2 = rkv_fma(qv, load_el(src, kt[2] + j, src_kind), a2);
                    a3 = rkv_fma(qv, load_el(src, kt[3] + j, src_kind), a3);
                    a4 = rkv_fma(qv, load_el(src, kt[4] + j, src_kind), a4);
                    a5 = rkv_fma(qv, load_el(src, kt[5] + j, src_kind), a5);
                    a6 = rkv_fma(qv, load_el(src, kt[6] + j, src_kind), a6);
                    a7 = rkv_fma(qv, load_el(src, kt[7] + j, src_kind), a7);
                }
                /* a sub-block may start mid-way through 8 (a block size not of 8) */
                store_scores8(a0, a1, a2, a3, a4, a5, a6, a7, key_scale, cnt, s + (int64_t)h * RK_ROW + tl);
            }
        }
        pos += cnt;
    }
    if (quant)  /* past the chunk: weight 0 (exp gives 0 there) times a finite scale */
        for (int kvh = 0; kvh < hkv; kvh++)
            for (int t = n; t < n_pad; t++) vsc[kvh * RK_ROW + t] = 0.0f;
    /* softmax statistics per head: scores past n are -inf and give exp 0 */
    for (int h = 0; h < hq; h++) {
        float *sh = s + (int64_t)h * RK_ROW;
        const float *vh = quant ? vsc + (int64_t)(h / group) * RK_ROW : zero_p;
        for (int t = n; t < n_pad; t++) sh[t] = -INFINITY;
        rkv vm = rkv_set1(-INFINITY);
        for (int t = 0; t < n_pad; t += RK_VL) vm = rkv_max(vm, rkv_load_aligned(sh + t));
        const float mx = rkv_hmax(vm);
        const rkv vmx = rkv_set1(mx);
        rkv vs = rkv_zero();
        for (int t = 0; t < n_pad; t += RK_VL) {
            const rkv p = rkv_exp(rkv_sub(rkv_load_aligned(sh + t), vmx));
            /* quantized: P.V reads the weights times the value scales */
            rkv_store_aligned(sh + t, quant ? rkv_mul(p, rkv_load_aligned(vh + t)) : p);
            vs = rkv_add(vs, p);
        }
        float *ph = part + (int64_t)h * (d + 2);
        ph[0] = mx;
        ph[1] = rkv_hsum(vs);
    }
    /* pass 2: P.V, three query heads of a KV head at a time (missing ones: zero weights) */
    for (int kvh = 0; kvh < hkv; kvh++) {
        for (int g0 = 0; g0 < group; g0 += 3) {
            const int h0 = kvh * group + g0;
            const float *s0 = s + (int64_t)h0 * RK_ROW;
            const float *s1 = g0 + 1 < group ? s0 + RK_ROW : zero_p;
            const float *s2 = g0 + 2 < group ? s0 + 2 * RK_ROW : zero_p;
            for (int j = 0; j < 3 * d; j++) acc[j] = 0.0f;
            for (int64_t pos = t0; pos < t1;) {
                int cnt;
                const int64_t base = sub_block(table, block_size, pos, t1, stride, &cnt);
                const int tl = (int)(pos - t0);
                const void *vb = (const char *)v_pool + (base + (int64_t)kvh * d) * el;
                if (kvh == 0 && g0 == 0) stream_rows(v_pool, el, table, block_size, pos, t1, stride);
                int jb = 0;
                for (; jb + 4 * RK_VL <= d; jb += 4 * RK_VL)
                    pv_block(vb, stride, cnt, s0 + tl, s1 + tl, s2 + tl, acc, acc + d, acc + 2 * d, jb, 4, kind);
                if (jb < d)  /* AVX-512: d % 64 == 32 */
                    pv_block(vb, stride, cnt, s0 + tl, s1 + tl, s2 + tl, acc, acc + d, acc + 2 * d, jb,
                             (32 / RK_VL), kind);
                pos += cnt;
            }
            for (int g = g0; g < group && g < g0 + 3; g++) {
                float *ph = part + (int64_t)(kvh * group + g) * (d + 2);
                memcpy(ph + 2, acc + (g - g0) * d, sizeof(float) * (size_t)d);
            }
        }
    }
}

/* Chunks of every sequence's keys: task_start[i] is the first task of sequence i (N + 1
 * entries); returns the number of tasks. */
static int64_t plan_tasks(const int32_t *kv_lens, int64_t num_seqs, int64_t window_left,
                          int64_t chunk_tokens, int64_t *task_start) {
    int64_t num_tasks = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        task_start[i] = num_tasks;
        const int64_t len = kv_lens[i];
        const int64_t first = window_left >= 0 && len - 1 - window_left > 0 ? len - 1 - window_left : 0;
        num_tasks += len > first ? (len - first + chunk_tokens - 1) / chunk_tokens : 0;
    }
    task_start[num_seqs] = num_tasks;
    return num_tasks;
}

typedef struct {
    const float *q;            /* [T, hq, d] */
    const int64_t *q_rows;     /* [N] */
    int64_t num_seqs;
    const void *k_pool, *v_pool;
    const int32_t *block_tables;
    int64_t max_blocks;
    const int32_t *kv_lens;
    int block_size, hq, hkv, d;
    float scale;
    int64_t window_left, chunk_tokens;
    const int64_t *task_start;
    float *parts;              /* [tasks, hq, d + 2] */
    float *out;                /* [T, hq, d] */
    int kind;                  /* the pools' RK_KV_* */
    const float *k_scales, *v_scales;  /* quantized kinds: [slots, hkv] fp32; else NULL */
} decode_args;

/* The chunks, then their merge, shared out among the enclosing region's threads. */
static void decode_for(const decode_args *a) {
    const int hq = a->hq, d = a->d;
    const int64_t part_size = (int64_t)hq * (d + 2), num_seqs = a->num_seqs;
    const int64_t *task_start = a->task_start;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < task_start[num_seqs]; task++) {
        int64_t lo = 0, hi = num_seqs;  /* the sequence owning this task */
        while (hi - lo > 1) {
            const int64_t mid = (lo + hi) / 2;
            if (task_start[mid] <= task) lo = mid; else hi = mid;
        }
        const int64_t i = lo, chunk = task - task_start[i], len = a->kv_lens[i];
        const int64_t first = a->window_left >= 0 && len - 1 - a->window_left > 0 ? len - 1 - a->window_left : 0;
        const int64_t t0 = first + chunk * a->chunk_tokens;
        const int64_t t1 = t0 + a->chunk_tokens < len ? t0 + a->chunk_tokens : len;
        const float *qi = a->q + a->q_rows[i] * hq * d;
        const int32_t *table = a->block_tables + i * a->max_blocks;
        float *part = a->parts + task * part_size;
        /* one specialised copy of the chunk kernel per pool kind */
#define RK_CHUNK(kind) decode_chunk(qi, hq, a->hkv, d, a->k_pool, a->v_pool, a->k_scales, a->v_scales, \
                                    table, a->block_size, t0, t1, a->scale, part, kind)
        switch (a->kind) {
        case RK_KV_BF16: RK_CHUNK(RK_KV_BF16); break;
        case RK_KV_I8: RK_CHUNK(RK_KV_I8); break;
        case RK_KV_FP8: RK_CHUNK(RK_KV_FP8); break;
        default: RK_CHUNK(RK_KV_F32); break;
        }
#undef RK_CHUNK
    }
#pragma omp for schedule(static)
    for (int64_t ih = 0; ih < num_seqs * hq; ih++) {
        const int64_t i = ih / hq;
        const int h = (int)(ih % hq);
        const int64_t first_task = task_start[i], chunks = task_start[i + 1] - task_start[i];
        float *o = a->out + (a->q_rows[i] * hq + h) * d;
        float mx = -INFINITY;
        for (int64_t c = 0; c < chunks; c++) {
            const float mc = a->parts[(first_task + c) * part_size + (int64_t)h * (d + 2)];
            mx = mc > mx ? mc : mx;
        }
        float denom = 0.0f;
        for (int j = 0; j < d; j += RK_VL) rkv_store(o + j, rkv_zero());
        for (int64_t c = 0; c < chunks; c++) {
            const float *ph = a->parts + (first_task + c) * part_size + (int64_t)h * (d + 2);
            if (ph[0] == -INFINITY) continue;
            const float w = expf(ph[0] - mx);
            denom += w * ph[1];
            const rkv vw = rkv_set1(w);
            for (int j = 0; j < d; j += RK_VL) rkv_store(o + j, rkv_fma(vw, rkv_load(ph + 2 + j), rkv_load(o + j)));
        }
        const rkv inv = rkv_set1(denom > 0.0f ? 1.0f / denom : 0.0f);
        for (int j = 0; j < d; j += RK_VL) rkv_store(o + j, rkv_mul(rkv_load(o + j), inv));
    }
}

static int decode_shape_ok(int hq, int hkv, int d, int64_t chunk_tokens, int block_size) {
    return hkv >= 1 && hq % hkv == 0 && hq / hkv <= RK_MAX_GROUP && hq <= RK_MAX_HEADS && d % 32 == 0
           && d >= 32 && d <= RK_MAX_DIM && chunk_tokens >= 1 && chunk_tokens <= RK_MAX_CHUNK
           && block_size >= 1;
}

static int paged_decode_entry(const float *q, const int64_t *q_rows, int64_t num_seqs,
                              const void *k_pool, const void *v_pool, const int32_t *block_tables,
                              int64_t max_blocks, const int32_t *kv_lens, int block_size, int hq,
                              int hkv, int d, float scale, int64_t window_left, int64_t chunk_tokens,
                              float *out, int num_threads, int kind, const float *k_scales,
                              const float *v_scales) {
    if (!decode_shape_ok(hq, hkv, d, chunk_tokens, block_size)) return 1;
    int64_t *task_start = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (!task_start) return 2;
    const int64_t num_tasks = plan_tasks(kv_lens, num_seqs, window_left, chunk_tokens, task_start);
    float *parts = malloc(sizeof(float) * (num_tasks > 0 ? num_tasks : 1) * hq * (d + 2));
    if (!parts) {
        free(task_start);
        return 2;
    }
    const decode_args a = {q, q_rows, num_seqs, k_pool, v_pool, block_tables, max_blocks, kv_lens,
                           block_size, hq, hkv, d, scale, window_left, chunk_tokens, task_start,
                           parts, out, kind, k_scales, v_scales};
#pragma omp parallel num_threads(num_threads)
    decode_for(&a);
    free(parts);
    free(task_start);
    return 0;
}

/* Decode attention over the paged pool: one query row per sequence.
 *   q, out: [T, hq, d] fp32 (row q_rows[i] is sequence i's query / output row)
 *   k_pool, v_pool: [blocks * block_size, hkv, d]; block_tables: [num_seqs, max_blocks] int32
 *   kv_lens: [num_seqs] int32 keys of each sequence (its new token's already written)
 *   window_left: keys at positions < kv_len - 1 - window_left are skipped; -1: none
 *   chunk_tokens: keys per parallel task (a multiple of block_size is best)
 * Returns 0, 1 on unsupported shapes, 2 on out of memory. */
int rk_paged_decode_f32(const float *q, const int64_t *q_rows, int64_t num_seqs,
                        const float *k_pool, const float *v_pool, const int32_t *block_tables,
                        int64_t max_blocks, const int32_t *kv_lens, int block_size, int hq, int hkv,
                        int d, float scale, int64_t window_left, int64_t chunk_tokens, float *out,
                        int num_threads) {
    return paged_decode_entry(q, q_rows, num_seqs, k_pool, v_pool, block_tables, max_blocks, kv_lens,
                              block_size, hq, hkv, d, scale, window_left, chunk_tokens, out,
                              num_threads, RK_KV_F32, NULL, NULL);
}

/* As rk_paged_decode_f32 over bf16 pools (q and out fp32). */
int rk_paged_decode_bf16(const float *q, const int64_t *q_rows, int64_t num_seqs,
                         const uint16_t *k_pool, const uint16_t *v_pool, const int32_t *block_tables,
                         int64_t max_blocks, const int32_t *kv_lens, int block_size, int hq, int hkv,
                         int d, float scale, int64_t window_left, int64_t chunk_tokens, float *out,
                         int num_threads) {
    return paged_decode_entry(q, q_rows, num_seqs, k_pool, v_pool, block_tables, max_blocks, kv_lens,
                              block_size, hq, hkv, d, scale, window_left, chunk_tokens, out,
                              num_threads, RK_KV_BF16, NULL, NULL);
}

/* As rk_paged_decode_f32 over quantized pools: kind RK_KV_I8 (int8) or RK_KV_FP8
 * (float8_e4m3fn bytes), k_scales / v_scales [blocks * block_size, hkv] fp32 (one scale per
 * slot and KV head; a key is float32(k_pool value) * its scale). Returns 1 also on another kind. */
int rk_paged_decode_q(const float *q, const int64_t *q_rows, int64_t num_seqs, const void *k_pool,
                      const void *v_pool, const float *k_scales, const float *v_scales,
                      const int32_t *block_tables, int64_t max_blocks, const int32_t *kv_lens,
                      int block_size, int hq, int hkv, int d, float scale, int64_t window_left,
                      int64_t chunk_tokens, float *out, int num_threads, int kind) {
    if (kind != RK_KV_I8 && kind != RK_KV_FP8) return 1;
    return paged_decode_entry(q, q_rows, num_seqs, k_pool, v_pool, block_tables, max_blocks, kv_lens,
                              block_size, hq, hkv, d, scale, window_left, chunk_tokens, out,
                              num_threads, kind, k_scales, v_scales);
}

/* ---- a whole decoder layer ---- */

/* x[t] = w * x_in[t] / sqrt(mean(x_in[t]^2) + eps) for each of m rows of k (k % 8 == 0). */
static void rms_norm_rows(const float *x_in, int64_t m, int64_t k, const float *w, float eps, float *x) {
    const int64_t k_main = k - k % RK_VL;
    const int rem = (int)(k - k_main);
    for (int64_t i = 0; i < m; i++) {
        const float *r = x_in + i * k;
        float *o = x + i * k;
        rkv ss = rkv_zero();
        for (int64_t j = 0; j < k_main; j += RK_VL) {
            const rkv v = rkv_load(r + j);
            ss = rkv_fma(v, v, ss);
        }
        if (rem) {
            const rkv v = rkv_load_n(r + k_main, rem);
            ss = rkv_fma(v, v, ss);
        }
        const rkv inv = rkv_set1(1.0f / sqrtf(rkv_hsum(ss) / (float)k + eps));
        for (int64_t j = 0; j < k_main; j += RK_VL)
            rkv_store(o + j, rkv_mul(rkv_load(w + j), rkv_mul(rkv_load(r + j), inv)));
        if (rem)
            rkv_store_n(o + k_main, rkv_mul(rkv_load_n(w + k_main, rem),
                                            rkv_mul(rkv_load_n(r + k_main, rem), inv)), rem);
    }
}

/* Half-split rotary embedding (HF layout: pair i is (x[i], x[i + d/2])) of `heads` heads of
 * one row, in place; cos/sin are that position's [d] rows (each half repeated). */
static void rope_row(float *x, int heads, int d, const float *cos, const float *sin) {
    const int half = d / 2;
    for (int h = 0; h < heads; h++) {
        float *xh = x + (int64_t)h * d;
        for (int i = 0; i < half; i++) {
            const float a = xh[i], b = xh[i + half];
            xh[i] = a * cos[i] - b * sin[i];
            xh[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* float8_e4m3fn bits of f, rounded to nearest even, for |f| <= 448 (larger and NaN: 0x7F,
 * NaN): c10's fp8e4m3fn_from_fp32_value (PyTorch, c10/util/Float8_e4m3fn.h), which torch's
 * .to(torch.float8_e4m3fn) computes. Below 2^-6 (subnormal e4m3fn) adding 2^14 rounds the
 * fp32 at the subnormal step 2^-9, whose multiple is then the mantissa field; above, the
 * exponent is rebiased (7 - 127) and the 20 dropped mantissa bits rounded half to even. */
static inline uint8_t fp8_e4m3_from_f32(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t sign = bits & UINT32_C(0x80000000);
    bits ^= sign;
    uint8_t r;
    if (bits >= (UINT32_C(1087) << 20)) {  /* >= 480 (after rounding past 448), inf, NaN */
        r = 0x7F;
    } else if (bits < (UINT32_C(121) << 23)) {
        const uint32_t denorm_mask = UINT32_C(141) << 23;
        float x, m;
        memcpy(&x, &bits, sizeof x);
        memcpy(&m, &denorm_mask, sizeof m);
        x += m;
        uint32_t xb;
        memcpy(&xb, &x, sizeof xb);
        r = (uint8_t)(xb - denorm_mask);
    } else {
        const uint32_t mant_odd = (bits >> 20) & 1;
        bits += ((uint32_t)(7 - 127) << 23) + UINT32_C(0x7FFFF);
        bits += mant_odd;
        r = (uint8_t)(bits >> 20);
    }
    return (uint8_t)(r | (sign >> 24));
}

/* kernels/kv_quant.py's quantize_kv of one KV head's [d] fp32 row, the same fp32 operations in
 * the same order, so the bytes and the scale are those of torch bit for bit:
 *   amax = max |x|; scale = amax / QMAX, inv = QMAX / amax (both 0 when amax == 0);
 *   int8: q = clamp(round_half_even(x * inv), -127, 127)   (nearbyintf: the default rounding)
 *   fp8:  q = e4m3fn_rne(clamp(x * inv, -448, 448))
 * A NaN in x is skipped by the max (torch's amax propagates it): NaN rows are not a format. */
static void rk_quantize_head(const float *x, int d, void *q, float *scale_out, int kind) {
    const float qmax = kind == RK_KV_I8 ? 127.0f : 448.0f;
    float amax = 0.0f;
    for (int j = 0; j < d; j++) {
        const float a = fabsf(x[j]);
        amax = a > amax ? a : amax;
    }
    float scale = 0.0f, inv = 0.0f;
    if (amax > 0.0f) {
        scale = amax / qmax;
        inv = qmax / amax;
    }
    *scale_out = scale;
    if (kind == RK_KV_I8) {
        int8_t *o = q;
        for (int j = 0; j < d; j++) {
            float r = nearbyintf(x[j] * inv);
            r = r < -127.0f ? -127.0f : r > 127.0f ? 127.0f : r;
            o[j] = (int8_t)r;
        }
    } else {
        uint8_t *o = q;
        for (int j = 0; j < d; j++) {
            float c = x[j] * inv;
            c = c < -448.0f ? -448.0f : c > 448.0f ? 448.0f : c;
            o[j] = fp8_e4m3_from_f32(c);
        }
    }
}

/* One token's hkv heads of n = hkv * d floats to its pool slot: copied, rounded to bf16, or
 * quantized per head (values to dst + slot * n elements, scales to scales + slot * hkv). */
static void store_kv(void *pool, float *scales, int64_t slot, const float *src, int hkv, int d, int kind) {
    const int64_t n = (int64_t)hkv * d;
    if (kind == RK_KV_F32) {
        memcpy((float *)pool + slot * n, src, sizeof(float) * (size_t)n);
    } else if (kind == RK_KV_BF16) {
        uint16_t *o = (uint16_t *)pool + slot * n;
        for (int64_t j = 0; j < n; j += RK_VL) rkv_store_bf16(o + j, rkv_load(src + j));
    } else {
        for (int h = 0; h < hkv; h++)
            rk_quantize_head(src + (int64_t)h * d, d, (int8_t *)pool + slot * n + (int64_t)h * d,
                             scales + slot * hkv + h, kind);
    }
}

/* K and V rows of num_tokens tokens ([T, hkv, d], fp32 or (x_bf16) bf16, contiguous) quantized
 * (rk_quantize_head) into their pool slots: values to k_pool / v_pool [slots, hkv, d] of kind
 * RK_KV_I8 or RK_KV_FP8, scales to k_scales / v_scales [slots, hkv] fp32. Tokens in parallel.
 * Returns 0, or 1 on another kind or a d outside [1, RK_MAX_DIM]. */
int rk_paged_kv_write_q(const void *k, const void *v, int x_bf16, const int64_t *slots, int64_t num_tokens,
                        int hkv, int d, void *k_pool, void *v_pool, float *k_scales, float *v_scales,
                        int kind, int num_threads) {
    if ((kind != RK_KV_I8 && kind != RK_KV_FP8) || d < 1 || d > RK_MAX_DIM || hkv < 1) return 1;
    const int64_t n = (int64_t)hkv * d;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < num_tokens; i++) {
        float row[RK_MAX_DIM];
        for (int src = 0; src < 2; src++) {
            const void *x = src ? v : k;
            void *pool = src ? v_pool : k_pool;
            float *scales = src ? v_scales : k_scales;
            for (int h = 0; h < hkv; h++) {
                const int64_t at = i * n + (int64_t)h * d;
                if (x_bf16) {
                    const uint16_t *xb = (const uint16_t *)x + at;
                    for (int j = 0; j < d; j++) {
                        const uint32_t w = (uint32_t)xb[j] << 16;
                        memcpy(row + j, &w, sizeof w);
                    }
                } else {
                    memcpy(row, (const float *)x + at, sizeof(float) * (size_t)d);
                }
                rk_quantize_head(row, d, (int8_t *)pool + slots[i] * n + (int64_t)h * d,
                                 scales + slots[i] * hkv + h, kind);
            }
        }
    }
    return 0;
}

/* g[j] = silu(g[j]) * u[j] = g[j] * u[j] / (1 + exp(-g[j])), n % 8 == 0. */
static void silu_mul(float *g, const float *u, int64_t n) {
    const rkv one = rkv_set1(1.0f), zero = rkv_zero();
    int64_t j = 0;
    for (; j + RK_VL <= n; j += RK_VL) {
        const rkv gv = rkv_load(g + j);
        rkv_store(g + j, vdiv(rkv_mul(gv, rkv_load(u + j)), rkv_add(one, rkv_exp(rkv_sub(zero, gv)))));
    }
    if (j < n) {
        const int rem = (int)(n - j);
        const rkv gv = rkv_load_n(g + j, rem);
        rkv_store_n(g + j, vdiv(rkv_mul(gv, rkv_load_n(u + j, rem)),
                                rkv_add(one, rkv_exp(rkv_sub(zero, gv)))), rem);
    }
}

/* Wall seconds the decode layers spent in attention (the paged decode part of each call), summed
 * since the last rk_take_attention_seconds: the fused layer has no boundary a caller could time.
 * Written by the region's master thread between the barriers that close the K/V write and the
 * attention merge, so it is the attention's wall time on all threads; one engine thread calls. */
static double rk_attention_seconds_acc;

static inline double rk_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double rk_take_attention_seconds(void) {
    const double s = rk_attention_seconds_acc;
    rk_attention_seconds_acc = 0.0;
    return s;
}

static int decode_layer_entry(float *hidden, int64_t num_seqs, int64_t hd, int64_t inter,
                              const float *input_norm, const void *w_qkv, const float *b_qkv,
                              const void *w_o, const float *post_norm, const void *w_gate_up,
                              const void *w_down, float eps, const float *cos, const float *sin,
                              const int64_t *slots, void *k_pool, void *v_pool,
                              const int32_t *block_tables, int64_t max_blocks, const int32_t *kv_lens,
                              const int64_t *q_rows, int block_size, int hq, int hkv, int d,
                              float scale, int64_t window_left, int64_t chunk_tokens, int num_threads,
                              int bf16, int kind, float *k_scales, float *v_scales) {
    if (!decode_shape_ok(hq, hkv, d, chunk_tokens, block_size) || hd % 8 || inter % 8 || num_seqs < 1)
        return 1;
    const int64_t t = num_seqs, qkv_n = (int64_t)(hq + 2 * hkv) * d, q_n = (int64_t)hq * d;
    const int64_t kv_row = (int64_t)hkv * d;
    int64_t *task_start = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (!task_start) return 2;
    const int64_t num_tasks = plan_tasks(kv_lens, num_seqs, window_left, chunk_tokens, task_start);
    /* x: normed rows; qkv; attn; gu (gate | up), then act in its first half of each row;
     * parts; q (the rotated queries, packed for decode_for) */
    float *buf = malloc(sizeof(float) * (t * hd + t * qkv_n + t * q_n + t * 2 * inter
                                         + (num_tasks > 0 ? num_tasks : 1) * hq * (d + 2) + t * q_n));
    if (!buf) {
        free(task_start);
        return 2;
    }
    float *x = buf, *qkv = x + t * hd, *attn = qkv + t * qkv_n, *gu = attn + t * q_n;
    float *parts = gu + t * 2 * inter;
    float *q = parts + (num_tasks > 0 ? num_tasks : 1) * hq * (d + 2);
    const decode_args a = {q, q_rows, num_seqs, k_pool, v_pool, block_tables, max_blocks, kv_lens,
                           block_size, hq, hkv, d, scale, window_left, chunk_tokens, task_start,
                           parts, attn, kind, k_scales, v_scales};
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp single
        rms_norm_rows(hidden, t, hd, input_norm, eps, x);
        linear_for(x, t, hd, w_qkv, qkv_n, b_qkv, qkv, 0, bf16);
#pragma omp single
        for (int64_t i = 0; i < t; i++) {
            float *row = qkv + i * qkv_n;
            rope_row(row, hq + hkv, d, cos + i * d, sin + i * d);  /* q and k heads are adjacent */
            memcpy(q + i * q_n, row, sizeof(float) * q_n);
            store_kv(k_pool, k_scales, slots[i], row + q_n, hkv, d, kind);
            store_kv(v_pool, v_scales, slots[i], row + q_n + kv_row, hkv, d, kind);
        }
        double attn_t0 = 0.0;  /* the single above ended at a barrier: every thread is here */
#pragma omp master
        attn_t0 = rk_now_s();
        decode_for(&a);  /* ends at its merge loop's barrier */
#pragma omp master
        rk_attention_seconds_acc += rk_now_s() - attn_t0;
        linear_for(attn, t, q_n, w_o, hd, NULL, hidden, 1, bf16);
#pragma omp single
        rms_norm_rows(hidden, t, hd, post_norm, eps, x);
        linear_for(x, t, hd, w_gate_up, 2 * inter, NULL, gu, 0, bf16);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < t; i++) silu_mul(gu + i * 2 * inter, gu + i * 2 * inter + inter, inter);
        /* act rows sit at stride 2 * inter: pack them for the down projection */
#pragma omp single
        for (int64_t i = 1; i < t; i++) memmove(gu + i * inter, gu + i * 2 * inter, sizeof(float) * inter);
        linear_for(gu, t, inter, w_down, hd, NULL, hidden, 1, bf16);
    }
    free(buf);
    free(task_start);
    return 0;
}

/* One whole Llama decoder layer for a decode step (one row per sequence, row i = sequence i),
 * in one parallel region: RMSNorm, fused q/k/v projection (+ bias), RoPE, K/V written to their
 * pool slots, paged decode attention, output projection + residual, RMSNorm, fused gate/up,
 * SiLU(gate) * up, down projection + residual. `hidden` [T, hd] fp32 is updated in place.
 *   w_qkv [(hq + 2 hkv) d, hd], b_qkv [(hq + 2 hkv) d] or NULL, w_o [hd, hq d],
 *   w_gate_up [2 inter, hd], w_down [hd, inter], norms [hd]; cos/sin [T, d] (rows of the
 *   positions); slots [T] flat pool slots; pools [M * B, hkv, d].
 * Returns 0, 1 on unsupported shapes, 2 on out of memory. */
int rk_decode_layer_f32(float *hidden, int64_t num_seqs, int64_t hd, int64_t inter,
                        const float *input_norm, const float *w_qkv, const float *b_qkv,
                        const float *w_o, const float *post_norm, const float *w_gate_up,
                        const float *w_down, float eps, const float *cos, const float *sin,
                        const int64_t *slots, float *k_pool, float *v_pool,
                        const int32_t *block_tables, int64_t max_blocks, const int32_t *kv_lens,
                        const int64_t *q_rows, int block_size, int hq, int hkv, int d, float scale,
                        int64_t window_left, int64_t chunk_tokens, int num_threads) {
    return decode_layer_entry(hidden, num_seqs, hd, inter, input_norm, w_qkv, b_qkv, w_o, post_norm,
                              w_gate_up, w_down, eps, cos, sin, slots, k_pool, v_pool, block_tables,
                              max_blocks, kv_lens, q_rows, block_size, hq, hkv, d, scale, window_left,
                              chunk_tokens, num_threads, 0, RK_KV_F32, NULL, NULL);
}

/* As rk_decode_layer_f32 with bf16 projection weights and bf16 pools; hidden, norms, bias and
 * cos/sin stay fp32. */
int rk_decode_layer_bf16(float *hidden, int64_t num_seqs, int64_t hd, int64_t inter,
                         const float *input_norm, const uint16_t *w_qkv, const float *b_qkv,
                         const uint16_t *w_o, const float *post_norm, const uint16_t *w_gate_up,
                         const uint16_t *w_down, float eps, const float *cos, const float *sin,
                         const int64_t *slots, uint16_t *k_pool, uint16_t *v_pool,
                         const int32_t *block_tables, int64_t max_blocks, const int32_t *kv_lens,
                         const int64_t *q_rows, int block_size, int hq, int hkv, int d, float scale,
                         int64_t window_left, int64_t chunk_tokens, int num_threads) {
    return decode_layer_entry(hidden, num_seqs, hd, inter, input_norm, w_qkv, b_qkv, w_o, post_norm,
                              w_gate_up, w_down, eps, cos, sin, slots, k_pool, v_pool, block_tables,
                              max_blocks, kv_lens, q_rows, block_size, hq, hkv, d, scale, window_left,
                              chunk_tokens, num_threads, 1, RK_KV_BF16, NULL, NULL);
}

/* As rk_decode_layer_f32 with fp32 (weights_bf16 == 0) or bf16 (1) weights over quantized
 * pools: kind RK_KV_I8 or RK_KV_FP8, k_scales / v_scales [M * B, hkv] fp32. The new tokens' K/V
 * are quantized from the layer's fp32 rows (rk_quantize_head: kernels/kv_quant.py bit for bit)
 * into their slots before attention reads them back dequantized. Returns 1 also on another
 * kind. */
int rk_decode_layer_q(float *hidden, int64_t num_seqs, int64_t hd, int64_t inter,
                      const float *input_norm, const void *w_qkv, const float *b_qkv,
                      const void *w_o, const float *post_norm, const void *w_gate_up,
                      const void *w_down, float eps, const float *cos, const float *sin,
                      const int64_t *slots, void *k_pool, void *v_pool,
                      const int32_t *block_tables, int64_t max_blocks, const int32_t *kv_lens,
                      const int64_t *q_rows, int block_size, int hq, int hkv, int d, float scale,
                      int64_t window_left, int64_t chunk_tokens, int num_threads, int weights_bf16,
                      float *k_scales, float *v_scales, int kind) {
    if (kind != RK_KV_I8 && kind != RK_KV_FP8) return 1;
    return decode_layer_entry(hidden, num_seqs, hd, inter, input_norm, w_qkv, b_qkv, w_o, post_norm,
                              w_gate_up, w_down, eps, cos, sin, slots, k_pool, v_pool, block_tables,
                              max_blocks, kv_lens, q_rows, block_size, hq, hkv, d, scale, window_left,
                              chunk_tokens, num_threads, weights_bf16 ? 1 : 0, kind, k_scales, v_scales);
}
