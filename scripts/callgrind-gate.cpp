// scripts/callgrind-gate.cpp: fixed, deterministic workloads for the instruction-count gate of the manager split
// (issue 32; scripts/callgrind-gate.sh runs each under callgrind and prints the table; docs/benchmarks.md "Manager
// split gate"). Google Benchmark 1.7 (Debian's) cannot fix an iteration count from the command line, so its
// instruction totals move with the timing; this driver runs the same shapes with fixed counts instead:
//
//   decode64, decode256   bench_decode_step's BM_DecodeStep/64/32768 and /256/131072: SHA-256, prompts of
//                         1000-4000 random tokens, 256 (64) decode steps of one token per sequence + the step build
//   admitfree-xxh3, -sha256  bench_prefix_cache's BM_AdmitFree/2048: a 2048-token prompt whose first half is one of
//                         64 cached prefixes and whose second half is fresh, admitted, built and freed (pool 64 Ki
//                         blocks: it fills with freed suffix blocks and then evicts them), 2000 (500) requests
//   groups0, groups1, groups2  bench_groups' configs (0 one group, 1 full:12,swa4096:24, 2 full:12 + full:12 with
//                         64-token pages), XXH3: Azure conv prompts (unique, 16 per chunk: admit + build, then free)
//                         on a pool of 16 Ki blocks per group, 256 requests, then 128 decode steps of 64 sequences
//
// Only the measured part runs inside gate_measured() (callgrind --collect-atstart=no --toggle-collect=gate_measured):
// setup, warm-up and resets are outside it. Usage: callgrind-gate WORKLOAD [AZURE_CONV_CSV]; prints a checksum
// (so the work is not optimized away and a behaviour change shows).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <pagedkv/batch_metadata.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/kv_cache_manager.hpp>

extern "C" void gate_measured();  // runs g_measured: the only function callgrind collects

