/* The weight formats: a panel's rows widened to fp32 in registers (the layout is in kernels.h).
 * Compiled once per instruction set, through isa_avx512.c and isa_avx2.c.
 *
 * A quantized matmul sums x times the unscaled quants over each group of rows that shares a scale
 * (32 rows; 16 for Q6_K), then folds the group in: y += d * sum (+ m * sum(x)). That is a third
 * of the arithmetic of widening every weight to d * q + m, and its result is within fp32 rounding
 * of the matmul on the weights GGUF's reference dequantizes (not bit for bit: it rounds in other
 * places). Both the one-row and the many-row paths compute it in the same order. */

#define INLINE static inline __attribute__((always_inline))

/* Row k of a float format's block (f32, bf16, f16): its 32 weights widened to fp32. */
INLINE void float_row(const int fmt, const uint8_t *blk, long k, vf w[NV]) {
    const uint8_t *row = blk + k * ROW_BYTES[fmt];
    for (int j = 0; j < NV; j++)
        w[j] = fmt == F_F32 ? vload((const float *)row + VEC * j)
             : fmt == F_BF16 ? vcvt_bf16(row + 2 * VEC * j) : vcvt_f16(row + 2 * VEC * j);
}

/* Row k of a quantized block: its 32 quants as fp32, unscaled (Q4_0's as 0..15, its -8 is folded in
 * with the scale; Q6_K's as q - 32). */
INLINE void quant_row(const int fmt, const uint8_t *blk, long k, vf w[NV]) {
    const uint8_t *row = blk + HEAD_BYTES[fmt] + k * ROW_BYTES[fmt];
    if (fmt == F_Q8_0 || fmt == F_Q6_K)
        for (int j = 0; j < NV; j++) w[j] = vcvt_i8((const int8_t *)row + VEC * j);
    else
        vcvt_u4(row, w);
}

/* Rows per scale: a Q6_K block has two scales per column (rows 0-15 and 16-31), the others one. */
#define SCALE_ROWS(fmt) ((fmt) == F_Q6_K ? QBLOCK / 2 : QBLOCK)

/* Whether a format's fold needs the sum of x over each block (a min, or Q4_0's offset of 8). */
#define NEEDS_SUMS(fmt) ((fmt) == F_Q4_0 || (fmt) == F_Q4_1 || (fmt) == F_Q4_K)

/* sums[m * K / 32 + b] = the sum of x[m, 32 b .. 32 b + 31], added in order: computed once per
 * matmul, for both the one-row and the many-row paths. NULL if the format needs none (or no memory). */
static void block_sums_into(const float *x, long ldx, long M, long K, float *sums) {
    const long blocks = K / QBLOCK;
    for (long m = 0; m < M; m++)
        for (long b = 0; b < blocks; b++) {
            float sum = 0.0f;
            for (long k = 0; k < QBLOCK; k++) sum += x[m * ldx + b * QBLOCK + k];
            sums[m * blocks + b] = sum;
        }
}

static float *block_sums(int fmt, const float *x, long ldx, long M, long K) {
    if (!NEEDS_SUMS(fmt)) return NULL;
    float *sums = malloc(sizeof(float) * M * (K / QBLOCK));
    if (sums) block_sums_into(x, ldx, M, K, sums);
    return sums;
}

/* Folds a scale group's sums s = sum_k x_k q_k (one per column) into the running totals a:
 * a += d s, with Q4_1's + m sum(x), Q4_K's - m sum(x) and Q4_0's -8 d sum(x). Scaling once per
 * group instead of once per weight is what makes a quantized row cheaper than an fp32 one. */
