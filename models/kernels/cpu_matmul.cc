// CPU kernels for decode, where XLA:CPU's own operations are slow, registered with XLA's FFI.
//
// matmul_f32: y[M, N] = x[M, K] . W for W[K, N], or x . W^T for W[N, K], float32, the few rows
// of a decode step, split over a team of threads that spin between products (Team, cpu_kernels.h).
// XLA:CPU's dot runs a decode step's small products on one thread, and is slower at 8 rows too.
// matmul_nk_s8: y[M, N] = x[M, K] . W^T for the few rows a decode step has (M = batch), W[N, K]
// int8 with a float32 scale per output row n (weight-only int8). Each weight byte is read once
// per call and dequantised in registers, with every row of x (kept in L1/L2) applied to it; the
// output rows are split over the team for one or two rows, over XLA's intra-op thread pool for
// more. XLA:CPU's own dot with an int8 operand falls back to a slow loop. Accumulation is in float32 in the order k = 0..K-1 per lane.
// matmul_nk_s4: the same for W in 4 bits, groups of 32 along K with a float16 step and minimum
// each (GGUF's Q4_1 numbers, precision.quantize=int4); activations and sums stay float32, so each
// weight costs a conversion and an FMA, and on a 2-core machine it runs out of compute before
// memory: a decode step reads fewer bytes than int8's but is no faster.
// From bf16_rows rows of x on (4 unless the caller asks for batch invariance: 1), where the CPU
// has AVX-512 BF16, it rounds x and the weights to bfloat16 instead (nk4_bf16): a core's
// multiply-adds double.
//
// Built on first use by models/kernels/cpu.py (g++ -O3 -march=native) with cpu_attention.cc into
// one library, and registered with XLA's FFI.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "cpu_kernels.h"

