// specmesh glue kernels (AVX2): the small element-wise steps between a decoder layer's products, each
// one op where torch runs 5 to 12 (a decode step of a 0.5B model issued ~40 small torch ops a layer,
// a third of its time; the products are the rest).
//   rms_norm(x, w, eps):          y = w * (x * 1 / sqrt(mean(x^2) + eps)), per row
//   add_rms_norm(h, a, w, eps):   s = h + a, y = rms_norm(s): the residual add and the next norm
//   rope(q, k, v, cos, sin):      [T, n * D] rows (views of one fused product, any row stride) ->
//                                 q, k rotated (x * cos + rotate_half(x) * sin) and v, each [n, T, D]
//   silu_mul(g, u):               silu(g) * u = g / (1 + e^-g) * u
// fp32, the last dimension contiguous and a multiple of 8 (rope: D a multiple of 16). Every output row
// is one fixed sequence of fp32 operations on its own input row (sums in 8 lanes, then `hsum8`), whatever
// the other rows or the thread count: rows stay batch-invariant, as the products and attention keep them.
// Rows are split over the kernel pool when there are enough of them to pay for it.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <tuple>

#include "pool.h"
#include "simd.h"

namespace {

constexpr int64_t ROWS_PER_CHUNK = 16;
constexpr int64_t SERIAL = 1 << 16;  // below this many elements one thread does it all

template <class F>
void over_rows(int64_t rows, int64_t width, int64_t threads, const F& f) {
  if (rows * width < SERIAL || threads <= 1) {
    for (int64_t r = 0; r < rows; ++r) f(r);
    return;
  }
  struct Ctx {
    const F* f;
    int64_t rows;
  } ctx{&f, rows};
  specmesh_pool::parallel_chunks(
      (rows + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK,
      [](const void* p, int64_t c) {
        const Ctx& x = *static_cast<const Ctx*>(p);
        const int64_t end = std::min(x.rows, (c + 1) * ROWS_PER_CHUNK);
        for (int64_t r = c * ROWS_PER_CHUNK; r < end; ++r) (*x.f)(r);
      },
      &ctx, threads);
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1 &&
                  x.size(1) % 8 == 0,
              what, ": fp32 CPU [rows, width], width contiguous and a multiple of 8");
}

inline void norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(hsum8(acc) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), r)));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t threads) {
  check_rows(x, "rms_norm");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == H, "rms_norm: weight fp32 [width]");
  at::Tensor y = at::empty({T, H}, x.options());
  const float *X = x.data_ptr<float>(), *W = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
  over_rows(T, H, threads, [&](int64_t t) { norm_row(X + t * xs, W, Y + t * H, H, static_cast<float>(eps)); });
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& a, const at::Tensor& w, double eps,
                                                int64_t threads) {
  check_rows(h, "add_rms_norm");
  check_rows(a, "add_rms_norm");
  const int64_t T = h.size(0), H = h.size(1);
  TORCH_CHECK(a.size(0) == T && a.size(1) == H, "add_rms_norm: h and a must have one shape");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == H, "add_rms_norm: weight fp32 [width]");
  at::Tensor s = at::empty({T, H}, h.options()), y = at::empty({T, H}, h.options());
  const float *A = h.data_ptr<float>(), *B = a.data_ptr<float>(), *W = w.data_ptr<float>();
  float *S = s.data_ptr<float>(), *Y = y.data_ptr<float>();
  const int64_t hs = h.stride(0), as = a.stride(0);
  over_rows(T, H, threads, [&](int64_t t) {
    float* st = S + t * H;
    for (int64_t i = 0; i < H; i += 8)
      _mm256_storeu_ps(st + i, _mm256_add_ps(_mm256_loadu_ps(A + t * hs + i), _mm256_loadu_ps(B + t * as + i)));
    norm_row(st, W, Y + t * H, H, static_cast<float>(eps));
  });
  return {s, y};
}

// One head's row rotated: out[i] = x[i] cos[i] - x[i + D/2] sin[i], out[i + D/2] = x[i + D/2] cos[i + D/2]
// + x[i] sin[i + D/2]: torch's x * cos + rotate_half(x) * sin, the same two products and one sum.
inline void rotate(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += 8) {
    const __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + half + i);
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(c + i)),
                                            _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), hi), _mm256_loadu_ps(s + i))));
    _mm256_storeu_ps(out + half + i, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(c + half + i)),
                                                   _mm256_mul_ps(lo, _mm256_loadu_ps(s + half + i))));
  }
}

