// tests/fuzz/seed_writer.hpp: the main() of the seed generators (make_seeds, make_group_seeds): writes each named
// seed's bytes to <output directory>/<name>.bin.
#pragma once

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace pagedkv_fuzz {

/// Writes every (name, seed) of `seeds` (a seed has `bytes()`, a byte vector) to argv[1]/name.bin, creating the
/// directory. Returns the process exit status: 0, 1 when a file cannot be written, 2 on a wrong command line.
template <class Seed>
int write_seeds(int argc, char** argv, const std::vector<std::pair<std::string, Seed>>& seeds) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <output directory>\n", argv[0]);
    return 2;
  }
  const std::filesystem::path dir(argv[1]);
  std::filesystem::create_directories(dir);
  for (const auto& [name, seed] : seeds) {
    const auto& bytes = seed.bytes();
    std::ofstream out(dir / (name + ".bin"), std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    if (!out) {
      std::fprintf(stderr, "%s: cannot write %s\n", argv[0], (dir / (name + ".bin")).string().c_str());
      return 1;
    }
  }
  std::printf("wrote %zu seeds to %s\n", seeds.size(), dir.string().c_str());
  return 0;
}

}  // namespace pagedkv_fuzz
