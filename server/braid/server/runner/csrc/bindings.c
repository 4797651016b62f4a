/* The Python module braid.server.runner._cpu_kernels: each function calls the kernels of the
 * instruction set selected by select_isa (isa_avx512*.c or isa_avx2*.c). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels.h"
#include "reference.c" /* compiled here, once: no instruction set's target */

static const kernels_t *const ISAS[] = {&AVX512_BF16_KERNELS, &AVX512_VNNI_KERNELS, &AVX512_KERNELS, &AVX2_VNNI_KERNELS,
                                        &AVX2_KERNELS}; /* best first */
static const kernels_t *K = NULL; /* the selected build; NULL until select_isa */

static int selected(void) {
    if (K) return 0;
    PyErr_SetString(PyExc_RuntimeError, "_cpu_kernels: no instruction set selected (select_isa)");
    return -1;
}

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

static int check_format(long fmt, long K, const char *who) {
    if (fmt & F_BF16_ROWS) {
        if (fmt != (F_BF16 | F_BF16_ROWS)) {
            PyErr_Format(PyExc_ValueError, "%s: only bf16 has a bf16-rows path, not format %ld", who, fmt);
            return -1;
        }
        return 0;
    }
    const long base = fmt & ~F_INT8;
    if (base < 0 || base >= F_FORMATS) {
        PyErr_Format(PyExc_ValueError, "%s: unknown weight format %ld", who, base);
        return -1;
    }
    if (fmt & F_INT8 && !FORMAT_TRAITS[base].dot_int8) {
        PyErr_Format(PyExc_ValueError, "%s: only a quantized format has an int8 path, not format %ld", who, base);
        return -1;
    }
    const long rows = FORMAT_TRAITS[base].super_bytes ? SUPER_ROWS : FORMAT_TRAITS[base].block_rows;
    if (K % rows) {
        PyErr_Format(PyExc_ValueError, "%s: a %s weight needs K a multiple of %ld, not %ld", who,
                     FORMAT_TRAITS[base].name, rows, K);
        return -1;
    }
    return 0;
}

static PyObject *py_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[12];
    if (parse(args, nargs, "plplplllllpl", a) || selected()) return NULL;
    const long M = a[6].l, Kd = a[7].l, N = a[8].l;
    if (M < 1 || Kd < 1 || N < 1 || a[1].l < Kd || a[5].l < N) {
        PyErr_SetString(PyExc_ValueError, "gemm: bad shape");
        return NULL;
    }
    if (check_format(a[3].l, Kd, "gemm")) return NULL;
    if (a[3].l & F_BF16_ROWS && !K->bf16_rows) {
        PyErr_Format(PyExc_ValueError, "gemm: the %s kernels have no bf16-rows path (it needs AVX-512 BF16)", K->name);
        return NULL;
    }
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = K->gemm(a[0].p, a[1].l, a[2].p, (int)a[3].l, a[4].p, a[5].l, M, Kd, N, (int)a[9].l, a[10].p, (int)a[11].l);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_columns(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[8];
    if (parse(args, nargs, "plllplpl", a) || selected()) return NULL;
    const long Kd = a[2].l, N = a[3].l, count = a[5].l;
    const int64_t *ids = a[4].p;
    if (check_format(a[1].l, Kd, "columns")) return NULL;
    for (long i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= N) {
            PyErr_Format(PyExc_IndexError, "columns: id %lld is not in [0, %ld)", (long long)ids[i], N);
            return NULL;
        }
    reference_columns(a[0].p, (int)a[1].l, Kd, N, ids, count, a[6].p, a[7].l);
    Py_RETURN_NONE;
}

static PyObject *py_reference_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[11];
    if (parse(args, nargs, "plplplllllp", a)) return NULL;
    const long M = a[6].l, Kd = a[7].l, N = a[8].l;
    if (M < 1 || Kd < 1 || N < 1 || a[1].l < Kd || a[5].l < N) {
        PyErr_SetString(PyExc_ValueError, "reference_gemm: bad shape");
        return NULL;
    }
    if (check_format(a[3].l, Kd, "reference_gemm")) return NULL;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = reference_gemm(a[0].p, a[1].l, a[2].p, (int)a[3].l, a[4].p, a[5].l, M, Kd, N, (int)a[9].l, a[10].p);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[8];
    if (parse(args, nargs, "plpplllf", a) || selected()) return NULL;
    K->rms_norm(a[0].p, a[1].l, a[2].p, a[3].p, a[4].l, a[5].l, a[6].l, (float)a[7].f);
    Py_RETURN_NONE;
}