namespace {

using namespace podrun;

// --- W[N, K]: each output is a dot product over contiguous K ----------------------------------

// NB rows of W at a time, with the rows two blocks on prefetched as they go: the rows of a block are
// contiguous, and each pass over k asks for that block's share (NB x kLanes values) of memory. The
// next block is too close to hide memory's latency at one row of x (two ahead measured best).
// Rows of a few hundred bytes (int8 weights, head-sized K) are too short for the hardware
// prefetcher to follow, so without these requests such products read at half the speed.
template <typename W, int MB, int NB>
void nk_block(const float* x, int64_t ldx, const W* w, const float* scale, float* y, int64_t ldy,
              int64_t n0, int64_t K) {
  vf acc[MB][NB];
  for (auto& r : acc) for (auto& a : r) a = zero();
  const char* next = reinterpret_cast<const char*>(w + (n0 + 2 * NB) * K);
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    for (size_t b = 0; b < NB * kLanes * sizeof(W); b += 64)  // a line at a time (never faults,
      // so the last block may ask past the end of W)
      __builtin_prefetch(next + k * NB * sizeof(W) + b, 0, 3);
    vf wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load_as_float(w + (n0 + j) * K + k);
    for (int i = 0; i < MB; ++i) {
      vf xv = load(x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = fma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t t = k; t < K; ++t) s += x[i * ldx + t] * float(w[(n0 + j) * K + t]);
      y[i * ldy + n0 + j] = scale ? s * scale[n0 + j] : s;
    }
}

template <typename W, int MB>
void nk_rows(const float* x, const W* w, const float* scale, float* y, int64_t N, int64_t K,
             int64_t n_begin, int64_t n_end) {
  // MB x NB sums and NB rows of W in registers
  constexpr int NB = kVecRegs >= 32 ? (MB == 1 ? 8 : MB == 2 ? 4 : 2)
                                    : (MB == 1 ? 4 : MB <= 4 ? 2 : 1);
  int64_t n = n_begin;
  for (; n + NB <= n_end; n += NB) nk_block<W, MB, NB>(x, K, w, scale, y, N, n, K);
  for (; n < n_end; ++n) nk_block<W, MB, 1>(x, K, w, scale, y, N, n, K);
}

template <typename W>
void nk_all(const float* x, const W* w, const float* scale, float* y, int64_t M, int64_t N,
            int64_t K, int64_t n0, int64_t n1) {
  // Rows of x in groups of up to 8; the slice of W a chunk covers stays in cache between groups.
  for (int64_t m = 0; m < M;) {
    int64_t left = M - m;
    const float* xm = x + m * K;
    float* ym = y + m * N;
    if (left >= 8) { nk_rows<W, 8>(xm, w, scale, ym, N, K, n0, n1); m += 8; }
    else if (left >= 4) { nk_rows<W, 4>(xm, w, scale, ym, N, K, n0, n1); m += 4; }
    else if (left >= 2) { nk_rows<W, 2>(xm, w, scale, ym, N, K, n0, n1); m += 2; }
    else { nk_rows<W, 1>(xm, w, scale, ym, N, K, n0, n1); m += 1; }
  }
}

// --- W[N, K] in 4 bits: groups of kGroup weights along K, each with an f16 scale and minimum -----
//
// q[N, K / 2] bytes, d and m [N, K / kGroup] f16: weight k of row n is d[n, g] * u + m[n, g], where
// g = k / kGroup and u in [0, 15] is the low nibble of byte 16 g + k % 16 for k % 32 < 16, else its
// high nibble (GGUF's Q4_1 blocks hold the same numbers). Each vector of weights is made once
// (d u + m) and applied to every row of x: a row's sums are the same operations in the same order
// whatever the other rows (batch invariance).
constexpr int64_t kGroup = 32;

// Rows [n0, n0 + NB) of W; ds, ms: their scales and minima as floats.
template <int MB, int NB>
void nk4_block(const float* x, int64_t K, const uint8_t* q, const float* ds, const float* ms,
               float* y, int64_t ldy, int64_t n0) {
  constexpr int H = 16 / kLanes;  // vectors of nibbles in a group's 16 bytes
  const int64_t G = K / kGroup, rb = K / 2;
  vf acc[MB][NB];
  for (auto& r : acc) for (auto& a : r) a = zero();
  const char* next = reinterpret_cast<const char*>(q + (n0 + 2 * NB) * rb);  // as nk_block
  for (int64_t g = 0; g < G; ++g) {
    for (int b = 0; b < NB * 16; b += 64) __builtin_prefetch(next + g * NB * 16 + b, 0, 3);
    vf lo[NB][H], hi[NB][H];
    for (int j = 0; j < NB; ++j) {
      vf dj = splat(ds[j * G + g]), mj = splat(ms[j * G + g]);
      for (int h = 0; h < H; ++h) {
        load_u4(q + (n0 + j) * rb + g * 16 + h * kLanes, lo[j][h], hi[j][h]);
        lo[j][h] = fma(lo[j][h], dj, mj), hi[j][h] = fma(hi[j][h], dj, mj);
      }
    }
    for (int i = 0; i < MB; ++i) {
      const float* xg = x + i * K + g * kGroup;
      for (int h = 0; h < H; ++h) {
        vf xl = load(xg + h * kLanes), xh = load(xg + 16 + h * kLanes);
        for (int j = 0; j < NB; ++j) acc[i][j] = fma(xh, hi[j][h], fma(xl, lo[j][h], acc[i][j]));
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ldy + n0 + j] = hsum(acc[i][j]);
}

template <int MB>
void nk4_rows(const float* x, const uint8_t* q, const float* ds, const float* ms, float* y,
              int64_t N, int64_t K, int64_t n_begin, int64_t n_end) {
  constexpr int NB = kVecRegs >= 32 ? (MB == 1 ? 8 : MB == 2 ? 4 : 2)
                                    : (MB == 1 ? 4 : MB <= 4 ? 2 : 1);
  const int64_t G = K / kGroup;
  int64_t n = n_begin;
  auto at = [&](const float* p) { return p + (n - n_begin) * G; };
  for (; n + NB <= n_end; n += NB) nk4_block<MB, NB>(x, K, q, at(ds), at(ms), y, N, n);
  for (; n < n_end; ++n) nk4_block<MB, 1>(x, K, q, at(ds), at(ms), y, N, n);
}

// The scales and minima of W's rows [n0, n0 + rows) as floats (row n0 + j's groups at j * G), in
// a buffer of the calling thread's that the next call reuses.
inline std::pair<const float*, const float*> group_floats(const uint16_t* d, const uint16_t* mn,
                                                          int64_t G, int64_t n0, int64_t rows) {
  thread_local std::vector<float> buf;
  if (buf.size() < size_t(2 * rows * G)) buf.resize(2 * rows * G);
  float *ds = buf.data(), *ms = ds + rows * G;
  halves_to_floats(d + n0 * G, ds, rows * G);
  halves_to_floats(mn + n0 * G, ms, rows * G);
  return {ds, ms};
}

void nk4_all(const float* x, const uint8_t* q, const uint16_t* d, const uint16_t* mn, float* y,
             int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup;
  auto [ds, ms] = group_floats(d, mn, G, n0, n1 - n0);
  for (int64_t m = 0; m < M;) {
    int64_t left = M - m;
    const float* xm = x + m * K;
    float* ym = y + m * N;
    if (left >= 8) { nk4_rows<8>(xm, q, ds, ms, ym, N, K, n0, n1); m += 8; }
    else if (left >= 4) { nk4_rows<4>(xm, q, ds, ms, ym, N, K, n0, n1); m += 4; }
    else if (left >= 2) { nk4_rows<2>(xm, q, ds, ms, ym, N, K, n0, n1); m += 2; }
    else { nk4_rows<1>(xm, q, ds, ms, ym, N, K, n0, n1); m += 1; }
  }
}

#if defined(__AVX512BF16__)
// --- int4 W, several rows of x (a batch's step, a prompt's chunk): products in bfloat16 --------
//
// From kBf16Rows rows of x on (fewer rows cannot spread a tile's making over enough products to
// beat float32's weights made in registers), each tile of up to kTile rows of W is made once
// (d u + m, rounded to bfloat16) into a buffer its thread reuses, x is rounded to bfloat16 once a
// call, and each 32 weights of a row of x cost one vdpbf16ps (32 products summed pairwise into
// float32 lanes), where the float32 path spends two FMAs and makes each weight again for every 8
// rows. A core does twice the multiply-adds in bfloat16. Rounding x and W to 8 bits of mantissa
// moves each product by at most about 2^-8 of |x w|, well under int4's own error (W in 4 bits;
// llama.cpp rounds a prompt's x to 8 bits a block too). The sums stay float32.
constexpr int64_t kBf16Rows = 4, kTile = 64;

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// Rows [n0, n0 + nt) of W made into t[nt, K] bfloat16, in k's order (a group's low nibbles, then
// its high ones).
void make_tile(const uint8_t* q, const uint16_t* d, const uint16_t* mn, int64_t K, int64_t n0,
               int64_t nt, uint16_t* t) {
  const int64_t G = K / kGroup, rb = K / 2;
  auto [ds, ms] = group_floats(d, mn, G, n0, nt);
  for (int64_t j = 0; j < nt; ++j)
    for (int64_t g = 0; g < G; ++g) {
      vf lo, hi, dj = splat(ds[j * G + g]), mj = splat(ms[j * G + g]);
      load_u4(q + (n0 + j) * rb + g * 16, lo, hi);
      __m512bh w = _mm512_cvtne2ps_pbh(fma(hi, dj, mj), fma(lo, dj, mj));  // lo in the low half
      _mm512_storeu_si512(t + j * K + g * kGroup, reinterpret_cast<__m512i&>(w));
    }
}

// y[i, j] = x[i] . t[j] for MB rows of x and NB rows of the tile, both bfloat16 rows of K.
template <int MB, int NB>
void bf16_block(const uint16_t* x, const uint16_t* t, int64_t K, float* y, int64_t ldy) {
  vf acc[MB][NB];
  for (auto& r : acc) for (auto& a : r) a = zero();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh w[NB];
    for (int j = 0; j < NB; ++j) w[j] = as_bh(_mm512_loadu_si512(t + j * K + k));
    for (int i = 0; i < MB; ++i) {
      __m512bh xv = as_bh(_mm512_loadu_si512(x + i * K + k));
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, w[j]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    if constexpr (NB == 4) hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], y + i * ldy);
    else for (int j = 0; j < NB; ++j) y[i * ldy + j] = hsum(acc[i][j]);
  }
}

// Rows [m, m + MB) of x against rows [0, nt) of the tile: 4 of the tile's rows at a time (6 x 4
// sums, 4 weight vectors and a row of x fill 29 of the 32 registers).
template <int MB>
void bf16_rows(const uint16_t* x, const uint16_t* t, int64_t nt, int64_t K, float* y, int64_t N) {
  int64_t j = 0;
  for (; j + 4 <= nt; j += 4) bf16_block<MB, 4>(x, t + j * K, K, y + j, N);
  for (; j < nt; ++j) bf16_block<MB, 1>(x, t + j * K, K, y + j, N);
}

// y[:, n0:n1] for xb [M, K] bfloat16, the weights made in registers a group of 32 at a time for
// the few rows of a decode step (NB rows of W at once): the same products and sums as the tiles'
// (make_tile, bf16_block) without writing a tile, which fewer than kBf16Rows rows of x cannot
// spread over enough products.
template <int MB>
void nk4_bf16_few(const uint16_t* xb, const uint8_t* q, const uint16_t* d, const uint16_t* mn,
                  float* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  constexpr int NB = MB == 1 ? 8 : 4;  // independent chains of vdpbf16ps to hide its latency
  const int64_t G = K / kGroup, rb = K / 2;
  auto [ds, ms] = group_floats(d, mn, G, n0, n1 - n0);
  for (int64_t n = n0; n < n1; n += NB) {
    const int nb = int(std::min<int64_t>(NB, n1 - n));
    vf acc[MB][NB];
    for (auto& r : acc) for (auto& a : r) a = zero();
    for (int64_t g = 0; g < G; ++g) {
      __m512bh w[NB];
      for (int j = 0; j < nb; ++j) {
        vf lo, hi, dj = splat(ds[(n - n0 + j) * G + g]), mj = splat(ms[(n - n0 + j) * G + g]);
        load_u4(q + (n + j) * rb + g * 16, lo, hi);
        w[j] = _mm512_cvtne2ps_pbh(fma(hi, dj, mj), fma(lo, dj, mj));
      }
      for (int i = 0; i < MB; ++i) {
        __m512bh xv = as_bh(_mm512_loadu_si512(xb + i * K + g * kGroup));
        for (int j = 0; j < nb; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, w[j]);
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < nb; ++j) y[i * N + n + j] = hsum(acc[i][j]);
  }
}

// y[:, n0:n1] for xb [M, K] bfloat16: tile by tile, every row of x against each.
void nk4_bf16(const uint16_t* xb, const uint8_t* q, const uint16_t* d, const uint16_t* mn,
              float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  thread_local std::vector<uint16_t> tile;
  if (tile.size() < size_t(kTile * K)) tile.resize(kTile * K);
  for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
    const int64_t nt = std::min(kTile, n1 - t0);
    make_tile(q, d, mn, K, t0, nt, tile.data());
    for (int64_t m = 0; m < M;) {
      const uint16_t* xm = xb + m * K;
      float* ym = y + m * N + t0;
      switch (std::min<int64_t>(M - m, 6)) {
        case 6: bf16_rows<6>(xm, tile.data(), nt, K, ym, N); m += 6; break;
        case 5: bf16_rows<5>(xm, tile.data(), nt, K, ym, N); m += 5; break;
        case 4: bf16_rows<4>(xm, tile.data(), nt, K, ym, N); m += 4; break;
        case 3: bf16_rows<3>(xm, tile.data(), nt, K, ym, N); m += 3; break;
        case 2: bf16_rows<2>(xm, tile.data(), nt, K, ym, N); m += 2; break;
        default: bf16_rows<1>(xm, tile.data(), nt, K, ym, N); m += 1; break;
      }
    }
  }
}
#endif

// Chunk sizes: enough chunks per thread to balance, each big enough to amortise the bookkeeping.
int64_t grain(int64_t n, int64_t unit, int64_t threads) {
  int64_t g = (n + 8 * threads - 1) / (8 * threads);
  g = std::max<int64_t>(unit, (g + unit - 1) / unit * unit);
  return g;
}

// --- W[K, N]: each output accumulates over rows of W -------------------------------------------
//
// Each thread reads its own contiguous parts of W's rows (in multiples of kKB, over_parts), a few
// rows at a time in sweeps across all N columns (one stream of contiguous memory per row), into
// the part's partial sums p[M, N] (part 0's are y); the caller adds them up after. Split by
// columns instead, the threads would read interleaved pieces of the same rows (slower). From 2
// rows of x on, each W row is prefetched 512 bytes ahead (256 at 8 rows); at 1 row each line of W
// asks instead, into L2, for the line 4 KB on (rows swept one at a time, kNarrow) or for its line
// in the next sweep: a core alone holds too few misses in flight to read at the machine's
// bandwidth, and the hardware prefetcher asks too late. Rows per sweep (kn_sweep_rows): 8 up to
// 4 rows of x, 16 at 8, where the reloads of p cost more than the extra streams.

constexpr int64_t kKB = 16;

constexpr int64_t kn_sweep_rows(int MB) { return MB >= 8 ? 16 : 8; }

// One row of x over rows of W of at most kNarrow floats sweeps them a row at a time, a single
// stream of memory per thread: in sweeps of 8 such short rows each stream ends before the hardware
// prefetcher has followed it. Wider rows keep their sweeps of 8, which read faster there.
constexpr int64_t kRowsAheadBytes = 4096;
constexpr int64_t kNarrow = 640;

// Columns [c, c + VB * kLanes) of p over rows [k0, k0 + kb) of w, MB x VB sums in registers.
template <int MB, int VB>
__attribute__((always_inline)) inline void kn_block(const float* x, int64_t K, const float* w, int64_t N, float* p, int64_t c,
                     int64_t k0, int64_t kb, bool first, int64_t next) {
  constexpr int64_t ahead = MB >= 8 ? 64 : 128;  // floats
  vf acc[MB][VB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < VB; ++j) acc[m][j] = first ? zero() : load(p + m * N + c + j * kLanes);
  for (int64_t k = k0; k < k0 + kb; ++k) {
    const float* r = w + k * N + c;
    if constexpr (MB >= 2)
      for (int j = 0; j < VB * kLanes; j += 16) __builtin_prefetch(r + ahead + j, 0, 3);  // a line each
    else if (next)
      for (int j = 0; j < VB * kLanes; j += 16) __builtin_prefetch(r + next + j, 0, 2);
    vf wv[VB];
    for (int j = 0; j < VB; ++j) wv[j] = load(r + j * kLanes);
    for (int m = 0; m < MB; ++m) {
      vf xv = splat(x[m * K + k]);
      for (int j = 0; j < VB; ++j) acc[m][j] = fma(wv[j], xv, acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < VB; ++j) store(p + m * N + c + j * kLanes, acc[m][j]);
}

// Columns [c0, c1): blocks of VB vectors, then of 4 and 1, then single columns.
template <int MB>
void kn_sweep(const float* x, int64_t K, const float* w, int64_t N, float* p, int64_t c0,
              int64_t c1, int64_t k0, int64_t kb, bool first, int64_t next) {
  // MB x VB sums in half the registers, VB more for the row of W; at one row of x, a quarter
  // (16 sums and 16 loads take every register and more, so the compiler spills).
  constexpr int VB = MB == 1 ? kVecRegs / 4 : std::max(1, kVecRegs / 2 / MB);
  int64_t c = c0;
  for (; c + VB * kLanes <= c1; c += VB * kLanes) kn_block<MB, VB>(x, K, w, N, p, c, k0, kb, first, next);
  if constexpr (VB > 4)
    for (; c + 4 * kLanes <= c1; c += 4 * kLanes) kn_block<MB, 4>(x, K, w, N, p, c, k0, kb, first, next);
  if constexpr (VB > 1)
    for (; c + kLanes <= c1; c += kLanes) kn_block<MB, 1>(x, K, w, N, p, c, k0, kb, first, next);
  for (; c < c1; ++c)
    for (int m = 0; m < MB; ++m) {
      float s = first ? 0.f : p[m * N + c];
      for (int64_t k = k0; k < k0 + kb; ++k) s += x[m * K + k] * w[k * N + c];
      p[m * N + c] = s;
    }
}

// p[M, N] = x[:, k0:k1] . w[k0:k1, :], in column chunks whose sums (MB x 64 KB) stay in L2
template <int MB>
void kn_rows(const float* x, const float* w, float* p, int64_t N, int64_t K, int64_t k0,
             int64_t k1) {
  constexpr int64_t chunk = 16384 / MB;
  // At one row of x, short rows of W go a row at a time (see kNarrow), each line asking for its
  // line in the row kRowsAheadBytes on; wider rows go in sweeps, each line asking for its line in
  // the next sweep. From 2 rows of x on, kn_block reads ahead within each row itself.
  const int64_t sweep = MB == 1 && N <= kNarrow ? 1 : kn_sweep_rows(MB);
  const int64_t ahead = sweep == 1 ? (kRowsAheadBytes + N * 4 - 1) / (N * 4) : sweep;
  for (int64_t c0 = 0; c0 < N; c0 += chunk)
    for (int64_t k = k0; k < k1; k += sweep)
      kn_sweep<MB>(x, K, w, N, p, c0, std::min(N, c0 + chunk), k, std::min(sweep, k1 - k), k == k0,
                   MB == 1 && k + ahead + sweep <= k1 ? ahead * N : 0);
}

void kn_all(const float* x, const float* w, float* p, int64_t M, int64_t N, int64_t K, int64_t k0,
            int64_t k1) {
  for (int64_t m = 0; m < M;) {
    int64_t left = M - m;
    const float* xm = x + m * K;
    float* pm = p + m * N;
    if (left >= 8) { kn_rows<8>(xm, w, pm, N, K, k0, k1); m += 8; }
    else if (left >= 4) { kn_rows<4>(xm, w, pm, N, K, k0, k1); m += 4; }
    else if (left >= 2) { kn_rows<2>(xm, w, pm, N, K, k0, k1); m += 2; }
    else { kn_rows<1>(xm, w, pm, N, K, k0, k1); m += 1; }
  }
}

// body(t, c, begin, end) for the parts c of W's `rows` rows (of `row_bytes` each), split in
// multiples of `unit`, on the team (t: the thread); returns the number of parts. 8 parts a
// thread (at most max_parts) that the threads claim as they go (Team::claim), so a thread that
// finishes early takes the end of another's share: fixed shares finish tens of microseconds
// apart. With fewer than 2 parts a thread (max_parts, or few rows), one fixed share a thread.
// Either way each thread starts at the front of its share, which tells the helpers what to read
// ahead of the next product.
constexpr int64_t kAnyParts = int64_t(1) << 30;

template <typename Body>
int64_t over_parts(const void* w, int64_t rows, int64_t unit, int64_t row_bytes, int64_t max_parts,
                   Body body) {
  Team& team = Team::get();
  const int T = team.size();
  const char* base = static_cast<const char*>(w);
  int64_t size = 0, parts = 0;
  if (T > 1 && rows > 0) {
    parts = std::min<int64_t>(8 * T, max_parts);
    size = (rows + parts * unit - 1) / (parts * unit) * unit;
    parts = (rows + size - 1) / size;
  }
  if (parts < 2 * T) {  // T shares, a thread each; one thread takes them all when the team is busy
    auto share = [&](int t, int running) {
      for (int c = t; c < T; c += running) {
        auto [begin, end] = part(rows, unit, c, T);
        body(t, int64_t(c), begin, end);
      }
    };
    team.run(share, Chain::next({base, rows, unit, row_bytes}));
    return T;
  }
  auto take = [&](int t, int T) {
    auto run = [&](int64_t c) { body(t, c, c * size, std::min(rows, (c + 1) * size)); };
    if (T == 1)
      for (int64_t c = 0; c < parts; ++c) run(c);
    else
      for (int64_t c; (c = team.claim(t)) >= 0;) run(c);
  };
  team.run(take, Chain::next({base, parts, 1, size * row_bytes}), parts);
  return parts;
}

// y[M, N] = x[M, K] . W, over the team. W[K, N]: part c of W's rows (a share per thread of the
// team, whatever M, so that a row's sums never depend on the others: batch invariance) sums
// into its own p[M, N] (part 0's is y) and y adds up the others in their order, so the sums are
// the same whichever thread took a part.
void matmul_f32(const float* xp, const float* wp, float* yp, int64_t M, int64_t N, int64_t K,
                bool w_nk) {
  if (w_nk) {
    over_parts(wp, N, kLanes, K * 4, kAnyParts, [=](int, int64_t, int64_t n0, int64_t n1) {
      if (n1 > n0) nk_all<float>(xp, wp, nullptr, yp, M, N, K, n0, n1);
    });
    return;
  }
  const int64_t MN = M * N;
  thread_local std::vector<float> sums;
  sums.resize(std::max<int64_t>(MN * (Team::get().size() - 1), 1 << 16));
  float* pp = sums.data();
  const int64_t parts = over_parts(wp, K, kKB, N * 4, 1,
                                   [=](int, int64_t c, int64_t k0, int64_t k1) {
    float* p = c ? pp + (c - 1) * MN : yp;
    if (k1 > k0) kn_all(xp, wp, p, M, N, K, k0, k1);
    else std::fill(p, p + MN, 0.f);
  });
  for (int64_t c = 1; c < parts; ++c)
    for (int64_t i = 0; i < MN; ++i) yp[i] += pp[(c - 1) * MN + i];
}

ffi::Error MatmulF32(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y, bool w_nk) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[w_nk ? 1 : 0])
    return ffi::Error::InvalidArgument(
        "podrun_matmul_f32: expects x[M, K] and w[K, N] (or w[N, K] with w_nk)");
  int64_t M = xd[0], K = xd[1], N = wd[w_nk ? 0 : 1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  if (K == 0) {
    std::fill(yp, yp + M * N, 0.f);
    return ffi::Error::Success();
  }
  // Rows go in groups of 8, 4, 2 and 1, each group reading all of W: 3, 5, 6 or 7 rows run as 4
  // or 8 with rows of zeros, so that W is read once rather than two or three times.
  int64_t padded = M <= 2 ? M : M <= 4 ? 4 : M <= 8 ? 8 : M;
  if (padded == M) {
    matmul_f32(xp, wp, yp, M, N, K, w_nk);
    return ffi::Error::Success();
  }
  thread_local std::vector<float> x_pad, y_pad;
  x_pad.assign(padded * K, 0.f);
  std::copy(xp, xp + M * K, x_pad.begin());
  y_pad.resize(padded * N);
  matmul_f32(x_pad.data(), wp, y_pad.data(), padded, N, K, w_nk);
  std::copy(y_pad.begin(), y_pad.begin() + M * N, yp);
  return ffi::Error::Success();
}

// --- W in column panels: [P, K, kPanel], panel p holding columns [p kPanel, (p + 1) kPanel) -----
//
// kernels.panel_weights packs a float32 projection W[K, N] so (models/panels.py, zero columns
// past N): each panel is contiguous and a thread reads its share of the panels (and of their
// rows of k) front to back, one stream of memory, as a plain read does, holding the panel's
// kPanel sums of each row of x in registers over k. Read in [K, N] instead, a row of x keeps
// its sums in memory (kn_sweep: a load and a store of them for every few rows of W), and the
// threads' reads of W are several streams or restart at each sweep (benchmarks/chained_products.cc
// compares the two). A decode step's product
// (up to 8 rows of x) splits each panel into as many runs of k as give the team 8 units a thread,
// which the threads claim (Team::claim) and whose sums add up in k's order; more rows (a prefill)
// go through XLA's pool in units of a panel and up to kGroupRows rows of x, blocks of kPanelRows
// rows of x against runs of kPanelK rows of the panel, which stays in L2 across the blocks.
constexpr int64_t kPanel = 64, kPanelK = 256, kGroupRows = 48;
// From 2 rows of x on, each row of a panel asks for the row 16 on (4 KB): at 8 rows a product's
// arithmetic no longer hides memory's latency behind the hardware prefetcher; at one row it does
// not help, so not there.
constexpr int64_t kPanelAhead = 16 * kPanel;
constexpr int kPanelVecs = int(kPanel / kLanes);
constexpr int64_t kPanelRows = 6;

// Vectors of a panel's row that MB rows of x sum at once (a power of two): as many as leave 8
// registers for the row's vectors and x.
constexpr int panel_vecs(int MB) {
  int v = std::min(kPanelVecs, std::max(1, (kVecRegs - 8) / MB)), p = 1;
  while (2 * p <= v) p *= 2;
  return p;
}

// t[MB, kPanel] (+)= x[MB, k0:k1] . panel[k0:k1, :] (ldx, ldt: row strides of x and t).
template <int MB>
void panel_block(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1,
                 float* t, int64_t ldt, bool add) {
  constexpr int VB = panel_vecs(MB);
  for (int c = 0; c < kPanelVecs; c += VB) {
    vf acc[MB][VB];
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < VB; ++j) acc[m][j] = add ? load(t + m * ldt + (c + j) * kLanes) : zero();
    const float* r = panel + k0 * kPanel + c * kLanes;
    for (int64_t k = k0; k < k1; ++k, r += kPanel) {
      if (MB >= 2 && c == 0)  // the first pass over the panel's columns asks ahead
        for (int64_t b = 0; b < kPanel; b += 64 / sizeof(float))
          __builtin_prefetch(r + kPanelAhead + b, 0, 3);
      vf wv[VB];
      for (int j = 0; j < VB; ++j) wv[j] = load(r + j * kLanes);
      for (int m = 0; m < MB; ++m) {
        vf xv = splat(x[m * ldx + k]);
        for (int j = 0; j < VB; ++j) acc[m][j] = fma(wv[j], xv, acc[m][j]);
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < VB; ++j) store(t + m * ldt + (c + j) * kLanes, acc[m][j]);
  }
}

// panel_block for mb (1 to 8) rows of x.
void panel_block_n(int64_t mb, const float* x, int64_t ldx, const float* panel, int64_t k0,
                   int64_t k1, float* t, bool add) {
  switch (mb) {
    case 1: return panel_block<1>(x, ldx, panel, k0, k1, t, kPanel, add);
    case 2: return panel_block<2>(x, ldx, panel, k0, k1, t, kPanel, add);
    case 3: return panel_block<3>(x, ldx, panel, k0, k1, t, kPanel, add);
    case 4: return panel_block<4>(x, ldx, panel, k0, k1, t, kPanel, add);
    case 5: return panel_block<5>(x, ldx, panel, k0, k1, t, kPanel, add);
    case 6: return panel_block<6>(x, ldx, panel, k0, k1, t, kPanel, add);
    case 7: return panel_block<7>(x, ldx, panel, k0, k1, t, kPanel, add);
    default: return panel_block<8>(x, ldx, panel, k0, k1, t, kPanel, add);
  }
}

// t[M, kPanel] (+)= x[M, k0:k1] . panel[k0:k1, :]: up to 8 rows of x at once (a decode step's,
// each weight read once), more in blocks of kPanelRows.
void panel_rows(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1,
                float* t, int64_t M, bool add) {
  const int64_t block = M <= 8 ? M : kPanelRows;
  for (int64_t m = 0; m < M; m += block)
    panel_block_n(std::min(block, M - m), x + m * ldx, ldx, panel, k0, k1, t + m * kPanel, add);
}

// y[M, N] = x[M, K] . W for W in panels wp[P, K, kPanel], P = ceil(N / kPanel).
void matmul_panels(ffi::ThreadPool* pool, const float* xp, const float* wp, float* yp, int64_t M,
                   int64_t N, int64_t K) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  auto out = [=](const float* t, int64_t m0, int64_t rows, int64_t p) {  // t[rows, kPanel] -> y
    int64_t n = std::min(kPanel, N - p * kPanel);
    for (int64_t m = 0; m < rows; ++m)
      std::copy(t + m * kPanel, t + m * kPanel + n, yp + (m0 + m) * N + p * kPanel);
  };
  // Each panel's k in `runs` runs, as many as give the team 8 units a thread at a decode step;
  // a run's sums start at zero and the runs add up in k's order, for every M: a row's sums are
  // the same bits whatever the other rows (batch invariance), prefill or decode.
  Team& team = Team::get();
  const int T = team.size();
  const int64_t split = std::max<int64_t>(1, (8 * T + P - 1) / P);  // runs of k a panel
  const int64_t run = (K + split - 1) / split, runs = (K + run - 1) / run, units = P * runs;
  if (M > 8 && pool) {
    const int64_t groups = (M + kGroupRows - 1) / kGroupRows;
    parallel_for(*pool, P * groups, 1, [=](int64_t u0, int64_t u1) {
      alignas(64) float t[kGroupRows * kPanel], r[kGroupRows * kPanel];
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t p = u / groups, m0 = u % groups * kGroupRows;
        const int64_t rows = std::min(kGroupRows, M - m0);
        for (int64_t k0 = 0; k0 < K; k0 += run) {
          float* s = k0 ? r : t;  // the first run's sums, then each later run's to add
          for (int64_t k = k0; k < std::min(K, k0 + run); k += kPanelK)
            panel_rows(xp + m0 * K, K, wp + p * K * kPanel, k, std::min({K, k0 + run, k + kPanelK}),
                       s, rows, k > k0);
          if (k0)
            for (int64_t i = 0; i < rows * kPanel; i += kLanes) store(t + i, load(t + i) + load(r + i));
        }
        out(t, m0, rows, p);
      }
    });
    return;
  }
  thread_local std::vector<float> sums;
  sums.resize(units * M * kPanel);
  float* sp = sums.data();
  auto unit = [=](int64_t u) {
    const int64_t p = u / runs, k0 = u % runs * run;
    panel_rows(xp, K, wp + p * K * kPanel, k0, std::min(K, k0 + run), sp + u * M * kPanel, M,
               false);
  };
  auto take = [&](int t, int T) {
    if (T == 1)
      for (int64_t u = 0; u < units; ++u) unit(u);
    else
      for (int64_t u; (u = team.claim(t)) >= 0;) unit(u);
  };
  team.run(take, Chain::next({reinterpret_cast<const char*>(wp), units, 1, run * kPanel * 4}),
           units);
  for (int64_t p = 0; p < P; ++p) {  // each panel's runs added in k's order
    float* s = sp + p * runs * M * kPanel;
    for (int64_t r = 1; r < runs; ++r)
      for (int64_t i = 0; i < M * kPanel; i += kLanes)
        store(s + i, load(s + i) + load(s + r * M * kPanel + i));
    out(s, 0, M, p);
  }
}

