// tests/cuda/gpu_main.cpp: Catch2 runner for the GPU tests. Prints the run's seed (PAGEDKV_GPU_SEED, or a fresh one
// from std::random_device; every test case mixes it into its own seed, so each run draws fresh random inputs and
// `PAGEDKV_GPU_SEED=<seed>` replays one). Exits with 77 (CTest SKIP_RETURN_CODE) after printing "no CUDA device" when
// no CUDA device is usable, unless the test spec selects only device-free tests ("[host]") or the run only lists
// tests. No CUDA call happens at static-initialization time.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

namespace pkt {
namespace {
std::uint64_t g_seed = 0;
bool g_seed_set = false;
}  // namespace

std::uint64_t run_seed() {
  if (!g_seed_set) {
    const char* env = std::getenv("PAGEDKV_GPU_SEED");
    if (env != nullptr && *env != '\0') {
      g_seed = std::strtoull(env, nullptr, 10);
    } else {
      std::random_device rd;
      g_seed = (std::uint64_t{rd()} << 32 | rd()) & ((std::uint64_t{1} << 48) - 1);
    }
    g_seed_set = true;
  }
  return g_seed;
}
}  // namespace pkt

int main(int argc, char** argv) {
  bool host_only = false;
  for (int i = 1; i < argc; ++i) {
    // A spec that selects [host] (not one that excludes it with ~[host]) needs no device.
    for (const char* at = std::strstr(argv[i], "[host]"); at != nullptr; at = std::strstr(at + 1, "[host]")) {
      host_only = host_only || at == argv[i] || at[-1] != '~';
    }
    host_only = host_only || std::strncmp(argv[i], "--list", 6) == 0 || std::strcmp(argv[i], "-l") == 0;
  }
  std::printf("pagedkv GPU tests: seed %llu (replay: PAGEDKV_GPU_SEED=%llu)\n",
              static_cast<unsigned long long>(pkt::run_seed()), static_cast<unsigned long long>(pkt::run_seed()));
  if (!host_only) {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      std::printf("pagedkv GPU tests: no CUDA device (%s): skipped (exit 77)\n",
                  e != cudaSuccess ? cudaGetErrorString(e) : "device count 0");
      return 77;
    }
  }
  return Catch::Session().run(argc, argv);
}
