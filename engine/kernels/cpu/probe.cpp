// What the benchmarks and reports ask of the library itself:
//
//   read_bytes(t) -> int   the sum of a contiguous tensor's bytes, each read once on torch's
//                          threads: the floor the block products are measured against
//                          (scripts/bench_blocks.py), psadbw over 32-byte loads with prefetch
//   isa() -> str           the instruction set this build was compiled for (simd.h's kIsa;
//                          engine.kernels.cpu.isa(), named by every benchmark)
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "simd.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace {

int64_t read_bytes(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "a contiguous CPU tensor");
  const uint8_t* p = static_cast<const uint8_t*>(t.data_ptr());
  const int64_t n = t.numel() * t.element_size(), chunk = 1 << 16;
  std::vector<int64_t> part(at::get_num_threads() + 1, 0);
  at::parallel_for(0, (n + chunk - 1) / chunk, 4, [&](int64_t c0, int64_t c1) {
    int64_t s = 0, i = c0 * chunk;
    const int64_t end = std::min(n, c1 * chunk);
#if defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 128 <= end; i += 128) {
      _mm_prefetch(reinterpret_cast<const char*>(p + i + 1024), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + i + 1088), _MM_HINT_T0);
      auto ld = [&](int64_t k) {  // the 32 bytes summed into four 64-bit lanes (psadbw)
        return _mm256_sad_epu8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + k)),
                               _mm256_setzero_si256());
      };
      a0 = _mm256_add_epi64(a0, ld(0)), a1 = _mm256_add_epi64(a1, ld(32));
      a2 = _mm256_add_epi64(a2, ld(64)), a3 = _mm256_add_epi64(a3, ld(96));
    }
    alignas(32) int64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                       _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
    s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
#endif
    for (; i < end; ++i) s += p[i];
    part[at::get_thread_num()] += s;
  });
  int64_t total = 0;
  for (int64_t s : part) total += s;
  return total;
}

std::string isa() { return kvlab::kIsa; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvlab, m) {
  m.def("read_bytes(Tensor t) -> int", &read_bytes);
  m.def("isa() -> str", &isa);
}
