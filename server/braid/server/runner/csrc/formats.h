/*
 * The weight formats as data: one row of FORMATS per format, and everything else about a format (its
 * code, its bytes, its place in every build's kernels, the plain-C reference, the Python side's
 * FORMATS) follows from that row. After ggml's type_traits_cpu, where each type is one row.
 *
 * A panel (kernels.h) is read in blocks: BLOCK_ROWS rows of k by 32 columns. A float format's block
 * is one row of 32 values; a quantized format's is 32 rows (QBLOCK, GGUF's block size), its 32
 * columns' scales (the head) first, then its 32 rows of quants. A quantized weight is
 *     w = d (q - OFFSET) + MIN m
 * where q is the stored quant (STORED: a full-range int8, a 6-bit one stored as q + 32, or a
 * 4-bit unsigned one), d the scale of its column and scale group (GROUPS per block: BLOCK_ROWS / GROUPS
 * rows share one), and m (if MIN is +1 or -1) the column's min. The head holds GROUPS rows of 32
 * scales, then (with a min) a row of 32 mins, each an fp16 (GGUF's own d and m) or, for the K-quants
 * (SUPER), the int8 sub-block scale (and min) of GGUF's two levels: the weight's d is then the
 * fp16 super-block scale of its column times it (and m: the super-block's dmin times its min), as
 * GGUF's reference computes them first; exact in fp32. The super-block scales of a panel's 256-row
 * super-blocks (per super-block: the 32 columns' fp16 d, then with a min their dmin) follow all of
 * its blocks (super_bytes each; kernels.h's super_scales).
 *
 * A new format that fits these columns is one row here, its name in runner/kernels/extension.py's
 * FORMAT_NAMES and the loader's unpacking of its blocks (model/weights.py): kernels/packing.py packs
 * it from the row's traits, every build compiles its kernels from them, and tests/test_kernels.py
 * asks for it. One that does not fit (a lookup table of values, 5-bit quants) adds a STORED kind,
 * each build's code that widens it (weights.c's quant_row, int8.c's group_quants) and its reference
 * functions (reference.c), set in its entry of FORMAT_TRAITS below in place of the ones every float
 * or quantized row gets now (ggml's type traits name each type's functions the same way).
 */
#ifndef BRAID_FORMATS_H
#define BRAID_FORMATS_H

#include <stdint.h>

/* How one weight is stored: a float format's value, or a quantized format's quant. V_U6 (Q6_K's
 * quants q in [-32, 31]) holds q + 32 in 6 bits, as two planes (kernels.h): its low 4 bits as V_U4's
 * nibbles, then its high 2 bits, four columns to a byte. */
enum { V_F32, V_BF16, V_F16, V_I8, V_U6, V_U4, V_U6_BYTES };
#define STORED_BITS(v) ((v) == V_F32 ? 32 : (v) == V_BF16 || (v) == V_F16 ? 16 : (v) == V_U4 ? 4 : (v) == V_U6 ? 6 : 8)
/* What a V_U6 quant holds above the format's q: Q6_K's [-32, 31] as 0..63 */
#define U6_LIFT 32
/* The type of a quantized format's scales and mins (0: a float format has none): fp16, or an int8
 * times its super-block's fp16 (the K-quants). */
enum { S_I8 = 1, S_F16 = 2 };
#define SUPER_ROWS 256 /* rows of a K-quant's super-block: GGUF's QK_K */

/* id, name (GGUF's, or torch's dtype), stored, block rows, scale bytes, groups, offset, min, super.
 * The order is the codes' (runner/kernels/extension.py's FORMAT_NAMES). */
#define FORMATS(X)                                         \
    X(F_F32, "f32", V_F32, 1, 0, 0, 0, 0, 0)               \
    X(F_BF16, "bf16", V_BF16, 1, 0, 0, 0, 0, 0)            \
    X(F_F16, "f16", V_F16, 1, 0, 0, 0, 0, 0)               \
    X(F_Q8_0, "q8_0", V_I8, QBLOCK, S_F16, 1, 0, 0, 0)     \
    X(F_Q4_0, "q4_0", V_U4, QBLOCK, S_F16, 1, 8, 0, 0)     \
    X(F_Q4_1, "q4_1", V_U4, QBLOCK, S_F16, 1, 0, 1, 0)     \
    X(F_Q6_K, "q6_k", V_U6, QBLOCK, S_I8, 2, 0, 0, 1)      \
    X(F_Q4_K, "q4_k", V_U4, QBLOCK, S_I8, 1, 0, -1, 1)

/* The kernels' own formats, never a weight's: Q6_K with its 6-bit quants a byte each (q + 32), as
 * int8.c widens a panel for a matmul of many rows, once for all its tiles. */
#define INNER_FORMATS(X) X(F_Q6_K_BYTES, "q6_k bytes", V_U6_BYTES, QBLOCK, S_I8, 2, 0, 0, 1)

#define FORMAT_ID(id, ...) id,
enum { FORMATS(FORMAT_ID) F_FORMATS };
enum { F_INNER_BEFORE = F_FORMATS - 1, INNER_FORMATS(FORMAT_ID) F_ALL_FORMATS };
#undef FORMAT_ID

/* The plain-C reference (reference.c, compiled once, no intrinsics): what every build's kernels
 * compute, written one value at a time. `layout`: 0 for a panel packed for float32 rows, F_INT8 for
 * one packed for the int8 path (its quants interleaved in groups of 4 rows; kernels.h). */