ffi::Error MatmulPanels(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] || wd[2] != kPanel || yd.size() != 2 ||
      yd[0] != xd[0] || (yd[1] + kPanel - 1) / kPanel != wd[0])
    return ffi::Error::InvalidArgument(
        "podrun_matmul_panels: expects x[M, K], w[P, K, 64] and y[M, N] with P = ceil(N / 64)");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  float* yp = y->typed_data();
  if (K == 0 || M == 0) {
    std::fill(yp, yp + M * N, 0.f);
    return ffi::Error::Success();
  }
  matmul_panels(&pool, x.typed_data(), w.typed_data(), yp, M, N, K);
  return ffi::Error::Success();
}

ffi::Error MatmulNKS8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                      ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || sd.size() != 1 || sd[0] != wd[0])
    return ffi::Error::InvalidArgument(
        "podrun_matmul_nk_s8: expects x[M, K], w[N, K] int8 and scale[N]");
  int64_t M = xd[0], K = xd[1], N = wd[0];
  const float* xp = x.typed_data();
  const int8_t* wp = w.typed_data();
  const float* sp = scale.typed_data();
  float* yp = y->typed_data();
  if (M <= 2) {  // a decode step of one or two rows: the team, as matmul_f32
    over_parts(wp, N, kLanes, K, kAnyParts, [=](int, int64_t, int64_t n0, int64_t n1) {
      if (n1 > n0) nk_all<int8_t>(xp, wp, sp, yp, M, N, K, n0, n1);
    });
    return ffi::Error::Success();
  }
  parallel_for(pool, N, grain(N, 16, pool.num_threads()), [=](int64_t n0, int64_t n1) {
    nk_all<int8_t>(xp, wp, sp, yp, M, N, K, n0, n1);
  });
  return ffi::Error::Success();
}

