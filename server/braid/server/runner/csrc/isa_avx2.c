/* braid's kernels built for AVX2 + FMA + F16C: 8-float vectors, for the many CPUs without AVX-512
 * (see kernels.h and simd.h); integer dot products by vpmaddubsw + vpmaddwd. */
#pragma GCC target("avx2,fma,f16c")
#define VEC 8
#define VNNI 0
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
    /* every CPU with AVX2 and FMA has F16C (Haswell, Zen), which __builtin_cpu_supports cannot name */
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

const kernels_t AVX2_KERNELS = {"avx2", supported, 0, gemm, rms_norm, silu_mul, gelu_tanh_mul, rope,
                                decode_attention, decode_step};
