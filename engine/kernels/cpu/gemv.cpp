// Matrix-vector products for a decode step on a CPU: y = (x @ W^T) * scale + bias for 1 to 4
// rows of x, with W in nn.Linear's [out, in] layout stored as fp32, bf16 or int8 (then with one
// fp32 scale per output row). A decode step is memory-bound, so what matters is streaming W
// once, contiguously, on every core: each thread takes a range of output rows and, four rows at
// a time, reads each row front to back into two vector accumulators per row (eight independent
// FMA chains hide the FMA latency). The four rows (12 KB for gpt2's 768-wide fp32 rows) stay in
// L1 while each row of x is multiplied with them. AVX-512 and AVX2+FMA paths are chosen at
// compile time (-march=native); a plain loop covers everything else. Results differ from
// F.linear's only by float32 summation order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "ops.h"
#include "simd.h"

namespace {

using namespace kvlab;

constexpr int64_t kRows = 4;   // output rows computed together
constexpr int64_t kGrain = 16; // groups of kRows rows per parallel task, at least

// Dot products of one x row with kRows consecutive W rows starting at row r.
template <typename W>
inline void dots(const float* x, const W* w, int64_t in, float out[kRows]) {
  int64_t i = 0;
#ifdef KVLAB_VECTOR
  vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  vec b0 = vzero(), b1 = vzero(), b2 = vzero(), b3 = vzero();
  const W* r0 = w;
  const W* r1 = w + in;
  const W* r2 = w + 2 * in;
  const W* r3 = w + 3 * in;
  for (; i + 2 * kLanes <= in; i += 2 * kLanes) {
    // the next group's rows, the same columns: their lines arrive while these are multiplied
    // (the hardware prefetcher alone left a third of the bandwidth unused; bench_kernels)
    _mm_prefetch(reinterpret_cast<const char*>(r3 + in + i), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(r3 + 2 * in + i), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(r3 + 3 * in + i), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(r3 + 4 * in + i), _MM_HINT_T0);
    vec x0 = vload(x + i), x1 = vload(x + i + kLanes);
    a0 = vfma(vload(r0 + i), x0, a0); b0 = vfma(vload(r0 + i + kLanes), x1, b0);
    a1 = vfma(vload(r1 + i), x0, a1); b1 = vfma(vload(r1 + i + kLanes), x1, b1);
    a2 = vfma(vload(r2 + i), x0, a2); b2 = vfma(vload(r2 + i + kLanes), x1, b2);
    a3 = vfma(vload(r3 + i), x0, a3); b3 = vfma(vload(r3 + i + kLanes), x1, b3);
  }
  out[0] = vsum(a0) + vsum(b0);
  out[1] = vsum(a1) + vsum(b1);
  out[2] = vsum(a2) + vsum(b2);
  out[3] = vsum(a3) + vsum(b3);
#else
  for (int r = 0; r < kRows; ++r) out[r] = 0.f;
#endif
  for (; i < in; ++i)
    for (int r = 0; r < kRows; ++r) out[r] += x[i] * scalar(w + r * in, i);
}

template <typename W>
inline float dot1(const float* x, const W* w, int64_t in) {
  float s = 0.f;
  for (int64_t i = 0; i < in; ++i) s += x[i] * scalar(w, i);
  return s;
}

template <typename W>
void run(const float* x, const W* w, const float* scale, const float* bias, float* y,
         int64_t batch, int64_t in, int64_t out) {
  const int64_t groups = (out + kRows - 1) / kRows;
  at::parallel_for(0, groups, kGrain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t o = g * kRows;
      const int64_t n = std::min(kRows, out - o);
      for (int64_t b = 0; b < batch; ++b) {
        float s[kRows];
        if (n == kRows) {
          dots(x + b * in, w + o * in, in, s);
        } else {
          for (int64_t r = 0; r < n; ++r) s[r] = dot1(x + b * in, w + (o + r) * in, in);
        }
        for (int64_t r = 0; r < n; ++r) {
          float v = s[r];
          if (scale) v *= scale[o + r];
          if (bias) v += bias[o + r];
          y[b * out + o + r] = v;
        }
      }
    }
  });
}

// The same product over fp32 weights repacked so that a group of kRows rows is ONE contiguous
// stream: wi (groups, in / kStrip, kRows, kStrip), the rows' strips of kStrip columns side by
// side (``engine.kernels.cpu.interleave`` makes it, rows padded to a multiple of kRows with zeros).
// Each thread then reads its range of groups front to back -- one sequential stream instead of
// kRows streams kRows rows apart. Same sums as ``dots``: per row, kStrip columns at a time.
constexpr int64_t kStrip = 16;

