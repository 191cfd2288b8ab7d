// Matrix-vector products over llama.cpp's GGUF blocks as they are stored, never expanded:
//
//   q8_0_linear(x, blocks, bias, exact) / q4_1_linear(...) -> y (B, out) fp32
//     x       (B, in) fp32, 1 to 8 rows; ``in`` a multiple of 32
//     blocks  (out, in / 32 * bytes) uint8, each row's 32-weight blocks back to back:
//               Q8_0  34 bytes: fp16 d, 32 int8 q             w = d * q
//               Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes q    w = d * q + m, q in 0..15; byte j
//                     holds weight j in its low nibble and weight j + 16 in its high nibble
//     exact   false: llama.cpp's way -- x rounded once per call to int8 in 32-wide blocks with
//             one fp32 scale each (dx = max|x| / 127), then integer dot products per block
//             (AVX2 maddubs + madd, or VNNI dpbusd where the build targets it), scaled by
//             d * dx in fp32 (for Q4_1 plus m * dx * sum(q_x)). true: each block converted to
//             fp32 in registers and multiplied with fp32 x, d * sum(q x) + m * sum(x).
//
// Error bound (either way, per output; engine/kernels/cpu/__init__.py states it for callers):
//   |y - y_ref| <= sum_j |w~_j| dx_j / 2 + (in / 32 + 40) * 2^-23 * sum_j |w~_j| (|x_j| + dx_j)
// with |w~_j| = |d q_j| + |m| (Q8_0: |d q_j|), y_ref the fp64 product over the blocks
// dequantized, dx_j = 0 when exact, else the scale of x's block holding j (the integer sums
// are exact: at most 32 * 127 * 127 < 2^24, so each converts to fp32 without rounding).
//
// Why: a decode step at batch 1 streams every weight once; GGUF's 5 (Q4_1) and 8.5 (Q8_0) bits
// per weight are 6.4x and 3.8x fewer bytes than fp32, but only if the product reads the blocks
// themselves. Each thread takes a range of output rows (a contiguous run of bytes: rows are
// stored back to back) and walks it four rows at a time, the next group's bytes prefetched while
// these are multiplied (SmolLM2's Q4_1 set on the quiet EPYC: 2.02x a read of its bytes without,
// 1.17x with at 1 thread, 1.68x and 1.08x at 2; two or four groups ahead the same within 3%;
// bench: scripts/bench_blocks.py). Each block is unpacked once for up to four rows of x (more
// rows of x, fewer rows of blocks at a time: the accumulators share the 16 vector registers):
// 4 rows of x cost 2-3x one row in cache, not 4x.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "ops.h"
#include "simd.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>  // F16C and the prefetch hint, also where simd.h has no vector path
#endif

namespace {

using namespace kvlab;

constexpr int64_t kBlock = 32;     // weights per block, both formats
constexpr int64_t kRows = 4;       // output rows walked together
constexpr int64_t kGrain = 16;     // groups of kRows rows per parallel task, at least
enum Format { kQ8_0, kQ4_1 };
constexpr int64_t block_bytes(Format f) { return f == kQ8_0 ? 34 : 20; }

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// x once per call. ``dx``: each row's 32-wide block scale, eight copies (a vector the block's
// d multiplies without a broadcast), integer path only; ``s``: per block, the rows side by side
// (lane b: row b), dx * sum(q_x) for the integer path, sum(x) for the exact one -- what the
// block's m multiplies (Q4_1); eight lanes for at most eight rows, one spare block of padding.
// ``pair``: (dx, s) of each row's block side by side, (1, s) for the exact path -- for one row
// of x, d * dx and m * s come out of one multiply of the block's converted (d, m).
struct PreparedX {
  std::vector<int8_t> q;    // (B, in) x rounded to int8
  std::vector<float> dx;    // (B, in / 32, 8)
  std::vector<float> s;     // (in / 32 + 1, 8)
  std::vector<float> pair;  // (B, in / 32, 2)
};

void prepare_x(const float* x, int64_t rows, int64_t in, bool exact, PreparedX& p) {
  const int64_t nb = in / kBlock;
  p.s.assign((nb + 1) * 8, 0.f);
  p.pair.resize(rows * nb * 2);
  if (!exact) p.q.resize(rows * in), p.dx.resize(rows * nb * 8);
  for (int64_t blk = 0; blk < rows * nb; ++blk) {
    const float* xb = x + blk * kBlock;
    float& s = p.s[(blk % nb) * 8 + blk / nb];
    if (exact) {
      s = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) s += xb[j];
      p.pair[2 * blk] = 1.f, p.pair[2 * blk + 1] = s;
      continue;
    }
    int8_t* qb = p.q.data() + blk * kBlock;
    int32_t sum = 0;
    float dx;
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_ps(xb + 8 * k);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float am = _mm_cvtss_f32(m4);
    dx = am / 127.f;
    const __m256 id = _mm256_set1_ps(am != 0.f ? 127.f / am : 0.f);
    __m256i i[4];
    for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], id));  // nearest-even
    const __m256i sums = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1)));
    // packs work within 128-bit halves: the permute puts the 32 bytes back in order
    const __m256i p16a = _mm256_packs_epi32(i[0], i[1]), p16b = _mm256_packs_epi32(i[2], i[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), p8);
