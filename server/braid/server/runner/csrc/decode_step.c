/* Every layer of a decode-only pass in one call. Compiled once per instruction set. */

/* x += in @ W: an attention's or an MLP's output joining the residual stream x [B, hidden], through
 * its RMSNorm (out_norm; a sandwich norm, Gemma) if it has one, computed in h [B, hidden]. */
static int add_output(const step_t *s, const float *in, long K, const float *w, int fmt, const float *out_norm) {
    const long B = s->B, hd = s->hidden;
    if (!out_norm) return gemm(in, K, w, fmt, s->x, hd, B, K, hd, 1, NULL, s->threads);
    if (gemm(in, K, w, fmt, s->h, hd, B, K, hd, 0, NULL, s->threads)) return -1;
    rms_norm_to(s->h, hd, out_norm, s->x, hd, B, hd, s->eps, 1);
    return 0;
}

/* RMSNorm over each of `heads` heads (of D) in each of the B rows of qkv, in place: weight [D], or none. */
static void head_norms(const step_t *s, float *heads_at, long heads, const float *weight) {
    const long width = (s->H + 2 * s->KVH) * s->D;
    for (long b = 0; weight && b < s->B; b++)
        rms_norm(heads_at + b * width, s->D, weight, heads_at + b * width, s->D, heads, s->D, s->eps);
}

static int decode_step(const step_t *s) {
    const long B = s->B, hd = s->hidden, D = s->D, qd = s->H * D, kvd = s->KVH * D, width = qd + 2 * kvd;
    for (long layer = 0; layer < s->layers; layer++) {
        const int64_t *t = s->table + layer * T_FIELDS;
#define P(field) ((float *)(intptr_t)t[field])
#define F(field) ((int)t[field])
        rms_norm(s->x, hd, P(T_INPUT_NORM), s->h, hd, B, hd, s->eps);
        if (gemm(s->h, hd, P(T_QKV), F(T_QKV_FMT), s->qkv, width, B, hd, width, 0, P(T_QKV_BIAS), s->threads))
            return -1;
        head_norms(s, s->qkv, s->H, P(T_Q_NORM));
        head_norms(s, s->qkv + qd, s->KVH, P(T_K_NORM));
        rope(s->qkv, width, B, s->H + s->KVH, D, s->positions, P(T_COS), P(T_SIN));
        decode_attention(s->qkv, s->qkv + qd, s->qkv + qd + kvd, width, P(T_K_CACHE), P(T_V_CACHE), s->kv_fmt,
                         s->tables, s->table_stride, s->positions, B, s->H, s->KVH, D, s->page_size, s->scale,
                         s->softcap, t[T_WINDOW], s->attn, qd, s->threads);
        if (add_output(s, s->attn, qd, P(T_O), F(T_O_FMT), P(T_ATTN_OUT_NORM))) return -1;
        rms_norm(s->x, hd, P(T_POST_NORM), s->h, hd, B, hd, s->eps);
        if (gemm(s->h, hd, P(T_GATE_UP), F(T_GATE_UP_FMT), s->gate_up, 2 * s->I, B, hd, 2 * s->I, 0, NULL,
                 s->threads))
            return -1;
        if (s->activation == A_GELU_TANH)
            gelu_tanh_mul(s->gate_up, 2 * s->I, B, s->I, s->act, s->I);
        else
            silu_mul(s->gate_up, 2 * s->I, B, s->I, s->act, s->I);
        if (add_output(s, s->act, s->I, P(T_DOWN), F(T_DOWN_FMT), P(T_MLP_OUT_NORM))) return -1;
#undef P
#undef F
    }
    return 0;
}
