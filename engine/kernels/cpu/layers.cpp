// A whole decode step after the embedding, in one call: every block and the output projection
// for 1 to 8 new tokens (one per sequence) over a preallocated fp32 KV cache on a CPU.
//
//   decode_layers(x, ln_w, ln_b, w, scale, bias, kind, out, k_buf, v_buf, pos, n_head, eps)
//       -> logits (B, vocab)                                                       (GPT-2)
//     x        (B, C) fp32, the new tokens' embeddings (token + position)
//     ln_w/b   2L + 1 LayerNorms: ln_1 and ln_2 of each block, then ln_f
//     w, scale, bias, kind, out
//              4L + 1 products: c_attn, attn.c_proj, c_fc, mlp.c_proj of each block, then the
//              output projection; each one of engine.models.gpt2.step's ways (``kind``):
//                0  kernel       w (out, in) fp32/bf16/int8 (+ scale): kvlab::linear
//                1  interleaved  w engine.kernels.cpu.interleave's copy: kvlab::linear_interleaved
//                2  packed       w (in, out): addmm / mm
//                3  chunked      w (chunks, in, width), bias (chunks, 1, width): baddbmm / bmm
//                4  linear       w (out, in): at::linear
//                5  Q8_0         w GGUF Q8_0 blocks (out, in/32*34) uint8: kvlab::q8_0_linear,
//                                x rounded to int8 per 32 (blocks.cpp)
//                6  Q4_1         w GGUF Q4_1 blocks (out, in/32*20) uint8: kvlab::q4_1_linear,
//                                x rounded to int8 per 32
//                7, 8            Q8_0, Q4_1 with fp32 x (``exact``)
//              ``out`` the product's width (the chunked and interleaved copies are padded)
//     k_buf, v_buf  (L, B, nh, T, hs), the new rows written at ``pos`` (kvlab::attend)
//
//   decode_layers_llama(x, norm_w, w, scale, bias, kind, out, k_buf, v_buf, cos, sin, pos,
//                       n_head, n_kv_head, eps, neox=True) -> logits (B, vocab) (Llama family)
//     x        (B, C) fp32, the new tokens' embeddings
//     norm_w   2L + 1 RMSNorm weights (C,): before attention and before the MLP of each block,
//              then the final one; y = x / sqrt(mean(x^2) + eps) * w
//     w, scale, bias, kind, out
//              7L + 1 products (q, k, v, o, gate, up, down per block, then the head) or 4L + 1
//              (q|k|v as one product of n_head + 2 n_kv_head heads' rows, o, gate|up as one of
//              2 * ffn rows, gate first, down), each of any kind above
//     k_buf, v_buf  (L, B, n_kv_head, T, hs): hs is the head size
//     cos, sin (T', hs / 2) or (T', hs) fp32 (then the first hs / 2 columns are read), T' > pos:
//              the rotary table; RoPE in the NEOX / rotate_half layout -- channel i of a head
//              pairs with channel i + hs / 2: (a, b) -> (a cos_i - b sin_i, b cos_i + a sin_i) --
//              or, with neox=False, channel 2i with 2i + 1 (llama.cpp's layout for the llama
//              architecture: its converter permutes the q and k rows of HF's weights for it)
//     per block: RMSNorm, q k v, RoPE on q and k at ``pos``, grouped-query attention (query head
//     h reads K/V head h / (n_head / n_kv_head)), o, residual; RMSNorm, gate and up,
//     SiLU(gate) * up, down, residual; then the final RMSNorm and the head.
//
// Why: engine.models.gpt2.step.decode_step runs the same ops from Python, and on a 2-core CPU the Python
// and dispatcher around them cost about 1 ms of a 14-40 ms step (a step with every matrix
// product replaced by a no-op took 1.4 ms at 128 tokens, 0.4 of it the attention). Here the
// same ATen calls and kernels run back to back: the same arithmetic in the same order, so the
// logits equal decode_step's bit for bit (tests/test_fused_step.py). The Llama step's norms,
// RoPE, SiLU and residual adds are short loops here (a few hundred floats per token: a
// dispatched ATen call would cost more than the arithmetic), tested against a PyTorch
// reference (tests/test_kernels.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

enum Kind : int64_t {
  kKernel = 0, kInterleaved = 1, kPacked = 2, kChunked = 3, kLinear = 4,
  kQ8_0 = 5, kQ4_1 = 6, kQ8_0Exact = 7, kQ4_1Exact = 8,
};

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
    case kQ8_0: return kvlab::q8_0_linear(x, w, bias, false);
    case kQ4_1: return kvlab::q4_1_linear(x, w, bias, false);
    case kQ8_0Exact: return kvlab::q8_0_linear(x, w, bias, true);
    case kQ4_1Exact: return kvlab::q4_1_linear(x, w, bias, true);
    default: TORCH_CHECK(false, "unknown product kind ", kind, ": 0 to 8 are known");
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

