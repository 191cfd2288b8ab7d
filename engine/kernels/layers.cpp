// A whole decode step after the embedding, in one call: every block and the output projection
// for 1 to 8 new tokens (one per sequence) over a preallocated fp32 KV cache on a CPU.
//
//   decode_layers(x, ln_w, ln_b, w, scale, bias, kind, out, k_buf, v_buf, pos, n_head, eps)
//       -> logits (B, vocab)
//     x        (B, C) fp32, the new tokens' embeddings (token + position)
//     ln_w/b   2L + 1 LayerNorms: ln_1 and ln_2 of each block, then ln_f
//     w, scale, bias, kind, out
//              4L + 1 products: c_attn, attn.c_proj, c_fc, mlp.c_proj of each block, then the
//              output projection; each one of engine.step's ways (``kind``):
//                0  kernel       w (out, in) fp32/bf16/int8 (+ scale): kvlab::linear
//                1  interleaved  w engine.kernels.interleave's copy: kvlab::linear_interleaved
//                2  packed       w (in, out): addmm / mm
//                3  chunked      w (chunks, in, width), bias (chunks, 1, width): baddbmm / bmm
//                4  linear       w (out, in): at::linear
//              ``out`` the product's width (the chunked and interleaved copies are padded)
//     k_buf, v_buf  (L, B, nh, T, hs), the new rows written at ``pos`` (kvlab::attend)
//
// Why: engine.step.decode_step runs the same ops from Python, and on a 2-core CPU the Python
// and dispatcher around them cost about 1 ms of a 14-40 ms step (a step with every matrix
// product replaced by a no-op took 1.4 ms at 128 tokens, 0.4 of it the attention). Here the
// same ATen calls and kernels run back to back: the same arithmetic in the same order, so the
// logits equal decode_step's bit for bit (tests/test_fused_step.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"

namespace {

enum Kind : int64_t { kKernel = 0, kInterleaved = 1, kPacked = 2, kChunked = 3, kLinear = 4 };

at::Tensor product(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                   const std::optional<at::Tensor>& bias, int64_t kind, int64_t out) {
  switch (kind) {
    case kKernel: return kvlab::linear(x, w, scale, bias);
    case kInterleaved: return kvlab::linear_interleaved(x, w, out, bias);
    case kPacked: return bias ? at::addmm(*bias, x, w) : at::mm(x, w);
    case kChunked: {
      const int64_t chunks = w.size(0), batch = x.size(0);
      at::Tensor xs = x.unsqueeze(0).expand({chunks, batch, x.size(1)});
      at::Tensor y = bias ? at::baddbmm(*bias, xs, w) : at::bmm(xs, w);  // (chunks, B, width)
      y = batch == 1 ? y.view({1, -1}) : y.transpose(0, 1).reshape({batch, -1});
      return y.size(1) == out ? y : y.narrow(1, 0, out);
    }
    case kLinear: return at::linear(x, w, bias);
    default: TORCH_CHECK(false, "unknown product kind ", kind, ": 0 to 4 are known");
  }
}

at::Tensor decode_layers(const at::Tensor& x_in, at::TensorList ln_w, at::TensorList ln_b,
                         const c10::List<std::optional<at::Tensor>>& w,
                         const c10::List<std::optional<at::Tensor>>& scale,
                         const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef kind,
                         at::IntArrayRef out, const at::Tensor& k_buf, const at::Tensor& v_buf,
                         int64_t pos, int64_t n_head, double eps) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "x must be fp32 (B, C) on the CPU");
  const int64_t layers = k_buf.size(0), batch = x_in.size(0), n_embd = x_in.size(1);
  TORCH_CHECK(batch >= 1 && batch <= 8, "1 to 8 sequences at a time");
  TORCH_CHECK(ln_w.size() == static_cast<size_t>(2 * layers + 1) && ln_b.size() == ln_w.size(),
              "2L + 1 LayerNorms (ln_1, ln_2 per block, then ln_f)");
  const size_t products = static_cast<size_t>(4 * layers + 1);
  TORCH_CHECK(w.size() == products && scale.size() == products && bias.size() == products &&
                  kind.size() == products && out.size() == products,
              "4L + 1 products (c_attn, attn.c_proj, c_fc, mlp.c_proj per block, then the head)");
  TORCH_CHECK(n_embd % n_head == 0, "n_embd must be a multiple of n_head");
  const int64_t hs = n_embd / n_head;
  auto mul = [&](const at::Tensor& h, size_t j) {
    const std::optional<at::Tensor> wj = w.get(j);
    TORCH_CHECK(wj.has_value(), "product ", j, " has no weight");
    return product(h, *wj, scale.get(j), bias.get(j), kind[j], out[j]);
  };
  auto norm = [&](const at::Tensor& h, size_t j) {
    return at::layer_norm(h, {n_embd}, ln_w[j], ln_b[j], eps);
  };
  at::Tensor x = x_in;
  for (int64_t i = 0; i < layers; ++i) {
    at::Tensor qkv = mul(norm(x, 2 * i), 4 * i).reshape({batch, 3, n_head, hs});  // (B, 3, nh, hs)
    at::Tensor y = kvlab::attend(qkv.select(1, 0), qkv.select(1, 1), qkv.select(1, 2),
                                 k_buf.select(0, i), v_buf.select(0, i), pos);  // (B, nh, hs)
    x = x + mul(y.view({batch, n_embd}), 4 * i + 1);
    at::Tensor f = mul(norm(x, 2 * i + 1), 4 * i + 2);
    x = x + mul(at::gelu(f, "tanh"), 4 * i + 3);
  }
  return mul(norm(x, 2 * layers), 4 * layers);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvlab, m) {
  m.def("decode_layers(Tensor x, Tensor[] ln_w, Tensor[] ln_b, Tensor?[] w, Tensor?[] scale, "
        "Tensor?[] bias, int[] kind, int[] out, Tensor(a!) k_buf, Tensor(b!) v_buf, int pos, "
        "int n_head, float eps) -> Tensor",
        &decode_layers);
}
