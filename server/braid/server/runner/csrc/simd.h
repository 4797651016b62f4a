/*
 * The vector operations the kernels are written in, for one instruction set: VEC = 16 (AVX-512) or
 * 8 (AVX2 + FMA + F16C), set by the isa_*.c file that includes this under its target pragma, and
 * VNNI = 1 where the build has the integer dot product (AVX-512 VNNI, AVX-VNNI), else 0.
 *
 * Written by hand, not taken from a SIMD library: the kernels need a dozen operations, and each
 * maps to one or two intrinsics here; a library would add a C++ dependency for that.
 */
#ifndef BRAID_SIMD_H
#define BRAID_SIMD_H

#include "kernels.h"

#define NV (PANEL / VEC) /* vectors per 32-column panel row */

#if VEC == 16
typedef __m512 vf;
typedef __mmask16 vmask;
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vdiv _mm512_div_ps
#define vmin _mm512_min_ps
#define vmax _mm512_max_ps
#define vfmadd _mm512_fmadd_ps
#define vfnmadd _mm512_fnmadd_ps
#define vsum _mm512_reduce_add_ps
/* the first n lanes (none for n <= 0, all for n >= VEC) */
static inline vmask vmask_n(long n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }
#define vloadm(m, p) _mm512_maskz_loadu_ps(m, p)
#define vstorem(m, p, v) _mm512_mask_storeu_ps(p, m, v)
#define vmaskz(m, v) _mm512_maskz_mov_ps(m, v) /* v in the mask's lanes, 0 elsewhere */
#define vabs _mm512_abs_ps
/* |magnitude| with the sign of `sign` (magnitude >= 0) */
#define vwithsign(magnitude, sign) _mm512_castsi512_ps(_mm512_or_epi32(_mm512_castps_si512(magnitude), \
    _mm512_and_epi32(_mm512_castps_si512(sign), _mm512_set1_epi32((int)0x80000000u))))
/* lanes of a less than b from x, the others from y */
#define vselect_lt(a, b, x, y) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x)
/* 16 int8 / fp16 / bf16 values widened to fp32 (exact) */
static inline vf vcvt_i8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline vf vcvt_f16(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vcvt_bf16(const void *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* one Q4 row: 16 bytes, column j in the low nibble of byte j and column j + 16 in its high one */
static inline void vcvt_u4(const uint8_t *p, vf w[NV]) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), f = _mm_set1_epi8(0x0F);
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, f)));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), f)));
}
/* exp(x), after Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-7
 * polynomial, times 2^n. About 2 ulp; the input is clamped (no inf, no NaN). */
#define EXP_LO -88.3762626647949f
#define EXP_HI 88.3762626647949f
#define vround(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vscale2(p, n) _mm512_scalef_ps(p, n)

/* The 16 horizontal sums of v[0..15], as lane i of one vector: pairs within 128-bit lanes, then
 * 128-bit lanes across vectors (45 shuffles and adds, against ~130 for 16 separate reductions). */
static inline vf vhsum(const vf v[16]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++) /* lanes [v2i, v2i+1, v2i, v2i+1] per 128 bits */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* lanes [v4i .. v4i+3] per 128 bits */
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(d01, d23, _MM_SHUFFLE(3, 1, 3, 1)));
}


/* Integer vectors for the int8 path (int8.c): VEC 32-bit lanes, each 4 bytes of 4 rows of k. The
 * AVX-512 builds need AVX-512BW for byte operations. */
typedef __m512i vi;
#define viload(p) _mm512_loadu_si512((const void *)(p))
#define vizero _mm512_setzero_si512
#define viset1(v) _mm512_set1_epi32(v)
#define viadd _mm512_add_epi32
#define visub _mm512_sub_epi32
#define vicvt _mm512_cvtepi32_ps
#define vilo4(v) _mm512_and_si512(v, _mm512_set1_epi8(0x0F))
#define vihi4(v) _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F))
#define vior _mm512_or_si512
#define viput(p, v) _mm512_storeu_si512((void *)(p), v)
/* The high 2 bits of a 4-row group's 6-bit quants (kernels.h's Q6_K plane of 32 bytes at p) for
 * columns [c, c + 16), c 0 or 16, in bits 4-5 of each byte (their low 4 bits' nibble below): the plane
 * in both halves, each shifted to its columns' bit pair (a qword's shift moves no bit of a byte's
 * pair into another byte's bits 4-5). */
