/* braid's kernels built for AVX-512 (with BW, for the int8 path's byte operations): 16-float
 * vectors, integer dot products by vpmaddubsw + vpmaddwd (see kernels.h and simd.h). */
#pragma GCC target("avx512f,avx512bw,avx2,fma,f16c")
#define VEC 16
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
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma");
}

const kernels_t AVX512_KERNELS = {"avx512", supported, 0, gemm, rms_norm, silu_mul, gelu_tanh_mul, rope,
                                  decode_attention, decode_step};
