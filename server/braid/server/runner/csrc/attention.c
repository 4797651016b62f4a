/* Decode attention over the paged KV cache. Compiled once per instruction set.
 *
 * The cache of a layer is [pages, KVH, P, D] in kv_fmt (fp32, bf16, f16 or q8_0): page p holds P
 * consecutive positions of one sequence, each KV head's keys contiguous. A sequence's page table
 * (a row of `tables`) lists its pages in position order: position t is at offset t % P of page
 * table[t / P]. Pages are shared between sequences with a common prefix; a decode step only ever
 * writes the position of its new token, in a page its sequence alone holds. The loops below count
 * rows: row (page * KVH + h) * P + i holds position i of KV head h's keys (or values) in that page,
 * kv_row_bytes(kv_fmt, D) bytes. A q8_0 row is llama.cpp's block_q8_0 (-ctk q8_0 -ctv q8_0) per 32
 * of its D values: their fp16 scale d, then 32 int8 q, a value being d * q. */

#define KV_Q8_BLOCK 34 /* bytes of a q8_0 block: fp16 d, 32 int8 */

/* Bytes of one row of D values (one position of one KV head) in kv_fmt. */
static inline long kv_row_bytes(int kv_fmt, long D) {
    return kv_fmt == F_Q8_0 ? D / QBLOCK * KV_Q8_BLOCK : kv_fmt == F_F32 ? D * 4 : D * 2;
}

/* VEC cache values from column `col` (a multiple of VEC) of `row`, widened to fp32: exact for the
 * float formats; q8_0's d * q is one fp32 rounding, as the dequantized reference computes it. */
static inline vf kv_load(const void *cache, int kv_fmt, long row, long D, long col) {
    if (kv_fmt == F_Q8_0) {
        const uint8_t *block = (const uint8_t *)cache + row * kv_row_bytes(F_Q8_0, D) + col / QBLOCK * KV_Q8_BLOCK;
        uint16_t d;
        memcpy(&d, block, sizeof d);
        return vmul(vcvt_i8((const int8_t *)block + 2 + col % QBLOCK), vset1(_cvtsh_ss(d)));
    }
    if (kv_fmt == F_BF16) return vcvt_bf16((const uint16_t *)cache + row * D + col);
    if (kv_fmt == F_F16) return vcvt_f16((const uint16_t *)cache + row * D + col);
    return vload((const float *)cache + row * D + col);
}

/* `row` of a cache in kv_fmt widened to D fp32 values at out: kv_load's values. A q8_0 row's scale is
 * widened once per block of 32, not once per vector as kv_load does: the same d, the same products. */
static inline __attribute__((always_inline)) void widen_row(const void *cache, const int kv_fmt, long row, long D,
                                                            float *out) {
    if (kv_fmt == F_F32) {
        memcpy(out, (const float *)cache + row * D, sizeof(float) * D);
        return;
    }
    if (kv_fmt == F_Q8_0) {
        const uint8_t *block = (const uint8_t *)cache + row * kv_row_bytes(F_Q8_0, D);
        for (long b = 0; b < D / QBLOCK; b++, block += KV_Q8_BLOCK) {
            uint16_t h;
            memcpy(&h, block, sizeof h);
            const vf d = vset1(_cvtsh_ss(h));
            for (long c = 0; c < QBLOCK; c += VEC)
                vstore(out + b * QBLOCK + c, vmul(vcvt_i8((const int8_t *)block + 2 + c), d));
        }
        return;
    }
    for (long j = 0; j < D / VEC; j++) vstore(out + VEC * j, kv_load(cache, kv_fmt, row, D, VEC * j));
}

/* `bytes` of a cache in kv_fmt from the start of `row` (a page's rows of one KV head are
 * consecutive), asked into L1 ahead of their use. */
static inline void prefetch_rows(const void *cache, int kv_fmt, long row, long bytes, long D) {
    const char *at = (const char *)cache + row * kv_row_bytes(kv_fmt, D);
    for (long b = 0; b < bytes; b += 64) _mm_prefetch(at + b, _MM_HINT_T0);
}

/* One row of D values in q8_0 blocks as llama.cpp's quantize_row_q8_0_ref makes them: d = amax / 127
 * rounded to fp16, q = roundf(x / d) by the fp32 reciprocal of the unrounded d (0 where d is 0). */
