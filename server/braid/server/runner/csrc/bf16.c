/* The bf16 path of a bf16 matmul (F_BF16 with F_BF16_ROWS; kernels.h): each row of x is rounded to
 * bf16 (round to nearest even) and multiplied with AVX-512 BF16's vdpbf16ps, which adds two products
 * of bf16 pairs into each fp32 lane. Compiled into every build; it runs only where BF16 is 1 (the
 * avx512_bf16 build), and the others reject the format (bindings.c asks has_bf16_rows).
 *
 * A bf16 weight times a bf16 x is exact in fp32, so the only new rounding is x's own (2^-8 of each
 * value at most). An output element is one vdpbf16ps chain over the pairs of k in order, the same
 * instructions whatever the number of rows, so a row gets the same bits alone and in any batch; a
 * row's rounding depends on that row alone. Against widening the weights to fp32 (gemm.c), a panel row
 * pair feeds 64 multiply-adds per instruction instead of 16, and nothing is widened. */

/* The rows of x rounded to bf16, by pairs of k: x[m * pairs + p] holds bf16(x[m, 2p]) in its low half
 * and bf16(x[m, 2p + 1]) in its high half (an odd K's last pair padded with 0), what vdpbf16ps
 * multiplies a panel's pair of rows by. */
typedef struct {
    uint32_t *x;
    long pairs;
} brows_t;

static int alloc_brows(long M, long K, brows_t *r) {
    r->x = malloc(sizeof(uint32_t) * M * ((K + 1) / 2));
    return r->x ? 0 : -1;
}

#if BF16
#define MAX_BTILE 12 /* rows per tile: 12 x 2 accumulators of AVX-512's 32 registers */

/* Rounds x [M, K] (row stride ldx) into r, which has room for it. */
static void round_rows_into(const float *x, long ldx, long M, long K, brows_t *r) {
    r->pairs = (K + 1) / 2;
    for (long m = 0; m < M; m++) {
        const float *row = x + m * ldx;
        uint16_t *out = (uint16_t *)(r->x + m * r->pairs);
        for (long k = 0; k < K; k += 32) { /* 32 values, the last run masked (and a pad of 0) */
            const __m512 lo = _mm512_maskz_loadu_ps(vmask_n(K - k), row + k);
            const __m512 hi = _mm512_maskz_loadu_ps(vmask_n(K - k - 16), row + k + 16);
            const long n = 2 * r->pairs - k;
            const __mmask32 mask = n >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << n) - 1);
            _mm512_mask_storeu_epi16(out + k, mask, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* One tile: MR rows of x (rounded, from row r of b) times an interleaved bf16 panel, stored into y
 * (+ bias, or added to y). ahead: where to prefetch the stream from (a lone row reads it from memory). */
INLINE void btile_rows(const int MR, const brows_t *b, long r, const uint8_t *panel, float *y, long ldy,
                       int accumulate, const float *bias, long width, int ahead) {
    vf a[MAX_BTILE][2];
    for (int m = 0; m < MR; m++) a[m][0] = a[m][1] = vzero();
    const uint32_t *x = b->x + r * b->pairs;
    for (long p = 0; p < b->pairs; p++) {
        const uint8_t *pair = panel + p * 2 * ROW_BYTES(F_BF16);
        if (ahead) {
            _mm_prefetch((const char *)pair + GEMV_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char *)pair + GEMV_AHEAD + 64, _MM_HINT_T0);
        }
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(pair), w1 = (__m512bh)_mm512_loadu_si512(pair + 64);
        for (int m = 0; m < MR; m++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[m * b->pairs + p]);
            a[m][0] = _mm512_dpbf16_ps(a[m][0], xb, w0);
            a[m][1] = _mm512_dpbf16_ps(a[m][1], xb, w1);
        }
    }
    for (int m = 0; m < MR; m++) store_row(a[m], y + m * ldy, accumulate, bias, width);
}

#define BTILE_ROWS(MR) \
    case MR: btile_rows(MR, b, r, panel, y, ldy, accumulate, bias, width, ahead); break;

static void btile(int rows, const brows_t *b, long r, const uint8_t *panel, float *y, long ldy, int accumulate,
                  const float *bias, long width, int ahead) {
    switch (rows) {
        BTILE_ROWS(1) BTILE_ROWS(2) BTILE_ROWS(3) BTILE_ROWS(4) BTILE_ROWS(5) BTILE_ROWS(6)
        BTILE_ROWS(7) BTILE_ROWS(8) BTILE_ROWS(9) BTILE_ROWS(10) BTILE_ROWS(11) BTILE_ROWS(12)
    }
}

/* Panel p of gemm_bf16 below: columns [32p, 32p + 32) of y, for every row of b, in tiles of up to
 * MAX_BTILE rows split evenly; the first tile reads the panel from memory, the rest from cache. */
static void bf16_panel(const brows_t *b, const void *w, float *y, long ldy, long M, long K, long N, int accumulate,
                       const float *bias, long p) {
    const long col = p * PANEL, width = N - col < PANEL ? N - col : PANEL;
    const long tiles = (M + MAX_BTILE - 1) / MAX_BTILE;
    const uint8_t *panel = (const uint8_t *)w + p * panel_bytes(F_BF16 | F_BF16_ROWS, K);
    long row = 0;
    for (long t = 0; t < tiles; t++) {
        const long rows = (M - row + (tiles - t) - 1) / (tiles - t);
        btile((int)rows, b, row, panel, y + row * ldy + col, ldy, accumulate, bias ? bias + col : NULL, width,
              t == 0);
        row += rows;
    }
}

/* y[M, N] (+)= x @ W + bias for W bf16, packed in pairs of rows: the rows rounded once, then the
 * threads share out the panels. Returns -1 without memory. */
static int gemm_bf16(const float *x, long ldx, const void *w, float *y, long ldy, long M, long K, long N,
                     int accumulate, const float *bias, int threads) {
    brows_t b;
    if (alloc_brows(M, K, &b)) return -1;
    round_rows_into(x, ldx, M, K, &b);
    const long panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(dynamic, PANEL_CHUNK) num_threads(threads) if (threads > 1)
    for (long p = 0; p < panels; p++) bf16_panel(&b, w, y, ldy, M, K, N, accumulate, bias, p);
    free(b.x);
    return 0;
}
#endif
