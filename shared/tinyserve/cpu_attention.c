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

/* One cached head vector of D numbers: fp32 read where it lies, bf16 widened into `buf`. */
static inline const float *head(const void *base, int bf16, long index, long D, float *buf) {
    if (!bf16) return (const float *)base + index * D;
    const uint16_t *p = (const uint16_t *)base + index * D;
    long d = 0;
    for (; d + 8 <= D; d += 8) {
        f8 v = load_bf16(p + d);
        memcpy(buf + d, &v, sizeof v);
    }
    for (; d < D; d++) buf[d] = bf16_to_f32(p[d]);
    return buf;
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
            /* the G query rows, their scores over the context, their sums, one widened row */
            float *qs = malloc(sizeof(float) * (2 * G * D + G * ctx + D));
            if (!qs) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            float *scores = qs + G * D, *acc = scores + G * ctx, *row = acc + G * D;
            for (long g = 0; g < G; g++)
                memcpy(qs + g * D, head(q, bf16, b * Hq + h * G + g, D, row), sizeof(float) * D);
            for (long t = 0; t < ctx; t++) {
                long slot = tables[b * W + t / block_size] * block_size + t % block_size;
                const float *key = head(k_cache, bf16, slot * Hkv + h, D, row);
                for (long g = 0; g < G; g++) scores[g * ctx + t] = dot(qs + g * D, key, D) * scale;
            }
            for (long g = 0; g < G; g++) {
                float *s = scores + g * ctx, top = -INFINITY, sum = 0;
                for (long t = 0; t < ctx; t++) top = s[t] > top ? s[t] : top;
                for (long t = 0; t < ctx; t++) sum += s[t] = expf(s[t] - top);
                for (long t = 0; t < ctx; t++) s[t] /= sum;
            }
            memset(acc, 0, sizeof(float) * G * D);
            for (long t = 0; t < ctx; t++) {
                long slot = tables[b * W + t / block_size] * block_size + t % block_size;
                const float *value = head(v_cache, bf16, slot * Hkv + h, D, row);
                for (long g = 0; g < G; g++) axpy(scores[g * ctx + t], value, acc + g * D, D);
            }
            for (long g = 0; g < G; g++) {
                long o = (b * Hq + h * G + g) * D;
                if (bf16)
                    for (long d = 0; d < D; d++) ((uint16_t *)out)[o + d] = f32_to_bf16(acc[g * D + d]);
                else
                    memcpy((float *)out + o, acc + g * D, sizeof(float) * D);
            }
            free(qs);
        }
    return failed ? -1 : 0;
}
