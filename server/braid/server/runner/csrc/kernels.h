/*
 * braid's CPU kernels for the few-row matmuls of a decode step.
 *
 * A decode step multiplies a handful of rows (one per running session) by every weight matrix of
 * the model. For so few rows, MKL's fp32 GEMM reads the weights from memory at a fraction of the
 * bandwidth (measured on a 2-core AVX-512 VM: 7 GB/s at 16 rows, where a plain stream reaches 27),
 * so the step is bound by how the weights are read, not by arithmetic. The fewer bytes a weight
 * takes, the faster the step: so each matrix stays in its own format (fp32, bf16, f16, or GGUF's
 * Q8_0, Q4_0, Q4_1 blocks) and is widened to fp32 in registers, never in memory.
 *
 * The matmul reads each weight exactly once per call, as one sequential stream: the weights are
 * packed into column panels of 32 (panel p holds output columns [32p, 32p + 32)), each thread walks
 * runs of PANEL_CHUNK panels, and every 32-weight row of a panel is multiplied into all rows of x while
 * it is in registers. Within a panel the rows k = 0..K-1 come in blocks of 32 (QBLOCK); a quantized
 * block starts with its 32 columns' scales (and mins), then its 32 rows of quants (formats.h).
 *
 * Activations and sums are fp32. A float format's output element is one fused multiply-add chain
 * over k = 0..K-1 in order; a quantized format's sums x times the unscaled quants over each group
 * of rows that shares a scale, then folds the group in with its scale (weights.c), within fp32
 * rounding of the matmul on the weights GGUF's reference dequantizes. Either way the order is
 * fixed, so a row's result does not depend on how many other rows share the call: the same token
 * gives the same logits whatever else is in the batch.
 *
 * Bits across builds. Every output of the matmul is computed lane by lane (a lane is a column), so the
 * vector width does not enter it: for float32 rows and for int8 rows, every build gives the bits of
 * the plain-C reference (reference.c), which writes the same sums one value at a time; so does the
 * embedding lookup, which is that reference. What may differ between the AVX-512 and the AVX2 builds
 * is what sums across lanes: RMSNorm's sum of squares and attention's dot products and softmax are
 * added in 16- or 8-lane partial sums, so a model's float32 logits differ between the widths in the
 * last bits (6.45e-5 at most over 512 positions of a SmolLM2-shaped model, docs/benchmarks.md), and
 * int8 rows, re-quantizing each layer's input, carry such a difference further. The bf16 path
 * (avx512_bf16 only) rounds as vdpbf16ps does and has no reference.
 *
 * The same source is compiled five times, for AVX-512 (16-float vectors) and for AVX2 + FMA (8-float
 * vectors), each with and without the integer dot product (AVX-512 VNNI, AVX-VNNI) the int8 path
 * uses, and for AVX-512 with VNNI and BF16, whose vdpbf16ps the bf16 path uses (bf16.c):
 * isa_avx512*.c and isa_avx2*.c each include it under their own target (simd.h). The Python
 * side picks the best the CPU runs (select_isa), or the one BRAID_KERNELS_ISA names.
 *
 * The functions take raw pointers (from torch's data_ptr()) and release the GIL while they run;
 * threads come from the OpenMP runtime torch itself loaded, so nothing oversubscribes the cores.
 */
#ifndef BRAID_KERNELS_H
#define BRAID_KERNELS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The contract with runner/kernels/extension.py and runner/weights.py, checked when the module loads. */
#define PANEL 32  /* columns per packed panel */
#define QBLOCK 32 /* rows of k per block of a panel; GGUF's block size */
#define KV_LAYOUT 3 /* the KV cache's layout: 3, paged [pages, KVH, page size, D], f32, bf16, f16 or q8_0 rows (attention.c) */

