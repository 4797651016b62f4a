/* The packed-panel matmul (see kernels.h for why). Compiled once per instruction set. */

#ifndef PREFETCH
#define PREFETCH 16384 /* floats ahead of a many-row tile's fp32 stream */
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T2
#endif
#ifndef KBLOCK
#define KBLOCK 32
#endif
#define CHUNK_ROWS 64 /* rows whose partial sums are kept at once (8 KiB of L1) */
/* rows per register tile: 12 rows x 2 vectors = 24 of AVX-512's 32 registers; 3 x 4 = 12 of AVX2's 16 */
#define MAX_TILE (VEC == 16 ? 12 : 3)

/* Adds bias (if any) and y (if accumulate) to a row's sums and stores its first `width` columns. */
INLINE void store_row(const vf a[NV], float *restrict y, int accumulate, const float *restrict bias, long width) {
    for (int j = 0; j < NV; j++) {
        const vmask mask = vmask_n(width - VEC * j);
        vf r = bias ? vadd(a[j], vloadm(mask, bias + VEC * j)) : a[j];
        if (accumulate) r = vadd(r, vloadm(mask, y + VEC * j));
        vstore_n(y + VEC * j, r, width - VEC * j);
    }
}

/* One tile: rows [0, MR) of x, k in [k0, k1), times one fp32 panel. The partial sums live in
 * acc ([MR][32], in L1) between k-blocks; the last k-block adds bias (and y) and stores into y. */