// y[M, N] = x[M, K] . W^T for 4-bit W (nk4_block): the team for one or two rows, as
// MatmulNKS8, else XLA's pool (when given); from bf16_rows rows on (> 0), in bfloat16 (nk4_bf16).
void matmul_s4(ffi::ThreadPool* pool, const float* xp, const uint8_t* qp, const uint16_t* dp,
               const uint16_t* mp, float* yp, int64_t M, int64_t N, int64_t K, int64_t bf16_rows) {
#if defined(__AVX512BF16__)
  if (bf16_rows > 0 && M >= bf16_rows && pool) {
    // x in bfloat16, read by every thread; each element written below, so none is zeroed first
    std::unique_ptr<uint16_t[]> xbuf(new uint16_t[M * K]);
    for (int64_t i = 0; i < M * K; i += kLanes) {  // K is a multiple of kGroup
      __m256bh h = _mm512_cvtneps_pbh(load(xp + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xbuf.get() + i), reinterpret_cast<__m256i&>(h));
    }
    const uint16_t* xb = xbuf.get();
    if (M < kBf16Rows) {  // a decode step's few rows: the team, as the float32 path
      over_parts(qp, N, kLanes, K / 2, kAnyParts, [=](int, int64_t, int64_t n0, int64_t n1) {
        switch (M) {
          case 1: return nk4_bf16_few<1>(xb, qp, dp, mp, yp, N, K, n0, n1);
          case 2: return nk4_bf16_few<2>(xb, qp, dp, mp, yp, N, K, n0, n1);
          default: return nk4_bf16_few<3>(xb, qp, dp, mp, yp, N, K, n0, n1);
        }
      });
      return;
    }
    parallel_for(*pool, N, grain(N, 16, pool->num_threads()), [=](int64_t n0, int64_t n1) {
      nk4_bf16(xb, qp, dp, mp, yp, M, N, K, n0, n1);
    });
    return;
  }
#endif
  if (M <= 2 || !pool) {
    over_parts(qp, N, kLanes, K / 2, kAnyParts, [=](int, int64_t, int64_t n0, int64_t n1) {
      if (n1 > n0) nk4_all(xp, qp, dp, mp, yp, M, N, K, n0, n1);
    });
    return;
  }
  parallel_for(*pool, N, grain(N, 16, pool->num_threads()), [=](int64_t n0, int64_t n1) {
    nk4_all(xp, qp, dp, mp, yp, M, N, K, n0, n1);
  });
}

