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
#endif
