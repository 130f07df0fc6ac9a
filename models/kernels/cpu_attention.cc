// Attention on CPU over the paged engine's pools of KV pages (a decode step's few queries, a
// prompt's chunk), registered with XLA's FFI beside the products of cpu_matmul.cc.

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

namespace {

using namespace podrun;

// A query attends over the key rows it sees in one softmax. With sinks, each query head n adds one
// logit sinks[n] that takes probability mass and contributes no value (GPT-OSS). Query heads
// n = k * G + g share kv head k (grouped-query).

constexpr float kMasked = -1e30f;

// e^x for a vector of scores (x <= 0 here: scores less their max). 2^(x log2 e) split into an
// integer power and 2^f, f in [-1/2, 1/2], by its degree-7 Taylor polynomial (relative error under
// 1e-7, as expf). Portable builds call expf.
inline void exp_lanes(float* x) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const float c[] = {1.f, 0.69314718f, 0.24022651f, 0.05550411f, 0.00961813f, 0.00133336f,
                     1.5403530e-4f, 1.5252734e-5f};
#if defined(__AVX512F__)
  vf t = _mm512_mul_ps(_mm512_max_ps(load(x), splat(-87.3f)), splat(1.44269504f));
  vf n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf f = _mm512_sub_ps(t, n);
#else
  vf t = _mm256_mul_ps(_mm256_max_ps(load(x), splat(-87.3f)), splat(1.44269504f));
  vf n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf f = _mm256_sub_ps(t, n);
#endif
  vf p = splat(c[7]);
  for (int i = 6; i >= 0; --i) p = fma(p, f, splat(c[i]));
#if defined(__AVX512F__)
  store(x, _mm512_scalef_ps(p, n));
#else  // 2^n by its exponent bits: n >= -126 (x >= -87.3), a normal float
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  store(x, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
#endif
#else
  for (int i = 0; i < kLanes; ++i) x[i] = std::exp(std::max(x[i], -87.3f));
#endif
}

template <typename C>
inline float dot_row(const float* q, const C* k, int64_t H) {
  int64_t h = 0;
  vf acc = zero();
  for (; h + kLanes <= H; h += kLanes) acc = fma(load(q + h), load_as_float(k + h), acc);
  float s = hsum(acc);
  for (; h < H; ++h) s += q[h] * float(k[h]);
  return s;
}

template <typename C>
inline void add_row(float w, const C* v, float* out, int64_t H) {
  int64_t h = 0;
  vf wv = splat(w);
  for (; h + kLanes <= H; h += kLanes) store(out + h, fma(wv, load_as_float(v + h), load(out + h)));
  for (; h < H; ++h) out[h] += w * float(v[h]);
}

// One query over the n rows idx[0 .. n) of kc, vc (in units of H; the scales ks, vs in units of 1),
// every one of them visible: paged attention's path for a head_dim the grouped one does not take.
// scores, w: room for n rounded up to kLanes.
template <typename C>
void attend_rows(const float* q, const C* kc, const C* vc, const float* ks, const float* vs,
                 const int32_t* idx, int64_t n, int64_t H, float scale, const float* sink,
                 float* scores, float* w, float* out) {
  int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  float m = sink ? *sink : kMasked;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = idx[j];
    scores[j] = dot_row(q, kc + r * H, H) * scale * (ks ? ks[r] : 1.f);
    m = std::max(m, scores[j]);
  }
  for (int64_t h = 0; h < H; ++h) out[h] = 0.f;
  if (m == kMasked) return;  // no rows and no sink
  for (int64_t j = 0; j < n; ++j) w[j] = scores[j] - m;
  for (int64_t j = n; j < padded; ++j) w[j] = -100.f;
  for (int64_t j = 0; j < padded; j += kLanes) exp_lanes(w + j);  // w = exp(scores - m)
  float total = sink ? std::exp(*sink - m) : 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = idx[j];
    total += w[j];
    add_row(w[j] * (vs ? vs[r] : 1.f), vc + r * H, out, H);
  }
  float inv = 1.f / total;
  for (int64_t h = 0; h < H; ++h) out[h] *= inv;
}

// The G query heads of one kv head together, for head_dim = kLanes * HV: each visible key and value
// row is loaded once for NG queries at a time, their dot products and weighted sums kept in
// registers, where attend_rows re-reads every row for every query. Only the visible rows (idx) are
// read.

