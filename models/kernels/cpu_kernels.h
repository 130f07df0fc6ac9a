// What podrun's CPU kernels (cpu_matmul.cc, cpu_attention.cc) share: the vectors of the widest
// path this build's target has (AVX-512, AVX2 or portable), XLA's intra-op pool split into chunks,
// and the team of threads that runs a decode step's products (one team per process: Team::get).

#pragma once

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace podrun {

// kLanes floats per vector register, kVecRegs vector registers: the kernels' register blocks are
// sized from these, so that their sums stay in registers (sized for AVX-512's 32 registers, the
// blocks spilled on an AVX2 machine's 16: a product of 8 rows ran 7x slower than of 1 row).
#if defined(__AVX512F__)
#define PODRUN_VECTOR_F16 1
constexpr int kLanes = 16, kVecRegs = 32;
constexpr const char* kVectorPath = "avx512";
typedef __m512 vf;
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline vf load_s8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
// kLanes bytes of 4-bit pairs: the low nibbles as floats (lo), the high ones (hi)
inline void load_u4(const uint8_t* p, vf& lo, vf& hi) {
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
inline vf load_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf splat(float s) { return _mm512_set1_ps(s); }
inline vf zero() { return _mm512_setzero_ps(); }
inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
// The lanes' sum in hsum4's order (lanes 2 apart, then 1, within each 128 bits; then the 128-bit
// blocks 2 apart, then 1): a sum is the same bits through either, so a kernel may take outputs
// four at a time or one at a time, wherever its blocks fall (batch invariance).
inline float hsum(vf v) {
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_cvtss_f32(v);
}
inline float hmax(vf v) { return _mm512_reduce_max_ps(v); }
// out[0..3] = hsum(a), hsum(b), hsum(c), hsum(d), the same bits: interleaved within 128-bit
// lanes, then the lanes added (8 shuffles for the four, where hsum takes 4 each)
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
  vf ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  vf cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512d x = _mm512_castps_pd(ab), y = _mm512_castps_pd(cd);
  vf s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(2, 3, 0, 1)));
  _mm_storeu_ps(out, _mm512_castps512_ps128(s));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8, kVecRegs = 16;
constexpr const char* kVectorPath = "avx2";
typedef __m256 vf;
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline vf load_s8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline void load_u4(const uint8_t* p, vf& lo, vf& hi) {
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
#if defined(__F16C__)
inline vf load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#define PODRUN_VECTOR_F16 1
#endif
inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf splat(float s) { return _mm256_set1_ps(s); }
inline vf zero() { return _mm256_setzero_ps(); }
inline vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline float hsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {  // as the AVX-512 one, two 128-bit lanes
  vf ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  vf cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
  __m256d x = _mm256_castps_pd(ab), y = _mm256_castps_pd(cd);
  vf s = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                       _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
#else  // portable: GCC vector extensions, whatever the target's vectors are
constexpr int kLanes = 8, kVecRegs = 16;
constexpr const char* kVectorPath = "portable";
typedef float vf __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef int8_t vb __attribute__((vector_size(kLanes), aligned(1)));
inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline vf load_s8(const int8_t* p) {
  vb b; std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vf);
}
typedef uint8_t vu8 __attribute__((vector_size(kLanes), aligned(1)));
typedef int32_t vi __attribute__((vector_size(kLanes * 4)));
inline void load_u4(const uint8_t* p, vf& lo, vf& hi) {
  vu8 b; std::memcpy(&b, p, sizeof b);
  vi w = __builtin_convertvector(b, vi);
  lo = __builtin_convertvector(w & 15, vf);
  hi = __builtin_convertvector(w >> 4, vf);
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float s) { return vf{} + s; }
inline vf zero() { return vf{}; }
inline vf fma(vf a, vf b, vf c) { return a * b + c; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}
inline float hmax(vf v) {
  float s = v[0];
  for (int i = 1; i < kLanes; ++i) s = std::max(s, v[i]);
  return s;
}
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
  out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d);
}
#endif

