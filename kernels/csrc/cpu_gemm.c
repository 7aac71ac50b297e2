/* fp32 GEMM for prefill and extend projections: C[M, N] = A[M, K] @ W[N, K]^T (+ bias[N]).
 *
 * Why our own: on AVX2-only CPUs (no AVX-512) torch's oneDNN and MKL fp32 GEMMs reach about
 * 80 % of the FMA peak at a model's prefill shapes (bench step on a Zen 3 EPYC); a blocked
 * GEMM around a register-tile microkernel reaches ~90 %. The structure is the one of BLIS
 * (Van Zee & van de Geijn, "BLIS: A Framework for Rapidly Instantiating BLAS Functionality",
 * ACM TOMS 41(3), 2015) and of Goto & van de Geijn, "Anatomy of High-Performance Matrix
 * Multiplication" (ACM TOMS 34(3), 2008):
 *
 * - The weight is packed once at load (rk_gemm_pack_weight) into panels of RK_GEMM_NR output
 *   columns, each stored [K][RK_GEMM_NR] (zero-padded past N), so the microkernel reads one
 *   contiguous stream of B.
 * - Per call, each thread packs its rows of A, RK_GEMM_MC rows by kc columns at a time, into
 *   micro-panels of RK_GEMM_MR rows stored [kc][RK_GEMM_MR] (zero-padded past M): this block
 *   stays in the core's L2 while every panel of B streams past it. Full micro-panels are packed
 *   8 columns at a time by an 8 x 8 transpose in registers (2,048-row GEMMs 1-3 % faster than
 *   the scalar copy on a Zen 3; the microkernel reading A unpacked, at row stride, was ~6 %
 *   slower).
 * - K is split into kc-blocks so a B micro-panel (kc x NR floats) stays in L1 while the A
 *   micro-panels of the block walk past it; the first kc-block stores C, later ones add to it,
 *   the bias is added with the last.
 * - The microkernel holds an MR x NR tile of C in 2 x MR vector registers (12 of AVX2's 16):
 *   per k it loads two B vectors, broadcasts MR values of A and issues 2 x MR independent
 *   FMAs, enough chains to cover the FMA latency on both pipes.
 *
 * Threads split the rows (each thread packs its own A block, all share the packed weight) when
 * there are enough rows, else the column panels. Same source for both builds (rk_vec.h):
 * NR = 2 x RK_VL columns (16 on AVX2, 32 on AVX-512).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rk_vec.h"

#define RK_GEMM_MR 6
#define RK_GEMM_NR (2 * RK_VL)
/* A B micro-panel (kc x NR floats) of at most ~20 KB stays in a 32 KB L1 beside the A stream. */
#define RK_GEMM_KC_MAX (5120 / RK_GEMM_NR)
/* Rows of A packed at a time: MC x kc floats (<= 240 KB) stay in a core's L2. On a Zen 3
 * EPYC (2 threads, fp32, SmolLM2's prefill shapes at 2,048 rows) kc 320 / 640 and MC 96 / 192
 * / 384 all measured within the VM's noise of each other (165-177 GFLOP/s, FMA peak ~190). */
#define RK_GEMM_MC 192

/* Output columns per packed panel (16 on AVX2, 32 on AVX-512). */
int rk_gemm_nr(void) { return RK_GEMM_NR; }

/* Floats of a packed [n, k] weight: ceil(n / NR) panels of k x NR. */
int64_t rk_gemm_packed_floats(int64_t n, int64_t k) {
    return (n + RK_GEMM_NR - 1) / RK_GEMM_NR * RK_GEMM_NR * k;
}

/* Pack w [n][k] (row stride ldw floats) into `out` (rk_gemm_packed_floats(n, k) floats):
 * panel p holds columns p*NR .. p*NR+NR-1 as [k][NR], columns past n zero. Returns 0, or -1 on
 * bad sizes. */
