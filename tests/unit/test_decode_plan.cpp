// Tests of the length-aware decode plan (pagedkv/decode_plan.hpp) and of the CPU reference executing it.
//
//  - Coverage: for random ragged batches (empty, tiny and long sequences; 1..8 kv heads; group 1..16; random head
//    tiles, machines and cost knobs; full or reduced buffers), every (request, query head, token < kv_len) is
//    covered by exactly one valid item, counted here by brute force; partial rows, merges and padding are checked
//    the same way, independently of validate_decode_work_list (which must agree).
//  - Balance: every item <= T; the items of a lane differ by at most one token; max item < 1.1 x mean item whenever
//    every non-empty lane is longer than 10 x T (the batch allows it); and for the named shapes of issue 8
//    (64 x 4k, 63 x 4k + 1 x 32k, 1 x 32k, 255 x 4k + 1 x 32k with 8 kv heads on 132 SMs).
//  - batch 64 x 8 kv heads x 4096 tokens on 132 SMs x 6 CTAs/SM (the bf16 d128 decode kernel's occupancy, see
//    docs/kernels.md) splits and fills every slot; with 1 or 2 CTAs/SM it does not split.
//  - Output: the reference executing plans of different granularity (no split, coarse, fine, other head tiles,
//    uniform chunks) gives the same o and lse up to float32 rounding (fp32: 2e-6 relative; fp16/bf16: at most one
//    unit in the last place), and each matches a float64 oracle (1e-5 / 1e-2).
//  - Errors: bad configs and too small buffers change nothing; corrupted lists are rejected by
//    validate_decode_work_list and by reference::decode(p, work_list), which then writes nothing.
//  - Windows (DecodePlanConfig::window): coverage of exactly the visible tokens (brute-force window, none before it)
//    on random batches; a windowed plan is the plan of the visible lengths shifted to the window (balance over visible
//    tokens); 64 x 32k under W = 4096 plans like 64 x 4096; validate_decode_work_list with a window.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <pagedkv/decode_plan.hpp>
#include <pagedkv/reference/decode.hpp>

