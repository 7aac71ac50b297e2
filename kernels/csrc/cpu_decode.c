/* radixkv CPU kernels (fp32, AVX2 + FMA, OpenMP): small-batch linear and paged decode attention.
 *
 * Built at first use by kernels/native.py (gcc -O3 -mavx2 -mfma -fopenmp -shared) and called
 * through ctypes with raw pointers of contiguous tensors; torch stays the owner of every buffer.
 * Linked against libgomp.so.1 by soname, so inside a process that imported torch it shares
 * torch's OpenMP runtime (one thread pool, no two runtimes spinning against each other).
 *
 * Why these two: a decode step at batch 1-16 is bound by memory bandwidth (every weight is read
 * once per step, every cached key and value once per layer), but MKL's sgemm on this build takes
 * a path for small M that runs at a third of the copy bandwidth on AMD CPUs, and attention over
 * the paged pool through torch needs a gather of each sequence's blocks before SDPA reads them
 * again. Here each weight row is streamed once and reused from L1 for every row of the batch,
 * and attention reads each key and value straight from its pool block (flash-decoding: the
 * keys of a sequence are split into chunks processed in parallel, each with an online softmax,
 * then merged; Dao et al., "Flash-Decoding for long-context inference", 2023,
 * https://crfm.stanford.edu/2023/10/12/flashdecoding.html).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RK_MAX_GROUP 16   /* query heads per KV head */
#define RK_MAX_HEADS 64   /* query heads */
#define RK_MAX_DIM 256    /* head dim */
#define RK_SUB 8          /* keys scored at once */
#define RK_MAX_CHUNK 256  /* keys per task */

int rk_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 sh = _mm_movehdup_ps(lo);
    lo = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, lo);
    return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}

/* exp(x) for 8 floats: Cephes expf's range reduction and degree-6 polynomial (relative error
 * ~1e-7 on [-87, 88]); inputs below -87 (and -inf, NaN) give exactly 0, which is what a masked
 * softmax score needs. Source: S. Moshier, Cephes Math Library, expf.c
 * (https://www.netlib.org/cephes/). */
static inline __m256 exp8(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(n)), keep);
}

/* Reads the tile's weights [p, p + num_floats) once in address order (values dropped: the
 * compute loop then reads four rows at a time from L1), and requests the next tile's. On 2
 * cores this took the whole model's batch-1 projections from 36 to 32 ms (538 MB). */
static inline void stream_tile(const float *p, int64_t num_floats, const float *next, int64_t next_floats) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    int64_t f = 0;
    for (; f + 32 <= num_floats; f += 32) {
        s0 = _mm256_or_ps(s0, _mm256_loadu_ps(p + f));
        s1 = _mm256_or_ps(s1, _mm256_loadu_ps(p + f + 16));
    }
    for (; f < num_floats; f += 8) s0 = _mm256_or_ps(s0, _mm256_loadu_ps(p + f));
    __asm__ volatile("" ::"x"(_mm256_or_ps(s0, s1)));
    if (next != NULL)
        for (int64_t b = 0; b < next_floats * (int64_t)sizeof(float); b += 64)
            _mm_prefetch((const char *)next + b, _MM_HINT_T0);
}

/* y[m, n] = x[m, k] . w[n, k]^T (+ bias[n]) (+ y[m, n] when `accumulate`): row-major,
 * contiguous, k % 8 == 0. Tiles of 4 weight rows are shared out among the threads of the
 * enclosing parallel region (an orphaned `omp for`); each tile is read from memory once and
 * reused from L1 by every pair of input rows. */
