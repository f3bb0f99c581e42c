// hash_print: prints block hashes of fixed inputs, one line per seed (SHA-256 and XXH3-128, without and with extra
// keys). test_events.cpp runs it as a second process and compares with the hashes it computes itself.
#include <cstdint>
#include <cstdio>
#include <vector>

#include <pagedkv/prefix_hash_index.hpp>

int main() {
  std::vector<pagedkv::TokenId> block(16);
  for (int i = 0; i < 16; ++i) block[static_cast<std::size_t>(i)] = 100 + i;
  pagedkv::BlockHash image;
  for (std::size_t i = 0; i < image.bytes.size(); ++i) image.bytes[i] = static_cast<std::uint8_t>(9 + 13 * i);
  pagedkv::RequestKeys k;
  k.salt = "tenant";
  k.adapter_id = 3;
  k.multimodal = {pagedkv::MultimodalItem{image, 4, 8}};
  using S = pagedkv::PrefixHashIndex<pagedkv::Sha256Hasher>;
  using X = pagedkv::PrefixHashIndex<pagedkv::Xxh3Hasher>;
  for (std::uint64_t seed : {0ULL, 1ULL, 0x5eedULL}) {
    std::printf("%s %s %s %s\n", S::hash_block(S::root_for_seed(seed), block, 0, nullptr).hex().c_str(),
                S::hash_block(S::root_for_seed(seed), block, 0, &k).hex().c_str(),
                X::hash_block(X::root_for_seed(seed), block, 0, nullptr).hex().c_str(),
                X::hash_block(X::root_for_seed(seed), block, 0, &k).hex().c_str());
  }
  return 0;
}