static inline vi vihi2(const uint8_t *p, long c) {
    const vi v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
    const vi s = c < 16 ? _mm512_sllv_epi64(v, _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4))
                        : _mm512_srlv_epi64(v, _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0));
    return _mm512_and_si512(s, _mm512_set1_epi8(0x30));
}
/* 4 signed bytes broadcast to every lane */
static inline vi vibcast4(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
/* acc + the sums of 4 products of unsigned bytes w by signed bytes x, per lane (w <= 127, or w <= 255 with VNNI) */
#if VNNI
static inline vi vidot_u8(vi acc, vi w, vi x) { return _mm512_dpbusd_epi32(acc, w, x); }
#else
static inline vi vidot_u8(vi acc, vi w, vi x) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
}
/* vidot_u8 in two halves (int8.c's 4-bit quants): acc16 + the 16-bit sums of pairs of products, then
 * acc + the pairs of a 16-bit sum added into each lane */
static inline vi vidot16_u8(vi acc16, vi w, vi x) { return _mm512_add_epi16(acc16, _mm512_maddubs_epi16(w, x)); }
static inline vi viwiden16(vi acc16) { return _mm512_madd_epi16(acc16, _mm512_set1_epi16(1)); }
#endif
/* The same for signed bytes w: with VNNI w + 128 (the caller subtracts 128 sum(x), S8_BIAS),
 * else |w| times x with w's sign, as llama.cpp does (no 16-bit sum can saturate). */
#if VNNI
#define S8_BIAS 128
static inline vi viprep_s8(vi w) { return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)); }
static inline vi vidot_s8(vi acc, vi prepared, vi w, vi x) { (void)w; return _mm512_dpbusd_epi32(acc, prepared, x); }
#else
#define S8_BIAS 0
static inline vi viprep_s8(vi w) { return _mm512_abs_epi8(w); }
static inline vi vidot_s8(vi acc, vi prepared, vi w, vi x) {
    return vidot_u8(acc, prepared, _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x));
}
#endif
/* fp32 lanes rounded to nearest even, stored as saturated int8 (the lanes are in [-127, 127]) */
static inline vi vround_i32(vf v) { return _mm512_cvtps_epi32(v); }
static inline void vistore_i8(int8_t *p, vi v) { _mm_storeu_si128((__m128i *)p, _mm512_cvtsepi32_epi8(v)); }
#define vihsum _mm512_reduce_add_epi32
#define vhmax _mm512_reduce_max_ps