static PyObject *py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[6];
    if (parse(args, nargs, "plllpl", a) || selected()) return NULL;
    K->silu_mul(a[0].p, a[1].l, a[2].l, a[3].l, a[4].p, a[5].l);
    Py_RETURN_NONE;
}

static PyObject *py_gelu_tanh_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[6];
    if (parse(args, nargs, "plllpl", a) || selected()) return NULL;
    K->gelu_tanh_mul(a[0].p, a[1].l, a[2].l, a[3].l, a[4].p, a[5].l);
    Py_RETURN_NONE;
}

static PyObject *py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[8];
    if (parse(args, nargs, "pllllppp", a) || selected()) return NULL;
    if (a[4].l > 1024 || a[4].l % 2) {
        PyErr_SetString(PyExc_ValueError, "rope: head_dim must be even and at most 1024");
        return NULL;
    }
    K->rope(a[0].p, a[1].l, a[2].l, a[3].l, a[4].l, a[5].p, a[6].p, a[7].p);
    Py_RETURN_NONE;
}

static int check_paging(long H, long KVH, long D, long P, long kv_fmt, const char *who) {
    if (KVH < 1 || H % KVH || D % 16 || D > 1024 || P < 16 || P % 16) {
        PyErr_Format(PyExc_ValueError, "%s: heads must divide evenly, head_dim and page size by 16", who);
        return -1;
    }
    if (kv_fmt != F_F32 && kv_fmt != F_BF16 && kv_fmt != F_F16 && kv_fmt != F_Q8_0) {
        PyErr_Format(PyExc_ValueError, "%s: a KV cache is f32, bf16, f16 or q8_0, not format %ld", who, kv_fmt);
        return -1;
    }
    if (kv_fmt == F_Q8_0 && D % QBLOCK) {
        PyErr_Format(PyExc_ValueError, "%s: a q8_0 KV cache needs head_dim a multiple of 32, not %ld", who, D);
        return -1;
    }
    return 0;
}

static PyObject *py_decode_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[22];
    if (parse(args, nargs, "ppplpplplplllllfflplll", a) || selected()) return NULL;
    const long H = a[11].l, KVH = a[12].l, D = a[13].l, P = a[14].l;
    if (check_paging(H, KVH, D, P, a[6].l, "decode_attention")) return NULL;
    Py_BEGIN_ALLOW_THREADS
    K->decode_attention(a[0].p, a[1].p, a[2].p, a[3].l, a[4].p, a[5].p, (int)a[6].l, a[7].p, a[8].l, a[9].p,
                        a[10].l, H, KVH, D, P, (float)a[15].f, (float)a[16].f, a[17].l, a[18].p, a[19].l,
                        (int)a[20].l, (int)a[21].l);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* A decode step's matrix (its weight pointer, then its format code), or each part of an F_PARTS one:
 * a known format, on a path this build has; a part's columns whole panels but the last's. */
static int check_step_code(long fmt) {
    if (check_format(fmt, 0, "decode_step")) return -1;
    if (fmt & F_BF16_ROWS && !K->bf16_rows) {
        PyErr_Format(PyExc_ValueError, "decode_step: the %s kernels have no bf16-rows path (it needs AVX-512 BF16)",
                     K->name);
        return -1;
    }
    return 0;
}

static int check_step_matrix(const int64_t *field) {
    if (field[1] != F_PARTS) return check_step_code((long)field[1]);
    const int64_t *parts = (const int64_t *)(intptr_t)field[0];
    if (!parts || parts[0] < 1 || parts[0] > MAX_PARTS) {
        PyErr_Format(PyExc_ValueError, "decode_step: a matrix of parts has 1 to %d of them", MAX_PARTS);
        return -1;
    }
    for (long i = 0; i < parts[0]; i++) {
        const int64_t *part = parts + 1 + i * PART_FIELDS;
        if (part[PART_CODE] == F_PARTS) {
            PyErr_SetString(PyExc_ValueError, "decode_step: a part of a matrix has no parts of its own");
            return -1;
        }
        if (check_step_code((long)part[PART_CODE])) return -1;
        if (part[PART_COLUMNS] < 1 || !part[PART_WEIGHT] || (i + 1 < parts[0] && part[PART_COLUMNS] % PANEL)) {
            PyErr_Format(PyExc_ValueError, "decode_step: part %ld of a matrix needs a weight and whole panels of "
                         "columns (%d) but the last's, not %lld", i, PANEL, (long long)part[PART_COLUMNS]);
            return -1;
        }
    }
    return 0;
}

