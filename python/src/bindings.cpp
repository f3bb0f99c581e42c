// python/src/bindings.cpp: the nanobind module pagedkv._pagedkv: KVCacheManager (over both hashers and three
// eviction policies, selected by name) with its KV-cache groups, prepared prompts and retention priorities, its
// result and statistics types, the KV events, and the batch-metadata builder writing into caller-owned numpy arrays
// (one set per group). docs/python.md describes the Python API.
//
// Conventions of this file:
//  - Every call that does work releases the GIL (nb::gil_scoped_release) and then takes the manager's mutex: the
//    C++ manager has one writer, and a released GIL would otherwise let two Python threads into it at once. Nothing
//    under the mutex touches a Python object; results are copied out under it and converted after.
//  - Input arrays (token ids, sequence ids) are read in place when they are C-contiguous 1-D numpy arrays of the
//    exact dtype; a list or tuple of ints is converted element by element; other dtypes are refused (never cast
//    silently). Output arrays (build_batch_metadata) are written in place and must be writable, C-contiguous and
//    of the exact dtype: no implicit conversion, which would write into a temporary.
//  - pagedkv::Error becomes pagedkv.Error's subclass for its code, with the same text (str(e) == what()).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/chrono.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <pagedkv/eviction_priority.hpp>
#include <pagedkv/eviction_slru.hpp>
#include <pagedkv/kv_cache_manager.hpp>

#include "bindings_common.hpp"  // ArrayIn, Manager, bind_external_kv

namespace nb = nanobind;
using namespace nb::literals;

namespace pagedkv::python {
namespace {

using Tokens = ArrayIn<std::int32_t>;
using SeqIds = ArrayIn<std::int64_t>;
using U32s = ArrayIn<std::uint32_t>;

// Output arrays of build_batch_metadata: writable, exact dtype, C-contiguous, host memory.
using OutI32 = nb::ndarray<std::int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using OutI64 = nb::ndarray<std::int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using OutI32Table = nb::ndarray<std::int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using OutPairs = nb::ndarray<std::int32_t, nb::shape<-1, 2>, nb::c_contig, nb::device::cpu>;
using OutU8 = nb::ndarray<std::uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

[[noreturn]] void bad_shape(std::string msg) { detail::raise(Errc::kBadShape, std::move(msg)); }
[[noreturn]] void invalid(std::string msg) { detail::raise(Errc::kInvalidArgument, std::move(msg)); }

/// Result of try_append / try_reserve / try_reserve_lookahead, owning its slots (the C++ span is invalidated by
/// the next call).
struct PyAppendResult {
  AppendStatus status = AppendStatus::kNoCapacity;
  std::vector<std::int64_t> slots;
  std::optional<std::pair<Id, Id>> copy;
  std::size_t num_missing_blocks = 0;
  std::size_t num_new_blocks = 0;
};

template <class R>
PyAppendResult to_py(const R& r) {
  PyAppendResult p;
  p.status = r.status;
  p.slots.assign(r.slots.begin(), r.slots.end());
  if (r.copy) p.copy = std::pair<Id, Id>{r.copy->src, r.copy->dst};
  p.num_missing_blocks = r.num_missing_blocks;
  p.num_new_blocks = r.num_new_blocks;
  return p;
}

// ---------------------------------------------------------------------------------------------------------------
// build_batch_metadata's output arrays: one set per KV-cache group, converted without copying (exact dtype,
// writable, C-contiguous) and kept alive here while the GIL is released.

constexpr const char* kBufferNames[] = {
    "indptr",   "indices",   "last_page_len",     "block_tables",         "seq_lens",         "qo_indptr",
    "slot_mapping", "copies", "swap_out",         "swap_in",              "state_in",         "state_out",
    "checkpoint_indptr",     "checkpoint_positions", "checkpoint_blocks"};

struct PyBuffers {
  std::optional<OutI32> indptr, indices, last_page_len;
  std::optional<OutI32Table> block_tables;
  std::optional<OutI32> seq_lens, qo_indptr;
  std::optional<OutI64> slot_mapping;
  std::optional<OutPairs> copies, swap_out, swap_in;
  // A recurrent-state group's outputs (batch_metadata.hpp).
  std::optional<OutI32> state_in, state_out, checkpoint_indptr, checkpoint_positions, checkpoint_blocks;

  // Sets the buffer called `name` from `value` (None = skipped). False when `name` is unknown; raises TypeError
  // naming `where` and the buffer when the array is not of the exact dtype, shape, writability and layout.
  bool set(std::string_view name, nb::handle value, const std::string& where) {
    const auto take = [&](auto& slot) {
      if (value.is_none()) return;
      typename std::remove_reference_t<decltype(slot)>::value_type a;
      if (!nb::try_cast(value, a, /*convert=*/false)) {
        const bool pairs = name == "copies" || name == "swap_out" || name == "swap_in";
        const bool table = name == "block_tables";
        std::string got = nb::str(value.type().attr("__name__")).c_str();
        if (nb::hasattr(value, "dtype")) {
          nb::object dtype = value.attr("dtype");
          got += " of dtype " + std::string(nb::steal<nb::str>(PyObject_Str(dtype.ptr())).c_str());
        }
        throw nb::type_error((where + "[\"" + std::string(name) + "\"]: expected a writable C-contiguous numpy array of " +
                              (name == "slot_mapping" ? "int64" : "int32") +
                              (pairs ? ", shape [n, 2]" : table ? ", 2-D" : ", 1-D") + "; got " + got)
                                 .c_str());
      }
      slot = std::move(a);
    };
    if (name == "indptr") take(indptr);
    else if (name == "indices") take(indices);
    else if (name == "last_page_len") take(last_page_len);
    else if (name == "block_tables") take(block_tables);
    else if (name == "seq_lens") take(seq_lens);
    else if (name == "qo_indptr") take(qo_indptr);
    else if (name == "slot_mapping") take(slot_mapping);
    else if (name == "copies") take(copies);
    else if (name == "swap_out") take(swap_out);
    else if (name == "swap_in") take(swap_in);
    else if (name == "state_in") take(state_in);
    else if (name == "state_out") take(state_out);
    else if (name == "checkpoint_indptr") take(checkpoint_indptr);
    else if (name == "checkpoint_positions") take(checkpoint_positions);
    else if (name == "checkpoint_blocks") take(checkpoint_blocks);
    else return false;
    return true;
  }

  // The C++ view of these arrays. Raises BadShapeError for a block table wider than the int32 metadata.
  [[nodiscard]] BatchMetadataBuffers view() {
    BatchMetadataBuffers buf;
    const auto span32 = [](std::optional<OutI32>& a) {
      return a ? std::span<std::int32_t>(a->data(), a->shape(0)) : std::span<std::int32_t>{};
    };
    const auto pairs = [](std::optional<OutPairs>& a) {
      return a ? std::span<std::int32_t>(a->data(), 2 * a->shape(0)) : std::span<std::int32_t>{};
    };
    buf.indptr = span32(indptr);
    buf.indices = span32(indices);
    buf.last_page_len = span32(last_page_len);
    if (block_tables) {
      if (block_tables->shape(1) > kMaxMetadataValue) {
        bad_shape("build_batch_metadata: block_tables has " + std::to_string(block_tables->shape(1)) +
                  " columns, above the int32 limit");
      }
      buf.block_tables = {block_tables->data(), block_tables->shape(0) * block_tables->shape(1)};
      buf.max_blocks_per_seq = static_cast<std::int32_t>(block_tables->shape(1));
    }
    buf.seq_lens = span32(seq_lens);
    buf.qo_indptr = span32(qo_indptr);
    if (slot_mapping) buf.slot_mapping = {slot_mapping->data(), slot_mapping->shape(0)};
    buf.copies = pairs(copies);
    buf.swap_out = pairs(swap_out);
    buf.swap_in = pairs(swap_in);
    buf.state_in = span32(state_in);
    buf.state_out = span32(state_out);
    buf.checkpoint_indptr = span32(checkpoint_indptr);
    buf.checkpoint_positions = span32(checkpoint_positions);
    buf.checkpoint_blocks = span32(checkpoint_blocks);
    return buf;
  }
};

// One group's buffers from a mapping of build_batch_metadata keywords (BatchMetadataBuffers.kwargs()) or from an
// object with those attributes (a BatchMetadataBuffers). A mapping with another key is refused (a misspelt
// buffer would otherwise be skipped silently).
PyBuffers buffers_from(nb::handle h, std::size_t g) {
  PyBuffers b;
  const std::string where = "build_batch_metadata: groups[" + std::to_string(g) + "]";
  if (PyDict_Check(h.ptr())) {
    for (auto [k, v] : nb::borrow<nb::dict>(h)) {
      if (!nb::isinstance<nb::str>(k) || !b.set(nb::borrow<nb::str>(k).c_str(), v, where)) {
        throw nb::type_error((where + ": unknown buffer " + nb::repr(k).c_str() +
                              " (expected build_batch_metadata's buffer keywords)")
                                 .c_str());
      }
    }
    return b;
  }
  for (const char* name : kBufferNames) {
    nb::object v = nb::getattr(h, name, nb::none());
    b.set(name, v, where);
  }
  return b;
}

void check_group_index(std::size_t g, std::size_t num_groups, const char* what) {
  if (g >= num_groups) {
    invalid(std::string(what) + ": group " + std::to_string(g) + " >= num_groups = " + std::to_string(num_groups));
  }
}

static_assert(sizeof(SeqId) == sizeof(std::int64_t));
std::span<const SeqId> seq_span(const SeqIds& batch) {
  const std::span<const std::int64_t> ids = batch.span();
  return {reinterpret_cast<const SeqId*>(ids.data()), ids.size()};
}


// Batched decode step: one token per sequence. Every id is checked first, as try_append checks it (live, no
// prompt tokens without slots, no lookahead, within max_tokens_per_seq), so a refused batch changes nothing.
template <class M>
void append_tokens_into(M& m, std::span<const std::int64_t> ids, std::span<const TokenId> tokens,
                        std::uint8_t* status) {
  if (ids.size() != tokens.size()) {
    bad_shape("append_tokens: " + std::to_string(ids.size()) + " sequence ids but " + std::to_string(tokens.size()) +
              " tokens (one token per sequence)");
  }
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const SeqId seq = static_cast<SeqId>(ids[i]);
    if (!m.contains(seq)) {
      detail::raise(Errc::kUnknownSequence,
                    "append_tokens: seq_ids[" + std::to_string(i) + "] = " + std::to_string(seq) + " is not live");
    }
    const auto& q = m.sequence(seq);
    if (q.num_unslotted() != 0 || q.num_lookahead != 0) {
      invalid("append_tokens: seq_ids[" + std::to_string(i) + "] = " + std::to_string(seq) + " has " +
              std::to_string(q.num_unslotted()) + " prompt tokens without slots and " +
              std::to_string(q.num_lookahead) + " lookahead slots (reserve or commit them first)");
    }
  }
  // A sequence may appear c times (c tokens): it must stay within max_tokens_per_seq after all of them. Only a
  // sequence within n tokens of the limit can fail, so the O(n) count runs for those only (none, usually).
  const std::size_t limit = m.max_tokens_per_seq();
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const SeqId seq = static_cast<SeqId>(ids[i]);
    const std::size_t known = m.sequence(seq).num_known();
    std::size_t grow = 1;
    if (known + ids.size() > limit) {
      grow = 0;
      for (std::int64_t id : ids) grow += (id == ids[i]);
    }
    if (known + grow > limit) {
      detail::raise(Errc::kLimitExceeded, "append_tokens: seq_ids[" + std::to_string(i) + "] = " +
                                              std::to_string(seq) + " would reach " + std::to_string(known + grow) +
                                              " tokens, above max_tokens_per_seq = " + std::to_string(limit));
    }
  }
  for (std::size_t i = 0; i < ids.size(); ++i) {
    status[i] = static_cast<std::uint8_t>(m.try_append(static_cast<SeqId>(ids[i]), tokens.subspan(i, 1)).status);
  }
}

RequestKeys make_keys(std::uint64_t adapter_id, const std::string& salt,
                      const std::vector<MultimodalItem>& multimodal) {
  RequestKeys k;
  k.adapter_id = adapter_id;
  k.salt = salt;
  k.multimodal = multimodal;
  return k;
}

BlockHash hash_from_bytes(const nb::bytes& b, const char* what) {
  if (b.size() != 16) {
    invalid(std::string(what) + ": a block hash is 16 bytes, got " + std::to_string(b.size()));
  }
  BlockHash h;
  std::memcpy(h.bytes.data(), b.c_str(), 16);
  return h;
}

nb::bytes hash_to_bytes(const BlockHash& h) { return nb::bytes(reinterpret_cast<const char*>(h.bytes.data()), 16); }

// ---------------------------------------------------------------------------------------------------------------
// Exceptions: pagedkv.Error (with .code, .message) and one subclass per Errc.

