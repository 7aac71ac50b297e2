/* The CPU's own arithmetic peak: a microbenchmark of independent FMA chains on every thread.
 *
 * `radixkv bench step` divides a prefill's FLOPs by this rate to get a floor that no library
 * choice can move: a slow GEMM shows up as a large "measured / floor" ratio instead of lowering
 * the floor it is judged against.
 *
 * Why the loop looks like this: an FMA has a latency of several cycles (4 on Zen 4 and most
 * Intel cores) and a core issues up to two per cycle, so one thread needs at least
 * latency x ports = 8 independent dependency chains to keep both pipes busy. We run
 * RK_PEAK_CHAINS (12 with 16 AVX2 registers, 24 with 32 AVX-512 registers) chains per thread,
 * each started from a different value so the compiler cannot prove two chains equal and fold
 * them (identical chains did get merged in an earlier version: check `objdump -d` shows
 * RK_PEAK_CHAINS vfmadd instructions in the loop). The chain acc = acc * m + c with m just
 * below 1 converges to c / (1 - m): no overflow, no denormals, whatever the iteration count.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "rk_vec.h"

#if RK_AVX512
#define RK_PEAK_CHAINS 24
#else
#define RK_PEAK_CHAINS 12
#endif

/* The best of this many timed runs is kept: on a shared VM one run in three came out at half
 * the rate (a neighbour, frequency ramp-up), and the peak is what the silicon can do. */
#define RK_PEAK_REPEATS 5

/* Result of every thread, so the chains are live until the end (no dead-code elimination). */
static volatile float rk_peak_sink;

/* `iters` rounds of RK_PEAK_CHAINS independent FMAs on one thread; returns the chains' sum. */
static float rk_fma_chains(int64_t iters, int salt) {
    const rkv m = rkv_set1(0.99999994f);
    const rkv c = rkv_set1(1e-3f);
    rkv acc[RK_PEAK_CHAINS];
    for (int i = 0; i < RK_PEAK_CHAINS; i++)
        acc[i] = rkv_set1((float)(i + 1) * 0.37f + (float)salt * 0.011f);
    for (int64_t it = 0; it < iters; it++) {
        /* Fully unrolled by the compiler (constant trip count): RK_PEAK_CHAINS FMAs, no loads. */
#pragma GCC unroll 32
        for (int i = 0; i < RK_PEAK_CHAINS; i++)
            acc[i] = rkv_fma(acc[i], m, c);
    }
    rkv total = acc[0];
    for (int i = 1; i < RK_PEAK_CHAINS; i++)
        total = rkv_add(total, acc[i]);
    return rkv_hsum(total);
}

/* Wall seconds of one parallel run: every thread does `iters` rounds. */
static double rk_fma_run(int64_t iters, int num_threads) {
    const double start = omp_get_wtime();
#pragma omp parallel num_threads(num_threads)
    {
        const float s = rk_fma_chains(iters, omp_get_thread_num());
#pragma omp atomic
        rk_peak_sink += s;
    }
    return omp_get_wtime() - start;
}

/* Peak fp32 FMA rate of this build's vector width on `num_threads` threads, GFLOP/s.
 *
 * Counts 2 FLOPs per lane per FMA (a multiply and an add): RK_VL lanes x RK_PEAK_CHAINS chains
 * x iterations x threads x 2. `seconds` is the time budget of all timed runs together (plus
 * one short calibration run); the best of RK_PEAK_REPEATS runs is returned.
 * Returns -1 on bad arguments (seconds <= 0 or not finite, num_threads < 1). */
double rk_fma_peak_gflops(double seconds, int num_threads) {
    if (!(seconds > 0.0) || !isfinite(seconds) || num_threads < 1)
        return -1.0;
    /* Calibrate: grow the iteration count until a run takes >= 10 ms, then scale it to the
     * per-run budget (fork/join costs are microseconds). Calibrated on the calling thread alone,
     * the faster of two runs: a parallel run lasts until its last thread gets a core, so on a
     * busy machine a tiny count could read 10 ms and leave every timed run far too short to be
     * more than scheduling noise. */
    int64_t iters = 1 << 12;
    rk_fma_run(iters, num_threads);  /* untimed: the first region spawns the OpenMP threads */
    double t;
    for (;;) {  /* on this thread alone, the faster of two runs */
        double a = omp_get_wtime();
        rk_peak_sink += rk_fma_chains(iters, 0);
        double b = omp_get_wtime();
        rk_peak_sink += rk_fma_chains(iters, 1);
        t = fmin(b - a, omp_get_wtime() - b);
        if (t >= 1e-2 || iters >= ((int64_t)1 << 40))
            break;
        iters *= 4;
    }
    const double per_run = seconds / RK_PEAK_REPEATS;
    if (t > 0.0 && per_run > t)
        iters = (int64_t)((double)iters * (per_run / t));
    const double flops = 2.0 * RK_VL * RK_PEAK_CHAINS * (double)iters * num_threads;
    double best = 0.0;
    for (int r = 0; r < RK_PEAK_REPEATS; r++) {
        const double s = rk_fma_run(iters, num_threads);
        if (s > 0.0 && flops / s > best)
            best = flops / s;
    }
    return best / 1e9;
}