static inline void kv_store_q8_0(uint8_t *out, const float *x, long D) {
    for (long b = 0; b < D / QBLOCK; b++, x += QBLOCK, out += KV_Q8_BLOCK) {
        float amax = 0.0f;
        for (int i = 0; i < QBLOCK; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const uint16_t h = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
        memcpy(out, &h, sizeof h);
        for (int i = 0; i < QBLOCK; i++) ((int8_t *)out)[2 + i] = (int8_t)roundf(x[i] * id);
    }
}

/* Stores D fp32 values as `row` of a cache in kv_fmt, rounded to nearest even as torch's .to() does
 * (q8_0: as kv_store_q8_0), so a key written here and one written by torch's prefill
 * (runner/kv_cache.py) are the same bits. */
static inline void kv_store(void *cache, int kv_fmt, long row, const float *x, long D) {
    if (kv_fmt == F_Q8_0) {
        kv_store_q8_0((uint8_t *)cache + row * kv_row_bytes(F_Q8_0, D), x, D);
        return;
    }
    if (kv_fmt == F_F32) {
        memcpy((float *)cache + row * D, x, D * sizeof(float));
        return;
    }
    uint16_t *out = (uint16_t *)cache + row * D;
    for (long i = 0; i < D; i++) {
        if (kv_fmt == F_F16) {
            out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
            continue;
        }
        uint32_t u;
        memcpy(&u, &x[i], sizeof u);
        out[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40) /* NaN stays NaN */
                                                 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
    }
}

/* NJ of weigh_rows for NG heads: their NG x NJ sums, NJ values and a weight in registers. AVX2 has
 * 16: at NG 3 or 4, NJ 4 took 19-24, gcc kept two sums on the stack, and each of their multiply-adds
 * waited on a store and a load. 3 x 3 (the embedded model's 3 query heads a KV head) fits. The
 * grouping changes no sum: each output element's runs over the positions in order. */
#define WEIGH_NJ(NG) (VEC == 8 && (NG) > 2 ? ((NG) == 3 ? 3 : 2) : 4)

/* acc[g][j + c] += sum over rows row0 + [i0, i1) of a cache in kv_fmt of sc[g][at + i] V[i][j + c],
 * for NG query heads from g0 and NJ vectors (of VEC) from j: every value vector read once for the NG
 * heads, the NG x NJ sums side by side, each in its own register and over the rows in order, kept
 * in acc (the output row, fp32: exact) between calls. The weighted sums of attention are these calls
 * over the attended positions in order, from acc = 0, then scaled by 1 / the weights' sum: the same
 * sums in the same order whichever rows a call covers (a page of the cache, or a block of fp32 rows).
 * sc: G rows of n_seen weights. NG (1 to 4) and NJ (WEIGH_NJ(NG) or 1) are constants where it is
 * called, so the loops unroll. */
static inline __attribute__((always_inline)) void weigh_rows(const void *cache, const int kv_fmt, long row0, long i0,
                                                             long i1, long D, const float *sc, long n_seen, long at,
                                                             long g0, const int NG, long j, const int NJ, float *acc) {
    vf a[4][4];
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < NJ; c++) a[g][c] = vload(acc + (g0 + g) * D + VEC * (j + c));
    for (long i = i0; i < i1; i++) {
        vf v[4], w[4];
        for (int c = 0; c < NJ; c++) {
            v[c] = kv_load(cache, kv_fmt, row0 + i, D, VEC * (j + c));
            vikeep(v[c]); /* in a register: gcc had read it from memory again for each head */
        }
        for (int g = 0; g < NG; g++) w[g] = vset1(sc[(g0 + g) * n_seen + at + i]);
        for (int g = 0; g < NG; g++)
            for (int c = 0; c < NJ; c++) a[g][c] = vfmadd(w[g], v[c], a[g][c]);
    }
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < NJ; c++) vstore(acc + (g0 + g) * D + VEC * (j + c), a[g][c]);
}

/* weigh_rows for all G heads and all D / VEC vectors of the rows, NG heads and WEIGH_NJ(NG) vectors at
 * a time: while the rows (a page, a block) are in L1. */
static inline __attribute__((always_inline)) void weigh_all(const void *cache, const int kv_fmt, long row0, long i0,
                                                            long i1, long G, long D, const float *sc, long n_seen,
                                                            long at, float *acc) {
    const long chunks = D / VEC;
    for (long g0 = 0; g0 < G; g0 += 4) {
        const long heads = G - g0 < 4 ? G - g0 : 4;
        long j = 0;
        WITH_1_TO_4(heads, NG, for (; j + WEIGH_NJ(NG) <= chunks; j += WEIGH_NJ(NG))
                                   weigh_rows(cache, kv_fmt, row0, i0, i1, D, sc, n_seen, at, g0, NG, j,
                                              WEIGH_NJ(NG), acc));
        if (j + 2 <= chunks) {
            WITH_1_TO_4(heads, NG, weigh_rows(cache, kv_fmt, row0, i0, i1, D, sc, n_seen, at, g0, NG, j, 2, acc));
            j += 2;
        }
        for (; j < chunks; j++)
            WITH_1_TO_4(heads, NG, weigh_rows(cache, kv_fmt, row0, i0, i1, D, sc, n_seen, at, g0, NG, j, 1, acc));
    }
}

/* The G heads' weighted sums (G rows of D at out) times each head's 1 / the sum of its weights. */
static inline void scale_heads(float *out, long G, long D, const float *inv) {
    for (long g = 0; g < G; g++)
        for (long j = 0; j < D / VEC; j++)
            vstore(out + g * D + VEC * j, vmul(vload(out + g * D + VEC * j), vset1(inv[g])));
}

/* The scores of one page's keys at rows row0 + [i, n) against the query qg, times scale, into
 * sc[at + i ...] (at: the page's first position less the first attended). VEC keys at a time, their
 * sums side by side and in one transpose: each key's is the same sum in the same order as one key
 * at a time, without each multiply-add waiting on the last. Inlined per kv_fmt. */