typedef struct format format_t;
/* out[r] = the weight (r, c) of the block, r < block_rows, as GGUF's reference dequantizes it. sup: the
 * block's super-block scales (a K-quant's; kernels.h's super_scales), else unused. */
typedef void (*dequantize_fn)(const format_t *f, const uint8_t *blk, const uint8_t *sup, int layout, long c,
                              float *out);
/* acc + the block's part of column c's dot product with x (block_rows values; xs: their sum, in
 * order), in the order the kernels add it (float32 rows). */
typedef float (*dot_fn)(const format_t *f, const uint8_t *blk, const uint8_t *sup, long c, const float *x, float xs,
                        float acc);
/* The same for x quantized to q (QBLOCK int8) with scale d (the int8 path; NULL: the format has none). */
typedef float (*dot_int8_fn)(const format_t *f, const uint8_t *blk, const uint8_t *sup, long c, const int8_t *q,
                             float d, float acc);

struct format {
    const char *name;
    int stored;                        /* V_*: a float format's value, or a quantized format's quant */
    int block_rows;                    /* rows of k per block: 1 (a float format) or QBLOCK */
    int scale_bytes;                   /* bytes of each scale and min: 0, 1 (int8, of a super-block's) or 2 (fp16) */
    int groups;                        /* scales per column per block */
    int group_rows;                    /* rows that share a scale: block_rows / groups */
    int offset;                        /* w = d (q - offset) ... */
    int min;                           /* ... + min m: +1, -1, or 0 for no min */
    long row_bytes;                    /* one row of a block's 32 weights */
    long head_bytes;                   /* the scales (and mins) ahead of a block's rows */
    long block_bytes;                  /* head_bytes + block_rows row_bytes */
    long super_bytes;                  /* a K-quant's super-block scales in a panel (fp16 d, dmin per column); 0 */
    dequantize_fn dequantize;
    dot_fn dot;
    dot_int8_fn dot_int8;
};

void ref_dequantize_float(const format_t *f, const uint8_t *blk, const uint8_t *sup, int layout, long c, float *out);
void ref_dequantize_quants(const format_t *f, const uint8_t *blk, const uint8_t *sup, int layout, long c, float *out);
float ref_dot_float(const format_t *f, const uint8_t *blk, const uint8_t *sup, long c, const float *x, float xs,
                    float acc);
float ref_dot_quants(const format_t *f, const uint8_t *blk, const uint8_t *sup, long c, const float *x, float xs,
                     float acc);
float ref_dot_int8_quants(const format_t *f, const uint8_t *blk, const uint8_t *sup, long c, const int8_t *q, float d,
                          float acc);

#define FORMAT_ROW_BYTES(stored) (PANEL * STORED_BITS(stored) / 8)
#define FORMAT_HEAD_BYTES(scale, groups, min) ((long)PANEL * (scale) * ((groups) + ((min) != 0)))
#define FORMAT_SUPER_BYTES(super, min) ((super) ? (long)PANEL * 2 * (1 + ((min) != 0)) : 0)
#define FORMAT_TRAITS_ROW(id, name_, stored_, rows, scale, groups_, offset_, min_, super_)                      \
    [id] = {.name = name_, .stored = stored_, .block_rows = rows, .scale_bytes = scale, .groups = groups_,      \
            .group_rows = groups_ ? rows / (groups_ + !groups_) : rows, .offset = offset_, .min = min_,         \
            .row_bytes = FORMAT_ROW_BYTES(stored_),                                                             \
            .head_bytes = FORMAT_HEAD_BYTES(scale, groups_, min_),                                              \
            .block_bytes = FORMAT_HEAD_BYTES(scale, groups_, min_) + rows * FORMAT_ROW_BYTES(stored_),         \
            .super_bytes = FORMAT_SUPER_BYTES(super_, min_),                                                    \
            .dequantize = scale ? ref_dequantize_quants : ref_dequantize_float,                                 \
            .dot = scale ? ref_dot_quants : ref_dot_float, .dot_int8 = scale ? ref_dot_int8_quants : 0},
/* Each translation unit's copy: a build's kernels read a constant format's row at compile time. */
static const format_t FORMAT_TRAITS[F_ALL_FORMATS] = {FORMATS(FORMAT_TRAITS_ROW) INNER_FORMATS(FORMAT_TRAITS_ROW)};
#undef FORMAT_TRAITS_ROW

/* A format's traits, for code compiled with fmt a constant (each build's kernels). */
#define TRAITS(fmt) (FORMAT_TRAITS[fmt])
#define QUANTIZED(fmt) (TRAITS(fmt).scale_bytes != 0)
#define ROW_BYTES(fmt) (TRAITS(fmt).row_bytes)
#define HEAD_BYTES(fmt) (TRAITS(fmt).head_bytes)
#define SCALE_ROWS(fmt) (TRAITS(fmt).group_rows) /* rows per scale: 16 for Q6_K, 32 for the others */
/* Whether a format's fold needs the sum of x over each block (a min, or an offset such as Q4_0's 8). */
#define NEEDS_SUMS(fmt) (TRAITS(fmt).offset != 0 || TRAITS(fmt).min != 0)

/* FORMAT_CALL(F) for the format fmt, with F its code as a constant: a switch made from FORMATS'
 * rows, so that a kernel is compiled once per format with the format's traits folded in (define
 * FORMAT_CALL(F) where EACH_FORMAT is expanded). */
#define FORMAT_CASE(id, ...) case id: FORMAT_CALL(id); break;
#define EACH_FORMAT(fmt) switch (fmt) { FORMATS(FORMAT_CASE) }

#endif
