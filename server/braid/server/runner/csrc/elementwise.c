/* Row-wise kernels: RMSNorm, SwiGLU, rotary embedding. */
#include "kernels.h"

/* out[M, D] = x / sqrt(mean(x^2) + eps) * weight, row by row (rows of stride ldx and ldo). */
AVX512 void rms_norm(const float *x, long ldx, const float *weight, float *out, long ldo,
                            long M, long D, float eps) {
    for (long m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        float *o = out + m * ldo;
        __m512 ss = _mm512_setzero_ps();
        long d = 0;
        for (; d + 16 <= D; d += 16) {
            const __m512 v = _mm512_loadu_ps(xr + d);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        float sum = _mm512_reduce_add_ps(ss);
        for (; d < D; d++) sum += xr[d] * xr[d];
        const float inv = 1.0f / sqrtf(sum / (float)D + eps);
        const __m512 s = _mm512_set1_ps(inv);
        for (d = 0; d + 16 <= D; d += 16)
            _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + d), s),
                                                  _mm512_loadu_ps(weight + d)));
        for (; d < D; d++) o[d] = xr[d] * inv * weight[d];
    }
}

/* out[M, I] = silu(gate) * up, where each row of gu (stride ldg) is [gate (I) | up (I)]. */
AVX512 void silu_mul(const float *gu, long ldg, long M, long I, float *out, long ldo) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (long m = 0; m < M; m++) {
        const float *g = gu + m * ldg, *u = g + I;
        float *o = out + m * ldo;
        for (long i = 0; i < I; i += 16) {
            const __mmask16 k = I - i >= 16 ? 0xFFFF : (__mmask16)((1u << (I - i)) - 1);
            const __m512 gv = _mm512_maskz_loadu_ps(k, g + i);
            const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            _mm512_mask_storeu_ps(o + i, k, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(k, u + i)));
        }
    }
}

/* Rotary embedding in place on the first `heads` heads (of D floats) of each of N rows (stride ld):
 * x' = x * cos[pos] + roll(x, D / 2) * signed_sin[pos], the tables [max_seq, D]. */
AVX512 void rope(float *x, long ld, long N, long heads, long D, const int64_t *positions,
                        const float *cos_t, const float *sin_t) {
    float tmp[1024];
    const long half = D / 2;
    for (long n = 0; n < N; n++) {
        const float *c = cos_t + positions[n] * D, *s = sin_t + positions[n] * D;
        for (long h = 0; h < heads; h++) {
            float *v = x + n * ld + h * D;
            if (half % 16 == 0) { /* both halves at once, 16 floats at a time */
                for (long d = 0; d < half; d += 16) {
                    const __m512 lo = _mm512_loadu_ps(v + d), hi = _mm512_loadu_ps(v + half + d);
                    _mm512_storeu_ps(v + d, _mm512_fmadd_ps(hi, _mm512_loadu_ps(s + d),
                                                            _mm512_mul_ps(lo, _mm512_loadu_ps(c + d))));
                    _mm512_storeu_ps(v + half + d, _mm512_fmadd_ps(lo, _mm512_loadu_ps(s + half + d),
                                                                   _mm512_mul_ps(hi, _mm512_loadu_ps(c + half + d))));
                }
                continue;
            }
            memcpy(tmp, v, D * sizeof(float));
            for (long d = 0; d < half; d++) v[d] = tmp[d] * c[d] + tmp[d + half] * s[d];
            for (long d = half; d < D; d++) v[d] = tmp[d] * c[d] + tmp[d - half] * s[d];
        }
    }
}