/* The weight formats (formats.h): F_F32, F_BF16, F_F16, then GGUF's Q8_0, Q4_0, Q4_1, Q6_K, Q4_K, each one
 * row of FORMATS. Q8_0, Q4_0 and Q4_1 keep GGUF's fp16 d (then Q4_1's fp16 m). GGUF's K-quants have
 * sub-block scales built from two levels, kept as two levels: per block the int8 scales (Q6_K: per 16
 * rows; Q4_K: per 32, then its mins, GGUF's 6-bit ones widened to a byte), and per 256-row super-block
 * the fp16 d (and Q4_K's dmin) of each column, after the panel's blocks. A kernel multiplies the two as
 * GGUF's reference does first (exact in fp32), so the weights come out exactly as there, in the
 * file's bytes (Q6_K: 0.820 a weight) or 3% more (Q4_K). (They were kept as those fp32 products: 1.25
 * and 0.75 bytes a weight; then Q6_K's quants as int8, 1.07.) Q4 rows hold column j in the low nibble
 * of byte j and column j + 16 in its high nibble. A Q6_K row is 24 bytes: its quants' low 4 bits as a
 * Q4 row's 16, then their high 2 bits, column j (j < 8) and j + 8, j + 16, j + 24 in bits 0-1, 2-3,
 * 4-5 and 6-7 of byte 16 + j. */
#include "formats.h"

/* A quantized format's code with F_INT8 set (kernels/packing.py sets it for --activations int8): each row
 * of x is quantized to int8 per block of 32 and multiplied with integer dot products (int8.c), and
 * the weight's blocks are packed for them: a block's 32 rows of quants come in 8 groups of 4 rows,
 * and a group holds each column's 4 quants in 4 consecutive bytes (Q8_0: column j at byte 4j of the
 * group's 128; Q4: column j < 16 in the low nibbles of bytes 4j..4j+3 of its 64, column j + 16 in
 * their high nibbles; Q6_K: the low 4 bits of its quants as Q4's 64, then their high 2 bits in 32,
 * columns j, j + 8, j + 16 and j + 24 (j < 8) in the bit pairs of bytes 64 + 4j..64 + 4j+3), the order
 * vpdpbusd and vpmaddubsw read. Same bytes per block. */
#define F_INT8 0x100

/* F_BF16 with F_BF16_ROWS set (kernels/packing.py sets it for --activations bf16 where the build has it):
 * each row of x is rounded to bf16 and multiplied with AVX-512 BF16's vdpbf16ps (bf16.c), and the
 * weight is packed for it in pairs of rows: pair p of a panel holds rows 2p and 2p + 1 as 64 bf16,
 * column j's two at 2j and 2j + 1 (an odd K's last pair padded with a row of zeros). */
#define F_BF16_ROWS 0x200

/* A matrix fused from parts in different formats (kernels/packing.py's PackedParts). A GGUF file may
 * keep q and k in one format and v in another (Q4_K_M keeps v in Q6_K in half the layers): fused in
 * one format, such a q/k/v was fp32, 4 bytes a weight where Q4_K reads 0.58. With F_PARTS as its
 * format, a decode step's matrix pointer points to int64s {count, then per part PART_FIELDS: its code,
 * its columns (each part's but the last a multiple of PANEL) and its packed weight}, the parts side by
 * side along the outputs, each in its own format and path. gemm's callers multiply part by part. */
#define F_PARTS 0x400
#define MAX_PARTS 4
enum { PART_CODE, PART_COLUMNS, PART_WEIGHT, PART_FIELDS };

/* The panels a thread takes at a time where the threads share out a matmul's (`schedule(dynamic,
 * PANEL_CHUNK)`): whichever finishes first takes the next four. Shared out statically, in halves,
 * one thread waited for the other at every matmul's end: two cores do not stream at one rate, and
 * a q/k/v of parts (Q4_K_M's v in Q6_K) put all of the dearer panels in one half. libgomp's wait
 * was 8% of a 1B Q4_K_M decode's samples; whole passes took 0.96-0.98x the time at 1 row and 0.88-0.90x
 * at 8 (benchmarks/kernels_ab.py --threads 2 --passes; docs/benchmarks.md). Which thread computes a panel
 * never changes its bits. */
#define PANEL_CHUNK 4

static inline long block_bytes(int fmt) { return TRAITS(fmt).block_bytes; }
/* Bytes of one packed panel of K rows. A quantized format needs K to be a multiple of QBLOCK, a
 * K-quant of SUPER_ROWS. */
