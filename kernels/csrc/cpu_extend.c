/* radixkv CPU kernels: extend / prefill attention over the paged KV pool (fp32 math).
 *
 * Rows with L >= 1 query tokens per sequence (a cold prefill, a suffix after a prefix hit, a
 * chunk of a chunked prefill): query j of sequence i sits at position P_i + j and sees keys
 * 0 .. P_i + j (the whole cached prefix, causal within its own suffix), optionally cut to a
 * sliding window. The step's own K/V were already written to the pool, so every key is read
 * from the pool through the block table; nothing is gathered by the caller.
 *
 * Algorithm: FlashAttention-2 (T. Dao, "FlashAttention-2: Faster Attention with Better
 * Parallelism and Work Partitioning", 2023, https://arxiv.org/abs/2307.08691) laid out for a
 * CPU core instead of a GPU thread block:
 *   - phase 1 packs each sequence's keys, per KV head and per tile of RK_KT positions, into
 *     K^T and V fp32 tiles stored pass-major (K^T as [RK_KT / RK_W][D][RK_W], V as
 *     [ceil(D / RK_W)][RK_KT][<= RK_W]: one microkernel column pass each), zero past the
 *     sequence's end. bf16 pools are widened here, once; int8 and float8_e4m3fn pools are
 *     dequantized here, once: float32(q) * its (token, KV head) scale, the exact values
 *     kernels/kv_quant.py's dequantize_kv gives. This is the pool read; every query tile of
 *     the sequence then reuses the packed tiles, so the transpose and the block-table walk
 *     cost O(S D), not O(S^2 D);
 *   - phase 2's work items are (sequence, KV head, tile of query tokens); a work item's rows
 *     are its tokens x the Hq / Hkv query heads sharing that KV head (GQA: each key tile is
 *     read once for all of them). Items run under a dynamic schedule, heaviest (most query-key
 *     pairs) first, so the long diagonal-heavy items do not end up last on one thread;
 *   - per item, key tiles are visited left to right, skipping tiles wholly above the causal
 *     diagonal or left of the window; only tiles that straddle the diagonal, the window's edge
 *     or the sequence's end are masked. S = Q K^T and O += P V are register-blocked
 *     microkernels (RK_RB rows x up to RK_NV vectors of accumulators, held in registers across
 *     the whole reduction), and the softmax is online: running max and sum per row, the row's
 *     O rescaled when the max moves by more than a bound (a lazy max: see run_item).
 *
 * One source for both ISAs (rk_vec.h): AVX-512 uses 6 rows x 4 zmm accumulators (24 of 32
 * registers), AVX2 6 rows x 2 ymm (12 of 16) with more column passes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rk_vec.h"

#define RK_KT 64         /* keys per tile (a multiple of RK_VL in both builds) */
#define RK_RB 6          /* rows per microkernel block */
/* Target rows (tokens x group heads) per work item: each item streams its sequence's packed
 * K/V once, so more rows read it fewer times. On a Zen 3, 192 against 96: cold prefill attention
 * 8-12 % faster at 4,096 and 8,192 tokens, the same at 2,048 and for 512-token extends. */
#define RK_ROWS 192
#define RK_MAX_DIM 256
#define RK_LAZY 8.0f     /* log2 units the running max may trail a tile's max (softmax below) */
/* Accumulator vectors per row (2 or 4): 4 x 16 floats on AVX-512, 2 x 8 on AVX2. A build may
 * set it (-DRK_NV=4 on AVX2: slower, register spills, but another pass width, so the tests can
 * run the AVX-512 build's tile layout on an AVX2-only CPU). */
#ifndef RK_NV
#if RK_AVX512
#define RK_NV 4
#else
#define RK_NV 2
#endif
#endif
#if RK_NV != 2 && RK_NV != 4
#error "RK_NV must be 2 or 4"
#endif
/* Width of one microkernel column pass (keys in QK, features in PV). Packed tiles are stored
 * pass-major ([pass][rows][RK_W]): each pass streams one contiguous run instead of an RK_W-wide
 * stripe of RK_KT- or d-float rows (1-3 % faster on a Zen 3 than row-major tiles). */
#define RK_W (RK_NV * RK_VL)
#if RK_KT % (RK_NV * RK_VL) != 0
#error "RK_KT must be a multiple of the pass width"
#endif

#define RK_INLINE static inline __attribute__((always_inline))
/* Unrolled before the accumulator arrays are assigned to registers: without it GCC 12 kept
 * them on the stack across each microkernel's prologue and epilogue (~10 % slower). */
#define RK_UNROLL _Pragma("GCC unroll 8")

/* s[r][c] = sum_e q[r][e] * kt[e][c] for rb rows and nv vectors of columns; q rows at stride d,
 * kt rows (one pass of the packed K^T tile) at stride RK_W, s rows at stride RK_KT. rb and nv
 * are constants at every call site (the dispatch below), so the loops unroll and the
 * accumulators live in registers. */
