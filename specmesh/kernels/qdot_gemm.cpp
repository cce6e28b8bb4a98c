// specmesh integer small-M linear (AVX2): y[M, N] = x[M, K] @ W^T with W as unsigned integer codes,
// w[n, k] = q[n, k] * scale[n, k / GS] + bias[n, k / GS], and x quantized per row to int8 in blocks of
// 32 (xq = round(x * 127 / max|x|), one fp32 step dx per block), the way llama.cpp multiplies GGUF
// blocks. Three code layouts:
//   BITS 4: q in 0..15, GS 32 (GGUF Q4_0 / Q4_1 / Q4_K), two codes a byte;
//   BITS 6: q in 0..63, GS 16 (GGUF Q6_K, Q5_0 / Q5_1 as pairs of 16-groups), a nibble plane and a
//           2-bit plane, 6 bits a code;
//   BITS 8: q in -128..127, GS 16 (GGUF Q8_0 as pairs of 16-groups), one signed byte a code.
// Three ways to hold (scale, bias):
//   S 0: one fp32 pair per group;
//   fp16 pairs (P 3, `HALF`): one fp16 pair per S groups (S 1, or 2: a GGUF 32-block split into two
//        16-groups), for types whose scale and bias are fp16 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
//        the same numbers as fp32 pairs, a quarter to a half of their bytes;
//   S > 0 (GGUF K-quants, the file's own form): per super-block of S groups a pair (d, dm), per
//        group int8 multipliers (sc, mn): scale = d * sc, bias = dm * mn, each one fp32 product, as
//        the file's dequantization computes it. P 1 plane of multipliers (mn = sc: Q6_K) or 2. The
//        pair is fp16 (P 4 and 5 for 1 and 2 planes: the file's own fp16 d and dmin, Q4_K 4.625 bits
//        a weight, Q6_K 6.625) or, where a value is not an fp16 one, fp32 (4.75, 6.75).
// y[m, n] = sum_g scale[n, g] * dx[m, g] * (sum_k in g q[n, k] xq[m, k]) + bias[n, g] * xs[m, g],
// xs = dx * sum of xq over the group. The integer sums are exact; the fp32 part is, per output, one
// fixed sequence (groups ascending, two FMAs each) whatever M, the tiling or the thread split: the
// product is batch-invariant, so a tree's rows equal the same rows decoded one at a time.
//
// Why this and not ggml's vec_dot (specmesh.kernels.ggml) for every row count: a dot product per
// output unpacks a weight block again for every activation row, so M rows cost ~M times one. Here a
// block of 8 output rows is unpacked once and meets up to 8 activation rows (10 in the VNNI builds,
// see `blocks`); an extra row costs a maddubs and an add per 32 weights. One row is bound by memory
// bandwidth: the bytes a weight takes are what a decode step pays.
//
// Three builds of this source (specmesh.kernels.qdot.VARIANTS): AVX2 (maddubs + madd) and, compiled with
// -mavx512vnni -mavx512vl, AVX512-VNNI (dpbusd: the 4 byte products of a lane summed into int32 in one
// instruction) on 512-bit registers holding two blocks, or (-DQDOT_YMM) on 256-bit registers, one
// block at a time: a CPU that runs 512-bit operations as two 256-bit halves (AMD Zen 4) gains nothing
// from the wide registers and pays the inserts that pair two blocks. The integer sums are exact either
// way, so all give bit-identical outputs; which one runs is chosen by timing them on the machine at hand.
//
// Layout (specmesh.kernels.qdot.pack): output rows in blocks of 8, one 32-bit lane per row, so a
// broadcast of 4 activation bytes meets 4 consecutive inputs of all 8 rows:
//   BITS 4: codes [N/8, K/32, 4, 32]: chunk c byte 4r + i = q[8b + r][32g + 8c + i] | q[8b + r][32g + 8c + 4 + i] << 4
//   BITS 8: codes [N/8, K/16, 4, 32]: chunk c byte 4r + i = q[8b + r][16g + 4c + i]
//   BITS 6: codes [N/8, K/16, 96]: with chunk c byte j as for BITS 8, bytes [32h, 32h + 32) hold chunk
//           2h in the low nibble and 2h + 1 in the high, bytes [64, 96) chunk c's top 2 bits at bit 2c.
//   S 0: sb [N/8, K/GS, 2, 8] float: the 8 rows' scales, then their biases.
//   HALF: sb [N/8, K/GS/S, 2, 8] half, as for S 0.
//   S > 0: sb [N/8, K/GS/S, 2, 8] float (P 1, 2) or half (P 4, 5): d, then dm; sc [N/8, K/GS, planes, 8]
//          int8: sc, then mn.
// Rows past N are zero padding.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "pool.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QDOT_VNNI 1
#if defined(QDOT_YMM)  // dpbusd on 256-bit registers only: one block (8 output rows) at a time
#define QDOT_PAIRS 0
#define QDOT_NS specmesh_qdot_vnni256
#else
#define QDOT_PAIRS 1
#define QDOT_NS specmesh_qdot_vnni
#endif
#else
#define QDOT_VNNI 0
#define QDOT_PAIRS 0
#define QDOT_NS specmesh_qdot
#endif

