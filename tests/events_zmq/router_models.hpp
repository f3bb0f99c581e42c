// tests/events_zmq/router_models.hpp: this project's models of two KV-aware routers' published indexing rules (not
// their code), shared by the fleet test (test_fleet.cpp) and the replay check (replay_events_check.cpp):
//  - llm-d (llm-d-kv-cache pkg/kvevents/pool.go, kvblock/token_processor.go, extra_keys.go): pod and model from the
//    topic kv@<pod>@<model>; an event's keys recomputed with FNV-64a over canonical CBOR from its token_ids and
//    its [identifier, offset] extra keys (bare strings skipped), rooted at the model, or at lora_name when set;
//    the parent's key found through the engine-key -> request-key map (an unknown parent drops the event);
//    removals by engine key.
//  - Dynamo (lib/kv-router zmq_wire/{deserialize,extra_keys,convert}.rs): per worker, tokens hash XXH3 seeded with
//    lora_name and the "dynamo-cache-salt:" namespace of the event's first block, 64-hex multimodal ids as the
//    u64 of their first 16 digits, sequence hashes chained from the parent's (an unknown parent drops the
//    event); removals by the event's block hash.
// docs/events-wire.md (section "Routers") cites the sources.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include <pagedkv/block_identity.hpp>
#include <pagedkv/events_zmq/wire.hpp>
#include <pagedkv/prefix_hash_index.hpp>
#include <pagedkv/request_keys.hpp>

namespace router_models {

namespace ev = pagedkv::events;
namespace id = pagedkv::identity;
using pagedkv::MultimodalItem;
using pagedkv::RequestKeys;
using pagedkv::TokenId;

/// The LoRA name of an adapter id, as the engine's EncodeOptions::lora_name writes it.
using LoraNames = std::function<std::string(std::uint64_t adapter_id)>;

/// Token ids as the routers hash them (u32).
inline std::vector<std::uint32_t> u32(std::span<const TokenId> t) { return {t.begin(), t.end()}; }

/// The tier bit of a wire medium: 2 for "CPU", 1 for "GPU" or none (vLLM's convention).
inline std::uint64_t medium_bit(const std::optional<std::string>& m) { return m && *m == "CPU" ? 2 : 1; }

/// Dynamo's u64 of a multimodal identifier as its extra_keys.rs maps it: 64 hex digits -> the first 16 as a u64
/// (the only form this fleet sends; anything else counts as unsupported).
inline std::optional<std::uint64_t> dynamo_mm(const std::string& s) {
  if (s.size() != 64 || s.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) return std::nullopt;
  return std::stoull(s.substr(0, 16), nullptr, 16);
}

/// The Dynamo namespace of an event: the first "dynamo-cache-salt:" string of its first block, after skipping the
/// first string equal to lora_name.
inline std::string dynamo_namespace(const ev::WireBlockStored& s) {
  if (s.extra_keys.empty() || !s.extra_keys[0]) return {};
  bool lora_pending = s.lora_name.has_value() && !s.lora_name->empty();
  for (const ev::WireExtraKey& k : *s.extra_keys[0]) {
    if (k.kind != ev::WireExtraKey::Kind::kString) continue;
    if (lora_pending && k.text == *s.lora_name) {
      lora_pending = false;
      continue;
    }
    if (k.text.starts_with(ev::kDynamoCacheSaltPrefix) && k.text.size() > ev::kDynamoCacheSaltPrefix.size()) {
      return k.text.substr(ev::kDynamoCacheSaltPrefix.size());
    }
  }
  return {};
}

/// One router model: per engine, engine key -> (router key, tiers holding it) and router key -> tiers.
struct RouterModel {
  struct Block {
    std::uint64_t key = 0;
    std::uint64_t tiers = 0;  // bit 1 GPU, bit 2 CPU
  };
  std::map<std::uint64_t, Block> by_engine_key;      // what the engine named, currently held
  std::map<std::uint64_t, std::uint64_t> key_tiers;  // router key -> tiers (union over engine keys)
  std::uint64_t stored_events = 0, stored_blocks = 0, removed_blocks = 0, dropped_events = 0, unsupported = 0;
  std::uint64_t bad_removals = 0, orphan_cpu = 0;