ffi::Error MatmulNKS4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                      ffi::Buffer<ffi::F16> d, ffi::Buffer<ffi::F16> m,
                      ffi::ResultBuffer<ffi::F32> y, int64_t bf16_rows) {
  auto xd = x.dimensions(), qd = q.dimensions(), dd = d.dimensions(), md = m.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || dd.size() != 2 || md.size() != 2 ||
      xd[1] % kGroup != 0 || qd[1] * 2 != xd[1] || dd[0] != qd[0] || dd[1] != xd[1] / kGroup ||
      md[0] != dd[0] || md[1] != dd[1])
    return ffi::Error::InvalidArgument(
        "podrun_matmul_nk_s4: expects x[M, K] with K a multiple of 32, q[N, K / 2] uint8 and "
        "d, m[N, K / 32] float16");
  matmul_s4(&pool, x.typed_data(), q.typed_data(), d.typed_data(), m.typed_data(),
            y->typed_data(), xd[0], qd[0], xd[1], bf16_rows);
  return ffi::Error::Success();
}

// --- greedy tokens through an int8 screen of the unembedding ---------------------------------
//
// A greedy step needs the largest logit z_v = x . W_v over the V rows of the unembedding, not the
// logits, and reading W is 40% of the peer model's batch-1 decode bytes in float32. The screen is
// W in int8 per row, W_v ~ s_v q_v, with a radius R_v (models/kernels/cpu.py, greedy_screen) such
// that for every x
//   |x . W_v - s_v fl(x . q_v)| <= ||x|| R_v,
// R_v covering the int8 rounding (||W_v - s_v q_v||) and the float32 rounding of the screen's
// product and of the bound's own arithmetic. Every row gets an interval around its screened
// logit; the largest logit lies in a row whose upper end reaches the largest lower end, and only
// those candidates (a few rows for a random or trained model: the intervals are about a hundredth
// of the logits' spread) are computed from W, with float64 sums. The step reads a quarter of W's
// bytes and returns the argmax of the logits computed in float64, ties to the lowest index.
// A row of x that is not finite gets the float32 logits' first maximum (V - 1 where they are
// NaN), as the engine's greedy_tokens; logits flat enough to leave more than kManyCandidates rows in
// 1024 (a zero x: all of them) are all computed, one pass over W.

