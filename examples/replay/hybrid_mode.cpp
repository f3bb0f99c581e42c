// examples/replay/hybrid_mode.cpp: hybrid models on the bundled traces: a HybridKVCacheManager for the model's
// KV-cache groups (full + sliding-window / chunked-local) against the same layers all full attention, on one pool.
#include "hybrid_mode.hpp"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <numeric>
#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <pagedkv/hash.hpp>

#include "modes.hpp"
#include "publish.hpp"
#include "report.hpp"

namespace replay {
namespace {

std::string group_label(const pagedkv::KVCacheGroupSpec& g) {
  switch (g.kind) {
    case pagedkv::AttentionKind::kSlidingWindow: return "swa" + std::to_string(g.window_tokens);
    case pagedkv::AttentionKind::kChunkedLocal: return "chunk" + std::to_string(g.window_tokens);
    case pagedkv::AttentionKind::kRecurrent: return "mamba";
    case pagedkv::AttentionKind::kFull: break;
  }
  return g.block_size != 0 ? "full@" + std::to_string(g.block_size) : "full";
}

std::string describe(const ModelLayers& m) {
  std::string s;
  for (std::size_t g = 0; g < m.groups.size(); ++g) s += (g ? "," : "") + group_label(m.groups[g]);
  return s + " x" + std::to_string(m.layers_per_group);
}

/// Requests that any manager of this pool can never run (every group holding the whole request): skipped by both.
std::size_t blocks_for(std::size_t tokens, std::uint32_t bs) { return (tokens + bs - 1) / bs; }

/// Fixed-capacity per-group metadata buffers, grown when a step needs more.
class GroupBuffers {
 public:
  explicit GroupBuffers(std::size_t groups) : g_(groups), views_(groups) {}
  /// Views for a step of `batch` sequences, `indices` page-table entries and `tokens` new slots per group, and
  /// `swap_out` / `swap_in` pairs of the host tier's copies (group 0's lists).
  std::span<const pagedkv::BatchMetadataBuffers> view(std::size_t batch, std::size_t indices, std::size_t tokens,
                                                      std::size_t swap_out = 0, std::size_t swap_in = 0) {
    const auto grow = [](auto& v, std::size_t n) {
      if (v.size() < n) v.resize(std::max(n, 2 * v.size()));
    };
    grow(indptr_, g_ * (batch + 1));
    grow(qo_, g_ * (batch + 1));
    grow(lpl_, g_ * std::max<std::size_t>(batch, 1));
    grow(lens_, g_ * std::max<std::size_t>(batch, 1));
    grow(indices_, g_ * std::max<std::size_t>(indices, 1));
    grow(slots_, g_ * std::max<std::size_t>(tokens, 1));
    grow(state_, g_ * 2 * std::max<std::size_t>(batch, 1));
    grow(ck_indptr_, g_ * (batch + 1));
    grow(ck_, g_ * 2 * std::max<std::size_t>(tokens, 1));
    grow(swap_out_, 2 * swap_out);
    grow(swap_in_, 2 * swap_in);
    for (std::size_t g = 0; g < g_; ++g) {
      pagedkv::BatchMetadataBuffers& v = views_[g];
      v.indptr = std::span(indptr_).subspan(g * (batch + 1), batch + 1);
      v.qo_indptr = std::span(qo_).subspan(g * (batch + 1), batch + 1);
      v.last_page_len = std::span(lpl_).subspan(g * std::max<std::size_t>(batch, 1), batch);
      v.seq_lens = std::span(lens_).subspan(g * std::max<std::size_t>(batch, 1), batch);
      v.indices = std::span(indices_).subspan(g * std::max<std::size_t>(indices, 1), indices);
      v.slot_mapping = std::span(slots_).subspan(g * std::max<std::size_t>(tokens, 1), tokens);
      // A recurrent group's state and checkpoint outputs (at most one checkpoint per new token).
      const std::size_t sb = 2 * std::max<std::size_t>(batch, 1), cb = 2 * std::max<std::size_t>(tokens, 1);
      v.state_in = std::span(state_).subspan(g * sb, batch);
      v.state_out = std::span(state_).subspan(g * sb + batch, batch);
      v.checkpoint_indptr = std::span(ck_indptr_).subspan(g * (batch + 1), batch + 1);
      v.checkpoint_positions = std::span(ck_).subspan(g * cb, tokens);
      v.checkpoint_blocks = std::span(ck_).subspan(g * cb + tokens, tokens);
      v.swap_out = g == 0 ? std::span(swap_out_).first(2 * swap_out) : std::span<std::int32_t>();
      v.swap_in = g == 0 ? std::span(swap_in_).first(2 * swap_in) : std::span<std::int32_t>();
    }
    return views_;
  }

