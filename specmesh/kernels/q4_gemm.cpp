// specmesh 4-bit small-M linear: y[M, N] = x[M, K] (fp32) @ W^T on AVX2/FMA CPUs, where
// w[n, k] = q[n, k] * scale[n, k / 32] + bias[n, k / 32], q in 0..15 (bias = zero - 8 * scale of
// specmesh.quant.Int4Codes). Activations, scales and sums stay fp32.
//
// Decoding is bandwidth-bound: 4-bit codes are an eighth of fp32's bytes, so the kernel must turn a
// code into an FMA operand in as few instructions as possible. Per group of 32 inputs of a row it
// computes the integer-weighted sum sum_k q[k] * x[k] (convert + FMA only), then adds
// scale * that + bias * sum_k x[k], with the per-group input sums precomputed once per call.
//
// Layout (repacked at load time by specmesh.kernels.q4, `pack`): output rows in blocks of 8, one
// vector lane per row, so scales and biases are plain vector loads and no horizontal sum is needed.
//   codes [N/8, K/32, 16, 8] uint8: unit u of group g, byte j = q[8b + j][32g + u] | q[8b + j][32g + u + 16] << 4
//   sb    [N/8, K/32, 2, 8] float: the 8 rows' scales, then their biases
// Rows past N are zero padding. The codes of a block are one sequential stream (128 bytes a group).
//
// Batch invariance: every output is the same sequence of fp32 operations whatever M, the tiling
// or the thread split: within a group, four partial sums by a fixed phase of the input index
// (lo nibble of an even/odd unit, hi nibble of an even/odd unit), combined (p0 + p1) + (p2 + p3),
// then acc = fma(scale, that, acc), acc = fma(bias, xsum, acc), groups in ascending order.
//
// Threads: pool.h (not at::parallel_for: its barrier costs a time slice on a shared machine),
// chunks of block pairs.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include <vector>

#include "pool.h"

