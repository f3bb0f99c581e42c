// pagedkv/pagedkv.hpp: the whole host API in one include.
#pragma once

#include <pagedkv/batch_metadata.hpp>
#include <pagedkv/block_allocator.hpp>
#include <pagedkv/block_table.hpp>
#include <pagedkv/config.hpp>
#include <pagedkv/decode_plan.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/event_log.hpp>
#include <pagedkv/events.hpp>
#include <pagedkv/eviction.hpp>
#include <pagedkv/eviction_priority.hpp>
#include <pagedkv/eviction_slru.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/host_tier.hpp>
#include <pagedkv/kernel_params.hpp>
#include <pagedkv/kv_cache_groups.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include <pagedkv/kv_pool_view.hpp>
#include <pagedkv/prefix_hash_index.hpp>
#include <pagedkv/request_keys.hpp>
#include <pagedkv/retention.hpp>
#include <pagedkv/sequence_state.hpp>
#include <pagedkv/stats.hpp>
#include <pagedkv/transfer_queue.hpp>