#define DEFINE_TILE(MR)                                                                          \
    static void tile_##MR(const float *restrict x, long ldx, const float *restrict w, long k0,  \
                          long k1, float *restrict acc, const float *restrict ahead,            \
                          float *restrict y, long ldy, int last, int accumulate,                \
                          const float *restrict bias, long width) {                             \
        vf a[MR][NV];                                                                            \
        for (int m = 0; m < MR; m++)                                                             \
            for (int j = 0; j < NV; j++) a[m][j] = k0 ? vload(acc + m * PANEL + VEC * j) : vzero(); \
        for (long k = k0; k < k1; k++) {                                                         \
            if (ahead) {                                                                         \
                _mm_prefetch((const char *)(ahead + k * PANEL), PREFETCH_HINT);                  \
                _mm_prefetch((const char *)(ahead + k * PANEL + 16), PREFETCH_HINT);             \
            }                                                                                    \
            vf wv[NV];                                                                           \
            for (int j = 0; j < NV; j++) wv[j] = vload(w + k * PANEL + VEC * j);                 \
            for (int m = 0; m < MR; m++) {                                                       \
                const vf b = vset1(x[m * ldx + k]);                                              \
                for (int j = 0; j < NV; j++) a[m][j] = vfmadd(b, wv[j], a[m][j]);               \
            }                                                                                    \
        }                                                                                        \
        if (!last) {                                                                             \
            for (int m = 0; m < MR; m++)                                                         \
                for (int j = 0; j < NV; j++) vstore(acc + m * PANEL + VEC * j, a[m][j]);         \
            return;                                                                              \
        }                                                                                        \
        const vf zero = vzero();                                                                 \
        for (int m = 0; m < MR; m++) {                                                           \
            vf r[NV];                                                                            \
            for (int j = 0; j < NV; j++)                                                         \
                r[j] = vadd(a[m][j], bias ? vloadm(vmask_n(width - VEC * j), bias + VEC * j) : zero); \
            store_row(r, y + m * ldy, accumulate, NULL, width);                                  \
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

/* Folds tile rows [0, MR)'s sums s of one group into their totals in acc. */
#define FOLD_ROWS(F)                                                                             \
    for (int m = 0; m < TILE_ROWS; m++) {                                                        \
        vf a[NV];                                                                                \
        for (int j = 0; j < NV; j++) a[j] = first && b0 == 0 && group == 0 ? vzero() : vload(acc + m * PANEL + VEC * j); \
        block_fold(F, blk, super_scales(F, panel, blocks, b0 / QBLOCK), group, s[m],             \
                   sums ? sums[m * blocks + b0 / QBLOCK] : 0.0f, a);                             \
        for (int j = 0; j < NV; j++) vstore(acc + m * PANEL + VEC * j, a[j]);                    \
    }

/* One tile of a quantized panel: rows [0, MR) of x times rows [k0, k1) of the panel (whole blocks),
 * given widened to unscaled quants in w. Each group of rows that shares a scale is summed from zero
 * and folded into the totals in acc ([MR][32], in L1) as gemv_fmt folds it; the first k-range
 * starts the totals, the last adds bias (and y) and stores into y. A long k-range per call keeps
 * each row of x read as one run (a prefill's rows are K floats apart). */
#define DEFINE_QTILE(MR)                                                                         \
    static void qtile_##MR(const float *restrict x, long ldx, const float *restrict w, long k0, \
                           long k1, const uint8_t *panel, int fmt, float *restrict acc,          \
                           float *restrict y, long ldy, int first, int last, int accumulate,     \
                           const float *restrict bias, long width, const float *sums,           \
                           long blocks) {                                                       \
        enum { TILE_ROWS = MR };                                                                 \
        const long group_rows = SCALE_ROWS(fmt);                                                 \
        for (long b0 = k0; b0 < k1; b0 += QBLOCK) {                                              \
            const uint8_t *blk = panel + b0 / QBLOCK * block_bytes(fmt);                         \
            for (int group = 0; group * group_rows < QBLOCK; group++) {                          \
                const long g0 = b0 + group * group_rows;                                         \
                vf s[MR][NV];                                                                    \
                for (int m = 0; m < MR; m++)                                                     \
                    for (int j = 0; j < NV; j++) s[m][j] = vzero();                              \
                for (long k = g0; k < g0 + group_rows; k++) {                                    \
                    vf wv[NV];                                                                   \
                    for (int j = 0; j < NV; j++) wv[j] = vload(w + k * PANEL + VEC * j);         \
                    for (int m = 0; m < MR; m++) {                                               \
                        const vf b = vset1(x[m * ldx + k]);                                      \
                        for (int j = 0; j < NV; j++) s[m][j] = vfmadd(b, wv[j], s[m][j]);       \
                    }                                                                            \
                }                                                                                \
                EACH_FORMAT(fmt) /* FOLD_ROWS, inlined per format */                            \
            }                                                                                    \
        }                                                                                        \
        if (!last) return;                                                                       \
        for (int m = 0; m < MR; m++) {                                                           \
            vf r[NV];                                                                            \
            for (int j = 0; j < NV; j++)                                                         \
                r[j] = vadd(vload(acc + m * PANEL + VEC * j),                                    \
                            bias ? vloadm(vmask_n(width - VEC * j), bias + VEC * j) : vzero());  \
            store_row(r, y + m * ldy, accumulate, NULL, width);                                  \
        }                                                                                        \
    }

#define FORMAT_CALL(F) FOLD_ROWS(F)
DEFINE_QTILE(1)
DEFINE_QTILE(2)
DEFINE_QTILE(3)
DEFINE_QTILE(4)
DEFINE_QTILE(5)
DEFINE_QTILE(6)
DEFINE_QTILE(7)
DEFINE_QTILE(8)
DEFINE_QTILE(9)
DEFINE_QTILE(10)
DEFINE_QTILE(11)
DEFINE_QTILE(12)
#undef FORMAT_CALL

typedef void (*qtile_fn)(const float *, long, const float *, long, long, const uint8_t *, int, float *, float *,
                         long, int, int, int, const float *, long, const float *, long);
static const qtile_fn QTILES[13] = {NULL,     qtile_1,  qtile_2,  qtile_3,  qtile_4,  qtile_5, qtile_6,
                                    qtile_7,  qtile_8,  qtile_9,  qtile_10, qtile_11, qtile_12};

typedef void (*tile_fn)(const float *, long, const float *, long, long, float *, const float *, float *,
                        long, int, int, const float *, long);
static const tile_fn TILES[13] = {NULL,    tile_1,  tile_2,  tile_3, tile_4, tile_5, tile_6,
                                  tile_7,  tile_8,  tile_9,  tile_10, tile_11, tile_12};

/* A thread's buffer for one panel widened to fp32 (K x 32 floats), kept for its next call. */
static __thread float *panel_buffer;
static __thread long panel_buffer_floats;

/* The panel as fp32 rows [K][32]: an fp32 panel itself, else widened into the thread's buffer
 * (a quantized one as unscaled quants). */
static float *fp32_panel(int fmt, const uint8_t *panel, long K) {
    if (fmt == F_F32) return (float *)panel;
    if (panel_buffer_floats < K * PANEL) {
        free(panel_buffer);
        panel_buffer = aligned_alloc(64, (size_t)K * PANEL * sizeof(float)); /* a multiple of 64 */
        panel_buffer_floats = panel_buffer ? K * PANEL : 0;
        if (!panel_buffer) return NULL;
    }
    widen_panel(fmt, panel, K, panel_buffer);
    return panel_buffer;
}

/* Panel p of gemm below: columns [32p, 32p + 32) of y, for every row. sums: block_sums' (or NULL).
 * Returns 0, or -1 if a panel buffer could not be allocated. */
static int gemm_panel(const float *x, long ldx, const void *w, int fmt, float *y, long ldy, long M, long K, long N,
                      int accumulate, const float *bias, const float *sums, long p) {
    /* Few rows: short k-blocks keep the weight stream even. Many rows (a prefill): long ones, so
     * the partial sums go through L1 less often (~10% faster at 128+ rows); same sums either way. */
    const long kblock = M > 16 ? 256 : KBLOCK;
    float acc[CHUNK_ROWS * PANEL] __attribute__((aligned(64)));
    const long col = p * PANEL, width = N - col < PANEL ? N - col : PANEL;
    const uint8_t *panel = (const uint8_t *)w + p * panel_bytes(fmt, K);
    const float *b = bias ? bias + col : NULL;
    if (M == 1) {
        vf a[NV];
        for (int j = 0; j < NV; j++) a[j] = vzero();
        gemv_panel(fmt, x, sums, panel, K, a);
        store_row(a, y + col, accumulate, b, width);
        return 0;
    }
    const float *fw = fp32_panel(fmt, panel, K);
    if (!fw) return -1;
    /* A long prefill goes in chunks of rows; the panel stays in L2 for the chunks after the
     * first, so it is read from memory once. */
    for (long r0 = 0; r0 < M && QUANTIZED(fmt); r0 += CHUNK_ROWS) { /* a quantized panel */
        const long rows_in_chunk = M - r0 < CHUNK_ROWS ? M - r0 : CHUNK_ROWS;
        const long tiles = (rows_in_chunk + MAX_TILE - 1) / MAX_TILE;
        for (long k0 = 0; k0 < K; k0 += kblock) {
            const long k1 = k0 + kblock < K ? k0 + kblock : K;
            long row = 0;
            for (long t = 0; t < tiles; t++) {
                const long rows = (rows_in_chunk - row + (tiles - t) - 1) / (tiles - t);
                const long r = r0 + row;
                QTILES[rows](x + r * ldx, ldx, fw, k0, k1, panel, fmt, acc + row * PANEL, y + r * ldy + col, ldy,
                             k0 == 0, k1 == K, accumulate, b, width, sums ? sums + r * (K / QBLOCK) : NULL,
                             K / QBLOCK);
                row += rows;
            }
        }
    }
    for (long r0 = 0; r0 < M && !QUANTIZED(fmt); r0 += CHUNK_ROWS) {
        const long rows_in_chunk = M - r0 < CHUNK_ROWS ? M - r0 : CHUNK_ROWS;
        const long tiles = (rows_in_chunk + MAX_TILE - 1) / MAX_TILE;
        for (long k0 = 0; k0 < K; k0 += kblock) {
            const long k1 = k0 + kblock < K ? k0 + kblock : K;
            const int last = k1 == K;
            const float *ahead = r0 == 0 && fmt == F_F32 ? fw + PREFETCH : NULL;
            /* rows split evenly over the tiles: 16 rows are two tiles of 8, not 12 + 4 */
            long row = 0;
            for (long t = 0; t < tiles; t++) {
                const long rows = (rows_in_chunk - row + (tiles - t) - 1) / (tiles - t);
                const long r = r0 + row;
                TILES[rows](x + r * ldx, ldx, fw, k0, k1, acc + row * PANEL, t == 0 ? ahead : NULL,
                            y + r * ldy + col, ldy, last, accumulate, b, width);
                row += rows;
            }
        }
    }
    return 0;
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W + bias, or y += ... when accumulate.
 * W is packed in fmt: panel p holds columns [32p, 32p + 32), zero-padded. One row streams the panel
 * through registers. More rows widen it once into L2 (or use it as it is, in fp32) and walk it in
 * k-blocks small enough for L1, every k-block used by all rows before the next is read. The
 * threads share out the panels. Returns 0, or -1 if a panel buffer could not be allocated. */
#if BF16
static int gemm_bf16(const float *x, long ldx, const void *w, float *y, long ldy, long M, long K, long N,
                     int accumulate, const float *bias, int threads); /* bf16.c */
#endif

static int gemm(const float *x, long ldx, const void *w, int fmt, float *y, long ldy, long M, long K, long N,
                int accumulate, const float *bias, int threads) {
#if BF16
    if (fmt & F_BF16_ROWS) return gemm_bf16(x, ldx, w, y, ldy, M, K, N, accumulate, bias, threads);
#endif
    if (fmt & F_INT8) return gemm_int8(x, ldx, w, fmt & ~F_INT8, y, ldy, M, K, N, accumulate, bias, threads);
    const long panels = (N + PANEL - 1) / PANEL;
    float *sums = block_sums(fmt, x, ldx, M, K);
    if (NEEDS_SUMS(fmt) && !sums) return -1;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, PANEL_CHUNK) num_threads(threads) if (threads > 1) reduction(| : failed)
    for (long p = 0; p < panels; p++) failed |= gemm_panel(x, ldx, w, fmt, y, ldy, M, K, N, accumulate, bias, sums, p);
    free(sums);
    return failed ? -1 : 0;
}
