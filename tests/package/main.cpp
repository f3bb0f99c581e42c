// Uses the installed package as an engine's scheduler would, in the order the README's "Using it" snippet shows it
// (the lines between the SNIPPET markers are the README's code, checked equal by scripts/check-readme-snippet.sh):
// a prefill step, a fork, a decode step whose copy-on-write goes out with its batch, a second request that hits the
// prompt's full blocks. Exits non-zero on any mismatch.
#include <cstdio>
#include <numeric>
#include <vector>

#include <pagedkv/pagedkv.hpp>

int main() {
  std::vector<pagedkv::TokenId> prompt(100);
  std::iota(prompt.begin(), prompt.end(), 1000);
  const pagedkv::TokenId sampled = 42;
  // SNIPPET-BEGIN
  pagedkv::KVCacheManager<> cache({.num_blocks = 1024, .block_size = 16});  // SHA-256 block hashes
  // The kernels' view of each layer's pool comes from the manager's config (same block size and block count).
  const pagedkv::KVPoolShape shape{.dtype = pagedkv::DType::kBFloat16, .num_kv_heads = 1, .head_dim = 64};
  std::vector<std::byte> layer0(pagedkv::kv_pool_bytes(cache.config(), shape));  // device memory in an engine
  const pagedkv::KVPoolView kv = pagedkv::make_kv_pool_view(cache.config(), pagedkv::KVLayout::kNhd,
                                                            layer0.data(), nullptr, shape);
  // One set of metadata buffers, sized once from the engine's limits (a CUDA-graph engine mirrors them on the GPU).
  pagedkv::BatchMetadataStorage md({.max_batch = 8, .max_tokens_per_step = 512, .max_blocks_per_seq = 64});

  // Admit: the longest cached prefix is reused, the rest gets blocks (all or nothing).
  const pagedkv::AdmitResult r = cache.try_admit(/*seq=*/7, prompt);
  if (r.status != pagedkv::AdmitStatus::kAdmitted) return 1;  // kNoCapacity: keep waiting, or preempt
  // The prefill step: its metadata; the build registers the full blocks whose K/V the step writes.
  std::vector<pagedkv::SeqId> batch{7};
  pagedkv::BatchMetadataSizes sz = cache.build_batch_metadata(batch, md.buffers());
  // -> copy_blocks(md.copies) ; write_kv(md.slot_mapping, kv) ; attention(md.indptr / indices / last_page_len, kv)
  cache.fork(7, 8);  // parallel sampling, after the step that wrote the prompt: shares every block

  // Each decode step: one token per running sequence (try_append), then the step's metadata for that batch.
  batch = {7, 8};
  for (pagedkv::SeqId s : batch) {
    if (!cache.try_append(s, std::span(&sampled, 1)).ok()) cache.preempt(s);  // preemption by recompute
  }
  sz = cache.build_batch_metadata(batch, md.buffers());  // sz.num_copies == 1: the shared last block, for 7

  // A later request with the same prompt reuses its full blocks (96 of 100 tokens: the last one is computed).
  const pagedkv::AdmitResult r2 = cache.try_admit(9, prompt);
  cache.free(7);
  cache.free(8);
  // SNIPPET-END
  const bool ok = r.num_cached_tokens == 0 && r2.admitted() && r2.num_cached_tokens == 96 && sz.batch_size == 2 &&
                  sz.num_new_tokens == 2 && sz.num_copies == 1 && md.copies[1] == md.indices[6] && md.copies[0] == md.indices[13] &&
                  md.last_page_len[0] == 5 && kv.block_size == 16 && kv.num_blocks == 1024;
  std::printf("pagedkv %d.%d.%d consumer: second request hit %zu tokens, decode step %zu tokens with %zu copy: %s\n",
              PAGEDKV_VERSION_MAJOR, PAGEDKV_VERSION_MINOR, PAGEDKV_VERSION_PATCH, r2.num_cached_tokens,
              sz.num_new_tokens, sz.num_copies, ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}
