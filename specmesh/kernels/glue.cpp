// specmesh glue kernels (AVX2): the small element-wise steps between a decoder layer's products, each
// one op where torch runs 5 to 12 (a decode step of a 0.5B model issued ~40 small torch ops a layer,
// a third of its time; the products are the rest).
//   rms_norm(x, w, eps):          y = w * (x * 1 / sqrt(mean(x^2) + eps)), per row
//   add_rms_norm(h, a, w, eps):   s = h + a, y = rms_norm(s): the residual add and the next norm
//   rope(q, k, v, cos, sin):      [T, n * D] rows (views of one fused product, any row stride) ->
//                                 q, k rotated (x * cos + rotate_half(x) * sin) and v, each [n, T, D]
//   silu_mul(g, u):               silu(g) * u = g / (1 + e^-g) * u
//   lean_layers(h, ...):          a lean step's decoder layers (specmesh.model._lean_layers): these
//                                 ops, the integer kernel's products and row attention, in one call
// fp32, the last dimension contiguous and a multiple of 8 (rope: D a multiple of 16). Every output row
// is one fixed sequence of fp32 operations on its own input row (sums in 8 lanes, then `hsum8`), whatever
// the other rows or the thread count: rows stay batch-invariant, as the products and attention keep them.
// Rows are split over the kernel pool when there are enough of them to pay for it.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

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

// --- the decoder layers of a lean step in one call (specmesh.model._lean_layers) ---------------
// The same ops, in the same order, with the same inputs as the Python loop they replace: the
// integer kernel's products (by name: the variant the caller picked for this row count, through
// the dispatcher), the row attention kernel, and this file's glue. Only the Python around them is
// gone (about 40 op calls a layer from the interpreter).
using QdotFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                          int64_t, int64_t);
using AttnFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          double, int64_t);

template <class Fn>
c10::TypedOperatorHandle<Fn> op_named(const std::string& name) {
  static std::mutex mu;
  static std::unordered_map<std::string, c10::TypedOperatorHandle<Fn>> found;
  std::lock_guard<std::mutex> lock(mu);
  auto it = found.find(name);
  if (it == found.end())
    it = found.emplace(name, c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<Fn>()).first;
  return it->second;
}

// One product of the plan: its tensors (codes, sb, sc, bias: empty for none) from `w`, and from
// `meta` its (n, bits, s, splits, split sizes...).
struct Product {
  const at::Tensor *codes, *sb, *sc, *bias;
  int64_t n, bits, s;
  std::vector<int64_t> splits;
};

struct PlanReader {
  at::TensorList w;
  at::IntArrayRef meta;
  size_t wi = 0, mi = 0;
  int64_t next() {
    TORCH_CHECK(mi < meta.size(), "lean_layers: plan ints end early");
    return meta[mi++];
  }
  const at::Tensor* tensor() {
    TORCH_CHECK(wi < w.size(), "lean_layers: plan tensors end early");
    return &w[wi++];
  }
  Product product() {
    Product p;
    p.codes = tensor(), p.sb = tensor(), p.sc = tensor(), p.bias = tensor();
    p.n = next(), p.bits = next(), p.s = next();
    for (int64_t k = next(); k > 0; --k) p.splits.push_back(next());
    return p;
  }
  std::vector<Product> products() {
    std::vector<Product> ps;
    for (int64_t k = next(); k > 0; --k) ps.push_back(product());
    return ps;
  }
};

// plan, per layer: tensors (input norm weight, post norm weight, then each product's four) and
// ints (qkv products, each product's, o's, gate/up products, each product's, down's); eps per layer
// (input norm's, post norm's). ops: the integer kernel op for 4-, 6- and 8-bit codes at these rows.
at::Tensor lean_layers(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, at::TensorList w, at::IntArrayRef meta,
                       at::ArrayRef<double> eps, const at::Tensor& kall, const at::Tensor& vall, const at::Tensor& offsets,
                       const at::Tensor& slots, int64_t start, int64_t head_dim, const std::string& op4,
                       const std::string& op6, const std::string& op8, int64_t threads) {
  const int64_t layers = static_cast<int64_t>(eps.size() / 2), t = h.size(0), end = start + t;
  TORCH_CHECK(layers > 0 && kall.dim() == 4 && kall.size(0) == layers && vall.sizes() == kall.sizes(),
              "lean_layers: one cache layer per plan layer");
  const c10::TypedOperatorHandle<QdotFn> qdot[3] = {op_named<QdotFn>(op4), op_named<QdotFn>(op6), op_named<QdotFn>(op8)};
  const auto attend = op_named<AttnFn>("specmesh_attention::row_attention");
  const auto product = [&](const Product& p, const at::Tensor& x) {
    at::Tensor y = qdot[p.bits == 4 ? 0 : p.bits == 6 ? 1 : 2].call(x, *p.codes, *p.sb, *p.sc, p.n, p.bits, p.s, threads);
    return p.bias->numel() ? at::add(y, *p.bias) : y;
  };
  const auto apply = [&](const std::vector<Product>& ps, const at::Tensor& x) {
    std::vector<at::Tensor> outs;
    for (const Product& p : ps) {
      at::Tensor y = product(p, x);
      if (p.splits.empty()) {
        outs.push_back(y);
      } else {
        for (at::Tensor& part : y.split_with_sizes(p.splits, -1)) outs.push_back(part);
      }
    }
    return outs;
  };
  PlanReader plan{w, meta};
  const at::Tensor* input_norm = plan.tensor();
  at::Tensor x = rms_norm(h, *input_norm, eps[0], threads);
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* post_norm = plan.tensor();
    const std::vector<Product> qkv = plan.products();
    const Product o = plan.product();
    const std::vector<Product> gate_up = plan.products();
    const Product down = plan.product();
    const std::vector<at::Tensor> q_k_v = apply(qkv, x);
    TORCH_CHECK(q_k_v.size() == 3, "lean_layers: q, k, v expected");
    at::Tensor kc = kall.select(0, i), vc = vall.select(0, i);
    at::Tensor q = rope_into(q_k_v[0], q_k_v[1], q_k_v[2], cos, sin, head_dim, kc, vc, start, threads);  // [H, T, D]
    if (q.stride(-1) != 1) q = q.contiguous();
    const at::Tensor a = attend.call(q, kc.slice(1, 0, end), vc.slice(1, 0, end), offsets, slots,
                                     1.0 / std::sqrt(static_cast<double>(q.size(-1))), threads);
    at::Tensor after;
    std::tie(after, x) = add_rms_norm(h, product(o, a.transpose(0, 1).reshape({t, -1})), *post_norm, eps[2 * i + 1],
                                      threads);
    const std::vector<at::Tensor> g_u = apply(gate_up, x);
    TORCH_CHECK(g_u.size() == 2, "lean_layers: gate, up expected");
    const at::Tensor m = product(down, silu_mul(g_u[0], g_u[1], threads));
    if (i + 1 < layers) {
      input_norm = plan.tensor();
      std::tie(h, x) = add_rms_norm(after, m, *input_norm, eps[2 * i + 2], threads);
    } else {
      h = at::add(after, m);
    }
  }
  TORCH_CHECK(plan.wi == w.size() && plan.mi == meta.size(), "lean_layers: plan longer than its layers");
  return h;
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
  m.def("lean_layers(Tensor h, Tensor cos, Tensor sin, Tensor[] w, int[] meta, float[] eps, Tensor(a!) kall, "
        "Tensor(b!) vall, Tensor offsets, Tensor slots, int start, int head_dim, str op4, str op6, str op8, "
        "int threads) -> Tensor",
        &lean_layers);
}
