// examples/pd/replay.cpp: pagedkv-pd --role replay: a request trace (Mooncake's conversation trace, FAST '25)
// through a prefill manager and a decode manager that hand every prompt over with the in-process transport
// (pagedkv/transfer_inproc.hpp), one request at a time in file order. It reports what disaggregation moves:
// bytes over the link with the decode side's own prefix hits (plan_import skips the blocks decode already caches)
// and without them (every importable block moved, as a consumer without a prefix cache would), TTFT proxies, and
// leaked blocks on both sides.
//
// The pools hold a 16-byte tag per block (not the model's K/V): the producer writes each computed block's identity
// prefix into it, the consumer checks every full block it received holds its own prompt's identity, so a block
// moved to the wrong place fails the run. Model bytes are a figure: --kv-bytes-per-token (default 131072: a
// Llama-3.1-8B-like 32 layers x 8 KV heads x 128 x K,V x bf16).
// TTFT proxy per request: (prompt tokens the prefill engine computes) / --prefill-tokens-per-s + (bytes moved) /
// --link-gbps; reported with and without the decode side's prefix hits.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <pagedkv/external_kv.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include <pagedkv/transfer_inproc.hpp>

#include "../replay/trace.hpp"
#include "replay_mode.hpp"

namespace pd {
namespace {

namespace tx = pagedkv::transfer;
using Mgr = pagedkv::KVCacheManager<>;
constexpr std::size_t kTagBytes = 16;

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(p * static_cast<double>(v.size() - 1))];
}

}  // namespace