int rk_gemm_pack_weight(const float *w, int64_t n, int64_t k, int64_t ldw, float *out) {
    if (n < 1 || k < 1 || ldw < k)
        return -1;
    const int64_t panels = (n + RK_GEMM_NR - 1) / RK_GEMM_NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = out + p * k * RK_GEMM_NR;
        const int64_t cols = (n - p * RK_GEMM_NR) < RK_GEMM_NR ? (n - p * RK_GEMM_NR) : RK_GEMM_NR;
        for (int64_t j = 0; j < RK_GEMM_NR; j++) {
            if (j < cols) {
                const float *src = w + (p * RK_GEMM_NR + j) * ldw;
                for (int64_t kk = 0; kk < k; kk++)
                    dst[kk * RK_GEMM_NR + j] = src[kk];
            } else {
                for (int64_t kk = 0; kk < k; kk++)
                    dst[kk * RK_GEMM_NR + j] = 0.0f;
            }
        }
    }
    return 0;
}

/* Pack rows [0, mc) x columns [0, kc) of a (row stride lda) into micro-panels of MR rows,
 * each [kc][MR]; rows past mc are zero so the microkernel never branches on them. */
static void rk_gemm_pack_a(const float *a, int64_t lda, int64_t mc, int64_t kc, float *dst) {
    for (int64_t i0 = 0; i0 < mc; i0 += RK_GEMM_MR) {
        const int64_t rows = (mc - i0) < RK_GEMM_MR ? (mc - i0) : RK_GEMM_MR;
        float *panel = dst + i0 * kc;
        if (rows == RK_GEMM_MR) {
            const float *r0 = a + (i0 + 0) * lda, *r1 = a + (i0 + 1) * lda, *r2 = a + (i0 + 2) * lda;
            const float *r3 = a + (i0 + 3) * lda, *r4 = a + (i0 + 4) * lda, *r5 = a + (i0 + 5) * lda;
            int64_t kk = 0;
            /* 8 columns at a time: an 8 x 8 transpose (rows 6, 7 zero) and one 8-float store per
             * column, each overlapping the next column's first two floats; the last column's
             * store would run 2 floats past the panel, so it is left to the scalar loop. */
            for (; kk + 8 < kc; kk += 8) {
                const __m256 z = _mm256_setzero_ps();
                __m256 x0 = _mm256_loadu_ps(r0 + kk), x1 = _mm256_loadu_ps(r1 + kk);
                __m256 x2 = _mm256_loadu_ps(r2 + kk), x3 = _mm256_loadu_ps(r3 + kk);
                __m256 x4 = _mm256_loadu_ps(r4 + kk), x5 = _mm256_loadu_ps(r5 + kk);
                __m256 t0 = _mm256_unpacklo_ps(x0, x1), t1 = _mm256_unpackhi_ps(x0, x1);
                __m256 t2 = _mm256_unpacklo_ps(x2, x3), t3 = _mm256_unpackhi_ps(x2, x3);
                __m256 t4 = _mm256_unpacklo_ps(x4, x5), t5 = _mm256_unpackhi_ps(x4, x5);
                __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
                __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
                __m256 u4 = _mm256_shuffle_ps(t4, z, 0x44), u5 = _mm256_shuffle_ps(t4, z, 0xEE);
                __m256 u6 = _mm256_shuffle_ps(t5, z, 0x44), u7 = _mm256_shuffle_ps(t5, z, 0xEE);
                float *d = panel + kk * RK_GEMM_MR;
                _mm256_storeu_ps(d + 0 * RK_GEMM_MR, _mm256_permute2f128_ps(u0, u4, 0x20));
                _mm256_storeu_ps(d + 1 * RK_GEMM_MR, _mm256_permute2f128_ps(u1, u5, 0x20));
                _mm256_storeu_ps(d + 2 * RK_GEMM_MR, _mm256_permute2f128_ps(u2, u6, 0x20));
                _mm256_storeu_ps(d + 3 * RK_GEMM_MR, _mm256_permute2f128_ps(u3, u7, 0x20));
                _mm256_storeu_ps(d + 4 * RK_GEMM_MR, _mm256_permute2f128_ps(u0, u4, 0x31));
                _mm256_storeu_ps(d + 5 * RK_GEMM_MR, _mm256_permute2f128_ps(u1, u5, 0x31));
                _mm256_storeu_ps(d + 6 * RK_GEMM_MR, _mm256_permute2f128_ps(u2, u6, 0x31));
                _mm256_storeu_ps(d + 7 * RK_GEMM_MR, _mm256_permute2f128_ps(u3, u7, 0x31));
            }
            for (; kk < kc; kk++) {
                float *d = panel + kk * RK_GEMM_MR;
                d[0] = r0[kk]; d[1] = r1[kk]; d[2] = r2[kk];
                d[3] = r3[kk]; d[4] = r4[kk]; d[5] = r5[kk];
            }
        } else {
            for (int64_t kk = 0; kk < kc; kk++)
                for (int64_t i = 0; i < RK_GEMM_MR; i++)
                    panel[kk * RK_GEMM_MR + i] = i < rows ? a[(i0 + i) * lda + kk] : 0.0f;
        }
    }
}

