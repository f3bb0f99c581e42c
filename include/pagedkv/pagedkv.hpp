// pagedkv/pagedkv.hpp: the whole host API in one include.
#pragma once

#include <pagedkv/batch_metadata.hpp>
#include <pagedkv/block_allocator.hpp>
#include <pagedkv/block_table.hpp>
#include <pagedkv/config.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/events.hpp>
#include <pagedkv/eviction.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/kernel_params.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include <pagedkv/prefix_hash_index.hpp>
