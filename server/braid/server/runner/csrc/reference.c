/* The plain-C reference of every weight format (formats.h): each format's dequantization and its dot
 * products, and a whole matmul built from them, one value at a time, in C without intrinsics. It is
 * compiled once, with bindings.c, for no particular instruction set, and is what every build's
 * kernels are tested against (tests/test_kernels.py), as ggml tests each arch's kernel against its
 * scalar _generic twin.
 *
 * What it promises (kernels.h says why the kernels keep to it):
 * - dequantize: the weights GGUF's reference dequantizes, bit for bit (d * (q - offset), then + or -
 *   m, each rounded: -ffp-contract=off keeps the compiler from fusing them). The embedding lookup
 *   (`columns`) of every build is this function.
 * - the matmul, float32 rows: each output is the kernels' fused multiply-add chain in the kernels'
 *   order (fmaf, exact as the CPU's vfmadd), so every build gives its bits.
 * - the matmul, int8 rows: x quantized as the kernels quantize it, the integer sums exact, and the
 *   folds the kernels' (fmaf again), so every build gives its bits.
 * - the matmul, bf16 rows (the avx512_bf16 build's vdpbf16ps): x rounded to bf16 (to nearest, ties to
 *   even), then per pair of k the odd product added, then the even one, each product exact and each
 *   add rounded, as the SDM's pseudo-code for VDPBF16PS has it (seen bit for bit on a Xeon). Its
 *   inputs' and sums' denormals are flushed to zero as the instruction does; a product that itself
 *   falls below fp32's normal range is where the two could part (bf16 values of magnitude < 2^-63). */

