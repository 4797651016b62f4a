/*
 * braid's CPU kernels for the few-row matmuls of a decode step.
 *
 * A decode step multiplies a handful of rows (one per running session) by every weight matrix of
 * the model. For so few rows, MKL's fp32 GEMM reads the weights from memory at a fraction of the
 * bandwidth (measured on a 2-core AVX-512 VM: 7 GB/s at 16 rows, where a plain stream reaches 27),
 * so the step is bound by how the weights are read, not by arithmetic.
 *
 * This kernel reads each weight exactly once per call, as one sequential stream: the weights are
 * packed into column panels of 32 ([N/32][K][32], contiguous), each thread walks its own run of
 * panels, and every 32-float row of a panel is multiplied into all rows of x while it is in
 * registers. Every output element is one fused multiply-add chain over k = 0..K-1 in order, so a
 * row's result does not depend on how many other rows share the call: the same token gives the
 * same logits whatever else is in the batch.
 *
 * The functions take raw pointers (from torch's data_ptr()) and release the GIL while they run;
 * threads come from the OpenMP runtime torch itself loaded, so nothing oversubscribes the cores.
 * The AVX-512 code is compiled for that target only and used only where the CPU has it: Python
 * asks has_avx512() and otherwise keeps torch's own matmul.
 */
#ifndef BRAID_KERNELS_H
#define BRAID_KERNELS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The contract with runner/kernels.py, which checks both when it imports the module. */
#define PANEL 32 /* columns per packed panel: two 16-float AVX-512 vectors */
/* A whole decode step through every layer, for passes where each sequence feeds one token: the
 * same kernels as above in the decoder's order, with no Python between them (one call and no GIL
 * for the step). x [B, hidden] holds the tokens' embeddings and leaves holding the last layer's
 * residual stream; the caller applies the final norm and the LM head. Each layer's row of `table`
 * holds pointers: input_norm, qkv, qkv_bias (or 0), o, post_norm, gate_up, down, k_cache, v_cache. */
enum { T_INPUT_NORM, T_QKV, T_QKV_BIAS, T_O, T_POST_NORM, T_GATE_UP, T_DOWN, T_K_CACHE, T_V_CACHE, T_FIELDS };

typedef struct {
    long B, hidden, H, KVH, D, I, layers, max_seq;
    float eps;
    const int64_t *table, *positions, *slots;
    const float *cos_t, *sin_t;
    float *x, *h, *qkv, *attn, *gate_up, *act; /* scratch: [B, hidden], [B, (H + 2 KVH) D], [B, H D], [B, 2 I], [B, I] */
    int threads;
} step_t;

#define AVX512 __attribute__((target("avx512f,fma")))

/* exp(x) on 16 floats, after Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its
 * degree-7 polynomial, times 2^n. About 2 ulp; the input is clamped to +-88.37 (no inf, no NaN). */
AVX512 static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)), _mm512_set1_ps(88.3762626647949f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* gemm.c */
AVX512 void gemm(const float *x, long ldx, const float *w, float *y, long ldy, long M, long K, long N,
                 int accumulate, const float *bias, int threads);
/* elementwise.c */
AVX512 void rms_norm(const float *x, long ldx, const float *weight, float *out, long ldo, long M, long D,
                     float eps);
AVX512 void silu_mul(const float *gu, long ldg, long M, long I, float *out, long ldo);
AVX512 void rope(float *x, long ld, long N, long heads, long D, const int64_t *positions, const float *cos_t,
                 const float *sin_t);
/* attention.c */
AVX512 void decode_attention(const float *q, const float *k_new, const float *v_new, long ldq, float *k_cache,
                             float *v_cache, const int64_t *slots, const int64_t *positions, long B, long H,
                             long KVH, long D, long max_seq, float scale, float *out, long ldo, int threads);
/* decode_step.c */
AVX512 void decode_step(const step_t *s);

#endif