void run_interleaved(const float* x, const float* wi, const float* bias, float* y, int64_t batch,
                     int64_t in, int64_t out) {
  const int64_t groups = (out + kRows - 1) / kRows, strips = in / kStrip;
  const int64_t group_size = strips * kRows * kStrip;
  at::parallel_for(0, groups, kGrain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const float* w = wi + g * group_size;
      for (int64_t b = 0; b < batch; ++b) {
        const float* xb = x + b * in;
        float s[kRows];
#ifdef KVLAB_VECTOR
        vec acc[kRows][kStrip / kLanes];
        for (int r = 0; r < kRows; ++r)
          for (int64_t l = 0; l < kStrip / kLanes; ++l) acc[r][l] = vzero();
        for (int64_t t = 0; t < strips; ++t) {
          const float* blk = w + t * kRows * kStrip;
          for (int64_t l = 0; l < kStrip / kLanes; ++l) {
            const vec xv = vload(xb + t * kStrip + l * kLanes);
            for (int r = 0; r < kRows; ++r)
              acc[r][l] = vfma(vload(blk + r * kStrip + l * kLanes), xv, acc[r][l]);
          }
        }
        for (int r = 0; r < kRows; ++r) {
          s[r] = 0.f;
          for (int64_t l = 0; l < kStrip / kLanes; ++l) s[r] += vsum(acc[r][l]);
        }
#else
        for (int r = 0; r < kRows; ++r) {
          s[r] = 0.f;
          for (int64_t t = 0; t < strips; ++t)
            for (int64_t j = 0; j < kStrip; ++j)
              s[r] += xb[t * kStrip + j] * w[(t * kRows + r) * kStrip + j];
        }
#endif
        const int64_t o = g * kRows, n = std::min(kRows, out - o);
        for (int64_t r = 0; r < n; ++r) y[b * out + o + r] = s[r] + (bias ? bias[o + r] : 0.f);
      }
    }
  });
}

}  // namespace

namespace kvlab {

at::Tensor linear_interleaved(const at::Tensor& x, const at::Tensor& wi, int64_t out,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.device().is_cpu(), "x must be contiguous fp32 (B, in) on the CPU");
  TORCH_CHECK(wi.dim() == 4 && wi.size(2) == kRows && wi.size(3) == kStrip &&
                  wi.scalar_type() == at::kFloat && wi.is_contiguous(),
              "wi must be engine.kernels.cpu.interleave's (groups, in/16, 4, 16) fp32");
  const int64_t batch = x.size(0), in = x.size(1);
  TORCH_CHECK(batch >= 1 && batch <= 8, "1 to 8 rows of x at a time");
  TORCH_CHECK(in == wi.size(1) * kStrip && out > (wi.size(0) - 1) * kRows &&
                  out <= wi.size(0) * kRows, "x's width or out does not match wi");
  const float* b = row_vector(bias, out, "bias");
  at::Tensor y = at::empty({batch, out}, x.options());
  run_interleaved(x.data_ptr<float>(), wi.data_ptr<float>(), b, y.data_ptr<float>(), batch, in,
                  out);
  return y;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x (B, in) and w (out, in) must be 2-D");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32");
  TORCH_CHECK(w.is_contiguous() && x.size(1) == w.size(1), "w must be contiguous (out, in)");
  const int64_t batch = x.size(0), in = x.size(1), out = w.size(0);
  TORCH_CHECK(batch >= 1 && batch <= 8, "1 to 8 rows of x at a time");
  const float* s = row_vector(scale, out, "scale");
  const float* b = row_vector(bias, out, "bias");
  at::Tensor y = at::empty({batch, out}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kFloat: run(xp, w.data_ptr<float>(), s, b, yp, batch, in, out); break;
    case at::kBFloat16: run(xp, w.data_ptr<c10::BFloat16>(), s, b, yp, batch, in, out); break;
    case at::kChar:
      TORCH_CHECK(s != nullptr, "int8 weights need their per-row scales");
      run(xp, w.data_ptr<int8_t>(), s, b, yp, batch, in, out);
      break;
    default: TORCH_CHECK(false, "weights must be float32, bfloat16 or int8");
  }
  return y;
}

}  // namespace kvlab

TORCH_LIBRARY(kvlab, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? scale, Tensor? bias) -> Tensor", &kvlab::linear);
  m.def("linear_interleaved(Tensor x, Tensor wi, int out, Tensor? bias) -> Tensor",
        &kvlab::linear_interleaved);
}