  void hold(std::uint64_t engine_key, std::uint64_t key, std::uint64_t tier) {
    Block& b = by_engine_key[engine_key];
    if (b.tiers != 0 && b.key != key) {  // the engine renamed a held block's content: move its holds
      for (const std::uint64_t t : {std::uint64_t{1}, std::uint64_t{2}}) {
        if ((b.tiers & t) != 0) drop_hold(b.key, t);
      }
      for (const std::uint64_t t : {std::uint64_t{1}, std::uint64_t{2}}) {
        if ((b.tiers & t) != 0) add_hold(key, t);
      }
    }
    b.key = key;
    if ((b.tiers & tier) == 0) add_hold(key, tier);
    b.tiers |= tier;
    ++stored_blocks;
  }
  void release(std::uint64_t engine_key, std::uint64_t tier) {
    const auto it = by_engine_key.find(engine_key);
    if (it == by_engine_key.end() || (it->second.tiers & tier) == 0) {
      ++bad_removals;  // a removal of a block never indexed (its store was dropped): a no-op in both routers
      return;
    }
    ++removed_blocks;
    it->second.tiers &= ~tier;
    drop_hold(it->second.key, tier);  // another engine block may share the router key: it keeps its tiers
    if (it->second.tiers == 0) by_engine_key.erase(it);
  }
  void clear() {
    by_engine_key.clear();
    key_tiers.clear();
    holders_.clear();
  }
  /// The parent's router key, if the parent is indexed.
  [[nodiscard]] std::optional<std::uint64_t> key_of(std::uint64_t engine_key) const {
    const auto it = by_engine_key.find(engine_key);
    if (it == by_engine_key.end()) return std::nullopt;
    return it->second.key;
  }
  [[nodiscard]] std::size_t count_prefix(const std::vector<std::uint64_t>& keys) const {
    std::size_t n = 0;
    while (n < keys.size() && key_tiers.count(keys[n]) != 0) ++n;
    return n;
  }

