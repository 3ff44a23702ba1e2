/* y = x @ w.T + bias for activations x [M, K] and bf16 weights w [N, K], out y [M, N];
 * x and y in fp32 or bf16, bias (optional) in fp32.
 *
 * A CPU without bf16 instructions (AVX2 only, as an AMD EPYC Zen 3) has no fast bf16 GEMM:
 * torch either multiplies bf16 slowly or needs an fp32 copy of the weight, written to memory
 * and read back. Here each 8 weights are widened to fp32 in a register (simd.h) right before
 * their multiply-adds, so the weight is read from memory once, as bf16: the fusion of the
 * chapter, for a GEMM.
 * Sums are fp32. Rows of w are split among OpenMP threads (torch's own pool where the
 * process loaded torch's libgomp first). Built at first use by tinyserve/native.py. */
#include <stdlib.h>

#include "simd.h"

/* Where the sums go: the bias added in fp32, then stored as fp32 or rounded once to bf16
 * (what a bf16 model wants; one cast fewer than rounding a whole fp32 output afterwards). */
typedef struct { float *f32; uint16_t *bf16; const float *bias; long N; } out_t;
static inline void put(out_t o, long i, long n, float s) {
    if (o.bias) s += o.bias[n];
    if (o.bf16) o.bf16[i * o.N + n] = f32_to_bf16(s);
    else o.f32[i * o.N + n] = s;
}

/* Ask for the weights 1 KiB ahead of the multiply-adds: the hardware prefetcher alone left
 * the one-row stream at 24-26 GB/s, this at 27 (AMD EPYC Zen 3, 512 MiB of weights, where
 * torch's sum reads 31-33; 2 KiB ahead was slower than none). */
#define PREFETCH 512

/* One row of w against `rows` <= MT rows of x, U vectors of it per pass (U independent
 * sums per row of x hide the multiply-add's latency): each thread reads its rows of w as
 * one stream, which is what a read-bound GEMM of few rows needs to run at the memory's
 * speed. Up to 8 rows this also beat the 4x3 tile below (each weight vector widened once). */
#define ROW(MT, U)                                                                         \
static void row_##MT##x##U(const float *x, const uint16_t *w, out_t y, long n, long K,      \
                           long rows) {                                                     \
    const float *xr[MT];                                                                    \
    for (int i = 0; i < MT; i++) xr[i] = x + (i < rows ? i : 0) * K;                        \
    long step = 8 * U, k_step = K - K % step, k8 = K & ~7L, k = 0;                          \
    f8 acc[MT][U];                                                                          \
    memset(acc, 0, sizeof acc);                                                             \
    for (; k < k_step; k += step) {                                                         \
        __builtin_prefetch(w + k + PREFETCH);                                               \
        for (int u = 0; u < U; u++) {                                                       \
            f8 wv = load_bf16(w + k + 8 * u);                                               \
            for (int i = 0; i < MT; i++) acc[i][u] += load_f32(xr[i] + k + 8 * u) * wv;     \
        }                                                                                   \
    }                                                                                       \
    for (; k < k8; k += 8) {                                                                \
        f8 wv = load_bf16(w + k);                                                           \
        for (int i = 0; i < MT; i++) acc[i][0] += load_f32(xr[i] + k) * wv;                 \
    }                                                                                       \
    for (int i = 0; i < rows; i++) {                                                        \
        f8 a = acc[i][0];                                                                   \
        for (int u = 1; u < U; u++) a += acc[i][u];                                         \
        float s = sum8(a);                                                                  \
        for (long j = k8; j < K; j++) s += xr[i][j] * bf16_to_f32(w[j]);                    \
        put(y, i, n, s);                                                                    \
    }                                                                                       \
}
ROW(1, 4)
ROW(2, 2)
ROW(3, 2)
ROW(4, 1)
ROW(8, 1)   /* 5 to 8 rows: 8 sums, the FMA units' 2 per cycle x 4 cycles of latency */

/* More rows of x: compute, not the read, is the cost. A tile of `rows` <= 4 rows of x
 * against `cols` <= 3 rows of w in 12 vector accumulators (+ 3 weights + 1 input: the 16
 * registers of AVX2), so each widened weight vector is used 4 times. */
static void tile_4x3(const float *x, const uint16_t *w, out_t y, long m, long n, long K,
                     long rows, long cols) {
    const float *xr[4];
    const uint16_t *wr[3];
    for (int i = 0; i < 4; i++) xr[i] = x + (i < rows ? i : 0) * K;
    for (int j = 0; j < 3; j++) wr[j] = w + (j < cols ? j : 0) * K;
    long k8 = K & ~7L;
    f8 acc[4][3];
    memset(acc, 0, sizeof acc);
    for (long k = 0; k < k8; k += 8) {
        f8 wv[3];
        for (int j = 0; j < 3; j++) wv[j] = load_bf16(wr[j] + k);
        for (int i = 0; i < 4; i++) {
            f8 xv = load_f32(xr[i] + k);
            for (int j = 0; j < 3; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            float s = sum8(acc[i][j]);
            for (long k = k8; k < K; k++) s += xr[i][k] * bf16_to_f32(wr[j][k]);
            put(y, m + i, n + j, s);
        }
}

static void gemm(const float *x, const uint16_t *w, out_t y, long M, long N, long K) {
    if (M <= 8) {
        #pragma omp parallel for schedule(static)
        for (long n = 0; n < N; n++) {
            const uint16_t *wn = w + n * K;
            if (M == 1) row_1x4(x, wn, y, n, K, 1);
            else if (M == 2) row_2x2(x, wn, y, n, K, 2);
            else if (M == 3) row_3x2(x, wn, y, n, K, 3);
            else if (M == 4) row_4x1(x, wn, y, n, K, 4);
            else row_8x1(x, wn, y, n, K, M);
        }
        return;
    }
    /* Rows of w go to threads in runs of 16 tiles (a run streams one stretch of w). */
    long span = 16 * 3, runs = (N + span - 1) / span;
    #pragma omp parallel for schedule(static)
    for (long r = 0; r < runs; r++) {
        long end = (r + 1) * span < N ? (r + 1) * span : N;
        for (long n = r * span; n < end; n += 3)
            for (long m = 0; m < M; m += 4)
                tile_4x3(x + m * K, w + n * K, y, m, n, K,
                         M - m < 4 ? M - m : 4, end - n < 3 ? end - n : 3);
    }
}

/* Returns 0, or -1 where the fp32 copy of a bf16 x could not be allocated. */
int bf16_gemm(const void *x, int x_bf16, const uint16_t *w, const float *bias, void *y, int y_bf16,
              long M, long N, long K) {
    out_t out = {y_bf16 ? NULL : (float *)y, y_bf16 ? (uint16_t *)y : NULL, bias, N};
    if (!x_bf16) {
        gemm((const float *)x, w, out, M, N, K);
        return 0;
    }
    /* Widen x once (it is small: a few rows) rather than in every dot product. */
    float *x32 = malloc(sizeof(float) * M * K);
    if (!x32) return -1;
    for (long i = 0; i < M * K; i++) x32[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    gemm(x32, w, out, M, N, K);
    free(x32);
    return 0;
}
