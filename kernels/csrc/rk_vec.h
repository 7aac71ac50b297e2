/* radixkv CPU kernels: one vector API over AVX-512 and AVX2, so every kernel has one source.
 *
 * kernels/native.py compiles the same .c files twice, once with the AVX-512 flags
 * (-mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c) and once with the AVX2 flags
 * (-mavx2 -mfma -mf16c), and loads the build the CPU can run (AVX-512 where present). Code
 * written against this header gets 16-lane zmm vectors in the first build and 8-lane ymm
 * vectors in the second: RK_VL is the number of fp32 lanes, never hard-code 8 or 16.
 *
 * Naming: rkv_* take and return `rkv` (RK_VL floats). Loads/stores are unaligned unless the
 * name says otherwise; *_n variants touch only the first n lanes (0 <= n <= RK_VL), the rest
 * of a loaded vector is 0. bf16 is the upper 16 bits of an fp32 (round-to-nearest-even on
 * store), so bf16 <-> fp32 needs no bf16 instructions and works in both builds.
 */
#ifndef RK_VEC_H
#define RK_VEC_H

#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define RK_AVX512 1
#define RK_VL 16
#define RK_ISA_NAME "avx512"
typedef __m512 rkv;
typedef __m512i rkvi;
#elif defined(__AVX2__) && defined(__FMA__)
#define RK_AVX512 0
#define RK_VL 8
#define RK_ISA_NAME "avx2"
typedef __m256 rkv;
typedef __m256i rkvi;
#else
#error "radixkv kernels need AVX2 + FMA (or AVX-512 F/BW/VL/DQ)"
#endif