 private:
  /// Router key -> engine blocks holding it, per tier (index 0 GPU, 1 CPU).
  std::map<std::uint64_t, std::array<std::uint64_t, 2>> holders_;
  void add_hold(std::uint64_t key, std::uint64_t tier) {
    ++holders_[key][tier == 2 ? 1 : 0];
    key_tiers[key] |= tier;
  }
  void drop_hold(std::uint64_t key, std::uint64_t tier) {
    auto& h = holders_[key];
    if (--h[tier == 2 ? 1 : 0] == 0) {
      const std::uint64_t t = (h[0] != 0 ? 1 : 0) | (h[1] != 0 ? 2 : 0);
      if (t == 0) {
        key_tiers.erase(key);
        holders_.erase(key);
      } else {
        key_tiers[key] = t;
      }
    }
  }
};

/// llm-d's rules for one pod.
struct Llmd : RouterModel {
  std::string model;  // from the topic
  void apply(const ev::WireBatch& b) {
    for (const ev::WireEvent& w : b.events) {
      if (std::holds_alternative<ev::WireAllBlocksCleared>(w)) {
        clear();
      } else if (const auto* r = std::get_if<ev::WireBlockRemoved>(&w)) {
        for (const ev::WireHash& h : r->block_hashes) release(h.key, medium_bit(r->medium));
      } else {
        const auto& s = std::get<ev::WireBlockStored>(w);
        ++stored_events;
        std::uint64_t parent = id::llmd_root_hash("", s.lora_name && !s.lora_name->empty() ? *s.lora_name : model);
        if (s.parent_block_hash) {
          const auto p = key_of(s.parent_block_hash->key);
          if (!p) {
            ++dropped_events;  // GetRequestKey fails: llm-d skips the event
            orphan_cpu += medium_bit(s.medium) == 2 ? 1 : 0;
            continue;
          }
          parent = *p;
        }
        for (std::size_t i = 0; i < s.block_hashes.size(); ++i) {
          std::vector<id::LlmdMmHash> mm;
          if (!s.extra_keys.empty() && s.extra_keys[i]) {
            for (const ev::WireExtraKey& k : *s.extra_keys[i]) {
              if (k.kind == ev::WireExtraKey::Kind::kIdentifierWithOffset) mm.push_back({k.text, k.signed_value});
            }
          }
          parent = id::llmd_block_key_mm(parent, u32(s.block_tokens(i)), mm);
          hold(s.block_hashes[i].key, parent, medium_bit(s.medium));
        }
      }
    }
  }
  /// The keys the router computes for a request: model (or LoRA) root, per block the overlapping items as
  /// (64-hex identifier, offset - block start). Salts are not part of llm-d's keys.
  /// `block_size` in tokens; `lora_name` names an adapter id (the engine's EncodeOptions::lora_name).
  [[nodiscard]] std::vector<std::uint64_t> request_keys(const std::vector<TokenId>& p, const RequestKeys& k,
                                                        std::uint32_t block_size, const LoraNames& lora_name) const {
    std::vector<std::uint64_t> out;
    std::uint64_t parent = id::llmd_root_hash("", k.adapter_id != 0 ? lora_name(k.adapter_id) : model);
    for (std::size_t b = 0; b + block_size <= p.size(); b += block_size) {
      std::vector<id::LlmdMmHash> mm;
      for (const MultimodalItem& m : k.multimodal) {
        if (pagedkv::detail::item_overlaps(m, b, b + block_size)) {
          mm.push_back({m.item_hash.hex() + std::string(32, '0'),
                        static_cast<std::int64_t>(m.offset_tokens) - static_cast<std::int64_t>(b)});
        }
      }
      parent = id::llmd_block_key_mm(parent, u32(std::span<const TokenId>(p).subspan(b, block_size)), mm);
      out.push_back(parent);
    }
    return out;
  }
};

/// Dynamo's rules for one worker.
struct Dynamo : RouterModel {
  void apply(const ev::WireBatch& b) {
    for (const ev::WireEvent& w : b.events) {
      if (std::holds_alternative<ev::WireAllBlocksCleared>(w)) {
        clear();
      } else if (const auto* r = std::get_if<ev::WireBlockRemoved>(&w)) {
        for (const ev::WireHash& h : r->block_hashes) release(h.key, medium_bit(r->medium));
      } else {
        const auto& s = std::get<ev::WireBlockStored>(w);
        ++stored_events;
        const std::uint64_t seed = id::dynamo_salt_hash(s.lora_name.value_or(""), dynamo_namespace(s));
        std::optional<std::uint64_t> parent;
        if (s.parent_block_hash) {
          parent = key_of(s.parent_block_hash->key);
          if (!parent) {
            ++dropped_events;  // the radix tree has no parent node: Dynamo drops the event
            continue;
          }
        }
        for (std::size_t i = 0; i < s.block_hashes.size(); ++i) {
          std::vector<std::uint64_t> mm;
          if (!s.extra_keys.empty() && s.extra_keys[i]) {
            for (const ev::WireExtraKey& k : *s.extra_keys[i]) {
              if (k.kind != ev::WireExtraKey::Kind::kIdentifierWithOffset) continue;
              if (const auto v = dynamo_mm(k.text)) {
                mm.push_back(*v);
              } else {
                ++unsupported;
              }
            }
          }
          std::sort(mm.begin(), mm.end());
          const std::uint64_t th = id::dynamo_tokens_hash(u32(s.block_tokens(i)), seed, mm);
          const std::uint64_t sh = parent ? id::dynamo_sequence_hash(*parent, th) : th;
          hold(s.block_hashes[i].key, sh, medium_bit(s.medium));
          parent = sh;
        }
      }
    }
  }
  /// The sequence hashes the router computes for a request (seeded with its LoRA name and salt).
  /// `block_size` in tokens; `lora_name` names an adapter id (the engine's EncodeOptions::lora_name).
  [[nodiscard]] static std::vector<std::uint64_t> request_keys(const std::vector<TokenId>& p, const RequestKeys& k,
                                                               std::uint32_t block_size, const LoraNames& lora_name) {
    const std::uint64_t seed = id::dynamo_salt_hash(k.adapter_id != 0 ? lora_name(k.adapter_id) : "", k.salt);
    std::vector<std::uint64_t> out;
    std::optional<std::uint64_t> parent;
    for (std::size_t b = 0; b + block_size <= p.size(); b += block_size) {
      std::vector<std::uint64_t> mm;
      for (const MultimodalItem& m : k.multimodal) {
        if (pagedkv::detail::item_overlaps(m, b, b + block_size)) mm.push_back(*dynamo_mm(m.item_hash.hex() + std::string(32, '0')));
      }
      std::sort(mm.begin(), mm.end());
      const std::uint64_t th = id::dynamo_tokens_hash(u32(std::span<const TokenId>(p).subspan(b, block_size)), seed, mm);
      parent = parent ? id::dynamo_sequence_hash(*parent, th) : th;
      out.push_back(*parent);
    }
    return out;
  }
};

/// A model's indexed blocks: engine key -> tiers.
inline std::map<std::uint64_t, std::uint64_t> model_blocks(const RouterModel& r) {
  std::map<std::uint64_t, std::uint64_t> out;
  for (const auto& [k, b] : r.by_engine_key) out[k] = b.tiers;
  return out;
}

}  // namespace router_models