namespace {

constexpr int LANES = 8;  // output rows per block
constexpr int XB = 32;    // activation quantization block
// Software prefetch distance in groups (~3 KB of codes ahead): one row's product is bound by memory,
// and the hardware prefetcher alone left the core waiting (1.1-1.2x slower decode steps).
constexpr int PF = 24;
constexpr int HALF = 3;  // P of fp16 (scale, bias) pairs
// P of super-blocks: 1 or 2 planes of multipliers, (d, dm) fp32; 4 or 5: the same, (d, dm) fp16
constexpr int planes_of(int P) { return P == 1 || P == 4 ? 1 : P == 2 || P == 5 ? 2 : 0; }
constexpr bool half_pairs(int P) { return P == HALF || P >= 4; }  // sb holds fp16 values
// The per-group steps, inlined into every tile whatever the compiler's size heuristics: left out of
// line (GCC did so for the 6-bit codes), a group's unpacked codes and the tile's accumulators go
// through memory at every call, 1.5-3x slower at 3 rows and more.
#define QDOT_INLINE inline __attribute__((always_inline))

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

QDOT_INLINE int32_t quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

struct Product {
  const int8_t* XQ;  // [M, K]
  const float* DX;   // [M, K / 32]
  const float* XS;   // [M, K / GS]: dx * sum of xq over the group
  const uint8_t* C;
  const float* SB;
  const uint16_t* SH;  // HALF: the fp16 pairs
  const int8_t* SC;  // S > 0: the groups' multipliers
  float* Y;
  int64_t M, K, N, NB, blocks_per_chunk, S;
};

QDOT_INLINE __m256 halves8(const uint16_t* p) {  // 8 fp16 -> 8 fp32 (exact)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

QDOT_INLINE __m256 widen8(const int8_t* p) {  // 8 int8 -> 8 fp32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// A group's codes of a block of 8 output rows, unpacked into registers once for all activation rows.
template <int BITS>
struct Codes {
  __m256i v[8];  // BITS 4: 4 low-nibble then 4 high-nibble chunks; 8: |q| then q; 6: 4 chunks

  QDOT_INLINE explicit Codes(const uint8_t* c) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if constexpr (BITS == 4) {
      for (int ch = 0; ch < 4; ++ch) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + ch * 32));
        v[ch] = _mm256_and_si256(w, low4);
        v[4 + ch] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
      }
    } else if constexpr (BITS == 8) {
      for (int ch = 0; ch < 4; ++ch) {
        v[4 + ch] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + ch * 32));
        v[ch] = _mm256_abs_epi8(v[4 + ch]);
      }
    } else {
      // Nibbles, and each chunk's 2 top bits moved to bits 4..5 (16-bit shifts, then a byte mask).
      const __m256i n0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
      const __m256i n1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64)), top = _mm256_set1_epi8(0x30);
      v[0] = _mm256_or_si256(_mm256_and_si256(n0, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), top));
      v[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n0, 4), low4), _mm256_and_si256(_mm256_slli_epi16(h, 2), top));
      v[2] = _mm256_or_si256(_mm256_and_si256(n1, low4), _mm256_and_si256(h, top));
      v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n1, 4), low4), _mm256_and_si256(_mm256_srli_epi16(h, 2), top));
    }
  }

  // The 8 rows' exact integer sums against one activation row's group (xq at its first input).
  QDOT_INLINE __m256i dot(const int8_t* xq) const {
#if QDOT_VNNI
    // Two accumulators: a dpbusd's latency, not its throughput, would bound one decode row.
    const auto x4 = [&](int off) { return _mm256_set1_epi32(quad(xq + off)); };
    if constexpr (BITS == 4) {
      __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
      for (int ch = 0; ch < 4; ++ch) {
        a = _mm256_dpbusd_epi32(a, v[ch], x4(ch * 8));
        b = _mm256_dpbusd_epi32(b, v[4 + ch], x4(ch * 8 + 4));
      }
      return _mm256_add_epi32(a, b);
    } else if constexpr (BITS == 8) {  // |q| unsigned, x with q's sign (|x| <= 127: no overflow)
      __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
      for (int ch = 0; ch < 4; ch += 2) {
        a = _mm256_dpbusd_epi32(a, v[ch], _mm256_sign_epi8(x4(4 * ch), v[4 + ch]));
        b = _mm256_dpbusd_epi32(b, v[ch + 1], _mm256_sign_epi8(x4(4 * ch + 4), v[5 + ch]));
      }
      return _mm256_add_epi32(a, b);
    } else {
      __m256i a = _mm256_dpbusd_epi32(_mm256_setzero_si256(), v[0], x4(0));
      __m256i b = _mm256_dpbusd_epi32(_mm256_setzero_si256(), v[1], x4(4));
      a = _mm256_dpbusd_epi32(a, v[2], x4(8));
      b = _mm256_dpbusd_epi32(b, v[3], x4(12));
      return _mm256_add_epi32(a, b);
    }
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (BITS == 4) {
      // 8 maddubs of codes <= 15 and |xq| <= 127 per int16 lane: |sum| <= 8 * 2 * 15 * 127 < 2^15.
      __m256i s16 = _mm256_setzero_si256();
      for (int ch = 0; ch < 4; ++ch) {
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v[ch], _mm256_set1_epi32(quad(xq + ch * 8))));
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v[4 + ch], _mm256_set1_epi32(quad(xq + ch * 8 + 4))));
      }
      return _mm256_madd_epi16(s16, ones);
    } else if constexpr (BITS == 8) {
      // signed codes: maddubs takes |q| (<= 128) and x with q's sign; one per int16 lane
      // (2 * 128 * 127 < 2^15), then widen.
      __m256i t[4];
      for (int ch = 0; ch < 4; ++ch)
        t[ch] = _mm256_madd_epi16(_mm256_maddubs_epi16(v[ch], _mm256_sign_epi8(_mm256_set1_epi32(quad(xq + 4 * ch)), v[4 + ch])), ones);
      return _mm256_add_epi32(_mm256_add_epi32(t[0], t[1]), _mm256_add_epi32(t[2], t[3]));
    } else {
      // codes <= 63: two maddubs per int16 lane at most (2 * 2 * 63 * 127 < 2^15), then widen.
      const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(v[0], _mm256_set1_epi32(quad(xq))),
                                         _mm256_maddubs_epi16(v[1], _mm256_set1_epi32(quad(xq + 4))));
      const __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(v[2], _mm256_set1_epi32(quad(xq + 8))),
                                         _mm256_maddubs_epi16(v[3], _mm256_set1_epi32(quad(xq + 12))));
      return _mm256_add_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(d, ones));
    }