#elif VEC == 8
typedef __m256 vf;
typedef __m256i vmask;
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vdiv _mm256_div_ps
#define vmin _mm256_min_ps
#define vmax _mm256_max_ps
#define vfmadd _mm256_fmadd_ps
#define vfnmadd _mm256_fnmadd_ps
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vmask vmask_n(long n) {
    const int lanes = n >= 8 ? 8 : n <= 0 ? 0 : (int)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#define vloadm(m, p) _mm256_maskload_ps(p, m)
#define vstorem(m, p, v) _mm256_maskstore_ps(p, m, v)
#define vmaskz(m, v) _mm256_and_ps(_mm256_castsi256_ps(m), v)
#define vabs(v) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v)
#define vwithsign(magnitude, sign) _mm256_or_ps(magnitude, _mm256_and_ps(sign, _mm256_set1_ps(-0.0f)))
#define vselect_lt(a, b, x, y) _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ))
static inline vf vcvt_i8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline vf vcvt_f16(const void *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vcvt_bf16(const void *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline void vcvt_u4(const uint8_t *p, vf w[NV]) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), f = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, f), hi = _mm_and_si128(_mm_srli_epi16(b, 4), f);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
/* Without AVX-512's scalef, 2^n is built in the exponent bits, so n must stay a normal exponent:
 * the clamp keeps n in [-126, 127]. */
#define EXP_LO -87.33654475f
#define EXP_HI 88.37626266f
#define vround(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline vf vscale2(vf p, vf n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
/* The 8 horizontal sums of v[0..7], as lane i of one vector. */
static inline vf vhsum(const vf v[8]) {
    const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* Integer vectors for the int8 path (int8.c), as for AVX-512 above. */
typedef __m256i vi;
#define viload(p) _mm256_loadu_si256((const __m256i *)(p))
#define vizero _mm256_setzero_si256
#define viset1(v) _mm256_set1_epi32(v)
#define viadd _mm256_add_epi32
#define visub _mm256_sub_epi32
#define vicvt _mm256_cvtepi32_ps
#define vilo4(v) _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
#define vihi4(v) _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F))
#define vior _mm256_or_si256
#define viput(p, v) _mm256_storeu_si256((__m256i *)(p), v)
/* vihi2 above, for columns [c, c + 8): the plane's bit pair c / 8 of each byte to bits 4-5. */
static inline vi vihi2(const uint8_t *p, long c) {
    const vi v = _mm256_loadu_si256((const __m256i *)p);
    const long pair = c / 8 % 4;
    const vi s = pair == 0 ? _mm256_slli_epi16(v, 4) : pair == 1 ? _mm256_slli_epi16(v, 2)
                 : pair == 2 ? v : _mm256_srli_epi16(v, 2);
    return _mm256_and_si256(s, _mm256_set1_epi8(0x30));
}
static inline vi vibcast4(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
#if VNNI
static inline vi vidot_u8(vi acc, vi w, vi x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
#else
static inline vi vidot_u8(vi acc, vi w, vi x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
static inline vi vidot16_u8(vi acc16, vi w, vi x) { return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w, x)); }
static inline vi viwiden16(vi acc16) { return _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)); }
#endif
#if VNNI
#define S8_BIAS 128
static inline vi viprep_s8(vi w) { return _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)); }
static inline vi vidot_s8(vi acc, vi prepared, vi w, vi x) { (void)w; return _mm256_dpbusd_avx_epi32(acc, prepared, x); }
#else
#define S8_BIAS 0
static inline vi viprep_s8(vi w) { return _mm256_abs_epi8(w); }
static inline vi vidot_s8(vi acc, vi prepared, vi w, vi x) { return vidot_u8(acc, prepared, _mm256_sign_epi8(x, w)); }
#endif
static inline vi vround_i32(vf v) { return _mm256_cvtps_epi32(v); }
static inline void vistore_i8(int8_t *p, vi v) {
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(w, w));
}
static inline int vihsum(vi v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}
static inline float vhmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

#else
#error "VEC must be 8 or 16"
#endif

/* v's first n lanes stored at p (all of them where n >= VEC): masked only for a tail. AVX2's masked
 * store is microcoded on AMD's Zen 2 and 3, about 14 cycles a store on Zen 3 against 1 (a row's
 * outputs, a softmax's exponentials and a gated activation stored every vector masked). */
static inline void vstore_n(float *p, vf v, long n) {
    if (n >= VEC)
        vstore(p, v);
    else
        vstorem(vmask_n(n), p, v);
}

static inline vf vexp(vf x) {
    x = vmin(vmax(x, vset1(EXP_LO)), vset1(EXP_HI));
    const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
    vf r = vfnmadd(n, vset1(0.693359375f), x);
    r = vfnmadd(n, vset1(-2.12194440e-4f), r);
    vf p = vset1(1.9875691500e-4f);
    p = vfmadd(p, r, vset1(1.3981999507e-3f));
    p = vfmadd(p, r, vset1(8.3334519073e-3f));
    p = vfmadd(p, r, vset1(4.1665795894e-2f));
    p = vfmadd(p, r, vset1(1.6666665459e-1f));
    p = vfmadd(p, r, vset1(5.0000001201e-1f));
    p = vfmadd(p, vmul(r, r), vadd(r, vset1(1.0f)));
    return vscale2(p, n);
}

