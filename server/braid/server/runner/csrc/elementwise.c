/* Row-wise kernels: RMSNorm, the MLP's gated activations, rotary embedding. Compiled once per
 * instruction set. */

/* out[M, D] = x / sqrt(mean(x^2) + eps) * weight, row by row (rows of stride ldx and ldo); with
 * accumulate, out += that instead (a sandwich norm's output joining the residual stream: the same
 * bits as the norm, then the add). out may be x. */
static void rms_norm_to(const float *x, long ldx, const float *weight, float *out, long ldo, long M, long D,
                        float eps, int accumulate) {
    for (long m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        float *o = out + m * ldo;
        vf ss = vzero();
        long d = 0;
        for (; d + VEC <= D; d += VEC) {
            const vf v = vload(xr + d);
            ss = vfmadd(v, v, ss);
        }
        float sum = vsum(ss);
        for (; d < D; d++) sum += xr[d] * xr[d];
        const float inv = 1.0f / sqrtf(sum / (float)D + eps);
        const vf s = vset1(inv);
        for (d = 0; d + VEC <= D; d += VEC) {
            const vf r = vmul(vmul(vload(xr + d), s), vload(weight + d));
            vstore(o + d, accumulate ? vadd(vload(o + d), r) : r);
        }
        for (; d < D; d++) o[d] = accumulate ? o[d] + xr[d] * inv * weight[d] : xr[d] * inv * weight[d];
    }
}

static void rms_norm(const float *x, long ldx, const float *weight, float *out, long ldo, long M, long D,
                     float eps) {
    rms_norm_to(x, ldx, weight, out, ldo, M, D, eps, 0);
}

/* silu(g) = g / (1 + exp(-g)) */
INLINE vf vsilu(vf g) { return vdiv(g, vadd(vset1(1.0f), vexp(vsub(vzero(), g)))); }

/* gelu(g) with the tanh approximation, as torch's: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) */
INLINE vf vgelu_tanh(vf g) {
    const vf inner = vmul(vset1(0.7978845608028654f), vadd(g, vmul(vset1(0.044715f), vmul(vmul(g, g), g))));
    return vmul(vmul(vset1(0.5f), g), vadd(vset1(1.0f), vtanh(inner)));
}

/* out[M, I] = act(gate) * up, where each row of gu (stride ldg) is [gate (I) | up (I)]. Inlined
 * once per activation. */
INLINE void gated(const int activation, const float *gu, long ldg, long M, long I, float *out, long ldo) {
    for (long m = 0; m < M; m++) {
        const float *g = gu + m * ldg, *u = g + I;
        float *o = out + m * ldo;
        for (long i = 0; i < I; i += VEC) {
            const vmask k = vmask_n(I - i);
            const vf gv = vloadm(k, g + i);
            vstore_n(o + i, vmul(activation == A_SILU ? vsilu(gv) : vgelu_tanh(gv), vloadm(k, u + i)), I - i);
        }
    }
}

static void silu_mul(const float *gu, long ldg, long M, long I, float *out, long ldo) {
    gated(A_SILU, gu, ldg, M, I, out, ldo);
}

static void gelu_tanh_mul(const float *gu, long ldg, long M, long I, float *out, long ldo) {
    gated(A_GELU_TANH, gu, ldg, M, I, out, ldo);
}

/* Rotary embedding in place on the first `heads` heads (of D floats) of each of N rows (stride ld):
 * x' = x * cos[pos] + roll(x, D / 2) * signed_sin[pos], the tables [max_seq, D]. */
static void rope(float *x, long ld, long N, long heads, long D, const int64_t *positions, const float *cos_t,
                 const float *sin_t) {
    float tmp[1024];
    const long half = D / 2;
    for (long n = 0; n < N; n++) {
        const float *c = cos_t + positions[n] * D, *s = sin_t + positions[n] * D;
        for (long h = 0; h < heads; h++) {
            float *v = x + n * ld + h * D;
            if (half % VEC == 0) { /* both halves at once, a vector at a time */
                for (long d = 0; d < half; d += VEC) {
                    const vf lo = vload(v + d), hi = vload(v + half + d);
                    vstore(v + d, vfmadd(hi, vload(s + d), vmul(lo, vload(c + d))));
                    vstore(v + half + d, vfmadd(lo, vload(s + half + d), vmul(hi, vload(c + half + d))));
                }
                continue;
            }
            memcpy(tmp, v, D * sizeof(float));
            for (long d = 0; d < half; d++) v[d] = tmp[d] * c[d] + tmp[d + half] * s[d];
            for (long d = half; d < D; d++) v[d] = tmp[d] * c[d] + tmp[d - half] * s[d];
        }
    }
}