#endif
  }
};

// R activation rows from m (unrolled) against a group's codes: acc[i] += scale dx isum, then bias xs.
template <int BITS, int R>
QDOT_INLINE void rows_of(const Codes<BITS>& u, const Product& p, int64_t m, int64_t g, __m256 s, __m256 bias, __m256* acc) {
  constexpr int GS = BITS == 4 ? 32 : 16;
  const int64_t G = p.K / GS, XG = p.K / XB;
  __m256i isum[R];
  for (int i = 0; i < R; ++i) isum[i] = u.dot(p.XQ + (m + i) * p.K + g * GS);
  for (int i = 0; i < R; ++i) {
    const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(p.DX[(m + i) * XG + (g * GS) / XB]));
    acc[i] = _mm256_fmadd_ps(sd, _mm256_cvtepi32_ps(isum[i]), acc[i]);
    acc[i] = _mm256_fmadd_ps(bias, _mm256_set1_ps(p.XS[(m + i) * G + g]), acc[i]);
  }
}

// One block of 8 output rows against activation rows [m0, m0 + MM), unrolled: each group's codes
// unpacked once for all MM rows. P 0: fp32 pairs per group (S 0); HALF: fp16 pairs per S groups;
// else super-blocks with P planes of multipliers.
template <int BITS, int MM, int P>
inline void tile(const Product& p, int64_t m0, int64_t b) {
  constexpr int GS = BITS == 4 ? 32 : 16;
  const int64_t G = p.K / GS;
  __m256 acc[MM];
  for (int i = 0; i < MM; ++i) acc[i] = _mm256_setzero_ps();
  constexpr int CB = BITS == 6 ? 96 : 128;  // code bytes per group of a block
  const uint8_t* cb = p.C + b * G * CB;
  constexpr int NP = planes_of(P);
  const float* sbb = half_pairs(P) ? nullptr : p.SB + b * (P ? G / p.S : G) * 2 * LANES;
  const uint16_t* shb = half_pairs(P) ? p.SH + b * (G / p.S) * 2 * LANES : nullptr;
  const int8_t* scb = NP ? p.SC + b * G * NP * LANES : nullptr;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* c = cb + g * CB;
    _mm_prefetch(reinterpret_cast<const char*>(c + PF * CB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(c + PF * CB + 64), _MM_HINT_T0);
    if constexpr (P == 0) _mm_prefetch(reinterpret_cast<const char*>(sbb + (g + PF) * 2 * LANES), _MM_HINT_T0);
    if constexpr (P == HALF) _mm_prefetch(reinterpret_cast<const char*>(shb + (g + PF) / p.S * 2 * LANES), _MM_HINT_T0);
    if constexpr (NP > 0) {  // super-blocks: the multipliers' stream and the (d, dm) pairs'
      _mm_prefetch(reinterpret_cast<const char*>(scb + (g + PF) * NP * LANES), _MM_HINT_T0);
      const int64_t o = (g + PF) / p.S * 2 * LANES;
      _mm_prefetch(half_pairs(P) ? reinterpret_cast<const char*>(shb + o) : reinterpret_cast<const char*>(sbb + o), _MM_HINT_T0);
    }
    const Codes<BITS> u(c);
    __m256 s, bias;
    if constexpr (P == 0) {
      s = _mm256_loadu_ps(sbb + g * 2 * LANES);
      bias = _mm256_loadu_ps(sbb + g * 2 * LANES + LANES);
    } else if constexpr (P == HALF) {
      s = halves8(shb + g / p.S * 2 * LANES);
      bias = halves8(shb + g / p.S * 2 * LANES + LANES);
    } else {
      const int64_t o = (g / p.S) * 2 * LANES;
      const __m256 d = half_pairs(P) ? halves8(shb + o) : _mm256_loadu_ps(sbb + o);
      const __m256 dm = half_pairs(P) ? halves8(shb + o + LANES) : _mm256_loadu_ps(sbb + o + LANES);
      const __m256 sc = widen8(scb + g * NP * LANES);
      s = _mm256_mul_ps(d, sc);
      bias = _mm256_mul_ps(dm, NP == 2 ? widen8(scb + g * NP * LANES + LANES) : sc);
    }
    rows_of<BITS, MM>(u, p, m0, g, s, bias, acc);
  }
  const int64_t n0 = b * LANES;
  for (int i = 0; i < MM; ++i) {
    float* y = p.Y + (m0 + i) * p.N + n0;
    if (n0 + LANES <= p.N) {
      _mm256_storeu_ps(y, acc[i]);
    } else {
      alignas(32) float tmp[LANES];
      _mm256_store_ps(tmp, acc[i]);
      for (int64_t j = 0; n0 + j < p.N; ++j) y[j] = tmp[j];
    }
  }
}

