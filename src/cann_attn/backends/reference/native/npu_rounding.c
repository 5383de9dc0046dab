/* The "npu" precision mode's casts (docs/semantics/precision.md): fp32 values rounded once to the float16 or
 * bfloat16 grid, half to even or half away from zero, returned as fp32, in one pass. Bit for bit what
 * problem/precision.py's Cast computes with PyTorch ops (a NaN stays a NaN, its payload not kept).
 *
 * Part of the attention_loops.c translation unit (included there; not compiled alone).
 */

static inline float npu_round_bf16(float x, int away) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return x;
    /* bf16 is fp32's upper half: add half of the dropped range (ties: away, or to the even kept bit), clear it */
    u += away ? 0x8000u : 0x7FFFu + ((u >> 16) & 1u);
    u &= 0xFFFF0000u;
    memcpy(&x, &u, sizeof u);
    return x;
}

static inline float npu_round_fp16(float x, int away) {
    const float a = fabsf(x);
    if (!(a < 65520.0f))  /* NaN, or at least the midpoint past fp16's largest value: inf either way */
        return a != a ? x : copysignf(INFINITY, x);
    float r;
    if (a < 0x1p-14f) {  /* fp16 subnormals: a fixed step of 2^-24 (the scaled value and its half are exact) */
        const float steps = a * 0x1p24f;
        r = (away ? floorf(steps + 0.5f) : nearbyintf(steps)) * 0x1p-24f;
    } else {  /* 13 fraction bits dropped */
        uint32_t u;
        memcpy(&u, &a, sizeof u);
        u += away ? 0x1000u : 0x0FFFu + ((u >> 13) & 1u);
        u &= ~0x1FFFu;
        memcpy(&r, &u, sizeof u);
    }
    return copysignf(r, x);
}

/* out[i] = x[i] rounded to float16 (half = 1) or bfloat16 (half = 0), ties away from zero (away = 1) or to even. */
void npu_round(const float *x, float *out, int64_t n, int64_t half, int64_t away) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i)
        out[i] = half ? npu_round_fp16(x[i], (int)away) : npu_round_bf16(x[i], (int)away);
}