constexpr int64_t kManyCandidates = 16;

double dot64(const float* a, const float* b, int64_t n) {
  double s = 0;
  for (int64_t k = 0; k < n; ++k) s += double(a[k]) * b[k];
  return s;
}

// logit[p] = x[rows[p]] . W_cols[p] in float64 for P pairs (row of x, row v of the unembedding),
// the pairs split over the team: W[V, D] (w_nk) a contiguous row each; W[D, V] a column each,
// D lines apart, a thread's columns read together in one pass over D with the lines of eight
// rows on asked for ahead.
void exact_logits(const float* x, const float* w, bool w_nk, int64_t V, int64_t D,
                  const std::vector<int64_t>& rows, const std::vector<int32_t>& cols,
                  std::vector<double>& logit) {
  const int64_t P = int64_t(cols.size());
  logit.assign(P, 0.0);
  const int64_t* r = rows.data();
  const int32_t* c = cols.data();
  double* out = logit.data();
  auto share = [=](int t, int T) {
    auto [p0, p1] = part(P, 1, t, T);
    if (w_nk) {
      for (int64_t p = p0; p < p1; ++p) out[p] = dot64(x + r[p] * D, w + c[p] * D, D);
      return;
    }
    for (int64_t k = 0; k < D; ++k) {
      const float* wk = w + k * V;
      if (k + 8 < D)
        for (int64_t p = p0; p < p1; ++p) __builtin_prefetch(wk + 8 * V + c[p], 0, 0);
      for (int64_t p = p0; p < p1; ++p) out[p] += double(x[r[p] * D + k]) * wk[c[p]];
    }
  };
  if (P > 1) Team::get().run(share);
  else share(0, 1);
}

