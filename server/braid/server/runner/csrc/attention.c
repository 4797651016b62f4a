/* Decode attention over the slot KV cache. Compiled once per instruction set. */

/* Attention for the decode rows of a pass: each of B sequences has one new token, at position
 * positions[b] of cache slot slots[b]. Its key and value (rows of k_new / v_new, KVH heads of D)
 * are written into the cache, [slots, KVH, max_seq, D], and its H query heads (rows of q) attend
 * over positions [0, positions[b]] of the slot. Grouped-query: the H / KVH query heads of a KV head
 * share one pass over its keys and values. out: B rows (stride ldo) of H x D. One task per
 * (sequence, KV head); a sequence's result does not depend on the others in the pass.
 * D is a multiple of 16. */
static void decode_attention(const float *q, const float *k_new, const float *v_new, long ldq, float *k_cache,
                             float *v_cache, const int64_t *slots, const int64_t *positions, long B, long H,
                             long KVH, long D, long max_seq, float scale, float *out, long ldo, int threads) {
    const long G = H / KVH, chunks = D / VEC;
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1 && B * KVH > 1)
    for (long task = 0; task < B * KVH; task++) {
        const long b = task / KVH, h = task % KVH, L = positions[b] + 1;
        float *keys = k_cache + (slots[b] * KVH + h) * max_seq * D;
        float *values = v_cache + (slots[b] * KVH + h) * max_seq * D;
        memcpy(keys + (L - 1) * D, k_new + b * ldq + h * D, D * sizeof(float));
        memcpy(values + (L - 1) * D, v_new + b * ldq + h * D, D * sizeof(float));
        float *scores = malloc(sizeof(float) * G * L);
        for (long g = 0; g < G; g++) {
            const float *qg = q + b * ldq + (h * G + g) * D;
            float *sc = scores + g * L, top = -INFINITY;
            long t = 0;
            for (; t + VEC <= L; t += VEC) { /* VEC keys at a time, their sums in one transpose */
                vf dots[VEC];
                for (int i = 0; i < VEC; i++) {
                    dots[i] = vzero();
                    for (long j = 0; j < chunks; j++)
                        dots[i] = vfmadd(vload(qg + VEC * j), vload(keys + (t + i) * D + VEC * j), dots[i]);
                }
                vstore(sc + t, vmul(vhsum(dots), vset1(scale)));
            }
            for (; t < L; t++) {
                vf dot = vzero();
                for (long j = 0; j < chunks; j++) dot = vfmadd(vload(qg + VEC * j), vload(keys + t * D + VEC * j), dot);
                sc[t] = vsum(dot) * scale;
            }
            for (t = 0; t < L; t++) top = sc[t] > top ? sc[t] : top;
            vf total = vzero();
            const vf topv = vset1(top);
            for (long t = 0; t < L; t += VEC) {
                const vmask k = vmask_n(L - t);
                /* masked-off lanes load 0, whose exp is not 0: zeroed before they are summed */
                const vf e = vmaskz(k, vexp(vsub(vloadm(k, sc + t), topv)));
                vstorem(k, sc + t, e);
                total = vadd(total, e);
            }
            const vf inv = vset1(1.0f / vsum(total));
            float *o = out + b * ldo + (h * G + g) * D;
            for (long j = 0; j < chunks; j++) {
                vf acc = vzero();
                for (long t = 0; t < L; t++) acc = vfmadd(vset1(sc[t]), vload(values + t * D + VEC * j), acc);
                vstore(o + VEC * j, vmul(acc, inv));
            }
        }
        free(scores);
    }
}
