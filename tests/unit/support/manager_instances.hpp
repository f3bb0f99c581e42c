// Explicit instantiation declarations ([temp.explicit]) of the two KVCacheManager configurations most unit tests
// use: KVCacheManager<> (Sha256Hasher, uint32 ids, LRU) and KVCacheManager<Xxh3Hasher> (also
// HybridKVCacheManager<Xxh3Hasher>). A test TU (tests/unit, tests/events_zmq) that includes this header stops
// emitting those managers' member functions; they are compiled once, in manager_instances_sha256.cpp and
// manager_instances_xxh3.cpp (one per configuration, so the two build side by side). Test-only and for build time
// alone (issue: the CI command under 40 minutes): same header, same flags, same behaviour; inline members may still
// be inlined where they are called. Measured on the ASan + UBSan unit-test flags (g++ 12, -O1 -g1), CPU seconds:
// test_errors.cpp 87.7 -> 52.9, test_scheduler.cpp 110.7 -> 78.6, test_kv_cache_manager.cpp 178.1 -> 130.1;
// manager_instances_sha256.cpp 71.3. Other configurations (other eviction policies, 16-bit ids) are still
// instantiated in the TU that uses them.
#pragma once

#include <pagedkv/hash.hpp>
#include <pagedkv/kv_cache_manager.hpp>

namespace pagedkv {
extern template class KVCacheManager<Sha256Hasher>;
extern template class KVCacheManager<Xxh3Hasher>;
// The external-KV calls live in the manager's base (external_kv_calls.hpp): instantiated apart.
extern template class ExternalKvCalls<KVCacheManager<Sha256Hasher>, std::uint32_t>;
extern template class ExternalKvCalls<KVCacheManager<Xxh3Hasher>, std::uint32_t>;
}  // namespace pagedkv
