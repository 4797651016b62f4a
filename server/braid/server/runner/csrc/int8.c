/* The int8 path of a quantized matmul (a format code with F_INT8; kernels.h): each row of x is
 * quantized to 8 bits per block of 32, as llama.cpp's Q8 activations, and multiplied with the CPU's
 * integer dot products. Compiled once per instruction set.
 *
 * A row's block b of 32 values becomes d = max|x| / 127 (fp32), q = round(x / d) in [-127, 127]
 * and the sum of its q. The dot product of a block with a column of weight quants is exact in
 * int32; it is folded into the column's fp32 total with both scales, as llama.cpp's
 * ggml_vec_dot_q4_1_q8_1 does: y += (d_w d) * sum(q_w q) (+ m_w d sum(q) for a min). A row's
 * quantization and every sum depend on that row alone, and the order is fixed, so a row gets the
 * same bits alone and in any batch, and in every build (the integer sums are exact everywhere and
 * the folds are elementwise). */

/* The rows of x quantized: q [M][K] (row stride K), and per row and block its scale d and sum of q,
 * and the sums of its two halves of 16 (Q6_K's scale groups). */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *sum, *half;
    long K, blocks;
} qrows_t;

static void free_qrows(qrows_t *r) {
    free(r->q);
    free(r->d);
    free(r->sum);
    free(r->half);
}

/* Room in r for M rows of up to K values. Returns -1 without memory (r then holds nothing). */
static int alloc_qrows(long M, long K, qrows_t *r) {
    r->q = malloc((size_t)(M * K));
    r->d = malloc(sizeof(float) * M * (K / QBLOCK));
    r->sum = malloc(sizeof(int32_t) * M * (K / QBLOCK));
    r->half = malloc(sizeof(int32_t) * M * (K / QBLOCK) * 2);
    if (r->q && r->d && r->sum && r->half) return 0;
    free_qrows(r);
    r->q = NULL, r->d = NULL, r->sum = NULL, r->half = NULL;
    return -1;
}

/* Quantizes x [M, K] (row stride ldx; K a multiple of 32) into r, which has room for it. */
static void quantize_rows_into(const float *x, long ldx, long M, long K, qrows_t *r) {
    r->K = K, r->blocks = K / QBLOCK;
    for (long m = 0; m < M; m++)
        for (long b = 0; b < r->blocks; b++) {
            const float *xb = x + m * ldx + b * QBLOCK;
            vf v[NV], amax = vzero();
            for (int j = 0; j < NV; j++) amax = vmax(amax, vabs(v[j] = vload(xb + VEC * j)));
            const float max = vhmax(amax), inv = max > 0.0f ? 127.0f / max : 0.0f;
            vi half[2] = {vizero(), vizero()};
            for (int j = 0; j < NV; j++) {
                const vi q = vround_i32(vmul(v[j], vset1(inv)));
                vistore_i8(r->q + m * K + b * QBLOCK + VEC * j, q);
                half[VEC * j / 16] = viadd(half[VEC * j / 16], q);
            }
            const long at = m * r->blocks + b;
            r->d[at] = max / 127.0f;
            r->half[2 * at] = vihsum(half[0]), r->half[2 * at + 1] = vihsum(half[1]);
            r->sum[at] = r->half[2 * at] + r->half[2 * at + 1];
        }
}

/* Per 4-row group of an interleaved block, the bytes of its quants; per build, the columns a tile
 * covers in one pass (32 with AVX-512; 16 with AVX2, whose 16 registers hold no more) and the most
 * rows a tile has (ITILE_ROWS_MAX below, per format). */