#if RK_AVX512
static inline rkv rkv_zero(void) { return _mm512_setzero_ps(); }
static inline rkv rkv_set1(float x) { return _mm512_set1_ps(x); }
static inline rkv rkv_load(const float *p) { return _mm512_loadu_ps(p); }
static inline rkv rkv_load_aligned(const float *p) { return _mm512_load_ps(p); }
static inline void rkv_store(float *p, rkv v) { _mm512_storeu_ps(p, v); }
static inline void rkv_store_aligned(float *p, rkv v) { _mm512_store_ps(p, v); }
static inline rkv rkv_add(rkv a, rkv b) { return _mm512_add_ps(a, b); }
static inline rkv rkv_sub(rkv a, rkv b) { return _mm512_sub_ps(a, b); }
static inline rkv rkv_mul(rkv a, rkv b) { return _mm512_mul_ps(a, b); }
static inline rkv rkv_max(rkv a, rkv b) { return _mm512_max_ps(a, b); }
static inline rkv rkv_min(rkv a, rkv b) { return _mm512_min_ps(a, b); }
/* a * b + c */
static inline rkv rkv_fma(rkv a, rkv b, rkv c) { return _mm512_fmadd_ps(a, b, c); }
/* c - a * b */
static inline rkv rkv_fnma(rkv a, rkv b, rkv c) { return _mm512_fnmadd_ps(a, b, c); }
static inline rkv rkv_or(rkv a, rkv b) { return _mm512_or_ps(a, b); }
static inline float rkv_hsum(rkv v) { return _mm512_reduce_add_ps(v); }
static inline float rkv_hmax(rkv v) { return _mm512_reduce_max_ps(v); }
static inline float rkv_first(rkv v) { return _mm512_cvtss_f32(v); }
static inline __mmask16 rk_mask_n(int n) { return (__mmask16)((n >= 16) ? 0xFFFF : ((1u << n) - 1u)); }
static inline rkv rkv_load_n(const float *p, int n) { return _mm512_maskz_loadu_ps(rk_mask_n(n), p); }
static inline void rkv_store_n(float *p, rkv v, int n) { _mm512_mask_storeu_ps(p, rk_mask_n(n), v); }
/* Lanes i >= n replaced by `fill`. */
static inline rkv rkv_fill_from(rkv v, int n, float fill) {
    return _mm512_mask_blend_ps(rk_mask_n(n), _mm512_set1_ps(fill), v);
}
static inline rkv rkv_load_bf16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline void rkv_store_bf16(uint16_t *p, rkv v) {
    __m512i x = _mm512_castps_si512(v);
    /* round to nearest even: x + 0x7FFF + ((x >> 16) & 1), NaN kept quiet */
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(x, _mm512_set1_epi32(0x00400000)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
/* exp() building blocks */
static inline rkv rkv_floor(rkv v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline rkv rkv_ldexp_int(rkv y, rkv fx) {  /* y * 2^fx, fx integral */
    const __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}
static inline rkv rkv_zero_below(rkv y, rkv x, float lo) {  /* y where x >= lo, else 0 (NaN x: 0) */
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_GE_OQ), y);
}
/* RK_VL int8 values widened exactly to fp32. */
static inline rkv rkv_load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* RK_VL float8_e4m3fn bytes widened exactly to fp32 (see rk_fp8_magnitude). */
static inline rkv rkv_load_fp8(const uint8_t *p) {
    const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7F)), 20);
    const __m512i sgn = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24);
    const __m512 t = _mm512_castsi512_ps(_mm512_add_epi32(mag, _mm512_set1_epi32(121 << 23)));
    const __mmask16 sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(1 << 23));
    const __m512 r = _mm512_mask_sub_ps(_mm512_mul_ps(t, _mm512_set1_ps(0.5f)), sub, t, _mm512_set1_ps(0x1p-6f));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), sgn));
}
#else
static inline rkv rkv_zero(void) { return _mm256_setzero_ps(); }
static inline rkv rkv_set1(float x) { return _mm256_set1_ps(x); }
static inline rkv rkv_load(const float *p) { return _mm256_loadu_ps(p); }
static inline rkv rkv_load_aligned(const float *p) { return _mm256_load_ps(p); }
static inline void rkv_store(float *p, rkv v) { _mm256_storeu_ps(p, v); }
static inline void rkv_store_aligned(float *p, rkv v) { _mm256_store_ps(p, v); }
static inline rkv rkv_add(rkv a, rkv b) { return _mm256_add_ps(a, b); }
static inline rkv rkv_sub(rkv a, rkv b) { return _mm256_sub_ps(a, b); }
static inline rkv rkv_mul(rkv a, rkv b) { return _mm256_mul_ps(a, b); }
static inline rkv rkv_max(rkv a, rkv b) { return _mm256_max_ps(a, b); }
static inline rkv rkv_min(rkv a, rkv b) { return _mm256_min_ps(a, b); }
static inline rkv rkv_fma(rkv a, rkv b, rkv c) { return _mm256_fmadd_ps(a, b, c); }
static inline rkv rkv_fnma(rkv a, rkv b, rkv c) { return _mm256_fnmadd_ps(a, b, c); }
static inline rkv rkv_or(rkv a, rkv b) { return _mm256_or_ps(a, b); }
static inline float rkv_hsum(rkv v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 sh = _mm_movehdup_ps(lo);
    lo = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, lo);
    return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}
static inline float rkv_hmax(rkv v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
static inline float rkv_first(rkv v) { return _mm256_cvtss_f32(v); }
static inline __m256i rk_mask_n(int n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx);
}
static inline rkv rkv_load_n(const float *p, int n) { return _mm256_maskload_ps(p, rk_mask_n(n)); }
static inline void rkv_store_n(float *p, rkv v, int n) { _mm256_maskstore_ps(p, rk_mask_n(n), v); }
static inline rkv rkv_fill_from(rkv v, int n, float fill) {
    return _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(rk_mask_n(n)));
}
static inline rkv rkv_load_bf16(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline void rkv_store_bf16(uint16_t *p, rkv v) {
    __m256i x = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(x, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
        _mm256_castsi256_ps(_mm256_or_si256(x, _mm256_set1_epi32(0x00400000))), nan));
    r = _mm256_srli_epi32(r, 16);
    /* pack 8 x u32 (each < 65536) into 8 x u16 */
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}
static inline rkv rkv_floor(rkv v) { return _mm256_floor_ps(v); }
static inline rkv rkv_ldexp_int(rkv y, rkv fx) {
    const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}