// Rows are read kAhead rows ahead of use: at batch 1 a layer's cache arrives cold from DRAM on a
// single thread, and the hardware prefetcher alone leaves most of the bandwidth unused.
constexpr int64_t kAhead = 8;

template <int Locality = 3, typename C>
inline void prefetch_row(const C* r, int64_t H) {
  for (int64_t b = 0; b < H * int64_t(sizeof(C)); b += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(r) + b, 0, Locality);
}

// The scores go four rows at a time where their sums fit in registers beside the queries, each
// query's four sums added across lanes together (hsum4): one horizontal sum a row per query
// would be most of this loop.
template <typename C, int HV, int NG>
void group_scores(const float* q, const C* rows, const float* row_scale, const int32_t* idx,
                  int64_t n, float scale, float* s, int64_t ld, const C* ahead = nullptr) {
  constexpr int64_t H = HV * kLanes;
  vf qv[NG][HV];
  for (int g = 0; g < NG; ++g)
    for (int h = 0; h < HV; ++h) qv[g][h] = load(q + g * H + h * kLanes);
  auto row = [&](int64_t i, vf (&a)[NG]) {  // a[g]: query g times row i, lanes not yet added
    const C* r = rows + idx[i] * H;
    if (i + kAhead < n) prefetch_row(rows + idx[i + kAhead] * H, H);
    if (ahead) prefetch_row<2>(ahead + idx[i] * H, H);  // into L2 for the value pass
    vf kv[HV];
    for (int h = 0; h < HV; ++h) kv[h] = load_as_float(r + h * kLanes);
    for (int g = 0; g < NG; ++g) {
      a[g] = zero();
      for (int h = 0; h < HV; ++h) a[g] = fma(qv[g][h], kv[h], a[g]);
    }
  };
  auto row_scale_at = [&](int64_t i) { return row_scale ? scale * row_scale[idx[i]] : scale; };
  int64_t i = 0;
  if constexpr (NG * HV + HV + 4 * NG <= kVecRegs)
    for (; i + 4 <= n; i += 4) {
      vf a[4][NG];
      for (int j = 0; j < 4; ++j) row(i + j, a[j]);
      for (int g = 0; g < NG; ++g) {
        float t[4];
        hsum4(a[0][g], a[1][g], a[2][g], a[3][g], t);
        for (int j = 0; j < 4; ++j) s[g * ld + i + j] = t[j] * row_scale_at(i + j);
      }
    }
  for (; i < n; ++i) {
    vf a[NG];
    row(i, a);
    for (int g = 0; g < NG; ++g) s[g * ld + i] = hsum(a[g]) * row_scale_at(i);
  }
}