namespace {

using pagedkv::DecodeMergeItem;
using pagedkv::DecodePlanConfig;
using pagedkv::DecodePlanInfo;
using pagedkv::DecodeWorkItem;
using pagedkv::DecodeWorkList;
using pagedkv::DType;
using pagedkv::Status;

constexpr std::size_t sz(std::int64_t x) { return static_cast<std::size_t>(x); }

std::uint64_t fresh_seed() {
  if (const char* env = std::getenv("PAGEDKV_TEST_SEED"); env != nullptr && *env != '\0') {
    return std::strtoull(env, nullptr, 10);
  }
  static std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

int uniform(std::mt19937_64& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

/// A plan and its buffers, sized by decode_plan_capacity unless told otherwise.
struct Planned {
  DecodePlanConfig cfg;
  std::vector<DecodeWorkItem> items;
  std::vector<DecodeMergeItem> merges;
  std::int32_t rows = 0;
  DecodePlanInfo info;
  Status status = Status::kInvalidValue;
};

Planned plan(const std::vector<std::int32_t>& lens, const DecodePlanConfig& cfg) {
  Planned p;
  p.cfg = cfg;
  const auto cap = pagedkv::decode_plan_capacity(static_cast<std::int32_t>(lens.size()), cfg);
  p.items.resize(sz(cap.items));
  p.merges.resize(sz(cap.merges));
  p.rows = cap.partial_rows;
  p.status = pagedkv::plan_decode(lens, cfg, {p.items, p.merges, p.rows}, &p.info);
  return p;
}

DecodePlanConfig config(int hq, int hkv, int sms, int cps) {
  DecodePlanConfig c;
  c.num_qo_heads = hq;
  c.num_kv_heads = hkv;
  c.head_dim = 128;
  c.num_sms = sms;
  c.ctas_per_sm = cps;
  return c;
}

/// The first key a decode query over len tokens sees (it sits at len - 1), from the definition (brute force, not the
/// library's AttentionWindow::first_visible): the smallest t such that every u in [t, len - 1] satisfies (len - 1) - u
/// < W (when W > 0) and u / C == (len - 1) / C (when C > 0). 0 for an empty sequence.
int visible_begin(int len, const pagedkv::AttentionWindow& w) {
  if (len == 0) return 0;
  const int p = len - 1;
  const auto visible = [&](int u) {
    return (w.sliding_window_tokens <= 0 || p - u < w.sliding_window_tokens) &&
           (w.attention_chunk_tokens <= 0 || u / w.attention_chunk_tokens == p / w.attention_chunk_tokens);
  };
  int t = p;
  while (t > 0 && visible(t - 1)) --t;
  return t;
}

/// Every property of a plan, checked by brute force (independently of validate_decode_work_list, which must agree).
/// With cfg.window, "every token" means every visible token [visible_begin, len), and no item may reach before it.
void check_plan(const std::vector<std::int32_t>& lens, const DecodePlanConfig& cfg, const DecodeWorkList& wl,
                const DecodePlanInfo& info) {
  const int batch = static_cast<int>(lens.size());
  const int hq = cfg.num_qo_heads, hkv = cfg.num_kv_heads, group = hq / hkv;
  const int hpt = wl.heads_per_tile;
  REQUIRE(hpt >= 1);
  REQUIRE(hpt <= group);
  const int tiles = (group + hpt - 1) / hpt;
  // Token coverage, per (request, query head, token): a count.
  std::vector<std::int64_t> base(sz(batch) + 1, 0);
  for (int b = 0; b < batch; ++b) base[sz(b) + 1] = base[sz(b)] + std::int64_t{lens[sz(b)]} * hq;
  std::vector<std::uint8_t> covered(sz(base[sz(batch)]), 0);
  std::vector<int> empty_seen(sz(batch) * sz(hq), 0);        // items on empty sequences, per (b, h)
  std::vector<std::int64_t> row_writes(sz(wl.partial_row_capacity) * sz(hq), 0);
  std::vector<std::vector<int>> req_rows(sz(batch));             // partial rows used by request b (any head)
  std::vector<int> whole_items(sz(batch) * sz(hq), 0);          // items with partial_row -1 per (b, h)
  int valid = 0, nonempty = 0, max_item = 0, bad_padding = 0;
  std::int64_t tokens = 0;
  for (int i = 0; i < wl.item_capacity; ++i) {
    const DecodeWorkItem& it = wl.items[i];
    if (it.valid == 0) {
      bad_padding += it.request != -1 ? 1 : 0;  // plan_decode's padding
      continue;
    }
    ++valid;
    // One assertion per broken item (not per field), to keep the counts readable.
    if (!(it.request >= 0 && it.request < batch && it.kv_head >= 0 && it.kv_head < hkv && it.head_tile >= 0 &&
          it.head_tile < tiles && it.reserved == 0)) {
      FAIL("item " << i << " names request " << it.request << ", kv head " << it.kv_head << ", tile " << it.head_tile);
    }
    const int len = lens[sz(it.request)];
    if (!(it.kv_begin >= visible_begin(len, cfg.window) && it.kv_begin <= it.kv_end && it.kv_end <= len)) {
      FAIL("item " << i << " range [" << it.kv_begin << ", " << it.kv_end << ") of a " << len
                   << "-token sequence whose first visible token is " << visible_begin(len, cfg.window));
    }
    const int n = it.kv_end - it.kv_begin;
    max_item = std::max(max_item, n);
    if (n > 0) {
      ++nonempty;
      tokens += n;
    }
    for (int hl = 0; hl < hpt && it.head_tile * hpt + hl < group; ++hl) {
      const int h = it.kv_head * group + it.head_tile * hpt + hl;
      if (len == 0) {
        if (n != 0 || it.partial_row != -1) FAIL("item " << i << " of an empty sequence has tokens or a partial row");
        ++empty_seen[sz(it.request) * sz(hq) + sz(h)];
        continue;
      }
      if (n == 0) FAIL("item " << i << " of a non-empty sequence is empty");
      for (int t = it.kv_begin; t < it.kv_end; ++t) {
        ++covered[sz(base[sz(it.request)] + std::int64_t{h} * len + t)];
      }
      if (it.partial_row < 0) {
        if (it.partial_row != -1) FAIL("item " << i << " partial row " << it.partial_row);
        ++whole_items[sz(it.request) * sz(hq) + sz(h)];
      } else {
        if (it.partial_row >= wl.partial_row_capacity) FAIL("item " << i << " partial row " << it.partial_row);
        ++row_writes[sz(it.partial_row) * sz(hq) + sz(h)];
        req_rows[sz(it.request)].push_back(it.partial_row);
      }
    }
  }
  CHECK(bad_padding == 0);
  CHECK(valid == info.num_items);
  CHECK(nonempty == info.nonempty_items);
  CHECK(max_item == info.max_item_tokens);
  CHECK(tokens == info.total_tokens);  // each lane's items add up to its length
  // Each visible (request, head, token) exactly once, the tokens before the window never.
  std::int64_t bad_cover = -1;
  for (int b = 0; b < batch && bad_cover < 0; ++b) {
    const int len = lens[sz(b)], first = visible_begin(len, cfg.window);
    for (int h = 0; h < hq && bad_cover < 0; ++h) {
      for (int t = 0; t < len; ++t) {
        const std::int64_t i = base[sz(b)] + std::int64_t{h} * len + t;
        if (covered[sz(i)] != (t >= first ? 1 : 0)) {
          bad_cover = i;
          break;
        }
      }
    }
  }
  INFO("first (request, head, token) not covered as it should be: flat index " << bad_cover);
  CHECK(bad_cover == -1);
  std::int64_t visible_tokens = 0;  // over all lanes: what the plan balances
  for (int b = 0; b < batch; ++b) {
    visible_tokens += std::int64_t{lens[sz(b)] - visible_begin(lens[sz(b)], cfg.window)} * hkv * tiles;
  }
  CHECK(info.total_tokens == visible_tokens);
  int bad_empty = 0;  // an empty sequence's (b, h) must be written (o = 0, lse = -inf) by exactly one item
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < hq; ++h) bad_empty += lens[sz(b)] == 0 && empty_seen[sz(b) * sz(hq) + sz(h)] != 1 ? 1 : 0;
  }
  CHECK(bad_empty == 0);
  // Rows: a request is split iff it has rows; every (row, head) of a split request written exactly once; no other
  // head writes o directly for it.
  std::vector<int> merge_count(sz(batch), 0);
  int bad_rows = 0;
  for (int i = 0; i < wl.merge_capacity; ++i) {
    const DecodeMergeItem& m = wl.merges[i];
    if (m.valid == 0) {
      bad_padding += m.request != -1 ? 1 : 0;
      continue;
    }
    if (m.request < 0 || m.request >= batch || m.num_partials < 2) FAIL("merge " << i << " of request " << m.request);
    ++merge_count[sz(m.request)];
    for (int r = m.partial_begin; r < m.partial_begin + m.num_partials; ++r) {
      if (r < 0 || r >= wl.partial_row_capacity) FAIL("merge " << i << " row " << r);
      for (int h = 0; h < hq; ++h) bad_rows += row_writes[sz(r) * sz(hq) + sz(h)] != 1 ? 1 : 0;
    }
    auto rows = req_rows[sz(m.request)];
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    CHECK(static_cast<int>(rows.size()) == m.num_partials);
    if (!rows.empty()) {
      CHECK(rows.front() == m.partial_begin);
      CHECK(rows.back() == m.partial_begin + m.num_partials - 1);
    }
  }
  CHECK(bad_rows == 0);
  CHECK(bad_padding == 0);
  int merges = 0, bad_merges = 0, bad_whole = 0;
  for (int b = 0; b < batch; ++b) {
    const bool split = !req_rows[sz(b)].empty();
    bad_merges += merge_count[sz(b)] != (split ? 1 : 0) ? 1 : 0;
    merges += merge_count[sz(b)];
    for (int h = 0; h < hq && lens[sz(b)] > 0; ++h) {
      bad_whole += whole_items[sz(b) * sz(hq) + sz(h)] != (split ? 0 : 1) ? 1 : 0;
    }
  }
  CHECK(bad_merges == 0);
  CHECK(bad_whole == 0);
  CHECK(merges == info.num_merges);
  // Bounds: no item above T when something is split; items of a lane differ by at most one token.
  if (info.chunk_target_tokens > 0) CHECK(info.max_item_tokens <= info.chunk_target_tokens);
  std::vector<int> lo(sz(batch), std::numeric_limits<int>::max()), hi(sz(batch), 0);
  for (int i = 0; i < wl.item_capacity; ++i) {
    const DecodeWorkItem& it = wl.items[i];
    if (it.valid == 0 || it.kv_head != 0 || it.head_tile != 0) continue;
    lo[sz(it.request)] = std::min(lo[sz(it.request)], it.kv_end - it.kv_begin);
    hi[sz(it.request)] = std::max(hi[sz(it.request)], it.kv_end - it.kv_begin);
  }
  int uneven = 0;
  for (int b = 0; b < batch; ++b) uneven += hi[sz(b)] - lo[sz(b)] > 1 ? 1 : 0;
  CHECK(uneven == 0);
  // The library's own checker agrees.
  CHECK(pagedkv::to_string(pagedkv::validate_decode_work_list(lens, hq, hkv, wl, cfg.window)) ==
        std::string("success"));
}

/// A random ragged batch: a mix of empty, tiny, medium and long sequences.
std::vector<std::int32_t> ragged_lengths(std::mt19937_64& rng, int batch, int max_len) {
  std::vector<std::int32_t> lens(sz(batch));
  for (auto& l : lens) {
    switch (uniform(rng, 0, 5)) {
      case 0: l = 0; break;
      case 1: l = uniform(rng, 1, 16); break;
      case 2: l = uniform(rng, 17, 700); break;
      default: l = uniform(rng, 1, max_len); break;
    }
  }
  return lens;
}

}  // namespace