static void linear_for(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
                       const float *bias, float *y, int accumulate) {
    const int64_t num_tiles = (n + 3) / 4;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tiles; t++) {
        const int64_t j0 = t * 4;
        const int nr = n - j0 < 4 ? (int)(n - j0) : 4;
        const float *w0 = w + j0 * k;
        const float *w1 = w + (j0 + (nr > 1 ? 1 : 0)) * k;
        const float *w2 = w + (j0 + (nr > 2 ? 2 : 0)) * k;
        const float *w3 = w + (j0 + (nr > 3 ? 3 : 0)) * k;
        stream_tile(w + j0 * k, (int64_t)nr * k, t + 1 < num_tiles ? w + (j0 + 4) * k : NULL,
                    (n - j0 - 4 < 4 ? n - j0 - 4 : 4) * k);
        float b[4] = {0, 0, 0, 0};
        if (bias)
            for (int r = 0; r < nr; r++) b[r] = bias[j0 + r];
        int64_t i = 0;
        for (; i + 1 < m; i += 2) {
            const float *xa = x + i * k, *xb = xa + k;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
            for (int64_t kk = 0; kk < k; kk += 8) {
                const __m256 va = _mm256_loadu_ps(xa + kk), vb = _mm256_loadu_ps(xb + kk);
                __m256 wv = _mm256_loadu_ps(w0 + kk);
                a0 = _mm256_fmadd_ps(wv, va, a0); c0 = _mm256_fmadd_ps(wv, vb, c0);
                wv = _mm256_loadu_ps(w1 + kk);
                a1 = _mm256_fmadd_ps(wv, va, a1); c1 = _mm256_fmadd_ps(wv, vb, c1);
                wv = _mm256_loadu_ps(w2 + kk);
                a2 = _mm256_fmadd_ps(wv, va, a2); c2 = _mm256_fmadd_ps(wv, vb, c2);
                wv = _mm256_loadu_ps(w3 + kk);
                a3 = _mm256_fmadd_ps(wv, va, a3); c3 = _mm256_fmadd_ps(wv, vb, c3);
            }
            const float sa[4] = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3)};
            const float sb[4] = {hsum8(c0), hsum8(c1), hsum8(c2), hsum8(c3)};
            float *ya = y + i * n + j0, *yb = ya + n;
            for (int r = 0; r < nr; r++) {
                ya[r] = sa[r] + b[r] + (accumulate ? ya[r] : 0.0f);
                yb[r] = sb[r] + b[r] + (accumulate ? yb[r] : 0.0f);
            }
        }
        if (i < m) {
            const float *xa = x + i * k;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t kk = 0; kk < k; kk += 8) {
                const __m256 va = _mm256_loadu_ps(xa + kk);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + kk), va, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + kk), va, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + kk), va, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + kk), va, a3);
            }
            const float sa[4] = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3)};
            float *ya = y + i * n + j0;
            for (int r = 0; r < nr; r++) ya[r] = sa[r] + b[r] + (accumulate ? ya[r] : 0.0f);
        }
    }
}

/* y = x . w^T (+ bias): see linear_for. Returns 0, or 1 on an unsupported k. */
int rk_linear_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
                  const float *bias, float *y, int num_threads) {
    if (k % 8 != 0 || m < 1 || n < 1) return 1;
#pragma omp parallel num_threads(num_threads)
    linear_for(x, m, k, w, n, bias, y, 0);
    return 0;
}

/* The sums of eight vectors, as one vector: [sum(x0), ..., sum(x7)]. */
static inline __m256 hsum8x8(__m256 x0, __m256 x1, __m256 x2, __m256 x3, __m256 x4, __m256 x5,
                             __m256 x6, __m256 x7) {
    const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(x0, x1), _mm256_hadd_ps(x2, x3));
    const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(x4, x5), _mm256_hadd_ps(x6, x7));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                         _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* The pool rows of keys [pos, pos + cnt) of a sequence: cnt ≤ RK_SUB, not crossing a block. */
static inline int64_t sub_block(const int32_t *table, int block_size, int64_t pos, int64_t t1,
                                int64_t stride, int *cnt) {
    const int64_t blk_idx = pos / block_size;
    const int off = (int)(pos - blk_idx * block_size);
    int n = block_size - off;
    if (n > RK_SUB) n = RK_SUB;
    if (n > t1 - pos) n = (int)(t1 - pos);
    *cnt = n;
    return ((int64_t)table[blk_idx] * block_size + off) * stride;
}

#ifndef RK_PF_DIST
#define RK_PF_DIST 4
#endif
/* Streams a sequence's pool rows ahead of the compute loops, which read them strided (eight
 * keys' rows per head, head after head): loads the rows of keys [pos, pos + RK_SUB) once in
 * address order (a sequential read the hardware prefetcher follows; the values are dropped), and
 * requests those RK_PF_DIST sub-blocks further on. Measured on 2 cores, 30 layers at 2k
 * context from DRAM: 8 GB/s with neither, 8 GB/s with either alone, 11-14 GB/s with both. */
