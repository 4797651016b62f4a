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
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 32 /* columns per packed panel: two 16-float AVX-512 vectors */
#ifndef PREFETCH
#define PREFETCH 16384
#endif
#ifndef GEMV_PREFETCH
#define GEMV_PREFETCH 2048
#endif
#define MAX_TILE 12
#define CHUNK_ROWS 64 /* rows whose partial sums are kept at once (8 KiB of L1) */
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T2
#endif
#ifndef KBLOCK
#define KBLOCK 32
#endif /* rows per register tile: 12 rows x 2 vectors = 24 accumulators */

#define AVX512 __attribute__((target("avx512f,fma")))

/* One tile: rows [0, MR) of x, k in [k0, k1), times one packed panel. The partial sums live in
 * acc ([MR][32], in L1) between k-blocks; the last k-block adds bias (and y) and stores into y. */
#define DEFINE_TILE(MR)                                                                          \
    AVX512 static void tile_##MR(const float *restrict x, long ldx, const float *restrict w,    \
                                 long k0, long k1, float *restrict acc, const float *restrict ahead, \
                                 float *restrict y, long ldy, int last, int accumulate,          \
                                 const float *restrict bias, __mmask16 m0, __mmask16 m1) {      \
        __m512 a0[MR], a1[MR];                                                                   \
        for (int m = 0; m < MR; m++) {                                                           \
            a0[m] = k0 ? _mm512_load_ps(acc + m * PANEL) : _mm512_setzero_ps();                  \
            a1[m] = k0 ? _mm512_load_ps(acc + m * PANEL + 16) : _mm512_setzero_ps();             \
        }                                                                                        \
        for (long k = k0; k < k1; k++) {                                                         \
            if (ahead) {                                                                         \
                _mm_prefetch((const char *)(ahead + k * PANEL), PREFETCH_HINT);                    \
                _mm_prefetch((const char *)(ahead + k * PANEL + 16), PREFETCH_HINT);               \
            }                                                                                    \
            const __m512 w0 = _mm512_loadu_ps(w + k * PANEL);                                    \
            const __m512 w1 = _mm512_loadu_ps(w + k * PANEL + 16);                               \
            for (int m = 0; m < MR; m++) {                                                       \
                const __m512 b = _mm512_set1_ps(x[m * ldx + k]);                                 \
                a0[m] = _mm512_fmadd_ps(b, w0, a0[m]);                                           \
                a1[m] = _mm512_fmadd_ps(b, w1, a1[m]);                                           \
            }                                                                                    \
        }                                                                                        \
        if (!last) {                                                                             \
            for (int m = 0; m < MR; m++) {                                                       \
                _mm512_store_ps(acc + m * PANEL, a0[m]);                                         \
                _mm512_store_ps(acc + m * PANEL + 16, a1[m]);                                    \
            }                                                                                    \
            return;                                                                              \
        }                                                                                        \
        __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();                               \
        if (bias) {                                                                              \
            b0 = _mm512_maskz_loadu_ps(m0, bias);                                                \
            b1 = _mm512_maskz_loadu_ps(m1, bias + 16);                                           \
        }                                                                                        \
        for (int m = 0; m < MR; m++) {                                                           \
            float *row = y + m * ldy;                                                            \
            __m512 r0 = _mm512_add_ps(a0[m], b0), r1 = _mm512_add_ps(a1[m], b1);                 \
            if (accumulate) {                                                                    \
                r0 = _mm512_add_ps(r0, _mm512_maskz_loadu_ps(m0, row));                          \
                r1 = _mm512_add_ps(r1, _mm512_maskz_loadu_ps(m1, row + 16));                     \
            }                                                                                    \
            _mm512_mask_storeu_ps(row, m0, r0);                                                  \
            _mm512_mask_storeu_ps(row + 16, m1, r1);                                             \
        }                                                                                        \
    }

DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)
DEFINE_TILE(7)
DEFINE_TILE(8)
DEFINE_TILE(9)
DEFINE_TILE(10)
DEFINE_TILE(11)
DEFINE_TILE(12)

typedef void (*tile_fn)(const float *, long, const float *, long, long, float *, const float *, float *,
                        long, int, int, const float *, __mmask16, __mmask16);
