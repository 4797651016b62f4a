/* Every layer of a decode-only pass in one call. Compiled once per instruction set. */

static int decode_step(const step_t *s) {
    const long B = s->B, hd = s->hidden, qd = s->H * s->D, kvd = s->KVH * s->D, width = qd + 2 * kvd;
    for (long layer = 0; layer < s->layers; layer++) {
        const int64_t *t = s->table + layer * T_FIELDS;
#define P(field) ((float *)(intptr_t)t[field])
#define F(field) ((int)t[field])
        rms_norm(s->x, hd, P(T_INPUT_NORM), s->h, hd, B, hd, s->eps);
        if (gemm(s->h, hd, P(T_QKV), F(T_QKV_FMT), s->qkv, width, B, hd, width, 0, P(T_QKV_BIAS), s->threads))
            return -1;
        rope(s->qkv, width, B, s->H + s->KVH, s->D, s->positions, s->cos_t, s->sin_t);
        decode_attention(s->qkv, s->qkv + qd, s->qkv + qd + kvd, width, P(T_K_CACHE), P(T_V_CACHE), s->kv_fmt,
                         s->tables, s->table_stride, s->positions, B, s->H, s->KVH, s->D, s->page_size,
                         1.0f / sqrtf((float)s->D), 0.0f, 0, s->attn, qd, s->threads);
        if (gemm(s->attn, qd, P(T_O), F(T_O_FMT), s->x, hd, B, qd, hd, 1, NULL, s->threads)) return -1;
        rms_norm(s->x, hd, P(T_POST_NORM), s->h, hd, B, hd, s->eps);
        if (gemm(s->h, hd, P(T_GATE_UP), F(T_GATE_UP_FMT), s->gate_up, 2 * s->I, B, hd, 2 * s->I, 0, NULL,
                 s->threads))
            return -1;
        silu_mul(s->gate_up, 2 * s->I, B, s->I, s->act, s->I);
        if (gemm(s->act, s->I, P(T_DOWN), F(T_DOWN_FMT), s->x, hd, B, s->I, hd, 1, NULL, s->threads)) return -1;
#undef P
#undef F
    }
    return 0;
}