 private:
  std::size_t g_;
  std::vector<std::int32_t> indptr_, qo_, lpl_, lens_, indices_, state_, ck_indptr_, ck_, swap_out_, swap_in_;
  std::vector<std::int64_t> slots_;
  std::vector<pagedkv::BatchMetadataBuffers> views_;
};

pagedkv::HybridCacheConfig make_config(const ModelLayers& model, const HybridOptions& opt, std::size_t max_len) {
  // Each group gets `capacity_tokens` tokens in its own pages (a coarse group's page holds block_size tokens).
  double blocks = 1.0;
  for (const auto& g : model.groups) {
    const double per_group = std::floor(opt.capacity_tokens / (g.block_size != 0 ? g.block_size : opt.block_size));
    if (!(per_group >= 1.0)) blocks = 0.0;
    blocks += per_group;
  }
  if (!(blocks >= 2.0) || blocks >= 2147483647.0) {
    throw std::invalid_argument("hybrid: capacity " + std::to_string(opt.capacity_tokens) +
                                " tokens gives no block per group or more than 2^31 blocks");
  }
  pagedkv::HybridCacheConfig c;
  c.num_blocks = static_cast<std::size_t>(blocks);
  c.block_size = opt.block_size;
  c.groups = model.groups;
  c.max_tokens_per_seq = max_len;
  return c;
}

/// The hybrid replay's serve row: the serve mode's scheduler (serve_mode.cpp, run_serve_groups) on a pool with
/// the model's groups.
Row serve_row(const Trace& trace, const HybridOptions& opt, const ModelLayers& model, const char* manager,
              bool publish) {
  Options o = opt.base;
  o.capacity_tokens = {opt.capacity_tokens};
  o.groups = model.groups;
  GroupRunLabels labels;
  labels.manager = manager;
  labels.groups = describe(model);
  for (const auto& g : model.groups) labels.group_kinds.push_back(group_label(g));
  labels.publish = publish;
  return run_serve_groups(trace, o, labels);
}

/// The trace's requests one at a time, as --mode prefix: admit (`admitted(result, prompt_len)` sees each admitted
/// one), build its prefill step, free it (`freed(i)` runs after, with the request's index). With a host tier the
/// build carries the tier's copies (`opt`'s offload policy), acknowledged after it. Library calls timed by `timer`.
/// Returns the requests refused.
template <class Manager, class Admitted, class Freed>
std::uint64_t one_at_a_time(const Trace& trace, Manager& m, std::uint32_t block_size, LibraryTimer& timer,
                            const Options& opt, const pagedkv::AdmitOptions& admit_options, Admitted&& admitted,
                            Freed&& freed) {
  GroupBuffers buffers(m.num_groups());
  std::vector<pagedkv::BatchMetadataSizes> sizes(m.num_groups());
  std::vector<pagedkv::TokenId> prompt;
  std::uint64_t rejected = 0;
  std::size_t last_blocks = 0;  // blocks of the last build, every group (bounds write-through's offloads)
  for (std::size_t i = 0; i < trace.requests.size(); ++i) {
    synthesize_prompt(trace, i, prompt);
    const auto r = timer.measure([&] { return m.try_admit(i, prompt, nullptr, admit_options); });
    if (!r.admitted()) {
      ++rejected;
      continue;
    }
    admitted(r, prompt.size());
    const pagedkv::SeqId id = i;
    const std::uint32_t n = static_cast<std::uint32_t>(prompt.size() - r.num_cached_tokens);
    const std::size_t blocks = blocks_for(prompt.size(), block_size);
    const auto [swap_out, swap_in] = swap_extents(m, opt, last_blocks);
    const auto views = buffers.view(1, blocks, n, swap_out, swap_in);
    last_blocks = blocks * m.num_groups();
    timer.measure([&] {
      m.build_batch_metadata(std::span(&id, 1), views, {}, sizes);
      // The engine runs the step (its copies first) and acknowledges them.
      if (sizes[0].transfer_token != 0) m.complete_transfers(sizes[0].transfer_token);
      m.free(id);
    });
    freed(i);
  }
  return rejected;
}

/// One row of the hybrid prefix replay: `model`'s groups on a Manager (opt.base's eviction policies), requests one
/// at a time with opt.base's retention; publishes its events when `publish` (--publish-events).
template <class Manager>
Row prefix_row(const Trace& trace, const HybridOptions& opt, const ModelLayers& model, const char* manager,
               std::size_t past, bool publish) {
  pagedkv::CacheConfig c = make_config(model, opt, 0);
  const bool host = opt.base.host_capacity_tokens > 0;
  if (host) {  // as the device pool: the tokens the all-full model holds, that many blocks per group
    c.num_host_blocks =
        usable_blocks_for(opt.base.host_capacity_tokens, opt.block_size, "--host-capacity-tokens") * model.groups.size() + 1;
    c.offload = opt.base.offload;
  }
  EventPublishing events(publish ? opt.base.publish_events : std::string(), opt.base.publish_wait_ms, model.groups);
  events.configure(c);
  Manager m(c);
  events.attach(m);
  pagedkv::AdmitOptions admit_options;
  admit_options.retention = opt.base.retention;  // applied when the request frees its blocks
  LibraryTimer timer;
  std::uint64_t past_queries = 0, past_hits = 0, hits_beyond_window = 0;
  const std::uint64_t rejected = one_at_a_time(
      trace, m, opt.block_size, timer,  // (a coarse group's page table is shorter than the buffers sized here)
      opt.base, admit_options, [&](const pagedkv::AdmitResult& r, std::size_t prompt_len) {
        if (past > 0 && prompt_len > past) {
          past_queries += prompt_len;
          past_hits += r.num_cached_tokens;
        }
        if (past > 0 && r.num_cached_tokens > past) ++hits_beyond_window;
      },
      [&](std::size_t i) { events.step(m, trace.requests[i].arrival_ms / 1000.0); });
  events.finish();
  const pagedkv::CacheStats s = m.stats();
  Row row;
  row.add("trace", trace.path.stem().string())
      .add("mode", "hybrid-prefix")
      .add("manager", manager)
      .add("groups", describe(model))
      .add("block_size", opt.block_size)
      .add("capacity_tokens", static_cast<std::int64_t>(opt.capacity_tokens));
  if (opt.base.eviction != EvictionKind::kLru) {
    row.add("eviction", to_string(opt.base.eviction)).add("retention", opt.base.retention_label);
  }
  row.add("requests", trace.requests.size())
      .add("rejected", rejected)
      .add("hit_ratio", s.prefix_query_tokens == 0 ? 0.0
                                                   : static_cast<double>(s.prefix_hit_tokens) /
                                                         static_cast<double>(s.prefix_query_tokens), 4)
      .add("past_window_tokens", static_cast<std::int64_t>(past))
      .add("hit_ratio_prompts_past_window",
           past_queries == 0 ? 0.0 : static_cast<double>(past_hits) / static_cast<double>(past_queries), 4)
      .add("hits_longer_than_window", hits_beyond_window)
      .add("evictions", s.evictions);
  if (host) {
    Options per_block = opt.base;  // a block holds one group's layers: 1 / groups of the bytes per token
    per_block.block_size = opt.block_size;
    per_block.kv_bytes_per_token = opt.base.kv_bytes_per_token / model.groups.size();
    row.add("host_capacity_tokens", static_cast<std::int64_t>(opt.base.host_capacity_tokens))
        .add("host_pool_blocks", s.host_num_usable_blocks)
        .add("offload", to_string(opt.base.offload));
    add_tier_fields(row, s, per_block);
  }
  if (events.enabled_at_start()) {
    std::vector<std::string> kinds;
    for (const auto& g : model.groups) kinds.push_back(group_label(g));
    events.add_fields(row, kinds);
  }
  row.add("manager_seconds", timer.seconds(), 3);
  return row;
}

/// One row of the recurrent replay: the model's groups with checkpoints every `interval` tokens (and at each
/// request's last block boundary when `last`), on a pool of `num_blocks` blocks of `block_size` tokens, requests one
/// at a time (admit, build the prefill step, free) as prefix_row; plus the bytes held by cached checkpoints.
template <class Hasher>
Row recurrent_row(const Trace& trace, const HybridOptions& opt, const ModelLayers& model, const std::string& manager,
                  std::uint32_t block_size, std::size_t num_blocks, std::uint32_t interval, bool last) {
  pagedkv::CacheConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.groups = model.groups;
  c.page_size_bytes = std::size_t{block_size} * opt.layer_kv_bytes;
  c.eviction_history = num_blocks;  // miss causes: evicted vs never stored
  c.count_miss_causes = true;
  for (auto& g : c.groups) {
    if (!g.recurrent()) continue;
    g.window_tokens = interval;
    g.state_bytes = opt.state_bytes;
    g.last_checkpoint = last;
  }
  pagedkv::KVCacheManager<Hasher> m(c);
  LibraryTimer timer;
  std::size_t peak_checkpoints = 0;
  const std::uint64_t rejected = one_at_a_time(
      trace, m, block_size, timer, Options{}, pagedkv::AdmitOptions{}, [](const pagedkv::AdmitResult&, std::size_t) {},
      [&](std::size_t) {
        std::size_t checkpoints = 0;
        for (std::size_t g = 0; g < c.groups.size(); ++g) checkpoints += m.is_recurrent(g) ? m.prefix_index(g).size() : 0;
        peak_checkpoints = std::max(peak_checkpoints, checkpoints);
      });
  const pagedkv::CacheStats st = m.stats();
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const double block_bytes = static_cast<double>(m.bytes_per_block());
  Row row;
  row.add("trace", trace.path.stem().string())
      .add("mode", "recurrent-prefix")
      .add("manager", manager)
      .add("groups", describe(model))
      .add("block_size", block_size)
      .add("checkpoint_interval", static_cast<std::int64_t>(interval))
      .add("last_checkpoint", last ? "yes" : "no")
      .add("capacity_tokens", static_cast<std::int64_t>(opt.capacity_tokens))
      .add("pool_gib", block_bytes * static_cast<double>(num_blocks - 1) / gib, 1)
      .add("requests", trace.requests.size())
      .add("rejected", rejected)
      .add("hit_ratio", st.prefix_query_tokens == 0 ? 0.0
                                                    : static_cast<double>(st.prefix_hit_tokens) /
                                                          static_cast<double>(st.prefix_query_tokens), 4)
      .add("peak_checkpoint_gib", block_bytes * static_cast<double>(peak_checkpoints) / gib, 1)
      .add("peak_checkpoint_share", static_cast<double>(peak_checkpoints) / static_cast<double>(num_blocks - 1), 3)
      .add("evictions", st.evictions);
  for (std::size_t k = 0; k < pagedkv::kNumMissCauses; ++k) {
    row.add(std::string("miss_") + pagedkv::to_string(static_cast<pagedkv::MissCause>(k)),
            st.admissions_by_miss_cause[k]);
  }
  row.add("manager_seconds", timer.seconds(), 3);
  return row;
}

/// The recurrent replay (prefix mode): all attention, vLLM's align mode, and checkpoints every interval, on pools
/// of the same bytes (docs/groups.md "Measured: recurrent groups").
template <class Hasher>
std::vector<Row> recurrent_rows(const Trace& trace, const HybridOptions& opt, const ModelLayers& model) {
  if (opt.layer_kv_bytes == 0 || opt.state_bytes == 0) {
    throw std::invalid_argument("recurrent replay: --layer-kv-bytes and --state-bytes must be positive");
  }
  const std::uint32_t bs = opt.block_size;
  // The pool: the bytes of the all-attention model's KV for capacity_tokens tokens.
  const double pool_bytes = opt.capacity_tokens * static_cast<double>(opt.layer_kv_bytes) * model.num_layers;
  // vLLM's page-size unification: the attention block grows until its page holds a state (a multiple of bs).
  const std::size_t per_page = (opt.state_bytes + opt.layer_kv_bytes - 1) / opt.layer_kv_bytes;
  const std::uint32_t unified = static_cast<std::uint32_t>(std::max<std::size_t>(bs, (per_page + bs - 1) / bs * bs));
  const double block_bytes =
      static_cast<double>(std::max<std::size_t>(std::size_t{unified} * opt.layer_kv_bytes, opt.state_bytes)) *
      model.layers_per_group;
  const double blocks = std::floor(pool_bytes / block_bytes);
  if (!(blocks >= static_cast<double>(model.groups.size() * 2)) || blocks >= 2147483646.0) {
    throw std::invalid_argument("recurrent replay: capacity " + std::to_string(opt.capacity_tokens) + " tokens gives " +
                                std::to_string(blocks) + " unified blocks (need 2 per group, below 2^31)");
  }
  const std::size_t num_blocks = static_cast<std::size_t>(blocks) + 1;
  const std::uint32_t never = 2147483647U / unified * unified;  // no checkpoint of the interval inside any prompt
  std::vector<Row> rows;
  {
    HybridOptions a = opt;
    const ModelLayers full = all_full(model);
    Row r = recurrent_row<Hasher>(trace, a, full, "all-attention", bs,
                                  static_cast<std::size_t>(std::floor(pool_bytes / (static_cast<double>(bs) *
                                                                                    static_cast<double>(opt.layer_kv_bytes) *
                                                                                    model.layers_per_group))) + 1,
                                  never, false);
    rows.push_back(std::move(r));
  }
  rows.push_back(recurrent_row<Hasher>(trace, opt, model, "vllm-align", unified, num_blocks, never, true));
  for (const std::uint32_t want : opt.checkpoint_intervals) {
    const std::uint32_t interval = std::max<std::uint32_t>(unified, (want + unified - 1) / unified * unified);
    rows.push_back(recurrent_row<Hasher>(trace, opt, model, "every-" + std::to_string(interval), unified, num_blocks,
                                         interval, false));
    rows.push_back(recurrent_row<Hasher>(trace, opt, model, "every-" + std::to_string(interval) + "+last", unified,
                                         num_blocks, interval, true));
  }
  return rows;
}

}  // namespace

ModelLayers parse_model_layers(std::string_view spec) {
  // kind (full / swa<W> / chunk<C>) -> layers, in first-seen order
  std::vector<std::pair<pagedkv::KVCacheGroupSpec, std::uint64_t>> kinds;
  const auto bad = [&](std::string_view item, const std::string& why) {
    throw std::invalid_argument("--model-layers \"" + std::string(spec) + "\": item \"" + std::string(item) + "\" " +
                                why + " (expected kind:layers items, kind = full, swa<W>, chunk<C> or mamba, "
                                      "e.g. \"full:12,swa4096:24\")");
  };
  const auto number = [&](std::string_view item, std::string_view digits, const char* what) -> std::uint32_t {
    if (digits.empty() || digits.size() > 10 ||
        !std::all_of(digits.begin(), digits.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
      bad(item, std::string("has no valid ") + what);
    }
    const std::uint64_t v = std::stoull(std::string(digits));
    if (v == 0 || v > 2147483647ULL) bad(item, std::string("has ") + what + " " + std::string(digits) + " outside [1, 2^31 - 1]");
    return static_cast<std::uint32_t>(v);
  };
  std::size_t pos = 0;
  if (spec.empty()) bad(spec, "is empty");
  while (pos <= spec.size()) {
    const std::size_t end = std::min(spec.find(',', pos), spec.size());
    const std::string_view item = spec.substr(pos, end - pos);
    const std::size_t colon = item.find(':');
    if (colon == std::string_view::npos) bad(item, "has no ':'");
    const std::string_view kind = item.substr(0, colon);
    pagedkv::KVCacheGroupSpec g;
    if (kind == "full") {
      g.kind = pagedkv::AttentionKind::kFull;
    } else if (kind.starts_with("full@")) {  // a full group with coarse pages of that many tokens
      g.kind = pagedkv::AttentionKind::kFull;
      g.block_size = number(item, kind.substr(5), "page size");
    } else if (kind.starts_with("swa")) {
      g.kind = pagedkv::AttentionKind::kSlidingWindow;
      g.window_tokens = number(item, kind.substr(3), "window");
    } else if (kind.starts_with("chunk")) {
      g.kind = pagedkv::AttentionKind::kChunkedLocal;
      g.window_tokens = number(item, kind.substr(5), "chunk size");
    } else if (kind == "mamba") {
      g.kind = pagedkv::AttentionKind::kRecurrent;  // the checkpoint interval is the recurrent replay's, per row
    } else {
      bad(item, "has an unknown kind \"" + std::string(kind) + "\"");
    }
    const std::uint32_t layers = number(item, item.substr(colon + 1), "layer count");
    auto it = std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) {
      return k.first.kind == g.kind && k.first.window_tokens == g.window_tokens && k.first.block_size == g.block_size;
    });
    if (it == kinds.end()) {
      kinds.emplace_back(g, layers);
    } else {
      it->second += layers;
    }
    pos = end + 1;
  }
  ModelLayers m;
  std::uint64_t gcd = 0, total = 0;
  for (const auto& k : kinds) {
    gcd = std::gcd(gcd, k.second);
    total += k.second;
  }
  if (total > 100000) bad(spec, "has " + std::to_string(total) + " layers (at most 100000)");
  if (total / gcd > pagedkv::HybridKVCacheManager<>::kMaxGroups) {
    bad(spec, "splits into " + std::to_string(total / gcd) + " groups of " + std::to_string(gcd) + " layers (at most " +
                  std::to_string(pagedkv::HybridKVCacheManager<>::kMaxGroups) + ")");
  }
  // Attention kinds at the match unit first, then coarse pages, then recurrent groups: group 0 of a manager is an
  // attention group at the pool's block size.
  std::stable_partition(kinds.begin(), kinds.end(), [](const auto& k) { return !k.first.recurrent(); });
  std::stable_partition(kinds.begin(), kinds.end(), [](const auto& k) { return !k.first.recurrent() && k.first.block_size == 0; });
  if (!kinds.empty() && kinds.front().first.recurrent()) bad(spec, "has no attention layers (a recurrent group needs one)");
  if (!kinds.empty() && kinds.front().first.block_size != 0) {
    bad(spec, "has only coarse-page attention layers (group 0 holds the pool's block size: add a full or window kind)");
  }
  m.layers_per_group = static_cast<std::uint32_t>(gcd);
  m.num_layers = static_cast<std::uint32_t>(total);
  for (const auto& [g, layers] : kinds) {
    for (std::uint64_t i = 0; i < layers / gcd; ++i) {
      pagedkv::KVCacheGroupSpec x = g;
      x.num_layers = m.layers_per_group;
      m.groups.push_back(x);
    }
  }
  return m;
}

