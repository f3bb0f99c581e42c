// The one definition of KVCacheManager<Xxh3Hasher> (uint32 ids, LRU) for the unit-test binary: see
// manager_instances.hpp.
#include "manager_instances.hpp"

template class pagedkv::KVCacheManager<pagedkv::Xxh3Hasher>;
template class pagedkv::ExternalKvCalls<pagedkv::KVCacheManager<pagedkv::Xxh3Hasher>, std::uint32_t>;
