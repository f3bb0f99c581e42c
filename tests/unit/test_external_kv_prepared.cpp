// tests/unit/test_external_kv_prepared.cpp: the external admission of a prompt hashed once by prepare_prompt
// (try_admit_external and query_admit_external of a PreparedPrompt: a KV connector's admission, retried while the
// pool is full, hashes each prompt once per request). Two managers run the same random operations, one through the
// span overloads, the other through the prepared ones; every answer, ticket, table and counter must be equal.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <optional>
#include <random>
#include <vector>

#include "support/shadow_engine.hpp"
#include "test_support.hpp"
#include <pagedkv/external_kv.hpp>
#include <pagedkv/kv_cache_manager.hpp>

namespace {

using pagedkv::AttentionKind;
using pagedkv::SeqId;
using pagedkv::TokenId;
using pagedkv_test::expect_error;
using Engine = pagedkv_test::ShadowEngine;

// One full-attention group, alone or beside a sliding window, a coarse group or a recurrent group; small pools so
// that admissions meet kNoCapacity and evictions.
pagedkv::CacheConfig random_pool(std::mt19937& rng, std::uint32_t bs) {
  pagedkv::CacheConfig c;
  c.num_blocks = 24 + rng() % 60;
  c.block_size = bs;
  c.enable_events = true;
  switch (rng() % 4) {
    case 0:
      break;
    case 1:
      c.groups.resize(2);
      c.groups[1] = {AttentionKind::kSlidingWindow, static_cast<std::uint32_t>(1 + rng() % (3 * bs)), 1};
      break;
    case 2:
      c.groups.resize(2);
      c.groups[1].block_size = bs * static_cast<std::uint32_t>(2 + rng() % 2);
      break;
    default:
      c.groups.resize(2);
      c.groups[1].kind = AttentionKind::kRecurrent;
      c.groups[1].window_tokens = bs * static_cast<std::uint32_t>(1 + rng() % 3);
      c.groups[1].last_checkpoint = rng() % 2 == 0;
  }
  return c;
}

void require_same(const pagedkv::CapacityQuery& a, const pagedkv::CapacityQuery& b) {
  REQUIRE(a.status == b.status);
  REQUIRE(a.num_blocks == b.num_blocks);
  REQUIRE(a.num_missing_blocks == b.num_missing_blocks);
  REQUIRE(a.num_cached_tokens == b.num_cached_tokens);
}

void require_same(const pagedkv::ExternalAdmitResult<std::uint32_t>& a,
                  const pagedkv::ExternalAdmitResult<std::uint32_t>& b) {
  REQUIRE(a.admit.status == b.admit.status);
  REQUIRE(a.admit.num_cached_tokens == b.admit.num_cached_tokens);
  REQUIRE(a.admit.num_host_cached_tokens == b.admit.num_host_cached_tokens);
  REQUIRE(a.admit.num_new_blocks == b.admit.num_new_blocks);
  REQUIRE(a.admit.num_missing_blocks == b.admit.num_missing_blocks);
  REQUIRE(a.ticket.fill_id == b.ticket.fill_id);
  REQUIRE(a.ticket.first_block == b.ticket.first_block);
  REQUIRE(a.ticket.first_token == b.ticket.first_token);
  REQUIRE(a.ticket.end_token == b.ticket.end_token);
  REQUIRE(a.ticket.blocks == b.ticket.blocks);
  REQUIRE(a.ticket.generations == b.ticket.generations);
}

void require_same_state(Engine& a, Engine& b, const std::deque<SeqId>& live) {
  REQUIRE(a.m.stats().blocks_used == b.m.stats().blocks_used);
  REQUIRE(a.m.stats().blocks_free == b.m.stats().blocks_free);
  for (SeqId s : live) {
    REQUIRE(a.m.num_built(s) == b.m.num_built(s));
    for (std::size_t g = 0; g < a.m.num_groups(); ++g) {
      const auto x = a.m.block_ids(s, g);
      const auto y = b.m.block_ids(s, g);
      REQUIRE(std::vector<std::uint32_t>(x.begin(), x.end()) == std::vector<std::uint32_t>(y.begin(), y.end()));
    }
  }
}

}  // namespace

