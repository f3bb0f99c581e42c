// examples/pd/engine.cpp: the P/D example's engine (engine.hpp).
#include "engine.hpp"

#include <cstring>
#include <limits>
#include <stdexcept>

#include <pagedkv/reference/all.hpp>

namespace pd {

using decode_loop::splitmix64;

std::vector<std::uint64_t> prefix_hashes(std::span<const TokenId> tokens) {
  std::vector<std::uint64_t> h;
  h.reserve(tokens.size());
  std::uint64_t x = decode_loop::kEmptyPrefixHash;
  for (TokenId t : tokens) h.push_back(x = decode_loop::extend_prefix_hash(x, t));
  return h;
}

TokenId next_token(std::span<const float> outputs) {
  std::uint64_t h = 0x6a09e667f3bcc909ull;
  for (float f : outputs) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, &f, sizeof bits);
    h = splitmix64(h ^ bits);
  }
  return static_cast<TokenId>(h % 32000u);
}

namespace {

// The query rows of the position whose prefix hash is `pos_hash` at `layer`: [num_qo_heads, head_dim] in (-1, 1).
void q_rows(const EngineShape& s, std::uint64_t pos_hash, int layer, float* out) {
  const std::uint64_t stream = splitmix64(pos_hash ^ splitmix64(0x51ed2701f3a5c7b9ull + static_cast<std::uint64_t>(layer)));
  const std::size_t n = static_cast<std::size_t>(s.num_qo_heads) * static_cast<std::size_t>(s.head_dim);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t r = splitmix64(stream + i);
    out[i] = static_cast<float>((static_cast<double>(r >> 40) + 0.5) / 8388608.0 - 1.0);
  }
}

void check(pagedkv::Status s, const char* op) {
  if (s != pagedkv::Status::kSuccess) throw std::runtime_error(std::string(op) + ": " + pagedkv::to_string(s));
}

pagedkv::CacheConfig cache_config(const EngineShape& s) {
  pagedkv::CacheConfig c;
  c.num_blocks = static_cast<std::size_t>(s.num_blocks);
  c.block_size = static_cast<std::uint32_t>(s.block_size);
  if (s.window > 0) {  // group 0: the full-attention layers; group 1: the sliding-window layers
    c.groups.resize(2);
    c.groups[1].kind = pagedkv::AttentionKind::kSlidingWindow;
    c.groups[1].window_tokens = static_cast<std::uint32_t>(s.window);
  }
  return c;
}

}  // namespace

Engine::Engine(const EngineShape& shape) : shape_(shape), mgr_(cache_config(shape)) {
  model_.dtype = pagedkv::DType::kFloat32;
  model_.num_layers = shape.num_layers;
  model_.num_qo_heads = shape.num_qo_heads;
  model_.num_kv_heads = shape.num_kv_heads;
  model_.head_dim = shape.head_dim;
  model_.block_size = shape.block_size;
  model_.num_blocks = shape.num_blocks;
  model_.layout = decode_loop::Layout::kNhd;
  const std::size_t floats = static_cast<std::size_t>(shape.num_blocks) * shape.layer_block_bytes() / sizeof(float);
  for (int l = 0; l < shape.num_layers; ++l) {
    // Every float NaN: a slot no token was written to (or a block that was never moved) poisons the outputs.
    pools_.emplace_back(floats, std::numeric_limits<float>::quiet_NaN());
    views_.push_back(model_.view(pools_.back().data(), nullptr));
  }
  const std::size_t max_blocks = static_cast<std::size_t>(shape.num_blocks);
  meta_.resize(mgr_.num_groups());
  for (GroupMeta& g : meta_) {
    g.indptr.assign(2, 0);
    g.indices.assign(max_blocks, 0);
    g.last_page_len.assign(1, 0);
    g.qo_indptr.assign(2, 0);
    g.seq_lens.assign(1, 0);
    g.copies.assign(8, -1);
  }
  workspace_.resize(pagedkv::decode_workspace_bytes(1, 1, shape.num_qo_heads, shape.head_dim) / sizeof(float) + 1);
}

pagedkv::KvLayoutFingerprint Engine::fingerprint() const {
  return mgr_.layout_fingerprint("nhd", "fp32", static_cast<std::uint32_t>(shape_.num_kv_heads),
                                 static_cast<std::uint32_t>(shape_.head_dim));
}

pagedkv::transfer::PoolDesc Engine::pool_desc() const {
  pagedkv::transfer::PoolDesc d;
  for (const auto& p : pools_) {
    d.regions.push_back({reinterpret_cast<std::uintptr_t>(p.data()), shape_.layer_block_bytes(),
                         shape_.layer_block_bytes()});
  }
  d.num_blocks = static_cast<std::uint32_t>(shape_.num_blocks);
  return d;
}

Engine::Built Engine::build(SeqId seq) {
  const std::size_t n = mgr_.pending_slots(seq).size();
  std::vector<pagedkv::BatchMetadataBuffers> bufs(meta_.size());
  for (std::size_t g = 0; g < meta_.size(); ++g) {
    GroupMeta& m = meta_[g];
    m.slots.assign(n, -1);
    bufs[g].indptr = m.indptr;
    bufs[g].indices = m.indices;
    bufs[g].last_page_len = m.last_page_len;
    bufs[g].qo_indptr = m.qo_indptr;
    bufs[g].seq_lens = m.seq_lens;
    bufs[g].slot_mapping = m.slots;
    bufs[g].copies = m.copies;
  }
  const SeqId batch[1] = {seq};
  const auto sz = mgr_.build_batch_metadata(batch, bufs);
  return {static_cast<std::size_t>(meta_[0].seq_lens[0]), sz[0].num_new_tokens};
}

