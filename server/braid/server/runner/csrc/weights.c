/* The weight formats: a panel's rows widened to fp32 in registers (the layout is in kernels.h, each
 * format's traits in formats.h). Compiled once per instruction set, through isa_avx512.c and isa_avx2.c;
 * every function here takes its format as a constant, so a format's traits fold away.
 *
 * A quantized matmul sums x times the unscaled quants over each group of rows that shares a scale
 * (32 rows; 16 for Q6_K), then folds the group in: y += d * sum (+ m * sum(x)). That is a third
 * of the arithmetic of widening every weight to d * q + m, and its result is within fp32 rounding
 * of the matmul on the weights GGUF's reference dequantizes (not bit for bit: it rounds in other
 * places). Both the one-row and the many-row paths compute it in the same order. */

#define INLINE static inline __attribute__((always_inline))

/* Row k of a float format's block (f32, bf16, f16): its 32 weights widened to fp32. */
INLINE void float_row(const int fmt, const uint8_t *blk, long k, vf w[NV]) {
    const uint8_t *row = blk + k * ROW_BYTES(fmt);
    const int stored = TRAITS(fmt).stored;
    for (int j = 0; j < NV; j++)
        w[j] = stored == V_F32 ? vload((const float *)row + VEC * j)
             : stored == V_BF16 ? vcvt_bf16(row + 2 * VEC * j) : vcvt_f16(row + 2 * VEC * j);
}

/* Row k of a quantized block: its 32 quants as fp32, unscaled (Q4_0's as 0..15, its -8 is folded in
 * with the scale; Q6_K's as q in [-32, 31]). */
INLINE void quant_row(const int fmt, const uint8_t *blk, long k, vf w[NV]) {
    const uint8_t *row = blk + HEAD_BYTES(fmt) + k * ROW_BYTES(fmt);
    if (TRAITS(fmt).stored == V_U4) {
        vcvt_u4(row, w);
    } else if (TRAITS(fmt).stored == V_U6) {
        int8_t q[PANEL];
        u6_row(row, q);
        for (int j = 0; j < NV; j++) w[j] = vcvt_i8(q + VEC * j);
    } else {
        for (int j = 0; j < NV; j++) w[j] = vcvt_i8((const int8_t *)row + VEC * j);
    }
}

/* Lanes [c, c + VEC) of a block's scales of group `group` (min: its mins), widened to fp32: an fp16's,
 * or a K-quant's int8 times its super-block's fp16 d (dmin for the mins) in sup (exact in fp32). */
INLINE vf block_scales(const int fmt, const uint8_t *blk, const uint8_t *sup, int group, long c) {
    const uint8_t *row = blk + (long)group * PANEL * TRAITS(fmt).scale_bytes;
    if (TRAITS(fmt).scale_bytes == S_F16) return vcvt_f16(row + 2 * c);
    const uint8_t *d = sup + (group == TRAITS(fmt).groups ? 2 * PANEL : 0); /* the mins' dmin */
    return vmul(vcvt_f16(d + 2 * c), vcvt_i8((const int8_t *)row + c));
}
#define MIN_GROUP(fmt) TRAITS(fmt).groups /* the mins come after the scales */

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
 * a += d (s - offset sum(x)) (+ or - m sum(x)): Q4_0's offset is 8, Q4_1's min +, Q4_K's -.
 * Scaling once per group instead of once per weight is what makes a quantized row cheaper than an
 * fp32 one. (A float format has nothing to fold.) */
INLINE void block_fold(const int fmt, const uint8_t *blk, const uint8_t *sup, int group, const vf s[NV], float xs,
                       vf a[NV]) {
    if (!QUANTIZED(fmt)) return;
    const vf sum = vset1(xs);
    for (int j = 0; j < NV; j++) {
        const vf d = block_scales(fmt, blk, sup, group, VEC * j);
        a[j] = vfmadd(d, TRAITS(fmt).offset ? vfnmadd(vset1((float)TRAITS(fmt).offset), sum, s[j]) : s[j], a[j]);
        if (TRAITS(fmt).min > 0) a[j] = vfmadd(block_scales(fmt, blk, sup, MIN_GROUP(fmt), VEC * j), sum, a[j]);
        if (TRAITS(fmt).min < 0) a[j] = vfnmadd(block_scales(fmt, blk, sup, MIN_GROUP(fmt), VEC * j), sum, a[j]);
    }
}

