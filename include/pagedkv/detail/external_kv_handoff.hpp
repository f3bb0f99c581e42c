// pagedkv/detail/external_kv_handoff.hpp: the pure pieces of an external-KV hand-off (issue 33): the layout
// fingerprint of a pool and its checks, the groups a hand-off supports, block identities in a declared convention,
// the external part of an admission's explanation, and the consumer's import plan with its checks. No state: the
// fills and holds these plans feed are detail/external_kv.hpp's ExternalKvState; the KVCacheManager calls both.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <pagedkv/block_identity.hpp>
#include <pagedkv/cache_config.hpp>
#include <pagedkv/config.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/external_kv.hpp>
#include <pagedkv/group_policy.hpp>
#include <pagedkv/hash.hpp>

namespace pagedkv::detail {

/// The fingerprint of a pool configured by `config` (block_size, groups, hash seed) with the caller's page layout,
/// dtype, KV heads and head_dim (KVCacheManager::layout_fingerprint). Pure; allocates.
[[nodiscard]] inline KvLayoutFingerprint external_layout_fingerprint(const CacheConfig& config, std::string page_layout,
                                                                     std::string dtype, std::uint32_t num_kv_heads,
                                                                     std::uint32_t head_dim,
                                                                     BlockIdentityConvention convention,
                                                                     std::string_view vllm_seed) {
  KvLayoutFingerprint fp{config.block_size, std::move(page_layout), std::move(dtype), num_kv_heads, head_dim,
                         config.groups, convention, 0, {}};
  if (convention == BlockIdentityConvention::kPagedkv) {
    fp.hash_seed = config.hash_seed;
  } else {
    fp.hash_seed_text = std::string(vllm_seed);
  }
  return fp;
}

/// Throws kInvalidArgument unless `layout` (a caller's fingerprint) describes the pool of `config`: the pool's
/// fingerprint with layout's caller fields, compared field by field (`what` names the call).
inline void check_pool_layout(const CacheConfig& config, const KvLayoutFingerprint& layout, const char* what) {
  check_same_layout(external_layout_fingerprint(config, layout.page_layout, layout.dtype, layout.num_kv_heads,
                                                layout.head_dim, layout.hash_algorithm, layout.hash_seed_text),
                    layout, what);
}

/// Throws kInvalidArgument naming the first group a save pin (KVCacheManager::pin_for_save) cannot take: a
/// recurrent group, whose working state every build rewrites in place, so a pin cannot keep it for a save (a
/// hand-off carries it: finish_with_lease). Every group kind takes part in fills and hand-offs: full attention,
/// windowed attention (sliding window, chunked-local: only the blocks inside the window of the consumer's first
/// query), recurrent state (one state: the one the consumer resumes from) and coarse pages (whole pages).
inline void check_save_pin_groups(const CacheConfig& config, const GroupLayout& layout, const char* what) {
  for (std::size_t g = 0; g < layout.num_groups; ++g) {
    if (!layout.is_recurrent(g)) continue;
    detail::raise(Errc::kInvalidArgument,
                  std::string(what) + ": KV-cache group " + std::to_string(g) + " is " +
                      to_string(config.groups[g].kind) +
                      ": a save pin cannot keep a working state that every build rewrites in place (hand the state "
                      "off with finish_with_lease)");
  }
}

/// The tokens a fill's first position is a multiple of: the least common multiple of the coarse groups' page sizes
/// (the match block size without coarse groups). A coarse group's pages move whole, so a fill starts on a page
/// boundary of every group (vLLM aligns its hits to the groups' common block size the same way). Pure.
[[nodiscard]] inline std::size_t handoff_page_tokens(const GroupLayout& layout) noexcept {
  std::size_t p = layout.block_size;
  for (std::size_t g = 0; g < layout.num_groups && layout.any_coarse; ++g) {
    p = std::lcm(p, std::size_t{layout.page_tokens[g]});
  }
  return p;
}

/// The local hit an external admission or import takes: `lookup(cap)`'s (the hit with at most cap tokens;
/// std::nullopt: no cap) from `cap`, lowered while it is not a multiple of handoff_page_tokens (each lower hit is
/// asked again: a window or recurrent group may serve a shorter prefix less). Pure but for `lookup`.
template <class Lookup>
[[nodiscard]] std::size_t page_aligned_hit(const GroupLayout& layout, std::optional<std::size_t> cap,
                                           Lookup&& lookup) {
  std::size_t h = lookup(cap);
  if (!layout.any_coarse) return h;
  const std::size_t page = handoff_page_tokens(layout);
  while (h % page != 0) h = lookup(std::optional<std::size_t>(h / page * page));
  return h;
}

/// A coarse group's row of a hand-off or fill ticket over match blocks [0, num_blocks) (`row`, allocated): each page
/// of `pages` (the group's table, `factor` match blocks per page) at the entry of its first match block, null
/// elsewhere, so that a transfer moves each page once.
template <class Id>
void coarse_row(std::span<const Id> pages, std::size_t factor, std::size_t num_blocks, std::vector<Id>& row) {
  row.assign(num_blocks, Id{0});
  for (std::size_t i = 0; i < num_blocks; i += factor) row[i] = i / factor < pages.size() ? pages[i / factor] : Id{0};
}

/// The first logical block of each group a consumer whose first query sits at `end_token` must hold: blocks before
/// it are wholly outside that query's window (first_kept_block; 0 for full attention), so a hand-off neither
/// describes nor transfers them and the consumer's table holds the null block there (as after a window group's
/// hit). Hand-off rule of a window group (vLLM: SlidingWindowManager's skipped blocks; SGLang's SWA radix cache).
[[nodiscard]] inline std::size_t handoff_first_block(const AttentionWindow& w, std::size_t end_token,
                                                     std::uint32_t block_size) noexcept {
  return first_kept_block(w, end_token, block_size);
}

/// Producer: the block a hand-off of `q` describes at logical block i of group g (KVCacheManager::finish_with_lease).
/// A recurrent group's: the block holding the state after the tokens up to the end of block i
/// (RecurrentGroup::handoff_state_at). A coarse group's: the page holding block i at its first match block, null at
/// the others (coarse_row). Another group's: the null block 0 before handoff_first_block of the query at
/// num_known - 1 (a consumer recomputes its last prompt token), else the table's block, or, when the last build's
/// window released it, the block the pool still caches under its hash (0 when evicted meanwhile). Pure.
template <class Id, class Pool, class Seq>
[[nodiscard]] Id handoff_block_at(const Pool& pool, const GroupLayout& layout, const Seq& q, std::size_t g,
                                  std::size_t i) {
  if (layout.is_recurrent(g)) return recurrent_group<Id>(layout, g).handoff_state_at(pool, q, i);
  if (layout.is_coarse(g)) {  // a page at its first match block (coarse_row)
    const std::size_t f = layout.coarse_factor(g);
    const auto pages = q.table_of(g).blocks();
    return i % f == 0 && i / f < pages.size() ? pages[i / f] : Id{0};
  }
  const std::size_t last = q.num_known() == 0 ? 0 : q.num_known() - 1;  // the consumer's first query, at most
  if (i < handoff_first_block(layout.windows[g], last, layout.block_size)) return Id{0};
  const auto blocks = q.table_of(g).blocks();
  const Id b = i < blocks.size() ? blocks[i] : Id{0};
  if (b != Id{0} || i >= q.hashes.size()) return b;
  const auto c = pool.ix(g).find(q.hashes[i]);  // released by the last build's window, still cached
  return c ? *c : Id{0};
}

/// Consumer: group g's row of the fill ticket of admitted `q` ending at `end_token`, over logical blocks from 0
/// (KVCacheManager::try_admit_external; ExternalKvState::open_fill takes the fill's part): a recurrent group's
/// (RecurrentGroup::ticket_row: the block receiving the state at end_token) or a coarse group's (coarse_row: pages
/// at their first match block) in `row`, any other group's table. Allocates `row`.
template <class Id, class Seq>
[[nodiscard]] std::span<const Id> ticket_row(const GroupLayout& layout, const Seq& q, std::size_t g,
                                             std::size_t end_token, std::vector<Id>& row) {
  if (layout.is_recurrent(g)) {
    recurrent_group<Id>(layout, g).ticket_row(q, end_token, row);
  } else if (layout.is_coarse(g)) {
    coarse_row(q.table_of(g).blocks(), layout.coarse_factor(g), q.num_slotted() / layout.block_size + 1, row);
  } else {
    return q.table_of(g).blocks();
  }
  return row;
}
/// Producer (KVCacheManager::finish_with_lease): every recurrent group's last checkpoint of `q` registered now, as a
/// free would (RecurrentGroup::register_last_checkpoint), so that the lease holds it cached. Reserves its events.
template <class Id, class Pool, class Seq>
void register_last_checkpoints(const GroupLayout& layout, Pool& pool, Seq& q) {
  if (!layout.any_recurrent) return;
  pool.events().reserve_more(layout.num_groups);
  for (std::size_t g = 1; g < layout.num_groups; ++g) {
    if (layout.is_recurrent(g)) recurrent_group<Id>(layout, g).register_last_checkpoint(pool, q);
  }
}
/// Consumer (KVCacheManager::complete_external_fill): a fill of `q` up to `end_token` completed with every block
/// valid: each recurrent group holds the state at end_token where its ticket row put it
/// (RecurrentGroup::complete_fill).
template <class Id, class Seq>
void complete_recurrent_fill(const GroupLayout& layout, Seq& q, std::size_t end_token) {
  for (std::size_t g = 1; g < layout.num_groups && layout.any_recurrent; ++g) {
    if (layout.is_recurrent(g)) recurrent_group<Id>(layout, g).complete_fill(q, end_token);
  }
}

/// Consumer (KVCacheManager::complete_external_fill): f(g, i) for each null entry i of q's attention groups g (not
/// recurrent, not coarse) from the logical block of position `built` to the end of their tables: blocks a
/// recompute of the positions from `built` writes, which an external admission left out (a window group's blocks
/// outside the window of the fill's end: window_external_skip). None after a complete fill. `f` may replace the
/// entry (table length unchanged).
template <class Id, class Seq, class F>
void for_each_null_block_from(const GroupLayout& layout, Seq& q, std::size_t built, F&& f) {
  for (std::size_t g = 0; g < layout.num_groups; ++g) {
    if (layout.is_recurrent(g) || layout.is_coarse(g)) continue;
    const std::size_t n = q.table_of(g).num_blocks();
    for (std::size_t i = built / layout.block_size; i < n; ++i) {
      if (q.table_of(g).blocks()[i] == Id{0}) f(g, i);
    }
  }
}

/// Consumer: the first logical block of group g a fill of tokens [first_token, end_token) holds: a window group's
/// first block inside the window of the query at end_token (handoff_first_block), else first_token's block.
[[nodiscard]] inline std::size_t ticket_first_block(const GroupLayout& layout, std::size_t g, std::size_t first_token,
                                                    std::size_t end_token) noexcept {
  return layout.is_recurrent(g) ? first_token / layout.block_size
                                : handoff_first_block(layout.windows[g], end_token, layout.block_size);
}

/// The valid blocks (per group, from the fill's first_block) that a completion may keep when `num_valid` of the
/// fill's `num_blocks` blocks hold K/V: `num_valid`, unless the query at the position it would leave computed
/// (first_token + num_valid blocks) sees a window block that was never transferred (a window group's blocks in
/// [first_block, handoff_first_block(end_token)) are left out of the transfer), in which case 0: the whole fill is
/// recomputed from the local hit, whose window blocks the table still holds. Pure.
[[nodiscard]] inline std::size_t window_valid_blocks(std::span<const AttentionWindow> windows, std::size_t first_block,
                                                     std::size_t first_token, std::size_t end_token,
                                                     std::size_t num_blocks, std::size_t num_valid,
                                                     std::uint32_t block_size) noexcept {
  if (num_valid >= num_blocks) return num_valid;
  const std::size_t at = first_token + num_valid * block_size;
  for (const AttentionWindow& w : windows) {
    const std::size_t sent = handoff_first_block(w, end_token, block_size);
    if (sent > first_block && first_kept_block(w, at, block_size) < sent) return 0;
  }
  return num_valid;
}

/// The valid blocks a completion keeps (KVCacheManager::complete_external_fill) of a fill of `num_blocks` blocks
/// per group over tokens [first_token, end_token) from logical block first_block, `num_valid` of them holding K/V:
/// with a recurrent group and a failed block, 0 (the group's only transferred entry, the state at end_token, is
/// the fill's last: without it the positions after the local hit are recomputed from the hit's state); else
/// window_valid_blocks. Pure.
[[nodiscard]] inline std::size_t fill_valid_blocks(const GroupLayout& layout, std::size_t first_block,
                                                   std::size_t first_token, std::size_t end_token,
                                                   std::size_t num_blocks, std::size_t num_valid) noexcept {
  if (num_valid >= num_blocks) return num_valid;
  if (layout.any_recurrent) return 0;
  return window_valid_blocks(layout.windows, first_block, first_token, end_token, num_blocks, num_valid,
                             layout.block_size);
}

/// Consumer: where an import of hand-off `desc` (whose blocks per group are `per_group`) over `layout` may end,
/// when the attention groups allow (hit, end]: with a recurrent group, the latest position p in (hit, end] whose
/// state every recurrent group's entries describe (the producer's working state at p = desc.num_tokens, or a
/// checkpoint at a block boundary: RecurrentGroup::handoff_state_at), since the consumer's next build resumes from
/// that state; `hit` when there is none (nothing is imported). Without a recurrent group, `end`. Pure.
template <BlockIdType Id>
[[nodiscard]] std::size_t recurrent_import_end(const HandoffDescriptor<Id>& desc, const GroupLayout& layout,
                                               std::size_t per_group, std::size_t hit, std::size_t end) {
  const std::size_t bs = layout.block_size;
  if (!layout.any_recurrent || end <= hit) return end;
  const auto described = [&](std::size_t pos) {  // the state after pos tokens, in every recurrent group
    for (std::size_t g = 0; g < layout.num_groups; ++g) {
      if (layout.is_recurrent(g) && desc.blocks[g * per_group + (pos + bs - 1) / bs - 1] == Id{0}) return false;
    }
    return true;
  };
  if (end == desc.num_tokens && described(end)) return end;
  for (std::size_t pos = end / bs * bs; pos > hit; pos -= bs) {
    if (described(pos)) return pos;
  }
  return hit;
}

/// The identities of the full blocks of `tokens` (`[tokens.size() / block_size]`) under `layout.hash_algorithm`:
/// pagedkv's from `hashes` (the chain hashes of those blocks; throws kInvalidArgument when fewer: prefix caching
/// off), vLLM's sha256_cbor recomputed from the tokens (throws kInvalidArgument when `has_keys`: extra keys are not
/// supported in that convention yet). `what` names the call in errors. Allocates.
[[nodiscard]] inline std::vector<BlockIdentity> block_identities(std::span<const TokenId> tokens,
                                                                 std::span<const BlockHash> hashes, bool has_keys,
                                                                 std::size_t block_size,
                                                                 const KvLayoutFingerprint& layout, const char* what) {
  const std::size_t n = tokens.size() / block_size;
  std::vector<BlockIdentity> out(n);
  if (layout.hash_algorithm == BlockIdentityConvention::kPagedkv) {
    if (hashes.size() < n) {
      detail::raise(Errc::kInvalidArgument, std::string(what) + ": pagedkv identities need the block hashes "
                                                                "(CacheConfig::enable_prefix_caching is off)");
    }
    for (std::size_t i = 0; i < n; ++i) std::copy(hashes[i].bytes.begin(), hashes[i].bytes.end(), out[i].begin());
    return out;
  }
  if (has_keys) {
    detail::raise(Errc::kInvalidArgument, std::string(what) + ": vLLM identities of a request with extra keys "
                                                              "(salt, adapter, multimodal) are not supported yet");
  }
  const std::vector<std::uint32_t> toks(tokens.begin(), tokens.end());
  const auto h = identity::vllm_request_block_hashes(toks, block_size, identity::VllmRequestKeys{},
                                                     identity::vllm_none_hash(layout.hash_seed_text));
  std::copy_n(h.begin(), n, out.begin());
  return out;
}

/// The external part of an admission whose local explanation is `local`, offered `num_external_tokens` after the
/// local hit, over blocks of `block_size` tokens (KVCacheManager::explain_admit_external). `from`: where the fill
/// would start when a coarse group lowers the hit to a page boundary (page_aligned_hit); the local hit otherwise
/// (any larger value). Pure.
[[nodiscard]] inline ExternalAdmitExplanation explain_external(AdmitExplanation local, std::size_t num_external_tokens,
                                                               std::size_t block_size, std::size_t from) {
  ExternalAdmitExplanation x;
  const std::size_t hit = std::min(local.hit_tokens, from);
  const std::size_t offered = num_external_tokens + (local.hit_tokens - hit);
  x.external_tokens = importable_tokens(hit + offered, local.prompt_tokens, hit);
  x.clamped_tokens = offered - x.external_tokens;
  x.first_external_token = hit;
  x.first_external_block = hit / block_size;
  x.skipped_blocks = x.first_external_block;
  x.external_blocks =
      x.external_tokens == 0 ? 0 : (hit + x.external_tokens + block_size - 1) / block_size - x.first_external_block;
  x.local = std::move(local);
  return x;
}

/// Throws kInvalidArgument (named "try_admit_external") unless import `plan` fits a pool of `num_groups` groups of
/// `block_size` tokens, a prompt of `prompt_len` tokens and the local hit now, `hit_tokens` (the plan's
/// first_token: a hit that changed since the plan would pair the ticket's blocks with the wrong remote blocks). Pure.
template <BlockIdType Id>
void check_plan_matches(const ImportPlan<Id>& plan, std::size_t num_groups, std::size_t block_size,
                        std::size_t prompt_len, std::size_t hit_tokens) {
  const bool shape = plan.num_groups == num_groups && plan.first_token <= plan.end_token &&
                     plan.end_token + 1 <= std::max<std::size_t>(prompt_len, 1) &&
                     plan.first_block == plan.first_token / block_size &&
                     plan.remote_blocks.size() == plan.num_blocks * num_groups &&
                     plan.remote_generations.size() == plan.remote_blocks.size();
  if (!shape) {
    detail::raise(Errc::kInvalidArgument,
                  "try_admit_external: import plan of tokens [" + std::to_string(plan.first_token) + ", " +
                      std::to_string(plan.end_token) + ") over " + std::to_string(plan.num_groups) + " groups, " +
                      std::to_string(plan.remote_blocks.size()) + " remote blocks does not fit a prompt of " +
                      std::to_string(prompt_len) + " tokens over " + std::to_string(num_groups) + " groups");
  }
  if (hit_tokens != plan.first_token) {
    detail::raise(Errc::kInvalidArgument, "try_admit_external: the local prefix hit changed since the import plan (" +
                                              std::to_string(plan.first_token) + " tokens then, " +
                                              std::to_string(hit_tokens) + " now): plan again");
  }
}

/// Consumer: the import plan of hand-off `desc` for `prompt`, over the groups of `layout`
/// (their hit windows and kinds, blocks of layout.block_size tokens). Checks the descriptor's
/// shape first (blocks per group = ceil(num_tokens / block_size), from the token count, never trusted: vLLM
/// #50558), then asks `local_hit()` for the consumer's own prefix hit (tokens, whole blocks: not transferred
/// again; a pair: the hit on a page boundary of every group, page_aligned_hit, where a fill starts, and lookup's
/// own, which an empty plan keeps), then, when blocks are to be transferred, checks their identities against
/// `mine()` (the prompt's identities under desc's convention, computed only then) and the partial last block's
/// tokens against desc.tail_tokens. A window group's blocks before
/// handoff_first_block(end_token) are null in the plan (never transferred); when the descriptor lacks one inside
/// that window (null: the producer no longer had it), the plan imports nothing. With a recurrent group the plan
/// ends where a state is described (recurrent_import_end) and moves only that state in each recurrent group (the
/// entry of its last block). Throws kInvalidArgument naming the values. Pure but for the two callables.
template <BlockIdType Id, class LocalHit, class Mine>
[[nodiscard]] ImportPlan<Id> make_import_plan(const HandoffDescriptor<Id>& desc, const GroupLayout& layout,
                                              std::span<const TokenId> prompt, LocalHit&& local_hit, Mine&& mine) {
  const std::size_t prompt_len = prompt.size();
  const std::span<const AttentionWindow> windows(layout.windows);
  const std::size_t num_groups = layout.num_groups;
  const std::size_t block_size = layout.block_size;
  const std::size_t bs = block_size;
  const std::size_t per_group = (desc.num_tokens + bs - 1) / bs;
  if (desc.num_groups != num_groups || desc.blocks.size() != per_group * num_groups ||
      desc.generations.size() != desc.blocks.size() || desc.identities.size() != desc.num_tokens / bs) {
    detail::raise(Errc::kInvalidArgument,
                  "plan_import: descriptor of " + std::to_string(desc.num_tokens) + " tokens holds " +
                      std::to_string(desc.blocks.size()) + " blocks, " + std::to_string(desc.generations.size()) +
                      " generations, " + std::to_string(desc.identities.size()) + " identities over " +
                      std::to_string(desc.num_groups) + " groups; expected ceil(" + std::to_string(desc.num_tokens) +
                      " / " + std::to_string(bs) + ") = " + std::to_string(per_group) + " blocks per group over " +
                      std::to_string(num_groups) + " groups and " + std::to_string(desc.num_tokens / bs) +
                      " identities");
  }
  if (desc.tail_tokens.size() != desc.num_tokens % bs) {
    detail::raise(Errc::kInvalidArgument, "plan_import: descriptor of " + std::to_string(desc.num_tokens) +
                                              " tokens holds " + std::to_string(desc.tail_tokens.size()) +
                                              " tail tokens; expected " + std::to_string(desc.num_tokens) + " % " +
                                              std::to_string(bs) + " = " + std::to_string(desc.num_tokens % bs));
  }
  const auto [hit, full_hit] = local_hit();  // on a page boundary (page_aligned_hit), and lookup's own
  ImportPlan<Id> p;
  p.num_groups = num_groups;
  p.first_token = hit;
  p.end_token = hit + importable_tokens(desc.num_tokens, prompt_len, hit);
  p.end_token = recurrent_import_end(desc, layout, per_group, hit, p.end_token);
  // A window group's blocks inside the consumer's first window must all be described (the producer leased them);
  // else nothing is imported (the consumer computes the prompt itself: a shorter end needs earlier blocks still).
  for (std::size_t g = 0; g < num_groups && p.end_token > hit; ++g) {
    // A recurrent group is described at p.end_token (recurrent_import_end); a coarse group at its pages' first blocks.
    if (layout.is_recurrent(g) || layout.is_coarse(g)) continue;
    const std::size_t from = std::max(handoff_first_block(windows[g], p.end_token, block_size), hit / bs);
    for (std::size_t i = from; i < (p.end_token + bs - 1) / bs; ++i) {
      if (desc.blocks[g * per_group + i] == Id{0}) {
        p.end_token = hit;
        break;
      }
    }
  }
  if (p.end_token == hit) p.first_token = p.end_token = full_hit;  // nothing to import: the admission takes its hit
  p.first_block = p.first_token / bs;
  p.skipped_blocks = p.first_block;
  p.num_blocks = p.end_token == p.first_token ? 0 : (p.end_token + bs - 1) / bs - p.first_block;
  if (p.num_blocks != 0) {
    const std::vector<BlockIdentity> m = mine();
    for (std::size_t i = p.first_block; i < p.first_block + p.num_blocks; ++i) {
      if (i < m.size() && i < desc.identities.size() && m[i] != desc.identities[i]) {
        detail::raise(Errc::kInvalidArgument, "plan_import: block " + std::to_string(i) +
                                                  "'s identity differs from this prompt's: the descriptor holds "
                                                  "another prefix");
      }
    }
    // The partial last block has no identity: its tokens are compared (positions before end_token).
    const std::size_t tail = desc.num_tokens / bs * bs;
    for (std::size_t pos = std::max(tail, p.first_token); pos < p.end_token; ++pos) {
      if (prompt[pos] != desc.tail_tokens[pos - tail]) {
        detail::raise(Errc::kInvalidArgument, "plan_import: token " + std::to_string(pos) + " of the partial block " +
                                                  std::to_string(tail / bs) + " differs from this prompt's (" +
                                                  std::to_string(desc.tail_tokens[pos - tail]) + " vs " +
                                                  std::to_string(prompt[pos]) +
                                                  "): the descriptor holds another prefix");
      }
    }
  }
  for (std::size_t g = 0; g < num_groups; ++g) {
    const bool recurrent = layout.is_recurrent(g);
    const std::size_t sent = recurrent ? p.first_block + p.num_blocks - 1  // the state at end_token only
                                       : handoff_first_block(windows[g], p.end_token, block_size);
    for (std::size_t i = p.first_block; i < p.first_block + p.num_blocks; ++i) {
      const bool out = i < sent;  // outside the window of the consumer's first query: never transferred
      p.remote_blocks.push_back(out ? Id{0} : desc.blocks[g * per_group + i]);
      p.remote_generations.push_back(out ? 0 : desc.generations[g * per_group + i]);
    }
  }
  return p;
}

}  // namespace pagedkv::detail