TEST_CASE("external admission of a prepared prompt: the same answers, tickets and tables as of the span",
          "[external_kv][manager][prepared]") {
  std::size_t admitted = 0, no_capacity = 0, with_ticket = 0, short_of_headroom = 0;
  for (unsigned seed = 0; seed < 60; ++seed) {
    CAPTURE(seed);
    std::mt19937 rng(seed);
    const std::uint32_t bs = 2 + rng() % 3;
    const pagedkv::CacheConfig c = random_pool(rng, bs);
    Engine a(c), b(c);
    // A few prompt families sharing prefixes (hits of every length), some with a salt.
    std::vector<std::vector<TokenId>> family(3);
    for (auto& f : family) {
      f.resize(40);
      for (auto& t : f) t = static_cast<TokenId>(rng() % 50);
    }
    std::deque<SeqId> live;
    for (SeqId seq = 1; seq <= 40; ++seq) {
      const auto& f = family[rng() % family.size()];
      std::vector<TokenId> prompt(f.begin(), f.begin() + static_cast<std::ptrdiff_t>(4 + rng() % 30));
      for (std::size_t i = rng() % 8; i > 0; --i) prompt.push_back(static_cast<TokenId>(100 + rng() % 50));
      std::optional<pagedkv::RequestKeys> keys;
      if (rng() % 5 == 0) keys = pagedkv::RequestKeys{0, {}, "tenant-" + std::to_string(rng() % 2)};
      const pagedkv::RequestKeys* k = keys ? &*keys : nullptr;
      const std::size_t n_ext = rng() % (prompt.size() + 2);
      pagedkv::AdmitOptions opts;
      if (rng() % 3 == 0) opts.max_cached_tokens = (rng() % (prompt.size() / bs + 1)) * bs;
      if (rng() % 3 == 0) opts.num_reserved_tokens = 1 + rng() % prompt.size();
      const std::size_t headroom = rng() % 3 == 0 ? rng() % 20 : 0;

      const pagedkv::PreparedPrompt prepared = b.m.prepare_prompt(prompt, k);
      require_same(a.m.query_admit_external(prompt, n_ext, k, opts), b.m.query_admit_external(prepared, n_ext, opts));
      const auto ra = a.m.try_admit_external(seq, prompt, n_ext, k, opts, headroom);
      const auto rb = b.m.try_admit_external(seq, prepared, n_ext, opts, headroom);
      require_same(ra, rb);
      if (!ra.admit.admitted()) {
        ++no_capacity;
        short_of_headroom += headroom != 0 && a.m.query_admit_external(prompt, n_ext, k, opts).fits();
        // Free the oldest sequence (both engines), as a scheduler preempts to make room.
        if (!live.empty()) {
          a.m.free(live.front());
          b.m.free(live.front());
          live.pop_front();
        }
        require_same_state(a, b, live);
        continue;
      }
      ++admitted;
      live.push_back(seq);
      require_same_state(a, b, live);
      if (ra.ticket.fill_id != 0) {
        ++with_ticket;
        const std::size_t valid = rng() % (ra.ticket.num_blocks() + 1);
        const auto ca = a.m.complete_external_fill(ra.ticket.fill_id, valid);
        const auto cb = b.m.complete_external_fill(rb.ticket.fill_id, valid);
        REQUIRE(ca.signal == cb.signal);
        REQUIRE(ca.num_valid_blocks == cb.num_valid_blocks);
        REQUIRE(ca.num_computed_tokens == cb.num_computed_tokens);
        REQUIRE(ca.sequence_failed == cb.sequence_failed);
        if (ca.sequence_failed) {
          live.pop_back();
          require_same_state(a, b, live);
          continue;
        }
      }
      // Compute the rest of the prompt if the reservation covers it (chunked admissions keep their pending part).
      const std::size_t pending = a.m.pending_slots(seq).size();
      REQUIRE(pending == b.m.pending_slots(seq).size());
      if (pending != 0) {
        a.build(seq, prompt, pending);
        b.build(seq, prompt, pending);
      }
      require_same_state(a, b, live);
      if (live.size() > 3) {
        a.m.free(live.front());
        b.m.free(live.front());
        live.pop_front();
      }
    }
  }
  // The random runs reach every outcome (seeds 0-59: 2,129 admitted, 271 refused, 1,964 fills, 144 of the refusals
  // by the headroom alone).
  CHECK(admitted > 1000);
  CHECK(no_capacity > 130);
  CHECK(with_ticket > 900);
  CHECK(short_of_headroom > 70);
}

