// Uses the installed package: two steps of a scheduler. Step 1 admits a request and builds its metadata (which
// registers its full blocks); step 2 admits a second request with the same prompt, which must hit the 6 full blocks
// (96 tokens: the cap leaves the last token to compute). Exits non-zero on any mismatch.
#include <cstdio>
#include <vector>

#include <pagedkv/pagedkv.hpp>

int main() {
  pagedkv::KVCacheManager<> cache(pagedkv::CacheConfig{.num_blocks = 64, .block_size = 16});
  std::vector<pagedkv::TokenId> prompt(100);
  for (int i = 0; i < 100; ++i) prompt[i] = 1000 + 7 * i;

  std::vector<std::int32_t> indptr(3), indices(16), last_page_len(2), seq_lens(2), qo_indptr(3);
  std::vector<std::int64_t> slots(256);
  pagedkv::BatchMetadataBuffers buf;
  buf.indptr = indptr;
  buf.indices = indices;
  buf.last_page_len = last_page_len;
  buf.seq_lens = seq_lens;
  buf.qo_indptr = qo_indptr;
  buf.slot_mapping = slots;

  const auto a = cache.try_admit(1, prompt);
  const std::vector<pagedkv::SeqId> step1{1};
  const auto sz1 = cache.build_batch_metadata(step1, buf);

  const auto b = cache.try_admit(2, prompt);
  const std::vector<pagedkv::SeqId> step2{1, 2};
  const auto sz2 = cache.build_batch_metadata(step2, buf);

  const bool ok = a.admitted() && b.admitted() && a.num_cached_tokens == 0 && b.num_cached_tokens == 96 &&
                  sz1.num_new_tokens == 100 && sz2.num_indices == 14 && sz2.num_new_tokens == 4 &&
                  last_page_len[0] == 4 && indices[7] == indices[0];
  std::printf("pagedkv %d.%d.%d consumer: first hit %zu, second hit %zu tokens, %zu page indices: %s\n",
              PAGEDKV_VERSION_MAJOR, PAGEDKV_VERSION_MINOR, PAGEDKV_VERSION_PATCH, a.num_cached_tokens,
              b.num_cached_tokens, sz2.num_indices, ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}