#define GROUP_BYTES(fmt) (4 * ROW_BYTES(fmt))
#define PASS_COLUMNS (2 * VEC)
#define MAX_ITILE (VEC == 16 ? 6 : 3)
/* A one-row tile of AVX2 takes the panel's 32 columns in one pass (NJ_ONE_ROW vectors of 8): its sums
 * and totals are 8 registers. A pass of 16 columns read every other cache line of each 4-row group of
 * 8-bit quants, the other half a pass later: one row of Q6_K (then a byte a quant) ran at 7-11 GB/s,
 * slower on two threads than on one. In one pass it took 0.40-0.49x the time, Q8_0 0.81-1.02x, Q4_0
 * and Q4_1 0.67-0.94x (two 4-bit passes read the same bytes, the second from L1), Q4_K 0.59-0.79x.
 * The same bits. */
#define NJ_ONE_ROW (PANEL / VEC)
#define NJ_MAX (PANEL / VEC)
/* A panel's first tile (rows from 0) reads it from memory, and asks for the bytes FIRST_TILE_AHEAD
 * past each block; the other tiles find it in cache. The hardware's prefetch alone left one row at
 * 20-23 GB/s on two threads. The 1B Q4_K_M shape's matmuls of a token, each matrix its own copy: one
 * row took 0.86-0.97x the time with 2 KiB ahead (0.90x with 8 KiB, 0.92-0.93x with 1 and 4 KiB), 2
 * rows 0.80x, 4 rows 0.87x, 16 rows 0.93x, 64 rows 0.98x. A prefetch past the panel reads the next
 * one, the same thread's but at the end of a run of PANEL_CHUNK. */
#define FIRST_TILE_AHEAD 2048

/* What a format's stored quants hold above q to be unsigned bytes (LIFT: Q6_K's [-32, 31] as 0..63),
 * and so what the int8 path subtracts again, times the sum of x's quants, with the format's offset
 * (BIAS): a full-range int8 quant (Q8_0) goes through the build's signed dot product (S8_BIAS). */
#define LIFT(fmt) (TRAITS(fmt).stored == V_U6 || TRAITS(fmt).stored == V_U6_BYTES ? U6_LIFT : 0)
#define BIAS(fmt) (TRAITS(fmt).stored == V_I8 ? S8_BIAS : LIFT(fmt) + TRAITS(fmt).offset)

/* The weight quants of 4-row group g of a block, for the columns [c0, c0 + NJ VEC), as unsigned bytes
 * (4-bit ones: 0..15; Q6_K's: q + LIFT, its two planes put together) or, a full-range int8 (Q8_0), as
 * they are (w) and prepared (u). */
INLINE void group_quants(const int fmt, const int NJ, const uint8_t *quants, int g, long c0, vi w[NJ_MAX],
                         vi u[NJ_MAX]) {
    for (int j = 0; j < NJ; j++) {
        const long c = c0 + VEC * j;
        if (TRAITS(fmt).stored == V_I8) {
            w[j] = viload(quants + g * GROUP_BYTES(fmt) + 4 * c);
            u[j] = viprep_s8(w[j]);
        } else if (TRAITS(fmt).stored == V_U6) {
            const uint8_t *group = quants + g * GROUP_BYTES(fmt);
            const vi v = viload(group + 4 * (c % 16));
            u[j] = vior(c < 16 ? vilo4(v) : vihi4(v), vihi2(group + 4 * (PANEL / 2), c));
        } else if (TRAITS(fmt).stored == V_U6_BYTES) {
            u[j] = viload(quants + g * GROUP_BYTES(fmt) + 4 * c);
        } else {
            const vi v = viload(quants + g * GROUP_BYTES(fmt) + 4 * (c % 16));
            u[j] = c < 16 ? vilo4(v) : vihi4(v);
        }
    }
}

/* Whether a build without VNNI sums a block's products of 4-bit quants in 16 bits: vpmaddubsw makes
 * 16-bit sums of pairs of products, each at most 2 * 15 * 127 = 3,810 (x's quants are within
 * [-127, 127]), so a block's 8 groups of 4 rows add up to at most 30,480 and never saturate; one
 * vpmaddwd then widens them, where vidot_u8 widened and added each group's (3 instructions a group, now
 * 2). Integer sums are exact: the bits are the same. Q6_K's lifted quants (2 * 63 * 127) and Q8_0's
 * (2 * 128 * 127) would overflow in 16 bits past one group. */