RK_INLINE void qk_block(const float *q, int d, const float *kt, float *s, const int rb, const int nv) {
    rkv acc[RK_RB][RK_NV];
    RK_UNROLL
    for (int r = 0; r < rb; r++)
        RK_UNROLL
        for (int c = 0; c < nv; c++) acc[r][c] = rkv_zero();
    for (int e = 0; e < d; e++) {
        const float *kr = kt + (int64_t)e * RK_W;
        rkv kv[RK_NV];
        RK_UNROLL
        for (int c = 0; c < nv; c++) kv[c] = rkv_load_aligned(kr + c * RK_VL);
        RK_UNROLL
        for (int r = 0; r < rb; r++) {
            const rkv qb = rkv_set1(q[(int64_t)r * d + e]);
            RK_UNROLL
            for (int c = 0; c < nv; c++) acc[r][c] = rkv_fma(qb, kv[c], acc[r][c]);
        }
    }
    RK_UNROLL
    for (int r = 0; r < rb; r++)
        RK_UNROLL
        for (int c = 0; c < nv; c++) rkv_store_aligned(s + (int64_t)r * RK_KT + c * RK_VL, acc[r][c]);
}

/* o[r][0 : nv*RK_VL] += sum_t p[r][t] * v[t][0 : nv*RK_VL] for t < nk; p rows at stride
 * RK_KT, o rows at stride d, v rows (one pass of the packed V tile) at stride vs (o and v
 * already offset to the column pass). */
RK_INLINE void pv_block(const float *p, const float *v, int vs, int nk, float *o, int d, const int rb,
                        const int nv) {
    rkv acc[RK_RB][RK_NV];
    RK_UNROLL
    for (int r = 0; r < rb; r++)
        RK_UNROLL
        for (int c = 0; c < nv; c++) acc[r][c] = rkv_load_aligned(o + (int64_t)r * d + c * RK_VL);
    for (int t = 0; t < nk; t++) {
        const float *vr = v + (int64_t)t * vs;
        rkv vv[RK_NV];
        RK_UNROLL
        for (int c = 0; c < nv; c++) vv[c] = rkv_load_aligned(vr + c * RK_VL);
        RK_UNROLL
        for (int r = 0; r < rb; r++) {
            const rkv pb = rkv_set1(p[(int64_t)r * RK_KT + t]);
            RK_UNROLL
            for (int c = 0; c < nv; c++) acc[r][c] = rkv_fma(pb, vv[c], acc[r][c]);
        }
    }
    RK_UNROLL
    for (int r = 0; r < rb; r++)
        RK_UNROLL
        for (int c = 0; c < nv; c++) rkv_store_aligned(o + (int64_t)r * d + c * RK_VL, acc[r][c]);
}

typedef void (*qk_fn)(const float *, int, const float *, float *);
typedef void (*pv_fn)(const float *, const float *, int, int, float *, int);

#define RK_DEF(rb, nv)                                                                         \
    static void qk_##rb##_##nv(const float *q, int d, const float *kt, float *s) {             \
        qk_block(q, d, kt, s, rb, nv);                                                         \
    }                                                                                          \
    static void pv_##rb##_##nv(const float *p, const float *v, int vs, int nk, float *o, int d) { \
        pv_block(p, v, vs, nk, o, d, rb, nv);                                                  \
    }
#define RK_DEF_ROWS(nv) RK_DEF(1, nv) RK_DEF(2, nv) RK_DEF(3, nv) RK_DEF(4, nv) RK_DEF(5, nv) RK_DEF(6, nv)
RK_DEF_ROWS(1)
RK_DEF_ROWS(2)
#if RK_NV == 4
RK_DEF_ROWS(3)
RK_DEF_ROWS(4)
#define RK_TABLE(f, rb) {f##_##rb##_1, f##_##rb##_2, f##_##rb##_3, f##_##rb##_4}
#else
#define RK_TABLE(f, rb) {f##_##rb##_1, f##_##rb##_2}
#endif
/* [rb - 1][nv - 1] */
static const qk_fn qk_table[RK_RB][RK_NV] = {RK_TABLE(qk, 1), RK_TABLE(qk, 2), RK_TABLE(qk, 3),
                                             RK_TABLE(qk, 4), RK_TABLE(qk, 5), RK_TABLE(qk, 6)};
static const pv_fn pv_table[RK_RB][RK_NV] = {RK_TABLE(pv, 1), RK_TABLE(pv, 2), RK_TABLE(pv, 3),
                                             RK_TABLE(pv, 4), RK_TABLE(pv, 5), RK_TABLE(pv, 6)};

