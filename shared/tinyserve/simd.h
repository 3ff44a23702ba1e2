/* What our CPU kernels share: 8 fp32 lanes as a vector (GCC/Clang vector extensions; the
 * compiler picks the instructions for -march=native), and bf16 <-> fp32. A bf16 number is
 * the upper half of an fp32 one: widening is exact (zero-extend, shift left 16). */
#ifndef TINYSERVE_SIMD_H
#define TINYSERVE_SIMD_H
#include <stdint.h>
#include <string.h>

typedef float f8 __attribute__((vector_size(32)));

#ifdef __AVX2__
#include <immintrin.h>
static inline f8 load_bf16(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (f8)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#else   /* any other CPU */
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

/* Round to nearest, ties to even, as torch's .to(torch.bfloat16); a NaN stays a NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Elements per call from which a kernel of a few elementwise passes splits its rows across
 * threads: below it a thread's start costs more than it saves (a decode row of
 * Qwen2.5-0.5B is 896 numbers). */
#define PARALLEL_FROM 32768

/* Loads and stores of fp32 or bf16 (bf16 = 1) tensors, 8 lanes or 1, with values in fp32. */
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

static inline f8 load8(const void *p, int bf16, long i) {
    return bf16 ? load_bf16((const uint16_t *)p + i) : load_f32((const float *)p + i);
}

static inline float load1(const void *p, int bf16, long i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* What a bf16 tensor would hold: rounded to nearest, ties to even (f32_to_bf16, 8 lanes). */
static inline f8 bf16_round8(f8 v) {
    u32x8 u;
    memcpy(&u, &v, sizeof u);
    u32x8 r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    i32x8 nan = v != v;
    r = (u32x8)(((i32x8)r & ~nan) | (0x7fc00000 & nan));
    memcpy(&v, &r, sizeof v);
    return v;
}

static inline float bf16_round1(float v) { return bf16_to_f32(f32_to_bf16(v)); }

/* Store 8 values (already rounded where bf16: the upper halves are the bf16 numbers). */
static inline void store8(void *p, int bf16, long i, f8 v) {
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
#endif