/* The one-row case (a single decoding session): acc[j] += the whole panel times x, widened row by
 * row in registers, with the stream prefetched a few KiB ahead; bound by memory bandwidth (fp32)
 * or by the widening (4-bit formats). A quantized group's sums start from zero and are folded in
 * with their scale, exactly as the many-row tiles do, so a row gets the same result alone as in a
 * batch. */
#define GEMV_AHEAD 8192
INLINE void prefetch_row(const int fmt, const char *row, long k) {
    if (ROW_BYTES(fmt) >= 64) {
        for (long off = 0; off < ROW_BYTES(fmt); off += 64) _mm_prefetch(row + GEMV_AHEAD + off, _MM_HINT_T0);
    } else if (((k * ROW_BYTES(fmt)) & 63) == 0) {
        _mm_prefetch(row + GEMV_AHEAD, _MM_HINT_T0);
    }
}

INLINE void gemv_fmt(const int fmt, const float *restrict x, const float *restrict sums, const uint8_t *restrict panel,
                     long K, vf acc[NV]) {
    for (long k0 = 0; k0 < K; k0 += QBLOCK) {
        const uint8_t *blk = panel + k0 / TRAITS(fmt).block_rows * block_bytes(fmt);
        const long rows = K - k0 < QBLOCK ? K - k0 : QBLOCK;
        vf w[NV];
        if (!QUANTIZED(fmt)) {
            for (long k = 0; k < rows; k++) {
                prefetch_row(fmt, (const char *)blk + k * ROW_BYTES(fmt), k);
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
                prefetch_row(fmt, (const char *)blk + HEAD_BYTES(fmt) + k * ROW_BYTES(fmt), k);
                quant_row(fmt, blk, k, w);
                const vf b = vset1(x[k0 + k]);
                for (int j = 0; j < NV; j++) s[j] = vfmadd(b, w[j], s[j]);
            }
            block_fold(fmt, blk, super_scales(fmt, panel, K / QBLOCK, k0 / QBLOCK), group, s,
                       NEEDS_SUMS(fmt) ? sums[k0 / QBLOCK] : 0.0f, acc);
        }
    }
}

/* The panel widened to fp32 rows [K][32] in out, once for all the rows of a matmul: a float
 * format's weights, or a quantized format's unscaled quants (the tiles fold the scales in). */
INLINE void widen_fmt(const int fmt, const uint8_t *restrict panel, long K, float *restrict out) {
    for (long k0 = 0; k0 < K; k0 += QBLOCK) {
        const uint8_t *blk = panel + k0 / TRAITS(fmt).block_rows * block_bytes(fmt);
        const long rows = K - k0 < QBLOCK ? K - k0 : QBLOCK;
        vf w[NV];
        for (long k = 0; k < rows; k++) {
            if (QUANTIZED(fmt))
                quant_row(fmt, blk, k, w);
            else
                float_row(fmt, blk, k, w);
            for (int j = 0; j < NV; j++) vstore(out + (k0 + k) * PANEL + VEC * j, w[j]);
        }
    }
}

/* Through EACH_FORMAT (formats.h): each loop above compiled with its format a constant. */
static void gemv_panel(int fmt, const float *x, const float *sums, const uint8_t *panel, long K, vf acc[NV]) {
#define FORMAT_CALL(F) gemv_fmt(F, x, sums, panel, K, acc)
    EACH_FORMAT(fmt)
#undef FORMAT_CALL
}

static void widen_panel(int fmt, const uint8_t *panel, long K, float *out) {
#define FORMAT_CALL(F) widen_fmt(F, panel, K, out)
    EACH_FORMAT(fmt)
#undef FORMAT_CALL
}