// Runs body(begin, end) over [0, total) in chunks of `grain`, on the caller and on the pool's other
// threads. A helper that starts after the work is gone finds no chunk and returns; the caller waits
// only for chunks that were taken, so it never waits on a helper that has not started.
template <typename Body>
void parallel_for(ffi::ThreadPool& pool, int64_t total, int64_t grain, Body body) {
  int64_t chunks = (total + grain - 1) / grain;
  int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks) - 1;
  if (helpers <= 0) { body(0, total); return; }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, chunks, total, grain, body]() {
    for (int64_t c; (c = state->next.fetch_add(1)) < chunks;) {
      body(c * grain, std::min(total, (c + 1) * grain));
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(work)(work));
  work();
  while (state->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}


// [begin, end) of `total` split T ways in multiples of `unit`: part t.
inline std::pair<int64_t, int64_t> part(int64_t total, int64_t unit, int t, int T) {
  int64_t per = (total / T + unit - 1) / unit * unit;
  int64_t begin = std::min(total, per * t), end = t == T - 1 ? total : std::min(total, per * (t + 1));
  return {begin, end};
}

// A team of threads for the products of one decode step, which come a few microseconds apart: a
// helper spins for a while after each product (kSpin) before it sleeps, so the next product finds
// it awake. The team has one thread per core this process may run on, the caller included, up to
// kMaxThreads: a few cores already saturate memory bandwidth, and each further thread adds a share
// of partial sums for the caller to add up (W[K, N] in cpu_matmul.cc) and a core spinning between
// products. A call that finds the team busy (another device's computation, in a process that
// simulates several) runs on its own thread. After fork, a child has no helpers and runs alone too.
class Team {
 public:
  static Team& get() {
    static Team* team = new Team();  // never destroyed: helpers may be asleep at exit
    return *team;
  }

  int size() const { return int(threads_) + 1; }

  // Memory for the helpers to read ahead once their share of a call is done: `rows` rows of
  // `row_bytes` from `base`, split among the team as part(rows, unit, t, T) splits a product.
  struct Ahead {
    const char* base = nullptr;
    int64_t rows = 0, unit = 1, row_bytes = 0;
  };

  // body(t, T) for every t in [0, T): this thread takes t = 0, each helper one other t. Helpers
  // that finish then ask for the first kAheadBytes of their own share of `ahead` (the product
  // expected next), until the next call starts. With `chunks`, the bodies take their work from
  // claim().
  template <typename Body>
  void run(Body& body, Ahead ahead = {}, int64_t chunks = 0) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (threads_ == 0 || !busy.owns_lock() || getpid() != pid_) { body(0, 1); return; }
    const int T = int(threads_) + 1;
    for (int t = 0; chunks && t < T; ++t) {
      auto [b, e] = part(chunks, 1, t, T);
      ranges_[t].lohi.store(uint64_t(b) << 32 | uint64_t(e), std::memory_order_relaxed);
    }
    fn_ = [](void* b, int t, int T) { (*static_cast<Body*>(b))(t, T); };
    ctx_ = &body;
    ahead_base_.store(ahead.base, std::memory_order_relaxed);
    ahead_rows_.store(ahead.rows, std::memory_order_relaxed);
    ahead_unit_.store(ahead.unit, std::memory_order_relaxed);
    ahead_row_bytes_.store(ahead.row_bytes, std::memory_order_relaxed);
    pending_.store(int(threads_));
    gen_.fetch_add(1);  // seq_cst, as the sleepers' count below (see wait)
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> l(mu_);
      cv_.notify_all();
    }
    body(0, T);
    while (pending_.load(std::memory_order_acquire) > 0) pause();
  }

  // The next chunk for thread t of a call run() split into chunks: those of t's own share
  // (part(chunks, 1, t, T)) from its front, then the others' from their backs; -1 when all are
  // taken. A thread that memory serves slower than the others (their shares of a product
  // finished 10-20% apart here) leaves them the end of its share.
  int64_t claim(int t) {
    const int T = int(threads_) + 1;
    for (int o = 0; o < T; ++o) {
      std::atomic<uint64_t>& r = ranges_[(t + o) % T].lohi;
      uint64_t v = r.load(std::memory_order_relaxed);
      for (;;) {
        const uint64_t lo = v >> 32, hi = v & 0xFFFFFFFFu;
        if (lo >= hi) break;
        const uint64_t rest = o == 0 ? (lo + 1) << 32 | hi : lo << 32 | (hi - 1);
        if (r.compare_exchange_weak(v, rest, std::memory_order_relaxed)) return int64_t(o ? hi - 1 : lo);
      }
    }
    return -1;
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(200);
  static constexpr int kMaxThreads = 8;
  static constexpr int64_t kAheadBytes = 256 << 10;

  Team() : pid_(getpid()) {
    cpu_set_t set;
    int cores = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set)
                                                            : int(std::thread::hardware_concurrency());
    threads_ = std::clamp(cores, 1, kMaxThreads) - 1;
    for (unsigned i = 0; i < threads_; ++i) std::thread([this, i] { loop(int(i) + 1); }).detach();
  }

  static void pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      seen = wait(seen);
      fn_(ctx_, id, int(threads_) + 1);
      constexpr auto relaxed = std::memory_order_relaxed;
      Ahead a{ahead_base_.load(relaxed), ahead_rows_.load(relaxed), ahead_unit_.load(relaxed),
              ahead_row_bytes_.load(relaxed)};
      pending_.fetch_sub(1, std::memory_order_release);
      if (a.base) read_ahead(a, seen, id);
    }
  }

  // A line at a time from the start of helper `id`'s own share of `a` (the share it takes first
  // in the next call), until the next call starts; the caller meanwhile runs XLA's operations
  // between two products, with memory idle. Only its own share: lines one core fetches for
  // another's share make that share slower to read when DRAM streams faster than one core takes
  // lines from another's L2.
  void read_ahead(const Ahead& a, uint64_t seen, int id) {
    auto [begin, end] = part(a.rows, a.unit, id, int(threads_) + 1);
    const char* share = a.base + begin * a.row_bytes;
    const int64_t len = std::min((end - begin) * a.row_bytes, kAheadBytes);
    for (int64_t i = 0, at = 0; at < len; ++i, at += 64) {
      if ((i & 15) == 0 && gen_.load(std::memory_order_relaxed) != seen) return;
      __builtin_prefetch(share + at, 0, 3);
    }
  }

  // The next generation after `seen`: spinning for kSpin, then asleep until run() wakes us.
  uint64_t wait(uint64_t seen) {
    auto until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 0;; ++i) {
      uint64_t g = gen_.load(std::memory_order_acquire);
      if (g != seen) return g;
      pause();
      if ((i & 255) == 255 && std::chrono::steady_clock::now() > until) break;
    }
    std::unique_lock<std::mutex> l(mu_);
    sleepers_.fetch_add(1);  // seq_cst: run() either sees us here or we see its new generation
    cv_.wait(l, [&] { return gen_.load() != seen; });
    sleepers_.fetch_sub(1);
    return gen_.load();
  }

  pid_t pid_;
  unsigned threads_ = 0;
  std::mutex busy_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0}, sleepers_{0};
  void (*fn_)(void*, int, int) = nullptr;
  void* ctx_ = nullptr;
  std::atomic<const char*> ahead_base_{nullptr};
  std::atomic<int64_t> ahead_rows_{0}, ahead_unit_{1}, ahead_row_bytes_{0};
  struct alignas(64) Range {  // chunks [lo, hi) left of a thread's share, lo << 32 | hi
    std::atomic<uint64_t> lohi{0};
  };
  Range ranges_[kMaxThreads];
};

