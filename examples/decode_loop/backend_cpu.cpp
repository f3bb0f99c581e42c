// examples/decode_loop/backend_cpu.cpp: the CPU reference backend (pagedkv::reference, host memory), and the
// Metadata buffers both backends share.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <pagedkv/reference/all.hpp>

#include "backend.hpp"

namespace decode_loop {

Metadata::Metadata(const Capacity& c)
    : cap(c),
      indptr(static_cast<std::size_t>(c.max_batch) + 1, 0),
      indices(static_cast<std::size_t>(c.max_indices), 0),
      last_page_len(static_cast<std::size_t>(c.max_batch), 0),
      block_tables(static_cast<std::size_t>(c.max_batch) * static_cast<std::size_t>(c.max_blocks_per_seq), 0),
      seq_lens(static_cast<std::size_t>(c.max_batch), 0),
      qo_indptr(static_cast<std::size_t>(c.max_batch) + 1, 0),
      slot_mapping(static_cast<std::size_t>(c.max_new_tokens), -1),
      copies(2 * static_cast<std::size_t>(c.max_copies), -1),
      swap_out(2 * static_cast<std::size_t>(c.max_swaps), -1),
      swap_in(2 * static_cast<std::size_t>(c.max_swaps), -1),
      plan_items(static_cast<std::size_t>(c.plan_cap.items)),
      plan_merges(static_cast<std::size_t>(c.plan_cap.merges)) {}

pagedkv::BatchMetadataBuffers Metadata::buffers() {
  pagedkv::BatchMetadataBuffers b;
  b.indptr = indptr;
  b.indices = indices;
  b.last_page_len = last_page_len;
  b.block_tables = block_tables;
  b.max_blocks_per_seq = cap.max_blocks_per_seq;
  b.seq_lens = seq_lens;
  b.qo_indptr = qo_indptr;
  b.slot_mapping = slot_mapping;
  b.copies = copies;
  b.swap_out = swap_out;
  b.swap_in = swap_in;
  return b;
}

pagedkv::DecodePlanBuffers Metadata::plan_buffers() {
  return pagedkv::DecodePlanBuffers{plan_items, plan_merges, cap.plan_cap.partial_rows};
}

pagedkv::DecodePlanConfig cpu_plan_config(const Shape& shape) {
  pagedkv::DecodePlanConfig cfg;
  cfg.num_qo_heads = shape.num_qo_heads;
  cfg.num_kv_heads = shape.num_kv_heads;
  cfg.head_dim = shape.head_dim;
  // The CUDA kernel's tiling (at most 8 query heads per item, 16 for fp16/bf16 x 64), so the CPU runs the same
  // plans the GPU would for this shape on a 4-SM device.
  const int group = shape.num_qo_heads / shape.num_kv_heads;
  const int slots = (shape.dtype != pagedkv::DType::kFloat32 && shape.head_dim == 64) ? 16 : 8;
  const int tiles = (group + slots - 1) / slots;
  cfg.heads_per_tile = (group + tiles - 1) / tiles;
  cfg.num_sms = 4;
  cfg.ctas_per_sm = 2;
  cfg.min_chunk_tokens = 8;
  cfg.item_overhead_tokens = 16;
  return cfg;
}

namespace {

using pagedkv::Status;

BackendResult fail(const char* op, Status s) {
  return {s, std::string(op) + ": " + pagedkv::to_string(s)};
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(const Shape& shape, const Capacity& cap) : shape_(shape), cap_(cap) {
    for (int l = 0; l < shape.num_layers; ++l) {
      // Every byte 0xff: NaN in fp32, fp16 and bf16, so reading a slot no token was written to poisons the output.
      k_.emplace_back(shape.k_buffer_bytes(), std::byte{0xff});
      v_.emplace_back(shape.v_buffer_bytes(), std::byte{0xff});
      views_.push_back(shape.view(k_.back().data(), v_.back().empty() ? nullptr : v_.back().data()));
    }
    if (cap.num_host_blocks > 0) {  // the host tier: same block shape, its own number of blocks
      Shape host = shape;
      host.num_blocks = cap.num_host_blocks;
      for (int l = 0; l < shape.num_layers; ++l) {
        host_k_.emplace_back(host.k_buffer_bytes(), std::byte{0xff});
        host_v_.emplace_back(host.v_buffer_bytes(), std::byte{0xff});
        host_views_.push_back(host.view(host_k_.back().data(), host_v_.back().empty() ? nullptr : host_v_.back().data()));
      }
    }
    workspace_.resize(std::max(pagedkv::decode_workspace_bytes(cap.max_batch, cap.max_num_chunks, shape.num_qo_heads,
                                                               shape.head_dim),
                               cap.plan_cap.workspace_bytes) /
                      sizeof(float));
  }

  std::string name() const override { return "cpu-reference"; }

  BackendResult set_metadata(const Metadata& md) override {
    md_ = &md;  // host memory already: the reference reads it in place
    return {};
  }

  BackendResult run_swaps(int num_out, int num_in) override {
    if (host_views_.empty()) return Backend::run_swaps(num_out, num_in);
    const Metadata& md = *md_;
    const pagedkv::SwapBlocksParams out{views_.data(), host_views_.data(), shape_.num_layers, md.swap_out.data(),
                                        num_out, pagedkv::SwapDirection::kDeviceToHost};
    if (const Status s = pagedkv::reference::swap_blocks(out); s != Status::kSuccess) return fail("swap_blocks out", s);
    const pagedkv::SwapBlocksParams in{host_views_.data(), views_.data(), shape_.num_layers, md.swap_in.data(), num_in,
                                       pagedkv::SwapDirection::kHostToDevice};
    if (const Status s = pagedkv::reference::swap_blocks(in); s != Status::kSuccess) return fail("swap_blocks in", s);
    return {};
  }

  BackendResult run_layer(const LayerWork& w) override {
    const Metadata& md = *md_;
    const pagedkv::KVPoolView& kv = views_[static_cast<std::size_t>(w.layer)];

    // 1. Copy-on-write copies of this step (fixed-capacity list, (-1, -1) padding skipped).
    const pagedkv::CopyBlocksParams cp{&kv, 1, md.copies.data(), cap_.max_copies};
    if (const Status s = pagedkv::reference::copy_blocks(cp); s != Status::kSuccess) return fail("copy_blocks", s);

    // 2. The new tokens' K/V rows into their slots (slot -1: padding or a deduplicated token, skipped).
    pagedkv::WriteKVParams wp;
    wp.key = w.key;
    wp.value = w.value;
    wp.slot_mapping = md.slot_mapping.data();
    wp.num_tokens = cap_.max_new_tokens;
    wp.kv = kv;
    if (const Status s = pagedkv::reference::write_kv(wp); s != Status::kSuccess) return fail("write_kv", s);

    // 3. Attention over every sequence's pages (padding sequences give o = 0, lse = -inf).
    if (w.prefill) {
      pagedkv::PrefillParams p;
      p.q = w.q;
      p.o = w.o;
      p.lse = w.lse;
      p.qo_indptr = md.qo_indptr.data();
      p.total_q_tokens = w.total_q_rows;
      p.kv = kv;
      p.pages = pagedkv::PageTable::csr(cap_.max_batch, md.indptr.data(), md.indices.data(), md.last_page_len.data());
      p.num_qo_heads = shape_.num_qo_heads;
      p.sm_scale = shape_.sm_scale();
      if (const Status s = pagedkv::reference::prefill(p); s != Status::kSuccess) return fail("prefill", s);
      return {};
    }
    pagedkv::DecodeParams p;
    p.q = w.q;
    p.o = w.o;
    p.lse = w.lse;
    p.kv = kv;
    p.pages = w.format == pagedkv::PageTableFormat::kCsr
                  ? pagedkv::PageTable::csr(cap_.max_batch, md.indptr.data(), md.indices.data(),
                                            md.last_page_len.data())
                  : pagedkv::PageTable::padded(cap_.max_batch, md.block_tables.data(), cap_.max_blocks_per_seq,
                                               md.seq_lens.data());
    p.num_qo_heads = shape_.num_qo_heads;
    p.sm_scale = shape_.sm_scale();
    p.kv_chunk_size_tokens = w.kv_chunk_size_tokens;
    p.max_num_chunks = w.max_num_chunks;
    p.workspace = workspace_.data();
    p.workspace_bytes = workspace_.size() * sizeof(float);
    // With a plan, the reference executes exactly the work list the CUDA backend would launch.
    const Status s = w.use_plan ? pagedkv::reference::decode(p, w.plan) : pagedkv::reference::decode(p);
    if (s != Status::kSuccess) return fail("decode", s);
    return {};
  }

 private:
  Shape shape_;
  Capacity cap_;
  std::vector<std::vector<std::byte>> k_, v_;
  std::vector<pagedkv::KVPoolView> views_;
  std::vector<std::vector<std::byte>> host_k_, host_v_;  // the host tier (cap.num_host_blocks > 0)
  std::vector<pagedkv::KVPoolView> host_views_;
  std::vector<float> workspace_;
  const Metadata* md_ = nullptr;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const Shape& shape, const Capacity& cap) {
  return std::make_unique<CpuBackend>(shape, cap);
}

}  // namespace decode_loop
