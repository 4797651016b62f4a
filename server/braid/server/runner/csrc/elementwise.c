/* Row-wise kernels: RMSNorm, SwiGLU, rotary embedding. Compiled once per instruction set. */

/* out[M, D] = x / sqrt(mean(x^2) + eps) * weight, row by row (rows of stride ldx and ldo). */
static void rms_norm(const float *x, long ldx, const float *weight, float *out, long ldo, long M, long D,
                     float eps) {
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
        for (d = 0; d + VEC <= D; d += VEC) vstore(o + d, vmul(vmul(vload(xr + d), s), vload(weight + d)));
        for (; d < D; d++) o[d] = xr[d] * inv * weight[d];
    }
}

/* out[M, I] = silu(gate) * up, where each row of gu (stride ldg) is [gate (I) | up (I)]. */
static void silu_mul(const float *gu, long ldg, long M, long I, float *out, long ldo) {
    const vf one = vset1(1.0f);
    for (long m = 0; m < M; m++) {
        const float *g = gu + m * ldg, *u = g + I;
        float *o = out + m * ldo;
        for (long i = 0; i < I; i += VEC) {
            const vmask k = vmask_n(I - i);
            const vf gv = vloadm(k, g + i);
            const vf silu = vdiv(gv, vadd(one, vexp(vsub(vzero(), gv))));
            vstorem(k, o + i, vmul(silu, vloadm(k, u + i)));
        }
    }
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