static inline __attribute__((always_inline)) void page_scores(const void *k_cache, const int kv_fmt, long row0, long i,
                                                              long n, long D, const float *qg, float scale, float *sc,
                                                              long at) {
    const long chunks = D / VEC;
    for (; i + VEC <= n; i += VEC) {
        vf dots[VEC];
        for (int r = 0; r < VEC; r++) dots[r] = vzero();
        for (long j = 0; j < chunks; j++) {
            const vf qj = vload(qg + VEC * j);
            for (int r = 0; r < VEC; r++)
                dots[r] = vfmadd(qj, kv_load(k_cache, kv_fmt, row0 + i + r, D, VEC * j), dots[r]);
        }
        vstore(sc + at + i, vmul(vhsum(dots), vset1(scale)));
    }
    for (; i < n; i++) {
        vf dot = vzero();
        for (long j = 0; j < chunks; j++)
            dot = vfmadd(vload(qg + VEC * j), kv_load(k_cache, kv_fmt, row0 + i, D, VEC * j), dot);
        sc[at + i] = vsum(dot) * scale;
    }
}

#if VEC == 8
/* The scores of 4 keys at rows row .. row + 3 against 3 query heads q (D apart), times
 * scale, into sc[g * n_seen ...]: each key's sum page_scores' (its lanes' multiply-adds over the D / VEC
 * chunks in order, then vhsum's tree of the lanes, taken here as vhsum takes lanes 0-3 of its 8),
 * with each key vector loaded once for the 3 heads, not once a head. A key cost a load per
 * multiply-add (9 loads for 8 on a core that does 2 a cycle); here 7 for 12. AVX2 only: its
 * registers fit 3 heads x 4 keys; the AVX-512 builds keep page_scores' 16-key tree. Not for 2 heads:
 * 2 x 4 keys' 8 sums wait on each other's latency, and a 2-head tile (Qwen3's 16 over 8 KV heads)
 * ran 7-12% slower than page_scores. */
static inline __attribute__((always_inline)) void heads_scores4(const void *cache, const int kv_fmt, long row, long D,
                                                                const float *q, float scale, float *sc, long n_seen) {
    enum { NH = 3 };
    vf d[3][4];
    for (int g = 0; g < NH; g++)
        for (int r = 0; r < 4; r++) d[g][r] = vzero();
    for (long j = 0; j < D / VEC; j++) {
        vf qv[3];
        for (int g = 0; g < NH; g++) qv[g] = vload(q + g * D + VEC * j);
        for (int r = 0; r < 4; r++) {
            const vf k = kv_load(cache, kv_fmt, row + r, D, VEC * j);
            for (int g = 0; g < NH; g++) d[g][r] = vfmadd(qv[g], k, d[g][r]);
        }
    }
    for (int g = 0; g < NH; g++) {
        const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(d[g][0], d[g][1]), _mm256_hadd_ps(d[g][2], d[g][3]));
        const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
        _mm_storeu_ps(sc + g * n_seen, _mm_mul_ps(sums, _mm_set1_ps(scale)));
    }
}
#endif

/* page_scores for the G query heads of q (D apart) into sc (n_seen apart): every score the bits
 * page_scores gives it. */
static inline __attribute__((always_inline)) void heads_page_scores(const void *k_cache, const int kv_fmt, long row0,
                                                                    long i, long n, long D, const float *q, long G,
                                                                    float scale, float *sc, long n_seen, long at) {
    long g = 0;
#if VEC == 8
    for (; g + 3 <= G; g += 3) {
        long k = i;
        for (; k + VEC <= n; k += VEC) /* the VEC-key groups page_scores makes, in halves */
            for (long half = k; half < k + VEC; half += 4)
                heads_scores4(k_cache, kv_fmt, row0 + half, D, q + g * D, scale, sc + g * n_seen + at + half, n_seen);
        for (long h = g; h < g + 3; h++) /* the keys after them, one at a time */
            page_scores(k_cache, kv_fmt, row0, k, n, D, q + h * D, scale, sc + h * n_seen, at);
    }
#endif
    for (; g < G; g++) page_scores(k_cache, kv_fmt, row0, i, n, D, q + g * D, scale, sc + g * n_seen, at);
}

/* The n_seen scores sc of one query head (sc[t - lo]: position t's score), soft-capped where softcap > 0,
 * turned into exp(score - the highest) in place; returns 1 / their sum. */
static inline float softmax(float *sc, long n_seen, float softcap) {
    float top = -INFINITY;
    if (softcap > 0.0f) /* Gemma 2: softcap * tanh(score / softcap), as transformers computes it */
        for (long t = 0; t < n_seen; t += VEC) {
            const vmask k = vmask_n(n_seen - t);
            vstore_n(sc + t, vmul(vtanh(vdiv(vloadm(k, sc + t), vset1(softcap))), vset1(softcap)), n_seen - t);
        }
    /* the highest, VEC at a time: max is exact, so the lanes' order changes nothing (vmax keeps its
     * second operand, as the scalar loop keeps top, where a score is NaN) */
    long t = 0;
    vf tops = vset1(-INFINITY);
    for (; t + VEC <= n_seen; t += VEC) tops = vmax(vload(sc + t), tops);
    top = vhmax(tops);
    for (; t < n_seen; t++) top = sc[t] > top ? sc[t] : top;
    vf total = vzero();
    const vf topv = vset1(top);
    /* Whole vectors plain, the tail masked (vstore_n says why): the same lanes in the same order. */
    for (t = 0; t + VEC <= n_seen; t += VEC) {
        const vf e = vexp(vsub(vload(sc + t), topv));
        vstore(sc + t, e);
        total = vadd(total, e);
    }
    if (t < n_seen) {
        const vmask k = vmask_n(n_seen - t);
        /* masked-off lanes load 0, whose exp is not 0: zeroed before they are summed */
        const vf e = vmaskz(k, vexp(vsub(vloadm(k, sc + t), topv)));
        vstorem(k, sc + t, e);
        total = vadd(total, e);
    }
    return 1.0f / vsum(total);
}

