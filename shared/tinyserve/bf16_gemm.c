/* y = x @ w.T for fp32 activations x [M, K] and bf16 weights w [N, K], fp32 out y [M, N].
 *
 * A CPU without bf16 instructions (AVX2 only, as an AMD EPYC Zen 3) has no fast bf16 GEMM:
 * torch either multiplies bf16 slowly or needs an fp32 copy of the weight, written to memory
 * and read back. Here each 8 weights are widened to fp32 in a register (a bf16 number is the
 * upper half of an fp32 one: zero-extend, shift left 16) right before their multiply-adds,
 * so the weight is read from memory once, as bf16: the fusion of the chapter, for a GEMM.
 * Sums are fp32. Rows of w are split among OpenMP threads (torch's own pool where the
 * process loaded torch's libgomp first). Built at first use by tinyserve/bf16_gemm.py. */
#include <stdint.h>
#include <string.h>

typedef float f8 __attribute__((vector_size(32)));

#ifdef __AVX2__
#include <immintrin.h>
static inline f8 load_bf16(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (f8)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#else   /* any other CPU: the compiler picks the vector instructions */
typedef uint32_t u8 __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));
static inline f8 load_bf16(const uint16_t *p) {
    h8 h;
    memcpy(&h, p, sizeof h);
    u8 u = __builtin_convertvector(h, u8) << 16;
    f8 f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#endif

static inline f8 load_f32(const float *p) { f8 f; memcpy(&f, p, sizeof f); return f; }
static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float sum8(f8 v) { float s = 0; for (int i = 0; i < 8; i++) s += v[i]; return s; }

/* A tile of `rows` <= MT rows of x against `cols` <= NB rows of w, in MT x NB vector
 * accumulators (registers): each widened weight vector is used MT times. */
#define TILE(MT, NB)                                                                       \
static void tile_##MT##x##NB(const float *x, const uint16_t *w, float *y, long N, long K,   \
                             long rows, long cols) {                                       \
    const float *xr[MT];                                                                   \
    const uint16_t *wr[NB];                                                                \
    for (int i = 0; i < MT; i++) xr[i] = x + (i < rows ? i : 0) * K;                       \
    for (int j = 0; j < NB; j++) wr[j] = w + (j < cols ? j : 0) * K;                       \
    long k8 = K & ~7L;                                                                     \
    f8 acc[MT][NB] = {{0}};                                                                \
    for (long k = 0; k < k8; k += 8) {                                                     \
        f8 wv[NB];                                                                         \
        for (int j = 0; j < NB; j++) wv[j] = load_bf16(wr[j] + k);                         \
        for (int i = 0; i < MT; i++) {                                                     \
            f8 xv = load_f32(xr[i] + k);                                                   \
            for (int j = 0; j < NB; j++) acc[i][j] += xv * wv[j];                          \
        }                                                                                  \
    }                                                                                      \
    for (int i = 0; i < rows; i++)                                                         \
        for (int j = 0; j < cols; j++) {                                                   \
            float s = sum8(acc[i][j]);                                                     \
            for (long k = k8; k < K; k++) s += xr[i][k] * bf16_to_f32(wr[j][k]);           \
            y[i * N + j] = s;                                                              \
        }                                                                                  \
}
TILE(1, 4)   /* one row: reading the weight is the cost; 4 streams of it at a time */
TILE(2, 4)
TILE(4, 3)   /* 12 accumulators + 3 weights + 1 input: the 16 vector registers of AVX2 */

/* Rows of w go to threads in runs of RUN tiles (a run streams one stretch of w). */
#define RUN 16
void bf16_gemm(const float *x, const uint16_t *w, float *y, long M, long N, long K) {
    long mt = M >= 4 ? 4 : M >= 2 ? 2 : 1, nb = mt == 4 ? 3 : 4;
    long span = RUN * nb, runs = (N + span - 1) / span;
    #pragma omp parallel for schedule(static)
    for (long r = 0; r < runs; r++) {
        long end = (r + 1) * span < N ? (r + 1) * span : N;
        for (long n = r * span; n < end; n += nb) {
            long cols = end - n < nb ? end - n : nb;
            for (long m = 0; m < M; m += mt) {
                long rows = M - m < mt ? M - m : mt;
                const float *xm = x + m * K;
                const uint16_t *wn = w + n * K;
                float *ym = y + m * N + n;
                if (mt == 4) tile_4x3(xm, wn, ym, N, K, rows, cols);
                else if (mt == 2) tile_2x4(xm, wn, ym, N, K, rows, cols);
                else tile_1x4(xm, wn, ym, N, K, rows, cols);
            }
        }
    }
}
