// tests/cuda/gpu_main.cpp: Catch2 runner for the GPU tests. Exits with 77 (CTest SKIP_RETURN_CODE) after printing
// "no CUDA device" when no CUDA device is usable, unless the test spec selects only device-free tests ("[host]") or
// the run only lists tests. No CUDA call happens at static-initialization time.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  bool host_only = false;
  for (int i = 1; i < argc; ++i) {
    host_only = host_only || std::strstr(argv[i], "[host]") != nullptr || std::strncmp(argv[i], "--list", 6) == 0 ||
                std::strcmp(argv[i], "-l") == 0;
  }
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
