// pagedkv/group_policy.hpp: KV-cache groups (sets of layers with one attention type) and what their attention
// type decides for the cache manager: which blocks a position still needs (the release rule), which full blocks can
// serve a prefix hit, how far a rewind may go, and the prefix-hit fixed point over groups. docs/groups.md.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <pagedkv/kernel_params.hpp>  // AttentionWindow

namespace pagedkv {

/// The attention type of a KV-cache group (a set of layers with the same attention type; vLLM's KVCacheSpec
/// kinds FullAttentionSpec / SlidingWindowSpec / ChunkedLocalAttentionSpec).
enum class AttentionKind : std::uint8_t {
  kFull = 0,           ///< Every earlier key is visible: the group keeps every block of the sequence.
  kSlidingWindow = 1,  ///< A query at p sees keys (p - W, p] (W keys, itself included; FlashInfer window_left = W-1).
  kChunkedLocal = 2,   ///< Llama 4 chunked-local: a query at p sees [floor(p / C) * C, p].
  /// Recurrent state (Mamba-2, gated delta net, linear attention; vLLM's MambaSpec): a constant-size state per
  /// sequence, updated in place by every step, plus read-only checkpoints of it every `window_tokens` tokens,
  /// content-addressed by the chain hash of the blocks before them (docs/groups.md, "Recurrent-state groups").
  kRecurrent = 3,
};

/// "full", "sliding_window", "chunked_local" or "recurrent". Never null.
[[nodiscard]] constexpr const char* to_string(AttentionKind k) noexcept {
  switch (k) {
    case AttentionKind::kSlidingWindow: return "sliding_window";
    case AttentionKind::kChunkedLocal: return "chunked_local";
    case AttentionKind::kRecurrent: return "recurrent";
    case AttentionKind::kFull: break;
  }
  return "full";
}

/// One KV-cache group: its attention type and how many layers it has (for byte accounting only).
/// `window_tokens`: W for kSlidingWindow (>= 1, visible keys including the query, as AttentionWindow and the
/// `sliding_window` of Mistral / Gemma / gpt-oss configs count it), C for kChunkedLocal (>= 1), 0 for kFull, the
/// checkpoint interval I for kRecurrent (tokens, a positive multiple of the block size: the state after every
/// multiple of I tokens is kept as a checkpoint when prefix caching is on).
/// `state_bytes`: kRecurrent only, one layer's state in bytes (byte accounting; 0 = none): a state takes one pool
/// block, so a pool block is max(page_size_bytes, state_bytes) per layer slot (docs/groups.md).
/// `last_checkpoint`: kRecurrent only, also keep the state at the last block boundary each sequence reached (the
/// end of its prompt, or of its answer): one more block per running sequence, rewritten in place whenever a build
/// crosses a block boundary, registered as a checkpoint when the sequence is freed or preempted (vLLM's `align`
/// mode keeps such a checkpoint, at its block size, and nothing else).
/// `state_in_table`: kRecurrent only, vLLM's `mamba_cache_mode = 'align'` layout (docs/vllm-mamba-align.md): no
/// working state apart; the group's table is indexed by position, and the state after a step that ends at token n
/// lives in the table's block at logical block ceil(n / block_size) - 1. A growth that enters a new logical block
/// takes one block there (the blocks between stay null) and the next build reads the previous one as its state_in;
/// a build that ends exactly at a block boundary registers that block as the checkpoint there (so states are kept
/// only where steps ended: chunk ends, decode steps that fill a block). window_tokens must be the block size.
/// Refused with it (typed errors): lookahead slots and commit_lookahead, mark_checkpoint, swap preemption, rewind
/// (any n), external KV, and a build that computes only part of a sequence's slotted positions.
/// `prefill_checkpoint_alignment`: state_in_table only, 0 = off; else vLLM's prefill checkpoint block
/// (MambaSpec.num_prefill_checkpoint_blocks = 1 with this prefill_checkpoint_alignment, set by vLLM's Mamba-2
/// layers): a growth that starts on a block boundary and ends at least a block past it also keeps the state at its
/// last block boundary pos (when (pos - start) is a multiple of the alignment; under a retention interval of 0 only
/// for the growth that reaches the prompt's end), in one more block at the logical block that ends at pos; the
/// build lists it as a checkpoint entry (the kernel writes the state there mid-step) and registers it like a
/// step's end.
/// `block_size`: tokens per block of this group's pages; 0 = the pool's CacheConfig::block_size (the match unit:
/// block hashes, hits and registration stay at that unit). A coarser page (kFull only; a multiple of the match unit,
/// e.g. a compressed or indexer group at 64 or 128 tokens beside attention at 16, DeepSeek-V4) keeps its own block
/// table of ceil(tokens / block_size) blocks; its hits are still computed per match block (a partial coarse block
/// is registered under the hash where its content ends: docs/groups.md, "Coarse pages"; vLLM RFC #45702's idea).
struct KVCacheGroupSpec {
  AttentionKind kind = AttentionKind::kFull;
  std::uint32_t window_tokens = 0;
  std::uint32_t num_layers = 1;
  std::size_t state_bytes = 0;
  bool last_checkpoint = false;
  std::uint32_t block_size = 0;
  bool state_in_table = false;
  std::uint32_t prefill_checkpoint_alignment = 0;