static PyObject *py_decode_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg_t a[29];
    if (parse(args, nargs, "llllllllllfffppplpppppplpplll", a) || selected()) return NULL;
    step_t s = {.B = a[0].l, .hidden = a[1].l, .H = a[2].l, .KVH = a[3].l, .D = a[4].l, .I = a[5].l,
                .layers = a[6].l, .page_size = a[7].l, .kv_fmt = (int)a[8].l, .activation = (int)a[9].l,
                .eps = (float)a[10].f, .scale = (float)a[11].f, .softcap = (float)a[12].f, .table = a[13].p,
                .positions = a[14].p, .tables = a[15].p, .table_stride = a[16].l, .x = a[17].p, .h = a[18].p,
                .qkv = a[19].p, .attn = a[20].p, .gate_up = a[21].p, .act = a[22].p, .threads = (int)a[23].l,
                .lora_rows = a[24].p, .lora_tables = a[25].p, .lora_cols = a[26].l, .shared = (int)a[27].l,
                .lora_alone = a[28].l};
    if (s.B < 1 || check_paging(s.H, s.KVH, s.D, s.page_size, s.kv_fmt, "decode_step")) return NULL;
    if (s.activation < 0 || s.activation >= A_ACTIVATIONS) {
        PyErr_Format(PyExc_ValueError, "decode_step: unknown activation %d", s.activation);
        return NULL;
    }
    static const int MATRICES[] = {T_QKV_FMT, T_O_FMT, T_GATE_UP_FMT, T_DOWN_FMT};
    for (long layer = 0; layer < s.layers; layer++) /* a weight packed for a path this build lacks */
        for (size_t i = 0; i < sizeof MATRICES / sizeof *MATRICES; i++)
            if (check_step_matrix(s.table + layer * T_FIELDS + MATRICES[i] - 1)) return NULL;
    if (s.lora_rows && (!s.lora_tables || s.lora_cols < 1)) {
        PyErr_SetString(PyExc_ValueError, "decode_step: LoRA rows need their adapters' tables and lora_cols >= 1");
        return NULL;
    }
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = K->decode_step(&s);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_isas(PyObject *self, PyObject *unused) {
    PyObject *names = PyList_New(0);
    for (size_t i = 0; names && i < sizeof ISAS / sizeof *ISAS; i++) {
        if (!ISAS[i]->supported()) continue;
        PyObject *name = PyUnicode_FromString(ISAS[i]->name);
        if (!name || PyList_Append(names, name)) {
            Py_XDECREF(name);
            Py_CLEAR(names);
            break;
        }
        Py_DECREF(name);
    }
    return names;
}

static PyObject *py_select_isa(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    for (size_t i = 0; i < sizeof ISAS / sizeof *ISAS; i++) {
        if (strcmp(ISAS[i]->name, name)) continue;
        if (!ISAS[i]->supported()) {
            PyErr_Format(PyExc_ValueError, "this CPU cannot run the %s kernels", name);
            return NULL;
        }
        K = ISAS[i];
        Py_RETURN_NONE;
    }
    PyErr_Format(PyExc_ValueError, "no kernels for instruction set %R (built: avx512_bf16, avx512_vnni, avx512, avx2_vnni, avx2)",
                 arg);
    return NULL;
}

static PyObject *py_bf16_rows(PyObject *self, PyObject *unused) {
    if (selected()) return NULL;
    return PyBool_FromLong(K->bf16_rows);
}

static PyObject *py_isa(PyObject *self, PyObject *unused) {
    if (!K) Py_RETURN_NONE;
    return PyUnicode_FromString(K->name);
}

