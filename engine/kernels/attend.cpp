// One new token's attention over a preallocated KV cache, with the cache write, in one call:
// the decode step's attention for modes 8, 12 and 13 on a CPU.
//
//   attend(q, k, v, k_buf, v_buf, pos) -> y (B, nh, hs)
//     q        (B, nh, hs) fp32, the new token's queries
//     k, v     (B, n_kv, hs) fp32, its keys and values: n_kv = nh (multi-head, GPT-2) or a divisor
//              of nh (grouped-query attention, Llama: query head h reads K/V head h / (nh / n_kv))
//              (views of a fused q|k|v output are fine: only the last dimension must be contiguous)
//     k_buf, v_buf  (B, n_kv, T, hs) one layer's cache, rows contiguous; k and v are written at row
//              ``pos``, then the query attends over rows 0..pos (the new token sees itself: no mask)
//
// Any head size: the vector paths take hs a multiple of the vector width (8 floats, 16 with
// AVX-512; the value sum's one-pass loop up to 8 vectors: 64 with AVX2, 128 with AVX-512, wider
// heads one lane group at a time), everything else the scalar tails.
//
// Why: at one query, ATen's flash-attention kernel pays block set-up per call and reads the cache
// in tiles meant for many queries (12 calls took 1.7 ms at 128 cached tokens and 3.9 ms at 512
// with 2 threads here, against a 37 MB read of gpt2's whole cache at 512 that streams in under
// 2 ms). Here each (sequence, head) is one task on torch's thread pool: the scores q.k_t over the
// head's contiguous keys, a softmax with a vector exp, then the weighted sum of its values --
// every cached row read once, front to back, with software prefetch two rounds ahead (and the
// values asked for while their keys are scored): on the Xeon a cold cache at 512 tokens went
// from 5.2 to 4.4 ms at 1 thread, 2.5 to 2.1-2.3 at 2 (12 layers, same process, same result). Same arithmetic as SDPA up to float32 rounding
// (scores scaled by 1/sqrt(hs), max subtracted before the exponent).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace kvlab;

// s[t] = (q . k_t) * scale for t < n, the keys ``hs`` floats apart.
void scores(const float* q, const float* k, const float* v, int64_t n, int64_t hs, float scale,
            float* s) {
  int64_t t = 0;
#ifdef KVLAB_VECTOR
  if (hs % kLanes == 0) {
    for (; t + 4 <= n; t += 4) {  // four keys at once: four independent FMA chains
      const float* k0 = k + t * hs;
      vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
      for (int64_t j = 0; j < hs; j += kLanes) {
        // keys two rounds ahead (2 KB for gpt2's 64-wide heads): a cold cache streams in while
        // these are multiplied; the hardware prefetcher alone left the scores at about half a
        // sum()'s speed (docs/engine-speed.md)
        _mm_prefetch(reinterpret_cast<const char*>(k0 + 8 * hs + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(k0 + 9 * hs + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(k0 + 10 * hs + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(k0 + 11 * hs + j), _MM_HINT_T0);
        const float* v0 = v + t * hs;  // the values these keys weigh, needed after the softmax
        _mm_prefetch(reinterpret_cast<const char*>(v0 + j), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(v0 + hs + j), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(v0 + 2 * hs + j), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(v0 + 3 * hs + j), _MM_HINT_T1);
        vec qj = vload(q + j);
        a0 = vfma(qj, vload(k0 + j), a0);
        a1 = vfma(qj, vload(k0 + hs + j), a1);
        a2 = vfma(qj, vload(k0 + 2 * hs + j), a2);
        a3 = vfma(qj, vload(k0 + 3 * hs + j), a3);
      }
      s[t] = vsum(a0) * scale;
      s[t + 1] = vsum(a1) * scale;
      s[t + 2] = vsum(a2) * scale;
      s[t + 3] = vsum(a3) * scale;
    }
  }
#endif
  for (; t < n; ++t) {
    float acc = 0.f;
    for (int64_t j = 0; j < hs; ++j) acc += q[j] * k[t * hs + j];
    s[t] = acc * scale;
  }
}

// s[t] = exp(s[t] - max) in place; returns their sum.
float softmax_numerators(float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
  float total = 0.f;
  int64_t t = 0;
#ifdef KVLAB_VECTOR
  const vec neg = vset(-m);
  vec acc = vzero();
  for (; t + kLanes <= n; t += kLanes) {
    vec e = vexp(vadd(vload(s + t), neg));
    vstore(s + t, e);
    acc = vadd(acc, e);
  }
  total = vsum(acc);
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    total += s[t];
  }
  return total;
}

// y = sum_t p[t] v_t / total over n value rows ``hs`` floats apart.
void weighted_values(const float* p, const float* v, int64_t n, int64_t hs, float total,
                     float* y) {
  std::fill(y, y + hs, 0.f);
  int64_t j0 = 0;
#ifdef KVLAB_VECTOR
  constexpr int64_t kMaxVecs = 8;  // heads up to 8 vectors wide (128 floats with AVX-512)
  if (hs % kLanes == 0 && hs / kLanes <= kMaxVecs) {
    // one pass over the value rows, each row's vectors in turn, the same two chains (even and
    // odd rows) per lane group as below: the same sums, each row read once, front to back
    const int64_t nv = hs / kLanes;
    vec acc0[kMaxVecs], acc1[kMaxVecs];
    for (int64_t l = 0; l < nv; ++l) acc0[l] = acc1[l] = vzero();
    int64_t t = 0;
    for (; t + 2 <= n; t += 2) {
      const float* r = v + t * hs;
      const vec p0 = vset(p[t]), p1 = vset(p[t + 1]);
      for (int64_t l = 0; l < nv; ++l) {
        _mm_prefetch(reinterpret_cast<const char*>(r + 8 * hs + l * kLanes), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(r + 9 * hs + l * kLanes), _MM_HINT_T0);
        acc0[l] = vfma(p0, vload(r + l * kLanes), acc0[l]);
        acc1[l] = vfma(p1, vload(r + hs + l * kLanes), acc1[l]);
      }
    }
    if (t < n)
      for (int64_t l = 0; l < nv; ++l) acc0[l] = vfma(vset(p[t]), vload(v + t * hs + l * kLanes), acc0[l]);
    for (int64_t l = 0; l < nv; ++l) vstore(y + l * kLanes, vadd(acc0[l], acc1[l]));
    j0 = hs;
  }
  for (; j0 + kLanes <= hs; j0 += kLanes) {  // one lane group of y at a time, kept in a register
    vec acc0 = vzero(), acc1 = vzero();
    int64_t t = 0;
    for (; t + 2 <= n; t += 2) {
      acc0 = vfma(vset(p[t]), vload(v + t * hs + j0), acc0);
      acc1 = vfma(vset(p[t + 1]), vload(v + (t + 1) * hs + j0), acc1);
    }
    if (t < n) acc0 = vfma(vset(p[t]), vload(v + t * hs + j0), acc0);
    vstore(y + j0, vadd(acc0, acc1));
  }
#endif
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = j0; j < hs; ++j) y[j] += p[t] * v[t * hs + j];
  const float inv = 1.f / total;
  for (int64_t j = 0; j < hs; ++j) y[j] *= inv;
}

void check_new(const at::Tensor& t, const char* name, const char* like, int64_t batch,
               int64_t heads, int64_t hs) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == batch && t.size(1) == heads && t.size(2) == hs,
              name, " must be ", like);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.stride(2) == 1,
              name, " must be fp32 on the CPU with its last dimension contiguous");
}

}  // namespace

