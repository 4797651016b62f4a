/* The Python module braid.server.runner._cpu_kernels. */
#include "kernels.h"

/* ---- Python bindings: every argument a number (a pointer from data_ptr(), a size, a float),
 * described by a format string: 'p' pointer (None: NULL), 'l' long, 'f' float. ---- */

typedef union {
    void *p;
    long l;
    double f;
} arg_t;

static int parse(PyObject *const *args, Py_ssize_t nargs, const char *format, arg_t *out) {
    const Py_ssize_t n = (Py_ssize_t)strlen(format);
    if (nargs != n) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", n, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (format[i] == 'p') out[i].p = args[i] == Py_None ? NULL : PyLong_AsVoidPtr(args[i]);
        else if (format[i] == 'l') out[i].l = PyLong_AsLong(args[i]);
        else out[i].f = PyFloat_AsDouble(args[i]);
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

static PyObject *py_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[11];
    if (parse(args, nargs, "plpplllllpl", a)) return NULL;
    const long M = a[5].l, K = a[6].l, N = a[7].l;
    if (M < 1 || K < 1 || N < 1 || a[1].l < K || a[4].l < N) {
        PyErr_SetString(PyExc_ValueError, "gemm: bad shape");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    gemm(a[0].p, a[1].l, a[2].p, a[3].p, a[4].l, M, K, N, (int)a[8].l, a[9].p, (int)a[10].l);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[8];
    if (parse(args, nargs, "plpplllf", a)) return NULL;
    rms_norm(a[0].p, a[1].l, a[2].p, a[3].p, a[4].l, a[5].l, a[6].l, (float)a[7].f);
    Py_RETURN_NONE;
}

static PyObject *py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[6];
    if (parse(args, nargs, "plllpl", a)) return NULL;
    silu_mul(a[0].p, a[1].l, a[2].l, a[3].l, a[4].p, a[5].l);
    Py_RETURN_NONE;
}

static PyObject *py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[8];
    if (parse(args, nargs, "pllllppp", a)) return NULL;
    if (a[4].l > 1024 || a[4].l % 2) {
        PyErr_SetString(PyExc_ValueError, "rope: head_dim must be even and at most 1024");
        return NULL;
    }
    rope(a[0].p, a[1].l, a[2].l, a[3].l, a[4].l, a[5].p, a[6].p, a[7].p);
    Py_RETURN_NONE;
}

static PyObject *py_decode_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[17];
    if (parse(args, nargs, "ppplpppplllllfpll", a)) return NULL;
    const long H = a[9].l, KVH = a[10].l, D = a[11].l;
    if (KVH < 1 || H % KVH || D % 16) {
        PyErr_SetString(PyExc_ValueError, "decode_attention: heads must divide evenly, head_dim by 16");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    decode_attention(a[0].p, a[1].p, a[2].p, a[3].l, a[4].p, a[5].p, a[6].p, a[7].p, a[8].l, H, KVH,
                     D, a[12].l, (float)a[13].f, a[14].p, a[15].l, (int)a[16].l);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_decode_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[21];
    if (parse(args, nargs, "llllllllfpppppppppppl", a)) return NULL;
    step_t s = {.B = a[0].l, .hidden = a[1].l, .H = a[2].l, .KVH = a[3].l, .D = a[4].l, .I = a[5].l,
                .layers = a[6].l, .max_seq = a[7].l, .eps = (float)a[8].f, .table = a[9].p,
                .positions = a[10].p, .slots = a[11].p, .cos_t = a[12].p, .sin_t = a[13].p, .x = a[14].p,
                .h = a[15].p, .qkv = a[16].p, .attn = a[17].p, .gate_up = a[18].p, .act = a[19].p,
                .threads = (int)a[20].l};
    if (s.B < 1 || s.KVH < 1 || s.H % s.KVH || s.D % 16 || s.D > 1024) {
        PyErr_SetString(PyExc_ValueError, "decode_step: bad shape");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    decode_step(&s);
    Py_END_ALLOW_THREADS
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
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL,
     "silu_mul(gate_up, ld, M, I, out, ldo): out = silu(gate) * up"},
    {"rope", (PyCFunction)(void (*)(void))py_rope, METH_FASTCALL,
     "rope(x, ld, N, heads, D, positions, cos, signed_sin): rotary embedding in place"},
    {"decode_attention", (PyCFunction)(void (*)(void))py_decode_attention, METH_FASTCALL,
     "decode_attention(q, k_new, v_new, ldq, k_cache, v_cache, slots, positions, B, H, KVH, D, "
     "max_seq, scale, out, ldo, threads)"},
    {"decode_step", (PyCFunction)(void (*)(void))py_decode_step, METH_FASTCALL,
     "decode_step(B, hidden, H, KVH, D, I, layers, max_seq, eps, table, positions, slots, cos, sin, "
     "x, h, qkv, attn, gate_up, act, threads): every layer of a decode-only pass"},
    {"has_avx512", py_has_avx512, METH_NOARGS, "whether this CPU runs the kernels"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_cpu_kernels",
                                    "braid's AVX-512 kernels for the CPU decode step", -1, METHODS};

/* The Python side checks these against its own when it imports the module (runner/kernels.py). */
PyMODINIT_FUNC PyInit__cpu_kernels(void) {
    PyObject *m = PyModule_Create(&MODULE);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "PANEL", PANEL) < 0 || PyModule_AddIntConstant(m, "LAYER_FIELDS", T_FIELDS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
