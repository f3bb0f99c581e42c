// pagedkv/detail/device_pool.hpp: the device block pool under a KVCacheManager (docs/design.md "The manager in
// parts"): the allocator and the prefix index every group shares, the reference rules (table holders, pending
// copy-on-write pins, host -> device fill marks), per-group accounting and peaks, the device-side evictor, the
// device KV events and the eviction history, and retention priorities. vLLM V1 calls the same part its BlockPool
// (vllm/v1/core/block_pool.py: free queue, cached-block map, events); TensorRT-LLM's V1 manager its BlockManager.
// It knows no sequence map, no host tier and no group kind: the facade composes those (the evictor takes a hook).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <pagedkv/block_allocator.hpp>
#include <pagedkv/block_table.hpp>
#include <pagedkv/cache_config.hpp>
#include <pagedkv/detail/copy_list.hpp>
#include <pagedkv/detail/stored_event.hpp>
#include <pagedkv/event_log.hpp>
#include <pagedkv/events.hpp>
#include <pagedkv/eviction.hpp>
#include <pagedkv/eviction_history.hpp>
#include <pagedkv/group_policy.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/prefix_hash_index.hpp>
#include <pagedkv/retention.hpp>
#include <pagedkv/sequence_state.hpp>

namespace pagedkv::detail {

/// The device pool of a manager configured by `config` with groups `layout` (both checked by the caller):
/// `config.num_blocks` blocks (block 0 the null block), one PrefixHashIndex shared by the groups (group g's blocks
/// keyed by group_block_key(hash, g)), pending copy-on-writes (CopyList), fill marks, events and eviction history.
/// Movable, not copyable; no allocation after construction except the event log's and copy list's reserve calls.
/// Every function is O(1) unless it says otherwise. `Hasher`, `Id`, `Evict`: the manager's.
template <class Hasher, class Id, class Evict>
class DevicePool {
 public:
  using allocator_type = BlockAllocator<Id, Evict>;
  using index_type = PrefixHashIndex<Hasher, Id>;
  using index_view = GroupPrefixIndexView<index_type>;
  using const_index_view = GroupPrefixIndexView<const index_type>;
  using copy_type = BlockCopy<Id>;
  using sequence_type = SequenceState<Id>;
  using copy_list_type = CopyList<copy_type, sequence_type>;

  DevicePool(const CacheConfig& config, const GroupLayout& layout)
      : block_size_(config.block_size),
        prefix_caching_(config.enable_prefix_caching),
        deduplicate_(config.deduplicate_blocks),
        simple_(layout.simple),
        num_groups_(layout.num_groups),
        alloc_(config.num_blocks),
        index_(config.num_blocks, config.hash_seed),
        filling_((config.num_blocks + 63) / 64, 0),
        unkeyed_fill_((config.num_blocks + 63) / 64, 0),
        events_(config.enable_events),
        history_(config.eviction_history) {
    if (num_groups_ > 1) {
      group_cached_.assign(num_groups_, 0);
      group_of_.assign(config.num_blocks, 0);
    }
    held_.assign(num_groups_, 0);
    peak_held_.assign(num_groups_, 0);
  }

  // --- The leaves ---
  [[nodiscard]] allocator_type& alloc() noexcept { return alloc_; }
  [[nodiscard]] const allocator_type& alloc() const noexcept { return alloc_; }
  /// The shared prefix index (keys group-mixed with several groups).
  [[nodiscard]] index_type& index() noexcept { return index_; }
  [[nodiscard]] const index_type& index() const noexcept { return index_; }
  /// Pending copy-on-writes, their owners, a build's selection.
  [[nodiscard]] copy_list_type& copies() noexcept { return copies_; }
  [[nodiscard]] const copy_list_type& copies() const noexcept { return copies_; }
  [[nodiscard]] EventLog& events() noexcept { return events_; }
  [[nodiscard]] const EventLog& events() const noexcept { return events_; }
  [[nodiscard]] EvictionHistory& history() noexcept { return history_; }
  [[nodiscard]] const EvictionHistory& history() const noexcept { return history_; }
  /// The logical blocks the last registrations switched to a registered duplicate (cleared by the caller per
  /// group and row; a build reads them to write -1 slots).
  [[nodiscard]] std::vector<std::size_t>& switched() noexcept { return switched_; }
  [[nodiscard]] const std::vector<std::size_t>& switched() const noexcept { return switched_; }
  /// CacheConfig::deduplicate_blocks for the registrations that follow.
  void set_deduplicate(bool on) noexcept { deduplicate_ = on; }
  /// Blocks switched to a registered duplicate since construction.
  [[nodiscard]] std::uint64_t dedup_blocks() const noexcept { return dedup_blocks_; }