#if QDOT_PAIRS
// AVX-512: two blocks (16 output rows) per register, lanes 0-7 block b and 8-15 block b + 1, so one
// broadcast activation quad and one dpbusd serve 16 rows. Every lane does what `tile` does for it, in
// the same order: outputs are bit-identical to the 8-row path.
QDOT_INLINE __m512i pair_bytes(const uint8_t* c0, const uint8_t* c1) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c0))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c1)), 1);
}

QDOT_INLINE __m512 pair_floats(const float* a, const float* b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a))),
                                             _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}

QDOT_INLINE __m512 pair_halves(const uint16_t* a, const uint16_t* b) {  // 8 + 8 fp16 -> 16 fp32
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}

QDOT_INLINE __m512 pair_widen(const int8_t* a, const int8_t* b) {  // 8 + 8 int8 -> 16 fp32
  const __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

template <int BITS>
struct Codes2 {
  __m512i v[8];  // as Codes::v, two blocks wide

  QDOT_INLINE Codes2(const uint8_t* c0, const uint8_t* c1) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    if constexpr (BITS == 4) {
      for (int ch = 0; ch < 4; ++ch) {
        const __m512i w = pair_bytes(c0 + ch * 32, c1 + ch * 32);
        v[ch] = _mm512_and_si512(w, low4);
        v[4 + ch] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
      }
    } else if constexpr (BITS == 8) {
      for (int ch = 0; ch < 4; ++ch) {
        v[4 + ch] = pair_bytes(c0 + ch * 32, c1 + ch * 32);
        v[ch] = _mm512_abs_epi8(v[4 + ch]);
      }
    } else {
      const __m512i n0 = pair_bytes(c0, c1), n1 = pair_bytes(c0 + 32, c1 + 32), h = pair_bytes(c0 + 64, c1 + 64);
      const __m512i top = _mm512_set1_epi8(0x30);
      v[0] = _mm512_or_si512(_mm512_and_si512(n0, low4), _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
      v[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n0, 4), low4), _mm512_and_si512(_mm512_slli_epi16(h, 2), top));
      v[2] = _mm512_or_si512(_mm512_and_si512(n1, low4), _mm512_and_si512(h, top));
      v[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n1, 4), low4), _mm512_and_si512(_mm512_srli_epi16(h, 2), top));
    }
  }

  QDOT_INLINE __m512i dot(const int8_t* xq) const {
    const auto x4 = [&](int off) { return _mm512_set1_epi32(quad(xq + off)); };
    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
    if constexpr (BITS == 4) {
      for (int ch = 0; ch < 4; ++ch) {
        a = _mm512_dpbusd_epi32(a, v[ch], x4(ch * 8));
        b = _mm512_dpbusd_epi32(b, v[4 + ch], x4(ch * 8 + 4));
      }
    } else if constexpr (BITS == 8) {  // x negated where q < 0 (AVX-512 has no sign_epi8); q = 0 adds 0
      const __m512i zero = _mm512_setzero_si512();
      for (int ch = 0; ch < 4; ch += 2) {
        const __m512i xa = x4(4 * ch), xb = x4(4 * ch + 4);
        a = _mm512_dpbusd_epi32(a, v[ch], _mm512_mask_sub_epi8(xa, _mm512_movepi8_mask(v[4 + ch]), zero, xa));
        b = _mm512_dpbusd_epi32(b, v[ch + 1], _mm512_mask_sub_epi8(xb, _mm512_movepi8_mask(v[5 + ch]), zero, xb));
      }
    } else {
      a = _mm512_dpbusd_epi32(a, v[0], x4(0));
      b = _mm512_dpbusd_epi32(b, v[1], x4(4));
      a = _mm512_dpbusd_epi32(a, v[2], x4(8));
      b = _mm512_dpbusd_epi32(b, v[3], x4(12));
    }
    return _mm512_add_epi32(a, b);
  }
};

