/* Every layer of a decode-only pass in one call. Compiled once per instruction set.
 *
 * The pass runs in one OpenMP parallel region: the threads meet at a barrier only where a stage
 * reads what the one before wrote across the threads: after the q/k/v matmul (a head spans two
 * panels), the attention (the o matmul reads every head), and the o, gate/up and down matmuls (a
 * norm or the gated activation reads a whole row). Each matmul's panels are shared out PANEL_CHUNK at
 * a time (`omp for`, whose end is the barrier); the row-wise work between two matmuls (RMSNorm, the
 * gated activation, quantizing or summing the rows a matmul multiplies: a few microseconds) is done
 * by every thread for every row into its own scratch, which costs less than a barrier. A task of
 * the attention norms and rotates its own heads first. Every value is computed by the same code in
 * the same order as by the kernels one at a time, so the bits are theirs whatever the threads. */

/* A thread's own scratch: the normed rows h [B, hidden], the gated activations act [B, I], what a
 * matmul computes from its rows first (int8 or bf16 rows, or the block sums of fp32 ones), room for
 * the rows' LoRA products x A^T [B, lora_cols], and the LoRA runs: where the rows of each run of one
 * adapter (up to 4) begin [B + 1]. lora_shared: the one thread's lora every thread reads (lora_down);
 * lora_own: this thread's own copy, where lora_down is cheaper done twice than met at a barrier;
 * lora_u: which of the two the up half of the current matmul reads. */
typedef struct {
    float *h, *act, *sums, *lora, *lora_shared, *lora_own, *lora_u;
    long *runs;
    qrows_t q;
    brows_t b;
} scratch_t;

static int alloc_scratch(scratch_t *t, long B, long hidden, long I, long kmax, long lora_cols) {
    t->h = malloc(sizeof(float) * B * hidden);
    t->act = malloc(sizeof(float) * B * I);
    t->sums = malloc(sizeof(float) * B * (kmax / QBLOCK + 1));
    t->lora = malloc(sizeof(float) * B * (lora_cols > 0 ? lora_cols : 1));
    t->lora_own = malloc(sizeof(float) * B * (lora_cols > 0 ? lora_cols : 1));
    t->lora_shared = t->lora_u = NULL;
    t->runs = malloc(sizeof(long) * (B + 1));
    const int failed = alloc_qrows(B, kmax, &t->q) | alloc_brows(B, kmax, &t->b);
    return failed || !t->h || !t->act || !t->sums || !t->lora || !t->lora_own || !t->runs ? -1 : 0;
}

static void free_scratch(scratch_t *t) {
    free(t->h);
    free(t->act);
    free(t->sums);
    free(t->lora);
    free(t->lora_own);
    free(t->runs);
    free_qrows(&t->q);
    free(t->b.x);
}

/* Row b's LoRA fields for a layer's projection group, or NULL where its adapter (if any) does not
 * target that group there. */
static const int64_t *lora_fields(const step_t *s, long b, long layer, int group) {
    if (!s->lora_rows || group < 0 || s->lora_rows[b] < 0) return NULL;
    const int64_t *f = (const int64_t *)(intptr_t)s->lora_tables[s->lora_rows[b]] + (layer * L_GROUPS + group) * L_FIELDS;
    return f[L_AT] ? f : NULL;
}

/* LoRA matrices' element i, widened exactly to fp32, stored in bf16 or fp32 (L_FMT). */
static inline __attribute__((always_inline)) vf lora_load(const void *p, long i, const int bf16) {
    return bf16 ? vcvt_bf16((const uint16_t *)p + i) : vload((const float *)p + i);
}

/* u[r] = x[r] A^T for n rows (1 to 4) that share an adapter, over nv vectors of columns from c0 of
 * A^T [K, cols], its rows lda apart (cols rounded up to 16, zeros past cols: every load is whole);
 * A^T read once for them all, each sum over k in order, in registers. n, nv and bf16 are constants
 * where lora_down calls it, so the loops unroll. */