ModelLayers all_full(const ModelLayers& model) {
  ModelLayers m = model;
  for (auto& g : m.groups) {
    g.kind = pagedkv::AttentionKind::kFull;
    g.window_tokens = 0;
    g.block_size = 0;  // at the pool's block size
  }
  return m;
}

/// The model with every page at the pool's block size (coarse pages dropped).
ModelLayers at_match_unit(const ModelLayers& model) {
  ModelLayers m = model;
  for (auto& g : m.groups) g.block_size = 0;
  return m;
}

int run_hybrid_serve(const Trace& trace, const HybridOptions& opt, std::ostream& out) {
  if (opt.block_size == 0) throw std::invalid_argument("hybrid: block size 0");
  const ModelLayers model = parse_model_layers(opt.model_layers);
  const ModelLayers baseline = all_full(model);
  std::vector<Row> rows;
  const bool recurrent = std::any_of(model.groups.begin(), model.groups.end(), [](const auto& g) { return g.recurrent(); });
  const auto run = [&]<class H>(std::type_identity<H>) {
    if (recurrent) {
      if (opt.mode != "prefix") throw std::invalid_argument("hybrid: a model with mamba layers replays in --mode prefix");
      rows = recurrent_rows<H>(trace, opt, model);
      return;
    }
    std::uint32_t page = 0;  // the largest coarse page (0: none)
    for (const auto& g : model.groups) page = std::max(page, g.block_size);
    if (page != 0 && opt.mode != "prefix") throw std::invalid_argument("hybrid: a model with coarse pages (full@P) replays in --mode prefix");
    if (opt.mode == "prefix") {
      // "Past the window": prompts longer than the hybrid model's smallest window (the same subset for both rows).
      std::size_t past = 0;
      for (const auto& g : model.groups) {
        if (g.kind != pagedkv::AttentionKind::kFull) past = past == 0 ? g.window_tokens : std::min<std::size_t>(past, g.window_tokens);
      }
      // The eviction policy (no host tier here: its policy is the device pool's, 6 manager types, not 12).
      with_policy(opt.base.eviction, [&]<class E>(std::type_identity<E>) {
        using M = pagedkv::KVCacheManager<H, std::uint32_t, E, E>;
        rows.push_back(prefix_row<M>(trace, opt, model, "hybrid", past, true));
        rows.push_back(prefix_row<M>(trace, opt, baseline, "all-full", past, false));
        if (page != 0) {  // the common-multiple rule (vLLM's): every group's block raised to the largest page
          HybridOptions lcm = opt;
          lcm.block_size = std::lcm(opt.block_size, page);
          rows.push_back(prefix_row<M>(trace, lcm, at_match_unit(model), "lcm-pages", past, false));
        }
      });
      return;
    }
    if (opt.mode != "serve") throw std::invalid_argument("hybrid: mode \"" + opt.mode + "\" (serve or prefix)");
    rows.push_back(serve_row(trace, opt, model, "hybrid", true));
    rows.push_back(serve_row(trace, opt, baseline, "all-full", false));
    const auto bpt = [](const Row& r) {
      for (const Field& f : r.fields()) {
        if (f.name == "blocks_per_token") return std::get<double>(f.value);
      }
      return 0.0;
    };
    const double full_bpt = bpt(rows[1]);
    rows[0].add("memory_saved", full_bpt == 0.0 ? 0.0 : 1.0 - bpt(rows[0]) / full_bpt, 4);
    rows[1].add("memory_saved", 0.0, 4);
  };
  if (opt.xxh3) {
    run(std::type_identity<pagedkv::Xxh3Hasher>{});
  } else {
    run(std::type_identity<pagedkv::Sha256Hasher>{});
  }
  if (opt.json) {
    print_json_lines(out, rows);
  } else {
    print_table(out, rows);
  }
  return 0;
}

}  // namespace replay
