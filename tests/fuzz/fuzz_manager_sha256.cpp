// tests/fuzz/fuzz_manager_sha256.cpp: the manager fuzzer's driver for KVCacheManager<Sha256Hasher, uint16 block ids>.
#include "manager_driver.hpp"

namespace pagedkv_fuzz {
template void run_manager_ops<ShaSmallIdManager>(const pagedkv::CacheConfig&, bool, ByteReader&, CallLog&);
}  // namespace pagedkv_fuzz