static PyMethodDef METHODS[] = {
    {"gemm", (PyCFunction)(void (*)(void))py_gemm, METH_FASTCALL,
     "gemm(x, ldx, w_packed, fmt, y, ldy, M, K, N, accumulate, bias, threads): y (+)= x @ W + bias"},
    {"columns", (PyCFunction)(void (*)(void))py_columns, METH_FASTCALL,
     "columns(w_packed, fmt, K, N, ids, count, out, ldo): out[i] = column ids[i] of W, dequantized"},
    {"reference_gemm", (PyCFunction)(void (*)(void))py_reference_gemm, METH_FASTCALL,
     "reference_gemm(x, ldx, w_packed, fmt, y, ldy, M, K, N, accumulate, bias): gemm's plain-C reference "
     "(reference.c), one thread, whatever build is selected"},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL,
     "rms_norm(x, ldx, weight, out, ldo, M, D, eps)"},
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL,
     "silu_mul(gate_up, ld, M, I, out, ldo): out = silu(gate) * up"},
    {"gelu_tanh_mul", (PyCFunction)(void (*)(void))py_gelu_tanh_mul, METH_FASTCALL,
     "gelu_tanh_mul(gate_up, ld, M, I, out, ldo): out = gelu_tanh(gate) * up"},
    {"rope", (PyCFunction)(void (*)(void))py_rope, METH_FASTCALL,
     "rope(x, ld, N, heads, D, positions, cos, signed_sin): rotary embedding in place"},
    {"decode_attention", (PyCFunction)(void (*)(void))py_decode_attention, METH_FASTCALL,
     "decode_attention(q, k_new, v_new, ldq, k_cache, v_cache, kv_fmt, tables, table_stride, positions, "
     "B, H, KVH, D, page_size, scale, softcap, window, out, ldo, threads, write)"},
    {"decode_step", (PyCFunction)(void (*)(void))py_decode_step, METH_FASTCALL,
     "decode_step(B, hidden, H, KVH, D, I, layers, page_size, kv_fmt, activation, eps, scale, softcap, table, "
     "positions, tables, table_stride, x, h, qkv, attn, gate_up, act, threads, lora_rows, lora_tables, lora_cols, "
     "shared, lora_alone): every layer of a pass, with its rows' LoRA deltas (lora_rows None: none); shared: whether rows "
     "read each other's keys"},
    {"isas", py_isas, METH_NOARGS, "the instruction sets this CPU runs the kernels in, best first"},
    {"select_isa", py_select_isa, METH_O, "select_isa(name): run the kernels built for that instruction set"},
    {"isa", py_isa, METH_NOARGS, "the selected instruction set, or None"},
    {"bf16_rows", py_bf16_rows, METH_NOARGS, "whether the selected build runs BF16_ROWS (AVX-512 BF16's vdpbf16ps)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_cpu_kernels",
                                    "braid's CPU kernels (AVX-512, AVX2) for the decoder", -1, METHODS};

/* A tuple of n C strings. */
static PyObject *names(const char *const *strings, int n) {
    PyObject *tuple = PyTuple_New(n);
    for (int i = 0; tuple && i < n; i++) {
        PyObject *name = PyUnicode_FromString(strings[i]);
        if (!name) Py_CLEAR(tuple);
        else PyTuple_SET_ITEM(tuple, i, name);
    }
    return tuple;
}

/* The Python side checks these against its own when it imports the module (runner/kernels/extension.py). */
PyMODINIT_FUNC PyInit__cpu_kernels(void) {
    PyObject *m = PyModule_Create(&MODULE);
    if (m == NULL) return NULL;
    PyObject *layout = PyTuple_New(F_FORMATS); /* per format, in code order: formats.h's traits */
    for (int f = 0; layout && f < F_FORMATS; f++) {
        const format_t *t = &FORMAT_TRAITS[f];
        PyObject *row = Py_BuildValue("(siilliiiil)", t->name, t->block_rows, STORED_BITS(t->stored), t->block_bytes,
                                      t->head_bytes, t->scale_bytes, t->groups, t->offset, t->min, t->super_bytes);
        if (!row) Py_CLEAR(layout);
        else PyTuple_SET_ITEM(layout, f, row);
    }
    PyObject *fields = names(LAYER_FIELD_NAMES, T_FIELDS), *activations = names(ACTIVATION_NAMES, A_ACTIVATIONS);
    PyObject *lora = names(LORA_FIELD_NAMES, L_FIELDS);
    if (!layout || !fields || !activations || !lora || PyModule_AddObjectRef(m, "LORA_FIELDS", lora) < 0 || PyModule_AddIntConstant(m, "PANEL", PANEL) < 0 ||
        PyModule_AddIntConstant(m, "QBLOCK", QBLOCK) < 0 || PyModule_AddIntConstant(m, "KV_LAYOUT", KV_LAYOUT) < 0 || PyModule_AddIntConstant(m, "INT8", F_INT8) < 0 ||
        PyModule_AddIntConstant(m, "BF16_ROWS", F_BF16_ROWS) < 0 ||
        PyModule_AddIntConstant(m, "PARTS", F_PARTS) < 0 || PyModule_AddIntConstant(m, "U6_LIFT", U6_LIFT) < 0 ||
        PyModule_AddObjectRef(m, "FORMATS", layout) < 0 || PyModule_AddObjectRef(m, "LAYER_FIELDS", fields) < 0 ||
        PyModule_AddObjectRef(m, "ACTIVATIONS", activations) < 0) {
        Py_XDECREF(layout);
        Py_XDECREF(fields);
        Py_XDECREF(activations);
        Py_XDECREF(lora);
        Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(layout);
    Py_DECREF(fields);
    Py_DECREF(activations);
    Py_DECREF(lora);
    return m;
}
