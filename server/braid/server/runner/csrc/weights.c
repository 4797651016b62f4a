/* The weight formats: a panel's rows widened to fp32 in registers (the layout is in kernels.h).
 * Compiled once per instruction set, through isa_avx512.c and isa_avx2.c. */

#define INLINE static inline __attribute__((always_inline))

/* The scales d (and the mins m of Q4_1 and Q4_K) of a block's 32 columns, as NV vectors each. Q6_K
 * has two scales per column, for rows 0-15 (d) and 16-31 (m). */
INLINE void block_scales(const int fmt, const uint8_t *blk, vf d[NV], vf m[NV]) {
    if (fmt < F_Q8_0) return;
    if (fmt == F_Q6_K || fmt == F_Q4_K) {
        for (int j = 0; j < NV; j++) {
            d[j] = vload((const float *)blk + VEC * j);
            m[j] = vload((const float *)blk + PANEL + VEC * j);
        }
        return;
    }
    for (int j = 0; j < NV; j++) d[j] = vcvt_f16(blk + 2 * VEC * j);
    if (fmt == F_Q4_1)
        for (int j = 0; j < NV; j++) m[j] = vcvt_f16(blk + 2 * PANEL + 2 * VEC * j);
}

/* Row k of a block: its 32 weights in fp32, dequantized as GGUF's reference does it (d * q, then
 * + m, each rounded; -ffp-contract=off keeps the compiler from fusing them). */
INLINE void block_row(const int fmt, const uint8_t *blk, long k, const vf d[NV], const vf m[NV], vf w[NV]) {
    const uint8_t *row = blk + HEAD_BYTES[fmt] + k * ROW_BYTES[fmt];
    switch (fmt) {
    case F_F32:
        for (int j = 0; j < NV; j++) w[j] = vload((const float *)row + VEC * j);
        break;
    case F_BF16:
        for (int j = 0; j < NV; j++) w[j] = vcvt_bf16(row + 2 * VEC * j);
        break;
    case F_F16:
        for (int j = 0; j < NV; j++) w[j] = vcvt_f16(row + 2 * VEC * j);
        break;
    case F_Q8_0:
        for (int j = 0; j < NV; j++) w[j] = vmul(vcvt_i8((const int8_t *)row + VEC * j), d[j]);
        break;
    case F_Q4_0:
        vcvt_u4(row, w);
        for (int j = 0; j < NV; j++) w[j] = vmul(d[j], vsub(w[j], vset1(8.0f)));
        break;
    case F_Q4_1:
        vcvt_u4(row, w);
        for (int j = 0; j < NV; j++) w[j] = vadd(vmul(d[j], w[j]), m[j]);
        break;
    case F_Q6_K: {
        const vf *s = k < QBLOCK / 2 ? d : m;
        for (int j = 0; j < NV; j++) w[j] = vmul(s[j], vcvt_i8((const int8_t *)row + VEC * j));
        break;
    }
    case F_Q4_K:
        vcvt_u4(row, w);
        for (int j = 0; j < NV; j++) w[j] = vsub(vmul(d[j], w[j]), m[j]);
        break;
    }
}

/* The one-row case (a single decoding session): acc[j] += the whole panel times x, widened row by
 * row in registers, with the stream prefetched a few KiB ahead; bound by memory bandwidth. The sums
 * run over k in the same order as the tiles', so a row gets the same result alone as in a batch. */
#define GEMV_AHEAD 8192
INLINE void gemv_fmt(const int fmt, const float *restrict x, const uint8_t *restrict panel, long K, vf acc[NV]) {
    for (long k0 = 0; k0 < K; k0 += QBLOCK) {
        const uint8_t *blk = panel + k0 / QBLOCK * block_bytes(fmt);
        vf d[NV], m[NV];
        block_scales(fmt, blk, d, m);
        const long rows = K - k0 < QBLOCK ? K - k0 : QBLOCK;
        for (long k = 0; k < rows; k++) {
            const char *row = (const char *)blk + HEAD_BYTES[fmt] + k * ROW_BYTES[fmt];
            if (ROW_BYTES[fmt] >= 64) {
                for (long off = 0; off < ROW_BYTES[fmt]; off += 64) _mm_prefetch(row + GEMV_AHEAD + off, _MM_HINT_T0);
            } else if (((k * ROW_BYTES[fmt]) & 63) == 0) {
                _mm_prefetch(row + GEMV_AHEAD, _MM_HINT_T0);
            }
            vf w[NV];
            block_row(fmt, blk, k, d, m, w);
            const vf b = vset1(x[k0 + k]);
            for (int j = 0; j < NV; j++) acc[j] = vfmadd(b, w[j], acc[j]);
        }
    }
}

/* The panel widened to fp32 rows [K][32] in out: a many-row matmul dequantizes each block once and
 * uses it for every row. */
INLINE void dequantize_fmt(const int fmt, const uint8_t *restrict panel, long K, float *restrict out) {
    for (long k0 = 0; k0 < K; k0 += QBLOCK) {
        const uint8_t *blk = panel + k0 / QBLOCK * block_bytes(fmt);
        vf d[NV], m[NV], w[NV];
        block_scales(fmt, blk, d, m);
        const long rows = K - k0 < QBLOCK ? K - k0 : QBLOCK;
        for (long k = 0; k < rows; k++) {
            block_row(fmt, blk, k, d, m, w);
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

static void gemv_panel(int fmt, const float *x, const uint8_t *panel, long K, vf acc[NV]) {
#define GEMV(F) gemv_fmt(F, x, panel, K, acc)
    EACH_FORMAT(GEMV)
#undef GEMV
}

static void dequantize_panel(int fmt, const uint8_t *panel, long K, float *out) {
#define DEQUANTIZE(F) dequantize_fmt(F, panel, K, out)
    EACH_FORMAT(DEQUANTIZE)
#undef DEQUANTIZE
}

/* Weight (row r, column c) of a packed panel, one at a time: the same products as block_row. */
static float weight_at(int fmt, const uint8_t *panel, long r, long c) {
    const uint8_t *blk = panel + r / QBLOCK * block_bytes(fmt);
    const uint8_t *row = blk + HEAD_BYTES[fmt] + r % QBLOCK * ROW_BYTES[fmt];
    const uint16_t *scales = (const uint16_t *)blk;
    const float *wide = (const float *)blk; /* the K-quants' fp32 scales */
    const float nibble = (float)(c < 16 ? row[c] & 0x0F : row[c - 16] >> 4);
    switch (fmt) {
    case F_F32: return ((const float *)row)[c];
    case F_BF16: {
        const uint32_t bits = (uint32_t)((const uint16_t *)row)[c] << 16;
        float v;
        memcpy(&v, &bits, sizeof v);
        return v;
    }
    case F_F16: return _cvtsh_ss(((const uint16_t *)row)[c]);
    case F_Q8_0: return (float)((const int8_t *)row)[c] * _cvtsh_ss(scales[c]);
    case F_Q4_0: return _cvtsh_ss(scales[c]) * (nibble - 8.0f);
    case F_Q4_1: return _cvtsh_ss(scales[c]) * nibble + _cvtsh_ss(scales[PANEL + c]);
    case F_Q6_K: return wide[(r % QBLOCK >= QBLOCK / 2 ? PANEL : 0) + c] * (float)((const int8_t *)row)[c];
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
