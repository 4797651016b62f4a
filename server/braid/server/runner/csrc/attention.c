/* Decode attention over the slot KV cache. */
#include "kernels.h"

/* The 16 horizontal sums of v[0..15], as lane i of one vector: pairs within 128-bit lanes, then
 * 128-bit lanes across vectors (45 shuffles and adds, against ~130 for 16 separate reductions). */
AVX512 static inline __m512 hsum16(const __m512 v[16]) {
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

/* Attention for the decode rows of a pass: each of B sequences has one new token, at position
 * positions[b] of cache slot slots[b]. Its key and value (rows of k_new / v_new, KVH heads of D)
 * are written into the cache, [slots, KVH, max_seq, D], and its H query heads (rows of q) attend
 * over positions [0, positions[b]] of the slot. Grouped-query: the H / KVH query heads of a KV head
 * share one pass over its keys and values. out: B rows (stride ldo) of H x D. One task per
 * (sequence, KV head); a sequence's result does not depend on the others in the pass. */
AVX512 void decode_attention(const float *q, const float *k_new, const float *v_new, long ldq,
                                    float *k_cache, float *v_cache, const int64_t *slots,
                                    const int64_t *positions, long B, long H, long KVH, long D,
                                    long max_seq, float scale, float *out, long ldo, int threads) {
    const long G = H / KVH, chunks = D / 16;
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1 && B * KVH > 1)
    for (long task = 0; task < B * KVH; task++) {
        const long b = task / KVH, h = task % KVH, L = positions[b] + 1;
        float *keys = k_cache + (slots[b] * KVH + h) * max_seq * D;
        float *values = v_cache + (slots[b] * KVH + h) * max_seq * D;
        memcpy(keys + (L - 1) * D, k_new + b * ldq + h * D, D * sizeof(float));
        memcpy(values + (L - 1) * D, v_new + b * ldq + h * D, D * sizeof(float));
        float *scores = malloc(sizeof(float) * G * L);
        for (long g = 0; g < G; g++) {
            const float *qg = q + b * ldq + (h * G + g) * D;
            float *sc = scores + g * L, top = -INFINITY;
            long t = 0;
            for (; t + 16 <= L; t += 16) { /* 16 keys at a time, their 16 sums in one transpose */
                __m512 dots[16];
                for (int i = 0; i < 16; i++) {
                    dots[i] = _mm512_setzero_ps();
                    for (long j = 0; j < chunks; j++)
                        dots[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j),
                                                  _mm512_loadu_ps(keys + (t + i) * D + 16 * j), dots[i]);
                }
                _mm512_storeu_ps(sc + t, _mm512_mul_ps(hsum16(dots), _mm512_set1_ps(scale)));
            }
            for (; t < L; t++) {
                __m512 dot = _mm512_setzero_ps();
                for (long j = 0; j < chunks; j++)
                    dot = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j), _mm512_loadu_ps(keys + t * D + 16 * j), dot);
                sc[t] = _mm512_reduce_add_ps(dot) * scale;
            }
            for (t = 0; t < L; t++) top = sc[t] > top ? sc[t] : top;
            __m512 total = _mm512_setzero_ps();
            const __m512 topv = _mm512_set1_ps(top);
            for (long t = 0; t < L; t += 16) {
                const __mmask16 k = L - t >= 16 ? 0xFFFF : (__mmask16)((1u << (L - t)) - 1);
                const __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + t), topv)));
                _mm512_mask_storeu_ps(sc + t, k, e);
                total = _mm512_add_ps(total, e);
            }
            const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
            float *o = out + b * ldo + (h * G + g) * D;
            for (long j = 0; j < chunks; j++) {
                __m512 acc = _mm512_setzero_ps();
                for (long t = 0; t < L; t++)
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(sc[t]), _mm512_loadu_ps(values + t * D + 16 * j), acc);
                _mm512_storeu_ps(o + 16 * j, _mm512_mul_ps(acc, inv));
            }
        }
        free(scores);
    }
}
