// tests/fuzz/fuzz_manager_xxh3.cpp: the manager fuzzer's driver for KVCacheManager<Xxh3Hasher, uint32 block ids>.
#include "manager_driver.hpp"

namespace pagedkv_fuzz {
template void run_manager_ops<XxhManager>(const pagedkv::CacheConfig&, bool, ByteReader&, CallLog&);
}  // namespace pagedkv_fuzz
