// benchmarks/main.cpp: the main() of every benchmark program: Google Benchmark's, except that a CSV report is
// refused with a clear message. Google Benchmark's CSV reporter (deprecated upstream) aborts with a failed CHECK
// unless every run of a program has the same user counters, and these programs' benchmark families report
// different counters; the console and JSON reporters have no such limit.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <string_view>

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--benchmark_format=csv" || a == "--benchmark_out_format=csv") {
      std::fprintf(stderr,
                   "%s: %s is not supported: Google Benchmark's CSV reporter (deprecated upstream) needs the same "
                   "counters in every run, and pagedkv's benchmark families report different ones; use "
                   "--benchmark_format=json or --benchmark_out_format=json (every counter, per run)\n",
                   argv[0], argv[i]);
      return 2;
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