  // --- Groups ---
  /// Group g's part of the shared index (keys mixed with g, registrations counted per group).
  [[nodiscard]] index_view ix(std::size_t g) noexcept {
    if (num_groups_ == 1) return index_view(index_, 0, nullptr, nullptr);
    return index_view(index_, g, group_of_.data(), &group_cached_[g]);
  }
  [[nodiscard]] const_index_view ix(std::size_t g) const noexcept {
    if (num_groups_ == 1) return const_index_view(index_, 0, nullptr, nullptr);
    return const_index_view(index_, g, group_of_.data(), &group_cached_[g]);
  }
  /// The group whose table holds (or last held) block b (0 with one group).
  [[nodiscard]] std::uint32_t group_of_block(Id b) const noexcept { return num_groups_ > 1 ? group_of_[b] : 0U; }
  /// Blocks group g holds (counted unless the layout is simple: then the allocator's used count is the answer).
  [[nodiscard]] std::size_t held(std::size_t g) const noexcept { return held_[g]; }
  [[nodiscard]] std::size_t peak_held(std::size_t g) const noexcept { return peak_held_[g]; }
  [[nodiscard]] std::size_t peak_used() const noexcept { return peak_used_; }
  /// Restart the peaks at the current values.
  void reset_peaks() noexcept {
    peak_held_ = held_;
    peak_used_ = alloc_.num_used_blocks();
  }
  /// The shared index was cleared: no group has a registered block.
  void clear_group_counts() noexcept { std::fill(group_cached_.begin(), group_cached_.end(), std::size_t{0}); }

  // --- Held-block accounting (several groups or a windowed one; with one full group held = used) ---
  void on_allocated(Id b, std::size_t g) noexcept {
    if (num_groups_ > 1) group_of_[b] = static_cast<std::uint8_t>(g);
    bump_held(g);
  }
  void bump_held(std::size_t g) noexcept {
    peak_held_[g] = std::max(peak_held_[g], ++held_[g]);
    peak_used_ = std::max(peak_used_, alloc_.num_used_blocks());
  }
  void note_peak() noexcept {
    if (simple_) peak_used_ = std::max(peak_used_, alloc_.num_used_blocks());
  }

  // --- Reference rules ---
  /// One block of group g (capacity checked by the caller; `evict`: the evictor, see evictor()).
  template <class F>
  Id allocate_one(std::size_t g, F&& evict) {
    const Id b = *alloc_.try_allocate_one(evict);
    if (!simple_) on_allocated(b, g);
    return b;
  }
  /// One more reference on b (a cached block becomes held again).
  void acquire_block(Id b) {
    if (!simple_ && alloc_.refcount(b) == 0) {
      alloc_.acquire(b);
      bump_held(group_of_block(b));
      return;
    }
    alloc_.acquire(b);
  }
  /// Release one reference. A block that becomes unreferenced is no longer the destination of a pending copy
  /// (nobody needs its contents), so that copy is dropped and its source reference released.
  /// (Always inlined, its recursive tail out of line: measured, docs/benchmarks.md "Manager split gate": out of line,
  /// the replay's prefix loop lost 3% to the call.)
  [[gnu::always_inline]] void release_block(Id b) {
    alloc_.release(b);
    if (!simple_ && alloc_.refcount(b) == 0) --held_[group_of_block(b)];
    if (copies_.empty() || alloc_.refcount(b) != 0) return;
    drop_copy_into(b);
  }
  /// The pending copy into unreferenced block b (if any) is dropped and its source reference released.
  [[gnu::noinline]] void drop_copy_into(Id b) {
    if (const auto src = copies_.drop_into(b)) release_block(*src);
  }
  /// Number of pending copies reading block b (each holds a reference on it).
  [[nodiscard]] std::uint32_t pins(Id b) const noexcept { return copies_.pins(b); }
  /// Block tables holding b, as copy-on-write sees them: a pending copy's reference on its source, or the reference
  /// of a host -> device fill that registers nothing on its destination, does not make the block shared (the step
  /// runs swap_in and the copies before its writes), so the one table still holding it may write in place (a
  /// resumed sequence appending to its swapped-in partial last block). A fill that registers its block under a hash
  /// when it completes keeps counting: writing into that block (after a rewind) would make the registered hash lie.
  /// (Always inlined: GCC kept it out of line in the decode step once it left the manager, +2.3% instructions.)
  [[nodiscard, gnu::always_inline]] std::uint32_t table_refcount(Id b) const {
    return alloc_.refcount(b) - pins(b) - (is_unkeyed_fill(b) ? 1U : 0U);
  }