#define SUMS_16(fmt) (!VNNI && TRAITS(fmt).stored == V_U4 && SCALE_ROWS(fmt) == QBLOCK)
/* The rows of a tile, per format: with AVX2, 3 where a block's sums are 16 bits (3 rows' sums and
 * totals, 12 registers, beside the 2 of the quants and 1 of x's), else 2 (Q8_0's quants as they are
 * and prepared, 2 more registers, leave room for no third row). */
#define ITILE_ROWS_MAX(fmt) (VEC == 16 ? 6 : SUMS_16(fmt) ? 3 : 2)
#if VNNI /* never called there (SUMS_16 is 0) */
static inline vi vidot16_u8(vi acc16, vi w, vi x) { return (void)w, (void)x, acc16; }
static inline vi viwiden16(vi acc16) { return acc16; }
#endif

/* What a scale group's integer sums s (the block, or a Q6_K half) add to the totals a, for columns
 * [c0, c0 + NJ VEC) of row m: (d_w d) (s - BIAS sum(q)) (+ or - m_w d sum(q)). */
INLINE void int8_fold(const int fmt, const int NJ, const uint8_t *blk, const uint8_t *sup, int group, long c0,
                      const vi s[NJ_MAX], float d, int32_t qsum, vf a[NJ_MAX]) {
    const int bias = BIAS(fmt);
    const vf dx = vset1(d), mx = vset1(d * (float)qsum);
    for (int j = 0; j < NJ; j++) {
        const long c = c0 + VEC * j;
        const vf sf = vicvt(bias ? visub(s[j], viset1(bias * qsum)) : s[j]);
        a[j] = vfmadd(vmul(block_scales(fmt, blk, sup, group, c), dx), sf, a[j]);
        if (TRAITS(fmt).min > 0) a[j] = vfmadd(block_scales(fmt, blk, sup, MIN_GROUP(fmt), c), mx, a[j]);
        if (TRAITS(fmt).min < 0) a[j] = vfnmadd(block_scales(fmt, blk, sup, MIN_GROUP(fmt), c), mx, a[j]);
    }
}

/* One tile: MR rows of x (quantized, from row r of q) times columns [c0, c0 + 2 VEC) of an
 * interleaved panel, blocks [b0, b1). Its sums start at zero (first) or from acc [MR][2 VEC], and end
 * stored into y (+ bias, or added to y; last) or into acc: a row's sums are the same fp32 numbers in
 * the same order either way, so its bits do not depend on how the blocks were split. */