static inline rkv rkv_zero_below(rkv y, rkv x, float lo) {
    return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(lo), _CMP_GE_OQ));
}
static inline rkv rkv_load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline rkv rkv_load_fp8(const uint8_t *p) {
    const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7F)), 20);
    const __m256i sgn = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24);
    const __m256 t = _mm256_castsi256_ps(_mm256_add_epi32(mag, _mm256_set1_epi32(121 << 23)));
    const __m256 sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(1 << 23), mag));
    const __m256 r = _mm256_blendv_ps(_mm256_mul_ps(t, _mm256_set1_ps(0.5f)),
                                      _mm256_sub_ps(t, _mm256_set1_ps(0x1p-6f)), sub);
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(r), sgn));
}
#endif

/* exp(x) per lane: Cephes expf's range reduction and degree-6 polynomial (relative error ~1e-7
 * on [-87, 88]); inputs below -87 (and -inf, NaN) give exactly 0, which is what a masked
 * softmax score needs. Source: S. Moshier, Cephes Math Library, expf.c
 * (https://www.netlib.org/cephes/). */
static inline rkv rkv_exp(rkv x0) {
    rkv x = rkv_min(x0, rkv_set1(88.0f));
    x = rkv_max(x, rkv_set1(-87.0f));
    const rkv fx = rkv_floor(rkv_fma(x, rkv_set1(1.44269504088896341f), rkv_set1(0.5f)));
    x = rkv_fnma(fx, rkv_set1(0.693359375f), x);
    x = rkv_fnma(fx, rkv_set1(-2.12194440e-4f), x);
    rkv y = rkv_set1(1.9875691500e-4f);
    y = rkv_fma(y, x, rkv_set1(1.3981999507e-3f));
    y = rkv_fma(y, x, rkv_set1(8.3334519073e-3f));
    y = rkv_fma(y, x, rkv_set1(4.1665795894e-2f));
    y = rkv_fma(y, x, rkv_set1(1.6666665459e-1f));
    y = rkv_fma(y, x, rkv_set1(5.0000001201e-1f));
    y = rkv_fma(y, rkv_mul(x, x), rkv_add(x, rkv_set1(1.0f)));
    return rkv_zero_below(rkv_ldexp_int(y, fx), x0, -87.0f);
}

/* Quantized KV (kernels/kv_quant.py): int8 and float8_e4m3fn values, one fp32 scale per
 * (token, KV head) beside them; a value is float32(q) * scale.
 *
 * rkv_load_i8 / rkv_load_fp8 widen RK_VL stored values to fp32 exactly (no scale). fp8 by bit
 * manipulation, no table and no fp32 denormal operand (which DAZ would flush and some CPUs
 * handle in microcode): the magnitude bits em = e:m (4 exponent, 3 mantissa bits) are placed
 * at fp32 bit 20 with 121 added to the exponent field, t = 2^(e - 6) (1 + m/8): twice the value
 * for e >= 1, and 2^-6 + m 2^-9 (the value plus 2^-6, subtracted exactly) for the subnormals
 * e = 0; the sign bit goes to bit 31. 0x7F / 0xFF (NaN in e4m3fn) read as +-480: the
 * quantizer never writes them (it clamps to +-448; a NaN input gives a NaN scale instead).
 * cpu_decode.c's rk_quantize_head is the write side. */
#define RK_KV_F32 0
#define RK_KV_BF16 1
#define RK_KV_I8 2
#define RK_KV_FP8 3

/* The ISA this file was compiled for ("avx512" or "avx2"): kernels/native.py checks that the
 * library it loaded is the build it asked for. Defined once per library (in cpu_decode.c). */
const char *rk_isa(void);

#endif