template <int BITS, int MM, int P>
inline void tile2(const Product& p, int64_t m0, int64_t b) {
  constexpr int GS = BITS == 4 ? 32 : 16;
  constexpr int CB = BITS == 6 ? 96 : 128;
  const int64_t G = p.K / GS, XG = p.K / XB, SBG = (P ? G / p.S : G) * 2 * LANES;  // pairs' values a block
  __m512 acc[MM];
  for (int i = 0; i < MM; ++i) acc[i] = _mm512_setzero_ps();
  const uint8_t* cb0 = p.C + b * G * CB;
  const uint8_t* cb1 = cb0 + G * CB;
  constexpr int NP = planes_of(P);
  const float* sb0 = half_pairs(P) ? nullptr : p.SB + b * SBG;
  const float* sb1 = half_pairs(P) ? nullptr : sb0 + SBG;
  const uint16_t* sh0 = half_pairs(P) ? p.SH + b * SBG : nullptr;
  const uint16_t* sh1 = half_pairs(P) ? sh0 + SBG : nullptr;
  const int8_t* sc0 = NP ? p.SC + b * G * NP * LANES : nullptr;
  const int8_t* sc1 = NP ? sc0 + G * NP * LANES : nullptr;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* c0 = cb0 + g * CB;
    const uint8_t* c1 = cb1 + g * CB;
    _mm_prefetch(reinterpret_cast<const char*>(c0 + PF * CB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(c0 + PF * CB + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(c1 + PF * CB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(c1 + PF * CB + 64), _MM_HINT_T0);
    if constexpr (P == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(sb0 + (g + PF) * 2 * LANES), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(sb1 + (g + PF) * 2 * LANES), _MM_HINT_T0);
    } else if constexpr (P == HALF) {
      _mm_prefetch(reinterpret_cast<const char*>(sh0 + (g + PF) / p.S * 2 * LANES), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(sh1 + (g + PF) / p.S * 2 * LANES), _MM_HINT_T0);
    } else if constexpr (NP > 0) {
      _mm_prefetch(reinterpret_cast<const char*>(sc0 + (g + PF) * NP * LANES), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(sc1 + (g + PF) * NP * LANES), _MM_HINT_T0);
      const int64_t o = (g + PF) / p.S * 2 * LANES;
      _mm_prefetch(half_pairs(P) ? reinterpret_cast<const char*>(sh0 + o) : reinterpret_cast<const char*>(sb0 + o), _MM_HINT_T0);
      _mm_prefetch(half_pairs(P) ? reinterpret_cast<const char*>(sh1 + o) : reinterpret_cast<const char*>(sb1 + o), _MM_HINT_T0);
    }
    const Codes2<BITS> u(c0, c1);
    __m512 s, bias;
    if constexpr (P == 0) {
      s = pair_floats(sb0 + g * 2 * LANES, sb1 + g * 2 * LANES);
      bias = pair_floats(sb0 + g * 2 * LANES + LANES, sb1 + g * 2 * LANES + LANES);
    } else if constexpr (P == HALF) {
      const int64_t o = g / p.S * 2 * LANES;
      s = pair_halves(sh0 + o, sh1 + o);
      bias = pair_halves(sh0 + o + LANES, sh1 + o + LANES);
    } else {
      const int64_t o = (g / p.S) * 2 * LANES;
      const __m512 d = half_pairs(P) ? pair_halves(sh0 + o, sh1 + o) : pair_floats(sb0 + o, sb1 + o);
      const __m512 dm = half_pairs(P) ? pair_halves(sh0 + o + LANES, sh1 + o + LANES)
                                      : pair_floats(sb0 + o + LANES, sb1 + o + LANES);
      const __m512 sc = pair_widen(sc0 + g * NP * LANES, sc1 + g * NP * LANES);
      s = _mm512_mul_ps(d, sc);
      bias = _mm512_mul_ps(dm, NP == 2 ? pair_widen(sc0 + g * NP * LANES + LANES, sc1 + g * NP * LANES + LANES) : sc);
    }
    __m512i isum[MM];
    for (int i = 0; i < MM; ++i) isum[i] = u.dot(p.XQ + (m0 + i) * p.K + g * GS);
    for (int i = 0; i < MM; ++i) {
      const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(p.DX[(m0 + i) * XG + (g * GS) / XB]));
      acc[i] = _mm512_fmadd_ps(sd, _mm512_cvtepi32_ps(isum[i]), acc[i]);
      acc[i] = _mm512_fmadd_ps(bias, _mm512_set1_ps(p.XS[(m0 + i) * G + g]), acc[i]);
    }
  }
  const int64_t n0 = b * LANES;
  for (int i = 0; i < MM; ++i) {
    float* y = p.Y + (m0 + i) * p.N + n0;
    if (n0 + 2 * LANES <= p.N) {
      _mm512_storeu_ps(y, acc[i]);
    } else {
      alignas(64) float tmp[2 * LANES];
      _mm512_store_ps(tmp, acc[i]);
      for (int64_t j = 0; n0 + j < p.N; ++j) y[j] = tmp[j];
    }
  }
}
#endif