TEST_CASE("plan_decode covers every (request, head, token) exactly once for random ragged batches",
          "[decode_plan][coverage]") {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  int split_plans = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int hkv = 1 << uniform(rng, 0, 3);
    const int group = std::vector<int>{1, 2, 3, 4, 6, 8, 12, 16}[sz(uniform(rng, 0, 7))];
    DecodePlanConfig cfg = config(hkv * group, hkv, uniform(rng, 1, 160), uniform(rng, 1, 8));
    cfg.heads_per_tile = uniform(rng, 0, group);
    cfg.min_chunk_tokens = std::vector<int>{1, 16, 64, 256}[sz(uniform(rng, 0, 3))];
    cfg.item_overhead_tokens = uniform(rng, 0, 256);
    cfg.max_waves = uniform(rng, 0, 12);
    const int batch = uniform(rng, 0, 48);
    // Keep batch * max_len * heads small enough for the brute-force coverage counter.
    const int max_len = std::max(1, std::min(40000, 24'000'000 / std::max(1, batch * hkv * group)));
    const std::vector<std::int32_t> lens = ragged_lengths(rng, batch, max_len);
    CAPTURE(trial, batch, hkv, group, cfg.heads_per_tile, cfg.num_sms, cfg.ctas_per_sm, cfg.min_chunk_tokens,
            cfg.item_overhead_tokens, cfg.max_waves, lens);
    const auto cap = pagedkv::decode_plan_capacity(batch, cfg);
    // Full buffers, or reduced ones (the plan must stay within them; no split when nothing else fits).
    const bool reduced = uniform(rng, 0, 3) == 0;
    const int lanes = batch * hkv * pagedkv::decode_num_head_tiles(group, cfg.heads_per_tile);
    std::vector<DecodeWorkItem> items(sz(reduced ? uniform(rng, lanes, cap.items) : cap.items));
    std::vector<DecodeMergeItem> merges(sz(cap.merges + (reduced ? uniform(rng, 0, 3) : 0)));
    const int rows = reduced ? uniform(rng, 0, cap.partial_rows) : cap.partial_rows;
    // Stale garbage from a "previous step": everything must be overwritten.
    for (auto& it : items) it = DecodeWorkItem{7, 7, 7, 1, 3, 9, 5, 0};
    for (auto& m : merges) m = DecodeMergeItem{3, 1, 4, 1};
    DecodePlanInfo info;
    REQUIRE(pagedkv::plan_decode(lens, cfg, {items, merges, rows}, &info) == Status::kSuccess);
    CHECK(info.num_items <= static_cast<int>(items.size()));
    CHECK(info.num_partial_rows <= rows);
    CHECK(info.num_lanes == lanes);
    const DecodeWorkList wl = info.work_list;
    CHECK(wl.items == items.data());
    CHECK(wl.item_capacity == static_cast<int>(items.size()));
    check_plan(lens, cfg, wl, info);
    split_plans += info.num_merges > 0 ? 1 : 0;
  }
  CHECK(split_plans >= 50);  // the random batches really exercise splitting
}

TEST_CASE("plan_decode balances items: max < 1.1 x mean when every lane is longer than 10 chunk targets",
          "[decode_plan][balance]") {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  int allowed = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int hkv = 1 << uniform(rng, 0, 3);
    const int group = uniform(rng, 1, 8);
    DecodePlanConfig cfg = config(hkv * group, hkv, uniform(rng, 16, 132), uniform(rng, 1, 8));
    cfg.min_chunk_tokens = std::vector<int>{16, 64, 128, 256}[sz(uniform(rng, 0, 3))];
    const int batch = uniform(rng, 1, 8);
    std::vector<std::int32_t> lens(sz(batch));
    for (auto& l : lens) l = uniform(rng, 2048, 65536);
    CAPTURE(trial, lens, hkv, group, cfg.num_sms, cfg.ctas_per_sm, cfg.min_chunk_tokens);
    const Planned p = plan(lens, cfg);
    REQUIRE(p.status == Status::kSuccess);
    const int t = p.info.chunk_target_tokens;
    if (t == 0) continue;
    CHECK(p.info.max_item_tokens <= t);
    const bool allows = std::all_of(lens.begin(), lens.end(), [&](std::int32_t l) { return l > 10 * t; });
    if (!allows) continue;
    ++allowed;
    CAPTURE(t, p.info.max_item_tokens, p.info.mean_item_tokens);
    CHECK(p.info.max_item_tokens < 1.1 * p.info.mean_item_tokens);
  }
  CHECK(allowed >= 100);  // the condition held often enough for the bound to be tested
}

TEST_CASE("plan_decode on issue 8's shapes: 132 SMs, 8 kv heads, group 4", "[decode_plan][shapes]") {
  // 6 CTAs/SM: the bf16 x d128 decode kernel (128 threads, 32 KiB static shared memory, 72 registers) on sm_90,
  // limited by shared memory (228 KiB per SM); cuda::decode_plan_config reads the real value from the occupancy API.
  const DecodePlanConfig cfg = config(32, 8, 132, 6);
  const int slots = 132 * 6;

  SECTION("batch 64 x 4096 splits to fill every CTA slot") {
    const std::vector<std::int32_t> lens(64, 4096);
    const Planned p = plan(lens, cfg);
    REQUIRE(p.status == Status::kSuccess);
    check_plan(lens, cfg, p.info.work_list, p.info);
    CHECK(p.info.num_merges == 64);              // every request split
    CHECK(p.info.nonempty_items >= slots);       // at least one full wave of 792 CTAs
    CHECK(p.info.max_item_tokens <= 1.1 * p.info.mean_item_tokens);
    // With 1 or 2 CTAs per SM the 512 lanes already fill 3.9 / 1.9 waves: no split.
    for (const int cps : {1, 2}) {
      const Planned q = plan(lens, config(32, 8, 132, cps));
      CHECK(q.info.num_merges == 0);
      CHECK(q.info.num_items == 512);
    }
  }
  SECTION("ragged 63 x 4096 + 1 x 32768: the long request no longer runs alone") {
    std::vector<std::int32_t> lens(63, 4096);
    lens.push_back(32768);
    const Planned p = plan(lens, cfg);
    REQUIRE(p.status == Status::kSuccess);
    check_plan(lens, cfg, p.info.work_list, p.info);
    CHECK(p.info.max_item_tokens < 1.1 * p.info.mean_item_tokens);
    CHECK(p.info.max_item_tokens <= 4096);
    // LPT order: the longest items come first.
    CHECK(p.items[0].kv_end - p.items[0].kv_begin == p.info.max_item_tokens);
  }
  SECTION("ragged 255 x 4096 + 1 x 32768") {
    std::vector<std::int32_t> lens(255, 4096);
    lens.push_back(32768);
    const Planned p = plan(lens, cfg);
    REQUIRE(p.status == Status::kSuccess);
    check_plan(lens, cfg, p.info.work_list, p.info);
    CHECK(p.info.max_item_tokens < 1.1 * p.info.mean_item_tokens);
  }
  SECTION("batch 1 x 32768: about one item per slot") {
    const std::vector<std::int32_t> lens{32768};
    const Planned p = plan(lens, cfg);
    REQUIRE(p.status == Status::kSuccess);
    check_plan(lens, cfg, p.info.work_list, p.info);
    CHECK(p.info.nonempty_items >= slots - 8);
    CHECK(p.info.nonempty_items <= slots);
    CHECK(p.info.max_item_tokens - (32768 / (p.info.nonempty_items / 8)) <= 1);
  }
  SECTION("a batch of padding only: one item per lane, nothing split") {
    const std::vector<std::int32_t> lens(5, 0);
    const Planned p = plan(lens, cfg);
    REQUIRE(p.status == Status::kSuccess);
    CHECK(p.info.num_items == 5 * 8);
    CHECK(p.info.nonempty_items == 0);
    check_plan(lens, cfg, p.info.work_list, p.info);
  }
}