static inline __attribute__((always_inline)) void down_rows(const float *x, long ldx, long K, const void *at,
                                                            long lda, long cols, long c0, float *u, long ldu,
                                                            const int n, const int nv, const int bf16) {
    vf acc[4][4];
    for (int r = 0; r < n; r++)
        for (int j = 0; j < nv; j++) acc[r][j] = vzero();
    for (long k = 0; k < K; k++) {
        vf w[4];
        for (int j = 0; j < nv; j++) w[j] = lora_load(at, k * lda + c0 + j * VEC, bf16);
        for (int r = 0; r < n; r++) {
            const vf xk = vset1(x[r * ldx + k]);
            for (int j = 0; j < nv; j++) acc[r][j] = vadd(acc[r][j], vmul(xk, w[j]));
        }
    }
    for (int r = 0; r < n; r++)
        for (int j = 0; j < nv; j++) vstore_n(u + r * ldu + c0 + j * VEC, acc[r][j], cols - c0 - j * VEC);
}

/* CALL with NAME 1 where fields f hold bf16 matrices, else 0 (fp32), a constant as above. */
#define WITH_BF16(f, NAME, CALL) do { \
        if ((f)[L_FMT] == F_BF16) { enum { NAME = 1 }; CALL; } \
        else { enum { NAME = 0 }; CALL; } \
    } while (0)

/* The first rows from b (up to 4) that run with the same adapter fields f; 0 where b has none. */
static int same_adapter(const step_t *s, long b, long layer, int group, const int64_t **f) {
    *f = lora_fields(s, b, layer, group);
    if (!*f) return 0;
    int n = 1;
    while (n < 4 && b + n < s->B && lora_fields(s, b + n, layer, group) == *f) n++;
    return n;
}

/* The first half of every row's LoRA delta: lora[b] = x[b] A^T, an item per run of rows of one
 * adapter (up to 4: the runner packs an adapter's rows together, and A^T is read once for them) and
 * block of DOWN_VECS vectors of its columns. Each value is summed by the same code in the same order
 * whichever thread takes its item and however the rows fall into runs: a row's is the same alone, in
 * any pass, on any threads.
 *
 * Where the items hold more than s->lora_alone multiply-adds in all, the threads share them out into
 * one thread's scratch that they all read (published once a pass), and the items' end is a barrier,
 * which the up half needs. Below it, every thread does every item into its own scratch: a few
 * rows' products take a microsecond or two, less than the barrier (and the wait for the slowest
 * thread) they would otherwise cost, four matmuls a layer. (Every thread doing every row at 16 rows
 * over 4 bf16 adapters: its best pass was 0.73x the base's, the shared one's 0.78x, on a loaded
 * machine: docs/benchmarks.md. One row over every projection, the shared one cost 120 barriers a
 * pass of the embedded model.) */
#define DOWN_VECS 2
static inline void down_item(const step_t *s, scratch_t *t, long layer, int group, const float *x, long ldx,
                             long K, long item, long blocks, float *into) {
    const long b = t->runs[item / blocks], c0 = item % blocks * DOWN_VECS * VEC, ldu = s->lora_cols;
    const int64_t *f;
    const int n = same_adapter(s, b, layer, group, &f);
    const long cols = f[L_COLS], lda = (cols + 15) & ~15L, left = (cols - c0 + VEC - 1) / VEC;
    if (c0 >= cols) return;
    const void *at = (const void *)(intptr_t)f[L_AT];
    const float *xb = x + b * ldx;
    float *u = into + b * ldu;
    WITH_BF16(f, BF, WITH_1_TO_4(n, ROWS, WITH_1_TO_4(left < DOWN_VECS ? left : DOWN_VECS, VECS,
                                                      down_rows(xb, ldx, K, at, lda, cols, c0, u, ldu, ROWS, VECS, BF))));
}

static void lora_down(const step_t *s, scratch_t *t, long layer, int group, const float *x, long ldx, long K) {
    long runs = 0, work = 0;
    for (long b = 0; b < s->B;) {
        const int64_t *f;
        const int n = same_adapter(s, b, layer, group, &f);
        if (n) {
            t->runs[runs++] = b;
            work += n * K * f[L_COLS];
        }
        b += n ? n : 1;
    }
    if (!runs) return; /* every thread sees the same: none reaches the barrier */
    const long blocks = (s->lora_cols + DOWN_VECS * VEC - 1) / (DOWN_VECS * VEC);
    if (work <= s->lora_alone) {
        for (long item = 0; item < runs * blocks; item++) down_item(s, t, layer, group, x, ldx, K, item, blocks, t->lora_own);
        t->lora_u = t->lora_own;
        return;
    }
    if (!t->lora_shared) {
        float *shared;
#pragma omp single copyprivate(shared)
        shared = t->lora;
        t->lora_shared = shared;
    }
#pragma omp for schedule(static)
    for (long item = 0; item < runs * blocks; item++) down_item(s, t, layer, group, x, ldx, K, item, blocks, t->lora_shared);
    t->lora_u = t->lora_shared;
}
#undef DOWN_VECS