/* One MR x NR tile: acc = A-panel (kc x MR) x B-panel (kc x NR), then C (rows x cols of it,
 * row stride ldc) = acc (first) or C + acc, plus bias (may be NULL) when `last`. */
static inline void rk_gemm_tile(int64_t kc, const float *restrict ap, const float *restrict bp,
                                float *c, int64_t ldc, int rows, int cols, int first,
                                const float *bias) {
    rkv c00 = rkv_zero(), c01 = rkv_zero(), c10 = rkv_zero(), c11 = rkv_zero();
    rkv c20 = rkv_zero(), c21 = rkv_zero(), c30 = rkv_zero(), c31 = rkv_zero();
    rkv c40 = rkv_zero(), c41 = rkv_zero(), c50 = rkv_zero(), c51 = rkv_zero();
    /* The C rows this tile writes, fetched while the k-loop runs (+1-2 % measured). */
    for (int i = 0; i < rows; i++) {
        _mm_prefetch((const char *)(c + i * ldc), _MM_HINT_T0);
        _mm_prefetch((const char *)(c + i * ldc + RK_GEMM_NR - 1), _MM_HINT_T0);
    }
#pragma GCC unroll 4
    for (int64_t kk = 0; kk < kc; kk++) {
        const rkv b0 = rkv_load_aligned(bp), b1 = rkv_load_aligned(bp + RK_VL);
        rkv a;
        a = rkv_set1(ap[0]); c00 = rkv_fma(a, b0, c00); c01 = rkv_fma(a, b1, c01);
        a = rkv_set1(ap[1]); c10 = rkv_fma(a, b0, c10); c11 = rkv_fma(a, b1, c11);
        a = rkv_set1(ap[2]); c20 = rkv_fma(a, b0, c20); c21 = rkv_fma(a, b1, c21);
        a = rkv_set1(ap[3]); c30 = rkv_fma(a, b0, c30); c31 = rkv_fma(a, b1, c31);
        a = rkv_set1(ap[4]); c40 = rkv_fma(a, b0, c40); c41 = rkv_fma(a, b1, c41);
        a = rkv_set1(ap[5]); c50 = rkv_fma(a, b0, c50); c51 = rkv_fma(a, b1, c51);
        ap += RK_GEMM_MR;
        bp += RK_GEMM_NR;
    }
    rkv acc[RK_GEMM_MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    const int n0 = cols < RK_VL ? cols : RK_VL;
    const int n1 = cols - n0;
    rkv bias0 = rkv_zero(), bias1 = rkv_zero();
    if (bias) {
        bias0 = rkv_load_n(bias, n0);
        bias1 = rkv_load_n(bias + RK_VL, n1);
    }
    for (int i = 0; i < rows; i++) {
        float *ci = c + i * ldc;
        rkv v0 = rkv_add(acc[i][0], bias0), v1 = rkv_add(acc[i][1], bias1);
        if (cols == RK_GEMM_NR) {
            if (!first) {
                v0 = rkv_add(v0, rkv_load(ci));
                v1 = rkv_add(v1, rkv_load(ci + RK_VL));
            }
            rkv_store(ci, v0);
            rkv_store(ci + RK_VL, v1);
        } else {
            if (!first) {
                v0 = rkv_add(v0, rkv_load_n(ci, n0));
                v1 = rkv_add(v1, rkv_load_n(ci + RK_VL, n1));
            }
            rkv_store_n(ci, v0, n0);
            if (n1 > 0)
                rkv_store_n(ci + RK_VL, v1, n1);
        }
    }
}

/* Rows [m0, m1) x panels [p0, p1) of C on the calling thread; `abuf` holds MC x kc_max floats. */
static void rk_gemm_block(const float *a, int64_t lda, const float *bp, int64_t n, int64_t k,
                          const float *bias, float *c, int64_t ldc, int64_t m0, int64_t m1,
                          int64_t p0, int64_t p1, int64_t kc_max, float *abuf) {
    for (int64_t pc = 0; pc < k; pc += kc_max) {
        const int64_t kc = (k - pc) < kc_max ? (k - pc) : kc_max;
        const int first = pc == 0, last = pc + kc == k;
        for (int64_t ic = m0; ic < m1; ic += RK_GEMM_MC) {
            const int64_t mc = (m1 - ic) < RK_GEMM_MC ? (m1 - ic) : RK_GEMM_MC;
            rk_gemm_pack_a(a + ic * lda + pc, lda, mc, kc, abuf);
            for (int64_t p = p0; p < p1; p++) {
                const float *bpanel = bp + p * k * RK_GEMM_NR + pc * RK_GEMM_NR;
                const int64_t col0 = p * RK_GEMM_NR;
                const int cols = (int)((n - col0) < RK_GEMM_NR ? (n - col0) : RK_GEMM_NR);
                const float *pbias = (last && bias) ? bias + col0 : NULL;
                for (int64_t ir = 0; ir < mc; ir += RK_GEMM_MR) {
                    const int rows = (int)((mc - ir) < RK_GEMM_MR ? (mc - ir) : RK_GEMM_MR);
                    rk_gemm_tile(kc, abuf + ir * kc, bpanel, c + (ic + ir) * ldc + col0, ldc,
                                 rows, cols, first, pbias);
                }
            }
        }
    }
}

/* C[m][n] (row stride ldc) = A[m][k] (row stride lda) @ W^T (+ bias), W packed by
 * rk_gemm_pack_weight (64-byte aligned), on up to `num_threads` OpenMP threads (< 1: the
 * OpenMP default). Returns 0, -1 on bad sizes or a bp not 64-byte aligned, -2 when a thread's
 * A buffer could not be allocated (C is then incomplete). */
int rk_gemm_f32(const float *a, int64_t m, int64_t k, int64_t lda, const float *bp, int64_t n,
                const float *bias, float *c, int64_t ldc, int num_threads) {
    if (m < 1 || n < 1 || k < 1 || lda < k || ldc < n || ((uintptr_t)bp & 63))
        return -1;
    const int64_t blocks_k = (k + RK_GEMM_KC_MAX - 1) / RK_GEMM_KC_MAX;
    /* Equal kc-blocks (576 -> 2 x 288 rather than 320 + 256), a multiple of 4 floats. */
    int64_t kc_max = (k + blocks_k - 1) / blocks_k;
    kc_max = (kc_max + 3) / 4 * 4;
    const int64_t panels = (n + RK_GEMM_NR - 1) / RK_GEMM_NR;
    int status = 0;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : omp_get_max_threads())
    {
        /* The split is made from the team OpenMP gave, which can be smaller than asked
         * (OMP_THREAD_LIMIT, dynamic teams, a nested region): every thread computes the same
         * split, and threads past it idle. Threads go over rows while each gets >= 4 row
         * tiles, the rest over column panels. */
        const int threads = omp_get_num_threads();
        int row_parts = threads;
        while (row_parts > 1 && (m / row_parts < 4 * RK_GEMM_MR || threads % row_parts))
            row_parts--;
        int col_parts = threads / row_parts;
        if (col_parts > panels)
            col_parts = (int)panels;
        const int t = omp_get_thread_num();
        if (t < row_parts * col_parts) {
            const int rp = t / col_parts, cp = t % col_parts;
            /* Row ranges in whole MR tiles, so only the last part has a ragged tile. */
            const int64_t tiles = (m + RK_GEMM_MR - 1) / RK_GEMM_MR;
            int64_t m0 = tiles * rp / row_parts * RK_GEMM_MR, m1 = tiles * (rp + 1) / row_parts * RK_GEMM_MR;
            if (m1 > m)
                m1 = m;
            const int64_t p0 = panels * cp / col_parts, p1 = panels * (cp + 1) / col_parts;
            float *abuf = aligned_alloc(64, (size_t)((RK_GEMM_MC * kc_max * sizeof(float) + 63) / 64 * 64));
            if (!abuf) {
#pragma omp atomic write
                status = -2;
            } else {
                if (m0 < m1 && p0 < p1)
                    rk_gemm_block(a, lda, bp, n, k, bias, c, ldc, m0, m1, p0, p1, kc_max, abuf);
                free(abuf);
            }
        }
    }
    return status;
}