  // --- The table adaptor (the pool as a BlockTable's allocator) ---
  /// The pool as group g's BlockTable sees it (block_table.hpp's Alloc: refcount, is_hashed, try_allocate_one,
  /// try_allocate, acquire, release): allocations are tagged with the group unless `simple` (one full group); the null
  /// block 0 (a windowed group's released entries) carries no reference; releases go through release_block so pending
  /// copies and held counts stay consistent. `coarse`: g's pages are coarser than the match unit
  /// (GroupLayout::is_coarse). kOne: compiled for one full-attention group (never coarse, no group tags: both
  /// fields ignored). A small value made per call and group by table_allocator; points at the pool only.
  template <bool kOne>
  struct GroupTableAllocator {
    DevicePool* pool;
    std::uint32_t g = 0;
    bool coarse = false;
    bool simple = true;
    [[nodiscard]] std::uint32_t refcount(Id b) const { return pool->table_refcount(b); }
    // A coarse group's partial page is keyed by the match block where its registered content ends, never beyond the
    // tokens of a table holding it: a hit takes a page only at its key, register_coarse moves the key only while one
    // table holds the page, a rewind below the key drops it. So appending after that content keeps the key true:
    // only sharing forces its copy-on-write.
    [[nodiscard]] bool is_hashed(Id b) const { return (kOne || !coarse) && pool->alloc_.is_hashed(b); }
    [[nodiscard]] std::size_t num_available_blocks() const noexcept { return pool->alloc_.num_available_blocks(); }
    template <class F>
    [[nodiscard, gnu::always_inline]] std::optional<Id> try_allocate_one(F&& f) {
      const auto b = pool->alloc_.try_allocate_one(f);
      if (b && !kOne && !simple) pool->on_allocated(*b, g);
      return b;
    }
    template <class F>
    [[nodiscard, gnu::always_inline]] bool try_allocate(std::span<Id> out, F&& f) {
      if (!pool->alloc_.try_allocate(out, f)) return false;
      if (!kOne && !simple) {
        for (Id b : out) pool->on_allocated(b, g);
      }
      return true;
    }
    void acquire(Id b) {
      if (b != Id{0}) pool->acquire_block(b);
    }
    void release(Id b) {
      if (b != Id{0}) pool->release_block(b);
    }
  };
  /// The read-only half of GroupTableAllocator, as capacity queries see it (BlockTable::last_block_needs_copy).
  template <bool kOne>
  struct GroupTableView {
    const DevicePool* pool;
    std::uint32_t g = 0;
    bool coarse = false;
    [[nodiscard]] std::uint32_t refcount(Id b) const { return pool->table_refcount(b); }
    [[nodiscard]] bool is_hashed(Id b) const { return (kOne || !coarse) && pool->alloc_.is_hashed(b); }
  };
  /// Group g of `layout` (the pool's) as its BlockTable's allocator. kOne: compiled for one full-attention group
  /// (layout.simple: not coarse, no group tags, both known statically). Precondition: g < layout.num_groups.
  template <bool kOne>
  [[nodiscard]] GroupTableAllocator<kOne> table_allocator(const GroupLayout& layout, std::size_t g) noexcept {
    return {this, static_cast<std::uint32_t>(g), !kOne && layout.is_coarse(g), kOne || layout.simple};
  }
  /// Group g of `layout` as its capacity queries see it (GroupTableView). kOne as table_allocator.
  template <bool kOne>
  [[nodiscard]] GroupTableView<kOne> table_view(const GroupLayout& layout, std::size_t g) const noexcept {
    return {this, static_cast<std::uint32_t>(g), !kOne && layout.is_coarse(g)};
  }