PyObject* g_error = nullptr;
PyObject* g_errors[8] = {};

void register_errors(nb::module_& m) {
  g_error = PyErr_NewExceptionWithDoc(
      "pagedkv.Error",
      "Misuse of a pagedkv call (pagedkv::Error). `code` is the stable pagedkv.Errc, `message` the text without the "
      "\"pagedkv: <code>: \" prefix; str(e) is the C++ what(). The call changed nothing.",
      PyExc_Exception, nullptr);
  m.attr("Error") = nb::borrow(g_error);
  struct Sub {
    Errc code;
    const char* name;
    PyObject* also;
  };
  const Sub subs[] = {
      {Errc::kInvalidArgument, "InvalidArgumentError", PyExc_ValueError},
      {Errc::kUnknownSequence, "UnknownSequenceError", PyExc_LookupError},
      {Errc::kDuplicateSequence, "DuplicateSequenceError", PyExc_ValueError},
      {Errc::kDoubleFree, "DoubleFreeError", PyExc_RuntimeError},
      {Errc::kLimitExceeded, "LimitExceededError", PyExc_ValueError},
      {Errc::kBlockOutOfRange, "BlockOutOfRangeError", PyExc_IndexError},
      {Errc::kBadShape, "BadShapeError", PyExc_ValueError},
  };
  for (const Sub& s : subs) {
    const std::string qual = std::string("pagedkv.") + s.name;
    const std::string doc = std::string("pagedkv.Error with code ") + to_string(s.code) + ".";
    nb::object bases = nb::make_tuple(nb::borrow(g_error), nb::borrow(s.also));
    PyObject* t = PyErr_NewExceptionWithDoc(qual.c_str(), doc.c_str(), bases.ptr(), nullptr);
    nb::object code = m.attr("Errc")(static_cast<int>(s.code));
    PyObject_SetAttrString(t, "code", code.ptr());
    g_errors[static_cast<int>(s.code)] = t;
    m.attr(s.name) = nb::borrow(t);
  }
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      const int c = static_cast<int>(e.code());
      PyObject* type = (c >= 1 && c <= 7 && g_errors[c] != nullptr) ? g_errors[c] : g_error;
      nb::object errc = nb::module_::import_("pagedkv._pagedkv").attr("Errc")(c);
      nb::object exc = nb::borrow(type)(nb::str(e.what()));
      exc.attr("code") = errc;
      exc.attr("message") = nb::str(e.message().c_str());
      PyErr_SetObject(type, exc.ptr());
    }
  });
}

template <class T>
std::string repr_fields(const char* name, std::initializer_list<std::pair<const char*, T>> f) {
  std::string s = std::string(name) + "(";
  bool first = true;
  for (const auto& [k, v] : f) {
    if (!first) s += ", ";
    first = false;
    s += k;
    s += "=";
    s += std::to_string(v);
  }
  return s + ")";
}

// ---------------------------------------------------------------------------------------------------------------
// pagedkv.vllm's calls (python/pagedkv/vllm.py): each composes existing manager calls under one lock, so that a
// vLLM allocate_slots is one crossing. Private to the adapter (leading underscore), not a stable API.

using BlockLists = std::vector<std::vector<std::int64_t>>;

// Issues the writes of every pending position of `seq` (a build of `seq` alone into scratch arrays: slot mapping
// and copies only), so the blocks they fill are registered in the prefix index; appends the build's copy-on-writes
// (src, dst) of every group to `copies`. No-op when nothing is pending.
template <class M>
void vllm_build_one(M& mm, SeqId seq, std::vector<std::pair<std::int64_t, std::int64_t>>& copies) {
  const std::size_t pending = mm.sequence(seq).num_pending();
  if (pending == 0) return;
  const std::size_t groups = mm.num_groups();
  constexpr std::size_t kMaxCopies = 16;  // per group and build of one sequence (a CoW per growth call at most)
  thread_local std::vector<std::int64_t> slots;
  thread_local std::vector<std::int32_t> pairs;
  slots.resize(groups * pending);
  pairs.resize(groups * 2 * kMaxCopies);
  std::vector<BatchMetadataBuffers> bufs(groups);
  // A recurrent group's state outputs (one row; checkpoints: at most two per pending position, the buffer
  // capacity's rule): scratch too, the adapter's caller (vLLM's worker in Mamba mode 'none') reads the state block
  // from the table it is given.
  thread_local std::vector<std::int32_t> state;
  const std::size_t max_ckpt = 2 * pending + 2, per_group = 4 + 2 * max_ckpt;
  state.resize(groups * per_group);
  for (std::size_t g = 0; g < groups; ++g) {
    bufs[g].slot_mapping = std::span<std::int64_t>(slots.data() + g * pending, pending);
    bufs[g].copies = std::span<std::int32_t>(pairs.data() + g * 2 * kMaxCopies, 2 * kMaxCopies);
    if (mm.is_recurrent(g)) {
      std::int32_t* p = state.data() + g * per_group;
      bufs[g].state_in = std::span<std::int32_t>(p, 1);
      bufs[g].state_out = std::span<std::int32_t>(p + 1, 1);
      bufs[g].checkpoint_indptr = std::span<std::int32_t>(p + 2, 2);
      bufs[g].checkpoint_positions = std::span<std::int32_t>(p + 4, max_ckpt);
      bufs[g].checkpoint_blocks = std::span<std::int32_t>(p + 4 + max_ckpt, max_ckpt);
    }
  }
  std::vector<BatchMetadataSizes> sizes(groups);
  const SeqId batch[1] = {seq};
  mm.build_batch_metadata(std::span<const SeqId>(batch, 1), bufs, {}, sizes);
  for (std::size_t g = 0; g < groups; ++g) {
    for (std::size_t i = 0; i < sizes[g].num_copies; ++i) {
      copies.emplace_back(pairs[g * 2 * kMaxCopies + 2 * i], pairs[g * 2 * kMaxCopies + 2 * i + 1]);
    }
  }
}

// Group g's entries of `seq`'s block table from index `from` on, per group.
template <class M>
BlockLists vllm_blocks_from(M& mm, SeqId seq, const std::vector<std::size_t>& from) {
  BlockLists out(mm.num_groups());
  for (std::size_t g = 0; g < out.size(); ++g) {
    const auto b = mm.block_ids(seq, g);
    const std::size_t f = std::min<std::size_t>(from.empty() ? 0 : from[g], b.size());
    out[g].assign(b.begin() + static_cast<std::ptrdiff_t>(f), b.end());
  }
  return out;
}

// Full blocks a build could register now: slotted positions (lookahead excluded) with known token ids.
template <class M>
std::size_t vllm_full_blocks(M& mm, SeqId seq) {
  const auto& q = mm.sequence(seq);
  return std::min(q.num_slotted() - q.num_lookahead, q.num_known()) / mm.block_size();
}

template <class R>
void vllm_expect_ok(const R& r, SeqId seq, const char* what) {
  if (r.status != AppendStatus::kOk) {
    throw std::logic_error(std::string("pagedkv.vllm: ") + what + " of sequence " + std::to_string(seq) +
                           " failed after query_append said the growth fits");
  }
}