  /// Whether this is a recurrent-state group.
  [[nodiscard]] constexpr bool recurrent() const noexcept { return kind == AttentionKind::kRecurrent; }
  /// Whether this is a recurrent group in vLLM's 'align' layout (state_in_table).
  [[nodiscard]] constexpr bool states_in_table() const noexcept { return recurrent() && state_in_table; }
  /// The checkpoint interval of a recurrent group (tokens); 0 for the other kinds.
  [[nodiscard]] constexpr std::uint32_t checkpoint_interval() const noexcept { return recurrent() ? window_tokens : 0; }

  /// The kernels' AttentionWindow of this group (off for kFull and kRecurrent). Precondition: window_tokens <=
  /// 2^31 - 1 (checked by KVCacheManager's constructor).
  [[nodiscard]] constexpr AttentionWindow window() const noexcept {
    AttentionWindow w;
    if (kind == AttentionKind::kSlidingWindow) w.sliding_window_tokens = static_cast<std::int32_t>(window_tokens);
    if (kind == AttentionKind::kChunkedLocal) w.attention_chunk_tokens = static_cast<std::int32_t>(window_tokens);
    return w;
  }

  /// The window the cache manager's hit and registration rules use: window() for the attention kinds; for
  /// kRecurrent a sliding window of 2 tokens, since a hit of k blocks needs exactly one thing of the group, the
  /// state after k * block_size tokens, kept with logical block k - 1 (the block that ends there).
  [[nodiscard]] constexpr AttentionWindow hit_window() const noexcept {
    if (!recurrent()) return window();
    AttentionWindow w;
    w.sliding_window_tokens = 2;
    return w;
  }
};

/// Sparse prefix-cache retention of one sliding-window group (CacheConfig::window_retention_interval; vLLM 0.32's
/// `prefix_cache_retention_interval`, SlidingWindowManager.reachable_block_mask; docs/vllm-swa-retention.md section
/// 4). A hit that ends at token k*bs needs the `need` = ceil((W - 1) / bs) blocks before it cached (the window of the
/// query at k*bs); so registering only the `need`-block runs ("tails") that end where a later hit can land keeps
/// every hit those landing points give, with fewer window blocks in the prefix index. The landing points: each
/// multiple of the interval (`period` blocks; none for interval 0) and, per sequence, its retention boundaries
/// (the replay boundary prompt_len - 1 and the shared-prefix junction: AdmitOptions), each aligned down to the hit
/// alignment (`align` blocks). Under EAGLE (CacheConfig::window_retention_eagle) a hit is proven by one more block
/// past it, so each tail is one block longer and ends one block later (`shift`), and the replay boundaries are
/// EAGLE's two. A plain value, built once per pool (GroupLayout); off = every block (dense).
struct WindowRetention {
  bool sparse = false;      ///< The rule is on (off: every block that can serve a hit is registered).
  bool every = false;       ///< The interval's tails cover every block: only the alignment horizon applies.
  bool eagle = false;       ///< EAGLE: tails shifted one block later, EAGLE's replay boundaries, horizon + 1 block.
  std::uint32_t need = 0;   ///< Blocks of a tail: ceil((W - 1) / block_size), + 1 under EAGLE.
  std::uint32_t period = 0; ///< Interval in blocks: a tail ends at each multiple (0: none, interval 0).
  std::uint32_t align = 1;  ///< Hit alignment in blocks (>= 1): boundaries are aligned down to a multiple.

