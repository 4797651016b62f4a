/* braid's kernels built for AVX-512 with VNNI and BF16: the AVX-512 VNNI build, and the bf16 path's
 * vdpbf16ps (bf16.c; see kernels.h and simd.h). */
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx512bf16,avx2,fma,f16c")
#define VEC 16
#define VNNI 1
#define BF16 1
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
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

const kernels_t AVX512_BF16_KERNELS = {"avx512_bf16", supported, 1, gemm, rms_norm, silu_mul, gelu_tanh_mul,
                                       rope, decode_attention, decode_step};
