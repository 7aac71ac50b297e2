/* radixkv CPU prefill/extend elementwise kernels (rk_vec.h, OpenMP over rows).
 *
 * A prefill step of many rows spends its time in the GEMMs (oneDNN, radixkv.kernels.gemm) and
 * attention; what is left is elementwise work that torch runs as several full passes over the
 * activations each (RMSNorm: pow, mean, rsqrt, two multiplies; RoPE: a cat, a negation, two
 * multiplies and an add; SwiGLU: silu and a multiply; residual adds). Each kernel here does
 * one pass, row-parallel, reading and writing the model dtype (fp32 or bf16) and computing in
 * fp32. Called through ctypes from radixkv/kernels/gemm.py, which checks dtypes, shapes and
 * contiguity before passing raw pointers.
 *
 * dtype codes: 0 = fp32, 1 = bf16 (the upper half of an fp32, round-to-nearest-even on store).
 * Return codes: 0 ok, -1 bad dtype or size.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "rk_vec.h"

#define RK_F32 0
#define RK_BF16 1

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return (uint16_t)((u | 0x00400000u) >> 16);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Element i of row `row` (fp32 or bf16) as fp32, and its store. */
static inline float ld1(const void *p, int64_t i, int dt) {
    return dt == RK_F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}
static inline void st1(void *p, int64_t i, float v, int dt) {
    if (dt == RK_F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = f32_to_bf16(v);
}
static inline rkv ldv(const void *p, int64_t i, int dt) {
    return dt == RK_F32 ? rkv_load((const float *)p + i) : rkv_load_bf16((const uint16_t *)p + i);
}
static inline void stv(void *p, int64_t i, rkv v, int dt) {
    if (dt == RK_F32) rkv_store((float *)p + i, v);
    else rkv_store_bf16((uint16_t *)p + i, v);
}
/* Round to the model dtype and back: the torch reference rounds intermediate results where it
 * materialises them in the model dtype, and matching those roundings keeps bf16 close to it. */
static inline rkv roundv(rkv v, int dt) {
    if (dt == RK_F32) return v;
    uint16_t tmp[RK_VL];
    rkv_store_bf16(tmp, v);
    return rkv_load_bf16(tmp);
}
static inline float round1(float v, int dt) { return dt == RK_F32 ? v : bf16_to_f32(f32_to_bf16(v)); }

static inline size_t esize(int dt) { return dt == RK_F32 ? 4 : 2; }

/* One row: optionally h += d (stored, rounded to the dtype), then out = w * (h * rsqrt(mean(h^2)
 * + eps)), the normalised row rounded to the dtype before the weight multiply (as the torch
 * reference does). */
static void add_norm_row(void *h, const void *d, const void *w, void *out, int64_t n, float eps, int dt) {
    rkv acc = rkv_zero();
    float tail = 0.0f;
    int64_t i = 0;
    for (; i + RK_VL <= n; i += RK_VL) {
        rkv x = ldv(h, i, dt);
        if (d) {
            x = roundv(rkv_add(x, ldv(d, i, dt)), dt);
            stv(h, i, x, dt);
        }
        acc = rkv_fma(x, x, acc);
    }
    for (; i < n; i++) {
        float x = ld1(h, i, dt);
        if (d) {
            x = round1(x + ld1(d, i, dt), dt);
            st1(h, i, x, dt);
        }
        tail += x * x;
    }
    const float r = 1.0f / sqrtf((rkv_hsum(acc) + tail) / (float)n + eps);
    const rkv rv = rkv_set1(r);
    for (i = 0; i + RK_VL <= n; i += RK_VL)
        stv(out, i, rkv_mul(ldv(w, i, dt), roundv(rkv_mul(ldv(h, i, dt), rv), dt)), dt);
    for (; i < n; i++) st1(out, i, ld1(w, i, dt) * round1(ld1(h, i, dt) * r, dt), dt);
}

/* out[r] = rms_norm(h[r] (+= d[r])) * w for r < rows; h, d, out are [rows, n] contiguous, w [n].
 * d may be NULL (no residual add; h untouched). */
int rk_add_rms_norm(void *h, const void *d, const void *w, void *out, int64_t rows, int64_t n,
                    float eps, int dt, int num_threads) {
    if ((dt != RK_F32 && dt != RK_BF16) || n <= 0 || rows < 0) return -1;
    const size_t es = esize(dt);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        add_norm_row((char *)h + (size_t)r * n * es, d ? (const char *)d + (size_t)r * n * es : NULL, w,
                     (char *)out + (size_t)r * n * es, n, eps, dt);
    }
    return 0;
}