#else
    float am = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) am = std::max(am, std::fabs(xb[j]));
    dx = am / 127.f;
    const float id = am != 0.f ? 127.f / am : 0.f;
    for (int64_t j = 0; j < kBlock; ++j) {
      qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
      sum += qb[j];
    }
#endif
    std::fill_n(p.dx.data() + blk * 8, 8, dx);
    s = dx * static_cast<float>(sum);
    p.pair[2 * blk] = dx, p.pair[2 * blk + 1] = s;
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVLAB_BLOCKS_AVX2 1

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// 8 int32 lanes, each the sum of 4 neighbouring products u[i] * s[i] (u unsigned, s signed)
inline __m256i dot_us(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else  // pairs fit in int16: at most 2 * 128 * 127 (Q8_0 |w|) or 2 * 15 * 127 (Q4_1)
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Dot products of NB prepared x rows (``in`` floats / int8 apart; ``dx`` their block scales,
// ``s`` lane 0 of their per-block sums) with R rows of blocks ``rb`` bytes apart from w:
// out[i * R + r]. Each block is unpacked, and its d and m converted, once for the NB rows of
// x. ``ahead``: the bytes to prefetch while these are read, or null.
template <Format F, bool Exact, int R, int NB>
void dots(const uint8_t* w, int64_t rb, int64_t nb, const float* x, const int8_t* xq,
          const float* dx, const float* s, const float* pair, int64_t in, const uint8_t* ahead,
          float* out) {
  constexpr int64_t bytes = block_bytes(F);
  __m256 acc[R][NB], mins[R];
  __m128 mins1[R];  // one row of x: lane 1 sums m * s (one add a block, no broadcast)
  for (int r = 0; r < R; ++r) {
    mins[r] = _mm256_setzero_ps(), mins1[r] = _mm_setzero_ps();
    for (int i = 0; i < NB; ++i) acc[r][i] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    if (ahead) {  // R rows' worth of the next group per block column: the stream stays ahead
      for (int64_t k = 0; k < R * bytes; k += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + b * R * bytes + k), _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * rb + b * bytes;
      int32_t raw;
      std::memcpy(&raw, blk, 4);  // d, m (Q8_0: d and two q bytes, lane 1 never used)
      const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(raw));
      __m256 d;  // NB = 1: d * dx (or d), else d, times each row's dx below
      if constexpr (NB == 1) {
        const __m128 sdm = _mm_mul_ps(dm, _mm_castpd_ps(_mm_load_sd(
            reinterpret_cast<const double*>(pair + 2 * b))));
        d = _mm256_broadcastss_ps(sdm);
        if constexpr (F == kQ4_1) mins1[r] = _mm_add_ps(mins1[r], sdm);
      } else {
        d = _mm256_broadcastss_ps(dm);
        if constexpr (F == kQ4_1)  // m * (the rows' x sums), lane i for x row i
          mins[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm)),
                                    _mm256_loadu_ps(s + 8 * b), mins[r]);
      }
      __m256i q;     // the integer way: 32 bytes (Q8_0 as stored, Q4_1's nibbles spread)
      __m256 wf[4];  // the exact way: the 32 q in fp32
      if constexpr (F == kQ8_0 && !Exact) {
        q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      } else if constexpr (F == kQ4_1 && !Exact) {
        // the 16 bytes in both halves (a load, no shuffle), the upper half shifted by 4
        const __m256i t = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)));
        q = _mm256_and_si256(_mm256_srlv_epi32(t, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                             _mm256_set1_epi8(0x0F));
      } else if constexpr (F == kQ8_0) {
        for (int k = 0; k < 4; ++k)
          wf[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * k))));
      } else {
        const __m256i lo = _mm256_cvtepu8_epi32(  // bytes 0..7, widened as they are loaded
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 4)));
        const __m256i hi = _mm256_cvtepu8_epi32(  // bytes 8..15
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 12)));
        const __m256i m15 = _mm256_set1_epi32(0x0F);
        wf[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo, m15));
        wf[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi, m15));
        wf[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4));
        wf[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4));
      }
      for (int i = 0; i < NB; ++i) {
        if constexpr (!Exact) {
          const __m256i xv = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(xq + i * in + b * kBlock));
          // Q8_0: |q| unsigned times x carrying q's sign (right for every q, -128 included)
          const __m256 sum = _mm256_cvtepi32_ps(
              F == kQ8_0 ? dot_us(_mm256_abs_epi8(q), _mm256_sign_epi8(xv, q)) : dot_us(q, xv));
          const __m256 dd = NB == 1 ? d : _mm256_mul_ps(d, _mm256_loadu_ps(dx + (i * nb + b) * 8));
          acc[r][i] = _mm256_fmadd_ps(sum, dd, acc[r][i]);
        } else {
          const float* xb = x + i * in + b * kBlock;
          __m256 sum = _mm256_mul_ps(wf[0], _mm256_loadu_ps(xb));
          for (int k = 1; k < 4; ++k) sum = _mm256_fmadd_ps(wf[k], _mm256_loadu_ps(xb + 8 * k), sum);
          acc[r][i] = _mm256_fmadd_ps(sum, d, acc[r][i]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float m[8];
    _mm256_store_ps(m, mins[r]);
    if (NB == 1) m[0] = _mm_cvtss_f32(_mm_movehdup_ps(mins1[r]));
    for (int i = 0; i < NB; ++i) out[i * R + r] = hsum(acc[r][i]) + (F == kQ4_1 ? m[i] : 0.f);
  }
}
#else
// The plain loops: the same sums in the same grouping (integer sums per block, then fp32).
template <Format F, bool Exact, int R, int NB>
void dots(const uint8_t* w, int64_t rb, int64_t nb, const float* x, const int8_t* xq,
          const float* dx, const float* s, const float* /*pair*/, int64_t in,
          const uint8_t* /*ahead*/, float* out) {
  constexpr int64_t bytes = block_bytes(F);
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < NB; ++i) {
      float acc = 0.f, mins = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + r * rb + b * bytes;
        const uint8_t* q = blk + (F == kQ8_0 ? 2 : 4);
        float sum = 0.f;
        int32_t isum = 0;
        for (int64_t j = 0; j < kBlock; ++j) {
          const int32_t qj = F == kQ8_0 ? static_cast<int8_t>(q[j])
                                        : (j < 16 ? q[j] & 0x0F : q[j - 16] >> 4);
          if (Exact) sum += static_cast<float>(qj) * x[i * in + b * kBlock + j];
          else isum += qj * xq[i * in + b * kBlock + j];
        }
        if (!Exact) sum = static_cast<float>(isum);
        acc += sum * (Exact ? half_at(blk) : half_at(blk) * dx[(i * nb + b) * 8]);
        if (F == kQ4_1) mins += half_at(blk + 2) * s[8 * b + i];
      }
      out[i * R + r] = acc + mins;
    }
  }
}
#endif

