// examples/pd/engine.hpp: one engine of the P/D example: a KVCacheManager over a host KV pool (one NHD interleaved
// buffer per layer, as vLLM registers one KV tensor per layer), the CPU reference kernels (write_kv, prefill,
// decode) and a small deterministic attention stack.
//
// K/V content is a pure function of (token prefix, layer), as in examples/decode_loop (model.hpp: kv_rows of the
// position's prefix hash), and so are the queries. Each step's output rows (every layer, every query head) are the
// request's outputs; the next token is a hash of them. A K/V byte that differs anywhere in a request's context
// changes its outputs, and from there its tokens: comparing outputs bit for bit compares the KV that was moved.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <pagedkv/external_kv.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include <pagedkv/transfer.hpp>

#include "../decode_loop/model.hpp"

namespace pd {

using pagedkv::SeqId;
using pagedkv::TokenId;

/// The attention stack and pool geometry of an engine. Defaults: fp32, 2 layers, 8 query heads over 4 KV heads
/// (GQA 2), head_dim 128, 16-token blocks: one layer's block (K and V, NHD interleaved) is 64 KiB.
struct EngineShape {
  int num_layers = 2;
  int num_qo_heads = 8;
  int num_kv_heads = 4;
  int head_dim = 128;
  int block_size = 16;
  int num_blocks = 257;  ///< Including the null block 0.
  /// > 0: a hybrid model (gpt-oss, Gemma 3): the odd layers are sliding-window layers of `window` tokens, KV-cache
  /// group 1 of the manager (their blocks outside the window are released, never read, never handed off); the even
  /// layers full attention, group 0. 0: every layer full attention, one group.
  int window = 0;
  /// Bytes of one layer's block: K and V pages, block_size x num_kv_heads x head_dim fp32 each.
  [[nodiscard]] std::size_t layer_block_bytes() const noexcept {
    return 2u * static_cast<std::size_t>(block_size) * static_cast<std::size_t>(num_kv_heads) *
           static_cast<std::size_t>(head_dim) * sizeof(float);
  }
  /// Floats of one step's output row set (every layer, every query head).
  [[nodiscard]] std::size_t output_floats() const noexcept {
    return static_cast<std::size_t>(num_layers) * static_cast<std::size_t>(num_qo_heads) *
           static_cast<std::size_t>(head_dim);
  }
};

/// Position hashes of `tokens` (decode_loop's prefix hash: position p carries the hash of tokens [0, p]).
[[nodiscard]] std::vector<std::uint64_t> prefix_hashes(std::span<const TokenId> tokens);

/// The next token sampled from one step's outputs (a hash of their bits, in [0, 32000)).
[[nodiscard]] TokenId next_token(std::span<const float> outputs);

/// One engine: manager + pool + reference kernels. Not thread safe.
class Engine {
 public:
  explicit Engine(const EngineShape& shape);

  [[nodiscard]] pagedkv::KVCacheManager<>& manager() noexcept { return mgr_; }
  [[nodiscard]] const EngineShape& shape() const noexcept { return shape_; }
  /// The layout fingerprint both sides compare at hand-shake ("nhd", "fp32", KV heads, head_dim + the pool's).
  [[nodiscard]] pagedkv::KvLayoutFingerprint fingerprint() const;
  /// The pool as a transfer agent registers it: one region per layer (the layer's NHD buffer), num_blocks blocks.
  [[nodiscard]] pagedkv::transfer::PoolDesc pool_desc() const;

  /// Computes every pending position of live `seq` (whose tokens are `tokens`) in one build: write_kv of their
  /// K/V, then prefill attention. Returns the last position's output rows, `[num_layers, num_qo_heads, head_dim]`.
  /// Throws pagedkv::Error from the manager or std::runtime_error naming the kernel that failed.
  std::vector<float> compute_pending(SeqId seq, std::span<const TokenId> tokens);

  /// Runs `seq` from "prompt built but for its pending positions" to the end: computes the pending positions, then
  /// decodes `num_decode` tokens (try_append + one build + decode kernel each), then frees it. Returns the outputs
  /// of every step concatenated (1 + num_decode row sets). Throws as compute_pending, and when an append finds no
  /// capacity.
  std::vector<float> run_to_end(SeqId seq, std::vector<TokenId> tokens, int num_decode);

  /// Blocks held now (refcount > 0): 0 once every sequence and hold has ended.
  [[nodiscard]] std::size_t blocks_used() { return mgr_.stats().blocks_used; }

 private:
  struct Built {
    std::size_t seq_len = 0;
    std::size_t num_new = 0;
  };
  Built build(SeqId seq);

  EngineShape shape_;
  decode_loop::Shape model_;  // decode_loop's shape: kv_rows draws the same K/V for the same prefix
  std::vector<std::vector<float>> pools_;  // [num_layers] NHD interleaved [num_blocks, 2, block_size, kvh, hd]
  std::vector<pagedkv::KVPoolView> views_;
  pagedkv::KVCacheManager<> mgr_;
  // The KV-cache group of `layer` (EngineShape::window).
  [[nodiscard]] std::size_t group_of(int layer) const noexcept {
    return shape_.window > 0 ? static_cast<std::size_t>(layer % 2) : 0;
  }
  // One build's metadata per KV-cache group (batch of one sequence).
  struct GroupMeta {
    std::vector<std::int32_t> indptr, indices, last_page_len, qo_indptr, seq_lens, copies;
    std::vector<std::int64_t> slots;
  };
  std::vector<GroupMeta> meta_;
  std::vector<float> workspace_;
};

}  // namespace pd