std::vector<float> Engine::compute_pending(SeqId seq, std::span<const TokenId> tokens) {
  const Built bt = build(seq);
  const std::vector<std::uint64_t> hashes = prefix_hashes(tokens.first(bt.seq_len));
  const std::size_t kv_row = static_cast<std::size_t>(shape_.num_kv_heads) * static_cast<std::size_t>(shape_.head_dim);
  const std::size_t q_row = static_cast<std::size_t>(shape_.num_qo_heads) * static_cast<std::size_t>(shape_.head_dim);
  std::vector<float> key(bt.num_new * kv_row), value(key.size()), q(bt.num_new * q_row), o(q.size()),
      lse(bt.num_new * static_cast<std::size_t>(shape_.num_qo_heads));
  std::vector<float> out;
  out.reserve(shape_.output_floats());
  const std::size_t first = bt.seq_len - bt.num_new;
  for (int l = 0; l < shape_.num_layers; ++l) {
    for (std::size_t j = 0; j < bt.num_new; ++j) {
      decode_loop::kv_rows(model_, hashes[first + j], l, false, key.data() + j * kv_row);
      decode_loop::kv_rows(model_, hashes[first + j], l, true, value.data() + j * kv_row);
      q_rows(shape_, hashes[first + j], l, q.data() + j * q_row);
    }
    const pagedkv::KVPoolView& kv = views_[static_cast<std::size_t>(l)];
    const std::size_t g = group_of(l);  // the layer's group: its slots, page table and window
    const GroupMeta& m = meta_[g];
    pagedkv::WriteKVParams wp;
    wp.key = key.data();
    wp.value = value.data();
    wp.slot_mapping = m.slots.data();
    wp.num_tokens = static_cast<std::int32_t>(bt.num_new);
    wp.kv = kv;
    check(pagedkv::reference::write_kv(wp), "write_kv");
    pagedkv::PrefillParams p;
    p.q = q.data();
    p.o = o.data();
    p.lse = lse.data();
    p.qo_indptr = m.qo_indptr.data();
    p.total_q_tokens = static_cast<std::int32_t>(bt.num_new);
    p.kv = kv;
    p.pages = pagedkv::PageTable::csr(1, m.indptr.data(), m.indices.data(), m.last_page_len.data());
    p.num_qo_heads = shape_.num_qo_heads;
    p.sm_scale = model_.sm_scale();
    p.window = mgr_.window(g);
    check(pagedkv::reference::prefill(p), "prefill");
    out.insert(out.end(), o.end() - static_cast<std::ptrdiff_t>(q_row), o.end());
  }
  return out;
}

std::vector<float> Engine::run_to_end(SeqId seq, std::vector<TokenId> tokens, int num_decode) {
  std::vector<float> outputs = compute_pending(seq, tokens);
  const std::size_t q_row = static_cast<std::size_t>(shape_.num_qo_heads) * static_cast<std::size_t>(shape_.head_dim);
  const std::size_t kv_row = static_cast<std::size_t>(shape_.num_kv_heads) * static_cast<std::size_t>(shape_.head_dim);
  std::vector<float> key(kv_row), value(kv_row), q(q_row), o(q_row), lse(static_cast<std::size_t>(shape_.num_qo_heads));
  std::uint64_t h = prefix_hashes(tokens).back();
  for (int step = 0; step < num_decode; ++step) {
    const TokenId t = next_token(std::span<const float>(outputs).last(shape_.output_floats()));
    tokens.push_back(t);
    h = decode_loop::extend_prefix_hash(h, t);
    const TokenId one[1] = {t};
    if (!mgr_.try_append(seq, one).ok()) throw std::runtime_error("try_append: no capacity for a decode token");
    build(seq);
    for (int l = 0; l < shape_.num_layers; ++l) {
      decode_loop::kv_rows(model_, h, l, false, key.data());
      decode_loop::kv_rows(model_, h, l, true, value.data());
      q_rows(shape_, h, l, q.data());
      const pagedkv::KVPoolView& kv = views_[static_cast<std::size_t>(l)];
      const std::size_t g = group_of(l);
      const GroupMeta& m = meta_[g];
      pagedkv::WriteKVParams wp;
      wp.key = key.data();
      wp.value = value.data();
      wp.slot_mapping = m.slots.data();
      wp.num_tokens = 1;
      wp.kv = kv;
      check(pagedkv::reference::write_kv(wp), "write_kv");
      pagedkv::DecodeParams p;
      p.q = q.data();
      p.o = o.data();
      p.lse = lse.data();
      p.kv = kv;
      p.pages = pagedkv::PageTable::csr(1, m.indptr.data(), m.indices.data(), m.last_page_len.data());
      p.num_qo_heads = shape_.num_qo_heads;
      p.sm_scale = model_.sm_scale();
      p.window = mgr_.window(g);
      p.workspace = workspace_.data();
      p.workspace_bytes = workspace_.size() * sizeof(float);
      check(pagedkv::reference::decode(p), "decode");
      outputs.insert(outputs.end(), o.begin(), o.end());
    }
  }
  mgr_.free(seq);
  return outputs;
}

}  // namespace pd