// y = x / sqrt(mean(x^2) + eps) * w, row by row (the sum of squares in double: exact enough that
// the order of the C additions does not matter)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t batch = x.size(0), c = x.size(1);
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    double ss = 0.0;
    for (int64_t i = 0; i < c; ++i) ss += static_cast<double>(xp[b * c + i]) * xp[b * c + i];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / c + eps));
    for (int64_t i = 0; i < c; ++i) yp[b * c + i] = xp[b * c + i] * r * wp[i];
  }
  return y;
}

// RoPE in place on ``heads`` heads of hs channels per row of t (rows ``t.stride(0)`` apart):
// channel i pairs with i + hs / 2 (NEOX / rotate_half), or with its neighbour (2i with 2i + 1:
// llama.cpp's "norm" layout, the q and k rows of a GGUF llama file)
void rope(at::Tensor t, int64_t heads, int64_t hs, const float* cos, const float* sin,
          bool neox) {
  const int64_t half = hs / 2, step = neox ? 1 : 2, other = neox ? half : 1;
  float* p = t.data_ptr<float>();
  for (int64_t b = 0; b < t.size(0); ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      float* v = p + b * t.stride(0) + h * hs;
      for (int64_t i = 0; i < half; ++i) {
        float* x = v + i * step;
        const float a = x[0], c = x[other];
        x[0] = a * cos[i] - c * sin[i];
        x[other] = c * cos[i] + a * sin[i];
      }
    }
  }
}

// SiLU(gate) * up, gate and up (B, ffn) each, from one (B, 2 ffn) product or two
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  const int64_t batch = gate.size(0), ffn = gate.size(1);
  at::Tensor y = at::empty({batch, ffn}, gate.options());
  float* yp = y.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    const float* g = gate.data_ptr<float>() + b * gate.stride(0);
    const float* u = up.data_ptr<float>() + b * up.stride(0);
    float* yb = yp + b * ffn;
    int64_t i = 0;
#ifdef KVLAB_VECTOR  // 1536 exponentials a layer for SmolLM2: the vector exp, not one by one
    using namespace kvlab;
    for (; i + kLanes <= ffn; i += kLanes) {
      const vec gv = vload(g + i);
      const vec silu = vdiv(gv, vadd(vset(1.f), vexp(vmul(gv, vset(-1.f)))));
      vstore(yb + i, vmul(silu, vload(u + i)));
    }
#endif
    for (; i < ffn; ++i) yb[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
  return y;
}

void add_(at::Tensor& x, const at::Tensor& y) {  // x (B, C) contiguous += y (B, C), rows contiguous
  float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  const int64_t c = x.size(1);
  for (int64_t b = 0; b < x.size(0); ++b)
    for (int64_t i = 0; i < c; ++i) xp[b * c + i] += yp[b * y.stride(0) + i];
}

