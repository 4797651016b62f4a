/*
 * braid's CPU kernels for the few-row matmuls of a decode step.
 *
 * A decode step multiplies a handful of rows (one per running session) by every weight matrix of
 * the model. For so few rows, MKL's fp32 GEMM reads the weights from memory at a fraction of the
 * bandwidth (measured on a 2-core AVX-512 VM: 7 GB/s at 16 rows, where a plain stream reaches 27),
 * so the step is bound by how the weights are read, not by arithmetic.
 *
 * This kernel reads each weight exactly once per call, as one sequential stream: the weights are
 * packed into column panels of 32 ([N/32][K][32], contiguous), each thread walks its own run of
 * panels, and every 32-float row of a panel is multiplied into all rows of x while it is in
 * registers. Every output element is one fused multiply-add chain over k = 0..K-1 in order, so a
 * row's result does not depend on how many other rows share the call: the same token gives the
 * same logits whatever else is in the batch.
 *
 * The functions take raw pointers (from torch's data_ptr()) and release the GIL while they run;
 * threads come from the OpenMP runtime torch itself loaded, so nothing oversubscribes the cores.
 * The AVX-512 code is compiled for that target only and used only where the CPU has it: Python
 * asks has_avx512() and otherwise keeps torch's own matmul.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define PANEL 32 /* columns per packed panel: two 16-float AVX-512 vectors */
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

#define AVX512 __attribute__((target("avx512f,fma")))

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
AVX512 static void gemm(const float *x, long ldx, const float *w, float *y, long ldy, long M, long K,
                        long N, int accumulate, const float *bias, int threads) {
    const long panels = (N + PANEL - 1) / PANEL;
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
            for (long k0 = 0; k0 < K; k0 += KBLOCK) {
                const long k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;
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

/* out[M, D] = x / sqrt(mean(x^2) + eps) * weight, row by row (rows of stride ldx and ldo). */
AVX512 static void rms_norm(const float *x, long ldx, const float *weight, float *out, long ldo,
                            long M, long D, float eps) {
    for (long m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        float *o = out + m * ldo;
        __m512 ss = _mm512_setzero_ps();
        long d = 0;
        for (; d + 16 <= D; d += 16) {
            const __m512 v = _mm512_loadu_ps(xr + d);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        float sum = _mm512_reduce_add_ps(ss);
        for (; d < D; d++) sum += xr[d] * xr[d];
        const float inv = 1.0f / sqrtf(sum / (float)D + eps);
        const __m512 s = _mm512_set1_ps(inv);
        for (d = 0; d + 16 <= D; d += 16)
            _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + d), s),
                                                  _mm512_loadu_ps(weight + d)));
        for (; d < D; d++) o[d] = xr[d] * inv * weight[d];
    }
}

/* ---- Python bindings: integers in (pointers, sizes), None out. ---- */

static int as_ptr(PyObject *o, void **out) {
    if (o == Py_None) {
        *out = NULL;
        return 0;
    }
    *out = PyLong_AsVoidPtr(o);
    return PyErr_Occurred() ? -1 : 0;
}

static int as_longs(PyObject *const *args, long *out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* gemm(x, ldx, w, y, ldy, M, K, N, accumulate, bias, threads) */
static PyObject *py_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    void *x, *w, *y, *bias;
    long ldx, dims[4], rest[2];
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "gemm takes 11 arguments");
        return NULL;
    }
    if (as_ptr(args[0], &x) || as_longs(args + 1, &ldx, 1) || as_ptr(args[2], &w) ||
        as_ptr(args[3], &y) || as_longs(args + 4, dims, 4) || as_longs(args + 8, rest, 1) ||
        as_ptr(args[9], &bias) || as_longs(args + 10, rest + 1, 1))
        return NULL;
    const long ldy = dims[0], M = dims[1], K = dims[2], N = dims[3];
    if (M < 1 || K < 1 || N < 1 || ldx < K || ldy < N) {
        PyErr_SetString(PyExc_ValueError, "gemm: bad shape");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    gemm(x, ldx, w, y, ldy, M, K, N, (int)rest[0], bias, (int)rest[1]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* rms_norm(x, ldx, weight, out, ldo, M, D, eps) */
static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    void *x, *weight, *out;
    long ldx, dims[3];
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "rms_norm takes 8 arguments");
        return NULL;
    }
    if (as_ptr(args[0], &x) || as_longs(args + 1, &ldx, 1) || as_ptr(args[2], &weight) ||
        as_ptr(args[3], &out) || as_longs(args + 4, dims, 3))
        return NULL;
    const double eps = PyFloat_AsDouble(args[7]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    rms_norm(x, ldx, weight, out, dims[0], dims[1], dims[2], (float)eps);
    Py_RETURN_NONE;
}

static PyObject *py_has_avx512(PyObject *self, PyObject *unused) {
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma"));
}

static PyMethodDef METHODS[] = {
    {"gemm", (PyCFunction)(void (*)(void))py_gemm, METH_FASTCALL,
     "gemm(x, ldx, w_packed, y, ldy, M, K, N, accumulate, bias, threads): y (+)= x @ W + bias"},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL,
     "rms_norm(x, ldx, weight, out, ldo, M, D, eps)"},
    {"has_avx512", py_has_avx512, METH_NOARGS, "whether this CPU runs the kernels"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_cpu_kernels",
                                    "braid's AVX-512 kernels for few-row fp32 matmuls", -1, METHODS};

PyMODINIT_FUNC PyInit__cpu_kernels(void) { return PyModule_Create(&MODULE); }