static inline long panel_bytes(int fmt, long K) {
    if (fmt & F_BF16_ROWS) return (K + 1) / 2 * 2 * ROW_BYTES(F_BF16);
    fmt &= ~F_INT8;
    return K / TRAITS(fmt).block_rows * TRAITS(fmt).block_bytes + K / SUPER_ROWS * TRAITS(fmt).super_bytes;
}
/* The super-block scales of block b of a panel of `blocks` blocks (a K-quant's: after its blocks, per
 * super-block the 32 columns' fp16 d, then dmin); NULL for the other formats. */
static inline const uint8_t *super_scales(int fmt, const uint8_t *panel, long blocks, long b) {
    fmt &= ~F_INT8;
    if (!TRAITS(fmt).super_bytes) return NULL;
    return panel + blocks * TRAITS(fmt).block_bytes + b / (SUPER_ROWS / QBLOCK) * TRAITS(fmt).super_bytes;
}

/* A whole decode step through every layer, for passes where each sequence feeds one token: the
 * same kernels in the decoder's order, with no Python between them (one call and no GIL for the
 * step). x [B, hidden] holds the tokens' embeddings and leaves holding the last layer's residual
 * stream; the caller applies the final norm and the LM head. Each layer's row of `table` holds, in
 * this order (the names are exported as LAYER_FIELDS and checked by runner/kernels/extension.py), pointers (a
 * weight followed by its format) and the layer's own settings. Fields a family does not have are 0,
 * and cost nothing:
 * - Q_NORM, K_NORM: RMSNorm weights [D] over each head of q and of k before RoPE (Qwen3, Gemma 3);
 * - ATTN_OUT_NORM, MLP_OUT_NORM: RMSNorm weights [hidden] on the attention's and the MLP's outputs
 *   before they join the residual stream (Gemma's sandwich norms);
 * - WINDOW: a sliding-window layer's window (a token sees the WINDOW positions up to its own);
 * - COS, SIN: the layer's RoPE tables [max_seq, D] (Gemma 3's local layers have their own). */
enum {
    T_INPUT_NORM, T_QKV, T_QKV_FMT, T_QKV_BIAS, T_O, T_O_FMT, T_POST_NORM, T_GATE_UP, T_GATE_UP_FMT,
    T_DOWN, T_DOWN_FMT, T_K_CACHE, T_V_CACHE, T_Q_NORM, T_K_NORM, T_ATTN_OUT_NORM, T_MLP_OUT_NORM, T_WINDOW,
    T_COS, T_SIN, T_FIELDS
};
static const char *const LAYER_FIELD_NAMES[T_FIELDS] = {
    [T_INPUT_NORM] = "input_norm", [T_QKV] = "qkv", [T_QKV_FMT] = "qkv_format", [T_QKV_BIAS] = "qkv_bias",
    [T_O] = "o", [T_O_FMT] = "o_format", [T_POST_NORM] = "post_norm", [T_GATE_UP] = "gate_up",
    [T_GATE_UP_FMT] = "gate_up_format", [T_DOWN] = "down", [T_DOWN_FMT] = "down_format", [T_K_CACHE] = "k_cache",
    [T_V_CACHE] = "v_cache", [T_Q_NORM] = "q_norm", [T_K_NORM] = "k_norm", [T_ATTN_OUT_NORM] = "attn_out_norm",
    [T_MLP_OUT_NORM] = "mlp_out_norm", [T_WINDOW] = "window", [T_COS] = "cos", [T_SIN] = "sin",
};

/* The MLP's gating activation: act(gate) * up. Exported as ACTIVATIONS, in this order, by the
 * names transformers' configs give them. */
enum { A_SILU, A_GELU_TANH, A_ACTIVATIONS };
static const char *const ACTIVATION_NAMES[A_ACTIVATIONS] = {[A_SILU] = "silu", [A_GELU_TANH] = "gelu_pytorch_tanh"};

/* LoRA adapters in a decode step (runner/lora.py): each adapter's table holds, per layer and per
 * fused projection group (L_QKV, L_O, L_GATE_UP, L_DOWN), a row of these fields: AT, its A^T [in, COLS],
 * its rows COLS rounded up to 16 apart (zeros past COLS: whole vector loads) (every targeted module's
 * A^T side by side, RANK columns each; 0: the group is not targeted), and per targeted module, in
 * AT's order, its B^T times the scale, added into the group's output columns [BEGIN, END), in
 * 32-column panels as the matmul's (panel p: the group's columns [32p, 32p + 32), zero outside the
 * module's): [panels from BEGIN / 32 to (END - 1) / 32, RANK, 32], each panel's part one contiguous
 * read. FMT: the matrices' format, F_F32 or F_BF16 (where every value is a bf16 one: half the bytes,
 * which are most of what the deltas cost; docs/benchmarks.md). Exported as LORA_FIELDS. */