static inline void stream_rows(const float *pool, const int32_t *table, int block_size, int64_t pos,
                               int64_t t1, int64_t stride) {
    int cnt;
    const float *p = pool + sub_block(table, block_size, pos, t1, stride, &cnt);
    const int64_t num_floats = (int64_t)cnt * stride;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t f = 0;
    for (; f + 64 <= num_floats; f += 64) {  /* one load per 64-byte line */
        s0 = _mm256_or_ps(s0, _mm256_loadu_ps(p + f));
        s1 = _mm256_or_ps(s1, _mm256_loadu_ps(p + f + 16));
        s2 = _mm256_or_ps(s2, _mm256_loadu_ps(p + f + 32));
        s3 = _mm256_or_ps(s3, _mm256_loadu_ps(p + f + 48));
    }
    for (; f < num_floats; f += 8) s0 = _mm256_or_ps(s0, _mm256_loadu_ps(p + f));
    __asm__ volatile("" ::"x"(_mm256_or_ps(_mm256_or_ps(s0, s1), _mm256_or_ps(s2, s3))));
    const int64_t ahead = pos + RK_PF_DIST * RK_SUB;
    if (ahead >= t1) return;
    const char *q = (const char *)(pool + sub_block(table, block_size, ahead, t1, stride, &cnt));
    const int64_t num_bytes = (int64_t)cnt * stride * (int64_t)sizeof(float);
    for (int64_t b = 0; b < num_bytes; b += 64) _mm_prefetch(q + b, _MM_HINT_T0);
}

/* One chunk [t0, t1) (at most RK_MAX_CHUNK keys) of one sequence's keys, for all its query
 * heads, in two passes: every score of the chunk first (eight q.k dot products reduced at
 * once, into an L1-resident [heads, chunk] array), then per head one max, one vector exp and
 * one sum over the chunk, then P.V with 3 heads x 32 dims of accumulators in registers. An
 * online softmax per group of keys instead chained every group's max, exp and rescale behind
 * the previous one and ran at a third of this speed. Written per query head as
 * (max, sum, unnormalised acc[d]). d % 32 == 0. */