namespace kvlab {

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_buf,
                  at::Tensor v_buf, int64_t pos) {
  TORCH_CHECK(q.dim() == 3, "q must be (B, nh, hs)");
  TORCH_CHECK(k.dim() == 3, "k must be (B, n_kv, hs)");
  const int64_t batch = q.size(0), nh = q.size(1), hs = q.size(2), nkv = k.size(1);
  check_new(q, "q", "(B, nh, hs)", batch, nh, hs);
  TORCH_CHECK(nkv >= 1 && nh % nkv == 0, "k and v's heads (", nkv,
              ") must divide q's (", nh, "): grouped-query attention");
  check_new(k, "k", "(B, n_kv, hs) like q's B and hs", batch, nkv, hs);
  check_new(v, "v", "(B, n_kv, hs) like k", batch, nkv, hs);
  for (const at::Tensor* buf : {&k_buf, &v_buf}) {
    TORCH_CHECK(buf->dim() == 4 && buf->size(0) == batch && buf->size(1) == nkv &&
                    buf->size(3) == hs, "k_buf and v_buf must be (B, n_kv, T, hs) like k");
    TORCH_CHECK(buf->scalar_type() == at::kFloat && buf->device().is_cpu() &&
                    buf->stride(3) == 1 && buf->stride(2) == hs,
                "k_buf and v_buf must be fp32 on the CPU with contiguous (T, hs) rows");
  }
  TORCH_CHECK(pos >= 0 && pos < k_buf.size(2) && v_buf.size(2) == k_buf.size(2),
              "pos must be a row of the cache: 0 <= pos < T");
  at::Tensor y = at::empty({batch, nh, hs}, q.options());
  const int64_t n = pos + 1, groups = nh / nkv;
  const float scale = 1.f / std::sqrt(static_cast<float>(hs));
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float *kb = k_buf.data_ptr<float>(), *vb = v_buf.data_ptr<float>(), *yp = y.data_ptr<float>();
  auto head = [&](float* buf, const at::Tensor& t, int64_t b, int64_t g) {
    return buf + b * t.stride(0) + g * t.stride(1);
  };
  // the new rows first: with groups > 1 several tasks read one K/V head (the same values either
  // way, so multi-head results are unchanged)
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t g = 0; g < nkv; ++g) {
      std::copy_n(kp + b * k.stride(0) + g * k.stride(1), hs, head(kb, k_buf, b, g) + pos * hs);
      std::copy_n(vp + b * v.stride(0) + g * v.stride(1), hs, head(vb, v_buf, b, g) + pos * hs);
    }
  }
  // one task per (sequence, query head); a group's query heads are neighbours, so a thread's
  // range mostly shares its K/V heads (read again from its own cache)
  at::parallel_for(0, batch * nh, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(n);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / nh, h = task % nh;
      const float* keys = head(kb, k_buf, b, h / groups);
      const float* values = head(vb, v_buf, b, h / groups);
      scores(qp + b * q.stride(0) + h * q.stride(1), keys, values, n, hs, scale, s.data());
      const float total = softmax_numerators(s.data(), n);
      weighted_values(s.data(), values, n, hs, total, yp + task * hs);
    }
  });
  return y;
}

}  // namespace kvlab

TORCH_LIBRARY_FRAGMENT(kvlab, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor(a!) k_buf, Tensor(b!) v_buf, int pos) -> Tensor",
        &kvlab::attend);
}