/* One (sequence, KV head) task of decode_attention: writes the new key and value at position L - 1
 * (unless `write` is 0: they are in the cache already) and attends the head's G query heads over
 * positions [lo, L). Inlined once per kv_fmt, so the format is a constant in the loops. Position t
 * is row t % P of page table[t / P]; the loops walk a page at a time from lo's page, so no position
 * is divided, score a page's keys for the G heads while it is in cache (heads_page_scores), then
 * weigh a page's values for them the same way. scores: G (L - lo) floats; keys: P D floats (q8_0's
 * dequantized page). */
static inline __attribute__((always_inline)) void attend(const float *q, const float *k_new, const float *v_new,
                                                         void *k_cache, void *v_cache, const int kv_fmt,
                                                         const int write, const int64_t *table, long lo, long L,
                                                         long h, long G, long KVH, long D, long P, float scale, float softcap,
                                                         float *scores, float *keys, float *out) {
    const long n_seen = L - lo;
#define ROWS(page) ((table[page] * KVH + h) * P) /* the row of position 0 of a page, this head */
    if (write) {
        kv_store(k_cache, kv_fmt, ROWS((L - 1) / P) + (L - 1) % P, k_new, D);
        kv_store(v_cache, kv_fmt, ROWS((L - 1) / P) + (L - 1) % P, v_new, D);
    }
    const long first_page = lo / P;
    for (long t0 = first_page * P, page = first_page; t0 < L; t0 += P, page++) {
        const long n = L - t0 < P ? L - t0 : P, i = t0 < lo ? lo - t0 : 0, at = t0 - lo;
        if (kv_fmt == F_Q8_0) { /* the page's keys dequantized once for the G heads, not once per head */
            for (long r = i; r < n; r++) widen_row(k_cache, F_Q8_0, ROWS(page) + r, D, keys + r * D);
            heads_page_scores(keys, F_F32, 0, i, n, D, q, G, scale, scores, n_seen, at);
        } else {
            heads_page_scores(k_cache, kv_fmt, ROWS(page), i, n, D, q, G, scale, scores, n_seen, at);
        }
    }
    float inv[G]; /* per query head, 1 / the sum of its weights */
    for (long g = 0; g < G; g++) inv[g] = softmax(scores + g * n_seen, n_seen, softcap);
    /* the weighted sums, a page at a time (all its columns while it is in L1), summed in out; the
     * next page's values asked for meanwhile: a page's first column group waited on memory for each
     * of its rows, where the old order (one column group over all positions) had kept the hardware
     * prefetcher ahead of it (the keys' pages, asked for the same way, ran 6-23% slower: the
     * prefetcher keeps ahead of their one column group) */
    memset(out, 0, sizeof(float) * G * D);
    const long page_bytes = P * kv_row_bytes(kv_fmt, D);
    for (long t0 = first_page * P, page = first_page; t0 < L; t0 += P, page++) {
        if (t0 + P < L) prefetch_rows(v_cache, kv_fmt, ROWS(page + 1), page_bytes, D);
        weigh_all(v_cache, kv_fmt, ROWS(page), t0 < lo ? lo - t0 : 0, L - t0 < P ? L - t0 : P, G, D, scores, n_seen,
                  t0 - lo, out);
    }
    scale_heads(out, G, D, inv);
#undef ROWS
}

/* CALL(format) with kv_fmt as a constant, one branch per KV-cache format, so that each format's
 * attention loop is compiled with its reads inlined (attend and attend_tile take it as a constant). */
#define BY_KV_FORMAT(kv_fmt, CALL)          \
    do {                                    \
        if ((kv_fmt) == F_Q8_0)             \
            CALL(F_Q8_0);                   \
        else if ((kv_fmt) == F_BF16)        \
            CALL(F_BF16);                   \
        else if ((kv_fmt) == F_F16)         \
            CALL(F_F16);                    \
        else                                \
            CALL(F_F32);                    \
    } while (0)

/* Attention for the decode rows of a pass: each of B sequences has one new token, at position
 * positions[b], with page table tables[b * table_stride ...]. Its key and value (rows of k_new /
 * v_new, KVH heads of D) are written into the cache, and its H query heads (rows of q) attend over
 * positions [0, positions[b]], or in a sliding window (window > 0) over the last `window` of those
 * (positions before it are not read at all). Scores are the dot products times scale; with
 * softcap > 0, then softcap * tanh(score / softcap) (Gemma 2). Grouped-query: the H / KVH query
 * heads of a KV head share one pass over its keys and values. out: B rows (stride ldo) of H x D.
 * One task per (sequence, KV head); a sequence's result does not depend on the others in the
 * pass, nor on which pages it holds. D and P are multiples of 16. attention_task: the task of row b
 * and KV head h; with `write` 0 it attends over keys and values already written (rows of one
 * sequence that read each other's: decode_step.c writes them all first). */
