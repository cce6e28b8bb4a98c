// y[M, N] = x[M, K] (fp32) @ W^T where W is kept as a GGUF tensor's own blocks ([N, row bytes]),
// multiplied by ggml's CPU kernels (llama.cpp's): each activation row is quantized once to the
// weight type's `vec_dot_type` with ggml's `from_float` (Q8_K for K-quants, Q8_0/Q8_1 for the
// 32-blocks), then every output is one ggml `vec_dot` of a weight row with an activation row.
//
// The two function pointers come from ggml's public `ggml_get_type_traits_cpu` (specmesh.kernels.ggml
// looks them up in the libggml-cpu that llama-cpp-python ships); this file does not link ggml.
//
// Batch invariance: an output is vec_dot(weight row n, quantized row m), one call whatever M, the
// tiling or the thread split, so a tree's rows equal the same rows decoded one at a time.
//
// Threads: pool.h, chunks of output rows; inside a chunk the weight rows of a small tile stay in
// L1/L2 while every activation row passes over them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "pool.h"

namespace {

using from_float_t = void (*)(const float* x, void* y, int64_t k);
using vec_dot_t = void (*)(int n, float* s, size_t bs, const void* x, size_t bx, const void* y, size_t by, int nrc);

constexpr int64_t TILE = 8;  // weight rows that meet every activation row before the next tile

struct Product {
  vec_dot_t dot;
  const uint8_t* W;
  const uint8_t* XQ;
  float* Y;
  int64_t M, K, N, w_row, x_row, rows_per_chunk;
};

void chunk(const void* ctx, int64_t c) {
  const Product& p = *static_cast<const Product*>(ctx);
  const int64_t end = std::min(p.N, (c + 1) * p.rows_per_chunk);
  for (int64_t n0 = c * p.rows_per_chunk; n0 < end; n0 += TILE) {
    const int64_t n1 = std::min(end, n0 + TILE);
    for (int64_t m = 0; m < p.M; ++m) {
      const uint8_t* xq = p.XQ + m * p.x_row;
      float* y = p.Y + m * p.N;
      for (int64_t n = n0; n < n1; ++n) p.dot(static_cast<int>(p.K), y + n, 0, p.W + n * p.w_row, 0, xq, 0, 1);
    }
  }
}

at::Tensor ggml_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t vec_dot, int64_t from_float,
                       int64_t x_row_bytes, int64_t threads) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "ggml_linear: x fp32 CPU [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "ggml_linear: w [N, row bytes] uint8");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<uint8_t> xq(M * x_row_bytes + 64);
  const auto quantize = reinterpret_cast<from_float_t>(from_float);
  for (int64_t m = 0; m < M; ++m) quantize(x.data_ptr<float>() + m * K, xq.data() + m * x_row_bytes, K);
  const int64_t w_row = w.size(1);
  // ~32 KB of weights a chunk: cheap to claim, many per thread.
  const int64_t rows = std::max<int64_t>(TILE, (32768 / std::max<int64_t>(1, w_row)) / TILE * TILE);
  const Product p{reinterpret_cast<vec_dot_t>(vec_dot), w.data_ptr<uint8_t>(), xq.data(), y.data_ptr<float>(),
                  M, K, N, w_row, x_row_bytes, rows};
  specmesh_pool::parallel_chunks((N + rows - 1) / rows, &chunk, &p, threads);
  return y;
}

}  // namespace

TORCH_LIBRARY(specmesh_ggml, m) {
  m.def("ggml_linear(Tensor x, Tensor w, int vec_dot, int from_float, int x_row_bytes, int threads) -> Tensor",
        &ggml_linear);
}