// The products of a decode step come in the same order every step, over weights that stay put: each
// call records which weights followed the previous call's, and hands the team the weights that
// followed its own last time (Team::Ahead), whose first bytes the helpers ask for once done, while
// XLA runs the operations between two products and memory would idle. A wrong guess (a first
// step, another device's calls in between) only reads memory in vain; calls that find the chain in
// use skip it. Paged attention (cpu_attention.cc) joins the chain: its pages lie anywhere in the
// pool, so nothing of them is asked for ahead, but while the caller finishes its heads the helpers
// ask for the next product's weights.
class Chain {
 public:
  static Team::Ahead next(const Team::Ahead& self) {
    static Chain* chain = new Chain();
    std::unique_lock<std::mutex> l(chain->mu_, std::try_to_lock);
    if (!l.owns_lock()) return {};
    if (Entry* e = chain->find(chain->last_, true)) e->next = self;
    chain->last_ = self.base;
    Entry* mine = chain->find(self.base, false);
    return mine ? mine->next : Team::Ahead{};
  }

 private:
  struct Entry {
    const char* key = nullptr;
    Team::Ahead next;
  };
  static constexpr size_t kSlots = 4096;  // products a step, at most (then no more are learnt)

  // The entry of `key` (open addressing), made when `add` and there is room; null otherwise.
  Entry* find(const char* key, bool add) {
    if (!key) return nullptr;
    size_t h = (reinterpret_cast<uintptr_t>(key) >> 6) * 0x9E3779B97F4A7C15ull >> 52;
    for (size_t i = 0; i < 64; ++i) {
      Entry& e = slots_[(h + i) % kSlots];
      if (e.key == key) return &e;
      if (!e.key) {
        if (!add) return nullptr;
        e.key = key;
        return &e;
      }
    }
    return nullptr;
  }

  std::mutex mu_;
  const char* last_ = nullptr;
  std::vector<Entry> slots_ = std::vector<Entry>(kSlots);
};

// IEEE half-precision values as floats (the int4 weights' scales and minima)
inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
  if (exp == 31) bits = sign | 0x7F800000u | (man << 13);  // inf, nan
  else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
  else if (!man) bits = sign;
  else {  // subnormal: normalise
    int e = -1;
    do { ++e; man <<= 1; } while (!(man & 1024));
    bits = sign | (uint32_t(112 - e) << 23) | ((man & 1023) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline void halves_to_floats(const uint16_t* h, float* f, int64_t n) {
  int64_t i = 0;
#if defined(PODRUN_VECTOR_F16)
  for (; i + kLanes <= n; i += kLanes) store(f + i, load_f16(h + i));
#endif
  for (; i < n; ++i) f[i] = half_to_float(h[i]);
}

template <typename C>
inline vf load_as_float(const C* p) {
  if constexpr (sizeof(C) == 1) return load_s8(p);
  else return load(p);
}

}  // namespace podrun
