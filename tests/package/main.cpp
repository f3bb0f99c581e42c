// Uses the installed package: admit two requests sharing a prefix, check the second one hits the cache, build
// batch metadata. Exits non-zero on any mismatch.
#include <cstdio>
#include <vector>

#include <pagedkv/pagedkv.hpp>

int main() {
  pagedkv::KVCacheManager<> cache(pagedkv::CacheConfig{.num_blocks = 64, .block_size = 16});
  std::vector<pagedkv::TokenId> prompt(100);
  for (int i = 0; i < 100; ++i) prompt[i] = 1000 + 7 * i;
  const auto a = cache.try_admit(1, prompt);
  const auto b = cache.try_admit(2, prompt);
  std::vector<std::int32_t> indptr(3), indices(16), last_page_len(2), seq_lens(2), qo_indptr(3);
  std::vector<std::int64_t> slots(256);
  pagedkv::BatchMetadataBuffers buf;
  buf.indptr = indptr;
  buf.indices = indices;
  buf.last_page_len = last_page_len;
  buf.seq_lens = seq_lens;
  buf.qo_indptr = qo_indptr;
  buf.slot_mapping = slots;
  const std::vector<pagedkv::SeqId> batch{1, 2};
  const auto sz = cache.build_batch_metadata(batch, buf);
  const bool ok = a.admitted() && b.admitted() && a.num_cached_tokens == 0 && b.num_cached_tokens == 96 &&
                  sz.num_indices == 14 && sz.num_new_tokens == 100 + 4 && last_page_len[0] == 4;
  std::printf("pagedkv %d.%d.%d consumer: first hit %zu, second hit %zu tokens, %zu page indices: %s\n",
              PAGEDKV_VERSION_MAJOR, PAGEDKV_VERSION_MINOR, PAGEDKV_VERSION_PATCH, a.num_cached_tokens,
              b.num_cached_tokens, sz.num_indices, ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}