TEST_CASE("external admission of a prepared prompt: a foreign preparation or a live id is refused, nothing changes",
          "[external_kv][manager][prepared]") {
  pagedkv::CacheConfig c;
  c.num_blocks = 32;
  c.block_size = 4;
  pagedkv::KVCacheManager<> m(c);
  pagedkv::CacheConfig other = c;
  other.hash_seed = c.hash_seed + 1;
  const pagedkv::KVCacheManager<> foreign(other);
  const std::vector<TokenId> prompt = pagedkv_test::toks(7, 21);
  const pagedkv::PreparedPrompt theirs = foreign.prepare_prompt(prompt);
  const std::size_t free_before = m.stats().blocks_free;
  const std::string e1 = expect_error([&] { (void)m.try_admit_external(1, theirs, 8); }, pagedkv::Errc::kInvalidArgument);
  CHECK(e1.find("try_admit_external") != std::string::npos);
  CHECK(e1.find("not prepared by a manager with this hasher") != std::string::npos);
  const std::string e2 = expect_error([&] { (void)m.query_admit_external(theirs, 8); }, pagedkv::Errc::kInvalidArgument);
  CHECK(e2.find("query_admit_external") != std::string::npos);
  CHECK_FALSE(m.contains(1));
  CHECK(m.stats().blocks_free == free_before);
  CHECK(m.stats().external.fills_started == 0);

  const pagedkv::PreparedPrompt ours = m.prepare_prompt(prompt);
  const auto r = m.try_admit_external(1, ours, 8);
  REQUIRE(r.admit.admitted());
  REQUIRE(r.ticket.fill_id != 0);
  CHECK(r.ticket.end_token == 8);
  const std::size_t used = m.stats().blocks_used;
  const std::string e3 = expect_error([&] { (void)m.try_admit_external(1, ours, 8); }, pagedkv::Errc::kDuplicateSequence);
  CHECK(e3.find("try_admit_external: sequence 1 is already live") != std::string::npos);
  CHECK(m.stats().blocks_used == used);
  CHECK(m.external_fill_of(1) == r.ticket.fill_id);
}

namespace {

// SHA-256 that counts its calls: a prepared prompt's external admission must hash nothing.
struct CountingSha256 {
  static constexpr const char* kName = "counting-sha256";
  static constexpr bool kCryptographic = true;
  static inline std::size_t calls = 0;
  static pagedkv::BlockHash hash(std::span<const std::byte> bytes) noexcept {
    ++calls;
    return pagedkv::Sha256Hasher::hash(bytes);
  }
};

template <class M>
void build_all(M& m, SeqId s) {
  pagedkv::BatchMetadataLimits lim;
  lim.max_batch = 1;
  lim.max_tokens_per_step = 256;
  lim.max_blocks_per_seq = 256;
  lim.max_copies = 16;
  std::vector<pagedkv::BatchMetadataStorage> st;
  std::vector<pagedkv::BatchMetadataBuffers> bufs;
  for (std::size_t g = 0; g < m.num_groups(); ++g) st.emplace_back(lim);
  for (auto& x : st) bufs.push_back(x.buffers());
  const std::vector<SeqId> batch{s};
  (void)m.build_batch_metadata(batch, bufs);
}

}  // namespace

