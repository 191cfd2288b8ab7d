// Vector helpers shared by the kernels (gemv.cpp, attend.cpp): one interface per instruction set
// -- AVX-512, AVX2+FMA, chosen at compile time by -march=native -- so each kernel body is
// written once. ``KVLAB_VECTOR`` is defined where a vector path exists; ``kLanes`` floats per
// ``vec``. ``scalar`` reads one weight of any stored type as fp32 (the plain-loop fallback).
// ``kIsa`` names the path compiled in (``engine.kernels.cpu.isa()``): the fp32 kernels run AVX-512
// or AVX2+FMA; blocks.cpp's integer dot products use VNNI where the target has it.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace kvlab {

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr const char* kIsa = "avx512-vnni";
#elif defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVXVNNI__)
constexpr const char* kIsa = "avx-vnni";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* kIsa = "avx2";
#else
constexpr const char* kIsa = "scalar";
#endif

inline float scalar(const float* p, int64_t i) { return p[i]; }
inline float scalar(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }
inline float scalar(const c10::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// What differs between the instruction sets: the vector type, the loads that widen int8 and
// bf16 to 32-bit lanes, a horizontal sum, floor; KVLAB_MM(op) names the set's intrinsic
// (_mm512_op / _mm256_op) for the operations both spell alike, written once below.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using vec = __m512;
using ivec = __m512i;
#define KVLAB_MM(op) _mm512_##op
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
inline ivec widen_i8(const int8_t* p) {  // 16 int8 -> 16 int32
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline ivec widen_u16(const void* p) {  // 16 uint16 -> 16 int32
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vec as_float(ivec u) { return _mm512_castsi512_ps(u); }
inline vec vfloor(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
#define KVLAB_VECTOR 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using vec = __m256;
using ivec = __m256i;
#define KVLAB_MM(op) _mm256_##op
inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline ivec widen_i8(const int8_t* p) {  // 8 int8 -> 8 int32
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline ivec widen_u16(const void* p) {  // 8 uint16 -> 8 int32
  return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vec as_float(ivec u) { return _mm256_castsi256_ps(u); }
inline vec vfloor(vec a) { return _mm256_floor_ps(a); }
#define KVLAB_VECTOR 1
#endif

#ifdef KVLAB_VECTOR
inline vec vload(const float* p) { return KVLAB_MM(loadu_ps)(p); }
inline vec vload(const int8_t* p) { return KVLAB_MM(cvtepi32_ps)(widen_i8(p)); }
inline vec vload(const c10::BFloat16* p) {  // bf16 is the high half of an fp32
  return as_float(KVLAB_MM(slli_epi32)(widen_u16(p), 16));
}
inline vec vzero() { return KVLAB_MM(setzero_ps)(); }
inline vec vfma(vec a, vec b, vec c) { return KVLAB_MM(fmadd_ps)(a, b, c); }
inline vec vset(float a) { return KVLAB_MM(set1_ps)(a); }
inline void vstore(float* p, vec a) { KVLAB_MM(storeu_ps)(p, a); }
inline vec vmul(vec a, vec b) { return KVLAB_MM(mul_ps)(a, b); }
inline vec vdiv(vec a, vec b) { return KVLAB_MM(div_ps)(a, b); }
inline vec vadd(vec a, vec b) { return KVLAB_MM(add_ps)(a, b); }
inline vec vmin(vec a, vec b) { return KVLAB_MM(min_ps)(a, b); }
inline vec vmax(vec a, vec b) { return KVLAB_MM(max_ps)(a, b); }
inline vec vpow2(vec n) {  // 2^n for integral n in [-126, 127], built in the exponent bits
  ivec e = KVLAB_MM(add_epi32)(KVLAB_MM(cvttps_epi32)(n), KVLAB_MM(set1_epi32)(127));
  return as_float(KVLAB_MM(slli_epi32)(e, 23));
}

// e^x, lane by lane, to float32 rounding (Cephes' expf: x = n ln2 + r, a degree-5 polynomial in
// r, times 2^n); inputs below -87 give 0, as softmax wants of scores far under the maximum.
inline vec vexp(vec x) {
  const vec lo = vset(-87.0f), hi = vset(88.0f);
  vec under = x;
  x = vmin(vmax(x, lo), hi);
  vec n = vfloor(vfma(x, vset(1.44269504088896341f), vset(0.5f)));
  x = vfma(n, vset(-0.693359375f), x);
  x = vfma(n, vset(2.12194440e-4f), x);
  vec z = vmul(x, x);
  vec y = vset(1.9875691500e-4f);
  y = vfma(y, x, vset(1.3981999507e-3f));
  y = vfma(y, x, vset(8.3334519073e-3f));
  y = vfma(y, x, vset(4.1665795894e-2f));
  y = vfma(y, x, vset(1.6666665459e-1f));
  y = vfma(y, x, vset(5.0000001201e-1f));
  y = vadd(vfma(y, z, x), vset(1.0f));
  y = vmul(y, vpow2(n));
#if defined(__AVX512F__)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(under, lo, _CMP_GE_OQ), y);
#else
  return _mm256_and_ps(y, _mm256_cmp_ps(under, lo, _CMP_GE_OQ));
#endif
}
#endif


}  // namespace kvlab