static void attention_task(const float *q, const float *k_new, const float *v_new, long ldq, void *k_cache,
                           void *v_cache, int kv_fmt, int write, const int64_t *tables, long table_stride,
                           const int64_t *positions, long H, long KVH, long D, long P, float scale, float softcap,
                           long window, float *out, long ldo, long b, long h) {
    const long G = H / KVH, L = positions[b] + 1;
    const long lo = window > 0 && L > window ? L - window : 0;
    const int64_t *table = tables + b * table_stride;
    const float *qb = q + b * ldq + h * G * D, *kb = k_new + b * ldq + h * D, *vb = v_new + b * ldq + h * D;
    /* scores, then q8_0's scratch for a dequantized page of keys */
    float *ob = out + b * ldo + h * G * D;
    float *scores = malloc(sizeof(float) * (G * (L - lo) + (kv_fmt == F_Q8_0) * P * D)), *keys = scores + G * (L - lo);
#define ATTEND(FMT) attend(qb, kb, vb, k_cache, v_cache, FMT, write, table, lo, L, h, G, KVH, D, P, scale, softcap, \
                           scores, keys, ob)
    BY_KV_FORMAT(kv_fmt, ATTEND);
#undef ATTEND
    free(scores);
}

/* The first half of attention_task alone: row b's key and value of KV head h, written at its
 * position through its page table. */
static void store_task(const float *k_new, const float *v_new, long ldq, void *k_cache, void *v_cache, int kv_fmt,
                       const int64_t *tables, long table_stride, const int64_t *positions, long KVH, long D, long P,
                       long b, long h) {
    const long t = positions[b], row = (tables[b * table_stride + t / P] * KVH + h) * P + t % P;
    kv_store(k_cache, kv_fmt, row, k_new + b * ldq + h * D, D);
    kv_store(v_cache, kv_fmt, row, v_new + b * ldq + h * D, D);
}

/* Prompt chunks (and a speculating row's proposals) in tiles. A chunk's rows are consecutive
 * positions of one sequence, so they read the same keys and values: by itself, each row re-reads
 * every key and value of its sequence once, and at thousands of positions those come from memory,
 * not cache. A tile of up to TILE_ROWS such rows loads a block of BLOCK_POSITIONS keys once (into
 * fp32 scratch, dequantized once), scores it for every row and query head of the tile while it is
 * in L1, and later weighs a block of values the same way. Each row's numbers are those of
 * attention_task bit for bit: the loops are interchanged, never the sums. A score is page_scores
 * over the row's own [i, n) of each page (the same VEC-key groups), the softmax is the same
 * function over the row's own scores, and each output sum runs over the positions in order, from
 * 0, held in the output row between blocks (fp32 in memory: exact) and scaled by inv at the end. */
#define TILE_ROWS 32
#define BLOCK_POSITIONS 64

/* Cuts rows [0, B) into tiles: runs of up to TILE_ROWS rows, each at the position after the one
 * before and with the same page table over the pages it reads (so every row of a tile reads its
 * pages through the tile's last row's table). Tile i is rows [starts[i], starts[i + 1]); returns
 * the count. starts: room for B + 1. */
static long attention_tiles(const int64_t *tables, long table_stride, const int64_t *positions, long P, long B,
                            long *starts) {
    long n = 0;
    for (long b = 0; b < B; b++) {
        const int joins = b > 0 && b - starts[n - 1] < TILE_ROWS && positions[b] == positions[b - 1] + 1 &&
                          !memcmp(tables + b * table_stride, tables + (b - 1) * table_stride,
                                  sizeof(int64_t) * (positions[b] / P + 1));
        if (!joins) starts[n++] = b;
    }
    starts[n] = B;
    return n;
}

/* Block positions [t0, t1) of KV head h from a cache in kv_fmt, widened to fp32 rows [t1 - t0, D]
 * (exact, and what kv_load gives). */
static inline __attribute__((always_inline)) void load_block(const void *cache, const int kv_fmt,
                                                             const int64_t *table, long t0, long t1, long h,
                                                             long KVH, long D, long P, float *block) {
    for (long t = t0; t < t1; t++)
        widen_row(cache, kv_fmt, (table[t / P] * KVH + h) * P + t % P, D, block + (t - t0) * D);
}

#if VEC == 8
/* The scores of a block of keys for the query vectors of every row of a tile that attends all of it,
 * keys in lanes (AVX2). heads_scores4 and page_scores sum a key's dot product in the lanes of one
 * vector (lane l: the terms at l, l + 8, ... in order), then add the lanes as a tree
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of horizontal adds: at D = 64 a key is 8
 * multiply-adds and 3 horizontal adds a query head, and the Zen 3 ran them at about 45% of its
 * multiply-add peak. Here each lane is a key: partial sum l of 8 keys is one vector, accumulated from
 * 0 over the same terms in the same order, from the block's keys transposed (kt: D rows of its
 * positions), and the tree is 7 vertical adds of those vectors, about 60% of the peak. The same
 * operations on the same values: the same bits. */
#define SCORE_NQ 4 /* query vectors a pass: 4 x 2 ran 1.4x 6 x 2's rate in a loop alone */
#define SCORE_NC 2 /* vectors of 8 keys a pass */

