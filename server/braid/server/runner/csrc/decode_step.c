/* Every layer of a decode-only pass in one call. Compiled once per instruction set.
 *
 * The pass runs in one OpenMP parallel region: the threads meet at a barrier only where a stage
 * reads what the one before wrote across the threads: after the q/k/v matmul (a head spans two
 * panels), the attention (the o matmul reads every head), and the o, gate/up and down matmuls (a
 * norm or the gated activation reads a whole row). Each matmul's panels are shared out statically
 * (`omp for`, whose end is the barrier); the row-wise work between two matmuls (RMSNorm, the
 * gated activation, quantizing or summing the rows a matmul multiplies: a few microseconds) is done
 * by every thread for every row into its own scratch, which costs less than a barrier. A task of
 * the attention norms and rotates its own heads first. Every value is computed by the same code in
 * the same order as by the kernels one at a time, so the bits are theirs whatever the threads. */

/* A thread's own scratch: the normed rows h [B, hidden], the gated activations act [B, I], and what
 * a matmul computes from its rows first (int8 or bf16 rows, or the block sums of fp32 ones). */
typedef struct {
    float *h, *act, *sums;
    qrows_t q;
    brows_t b;
} scratch_t;

static int alloc_scratch(scratch_t *t, long B, long hidden, long I, long kmax) {
    t->h = malloc(sizeof(float) * B * hidden);
    t->act = malloc(sizeof(float) * B * I);
    t->sums = malloc(sizeof(float) * B * (kmax / QBLOCK + 1));
    const int failed = alloc_qrows(B, kmax, &t->q) | alloc_brows(B, kmax, &t->b);
    return failed || !t->h || !t->act || !t->sums ? -1 : 0;
}

static void free_scratch(scratch_t *t) {
    free(t->h);
    free(t->act);
    free(t->sums);
    free_qrows(&t->q);
    free(t->b.x);
}

/* gemm inside the step's parallel region, called by every thread with the same arguments: each
 * prepares the rows in its scratch, then the threads share out the panels and meet at the end.
 * Returns 0, or -1 if this thread could not allocate a panel buffer. */
static int team_gemm(scratch_t *t, const float *x, long ldx, const void *w, int fmt, float *y, long ldy, long M,
                     long K, long N, int accumulate, const float *bias) {
    const long panels = (N + PANEL - 1) / PANEL;
    int failed = 0;
#if BF16
    if (fmt & F_BF16_ROWS) {
        round_rows_into(x, ldx, M, K, &t->b);
#pragma omp for schedule(static)
        for (long p = 0; p < panels; p++) bf16_panel(&t->b, w, y, ldy, M, K, N, accumulate, bias, p);
        return 0;
    }
#endif
    if (fmt & F_INT8) {
        quantize_rows_into(x, ldx, M, K, &t->q);
#pragma omp for schedule(static)
        for (long p = 0; p < panels; p++) int8_panel(&t->q, w, fmt & ~F_INT8, y, ldy, M, K, N, accumulate, bias, p);
        return 0;
    }
    if (NEEDS_SUMS(fmt)) block_sums_into(x, ldx, M, K, t->sums);
    const float *sums = NEEDS_SUMS(fmt) ? t->sums : NULL;
#pragma omp for schedule(static)
    for (long p = 0; p < panels; p++) failed |= gemm_panel(x, ldx, w, fmt, y, ldy, M, K, N, accumulate, bias, sums, p);
    return failed;
}

/* x += in @ W: an attention's or an MLP's output joining the residual stream x [B, hidden], through
 * its RMSNorm (out_norm; a sandwich norm, Gemma) if it has one, computed in the shared h. */
static int add_output(const step_t *s, scratch_t *t, const float *in, long K, const float *w, int fmt,
                      const float *out_norm) {
    const long B = s->B, hd = s->hidden;
    if (!out_norm) return team_gemm(t, in, K, w, fmt, s->x, hd, B, K, hd, 1, NULL);
    const int failed = team_gemm(t, in, K, w, fmt, s->h, hd, B, K, hd, 0, NULL);
#pragma omp for schedule(static)
    for (long b = 0; b < B; b++) rms_norm_to(s->h + b * hd, hd, out_norm, s->x + b * hd, hd, 1, hd, s->eps, 1);
    return failed;
}