  /// The block indexes one past each tail a sequence's boundaries give (0 = no tail): the replay boundary's (two
  /// under EAGLE) and the shared-prefix junction's.
  struct Ends {
    std::size_t replay = 0, replay_eagle = 0, junction = 0;
  };

  /// The rule for a sliding window of `window_tokens` W over blocks of `block_size` tokens, with `interval_tokens`
  /// (a multiple of `align_tokens`, itself a multiple of block_size, > 0), EAGLE or not. When the interval's tails
  /// already cover every block (need >= period) vLLM's mask is None: every block is kept (`every`), and the rule
  /// stays on only for its horizon when the alignment is coarser than a block (sparse false otherwise: the dense
  /// loop).
  [[nodiscard]] static constexpr WindowRetention make(std::uint32_t window_tokens, std::uint32_t block_size,
                                                      std::size_t interval_tokens, std::size_t align_tokens,
                                                      bool eagle = false) noexcept {
    WindowRetention r;
    r.eagle = eagle;
    r.need = (window_tokens > 1 ? (window_tokens - 2) / block_size + 1 : 0) + (eagle ? 1 : 0);
    r.period = static_cast<std::uint32_t>(interval_tokens / block_size);
    r.align = static_cast<std::uint32_t>(std::max<std::size_t>(align_tokens / block_size, 1));
    r.every = r.period != 0 && r.need >= r.period;
    r.sparse = !r.every || r.align > 1;
    return r;
  }
  /// The tails of a sequence whose replay boundary is token `replay` (prompt_len - 1) and whose shared-prefix
  /// junction is token `junction` (0 = none), over blocks of `block_size` tokens: each boundary aligned down to
  /// the alignment, in blocks, + 1 under EAGLE. EAGLE's replay boundaries (vLLM's replay_boundaries with
  /// use_eagle) are one alignment below the aligned prompt_len - 1 and below the aligned prompt_len, at least 0.
  [[nodiscard]] constexpr Ends ends(std::size_t replay, std::size_t junction, std::size_t block_size) const noexcept {
    const std::size_t shift = eagle ? 1 : 0;
    const auto aligned = [&](std::size_t token) { return token / block_size / align * align; };
    Ends e;
    if (eagle) {
      const auto below = [&](std::size_t token) { return aligned(token) >= align ? aligned(token) - align : 0; };
      e.replay = below(replay) + shift;
      e.replay_eagle = below(replay + 1) + shift;
    } else {
      e.replay = aligned(replay);
    }
    e.junction = junction != 0 ? aligned(junction) + shift : 0;
    return e;
  }
  /// Whether full block `i` is registered, for a sequence whose tails end at `e`. Precondition: sparse.
  [[nodiscard]] constexpr bool keeps(std::size_t i, const Ends& e) const noexcept {
    const std::size_t shift = eagle ? 1 : 0;
    if (every || (period != 0 && i >= shift && (i - shift) % period + need >= period)) return true;
    const auto in = [&](std::size_t end) { return i < end && i + need >= end; };
    return in(e.replay) || in(e.replay_eagle) || in(e.junction);
  }
  /// Of a sequence's first `end` full blocks, those a build may examine: up to a multiple of the alignment (vLLM's
  /// cacheable horizon, floor_A of the computed tokens), and under EAGLE one block past it when that is not 0.
  [[nodiscard]] constexpr std::size_t horizon(std::size_t end) const noexcept {
    const std::size_t a = end / align * align;
    return eagle && a != 0 ? std::min(end, a + 1) : a;
  }
};

/// What each KV-cache group of a pool is, resolved once from its group list (docs/design.md "The manager in
/// parts"): the hit rule's window, the page size and its factor over the match unit, and the pool-wide facts the
/// manager branches on (one full-attention group: its compiled fast path; any coarse or recurrent group). An empty
/// group list is one full-attention group. Built by KVCacheManager's constructor after the config was validated
/// (group block sizes are multiples of `block_size`); read-only afterwards.
struct GroupLayout {
  std::size_t num_groups = 1;                ///< G >= 1.
  bool simple = true;                        ///< One full-attention group: the plain pool's fast paths (kOne).
  bool any_coarse = false;                   ///< A group's pages are coarser than the match unit.
  bool any_recurrent = false;                ///< A recurrent-state group exists (no swap, no lookahead).
  bool any_state_table = false;              ///< A recurrent group keeps its states in its table (state_in_table).
  std::uint32_t block_size = 0;              ///< The match unit (tokens): CacheConfig::block_size.
  std::vector<AttentionWindow> windows;      ///< [G] the hit rule's window (KVCacheGroupSpec::hit_window).
  std::vector<std::uint32_t> page_tokens;    ///< [G] tokens per block of each group's pages.
  std::vector<std::uint32_t> page_factors;   ///< [G] page_tokens[g] / block_size.
  std::vector<KVCacheGroupSpec> specs;       ///< [G] the group specs (visit_group builds each kind from its own).
  bool prefix_caching = false;               ///< CacheConfig::enable_prefix_caching (a recurrent kind's checkpoints).
  /// [G] each group's sparse retention (WindowRetention; off but for sliding-window groups and recurrent groups
  /// with their states in their tables under CacheConfig::window_retention_interval), or empty when no group has it
  /// (set_window_retention).
  std::vector<WindowRetention> retention;