/* tanh(x), after Cephes' tanhf: x + x^3 P(x^2) where |x| < 0.625, else 1 - 2 / (exp(2|x|) + 1)
 * with x's sign (exp's clamp keeps it finite: +-1 for large |x|). About 2 ulp. */
static inline vf vtanh(vf x) {
    const vf a = vabs(x), one = vset1(1.0f);
    const vf far = vsub(one, vdiv(vset1(2.0f), vadd(vexp(vadd(a, a)), one)));
    const vf z = vmul(x, x);
    vf p = vset1(-5.70498872745e-3f);
    p = vfmadd(p, z, vset1(2.06390887954e-2f));
    p = vfmadd(p, z, vset1(-5.37397155531e-2f));
    p = vfmadd(p, z, vset1(1.33314422036e-1f));
    p = vfmadd(p, z, vset1(-3.33332819422e-1f));
    const vf near = vfmadd(vmul(p, z), x, x);
    return vselect_lt(a, vset1(0.625f), near, vwithsign(far, x));
}

/* Row `row` of a Q6_K block in rows (kernels.h: 16 bytes of low nibbles, 8 of high bit pairs) as its
 * 32 quants q in [-32, 31]. SSE2, the same in every build. */
static inline void u6_row(const uint8_t *row, int8_t out[PANEL]) {
    const __m128i b = _mm_loadu_si128((const __m128i *)row), h = _mm_loadl_epi64((const __m128i *)(row + 16));
    const __m128i f = _mm_set1_epi8(0x0F), three = _mm_set1_epi8(3), lift = _mm_set1_epi8(U6_LIFT);
    const __m128i h0 = _mm_and_si128(h, three), h1 = _mm_and_si128(_mm_srli_epi16(h, 2), three);
    const __m128i h2 = _mm_and_si128(_mm_srli_epi16(h, 4), three), h3 = _mm_and_si128(_mm_srli_epi16(h, 6), three);
    const __m128i top0 = _mm_slli_epi16(_mm_unpacklo_epi64(h0, h1), 4); /* columns 0-15's, at bits 4-5 */
    const __m128i top1 = _mm_slli_epi16(_mm_unpacklo_epi64(h2, h3), 4); /* columns 16-31's */
    const __m128i lo = _mm_or_si128(_mm_and_si128(b, f), top0);
    const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(b, 4), f), top1);
    _mm_storeu_si128((__m128i *)out, _mm_sub_epi8(lo, lift));
    _mm_storeu_si128((__m128i *)(out + 16), _mm_sub_epi8(hi, lift));
}

/* v left in its register as it is. An unrolled chain of integer adds (int8.c's tile sums) is one gcc
 * may reassociate into a tree, and it did in the AVX2 builds: it computed a block's products first and
 * spilled them to the stack to add them after. The empty asm, which might change v, keeps the adds in
 * their order. The AVX-512 builds (32 registers) are left as they were: no machine here runs them to
 * measure what it would change (the sums are exact either way: the bits are the same). */
#if VEC == 16
#define vikeep(v) ((void)0)
#else
#define vikeep(v) __asm__("" : "+x"(v))
#endif

/* CALL with NAME a constant: value, 1 to 4 (4 for more), so that the loops it runs unroll. */
#define WITH_1_TO_4(value, NAME, CALL) do { \
        switch (value) { \
        case 1: { enum { NAME = 1 }; CALL; } break; \
        case 2: { enum { NAME = 2 }; CALL; } break; \
        case 3: { enum { NAME = 3 }; CALL; } break; \
        default: { enum { NAME = 4 }; CALL; } break; \
        } \
    } while (0)

#endif