// The weighted sum of value rows into acc, for head_dim's vectors h0 .. h0 + HB - 1 (HB = HV: all
// of them, and each row asked for kAhead rows ahead).
template <typename C, int HV, int NG, int HB>
void group_values(const float* w, int64_t ld, const C* rows, const float* row_scale,
                  const int32_t* idx, int64_t n, int h0, vf (&acc)[NG][HB]) {
  constexpr int64_t H = HV * kLanes;
  // The sums in registers: a vector type may alias w's floats, so sums kept in acc's memory would
  // be stored again for every row.
  vf a[NG][HB];
  for (int g = 0; g < NG; ++g)
    for (int h = 0; h < HB; ++h) a[g][h] = acc[g][h];
  for (int64_t i = 0; i < n; ++i) {
    const C* r = rows + idx[i] * H + h0 * kLanes;
    if constexpr (HB == HV)
      if (i + kAhead < n) prefetch_row(rows + idx[i + kAhead] * H, H);
    vf vv[HB];
    for (int h = 0; h < HB; ++h) vv[h] = load_as_float(r + h * kLanes);
    float sc = row_scale ? row_scale[idx[i]] : 1.f;
    for (int g = 0; g < NG; ++g) {
      vf wv = splat(w[g * ld + i] * sc);
      for (int h = 0; h < HB; ++h) a[g][h] = fma(wv, vv[h], a[g][h]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int h = 0; h < HB; ++h) acc[g][h] = a[g][h];
}

// Rows g < NG of s (n scores each, ld apart) become exp(score - max), the max taken with the sink
// where there is one; inv[g] = 1 / (their sum + the sink's exp), or 0 where nothing is visible.
template <int NG>
void softmax_rows(float* s, int64_t ld, int64_t n, const float* sinks, float (&inv)[NG]) {
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;  // s has room for the padding
  for (int g = 0; g < NG; ++g) {
    float* sg = s + g * ld;
    for (int64_t i = n; i < padded; ++i) sg[i] = kMasked;
    vf mv = splat(sinks ? sinks[g] : kMasked);  // the max and the sum a vector at a time
    for (int64_t i = 0; i < padded; i += kLanes) mv = vmax(mv, load(sg + i));
    float m = hmax(mv);
    if (m == kMasked) m = 0.f;  // nothing visible, no sink: a padding query, output zero
    const vf mm = splat(m);
    vf tv = zero();
    for (int64_t i = 0; i < padded; i += kLanes) {
      store(sg + i, load(sg + i) - mm);
      exp_lanes(sg + i);
      if (i + kLanes > n)
        for (int64_t j = n; j < i + kLanes; ++j) sg[j] = 0.f;  // the padding adds nothing
      tv = tv + load(sg + i);
    }
    float t = hsum(tv) + (sinks ? std::exp(sinks[g] - m) : 0.f);
    inv[g] = t > 0.f ? 1.f / t : 0.f;
  }
}

// Wide heads (head_dim of HV vectors, too many for 4 queries' sums in registers: 24 floats and up
// on AVX2, as the 64 of the peer model, SmolLM2 and GPT-OSS; 80 and up on AVX-512): NG query heads
// still share each row, read once. Each score is one query against the row in registers, the queries read from L1;
// the values go in column blocks of HB vectors, NG x HB sums in registers per pass over the rows,
// so each pass reads its own cache lines of every row (L2 after the scores asked for them). The
// keys are left to the hardware prefetcher: with the values asked for too, prefetching the keys
// (kAhead, as above) measured slower. Against one query head at a time, a third less time over a
// cold cache.
template <typename C, int HV, int NG>
void wide_scores(const float* q, const C* rows, const float* row_scale, const int32_t* idx,
                 int64_t n, float scale, float* s, int64_t ld, const C* ahead = nullptr) {
  constexpr int64_t H = HV * kLanes;
  for (int64_t i = 0; i < n; ++i) {
    const C* r = rows + idx[i] * H;
    if (ahead) prefetch_row<2>(ahead + idx[i] * H, H);  // into L2 for the value passes
    vf kv[HV];
    for (int h = 0; h < HV; ++h) kv[h] = load_as_float(r + h * kLanes);
    float sc = row_scale ? scale * row_scale[idx[i]] : scale;
    for (int g = 0; g < NG; ++g) {
      vf a = zero(), b = zero();  // two chains
      int h = 0;
      for (; h + 1 < HV; h += 2) {
        a = fma(load(q + g * H + h * kLanes), kv[h], a);
        b = fma(load(q + g * H + (h + 1) * kLanes), kv[h + 1], b);
      }
      if (h < HV) a = fma(load(q + g * H + h * kLanes), kv[h], a);
      s[g * ld + i] = hsum(a + b) * sc;
    }
  }
}

// NG query heads (q, out: [NG, H]) over the visible rows (cidx, nc of them). s: room for NG rows
// of ld >= nc rounded up to kLanes. Wide: wide_scores, and the
// values in column blocks of HB vectors (NG x HB sums within half the registers, HB dividing HV);
// else the queries and all of head_dim's sums in registers.
template <typename C, int HV, int NG, bool Wide>
void attend_group(const float* q, const C* kc, const C* vc, const float* ks, const float* vs,
                  const int32_t* cidx, int64_t nc, float scale, const float* sinks, float* s,
                  int64_t ld, float* out) {
  constexpr int64_t H = HV * kLanes;
  constexpr int fit = std::max(1, kVecRegs / 2 / NG);
  constexpr int HB = !Wide ? HV : fit >= 4 && HV % 4 == 0 ? 4 : fit >= 2 && HV % 2 == 0 ? 2 : 1;
  if constexpr (Wide)
    wide_scores<C, HV, NG>(q, kc, ks, cidx, nc, scale, s, ld, vc);  // and asks for the values
  else
    group_scores<C, HV, NG>(q, kc, ks, cidx, nc, scale, s, ld, vc);  // and asks for the values
  float inv[NG];
  softmax_rows<NG>(s, ld, nc, sinks, inv);
  for (int h0 = 0; h0 < HV; h0 += HB) {
    vf acc[NG][HB];
    for (auto& a : acc) for (auto& v : a) v = zero();
    group_values<C, HV, NG, HB>(s, ld, vc, vs, cidx, nc, h0, acc);
    for (int g = 0; g < NG; ++g)
      for (int h = 0; h < HB; ++h)
        store(out + g * H + (h0 + h) * kLanes, fma(acc[g][h], splat(inv[g]), zero()));
  }
}

// Every query head of kv head k at one query position, in blocks of NG heads and then the largest
// block that fits what is left.
template <typename C, int HV>
void attend_heads(int64_t G, const float* q, const C* kc, const C* vc, const float* ks,
                  const float* vs, const int32_t* cidx, int64_t nc, float scale,
                  const float* sinks, float* s, int64_t ld, float* out) {
  constexpr int64_t H = HV * kLanes;
  // accumulators NG * HV within half the registers
  constexpr int NG = kVecRegs >= 32 ? (HV <= 2 ? 8 : HV <= 4 ? 4 : 2)
                                    : (HV <= 1 ? 8 : HV <= 2 ? 4 : HV <= 4 ? 2 : 1);
  // Wide heads (fewer than 4 queries' sums fit in registers): blocks of up to 8 heads all the same
  bool wide = G > NG && NG < 4;
  int top = wide ? 8 : NG;
  auto run = [&](auto ng, int64_t g) {
    constexpr int B = decltype(ng)::value;
    auto go = [&](auto w) {
      attend_group<C, HV, B, decltype(w)::value>(q + g * H, kc, vc, ks, vs, cidx, nc, scale,
                                                sinks ? sinks + g : nullptr, s, ld, out + g * H);
    };
    if constexpr (B <= NG)
      if (!wide) return go(std::false_type{});
    go(std::true_type{});
  };
  for (int64_t g = 0; g < G;) {  // the largest block that fits what is left (G = 3: 3 at once)
    int64_t left = G - g;
    if (top >= 8 && left >= 8) { run(std::integral_constant<int, 8>{}, g); g += 8; }
    else if (top >= 4 && left >= 4) { run(std::integral_constant<int, 4>{}, g); g += 4; }
    else if (top >= 4 && left >= 3) { run(std::integral_constant<int, 3>{}, g); g += 3; }
    else if (top >= 2 && left >= 2) { run(std::integral_constant<int, 2>{}, g); g += 2; }
    else { run(std::integral_constant<int, 1>{}, g); g += 1; }
  }
}

// --- paged attention ----------------------------------------------------------------------------
//
// q [T, N, H]: the T query tokens of a ragged step, query t of sequence rows[t] at position
// qpos[t] (negative: a padding query, output zeros, nothing read for it), over a pool of KV pages
// k, v [P, K, S, H] (float32, or int8 with per-slot scales [P, K, S]): position p of sequence r is
// slot p % S of page tables[r, p / S]. Query t sees positions max(0, qpos - window + 1) .. qpos
// (0 .. qpos without a window), every one of them assumed written; only the table entries those
// positions name are read, each checked to lie in [0, P) before any page is. One task per (query, kv head k), its G query heads
// together through the grouped path (attend_heads): relative to kv head k's
// base (k * S rows in), position p is row page * K * S + p % S, in units of H for the keys and
// values and of 1 for the scales. A head_dim the grouped path does not take goes query head by
// query head (attend_rows).

constexpr int64_t kTeamQueries = 64;  // a paged call of at most this many queries: a decode step's

template <typename C>
ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, const C* kp, const C* vp,
                          const float* ksp, const float* vsp, ffi::Span<const int64_t> kd,
                          ffi::Span<const int64_t> vd, ffi::Span<const int64_t> ksd,
                          ffi::Span<const int64_t> vsd, ffi::Buffer<ffi::S32> tables,
                          ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> qpos,
                          ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out,
                          int64_t has_sinks, float scale, int64_t window) {
  const std::string name = ksp ? "podrun_paged_attention_s8" : "podrun_paged_attention";
  auto bad = [&](const std::string& why) { return ffi::Error::InvalidArgument(name + ": " + why); };
  auto qd = q.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2)
    return bad("expects q [T, N, H], k_pages and v_pages [P, K, S, H] (or [1, P, K, S, H]), "
               "tables [R, M]");
  const int64_t T = qd[0], N = qd[1], H = qd[2], P = kd[0], K = kd[1], S = kd[2];
  const int64_t R = td[0], M = td[1];
  if (!(vd == kd)) return bad("k_pages and v_pages differ in shape");
  if (kd[3] != H) return bad("the pages' head_dim differs from q's");
  if (K <= 0 || S <= 0 || N % K) return bad("q's heads must be a multiple of the pages' kv heads");
  if (ksp) {
    const int64_t want[] = {P, K, S};
    const ffi::Span<const int64_t> scale_dims(want, 3);
    if (!(ksd == scale_dims) || !(vsd == scale_dims))
      return bad("k_scale and v_scale must be [P, K, S] for pages [P, K, S, H]");
  }
  if (rows.dimensions().size() != 1 || rows.dimensions()[0] != T ||
      qpos.dimensions().size() != 1 || qpos.dimensions()[0] != T)
    return bad("rows and q_pos must be [T] for q [T, N, H]");
  if (sinks.dimensions().size() != 1 || sinks.dimensions()[0] != N)
    return bad("sinks must be [N] for q [T, N, H]");
  if (P * K * S > INT32_MAX) return bad("the page pool has more than 2^31 slots");
  const int64_t G = N / K;
  const float *qp = q.typed_data(), *sp = sinks.typed_data();
  const int32_t *tp = tables.typed_data(), *rp = rows.typed_data(), *pp = qpos.typed_data();
  float* op = out->typed_data();
  // The first position each query sees, and every table entry it reads checked before any page is
  // read; ld: room for the most keys any query sees, rounded up to vectors.
  auto first = [=](int32_t at) { return window > 0 ? std::max<int64_t>(0, at - window + 1) : 0; };
  int64_t most = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int32_t at = pp[t];
    if (at < 0) continue;
    const int64_t r = rp[t], lo = first(at);
    if (r < 0 || r >= R)
      return bad("query " + std::to_string(t) + " is of sequence " + std::to_string(r) +
                 ", outside tables' " + std::to_string(R) + " rows");
    if (at / S >= M)
      return bad("query " + std::to_string(t) + " at position " + std::to_string(at) +
                 " is past its table's " + std::to_string(M) + " pages of " + std::to_string(S));
    for (int64_t e = lo / S; e <= at / S; ++e) {
      const int32_t page = tp[r * M + e];
      if (page < 0 || page >= P)
        return bad("query " + std::to_string(t) + " reads tables[" + std::to_string(r) + ", " +
                   std::to_string(e) + "] = " + std::to_string(page) + ", not a page of " +
                   std::to_string(P));
    }
    most = std::max<int64_t>(most, at - lo + 1);
  }
  const int64_t ld = std::max<int64_t>((most + kLanes - 1) / kLanes * kLanes, kLanes);
  using Heads = void (*)(int64_t, const float*, const C*, const C*, const float*, const float*,
                         const int32_t*, int64_t, float, const float*, float*, int64_t, float*);
  static constexpr Heads kGrouped[] = {nullptr, attend_heads<C, 1>, attend_heads<C, 2>,
                                       attend_heads<C, 3>, attend_heads<C, 4>, attend_heads<C, 5>,
                                       attend_heads<C, 6>, attend_heads<C, 7>, attend_heads<C, 8>};
  const Heads grouped = H % kLanes == 0 && H / kLanes <= 8 ? kGrouped[H / kLanes] : nullptr;
  auto body = [=](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores, w;  // kept from call to call (a decode step's: a few us)
    thread_local std::vector<int32_t> cidx;
    scores.resize(grouped ? 8 * ld : ld), w.resize(ld), cidx.resize(ld);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / K, k = task % K;
      const float* qt = qp + (t * N + k * G) * H;
      float* ot = op + (t * N + k * G) * H;
      const int32_t at = pp[t];
      if (at < 0) {  // padding: zeros, and no table or page read
        std::fill(ot, ot + G * H, 0.f);
        continue;
      }
      const int32_t* table = tp + int64_t(rp[t]) * M;
      int64_t n = 0;
      for (int64_t p = first(at); p <= at; ++p)
        cidx[n++] = int32_t(int64_t(table[p / S]) * K * S + p % S);
      const C* kb = kp + k * S * H;
      const C* vb = vp + k * S * H;
      const float* ksb = ksp ? ksp + k * S : nullptr;
      const float* vsb = vsp ? vsp + k * S : nullptr;
      const float* sk = has_sinks ? sp + k * G : nullptr;
      if (grouped) {
        grouped(G, qt, kb, vb, ksb, vsb, cidx.data(), n, scale, sk, scores.data(), ld, ot);
        continue;
      }
      for (int64_t g = 0; g < G; ++g)
        attend_rows<C>(qt + g * H, kb, vb, ksb, vsb, cidx.data(), n, H, scale,
                       sk ? sk + g : nullptr, scores.data(), w.data(), ot + g * H);
    }
  };
  // A decode step's few queries (a token a row) go to the team, which the products keep awake
  // (XLA's pool takes longer to wake than the work is worth), and join the product chain: nothing of the pages is asked for ahead (they lie anywhere in the
  // pool), but while the last heads run the helpers ask for the next product's weights. A
  // prompt's chunk goes to XLA's pool.
  const int64_t tasks = T * K;
  if (T <= kTeamQueries) {
    Team& team = Team::get();
    auto run = [&](int t, int n) {
      if (n == 1) return body(0, tasks);
      for (int64_t c; (c = team.claim(t)) >= 0;) body(c, c + 1);
    };
    team.run(run, Chain::next({reinterpret_cast<const char*>(kp)}), tasks);
  } else {
    parallel_for(pool, tasks, 1, body);
  }
  return ffi::Error::Success();
}