  // --- Fill marks (device blocks a host -> device copy is filling) ---
  /// Mark device block `dst` filling; `unkeyed`: its copy registers nothing when it completes (a swapped-in partial
  /// or unhashed block).
  void mark_fill(Id dst, bool unkeyed) noexcept {
    filling_[dst / 64] |= std::uint64_t{1} << (dst % 64);
    if (unkeyed) unkeyed_fill_[dst / 64] |= std::uint64_t{1} << (dst % 64);
  }
  /// The fill into `dst` completed.
  void end_fill(Id dst) noexcept {
    filling_[dst / 64] &= ~(std::uint64_t{1} << (dst % 64));
    unkeyed_fill_[dst / 64] &= ~(std::uint64_t{1} << (dst % 64));
    ++completed_fills_;
  }
  [[nodiscard]] bool is_filling(Id b) const noexcept { return ((filling_[b / 64] >> (b % 64)) & 1U) != 0; }
  [[nodiscard]] bool is_unkeyed_fill(Id b) const noexcept { return ((unkeyed_fill_[b / 64] >> (b % 64)) & 1U) != 0; }
  /// Fills completed since construction (with the fills started, whether any is in flight).
  [[nodiscard]] std::uint64_t completed_fills() const noexcept { return completed_fills_; }

  // --- Leaving the index ---
  /// Group g's block left the shared index under `key`: one registration less for g; its hash (the key unmixed).
  BlockHash unregistered_from_group(const BlockHash& key, std::uint32_t g) noexcept {
    --group_cached_[g];
    return group_block_key(key, g);
  }
  // Out of line: the eviction paths stay small enough to inline their index probes (measured: docs/benchmarks.md).
  [[gnu::noinline]] void record_eviction(const BlockHash& key, EvictedTier t, std::uint32_t g) {
    history_.record(key, t, g);
  }
  /// Drop block b's registration (if any): its hash leaves the index and the eviction history records it,
  /// BlockRemoved is reported. Returns the hash (unmixed) and the group, or nullopt when b was not registered.
  /// Precondition: room for one event reserved.
  struct Forgotten {
    BlockHash hash;
    std::uint32_t group;
  };
  [[gnu::always_inline]] std::optional<Forgotten> forget_registration(Id b) {
    const std::uint32_t g = group_of_block(b);
    const auto key = index_.erase_block(b);  // inlined (always_inline; the view's would add no work here)
    if (!key) return std::nullopt;
    const BlockHash h = num_groups_ > 1 ? unregistered_from_group(*key, g) : *key;
    if (history_.enabled()) record_eviction(*key, EvictedTier::kDevice, g);
    if (events_.enabled()) {
      KVEvent& e = events_.push(KVEventType::kBlockRemoved);
      e.hash = h;
      e.group = g;
    }
    return Forgotten{h, g};
  }
  /// Evict block b's hash now, by id (KVCacheManager::evict_cached_block: vLLM's `evict_blocks` after a failed load):
  /// its registration is dropped (forget_registration) and its hashed mark cleared; a cached block goes to the free
  /// list, a held one stays with its holders and is freed on its last release. Returns whether b was registered
  /// (false when b was not hashed: nothing changes). Precondition: 0 < b < num_blocks. May throw std::bad_alloc
  /// (the event's room) before any change.
  [[gnu::cold, gnu::noinline]] bool evict_by_id(Id b) {
    if (!alloc_.is_hashed(b)) return false;
    events_.reserve_more(1);
    const bool registered = forget_registration(b).has_value();
    if (alloc_.refcount(b) == 0) {  // cached: to the free list (an unhashed release frees)
      alloc_.acquire(b);
      alloc_.set_hashed(b, false);
      alloc_.release(b);
    } else {
      alloc_.set_hashed(b, false);
    }
    return registered;
  }
  /// The evictor the allocator calls just before a cached block b is reused: drops its registration (above); then
  /// `on_evicted(b, hash, group)` (the facade's host offload) runs for a block that was registered. The caller
  /// reserved room for the events and whatever the hook queues.
  template <class OnEvicted>
  auto evictor(OnEvicted on_evicted) {
    return [this, on_evicted](Id b) {
      const auto f = forget_registration(b);
      if (f) on_evicted(b, f->hash, f->group);
    };
  }

