/* braid's kernels built for AVX-512: 16-float vectors (see kernels.h and simd.h). */
#pragma GCC target("avx512f,avx2,fma,f16c")
#define VEC 16
#include "simd.h"
#include "weights.c"
#include "gemm.c"
#include "elementwise.c"
#include "attention.c"
#include "decode_step.c"

static int supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

const kernels_t AVX512_KERNELS = {"avx512", supported, gemm, columns, rms_norm, silu_mul, gelu_tanh_mul, rope,
                                  decode_attention, decode_step};
