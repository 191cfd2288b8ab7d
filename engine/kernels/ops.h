// The kernels' entry points, callable from C++ as well as through ``torch.ops.kvlab`` (the fused
// decode step in layers.cpp calls them directly, without the dispatcher). See each source file.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace kvlab {

// gemv.cpp: y (B, out) = (x (B, in) @ w.T) * scale + bias, w (out, in) fp32/bf16/int8
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                  const std::optional<at::Tensor>& bias);
// gemv.cpp: the fp32 product over engine.kernels.interleave's copy of w
at::Tensor linear_interleaved(const at::Tensor& x, const at::Tensor& wi, int64_t out,
                              const std::optional<at::Tensor>& bias);
// attend.cpp: write one token's k, v at row pos of a layer's cache, attend q over rows 0..pos
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_buf,
                  at::Tensor v_buf, int64_t pos);

}  // namespace kvlab