TEST_CASE("plan_decode is deterministic, stays within any buffers it accepts, and rejects bad input unchanged",
          "[decode_plan][errors]") {
  std::vector<std::int32_t> lens(20, 3000);
  lens[3] = 0;
  lens[7] = 40000;
  const DecodePlanConfig cfg = config(16, 4, 100, 4);
  const Planned a = plan(lens, cfg);
  const Planned b = plan(lens, cfg);
  REQUIRE(a.status == Status::kSuccess);
  CHECK(std::memcmp(a.items.data(), b.items.data(), a.items.size() * sizeof(DecodeWorkItem)) == 0);
  CHECK(std::memcmp(a.merges.data(), b.merges.data(), a.merges.size() * sizeof(DecodeMergeItem)) == 0);

  // No partial rows: nothing may be split.
  {
    std::vector<DecodeWorkItem> items(a.items.size());
    std::vector<DecodeMergeItem> merges(a.merges.size());
    DecodePlanInfo info;
    REQUIRE(pagedkv::plan_decode(lens, cfg, {items, merges, 0}, &info) == Status::kSuccess);
    CHECK(info.num_merges == 0);
    CHECK(info.num_items == 20 * 4);
  }

  std::vector<DecodeWorkItem> items(a.items.size(), DecodeWorkItem{1, 2, 3, 1, 4, 5, 6, 0});
  std::vector<DecodeMergeItem> merges(a.merges.size(), DecodeMergeItem{1, 2, 3, 1});
  std::int32_t rows = a.rows;
  DecodePlanConfig bad = cfg;
  std::vector<std::int32_t> bad_lens = lens;
  std::size_t n_items = items.size(), n_merges = merges.size();
  SECTION("num_qo_heads not a multiple of num_kv_heads") { bad.num_qo_heads = 6; }
  SECTION("num_kv_heads 0") { bad.num_kv_heads = 0; }
  SECTION("head_dim 0") { bad.head_dim = 0; }
  SECTION("heads_per_tile above the group") { bad.heads_per_tile = 5; }
  SECTION("num_sms 0") { bad.num_sms = 0; }
  SECTION("ctas_per_sm 0") { bad.ctas_per_sm = 0; }
  SECTION("min_chunk_tokens 0") { bad.min_chunk_tokens = 0; }
  SECTION("negative overhead") { bad.item_overhead_tokens = -1; }
  SECTION("max_waves 65") { bad.max_waves = 65; }
  SECTION("negative length") { bad_lens[5] = -1; }
  SECTION("fewer items than lanes") { n_items = 20 * 4 - 1; }
  SECTION("fewer merge slots than requests") { n_merges = 19; }
  SECTION("negative partial rows") { rows = -1; }
  const auto items_before = items;
  const auto merges_before = merges;
  DecodePlanInfo info;
  info.num_items = 12345;
  CHECK(pagedkv::plan_decode(bad_lens, bad, {std::span(items).first(n_items), std::span(merges).first(n_merges), rows},
                             &info) == Status::kInvalidValue);
  CHECK(std::memcmp(items.data(), items_before.data(), items.size() * sizeof(DecodeWorkItem)) == 0);
  CHECK(std::memcmp(merges.data(), merges_before.data(), merges.size() * sizeof(DecodeMergeItem)) == 0);
  CHECK(info.num_items == 12345);
}