void bind_vllm_helpers(nb::class_<Manager>& cls) {
  cls.def(
      "_vllm_hit",
      [](Manager& s, const PreparedPrompt& prompt, std::size_t max_cached_tokens, std::size_t drop_tokens) {
        std::size_t hit = 0;
        BlockLists ids;
        s.work([&](auto& mm) {
          const std::size_t bs = mm.block_size();
          ids.assign(mm.num_groups(), {});
          const auto& groups = mm.config().groups;
          if (groups.size() <= 1 && (groups.empty() || groups[0].kind == AttentionKind::kFull) &&
              mm.config().num_host_blocks == 0) {
            // One full-attention group, no host tier: the hit is the run of leading full blocks in the prefix index
            // (what lookup walks), read from the prepared hashes. (A window group alone needs only the blocks its
            // window sees before the hit: the fixed point below.)
            if (mm.config().enable_prefix_caching) {
              const std::size_t cap = std::min(max_cached_tokens, prompt.tokens.size()) / bs;
              const auto& index = mm.prefix_index(0);
              for (std::size_t i = 0; i < cap && i < prompt.hashes.size(); ++i) {
                const auto b = index.find(prompt.hashes[i]);
                if (!b) break;
                ids[0].push_back(static_cast<std::int64_t>(*b));
              }
            }
            hit = ids[0].size() * bs;
          } else {  // the fixed point over the groups
            hit = mm.query_admit(prompt, admit_options(max_cached_tokens, std::nullopt)).num_cached_tokens;
          }
          hit = hit > drop_tokens ? hit - drop_tokens : 0;
          const std::size_t nb = std::min(hit / bs, prompt.hashes.size());
          for (std::size_t g = 0; g < ids.size(); ++g) {
            if (ids[g].size() >= nb) {
              ids[g].resize(nb);
              continue;
            }
            ids[g].clear();
            ids[g].reserve(nb);
            for (std::size_t i = 0; i < nb; ++i) {
              const auto b = mm.prefix_index(g).find(prompt.hashes[i]);
              ids[g].push_back(b ? static_cast<std::int64_t>(*b) : 0);
            }
          }
        });
        return nb::make_tuple(hit, ids);
      },
      "prompt"_a, "max_cached_tokens"_a, "drop_tokens"_a,
      "pagedkv.vllm's get_computed_blocks: (hit tokens, each group's cached block ids of the hit's blocks, 0 where "
      "a group holds none), the hit as query_admit(prompt, max_cached_tokens=) finds it less `drop_tokens` (EAGLE's "
      "dropped block; no hashing: a prepared prompt). Pure.");
  cls.def(
      "_vllm_run",
      [](Manager& s, const PreparedPrompt& prompt, const std::vector<std::size_t>& groups, std::size_t max_tokens) {
        std::size_t run = 0;
        s.peek([&](auto& mm) {
          if (!mm.config().enable_prefix_caching || groups.empty()) return;
          const std::size_t bs = mm.block_size();
          const std::size_t cap = std::min(max_tokens, prompt.tokens.size()) / bs;
          std::size_t step = 1;  // match blocks per page: the run grows a whole page of every group at a time
          for (const std::size_t g : groups) step = std::lcm(step, std::size_t{mm.block_size(g)} / bs);
          for (std::size_t k = step; k <= cap && k <= prompt.hashes.size(); k += step) {
            for (const std::size_t g : groups) {  // a page is cached under the hash of its last match block
              const std::size_t f = mm.block_size(g) / bs;
              for (std::size_t j = k - step + f; j <= k; j += f) {
                if (!mm.prefix_index(g).find(prompt.hashes[j - 1])) return;
              }
            }
            run = k * bs;
          }
        });
        return run;
      },
      "prompt"_a, "groups"_a, "max_tokens"_a,
      "pagedkv.vllm's shared-prefix junction: the longest run of leading full blocks of `prompt` (tokens, at most "
      "`max_tokens`) that every group of `groups` (full-attention groups; a coarse one by whole pages) holds in "
      "its prefix index, as vLLM's full-attention lookup finds it. Pure; no hashing.");
  cls.def(
      "_vllm_admit",
      [](Manager& s, SeqId seq, const PreparedPrompt& prompt, std::size_t hit, std::size_t reserved,
         std::size_t lookahead, std::optional<std::int64_t> whole_limit, std::optional<std::int64_t> limit,
         std::optional<std::size_t> prompt_retention_tokens, std::size_t junction) {
        int status = 1;  // 0 admitted, 1 refused (nothing changed), 2 the hit is no longer cached (nothing changed)
        std::size_t found = 0, num_tokens = 0, full = 0;
        BlockLists blocks;
        std::vector<std::pair<std::int64_t, std::int64_t>> copies;
        s.work([&](auto& mm) {
          const auto over = [](std::size_t n, const std::optional<std::int64_t>& lim) {
            return lim && static_cast<std::int64_t>(n) > *lim;
          };
          if (whole_limit) {
            const CapacityQuery w = mm.query_admit(prompt, admit_options(hit, std::nullopt));
            if (!w.fits() || over(w.num_blocks, whole_limit)) return;
          }
          const CapacityQuery q = mm.query_admit(prompt, admit_options(hit, reserved));
          if (!q.fits() || over(q.num_blocks, limit)) return;
          found = q.num_cached_tokens;
          if (found != hit) {
            status = 2;
            return;
          }
          const AdmitResult r =
              mm.try_admit(seq, prompt, admit_options(hit, reserved, nullptr, prompt_retention_tokens, junction));
          if (!r.admitted()) return;
          if (lookahead > 0) {
            const auto la = mm.try_reserve_lookahead(seq, lookahead);
            if (la.status != AppendStatus::kOk || over(r.num_new_blocks + la.num_new_blocks, limit)) {
              mm.free(seq);
              return;
            }
          }
          status = 0;
          blocks = vllm_blocks_from(mm, seq, std::vector<std::size_t>(mm.num_groups(), hit / mm.block_size()));
          // vLLM's scheduler reads a new request's blocks after this call (get_blocks): its build may switch a
          // duplicate to the registered block; a running request's ids stay as handed out (deduplicate_blocks off).
          struct Restore {  // the flag goes back even if the build throws
            decltype(mm)& m;
            bool was;
            ~Restore() { m.set_deduplicate_blocks(was); }
          } restore{mm, mm.config().deduplicate_blocks};
          mm.set_deduplicate_blocks(true);
          vllm_build_one(mm, seq, copies);
          num_tokens = mm.sequence(seq).num_slotted();
          full = vllm_full_blocks(mm, seq);
        });
        return nb::make_tuple(status, blocks, copies, num_tokens, full, found);
      },
      "seq"_a, "prompt"_a, "hit"_a, "reserved"_a, "lookahead"_a, "whole_limit"_a.none(), "limit"_a.none(),
      "prompt_retention_tokens"_a.none() = nb::none(), "junction"_a = 0,
      "pagedkv.vllm's allocate_slots of a new request, one crossing: (whole_limit) query_admit of the whole prompt "
      "within that many new blocks, query_admit within `limit` new blocks, try_admit(seq, prompt, max_cached_tokens="
      "hit, num_reserved_tokens=reserved), try_reserve_lookahead(lookahead) (within `limit` too, else freed), then "
      "a build of its pending positions (with the sparse window retention's boundaries prompt_retention_tokens and "
      "junction: AdmitOptions). Returns (status: 0 admitted / 1 refused / 2 the hit is gone, new blocks "
      "per group, the build's copies [(src, dst)], num_tokens, full blocks built, the hit found); on 1 and 2 "
      "nothing changed.");
  cls.def(
      "_vllm_grow",
      [](Manager& s, SeqId seq, std::size_t reserve, const Tokens& tokens, std::size_t lookahead,
         std::optional<std::int64_t> limit, std::int64_t built_full, bool always_build) {
        bool ok = false, built = false;
        std::size_t num_tokens = 0, full = 0;
        BlockLists blocks;
        std::vector<std::pair<std::int64_t, std::int64_t>> copies;
        const auto toks = tokens.span();
        s.work([&](auto& mm) {
          const CapacityQuery q = mm.query_append(seq, reserve + toks.size() + lookahead);
          // A recurrent group with its states in its table takes a block where each growth ends: the reservation
          // and the appended tokens are two growths, so one more block each when both happen.
          std::size_t extra = 0;
          if (reserve > 0 && !toks.empty()) {
            for (const auto& spec : mm.config().groups) extra += spec.states_in_table() ? 1 : 0;
          }
          if (!q.fits() || (limit && static_cast<std::int64_t>(q.num_blocks + extra) > *limit) ||
              (extra != 0 && q.num_blocks + extra > mm.allocator().num_available_blocks())) {
            return;
          }
          std::vector<std::size_t> before(mm.num_groups());
          for (std::size_t g = 0; g < before.size(); ++g) before[g] = mm.block_ids(seq, g).size();
          bool copied = false;
          if (reserve > 0) {
            const auto r = mm.try_reserve(seq, reserve);
            vllm_expect_ok(r, seq, "try_reserve");
            copied |= r.copy.has_value();
          }
          if (!toks.empty()) {
            const auto r = mm.try_append(seq, toks);
            vllm_expect_ok(r, seq, "try_append");
            copied |= r.copy.has_value();
          }
          if (lookahead > 0) {
            const auto r = mm.try_reserve_lookahead(seq, lookahead);
            vllm_expect_ok(r, seq, "try_reserve_lookahead");
            copied |= r.copy.has_value();
          }
          ok = true;
          blocks = vllm_blocks_from(mm, seq, before);
          full = vllm_full_blocks(mm, seq);
          if (always_build || copied || lookahead > 0 || static_cast<std::int64_t>(full) > built_full) {
            vllm_build_one(mm, seq, copies);
            built = true;
          }
          num_tokens = mm.sequence(seq).num_slotted();
        });
        return nb::make_tuple(ok, blocks, copies, num_tokens, full, built);
      },
      "seq"_a, "reserve"_a, "tokens"_a, "lookahead"_a, "limit"_a.none(), "built_full"_a, "always_build"_a,
      "pagedkv.vllm's allocate_slots of a running request, one crossing: query_append of the whole growth (within "
      "`limit` new blocks), then try_reserve(reserve), try_append(tokens), try_reserve_lookahead(lookahead), and a "
      "build of the pending positions when one copied, reserved lookahead, filled a block past `built_full` full "
      "blocks, or `always_build`. Returns (grown, new blocks per group, the build's copies [(src, dst)], "
      "num_tokens, full blocks, built); not grown: nothing changed.");
  cls.def(
      "_vllm_seq_hash",
      [](Manager& s, SeqId seq, std::size_t i) {
        const std::optional<BlockHash> h = s.peek([&](auto& mm) -> std::optional<BlockHash> {
          const auto& q = mm.sequence(seq);
          if (i >= q.hashes.size()) return std::nullopt;
          return q.hashes[i];
        });
        return h ? std::optional<nb::bytes>(hash_to_bytes(*h)) : std::nullopt;
      },
      "seq"_a, "i"_a,
      "The chain hash of `seq`'s full block i (16 bytes, as PreparedPrompt.hashes), or None when block i is not "
      "full or known: pagedkv.vllm's record of the Mamba 'align' states a step registers (vLLM's "
      "cached_blocks_this_step). Raises UnknownSequenceError.");
  cls.def(
      "_vllm_seq_hashes",
      [](Manager& s, SeqId seq, std::size_t first, std::size_t end) {
        nb::list out;
        std::vector<BlockHash> hs;
        s.peek([&](auto& mm) {
          const auto& q = mm.sequence(seq);
          const std::size_t last = std::min(end, q.hashes.size());
          for (std::size_t i = first; i < last; ++i) hs.push_back(q.hashes[i]);
        });
        for (const BlockHash& h : hs) out.append(hash_to_bytes(h));
        return out;
      },
      "seq"_a, "first"_a, "end"_a,
      "The chain hashes of `seq`'s full blocks [first, end) (16 bytes each), as many as are full and known: "
      "pagedkv.vllm's KV event records (one crossing for a record's blocks). Raises UnknownSequenceError.");
  cls.def(
      "_vllm_tables",
      [](Manager& s, SeqId seq) { return s.peek([&](auto& mm) { return vllm_blocks_from(mm, seq, {}); }); },
      "seq"_a, "Every group's block table of `seq` as lists (one crossing).");
  cls.def(
      "_vllm_cached_prefix_blocks",
      [](Manager& s, SeqId seq) {
        return s.peek([&](auto& mm) {
          std::vector<std::size_t> out(mm.num_groups(), 0);
          const auto& hashes = mm.sequence(seq).hashes;
          for (std::size_t g = 0; g < out.size(); ++g) {
            const auto b = mm.block_ids(seq, g);
            const auto& specs = mm.config().groups;
            const bool fine = mm.block_size(g) == mm.block_size() &&
                              (specs.empty() || specs[g].kind == AttentionKind::kFull);
            for (std::size_t i = 0; i < b.size(); ++i) {
              if (b[i] == 0) continue;
              // A duplicate the build kept (CacheConfig::deduplicate_blocks off) counts as vLLM's hashed copy does.
              if (mm.prefix_index(mm.group_of(b[i])).hash_of(b[i]) ||
                  (fine && i < hashes.size() && mm.prefix_index(g).find(hashes[i]))) {
                out[g] = i + 1;
              }
            }
          }
          return out;
        });
      },
      "seq"_a,
      "Per group, 1 + the index of the last entry of `seq`'s block table registered in the prefix index, or (a "
      "full-attention group at the match unit) a kept duplicate of a registered block (0: none): pagedkv.vllm's estimate_cached_tokens in "
      "one crossing.");
}

}  // namespace
}  // namespace pagedkv::python

