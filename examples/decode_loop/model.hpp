// examples/decode_loop/model.hpp: the "model" of the decode_loop example: problem shape, deterministic K/V content,
// and the float64 attention oracle every step is checked against.
//
// K/V content is a pure function of (token prefix, layer): position p of a sequence carries the running hash
// h_p = mix(h_{p-1}, token_p) of its token ids [0, p], and its K and V rows are drawn from splitmix64 streams seeded
// by (h_p, layer, K|V). Two sequences with the same token prefix therefore produce bit-identical K/V at every
// position, which is what makes prefix-cache hits and deduplicated blocks (slot -1) truthful: the block the
// manager points a sequence at really holds that sequence's K/V.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <pagedkv/config.hpp>
#include <pagedkv/kernel_params.hpp>

namespace decode_loop {

/// Physical layout of each layer's KV pool.
enum class Layout { kNhd, kHnd, kSeparateNhd, kSeparateHnd };

[[nodiscard]] const char* layout_name(Layout l) noexcept;
[[nodiscard]] const char* dtype_name(pagedkv::DType dt) noexcept;

/// The attention problem shape and the KV pool geometry shared by every layer.
struct Shape {
  pagedkv::DType dtype = pagedkv::DType::kFloat32;
  int num_layers = 2;
  int num_qo_heads = 8;
  int num_kv_heads = 2;
  int head_dim = 128;
  int block_size = 16;
  int num_blocks = 0;  ///< Including the null block 0.
  Layout layout = Layout::kNhd;

  [[nodiscard]] std::size_t elem_bytes() const noexcept { return pagedkv::dtype_size_bytes(dtype); }
  /// Elements of one K (or V) page: block_size * num_kv_heads * head_dim.
  [[nodiscard]] std::int64_t page_elems() const noexcept {
    return std::int64_t{block_size} * num_kv_heads * head_dim;
  }
  /// Elements of one token's K (or V) row set: num_kv_heads * head_dim.
  [[nodiscard]] std::int64_t kv_row_elems() const noexcept { return std::int64_t{num_kv_heads} * head_dim; }
  /// Elements of one query (or output) row set: num_qo_heads * head_dim.
  [[nodiscard]] std::int64_t q_row_elems() const noexcept { return std::int64_t{num_qo_heads} * head_dim; }
  /// Bytes of the buffer at KVPoolView::k (interleaved layouts hold K and V in it).
  [[nodiscard]] std::size_t k_buffer_bytes() const noexcept;
  /// Bytes of the buffer at KVPoolView::v for the separate layouts; 0 for the interleaved ones.
  [[nodiscard]] std::size_t v_buffer_bytes() const noexcept;
  /// The pool view over buffers `k` (and `v` for the separate layouts), in whatever memory space they live.
  [[nodiscard]] pagedkv::KVPoolView view(void* k, void* v) const noexcept;
  [[nodiscard]] float sm_scale() const noexcept;
};

/// splitmix64 (Steele et al., "Fast splittable pseudorandom number generators", OOPSLA'14).
[[nodiscard]] constexpr std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Hash of the empty token prefix.
inline constexpr std::uint64_t kEmptyPrefixHash = 0x243f6a8885a308d3ull;

/// Hash of (prefix, token): depends only on the token ids of the prefix and the token.
[[nodiscard]] constexpr std::uint64_t extend_prefix_hash(std::uint64_t prefix_hash, pagedkv::TokenId token) noexcept {
  return splitmix64(prefix_hash ^ splitmix64(static_cast<std::uint64_t>(static_cast<std::uint32_t>(token)) +
                                             0x632be59bd9b4e019ull));
}

/// `x` rounded to `dt` (round to nearest even) and back to float.
[[nodiscard]] float round_to(pagedkv::DType dt, float x) noexcept;

/// The K (is_value = false) or V rows of the token whose prefix hash is `pos_hash`, at `layer`:
/// out `[num_kv_heads, head_dim]` floats in [-1, 1), already rounded to the shape's dtype (never zero).
void kv_rows(const Shape& s, std::uint64_t pos_hash, int layer, bool is_value, float* out) noexcept;

/// Writes `n` floats as dtype elements at element offset `offset` of `dst` (host memory).
void store_row(pagedkv::DType dt, void* dst, std::int64_t offset, const float* src, std::int64_t n) noexcept;

/// One layer's K and V of one sequence in float64, gathered from its position hashes:
/// k, v `[num_tokens, num_kv_heads, head_dim]`.
struct SeqKV {
  std::vector<double> k;
  std::vector<double> v;
  void build(const Shape& s, std::span<const std::uint64_t> pos_hashes, int layer);
};

/// float64 attention of one query head: q `[head_dim]` (kv head `kv_head`) against tokens [0, n) of `kv`.
/// Writes o `[head_dim]` and the natural-log softmax denominator *lse (of scale * q.k).
void attend_f64(const Shape& s, const SeqKV& kv, int kv_head, const double* q, std::int64_t n, double scale,
                double* o, double* lse);

/// Error of one output row (one query head) against the oracle: max |got - ref| / max |ref| over head_dim (a
/// normwise relative error, robust to entries of ref near 0). +inf when got holds a NaN or an infinity.
[[nodiscard]] double row_rel_error(const float* got, const double* ref, int head_dim) noexcept;

}  // namespace decode_loop