/* The layer's attention, one task per (sequence, KV head) shared out as the threads finish: the
 * task's G query heads and its key head get their RMSNorms (Qwen3, Gemma 3) and RoPE, then attend. */
static void team_attention(const step_t *s, const int64_t *t) {
    const long D = s->D, KVH = s->KVH, G = s->H / KVH, qd = s->H * D, kvd = KVH * D, width = qd + 2 * kvd;
    const float *q_norm = (const float *)(intptr_t)t[T_Q_NORM], *k_norm = (const float *)(intptr_t)t[T_K_NORM];
    const float *cos_t = (const float *)(intptr_t)t[T_COS], *sin_t = (const float *)(intptr_t)t[T_SIN];
#pragma omp for schedule(dynamic)
    for (long task = 0; task < s->B * KVH; task++) {
        const long b = task / KVH, h = task % KVH;
        float *q = s->qkv + b * width + h * G * D, *k = s->qkv + b * width + qd + h * D;
        if (q_norm) rms_norm(q, D, q_norm, q, D, G, D, s->eps);
        if (k_norm) rms_norm(k, D, k_norm, k, D, 1, D, s->eps);
        rope(q, D, 1, G, D, s->positions + b, cos_t, sin_t);
        rope(k, D, 1, 1, D, s->positions + b, cos_t, sin_t);
        attention_task(s->qkv, s->qkv + qd, s->qkv + qd + kvd, width, (void *)(intptr_t)t[T_K_CACHE],
                       (void *)(intptr_t)t[T_V_CACHE], s->kv_fmt, s->tables, s->table_stride, s->positions, s->H,
                       KVH, D, s->page_size, s->scale, s->softcap, t[T_WINDOW], s->attn, qd, task);
    }
}

/* One thread's part of the pass. Returns 0, or -1 if it could not allocate a panel buffer. */
static int run_layers(const step_t *s, scratch_t *t) {
    const long B = s->B, hd = s->hidden, I = s->I, qd = s->H * s->D, width = qd + 2 * s->KVH * s->D;
    int failed = 0;
    for (long layer = 0; layer < s->layers; layer++) {
        const int64_t *row = s->table + layer * T_FIELDS;
#define P(field) ((float *)(intptr_t)row[field])
#define F(field) ((int)row[field])
        rms_norm(s->x, hd, P(T_INPUT_NORM), t->h, hd, B, hd, s->eps);
        failed |= team_gemm(t, t->h, hd, P(T_QKV), F(T_QKV_FMT), s->qkv, width, B, hd, width, 0, P(T_QKV_BIAS));
        team_attention(s, row);
        failed |= add_output(s, t, s->attn, qd, P(T_O), F(T_O_FMT), P(T_ATTN_OUT_NORM));
        rms_norm(s->x, hd, P(T_POST_NORM), t->h, hd, B, hd, s->eps);
        failed |= team_gemm(t, t->h, hd, P(T_GATE_UP), F(T_GATE_UP_FMT), s->gate_up, 2 * I, B, hd, 2 * I, 0, NULL);
        if (s->activation == A_GELU_TANH)
            gelu_tanh_mul(s->gate_up, 2 * I, B, I, t->act, I);
        else
            silu_mul(s->gate_up, 2 * I, B, I, t->act, I);
        failed |= add_output(s, t, t->act, I, P(T_DOWN), F(T_DOWN_FMT), P(T_MLP_OUT_NORM));
#undef P
#undef F
    }
    return failed;
}

static int decode_step(const step_t *s) {
    const long qd = s->H * s->D, most = s->hidden > s->I ? s->hidden : s->I, kmax = most > qd ? most : qd;
    int no_scratch = 0, failed = 0;
#pragma omp parallel num_threads(s->threads) if (s->threads > 1)
    {
        scratch_t t;
        if (alloc_scratch(&t, s->B, s->hidden, s->I, kmax)) {
#pragma omp atomic write
            no_scratch = 1;
        }
#pragma omp barrier
        int none; /* every thread runs the layers or none does: the barriers need them all */
#pragma omp atomic read
        none = no_scratch;
        if (!none && run_layers(s, &t)) {
#pragma omp atomic write
            failed = 1;
        }
        free_scratch(&t);
    }
    return failed || no_scratch ? -1 : 0;
}