static const tile_fn TILES[MAX_TILE + 1] = {NULL,     tile_1,  tile_2,  tile_3, tile_4,
                                            tile_5,   tile_6,  tile_7,  tile_8, tile_9,
                                            tile_10,  tile_11, tile_12};

/* The one-row case (a single decoding session): the whole panel in one pass, prefetched into L1 a
 * few KiB ahead; bound by memory bandwidth alone. Its sums run over k in the same order as the
 * tiles', so a row gets the same result alone as in a batch. */
AVX512 static void gemv_panel(const float *restrict x, const float *restrict w, long K,
                              float *restrict y, int accumulate, const float *restrict bias,
                              __mmask16 m0, __mmask16 m1) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    for (long k = 0; k < K; k++) {
        const float *row = w + k * PANEL;
        _mm_prefetch((const char *)(row + GEMV_PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(row + GEMV_PREFETCH + 16), _MM_HINT_T0);
        const __m512 b = _mm512_set1_ps(x[k]);
        a0 = _mm512_fmadd_ps(b, _mm512_loadu_ps(row), a0);
        a1 = _mm512_fmadd_ps(b, _mm512_loadu_ps(row + 16), a1);
    }
    if (bias) {
        a0 = _mm512_add_ps(a0, _mm512_maskz_loadu_ps(m0, bias));
        a1 = _mm512_add_ps(a1, _mm512_maskz_loadu_ps(m1, bias + 16));
    }
    if (accumulate) {
        a0 = _mm512_add_ps(a0, _mm512_maskz_loadu_ps(m0, y));
        a1 = _mm512_add_ps(a1, _mm512_maskz_loadu_ps(m1, y + 16));
    }
    _mm512_mask_storeu_ps(y, m0, a0);
    _mm512_mask_storeu_ps(y + 16, m1, a1);
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W + bias, or y += ... when accumulate.
 * W is packed: panel p holds columns [32p, 32p + 32) as K rows of 32 floats, zero-padded.
 * Each panel is walked in k-blocks small enough for L1, and every k-block is used by all rows
 * before the next is read, so the weights stream from memory at an even pace while the next
 * k-block is prefetched. */
AVX512 static void gemm(const float *x, long ldx, const float *w, float *y, long ldy, long M, long K,
                        long N, int accumulate, const float *bias, int threads) {
    const long panels = (N + PANEL - 1) / PANEL;
    /* Few rows: short k-blocks keep the weight stream even. Many rows (a prefill): long ones, so
     * the partial sums go through L1 less often (~10% faster at 128+ rows); same sums either way. */
    const long kblock = M > 16 ? 256 : KBLOCK;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (long p = 0; p < panels; p++) {
        float acc[CHUNK_ROWS * PANEL] __attribute__((aligned(64)));
        const long col = p * PANEL, width = N - col < PANEL ? N - col : PANEL;
        const __mmask16 m0 = width >= 16 ? 0xFFFF : (__mmask16)((1u << width) - 1);
        const __mmask16 m1 = width <= 16 ? 0 : width >= 32 ? 0xFFFF : (__mmask16)((1u << (width - 16)) - 1);
        const float *panel = w + p * K * PANEL;
        const float *b = bias ? bias + col : NULL;
        if (M == 1) {
            gemv_panel(x, panel, K, y + col, accumulate, b, m0, m1);
            continue;
        }
        /* A long prefill goes in chunks of rows; the panel stays in L2 for the chunks after the
         * first, so it is read from memory once. */
        for (long r0 = 0; r0 < M; r0 += CHUNK_ROWS) {
            const long rows_in_chunk = M - r0 < CHUNK_ROWS ? M - r0 : CHUNK_ROWS;
            const long tiles = (rows_in_chunk + MAX_TILE - 1) / MAX_TILE;
            for (long k0 = 0; k0 < K; k0 += kblock) {
                const long k1 = k0 + kblock < K ? k0 + kblock : K;
                const int last = k1 == K;
                const float *ahead = r0 == 0 ? panel + PREFETCH : NULL;
                /* rows split evenly over the tiles: 16 rows are two tiles of 8, not 12 + 4 */
                long row = 0;
                for (long t = 0; t < tiles; t++) {
                    const long rows = (rows_in_chunk - row + (tiles - t) - 1) / (tiles - t);
                    const long r = r0 + row;
                    TILES[rows](x + r * ldx, ldx, panel, k0, k1, acc + row * PANEL,
                                t == 0 ? ahead : NULL, y + r * ldy + col, ldy, last, accumulate, b,
                                m0, m1);
                    row += rows;
                }
            }
        }
    }
}

/* out[M, D] = x / sqrt(mean(x^2) + eps) * weight, row by row (rows of stride ldx and ldo). */
AVX512 static void rms_norm(const float *x, long ldx, const float *weight, float *out, long ldo,
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

/* out[M, I] = silu(gate) * up, where each row of gu (stride ldg) is [gate (I) | up (I)]. */
AVX512 static void silu_mul(const float *gu, long ldg, long M, long I, float *out, long ldo) {
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
AVX512 static void rope(float *x, long ld, long N, long heads, long D, const int64_t *positions,
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
AVX512 static void decode_attention(const float *q, const float *k_new, const float *v_new, long ldq,
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

AVX512 static void decode_step(const step_t *s) {
    const long B = s->B, hd = s->hidden, qd = s->H * s->D, kvd = s->KVH * s->D, width = qd + 2 * kvd;
    for (long layer = 0; layer < s->layers; layer++) {
        const int64_t *t = s->table + layer * T_FIELDS;
#define P(field) ((float *)(intptr_t)t[field])
        rms_norm(s->x, hd, P(T_INPUT_NORM), s->h, hd, B, hd, s->eps);
        gemm(s->h, hd, P(T_QKV), s->qkv, width, B, hd, width, 0, P(T_QKV_BIAS), s->threads);
        rope(s->qkv, width, B, s->H + s->KVH, s->D, s->positions, s->cos_t, s->sin_t);
        decode_attention(s->qkv, s->qkv + qd, s->qkv + qd + kvd, width, P(T_K_CACHE), P(T_V_CACHE), s->slots,
                         s->positions, B, s->H, s->KVH, s->D, s->max_seq, 1.0f / sqrtf((float)s->D), s->attn,
                         qd, s->threads);
        gemm(s->attn, qd, P(T_O), s->x, hd, B, qd, hd, 1, NULL, s->threads);
        rms_norm(s->x, hd, P(T_POST_NORM), s->h, hd, B, hd, s->eps);
        gemm(s->h, hd, P(T_GATE_UP), s->gate_up, 2 * s->I, B, hd, 2 * s->I, 0, NULL, s->threads);
        silu_mul(s->gate_up, 2 * s->I, B, s->I, s->act, s->I);
        gemm(s->act, s->I, P(T_DOWN), s->x, hd, B, s->I, hd, 1, NULL, s->threads);
#undef P
    }
}

/* ---- Python bindings: every argument a number (a pointer from data_ptr(), a size, a float),
 * described by a format string: 'p' pointer (None: NULL), 'l' long, 'f' float. ---- */

typedef union {
    void *p;
    long l;
    double f;
} arg_t;

static int parse(PyObject *const *args, Py_ssize_t nargs, const char *format, arg_t *out) {
    const Py_ssize_t n = (Py_ssize_t)strlen(format);
    if (nargs != n) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", n, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (format[i] == 'p') out[i].p = args[i] == Py_None ? NULL : PyLong_AsVoidPtr(args[i]);
        else if (format[i] == 'l') out[i].l = PyLong_AsLong(args[i]);
        else out[i].f = PyFloat_AsDouble(args[i]);
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

static PyObject *py_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[11];
    if (parse(args, nargs, "plpplllllpl", a)) return NULL;
    const long M = a[5].l, K = a[6].l, N = a[7].l;
    if (M < 1 || K < 1 || N < 1 || a[1].l < K || a[4].l < N) {
        PyErr_SetString(PyExc_ValueError, "gemm: bad shape");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    gemm(a[0].p, a[1].l, a[2].p, a[3].p, a[4].l, M, K, N, (int)a[8].l, a[9].p, (int)a[10].l);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[8];
    if (parse(args, nargs, "plpplllf", a)) return NULL;
    rms_norm(a[0].p, a[1].l, a[2].p, a[3].p, a[4].l, a[5].l, a[6].l, (float)a[7].f);
    Py_RETURN_NONE;
}

static PyObject *py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[6];
    if (parse(args, nargs, "plllpl", a)) return NULL;
    silu_mul(a[0].p, a[1].l, a[2].l, a[3].l, a[4].p, a[5].l);
    Py_RETURN_NONE;
}

static PyObject *py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[8];
    if (parse(args, nargs, "pllllppp", a)) return NULL;
    if (a[4].l > 1024 || a[4].l % 2) {
        PyErr_SetString(PyExc_ValueError, "rope: head_dim must be even and at most 1024");
        return NULL;
    }
    rope(a[0].p, a[1].l, a[2].l, a[3].l, a[4].l, a[5].p, a[6].p, a[7].p);
    Py_RETURN_NONE;
}

static PyObject *py_decode_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[17];
    if (parse(args, nargs, "ppplpppplllllfpll", a)) return NULL;
    const long H = a[9].l, KVH = a[10].l, D = a[11].l;
    if (KVH < 1 || H % KVH || D % 16) {
        PyErr_SetString(PyExc_ValueError, "decode_attention: heads must divide evenly, head_dim by 16");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    decode_attention(a[0].p, a[1].p, a[2].p, a[3].l, a[4].p, a[5].p, a[6].p, a[7].p, a[8].l, H, KVH,
                     D, a[12].l, (float)a[13].f, a[14].p, a[15].l, (int)a[16].l);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_decode_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[21];
    if (parse(args, nargs, "llllllllfpppppppppppl", a)) return NULL;
    step_t s = {.B = a[0].l, .hidden = a[1].l, .H = a[2].l, .KVH = a[3].l, .D = a[4].l, .I = a[5].l,
                .layers = a[6].l, .max_seq = a[7].l, .eps = (float)a[8].f, .table = a[9].p,
                .positions = a[10].p, .slots = a[11].p, .cos_t = a[12].p, .sin_t = a[13].p, .x = a[14].p,
                .h = a[15].p, .qkv = a[16].p, .attn = a[17].p, .gate_up = a[18].p, .act = a[19].p,
                .threads = (int)a[20].l};
    if (s.B < 1 || s.KVH < 1 || s.H % s.KVH || s.D % 16 || s.D > 1024) {
        PyErr_SetString(PyExc_ValueError, "decode_step: bad shape");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    decode_step(&s);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_has_avx512(PyObject *self, PyObject *unused) {
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma"));
}

static PyMethodDef METHODS[] = {
    {"gemm", (PyCFunction)(void (*)(void))py_gemm, METH_FASTCALL,
     "gemm(x, ldx, w_packed, y, ldy, M, K, N, accumulate, bias, threads): y (+)= x @ W + bias"},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL,
     "rms_norm(x, ldx, weight, out, ldo, M, D, eps)"},
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL,
     "silu_mul(gate_up, ld, M, I, out, ldo): out = silu(gate) * up"},
    {"rope", (PyCFunction)(void (*)(void))py_rope, METH_FASTCALL,
     "rope(x, ld, N, heads, D, positions, cos, signed_sin): rotary embedding in place"},
    {"decode_attention", (PyCFunction)(void (*)(void))py_decode_attention, METH_FASTCALL,
     "decode_attention(q, k_new, v_new, ldq, k_cache, v_cache, slots, positions, B, H, KVH, D, "
     "max_seq, scale, out, ldo, threads)"},
    {"decode_step", (PyCFunction)(void (*)(void))py_decode_step, METH_FASTCALL,
     "decode_step(B, hidden, H, KVH, D, I, layers, max_seq, eps, table, positions, slots, cos, sin, "
     "x, h, qkv, attn, gate_up, act, threads): every layer of a decode-only pass"},
    {"has_avx512", py_has_avx512, METH_NOARGS, "whether this CPU runs the kernels"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_cpu_kernels",
                                    "braid's AVX-512 kernels for the CPU decode step", -1, METHODS};

PyMODINIT_FUNC PyInit__cpu_kernels(void) { return PyModule_Create(&MODULE); }