  GroupLayout() = default;
  /// The layout of `groups` (empty: one full-attention group) over match unit `match_block_size` (> 0), with prefix
  /// caching on or off.
  GroupLayout(std::span<const KVCacheGroupSpec> groups, std::uint32_t match_block_size, bool with_prefix_caching = false)
      : num_groups(groups.empty() ? 1 : groups.size()),
        simple(groups.size() <= 1 && (groups.empty() || groups[0].kind == AttentionKind::kFull)),
        block_size(match_block_size),
        prefix_caching(with_prefix_caching) {
    const KVCacheGroupSpec one{};
    for (const KVCacheGroupSpec& g : groups.empty() ? std::span<const KVCacheGroupSpec>(&one, 1) : groups) {
      specs.push_back(g);
      windows.push_back(g.hit_window());
      any_recurrent = any_recurrent || g.recurrent();
      any_state_table = any_state_table || g.states_in_table();
      page_tokens.push_back(g.block_size != 0 ? g.block_size : match_block_size);
      any_coarse = any_coarse || page_tokens.back() != match_block_size;
      page_factors.push_back(page_tokens.back() / match_block_size);
    }
  }

  /// Turn sparse retention on for every sliding-window group and every recurrent group with its states in its table
  /// (the rule of a 2-token window: one block per landing point, vLLM's MambaManager.reachable_block_mask): an
  /// interval of `interval_tokens` (0: boundaries only) with boundaries aligned down to `align_tokens` (0: the
  /// match unit). Preconditions: as CacheConfig::window_retention_interval (validate_cache_config). A group whose
  /// rule is dense keeps it off.
  void set_window_retention(std::size_t interval_tokens, std::size_t align_tokens, bool eagle = false) {
    retention.assign(num_groups, WindowRetention{});
    bool any = false;
    for (std::size_t g = 0; g < num_groups; ++g) {
      if (specs[g].kind != AttentionKind::kSlidingWindow && !specs[g].states_in_table()) continue;
      retention[g] = WindowRetention::make(static_cast<std::uint32_t>(windows[g].sliding_window_tokens), block_size, interval_tokens,
                                           align_tokens != 0 ? align_tokens : block_size,
                                           eagle && specs[g].kind == AttentionKind::kSlidingWindow);
      any = any || retention[g].sparse;
    }
    if (!any) retention.clear();
  }
  /// Group g's retention rule (off when none is set). Precondition: g < num_groups.
  [[nodiscard]] const WindowRetention& retention_of(std::size_t g) const noexcept {
    static constexpr WindowRetention kDense{};
    return retention.empty() ? kDense : retention[g];
  }