int run_replay(const ReplayOptions& o) {
  const replay::Trace trace = replay::load_trace(o.trace, o.limit);
  pagedkv::CacheConfig c;
  c.num_blocks = o.num_blocks;
  c.block_size = 16;
  Mgr prod(c), cons(c);
  const auto fp = prod.layout_fingerprint("nhd", "bf16", 8, 128);
  std::vector<std::byte> prod_mem(c.num_blocks * kTagBytes), cons_mem(c.num_blocks * kTagBytes);
  tx::InProcFabric fabric;
  tx::InProcAgent& pa = fabric.make_agent("prefill");
  tx::InProcAgent& ca = fabric.make_agent("decode");
  const auto pool = [&](std::vector<std::byte>& m) {
    return tx::PoolDesc{{{reinterpret_cast<std::uintptr_t>(m.data()), kTagBytes, kTagBytes}},
                        static_cast<std::uint32_t>(c.num_blocks), tx::MemoryKind::kDram, 0};
  };
  pa.register_pool(pool(prod_mem));
  ca.register_pool(pool(cons_mem));
  ca.load_remote(pa.export_metadata());
  pa.load_remote(ca.export_metadata());
  const double block_bytes = static_cast<double>(o.kv_bytes_per_token) * 16.0;

  std::uint64_t moved = 0, moved_no_hits = 0, skipped = 0, prefill_tokens = 0, bad_blocks = 0, handoffs = 0;
  std::vector<double> ttft, ttft_no_hits;
  std::vector<pagedkv::TokenId> prompt;
  std::vector<std::int64_t> slots;
  std::vector<std::int32_t> copies(16, -1);
  for (std::size_t i = 0; i < trace.requests.size(); ++i) {
    replay::synthesize_prompt(trace, i, prompt);
    const pagedkv::SeqId seq = i + 1;
    // Producer: admit (its own prefix hit), compute the rest (one build), tag the blocks, hand off under a lease.
    const auto adm = prod.try_admit(seq, prompt);
    if (!adm.admitted()) throw std::runtime_error("replay: the prefill pool cannot hold request " + std::to_string(i));
    slots.assign(prod.pending_slots(seq).size(), -1);
    pagedkv::BatchMetadataBuffers b;
    b.slot_mapping = slots;
    b.copies = copies;
    const pagedkv::SeqId batch[1] = {seq};
    prod.build_batch_metadata(batch, b);
    const std::size_t computed = prompt.size() - adm.num_cached_tokens;
    prefill_tokens += computed;
    const auto desc = prod.finish_with_lease(seq, fp, std::nullopt);
    for (std::size_t k = 0; k < desc.identities.size(); ++k)
      std::memcpy(prod_mem.data() + desc.blocks[k] * kTagBytes, desc.identities[k].data(), kTagBytes);

    // Consumer: plan (its own hit is not moved), admit with the fill, one READ, complete.
    const auto plan = cons.plan_import(desc, fp, prompt);
    skipped += plan.skipped_blocks;
    const std::size_t importable = (pagedkv::importable_tokens(desc.num_tokens, prompt.size(), 0) + 15) / 16;
    moved_no_hits += importable;
    const auto r = plan.num_blocks == 0 ? cons.try_admit_external(seq, prompt, 0)
                                        : cons.try_admit_external(seq, prompt, plan);
    if (!r.admit.admitted()) throw std::runtime_error("replay: the decode pool cannot hold request " + std::to_string(i));
    if (r.ticket.fill_id != 0) {
      ++handoffs;
      const std::string note = "read-done:" + std::to_string(desc.hold_id);
      const tx::RequestId id = ca.submit({tx::TransferOp::kRead, 0, r.ticket.blocks, "prefill", 0, plan.remote_blocks, note});
      fabric.drain();
      if (ca.poll(id).status != tx::TransferStatus::kDone) throw std::runtime_error("replay: an in-process READ failed");
      ca.release(id);
      moved += r.ticket.blocks.size();
      // Every full block received holds this prompt's identity (a block moved to the wrong place fails).
      for (std::size_t k = 0; k < r.ticket.blocks.size(); ++k) {
        const std::size_t logical = r.ticket.first_block + k;
        if (logical < desc.identities.size() &&
            std::memcmp(cons_mem.data() + r.ticket.blocks[k] * kTagBytes, desc.identities[logical].data(), kTagBytes) != 0)
          ++bad_blocks;
      }
      cons.complete_external_fill(r.ticket.fill_id, r.ticket.num_blocks());
    }
    for (const tx::Notification& n : pa.take_notifications())
      if (n.message.rfind("read-done:", 0) == 0) prod.release_lease(std::stoull(n.message.substr(10)));
    if (r.ticket.fill_id == 0) prod.release_lease(desc.hold_id);  // nothing to read: the consumer releases
    // The decode engine computes the last prompt token and appends the outputs; then the request ends.
    std::vector<pagedkv::TokenId> out(trace.requests[i].output_tokens);
    for (std::size_t k = 0; k < out.size(); ++k) out[k] = replay::generated_token(i, 0, k);
    if (!out.empty() && !cons.try_append(seq, out).ok()) throw std::runtime_error("replay: decode append failed");
    slots.assign(cons.pending_slots(seq).size(), -1);
    b.slot_mapping = slots;
    cons.build_batch_metadata(batch, b);
    cons.free(seq);
    const double t_compute = static_cast<double>(computed) / o.prefill_tokens_per_s;
    ttft.push_back(1e3 * (t_compute + static_cast<double>(r.ticket.blocks.size()) * block_bytes / (o.link_gbps * 1e9)));
    ttft_no_hits.push_back(1e3 * (t_compute + static_cast<double>(importable) * block_bytes / (o.link_gbps * 1e9)));
  }
  const std::size_t leak_p = prod.stats().blocks_used, leak_c = cons.stats().blocks_used;
  const bool pass = leak_p == 0 && leak_c == 0 && bad_blocks == 0 && fabric.counters().blocks_moved == moved;
  std::printf("replay: %s, %zu requests, block_size 16, %zu blocks per pool, %.0f KiB of KV per block\n",
              trace.path.filename().string().c_str(), trace.requests.size(), c.num_blocks, block_bytes / 1024);
  const std::uint64_t total = trace.total_input_tokens();
  std::printf("replay: prefill computed %llu of %llu prompt tokens (its own prefix hits: %.1f%%); %llu hand-offs\n",
              static_cast<unsigned long long>(prefill_tokens), static_cast<unsigned long long>(total),
              total ? 100.0 * (1.0 - static_cast<double>(prefill_tokens) / static_cast<double>(total)) : 0.0,
              static_cast<unsigned long long>(handoffs));
  std::printf("replay: blocks moved %llu with decode's prefix hits (%llu skipped), %llu without: %.1f GB vs %.1f GB "
              "(%.1f%% saved)\n",
              static_cast<unsigned long long>(moved), static_cast<unsigned long long>(skipped),
              static_cast<unsigned long long>(moved_no_hits), static_cast<double>(moved) * block_bytes / 1e9,
              static_cast<double>(moved_no_hits) * block_bytes / 1e9,
              moved_no_hits ? 100.0 * (1.0 - static_cast<double>(moved) / static_cast<double>(moved_no_hits)) : 0.0);
  std::printf("replay: TTFT proxy (prefill at %.0f tokens/s + link at %.0f GB/s): p50 %.1f ms, p90 %.1f ms with "
              "decode's hits; p50 %.1f ms, p90 %.1f ms without\n",
              o.prefill_tokens_per_s, o.link_gbps, pct(ttft, 0.5), pct(ttft, 0.9), pct(ttft_no_hits, 0.5),
              pct(ttft_no_hits, 0.9));
  std::printf("pd-replay: %s requests=%zu blocks_moved=%llu blocks_moved_without_decode_hits=%llu bytes_moved=%.0f "
              "bytes_moved_without_decode_hits=%.0f misplaced_blocks=%llu leaked_blocks=%zu/%zu\n",
              pass ? "PASS" : "FAIL", trace.requests.size(), static_cast<unsigned long long>(moved),
              static_cast<unsigned long long>(moved_no_hits), static_cast<double>(moved) * block_bytes,
              static_cast<double>(moved_no_hits) * block_bytes, static_cast<unsigned long long>(bad_blocks), leak_p,
              leak_c);
  return pass ? 0 : 1;
}

}  // namespace pd