  // --- Registration (prefix caching) ---
  /// Register group g's registrable full blocks of `q` beyond its registered cursor (see SequenceState), in
  /// `q.table` (kOne: the one full group) or `q.table_of(g)`. A block whose hash is already registered to another
  /// block is switched to that block when `q` is its only table holder and CacheConfig::deduplicate_blocks is on:
  /// its own copy is released and its logical index appended to switched() (the build writes -1 for its slots: the
  /// registered block holds the same K/V, written in an earlier step or earlier in this step's write_kv). A shared
  /// duplicate, or any duplicate with deduplication off, stays as it is, unregistered. A null entry, or a block that can never serve a hit under the group's `window`
  /// (block_can_serve_hit), is skipped, and so is one outside the group's sparse retention (`keep`, a
  /// sliding-window group's WindowRetention under the sequence's boundaries; null or not sparse: none; such a
  /// group's blocks are examined only up to a multiple of the rule's alignment, vLLM's cacheable horizon); the
  /// cursor moves past skipped blocks all the same (vLLM's num_cached_block). `on_registered(block, hash)` runs for each
  /// block registered (the facade's write-through list). Precondition: room reserved in switched() and the event log.
  // Always inlined into the build's per-row loop, where it is hot: out of line, the view's hash_of below is no
  // longer inlined either and computes the unmixed hash it discards. A sparse rule takes its own instantiation of the
  // loop (out of line), so the dense loop is the one it always was.
  template <bool kOne, class OnRegistered>
  [[gnu::always_inline]] void register_blocks(sequence_type& q, std::size_t g, const AttentionWindow& window,
                                              const WindowRetention* keep, OnRegistered&& on_registered) {
    if (!prefix_caching_) return;
    if constexpr (!kOne) {
      if (keep != nullptr && keep->sparse) {
        register_sparse(q, g, window, *keep, on_registered);
        return;
      }
    }
    register_loop<kOne, false>(q, g, window, WindowRetention{}, on_registered);
  }

 private:
  template <class OnRegistered>
  [[gnu::noinline]] void register_sparse(sequence_type& q, std::size_t g, const AttentionWindow& window,
                                         const WindowRetention& rule, OnRegistered& on_registered) {
    register_loop<false, true>(q, g, window, rule, on_registered);
  }
  // register_blocks' loop; kSparse: blocks outside `rule`'s tails (for q's boundaries) are skipped too.
  template <bool kOne, bool kSparse, class OnRegistered>
  [[gnu::always_inline]] void register_loop(sequence_type& q, std::size_t g, const AttentionWindow& window,
                                            const WindowRetention& rule, OnRegistered& on_registered) {
    index_view index = kOne ? index_view(index_, 0, nullptr, nullptr) : ix(g);
    BlockTable<Id>& table = kOne ? q.table : q.table_of(g);
    std::size_t& registered = kOne ? q.num_registered : q.registered_of(g);
    std::size_t end = std::min(q.num_registrable_blocks(), q.hashes.size());
    [[maybe_unused]] WindowRetention::Ends tails{};  // kSparse: where q's boundary tails end (blocks)
    if constexpr (kSparse) {
      tails = rule.ends(q.retention_replay, q.retention_junction, block_size_);
      // Blocks are examined only up to the hit alignment (vLLM's cacheable horizon, floor_A of the computed tokens;
      // one block further under EAGLE): a block past it waits, unexamined, for the build whose horizon covers it
      // (it may be null by then).
      end = rule.horizon(end);
    }
    for (std::size_t i = registered; i < end; ++i) {
      if (i + 1 < end) index.prefetch(q.hashes[i + 1]);  // the next insert's probe overlaps this one
      const BlockHash& h = q.hashes[i];
      const Id own = table.blocks()[i];
      if constexpr (!kOne) {
        if (own == Id{0} || !block_can_serve_hit(window, i, block_size_)) continue;
      }
      if constexpr (kSparse) {
        if (!rule.keeps(i, tails)) continue;
      }
      if (index.hash_of(own)) continue;  // already registered (by a sequence sharing it)
      const Id reg = index.insert(h, own);  // one map probe: inserts, or finds the registered block
      if (reg == own) {
        alloc_.set_hashed(own, true);
        if (events_.enabled()) record_stored(q, i, h, g);
        on_registered(own, h);
        continue;
      }
      // A shared duplicate, or one the engine must keep (deduplication off): leave it unregistered.
      if (!deduplicate_ || alloc_.refcount(own) - pins(own) != 1) continue;
      // Duplicate content: switch to the registered block, free ours.
      acquire_block(reg);
      table.replace_block(i, reg);
      release_block(own);
      ++dedup_blocks_;
      switched_.push_back(i);
    }
    registered = std::max(registered, end);
  }

