/* The residual add and RMSNorm that open each half of a decoder layer, fused into one pass
 * over each row, for CPUs (tinyserve.kernels' Triton kernel does the same on a GPU):
 *   h = x + residual; out = weight * (h * rsqrt(mean(h^2) + eps))
 * Eager torch runs it as a chain of 7 ops, each a call with its own fixed cost and a whole
 * tensor written and read back; in a decode step those fixed costs are most of its time.
 * fp32 or bf16 tensors, arithmetic in fp32; a bf16 value is rounded wherever torch's chain
 * holds a bf16 tensor (after the add, before and after the weight), so the results differ
 * from torch's only by the order of the sum of squares. Built at first use by native.py. */
#include <math.h>

#include "simd.h"

typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

/* Elements per call from which the rows are split across threads: below it a thread's
 * start costs more than it saves (a decode row of Qwen2.5-0.5B is 896). */
#define PARALLEL_FROM 32768

static inline f8 load(const void *p, int bf16, long i) {
    return bf16 ? load_bf16((const uint16_t *)p + i) : load_f32((const float *)p + i);
}

static inline float load1(const void *p, int bf16, long i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* What a bf16 tensor would hold: rounded to nearest, ties to even (f32_to_bf16, 8 lanes). */
static inline f8 round_bf16(f8 v) {
    u32x8 u;
    memcpy(&u, &v, sizeof u);
    u32x8 r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    i32x8 nan = v != v;
    r = (u32x8)(((i32x8)r & ~nan) | (0x7fc00000 & nan));
    memcpy(&v, &r, sizeof v);
    return v;
}

static inline float round1(float v) { return bf16_to_f32(f32_to_bf16(v)); }

/* Store 8 values (already rounded where bf16: the upper halves are the bf16 numbers). */
static inline void store(void *p, int bf16, long i, f8 v) {
    if (!bf16) {
        memcpy((float *)p + i, &v, sizeof v);
        return;
    }
    u32x8 u;
    memcpy(&u, &v, sizeof u);
    u16x8 h = __builtin_convertvector(u >> 16, u16x8);
    memcpy((uint16_t *)p + i, &h, sizeof h);
}

static inline void store1(void *p, int bf16, long i, float v) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

static void add_rmsnorm_row(const void *x, const void *res, const void *w, void *out, void *h,
                            int bf16, long n, float eps, long o) {
    f8 squares = {0};
    long d = 0;
    for (; d + 8 <= n; d += 8) {
        f8 v = load(x, bf16, o + d) + load(res, bf16, o + d);
        if (bf16) v = round_bf16(v);
        store(h, bf16, o + d, v);
        squares += v * v;
    }
    float sum = sum8(squares);
    for (; d < n; d++) {
        float v = load1(x, bf16, o + d) + load1(res, bf16, o + d);
        if (bf16) v = round1(v);
        store1(h, bf16, o + d, v);
        sum += v * v;
    }
    float rstd = 1.0f / sqrtf(sum / (float)n + eps);
    for (d = 0; d + 8 <= n; d += 8) {
        f8 v = load(h, bf16, o + d) * rstd;
        if (bf16) v = round_bf16(load(w, bf16, d) * round_bf16(v));
        else v = load(w, bf16, d) * v;
        store(out, bf16, o + d, v);
    }
    for (; d < n; d++) {
        float v = load1(h, bf16, o + d) * rstd;
        store1(out, bf16, o + d, load1(w, bf16, d) * (bf16 ? round1(v) : v));
    }
}

/* x, residual, out, h [rows, n]; weight [n]; all fp32 or all bf16 (bf16 = 1). */
void add_rmsnorm(const void *x, const void *res, const void *w, void *out, void *h, int bf16,
                 long rows, long n, float eps) {
    #pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_FROM)
    for (long r = 0; r < rows; r++) add_rmsnorm_row(x, res, w, out, h, bf16, n, eps, r * n);
}