/* Rows [0, 8) of `in` (stride in_stride) transposed into columns of `out` (stride out_stride). */
static inline void transpose8(const float *in, long in_stride, float *out, long out_stride) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(in + i * in_stride);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(out + i * out_stride, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(out + (i + 4) * out_stride, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}

/* Block positions [t0, t1) of KV head h from a cache in kv_fmt, widened to fp32 (load_block's values)
 * and transposed: kt[d * span + i] is position t0 + i's value d; positions up to a multiple of 8 are
 * 0. rows: 8 D floats of scratch. */
static inline __attribute__((always_inline)) void load_block_t(const void *cache, const int kv_fmt,
                                                               const int64_t *table, long t0, long t1, long h,
                                                               long KVH, long D, long P, long span, float *rows,
                                                               float *kt) {
    for (long i = 0; t0 + i < t1; i += 8) {
        const long n = t1 - t0 - i < 8 ? t1 - t0 - i : 8;
        load_block(cache, kv_fmt, table, t0 + i, t0 + i + n, h, KVH, D, P, rows);
        memset(rows + n * D, 0, sizeof(float) * (8 - n) * D);
        for (long c = 0; c < D; c += 8) transpose8(rows + c, D, kt + c * span + i, span);
    }
}

/* sc[q][8 (c0 + c) ...] = scale times the dot products of NQ query vectors q and the 8 keys in lanes
 * of NC vectors from c0 (at most n keys written a row), each lane sum over j in order from 0, then
 * the tree. NQ and NC are constants where it is called, so the loops unroll. */
static inline __attribute__((always_inline)) void score_keys(const float *kt, long span, long n, long D,
                                                             const float *const *q, float *const *sc, float scale,
                                                             const int NQ, long c0, const int NC) {
    vf part[8][SCORE_NQ][SCORE_NC];
    for (int l = 0; l < 8; l++) {
        vf a[SCORE_NQ][SCORE_NC];
        for (int g = 0; g < NQ; g++)
            for (int c = 0; c < NC; c++) a[g][c] = vzero();
        for (long j = 0; j < D / 8; j++) {
            const float *keys = kt + (8 * j + l) * span + 8 * c0;
            vf k[SCORE_NC];
            for (int c = 0; c < NC; c++) {
                k[c] = vload(keys + 8 * c);
                vikeep(k[c]);
            }
            for (int g = 0; g < NQ; g++) {
                const vf b = vset1(q[g][8 * j + l]);
                for (int c = 0; c < NC; c++) a[g][c] = vfmadd(b, k[c], a[g][c]);
            }
        }
        for (int g = 0; g < NQ; g++)
            for (int c = 0; c < NC; c++) part[l][g][c] = a[g][c];
    }
    for (int g = 0; g < NQ; g++)
        for (int c = 0; c < NC; c++) {
            const vf s = vadd(vadd(vadd(part[0][g][c], part[1][g][c]), vadd(part[2][g][c], part[3][g][c])),
                              vadd(vadd(part[4][g][c], part[5][g][c]), vadd(part[6][g][c], part[7][g][c])));
            const long key = 8 * (c0 + c);
            vstore_n(sc[g] + key, vmul(s, vset1(scale)), n - key);
        }
}

/* score_keys for nq query vectors over the n keys of a transposed block, SCORE_NQ and SCORE_NC at a
 * time. A function of its own, for the registers (as weigh_block). */
static __attribute__((noinline)) void score_block(const float *kt, long span, long n, long D, const float *const *q,
                                                  float *const *sc, long nq, float scale) {
    const long vecs = (n + 7) / 8;
    for (long q0 = 0; q0 < nq; q0 += SCORE_NQ) {
        const long m = nq - q0 < SCORE_NQ ? nq - q0 : SCORE_NQ;
        for (long c0 = 0; c0 < vecs; c0 += SCORE_NC) {
            const long nc = vecs - c0 < SCORE_NC ? vecs - c0 : SCORE_NC;
#define SCORE_M(NQ)                                                            \
    do {                                                                       \
        if (nc == 2)                                                           \
            score_keys(kt, span, n, D, q + q0, sc + q0, scale, NQ, c0, 2);     \
        else                                                                   \
            score_keys(kt, span, n, D, q + q0, sc + q0, scale, NQ, c0, 1);     \
    } while (0)
            WITH_1_TO_4(m, NQ, SCORE_M(NQ));
#undef SCORE_M
        }
    }
}

#endif

/* Query vectors (a tile's rows and heads, flattened) weighed together over a block of fp32 values. */
#define WEIGH_NQ 6

/* acc[q][VEC (j + c) ...] += sum over i in [0, n) of w[q][i] block[i][VEC (j + c) ...] for NQ query
 * vectors and NJ (1 or 2) vectors of columns from j: weigh_rows' sums (each over the positions in
 * order, kept in acc between calls: the same bits) for query vectors of any rows of a tile, not the
 * heads of one. 6 x 2 sums against weigh_rows' 4 x 2: a position's 4 cycles of multiply-add latency
 * hide behind its 6 of issue. NQ and NJ are constants where it is called, so the loops unroll. */
static inline __attribute__((always_inline)) void weigh_queries(const float *block, long n, long D,
                                                                const float *const *w, float *const *acc,
                                                                const int NQ, long j, const int NJ) {
    vf a[WEIGH_NQ][2];
    const float *wq[WEIGH_NQ];
    for (int q = 0; q < NQ; q++) {
        wq[q] = w[q];
        for (int c = 0; c < NJ; c++) a[q][c] = vload(acc[q] + VEC * (j + c));
    }
    for (long i = 0; i < n; i++) {
        vf v[2];
        for (int c = 0; c < NJ; c++) {
            v[c] = vload(block + i * D + VEC * (j + c));
            vikeep(v[c]);
        }
        for (int q = 0; q < NQ; q++) {
            const vf wv = vset1(wq[q][i]);
            for (int c = 0; c < NJ; c++) a[q][c] = vfmadd(wv, v[c], a[q][c]);
        }
    }
    for (int q = 0; q < NQ; q++)
        for (int c = 0; c < NJ; c++) vstore(acc[q] + VEC * (j + c), a[q][c]);
}

/* weigh_queries for nq query vectors over the n rows of a block, WEIGH_NQ at a time, every column.
 * A function of its own: inlined into attend_tile, weigh_rows' weight offsets lived on the stack and
 * were loaded again at every position. */
static __attribute__((noinline)) void weigh_block(const float *block, long n, long D, const float *const *w,
                                                  float *const *acc, long nq) {
    for (long q0 = 0; q0 < nq; q0 += WEIGH_NQ) {
        const long k = nq - q0 < WEIGH_NQ ? nq - q0 : WEIGH_NQ;
#define WEIGH_J(NQ)                                                                          \
    do {                                                                                     \
        long j = 0;                                                                          \
        for (; j + 2 <= D / VEC; j += 2) weigh_queries(block, n, D, w + q0, acc + q0, NQ, j, 2); \
        if (j < D / VEC) weigh_queries(block, n, D, w + q0, acc + q0, NQ, j, 1);              \
    } while (0)
        switch (k) {
        case 1: WEIGH_J(1); break;
        case 2: WEIGH_J(2); break;
        case 3: WEIGH_J(3); break;
        case 4: WEIGH_J(4); break;
        case 5: WEIGH_J(5); break;
        default: WEIGH_J(6); break;
        }
#undef WEIGH_J
    }
}

/* One (tile, KV head) task: rows [b0, b0 + R) of a tile (attention_tiles), keys and values in the
 * cache already. scores: G (L - lo) floats per row; block: BLOCK_POSITIONS rounded up to pages, D
 * floats each. Inlined once per kv_fmt. */
static inline __attribute__((always_inline)) void attend_tile(const float *q, long ldq, const void *k_cache,
                                                              const void *v_cache, const int kv_fmt,
                                                              const int64_t *table, const int64_t *positions,
                                                              long b0, long R, long window, long h, long G,
                                                              long KVH, long D, long P, float scale,
                                                              float softcap, float *scores, float *block,
                                                              float *out, long ldo) {
    long L[TILE_ROWS], lo[TILE_ROWS], at[TILE_ROWS]; /* a row's end, window start, scores' offset */
    float inv[TILE_ROWS][G];
    const float *weights[TILE_ROWS * G]; /* a block's query vectors for weigh_block: their weights, */
    float *sums[TILE_ROWS * G];          /* their sums */
#if VEC == 8
    const float *reads[TILE_ROWS * G]; /* and for score_block: the query vectors, */
    float *writes[TILE_ROWS * G];      /* their scores of the block's first position */
#endif
    const long span = (BLOCK_POSITIONS + P - 1) / P * P; /* positions a block */
    for (long r = 0, used = 0; r < R; r++) {
        L[r] = positions[b0 + r] + 1;
        lo[r] = window > 0 && L[r] > window ? L[r] - window : 0;
        at[r] = used;
        used += G * (L[r] - lo[r]);
    }
    /* positions ascend in a tile: the first row's lo is the lowest, the last row's L the highest */
    const long low = window > 0 && positions[b0] + 1 > window ? positions[b0] + 1 - window : 0;
    const long first = low / P * P, end = positions[b0 + R - 1] + 1;
    for (long t0 = first; t0 < end; t0 += span) { /* the scores, a block of keys at a time */
        const long t1 = t0 + span < end ? t0 + span : end, from = t0 > low ? t0 : low;
        char whole[TILE_ROWS] = {0}; /* rows scored with the keys in lanes */
        long nq = 0;
#if VEC == 8
        /* Rows that attend the whole block, each of its keys in a group of VEC in page_scores (not
         * past the row's last whole group of its last page: page_scores sums those keys one at a
         * time, with vsum's tree), keys in lanes (score_block); the rest as before. */
        for (long r = 0; r < R; r++) {
            whole[r] = lo[r] <= t0 && L[r] >= t1 && (L[r] > t1 || (t1 - t0) % VEC == 0);
            for (long g = 0; whole[r] && g < G; g++, nq++) {
                reads[nq] = q + (b0 + r) * ldq + g * D;
                writes[nq] = scores + at[r] + g * (L[r] - lo[r]) + t0 - lo[r];
            }
        }
        if (nq) {
            load_block_t(k_cache, kv_fmt, table, t0, t1, h, KVH, D, P, span, block, block + span * D);
            score_block(block + span * D, span, t1 - t0, D, reads, writes, nq, scale);
        }
#endif
        if (nq == R * G) continue;
        load_block(k_cache, kv_fmt, table, from, t1, h, KVH, D, P, block + (from - t0) * D);
        for (long r = 0; r < R; r++)
            for (long p0 = t0; !whole[r] && p0 < t1 && p0 < L[r]; p0 += P) { /* a page at a time, as attend does */
                if (p0 + P <= lo[r]) continue;
                const long i = p0 < lo[r] ? lo[r] - p0 : 0, n = L[r] - p0 < P ? L[r] - p0 : P, n_seen = L[r] - lo[r];
                heads_page_scores(block, F_F32, p0 - t0, i, n, D, q + (b0 + r) * ldq, G, scale, scores + at[r],
                                  n_seen, p0 - lo[r]);
            }
    }
    for (long r = 0; r < R; r++) {
        const long n_seen = L[r] - lo[r];
        for (long g = 0; g < G; g++) inv[r][g] = softmax(scores + at[r] + g * n_seen, n_seen, softcap);
        memset(out + (b0 + r) * ldo, 0, sizeof(float) * G * D);
    }
    for (long t0 = first; t0 < end; t0 += span) { /* the weighted sums, a block of values at a time */
        const long t1 = t0 + span < end ? t0 + span : end, from = t0 > low ? t0 : low;
        load_block(v_cache, kv_fmt, table, from, t1, h, KVH, D, P, block + (from - t0) * D);
        long nq = 0; /* the query vectors of the rows that attend the whole block, weighed together */
        for (long r = 0; r < R; r++) {
            const long i0 = lo[r] > t0 ? lo[r] - t0 : 0, i1 = (L[r] < t1 ? L[r] : t1) - t0, n_seen = L[r] - lo[r];
            if (i0 >= i1) continue;
            if (i0 > 0 || i1 < t1 - t0) { /* a row that sees part of it (the block of its own position) */
                weigh_all(block, F_F32, 0, i0, i1, G, D, scores + at[r], n_seen, t0 - lo[r], out + (b0 + r) * ldo);
                continue;
            }
            for (long g = 0; g < G; g++, nq++) {
                weights[nq] = scores + at[r] + g * n_seen + t0 - lo[r];
                sums[nq] = out + (b0 + r) * ldo + g * D;
            }
        }
        weigh_block(block, t1 - t0, D, weights, sums, nq);
    }
    for (long r = 0; r < R; r++) scale_heads(out + (b0 + r) * ldo, G, D, inv[r]);
}

/* The task of tile [starts[i], starts[i + 1]) and KV head h, keys and values written already: a
 * tile of one row attends by itself (attention_task), a longer one as above. */
static void tile_task(const float *q, long ldq, const void *k_cache, const void *v_cache, int kv_fmt,
                      const int64_t *tables, long table_stride, const int64_t *positions, const long *starts,
                      long H, long KVH, long D, long P, float scale, float softcap, long window, float *out, long ldo,
                      long i, long h) {
    const long b0 = starts[i], R = starts[i + 1] - b0, G = H / KVH;
    if (R == 1) {
        attention_task(q, q + H * D, q + (H + KVH) * D, ldq, (void *)k_cache, (void *)v_cache, kv_fmt, 0, tables,
                       table_stride, positions, H, KVH, D, P, scale, softcap, window, out, ldo, b0, h);
        return;
    }
    const int64_t *table = tables + (b0 + R - 1) * table_stride; /* the last row's: every row's pages */
    long n_scores = 0;
    for (long r = 0; r < R; r++) {
        const long L = positions[b0 + r] + 1;
        n_scores += G * (window > 0 && L > window ? window : L);
    }
    const long span = (BLOCK_POSITIONS + P - 1) / P * P;
    /* a block of keys or values, and (AVX2) its keys transposed */
    float *scores = malloc(sizeof(float) * (n_scores + (1 + (VEC == 8)) * span * D)), *block = scores + n_scores;
    const float *qh = q + h * G * D;
    float *oh = out + h * G * D;
#define ATTEND(FMT) attend_tile(qh, ldq, k_cache, v_cache, FMT, table, positions, b0, R, window, h, G, KVH, D, P, \
                                scale, softcap, scores, block, oh, ldo)
    BY_KV_FORMAT(kv_fmt, ATTEND);
#undef ATTEND
    free(scores);
}