constexpr int TILE = 8;  // activation rows per tile
constexpr int TAIL = QDOT_VNNI ? 2 : 0;  // up to this many rows left over join the last 8-row tile

// f(std::integral_constant<int, r>) for a run-time r in 1..T.
template <int T, class F>
inline void with_rows(int64_t r, const F& f) {
  if constexpr (T > 1) {
    if (r != T) return with_rows<T - 1>(r, f);
  }
  f(std::integral_constant<int, T>{});
}

// One block (W 1) or two (W 2: the AVX-512 build) of output rows against every activation row, in
// unrolled tiles of 8 rows and one of what is left: each tile unpacks every group's codes again, so a
// lone left-over row costs far more than a row inside a tile. In the VNNI builds (32 vector
// registers) 1 or 2 left-over rows join the last 8-row tile instead (faster at 9 rows for 4- and
// 6-bit codes, measured; larger single tiles and near-equal splits were not). The AVX2 build (16
// registers) keeps 8 + rest. Only how rows are grouped changes: every output's operations are the same.
template <int BITS, int P, int W>
inline void blocks(const Product& p, int64_t b) {
  const auto run = [&](int64_t m, int64_t r) {
    with_rows<TILE + TAIL>(r, [&](auto mm) {
#if QDOT_PAIRS
      if constexpr (W == 2) {
        tile2<BITS, decltype(mm)::value, P>(p, m, b);
        return;
      }
#endif
      tile<BITS, decltype(mm)::value, P>(p, m, b);
    });
  };
  int64_t m = 0;
  for (; p.M - m > TILE + TAIL; m += TILE) run(m, TILE);
  if (m < p.M) run(m, p.M - m);
}