namespace {

constexpr int GROUP = 32;
constexpr int LANES = 8;  // output rows per block

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Blocks [b0, b0 + RB) of 8 output rows against input rows [m0, m0 + MM).
template <int RB, int MM>
inline void tile(const float* X, const float* XS, const uint8_t* C, const float* SB, float* Y, int64_t K,
                 int64_t N, int64_t m0, int64_t b0) {
  const int64_t G = K / GROUP;
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  __m256 acc[RB][MM];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < MM; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 p[RB][MM][4];
    for (int r = 0; r < RB; ++r)
      for (int i = 0; i < MM; ++i)
        for (int f = 0; f < 4; ++f) p[r][i][f] = _mm256_setzero_ps();
    const float* xg[MM];
    for (int i = 0; i < MM; ++i) xg[i] = X + (m0 + i) * K + g * GROUP;
    for (int r = 0; r < RB; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(C + ((b0 + r) * G + g) * 128 + 1024), _MM_HINT_T0);
#pragma GCC unroll 16
    for (int u = 0; u < 16; ++u) {
      __m256 lo[RB], hi[RB];
      for (int r = 0; r < RB; ++r) {
        const uint8_t* c = C + (((b0 + r) * G + g) * 16 + u) * LANES;
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
        lo[r] = _mm256_cvtepi32_ps(_mm256_and_si256(v, low4));
        hi[r] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
      }
      for (int i = 0; i < MM; ++i) {
        const __m256 xl = _mm256_broadcast_ss(xg[i] + u), xh = _mm256_broadcast_ss(xg[i] + u + 16);
        for (int r = 0; r < RB; ++r) {
          p[r][i][u & 1] = _mm256_fmadd_ps(xl, lo[r], p[r][i][u & 1]);
          p[r][i][2 + (u & 1)] = _mm256_fmadd_ps(xh, hi[r], p[r][i][2 + (u & 1)]);
        }
      }
    }
    for (int r = 0; r < RB; ++r) {
      const float* sb = SB + ((b0 + r) * G + g) * 2 * LANES;
      const __m256 s = _mm256_loadu_ps(sb), b = _mm256_loadu_ps(sb + LANES);
      for (int i = 0; i < MM; ++i) {
        const __m256 q = _mm256_add_ps(_mm256_add_ps(p[r][i][0], p[r][i][1]), _mm256_add_ps(p[r][i][2], p[r][i][3]));
        acc[r][i] = _mm256_fmadd_ps(s, q, acc[r][i]);
        acc[r][i] = _mm256_fmadd_ps(b, _mm256_broadcast_ss(XS + (m0 + i) * G + g), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    const int64_t n0 = (b0 + r) * LANES;
    for (int i = 0; i < MM; ++i) {
      float* y = Y + (m0 + i) * N + n0;
      if (n0 + LANES <= N) {
        _mm256_storeu_ps(y, acc[r][i]);
      } else {
        alignas(32) float tmp[LANES];
        _mm256_store_ps(tmp, acc[r][i]);
        for (int64_t j = 0; n0 + j < N; ++j) y[j] = tmp[j];
      }
    }
  }
}

template <int RB>
inline void rows(const float* X, const float* XS, const uint8_t* C, const float* SB, float* Y, int64_t M,
                 int64_t K, int64_t N, int64_t b0) {
  int64_t m = 0;
  if constexpr (RB == 1) {
    for (; m + 3 <= M; m += 3) tile<1, 3>(X, XS, C, SB, Y, K, N, m, b0);
    if (M - m == 2) tile<1, 2>(X, XS, C, SB, Y, K, N, m, b0);
    if (M - m == 1) tile<1, 1>(X, XS, C, SB, Y, K, N, m, b0);
  } else {
    for (; m < M; ++m) tile<RB, 1>(X, XS, C, SB, Y, K, N, m, b0);
  }
}

struct Product {
  const float* X;
  const float* XS;
  const uint8_t* C;
  const float* SB;
  float* Y;
  int64_t M, K, N, NB, pairs_per_chunk;
};

void chunk(const void* ctx, int64_t c) {
  const Product& p = *static_cast<const Product*>(ctx);
  const int64_t pairs = (p.NB + 1) / 2;
  for (int64_t q = c * p.pairs_per_chunk; q < std::min(pairs, (c + 1) * p.pairs_per_chunk); ++q) {
    const int64_t b = 2 * q;
    if (p.M == 1 && b + 1 < p.NB) {
      rows<2>(p.X, p.XS, p.C, p.SB, p.Y, p.M, p.K, p.N, b);
    } else {
      rows<1>(p.X, p.XS, p.C, p.SB, p.Y, p.M, p.K, p.N, b);
      if (b + 1 < p.NB) rows<1>(p.X, p.XS, p.C, p.SB, p.Y, p.M, p.K, p.N, b + 1);
    }
  }
}

at::Tensor q4_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& sb, int64_t N, int64_t threads) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "q4_linear: x fp32 CPU [M, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1), G = K / GROUP, NB = (N + LANES - 1) / LANES;
  TORCH_CHECK(K % GROUP == 0, "q4_linear: K must be a multiple of 32");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.numel() == NB * G * 16 * LANES,
              "q4_linear: codes [N/8, K/32, 16, 8] uint8");
  TORCH_CHECK(sb.scalar_type() == at::kFloat && sb.is_contiguous() && sb.numel() == NB * G * 2 * LANES,
              "q4_linear: sb [N/8, K/32, 2, 8] float");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* X = x.data_ptr<float>();
  // Per-group input sums, the same fixed order for every row.
  std::vector<float> xs(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* p = X + m * K + g * GROUP;
      const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
      xs[m * G + g] = hsum8(s);
    }
  const float* XS = xs.data();
  const uint8_t* C = codes.data_ptr<uint8_t>();
  const float* SB = sb.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  // Chunks of block pairs, ~64 KB of codes each: cheap to claim, many per thread.
  const int64_t pairs = (NB + 1) / 2;
  const Product p{X, XS, C, SB, Y, M, K, N, NB, std::max<int64_t>(1, 65536 / (K * 8))};
  specmesh_pool::parallel_chunks((pairs + p.pairs_per_chunk - 1) / p.pairs_per_chunk, &chunk, &p, threads);
  return y;
}

}  // namespace

TORCH_LIBRARY(specmesh_q4, m) {
  m.def("q4_linear(Tensor x, Tensor codes, Tensor sb, int n, int threads) -> Tensor", &q4_linear);
}