/* Every task of the pass, the threads sharing them out as they finish; `write` 0: the rows' keys
 * and values are in the cache already (rows of one sequence, which read each other's), and a
 * prompt chunk's rows attend in tiles (attention_tiles), each with the bits it gets alone. */
static void decode_attention(const float *q, const float *k_new, const float *v_new, long ldq, void *k_cache,
                             void *v_cache, int kv_fmt, const int64_t *tables, long table_stride,
                             const int64_t *positions, long B, long H, long KVH, long D, long P, float scale,
                             float softcap, long window, float *out, long ldo, int threads, int write) {
    if (!write) { /* rows of one sequence among them: in tiles */
        long *starts = malloc(sizeof(long) * (B + 1));
        const long tiles = attention_tiles(tables, table_stride, positions, P, B, starts);
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1 && tiles * KVH > 1)
        for (long task = 0; task < tiles * KVH; task++)
            tile_task(q, ldq, k_cache, v_cache, kv_fmt, tables, table_stride, positions, starts, H, KVH, D, P, scale,
                      softcap, window, out, ldo, task / KVH, task % KVH);
        free(starts);
        return;
    }
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1 && B * KVH > 1)
    for (long task = 0; task < B * KVH; task++)
        attention_task(q, k_new, v_new, ldq, k_cache, v_cache, kv_fmt, write, tables, table_stride, positions, H, KVH, D,
                       P, scale, softcap, window, out, ldo, task / KVH, task % KVH);
}