// The first index of the largest of y[0, V), V - 1 when it is NaN (the engine's greedy_tokens)
int32_t first_max(const float* y, int64_t V) {
  float top = -INFINITY;
  for (int64_t v = 0; v < V; ++v)
    if (std::isnan(y[v]) || y[v] > top) top = y[v];
  for (int64_t v = 0; v < V; ++v)
    if (y[v] == top) return int32_t(v);
  return int32_t(V - 1);
}

// The first maximum of row x's float32 logits, as the engine finds it without the screen.
int32_t float_first_max(const float* x, const float* w, bool w_nk, int64_t V, int64_t D) {
  thread_local std::vector<float> y;
  y.resize(V);
  matmul_f32(x, w, y.data(), 1, V, D, w_nk);
  return first_max(y.data(), V);
}

// Every logit of row x in float64, in one pass over W; the argmax, ties to the lowest index.
int32_t exact_argmax(const float* x, const float* w, bool w_nk, int64_t V, int64_t D) {
  thread_local std::vector<double> z;
  z.assign(V, 0.0);
  if (w_nk)
    for (int64_t v = 0; v < V; ++v) z[v] = dot64(x, w + v * D, D);
  else
    for (int64_t k = 0; k < D; ++k) {
      const double xk = x[k];
      const float* r = w + k * V;
      for (int64_t v = 0; v < V; ++v) z[v] += xk * r[v];
    }
  return int32_t(std::max_element(z.begin(), z.end()) - z.begin());
}

