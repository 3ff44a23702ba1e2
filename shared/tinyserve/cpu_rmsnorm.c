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

static void add_rmsnorm_row(const void *x, const void *res, const void *w, void *out, void *h,
                            int bf16, long n, float eps, long o) {
    f8 squares = {0};
    long d = 0;
    for (; d + 8 <= n; d += 8) {
        f8 v = load8(x, bf16, o + d) + load8(res, bf16, o + d);
        if (bf16) v = bf16_round8(v);
        store8(h, bf16, o + d, v);
        squares += v * v;
    }
    float sum = sum8(squares);
    for (; d < n; d++) {
        float v = load1(x, bf16, o + d) + load1(res, bf16, o + d);
        if (bf16) v = bf16_round1(v);
        store1(h, bf16, o + d, v);
        sum += v * v;
    }
    float rstd = 1.0f / sqrtf(sum / (float)n + eps);
    for (d = 0; d + 8 <= n; d += 8) {
        f8 v = load8(h, bf16, o + d) * rstd;
        if (bf16) v = bf16_round8(load8(w, bf16, d) * bf16_round8(v));
        else v = load8(w, bf16, d) * v;
        store8(out, bf16, o + d, v);
    }
    for (; d < n; d++) {
        float v = load1(h, bf16, o + d) * rstd;
        store1(out, bf16, o + d, load1(w, bf16, d) * (bf16 ? bf16_round1(v) : v));
    }
}

/* x, residual, out, h [rows, n]; weight [n]; all fp32 or all bf16 (bf16 = 1). */
void add_rmsnorm(const void *x, const void *res, const void *w, void *out, void *h, int bf16,
                 long rows, long n, float eps) {
    #pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_FROM)
    for (long r = 0; r < rows; r++) add_rmsnorm_row(x, res, w, out, h, bf16, n, eps, r * n);
}