TEST_CASE("external admission of a prepared prompt hashes nothing, with headroom and coarse pages too",
          "[external_kv][manager][prepared]") {
  for (const bool coarse : {false, true}) {
    CAPTURE(coarse);
    pagedkv::CacheConfig c;
    c.num_blocks = 64;
    c.block_size = 4;
    if (coarse) {
      c.groups.resize(2);
      c.groups[1].block_size = 8;  // pages of 2 match blocks: the external hit is lowered to a page boundary
    }
    pagedkv::KVCacheManager<CountingSha256> m(c);
    const std::vector<TokenId> prompt = pagedkv_test::toks(3, 40);
    const std::vector<TokenId> prefix(prompt.begin(), prompt.begin() + 13);  // 3 full blocks cached
    REQUIRE(m.try_admit(1, prefix).admitted());
    build_all(m, 1);
    m.free(1);
    REQUIRE(m.lookup(prompt) == 12);
    const pagedkv::PreparedPrompt pp = m.prepare_prompt(prompt);
    CountingSha256::calls = 0;
    const auto q = m.query_admit_external(pp, 16);
    const auto r = m.try_admit_external(2, pp, 16, {}, 4);
    CHECK(CountingSha256::calls == 0);
    REQUIRE(r.admit.admitted());
    CHECK(r.admit.num_cached_tokens == (coarse ? 8U : 12U));
    CHECK(q.num_cached_tokens == r.admit.num_cached_tokens);
    REQUIRE(r.ticket.fill_id != 0);
    CHECK(r.ticket.end_token == 28);  // the full hit (12) plus the 16 offered
    // The span overloads hash the prompt (the counter sees them), the same answers.
    m.abort_sequence(2, true);
    CountingSha256::calls = 0;
    const auto q2 = m.query_admit_external(prompt, 16);
    const auto r2 = m.try_admit_external(2, prompt, 16, nullptr, {}, 4);
    CHECK(CountingSha256::calls >= 2 * (prompt.size() / 4));
    CHECK(q2.num_blocks == q.num_blocks);
    CHECK(r2.admit.num_cached_tokens == r.admit.num_cached_tokens);
    CHECK(r2.ticket.end_token == r.ticket.end_token);
  }
}

TEST_CASE("external admission with headroom of a swapped sequence id is a duplicate, not no-capacity",
          "[external_kv][manager][prepared]") {
  pagedkv::CacheConfig c;
  c.num_blocks = 16;
  c.block_size = 4;
  c.num_host_blocks = 16;
  pagedkv::KVCacheManager<> m(c);
  const std::vector<TokenId> prompt = pagedkv_test::toks(5, 10);
  REQUIRE(m.try_admit(7, prompt).admitted());
  pagedkv_test::build_step(m, {7});
  REQUIRE(m.preempt(7, pagedkv::PreemptMode::kSwap));
  REQUIRE_FALSE(m.contains(7));
  // A headroom no pool could give: the id is checked first all the same, in both overloads.
  const std::string e1 = expect_error([&] { (void)m.try_admit_external(7, prompt, 4, nullptr, {}, 1000); },
                                      pagedkv::Errc::kDuplicateSequence);
  CHECK(e1.find("try_admit_external: sequence 7 is already live") != std::string::npos);
  const pagedkv::PreparedPrompt pp = m.prepare_prompt(prompt);
  (void)expect_error([&] { (void)m.try_admit_external(7, pp, 4, {}, 1000); }, pagedkv::Errc::kDuplicateSequence);
  CHECK(m.stats().external.fills_started == 0);
  m.free(7);  // the swapped sequence, still there
  CHECK(m.stats().blocks_used == 0);
}
