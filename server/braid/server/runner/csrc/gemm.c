/* The packed-panel matmul (see kernels.h for why). */
#include "kernels.h"

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
AVX512 void gemm(const float *x, long ldx, const float *w, float *y, long ldy, long M, long K,
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
