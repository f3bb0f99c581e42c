// tests/fuzz/fuzz_manager.cpp: libFuzzer target driving KVCacheManager with every call an engine makes (and the
// misuse a careless one makes), checked against the shadow model of manager_model.hpp after every call.
//
// Input layout: manager_ops.hpp (one byte per decision, see byte_reader.hpp; make_seeds.cpp writes seeds in it):
// the configuration, decoded here, then operations, decoded by the driver (manager_driver.hpp). At the end of the
// input every sequence is freed and the pool must hold no referenced block.
#include <cstddef>
#include <cstdint>
#include <span>

#include "manager_driver.hpp"

namespace pagedkv_fuzz {

/// One fuzz input: decode the configuration, then the operations.
void run_manager_input(std::span<const std::uint8_t> data) {
  static CallLog log;
  log.clear();
  ByteReader r(data);
  const std::uint8_t flags = r.u8();
  const std::uint8_t bsel = r.u8();
  const std::uint8_t nsel = r.u8();
  pagedkv::CacheConfig c;
  c.enable_prefix_caching = (flags & 3) != 3;
  c.enable_events = (flags & 4) == 0;
  const bool small_ids = ((flags >> 3) & 3) == 3;
  c.block_size = bsel == 0xFF ? 0 : kBlockSizes[bsel % 8];
  c.num_blocks = nsel % 66;
  if (flags & 0x20) c.max_tokens_per_seq = r.u16() % 2048;
  c.hash_seed = r.u8();
  bool invalid = c.num_blocks < 2 || c.block_size == 0;
  // Limits of the int32 metadata, checked before anything is allocated.
  if (nsel == 0xFE) c.num_blocks = pagedkv::kMaxMetadataValue + 2, invalid = true;
  if ((flags & 0x20) && nsel == 0xFD) c.max_tokens_per_seq = pagedkv::kMaxMetadataValue + 1, invalid = true;
  if (small_ids && !(flags & 0x40) && c.num_blocks > 0xFFFF) invalid = true;
  if (flags & 0x40) {  // retention priorities (the small-id bits are ignored)
    run_manager_ops<RetentionManager>(c, invalid, r, log);
  } else if (small_ids) {
    run_manager_ops<ShaSmallIdManager>(c, invalid, r, log);
  } else {
    run_manager_ops<XxhManager>(c, invalid, r, log);
  }
}

}  // namespace pagedkv_fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  pagedkv_fuzz::run_manager_input({data, size});
  return 0;
}
