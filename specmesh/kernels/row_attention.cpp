// specmesh exact row attention (AVX2): out[h, t] = softmax(q[h, t] . K_t^T * scale) V_t for each query
// row t over exactly the key slots it sees, K_t = keys[g, slots[offsets[t]:offsets[t + 1]]] (g the row's
// K/V head, GQA: g = h / (H / H_kv)), read in place from the cache: no gathered copy per row.
//
// Every output is one fixed sequence of fp32 operations over the row's keys in the order given
// (dot products in 8-lane vectors with two accumulators (`dots`), a sequential max, a lane-wise exp, a
// sequential sum, then the weighted value sum key by key), whatever the other rows, where the slots lie in the cache or the
// thread count. A tree's row therefore equals the same token decoded alone once its ancestors sit
// in the committed prefix: the same keys in the same order give the same bits (what
// specmesh.model._attention_by_row requires).
//
// Work items are (K/V head, row) pairs: the H / H_kv query heads of one K/V head share each key and
// value load.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

#include "pool.h"
#include "simd.h"

namespace {

struct Job {
  const float* Q;
  int64_t qh, qt;  // strides of q's head and row dimensions
  const float* K;
  const float* V;
  int64_t kh, vh;  // strides of the keys' and values' head dimension (slot stride D)
  const int64_t* off;
  const int64_t* slots;
  float* O;  // [H, T, D]
  int64_t H, Hkv, T, D;
  float scale;
};

// U query heads' scores against one key, interleaved for ILP; each dot is the same sequence as `dot`.
template <int U>
inline void dots(const float* const* q, const float* k, int64_t d, float scale, float* const* out) {
  __m256 x[U], y[U];
  for (int u = 0; u < U; ++u) x[u] = y[u] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m256 ka = _mm256_loadu_ps(k + i), kb = _mm256_loadu_ps(k + i + 8);
    for (int u = 0; u < U; ++u) {
      x[u] = _mm256_fmadd_ps(_mm256_loadu_ps(q[u] + i), ka, x[u]);
      y[u] = _mm256_fmadd_ps(_mm256_loadu_ps(q[u] + i + 8), kb, y[u]);
    }
  }
  if (i < d) {
    const __m256 ka = _mm256_loadu_ps(k + i);
    for (int u = 0; u < U; ++u) x[u] = _mm256_fmadd_ps(_mm256_loadu_ps(q[u] + i), ka, x[u]);
  }
  for (int u = 0; u < U; ++u) *out[u] = hsum8(_mm256_add_ps(x[u], y[u])) * scale;
}

// out[u][0:32] = sum over keys r, in order, of p[u][r] * v_r[0:32], for U (<= 2) heads.
template <int U>
inline void weigh(const float* const* p, const float* v0, const int64_t* sl, int64_t n, int64_t D, float* const* out) {
  __m256 a[U][4];
  for (int u = 0; u < U; ++u)
    for (int l = 0; l < 4; ++l) a[u][l] = _mm256_setzero_ps();
  for (int64_t r = 0; r < n; ++r) {
    const float* v = v0 + sl[r] * D;
    const __m256 v_[4] = {_mm256_loadu_ps(v), _mm256_loadu_ps(v + 8), _mm256_loadu_ps(v + 16), _mm256_loadu_ps(v + 24)};
    for (int u = 0; u < U; ++u) {
      const __m256 w = _mm256_set1_ps(p[u][r]);
      for (int l = 0; l < 4; ++l) a[u][l] = _mm256_fmadd_ps(w, v_[l], a[u][l]);
    }
  }
  for (int u = 0; u < U; ++u)
    for (int l = 0; l < 4; ++l) _mm256_storeu_ps(out[u] + 8 * l, a[u][l]);
}

constexpr int DOTS = 6;  // heads per interleaved score pass