typedef struct {
    const float *q;              /* [T, hq, d], rows q_stride floats apart */
    int64_t q_stride;
    const int64_t *qo_indptr;    /* [N + 1] */
    const int32_t *prefix_lens;  /* [N] */
    int64_t num_seqs;
    const void *k_pool, *v_pool; /* [M * B, hkv, d] of kind */
    int kind;                    /* RK_KV_* (rk_vec.h) */
    const float *k_scales, *v_scales;  /* quantized kinds: [M * B, hkv] fp32; else NULL */
    const int32_t *block_tables;
    int64_t max_blocks;
    int block_size, hq, hkv, d;
    float scale;
    int64_t window_left;
    float *out;                  /* [T, hq, d] */
    const int64_t *tile_start;   /* [N + 1] first packed tile (per KV head) of each sequence */
    float *packed;               /* [tiles, hkv, 2, RK_KT * d]: K^T tile then V tile */
    int64_t num_items, q_tile;
    const int64_t *items;        /* [num_items, 3]: sequence, KV head, first query token */
} extend_args;

static inline int64_t kv_len_of(const extend_args *a, int64_t i) {
    return a->prefix_lens[i] + (a->qo_indptr[i + 1] - a->qo_indptr[i]);
}

/* The first key any query of sequence i may see (the window's left edge at its first query). */
static inline int64_t first_key_of(const extend_args *a, int64_t i) {
    const int64_t lo = a->prefix_lens[i] - a->window_left;
    return a->window_left >= 0 && lo > 0 ? lo : 0;
}

static inline float *packed_tile(const extend_args *a, int64_t i, int64_t tile, int kvh) {
    return a->packed + ((a->tile_start[i] + tile) * a->hkv + kvh) * (int64_t)2 * RK_KT * a->d;
}

/* In-place transpose of an RK_VL x RK_VL block held in RK_VL vectors (r[x] lane y becomes
 * r[y] lane x). Three shuffle stages over log2 of the width: 32-bit pairs, 64-bit pairs, then
 * 128-bit lanes (one permute on AVX2, two rounds of shuffle_f32x4 on AVX-512). */