  /// Whether group g's pages are coarser than the match unit. Precondition: g < num_groups.
  [[nodiscard]] bool is_coarse(std::size_t g) const noexcept { return any_coarse && page_tokens[g] != block_size; }
  /// Match blocks per page of group g. Precondition: g < num_groups.
  [[nodiscard]] std::size_t coarse_factor(std::size_t g) const noexcept { return page_tokens[g] / block_size; }
  /// Whether group g is a recurrent-state group (AttentionKind::kRecurrent). Precondition: g < num_groups.
  [[nodiscard]] bool is_recurrent(std::size_t g) const noexcept { return specs[g].recurrent(); }
  /// Whether group g keeps its states in its table (KVCacheGroupSpec::state_in_table). Precondition: g < num_groups.
  [[nodiscard]] bool is_state_table(std::size_t g) const noexcept { return any_state_table && specs[g].state_in_table; }
  /// Whether group g registers its blocks by its own rule, not DevicePool::register_blocks' loop: coarse pages
  /// (DevicePool::register_coarse) and states in a table (RecurrentGroup::register_states). Precondition: g <
  /// num_groups.
  [[nodiscard]] bool registers_apart(std::size_t g) const noexcept {
    return (any_coarse && page_tokens[g] != block_size) || is_state_table(g);
  }
  /// The groups a loop compiled for `kOne` visits: 1 (statically group 0, the one full-attention group of a simple
  /// layout) or num_groups.
  template <bool kOne>
  [[nodiscard]] std::size_t groups() const noexcept {
    if constexpr (kOne) {
      return 1;
    } else {
      return num_groups;
    }
  }
  /// [G] match blocks per page of every group, or empty when no group is coarse (fixed_point_hit_blocks' `coarse`).
  [[nodiscard]] std::span<const std::uint32_t> coarse_factors() const noexcept {
    return any_coarse ? std::span<const std::uint32_t>(page_factors) : std::span<const std::uint32_t>();
  }
};

namespace detail {

template <class Id>
struct FullGroup;  // detail/group_full.hpp
template <class Id>
struct WindowGroup;  // detail/group_window.hpp
template <class Id>
struct CoarseGroup;  // detail/group_coarse.hpp
template <class Id>
struct RecurrentGroup;  // detail/group_recurrent.hpp

/// Recurrent group g of `layout` as its kind (detail/group_recurrent.hpp; the includer includes it). Precondition:
/// layout.is_recurrent(g).
template <class Id>
[[nodiscard]] RecurrentGroup<Id> recurrent_group(const GroupLayout& layout, std::size_t g) noexcept {
  RecurrentGroup<Id> r{};
  r.g = g;
  r.block_size = layout.block_size;
  r.interval = layout.specs[g].window_tokens;
  r.prefix_caching = layout.prefix_caching;
  r.last_checkpoint = layout.specs[g].last_checkpoint;
  r.in_table = layout.specs[g].state_in_table;
  r.checkpoint_align = layout.specs[g].prefill_checkpoint_alignment;
  r.retention = layout.retention_of(g);
  return r;
}

/// Call `f` with group g of `layout` as its kind, a small value built here once (issue 32; vLLM V1's one
/// SingleTypeKVCacheManager per group, a value instead of a subclass): detail::WindowGroup for sliding-window and
/// chunked-local groups, detail::RecurrentGroup for recurrent ones, detail::CoarseGroup for a full group with pages
/// coarser than the match unit, detail::FullGroup otherwise. Every kind's hooks share names (a hook a kind does not
/// override is the full kind's), so `f` is a generic callable; its result is returned (the same type for every
/// kind). One switch per call: run it once per call and group, never per block. The includer of this call's
/// instantiation includes the four kind headers (the facade does). Precondition: g < layout.num_groups.
template <class Id, class F>
decltype(auto) visit_group(const GroupLayout& layout, std::size_t g, F&& f) {
  const KVCacheGroupSpec& spec = layout.specs[g];
  const std::size_t bs = layout.block_size;
  switch (spec.kind) {
    case AttentionKind::kSlidingWindow:
    case AttentionKind::kChunkedLocal: {
      WindowGroup<Id> w{};
      w.g = g;
      w.block_size = bs;
      w.attention = spec.window();
      w.retention = layout.retention_of(g);
      return f(static_cast<const WindowGroup<Id>&>(w));
    }
    case AttentionKind::kRecurrent: {
      const RecurrentGroup<Id> r = recurrent_group<Id>(layout, g);
      return f(r);
    }
    case AttentionKind::kFull: break;
  }
  if (layout.is_coarse(g)) {
    CoarseGroup<Id> c{};
    c.g = g;
    c.block_size = bs;
    c.factor = layout.coarse_factor(g);
    return f(static_cast<const CoarseGroup<Id>&>(c));
  }
  FullGroup<Id> full{};
  full.g = g;
  full.block_size = bs;
  return f(static_cast<const FullGroup<Id>&>(full));
}

/// First logical block a group with window `w` must still hold for a sequence whose next query is at position
/// `first_query_pos` (tokens): floor(w.first_visible(first_query_pos) / block_size); 0 for full attention. Every
/// block before it is wholly before the window of every later query (first_visible is non-decreasing), which is
/// AttentionWindow::first_needed_token's rule. Precondition: w.valid().
[[nodiscard]] constexpr std::size_t first_kept_block(const AttentionWindow& w, std::size_t first_query_pos,
                                                     std::uint32_t block_size) noexcept {
  if (!w.enabled()) return 0;
  return static_cast<std::size_t>(w.first_visible(static_cast<std::int64_t>(first_query_pos))) / block_size;
}

/// Whether full block `i` of a group with window `w` can ever serve a prefix hit: a hit of k blocks needs blocks
/// [first_kept_block(k * block_size), k), and that range contains i for some k > i exactly when the query at
/// (i + 1) * block_size sees a key before itself, i.e. first_visible((i + 1) * block_size) < (i + 1) * block_size.
/// Always true for full attention and for W >= 2; never for W = 1; false for the last block of every chunk of a
/// chunked-local group whose chunk ends on a block boundary.
[[nodiscard]] constexpr bool block_can_serve_hit(const AttentionWindow& w, std::size_t i,
                                                 std::uint32_t block_size) noexcept {
  if (!w.enabled()) return true;
  const std::size_t end = (i + 1) * block_size;
  return static_cast<std::size_t>(w.first_visible(static_cast<std::int64_t>(end))) < end;
}

/// The prefix-hit fixed point over groups (vLLM's hybrid KVCacheCoordinator): the largest k <= max_blocks such that
/// every group g has every block of [first_kept_block(windows[g], k * block_size), k) cached; `cached(g, i)` says
/// whether full block i of the prompt is cached in group g (only called for i < max_blocks). Full groups bound k
/// from above (their longest cached run from block 0); each windowed group then searches downward for the largest
/// length whose window blocks are all cached; the minimum is fed back until no group lowers it. The result is the
/// same as the brute-force maximum (any k valid for all groups stays below every bound). Cost: one `cached` call
/// per (group, block < max_blocks) plus O(groups x iterations). `run` is scratch (resized to groups x max_blocks:
/// no allocation once it has grown); the overload without it allocates.
///
/// `coarse` (optional, [groups] or empty): group g's pages hold coarse[g] match blocks (KVCacheGroupSpec::block_size /
/// block_size; 0 or 1 = one). A coarse full-attention group registers each of its blocks under the hash of the last
/// match block it holds (a full block: its last; a partial one: where its content ends), so `cached(g, i)` means
/// "group g holds a block whose content ends at match block i", and a hit of k blocks needs the full coarse blocks
/// before block k - 1's one cached at their last match block, and block k - 1 cached: a downward search like a
/// window's (docs/groups.md, "Coarse pages").
template <class Cached>
[[nodiscard]] std::size_t fixed_point_hit_blocks(std::span<const AttentionWindow> windows, std::uint32_t block_size,
                                                 std::size_t max_blocks, Cached&& cached,
                                                 std::vector<std::uint32_t>& run_scratch,
                                                 std::span<const std::uint32_t> coarse = {}) {
  if (max_blocks == 0) return 0;
  std::size_t m = max_blocks;
  const auto factor = [&](std::size_t g) -> std::size_t { return g < coarse.size() && coarse[g] > 1 ? coarse[g] : 1; };
  const auto searched = [&](std::size_t g) { return windows[g].enabled() || factor(g) > 1; };
  // run(g, i): cached blocks ending at i (inclusive) in group g; full groups only need the run from block 0. A
  // coarse group's run(g, 0) holds its count of leading full coarse blocks cached.
  run_scratch.resize(windows.size() * max_blocks);
  const auto run = [&](std::size_t g) { return run_scratch.data() + g * max_blocks; };
  for (std::size_t g = 0; g < windows.size(); ++g) {
    if (!searched(g)) {
      std::size_t k = 0;
      while (k < m && cached(g, k)) ++k;
      m = std::min(m, k);
    }
  }
  for (std::size_t g = 0; g < windows.size() && m > 0; ++g) {
    if (!searched(g)) continue;
    std::uint32_t* r = run(g);
    if (const std::size_t f = factor(g); f > 1) {
      std::uint32_t c = 0;
      while ((c + 1) * f - 1 < m && cached(g, (c + 1) * f - 1)) ++c;
      r[0] = c;
      continue;
    }
    for (std::size_t i = 0; i < m; ++i) r[i] = cached(g, i) ? (i == 0 ? 1U : r[i - 1] + 1U) : 0U;
  }
  for (bool changed = true; changed && m > 0;) {
    changed = false;
    for (std::size_t g = 0; g < windows.size(); ++g) {
      if (!searched(g)) continue;
      std::size_t k = m;
      if (const std::size_t f = factor(g); f > 1) {  // the full coarse blocks before block k - 1's, then k - 1
        for (; k > 0; --k) {
          if ((k - 1) / f <= run(g)[0] && cached(g, k - 1)) break;
        }
      } else {
        for (; k > 0; --k) {  // valid: every block of [lo, k) cached, i.e. the run ending at k - 1 is long enough
          const std::size_t lo = first_kept_block(windows[g], k * block_size, block_size);
          if (lo >= k || run(g)[k - 1] >= k - lo) break;
        }
      }
      if (k < m) {
        m = k;
        changed = true;
      }
    }
  }
  return m;
}

/// fixed_point_hit_blocks with its own scratch (allocates O(groups x max_blocks)).
template <class Cached>
[[nodiscard]] std::size_t fixed_point_hit_blocks(std::span<const AttentionWindow> windows, std::uint32_t block_size,
                                                 std::size_t max_blocks, Cached&& cached,
                                                 std::span<const std::uint32_t> coarse = {}) {
  std::vector<std::uint32_t> run;
  return fixed_point_hit_blocks(windows, block_size, max_blocks, cached, run, coarse);
}

}  // namespace detail

}  // namespace pagedkv
