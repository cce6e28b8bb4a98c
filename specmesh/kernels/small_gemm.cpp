// specmesh small-M linear: y[M, N] = x[M, K] @ w[N, K]^T in fp32 on AVX2/FMA CPUs.
//
// Speculative verification runs the target on a handful of rows (a tree of 2-16 nodes). On a
// memory-bound CPU that should cost about one row: every weight is read once either way. This
// kernel streams the weights in blocks (4 rows against up to 3 input rows, or 2 rows against up
// to 6: at most 12 accumulators, so one pass over the weights for M <= 6; larger M re-reads the
// block from L1), prefetches the next block, and computes every output as the same fixed-order
// dot product (8-lane FMA accumulator over K, fixed horizontal sum, scalar K tail) whatever M,
// the blocking or the thread split: a row's result does not depend on which rows are computed
// with it (batch invariance).
//
// Threads: our own small pool (pool.h, shared with q4_gemm.cpp), not at::parallel_for. An OpenMP
// region ends in a barrier that waits for every team thread, also one that has not been scheduled
// yet; on a shared 2-core machine that wait is a scheduler time slice (ms) for a product that takes
// 0.1-3 ms on one core. Here the caller claims chunks of weight rows itself and waits only for
// chunks another thread has claimed, so a product never takes longer than on one thread plus a few
// microseconds, and a free core halves it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "pool.h"

#include <vector>

namespace {

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Weight rows [r0, r0+R) against input rows [m0, m0+MM).
template <int R, int MM>
inline void tile(const float* X, const float* W, float* Y, int64_t K, int64_t N, int64_t m0, int64_t r0,
                 bool prefetch) {
  __m256 acc[MM][R];
  for (int i = 0; i < MM; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 w[R];
    for (int r = 0; r < R; ++r) w[r] = _mm256_loadu_ps(W + (r0 + r) * K + k);
    if (prefetch && (k & 15) == 0)  // one 64-byte line per row of the next block
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(W + (r0 + R + r) * K + k), _MM_HINT_T0);
    for (int i = 0; i < MM; ++i) {
      const __m256 xv = _mm256_loadu_ps(X + (m0 + i) * K + k);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(xv, w[r], acc[i][r]);
    }
  }
  for (int i = 0; i < MM; ++i)
    for (int r = 0; r < R; ++r) {
      float s = hsum8(acc[i][r]);
      for (int64_t k = K8; k < K; ++k) s += X[(m0 + i) * K + k] * W[(r0 + r) * K + k];
      Y[(m0 + i) * N + r0 + r] = s;
    }
}

template <int R, int T>
inline void block(const float* X, const float* W, float* Y, int64_t M, int64_t K, int64_t N, int64_t r0,
                  bool prefetch) {
  int64_t m = 0;
  for (; m + T <= M; m += T) tile<R, T>(X, W, Y, K, N, m, r0, prefetch && m == 0);
  const bool pf = prefetch && m == 0;
  switch (M - m) {
    case 5: if constexpr (T > 5) tile<R, 5>(X, W, Y, K, N, m, r0, pf); break;
    case 4: if constexpr (T > 4) tile<R, 4>(X, W, Y, K, N, m, r0, pf); break;
    case 3: if constexpr (T > 3) tile<R, 3>(X, W, Y, K, N, m, r0, pf); break;
    case 2: tile<R, 2>(X, W, Y, K, N, m, r0, pf); break;
    case 1: tile<R, 1>(X, W, Y, K, N, m, r0, pf); break;
    default: break;
  }
}

constexpr int64_t CHUNK_BYTES = 256 << 10;  // weight bytes per chunk: the claim and hand-off cost stays small

struct Product {
  const float* X;
  const float* W;
  float* Y;
  int64_t M, K, N, rows_per_chunk, threads;
};

template <int R, int T>
void chunk(const void* ctx, int64_t c) {
  const Product& p = *static_cast<const Product*>(ctx);
  const int64_t b0 = c * p.rows_per_chunk / R, b1 = std::min(p.N / R, (c + 1) * p.rows_per_chunk / R);
  for (int64_t b = b0; b < b1; ++b) block<R, T>(p.X, p.W, p.Y, p.M, p.K, p.N, b * R, b + 1 < b1);
}

template <int R, int T>
void parallel_blocks(const Product& p) {
  specmesh_pool::parallel_chunks((p.N / R * R + p.rows_per_chunk - 1) / p.rows_per_chunk, &chunk<R, T>, &p, p.threads);
}

at::Tensor small_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t threads) {
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1), "small_linear: shapes");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "small_linear: fp32 only");
  TORCH_CHECK(x_in.device().is_cpu() && w.device().is_cpu() && w.is_contiguous(), "small_linear: CPU, contiguous w");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  // Chunks of whole blocks, at least CHUNK_BYTES of weights each (a multiple of 4 rows).
  const int64_t rows_per_chunk = std::max<int64_t>(4, (CHUNK_BYTES / (K * 4) + 3) / 4 * 4);
  const Product p{X, W, Y, M, K, N, rows_per_chunk, threads};
  if (M <= 3) {  // 4 weight rows x 3 input rows: 12 accumulators, one pass over the weights
    parallel_blocks<4, 3>(p);
    for (int64_t r = N / 4 * 4; r < N; ++r) block<1, 3>(X, W, Y, M, K, N, r, false);
  } else {  // 2 weight rows x 6 input rows: one pass over the weights up to 6 input rows
    parallel_blocks<2, 6>(p);
    for (int64_t r = N / 2 * 2; r < N; ++r) block<1, 6>(X, W, Y, M, K, N, r, false);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(specmesh, m) { m.def("small_linear(Tensor x, Tensor w, int threads) -> Tensor", &small_linear); }