INLINE void block_fold(const int fmt, const uint8_t *blk, int group, const vf s[NV], float xs, vf a[NV]) {
    const vf sum = vset1(xs);
    for (int j = 0; j < NV; j++) {
        switch (fmt) {
        case F_Q8_0:
            a[j] = vfmadd(vcvt_f16(blk + 2 * VEC * j), s[j], a[j]);
            break;
        case F_Q4_0:
            a[j] = vfmadd(vcvt_f16(blk + 2 * VEC * j), vfnmadd(vset1(8.0f), sum, s[j]), a[j]);
            break;
        case F_Q4_1:
            a[j] = vfmadd(vcvt_f16(blk + 2 * VEC * j), s[j], a[j]);
            a[j] = vfmadd(vcvt_f16(blk + 2 * PANEL + 2 * VEC * j), sum, a[j]);
            break;
        case F_Q6_K:
            a[j] = vfmadd(vload((const float *)blk + group * PANEL + VEC * j), s[j], a[j]);
            break;
        case F_Q4_K:
            a[j] = vfmadd(vload((const float *)blk + VEC * j), s[j], a[j]);
            a[j] = vfnmadd(vload((const float *)blk + PANEL + VEC * j), sum, a[j]);
            break;
        }
    }
}

/* The one-row case (a single decoding session): acc[j] += the whole panel times x, widened row by
 * row in registers, with the stream prefetched a few KiB ahead; bound by memory bandwidth (fp32)
 * or by the widening (4-bit formats). A quantized group's sums start from zero and are folded in
 * with their scale, exactly as the many-row tiles do, so a row gets the same result alone as in a
 * batch. */
#define GEMV_AHEAD 8192
INLINE void prefetch_row(const int fmt, const char *row, long k) {
    if (ROW_BYTES[fmt] >= 64) {
        for (long off = 0; off < ROW_BYTES[fmt]; off += 64) _mm_prefetch(row + GEMV_AHEAD + off, _MM_HINT_T0);
    } else if (((k * ROW_BYTES[fmt]) & 63) == 0) {
        _mm_prefetch(row + GEMV_AHEAD, _MM_HINT_T0);
    }
}

INLINE void gemv_fmt(const int fmt, const float *restrict x, const float *restrict sums, const uint8_t *restrict panel,
                     long K, vf acc[NV]) {
    for (long k0 = 0; k0 < K; k0 += QBLOCK) {
        const uint8_t *blk = panel + k0 / QBLOCK * block_bytes(fmt);
        const long rows = K - k0 < QBLOCK ? K - k0 : QBLOCK;
        vf w[NV];
        if (!HEAD_BYTES[fmt]) {
            for (long k = 0; k < rows; k++) {
                prefetch_row(fmt, (const char *)blk + k * ROW_BYTES[fmt], k);
                float_row(fmt, blk, k, w);
                const vf b = vset1(x[k0 + k]);
                for (int j = 0; j < NV; j++) acc[j] = vfmadd(b, w[j], acc[j]);
            }
            continue;
        }
        for (int group = 0; group * SCALE_ROWS(fmt) < QBLOCK; group++) {
            const long g0 = group * SCALE_ROWS(fmt);
            vf s[NV];
            for (int j = 0; j < NV; j++) s[j] = vzero();
            for (long k = g0; k < g0 + SCALE_ROWS(fmt); k++) {
                prefetch_row(fmt, (const char *)blk + HEAD_BYTES[fmt] + k * ROW_BYTES[fmt], k);
                quant_row(fmt, blk, k, w);
                const vf b = vset1(x[k0 + k]);
                for (int j = 0; j < NV; j++) s[j] = vfmadd(b, w[j], s[j]);
            }
            block_fold(fmt, blk, group, s, NEEDS_SUMS(fmt) ? sums[k0 / QBLOCK] : 0.0f, acc);
        }
    }
}

/* The panel widened to fp32 rows [K][32] in out, once for all the rows of a matmul: a float
 * format's weights, or a quantized format's unscaled quants (the tiles fold the scales in). */
INLINE void widen_fmt(const int fmt, const uint8_t *restrict panel, long K, float *restrict out) {
    for (long k0 = 0; k0 < K; k0 += QBLOCK) {
        const uint8_t *blk = panel + k0 / QBLOCK * block_bytes(fmt);
        const long rows = K - k0 < QBLOCK ? K - k0 : QBLOCK;
        vf w[NV];
        for (long k = 0; k < rows; k++) {
            if (HEAD_BYTES[fmt])
                quant_row(fmt, blk, k, w);
            else
                float_row(fmt, blk, k, w);
            for (int j = 0; j < NV; j++) vstore(out + (k0 + k) * PANEL + VEC * j, w[j]);
        }
    }
}