// Returns q rotated, [Hq, T, D]; k rotated and v copied into head h's rows row0.. of OK / OV, heads
// `stride` floats apart (a [Hk, T, D] result, or a cache layer's [Hk, capacity, D] slots).
at::Tensor rotate_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                       const at::Tensor& sin, int64_t D, float* OK, float* OV, int64_t stride, int64_t row0,
                       int64_t threads) {
  check_rows(q, "rope");
  check_rows(k, "rope");
  check_rows(v, "rope");
  const int64_t T = q.size(0);
  TORCH_CHECK(D % 16 == 0 && q.size(1) % D == 0 && k.size(1) % D == 0 && v.size(1) == k.size(1) && k.size(0) == T &&
                  v.size(0) == T,
              "rope: q, k, v [T, heads * D], D a multiple of 16, k and v alike");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
              "rope: cos and sin fp32 [T, D], contiguous");
  const int64_t Hq = q.size(1) / D, Hk = k.size(1) / D;
  at::Tensor oq = at::empty({Hq, T, D}, q.options());
  float* OQ = oq.data_ptr<float>();
  const float *Q = q.data_ptr<float>(), *K = k.data_ptr<float>(), *V = v.data_ptr<float>();
  const float *C = cos.data_ptr<float>(), *S = sin.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);
  over_rows(T, q.size(1) + 2 * k.size(1), threads, [&](int64_t t) {
    const float *c = C + t * D, *s = S + t * D;
    for (int64_t h = 0; h < Hq; ++h) rotate(Q + t * qs + h * D, c, s, OQ + (h * T + t) * D, D);
    for (int64_t h = 0; h < Hk; ++h) {
      rotate(K + t * ks + h * D, c, s, OK + h * stride + (row0 + t) * D, D);
      const float* src = V + t * vs + h * D;
      float* dst = OV + h * stride + (row0 + t) * D;
      for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(dst + i, _mm256_loadu_ps(src + i));
    }
  });
  return oq;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim,
                                                    int64_t threads) {
  const int64_t T = q.size(0), D = head_dim;
  TORCH_CHECK(D > 0 && q.dim() == 2 && k.dim() == 2, "rope: q, k, v [T, heads * D]");
  const auto f32 = q.options().dtype(at::kFloat);  // rotate_rows checks the inputs' own dtype
  at::Tensor ok = at::empty({k.size(1) / D, T, D}, f32), ov = at::empty({k.size(1) / D, T, D}, f32);
  at::Tensor oq = rotate_rows(q, k, v, cos, sin, D, ok.data_ptr<float>(), ov.data_ptr<float>(), T * D, 0, threads);
  return {oq, ok, ov};
}

// rope, with k and v written straight into a cache layer's slots [start, start + T) (kc, vc:
// [Hk, capacity, D] contiguous) instead of new tensors; returns q.
at::Tensor rope_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                     const at::Tensor& sin, int64_t head_dim, at::Tensor& kc, at::Tensor& vc, int64_t start,
                     int64_t threads) {
  const int64_t T = q.size(0), D = head_dim;
  TORCH_CHECK(D > 0 && q.dim() == 2 && k.dim() == 2, "rope_into: q, k, v [T, heads * D]");
  TORCH_CHECK(kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat && kc.is_contiguous() &&
                  vc.is_contiguous() && kc.dim() == 3 && kc.sizes() == vc.sizes() && kc.size(0) * D == k.size(1) &&
                  kc.size(2) == D && start >= 0 && start + T <= kc.size(1),
              "rope_into: kc, vc fp32 [Hk, capacity, D] contiguous, with room for slots [start, start + T)");
  return rotate_rows(q, k, v, cos, sin, D, kc.data_ptr<float>(), vc.data_ptr<float>(), kc.size(1) * D, start, threads);
}

at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u, int64_t threads) {
  check_rows(g, "silu_mul");
  check_rows(u, "silu_mul");
  const int64_t T = g.size(0), I = g.size(1);
  TORCH_CHECK(u.size(0) == T && u.size(1) == I, "silu_mul: g and u must have one shape");
  at::Tensor y = at::empty({T, I}, g.options());
  const float *G = g.data_ptr<float>(), *U = u.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  const int64_t gs = g.stride(0), us = u.stride(0);
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  over_rows(T, I, threads, [&](int64_t t) {
    for (int64_t i = 0; i < I; i += 8) {
      const __m256 x = _mm256_loadu_ps(G + t * gs + i);
      const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
      _mm256_storeu_ps(Y + t * I + i, _mm256_mul_ps(silu, _mm256_loadu_ps(U + t * us + i)));
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(specmesh_glue, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, int threads) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor h, Tensor a, Tensor w, float eps, int threads) -> (Tensor, Tensor)", &add_rms_norm);
  m.def("rope(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, int head_dim, int threads) -> (Tensor, Tensor, Tensor)",
        &rope);
  m.def("rope_into(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, int head_dim, Tensor(a!) kc, Tensor(b!) vc, "
        "int start, int threads) -> Tensor",
        &rope_into);
  m.def("silu_mul(Tensor g, Tensor u, int threads) -> Tensor", &silu_mul);
}
