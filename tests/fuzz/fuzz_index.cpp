// tests/fuzz/fuzz_index.cpp: libFuzzer target for PrefixHashIndex (and the open-addressing table behind it,
// detail/block_hash_table.hpp) with adversarial block hashes: the input picks each hash's home group, its 7-bit
// tag and the rest, so probes collide, groups overflow, deletions leave tombstones and in-place rehashes run, far
// more often than real SHA-256 / XXH3 hashes of a small pool would make them.
//
// Input: u8 pool size (num_blocks = 2 + b % 300), then operations (u8 op, arguments) until the input runs out:
//   insert  u8 block (b % (num_blocks + 1): 0 and num_blocks are out of range), hash (3 bytes, below)
//   erase   u8 block          find  hash          hash_of  u8 block          clear  (only when the op byte is 4)
//   hash: u8 placement (bits 0-2: one of 8 home positions; bits 3-4: one of 4 tags), u16 rest (the other bytes)
// Checked against a plain model (hash -> block, block -> hash) after every operation: find, hash_of, size, the
// result of insert (the block inserted, or the block already registered under that hash), misuse errors
// (kBlockOutOfRange, kInvalidArgument for a block registered twice) that change nothing; every 32 operations
// and at the end, every hash and every block. Any mismatch or sanitizer report is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>

#include <pagedkv/error.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/prefix_hash_index.hpp>

#include "byte_reader.hpp"

namespace {

using pagedkv::BlockHash;
using Index = pagedkv::PrefixHashIndex<pagedkv::Xxh3Hasher, std::uint32_t>;

[[noreturn]] void finding(const std::string& what, std::size_t op) {
  std::fprintf(stderr, "\n==== pagedkv index fuzz: %s (operation %zu)\n", what.c_str(), op);
  std::fflush(stderr);
  std::abort();
}

BlockHash adversarial_hash(std::uint8_t placement, std::uint16_t rest) {
  // Home group: fastrange of the low 64 bits, so spread values over [0, 2^64) land in distinct groups of any table.
  static constexpr std::uint64_t kHomes[8] = {0,
                                              0x0800000000000000ULL,
                                              0x2000000000000000ULL,
                                              0x5555555555555555ULL,
                                              0x8000000000000000ULL,
                                              0xA000000000000001ULL,
                                              0xE000000000000000ULL,
                                              0xFFFFFFFFFFFFFFFFULL};
  BlockHash h;
  const std::uint64_t low = kHomes[placement & 7];
  for (int i = 0; i < 8; ++i) h.bytes[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(low >> (8 * i));
  h.bytes[8] = static_cast<std::uint8_t>(((placement >> 3) & 3) * 37 + (rest & 0x80));  // tag: bits 0-6
  h.bytes[9] = static_cast<std::uint8_t>(rest);
  h.bytes[10] = static_cast<std::uint8_t>(rest >> 8);
  h.bytes[11] = placement;  // distinct placements never share a hash
  return h;
}

BlockHash read_hash(pagedkv_fuzz::ByteReader& r) {
  const std::uint8_t placement = r.u8();
  return adversarial_hash(placement, r.u16());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  pagedkv_fuzz::ByteReader r({data, size});
  const std::size_t num_blocks = 2 + r.u8() % 300;
  Index index(num_blocks, 7);
  const std::size_t memory = index.memory_bytes();
  std::map<BlockHash, std::uint32_t> by_hash;
  std::map<std::uint32_t, BlockHash> by_block;
  std::uint64_t rehashes = 0;

  const auto check_everything = [&](std::size_t op) {
    if (index.size() != by_hash.size()) finding("size " + std::to_string(index.size()) + " != " + std::to_string(by_hash.size()), op);
    for (const auto& [h, b] : by_hash) {
      if (index.find(h) != std::optional<std::uint32_t>(b)) finding("find of a registered hash", op);
    }
    for (std::uint32_t b = 0; b < num_blocks + 2; ++b) {
      const auto it = by_block.find(b);
      const auto want = it == by_block.end() ? std::nullopt : std::optional<BlockHash>(it->second);
      if (index.hash_of(b) != want) finding("hash_of(" + std::to_string(b) + ")", op);
    }
    if (index.memory_bytes() != memory) finding("the index allocated after construction", op);
    if (index.num_rehashes() < rehashes) finding("num_rehashes decreased", op);
    rehashes = index.num_rehashes();
  };

  for (std::size_t op = 0; !r.empty(); ++op) {
    const std::uint8_t code = r.u8();
    switch (code % 5) {
      case 0: {  // insert
        const auto b = static_cast<std::uint32_t>(r.u8() % (num_blocks + 1));
        const BlockHash h = read_hash(r);
        const bool out_of_range = b == 0 || b >= num_blocks;
        const bool registered = by_block.contains(b);
        try {
          const std::uint32_t got = index.insert(h, b);
          if (out_of_range || registered) finding("insert of block " + std::to_string(b) + " did not throw", op);
          const auto it = by_hash.find(h);
          if (it != by_hash.end()) {
            if (got != it->second) finding("insert of a present hash returned another block", op);
          } else {
            if (got != b) finding("insert of a new hash returned another block", op);
            by_hash[h] = b;
            by_block[b] = h;
          }
        } catch (const pagedkv::Error& e) {
          const auto want = out_of_range ? pagedkv::Errc::kBlockOutOfRange : pagedkv::Errc::kInvalidArgument;
          if (!(out_of_range || registered) || e.code() != want) finding(std::string("insert threw ") + e.what(), op);
          if (index.find(h) != (by_hash.contains(h) ? std::optional<std::uint32_t>(by_hash[h]) : std::nullopt)) {
            finding("a refused insert changed the index", op);
          }
        }
        break;
      }
      case 1: {  // erase
        const auto b = static_cast<std::uint32_t>(r.u8() % (num_blocks + 1));
        const auto got = index.erase_block(b);
        const auto it = by_block.find(b);
        if (it == by_block.end()) {
          if (got) finding("erase_block of an unregistered block returned a hash", op);
        } else {
          if (got != std::optional<BlockHash>(it->second)) finding("erase_block returned another hash", op);
          by_hash.erase(it->second);
          by_block.erase(it);
          if (index.find(*got)) finding("an erased hash is still found", op);
        }
        break;
      }
      case 2: {  // find
        const BlockHash h = read_hash(r);
        const auto it = by_hash.find(h);
        if (index.find(h) != (it == by_hash.end() ? std::nullopt : std::optional<std::uint32_t>(it->second))) {
          finding("find", op);
        }
        break;
      }
      case 3: {  // hash_of
        const auto b = static_cast<std::uint32_t>(r.u8() % (num_blocks + 2));
        const auto it = by_block.find(b);
        if (index.hash_of(b) != (it == by_block.end() ? std::nullopt : std::optional<BlockHash>(it->second))) {
          finding("hash_of", op);
        }
        break;
      }
      default:  // clear, rarely
        if (code != 4) break;
        index.clear();
        by_hash.clear();
        by_block.clear();
        break;
    }
    if (index.size() != by_hash.size()) finding("size", op);
    if (op % 32 == 31) check_everything(op);
  }
  check_everything(~std::size_t{0});
  return 0;
}