static void decode_chunk(const float *q, int hq, int hkv, int d, const float *k_pool,
                         const float *v_pool, const int32_t *table, int block_size, int64_t t0,
                         int64_t t1, float scale, float *part) {
    const int group = hq / hkv;
    const int64_t stride = (int64_t)hkv * d;
    const int n = (int)(t1 - t0);
    const int n_pad = (n + 7) & ~7;
    static const float zero_p[RK_MAX_CHUNK + RK_SUB] __attribute__((aligned(32))) = {0};
    float s[RK_MAX_HEADS * (RK_MAX_CHUNK + RK_SUB)] __attribute__((aligned(32)));
    float acc[3 * RK_MAX_DIM] __attribute__((aligned(32)));
    const __m256 vscale = _mm256_set1_ps(scale);
    const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    /* pass 1: scores */
    for (int64_t pos = t0; pos < t1;) {
        int cnt;
        const int64_t base = sub_block(table, block_size, pos, t1, stride, &cnt);
        const int tl = (int)(pos - t0);
        stream_rows(k_pool, table, block_size, pos, t1, stride);
        const __m256 valid = _mm256_cmp_ps(lanes, _mm256_set1_ps((float)cnt), _CMP_LT_OQ);
        for (int kvh = 0; kvh < hkv; kvh++) {
            const float *kb = k_pool + base + (int64_t)kvh * d;
            const float *kt[RK_SUB];
            for (int t = 0; t < RK_SUB; t++) kt[t] = kb + (t < cnt ? t : 0) * stride;
            for (int g = 0; g < group; g++) {
                const int h = kvh * group + g;
                const float *qh = q + (int64_t)h * d;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
                       a7 = a0;
                for (int j = 0; j < d; j += 8) {
                    const __m256 qv = _mm256_loadu_ps(qh + j);
                    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt[0] + j), a0);
                    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt[1] + j), a1);
                    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt[2] + j), a2);
                    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt[3] + j), a3);
                    a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt[4] + j), a4);
                    a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt[5] + j), a5);
                    a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt[6] + j), a6);
                    a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt[7] + j), a7);
                }
                const __m256 sc = _mm256_mul_ps(hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7), vscale);
                /* unaligned: a sub-block may start mid-way through 8 (a block size not of 8) */
                _mm256_storeu_ps(s + (int64_t)h * (RK_MAX_CHUNK + RK_SUB) + tl,
                                 _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sc, valid));
            }
        }
        pos += cnt;
    }
    /* softmax statistics per head: scores past n are -inf and give exp 0 */
    for (int h = 0; h < hq; h++) {
        float *sh = s + (int64_t)h * (RK_MAX_CHUNK + RK_SUB);
        for (int t = n; t < n_pad; t++) sh[t] = -INFINITY;
        __m256 vm = _mm256_set1_ps(-INFINITY);
        for (int t = 0; t < n_pad; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sh + t));
        const float mx = hmax8(vm);
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vs = _mm256_setzero_ps();
        for (int t = 0; t < n_pad; t += 8) {
            const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + t), vmx));
            _mm256_storeu_ps(sh + t, p);
            vs = _mm256_add_ps(vs, p);
        }
        float *ph = part + (int64_t)h * (d + 2);
        ph[0] = mx;
        ph[1] = hsum8(vs);
    }
    /* pass 2: P.V, three query heads of a KV head at a time (missing ones: zero weights) */
    for (int kvh = 0; kvh < hkv; kvh++) {
        for (int g0 = 0; g0 < group; g0 += 3) {
            const int h0 = kvh * group + g0;
            const float *s0 = s + (int64_t)h0 * (RK_MAX_CHUNK + RK_SUB);
            const float *s1 = g0 + 1 < group ? s0 + RK_MAX_CHUNK + RK_SUB : zero_p;
            const float *s2 = g0 + 2 < group ? s0 + 2 * (RK_MAX_CHUNK + RK_SUB) : zero_p;
            for (int j = 0; j < 3 * d; j++) acc[j] = 0.0f;
            for (int64_t pos = t0; pos < t1;) {
                int cnt;
                const int64_t base = sub_block(table, block_size, pos, t1, stride, &cnt);
                const int tl = (int)(pos - t0);
                const float *vb = v_pool + base + (int64_t)kvh * d;
                if (kvh == 0 && g0 == 0) stream_rows(v_pool, table, block_size, pos, t1, stride);
                for (int jb = 0; jb < d; jb += 32) {
                    float *A0 = acc + jb, *A1 = acc + d + jb, *A2 = acc + 2 * d + jb;
                    __m256 r00 = _mm256_load_ps(A0), r01 = _mm256_load_ps(A0 + 8),
                           r02 = _mm256_load_ps(A0 + 16), r03 = _mm256_load_ps(A0 + 24);
                    __m256 r10 = _mm256_load_ps(A1), r11 = _mm256_load_ps(A1 + 8),
                           r12 = _mm256_load_ps(A1 + 16), r13 = _mm256_load_ps(A1 + 24);
                    __m256 r20 = _mm256_load_ps(A2), r21 = _mm256_load_ps(A2 + 8),
                           r22 = _mm256_load_ps(A2 + 16), r23 = _mm256_load_ps(A2 + 24);
                    for (int t = 0; t < cnt; t++) {
                        const float *vt = vb + t * stride + jb;
                        const __m256 v0 = _mm256_loadu_ps(vt), v1 = _mm256_loadu_ps(vt + 8),
                                     v2 = _mm256_loadu_ps(vt + 16), v3 = _mm256_loadu_ps(vt + 24);
                        const __m256 p0 = _mm256_set1_ps(s0[tl + t]), p1 = _mm256_set1_ps(s1[tl + t]),
                                     p2 = _mm256_set1_ps(s2[tl + t]);
                        r00 = _mm256_fmadd_ps(p0, v0, r00); r01 = _mm256_fmadd_ps(p0, v1, r01);
                        r02 = _mm256_fmadd_ps(p0, v2, r02); r03 = _mm256_fmadd_ps(p0, v3, r03);
                        r10 = _mm256_fmadd_ps(p1, v0, r10); r11 = _mm256_fmadd_ps(p1, v1, r11);
                        r12 = _mm256_fmadd_ps(p1, v2, r12); r13 = _mm256_fmadd_ps(p1, v3, r13);
                        r20 = _mm256_fmadd_ps(p2, v0, r20); r21 = _mm256_fmadd_ps(p2, v1, r21);
                        r22 = _mm256_fmadd_ps(p2, v2, r22); r23 = _mm256_fmadd_ps(p2, v3, r23);
                    }
                    _mm256_store_ps(A0, r00); _mm256_store_ps(A0 + 8, r01);
                    _mm256_store_ps(A0 + 16, r02); _mm256_store_ps(A0 + 24, r03);
                    _mm256_store_ps(A1, r10); _mm256_store_ps(A1 + 8, r11);
                    _mm256_store_ps(A1 + 16, r12); _mm256_store_ps(A1 + 24, r13);
                    _mm256_store_ps(A2, r20); _mm256_store_ps(A2 + 8, r21);
                    _mm256_store_ps(A2 + 16, r22); _mm256_store_ps(A2 + 24, r23);
                }
                pos += cnt;
            }
            for (int g = g0; g < group && g < g0 + 3; g++) {
                float *ph = part + (int64_t)(kvh * group + g) * (d + 2);
                for (int j = 0; j < d; j++) ph[2 + j] = acc[(g - g0) * d + j];
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
    const float *k_pool, *v_pool;
    const int32_t *block_tables;
    int64_t max_blocks;
    const int32_t *kv_lens;
    int block_size, hq, hkv, d;
    float scale;
    int64_t window_left, chunk_tokens;
    const int64_t *task_start;
    float *parts;              /* [tasks, hq, d + 2] */
    float *out;                /* [T, hq, d] */
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
        decode_chunk(a->q + a->q_rows[i] * hq * d, hq, a->hkv, d, a->k_pool, a->v_pool,
                     a->block_tables + i * a->max_blocks, a->block_size, t0, t1, a->scale,
                     a->parts + task * part_size);
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
        for (int j = 0; j < d; j++) o[j] = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            const float *ph = a->parts + (first_task + c) * part_size + (int64_t)h * (d + 2);
            if (ph[0] == -INFINITY) continue;
            const float w = expf(ph[0] - mx);
            denom += w * ph[1];
            for (int j = 0; j < d; j++) o[j] += w * ph[2 + j];
        }
        const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
        for (int j = 0; j < d; j++) o[j] *= inv;
    }
}