/* An fp16's or a bf16's value, exactly (as F16C's vcvtph2ps and a 16-bit shift give it). */
static float f16_value(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = h >> 10 & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | mantissa << 13 | (mantissa ? 0x400000u : 0); /* inf, or a quiet NaN */
    } else if (exponent) {
        bits = sign | (exponent + 112) << 23 | mantissa << 13;
    } else { /* zero or subnormal: mantissa 2^-24, exact in fp32 */
        const float v = (float)mantissa * 0x1p-24f;
        memcpy(&bits, &v, sizeof bits);
        bits |= sign;
    }
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static float bf16_value(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* Weight (0, c) of a float format's block (one row). */
static float float_at(const format_t *f, const uint8_t *blk, long c) {
    uint16_t h;
    if (f->stored == V_F32) {
        float v;
        memcpy(&v, blk + 4 * c, sizeof v);
        return v;
    }
    memcpy(&h, blk + 2 * c, sizeof h);
    return f->stored == V_BF16 ? bf16_value(h) : f16_value(h);
}

/* Quant (r, c) of a quantized block (an int8, a 6-bit one as q in [-32, 31], or a 4-bit one as
 * 0..15), in either layout (kernels.h): rows of 32 columns, or (F_INT8) groups of 4 rows, each
 * column's 4 quants in 4 consecutive bytes. A 4-bit column c >= 16 is the high nibble of column
 * c - 16's byte; a 6-bit quant's low 4 bits are a 4-bit one's, its high 2 bits in the plane after
 * them (PANEL / 2 bytes a row), at bit 2 (c / 8) of column c % 8's byte. */
static int quant_at(const format_t *f, const uint8_t *blk, int layout, long r, long c) {
    const uint8_t *quants = blk + f->head_bytes;
    const int int8 = layout & F_INT8;
    /* the byte of row r and column `column` of a plane that starts `at` bytes into a row (or group) */
#define BYTE_AT(at, column)                                                       \
    (int8 ? quants[r / 4 * 4 * f->row_bytes + 4 * (at) + 4 * (column) + r % 4] \
          : quants[r * f->row_bytes + (at) + (column)])
    if (f->stored != V_U4 && f->stored != V_U6) return (int8_t)BYTE_AT(0, c);
    const uint8_t low = BYTE_AT(0, c % 16), nibble = c < 16 ? low & 0x0F : low >> 4;
    if (f->stored == V_U4) return nibble;
    const uint8_t high = BYTE_AT(PANEL / 2, c % 8) >> (2 * (c / 8)) & 3;
#undef BYTE_AT
    return (nibble | high << 4) - U6_LIFT;
}

/* Column c's scale of group `group` of a quantized block; group `groups` holds the mins. A K-quant's
 * is its int8 times the super-block's fp16 d (the mins': dmin) in sup, as GGUF's reference forms it. */
static float scale_at(const format_t *f, const uint8_t *blk, const uint8_t *sup, int group, long c) {
    const uint8_t *p = blk + ((long)group * PANEL + c) * f->scale_bytes;
    uint16_t h;
    if (f->scale_bytes == S_I8) {
        memcpy(&h, sup + ((group == f->groups ? PANEL : 0) + c) * 2, sizeof h);
        return f16_value(h) * (float)(int8_t)p[0];
    }
    memcpy(&h, p, sizeof h);
    return f16_value(h);
}

void ref_dequantize_float(const format_t *f, const uint8_t *blk, const uint8_t *sup, int layout, long c, float *out) {
    (void)sup, (void)layout;
    out[0] = float_at(f, blk, c);
}

void ref_dequantize_quants(const format_t *f, const uint8_t *blk, const uint8_t *sup, int layout, long c, float *out) {
    const float m = f->min ? scale_at(f, blk, sup, f->groups, c) : 0.0f;
    for (long r = 0; r < f->block_rows; r++) {
        const float d = scale_at(f, blk, sup, (int)(r / (QBLOCK / f->groups)), c);
        const float w = d * (float)(quant_at(f, blk, layout, r, c) - f->offset);
        out[r] = f->min > 0 ? w + m : f->min < 0 ? w - m : w;
    }
}

float ref_dot_float(const format_t *f, const uint8_t *blk, const uint8_t *sup, long c, const float *x, float xs,
                    float acc) {
    (void)sup, (void)xs;
    return fmaf(x[0], float_at(f, blk, c), acc);
}

/* Per scale group: s = x times the unscaled quants, a chain from zero; then acc += d (s - offset xs)
 * (+ or - m xs), as weights.c's gemv_fmt and block_fold. */
float ref_dot_quants(const format_t *f, const uint8_t *blk, const uint8_t *sup, long c, const float *x, float xs,
                     float acc) {
    const long rows = QBLOCK / f->groups;
    for (int g = 0; g < f->groups; g++) {
        float s = 0.0f;
        for (long r = g * rows; r < (g + 1) * rows; r++) s = fmaf(x[r], (float)quant_at(f, blk, 0, r, c), s);
        if (f->offset) s = fmaf(-(float)f->offset, xs, s);
        acc = fmaf(scale_at(f, blk, sup, g, c), s, acc);
    }
    if (f->min) {
        const float m = scale_at(f, blk, sup, f->groups, c);
        acc = fmaf(f->min > 0 ? m : -m, xs, acc);
    }
    return acc;
}

/* Per scale group: the exact integer sum of (q_w - offset) q, then acc += (d_w d) sum (+ or - m_w
 * (d sum(q))), as int8.c's itile_fmt and int8_fold. */
float ref_dot_int8_quants(const format_t *f, const uint8_t *blk, const uint8_t *sup, long c, const int8_t *q, float d,
                          float acc) {
    const long rows = QBLOCK / f->groups;
    for (int g = 0; g < f->groups; g++) {
        int32_t s = 0, qsum = 0;
        for (long r = g * rows; r < (g + 1) * rows; r++) {
            s += (quant_at(f, blk, F_INT8, r, c) - f->offset) * q[r];
            qsum += q[r];
        }
        acc = fmaf(scale_at(f, blk, sup, g, c) * d, (float)s, acc);
        if (f->min) {
            const float m = scale_at(f, blk, sup, f->groups, c);
            acc = fmaf(f->min > 0 ? m : -m, d * (float)qsum, acc);
        }
    }
    return acc;
}

/* A block of 32 values of x as the int8 path quantizes it (int8.c): d = max|x| / 127, q = x * (127 /
 * max|x|) rounded to the nearest, ties to even (the CPU's default rounding, which nearbyintf keeps). */
static float ref_quantize_block(const float *x, int8_t *q) {
    float max = 0.0f;
    for (int k = 0; k < QBLOCK; k++) max = fabsf(x[k]) > max ? fabsf(x[k]) : max;
    const float inv = max > 0.0f ? 127.0f / max : 0.0f;
    for (int k = 0; k < QBLOCK; k++) q[k] = (int8_t)nearbyintf(x[k] * inv);
    return max / 127.0f;
}

/* v with a denormal flushed to a zero of its sign (vdpbf16ps' and vcvtne2ps2bf16's DAZ and FTZ). */
static float flushed(float v) { return fabsf(v) < 0x1p-126f ? copysignf(0.0f, v) : v; }

/* x rounded to bf16 (to nearest, ties to even; a denormal to zero), as bf16.c's round_rows_into. */
static float bf16_rounded(float x) {
    uint32_t bits;
    x = flushed(x);
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7F800000u) != 0x7F800000u) bits += 0x7FFF + (bits >> 16 & 1); /* not inf or NaN */
    return flushed(bf16_value((uint16_t)(bits >> 16)));
}