enum { L_QKV, L_O, L_GATE_UP, L_DOWN, L_GROUPS };
enum { L_AT, L_COLS, L_RANK, L_B0, L_BEGIN0, L_END0, L_B1, L_BEGIN1, L_END1, L_B2, L_BEGIN2, L_END2, L_FMT, L_FIELDS };
static const char *const LORA_FIELD_NAMES[L_FIELDS] = {
    [L_AT] = "at", [L_COLS] = "cols", [L_RANK] = "rank", [L_B0] = "b0", [L_BEGIN0] = "begin0", [L_END0] = "end0",
    [L_B1] = "b1", [L_BEGIN1] = "begin1", [L_END1] = "end1", [L_B2] = "b2", [L_BEGIN2] = "begin2", [L_END2] = "end2",
    [L_FMT] = "fmt",
};

typedef struct {
    long B, hidden, H, KVH, D, I, layers, page_size, table_stride;
    int kv_fmt; /* the KV cache's format: F_F32, F_BF16, F_F16 or F_Q8_0 (attention.c) */
    int activation; /* A_SILU or A_GELU_TANH */
    float eps, scale, softcap; /* attention: scores * scale, then softcap * tanh(scores / softcap) if softcap > 0 */
    const int64_t *table, *positions, *tables; /* tables: B page tables of table_stride entries */
    float *x, *h, *qkv, *attn, *gate_up, *act; /* scratch: [B, hidden], [B, (H + 2 KVH) D], [B, H D], [B, 2 I], [B, I] */
    int threads;
    /* whether rows read each other's keys (rows of one sequence: a prompt chunk's, or a speculating
     * row's): then every key is written before any row attends */
    int shared;
    /* LoRA: lora_rows [B], each row's adapter as an index into lora_tables (-1: none; NULL: no row
     * has one); lora_tables: pointers to each adapter's table [layers, L_GROUPS, L_FIELDS];
     * lora_cols: the most COLS of any of them; lora_alone: the most multiply-adds a matmul's x A^T
     * may take for every thread to do it all itself rather than share it out (decode_step.c) */
    const int64_t *lora_rows, *lora_tables;
    long lora_cols, lora_alone;
} step_t;

/* One instruction set's build of every kernel (isa_avx512.c, isa_avx2.c). */
typedef struct {
    const char *name;
    int (*supported)(void);
    int bf16_rows; /* whether gemm runs F_BF16_ROWS (the build has AVX-512 BF16) */
    /* y[M, N] (row stride ldy) = x[M, K] @ W + bias (or y += ... when accumulate), W packed in fmt. */
    int (*gemm)(const float *x, long ldx, const void *w, int fmt, float *y, long ldy, long M, long K, long N,
                 int accumulate, const float *bias, int threads); /* -1: out of memory */
    void (*rms_norm)(const float *x, long ldx, const float *weight, float *out, long ldo, long M, long D, float eps);
    void (*silu_mul)(const float *gu, long ldg, long M, long I, float *out, long ldo);
    void (*gelu_tanh_mul)(const float *gu, long ldg, long M, long I, float *out, long ldo);
    void (*rope)(float *x, long ld, long N, long heads, long D, const int64_t *positions, const float *cos_t,
                 const float *sin_t);
    void (*decode_attention)(const float *q, const float *k_new, const float *v_new, long ldq, void *k_cache,
                             void *v_cache, int kv_fmt, const int64_t *tables, long table_stride,
                             const int64_t *positions, long B, long H, long KVH, long D, long P, float scale,
                             float softcap, long window, float *out, long ldo, int threads, int write);
    int (*decode_step)(const step_t *s); /* -1: out of memory */
} kernels_t;

extern const kernels_t AVX512_BF16_KERNELS, AVX512_VNNI_KERNELS, AVX512_KERNELS, AVX2_VNNI_KERNELS, AVX2_KERNELS;

#endif