static int decode_shape_ok(int hq, int hkv, int d, int64_t chunk_tokens, int block_size) {
    return hkv >= 1 && hq % hkv == 0 && hq / hkv <= RK_MAX_GROUP && hq <= RK_MAX_HEADS && d % 32 == 0
           && d <= RK_MAX_DIM && chunk_tokens >= 1 && chunk_tokens <= RK_MAX_CHUNK && block_size >= 1;
}

/* Decode attention over the paged pool: one query row per sequence.
 *   q, out: [T, hq, d] (row q_rows[i] is sequence i's query / output row)
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
                           parts, out};
#pragma omp parallel num_threads(num_threads)
    decode_for(&a);
    free(parts);
    free(task_start);
    return 0;
}

/* x[t] = w * x_in[t] / sqrt(mean(x_in[t]^2) + eps) for each of m rows of k. */
static void rms_norm_rows(const float *x_in, int64_t m, int64_t k, const float *w, float eps, float *x) {
    for (int64_t i = 0; i < m; i++) {
        const float *r = x_in + i * k;
        double ss = 0.0;
        for (int64_t j = 0; j < k; j++) ss += (double)r[j] * r[j];
        const float inv = 1.0f / sqrtf((float)(ss / (double)k) + eps);
        for (int64_t j = 0; j < k; j++) x[i * k + j] = w[j] * (r[j] * inv);
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

/* One whole Llama decoder layer for a decode step (one row per sequence, row i = sequence i),
 * in one parallel region: RMSNorm, fused q/k/v projection (+ bias), RoPE, K/V written to their
 * pool slots, paged decode attention, output projection + residual, RMSNorm, fused gate/up,
 * SiLU(gate) * up, down projection + residual. `hidden` [T, hd] is updated in place.
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
                           parts, attn};
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp single
        rms_norm_rows(hidden, t, hd, input_norm, eps, x);
        linear_for(x, t, hd, w_qkv, qkv_n, b_qkv, qkv, 0);
#pragma omp single
        for (int64_t i = 0; i < t; i++) {
            float *row = qkv + i * qkv_n;
            rope_row(row, hq + hkv, d, cos + i * d, sin + i * d);  /* q and k heads are adjacent */
            memcpy(q + i * q_n, row, sizeof(float) * q_n);
            memcpy(k_pool + slots[i] * kv_row, row + q_n, sizeof(float) * kv_row);
            memcpy(v_pool + slots[i] * kv_row, row + q_n + kv_row, sizeof(float) * kv_row);
        }
        decode_for(&a);
        linear_for(attn, t, q_n, w_o, hd, NULL, hidden, 1);
#pragma omp single
        rms_norm_rows(hidden, t, hd, post_norm, eps, x);
        linear_for(x, t, hd, w_gate_up, 2 * inter, NULL, gu, 0);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < t; i++) {
            float *g = gu + i * 2 * inter, *u = g + inter;
            for (int64_t j = 0; j < inter; j++) g[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
        }
        /* act rows sit at stride 2 * inter: pack them for the down projection */
#pragma omp single
        for (int64_t i = 1; i < t; i++) memmove(gu + i * inter, gu + i * 2 * inter, sizeof(float) * inter);
        linear_for(gu, t, inter, w_down, hd, NULL, hidden, 1);
    }
    free(buf);
    free(task_start);
    return 0;
}