// One group of kRows rows (n of them real) times NB rows of x: s[i * kRows + r]. One x row
// takes the rows four at a time; more x rows take fewer at a time (their accumulators share
// the 16 vector registers), so that each block is unpacked once for all of them.
template <Format F, bool Exact, int NB>
void group(const uint8_t* rows, int64_t n, int64_t rb, int64_t nb, const float* x,
           const int8_t* xq, const float* dx, const float* xs, const float* pair, int64_t in,
           const uint8_t* ahead, float* s) {
  constexpr int R = NB == 1 ? 4 : NB == 2 ? 2 : 1;
  float t[R * NB];
  for (int64_t r0 = 0; r0 < n; r0 += n == kRows ? R : 1) {
    if (n == kRows) {
      dots<F, Exact, R, NB>(rows + r0 * rb, rb, nb, x, xq, dx, xs, pair, in,
                            ahead ? ahead + r0 * rb : nullptr, t);
      for (int i = 0; i < NB; ++i)
        for (int r = 0; r < R; ++r) s[i * kRows + r0 + r] = t[i * R + r];
    } else {  // the last rows of the matrix, one by one
      dots<F, Exact, 1, NB>(rows + r0 * rb, rb, nb, x, xq, dx, xs, pair, in, nullptr, t);
      for (int i = 0; i < NB; ++i) s[i * kRows + r0] = t[i];
    }
  }
}