NB_MODULE(_pagedkv, m) {
  using namespace pagedkv;
  using namespace pagedkv::python;
  m.doc() = "pagedkv: paged KV-cache management (block tables, prefix caching, eviction, events) for LLM "
            "serving schedulers. See docs/python.md.";
  m.attr("__version__") = std::to_string(PAGEDKV_VERSION_MAJOR) + "." + std::to_string(PAGEDKV_VERSION_MINOR) + "." +
                          std::to_string(PAGEDKV_VERSION_PATCH);

  nb::enum_<Errc>(m, "Errc", nb::is_arithmetic(), "Stable error codes of pagedkv.Error (error.hpp).")
      .value("INVALID_ARGUMENT", Errc::kInvalidArgument)
      .value("UNKNOWN_SEQUENCE", Errc::kUnknownSequence)
      .value("DUPLICATE_SEQUENCE", Errc::kDuplicateSequence)
      .value("DOUBLE_FREE", Errc::kDoubleFree)
      .value("LIMIT_EXCEEDED", Errc::kLimitExceeded)
      .value("BLOCK_OUT_OF_RANGE", Errc::kBlockOutOfRange)
      .value("BAD_SHAPE", Errc::kBadShape);
  register_errors(m);

  nb::enum_<OffloadPolicy>(m, "OffloadPolicy", "When cached device blocks are copied to the host tier.")
      .value("NONE", OffloadPolicy::kNone)
      .value("WRITE_BACK", OffloadPolicy::kWriteBack)
      .value("WRITE_THROUGH", OffloadPolicy::kWriteThrough);
  nb::enum_<PreemptMode>(m, "PreemptMode", "How preempt() frees a running sequence's device blocks.")
      .value("RECOMPUTE", PreemptMode::kRecompute)
      .value("SWAP", PreemptMode::kSwap);
  nb::enum_<AdmitStatus>(m, "AdmitStatus", nb::is_arithmetic(), "Outcome of an admission.")
      .value("ADMITTED", AdmitStatus::kAdmitted)
      .value("NO_CAPACITY", AdmitStatus::kNoCapacity)
      .value("NEVER_FITS", AdmitStatus::kNeverFits)
      .value("TRANSFER_PENDING", AdmitStatus::kTransferPending);
  nb::enum_<AppendStatus>(m, "AppendStatus", nb::is_arithmetic(),
                          "Outcome of an append or reservation (also the values of append_tokens' status array).")
      .value("OK", AppendStatus::kOk)
      .value("NO_CAPACITY", AppendStatus::kNoCapacity)
      .value("NEVER_FITS", AppendStatus::kNeverFits);
  nb::enum_<CapacityStatus>(m, "CapacityStatus", nb::is_arithmetic(), "Outcome of a capacity query.")
      .value("FITS", CapacityStatus::kFits)
      .value("NO_CAPACITY", CapacityStatus::kNoCapacity)
      .value("NEVER_FITS", CapacityStatus::kNeverFits);
  nb::enum_<KVEventType>(m, "KVEventType", "Kind of a KV-cache event (vLLM's BlockStored / BlockRemoved / "
                                           "AllBlocksCleared).")
      .value("BLOCK_STORED", KVEventType::kBlockStored)
      .value("BLOCK_REMOVED", KVEventType::kBlockRemoved)
      .value("ALL_CLEARED", KVEventType::kAllCleared);
  nb::enum_<Medium>(m, "Medium", "Memory tier of a block (vLLM's medium).")
      .value("GPU", Medium::kGpu)
      .value("CPU", Medium::kCpu);

  nb::enum_<AttentionKind>(m, "AttentionKind",
                           "The attention type of a KV-cache group (vLLM's FullAttentionSpec / SlidingWindowSpec / "
                           "ChunkedLocalAttentionSpec; group_policy.hpp).")
      .value("FULL", AttentionKind::kFull, "Every earlier key is visible: the group keeps every block.")
      .value("SLIDING_WINDOW", AttentionKind::kSlidingWindow,
             "A query at p sees keys (p - W, p]: W keys, itself included (FlashInfer window_left = W - 1).")
      .value("CHUNKED_LOCAL", AttentionKind::kChunkedLocal,
             "Llama 4 chunked-local attention: a query at p sees [floor(p / C) * C, p].")
      .value("RECURRENT", AttentionKind::kRecurrent,
             "A recurrent state per sequence (Mamba-2, gated delta net; vLLM's MambaSpec) with checkpoints every "
             "window_tokens tokens (docs/groups.md, 'Recurrent-state groups').");

  nb::enum_<MissCause>(m, "MissCause", "Why an admission's prefix hit ends where it does (manager_results.hpp).")
      .value("NONE", MissCause::kNone, "Every full block of the prompt is served.")
      .value("PREFIX_CACHING_OFF", MissCause::kPrefixCachingOff, "CacheConfig.enable_prefix_caching is False.")
      .value("SHORT_PROMPT", MissCause::kShortPrompt, "The prompt holds no full block.")
      .value("CAPPED", MissCause::kCapped, "The next block is cached but the cap stops the hit.")
      .value("NOT_CACHED", MissCause::kNotCached, "The block is in no tier and the eviction history lacks it.")
      .value("KEY_MISMATCH", MissCause::kKeyMismatch, "Cached without this request's salt / adapter / items.")
      .value("LIMITED_BY_GROUP", MissCause::kLimitedByGroup, "A window group lacks a block its window needs.")
      .value("EVICTED", MissCause::kEvicted, "The block was cached and has been evicted (see .eviction).");

  nb::enum_<EvictedTier>(m, "EvictedTier", "The tier a block was evicted from.")
      .value("DEVICE", EvictedTier::kDevice)
      .value("HOST", EvictedTier::kHost);

  nb::class_<EvictionRecord>(m, "EvictionRecord", "One remembered eviction (eviction_history.hpp).")
      .def_ro("tier", &EvictionRecord::tier)
      .def_ro("group", &EvictionRecord::group)
      .def_ro("eviction_number", &EvictionRecord::eviction_number, "That tier's evictions before this one.");

  nb::class_<AdmitExplanation>(m, "AdmitExplanation",
                               "Why an admission's prefix hit ends where it does (KVCacheManager.explain_admit); "
                               "tokens.")
      .def_ro("prompt_tokens", &AdmitExplanation::prompt_tokens)
      .def_ro("cap_tokens", &AdmitExplanation::cap_tokens)
      .def_ro("hit_tokens", &AdmitExplanation::hit_tokens)
      .def_ro("host_hit_tokens", &AdmitExplanation::host_hit_tokens)
      .def_ro("cause", &AdmitExplanation::cause)
      .def_ro("first_miss_block", &AdmitExplanation::first_miss_block)
      .def_ro("limiting_group", &AdmitExplanation::limiting_group)
      .def_ro("group_cached_run_tokens", &AdmitExplanation::group_cached_run_tokens)
      .def_ro("eviction", &AdmitExplanation::eviction)
      .def_ro("evictions_since", &AdmitExplanation::evictions_since);

  nb::class_<AttentionWindow>(m, "AttentionWindow",
                              "Which keys a query sees (kernel_params.hpp): sliding_window_tokens W (0 = none) and "
                              "attention_chunk_tokens C (0 = none); what a group's kernels and decode plan take.")
      .def(
          "__init__",
          [](AttentionWindow* w, std::int32_t sliding_window_tokens, std::int32_t attention_chunk_tokens) {
            new (w) AttentionWindow{sliding_window_tokens, attention_chunk_tokens};
          },
          "sliding_window_tokens"_a = 0, "attention_chunk_tokens"_a = 0)
      .def_rw("sliding_window_tokens", &AttentionWindow::sliding_window_tokens)
      .def_rw("attention_chunk_tokens", &AttentionWindow::attention_chunk_tokens)
      .def_prop_ro("enabled", &AttentionWindow::enabled, "Whether some key can be masked (W > 0 or C > 0).")
      .def(
          "first_visible",
          [](const AttentionWindow& w, std::int64_t pos) {
            if (pos < 0 || !w.valid()) invalid("AttentionWindow.first_visible: needs pos >= 0 and W, C >= 0");
            return w.first_visible(pos);
          },
          "pos"_a, "The first key position a query at `pos` sees (0 when nothing is masked).")
      .def(
          "first_needed_token",
          [](const AttentionWindow& w, std::int64_t kv_len_tokens, std::int64_t num_queries) {
            if (!w.valid()) invalid("AttentionWindow.first_needed_token: needs W, C >= 0");
            return w.first_needed_token(kv_len_tokens, num_queries);
          },
          "kv_len_tokens"_a, "num_queries"_a,
          "The first key read for a sequence of kv_len_tokens keys whose last num_queries are queries: pages "
          "wholly before it are never read (their page-table entries may be the null block 0).")
      .def("__eq__", [](const AttentionWindow& a, const AttentionWindow& b) {
        return a.sliding_window_tokens == b.sliding_window_tokens && a.attention_chunk_tokens == b.attention_chunk_tokens;
      })
      .def("__repr__", [](const AttentionWindow& w) {
        return "AttentionWindow(sliding_window_tokens=" + std::to_string(w.sliding_window_tokens) +
               ", attention_chunk_tokens=" + std::to_string(w.attention_chunk_tokens) + ")";
      });

  nb::class_<KVCacheGroupSpec>(m, "KVCacheGroupSpec",
                               "One KV-cache group (a set of layers with one attention type): `kind`, "
                               "`window_tokens` (W for SLIDING_WINDOW, C for CHUNKED_LOCAL, the checkpoint interval "
                               "for RECURRENT, 0 for FULL), `num_layers` (for byte accounting only), and for "
                               "RECURRENT `state_bytes` (one layer's state) and `last_checkpoint` (also keep the "
                               "state at each sequence's last block boundary), `block_size` (tokens per block of "
                               "this group's pages: 0 = the pool's; a coarser page, a multiple of it, for a FULL "
                               "group after group 0: docs/groups.md \"Coarse pages\"), and for RECURRENT `state_in_table` (vLLM's "
                               "Mamba 'align' layout: the states live in the group's table, one block where each "
                               "step ends; window_tokens must be the block size) with `prefill_checkpoint_alignment` (0 = off; "
                               "vLLM's prefill checkpoint block of Mamba-2 layers: docs/groups.md). Checked by "
                               "KVCacheManager.")
      .def(
          "__init__",
          [](KVCacheGroupSpec* g, AttentionKind kind, std::uint32_t window_tokens, std::uint32_t num_layers,
             std::size_t state_bytes, bool last_checkpoint, std::uint32_t block_size, bool state_in_table,
             std::uint32_t prefill_checkpoint_alignment) {
            new (g) KVCacheGroupSpec{kind,       window_tokens,  num_layers, state_bytes, last_checkpoint,
                                     block_size, state_in_table, prefill_checkpoint_alignment};
          },
          "kind"_a = AttentionKind::kFull, "window_tokens"_a = 0, "num_layers"_a = 1, "state_bytes"_a = 0,
          "last_checkpoint"_a = false, "block_size"_a = 0, "state_in_table"_a = false,
          "prefill_checkpoint_alignment"_a = 0)
      .def_rw("kind", &KVCacheGroupSpec::kind)
      .def_rw("window_tokens", &KVCacheGroupSpec::window_tokens)
      .def_rw("num_layers", &KVCacheGroupSpec::num_layers)
      .def_rw("state_bytes", &KVCacheGroupSpec::state_bytes)
      .def_rw("last_checkpoint", &KVCacheGroupSpec::last_checkpoint)
      .def_rw("block_size", &KVCacheGroupSpec::block_size)
      .def_rw("state_in_table", &KVCacheGroupSpec::state_in_table)
      .def_rw("prefill_checkpoint_alignment", &KVCacheGroupSpec::prefill_checkpoint_alignment)
      .def(
          "window",
          [](const KVCacheGroupSpec& g) {
            if (g.window_tokens > static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max())) {
              invalid("KVCacheGroupSpec.window: window_tokens = " + std::to_string(g.window_tokens) +
                      " above 2^31 - 1");
            }
            return g.window();
          },
          "The kernels' AttentionWindow of this group (off for FULL).")
      .def("__eq__", [](const KVCacheGroupSpec& a, const KVCacheGroupSpec& b) {
        return a.kind == b.kind && a.window_tokens == b.window_tokens && a.num_layers == b.num_layers &&
               a.state_bytes == b.state_bytes && a.last_checkpoint == b.last_checkpoint &&
               a.block_size == b.block_size && a.state_in_table == b.state_in_table &&
               a.prefill_checkpoint_alignment == b.prefill_checkpoint_alignment;
      })
      .def("__repr__", [](const KVCacheGroupSpec& g) {
        return std::string("KVCacheGroupSpec(kind=AttentionKind.") +
               (g.kind == AttentionKind::kSlidingWindow ? "SLIDING_WINDOW"
                : g.kind == AttentionKind::kChunkedLocal ? "CHUNKED_LOCAL"
                : g.kind == AttentionKind::kRecurrent    ? "RECURRENT"
                                                          : "FULL") +
               ", window_tokens=" + std::to_string(g.window_tokens) + ", num_layers=" + std::to_string(g.num_layers) +
               (g.recurrent() ? ", state_bytes=" + std::to_string(g.state_bytes) +
                                    ", last_checkpoint=" + (g.last_checkpoint ? "True" : "False") +
                                    (g.state_in_table ? ", state_in_table=True" : "") +
                                    (g.prefill_checkpoint_alignment != 0
                                         ? ", prefill_checkpoint_alignment=" +
                                               std::to_string(g.prefill_checkpoint_alignment)
                                         : "")
                              : std::string()) +
               (g.block_size != 0 ? ", block_size=" + std::to_string(g.block_size) : std::string()) + ")";
      });

  nb::class_<CacheConfig>(m, "CacheConfig", "Configuration of one KV pool (kv_cache_manager.hpp CacheConfig).")
      .def(
          "__init__",
          [](CacheConfig* c, std::size_t num_blocks, std::uint32_t block_size, bool enable_prefix_caching,
             std::uint64_t hash_seed, std::size_t max_tokens_per_seq, bool enable_events, std::size_t num_host_blocks,
             OffloadPolicy offload, std::uint8_t min_offload_priority, std::vector<KVCacheGroupSpec> groups,
             std::size_t page_size_bytes, std::size_t eviction_history, bool count_miss_causes,
             bool release_at_build, std::optional<std::size_t> window_retention_interval,
             std::size_t window_retention_alignment, bool deduplicate_blocks) {
            new (c) CacheConfig{num_blocks,     block_size,      enable_prefix_caching, hash_seed, max_tokens_per_seq,
                                enable_events, num_host_blocks, offload,               min_offload_priority,
                                std::move(groups), page_size_bytes, eviction_history, count_miss_causes,
                                release_at_build, window_retention_interval, window_retention_alignment,
                                deduplicate_blocks};
          },
          "num_blocks"_a, "block_size"_a = kDefaultBlockSize, "enable_prefix_caching"_a = true, "hash_seed"_a = 0,
          "max_tokens_per_seq"_a = 0, "enable_events"_a = false, "num_host_blocks"_a = 0,
          "offload"_a = OffloadPolicy::kWriteBack, "min_offload_priority"_a = 0,
          "groups"_a = std::vector<KVCacheGroupSpec>{}, "page_size_bytes"_a = 0, "eviction_history"_a = 0,
          "count_miss_causes"_a = false, "release_at_build"_a = true, "window_retention_interval"_a = nb::none(),
          "window_retention_alignment"_a = 0, "deduplicate_blocks"_a = true,
          "num_blocks: pool size in blocks including the null block 0, [2, 2^31]; block_size: tokens per block; "
          "max_tokens_per_seq: 0 = 2^31 - 1; num_host_blocks: 0 = no host tier; groups: the KV-cache groups "
          "sharing the pool, at most 64 (empty = one full-attention group; group g is index g in every call); "
          "page_size_bytes: bytes of one layer's K+V page of block_size tokens (0 = no byte accounting); "
          "eviction_history: slots remembering evictions, so a miss can say 'evicted' (0 = off); "
          "count_miss_causes: count every admission's miss cause in CacheStats.admissions_by_miss_cause; "
          "release_at_build: windowed and recurrent groups drop the blocks no later query needs at each build "
          "(False: only at release_skipped_blocks, for a caller that hands the table to its kernels after the "
          "build); window_retention_interval: sparse prefix-cache retention of sliding-window groups in tokens "
          "(vLLM's prefix_cache_retention_interval: None = every window block, 0 = only each sequence's boundary "
          "tails, I = those and the tails at each multiple of I; docs/vllm-swa-retention.md); "
          "window_retention_alignment: tokens the boundaries align down to (0 = block_size); deduplicate_blocks: a "
          "full block whose content another registered block holds is switched to it at registration (False: "
          "block ids stay as handed out, the duplicate unregistered; for engines whose workers keep append-only "
          "block tables, as vLLM's). Checked by KVCacheManager.")
      .def_rw("num_blocks", &CacheConfig::num_blocks)
      .def_rw("block_size", &CacheConfig::block_size)
      .def_rw("enable_prefix_caching", &CacheConfig::enable_prefix_caching)
      .def_rw("hash_seed", &CacheConfig::hash_seed)
      .def_rw("max_tokens_per_seq", &CacheConfig::max_tokens_per_seq)
      .def_rw("enable_events", &CacheConfig::enable_events)
      .def_rw("num_host_blocks", &CacheConfig::num_host_blocks)
      .def_rw("offload", &CacheConfig::offload)
      .def_rw("min_offload_priority", &CacheConfig::min_offload_priority)
      .def_prop_rw(
          "groups", [](const CacheConfig& c) { return c.groups; },
          [](CacheConfig& c, std::vector<KVCacheGroupSpec> g) { c.groups = std::move(g); },
          "The KV-cache groups (a copy: assign a new list to change them).")
      .def_rw("page_size_bytes", &CacheConfig::page_size_bytes)
      .def_rw("eviction_history", &CacheConfig::eviction_history)
      .def_rw("count_miss_causes", &CacheConfig::count_miss_causes)
      .def_rw("release_at_build", &CacheConfig::release_at_build)
      .def_rw("window_retention_interval", &CacheConfig::window_retention_interval)
      .def_rw("window_retention_alignment", &CacheConfig::window_retention_alignment)
      .def_rw("window_retention_eagle", &CacheConfig::window_retention_eagle,
              "With window_retention_interval: EAGLE drafts and every sliding-window group is an EAGLE group (vLLM's "
              "use_eagle): tails one block longer, ending one block later; EAGLE's two replay boundaries; one block "
              "past the alignment horizon examined. Default False.")
      .def_rw("deduplicate_blocks", &CacheConfig::deduplicate_blocks)
      .def("__repr__", [](const CacheConfig& c) {
        return "CacheConfig(num_blocks=" + std::to_string(c.num_blocks) + ", block_size=" +
               std::to_string(c.block_size) + ", enable_prefix_caching=" + (c.enable_prefix_caching ? "True" : "False") +
               ", hash_seed=" + std::to_string(c.hash_seed) + ", max_tokens_per_seq=" +
               std::to_string(c.max_tokens_per_seq) + ", enable_events=" + (c.enable_events ? "True" : "False") +
               ", num_host_blocks=" + std::to_string(c.num_host_blocks) + ", groups=" +
               std::to_string(c.groups.size()) + " groups, page_size_bytes=" + std::to_string(c.page_size_bytes) +
               ")";
      });

  nb::class_<MultimodalItem>(m, "MultimodalItem",
                             "A multimodal input at prompt positions [offset_tokens, offset_tokens + length_tokens); "
                             "item_hash (16 bytes) identifies its content.")
      .def(
          "__init__",
          [](MultimodalItem* p, nb::bytes item_hash, std::uint64_t offset_tokens, std::uint64_t length_tokens) {
            new (p) MultimodalItem{hash_from_bytes(item_hash, "MultimodalItem"), offset_tokens, length_tokens};
          },
          "item_hash"_a, "offset_tokens"_a, "length_tokens"_a)
      .def_prop_ro("item_hash", [](const MultimodalItem& i) { return hash_to_bytes(i.item_hash); })
      .def_ro("offset_tokens", &MultimodalItem::offset_tokens)
      .def_ro("length_tokens", &MultimodalItem::length_tokens);

  nb::class_<RequestKeys>(m, "RequestKeys",
                          "Per-request extra keys mixed into block hashes (vLLM's extra keys): LoRA adapter id "
                          "(0 = base model), cache salt (first block only), multimodal items sorted by offset.")
      .def(
          "__init__",
          [](RequestKeys* k, std::uint64_t adapter_id, const std::string& salt,
             const std::vector<MultimodalItem>& multimodal) { new (k) RequestKeys(make_keys(adapter_id, salt, multimodal)); },
          "adapter_id"_a = 0, "salt"_a = "", "multimodal"_a = std::vector<MultimodalItem>{})
      .def_ro("adapter_id", &RequestKeys::adapter_id)
      .def_ro("salt", &RequestKeys::salt)
      .def_ro("multimodal", &RequestKeys::multimodal);

  m.attr("DEFAULT_RETENTION_PRIORITY") = kDefaultRetentionPriority;
  m.attr("MAX_RETENTION_PRIORITY") = kMaxRetentionPriority;
  nb::class_<TokenRangeRetention>(m, "TokenRangeRetention",
                                  "Retention priority of prompt tokens [begin, end) (TensorRT-LLM's "
                                  "TokenRangeRetentionConfig; retention.hpp): `priority` 0..100 (higher = evicted "
                                  "later; default 35), held for `duration` after the block is cached (None = as long "
                                  "as it stays cached; a timedelta or seconds, on the manager's retention clock).")
      .def(
          "__init__",
          [](TokenRangeRetention* r, std::size_t begin, std::optional<std::size_t> end, std::uint8_t priority,
             std::optional<std::chrono::nanoseconds> duration) {
            new (r) TokenRangeRetention{begin, end, priority, duration};
          },
          "begin"_a = 0, "end"_a = nb::none(), "priority"_a = kDefaultRetentionPriority, "duration"_a = nb::none())
      .def_rw("begin", &TokenRangeRetention::begin, "First token position of the range.")
      .def_rw("end", &TokenRangeRetention::end, "One past the last; None = to the end of the prompt.")
      .def_rw("priority", &TokenRangeRetention::priority)
      .def_rw("duration", &TokenRangeRetention::duration)
      .def("__repr__", [](const TokenRangeRetention& r) {
        return "TokenRangeRetention(begin=" + std::to_string(r.begin) +
               ", end=" + (r.end ? std::to_string(*r.end) : std::string("None")) +
               ", priority=" + std::to_string(r.priority) +
               ", duration=" + (r.duration ? std::to_string(r.duration->count()) + " ns" : std::string("None")) + ")";
      });
  nb::class_<RetentionConfig>(m, "RetentionConfig",
                              "A request's retention priorities (TensorRT-LLM's KvCacheRetentionConfig; "
                              "retention.hpp): prompt token `ranges` (sorted by begin, disjoint; uncovered positions "
                              "get the default priority) and `decode_priority` / `decode_duration` for blocks "
                              "holding only generated tokens. A block takes the highest priority among the ranges "
                              "it overlaps when its last holder releases it. Applies under eviction=\"priority\" "
                              "only; validated at admission (InvalidArgumentError naming the range).")
      .def(
          "__init__",
          [](RetentionConfig* c, std::vector<TokenRangeRetention> ranges, std::uint8_t decode_priority,
             std::optional<std::chrono::nanoseconds> decode_duration) {
            new (c) RetentionConfig{std::move(ranges), decode_priority, decode_duration};
          },
          "ranges"_a = std::vector<TokenRangeRetention>{}, "decode_priority"_a = kDefaultRetentionPriority,
          "decode_duration"_a = nb::none())
      .def_prop_rw(
          "ranges", [](const RetentionConfig& c) { return c.ranges; },
          [](RetentionConfig& c, std::vector<TokenRangeRetention> r) { c.ranges = std::move(r); },
          "The token ranges (a copy: assign a new list to change them).")
      .def_rw("decode_priority", &RetentionConfig::decode_priority)
      .def_rw("decode_duration", &RetentionConfig::decode_duration)
      .def(
          "validate", [](const RetentionConfig& c) { validate_retention(c, "RetentionConfig"); },
          "Raise InvalidArgumentError as an admission with this config would (priority above 100, a duration <= 0, "
          "an empty, unsorted or overlapping range).");

  nb::class_<PreparedPrompt>(m, "PreparedPrompt",
                             "A prompt validated and hashed once by KVCacheManager.prepare_prompt, for admissions "
                             "retried step after step while the pool is full (try_admit / query_admit take it "
                             "without hashing again). Tied to the hasher, seed and block size of the manager that "
                             "prepared it. Immutable.")
      .def("__len__", [](const PreparedPrompt& p) { return p.tokens.size(); })
      .def_prop_ro("num_tokens", [](const PreparedPrompt& p) { return p.tokens.size(); })
      .def_prop_ro("tokens", [](const PreparedPrompt& p) { return p.tokens; }, "The token ids (a new list).")
      .def_prop_ro(
          "keys", [](const PreparedPrompt& p) -> std::optional<RequestKeys> {
            if (!p.keys) return std::nullopt;
            return *p.keys;
          },
          "The extra keys (a copy), or None.")
      .def_prop_ro(
          "hashes",
          [](const PreparedPrompt& p) {
            std::vector<nb::bytes> out;
            out.reserve(p.hashes.size());
            for (const BlockHash& h : p.hashes) out.push_back(hash_to_bytes(h));
            return out;
          },
          "The block hashes of its full blocks, [len // block_size] 16-byte bytes (empty without prefix caching).");

  nb::class_<AdmitResult>(m, "AdmitResult", "Result of try_admit / try_resume. Only ADMITTED changed state.")
      .def_ro("status", &AdmitResult::status)
      .def_ro("num_cached_tokens", &AdmitResult::num_cached_tokens, "Prompt tokens found in the prefix cache.")
      .def_ro("num_host_cached_tokens", &AdmitResult::num_host_cached_tokens, "Of which served by the host tier.")
      .def_ro("num_new_blocks", &AdmitResult::num_new_blocks, "Blocks taken from the pool.")
      .def_ro("num_missing_blocks", &AdmitResult::num_missing_blocks,
              "NO_CAPACITY: blocks missing now; NEVER_FITS: beyond the pool; 0 when admitted.")
      .def_prop_ro("admitted", &AdmitResult::admitted)
      .def("__bool__", &AdmitResult::admitted)
      .def("__repr__", [](const AdmitResult& r) {
        return "AdmitResult(status=" + std::to_string(static_cast<int>(r.status)) +
               ", num_cached_tokens=" + std::to_string(r.num_cached_tokens) +
               ", num_new_blocks=" + std::to_string(r.num_new_blocks) +
               ", num_missing_blocks=" + std::to_string(r.num_missing_blocks) + ")";
      });

  nb::class_<PyAppendResult>(m, "AppendResult",
                             "Result of try_append / try_reserve / try_reserve_lookahead. `slots` are the slots "
                             "reserved (block * block_size + offset); the build's slot mapping is the authority.")
      .def_ro("status", &PyAppendResult::status)
      .def_ro("slots", &PyAppendResult::slots)
      .def_ro("copy", &PyAppendResult::copy, "The copy-on-write (src, dst) this call needs, or None.")
      .def_ro("num_missing_blocks", &PyAppendResult::num_missing_blocks)
      .def_ro("num_new_blocks", &PyAppendResult::num_new_blocks,
              "OK: blocks taken from the pool over all groups (new blocks and copies).")
      .def_prop_ro("ok", [](const PyAppendResult& r) { return r.status == AppendStatus::kOk; })
      .def("__bool__", [](const PyAppendResult& r) { return r.status == AppendStatus::kOk; })
      .def("__repr__", [](const PyAppendResult& r) {
        return "AppendResult(status=" + std::to_string(static_cast<int>(r.status)) + ", slots=" +
               std::to_string(r.slots.size()) + " slots, copy=" +
               (r.copy ? "(" + std::to_string(r.copy->first) + ", " + std::to_string(r.copy->second) + ")"
                       : std::string("None")) +
               ", num_missing_blocks=" + std::to_string(r.num_missing_blocks) + ")";
      });

  nb::class_<CapacityQuery>(m, "CapacityQuery", "What an admission or growth would take from the pool now.")
      .def_ro("status", &CapacityQuery::status)
      .def_ro("num_blocks", &CapacityQuery::num_blocks)
      .def_ro("num_missing_blocks", &CapacityQuery::num_missing_blocks)
      .def_ro("num_cached_tokens", &CapacityQuery::num_cached_tokens)
      .def_prop_ro("fits", &CapacityQuery::fits)
      .def("__bool__", &CapacityQuery::fits);

  nb::class_<BatchMetadataSizes>(m, "BatchMetadataSizes", "What one build wrote: the live extents in the buffers.")
      .def_ro("batch_size", &BatchMetadataSizes::batch_size)
      .def_ro("num_indices", &BatchMetadataSizes::num_indices)
      .def_ro("num_new_tokens", &BatchMetadataSizes::num_new_tokens)
      .def_ro("num_copies", &BatchMetadataSizes::num_copies)
      .def_ro("num_swap_out", &BatchMetadataSizes::num_swap_out)
      .def_ro("num_swap_in", &BatchMetadataSizes::num_swap_in)
      .def_ro("transfer_token", &BatchMetadataSizes::transfer_token)
      .def_ro("num_checkpoints", &BatchMetadataSizes::num_checkpoints)
      .def("__repr__", [](const BatchMetadataSizes& s) {
        return repr_fields<std::uint64_t>("BatchMetadataSizes", {{"batch_size", s.batch_size},
                                                                 {"num_indices", s.num_indices},
                                                                 {"num_new_tokens", s.num_new_tokens},
                                                                 {"num_copies", s.num_copies},
                                                                 {"num_swap_out", s.num_swap_out},
                                                                 {"num_swap_in", s.num_swap_in},
                                                                 {"transfer_token", s.transfer_token},
                                                                 {"num_checkpoints", s.num_checkpoints}});
      });

  nb::class_<BatchMetadataLimits>(m, "BatchMetadataLimits", "An engine's fixed limits for one build.")
      .def(
          "__init__",
          [](BatchMetadataLimits* l, std::size_t max_batch, std::size_t max_tokens_per_step,
             std::size_t max_blocks_per_seq, std::size_t max_copies, std::size_t max_swaps,
             std::size_t max_checkpoints) {
            new (l) BatchMetadataLimits{max_batch,  max_tokens_per_step, max_blocks_per_seq,
                                        max_copies, max_swaps,           max_checkpoints};
          },
          "max_batch"_a, "max_tokens_per_step"_a, "max_blocks_per_seq"_a, "max_copies"_a = 0, "max_swaps"_a = 0,
          "max_checkpoints"_a = 0)
      .def_rw("max_batch", &BatchMetadataLimits::max_batch)
      .def_rw("max_tokens_per_step", &BatchMetadataLimits::max_tokens_per_step)
      .def_rw("max_blocks_per_seq", &BatchMetadataLimits::max_blocks_per_seq)
      .def_rw("max_copies", &BatchMetadataLimits::max_copies)
      .def_rw("max_swaps", &BatchMetadataLimits::max_swaps)
      .def_rw("max_checkpoints", &BatchMetadataLimits::max_checkpoints);

  nb::class_<BatchMetadataCapacity>(m, "BatchMetadataCapacity",
                                    "Entries of each buffer for some limits (copies / swaps: int32 entries, two per "
                                    "pair).")
      .def_ro("indptr", &BatchMetadataCapacity::indptr)
      .def_ro("indices", &BatchMetadataCapacity::indices)
      .def_ro("last_page_len", &BatchMetadataCapacity::last_page_len)
      .def_ro("block_tables", &BatchMetadataCapacity::block_tables)
      .def_ro("seq_lens", &BatchMetadataCapacity::seq_lens)
      .def_ro("qo_indptr", &BatchMetadataCapacity::qo_indptr)
      .def_ro("slot_mapping", &BatchMetadataCapacity::slot_mapping)
      .def_ro("copies", &BatchMetadataCapacity::copies)
      .def_ro("swap_out", &BatchMetadataCapacity::swap_out)
      .def_ro("swap_in", &BatchMetadataCapacity::swap_in)
      .def_ro("state_in", &BatchMetadataCapacity::state_in)
      .def_ro("state_out", &BatchMetadataCapacity::state_out)
      .def_ro("checkpoint_indptr", &BatchMetadataCapacity::checkpoint_indptr)
      .def_ro("checkpoint_positions", &BatchMetadataCapacity::checkpoint_positions)
      .def_ro("checkpoint_blocks", &BatchMetadataCapacity::checkpoint_blocks)
      .def_ro("max_blocks_per_seq", &BatchMetadataCapacity::max_blocks_per_seq);
  m.def("batch_metadata_capacity", &batch_metadata_capacity, "limits"_a,
        "Capacities of the buffers a build writes for an engine with `limits`. Raises InvalidArgumentError (a "
        "limit is 0) or LimitExceededError (beyond the int32 metadata).");

  nb::class_<CacheStats>(m, "CacheStats", "Lifetime counters and block counts of a KVCacheManager (stats.hpp).")
      .def_ro("num_usable_blocks", &CacheStats::num_usable_blocks)
      .def_ro("blocks_used", &CacheStats::blocks_used)
      .def_ro("blocks_cached", &CacheStats::blocks_cached)
      .def_ro("blocks_free", &CacheStats::blocks_free)
      .def_ro("usage", &CacheStats::usage)
      .def_ro("prefix_query_requests", &CacheStats::prefix_query_requests)
      .def_ro("prefix_hit_requests", &CacheStats::prefix_hit_requests)
      .def_ro("prefix_query_tokens", &CacheStats::prefix_query_tokens)
      .def_ro("prefix_hit_tokens", &CacheStats::prefix_hit_tokens)
      .def_ro("readmitted_requests", &CacheStats::readmitted_requests)
      .def_ro("readmitted_query_tokens", &CacheStats::readmitted_query_tokens)
      .def_ro("readmitted_hit_tokens", &CacheStats::readmitted_hit_tokens)
      .def_ro("evictions", &CacheStats::evictions)
      .def_ro("cow_copies", &CacheStats::cow_copies)
      .def_ro("dedup_blocks", &CacheStats::dedup_blocks)
      .def_ro("preemptions", &CacheStats::preemptions)
      .def_ro("block_ops", &CacheStats::block_ops)
      .def_ro("host_num_usable_blocks", &CacheStats::host_num_usable_blocks)
      .def_ro("host_blocks_used", &CacheStats::host_blocks_used)
      .def_ro("host_blocks_cached", &CacheStats::host_blocks_cached)
      .def_ro("host_blocks_free", &CacheStats::host_blocks_free)
      .def_ro("host_hit_tokens", &CacheStats::host_hit_tokens)
      .def_ro("host_evictions", &CacheStats::host_evictions)
      .def_ro("offloads", &CacheStats::offloads)
      .def_ro("offloads_dropped", &CacheStats::offloads_dropped)
      .def_ro("offloads_below_priority", &CacheStats::offloads_below_priority)
      .def_ro("onboards", &CacheStats::onboards)
      .def_ro("swap_outs", &CacheStats::swap_outs)
      .def_ro("swap_ins", &CacheStats::swap_ins)
      .def_ro("transfers_in_flight", &CacheStats::transfers_in_flight)
      .def_ro("transfers_queued", &CacheStats::transfers_queued)
      .def_ro("events_lost", &CacheStats::events_lost)
      .def_prop_ro(
          "admissions_by_miss_cause",
          [](const CacheStats& s) {
            nb::dict d;
            for (std::size_t c = 0; c < kNumMissCauses; ++c) {
              d[to_string(static_cast<MissCause>(c))] = s.admissions_by_miss_cause[c];
            }
            return d;
          },
          "Admitted requests per miss cause (label -> count; CacheConfig.count_miss_causes).")
      .def("as_dict", [](const CacheStats& s) {
        nb::dict d;
        nb::object self = nb::cast(s);
        for (const char* k :
             {"num_usable_blocks", "blocks_used", "blocks_cached", "blocks_free", "usage", "prefix_query_requests",
              "prefix_hit_requests", "prefix_query_tokens", "prefix_hit_tokens", "readmitted_requests",
              "readmitted_query_tokens", "readmitted_hit_tokens", "evictions", "cow_copies", "dedup_blocks",
              "preemptions", "block_ops", "host_num_usable_blocks", "host_blocks_used", "host_blocks_cached",
              "host_blocks_free", "host_hit_tokens", "host_evictions", "offloads", "offloads_dropped",
              "offloads_below_priority", "onboards", "swap_outs", "swap_ins", "transfers_in_flight",
              "transfers_queued", "events_lost"}) {
          d[k] = self.attr(k);
        }
        return d;
      }, "Every field as a dict (compare two snapshots with ==).");

  nb::class_<PrefixCacheStats>(m, "PrefixCacheStats",
                               "Prefix-cache statistics of one interval, with vLLM's field names (queries / hits "
                               "are prompt tokens).")
      .def_ro("reset", &PrefixCacheStats::reset)
      .def_ro("requests", &PrefixCacheStats::requests)
      .def_ro("queries", &PrefixCacheStats::queries)
      .def_ro("hits", &PrefixCacheStats::hits)
      .def_ro("preempted_requests", &PrefixCacheStats::preempted_requests)
      .def_ro("preempted_queries", &PrefixCacheStats::preempted_queries)
      .def_ro("preempted_hits", &PrefixCacheStats::preempted_hits)
      .def_prop_ro("hit_rate", &PrefixCacheStats::hit_rate)
      .def_prop_ro("preempted_hit_rate", &PrefixCacheStats::preempted_hit_rate);

  nb::class_<KVEvent>(m, "KVEvent", "One KV-cache event (events.hpp): hashes are 16-byte bytes objects.")
      .def_ro("seq_no", &KVEvent::seq_no)
      .def_ro("type", &KVEvent::type)
      .def_prop_ro("hash", [](const KVEvent& e) { return hash_to_bytes(e.hash); })
      .def_prop_ro("parent_hash",
                   [](const KVEvent& e) -> std::optional<nb::bytes> {
                     if (!e.parent_hash) return std::nullopt;
                     return hash_to_bytes(*e.parent_hash);
                   })
      .def_ro("token_ids", &KVEvent::token_ids)
      .def_ro("block_size", &KVEvent::block_size)
      .def_ro("block_start", &KVEvent::block_start)
      .def_ro("adapter_id", &KVEvent::adapter_id)
      .def_ro("multimodal_items", &KVEvent::multimodal_items)
      .def_ro("salt", &KVEvent::salt)
      .def_ro("medium", &KVEvent::medium)
      .def_ro("group", &KVEvent::group);
  nb::class_<KVEventBatch>(m, "KVEventBatch", "The events of one engine step (vLLM's KVEventBatch).")
      .def_ro("seq_no", &KVEventBatch::seq_no)
      .def_ro("ts", &KVEventBatch::ts)
      .def_ro("events", &KVEventBatch::events);

  // ---- the manager ----
  auto manager_cls = nb::class_<Manager>(m, "KVCacheManager",
                      "The KV-cache manager a scheduler calls, one per KV pool (kv_cache_manager.hpp). `hasher`: "
                      "\"sha256\" (default) or \"xxh3\"; `eviction`: \"lru\" (default), \"slru\" or \"priority\". "
                      "Thread-safe in Python: each call holds the manager's lock (the GIL is released while it "
                      "works).")
      .def(nb::init<const CacheConfig&, const std::string&, const std::string&>(), "config"_a,
           "hasher"_a = "sha256", "eviction"_a = "lru",
           "Raises InvalidArgumentError (num_blocks < 2, block_size outside [1, 65536], unknown hasher or "
           "eviction) or LimitExceededError (num_blocks > 2^31, max_tokens_per_seq > 2^31 - 1).")
      .def_prop_ro("hasher", &Manager::hasher)
      .def_prop_ro("eviction", &Manager::eviction)
      .def_prop_ro("config", [](Manager& s) { return s.peek([](auto& mm) { return mm.config(); }); })
      .def_prop_ro("block_size", [](Manager& s) { return s.peek([](auto& mm) { return mm.block_size(); }); })
      .def(
          "group_block_size",
          [](Manager& s, std::size_t g) {
            return s.peek([&](auto& mm) {
              if (g >= mm.num_groups()) {
                invalid("group_block_size: group " + std::to_string(g) + " >= " + std::to_string(mm.num_groups()) +
                        " groups");
              }
              return mm.block_size(g);
            });
          },
          "g"_a, "Tokens per block of group g's pages (its block table, page table and slot mapping count in them).")
      .def_prop_ro("max_tokens_per_seq",
                   [](Manager& s) { return s.peek([](auto& mm) { return mm.max_tokens_per_seq(); }); })
      .def(
          "try_admit",
          [](Manager& s, SeqId seq, const Tokens& prompt, const RequestKeys* keys,
             std::optional<std::size_t> max_cached_tokens, std::optional<std::size_t> num_reserved_tokens,
             const RetentionConfig* retention, std::optional<std::size_t> prompt_retention_tokens,
             std::size_t shared_prefix_boundary) {
            const AdmitOptions o = admit_options(max_cached_tokens, num_reserved_tokens, retention,
                                                 prompt_retention_tokens, shared_prefix_boundary);
            return s.work([&](auto& mm) { return mm.try_admit(seq, prompt.span(), keys, o); });
          },
          "seq"_a, "prompt"_a, "keys"_a = nb::none(), nb::kw_only(), "max_cached_tokens"_a = nb::none(),
          "num_reserved_tokens"_a = nb::none(), "retention"_a = nb::none(), "prompt_retention_tokens"_a = nb::none(),
          "shared_prefix_boundary"_a = 0,
          "Admit sequence `seq` with `prompt` (int32 token ids), all or nothing. `retention`: the priorities its "
          "blocks take when released (copied; eviction=\"priority\" only). `prompt_retention_tokens` (default the "
          "prompt's length) and `shared_prefix_boundary` (0 = none): the sequence's boundaries under "
          "CacheConfig.window_retention_interval (AdmitOptions). An empty prompt admits a sequence with no token "
          "yet (its slots come from try_append or try_reserve_lookahead). Raises DuplicateSequenceError, "
          "InvalidArgumentError (bad multimodal item, invalid retention, a boundary past the prompt), "
          "LimitExceededError (prompt > max_tokens_per_seq).")
      .def(
          "try_admit",
          [](Manager& s, SeqId seq, const PreparedPrompt& prompt, std::optional<std::size_t> max_cached_tokens,
             std::optional<std::size_t> num_reserved_tokens, const RetentionConfig* retention,
             std::optional<std::size_t> prompt_retention_tokens, std::size_t shared_prefix_boundary) {
            const AdmitOptions o = admit_options(max_cached_tokens, num_reserved_tokens, retention,
                                                 prompt_retention_tokens, shared_prefix_boundary);
            return s.work([&](auto& mm) { return mm.try_admit(seq, prompt, o); });
          },
          "seq"_a, "prompt"_a, nb::kw_only(), "max_cached_tokens"_a = nb::none(),
          "num_reserved_tokens"_a = nb::none(), "retention"_a = nb::none(), "prompt_retention_tokens"_a = nb::none(),
          "shared_prefix_boundary"_a = 0,
          "try_admit of a prompt hashed beforehand by prepare_prompt (its keys included): no hashing. Also raises "
          "InvalidArgumentError for a prompt prepared by a manager with another hasher, seed or block size.")
      .def(
          "prepare_prompt",
          [](Manager& s, const Tokens& prompt, const RequestKeys* keys) {
            return s.work([&](auto& mm) { return mm.prepare_prompt(prompt.span(), keys); });
          },
          "prompt"_a, "keys"_a = nb::none(),
          "Validate `prompt` (with `keys`) and hash its full blocks once (GIL released), for try_admit / "
          "query_admit retries. Pure. Raises as try_admit for invalid input.")
      .def(
          "try_append",
          [](Manager& s, SeqId seq, const Tokens& tokens) {
            return s.work([&](auto& mm) { return to_py(mm.try_append(seq, tokens.span())); });
          },
          "seq"_a, "tokens"_a,
          "Append `tokens` to live sequence `seq`, reserving their slots (copy-on-write of a shared tail first). "
          "Raises UnknownSequenceError, LimitExceededError, InvalidArgumentError.")
      .def(
          "append_tokens",
          [](Manager& s, const SeqIds& seq_ids, const Tokens& tokens, std::optional<OutU8> out) {
            const std::size_t n = seq_ids.size;
            std::uint8_t* status = nullptr;
            nb::ndarray<nb::numpy, std::uint8_t, nb::ndim<1>> result;
            if (out) {
              if (out->shape(0) < n) {
                bad_shape("append_tokens: out holds " + std::to_string(out->shape(0)) + " entries for " +
                          std::to_string(n) + " sequences");
              }
              status = out->data();
              result = nb::ndarray<nb::numpy, std::uint8_t, nb::ndim<1>>(status, {n}, nb::cast(*out));
            } else {
              auto* buf = new std::uint8_t[n == 0 ? 1 : n];
              nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<std::uint8_t*>(p); });
              status = buf;
              result = nb::ndarray<nb::numpy, std::uint8_t, nb::ndim<1>>(buf, {n}, owner);
            }
            s.work([&](auto& mm) { append_tokens_into(mm, seq_ids.span(), tokens.span(), status); });
            return result;
          },
          "seq_ids"_a, "tokens"_a, "out"_a.noconvert() = nb::none(),
          "Decode step in one call: try_append(seq_ids[i], [tokens[i]]) for every i, in order. Returns the uint8 "
          "AppendStatus of each (a new array, or a view of the first len(seq_ids) entries of `out` if given). Every id is checked first (live, no prompt tokens without "
          "slots, no lookahead, within max_tokens_per_seq), so a raised error changes nothing.")
      .def(
          "try_reserve",
          [](Manager& s, SeqId seq, std::size_t n) {
            return s.work([&](auto& mm) { return to_py(mm.try_reserve(seq, n)); });
          },
          "seq"_a, "n"_a, "Chunked prefill: reserve slots for the next `n` prompt tokens of `seq`, all or nothing.")
      .def(
          "mark_checkpoint",
          [](Manager& s, SeqId seq, std::size_t pos) {
            return s.work([&](auto& mm) { return mm.mark_checkpoint(seq, pos); });
          },
          "seq"_a, "pos"_a,
          "Keep the state after the first `pos` tokens of `seq` as a checkpoint of every recurrent group (the end of "
          "a chat turn or tool output), besides those of the interval. `pos`: a block boundary in (num_built, "
          "num_tokens], not inside lookahead slots. Returns AppendStatus.OK or NO_CAPACITY (nothing changed). Raises "
          "UnknownSequenceError, InvalidArgumentError (no recurrent group, prefix caching off, not a block boundary, "
          "already built), LimitExceededError (beyond the slotted positions, or inside lookahead slots).")
      .def(
          "try_reserve_lookahead",
          [](Manager& s, SeqId seq, std::size_t k) {
            return s.work([&](auto& mm) { return to_py(mm.try_reserve_lookahead(seq, k)); });
          },
          "seq"_a, "k"_a,
          "Speculative decoding: reserve `k` lookahead slots after the last token of `seq`. With a recurrent group, "
          "each slot also takes a draft state block in it (the build writes the state after each draft there; "
          "commit_lookahead keeps the one after the last accepted draft).")
      .def(
          "commit_lookahead",
          [](Manager& s, SeqId seq, const Tokens& accepted) {
            s.work([&](auto& mm) { mm.commit_lookahead(seq, accepted.span()); });
          },
          "seq"_a, "accepted"_a, "Keep the accepted draft tokens of the outstanding lookahead, rewind the rest.")
      .def(
          "fork",
          [](Manager& s, SeqId parent, SeqId child) { s.work([&](auto& mm) { mm.fork(parent, child); }); },
          "parent"_a, "child"_a, "Share every block of settled `parent` with new sequence `child`.")
      .def(
          "free", [](Manager& s, SeqId seq) { s.work([&](auto& mm) { mm.free(seq); }); }, "seq"_a,
          "Free sequence `seq` (live or swapped). Raises UnknownSequenceError (also on a double free).")
      .def(
          "free_many",
          [](Manager& s, const SeqIds& seq_ids) {
            s.work([&](auto& mm) {
              const auto ids = seq_ids.span();
              for (std::size_t i = 0; i < ids.size(); ++i) {
                const SeqId seq = static_cast<SeqId>(ids[i]);
                if (!mm.contains(seq) && !mm.is_swapped(seq)) {
                  detail::raise(Errc::kUnknownSequence, "free_many: seq_ids[" + std::to_string(i) + "] = " +
                                                            std::to_string(seq) + " is not live");
                }
              }
              std::vector<std::int64_t> sorted(ids.begin(), ids.end());
              std::sort(sorted.begin(), sorted.end());
              if (const auto d = std::adjacent_find(sorted.begin(), sorted.end()); d != sorted.end()) {
                detail::raise(Errc::kUnknownSequence, "free_many: sequence " + std::to_string(static_cast<SeqId>(*d)) +
                                                          " appears twice in seq_ids (a double free)");
              }
              for (std::int64_t id : ids) mm.free(static_cast<SeqId>(id));
            });
          },
          "seq_ids"_a,
          "Free every sequence of `seq_ids` (int64). All are checked first (live or swapped, no repeats), so a "
          "raised UnknownSequenceError frees nothing.")
      .def(
          "preempt",
          [](Manager& s, SeqId seq, PreemptMode mode) {
            return s.work([&](auto& mm) { return mm.preempt(seq, mode); });
          },
          "seq"_a, "mode"_a = PreemptMode::kRecompute,
          "Preempt running sequence `seq`. RECOMPUTE frees it (counted as a preemption); SWAP copies its blocks to "
          "the host tier (returns False, changing nothing, when the tier is full).")
      .def(
          "try_resume", [](Manager& s, SeqId seq) { return s.work([&](auto& mm) { return mm.try_resume(seq); }); },
          "seq"_a, "Resume swapped sequence `seq`.")
      .def(
          "rewind", [](Manager& s, SeqId seq, std::size_t n) { s.work([&](auto& mm) { mm.rewind(seq, n); }); },
          "seq"_a, "n"_a, "Drop the last `n` tokens of `seq`. Raises UnknownSequenceError, LimitExceededError.")
      .def(
          "lookup",
          [](Manager& s, const Tokens& prompt, const RequestKeys* keys, std::optional<std::size_t> max_cached) {
            return s.work([&](auto& mm) { return mm.lookup(prompt.span(), keys, max_cached); });
          },
          "prompt"_a, "keys"_a = nb::none(), nb::kw_only(), "max_cached_tokens"_a = nb::none(),
          "Cached prefix length in tokens of `prompt` if it were admitted now (pure).")
      .def(
          "explain_admit",
          [](Manager& s, const Tokens& prompt, const RequestKeys* keys, std::optional<std::size_t> max_cached_tokens) {
            const AdmitOptions o = admit_options(max_cached_tokens, std::nullopt, nullptr);
            return s.work([&](auto& mm) { return mm.explain_admit(prompt.span(), keys, o); });
          },
          "prompt"_a, "keys"_a = nb::none(), nb::kw_only(), "max_cached_tokens"_a = nb::none(),
          "Why the hit of `prompt` would end where it does if admitted now: an AdmitExplanation (pure).")
      .def(
          "query_admit",
          [](Manager& s, const Tokens& prompt, const RequestKeys* keys, std::optional<std::size_t> max_cached_tokens,
             std::optional<std::size_t> num_reserved_tokens, const RetentionConfig* retention) {
            const AdmitOptions o = admit_options(max_cached_tokens, num_reserved_tokens, retention);
            return s.work([&](auto& mm) { return mm.query_admit(prompt.span(), keys, o); });
          },
          "prompt"_a, "keys"_a = nb::none(), nb::kw_only(), "max_cached_tokens"_a = nb::none(),
          "num_reserved_tokens"_a = nb::none(), "retention"_a = nb::none(), "What try_admit would take now (pure).")
      .def(
          "query_admit",
          [](Manager& s, const PreparedPrompt& prompt, std::optional<std::size_t> max_cached_tokens,
             std::optional<std::size_t> num_reserved_tokens, const RetentionConfig* retention) {
            const AdmitOptions o = admit_options(max_cached_tokens, num_reserved_tokens, retention);
            return s.work([&](auto& mm) { return mm.query_admit(prompt, o); });
          },
          "prompt"_a, nb::kw_only(), "max_cached_tokens"_a = nb::none(), "num_reserved_tokens"_a = nb::none(),
          "retention"_a = nb::none(), "What try_admit of a prepared prompt would take now (pure, no hashing).")
      .def(
          "expire_retention",
          [](Manager& s, RetentionTimePoint now) { return s.work([&](auto& mm) { return mm.expire_retention(now); }); },
          "now"_a,
          "Retention clock tick: record `now` (seconds or a timedelta on the steady clock, i.e. time.monotonic(); "
          "the clock never goes back) and let every cached block whose retention duration expired by then fall back "
          "to the default priority, in both tiers. Durations count from the last `now` recorded: call it once per "
          "step. Returns how many cached blocks changed priority (0 unless eviction=\"priority\").")
      .def(
          "retention_now", [](Manager& s) { return s.peek([](auto& mm) { return mm.retention_now(); }); },
          "The retention clock: the latest `now` given to expire_retention (a timedelta since the steady clock's "
          "epoch; 0 before the first call).")
      .def(
          "query_append",
          [](Manager& s, SeqId seq, std::size_t n) {
            return s.work([&](auto& mm) { return mm.query_append(seq, n); });
          },
          "seq"_a, "n"_a, "What growing `seq` by `n` slots would take now (pure).")
      .def(
          "__contains__", [](Manager& s, SeqId seq) { return s.peek([&](auto& mm) { return mm.contains(seq); }); },
          "seq"_a)
      .def(
          "contains", [](Manager& s, SeqId seq) { return s.peek([&](auto& mm) { return mm.contains(seq); }); },
          "seq"_a, "Whether `seq` is live.")
      .def_prop_ro("num_sequences",
                   [](Manager& s) { return s.peek([](auto& mm) { return mm.num_sequences(); }); })
      .def("__len__", [](Manager& s) { return s.peek([](auto& mm) { return mm.num_sequences(); }); })
      .def(
          "num_tokens", [](Manager& s, SeqId seq) { return s.peek([&](auto& mm) { return mm.num_tokens(seq); }); },
          "seq"_a, "Tokens of live sequence `seq` (positions with slots).")
      .def(
          "block_ids",
          [](Manager& s, SeqId seq, std::size_t g) {
            std::vector<std::uint32_t> v = s.peek([&](auto& mm) {
              auto b = mm.block_ids(seq, g);
              return std::vector<std::uint32_t>(b.begin(), b.end());
            });
            auto* heap = new std::vector<std::uint32_t>(std::move(v));
            nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<std::uint32_t>*>(p); });
            return nb::ndarray<nb::numpy, std::uint32_t, nb::ndim<1>>(heap->data(), {heap->size()}, owner);
          },
          "seq"_a, "group"_a = 0,
          "Group `group`'s block table of live sequence `seq` (a new uint32 array; a windowed group's leading "
          "entries may be the null block 0). Raises UnknownSequenceError, InvalidArgumentError (group).")
      .def(
          "token_ids",
          [](Manager& s, SeqId seq) {
            return s.peek([&](auto& mm) { auto t = mm.token_ids(seq); return std::vector<TokenId>(t.begin(), t.end()); });
          },
          "seq"_a, "Token ids of live sequence `seq` (a new list).")
      .def(
          "pending_slots",
          [](Manager& s, SeqId seq, std::size_t g) { return s.peek([&](auto& mm) { return mm.pending_slots(seq, g); }); },
          "seq"_a, "group"_a = 0,
          "Slots of the pending (unbuilt) positions of `seq` in group `group`'s blocks; -1 where the block is null (a "
          "window group's block an open fill leaves out).")
      .def(
          "is_swapped", [](Manager& s, SeqId seq) { return s.peek([&](auto& mm) { return mm.is_swapped(seq); }); },
          "seq"_a)
      .def_prop_ro("num_groups", [](Manager& s) { return s.peek([](auto& mm) { return mm.num_groups(); }); },
                   "KV-cache groups (1 for a plain full-attention pool).")
      .def_prop_ro("bytes_per_block",
                   [](Manager& s) { return s.peek([](auto& mm) { return mm.bytes_per_block(); }); },
                   "Bytes of one pool block: max(page_size_bytes, every recurrent group's state_bytes) x the most "
                   "layers of any group (0 without either).")
      .def(
          "window",
          [](Manager& s, std::size_t g) {
            return s.peek([&](auto& mm) {
              check_group_index(g, mm.num_groups(), "window");
              return mm.window(g);
            });
          },
          "group"_a, "The AttentionWindow of group `group` (off for full attention). Raises InvalidArgumentError.")
      .def(
          "window_block_bound",
          [](Manager& s, std::size_t g, std::size_t chunk_tokens) {
            return s.peek([&](auto& mm) { return mm.window_block_bound(g, chunk_tokens); });
          },
          "group"_a, "chunk_tokens"_a,
          "Most blocks a sequence holds in windowed group `group` growing by at most `chunk_tokens` per build: "
          "ceil((W - 1 + chunk) / block_size) + 1 (chunked-local: C - 1 for W - 1); None for a full group. Raises "
          "InvalidArgumentError.")
      .def(
          "release_skipped_blocks",
          [](Manager& s, SeqId seq) { return s.work([&](auto& mm) { return mm.release_skipped_blocks(seq); }); },
          "seq"_a,
          "The release rule for `seq` now (CacheConfig.release_at_build False leaves it to this call): blocks of "
          "windowed and recurrent groups no query from its computed position on reads leave its tables. Call it "
          "before the sequence grows for its next step (vLLM's remove_skipped_blocks), never between a build and "
          "the kernels reading it. Returns how many table entries it released (0: the tables did not change). Raises "
          "UnknownSequenceError.")
      .def(
          "num_null_blocks",
          [](Manager& s, SeqId seq, std::size_t g) {
            return s.peek([&](auto& mm) { return mm.num_null_blocks(seq, g); });
          },
          "seq"_a, "group"_a = 0,
          "Leading null blocks (0) of group `group`'s table of `seq`: blocks released behind a windowed group's "
          "window, or before the window at a prefix hit. Raises UnknownSequenceError, InvalidArgumentError.")
      .def(
          "is_recurrent",
          [](Manager& s, std::size_t g) {
            return s.peek([&](auto& mm) {
              check_group_index(g, mm.num_groups(), "is_recurrent");
              return mm.is_recurrent(g);
            });
          },
          "group"_a, "Whether group `group` is a recurrent-state group. Raises InvalidArgumentError.")
      .def(
          "state_block",
          [](Manager& s, SeqId seq, std::size_t g) {
            return s.peek([&](auto& mm) { return static_cast<std::uint32_t>(mm.state_block(seq, g)); });
          },
          "seq"_a, "group"_a,
          "The block of `seq`'s working state in recurrent group `group` (held from admission to free; a fork "
          "shares it until the next growth of either side copies it). Raises UnknownSequenceError, "
          "InvalidArgumentError (not a recurrent group).")
      .def(
          "num_built", [](Manager& s, SeqId seq) { return s.peek([&](auto& mm) { return mm.num_built(seq); }); },
          "seq"_a, "Positions of `seq` whose writes a build issued (or served by prefix hits).")
      .def(
          "held_blocks",
          [](Manager& s, std::size_t g) { return s.peek([&](auto& mm) { return mm.held_blocks(g); }); }, "group"_a,
          "Blocks group `group` holds now (refcount > 0, each shared block once). Raises InvalidArgumentError.")
      .def(
          "peak_held_blocks",
          [](Manager& s, std::size_t g) { return s.peek([&](auto& mm) { return mm.peak_held_blocks(g); }); },
          "group"_a, "The most blocks group `group` held at once since construction or reset_peaks().")
      .def(
          "held_bytes",
          [](Manager& s, std::size_t g) { return s.peek([&](auto& mm) { return mm.held_bytes(g); }); }, "group"_a,
          "held_blocks(group) x bytes_per_block.")
      .def("peak_used_blocks", [](Manager& s) { return s.peek([](auto& mm) { return mm.peak_used_blocks(); }); },
           "The most blocks all groups held at once since construction or reset_peaks().")
      .def("reset_peaks", [](Manager& s) { s.peek([](auto& mm) { mm.reset_peaks(); }); },
           "Restart the peaks at the current values.")
      .def(
          "group_of",
          [](Manager& s, std::uint32_t b) {
            return s.peek([&](auto& mm) {
              if (b == 0 || b >= mm.config().num_blocks) {
                detail::raise(Errc::kBlockOutOfRange, "group_of: block " + std::to_string(b) + " outside [1, " +
                                                          std::to_string(mm.config().num_blocks) + ")");
              }
              return mm.group_of(b);
            });
          },
          "block"_a,
          "The group whose table holds (or last held) pool block `block` (0 with one group). Raises "
          "BlockOutOfRangeError.")
      .def(
          "num_cached_blocks",
          [](Manager& s, std::size_t g) { return s.peek([&](auto& mm) { return mm.prefix_index(g).size(); }); },
          "group"_a = 0,
          "Blocks registered in group `group`'s prefix index (cached: held or evictable). Raises "
          "InvalidArgumentError.")
      .def(
          "cached_block",
          [](Manager& s, const nb::bytes& hash, std::size_t g) {
            const BlockHash h = hash_from_bytes(hash, "cached_block");
            return s.peek([&](auto& mm) -> std::optional<Id> { return mm.prefix_index(g).find(h); });
          },
          "hash"_a, "group"_a = 0,
          "The block group `group`'s prefix index holds under `hash` (16 bytes, as in events and "
          "PreparedPrompt.hashes), or None: a prefix miss in that group. Raises InvalidArgumentError.")
      .def(
          "block_hash",
          [](Manager& s, std::uint32_t b) {
            const std::optional<BlockHash> h = s.peek([&](auto& mm) -> std::optional<BlockHash> {
              if (b == 0 || b >= mm.config().num_blocks) return std::nullopt;
              return mm.prefix_index(mm.group_of(b)).hash_of(b);
            });
            return h ? std::optional<nb::bytes>(hash_to_bytes(*h)) : std::nullopt;
          },
          "block"_a, "The hash block `block` is registered under in its group's prefix index, or None.")
      .def("stats", [](Manager& s) { return s.peek([](auto& mm) { return mm.stats(); }); }, "Counters now.")
      .def("take_prefix_cache_stats",
           [](Manager& s) { return s.peek([](auto& mm) { return mm.take_prefix_cache_stats(); }); },
           "Prefix-cache statistics since the previous call (vLLM's PrefixCacheStats).")
      .def("reset_prefix_cache", [](Manager& s) { return s.work([](auto& mm) { return mm.reset_prefix_cache(); }); },
           "Drop every block hash; False (nothing changed) while a block is referenced.")
      .def(
          "complete_transfers",
          [](Manager& s, std::uint64_t token) { s.work([&](auto& mm) { mm.complete_transfers(token); }); },
          "token"_a, "The copies of the build that returned `token` (transfer_token) have completed.")
      .def(
          "take_event_batch",
          [](Manager& s, double ts) { return s.work([&](auto& mm) { return mm.take_event_batch(ts); }); }, "ts"_a,
          "The events since the last take or drain as the next numbered KVEventBatch, or None.")
      .def(
          "drain_events",
          [](Manager& s) {
            return s.work([](auto& mm) {
              std::vector<KVEvent> out;
              mm.drain_events(out);
              return out;
            });
          },
          "The recorded events (oldest first), unbatched.")
      .def(
          "build_batch_metadata",
          [](Manager& s, const SeqIds& batch, std::optional<OutI32> indptr, std::optional<OutI32> indices,
             std::optional<OutI32> last_page_len, std::optional<OutI32Table> block_tables,
             std::optional<OutI32> seq_lens, std::optional<OutI32> qo_indptr, std::optional<OutI64> slot_mapping,
             std::optional<OutPairs> copies, std::optional<OutPairs> swap_out, std::optional<OutPairs> swap_in,
             std::optional<U32s> num_scheduled_tokens) {
            PyBuffers arrays{indptr,    indices,      last_page_len, block_tables, seq_lens,
                             qo_indptr, slot_mapping, copies,        swap_out,     swap_in,
                             {},        {},           {},            {},           {}};
            const BatchMetadataBuffers buf = arrays.view();
            const std::span<const std::uint32_t> sched =
                num_scheduled_tokens ? num_scheduled_tokens->span() : std::span<const std::uint32_t>{};
            const std::span<const SeqId> seqs = seq_span(batch);
            return s.work([&](auto& mm) { return mm.build_batch_metadata(seqs, buf, sched); });
          },
          "batch"_a, nb::kw_only(), "indptr"_a.noconvert() = nb::none(), "indices"_a.noconvert() = nb::none(),
          "last_page_len"_a.noconvert() = nb::none(), "block_tables"_a.noconvert() = nb::none(),
          "seq_lens"_a.noconvert() = nb::none(), "qo_indptr"_a.noconvert() = nb::none(),
          "slot_mapping"_a.noconvert() = nb::none(), "copies"_a.noconvert() = nb::none(),
          "swap_out"_a.noconvert() = nb::none(), "swap_in"_a.noconvert() = nb::none(),
          "num_scheduled_tokens"_a = nb::none(),
          "Write this step's metadata for the sequences `batch` (int64 ids, in order) straight into the given numpy "
          "arrays (int32; slot_mapping int64; block_tables [max_batch, max_blocks_per_seq]; copies / swap_out / "
          "swap_in [n, 2]); None skips an output. Returns the sizes written. Nothing is copied: the arrays are "
          "written in place, so pinned host buffers can be reused step after step. Raises as the C++ call "
          "(UnknownSequenceError, InvalidArgumentError, BadShapeError, LimitExceededError; BadShapeError on a "
          "manager with several KV-cache groups: pass groups=); then nothing is written and nothing changes.")
      .def(
          "build_batch_metadata",
          [](Manager& s, const SeqIds& batch, const std::vector<nb::object>& groups,
             std::optional<U32s> num_scheduled_tokens) {
            std::vector<PyBuffers> arrays;
            arrays.reserve(groups.size());
            for (std::size_t g = 0; g < groups.size(); ++g) arrays.push_back(buffers_from(groups[g], g));
            std::vector<BatchMetadataBuffers> bufs;
            bufs.reserve(arrays.size());
            for (PyBuffers& a : arrays) bufs.push_back(a.view());
            const std::span<const std::uint32_t> sched =
                num_scheduled_tokens ? num_scheduled_tokens->span() : std::span<const std::uint32_t>{};
            const std::span<const SeqId> seqs = seq_span(batch);
            std::vector<BatchMetadataSizes> sizes(groups.size());
            s.work([&](auto& mm) { mm.build_batch_metadata(seqs, bufs, sched, sizes); });
            return sizes;
          },
          "batch"_a, nb::kw_only(), "groups"_a, "num_scheduled_tokens"_a = nb::none(),
          "The build of a manager with KV-cache groups: `groups[g]` holds group g's output arrays, as a dict of the "
          "one-group call's buffer keywords (BatchMetadataBuffers.kwargs()) or a BatchMetadataBuffers; one entry "
          "per group (num_groups). Each group gets its own page table (the null block 0 before a windowed group's "
          "window), slot mapping and copy list; seq_lens and qo_indptr are equal in every group; the host tier's "
          "swap lists go into group 0's buffers. Returns the sizes written, one per group. Written in place with "
          "the GIL released, as the one-group call. Raises TypeError (an unknown key, an array of the wrong dtype, "
          "layout or writability), BadShapeError (len(groups) != num_groups, a buffer too small) and as the "
          "one-group call; then nothing is written and nothing changes.");
  bind_vllm_helpers(manager_cls);
  bind_external_kv(m, manager_cls);  // bindings_external.cpp
}