// A group's pool as the engine holds it, [1, P, K, S, H] (scales [1, P, K, S]), read as
// [P, K, S, H]: taking it whole spares XLA a bitcast of the just-written pool, which it fuses with
// the write and so copies the whole pool at every step of a one-row decode.
ffi::Span<const int64_t> one_group(ffi::Span<const int64_t> d, size_t rank) {
  return d.size() == rank + 1 && d[0] == 1 ? ffi::Span<const int64_t>(d.begin() + 1, rank) : d;
}

ffi::Error PagedAttentionF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                             ffi::Buffer<ffi::F32> kc, ffi::Buffer<ffi::F32> vc,
                             ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> rows,
                             ffi::Buffer<ffi::S32> qpos, ffi::Buffer<ffi::F32> sinks,
                             ffi::ResultBuffer<ffi::F32> out, int64_t has_sinks, float scale,
                             int64_t window) {
  return PagedAttention<float>(pool, q, kc.typed_data(), vc.typed_data(), nullptr, nullptr,
                               one_group(kc.dimensions(), 4), one_group(vc.dimensions(), 4), {}, {},
                               tables, rows, qpos, sinks,
                               out, has_sinks, scale, window);
}

ffi::Error PagedAttentionS8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                            ffi::Buffer<ffi::S8> kc, ffi::Buffer<ffi::S8> vc,
                            ffi::Buffer<ffi::F32> ks, ffi::Buffer<ffi::F32> vs,
                            ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> rows,
                            ffi::Buffer<ffi::S32> qpos, ffi::Buffer<ffi::F32> sinks,
                            ffi::ResultBuffer<ffi::F32> out, int64_t has_sinks, float scale,
                            int64_t window) {
  return PagedAttention<int8_t>(pool, q, kc.typed_data(), vc.typed_data(), ks.typed_data(),
                                vs.typed_data(), one_group(kc.dimensions(), 4),
                                one_group(vc.dimensions(), 4), one_group(ks.dimensions(), 3),
                                one_group(vs.dimensions(), 3), tables, rows, qpos, sinks, out,
                                has_sinks, scale,
                                window);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(podrun_paged_attention, PagedAttentionF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, N, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k pages [P, K, S, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables [R, M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_pos [T]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks [N]
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("has_sinks")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(podrun_paged_attention_s8, PagedAttentionS8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, N, H]
                                  .Arg<ffi::Buffer<ffi::S8>>()  // k pages [P, K, S, H], int8
                                  .Arg<ffi::Buffer<ffi::S8>>()  // v pages, int8
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k scales [P, K, S]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables [R, M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_pos [T]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks [N]
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("has_sinks")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window"));