 public:

  // Coarse group g (docs/groups.md, "Coarse pages"): key each page of `q` that holds registrable match blocks beyond
  // the registered cursor by the hash of the last of them: a full page by its last match block, the page being
  // filled by where its registrable content ends (a partial entry), re-keyed as it fills (one key per page: the
  // old one goes, BlockRemoved then BlockStored). A page whose new key another page holds keeps its old key: no
  // switch to the other (their contents after the key differ); so does a page another table holds (a lost entry,
  // never a wrong one). Room for two events per page reserved by the build.
  [[gnu::noinline]] void register_coarse(sequence_type& q, std::size_t g, std::size_t f) {
    if (!prefix_caching_) return;
    std::size_t& registered = q.registered_of(g);
    const std::size_t end = std::min(q.num_registrable_blocks(), q.hashes.size());
    if (end <= registered) return;
    index_view index = ix(g);
    const auto blocks = q.table_of(g).blocks();
    const auto gk = static_cast<std::uint32_t>(g);
    for (std::size_t c = registered / f; c * f < end; ++c) {
      const std::size_t j = std::min((c + 1) * f, end) - 1;
      const BlockHash& h = q.hashes[j];
      const Id own = blocks[c];
      // Keys as the shared index holds them (group-mixed): the view's hash_of stays with its hot caller, inlined.
      const std::optional<BlockHash> old = index_.hash_of(own);
      if (old == group_block_key(h, gk) || index_.find(group_block_key(h, gk))) continue;
      // A page another table holds keeps its key: that table may end where the key ends now (it took the page by
      // a hit there), and its appends go in place once it is the page's only holder (GroupTableAllocator::is_hashed).
      if (table_refcount(own) > 1) continue;
      if (old) unregister_page(own, g, false);
      index.insert(h, own);
      alloc_.set_hashed(own, true);
      if (events_.enabled()) record_stored(q, j, h, g);
    }
    registered = end;
  }
  // After a rewind of `q` to `kept` known match blocks: coarse group g's last page, left partial, loses a key beyond
  // those blocks (its content there may be overwritten in place: only sharing forces a copy of a coarse page; a
  // sharer's copy of that content then goes unregistered too, a lost entry, never a wrong one).
  void unkey_rewound_page(sequence_type& q, std::size_t g, std::size_t f, std::size_t kept) {
    BlockTable<Id>& t = q.table_of(g);
    if (t.num_tokens() % t.block_size() == 0) return;
    const Id last = t.blocks().back();
    const std::optional<BlockHash> key = index_.hash_of(last);  // group-mixed
    if (!key) return;
    const std::size_t c = t.num_blocks() - 1;
    for (std::size_t j = c * f; j < std::min(kept, (c + 1) * f); ++j) {
      if (group_block_key(q.hashes[j], static_cast<std::uint32_t>(g)) == *key) return;
    }
    unregister_page(last, g, true);
  }
  // Drop coarse group g's key of page b (a re-key, or a rewind below its key), reporting BlockRemoved.
  // `forget`: also clear its hashed bit (the page stays unregistered).
  void unregister_page(Id b, std::size_t g, bool forget) {
    const std::optional<BlockHash> key = index_.erase_block(b);
    if (!key) return;
    const BlockHash h = unregistered_from_group(*key, static_cast<std::uint32_t>(g));  // (a coarse pool has G > 1)
    if (forget) alloc_.set_hashed(b, false);
    if (events_.enabled()) {
      KVEvent& e = events_.push(KVEventType::kBlockRemoved);
      e.hash = h;
      e.group = static_cast<std::uint32_t>(g);
    }
  }