static inline void transpose_block(rkv r[RK_VL]) {
    rkv a[RK_VL], b[RK_VL];
    for (int i = 0; i < RK_VL; i += 2) {
#if RK_AVX512
        a[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        a[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
#else
        a[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        a[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
#endif
    }
    /* b[4j + k], 128-bit lane l: column 4l + k of rows 4j .. 4j + 3 */
    for (int j = 0; j < RK_VL; j += 4) {
#if RK_AVX512
#define RK_PD(x) _mm512_castps_pd(x)
        b[j] = _mm512_castpd_ps(_mm512_unpacklo_pd(RK_PD(a[j]), RK_PD(a[j + 2])));
        b[j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(RK_PD(a[j]), RK_PD(a[j + 2])));
        b[j + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(RK_PD(a[j + 1]), RK_PD(a[j + 3])));
        b[j + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(RK_PD(a[j + 1]), RK_PD(a[j + 3])));
#undef RK_PD
#else
#define RK_PD(x) _mm256_castps_pd(x)
        b[j] = _mm256_castpd_ps(_mm256_unpacklo_pd(RK_PD(a[j]), RK_PD(a[j + 2])));
        b[j + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(RK_PD(a[j]), RK_PD(a[j + 2])));
        b[j + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(RK_PD(a[j + 1]), RK_PD(a[j + 3])));
        b[j + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(RK_PD(a[j + 1]), RK_PD(a[j + 3])));
#undef RK_PD
#endif
    }
    /* output column 4l + k, lane m = b[4m + k] lane l: a 4 x 4 (AVX-512) or 2 x 2 (AVX2)
     * transpose of 128-bit lanes */
    for (int k = 0; k < 4; k++) {
#if RK_AVX512
        const rkv c0 = _mm512_shuffle_f32x4(b[k], b[4 + k], 0x44);
        const rkv c1 = _mm512_shuffle_f32x4(b[k], b[4 + k], 0xEE);
        const rkv c2 = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0x44);
        const rkv c3 = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0xEE);
        r[k] = _mm512_shuffle_f32x4(c0, c2, 0x88);
        r[4 + k] = _mm512_shuffle_f32x4(c0, c2, 0xDD);
        r[8 + k] = _mm512_shuffle_f32x4(c1, c3, 0x88);
        r[12 + k] = _mm512_shuffle_f32x4(c1, c3, 0xDD);
#else
        r[k] = _mm256_permute2f128_ps(b[k], b[4 + k], 0x20);
        r[4 + k] = _mm256_permute2f128_ps(b[k], b[4 + k], 0x31);
#endif
    }
}

/* Phase 1: one (sequence, key tile) of every KV head into K^T and V tiles, zero past the end.
 * Keys go RK_VL positions at a time: their rows (each found through the block table) are read
 * RK_VL features at a time and transposed in registers, so K^T is written in whole aligned
 * vectors; scalar strided stores made this ~5x slower, which mattered when a short suffix
 * re-packs a long prefix in every layer. */
/* RK_VL values of a pool of `kind` from element i, as fp32; quantized kinds times `scale`. */
static inline rkv load_kv(const void *pool, int64_t i, int kind, float scale) {
    switch (kind) {
    case RK_KV_BF16: return rkv_load_bf16((const uint16_t *)pool + i);
    case RK_KV_I8: return rkv_mul(rkv_load_i8((const int8_t *)pool + i), rkv_set1(scale));
    case RK_KV_FP8: return rkv_mul(rkv_load_fp8((const uint8_t *)pool + i), rkv_set1(scale));
    default: return rkv_load((const float *)pool + i);
    }
}

static void pack_tile(const extend_args *a, int64_t i, int64_t tile) {
    const int d = a->d, hkv = a->hkv, bs = a->block_size, kind = a->kind;
    const int quant = kind == RK_KV_I8 || kind == RK_KV_FP8;
    const int64_t len = kv_len_of(a, i), k0 = tile * RK_KT;
    const int nk = len - k0 < RK_KT ? (int)(len - k0) : RK_KT;
    const int32_t *table = a->block_tables + i * a->max_blocks;
    const int64_t row = (int64_t)hkv * d;
    int64_t slot[RK_KT], off[RK_KT];  /* pool slot of each key; its row, head 0 */
    for (int c = 0; c < nk; c++) {
        const int64_t pos = k0 + c;
        slot[c] = (int64_t)table[pos / bs] * bs + pos % bs;
        off[c] = slot[c] * row;
    }
    for (int kvh = 0; kvh < hkv; kvh++) {
        float *kt = packed_tile(a, i, tile, kvh), *vt = kt + RK_KT * d;
        const int64_t h = (int64_t)kvh * d;
        /* a sequence's last tile: keys past nk read as zeros (only its last tile is short) */
        if (nk < RK_KT) memset(kt, 0, sizeof(float) * 2 * RK_KT * d);
        for (int c0 = 0; c0 < nk; c0 += RK_VL) {
            const int n = nk - c0 < RK_VL ? nk - c0 : RK_VL;
            for (int e = 0; e < d; e += RK_VL) {
                rkv blk[RK_VL];
                for (int x = 0; x < RK_VL; x++) {
                    if (x >= n) {
                        blk[x] = rkv_zero();
                    } else {
                        const float sc = quant ? a->k_scales[slot[c0 + x] * hkv + kvh] : 1.0f;
                        blk[x] = load_kv(a->k_pool, off[c0 + x] + h + e, kind, sc);
                    }
                }
                transpose_block(blk);
                float *kp = kt + ((int64_t)(c0 / RK_W) * d + e) * RK_W + c0 % RK_W;
                for (int x = 0; x < RK_VL; x++) rkv_store_aligned(kp + (int64_t)x * RK_W, blk[x]);
            }
            for (int x = 0; x < n; x++) {
                const int64_t t = c0 + x;
                const float sc = quant ? a->v_scales[slot[t] * hkv + kvh] : 1.0f;
                /* feature e of key t: pass e / RK_W, [RK_KT][w] with w that pass's width */
                for (int e0 = 0; e0 < d; e0 += RK_W) {
                    const int w = d - e0 < RK_W ? d - e0 : RK_W;
                    float *vr = vt + (int64_t)e0 * RK_KT + t * w;
                    if (kind == RK_KV_F32) {
                        memcpy(vr, (const float *)a->v_pool + off[t] + h + e0, sizeof(float) * w);
                    } else {
                        for (int e = 0; e < w; e += RK_VL)
                            rkv_store_aligned(vr + e, load_kv(a->v_pool, off[t] + h + e0 + e, kind, sc));
                    }
                }
            }
        }
    }
}

typedef struct {
    float *q, *o, *s, *m;
    rkv *l;  /* [rows] per-lane partial row sums */
} item_buffers;

/* 2^x for x <= RK_LAZY (a score minus its row's lazy running max, log2 units): x = n + f with
 * n an integer and |f| <= 1/2, 2^f by its degree-6 Taylor polynomial (coefficients
 * ln(2)^k / k!; relative error below 2e-7 on [-1/2, 1/2]), times 2^n. Inputs are clamped to
 * -126, so -inf gives 2^-126 (the caller zeroes hidden keys itself); 11 vector ops against
 * rkv_exp's ~20. */
static inline rkv exp2_bounded(rkv x) {
    x = rkv_max(x, rkv_set1(-126.0f));
#if RK_AVX512
    const rkv n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const rkv n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
    const rkv f = rkv_sub(x, n);
    rkv y = rkv_set1(1.5403530393381606e-4f);
    y = rkv_fma(y, f, rkv_set1(1.3333558146428443e-3f));
    y = rkv_fma(y, f, rkv_set1(9.6181291076284772e-3f));
    y = rkv_fma(y, f, rkv_set1(5.5504108664821580e-2f));
    y = rkv_fma(y, f, rkv_set1(2.4022650695910071e-1f));
    y = rkv_fma(y, f, rkv_set1(6.9314718055994531e-1f));
    y = rkv_fma(y, f, rkv_set1(1.0f));
#if RK_AVX512
    return _mm512_scalef_ps(y, n);
#else
    return rkv_ldexp_int(y, n);
#endif
}

/* Keys of the tile at k0 (nk of them) that a query at position pos may see: 0 .. pos - k0. */
static inline int block_keys(int64_t pos, int64_t k0, int nk) {
    const int64_t n = pos - k0 + 1;
    return n < 0 ? 0 : n < nk ? (int)n : nk;
}

/* Phase 2: one work item, start to finish (rows r = token t * group + head g). */
static void run_item(const extend_args *a, const int64_t *item, const item_buffers *buf) {
    const int d = a->d, hq = a->hq, group = a->hq / a->hkv;
    const int64_t i = item[0], j0 = item[2];
    const int kvh = (int)item[1];
    const int64_t P = a->prefix_lens[i], L = a->qo_indptr[i + 1] - a->qo_indptr[i];
    const int64_t j1 = j0 + a->q_tile < L ? j0 + a->q_tile : L;
    const int tokens = (int)(j1 - j0), rows = tokens * group;
    const int64_t len = P + L, wl = a->window_left;
    const int64_t pos_lo = P + j0, pos_hi = P + j1 - 1;  /* first / last query position */
    float *qb = buf->q, *o = buf->o, *s = buf->s, *m = buf->m;
    rkv *l = buf->l;
    /* scores in log2 units (softmax(x) = 2^(x log2 e) / sum): exp2 needs no range-reduction
     * multiply */
    const rkv vscale = rkv_set1(a->scale * 1.44269504088896341f);

    for (int t = 0; t < tokens; t++) {
        const float *src = a->q + (a->qo_indptr[i] + j0 + t) * a->q_stride + (int64_t)kvh * group * d;
        for (int x = 0; x < group * d; x += RK_VL)
            rkv_store_aligned(qb + (int64_t)t * group * d + x, rkv_mul(rkv_load(src + x), vscale));
    }
    memset(o, 0, sizeof(float) * rows * d);
    for (int r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = rkv_zero();
    }

    const int64_t key_lo = wl >= 0 && pos_lo - wl > 0 ? pos_lo - wl : 0;
    const int64_t tile_lo = key_lo / RK_KT, tile_hi = pos_hi / RK_KT;  /* inclusive */
    const int cv = RK_KT / RK_VL, dv = d / RK_VL;
    for (int64_t tile = tile_lo; tile <= tile_hi; tile++) {
        const int64_t k0 = tile * RK_KT;
        const int nk = len - k0 < RK_KT ? (int)(len - k0) : RK_KT;
        const float *kt = packed_tile(a, i, tile, kvh), *vt = kt + RK_KT * d;
        /* masked unless every row sees every key of the tile */
        const int masked = nk < RK_KT || k0 + RK_KT - 1 > pos_lo || (wl >= 0 && k0 < pos_hi - wl);

        /* On a diagonal tile a row block needs only the keys up to its last row's position:
         * the columns past them are masked (-inf) below without being read. */
        for (int r0 = 0; r0 < rows; r0 += RK_RB) {
            const int rb = rows - r0 < RK_RB ? rows - r0 : RK_RB;
            const int need = block_keys(pos_lo + (r0 + rb - 1) / group, k0, nk);
            const int cvb = (need + RK_VL - 1) / RK_VL;
            for (int c = 0; c < cvb; c += RK_NV) {
                const int nv = cvb - c < RK_NV ? cvb - c : RK_NV;
                qk_table[rb - 1][nv - 1](qb + (int64_t)r0 * d, d, kt + (int64_t)c * RK_VL * d,
                                         s + (int64_t)r0 * RK_KT + c * RK_VL);
            }
        }

        /* online softmax, row by row. The running max is lazy: it moves only when a tile's
         * max exceeds it by more than RK_LAZY (log2 units), so p = 2^(s - m) <= 2^RK_LAZY stays
         * far from overflow while O rows are rescaled only on large jumps (any m works: the
         * final division by l cancels it exactly). Row sums stay vectors until the end. */
        for (int r = 0; r < rows; r++) {
            float *sr = s + (int64_t)r * RK_KT;
            rkv *lr = l + r;
            int lo = 0, hi = RK_KT;  /* the row's visible columns */
            if (masked) {
                const int64_t pos = pos_lo + r / group;
                const int64_t h = pos - k0 + 1, w = wl >= 0 ? pos - wl - k0 : 0;
                hi = h > nk ? nk : (int)h;
                lo = w < 0 ? 0 : w > RK_KT ? RK_KT : (int)w;
                if (hi <= lo) {  /* nothing visible in this tile: p = 0 */
                    memset(sr, 0, sizeof(float) * RK_KT);
                    continue;
                }
                for (int c = 0; c < lo; c++) sr[c] = -INFINITY;
            }
            /* columns at or past hi are never read as scores: chunks wholly past it are
             * skipped, the straddling one has its tail replaced */
            const int cvr = (hi + RK_VL - 1) / RK_VL;
            const int tail = hi - (cvr - 1) * RK_VL;
            rkv vm = rkv_fill_from(rkv_load_aligned(sr + (cvr - 1) * RK_VL), tail, -INFINITY);
            for (int c = 0; c < cvr - 1; c++) vm = rkv_max(vm, rkv_load_aligned(sr + c * RK_VL));
            const float tile_max = rkv_hmax(vm);
            if (tile_max > m[r] + RK_LAZY) {  /* also the row's first visible keys */
                const float alpha = exp2f(m[r] - tile_max);  /* m[r] = -inf: 0, O and l are 0 */
                if (m[r] != -INFINITY) {
                    const rkv va = rkv_set1(alpha);
                    float *orow = o + (int64_t)r * d;
                    for (int x = 0; x < dv; x++)
                        rkv_store_aligned(orow + x * RK_VL, rkv_mul(rkv_load_aligned(orow + x * RK_VL), va));
                    *lr = rkv_mul(*lr, va);
                }
                m[r] = tile_max;
            }
            const rkv vmax = rkv_set1(m[r]);
            rkv vs = *lr;
            /* Two vectors per iteration: each exp2 is a chain of ~12 dependent ops, and two
             * independent chains in one loop body keep both FMA pipes busy where one chain
             * per iteration left them waiting on its latency. The sum keeps its order. */
            int c = 0;
            for (; c + 2 < cvr; c += 2) {
                const rkv p0 = exp2_bounded(rkv_sub(rkv_load_aligned(sr + c * RK_VL), vmax));
                const rkv p1 = exp2_bounded(rkv_sub(rkv_load_aligned(sr + (c + 1) * RK_VL), vmax));
                rkv_store_aligned(sr + c * RK_VL, p0);
                rkv_store_aligned(sr + (c + 1) * RK_VL, p1);
                vs = rkv_add(rkv_add(vs, p0), p1);
            }
            for (; c < cvr; c++) {
                rkv p = exp2_bounded(rkv_sub(rkv_load_aligned(sr + c * RK_VL), vmax));
                if (c == cvr - 1) p = rkv_fill_from(p, tail, 0.0f);
                rkv_store_aligned(sr + c * RK_VL, p);
                vs = rkv_add(vs, p);
            }
            for (int c = cvr; c < cv; c++) rkv_store_aligned(sr + c * RK_VL, rkv_zero());
            if (lo > 0) {  /* exp2_bounded(-inf) is 2^-126, not 0: hidden keys get exactly 0 */
                for (int c = 0; c < lo; c++) sr[c] = 0.0f;
                vs = *lr;
                for (int c = 0; c < cvr; c++) vs = rkv_add(vs, rkv_load_aligned(sr + c * RK_VL));
            }
            *lr = vs;
        }

        for (int r0 = 0; r0 < rows; r0 += RK_RB) {
            const int rb = rows - r0 < RK_RB ? rows - r0 : RK_RB;
            const int need = block_keys(pos_lo + (r0 + rb - 1) / group, k0, nk);
            for (int c = 0; c < dv; c += RK_NV) {
                const int nv = dv - c < RK_NV ? dv - c : RK_NV;
                const int vs = d - c * RK_VL < RK_W ? d - c * RK_VL : RK_W;
                pv_table[rb - 1][nv - 1](s + (int64_t)r0 * RK_KT, vt + (int64_t)c * RK_VL * RK_KT, vs, need,
                                         o + (int64_t)r0 * d + c * RK_VL, d);
            }
        }
    }

    for (int t = 0; t < tokens; t++) {
        float *dst = a->out + ((a->qo_indptr[i] + j0 + t) * hq + (int64_t)kvh * group) * d;
        for (int g = 0; g < group; g++) {
            const int r = t * group + g;
            /* l > 0: every query sees its own key */
            const rkv inv = rkv_set1(1.0f / rkv_hsum(l[r]));
            for (int x = 0; x < dv; x++)
                rkv_store(dst + (int64_t)g * d + x * RK_VL,
                          rkv_mul(rkv_load_aligned(o + (int64_t)r * d + x * RK_VL), inv));
        }
    }
}

/* The packed tiles' buffer, kept per calling thread and grown to the largest call up to
 * RK_KEEP_BYTES (one layer's keys and values in fp32): a fresh multi-MB malloc is an mmap whose
 * first touch page faults, which cost ~10 % of a 2k-token prefill's attention when it happened
 * in every layer. Larger calls (long contexts, where attention's S^2 work dwarfs the faults)
 * allocate and free their own, so no thread keeps more than RK_KEEP_BYTES. */
#define RK_KEEP_BYTES ((size_t)64 << 20)
static _Thread_local float *tl_packed;
static _Thread_local size_t tl_packed_bytes;

static float *packed_buffer(size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    if (bytes == 0) bytes = 64;
    if (bytes > RK_KEEP_BYTES) return aligned_alloc(64, bytes);
    if (bytes > tl_packed_bytes) {
        free(tl_packed);
        tl_packed = aligned_alloc(64, bytes);
        tl_packed_bytes = tl_packed ? bytes : 0;
    }
    return tl_packed;
}

static void packed_release(float *packed) {
    if (packed != tl_packed) free(packed);
}

static int cmp_cost_desc(const void *x, const void *y) {
    const int64_t a = ((const int64_t *)x)[3], b = ((const int64_t *)y)[3];
    return a < b ? 1 : a > b ? -1 : 0;
}

static int extend(const float *q, int64_t q_stride, const int64_t *qo_indptr,
                  const int32_t *prefix_lens, int64_t num_seqs, const void *k_pool, const void *v_pool,
                  int kind, const float *k_scales, const float *v_scales, const int32_t *block_tables, int64_t max_blocks, int block_size, int hq,
                  int hkv, int d, float scale, int64_t window_left, float *out, int num_threads) {
    if (hkv < 1 || hq < 1 || hq % hkv || d < RK_VL || d % 16 || d > RK_MAX_DIM || block_size < 1
        || num_seqs < 0 || q_stride < (int64_t)hq * d)
        return 1;
    if (num_seqs == 0) return 0;
    const int group = hq / hkv;
    /* RK_ROWS rows per item, fewer when that leaves under 4 items per thread (a short chunk
     * after a long prefix: 3 KV heads on 2 threads would idle one thread a third of the time),
     * but never under one microkernel block of rows. */
    int64_t q_tile = group >= RK_ROWS ? 1 : RK_ROWS / group;
    {
        int64_t total = 0;
        for (int64_t i = 0; i < num_seqs; i++) total += qo_indptr[i + 1] - qo_indptr[i];
        const int64_t want_items = 4 * (int64_t)(num_threads > 0 ? num_threads : 1);
        const int64_t min_tile = (RK_RB + group - 1) / group;
        while (q_tile > min_tile && (total + q_tile - 1) / q_tile * hkv < want_items)
            q_tile = (q_tile + 1) / 2;
        if (q_tile < min_tile) q_tile = min_tile;
    }
    int64_t *tile_start = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (!tile_start) return 2;
    extend_args a = {q, q_stride, qo_indptr, prefix_lens, num_seqs, k_pool, v_pool, kind, k_scales,
                     v_scales, block_tables,
                     max_blocks, block_size, hq, hkv, d, scale, window_left, out, tile_start,
                     NULL, 0, q_tile, NULL};
    int64_t num_tiles = 0, num_items = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t L = qo_indptr[i + 1] - qo_indptr[i];
        if (L < 1) {
            free(tile_start);
            return 1;
        }
        tile_start[i] = num_tiles;
        num_tiles += (kv_len_of(&a, i) + RK_KT - 1) / RK_KT;
        num_items += (L + q_tile - 1) / q_tile * hkv;
    }
    tile_start[num_seqs] = num_tiles;
    /* packed tiles (64-byte aligned: the microkernels use aligned loads) and work items */
    const size_t packed_bytes = sizeof(float) * (size_t)num_tiles * hkv * 2 * RK_KT * d;
    float *packed = packed_buffer(packed_bytes);
    int64_t *items = malloc(sizeof(int64_t) * 4 * num_items);
    if (!packed || !items) {
        if (packed) packed_release(packed);
        free(items);
        free(tile_start);
        return 2;
    }
    int64_t n = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t P = prefix_lens[i], L = qo_indptr[i + 1] - qo_indptr[i];
        for (int64_t j0 = 0; j0 < L; j0 += q_tile) {
            const int64_t j1 = j0 + q_tile < L ? j0 + q_tile : L;
            const int64_t lo = window_left >= 0 && P + j0 - window_left > 0 ? P + j0 - window_left : 0;
            const int64_t cost = (j1 - j0) * (P + j1 - lo);  /* query-key pairs, rounded up */
            for (int kvh = 0; kvh < hkv; kvh++) {
                items[4 * n] = i;
                items[4 * n + 1] = kvh;
                items[4 * n + 2] = j0;
                items[4 * n + 3] = cost;
                n++;
            }
        }
    }
    qsort(items, (size_t)num_items, sizeof(int64_t) * 4, cmp_cost_desc);
    a.packed = packed;
    a.num_items = num_items;
    a.items = items;
    const int rows = (int)(q_tile * group);
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        /* phase 1: pack every tile some query reads (tiles left of every window are skipped) */
#pragma omp for schedule(dynamic, 4)
        for (int64_t u = 0; u < num_tiles; u++) {
            int64_t lo = 0, hi = num_seqs;  /* the sequence owning tile u */
            while (hi - lo > 1) {
                const int64_t mid = (lo + hi) / 2;
                if (tile_start[mid] <= u) lo = mid; else hi = mid;
            }
            const int64_t tile = u - tile_start[lo];
            if ((tile + 1) * RK_KT > first_key_of(&a, lo)) pack_tile(&a, lo, tile);
        }
        const size_t qo_floats = (size_t)rows * d, s_floats = (size_t)rows * RK_KT;
        /* sizes are multiples of 16 floats: 64 bytes, as aligned_alloc wants */
        const size_t m_floats = ((size_t)rows + 15) / 16 * 16;
        const size_t l_floats = ((size_t)rows * RK_VL + 15) / 16 * 16;
        float *mem = aligned_alloc(64, sizeof(float) * (2 * qo_floats + s_floats + l_floats + m_floats));
        if (!mem) {
#pragma omp atomic write
            failed = 1;
        }
        const item_buffers buf = {mem, mem ? mem + qo_floats : NULL, mem ? mem + 2 * qo_floats : NULL,
                                  mem ? mem + 2 * qo_floats + s_floats + l_floats : NULL,
                                  mem ? (rkv *)(mem + 2 * qo_floats + s_floats) : NULL};
        /* phase 2 (the implicit barrier above: every tile is packed) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < num_items; w++)
            if (mem) run_item(&a, items + 4 * w, &buf);
        free(mem);
    }
    free(items);
    packed_release(packed);
    free(tile_start);
    return failed ? 2 : 0;
}

/* Extend attention over the paged pool (module comment), fp32 pools.
 *   q: [T, hq, d] fp32, token rows q_stride >= hq * d floats apart (a view into a fused qkv
 *     row needs no copy); sequence i owns rows qo_indptr[i] .. qo_indptr[i+1]
 *   out: [T, hq, d] fp32 contiguous
 *   qo_indptr: [N + 1] int64; prefix_lens: [N] int32 (P_i; its L_i = qo_indptr[i+1] -
 *     qo_indptr[i] >= 1 keys after them are the step's own, already in the pool)
 *   k_pool, v_pool: [M * block_size, hkv, d] fp32; block_tables: [N, max_blocks] int32
 *     (trusted: every block a sequence reads must be a valid id)
 *   scale: softmax scale; window_left: a query at position p sees keys >= p - window_left, -1: all
 *   hq % hkv == 0, d a multiple of 16 in [16, 256]
 * Returns 0, 1 on unsupported shapes, 2 on out of memory. */
int rk_paged_extend_f32(const float *q, int64_t q_stride, const int64_t *qo_indptr,
                        const int32_t *prefix_lens, int64_t num_seqs, const float *k_pool,
                        const float *v_pool, const int32_t *block_tables, int64_t max_blocks,
                        int block_size, int hq, int hkv, int d, float scale, int64_t window_left,
                        float *out, int num_threads) {
    return extend(q, q_stride, qo_indptr, prefix_lens, num_seqs, k_pool, v_pool, RK_KV_F32, NULL, NULL,
                  block_tables, max_blocks, block_size, hq, hkv, d, scale, window_left, out, num_threads);
}

/* As rk_paged_extend_f32 with bf16 pools (uint16 upper halves of fp32, widened exactly);
 * q and out stay fp32. */
int rk_paged_extend_bf16(const float *q, int64_t q_stride, const int64_t *qo_indptr,
                         const int32_t *prefix_lens, int64_t num_seqs, const uint16_t *k_pool,
                         const uint16_t *v_pool, const int32_t *block_tables, int64_t max_blocks,
                         int block_size, int hq, int hkv, int d, float scale, int64_t window_left,
                         float *out, int num_threads) {
    return extend(q, q_stride, qo_indptr, prefix_lens, num_seqs, k_pool, v_pool, RK_KV_BF16, NULL, NULL,
                  block_tables, max_blocks, block_size, hq, hkv, d, scale, window_left, out, num_threads);
}

/* As rk_paged_extend_f32 over quantized pools: kind RK_KV_I8 (int8) or RK_KV_FP8
 * (float8_e4m3fn bytes), k_scales / v_scales [M * block_size, hkv] fp32 (one scale per slot and
 * KV head); keys and values are dequantized once per call as they are packed, then the fp32
 * kernel runs unchanged. Returns 1 also on another kind. */
int rk_paged_extend_q(const float *q, int64_t q_stride, const int64_t *qo_indptr,
                      const int32_t *prefix_lens, int64_t num_seqs, const void *k_pool,
                      const void *v_pool, const int32_t *block_tables, int64_t max_blocks,
                      int block_size, int hq, int hkv, int d, float scale, int64_t window_left,
                      float *out, int num_threads, const float *k_scales, const float *v_scales,
                      int kind) {
    if (kind != RK_KV_I8 && kind != RK_KV_FP8) return 1;
    return extend(q, q_stride, qo_indptr, prefix_lens, num_seqs, k_pool, v_pool, kind, k_scales, v_scales,
                  block_tables, max_blocks, block_size, hq, hkv, d, scale, window_left, out, num_threads);
}
