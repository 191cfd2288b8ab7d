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
// from 5.2 to 4.4 ms at 1 thread, 2.5 to 2.1-2.3 at 2 (12 layers, same process, same result).
// Same arithmetic as SDPA up to float32 rounding (scores scaled by 1/sqrt(hs), max subtracted
// before the exponent). Grouped-query attention (n_kv < nh) takes its own path: one task per
// (sequence, K/V head), up to three of the group's query heads scored per pass over the keys and
// summed per pass over the values, the rows split into runs among the threads when there are few
// K/V heads, the runs' softmaxes merged at the end (multi-head keeps the path above: bit for bit
// the results it gave before).
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

// s[t] = exp(s[t] - max) in place; returns their sum (and the max through ``max_out``).
float softmax_numerators(float* s, int64_t n, float* max_out = nullptr) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
  if (max_out) *max_out = m;
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

// Grouped-query attention (n_head > n_kv_head): one pass over a K/V head's rows serves up to kG
// of its query heads -- each key and value row read once for them, not once per query head (at
// 1024 tokens, 9 query heads over 3 K/V heads of 64 took 1.67x a read of the cache one query
// head at a time, 3 heads over 3 took 1.14x).
constexpr int kG = 3;

// s[j * n + t] = (q_j . k_t) * scale for G queries ``qs`` floats apart, n keys ``hs`` apart.
template <int G>
void group_scores(const float* q, int64_t qs, const float* k, const float* v, int64_t n,
                  int64_t hs, float scale, float* s) {
  int64_t t = 0;
#ifdef KVLAB_VECTOR
  if (hs % kLanes == 0) {
    for (; t < n; ++t) {
      const float* kt = k + t * hs;
      vec a[G];
      for (int j = 0; j < G; ++j) a[j] = vzero();
      for (int64_t c = 0; c < hs; c += kLanes) {
        _mm_prefetch(reinterpret_cast<const char*>(kt + 8 * hs + c), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(v + t * hs + c), _MM_HINT_T1);
        const vec kv = vload(kt + c);
        for (int j = 0; j < G; ++j) a[j] = vfma(vload(q + j * qs + c), kv, a[j]);
      }
      for (int j = 0; j < G; ++j) s[j * n + t] = vsum(a[j]) * scale;
    }
  }
#endif
  for (; t < n; ++t) {
    for (int j = 0; j < G; ++j) {
      float acc = 0.f;
      for (int64_t c = 0; c < hs; ++c) acc += q[j * qs + c] * k[t * hs + c];
      s[j * n + t] = acc * scale;
    }
  }
}