INLINE void itile_fmt(const int fmt, const int MR, const int NJ, const qrows_t *q, long r, const uint8_t *panel,
                      long c0, long b0, long b1, float *acc, int first, int last, float *y, long ldy, int accumulate,
                      const float *bias, long width) {
    const long bytes = block_bytes(fmt);
    vf a[MAX_ITILE][NJ_MAX];
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < NJ; j++) a[m][j] = first ? vzero() : vload(acc + (NJ * m + j) * VEC);
    for (long b = b0; b < b1; b++) {
        const uint8_t *blk = panel + b * bytes, *quants = blk + HEAD_BYTES(fmt);
        const uint8_t *sup = super_scales(fmt, panel, q->blocks, b);
        if (r == 0) /* the panel's stream from memory: each block's lines FIRST_TILE_AHEAD bytes ahead */
            for (long off = 0; off < bytes; off += 64)
                _mm_prefetch((const char *)blk + FIRST_TILE_AHEAD + off, _MM_HINT_T0);
        const int8_t *xq = q->q + r * q->K + b * QBLOCK;
        vi s[MAX_ITILE][NJ_MAX];
        for (int group = 0; group < TRAITS(fmt).groups; group++) { /* its 4-row groups [g0, g1) */
            for (int m = 0; m < MR; m++)
                for (int j = 0; j < NJ; j++) s[m][j] = vizero();
            const int g0 = group * SCALE_ROWS(fmt) / 4, g1 = g0 + SCALE_ROWS(fmt) / 4;
            if (SUMS_16(fmt)) { /* a block's 4-bit products summed in 16 bits, widened once */
#pragma GCC unroll 8
                for (int g = g0; g < g1; g++) {
                    vi w[NJ_MAX], u[NJ_MAX];
                    group_quants(fmt, NJ, quants, g, c0, w, u);
                    for (int m = 0; m < MR; m++) {
                        const vi xb = vibcast4(xq + m * q->K + 4 * g);
                        for (int j = 0; j < NJ; j++) {
                            s[m][j] = vidot16_u8(s[m][j], u[j], xb);
                            vikeep(s[m][j]);
                        }
                    }
                }
                for (int m = 0; m < MR; m++)
                    for (int j = 0; j < NJ; j++) s[m][j] = viwiden16(s[m][j]);
            } else {
#pragma GCC unroll 8 /* unrolled, the sums stay in their registers; looped, gcc moved them each turn */
                for (int g = g0; g < g1; g++) {
                    vi w[NJ_MAX], u[NJ_MAX];
                    group_quants(fmt, NJ, quants, g, c0, w, u);
                    for (int m = 0; m < MR; m++) {
                        const vi xb = vibcast4(xq + m * q->K + 4 * g);
                        for (int j = 0; j < NJ; j++) {
                            s[m][j] = TRAITS(fmt).stored == V_I8 ? vidot_s8(s[m][j], u[j], w[j], xb)
                                                                 : vidot_u8(s[m][j], u[j], xb);
                            vikeep(s[m][j]);
                        }
                    }
                }
            }
            for (int m = 0; m < MR; m++) {
                const long at = (r + m) * q->blocks + b;
                /* the group's sum of x's quants: the block's, or (Q6_K) its half's */
                const int32_t sum = TRAITS(fmt).groups > 1 ? q->half[2 * at + group] : q->sum[at];
                int8_fold(fmt, NJ, blk, sup, group, c0, s[m], q->d[at], sum, a[m]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < NJ; j++) {
            if (!last) {
                vstore(acc + (NJ * m + j) * VEC, a[m][j]);
                continue;
            }
            const long c = c0 + VEC * j;
            const vmask mask = vmask_n(width - c);
            vf v = bias ? vadd(a[m][j], vloadm(mask, bias + c)) : a[m][j];
            if (accumulate) v = vadd(v, vloadm(mask, y + m * ldy + c));
            vstore_n(y + m * ldy + c, v, width - c);
        }
}

/* The tiles compiled per format and per number of rows (none of more rows than the format's tiles have). */
#define ITILE_ROWS(F, MR) \
    case MR: \
        if ((MR) > ITILE_ROWS_MAX(F)) \
            break; \
        if ((MR) == 1 && pass == PANEL) /* the whole panel in one pass (NJ_ONE_ROW) */ \
            itile_fmt(F, MR, NJ_ONE_ROW, q, r, panel, 0, b0, b1, acc, first, last, y, ldy, accumulate, bias, width); \
        else if (c0 == 0) /* a constant: which half of a byte each column's quants are (group_quants) */ \
            itile_fmt(F, MR, 2, q, r, panel, 0, b0, b1, acc, first, last, y, ldy, accumulate, bias, width); \
        else /* the second pass of a panel: c0 is PASS_COLUMNS (AVX2's 16; AVX-512 takes one pass) */ \
            itile_fmt(F, MR, 2, q, r, panel, PASS_COLUMNS, b0, b1, acc, first, last, y, ldy, accumulate, bias, width); \
        break;
#if VEC == 16
#define ITILE_WIDE(F) ITILE_ROWS(F, 3) ITILE_ROWS(F, 4) ITILE_ROWS(F, 5) ITILE_ROWS(F, 6)
#else
#define ITILE_WIDE(F) ITILE_ROWS(F, 3)
#endif
#define ITILE_FMT(F) switch (rows) { ITILE_ROWS(F, 1) ITILE_ROWS(F, 2) ITILE_WIDE(F) }

/* Every quantized format's tiles, through EACH_FORMAT (formats.h), and Q6_K's widened to bytes (a float
 * format has no int8 path). */
#define FORMAT_CALL(F) if (QUANTIZED(F)) { ITILE_FMT(F) }
static void itile(int fmt, int rows, long pass, const qrows_t *q, long r, const uint8_t *panel, long c0, long b0,
                  long b1, float *acc, int first, int last, float *y, long ldy, int accumulate, const float *bias,
                  long width) {
    if (fmt == F_Q6_K_BYTES) {
        ITILE_FMT(F_Q6_K_BYTES)
        return;
    }
    EACH_FORMAT(fmt)
}
#undef FORMAT_CALL

/* A Q6_K panel of `blocks` blocks for a matmul of more than one tile: its quants widened to a byte each
 * (F_Q6_K_BYTES), once for all the tiles, in a buffer of the calling thread's (kept for its next
 * panels: a thread's is at most one panel, 0.5 MiB at K = 14,336). Unpacked in every tile, AVX2's
 * tiles of 2 rows each spent as much on putting the quants' two planes together as on their products:
 * 16 rows took 1.15-1.27x the time of the old panels of bytes. Returns the panel, or NULL without memory
 * (the tiles then unpack it themselves). */
static const uint8_t *q6_k_bytes(const uint8_t *panel, long blocks) {
    static __thread uint8_t *buffer;
    static __thread long room;
    const long bytes = panel_bytes(F_Q6_K_BYTES, blocks * QBLOCK), supers = blocks / (SUPER_ROWS / QBLOCK);
    if (bytes > room) {
        free(buffer);
        buffer = aligned_alloc(64, (size_t)(bytes + 63) / 64 * 64);
        room = buffer ? bytes : 0;
        if (!buffer) return NULL;
    }
    for (long b = 0; b < blocks; b++) {
        const uint8_t *blk = panel + b * block_bytes(F_Q6_K);
        uint8_t *out = buffer + b * block_bytes(F_Q6_K_BYTES);
        for (long off = 0; off < block_bytes(F_Q6_K); off += 64)
            _mm_prefetch((const char *)blk + FIRST_TILE_AHEAD + off, _MM_HINT_T0);
        memcpy(out, blk, HEAD_BYTES(F_Q6_K));
        for (int g = 0; g < QBLOCK / 4; g++) {
            vi w[NJ_MAX], u[NJ_MAX];
            group_quants(F_Q6_K, NJ_MAX, blk + HEAD_BYTES(F_Q6_K), g, 0, w, u);
            for (int j = 0; j < NJ_MAX; j++)
                viput(out + HEAD_BYTES(F_Q6_K) + g * GROUP_BYTES(F_Q6_K_BYTES) + 4 * VEC * j, u[j]);
        }
    }
    memcpy(buffer + blocks * block_bytes(F_Q6_K_BYTES), panel + blocks * block_bytes(F_Q6_K),
           (size_t)(supers * TRAITS(F_Q6_K).super_bytes));
    return buffer;
}

/* Panel p of gemm_int8 below: columns [32p, 32p + 32) of y, for every row of q, in tiles of up to
 * ITILE_ROWS_MAX rows (split evenly: 16 rows are 6 + 5 + 5 with AVX-512), each in passes of
 * PASS_COLUMNS columns (two with AVX2, one with AVX-512). One tile reads the panel once, from memory.
 * Two to TURN_TILES tiles (a verification's 7 rows are 4 + 3; a batch's 16 rows, three tiles) take
 * turns on CHUNK_BLOCKS blocks at a time, their sums kept in acc between turns: the chunk the first
 * tile brought from memory is still in L1 for the rest, and the stream from memory overlaps every
 * tile's arithmetic. (Tile after tile over the whole panel left the later tiles' arithmetic after
 * the stream: a 7th row cost a pass of 6 rows a third more, benchmarks/proposal_rows.py.) More
 * tiles, a prompt's rows, go one after another over the whole panel, read from cache but the first
 * time, where turns measured no faster. So do AVX2's tiles of 2 or 3 rows (the turns cost tiles of 2
 * more than they saved): there, tiles always go one after another.
 * A Q6_K panel for more than one tile has its quants widened to bytes first, once (q6_k_bytes).
 * Every split keeps each row's sums in the same order: the same bits. (When Q6_K's quants were a byte
 * each in the panel, a single AVX2 tile of 2 or 3 rows took its two passes in turns on 8 blocks: each
 * pass read every other cache line of the panel. Its 6-bit planes are read whole by both passes, as
 * 4-bit quants are, and 2 rows measured the same with turns and without.) */
#define CHUNK_BLOCKS 2
#define TURN_TILES (VEC == 16 ? 4 : 1)
static void int8_panel(const qrows_t *q, const void *w, int fmt, float *y, long ldy, long M, long K, long N,
                       int accumulate, const float *bias, long p) {
    const long col = p * PANEL, width = N - col < PANEL ? N - col : PANEL;
    const long most = ITILE_ROWS_MAX(fmt), tiles = (M + most - 1) / most;
    const long pass = M == 1 ? PANEL : PASS_COLUMNS; /* the columns of a pass: one row's, all (NJ_ONE_ROW) */
    const long step = tiles == 1 || tiles > TURN_TILES ? q->blocks : CHUNK_BLOCKS;
    const uint8_t *panel = (const uint8_t *)w + p * panel_bytes(fmt, K);
    if (TRAITS(fmt).stored == V_U6 && tiles > 1) { /* Q6_K's quants to bytes once for all tiles */
        const uint8_t *bytes = q6_k_bytes(panel, q->blocks);
        if (bytes) panel = bytes, fmt = F_Q6_K_BYTES;
    }
    const float *b = bias ? bias + col : NULL;
    float acc[PANEL / PASS_COLUMNS][TURN_TILES][MAX_ITILE * 2 * VEC] __attribute__((aligned(64)));
    for (long b0 = 0; b0 < q->blocks; b0 += step) {
        const long b1 = b0 + step < q->blocks ? b0 + step : q->blocks;
        for (long c0 = 0; c0 < width; c0 += pass) {
            long row = 0;
            for (long t = 0; t < tiles; t++) {
                const long rows = (M - row + (tiles - t) - 1) / (tiles - t);
                itile(fmt, (int)rows, pass, q, row, panel, c0, b0, b1, acc[c0 / pass][t % TURN_TILES], b0 == 0,
                      b1 == q->blocks, y + row * ldy + col, ldy, accumulate, b, width);
                row += rows;
            }
        }
    }
}

/* y[M, N] (+)= x @ W + bias for W packed interleaved in a quantized format (fmt without F_INT8):
 * the rows quantized once, then the threads share out the panels. Returns -1 without memory. */
static int gemm_int8(const float *x, long ldx, const void *w, int fmt, float *y, long ldy, long M, long K, long N,
                     int accumulate, const float *bias, int threads) {
    qrows_t q;
    if (alloc_qrows(M, K, &q)) return -1;
    quantize_rows_into(x, ldx, M, K, &q);
    const long panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(dynamic, PANEL_CHUNK) num_threads(threads) if (threads > 1)
    for (long p = 0; p < panels; p++) int8_panel(&q, w, fmt, y, ldy, M, K, N, accumulate, bias, p);
    free_qrows(&q);
    return 0;
}
