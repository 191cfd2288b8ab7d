// The kernels' entry points, callable from C++ as well as through ``torch.ops.kvlab`` (the fused
// decode step in layers.cpp calls them directly, without the dispatcher), and the argument check
// they share. See each source file.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace kvlab {

// An optional (out,) fp32 argument of a product (its bias, int8's scale per row): its data, or
// nullptr when absent; anything else is refused, naming ``what``.
inline const float* row_vector(const std::optional<at::Tensor>& t, int64_t out, const char* what) {
  if (!t) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == out && t->is_contiguous(), what,
              " must be (out,) contiguous fp32");
  return t->data_ptr<float>();
}

// gemv.cpp: y (B, out) = (x (B, in) @ w.T) * scale + bias, w (out, in) fp32/bf16/int8
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                  const std::optional<at::Tensor>& bias);
// gemv.cpp: the fp32 product over engine.kernels.cpu.interleave's copy of w
at::Tensor linear_interleaved(const at::Tensor& x, const at::Tensor& wi, int64_t out,
                              const std::optional<at::Tensor>& bias);
// attend.cpp: write one token's k, v (B, n_kv, hs) at row pos of a layer's cache (B, n_kv, T, hs),
// attend q (B, nh, hs) over rows 0..pos, query head h reading K/V head h / (nh / n_kv)
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_buf,
                  at::Tensor v_buf, int64_t pos);
// attend.cpp: one (sequence, K/V head)'s softmax over n contiguous rows ``hs`` floats apart, for
// ``groups`` query heads ``qs`` floats apart: part[j * (hs + 2)] = (max score, sum of
// exp(score - max), sum of exp(score - max) v); s holds 3 * n floats, o 3 * hs (scratch)
void group_partial_rows(const float* q, int64_t qs, int64_t groups, const float* keys,
                        const float* values, int64_t n, int64_t hs, float scale, float* s,
                        float* o, float* part);
// paged.cpp: y (B, nh, hs), query b over rows 0..lengths[b]-1 of its block table, read in place
at::Tensor paged_attend(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& table, const at::Tensor& lengths);
// blocks.cpp: y (B, out) = x (B, in) @ W.T + bias over GGUF Q8_0 / Q4_1 blocks (out, in/32*bytes)
// as stored; exact: blocks widened to fp32, else x rounded to int8 per 32 (see blocks.cpp)
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias, bool exact);
at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias, bool exact);

}  // namespace kvlab