namespace {

using Id = std::uint32_t;
using pagedkv::SeqId;
using pagedkv::TokenId;
constexpr std::uint32_t kBlockSize = 16;
constexpr TokenId kVocab = 128'000;

std::uint64_t g_check = 0;  // what the workloads saw (blocks taken, cached tokens, slots)

struct Tokens {
  std::uint64_t s;
  TokenId next() noexcept {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return static_cast<TokenId>(1 + s % static_cast<std::uint64_t>(kVocab - 1));
  }
  std::vector<TokenId> draw(std::size_t n) {
    std::vector<TokenId> t(n);
    for (TokenId& x : t) x = next();
    return t;
  }
};

/// Per-group buffers for builds of up to `batch` sequences of up to `max_tokens` tokens, `new_tokens` new ones.
struct Buffers {
  std::size_t groups, max_blocks;
  std::vector<std::int32_t> indptr, indices, last_page_len, seq_lens, qo_indptr, copies;
  std::vector<std::int64_t> slots;
  std::vector<pagedkv::BatchMetadataBuffers> views;
  std::vector<pagedkv::BatchMetadataSizes> sizes;
  Buffers(std::size_t g, std::size_t batch, std::size_t max_tokens, std::size_t new_tokens)
      : groups(g), max_blocks(batch * ((max_tokens + kBlockSize - 1) / kBlockSize)), indptr(g * (batch + 1)),
        indices(g * max_blocks), last_page_len(g * batch), seq_lens(g * batch), qo_indptr(g * (batch + 1)),
        copies(g * 2 * batch), slots(g * new_tokens), views(g), sizes(g) {
    for (std::size_t i = 0; i < g; ++i) {
      pagedkv::BatchMetadataBuffers& v = views[i];
      v.indptr = std::span(indptr).subspan(i * (batch + 1), batch + 1);
      v.indices = std::span(indices).subspan(i * max_blocks, max_blocks);
      v.last_page_len = std::span(last_page_len).subspan(i * batch, batch);
      v.seq_lens = std::span(seq_lens).subspan(i * batch, batch);
      v.qo_indptr = std::span(qo_indptr).subspan(i * (batch + 1), batch + 1);
      v.copies = std::span(copies).subspan(i * 2 * batch, 2 * batch);
      v.slot_mapping = std::span(slots).subspan(i * new_tokens, new_tokens);
    }
  }
  template <class M>
  void build(M& m, std::span<const SeqId> batch) {
    if (groups == 1) {
      sizes[0] = m.build_batch_metadata(batch, views[0]);
    } else {
      m.build_batch_metadata(batch, std::span<const pagedkv::BatchMetadataBuffers>(views), {},
                             std::span<pagedkv::BatchMetadataSizes>(sizes));
    }
    for (std::size_t g = 0; g < groups; ++g) {  // counts, the last block id and the first slot: ids show too
      const pagedkv::BatchMetadataSizes& s = sizes[g];
      g_check = g_check * 31 + s.num_indices + s.num_new_tokens + s.num_copies +
                (s.num_indices != 0 ? static_cast<std::uint64_t>(views[g].indices[s.num_indices - 1]) : 0) +
                (s.num_new_tokens != 0 ? static_cast<std::uint64_t>(views[g].slot_mapping[0]) : 0);
    }
  }
};

pagedkv::CacheConfig group_config(int config, std::size_t blocks_per_group, std::size_t max_len) {
  pagedkv::CacheConfig c;
  c.block_size = kBlockSize;
  c.max_tokens_per_seq = max_len;
  c.num_blocks = blocks_per_group;
  if (config == 1) {
    pagedkv::KVCacheGroupSpec full, swa;
    full.num_layers = 12;
    swa.kind = pagedkv::AttentionKind::kSlidingWindow;
    swa.window_tokens = 4096;
    swa.num_layers = 12;
    c.groups = {full, swa, swa};
    c.num_blocks = blocks_per_group * 3 + 1;
  } else if (config == 2) {
    pagedkv::KVCacheGroupSpec full, coarse;
    full.num_layers = 12;
    coarse.num_layers = 12;
    coarse.block_size = 4 * kBlockSize;
    c.groups = {full, coarse};
    c.num_blocks = blocks_per_group + blocks_per_group / 4 + 1;
  }
  return c;
}

std::function<void()> g_measured;  // the measured part of the chosen workload

/// Decode steps of `batch` sequences (one token each + the step build), `steps` of them; a reset (free + admit
/// again) every 256 steps outside the measured part is not needed for these counts.
template <class Hasher>
void decode(std::size_t batch, std::size_t pool_blocks, std::size_t steps, int config) {
  std::mt19937_64 rng(0x5eed'dec0'de00'0003ULL ^ batch);
  Tokens tok{0x9e3779b97f4a7c15ULL ^ batch};
  std::uniform_int_distribution<std::size_t> len(1000, 4000);
  std::vector<std::vector<TokenId>> prompts;
  std::vector<SeqId> ids;
  for (std::size_t i = 0; i < batch; ++i) {
    prompts.push_back(tok.draw(len(rng)));
    ids.push_back(rng());
  }
  const std::size_t G = config == 1 ? 3 : config == 2 ? 2 : 1;
  auto m = std::make_unique<pagedkv::KVCacheManager<Hasher, Id>>(group_config(config, pool_blocks, 8192));
  Buffers prefill(G, batch, 8192, batch * 4000), step(G, batch, 8192, batch);
  for (std::size_t i = 0; i < batch; ++i) {
    if (!m->try_admit(ids[i], prompts[i]).admitted()) throw std::runtime_error("admission did not fit");
  }
  prefill.build(*m, ids);
  g_measured = [&] {
    for (std::size_t s = 0; s < steps; ++s) {
      for (SeqId id : ids) {
        const TokenId t = tok.next();
        if (!m->try_append(id, std::span<const TokenId>(&t, 1)).ok()) throw std::runtime_error("append failed");
      }
      step.build(*m, ids);
    }
  };
  gate_measured();
}

/// BM_AdmitFree/2048's loop: `n` requests.
template <class Hasher>
void admit_free(std::size_t n) {
  constexpr std::size_t kPrompt = 2048, kPrefix = kPrompt / 2, kPrefixes = 64;
  pagedkv::CacheConfig cfg;
  cfg.num_blocks = std::size_t{1} << 16;
  cfg.block_size = kBlockSize;
  pagedkv::KVCacheManager<Hasher, Id> m(cfg);
  Tokens tok{0x5eed'0000'0000'0013ULL};
  std::vector<std::vector<TokenId>> prompts;
  Buffers buf(1, 1, kPrompt, kPrompt);
  SeqId next_seq = 1;
  for (std::size_t p = 0; p < kPrefixes; ++p, ++next_seq) {
    prompts.push_back(tok.draw(kPrompt));
    const std::span<const TokenId> head(prompts.back().data(), kPrefix + 1);
    if (!m.try_admit(next_seq, head).admitted()) throw std::runtime_error("setup admission failed");
    buf.build(m, std::span<const SeqId>(&next_seq, 1));
    m.free(next_seq);
  }
  std::uint32_t unique = 12345;
  const auto one = [&](std::size_t k) {
    std::vector<TokenId>& prompt = prompts[k % kPrefixes];
    prompt[kPrefix] = static_cast<TokenId>(1 + unique++);
    const pagedkv::AdmitResult r = m.try_admit(next_seq, prompt);
    if (!r.admitted()) throw std::runtime_error("admission failed");
    g_check += r.num_cached_tokens;
    buf.build(m, std::span<const SeqId>(&next_seq, 1));
    m.free(next_seq++);
  };
  for (std::size_t k = 0; k < 4 * kPrefixes; ++k) one(k);  // warm-up: scratch grown
  g_measured = [&] {
    for (std::size_t k = 0; k < n; ++k) one(k);
  };
  gate_measured();
}

/// bench_groups' BM_AzureAdmitBuild (XXH3) and BM_DecodeBuild shapes for `config`, with fixed counts.
void groups(int config, const std::string& azure_csv) {
  std::ifstream in(azure_csv);
  if (!in) throw std::runtime_error("cannot open " + azure_csv);
  std::string line;
  std::getline(in, line);
  std::vector<std::size_t> lens;
  while (std::getline(in, line) && lens.size() < 512) {
    const std::size_t a = line.find(',');
    if (a != std::string::npos) lens.push_back(std::min<std::size_t>(std::stoul(line.substr(a + 1)), 8192));
  }
  constexpr std::size_t kPerGroup = std::size_t{1} << 14, kChunk = 16;
  const std::size_t G = config == 1 ? 3 : config == 2 ? 2 : 1;
  pagedkv::KVCacheManager<pagedkv::Xxh3Hasher, Id> m(group_config(config, kPerGroup, 8192));
  Tokens tok{0x5eed'a2c0'0000'0017ULL};
  const std::vector<TokenId> pool = tok.draw(std::size_t{1} << 18);
  Buffers buf(G, 1, 8192, 8192);
  SeqId next_seq = 1;
  std::uint32_t unique = 1;
  std::size_t next = 0;
  std::vector<SeqId> live;
  std::vector<TokenId> prompt;
  const auto chunk = [&] {
    for (std::size_t i = 0; i < kChunk; ++i) {
      const std::size_t len = std::max<std::size_t>(lens[next], 1);
      const std::size_t off = (next * 0x9e3779b97f4a7c15ULL >> 20) % (pool.size() - len);
      prompt.assign(pool.begin() + static_cast<std::ptrdiff_t>(off),
                    pool.begin() + static_cast<std::ptrdiff_t>(off + len));
      prompt[0] = unique++;
      next = (next + 1) % lens.size();
      const SeqId id = next_seq++;
      const pagedkv::AdmitResult r = m.try_admit(id, prompt);
      if (!r.admitted()) throw std::runtime_error("admission failed");
      g_check += r.num_new_blocks;
      buf.build(m, std::span<const SeqId>(&id, 1));
      live.push_back(id);
    }
    for (SeqId id : live) m.free(id);
    live.clear();
  };
  for (std::size_t k = 0; k < lens.size() / kChunk; ++k) chunk();  // warm-up: one pass, the pool fills
  g_measured = [&] {
    for (std::size_t k = 0; k < 256 / kChunk; ++k) chunk();
  };
  gate_measured();
  decode<pagedkv::Xxh3Hasher>(64, kPerGroup, 128, config);
}

}  // namespace

extern "C" [[gnu::noinline]] void gate_measured() { g_measured(); }

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s WORKLOAD [AZURE_CONV_CSV]\n", argv[0]);
    return 2;
  }
  const std::string w = argv[1];
  const std::string csv = argc > 2 ? argv[2] : "data/traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv";
  if (w == "decode64") decode<pagedkv::Sha256Hasher>(64, std::size_t{1} << 15, 256, 0);
  else if (w == "decode256") decode<pagedkv::Sha256Hasher>(256, std::size_t{1} << 17, 64, 0);
  else if (w == "admitfree-xxh3") admit_free<pagedkv::Xxh3Hasher>(2000);
  else if (w == "admitfree-sha256") admit_free<pagedkv::Sha256Hasher>(500);
  else if (w == "groups0") groups(0, csv);
  else if (w == "groups1") groups(1, csv);
  else if (w == "groups2") groups(2, csv);
  else {
    std::fprintf(stderr, "unknown workload %s\n", w.c_str());
    return 2;
  }
  std::printf("%s checksum %llu\n", w.c_str(), static_cast<unsigned long long>(g_check));
  return 0;
}