/* y[r] += u[r] B^T for n rows (1 to 4) that share an adapter, one module's part of a panel: its
 * columns [lo, hi) of the panel's [c0, c0 + 32), B^T's panel bp [rank, 32]; one rank term after
 * another, in registers, each panel row read once for them all. */
static inline __attribute__((always_inline)) void up_rows(const float *u, long ldu, const void *bp, long rank,
                                                          float *y, long ldy, long c0, long lo, long hi,
                                                          const int n, const int bf16) {
    vmask m[NV];
    vf acc[4][NV];
    for (int v = 0; v < NV; v++) m[v] = vmask_n(hi - c0 - v * VEC) & ~vmask_n(lo - c0 - v * VEC);
    for (int r = 0; r < n; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = vloadm(m[v], y + r * ldy + c0 + v * VEC);
    for (long k = 0; k < rank; k++) {
        vf w[NV];
        for (int v = 0; v < NV; v++) w[v] = lora_load(bp, k * PANEL + v * VEC, bf16);
        for (int r = 0; r < n; r++) {
            const vf uk = vset1(u[r * ldu + k]);
            for (int v = 0; v < NV; v++) acc[r][v] = vadd(acc[r][v], vmul(uk, w[v]));
        }
    }
    for (int r = 0; r < n; r++)
        for (int v = 0; v < NV; v++) vstorem(m[v], y + r * ldy + c0 + v * VEC, acc[r][v]);
}

/* The second half, for panel p's output columns (by the thread that computed the panel): y[b] +=
 * lora[b] B^T over each targeted module's columns in it. */
static void lora_up(const step_t *s, const scratch_t *t, long layer, int group, float *y, long ldy, long p,
                    long N) {
    const long c0 = p * PANEL, c1 = c0 + PANEL < N ? c0 + PANEL : N;
    for (long b = 0; b < s->B;) {
        const int64_t *f;
        const int n = same_adapter(s, b, layer, group, &f);
        if (!n) {
            b++;
            continue;
        }
        const long rank = f[L_RANK], ldu = s->lora_cols;
        float *yb = y + b * ldy;
        for (int m = 0; m < 3; m++) {
            const int64_t *part = f + L_B0 + 3 * m; /* B, BEGIN, END */
            const long begin = part[1], lo = c0 > begin ? c0 : begin, hi = c1 < part[2] ? c1 : part[2];
            if (!part[0] || lo >= hi) continue;
            const long offset = (p - begin / PANEL) * rank * PANEL;
            const float *u = t->lora_u + b * ldu + m * rank;
            WITH_BF16(f, BF, WITH_1_TO_4(n, ROWS, up_rows(u, ldu, (const char *)(intptr_t)part[0] + offset * (BF ? 2 : 4),
                                                          rank, yb, ldy, c0, lo, hi, ROWS, BF)));
        }
        b += n;
    }
}
#undef WITH_BF16

/* gemm inside the step's parallel region, called by every thread with the same arguments: each
 * prepares the rows in its scratch, then the threads share out the panels and meet at the end. A
 * panel's thread adds the LoRA deltas of the layer's projection `group` (-1: none) to its columns.
 * Returns 0, or -1 if this thread could not allocate a panel buffer. */
static int team_gemm(const step_t *s, scratch_t *t, long layer, int group, const float *x, long ldx, const void *w,
                     int fmt, float *y, long ldy, long M, long K, long N, int accumulate, const float *bias) {
    /* One matrix is one part; F_PARTS (kernels.h) lists its parts. x is prepared once for each path
     * a part takes, and a panel goes through its part's. */
    const int64_t one[1 + PART_FIELDS] = {1, fmt, N, (int64_t)(intptr_t)w};
    const int64_t *parts = fmt == F_PARTS ? (const int64_t *)w : one;
    int bf16 = 0, int8 = 0, sums = 0, failed = 0;
    for (long i = 0; i < parts[0]; i++) {
        const int code = (int)parts[1 + i * PART_FIELDS + PART_CODE];
        bf16 |= (code & F_BF16_ROWS) != 0, int8 |= (code & F_INT8) != 0;
        sums |= !(code & (F_BF16_ROWS | F_INT8)) && NEEDS_SUMS(code);
    }
    if (s->lora_rows) lora_down(s, t, layer, group, x, ldx, K);
    (void)bf16; /* a build without the bf16 path never has such a part (the bindings refuse it) */
#if BF16
    if (bf16) round_rows_into(x, ldx, M, K, &t->b);
#endif
    if (int8) quantize_rows_into(x, ldx, M, K, &t->q);
    if (sums) block_sums_into(x, ldx, M, K, t->sums);
    const long panels = (N + PANEL - 1) / PANEL;
#pragma omp for schedule(dynamic, PANEL_CHUNK)
    for (long p = 0; p < panels; p++) {
        const int64_t *part = parts + 1;
        long col = 0; /* the part's first column */
        while (p * PANEL >= col + part[PART_COLUMNS]) col += part[PART_COLUMNS], part += PART_FIELDS;
        const int code = (int)part[PART_CODE];
        const void *pw = (const void *)(intptr_t)part[PART_WEIGHT];
        const long pn = part[PART_COLUMNS], pp = p - col / PANEL;
        float *py = y + col;
        const float *pb = bias ? bias + col : NULL;
#if BF16
        if (code & F_BF16_ROWS)
            bf16_panel(&t->b, pw, py, ldy, M, K, pn, accumulate, pb, pp);
        else
#endif
        if (code & F_INT8)
            int8_panel(&t->q, pw, code & ~F_INT8, py, ldy, M, K, pn, accumulate, pb, pp);
        else
            failed |= gemm_panel(x, ldx, pw, code, py, ldy, M, K, pn, accumulate, pb, NEEDS_SUMS(code) ? t->sums : NULL,
                                 pp);
        if (s->lora_rows) lora_up(s, t, layer, group, y, ldy, p, N);
    }
    return failed;
}

/* x += in @ W: an attention's or an MLP's output joining the residual stream x [B, hidden], through
 * its RMSNorm (out_norm; a sandwich norm, Gemma) if it has one, computed in the shared h. */
static int add_output(const step_t *s, scratch_t *t, long layer, int group, const float *in, long K, const float *w,
                      int fmt, const float *out_norm) {
    const long B = s->B, hd = s->hidden;
    if (!out_norm) return team_gemm(s, t, layer, group, in, K, w, fmt, s->x, hd, B, K, hd, 1, NULL);
    const int failed = team_gemm(s, t, layer, group, in, K, w, fmt, s->h, hd, B, K, hd, 0, NULL);
#pragma omp for schedule(static)
    for (long b = 0; b < B; b++) rms_norm_to(s->h + b * hd, hd, out_norm, s->x + b * hd, hd, 1, hd, s->eps, 1);
    return failed;
}

/* The layer's attention, one task per (row, KV head) shared out as the threads finish: the task's G
 * query heads and its key head get their RMSNorms (Qwen3, Gemma 3) and RoPE, then attend. Where rows
 * read each other's keys (s->shared: a prompt chunk's rows, or a speculating row's proposals), every
 * key and value is written first, and the threads meet before any row attends, one task per (tile of
 * the tiles decode_step cut, KV head): a row's numbers are the same either way, and the same as a
 * decode step's at that position. */
static void team_attention(const step_t *s, const int64_t *t, const long *starts, long tiles) {
    const long D = s->D, KVH = s->KVH, G = s->H / KVH, qd = s->H * D, kvd = KVH * D, width = qd + 2 * kvd;
    const float *q_norm = (const float *)(intptr_t)t[T_Q_NORM], *k_norm = (const float *)(intptr_t)t[T_K_NORM];
    const float *cos_t = (const float *)(intptr_t)t[T_COS], *sin_t = (const float *)(intptr_t)t[T_SIN];
    float *k_new = s->qkv + qd, *v_new = s->qkv + qd + kvd;
    void *k_cache = (void *)(intptr_t)t[T_K_CACHE], *v_cache = (void *)(intptr_t)t[T_V_CACHE];
#pragma omp for schedule(dynamic)
    for (long task = 0; task < s->B * KVH; task++) {
        const long b = task / KVH, h = task % KVH;
        float *q = s->qkv + b * width + h * G * D, *k = s->qkv + b * width + qd + h * D;
        if (q_norm) rms_norm(q, D, q_norm, q, D, G, D, s->eps);
        if (k_norm) rms_norm(k, D, k_norm, k, D, 1, D, s->eps);
        rope(q, D, 1, G, D, s->positions + b, cos_t, sin_t);
        rope(k, D, 1, 1, D, s->positions + b, cos_t, sin_t);
        if (s->shared)
            store_task(k_new, v_new, width, k_cache, v_cache, s->kv_fmt, s->tables, s->table_stride, s->positions,
                       KVH, D, s->page_size, b, h);
        else
            attention_task(s->qkv, k_new, v_new, width, k_cache, v_cache, s->kv_fmt, 1, s->tables,
                           s->table_stride, s->positions, s->H, KVH, D, s->page_size, s->scale, s->softcap,
                           t[T_WINDOW], s->attn, qd, b, h);
    }
    if (!s->shared) return;
    /* the end of the loop above is the barrier: every key of the pass is in the cache; a prompt
     * chunk's rows attend in tiles (attention.c) */
#pragma omp for schedule(dynamic)
    for (long task = 0; task < tiles * KVH; task++)
        tile_task(s->qkv, width, k_cache, v_cache, s->kv_fmt, s->tables, s->table_stride, s->positions, starts, s->H,
                  KVH, D, s->page_size, s->scale, s->softcap, t[T_WINDOW], s->attn, qd, task / KVH, task % KVH);
}

/* One thread's part of the pass. Returns 0, or -1 if it could not allocate a panel buffer. */
static int run_layers(const step_t *s, scratch_t *t, const long *starts, long tiles) {
    const long B = s->B, hd = s->hidden, I = s->I, qd = s->H * s->D, width = qd + 2 * s->KVH * s->D;
    int failed = 0;
    for (long layer = 0; layer < s->layers; layer++) {
        const int64_t *row = s->table + layer * T_FIELDS;
#define P(field) ((float *)(intptr_t)row[field])
#define F(field) ((int)row[field])
        rms_norm(s->x, hd, P(T_INPUT_NORM), t->h, hd, B, hd, s->eps);
        failed |= team_gemm(s, t, layer, L_QKV, t->h, hd, P(T_QKV), F(T_QKV_FMT), s->qkv, width, B, hd, width, 0, P(T_QKV_BIAS));
        team_attention(s, row, starts, tiles);
        failed |= add_output(s, t, layer, L_O, s->attn, qd, P(T_O), F(T_O_FMT), P(T_ATTN_OUT_NORM));
        rms_norm(s->x, hd, P(T_POST_NORM), t->h, hd, B, hd, s->eps);
        failed |= team_gemm(s, t, layer, L_GATE_UP, t->h, hd, P(T_GATE_UP), F(T_GATE_UP_FMT), s->gate_up, 2 * I, B, hd, 2 * I, 0, NULL);
        if (s->activation == A_GELU_TANH)
            gelu_tanh_mul(s->gate_up, 2 * I, B, I, t->act, I);
        else
            silu_mul(s->gate_up, 2 * I, B, I, t->act, I);
        failed |= add_output(s, t, layer, L_DOWN, t->act, I, P(T_DOWN), F(T_DOWN_FMT), P(T_MLP_OUT_NORM));
#undef P
#undef F
    }
    return failed;
}

static int decode_step(const step_t *s) {
    const long qd = s->H * s->D, most = s->hidden > s->I ? s->hidden : s->I, kmax = most > qd ? most : qd;
    int no_scratch = 0, failed = 0;
    /* where rows read each other's keys, the attention's tiles (attention.c), once for the pass */
    long *starts = s->shared ? malloc(sizeof(long) * (s->B + 1)) : NULL;
    if (s->shared && !starts) return -1;
    const long tiles = s->shared ? attention_tiles(s->tables, s->table_stride, s->positions, s->page_size, s->B, starts) : 0;
#pragma omp parallel num_threads(s->threads) if (s->threads > 1)
    {
        scratch_t t;
        if (alloc_scratch(&t, s->B, s->hidden, s->I, kmax, s->lora_cols)) {
#pragma omp atomic write
            no_scratch = 1;
        }
#pragma omp barrier
        int none; /* every thread runs the layers or none does: the barriers need them all */
#pragma omp atomic read
        none = no_scratch;
        if (!none && run_layers(s, &t, starts, tiles)) {
#pragma omp atomic write
            failed = 1;
        }
        free_scratch(&t);
    }
    free(starts);
    return failed || no_scratch ? -1 : 0;
}
