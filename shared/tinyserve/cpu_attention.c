/* Decode attention on a CPU: each request's one new query row against the keys and values
 * of its own blocks, read where they lie in the paged cache (block table), in fp32.
 *
 * torch's path gathers every request's blocks into a dense copy, pads the contexts to the
 * longest, masks, and upcasts bf16 to fp32: a dozen small ops per layer whose fixed costs,
 * not their arithmetic, make up a B=1 step's attention. Here one pass per (request, KV head)
 * reads each cached key and value once (the G = Hq / Hkv query heads sharing that KV head,
 * grouped-query attention, use it together), takes the softmax with its maximum subtracted,
 * and rounds once at the end. Built at first use by tinyserve/native.py. */
#include <math.h>
#include <stdlib.h>

#include "simd.h"

/* The D numbers from element `at` on: fp32 read where they lie, bf16 widened into `buf`. */
static inline const float *head(const void *base, int bf16, long at, long D, float *buf) {
    if (!bf16) return (const float *)base + at;
    const uint16_t *p = (const uint16_t *)base + at;
    long d = 0;
    for (; d + 8 <= D; d += 8) {
        f8 v = load_bf16(p + d);
        memcpy(buf + d, &v, sizeof v);
    }
    for (; d < D; d++) buf[d] = bf16_to_f32(p[d]);
    return buf;
}

/* In a decode step the cache comes from memory: the weights streamed since have evicted it,
 * and a request's blocks lie anywhere, where no hardware prefetcher follows. So each pass asks
 * for its keys this many bytes of one head's keys ahead of their scores (16 tokens of 64
 * fp32 numbers, 32 of 64 bf16), and for each value as its key is read (the values are used
 * after the softmax). AMD EPYC Zen 4, B=32, contexts of 170, a cold cache: 1.3-1.4x faster
 * a layer in bf16, 1.05-1.1x in fp32, against none. AMD EPYC Zen 5 (family 26 model 2),
 * cpu-bench's heads: 32 bf16 tokens ahead rather than 16 took 0.87-0.91x the time (two
 * runs), the same 4 KB as fp32's 16 tokens; fp32 was no faster at 32. */
#define PREFETCH_BYTES 4096

/* Ask for the D numbers from element `at` on (2 or 4 bytes each), one cache line at a time. */
static inline void prefetch_head(const void *base, int bf16, long at, long D) {
    const char *p = (const char *)base + at * (bf16 ? 2 : 4);
    for (long byte = 0; byte < D * (bf16 ? 2 : 4); byte += 64) __builtin_prefetch(p + byte, 0, 3);
}

typedef int32_t i8 __attribute__((vector_size(32)));

#ifdef __AVX512F__
/* 16 lanes, for the value sums where the CPU has 32 vector registers of 512 bits: the 16
 * sums below and their operands fit. With AVX2's 16 of 256 bits they spilled (built for
 * Haswell, on an AMD EPYC Zen 5: 3.4x the time of the buffered path), so other CPUs keep
 * the buffered path. */
typedef float f16 __attribute__((vector_size(64)));
#define WIDE_VALUES 1

/* The 16 numbers from element `at` on, as fp32 (bf16 widened in registers, not copied). */
static inline f16 load16(const void *base, int bf16, long at) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at));
        return (f16)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return (f16)_mm512_loadu_ps((const float *)base + at);
}
#else
#define WIDE_VALUES 0
#endif

/* e^x in 8 lanes for x <= 0 (a softmax's shifted scores; glibc's expf, one lane per call, was
 * a sixth of this kernel's time): x = n ln2 + r with |r| <= ln2/2, e^r = 1 + r + r^2 P(r) with
 * the coefficients of Cephes' expf, 2^n written into the exponent bits. x below -87 is taken
 * as -87 (e^-87 ~ 1.6e-38: nothing beside a softmax's largest term, 1). A NaN stays NaN. */
