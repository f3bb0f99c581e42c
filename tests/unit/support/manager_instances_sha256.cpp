// The one definition of KVCacheManager<> (Sha256Hasher, uint32 ids, LRU) for the unit-test binary: see
// manager_instances.hpp.
#include "manager_instances.hpp"

template class pagedkv::KVCacheManager<pagedkv::Sha256Hasher>;
template class pagedkv::ExternalKvCalls<pagedkv::KVCacheManager<pagedkv::Sha256Hasher>, std::uint32_t>;