// o[j * hs + c] = sum_t p[j * n + t] v_t[c] for columns c0 .. c0 + NV vectors: G * NV
// accumulators in registers, one pass over the rows' columns.
#ifdef KVLAB_VECTOR
template <int G, int NV>
void group_values_cols(const float* p, const float* v, int64_t n, int64_t hs, int64_t c0,
                       float* o) {
  vec acc[G][NV];
  for (int j = 0; j < G; ++j)
    for (int l = 0; l < NV; ++l) acc[j][l] = vzero();
  for (int64_t t = 0; t < n; ++t) {
    const float* r = v + t * hs + c0;
    _mm_prefetch(reinterpret_cast<const char*>(r + 8 * hs), _MM_HINT_T0);
    for (int l = 0; l < NV; ++l) {
      const vec vv = vload(r + l * kLanes);
      for (int j = 0; j < G; ++j) acc[j][l] = vfma(vset(p[j * n + t]), vv, acc[j][l]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int l = 0; l < NV; ++l) vstore(o + j * hs + c0 + l * kLanes, acc[j][l]);
}
#endif

template <int G>
void group_values(const float* p, const float* v, int64_t n, int64_t hs, float* o) {
  int64_t c = 0;
#ifdef KVLAB_VECTOR
  for (; c + 4 * kLanes <= hs; c += 4 * kLanes) group_values_cols<G, 4>(p, v, n, hs, c, o);
  for (; c + kLanes <= hs; c += kLanes) group_values_cols<G, 1>(p, v, n, hs, c, o);
#endif
  for (; c < hs; ++c) {
    for (int j = 0; j < G; ++j) {
      float acc = 0.f;
      for (int64_t t = 0; t < n; ++t) acc += p[j * n + t] * v[t * hs + c];
      o[j * hs + c] = acc;
    }
  }
}

// One (sequence, K/V head, run of rows): for each of ``groups`` query heads from q (``qs``
// floats apart), (max score, sum of exp(score - max), sum of exp(score - max) v) into
// part[j * (hs + 2)]: a softmax over the run, merged with the other runs' afterwards.
void group_partial(const float* q, int64_t qs, int64_t groups, const float* keys,
                   const float* values, int64_t n, int64_t hs, float scale, float* s,
                   float* o, float* part) {
  for (int64_t j0 = 0; j0 < groups; j0 += kG) {
    const int g = static_cast<int>(std::min<int64_t>(kG, groups - j0));
    const float* qj = q + j0 * qs;
    if (g == 3) group_scores<3>(qj, qs, keys, values, n, hs, scale, s);
    else if (g == 2) group_scores<2>(qj, qs, keys, values, n, hs, scale, s);
    else group_scores<1>(qj, qs, keys, values, n, hs, scale, s);
    for (int j = 0; j < g; ++j) {
      float* pj = part + (j0 + j) * (hs + 2);
      pj[1] = softmax_numerators(s + j * n, n, pj);
    }
    if (g == 3) group_values<3>(s, values, n, hs, o);
    else if (g == 2) group_values<2>(s, values, n, hs, o);
    else group_values<1>(s, values, n, hs, o);
    for (int j = 0; j < g; ++j) std::copy_n(o + j * hs, hs, part + (j0 + j) * (hs + 2) + 2);
  }
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

void group_partial_rows(const float* q, int64_t qs, int64_t groups, const float* keys,
                        const float* values, int64_t n, int64_t hs, float scale, float* s,
                        float* o, float* part) {
  group_partial(q, qs, groups, keys, values, n, hs, scale, s, o, part);
}

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
  if (groups > 1) {
    // one task per (sequence, K/V head, run of rows): runs split the rows when there are fewer
    // (sequence, K/V head) pairs than twice the threads (SmolLM2 at batch 1: 3), at least 64
    // rows a run; each run's softmax is merged below (the flash-decoding sum)
    const int64_t pairs = batch * nkv, threads = at::get_num_threads();
    int64_t runs = pairs >= 2 * threads ? 1 : std::min((2 * threads + pairs - 1) / pairs,
                                                         std::max<int64_t>(1, n / 64));
    const int64_t len = (n + runs - 1) / runs;
    runs = (n + len - 1) / len;
    std::vector<float> part(pairs * runs * nh / nkv * (hs + 2) + 1);
    at::parallel_for(0, pairs * runs, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> s(kG * len), o(kG * hs);
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t pair = task / runs, r0 = task % runs * len, r1 = std::min(n, r0 + len);
        const int64_t b = pair / nkv, g = pair % nkv;
        group_partial(qp + b * q.stride(0) + g * groups * q.stride(1), q.stride(1), groups,
                      head(kb, k_buf, b, g) + r0 * hs, head(vb, v_buf, b, g) + r0 * hs, r1 - r0,
                      hs, scale, s.data(), o.data(), part.data() + task * groups * (hs + 2));
      }
    });
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t pair = b * nkv + h / groups;
        auto run = [&](int64_t r) {
          return part.data() + ((pair * runs + r) * groups + h % groups) * (hs + 2);
        };
        float m = -std::numeric_limits<float>::infinity(), total = 0.f;
        for (int64_t r = 0; r < runs; ++r) m = std::max(m, run(r)[0]);
        float* y_bh = yp + (b * nh + h) * hs;
        std::fill(y_bh, y_bh + hs, 0.f);
        for (int64_t r = 0; r < runs; ++r) {
          const float w = std::exp(run(r)[0] - m);
          total += w * run(r)[1];
          for (int64_t c = 0; c < hs; ++c) y_bh[c] += w * run(r)[2 + c];
        }
        for (int64_t c = 0; c < hs; ++c) y_bh[c] /= total;
      }
    }
    return y;
  }
  // multi-head: one task per (sequence, head)
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