  // BlockStored of q's match block i (hash h) in group g. Precondition: events on, room reserved.
  void record_stored(const sequence_type& q, std::size_t i, const BlockHash& h, std::size_t g) {
    KVEvent& e = events_.push(KVEventType::kBlockStored);
    fill_stored_event(e, h, i, block_size_, q.tokens, q.hashes, q.keys.get());
    e.group = static_cast<std::uint32_t>(g);
  }

  // --- Retention ---
  /// The retention clock (the latest `now` of expire_retention).
  [[nodiscard]] RetentionTimePoint retention_now() const noexcept { return retention_now_; }
  /// Advance the retention clock to `now` (never back). Returns the clock.
  RetentionTimePoint advance_retention(RetentionTimePoint now) noexcept {
    retention_now_ = std::max(retention_now_, now);
    return retention_now_;
  }
  /// Give table blocks [first, end) of `blocks` (pages of `page_tokens` tokens, of a sequence with retention `r`
  /// over `num_prompt_tokens` prompt tokens) the priority and expiry `r` assigns, before a release that may cache
  /// them. Only for a RetentionEvictionPolicy (compiled out otherwise). Never throws: blocks held, priorities valid.
  void apply_retention(std::span<const Id> blocks, std::size_t page_tokens, const RetentionConfig* r,
                       std::size_t num_prompt_tokens, std::size_t first, std::size_t end) {
    if constexpr (RetentionEvictionPolicy<Evict, Id>) {
      for (std::size_t i = first; i < end; ++i) {
        if (blocks[i] == Id{0}) continue;
        BlockRetention br;
        if (r != nullptr) br = block_retention(*r, i * page_tokens, page_tokens, num_prompt_tokens);
        std::optional<RetentionTimePoint> at;
        if (br.duration) at = retention_now_ + *br.duration;
        alloc_.set_retention_priority(blocks[i], br.priority, at);
      }
    } else {
      (void)blocks;
      (void)page_tokens;
      (void)r;
      (void)num_prompt_tokens;
      (void)first;
      (void)end;
    }
  }

 private:
  std::size_t block_size_;                   // tokens per match block
  bool prefix_caching_;                      // registration on
  bool deduplicate_;                         // CacheConfig::deduplicate_blocks
  bool simple_;                              // one full group: held = used, no per-group counts
  std::size_t num_groups_;
  allocator_type alloc_;
  index_type index_;                         // the prefix index, shared by the groups (keys: group_block_key)
  std::vector<std::size_t> group_cached_;    // [G] when G > 1: blocks registered per group
  std::vector<std::uint8_t> group_of_;       // [num_blocks] when G > 1: the group a block was last taken for
  std::vector<std::size_t> held_;            // [G] blocks held per group (unless simple)
  std::vector<std::size_t> peak_held_;       // [G]
  std::size_t peak_used_ = 0;
  copy_list_type copies_;                    // pending copy-on-writes, their owners, a build's selection
  std::vector<std::uint64_t> filling_;       // [ceil(num_blocks / 64)] device blocks a fill targets
  std::vector<std::uint64_t> unkeyed_fill_;  // [ceil(num_blocks / 64)] of those, fills with no hash
  std::uint64_t completed_fills_ = 0;        // onboard + swap-in transfers completed
  EventLog events_;
  EvictionHistory history_;                  // recent evictions, for miss causes (capacity 0 = off)
  RetentionTimePoint retention_now_{};       // the retention clock (expire_retention)
  std::vector<std::size_t> switched_;        // a registration's switched logical blocks (ascending per call)
  std::uint64_t dedup_blocks_ = 0;           // blocks switched to a registered duplicate (CacheStats::dedup_blocks)
};

}  // namespace pagedkv::detail