at::Tensor decode_layers_llama(const at::Tensor& x_in, at::TensorList norm_w,
                               const c10::List<std::optional<at::Tensor>>& w,
                               const c10::List<std::optional<at::Tensor>>& scale,
                               const c10::List<std::optional<at::Tensor>>& bias,
                               at::IntArrayRef kind, at::IntArrayRef out, const at::Tensor& k_buf,
                               const at::Tensor& v_buf, const at::Tensor& cos,
                               const at::Tensor& sin, int64_t pos, int64_t n_head,
                               int64_t n_kv_head, double eps, bool neox) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "x must be fp32 (B, C) on the CPU");
  TORCH_CHECK(k_buf.dim() == 5 && v_buf.sizes() == k_buf.sizes(),
              "k_buf and v_buf must be (L, B, n_kv_head, T, hs)");
  const int64_t layers = k_buf.size(0), batch = x_in.size(0), c = x_in.size(1),
                hs = k_buf.size(4);
  TORCH_CHECK(batch >= 1 && batch <= 8 && k_buf.size(1) == batch,
              "1 to 8 sequences at a time, as many as the cache holds");
  TORCH_CHECK(n_kv_head >= 1 && n_head % n_kv_head == 0 && k_buf.size(2) == n_kv_head,
              "n_kv_head must divide n_head and be the cache's heads");
  TORCH_CHECK(hs % 2 == 0, "RoPE needs an even head size");
  TORCH_CHECK(norm_w.size() == static_cast<size_t>(2 * layers + 1),
              "2L + 1 RMSNorm weights (before attention, before the MLP, then the final one)");
  for (const at::Tensor& n : norm_w)
    TORCH_CHECK(n.scalar_type() == at::kFloat && n.numel() == c && n.is_contiguous(),
                "RMSNorm weights must be (C,) contiguous fp32");
  const size_t n = w.size();
  TORCH_CHECK(n == static_cast<size_t>(7 * layers + 1) || n == static_cast<size_t>(4 * layers + 1),
              "7L + 1 products (q, k, v, o, gate, up, down per block, then the head) or 4L + 1 "
              "(q|k|v, o, gate|up, down)");
  TORCH_CHECK(scale.size() == n && bias.size() == n && kind.size() == n && out.size() == n,
              "scale, bias, kind and out must have one entry per product");
  const int64_t per = n == static_cast<size_t>(7 * layers + 1) ? 7 : 4;
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == at::kFloat && t->stride(1) == 1 &&
                    (t->size(1) == hs / 2 || t->size(1) == hs) && t->size(0) > pos && pos >= 0,
                "cos and sin must be fp32 (T, hs/2) or (T, hs) with T > pos and rows contiguous");
  const float* cp = cos.data_ptr<float>() + pos * cos.stride(0);
  const float* sp = sin.data_ptr<float>() + pos * sin.stride(0);
  const int64_t qw = n_head * hs, kw = n_kv_head * hs;
  auto mul = [&](const at::Tensor& h, size_t j, int64_t width) {
    const std::optional<at::Tensor> wj = w.get(j);
    TORCH_CHECK(wj.has_value(), "product ", j, " has no weight");
    at::Tensor y = product(h, *wj, scale.get(j), bias.get(j), kind[j], out[j]);
    TORCH_CHECK(width < 0 || y.size(1) == width, "product ", j, " gives ", y.size(1),
                " columns where ", width, " are needed");
    return y;
  };
  at::Tensor x = x_in.contiguous().clone();
  for (int64_t i = 0; i < layers; ++i) {
    const size_t j = static_cast<size_t>(per * i);
    at::Tensor h = rms_norm(x, norm_w[2 * i], eps);
    at::Tensor q, k, v;
    if (per == 7) {
      q = mul(h, j, qw), k = mul(h, j + 1, kw), v = mul(h, j + 2, kw);
    } else {
      at::Tensor qkv = mul(h, j, qw + 2 * kw);
      q = qkv.narrow(1, 0, qw), k = qkv.narrow(1, qw, kw), v = qkv.narrow(1, qw + kw, kw);
    }
    rope(q, n_head, hs, cp, sp, neox);
    rope(k, n_kv_head, hs, cp, sp, neox);
    at::Tensor y = kvlab::attend(q.view({batch, n_head, hs}), k.view({batch, n_kv_head, hs}),
                                 v.view({batch, n_kv_head, hs}), k_buf.select(0, i),
                                 v_buf.select(0, i), pos);  // (B, n_head, hs)
    add_(x, mul(y.view({batch, qw}), j + (per == 7 ? 3 : 1), c));
    h = rms_norm(x, norm_w[2 * i + 1], eps);
    at::Tensor a;
    if (per == 7) {
      a = swiglu(mul(h, j + 4, -1), mul(h, j + 5, -1));
    } else {
      at::Tensor gu = mul(h, j + 2, -1);
      TORCH_CHECK(gu.size(1) % 2 == 0, "gate|up must have 2 * ffn columns");
      a = swiglu(gu.narrow(1, 0, gu.size(1) / 2), gu.narrow(1, gu.size(1) / 2, gu.size(1) / 2));
    }
    add_(x, mul(a, j + (per == 7 ? 6 : 3), c));
  }
  return mul(rms_norm(x, norm_w[2 * layers], eps), n - 1, -1);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvlab, m) {
  m.def("decode_layers(Tensor x, Tensor[] ln_w, Tensor[] ln_b, Tensor?[] w, Tensor?[] scale, "
        "Tensor?[] bias, int[] kind, int[] out, Tensor(a!) k_buf, Tensor(b!) v_buf, int pos, "
        "int n_head, float eps) -> Tensor",
        &decode_layers);
  m.def("decode_layers_llama(Tensor x, Tensor[] norm_w, Tensor?[] w, Tensor?[] scale, "
        "Tensor?[] bias, int[] kind, int[] out, Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor cos, "
        "Tensor sin, int pos, int n_head, int n_kv_head, float eps, bool neox=True) -> Tensor",
        &decode_layers_llama);
}