void item(const void* ctx, int64_t c) {
  const Job& j = *static_cast<const Job*>(ctx);
  const int64_t g = c / j.T, t = c % j.T, group = j.H / j.Hkv, D = j.D;
  const int64_t begin = j.off[t], n = j.off[t + 1] - begin;
  const int64_t* sl = j.slots + begin;
  const int64_t n8 = (n + 7) / 8 * 8;  // each head's scores padded to whole vectors
  std::vector<float> s(group * n8);
  std::vector<const float*> qs(group);
  for (int64_t u = 0; u < group; ++u) qs[u] = j.Q + (g * group + u) * j.qh + t * j.qt;
  const float* K = j.K + g * j.kh;
  for (int64_t r = 0; r < n; ++r) {
    const float* k = K + sl[r] * D;
    for (int64_t u0 = 0; u0 < group; u0 += DOTS) {
      float* out[DOTS];
      const int64_t U = std::min<int64_t>(DOTS, group - u0);
      for (int64_t u = 0; u < U; ++u) out[u] = s.data() + (u0 + u) * n8 + r;
      const float* const* q = qs.data() + u0;
      switch (U) {
        case 6: dots<6>(q, k, D, j.scale, out); break;
        case 5: dots<5>(q, k, D, j.scale, out); break;
        case 4: dots<4>(q, k, D, j.scale, out); break;
        case 3: dots<3>(q, k, D, j.scale, out); break;
        case 2: dots<2>(q, k, D, j.scale, out); break;
        default: dots<1>(q, k, D, j.scale, out); break;
      }
    }
  }
  std::vector<float> inv(group);
  for (int64_t u = 0; u < group; ++u) {
    float* su = s.data() + u * n8;
    float m = -INFINITY;
    for (int64_t r = 0; r < n; ++r) m = std::max(m, su[r]);
    const __m256 mv = _mm256_set1_ps(m);
    for (int64_t r = 0; r < n8; r += 8) _mm256_storeu_ps(su + r, exp8(_mm256_sub_ps(_mm256_loadu_ps(su + r), mv)));
    float total = 0.0f;  // the padding lanes are computed and never summed
    for (int64_t r = 0; r < n; ++r) total += su[r];
    inv[u] = 1.0f / total;
  }
  // Values in 32-wide slices of D (D % 32 == 0: `row_attention` checks), two heads at a time.
  const float* V = j.V + g * j.vh;
  for (int64_t u0 = 0; u0 < group; u0 += 2) {
    const int64_t U = std::min<int64_t>(2, group - u0);
    for (int64_t l = 0; l < D; l += 32) {
      const float* p[2] = {s.data() + u0 * n8, s.data() + (u0 + U - 1) * n8};
      float* o[2] = {j.O + ((g * group + u0) * j.T + t) * D + l, j.O + ((g * group + u0 + U - 1) * j.T + t) * D + l};
      if (U == 2) weigh<2>(p, V + l, sl, n, D, o);
      else weigh<1>(p, V + l, sl, n, D, o);
    }
    for (int64_t u = u0; u < u0 + U; ++u) {
      float* o = j.O + ((g * group + u) * j.T + t) * D;
      const __m256 w = _mm256_set1_ps(inv[u]);
      for (int64_t l = 0; l < D; l += 8) _mm256_storeu_ps(o + l, _mm256_mul_ps(_mm256_loadu_ps(o + l), w));
    }
  }
}

at::Tensor row_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                         const at::Tensor& offsets, const at::Tensor& slots, double scale, int64_t threads) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "row_attention: q [H, T, D], keys/values [H_kv, S, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "row_attention: fp32 only");
  const int64_t H = q.size(0), T = q.size(1), D = q.size(2), Hkv = keys.size(0);
  TORCH_CHECK(D % 32 == 0 && keys.size(2) == D && values.size(2) == D && values.size(0) == Hkv && Hkv > 0 && H % Hkv == 0,
              "row_attention: head dims must match (a multiple of 32) and H a multiple of H_kv");
  TORCH_CHECK(q.stride(2) == 1 && keys.stride(2) == 1 && values.stride(2) == 1 && keys.stride(1) == D && values.stride(1) == D,
              "row_attention: D contiguous, slots D apart");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && offsets.is_contiguous() &&
                  slots.is_contiguous() && offsets.numel() == T + 1,
              "row_attention: offsets [T + 1] and slots int64");
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t S = keys.size(1);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(off[t] < off[t + 1], "row_attention: every row sees a key");
  TORCH_CHECK(off[0] == 0 && off[T] == slots.numel(), "row_attention: offsets must span the slots");
  for (int64_t i = 0; i < slots.numel(); ++i) TORCH_CHECK(sl[i] >= 0 && sl[i] < S, "row_attention: slot out of range");
  at::Tensor out = at::empty({H, T, D}, q.options());
  const Job job{q.data_ptr<float>(), q.stride(0), q.stride(1), keys.data_ptr<float>(), values.data_ptr<float>(),
                keys.stride(0), values.stride(0), off, sl, out.data_ptr<float>(), H, Hkv, T, D, static_cast<float>(scale)};
  specmesh_pool::parallel_chunks(Hkv * T, &item, &job, threads);
  return out;
}

}  // namespace

TORCH_LIBRARY(specmesh_attention, m) {
  m.def("row_attention(Tensor q, Tensor keys, Tensor values, Tensor offsets, Tensor slots, float scale, int threads) -> Tensor",
        &row_attention);
}