template <int BITS, int P>
void chunk(const void* ctx, int64_t c) {
  const Product& p = *static_cast<const Product*>(ctx);
  const int64_t end = std::min(p.NB, (c + 1) * p.blocks_per_chunk);
  int64_t b = c * p.blocks_per_chunk;
#if QDOT_PAIRS
  for (; b + 2 <= end; b += 2) blocks<BITS, P, 2>(p, b);
#endif
  for (; b < end; ++b) blocks<BITS, P, 1>(p, b);
}

using ChunkFn = void (*)(const void*, int64_t);

template <int BITS>
ChunkFn chunk_for(int64_t P) {
  switch (P) {
    case 0: return &chunk<BITS, 0>;
    case 1: return &chunk<BITS, 1>;
    case 2: return &chunk<BITS, 2>;
    case HALF: return &chunk<BITS, HALF>;
    case 4: return &chunk<BITS, 4>;
    default: return &chunk<BITS, 5>;
  }
}

at::Tensor qdot_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& sb, const at::Tensor& sc,
                       int64_t N, int64_t bits, int64_t S, int64_t threads) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "qdot_linear: x fp32 CPU [M, K]");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "qdot_linear: bits 4, 6 or 8");
  const int64_t M = x_in.size(0), K = x_in.size(1), GS = bits == 4 ? 32 : 16, G = K / GS, NB = (N + LANES - 1) / LANES;
  TORCH_CHECK(K % XB == 0, "qdot_linear: K must be a multiple of 32");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.numel() == NB * G * (bits == 6 ? 96 : 128),
              "qdot_linear: codes [N/8, K/GS, 128] uint8 (96 for bits 6)");
  TORCH_CHECK(S >= 0 && (S == 0 || G % S == 0), "qdot_linear: S must divide K/GS");
  const bool half = sb.scalar_type() == at::kHalf;
  const int64_t planes = S == 0 ? 0 : sc.numel() / std::max<int64_t>(1, NB * G * LANES);  // of multipliers
  TORCH_CHECK((sb.scalar_type() == at::kFloat || (half && S > 0)) && sb.is_contiguous() &&
                  sb.numel() == NB * (S ? G / S : G) * 2 * LANES,
              "qdot_linear: sb [N/8, K/GS (/ S), 2, 8] float, or half with S > 0");
  TORCH_CHECK(S == 0 || (half && sc.numel() == 0) ||
                  (sc.scalar_type() == at::kChar && sc.is_contiguous() && (planes == 1 || planes == 2) &&
                   sc.numel() == NB * G * planes * LANES),
              "qdot_linear: sc [N/8, K/GS, 1 or 2, 8] int8, or empty with fp16 pairs");
  const int64_t P = half ? (planes ? planes + 3 : HALF) : planes;
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* X = x.data_ptr<float>();
  // Per row: int8 codes and one step per 32 inputs, and the groups' exact quantized sums.
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * (K / XB)), xs(M * G);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i lim = _mm256_set1_epi32(127), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < K / XB; ++j) {
      const float* px = X + m * K + j * XB;
      __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(px));
      for (int u = 8; u < XB; u += 8) a = _mm256_max_ps(a, _mm256_andnot_ps(sign, _mm256_loadu_ps(px + u)));
      const float amax = hmax8(a), d = amax / 127.0f;
      dx[m * (K / XB) + j] = d;
      const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
      __m256i q[4];
      for (int u = 0; u < 4; ++u) {
        const __m256i r = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(px + 8 * u), inv),
                                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        q[u] = _mm256_max_epi32(_mm256_min_epi32(r, lim), _mm256_sub_epi32(_mm256_setzero_si256(), lim));
      }
      // int32 -> int8 (the packs work per 128-bit lane; the permute restores input order)
      const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq.data() + m * K + j * XB), _mm256_permutevar8x32_epi32(b, order));
      // The bias term multiplies the same quantized inputs as the codes do, so the product is exactly
      // sum_k w[k] * (xq[k] dx): quantization error scales with w, not with the larger q * scale.
      alignas(32) int32_t t[8];
      if (GS == 32) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(t), _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
        xs[m * G + j] = d * static_cast<float>(t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7]);
      } else {
        for (int h = 0; h < 2; ++h) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(t), _mm256_add_epi32(q[2 * h], q[2 * h + 1]));
          xs[m * G + 2 * j + h] = d * static_cast<float>(t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7]);
        }
      }
    }
  }
  // ~32 KB of codes a chunk: cheap to claim, many per thread.
  const int64_t per = 2 * std::max<int64_t>(1, 16384 / (G * 128));  // even: the AVX-512 build takes blocks in pairs
  const Product p{xq.data(), dx.data(), xs.data(), codes.data_ptr<uint8_t>(), half ? nullptr : sb.data_ptr<float>(),
                  half ? reinterpret_cast<const uint16_t*>(sb.data_ptr<at::Half>()) : nullptr,
                  planes ? sc.data_ptr<int8_t>() : nullptr, y.data_ptr<float>(), M, K, N, NB, per, S};
  specmesh_pool::parallel_chunks((NB + per - 1) / per, bits == 4 ? chunk_for<4>(P) : bits == 6 ? chunk_for<6>(P) : chunk_for<8>(P),
                                 &p, threads);
  return y;
}

}  // namespace

#define QDOT_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)  // expands QDOT_NS before TORCH_LIBRARY pastes it
QDOT_LIBRARY(QDOT_NS, m) {
  m.def("qdot_linear(Tensor x, Tensor codes, Tensor sb, Tensor sc, int n, int bits, int s, int threads) -> Tensor",
        &qdot_linear);
}