template <Format F, bool Exact>
void run(const float* x, const uint8_t* w, const float* bias, float* y, int64_t batch,
         int64_t in, int64_t out) {
  const int64_t nb = in / kBlock, rb = nb * block_bytes(F);
  PreparedX p;
  prepare_x(x, batch, in, Exact, p);
  const int64_t groups = (out + kRows - 1) / kRows;
  at::parallel_for(0, groups, kGrain, [&](int64_t g0, int64_t g1) {
    float s[4 * kRows];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t o = g * kRows, n = std::min(kRows, out - o);
      const uint8_t* rows = w + o * rb;
      const uint8_t* ahead = g + 1 < g1 && o + 2 * kRows <= out ? rows + kRows * rb : nullptr;
      for (int64_t b0 = 0; b0 < batch; b0 += 4) {  // up to four rows of x per pass over the group
        const float* xb = x + b0 * in;
        const int8_t* xq = Exact ? nullptr : p.q.data() + b0 * in;
        const float* dx = Exact ? nullptr : p.dx.data() + b0 * nb * 8;
        const float* xs = p.s.data() + b0;
        const float* pair = p.pair.data() + b0 * nb * 2;
        const uint8_t* pf = b0 == 0 ? ahead : nullptr;
        const int64_t k = std::min<int64_t>(4, batch - b0);
        if (k == 1) group<F, Exact, 1>(rows, n, rb, nb, xb, xq, dx, xs, pair, in, pf, s);
        else if (k == 2) group<F, Exact, 2>(rows, n, rb, nb, xb, xq, dx, xs, pair, in, pf, s);
        else if (k == 3) group<F, Exact, 3>(rows, n, rb, nb, xb, xq, dx, xs, pair, in, pf, s);
        else group<F, Exact, 4>(rows, n, rb, nb, xb, xq, dx, xs, pair, in, pf, s);
        for (int64_t i = 0; i < k; ++i)
          for (int64_t r = 0; r < n; ++r)
            y[(b0 + i) * out + o + r] = s[i * kRows + r] + (bias ? bias[o + r] : 0.f);
      }
    }
  });
}

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& blocks,
                        const std::optional<at::Tensor>& bias, bool exact, Format f) {
  const char* name = f == kQ8_0 ? "Q8_0" : "Q4_1";
  const int64_t bytes = block_bytes(f);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.device().is_cpu(), "x must be contiguous fp32 (B, in) on the CPU");
  const int64_t batch = x.size(0), in = x.size(1);
  TORCH_CHECK(batch >= 1 && batch <= 8, "1 to 8 rows of x at a time");
  TORCH_CHECK(in % kBlock == 0, "in (x's width) must be a multiple of 32, got ", in);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.device().is_cpu(),
              name, " blocks must be a contiguous uint8 (out, in / 32 * ", bytes,
              ") tensor on the CPU");
  TORCH_CHECK(blocks.size(1) == in / kBlock * bytes, name, " blocks for in = ", in, " take ",
              in / kBlock * bytes, " bytes per row (", bytes, " per 32 weights), got ",
              blocks.size(1));
  const int64_t out = blocks.size(0);
  const float* b = row_vector(bias, out, "bias");
  at::Tensor y = at::empty({batch, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (f == kQ8_0) {
    exact ? run<kQ8_0, true>(xp, wp, b, yp, batch, in, out)
          : run<kQ8_0, false>(xp, wp, b, yp, batch, in, out);
  } else {
    exact ? run<kQ4_1, true>(xp, wp, b, yp, batch, in, out)
          : run<kQ4_1, false>(xp, wp, b, yp, batch, in, out);
  }
  return y;
}

}  // namespace

namespace kvlab {

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias, bool exact) {
  return block_linear(x, blocks, bias, exact, kQ8_0);
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias, bool exact) {
  return block_linear(x, blocks, bias, exact, kQ4_1);
}

}  // namespace kvlab

TORCH_LIBRARY_FRAGMENT(kvlab, m) {
  m.def("q8_0_linear(Tensor x, Tensor blocks, Tensor? bias=None, bool exact=False) -> Tensor",
        &kvlab::q8_0_linear);
  m.def("q4_1_linear(Tensor x, Tensor blocks, Tensor? bias=None, bool exact=False) -> Tensor",
        &kvlab::q4_1_linear);
}