/* One call per format, so each loop above is compiled with its format a constant. */
#define EACH_FORMAT(CALL)                   \
    switch (fmt) {                          \
    case F_F32: CALL(F_F32); break;         \
    case F_BF16: CALL(F_BF16); break;       \
    case F_F16: CALL(F_F16); break;         \
    case F_Q8_0: CALL(F_Q8_0); break;       \
    case F_Q4_0: CALL(F_Q4_0); break;       \
    case F_Q4_1: CALL(F_Q4_1); break;       \
    case F_Q6_K: CALL(F_Q6_K); break;       \
    case F_Q4_K: CALL(F_Q4_K); break;       \
    }

static void gemv_panel(int fmt, const float *x, const float *sums, const uint8_t *panel, long K, vf acc[NV]) {
#define GEMV(F) gemv_fmt(F, x, sums, panel, K, acc)
    EACH_FORMAT(GEMV)
#undef GEMV
}

static void widen_panel(int fmt, const uint8_t *panel, long K, float *out) {
#define WIDEN(F) widen_fmt(F, panel, K, out)
    EACH_FORMAT(WIDEN)
#undef WIDEN
}



/* Weight (row r, column c) of a packed panel, dequantized as GGUF's reference does it (d * q, then
 * + m, each rounded; -ffp-contract=off keeps the compiler from fusing them). */
static float weight_at(int fmt, const uint8_t *panel, long r, long c) {
    if (fmt & F_BF16_ROWS) { /* pairs of rows: (r, c) at bf16 2c + r % 2 of pair r / 2 */
        const uint32_t bits = (uint32_t)((const uint16_t *)panel)[r / 2 * 2 * PANEL + 2 * c + r % 2] << 16;
        float v;
        memcpy(&v, &bits, sizeof v);
        return v;
    }
    const int interleaved = fmt & F_INT8;
    fmt &= ~F_INT8;
    const uint8_t *blk = panel + r / QBLOCK * block_bytes(fmt);
    const uint8_t *row = blk + HEAD_BYTES[fmt] + r % QBLOCK * ROW_BYTES[fmt];
    /* the byte of a quant: column c of the row (a 4-bit column c >= 16 in the high nibble of c - 16) */
    const long column = ROW_BYTES[fmt] == 16 ? c % 16 : c;
    const uint8_t *byte = interleaved ? blk + HEAD_BYTES[fmt] + r % QBLOCK / 4 * 4 * ROW_BYTES[fmt] + 4 * column + r % 4
                                      : row + column;
    const uint16_t *scales = (const uint16_t *)blk;
    const float *wide = (const float *)blk; /* the K-quants' fp32 scales */
    const float nibble = (float)(c < 16 ? *byte & 0x0F : *byte >> 4);
    switch (fmt) {
    case F_F32: return ((const float *)row)[c];
    case F_BF16: {
        const uint32_t bits = (uint32_t)((const uint16_t *)row)[c] << 16;
        float v;
        memcpy(&v, &bits, sizeof v);
        return v;
    }
    case F_F16: return _cvtsh_ss(((const uint16_t *)row)[c]);
    case F_Q8_0: return (float)(int8_t)*byte * _cvtsh_ss(scales[c]);
    case F_Q4_0: return _cvtsh_ss(scales[c]) * (nibble - 8.0f);
    case F_Q4_1: return _cvtsh_ss(scales[c]) * nibble + _cvtsh_ss(scales[PANEL + c]);
    case F_Q6_K: return wide[(r % QBLOCK >= QBLOCK / 2 ? PANEL : 0) + c] * (float)(int8_t)*byte;
    default: return wide[c] * nibble - wide[PANEL + c];
    }
}

/* out[i, :] = column ids[i] of W [K, N]: a lookup in an embedding packed as the LM head. */
static void columns(const void *w, int fmt, long K, long N, const int64_t *ids, long count, float *out, long ldo) {
    (void)N;
    const long bytes = panel_bytes(fmt, K);
    for (long i = 0; i < count; i++) {
        const uint8_t *panel = (const uint8_t *)w + ids[i] / PANEL * bytes;
        for (long r = 0; r < K; r++) out[i * ldo + r] = weight_at(fmt, panel, r, ids[i] % PANEL);
    }
}