void greedy_screened(const float* x, const float* w, bool w_nk, const int8_t* q, const float* s,
                     const float* R, int32_t* ids, int64_t M, int64_t V, int64_t D) {
  thread_local std::vector<float> norm, z, tau;
  thread_local std::vector<std::vector<int32_t>> cands;
  norm.resize(M);
  for (int64_t m = 0; m < M; ++m) {  // ||x_m||, rounded up
    double a = 0;
    for (int64_t k = 0; k < D; ++k) a += double(x[m * D + k]) * x[m * D + k];
    norm[m] = float(std::sqrt(a) * (1 + 1e-6));
  }
  const int T = Team::get().size();
  z.resize(M * V);
  tau.assign(T * M, -INFINITY);
  cands.resize(T * M);
  for (auto& c : cands) c.clear();  // a busy team runs every share on this thread as t = 0
  // (the helpers see this thread's buffers through pointers: a thread_local named in the body
  // would be the helper's own)
  float *zp = z.data(), *taup = tau.data();
  const float* normp = norm.data();
  std::vector<int32_t>* candp = cands.data();
  // each part: its screened logits, the largest lower end there, and the rows whose upper end
  // reaches it (a superset of the candidates the part holds), gathered by thread
  over_parts(q, V, kLanes, D, kAnyParts, [=](int t, int64_t, int64_t n0, int64_t n1) {
    if (n1 <= n0) return;
    nk_all<int8_t>(x, q, s, zp, M, V, D, n0, n1);
    for (int64_t m = 0; m < M; ++m) {
      const float* zm = zp + m * V;
      const float r = normp[m];
      auto upper = [&](int64_t n) { return zm[n] + r * R[n]; };
      vf low = splat(-INFINITY), nr = splat(-r), vr = splat(r);
      int64_t n = n0;
      for (; n + kLanes <= n1; n += kLanes) low = vmax(low, fma(nr, load(R + n), load(zm + n)));
      float best = hmax(low);
      for (; n < n1; ++n) best = std::max(best, zm[n] - r * R[n]);
      auto& c = candp[t * M + m];
      constexpr int64_t span = 4 * kLanes;  // rows whose upper ends are checked together
      for (n = n0; n + span <= n1; n += span) {
        vf up = fma(vr, load(R + n), load(zm + n));
        for (int64_t j = kLanes; j < span; j += kLanes)
          up = vmax(up, fma(vr, load(R + n + j), load(zm + n + j)));
        if (hmax(up) >= best)
          for (int64_t j = n; j < n + span; ++j)
            if (upper(j) >= best) c.push_back(int32_t(j));
      }
      for (; n < n1; ++n)
        if (upper(n) >= best) c.push_back(int32_t(n));
      taup[t * M + m] = std::max(taup[t * M + m], best);  // over the thread's parts
    }
  });
  // the candidates of all rows as (row, v) pairs
  thread_local std::vector<int64_t> rows;
  thread_local std::vector<int32_t> cols;
  thread_local std::vector<double> logit;
  rows.clear(), cols.clear();
  const int64_t many = std::max<int64_t>(kManyCandidates, kManyCandidates * V / 1024);
  for (int64_t m = 0; m < M; ++m) {
    ids[m] = -1;
    const float* xm = x + m * D;
    if (!std::isfinite(norm[m])) {
      ids[m] = float_first_max(xm, w, w_nk, V, D);
      continue;
    }
    float best = -INFINITY;
    for (int t = 0; t < T; ++t) best = std::max(best, tau[t * M + m]);
    const float r = norm[m];
    const size_t first = cols.size();
    for (int t = 0; t < T; ++t)
      for (int32_t v : cands[t * M + m])
        if (z[m * V + v] + r * R[v] >= best) rows.push_back(m), cols.push_back(v);
    const int64_t found = int64_t(cols.size() - first);
    if (found > many || found == 0) {  // flat logits; none: a weight is not finite
      rows.resize(first), cols.resize(first);
      ids[m] = found ? exact_argmax(xm, w, w_nk, V, D) : float_first_max(xm, w, w_nk, V, D);
    }
  }
  exact_logits(x, w, w_nk, V, D, rows, cols, logit);
  std::vector<double> top(M, -INFINITY);
  for (size_t p = 0; p < cols.size(); ++p) {  // ties go to the lowest v
    const int64_t m = rows[p];
    if (ids[m] < 0 || logit[p] > top[m] || (logit[p] == top[m] && cols[p] < ids[m]))
      top[m] = logit[p], ids[m] = cols[p];
  }
}

ffi::Error GreedyScreened(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S8> q,
                          ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> radius,
                          ffi::ResultBuffer<ffi::S32> ids, bool w_nk) {
  auto xd = x.dimensions(), wd = w.dimensions(), qd = q.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || qd.size() != 2 || xd[1] != qd[1] ||
      wd[w_nk ? 0 : 1] != qd[0] || wd[w_nk ? 1 : 0] != qd[1] ||
      scale.dimensions().size() != 1 || scale.dimensions()[0] != qd[0] ||
      radius.dimensions().size() != 1 || radius.dimensions()[0] != qd[0] || qd[0] == 0)
    return ffi::Error::InvalidArgument(
        "podrun_greedy_screened: expects x[M, D], w[D, V] (or [V, D] with w_nk), q[V, D] int8, "
        "scale[V] and radius[V], V > 0");
  greedy_screened(x.typed_data(), w.typed_data(), w_nk, q.typed_data(), scale.typed_data(),
                  radius.typed_data(), ids->typed_data(), xd[0], qd[0], xd[1]);
  return ffi::Error::Success();
}

// --- a decode step's RMS norm -----------------------------------------------------------------
//
// y[m] = (x[m] / sqrt(mean(x[m]^2) + eps)) * w for each row of x [M, D], as models/norms.rms_norm
// computes it, in one call: XLA:CPU ran it as four operations (the squares, a partial sum, its
// total and rsqrt, the scaling), each with its own gap, twice a layer.
ffi::Error RmsNorm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y,
                   float eps) {
  auto xd = x.dimensions();
  const int64_t D = xd.size() ? xd.back() : 0;
  if (!xd.size() || w.dimensions().size() != 1 || w.dimensions()[0] != D)
    return ffi::Error::InvalidArgument("podrun_rms_norm: expects x[..., D] and w[D]");
  const int64_t M = D ? int64_t(x.element_count()) / D : 0;
  const float *xp = x.typed_data(), *wp = w.typed_data();
  float* yp = y->typed_data();
  // w arrives cold from DRAM (a step streams more than the caches hold): every line asked for
  // at once, not one miss after another as the loop below would
  for (int64_t k = 0; k < D; k += 64 / sizeof(float)) __builtin_prefetch(wp + k, 0, 3);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = xp + m * D;
    float* ym = yp + m * D;
    int64_t k = 0;
    vf a = zero(), b = zero();  // two chains
    for (; k + 2 * kLanes <= D; k += 2 * kLanes) {
      vf u = load(xm + k), v = load(xm + k + kLanes);
      a = fma(u, u, a), b = fma(v, v, b);
    }
    for (; k + kLanes <= D; k += kLanes) a = fma(load(xm + k), load(xm + k), a);
    float sq = hsum(a + b);
    for (; k < D; ++k) sq += xm[k] * xm[k];
    const float r = 1.f / std::sqrt(sq / float(D) + eps);
    const vf rv = splat(r);
    for (k = 0; k + kLanes <= D; k += kLanes) store(ym + k, load(xm + k) * rv * load(wp + k));
    for (; k < D; ++k) ym[k] = xm[k] * r * wp[k];
  }
  return ffi::Error::Success();
}

}  // namespace

// Which vector path of cpu_kernels.h this build uses (models/kernels/cpu.vector_path).
extern "C" const char* podrun_vector_path() { return kVectorPath; }

// The rows of x from which the int4 product runs in bfloat16 (nk4_bf16), 0 where this build has
// no AVX-512 BF16 (models/kernels/cpu.bf16_rows).
extern "C" int podrun_bf16_rows() {
#if defined(__AVX512BF16__)
  return kBf16Rows;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(podrun_matmul_f32, MatmulF32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("w_nk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(podrun_matmul_panels, MatmulPanels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(podrun_matmul_nk_s8, MatmulNKS8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(podrun_matmul_nk_s4, MatmulNKS4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bf16_rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(podrun_greedy_screened, GreedyScreened,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<bool>("w_nk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(podrun_rms_norm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [D]
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));