/* Chains of this build's peak loop (for tests and reports). */
int rk_fma_peak_chains(void) { return RK_PEAK_CHAINS; }

/* --------------------------------------------------------------------------- bf16 dot products
 * VDPBF16PS (AVX512_BF16): each 32-bit lane accumulates the products of two bf16 pairs, so one
 * zmm instruction is 32 multiplies + 32 adds = 64 FLOPs (2 FLOPs per bf16 pair, as a GEMM's
 * FLOP count has it). Compiled into both builds through a target attribute and called only
 * where the CPU reports the instructions (rk_cpu_has_avx512_bf16). The intrinsics, the __m512bh
 * type and __builtin_cpu_supports("avx512bf16") arrived in GCC 10 and Clang 9: older compilers
 * build the library without this kernel, and the bf16 peak reports "unavailable" (-3).
 * -DRK_PEAK_NO_BF16 builds that way on any compiler (tests). */

#if !defined(RK_PEAK_NO_BF16) && \
    ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define RK_PEAK_BF16 1
#else
#define RK_PEAK_BF16 0
#endif

/* 1 where this build carries the VDPBF16PS peak kernel (see above), else 0. */
int rk_bf16_peak_compiled(void) { return RK_PEAK_BF16; }

int rk_cpu_has_avx512_bf16(void) {
#if RK_PEAK_BF16
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512f");
#else
    return 0;
#endif
}

#if RK_PEAK_BF16

#define RK_BF16_CHAINS 24

__attribute__((target("avx512f,avx512bf16")))
static float rk_bf16_chains(int64_t iters, int salt) {
    /* Inputs: bf16 pairs near 1e-3 and 0.5; fp32 accumulators grow by ~1e-3 per step, far
     * from overflow for any run this benchmark makes. */
    const __m512bh a = (__m512bh)_mm512_set1_epi16((short)0x3A83);  /* ~1e-3 in bf16 */
    const __m512bh b = (__m512bh)_mm512_set1_epi16((short)0x3F00);  /* 0.5 in bf16 */
    __m512 acc[RK_BF16_CHAINS];
    for (int i = 0; i < RK_BF16_CHAINS; i++)
        acc[i] = _mm512_set1_ps((float)(i + 1) * 0.37f + (float)salt * 0.011f);
    for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 32
        for (int i = 0; i < RK_BF16_CHAINS; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    }
    __m512 total = acc[0];
    for (int i = 1; i < RK_BF16_CHAINS; i++)
        total = _mm512_add_ps(total, acc[i]);
    return _mm512_reduce_add_ps(total);
}

__attribute__((target("avx512f,avx512bf16")))
static double rk_bf16_run(int64_t iters, int num_threads) {
    const double start = omp_get_wtime();
#pragma omp parallel num_threads(num_threads)
    {
        const float s = rk_bf16_chains(iters, omp_get_thread_num());
#pragma omp atomic
        rk_peak_sink += s;
    }
    return omp_get_wtime() - start;
}

#endif /* RK_PEAK_BF16 */

/* Peak bf16 dot-product rate (VDPBF16PS on zmm) on `num_threads` threads, GFLOP/s, 64 FLOPs
 * per instruction; timing as rk_fma_peak_gflops. Returns -3 where this build lacks the kernel
 * (an old compiler), -2 where the CPU lacks AVX512_BF16 (nothing is executed), -1 on bad
 * arguments. */
double rk_bf16_dot_peak_gflops(double seconds, int num_threads) {
    if (!(seconds > 0.0) || !isfinite(seconds) || num_threads < 1)
        return -1.0;
#if !RK_PEAK_BF16
    return -3.0;
#else
    if (!rk_cpu_has_avx512_bf16())
        return -2.0;
    int64_t iters = 1 << 12;
    rk_bf16_run(iters, num_threads);  /* untimed: the first region spawns the OpenMP threads */
    double t;
    for (;;) {  /* on this thread alone, the faster of two runs */
        double a = omp_get_wtime();
        rk_peak_sink += rk_bf16_chains(iters, 0);
        double b = omp_get_wtime();
        rk_peak_sink += rk_bf16_chains(iters, 1);
        t = fmin(b - a, omp_get_wtime() - b);
        if (t >= 1e-2 || iters >= ((int64_t)1 << 40))
            break;
        iters *= 4;
    }
    const double per_run = seconds / RK_PEAK_REPEATS;
    if (t > 0.0 && per_run > t)
        iters = (int64_t)((double)iters * (per_run / t));
    const double flops = 64.0 * RK_BF16_CHAINS * (double)iters * num_threads;
    double best = 0.0;
    for (int r = 0; r < RK_PEAK_REPEATS; r++) {
        const double s = rk_bf16_run(iters, num_threads);
        if (s > 0.0 && flops / s > best)
            best = flops / s;
    }
    return best / 1e9;
#endif
}