TEST_CASE("decode_plan_capacity is enough for any lengths", "[decode_plan][capacity]") {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 200; ++trial) {
    DecodePlanConfig cfg = config(8 * uniform(rng, 1, 4), 8, uniform(rng, 1, 200), uniform(rng, 1, 16));
    cfg.heads_per_tile = uniform(rng, 0, cfg.num_qo_heads / 8);
    cfg.min_chunk_tokens = uniform(rng, 1, 300);
    cfg.item_overhead_tokens = uniform(rng, 0, 300);
    cfg.max_waves = uniform(rng, 0, 64);
    const int batch = uniform(rng, 1, 300);
    std::vector<std::int32_t> lens(sz(batch));
    for (auto& l : lens) l = uniform(rng, 0, 1) == 0 ? uniform(rng, 0, 100) : uniform(rng, 0, 1 << 20);
    const Planned p = plan(lens, cfg);
    CAPTURE(trial, batch, cfg.num_sms, cfg.ctas_per_sm, cfg.min_chunk_tokens, cfg.item_overhead_tokens, cfg.max_waves);
    REQUIRE(p.status == Status::kSuccess);
    // The chosen candidate never had to be dropped for space: a plan with unbounded buffers is identical.
    Planned big;
    big.items.resize(p.items.size() * 4 + 64);
    big.merges.resize(p.merges.size());
    DecodePlanInfo info;
    REQUIRE(pagedkv::plan_decode(lens, cfg, {big.items, big.merges, p.rows * 4 + 64}, &info) == Status::kSuccess);
    CHECK(info.num_items == p.info.num_items);
    CHECK(info.chunk_target_tokens == p.info.chunk_target_tokens);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The reference executing plans: same output for every granularity, float64 oracle, invalid lists rejected.

namespace {

/// A tiny paged batch in host memory (NHD, separate K/V), unused slots NaN, random non-zero K/V and q.
struct Batch {
  DType dt;
  int bs, hkv, hq, dim;
  std::vector<std::int32_t> lens, indptr{0}, indices, last;
  std::vector<std::uint16_t> k16, v16, q16;
  std::vector<float> k32, v32, q32;
  pagedkv::KVPoolView kv;
  int num_blocks = 1;

  Batch(std::mt19937_64& rng, DType d, std::vector<std::int32_t> l, int block_size, int kv_heads, int group, int head_dim)
      : dt(d), bs(block_size), hkv(kv_heads), hq(kv_heads * group), dim(head_dim), lens(std::move(l)) {
    for (const std::int32_t len : lens) {
      const int pages = (len + bs - 1) / bs;
      for (int i = 0; i < pages; ++i) indices.push_back(num_blocks++);
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
      last.push_back(pages == 0 ? 0 : len - (pages - 1) * bs);
    }
    if (indices.empty()) indices.push_back(0);
    const std::size_t elems = sz(num_blocks) * sz(bs) * sz(hkv) * sz(dim);
    std::uniform_real_distribution<float> u(0.1f, 1.0f);
    const auto val = [&] { return (rng() & 1) != 0 ? u(rng) : -u(rng); };
    if (dt == DType::kFloat32) {
      k32.assign(elems, std::numeric_limits<float>::quiet_NaN());
      v32 = k32;
      q32.resize(lens.size() * sz(hq) * sz(dim));
      for (auto& x : q32) x = val();
    } else {
      k16.assign(elems, 0x7fff);  // NaN in fp16 and bf16
      v16 = k16;
      q16.resize(lens.size() * sz(hq) * sz(dim));
      for (std::size_t i = 0; i < q16.size(); ++i) pagedkv::reference::store(q16.data(), dt, static_cast<std::int64_t>(i), val());
    }
    void* kp = dt == DType::kFloat32 ? static_cast<void*>(k32.data()) : static_cast<void*>(k16.data());
    void* vp = dt == DType::kFloat32 ? static_cast<void*>(v32.data()) : static_cast<void*>(v16.data());
    kv = pagedkv::KVPoolView::separate_nhd(kp, vp, dt, num_blocks, bs, hkv, dim);
    for (std::size_t b = 0; b < lens.size(); ++b) {
      for (int t = 0; t < lens[b]; ++t) {
        const std::int32_t blk = indices[sz(indptr[b]) + sz(t / bs)];
        for (int h = 0; h < hkv; ++h) {
          for (int e = 0; e < dim; ++e) {
            const std::int64_t off = kv.offset(blk, t % bs, h) + e;
            pagedkv::reference::store(kv.k, dt, off, val());
            pagedkv::reference::store(kv.v, dt, off, val());
          }
        }
      }
    }
  }
  [[nodiscard]] const void* q() const {
    return dt == DType::kFloat32 ? static_cast<const void*>(q32.data()) : static_cast<const void*>(q16.data());
  }
  [[nodiscard]] int batch() const { return static_cast<int>(lens.size()); }

  /// float64 oracle of o [batch, hq, dim] and lse [batch, hq].
  void oracle(double scale, std::vector<double>& o, std::vector<double>& lse) const {
    o.assign(lens.size() * sz(hq) * sz(dim), 0.0);
    lse.assign(lens.size() * sz(hq), -std::numeric_limits<double>::infinity());
    const int group = hq / hkv;
    for (int b = 0; b < batch(); ++b) {
      for (int h = 0; h < hq; ++h) {
        const std::int64_t row = std::int64_t{b} * hq + h;
        const int n = lens[sz(b)];
        if (n == 0) continue;
        std::vector<double> s(sz(n));
        double m = -std::numeric_limits<double>::infinity();
        for (int t = 0; t < n; ++t) {
          const std::int64_t off = kv.offset(indices[sz(indptr[sz(b)]) + sz(t / bs)], t % bs, h / group);
          double acc = 0;
          for (int e = 0; e < dim; ++e) {
            acc += pagedkv::reference::load(q(), dt, row * dim + e) * pagedkv::reference::load(kv.k, dt, off + e);
          }
          s[sz(t)] = acc * scale;
          m = std::max(m, s[sz(t)]);
        }
        double den = 0;
        for (int t = 0; t < n; ++t) {
          const std::int64_t off = kv.offset(indices[sz(indptr[sz(b)]) + sz(t / bs)], t % bs, h / group);
          const double w = std::exp(s[sz(t)] - m);
          den += w;
          for (int e = 0; e < dim; ++e) o[sz(row * dim + e)] += w * pagedkv::reference::load(kv.v, dt, off + e);
        }
        for (int e = 0; e < dim; ++e) o[sz(row * dim + e)] /= den;
        lse[sz(row)] = m + std::log(den);
      }
    }
  }
};

struct Output {
  std::vector<std::uint32_t> o;  // raw storage (fp32 words, or two 16-bit values per word)
  std::vector<float> lse;
};

/// Runs reference::decode(p, work_list) of `plan` on `bt`; o poisoned with NaN first.
Output run_plan(const Batch& bt, const DecodeWorkList& wl, std::size_t ws_bytes, Status* status) {
  Output out;
  const std::size_t o_elems = sz(bt.batch()) * sz(bt.hq) * sz(bt.dim);
  out.o.assign(bt.dt == DType::kFloat32 ? o_elems : (o_elems + 1) / 2, 0x7fc07fc0u);
  out.lse.assign(sz(bt.batch()) * sz(bt.hq), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> ws(ws_bytes / sizeof(float) + 1, std::numeric_limits<float>::quiet_NaN());
  pagedkv::DecodeParams p;
  p.q = bt.q();
  p.o = out.o.data();
  p.lse = out.lse.data();
  p.kv = bt.kv;
  p.pages = pagedkv::PageTable::csr(bt.batch(), bt.indptr.data(), bt.indices.data(), bt.last.data());
  p.num_qo_heads = bt.hq;
  p.sm_scale = 1.f / std::sqrt(static_cast<float>(bt.dim));
  p.workspace = ws.data();
  p.workspace_bytes = ws.size() * sizeof(float);
  *status = pagedkv::reference::decode(p, wl, 3);
  return out;
}

/// Monotone integer image of a 16-bit float pattern (adjacent representable values differ by 1).
int ordered16(std::uint16_t bits) {
  return (bits & 0x8000u) != 0 ? -static_cast<int>(bits & 0x7fffu) : static_cast<int>(bits);
}

}  // namespace

TEST_CASE("reference::decode gives the same output for plans of different granularity", "[decode_plan][reference]") {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  for (const DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    const int group = uniform(rng, 1, 6), hkv = uniform(rng, 1, 3), dim = 8 * uniform(rng, 1, 8);
    const int bs = std::vector<int>{1, 3, 16}[sz(uniform(rng, 0, 2))];
    std::vector<std::int32_t> lens = {uniform(rng, 1, 900), 0, uniform(rng, 1, 40), uniform(rng, 300, 1500), 1,
                                      uniform(rng, 50, 400)};
    std::shuffle(lens.begin(), lens.end(), rng);
    const Batch bt(rng, dt, lens, bs, hkv, group, dim);
    CAPTURE(static_cast<int>(dt), group, hkv, dim, bs, lens);
    std::vector<double> o_ref, lse_ref;
    bt.oracle(1.0 / std::sqrt(static_cast<double>(dim)), o_ref, lse_ref);
    double max_ref = 0;
    for (const double x : o_ref) max_ref = std::max(max_ref, std::abs(x));
    const double tol = dt == DType::kFloat32 ? 1e-5 : 1e-2;

    // Granularities: no split, coarse, fine (many tiny items), other head tiles, and the uniform-chunk plan.
    std::vector<Output> outs;
    std::vector<std::string> names;
    int splits_seen = 0;
    const auto check_vs_oracle = [&](const Output& out) {
      double err = 0, lse_err = 0;
      for (std::size_t i = 0; i < o_ref.size(); ++i) {
        const double g = pagedkv::reference::load(out.o.data(), dt, static_cast<std::int64_t>(i));
        err = std::max(err, std::isfinite(g) ? std::abs(g - o_ref[i]) : std::numeric_limits<double>::infinity());
      }
      for (std::size_t i = 0; i < lse_ref.size(); ++i) {
        if (std::isinf(lse_ref[i])) {
          CHECK((std::isinf(out.lse[i]) && out.lse[i] < 0));
          continue;
        }
        lse_err = std::max(lse_err, std::abs(out.lse[i] - lse_ref[i]) / std::max(1.0, std::abs(lse_ref[i])));
      }
      CHECK(err / max_ref <= tol);
      CHECK(lse_err <= 1e-5);
    };
    struct Knobs {
      int sms, cps, min_chunk, hpt, waves;
    };
    for (const Knobs k : {Knobs{1, 1, 256, 0, 0}, Knobs{2, 1, 256, 0, 8}, Knobs{8, 4, 1, 0, 8}, Knobs{64, 8, 1, 1, 16},
                          Knobs{3, 2, 7, group, 3}, Knobs{5, 3, 11, std::max(1, group / 2), 8}}) {
      DecodePlanConfig cfg = config(hkv * group, hkv, k.sms, k.cps);
      cfg.head_dim = dim;
      cfg.min_chunk_tokens = k.min_chunk;
      cfg.heads_per_tile = std::min(k.hpt, group);
      cfg.max_waves = k.waves;
      cfg.item_overhead_tokens = 0;
      const Planned p = plan(lens, cfg);
      REQUIRE(p.status == Status::kSuccess);
      splits_seen += p.info.num_merges > 0 ? 1 : 0;
      Status s = Status::kInvalidValue;
      outs.push_back(run_plan(bt, p.info.work_list, p.info.workspace_bytes, &s));
      REQUIRE(s == Status::kSuccess);
      names.push_back("sms " + std::to_string(k.sms) + " x " + std::to_string(k.cps) + ", items " +
                      std::to_string(p.info.num_items) + ", merges " + std::to_string(p.info.num_merges));
      check_vs_oracle(outs.back());
    }
    {  // the uniform-chunk plan of decode(p) with kv_chunk_size_tokens = 37
      const int chunk = 37, max_chunks = 1500 / chunk + 1;
      std::vector<DecodeWorkItem> items(sz(bt.batch()) * sz(hkv) * sz(max_chunks));
      std::vector<DecodeMergeItem> merges(sz(bt.batch()));
      const pagedkv::DecodePlanBuffers buf{items, merges, bt.batch() * max_chunks};
      REQUIRE(pagedkv::plan_decode_uniform_chunks(lens, hkv, chunk, max_chunks, buf) == Status::kSuccess);
      const DecodeWorkList wl{items.data(), static_cast<std::int32_t>(items.size()), merges.data(), bt.batch(), group,
                              buf.partial_row_capacity};
      Status s = Status::kInvalidValue;
      outs.push_back(run_plan(bt, wl, pagedkv::decode_plan_workspace_bytes(buf.partial_row_capacity, bt.hq, dim), &s));
      REQUIRE(s == Status::kSuccess);
      names.push_back("uniform chunks of 37");
      check_vs_oracle(outs.back());
    }
    CHECK(splits_seen >= 3);
    // Pairwise against the unsplit plan: float32 rounding only.
    for (std::size_t j = 1; j < outs.size(); ++j) {
      INFO("plan " << names[j] << " vs " << names[0]);
      double max_diff = 0, max_lse_diff = 0;
      int max_ulps = 0;
      for (std::size_t i = 0; i < o_ref.size(); ++i) {
        const auto idx = static_cast<std::int64_t>(i);
        if (dt == DType::kFloat32) {
          max_diff = std::max<double>(max_diff, std::abs(pagedkv::reference::load(outs[j].o.data(), dt, idx) -
                                                 pagedkv::reference::load(outs[0].o.data(), dt, idx)));
        } else {
          // Two roundings to 16 bits of float32 values that differ by float32 noise (<= 2e-6 of the output scale,
          // as the fp32 check) may land 2+ units apart only where the value is tiny (its unit is below the noise):
          // count units only where the difference exceeds that noise.
          const double da = pagedkv::reference::load(outs[j].o.data(), dt, idx);
          const double db = pagedkv::reference::load(outs[0].o.data(), dt, idx);
          if (std::abs(da - db) <= 2e-6 * max_ref) continue;
          std::uint16_t a, b;
          std::memcpy(&a, reinterpret_cast<const char*>(outs[j].o.data()) + 2 * i, 2);
          std::memcpy(&b, reinterpret_cast<const char*>(outs[0].o.data()) + 2 * i, 2);
          max_ulps = std::max(max_ulps, std::abs(ordered16(a) - ordered16(b)));
        }
      }
      for (std::size_t i = 0; i < lse_ref.size(); ++i) {
        if (std::isinf(lse_ref[i])) {
          CHECK(outs[j].lse[i] == outs[0].lse[i]);
          continue;
        }
        max_lse_diff = std::max<double>(max_lse_diff, std::abs(outs[j].lse[i] - outs[0].lse[i]) /
                                                  std::max(1.0, std::abs(lse_ref[i])));
      }
      CHECK(max_diff <= 2e-6 * max_ref);
      CHECK(max_ulps <= 1);
      CHECK(max_lse_diff <= 2e-6);
    }
  }
}

TEST_CASE("a corrupted work list is rejected and reference::decode writes nothing", "[decode_plan][validation]") {
  std::mt19937_64 rng(99);
  const std::vector<std::int32_t> lens = {700, 0, 90, 1300};
  const Batch bt(rng, DType::kFloat32, lens, 16, 2, 3, 16);
  DecodePlanConfig cfg = config(6, 2, 16, 4);
  cfg.head_dim = 16;
  cfg.min_chunk_tokens = 100;  // the 90-token request stays one item per lane
  cfg.item_overhead_tokens = 0;
  cfg.heads_per_tile = 2;  // tiles of 2 + 1 heads
  Planned p = plan(lens, cfg);
  REQUIRE(p.status == Status::kSuccess);
  REQUIRE(p.info.num_merges >= 2);
  DecodeWorkList wl = p.info.work_list;
  REQUIRE(pagedkv::validate_decode_work_list(lens, 6, 2, wl) == Status::kSuccess);
  // Find a split item and an unsplit non-empty one.
  int split_i = -1, whole_i = -1;
  for (int i = 0; i < p.info.num_items; ++i) {
    if (p.items[sz(i)].partial_row >= 0 && split_i < 0 && p.items[sz(i)].kv_begin > 0) split_i = i;
    if (p.items[sz(i)].partial_row < 0 && p.items[sz(i)].kv_end > 0 && whole_i < 0) whole_i = i;
  }
  REQUIRE(split_i >= 0);
  REQUIRE(whole_i >= 0);
  DecodeWorkItem& s_it = p.items[sz(split_i)];
  DecodeWorkItem& w_it = p.items[sz(whole_i)];
  SECTION("gap in a lane") { s_it.kv_begin += 1; }
  SECTION("overlap in a lane") { s_it.kv_begin -= 1; }
  SECTION("range past the sequence") { w_it.kv_end += 1; }
  SECTION("an item dropped") { s_it.valid = 0; }
  SECTION("an item twice") { p.items[sz(p.info.num_items)] = s_it; }
  SECTION("whole lane writing a partial row") { w_it.partial_row = 0; }
  SECTION("split item writing o directly") { s_it.partial_row = -1; }
  SECTION("partial row out of range") { s_it.partial_row = wl.partial_row_capacity; }
  SECTION("two chunks on one row") {
    for (auto& it : p.items) {
      if (it.valid != 0 && it.request == s_it.request && it.kv_head == s_it.kv_head &&
          it.head_tile == s_it.head_tile && it.partial_row != s_it.partial_row) {
        it.partial_row = s_it.partial_row;
        break;
      }
    }
  }
  SECTION("merge missing") { p.merges[0].valid = 0; }
  SECTION("merge twice") { p.merges[sz(p.info.num_merges)] = p.merges[0]; }
  SECTION("merge with the wrong rows") { p.merges[0].partial_begin += 1; }
  SECTION("merge of an unsplit request") { p.merges[sz(p.info.num_merges)] = DecodeMergeItem{1, 0, 2, 1}; }
  SECTION("request out of range") { w_it.request = 4; }
  SECTION("head tile out of range") { w_it.head_tile = 2; }
  SECTION("heads_per_tile above the group") { wl.heads_per_tile = 4; }
  CHECK(pagedkv::validate_decode_work_list(lens, 6, 2, wl) == Status::kInvalidValue);
  Status s = Status::kSuccess;
  const Output out = run_plan(bt, wl, p.info.workspace_bytes, &s);
  CHECK(s == Status::kInvalidValue);
  CHECK(std::all_of(out.o.begin(), out.o.end(), [](std::uint32_t w) { return w == 0x7fc07fc0u; }));
  CHECK(std::all_of(out.lse.begin(), out.lse.end(), [](float x) { return std::isnan(x); }));
}

TEST_CASE("reference::decode(p, work_list) needs the workspace the list's rows name", "[decode_plan][validation]") {
  std::mt19937_64 rng(5);
  const std::vector<std::int32_t> lens = {400, 33};
  const Batch bt(rng, DType::kBFloat16, lens, 8, 1, 2, 32);
  DecodePlanConfig cfg = config(2, 1, 2, 2);
  cfg.head_dim = 32;
  cfg.min_chunk_tokens = 16;
  const Planned p = plan(lens, cfg);
  REQUIRE(p.info.num_merges >= 1);
  Status s = Status::kSuccess;
  (void)run_plan(bt, p.info.work_list, 0, &s);  // a 4-byte workspace
  CHECK(s == Status::kInvalidValue);
  (void)run_plan(bt, p.info.work_list, p.info.workspace_bytes, &s);
  CHECK(s == Status::kSuccess);
}

// ---------------------------------------------------------------------------------------------------------------
// Windows (DecodePlanConfig::window: sliding window W and / or chunked-local attention C): the plan covers exactly
// the visible tokens [first visible, kv_len) of each request and balances those.

namespace {

/// A random window: sliding only, chunked only, or both, with W = 1 and sizes around the lengths.
pagedkv::AttentionWindow random_window(std::mt19937_64& rng, int max_len) {
  const int hi = std::max(2, max_len);
  switch (uniform(rng, 0, 3)) {
    case 0: return {uniform(rng, 1, hi), 0};
    case 1: return {0, uniform(rng, 1, hi)};
    case 2: return {uniform(rng, 1, hi), uniform(rng, 1, hi)};
    default: return {1, 0};
  }
}

}  // namespace

TEST_CASE("plan_decode with a window covers exactly the visible tokens of random ragged batches",
          "[decode_plan][coverage][window]") {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  int split_plans = 0, windowed_requests = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int hkv = 1 << uniform(rng, 0, 3);
    const int group = std::vector<int>{1, 2, 3, 4, 6, 8}[sz(uniform(rng, 0, 5))];
    DecodePlanConfig cfg = config(hkv * group, hkv, uniform(rng, 1, 160), uniform(rng, 1, 8));
    cfg.heads_per_tile = uniform(rng, 0, group);
    cfg.min_chunk_tokens = std::vector<int>{1, 16, 64, 256}[sz(uniform(rng, 0, 3))];
    cfg.item_overhead_tokens = uniform(rng, 0, 256);
    cfg.max_waves = uniform(rng, 0, 12);
    const int batch = uniform(rng, 0, 40);
    const int max_len = std::max(1, std::min(20000, 16'000'000 / std::max(1, batch * hkv * group)));
    const std::vector<std::int32_t> lens = ragged_lengths(rng, batch, max_len);
    cfg.window = random_window(rng, uniform(rng, 1, 2) == 1 ? 64 : max_len);
    CAPTURE(trial, batch, hkv, group, cfg.heads_per_tile, cfg.num_sms, cfg.ctas_per_sm, cfg.min_chunk_tokens,
            cfg.window.sliding_window_tokens, cfg.window.attention_chunk_tokens, lens);
    const Planned p = plan(lens, cfg);
    REQUIRE(p.status == Status::kSuccess);
    check_plan(lens, cfg, p.info.work_list, p.info);
    split_plans += p.info.num_merges > 0 ? 1 : 0;
    for (const std::int32_t len : lens) windowed_requests += visible_begin(len, cfg.window) > 0 ? 1 : 0;
  }
  CHECK(split_plans >= 30);
  CHECK(windowed_requests >= 500);  // the windows really cut most requests
}

TEST_CASE("plan_decode with a window is the plan of the visible lengths, shifted to the window",
          "[decode_plan][balance][window]") {
  // Balance is over visible tokens: planning kv_len with the window must give the very plan of the visible lengths
  // without a window, every item moved by its request's first visible token (same T, same items, same rows).
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  int differs_from_unwindowed = 0;
  for (int trial = 0; trial < 150; ++trial) {
    const int hkv = 1 << uniform(rng, 0, 3);
    const int group = uniform(rng, 1, 8);
    DecodePlanConfig cfg = config(hkv * group, hkv, uniform(rng, 1, 132), uniform(rng, 1, 8));
    cfg.min_chunk_tokens = std::vector<int>{1, 16, 64, 256}[sz(uniform(rng, 0, 3))];
    const int batch = uniform(rng, 1, 64);
    const std::vector<std::int32_t> lens = ragged_lengths(rng, batch, 40000);
    DecodePlanConfig wcfg = cfg;
    wcfg.window = random_window(rng, 8192);
    CAPTURE(trial, lens, wcfg.window.sliding_window_tokens, wcfg.window.attention_chunk_tokens);
    std::vector<std::int32_t> visible(lens.size());
    for (std::size_t b = 0; b < lens.size(); ++b) visible[b] = lens[b] - visible_begin(lens[b], wcfg.window);
    const Planned w = plan(lens, wcfg);
    const Planned v = plan(visible, cfg);
    const Planned full = plan(lens, cfg);
    REQUIRE(w.status == Status::kSuccess);
    REQUIRE(v.status == Status::kSuccess);
    CHECK(w.info.num_items == v.info.num_items);
    CHECK(w.info.chunk_target_tokens == v.info.chunk_target_tokens);
    CHECK(w.info.max_item_tokens == v.info.max_item_tokens);
    CHECK(w.info.total_tokens == v.info.total_tokens);
    CHECK(w.info.estimated_cost == v.info.estimated_cost);
    int bad_items = 0;
    for (std::size_t i = 0; i < w.items.size(); ++i) {
      DecodeWorkItem shifted = v.items[i];
      if (shifted.valid != 0) {
        const int first = visible_begin(lens[sz(shifted.request)], wcfg.window);
        shifted.kv_begin += first;
        shifted.kv_end += first;
      }
      bad_items += std::memcmp(&shifted, &w.items[i], sizeof(DecodeWorkItem)) != 0 ? 1 : 0;
    }
    CHECK(bad_items == 0);
    CHECK(std::memcmp(w.merges.data(), v.merges.data(), w.merges.size() * sizeof(DecodeMergeItem)) == 0);
    differs_from_unwindowed += full.info.total_tokens != w.info.total_tokens ? 1 : 0;
  }
  CHECK(differs_from_unwindowed >= 100);
}

TEST_CASE("plan_decode: 64 x 32k under a 4096-token sliding window plans like 64 x 4096", "[decode_plan][shapes][window]") {
  // Gemma / gpt-oss style sliding-window layers: the work is the window, not the sequence.
  const DecodePlanConfig cfg = config(32, 8, 132, 6);
  DecodePlanConfig wcfg = cfg;
  wcfg.window.sliding_window_tokens = 4096;
  const std::vector<std::int32_t> lens(64, 32768);
  const Planned w = plan(lens, wcfg);
  const Planned ref4k = plan(std::vector<std::int32_t>(64, 4096), cfg);
  REQUIRE(w.status == Status::kSuccess);
  check_plan(lens, wcfg, w.info.work_list, w.info);
  CHECK(w.info.num_items == ref4k.info.num_items);  // 2048 items of 1024 tokens (docs/kernels.md)
  CHECK(w.info.num_items == 2048);
  CHECK(w.info.max_item_tokens == 1024);
  CHECK(w.info.total_tokens == std::int64_t{64} * 8 * 4096);
  for (int i = 0; i < w.info.num_items; ++i) {
    if (w.items[sz(i)].kv_begin < 32768 - 4096) FAIL("item " << i << " starts before the window");
  }
  // Chunked-local 8192 (Llama 4) at 32768 tokens: the query at 32767 sees its chunk [24576, 32768).
  DecodePlanConfig ccfg = cfg;
  ccfg.window.attention_chunk_tokens = 8192;
  const Planned c = plan(lens, ccfg);
  REQUIRE(c.status == Status::kSuccess);
  check_plan(lens, ccfg, c.info.work_list, c.info);
  CHECK(c.info.total_tokens == std::int64_t{64} * 8 * 8192);
}

TEST_CASE("validate_decode_work_list with a window: visible tokens exactly once, an early start allowed, a late one not",
          "[decode_plan][validation][window]") {
  const std::vector<std::int32_t> lens = {700, 0, 90, 1300, 5};
  const pagedkv::AttentionWindow w{300, 0};
  DecodePlanConfig cfg = config(6, 2, 16, 4);
  cfg.min_chunk_tokens = 50;
  DecodePlanConfig wcfg = cfg;
  wcfg.window = w;
  const Planned full = plan(lens, cfg);
  const Planned win = plan(lens, wcfg);
  REQUIRE(win.info.num_merges >= 1);
  // The window's plan under the window; the unwindowed plan under the window too (its early items are masked).
  CHECK(pagedkv::validate_decode_work_list(lens, 6, 2, win.info.work_list, w) == Status::kSuccess);
  CHECK(pagedkv::validate_decode_work_list(lens, 6, 2, full.info.work_list, w) == Status::kSuccess);
  // The window's plan without the window, or under a wider one: keys uncovered.
  CHECK(pagedkv::validate_decode_work_list(lens, 6, 2, win.info.work_list) == Status::kInvalidValue);
  CHECK(pagedkv::validate_decode_work_list(lens, 6, 2, win.info.work_list, {301, 0}) == Status::kInvalidValue);
  CHECK(pagedkv::validate_decode_work_list(lens, 6, 2, win.info.work_list, {0, 2048}) == Status::kInvalidValue);
  // ... but a narrower window is fine (the plan starts early).
  CHECK(pagedkv::validate_decode_work_list(lens, 6, 2, win.info.work_list, {299, 0}) == Status::kSuccess);
  CHECK(pagedkv::validate_decode_work_list(lens, 6, 2, win.info.work_list, {300, 64}) == Status::kSuccess);
  // A negative window is invalid.
  CHECK(pagedkv::validate_decode_work_list(lens, 6, 2, win.info.work_list, {-1, 0}) == Status::kInvalidValue);
  // The uniform chunk rule's list (from token 0) is valid under any window.
  std::vector<DecodeWorkItem> items(lens.size() * 2 * 40);
  std::vector<DecodeMergeItem> merges(lens.size());
  const pagedkv::DecodePlanBuffers buf{items, merges, static_cast<std::int32_t>(lens.size()) * 40};
  REQUIRE(pagedkv::plan_decode_uniform_chunks(lens, 2, 37, 40, buf) == Status::kSuccess);
  const DecodeWorkList uwl{items.data(), static_cast<std::int32_t>(items.size()), merges.data(),
                           static_cast<std::int32_t>(merges.size()), 3, buf.partial_row_capacity};
  CHECK(pagedkv::validate_decode_work_list(lens, 6, 2, uwl, w) == Status::kSuccess);
  CHECK(pagedkv::validate_decode_work_list(lens, 6, 2, uwl, {1, 7}) == Status::kSuccess);
  // Moving the first item of a windowed lane one token later leaves the first visible token uncovered.
  Planned broken = win;
  for (auto& it : broken.items) {
    if (it.valid != 0 && it.request == 3 && it.kv_begin == 1300 - 300) {
      it.kv_begin += 1;
      break;
    }
  }
  DecodeWorkList bwl = broken.info.work_list.relocated(broken.items.data(), broken.merges.data());
  CHECK(pagedkv::validate_decode_work_list(lens, 6, 2, bwl, w) == Status::kInvalidValue);
  // A negative window in the plan config is rejected, nothing written.
  DecodePlanConfig bad = wcfg;
  bad.window.attention_chunk_tokens = -1;
  std::vector<DecodeWorkItem> bitems(win.items.size(), DecodeWorkItem{1, 2, 3, 1, 4, 5, 6, 0});
  std::vector<DecodeMergeItem> bmerges(win.merges.size(), DecodeMergeItem{1, 2, 3, 1});
  CHECK(pagedkv::plan_decode(lens, bad, {bitems, bmerges, win.rows}) == Status::kInvalidValue);
  CHECK(bitems[0].request == 1);
  CHECK(bmerges[0].request == 1);
  CHECK(pagedkv::decode_plan_capacity(5, bad).items == 0);
}
