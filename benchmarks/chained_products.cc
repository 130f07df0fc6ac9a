// A batch-1 decode step's float32 projections in C++, without XLA: SmolLM2's shapes (30 layers of
// q, k, v, o, gate, up, down) chained with gaps between them (4 us, 13 us after v, where XLA runs
// the operations between products), W in [K, N] (matmul_f32) against W in panels (matmul_panels),
// and in panels with q/k/v and gate/up fused (programs.fuse_projections: 13 us after qkv),
// beside a plain two-thread read of the same bytes; alternated round by round in one process, the
// rounds sorted by that read into fast (above --split GB/s) and slow ones.
//
//   g++ -O3 -march=native -std=c++17 -fno-math-errno -pthread -w \
//       -I$(python -c "import jax; print(jax.ffi.include_dir())") \
//       benchmarks/chained_products.cc -o /tmp/chained_products && /tmp/chained_products 60 45
//
// Arguments: rounds (default 30), the GB/s that splits fast from slow rounds (default 45).

#include "../models/kernels/cpu_matmul.cc"

#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

using clk = std::chrono::steady_clock;

static void spin_us(double us) {
  auto until = clk::now() + std::chrono::nanoseconds(int64_t(us * 1000));
  while (clk::now() < until) {}
}

static double median(std::vector<double> a) {
  std::sort(a.begin(), a.end());
  return a[a.size() / 2];
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 30;
  const double split = argc > 2 ? atof(argv[2]) : 45;
  struct Mat { int64_t K, N; float* w; };
  std::vector<Mat> mats, fused;  // q, k, v, o, gate, up, down; fused: qkv, o, gate_up, down
  for (int l = 0; l < 30; ++l) {
    for (auto [K, N] : {std::pair{576, 576}, {576, 192}, {576, 192}, {576, 576}, {576, 1536},
                        {576, 1536}, {1536, 576}})
      mats.push_back({K, N, nullptr});
    for (auto [K, N] : {std::pair{576, 960}, {576, 576}, {576, 3072}, {1536, 576}})
      fused.push_back({K, N, nullptr});
  }
  size_t total = 0;
  for (auto& m : mats) total += size_t(m.K * m.N * 4);
  const size_t bytes = (total + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  char* pool = static_cast<char*>(aligned_alloc(2 << 20, bytes));
  madvise(pool, bytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < bytes / 4; ++i) reinterpret_cast<float*>(pool)[i] = 0.01f * (i % 7);
  size_t at = 0;
  for (auto& m : mats) m.w = reinterpret_cast<float*>(pool + at), at += size_t(m.K * m.N * 4);
  at = 0;
  for (auto& m : fused) m.w = reinterpret_cast<float*>(pool + at), at += size_t(m.K * m.N * 4);
  std::vector<float> x(1536, 0.5f), y(1536);
  std::atomic<float> sink{0};
  auto plain = [&] {
    auto body = [&](int t, int T) {
      auto [b, e] = part(int64_t(total / 256), 1, t, T);
      vf s = zero();
      for (int64_t i = b; i < e; ++i) {
        const float* p = reinterpret_cast<const float*>(pool + i * 256);
        s = s + load(p) + load(p + 16) + load(p + 32) + load(p + 48);
      }
      sink.store(hsum(s));
    };
    Team::get().run(body);
  };
  std::vector<float> yf(3072);
  auto chain = [&](bool panels, bool gaps) {
    for (size_t i = 0; i < mats.size(); ++i) {
      const Mat& m = mats[i];  // the same bytes read either way; as panels, [N / 64, K, 64]
      if (panels) matmul_panels(nullptr, x.data(), m.w, y.data(), 1, m.N, m.K);
      else matmul_f32(x.data(), m.w, y.data(), 1, m.N, m.K, false);
      if (gaps) spin_us(i % 7 == 2 ? 13 : 4);
    }
  };
  auto chain_fused = [&](bool gaps) {
    for (size_t i = 0; i < fused.size(); ++i) {
      const Mat& m = fused[i];
      matmul_panels(nullptr, x.data(), m.w, yf.data(), 1, m.N, m.K);
      if (gaps) spin_us(i % 4 == 0 ? 13 : 4);
    }
  };
  std::map<std::string, std::vector<double>> fast, slow;
  for (int r = 0; r < rounds; ++r) {
    std::map<std::string, std::vector<double>> t;
    auto time = [&](const std::string& name, auto f) {
      auto t0 = clk::now();
      f();
      t[name].push_back(std::chrono::duration<double>(clk::now() - t0).count());
    };
    for (int rep = 0; rep < 3; ++rep) {
      time("plain read", plain);
      time("[K, N] with gaps", [&] { chain(false, true); });
      time("panels with gaps", [&] { chain(true, true); });
      time("[K, N]", [&] { chain(false, false); });
      time("panels", [&] { chain(true, false); });
      time("fused panels", [&] { chain_fused(false); });
      time("fused with gaps", [&] { chain_fused(true); });
    }
    const bool is_fast = total / median(t["plain read"]) / 1e9 > split;
    for (auto& [k, v] : t) for (double d : v) (is_fast ? fast : slow)[k].push_back(d);
  }
  printf("%.1f MB of weights a step, %d rounds\n", total / 1e6, rounds);
  for (auto* group : {&fast, &slow}) {
    if (group->empty()) continue;
    printf("%s rounds (%zu):\n", group == &fast ? "fast" : "slow", (*group)["plain read"].size() / 3);
    for (auto& [k, v] : *group)
      printf("  %-18s %7.3f ms  %5.1f GB/s\n", k.c_str(), median(v) * 1e3, total / median(v) / 1e9);
  }
}