/* y[m, n] of the bf16 path: W packed in pairs of rows (F_BF16_ROWS: pair p's column c at bf16 2c
 * and 2c + 1), per pair the odd row's product added first, as vdpbf16ps adds them. */
static float reference_bf16_rows(const float *row, const uint8_t *panel, long K, long c) {
    const uint16_t *pairs = (const uint16_t *)panel;
    float acc = 0.0f;
    for (long p = 0; p < (K + 1) / 2; p++) {
        const float x0 = bf16_rounded(row[2 * p]), x1 = 2 * p + 1 < K ? bf16_rounded(row[2 * p + 1]) : 0.0f;
        acc = flushed(acc + x1 * flushed(bf16_value(pairs[p * 2 * PANEL + 2 * c + 1])));
        acc = flushed(acc + x0 * flushed(bf16_value(pairs[p * 2 * PANEL + 2 * c])));
    }
    return acc;
}

/* y[M, N] = x[M, K] @ W + bias (or y += ...), W packed in fmt (with F_INT8: x's rows quantized to
 * int8 per block, the int8 path; with F_BF16_ROWS: rounded to bf16, the bf16 path), one output at a
 * time through the format's row of FORMAT_TRAITS. Returns -1 without memory. */
static int reference_gemm(const float *x, long ldx, const void *w, int fmt, float *y, long ldy, long M, long K,
                          long N, int accumulate, const float *bias) {
    const int int8 = fmt & F_INT8, bf16_rows = fmt & F_BF16_ROWS;
    const format_t *f = &FORMAT_TRAITS[fmt & ~(F_INT8 | F_BF16_ROWS)];
    const long bytes = panel_bytes(fmt, K), blocks = K / f->block_rows;
    int8_t *q = malloc((size_t)K);
    float *d = malloc(sizeof(float) * (size_t)blocks), *sums = malloc(sizeof(float) * (size_t)blocks);
    if (!q || !d || !sums) {
        free(q), free(d), free(sums);
        return -1;
    }
    for (long m = 0; m < M; m++) {
        const float *row = x + m * ldx;
        for (long b = 0; b < blocks && !bf16_rows; b++) {
            const float *xb = row + b * f->block_rows;
            if (int8) d[b] = ref_quantize_block(xb, q + b * QBLOCK);
            float sum = 0.0f; /* in order, as weights.c's block_sums */
            for (long k = 0; k < f->block_rows; k++) sum += xb[k];
            sums[b] = sum;
        }
        for (long n = 0; n < N; n++) {
            const uint8_t *panel = (const uint8_t *)w + n / PANEL * bytes;
            float acc = bf16_rows ? reference_bf16_rows(row, panel, K, n % PANEL) : 0.0f;
            for (long b = 0; b < blocks && !bf16_rows; b++) {
                const uint8_t *blk = panel + b * f->block_bytes, *sup = super_scales(fmt, panel, blocks, b);
                acc = int8 ? f->dot_int8(f, blk, sup, n % PANEL, q + b * QBLOCK, d[b], acc)
                           : f->dot(f, blk, sup, n % PANEL, row + b * f->block_rows, sums[b], acc);
            }
            if (bias) acc = acc + bias[n];
            y[m * ldy + n] = accumulate ? acc + y[m * ldy + n] : acc;
        }
    }
    free(q), free(d), free(sums);
    return 0;
}

/* out[i, :] = column ids[i] of the packed W [K, N], dequantized: the embedding lookup in a matrix
 * packed as the LM head (every build's; plain C is all it needs). */
static void reference_columns(const void *w, int fmt, long K, long N, const int64_t *ids, long count, float *out,
                              long ldo) {
    (void)N;
    const long bytes = panel_bytes(fmt, K);
    for (long i = 0; i < count; i++) {
        const uint8_t *panel = (const uint8_t *)w + ids[i] / PANEL * bytes;
        const long c = ids[i] % PANEL;
        if (fmt & F_BF16_ROWS) { /* pairs of rows: (r, c) is bf16 2c + r % 2 of pair r / 2 */
            for (long r = 0; r < K; r++)
                out[i * ldo + r] = bf16_value(((const uint16_t *)panel)[r / 2 * 2 * PANEL + 2 * c + r % 2]);
            continue;
        }
        const format_t *f = &FORMAT_TRAITS[fmt & ~F_INT8];
        const long blocks = K / f->block_rows;
        for (long b = 0; b < blocks; b++)
            f->dequantize(f, panel + b * f->block_bytes, super_scales(fmt, panel, blocks, b), fmt & F_INT8, c,
                          out + i * ldo + b * f->block_rows);
    }
}