static inline f8 exp8(f8 x) {
    const f8 lo = {-87, -87, -87, -87, -87, -87, -87, -87};
    const f8 magic = {12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f,
                      12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f};   /* 1.5 * 2^23 */
    i8 below = x < lo;
    x = (f8)(((i8)x & ~below) | ((i8)lo & below));
    f8 v = x * 1.44269504089f + magic;         /* round(x / ln2) in the low bits */
    i8 n = (i8)v - (i8)magic;
    f8 nf = v - magic;
    f8 r = x - nf * 0.693145751953125f - nf * 1.428606765330187e-06f;   /* ln2 in two parts */
    f8 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (f8)((n + 127) << 23);
}

/* The 8 lane-sums of a[0..7] as one vector, [sum(a[0]), ..., sum(a[7])]: one transpose-add
 * instead of 8 separate reductions. */
static inline f8 sums8(const f8 a[8]) {
#ifdef __AVX2__
    __m256 h01 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]);
    __m256 h23 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    __m256 h45 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]);
    __m256 h67 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    return (f8)_mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                             _mm256_permute2f128_ps(h0123, h4567, 0x31));
#else
    f8 s;
    for (int j = 0; j < 8; j++) s[j] = sum8(a[j]);
    return s;
#endif
}

static inline float dot(const float *a, const float *b, long D) {
    f8 acc = {0};
    long d = 0;
    for (; d + 8 <= D; d += 8) acc += load_f32(a + d) * load_f32(b + d);
    float s = sum8(acc);
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

static inline void axpy(float p, const float *x, float *y, long D) {
    long d = 0;
    for (; d + 8 <= D; d += 8) {
        f8 v = load_f32(y + d) + p * load_f32(x + d);
        memcpy(y + d, &v, sizeof v);
    }
    for (; d < D; d++) y[d] += p * x[d];
}

#if defined(__AVX512BF16__) && defined(__AVX512DQ__)     /* DQ: the 8-lane halves */
/* The scores of G query rows against 8 keys, from the bf16 numbers as they lie: vdpbf16ps
 * multiplies 32 pairs exactly and adds each pair's two products into an fp32 lane, with
 * no widening copies. AMD EPYC Zen 5 (family 26 model 2), B=32, contexts of 128-192, a
 * cold cache: with this and the prefetch distance above, a layer of cpu-bench's heads took
 * 0.78-0.93x the time of neither (median 0.87, 6 interleaved runs), the 0.5B shape's
 * 0.83-0.86x. Sums are taken in another order than the fp32 path's (pairs first): results
 * differ from it in the last bits of fp32, as two orders of one sum do. D a multiple of 32. */
static void scores8_bf16(const uint16_t *q, const uint16_t *k_cache, const long *at, long G,
                         long D, float scale, float *scores, long ctx) {
    for (long g = 0; g < G; g++) {
        const uint16_t *qg = q + g * D;
        __m512 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
        for (long d = 0; d < D; d += 32) {
            __m512bh qv = (__m512bh)_mm512_loadu_si512(qg + d);
            for (int j = 0; j < 8; j++)
                a[j] = _mm512_dpbf16_ps(a[j], qv, (__m512bh)_mm512_loadu_si512(k_cache + at[j] + d));
        }
        f8 halves[8];
        for (int j = 0; j < 8; j++)
            halves[j] = (f8)_mm256_add_ps(_mm512_castps512_ps256(a[j]), _mm512_extractf32x8_ps(a[j], 1));
        f8 sc = sums8(halves) * scale;
        memcpy(scores + g * ctx, &sc, sizeof sc);
    }
}
#define DPBF16 1
#else
#define DPBF16 0
#endif

/* q, out [B, Hq, D]; k_cache, v_cache [blocks, block_size, Hkv, D]; tables [B, W] and
 * lens [B] int64. All fp32, or all bf16 (bf16 = 1). Returns 0; -1 out of memory; -2 a
 * context length outside 1..W * block_size; -3 a block id the context uses outside the cache. */
int decode_attention(const void *q, const void *k_cache, const void *v_cache,
                     const int64_t *tables, const int64_t *lens, void *out, int bf16,
                     long B, long Hq, long Hkv, long D, long blocks, long block_size, long W,
                     float scale) {
    for (long b = 0; b < B; b++) {      /* checked first: nothing is read out of bounds */
        if (lens[b] < 1 || lens[b] > W * block_size) return -2;
        for (long i = 0; i < (lens[b] + block_size - 1) / block_size; i++)
            if (tables[b * W + i] < 0 || tables[b * W + i] >= blocks) return -3;
    }
    long G = Hq / Hkv;
    int failed = 0;
    #pragma omp parallel for collapse(2) schedule(static)
    for (long b = 0; b < B; b++)
        for (long h = 0; h < Hkv; h++) {
            long ctx = lens[b];
            int values_in_registers = WIDE_VALUES && D % 64 == 0;
            /* where each token's head vector starts; the G query rows, their scores over the
             * context, their sums; one widened row, 8 widened keys; in bf16, unless the values
             * are summed in registers, the widened values */
            long vbuf_len = bf16 && !values_in_registers ? ctx * D : 0;
            long *at = malloc(sizeof(long) * ctx +
                              sizeof(float) * (2 * G * D + G * ctx + 9 * D + vbuf_len));
            if (!at) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            float *qs = (float *)(at + ctx), *scores = qs + G * D, *acc = scores + G * ctx;
            float *row = acc + G * D, *kbuf = row + D, *vbuf = kbuf + 8 * D;
            /* at[t]: token t's element offset in either cache, walked block by block once
             * rather than divided out of t for every use. */
            for (long i = 0, t = 0; t < ctx; i++)
                for (long o = 0; o < block_size && t < ctx; o++, t++)
                    at[t] = ((tables[b * W + i] * block_size + o) * Hkv + h) * D;
            for (long g = 0; g < G; g++)
                memcpy(qs + g * D, head(q, bf16, (b * Hq + h * G + g) * D, D, row),
                       sizeof(float) * D);
            /* Scores 8 tokens at a time: each query row against 8 keys, the 8 dot products'
             * partial sums reduced across lanes together. */
            long t = 0, D8 = D & ~7L, ahead = PREFETCH_BYTES / (D * (bf16 ? 2 : 4));
            if (ahead < 1) ahead = 1;
            for (long j = 0; j < ahead && j < ctx; j++) prefetch_head(k_cache, bf16, at[j], D);
            for (; t + 8 <= ctx; t += 8) {
                for (int j = 0; j < 8; j++) {
                    if (t + ahead + j < ctx)
                        prefetch_head(k_cache, bf16, at[t + ahead + j], D);
                    prefetch_head(v_cache, bf16, at[t + j], D);
                }
#if DPBF16
                if (bf16 && D % 32 == 0) {
                    scores8_bf16((const uint16_t *)q + (b * Hq + h * G) * D, k_cache, at + t, G, D,
                                 scale, scores + t, ctx);
                    continue;
                }
#endif
                const float *keys[8];
                for (int j = 0; j < 8; j++)
                    keys[j] = head(k_cache, bf16, at[t + j], D, kbuf + j * D);
                for (long g = 0; g < G; g++) {
                    const float *qg = qs + g * D;
                    f8 a[8] = {{0}};
                    for (long d = 0; d < D8; d += 8) {
                        f8 qv = load_f32(qg + d);
                        for (int j = 0; j < 8; j++) a[j] += qv * load_f32(keys[j] + d);
                    }
                    f8 sc = sums8(a);
                    for (long d = D8; d < D; d++)
                        for (int j = 0; j < 8; j++) sc[j] += qg[d] * keys[j][d];
                    sc *= scale;
                    memcpy(scores + g * ctx + t, &sc, sizeof sc);
                }
            }
            for (; t < ctx; t++) {
                prefetch_head(v_cache, bf16, at[t], D);
                const float *key = head(k_cache, bf16, at[t], D, row);
                for (long g = 0; g < G; g++) scores[g * ctx + t] = dot(qs + g * D, key, D) * scale;
            }
            for (long g = 0; g < G; g++) {
                float *s = scores + g * ctx, top = -INFINITY, sum = 0;
                f8 top8 = {top, top, top, top, top, top, top, top}, sum8v = {0};
                long t = 0;
                for (; t + 8 <= ctx; t += 8) {      /* 8 running maxima: no chain of compares */
                    f8 x = load_f32(s + t);
                    i8 above = x > top8;
                    top8 = (f8)(((i8)x & above) | ((i8)top8 & ~above));
                }
                for (int j = 0; j < 8; j++) top = top8[j] > top ? top8[j] : top;
                for (; t < ctx; t++) top = s[t] > top ? s[t] : top;
                top8 = (f8){top, top, top, top, top, top, top, top};
                t = 0;
                for (; t + 8 <= ctx; t += 8) {
                    f8 e = exp8(load_f32(s + t) - top8);
                    memcpy(s + t, &e, sizeof e);
                    sum8v += e;
                }
                sum = sum8(sum8v);
                for (; t < ctx; t++) sum += s[t] = expf(s[t] - top);
                for (long t = 0; t < ctx; t++) s[t] /= sum;
            }
#if WIDE_VALUES
            /* Values, for head sizes a multiple of 64: up to 4 query rows at a time, 64 of
             * each row's sums held in registers (16 vectors of 16) while the context runs;
             * each value is read and widened once for all of them, straight from the cache.
             * Every sum is taken over the tokens in order, as the other path does: the same
             * numbers. AMD EPYC Zen 5 (family 26 model 2), B=32, contexts 128-192, a cold
             * cache: a layer of bf16 attention in 0.78x the time of widening the values into
             * a buffer first (cpu-bench's heads; 0.71x the 0.5B shape's), fp32 as before. */
            if (values_in_registers) {
                for (long g0 = 0; g0 < G; g0 += 4) {
                    long rows = G - g0 < 4 ? G - g0 : 4;
                    for (long d0 = 0; d0 < D; d0 += 64) {
                        f16 a[4][4] = {{{0}}};
                        for (long t = 0; t < ctx; t++) {
                            f16 v[4];
                            for (int c = 0; c < 4; c++) v[c] = load16(v_cache, bf16, at[t] + d0 + 16 * c);
                            #pragma GCC unroll 4
                            for (int r = 0; r < 4; r++) {
                                if (r == rows) break;
                                f16 p = scores[(g0 + r) * ctx + t] + (f16){0};
                                for (int c = 0; c < 4; c++) a[r][c] += p * v[c];
                            }
                        }
                        for (int r = 0; r < rows; r++) memcpy(acc + (g0 + r) * D + d0, a[r], sizeof a[r]);
                    }
                }
            } else
#endif
            {
                /* Other head sizes and CPUs: per query row, up to 64 of its sums held in
                 * registers (8 vectors) while the row's weights run over the context; the rest
                 * of a row's D by lanes. All G rows read every value: bf16 ones are widened
                 * once, into vbuf, not G times. */
                const float *values = v_cache;
                if (bf16) {
                    for (long t = 0; t < ctx; t++) {
                        head(v_cache, 1, at[t], D, vbuf + t * D);
                        at[t] = t * D;      /* the keys are done with: at now walks vbuf */
                    }
                    values = vbuf;
                }
                memset(acc, 0, sizeof(float) * G * D);
                for (long g = 0; g < G; g++) {
                    const float *p = scores + g * ctx;
                    float *out_g = acc + g * D;
                    long d0 = 0;
                    for (; d0 + 64 <= D; d0 += 64) {
                        f8 a[8] = {{0}};
                        for (long t = 0; t < ctx; t++) {
                            const float *e = values + at[t] + d0;
                            f8 pt = {p[t], p[t], p[t], p[t], p[t], p[t], p[t], p[t]};
                            for (int c = 0; c < 8; c++)
                                a[c] += pt * load_f32(e + 8 * c);
                        }
                        memcpy(out_g + d0, a, sizeof a);
                    }
                    if (d0 < D)
                        for (long t = 0; t < ctx; t++)
                            axpy(p[t], values + at[t] + d0, out_g + d0, D - d0);
                }
            }
            for (long g = 0; g < G; g++) {
                long o = (b * Hq + h * G + g) * D;
                if (bf16)
                    for (long d = 0; d < D; d++) ((uint16_t *)out)[o + d] = f32_to_bf16(acc[g * D + d]);
                else
                    memcpy((float *)out + o, acc + g * D, sizeof(float) * D);
            }
            free(at);
        }
    return failed ? -1 : 0;
}


/* torch rounds each product before the sum; GCC would fuse a product into the sum (one
 * rounding fewer, results a bit off torch's): not in these two functions. Clang fuses only
 * within one expression, never across the statements below. */
#if defined(__GNUC__) && !defined(__clang__)
#define PRODUCTS_ROUNDED __attribute__((optimize("fp-contract=off")))
#else
#define PRODUCTS_ROUNDED
#endif

/* y = x * cos + rotate_half(x) * sin for one head's D numbers (rotate_half(x) = [-x2, x1],
 * the "rotate half" layout of Llama checkpoints in HF format): torch's three products and
 * sum, each rounded where torch holds a bf16 tensor. x, y at elements xo, yo; cos, sin at co. */
static inline PRODUCTS_ROUNDED void rotate_head(const void *x, long xo, const void *cos, const void *sin, long co,
                               void *y, long yo, int bf16, long D) {
    long half = D / 2, i = 0;
    for (; i + 8 <= half; i += 8) {
        f8 x1 = load8(x, bf16, xo + i), x2 = load8(x, bf16, xo + half + i);
        f8 a1 = x1 * load8(cos, bf16, co + i), b1 = -x2 * load8(sin, bf16, co + i);
        f8 a2 = x2 * load8(cos, bf16, co + half + i), b2 = x1 * load8(sin, bf16, co + half + i);
        if (bf16) {
            a1 = bf16_round8(a1), b1 = bf16_round8(b1), a2 = bf16_round8(a2), b2 = bf16_round8(b2);
            store8(y, bf16, yo + i, bf16_round8(a1 + b1));
            store8(y, bf16, yo + half + i, bf16_round8(a2 + b2));
        } else {
            store8(y, bf16, yo + i, a1 + b1);
            store8(y, bf16, yo + half + i, a2 + b2);
        }
    }
    for (; i < half; i++) {
        float x1 = load1(x, bf16, xo + i), x2 = load1(x, bf16, xo + half + i);
        float a1 = x1 * load1(cos, bf16, co + i), b1 = -x2 * load1(sin, bf16, co + i);
        float a2 = x2 * load1(cos, bf16, co + half + i), b2 = x1 * load1(sin, bf16, co + half + i);
        if (bf16) a1 = bf16_round1(a1), b1 = bf16_round1(b1), a2 = bf16_round1(a2), b2 = bf16_round1(b2);
        store1(y, bf16, yo + i, a1 + b1);
        store1(y, bf16, yo + half + i, a2 + b2);
    }
}

/* The new tokens' q [T, Hq, D], k and v [T, Hkv, D] (a token's heads contiguous, tokens q_ld,
 * k_ld, v_ld elements apart: slices of one GEMM's output); cos, sin [T, D]. q is rotated into
 * q_out [T, Hq, D]; k rotated and v as it is go to cache slot slots[t] of k_cache, v_cache
 * [num_slots, Hkv, D]. All fp32 or all bf16 (bf16 = 1); D even. Returns 0; -2 a slot
 * outside the cache. */
PRODUCTS_ROUNDED int rotate_and_store(const void *q, const void *k, const void *v, long q_ld, long k_ld, long v_ld,
                     const void *cos, const void *sin, void *q_out, void *k_cache, void *v_cache,
                     const int64_t *slots, int bf16, long T, long Hq, long Hkv, long D,
                     long num_slots) {
    for (long t = 0; t < T; t++)        /* checked first: nothing is written out of bounds */
        if (slots[t] < 0 || slots[t] >= num_slots) return -2;
    long size = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) if (T * (Hq + 2 * Hkv) * D >= PARALLEL_FROM)
    for (long t = 0; t < T; t++) {
        for (long h = 0; h < Hq; h++)
            rotate_head(q, t * q_ld + h * D, cos, sin, t * D, q_out, (t * Hq + h) * D, bf16, D);
        for (long h = 0; h < Hkv; h++) {
            long c = (slots[t] * Hkv + h) * D;
            rotate_head(k, t * k_ld + h * D, cos, sin, t * D, k_cache, c, bf16, D);
            memcpy((char *)v_cache + c * size, (const char *)v + (t * v_ld + h * D) * size, D * size);
        }
    }
    return 0;
}
