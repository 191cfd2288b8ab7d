// Paged decode attention on a CPU: one query per sequence over that sequence's rows in a block
// pool, read where they lie through its block table (the serving engine's batched step).
//
//   paged_attend(q, k_pool, v_pool, table, lengths) -> y (B, nh, hs)
//     q        (B, nh, hs) fp32, one new token per sequence (its row already written to the pool)
//     k_pool, v_pool  (n_kv, n_blocks, bt, hs) fp32 contiguous: one layer of the pool
//              (``engine.cache.blocks.BlockPool.k[layer]``); row t of sequence b is row t % bt of
//              block table[b, t / bt]
//     table    (B, M) int64 contiguous, each sequence's block ids from position 0 (entries past
//              its length are not read: -1 or anything)
//     lengths  (B,) int64: sequence b attends over its rows 0..lengths[b]-1 (its own included)
//
// Why: gathering each sequence's blocks into a contiguous copy before attention (torch's way: its
// attention reads dense tensors) writes and reads again every row every step; at batch 64 and 512
// tokens that is 1.5 GB of copies a step for SmolLM2, three times what the weights cost. Here a
// run of consecutive block ids is one contiguous stretch of rows for a K/V head (blocks are
// handed out in order, so most tables are a few runs): attend.cpp's grouped pass (every query
// head of a group scored against each key row read once) goes over each run in place, and the
// runs' softmaxes are merged (the flash-decoding sum). A (sequence, K/V head) is one task; when
// there are fewer of them than twice the threads (batch 1), each one's blocks are split among
// tasks, merged at the end. Same arithmetic as SDPA up to float32 rounding.
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

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// acc (max, total, o[hs]) merged with one more partial of the same layout.
void merge(float* acc, const float* part, int64_t hs) {
  if (part[1] == 0.f) return;  // an empty partial
  if (acc[1] == 0.f) {
    std::copy_n(part, hs + 2, acc);
    return;
  }
  const float m = std::max(acc[0], part[0]);
  const float wa = std::exp(acc[0] - m), wp = std::exp(part[0] - m);
  acc[0] = m;
  acc[1] = acc[1] * wa + part[1] * wp;
  for (int64_t c = 0; c < hs; ++c) acc[2 + c] = acc[2 + c] * wa + part[2 + c] * wp;
}

}  // namespace

namespace kvlab {

at::Tensor paged_attend(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& table, const at::Tensor& lengths) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.device().is_cpu() &&
                  q.stride(2) == 1,
              "q must be (B, nh, hs) fp32 on the CPU with its last dimension contiguous");
  const int64_t batch = q.size(0), nh = q.size(1), hs = q.size(2);
  for (const at::Tensor* p : {&k_pool, &v_pool}) {
    TORCH_CHECK(p->dim() == 4 && p->size(3) == hs && p->scalar_type() == at::kFloat &&
                    p->device().is_cpu() && p->is_contiguous(),
                "k_pool and v_pool must be contiguous fp32 (n_kv, n_blocks, bt, hs) like q's hs");
    TORCH_CHECK(p->sizes() == k_pool.sizes(), "k_pool and v_pool must have one shape");
  }
  const int64_t nkv = k_pool.size(0), nblocks = k_pool.size(1), bt = k_pool.size(2);
  TORCH_CHECK(nkv >= 1 && nh % nkv == 0, "the pool's K/V heads (", nkv, ") must divide q's (",
              nh, "): grouped-query attention");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == batch && table.scalar_type() == at::kLong &&
                  table.is_contiguous(),
              "table must be (B, M) contiguous int64, one row per query");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == batch &&
                  lengths.scalar_type() == at::kLong && lengths.is_contiguous(),
              "lengths must be (B,) contiguous int64");
  const int64_t width = table.size(1);
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) {  // checked here: nothing may throw inside the threads
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= width * bt, "sequence ", b, "'s length ", lp[b],
                " must be 1..", width * bt, " (its table's blocks x ", bt, " rows)");
    for (int64_t j = 0; j < (lp[b] + bt - 1) / bt; ++j)
      TORCH_CHECK(tp[b * width + j] >= 0 && tp[b * width + j] < nblocks, "sequence ", b,
                  "'s block ", j, " is ", tp[b * width + j], "; allowed: 0..", nblocks - 1);
    longest = std::max(longest, lp[b]);
  }
  at::Tensor y = at::empty({batch, nh, hs}, q.options());
  const int64_t groups = nh / nkv, pairs = batch * nkv, threads = at::get_num_threads();
  // each (sequence, K/V head)'s blocks split among `splits` tasks when the pairs are too few to
  // keep the threads busy (at least 64 rows a task)
  const int64_t splits =
      pairs >= 2 * threads ? 1
                           : std::max<int64_t>(1, std::min((2 * threads + pairs - 1) / pairs,
                                                           longest / 64));
  const int64_t stride = groups * (hs + 2);  // one task's partials
  std::vector<float> part(pairs * splits * stride);
  const float scale = 1.f / std::sqrt(static_cast<float>(hs));
  const float *qp = q.data_ptr<float>(), *kp = k_pool.data_ptr<float>(),
              *vp = v_pool.data_ptr<float>();
  const int64_t head_rows = nblocks * bt * hs;  // floats of one K/V head's blocks
  at::parallel_for(0, pairs * splits, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s, o(3 * hs), tmp(stride);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t pair = task / splits, sp = task % splits, b = pair / nkv, g = pair % nkv;
      const int64_t len = lp[b], used = (len + bt - 1) / bt, per = (used + splits - 1) / splits;
      const int64_t j0 = std::min(used, sp * per), j1 = std::min(used, j0 + per);
      float* acc = part.data() + task * stride;
      for (int64_t h = 0; h < groups; ++h) {
        acc[h * (hs + 2)] = kNegInf;
        std::fill_n(acc + h * (hs + 2) + 1, hs + 1, 0.f);
      }
      const int64_t* ids = tp + b * width;
      for (int64_t j = j0; j < j1;) {
        int64_t run = 1;  // consecutive block ids: one contiguous stretch of rows
        while (j + run < j1 && ids[j + run] == ids[j] + run) ++run;
        const int64_t rows = std::min((j + run) * bt, len) - j * bt;
        if (static_cast<int64_t>(s.size()) < 3 * rows) s.resize(3 * rows);
        const int64_t at_row = g * head_rows + ids[j] * bt * hs;
        group_partial_rows(qp + b * q.stride(0) + g * groups * q.stride(1), q.stride(1), groups,
                           kp + at_row, vp + at_row, rows, hs, scale, s.data(), o.data(),
                           tmp.data());
        for (int64_t h = 0; h < groups; ++h)
          merge(acc + h * (hs + 2), tmp.data() + h * (hs + 2), hs);
        j += run;
      }
    }
  });
  float* yp = y.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t pair = b * nkv + h / groups;
      float* acc = part.data() + (pair * splits) * stride + (h % groups) * (hs + 2);
      for (int64_t sp = 1; sp < splits; ++sp)
        merge(acc, part.data() + (pair * splits + sp) * stride + (h % groups) * (hs + 2), hs);
      float* y_bh = yp + (b * nh + h) * hs;
      const float inv = 1.f / acc[1];
      for (int64_t c = 0; c < hs; ++c) y_bh[c] = acc[2 + c] * inv;
    }
  }
  return y;
}

}  // namespace kvlab

TORCH_LIBRARY_FRAGMENT(kvlab, m) {
  m.def("paged_attend(Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, Tensor lengths) "
        "-> Tensor",
        &kvlab::paged_attend);
}
