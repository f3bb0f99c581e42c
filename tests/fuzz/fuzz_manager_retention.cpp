// tests/fuzz/fuzz_manager_retention.cpp: the manager fuzzer's driver for KVCacheManager<Xxh3Hasher, uint32 block ids,
// PriorityLruEviction, SlruEviction> (retention priorities; config bit 6).
#include "manager_driver.hpp"

namespace pagedkv_fuzz {
template void run_manager_ops<RetentionManager>(const pagedkv::CacheConfig&, bool, ByteReader&, CallLog&);
}  // namespace pagedkv_fuzz