/* Half-split RoPE (Hugging Face layout, pair i is (x[i], x[i + D/2])) applied in place to the
 * first `heads` heads of each row of x ([rows, row_stride] contiguous; the fused q/k/v output,
 * whose q and k heads are adjacent). cos/sin are fp32 tables [max_pos, D], row positions[r]:
 *   x'[i] = x[i] cos[i] - x[i + D/2] sin[i],  x'[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2].
 * Positions are trusted (checked where they enter the engine). */
int rk_rope_inplace(void *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                    const int64_t *positions, const float *cos_t, const float *sin_t, int dt,
                    int num_threads) {
    if ((dt != RK_F32 && dt != RK_BF16) || head_dim <= 0 || head_dim % 2 || heads * head_dim > row_stride)
        return -1;
    const int64_t half = head_dim / 2;
    const size_t es = esize(dt);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        char *row = (char *)x + (size_t)r * row_stride * es;
        const float *c = cos_t + positions[r] * head_dim;
        const float *s = sin_t + positions[r] * head_dim;
        for (int64_t hh = 0; hh < heads; hh++) {
            void *lo = row + (size_t)hh * head_dim * es;
            void *hi = row + (size_t)(hh * head_dim + half) * es;
            int64_t i = 0;
            for (; i + RK_VL <= half; i += RK_VL) {
                const rkv a = ldv(lo, i, dt), b = ldv(hi, i, dt);
                stv(lo, i, rkv_fnma(b, rkv_load(s + i), rkv_mul(a, rkv_load(c + i))), dt);
                stv(hi, i, rkv_fma(a, rkv_load(s + half + i), rkv_mul(b, rkv_load(c + half + i))), dt);
            }
            for (; i < half; i++) {
                const float a = ld1(lo, i, dt), b = ld1(hi, i, dt);
                st1(lo, i, a * c[i] - b * s[i], dt);
                st1(hi, i, b * c[half + i] + a * s[half + i], dt);
            }
        }
    }
    return 0;
}

/* out[r, i] = silu(gu[r, i]) * gu[r, inter + i]: SwiGLU from the fused gate/up output
 * gu [rows, 2 inter] into out [rows, inter], both contiguous. silu(g) = g / (1 + exp(-g)). */
int rk_silu_mul(const void *gu, void *out, int64_t rows, int64_t inter, int dt, int num_threads) {
    if ((dt != RK_F32 && dt != RK_BF16) || inter <= 0) return -1;
    const size_t es = esize(dt);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        const char *g = (const char *)gu + (size_t)r * 2 * inter * es;
        const char *u = g + (size_t)inter * es;
        char *o = (char *)out + (size_t)r * inter * es;
        int64_t i = 0;
        const rkv one = rkv_set1(1.0f);
        for (; i + RK_VL <= inter; i += RK_VL) {
            const rkv gv = ldv(g, i, dt);
            const rkv e = rkv_exp(rkv_sub(rkv_zero(), gv));
            /* exp(-g) for g below -88 saturates at exp(88): the quotient is then ~0, as
             * silu is there. rk_vec.h has no division; both widths have one. */
#if RK_AVX512
            const rkv sv = _mm512_div_ps(gv, rkv_add(one, e));
#else
            const rkv sv = _mm256_div_ps(gv, rkv_add(one, e));
#endif
            stv(o, i, rkv_mul(roundv(sv, dt), ldv(u, i, dt)), dt);
        }
        for (; i < inter; i++) {
            const float gv = ld1(g, i, dt);
            st1(o, i, round1(gv / (1.0f + expf(-gv)), dt) * ld1(u, i, dt), dt);
        }
    }
    return 0;
}
