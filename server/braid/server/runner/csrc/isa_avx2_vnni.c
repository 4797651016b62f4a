/* braid's kernels built for AVX2 with AVX-VNNI (Alder Lake, Zen 5): the AVX2 build, its integer dot
 * products one vpdpbusd each (see kernels.h and simd.h). */
#pragma GCC target("avx2,avxvnni,fma,f16c")
#define VEC 8
#define VNNI 1
#define BF16 0
#include "simd.h"
#include "weights.c"
#include "int8.c"
#include "gemm.c"
#include "bf16.c"
#include "elementwise.c"
#include "attention.c"
#include "decode_step.c"

static int supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("fma");
}

const kernels_t AVX2_VNNI_KERNELS = {"avx2_vnni", supported, 0, gemm, rms_norm, silu_mul, gelu_tanh_mul, rope,
                                     decode_attention, decode_step};
