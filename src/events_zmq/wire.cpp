// src/events_zmq/wire.cpp: vLLM-format msgpack encoding and decoding of KV event batches (msgpack-cxx).
// Layout and sources: docs/events-wire.md.
#include <pagedkv/events_zmq/wire.hpp>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <unordered_map>

#include <msgpack.hpp>

namespace pagedkv::events {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Encoding

/// msgpack-cxx output stream appending to a byte vector.
struct ByteSink {
  std::vector<std::byte>* out;
  void write(const char* p, std::size_t n) {
    const auto* b = reinterpret_cast<const std::byte*>(p);
    out->insert(out->end(), b, b + n);
  }
};
using Packer = msgpack::packer<ByteSink>;

constexpr std::string_view kBlockStored = "BlockStored";
constexpr std::string_view kBlockRemoved = "BlockRemoved";
constexpr std::string_view kAllBlocksCleared = "AllBlocksCleared";

void put_str(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<std::uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<std::uint32_t>(s.size()));
}

void put_bin(Packer& pk, const void* p, std::size_t n) {
  pk.pack_bin(static_cast<std::uint32_t>(n));
  pk.pack_bin_body(static_cast<const char*>(p), static_cast<std::uint32_t>(n));
}

/// Always a float64 (0xcb), as msgspec writes a Python float: msgpack-cxx's pack_double writes a whole number as an
/// integer, which typed decoders of vLLM's `ts: float` need not accept.
void put_f64(ByteSink& sink, double d) {
  const auto bits = std::bit_cast<std::uint64_t>(d);
  char b[9];
  b[0] = static_cast<char>(0xcb);
  for (int i = 0; i < 8; ++i) b[1 + i] = static_cast<char>(bits >> (56 - 8 * i));
  sink.write(b, sizeof b);
}

void put_hash(Packer& pk, const BlockHash& h, HashFormat f) {
  if (f == HashFormat::kBytes16) {
    put_bin(pk, h.bytes.data(), h.bytes.size());
  } else {
    pk.pack_uint64(wire_key(h));
  }
}

/// Whether `s` is well-formed UTF-8 (msgpack str must be; msgspec decodes str into a Python str).
bool is_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t n = 0;
    std::uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;  // truncated sequence
    for (std::size_t k = 1; k <= n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    // Overlong forms, surrogates and code points past U+10FFFF are not UTF-8.
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += n + 1;
  }
  return true;
}

const char* medium_name(Medium m) { return to_string(m); }


std::optional<std::string> lora_name_of(std::uint64_t adapter_id, const EncodeOptions& opt) {
  if (adapter_id == 0 || !opt.lora_name) return std::nullopt;
  return opt.lora_name(adapter_id);
}

std::string mm_identifier_of(const BlockHash& h, const EncodeOptions& opt) {
  if (opt.mm_identifier) {
    if (auto id = opt.mm_identifier(h)) return *id;
  }
  std::string hex = h.hex();
  if (opt.mm_id_form == MmIdForm::kHex64) hex.append(32, '0');
  return hex;
}

/// One block's `extra_keys` entry (docs/events-wire.md section 6): nil, or
/// [lora_name or adapter_id?, [item_id, offset]..., salt (in `salt_form`)?], vLLM's order.
/// `run_head`: the block is the first of its wire event. The bare (vLLM) salt goes on a sequence's first block
/// only, where vLLM puts it and where it enters the hash; Dynamo's tagged salt goes on the first block of every
/// event of a salted sequence, because Dynamo reads the namespace from an event's first block and seeds every
/// block's hash with it (a continuation event without it would be indexed as unsalted).
void put_block_keys(Packer& pk, const KVEvent& e, bool run_head, const std::optional<std::string>& lora,
                    const EncodeOptions& opt) {
  const bool utf8 = !e.salt.empty() && is_utf8(e.salt);
  // A salt that is not UTF-8 cannot carry Dynamo's text prefix: it is written bare, as bytes, whatever the form.
  const bool bare = e.block_start == 0 && !e.salt.empty() && (opt.salt_form != SaltForm::kDynamo || !utf8);
  const bool tagged = run_head && utf8 && opt.salt_form != SaltForm::kVllm;
  if (e.adapter_id == 0 && e.multimodal_items.empty() && !bare && !tagged) {
    pk.pack_nil();
    return;
  }
  pk.pack_array(static_cast<std::uint32_t>((e.adapter_id != 0 ? 1 : 0) + e.multimodal_items.size() + (bare ? 1 : 0) +
                                           (tagged ? 1 : 0)));
  if (e.adapter_id != 0) {
    if (lora) {
      put_str(pk, *lora);
    } else {
      pk.pack_uint64(e.adapter_id);
    }
  }
  for (const MultimodalItem& m : e.multimodal_items) {
    pk.pack_array(2);
    put_str(pk, mm_identifier_of(m.item_hash, opt));
    pk.pack_int64(static_cast<std::int64_t>(m.offset_tokens - e.block_start));  // two's complement: may be < 0
  }
  if (bare) {
    if (utf8) {
      put_str(pk, e.salt);
    } else {
      put_bin(pk, e.salt.data(), e.salt.size());
    }
  }
  if (tagged) put_str(pk, std::string(kDynamoCacheSaltPrefix) + e.salt);
}

/// The spec of `group` (nullptr: none to write). Throws when a non-empty table lacks the group.
const GroupSpec* group_spec(std::uint32_t group, const EncodeOptions& opt, std::size_t index) {
  static const GroupSpec kFull{};
  if (opt.group_specs.empty()) return group == 0 ? &kFull : nullptr;
  if (group >= opt.group_specs.size()) {
    pagedkv::detail::raise(Errc::kInvalidArgument,
                           "encode_batch: event " + std::to_string(index) + " is in KV-cache group " +
                               std::to_string(group) + ", but EncodeOptions::group_specs has " +
                               std::to_string(opt.group_specs.size()) + " entries (one per group needed)");
  }
  const GroupSpec* g = &opt.group_specs[group];
  if (g->kind.empty()) {
    pagedkv::detail::raise(Errc::kInvalidArgument, "encode_batch: EncodeOptions::group_specs[" +
                                                       std::to_string(group) + "].kind is empty");
  }
  return g;
}

void put_optional_lora_id(Packer& pk, std::uint64_t adapter_id) {
  if (adapter_id == 0) {
    pk.pack_nil();
  } else {
    pk.pack_uint64(adapter_id);
  }
}

void put_lora_name(Packer& pk, const std::optional<std::string>& name) {
  if (name) {
    put_str(pk, *name);
  } else {
    pk.pack_nil();
  }
}

/// A run of KVEvents that becomes one wire event: events[first, last].
struct Run {
  std::size_t first;
  std::size_t last;
};

bool chains(const KVEvent& a, const KVEvent& b) {
  return b.type == KVEventType::kBlockStored && b.parent_hash && *b.parent_hash == a.hash &&
         b.block_size == a.block_size && b.adapter_id == a.adapter_id && b.medium == a.medium &&
         b.group == a.group && b.block_start == a.block_start + a.block_size;
}

bool same_removal_group(const KVEvent& a, const KVEvent& b) {
  return b.type == KVEventType::kBlockRemoved && b.medium == a.medium && b.group == a.group;
}

template <class Events>
std::vector<Run> make_runs(const Events& events, bool merge) {
  std::vector<Run> runs;
  for (std::size_t i = 0; i < events.size();) {
    std::size_t j = i;
    if (merge) {
      if (events[i]->type == KVEventType::kBlockStored) {
        while (j + 1 < events.size() && chains(*events[j], *events[j + 1])) ++j;
      } else if (events[i]->type == KVEventType::kBlockRemoved) {
        while (j + 1 < events.size() && same_removal_group(*events[i], *events[j + 1])) ++j;
      }
    }
    runs.push_back({i, j});
    i = j + 1;
  }
  return runs;
}

void validate(const KVEvent& e, std::size_t index, const char* what) {
  if (e.type != KVEventType::kBlockStored) return;
  if (e.block_size == 0 || e.token_ids.size() != e.block_size) {
    pagedkv::detail::raise(Errc::kInvalidArgument,
                  std::string(what) + ": event " + std::to_string(index) + " (seq_no " + std::to_string(e.seq_no) +
                      ", BlockStored) holds " + std::to_string(e.token_ids.size()) +
                      " token ids for block_size " + std::to_string(e.block_size) + " (must be equal and > 0)");
  }
}

void put_run(Packer& pk, const std::vector<const KVEvent*>& ev, const Run& r, const EncodeOptions& opt) {
  const KVEvent& head = *ev[r.first];
  const auto n = static_cast<std::uint32_t>(r.last - r.first + 1);
  const bool map = opt.layout == EventLayout::kMap;
  const auto key = [&](std::string_view k) {
    if (map) put_str(pk, k);
  };
  switch (head.type) {
    case KVEventType::kBlockStored: {
      // BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
      //             extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window)
      //   -- vllm/distributed/kv_events.py field order
      const GroupSpec* spec = group_spec(head.group, opt, r.first);
      const std::optional<std::string> lora = lora_name_of(head.adapter_id, opt);
      // Array: 12 elements with a spec (a window of None written as nil), else 10. Map: None fields omitted.
      const bool window = spec != nullptr && (spec->sliding_window.has_value() || !map);
      const std::uint32_t fields = 10 + (spec != nullptr ? 1 : 0) + (window ? 1 : 0);
      if (map) {
        pk.pack_map(fields);
      } else {
        pk.pack_array(fields);
      }
      key("type");
      put_str(pk, kBlockStored);
      key("block_hashes");
      pk.pack_array(n);
      for (std::size_t i = r.first; i <= r.last; ++i) put_hash(pk, ev[i]->hash, opt.hash_format);
      key("parent_block_hash");
      if (head.parent_hash) {
        put_hash(pk, *head.parent_hash, opt.hash_format);
      } else {
        pk.pack_nil();
      }
      key("token_ids");
      pk.pack_array(n * head.block_size);
      for (std::size_t i = r.first; i <= r.last; ++i) {
        for (const TokenId t : ev[i]->token_ids) pk.pack_int32(t);
      }
      key("block_size");
      pk.pack_uint32(head.block_size);
      key("lora_id");
      put_optional_lora_id(pk, head.adapter_id);
      key("medium");
      put_str(pk, medium_name(head.medium));
      key("lora_name");
      put_lora_name(pk, lora);
      key("extra_keys");
      pk.pack_array(n);
      for (std::size_t i = r.first; i <= r.last; ++i) put_block_keys(pk, *ev[i], i == r.first, lora, opt);
      key("group_idx");
      pk.pack_uint32(head.group);
      if (spec != nullptr) {
        key("kv_cache_spec_kind");
        put_str(pk, spec->kind);
      }
      if (window) {
        key("kv_cache_spec_sliding_window");
        if (spec->sliding_window) {
          pk.pack_uint32(*spec->sliding_window);
        } else {
          pk.pack_nil();
        }
      }
      break;
    }
    case KVEventType::kBlockRemoved: {
      // BlockRemoved(block_hashes, medium, group_idx)
      if (map) {
        pk.pack_map(4);
      } else {
        pk.pack_array(4);
      }
      key("type");
      put_str(pk, kBlockRemoved);
      key("block_hashes");
      pk.pack_array(n);
      for (std::size_t i = r.first; i <= r.last; ++i) put_hash(pk, ev[i]->hash, opt.hash_format);
      key("medium");
      put_str(pk, medium_name(head.medium));
      key("group_idx");
      pk.pack_uint32(head.group);
      break;
    }
    case KVEventType::kAllCleared: {
      // AllBlocksCleared(): the tag alone.
      if (map) {
        pk.pack_map(1);
      } else {
        pk.pack_array(1);
      }
      key("type");
      put_str(pk, kAllBlocksCleared);
      break;
    }
  }
}

/// Parents first: a BlockStored whose parent is stored later in the same batch (in any tier) is moved to just after
/// that parent's BlockStored, unless an event between them names the block itself or clears everything. Why: a
/// manager frees a sequence last block first, so a write-back host tier copies (and completes, and reports)
/// children before parents; llm-d and Dynamo look an event's parent up when they apply it and drop the event when
/// they do not know it. Only stores move, only later, past events of other blocks: the final state is the same.
/// O(events) expected.
std::vector<const KVEvent*> parents_first(const std::vector<const KVEvent*>& ev) {
  std::unordered_map<BlockHash, std::vector<std::size_t>, BlockHashHasher> stored_at;  // hash -> store positions
  std::vector<std::size_t> clears;
  for (std::size_t i = 0; i < ev.size(); ++i) {
    if (ev[i]->type == KVEventType::kBlockStored) stored_at[ev[i]->hash].push_back(i);
    if (ev[i]->type == KVEventType::kAllCleared) clears.push_back(i);
  }
  std::unordered_map<BlockHash, std::vector<std::size_t>, BlockHashHasher> touched;  // hash -> every position
  for (std::size_t i = 0; i < ev.size(); ++i) {
    if (ev[i]->type != KVEventType::kAllCleared) touched[ev[i]->hash].push_back(i);
  }
  const auto next_after = [](const std::vector<std::size_t>& v, std::size_t i) -> std::optional<std::size_t> {
    const auto it = std::upper_bound(v.begin(), v.end(), i);
    return it == v.end() ? std::nullopt : std::optional<std::size_t>(*it);
  };
  // deferred[j]: events to write right after position j (the parent's store).
  std::unordered_map<std::size_t, std::vector<std::size_t>> deferred;
  std::vector<bool> moved(ev.size(), false);
  for (std::size_t i = 0; i < ev.size(); ++i) {
    const KVEvent& e = *ev[i];
    if (e.type != KVEventType::kBlockStored || !e.parent_hash) continue;
    const auto sp = stored_at.find(*e.parent_hash);
    if (sp == stored_at.end()) continue;
    const auto j = next_after(sp->second, i);
    if (!j) continue;
    const auto own = next_after(touched[e.hash], i);
    const auto clear = next_after(clears, i);
    if ((own && *own < *j) || (clear && *clear < *j)) continue;
    deferred[*j].push_back(i);
    moved[i] = true;
  }
  if (deferred.empty()) return ev;
  std::vector<const KVEvent*> out;
  out.reserve(ev.size());
  std::vector<std::size_t> stack;
  for (std::size_t i = 0; i < ev.size(); ++i) {
    if (moved[i]) continue;
    stack.assign(1, i);
    while (!stack.empty()) {  // depth-first: a deferred child may have deferred children of its own
      const std::size_t k = stack.back();
      stack.pop_back();
      out.push_back(ev[k]);
      if (const auto d = deferred.find(k); d != deferred.end()) {
        for (auto it = d->second.rbegin(); it != d->second.rend(); ++it) stack.push_back(*it);
      }
    }
  }
  return out;
}

std::vector<std::byte> encode_events(const std::vector<const KVEvent*>& in, double ts, const EncodeOptions& opt,
                                     const char* what) {
  for (std::size_t i = 0; i < in.size(); ++i) validate(*in[i], i, what);
  // A moved parent can land after a child that followed it; repeat until stable (each pass only moves stores
  // later, behind a store of their parent, so chains settle within their depth; bounded all the same).
  std::vector<const KVEvent*> ev;
  ev.reserve(in.size());
  for (const KVEvent* e : in) {  // main-attention groups only (EncodeOptions::main_groups_only)
    if (opt.main_groups_only && !opt.group_specs.empty() && e->type != KVEventType::kAllCleared &&
        e->group < opt.group_specs.size() && !is_main_attention(opt.group_specs[e->group].kind)) {
      continue;
    }
    ev.push_back(e);
  }
  for (int pass = 0; pass < 32; ++pass) {
    std::vector<const KVEvent*> next = parents_first(ev);
    if (next == ev) break;
    ev = std::move(next);
  }
  const std::vector<Run> runs = make_runs(ev, opt.merge_runs);
  std::size_t tokens = 0;
  for (const KVEvent* e : ev) tokens += e->token_ids.size();
  std::vector<std::byte> out;
  out.reserve(16 + 48 * ev.size() + 5 * tokens);
  ByteSink sink{&out};
  Packer pk(sink);
  pk.pack_array(3);  // EventBatch(ts, events, data_parallel_rank)
  put_f64(sink, ts);
  pk.pack_array(static_cast<std::uint32_t>(runs.size()));
  for (const Run& r : runs) put_run(pk, ev, r, opt);
  pk.pack_int32(opt.data_parallel_rank);
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Decoding

using msgpack::type::object_type;

const char* type_name(object_type t) {
  switch (t) {
    case object_type::NIL: return "nil";
    case object_type::BOOLEAN: return "bool";
    case object_type::POSITIVE_INTEGER: return "unsigned int";
    case object_type::NEGATIVE_INTEGER: return "negative int";
    case object_type::FLOAT32: return "float32";
    case object_type::FLOAT64: return "float64";
    case object_type::STR: return "str";
    case object_type::BIN: return "bin";
    case object_type::ARRAY: return "array";
    case object_type::MAP: return "map";
    case object_type::EXT: return "ext";
  }
  return "unknown";
}

/// Where a decode error happened, for messages.
struct Where {
  std::size_t event = 0;
  std::string_view tag;
};

[[noreturn]] void bad(const Where& w, std::string_view field, const std::string& why) {
  pagedkv::detail::raise(Errc::kInvalidArgument, "decode_batch: event " + std::to_string(w.event) + " (" +
                                            std::string(w.tag) + "): field " + std::string(field) + ": " + why);
}

std::string got(const msgpack::object& o) { return std::string("got ") + type_name(o.type); }

std::string_view as_str(const msgpack::object& o) { return {o.via.str.ptr, o.via.str.size}; }

bool is_int(const msgpack::object& o) {
  return o.type == object_type::POSITIVE_INTEGER || o.type == object_type::NEGATIVE_INTEGER;
}

std::int64_t to_i64(const Where& w, std::string_view field, const msgpack::object& o) {
  if (o.type == object_type::NEGATIVE_INTEGER) return o.via.i64;
  if (o.type == object_type::POSITIVE_INTEGER) {
    if (o.via.u64 > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      bad(w, field, "integer " + std::to_string(o.via.u64) + " does not fit int64");
    }
    return static_cast<std::int64_t>(o.via.u64);
  }
  bad(w, field, "expected an integer, " + got(o));
}

std::optional<std::int64_t> opt_i64(const Where& w, std::string_view field, const msgpack::object& o) {
  if (o.type == object_type::NIL) return std::nullopt;
  return to_i64(w, field, o);
}

std::optional<std::string> opt_str(const Where& w, std::string_view field, const msgpack::object& o) {
  if (o.type == object_type::NIL) return std::nullopt;
  if (o.type != object_type::STR) bad(w, field, "expected str or nil, " + got(o));
  return std::string(as_str(o));
}

WireHash to_hash(const Where& w, std::string_view field, const msgpack::object& o) {
  WireHash h;
  if (o.type == object_type::POSITIVE_INTEGER) {
    h.key = o.via.u64;
  } else if (o.type == object_type::NEGATIVE_INTEGER) {
    h.key = static_cast<std::uint64_t>(o.via.i64);
  } else if (o.type == object_type::BIN) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(o.via.bin.ptr);
    const std::size_t n = o.via.bin.size;
    for (std::size_t i = n > 8 ? n - 8 : 0; i < n; ++i) h.key = (h.key << 8) | p[i];
    if (n == 16) {
      BlockHash b;
      std::memcpy(b.bytes.data(), p, 16);
      h.full = b;
    }
  } else {
    bad(w, field, "expected an integer or bytes block hash, " + got(o));
  }
  return h;
}

std::vector<WireHash> to_hashes(const Where& w, std::string_view field, const msgpack::object& o) {
  if (o.type != object_type::ARRAY) bad(w, field, "expected an array of block hashes, " + got(o));
  std::vector<WireHash> out;
  out.reserve(o.via.array.size);
  for (std::uint32_t i = 0; i < o.via.array.size; ++i) out.push_back(to_hash(w, field, o.via.array.ptr[i]));
  return out;
}

std::vector<TokenId> to_tokens(const Where& w, const msgpack::object& o) {
  if (o.type != object_type::ARRAY) bad(w, "token_ids", "expected an array of integers, " + got(o));
  std::vector<TokenId> out;
  out.reserve(o.via.array.size);
  for (std::uint32_t i = 0; i < o.via.array.size; ++i) {
    const msgpack::object& t = o.via.array.ptr[i];
    if (!is_int(t)) bad(w, "token_ids", "element " + std::to_string(i) + ": expected an integer, " + got(t));
    const std::int64_t v = to_i64(w, "token_ids", t);
    if (v < std::numeric_limits<TokenId>::min() || v > std::numeric_limits<TokenId>::max()) {
      bad(w, "token_ids", "element " + std::to_string(i) + ": token " + std::to_string(v) + " does not fit int32");
    }
    out.push_back(static_cast<TokenId>(v));
  }
  return out;
}

WireExtraKey to_extra_key(const msgpack::object& o) {
  WireExtraKey k;
  switch (o.type) {
    case object_type::POSITIVE_INTEGER:
      k.kind = WireExtraKey::Kind::kUnsigned;
      k.unsigned_value = o.via.u64;
      break;
    case object_type::NEGATIVE_INTEGER:
      k.kind = WireExtraKey::Kind::kSigned;
      k.signed_value = o.via.i64;
      break;
    case object_type::STR:
      k.kind = WireExtraKey::Kind::kString;
      k.text = std::string(as_str(o));
      break;
    case object_type::BIN:
      k.kind = WireExtraKey::Kind::kBytes;
      k.text = std::string(o.via.bin.ptr, o.via.bin.size);
      break;
    case object_type::ARRAY:
      if (o.via.array.size == 2 && o.via.array.ptr[0].type == object_type::STR && is_int(o.via.array.ptr[1])) {
        const msgpack::object& off = o.via.array.ptr[1];
        if (off.type == object_type::NEGATIVE_INTEGER ||
            off.via.u64 <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
          k.kind = WireExtraKey::Kind::kIdentifierWithOffset;
          k.text = std::string(as_str(o.via.array.ptr[0]));
          k.signed_value = off.type == object_type::NEGATIVE_INTEGER ? off.via.i64 : static_cast<std::int64_t>(off.via.u64);
        }
      }
      break;
    default: break;
  }
  return k;
}

std::vector<std::optional<std::vector<WireExtraKey>>> to_extra_keys(const Where& w, const msgpack::object& o,
                                                                    std::size_t num_blocks) {
  std::vector<std::optional<std::vector<WireExtraKey>>> out;
  if (o.type == object_type::NIL) return out;
  if (o.type != object_type::ARRAY) bad(w, "extra_keys", "expected an array or nil, " + got(o));
  if (o.via.array.size != num_blocks) {
    bad(w, "extra_keys", "has " + std::to_string(o.via.array.size) + " entries for " + std::to_string(num_blocks) +
                             " block hashes (one per block)");
  }
  out.reserve(o.via.array.size);
  for (std::uint32_t i = 0; i < o.via.array.size; ++i) {
    const msgpack::object& b = o.via.array.ptr[i];
    if (b.type == object_type::NIL) {
      out.emplace_back(std::nullopt);
      continue;
    }
    if (b.type != object_type::ARRAY) {
      bad(w, "extra_keys", "entry " + std::to_string(i) + ": expected an array or nil, " + got(b));
    }
    std::vector<WireExtraKey> keys;
    keys.reserve(b.via.array.size);
    for (std::uint32_t k = 0; k < b.via.array.size; ++k) keys.push_back(to_extra_key(b.via.array.ptr[k]));
    out.emplace_back(std::move(keys));
  }
  return out;
}

/// Fields of an event, by name, gathered from either layout.
struct Fields {
  const msgpack::object* block_hashes = nullptr;
  const msgpack::object* parent_block_hash = nullptr;
  const msgpack::object* token_ids = nullptr;
  const msgpack::object* block_size = nullptr;
  const msgpack::object* lora_id = nullptr;
  const msgpack::object* medium = nullptr;
  const msgpack::object* lora_name = nullptr;
  const msgpack::object* extra_keys = nullptr;
  const msgpack::object* group_idx = nullptr;
  const msgpack::object* spec_kind = nullptr;
  const msgpack::object* spec_window = nullptr;
};

const msgpack::object& require(const Where& w, std::string_view field, const msgpack::object* o) {
  if (o == nullptr) bad(w, field, "missing (required)");
  return *o;
}

WireEvent decode_stored(const Where& w, const Fields& f) {
  WireBlockStored e;
  e.block_hashes = to_hashes(w, "block_hashes", require(w, "block_hashes", f.block_hashes));
  if (f.parent_block_hash != nullptr && f.parent_block_hash->type != object_type::NIL) {
    e.parent_block_hash = to_hash(w, "parent_block_hash", *f.parent_block_hash);
  }
  e.token_ids = to_tokens(w, require(w, "token_ids", f.token_ids));
  const std::int64_t bs = to_i64(w, "block_size", require(w, "block_size", f.block_size));
  if (bs <= 0 || bs > std::numeric_limits<std::uint32_t>::max()) {
    bad(w, "block_size", "block size " + std::to_string(bs) + " is not in [1, 2^32)");
  }
  e.block_size = static_cast<std::uint32_t>(bs);
  if (e.token_ids.size() != e.block_hashes.size() * e.block_size) {
    bad(w, "token_ids", "holds " + std::to_string(e.token_ids.size()) + " tokens for " +
                            std::to_string(e.block_hashes.size()) + " blocks of " + std::to_string(e.block_size));
  }
  if (f.lora_id != nullptr) e.lora_id = opt_i64(w, "lora_id", *f.lora_id);
  if (f.medium != nullptr) e.medium = opt_str(w, "medium", *f.medium);
  if (f.lora_name != nullptr) e.lora_name = opt_str(w, "lora_name", *f.lora_name);
  if (f.extra_keys != nullptr) e.extra_keys = to_extra_keys(w, *f.extra_keys, e.block_hashes.size());
  if (f.group_idx != nullptr) e.group_idx = opt_i64(w, "group_idx", *f.group_idx);
  if (f.spec_kind != nullptr) e.kv_cache_spec_kind = opt_str(w, "kv_cache_spec_kind", *f.spec_kind);
  if (f.spec_window != nullptr) {
    e.kv_cache_spec_sliding_window = opt_i64(w, "kv_cache_spec_sliding_window", *f.spec_window);
  }
  return e;
}

WireEvent decode_removed(const Where& w, const Fields& f) {
  WireBlockRemoved e;
  e.block_hashes = to_hashes(w, "block_hashes", require(w, "block_hashes", f.block_hashes));
  if (f.medium != nullptr) e.medium = opt_str(w, "medium", *f.medium);
  if (f.group_idx != nullptr) e.group_idx = opt_i64(w, "group_idx", *f.group_idx);
  return e;
}

/// Decodes one event; false for an unknown tag.
bool decode_event(std::size_t index, const msgpack::object& o, std::vector<WireEvent>& out) {
  Where w{index, "?"};
  Fields f;
  std::string_view tag;
  if (o.type == object_type::ARRAY) {
    const auto& a = o.via.array;
    if (a.size == 0 || a.ptr[0].type != object_type::STR) {
      bad(w, "tag", "a tagged array must start with the event type name");
    }
    tag = as_str(a.ptr[0]);
    w.tag = tag;
    const auto at = [&](std::uint32_t i) -> const msgpack::object* { return i < a.size ? &a.ptr[i] : nullptr; };
    if (tag == kBlockStored) {
      // Positions of vLLM's array_like BlockStored; trailing fields a producer did not send take their defaults,
      // trailing fields this decoder does not know (kv_cache_spec_kind, ...) are ignored. A producer whose
      // trailing element is not what vLLM puts there (Dynamo's legacy block_mm_infos) is tolerated: only values
      // of the expected type are taken.
      f.block_hashes = at(1);
      f.parent_block_hash = at(2);
      f.token_ids = at(3);
      f.block_size = at(4);
      f.lora_id = at(5) != nullptr && (is_int(*at(5)) || at(5)->type == object_type::NIL) ? at(5) : nullptr;
      f.medium = at(6) != nullptr && (at(6)->type == object_type::STR || at(6)->type == object_type::NIL) ? at(6) : nullptr;
      f.lora_name = at(7) != nullptr && (at(7)->type == object_type::STR || at(7)->type == object_type::NIL) ? at(7) : nullptr;
      f.extra_keys = at(8) != nullptr && (at(8)->type == object_type::ARRAY || at(8)->type == object_type::NIL) ? at(8) : nullptr;
      f.group_idx = at(9) != nullptr && (is_int(*at(9)) || at(9)->type == object_type::NIL) ? at(9) : nullptr;
      f.spec_kind = at(10) != nullptr && at(10)->type == object_type::STR ? at(10) : nullptr;
      f.spec_window = f.spec_kind != nullptr && at(11) != nullptr && (is_int(*at(11)) || at(11)->type == object_type::NIL)
                          ? at(11)
                          : nullptr;
    } else if (tag == kBlockRemoved) {
      f.block_hashes = at(1);
      f.medium = at(2) != nullptr && (at(2)->type == object_type::STR || at(2)->type == object_type::NIL) ? at(2) : nullptr;
      f.group_idx = at(3) != nullptr && (is_int(*at(3)) || at(3)->type == object_type::NIL) ? at(3) : nullptr;
    }
  } else if (o.type == object_type::MAP) {
    const auto& m = o.via.map;
    for (std::uint32_t i = 0; i < m.size; ++i) {
      const msgpack::object& k = m.ptr[i].key;
      if (k.type != object_type::STR) continue;
      const std::string_view name = as_str(k);
      const msgpack::object* v = &m.ptr[i].val;
      if (name == "type") {
        if (v->type != object_type::STR) bad(w, "type", "expected the event type name as str, " + got(*v));
        tag = as_str(*v);
      } else if (name == "block_hashes") {
        f.block_hashes = v;
      } else if (name == "parent_block_hash") {
        f.parent_block_hash = v;
      } else if (name == "token_ids") {
        f.token_ids = v;
      } else if (name == "block_size") {
        f.block_size = v;
      } else if (name == "lora_id") {
        f.lora_id = v;
      } else if (name == "medium") {
        f.medium = v;
      } else if (name == "lora_name") {
        f.lora_name = v;
      } else if (name == "extra_keys") {
        f.extra_keys = v;
      } else if (name == "group_idx") {
        f.group_idx = v;
      } else if (name == "kv_cache_spec_kind") {
        f.spec_kind = v;
      } else if (name == "kv_cache_spec_sliding_window") {
        f.spec_window = v;
      }
    }
    if (tag.empty()) bad(w, "type", "missing (a tagged map needs the event type name)");
    w.tag = tag;
  } else {
    bad(w, "event", "expected a tagged array or map, " + got(o));
  }
  if (tag == kBlockStored) {
    out.push_back(decode_stored(w, f));
  } else if (tag == kBlockRemoved) {
    out.push_back(decode_removed(w, f));
  } else if (tag == kAllBlocksCleared) {
    out.emplace_back(WireAllBlocksCleared{});
  } else {
    return false;
  }
  return true;
}

}  // namespace

std::vector<std::byte> encode_batch(const KVEventBatch& batch, const EncodeOptions& options) {
  std::vector<const KVEvent*> ev;
  ev.reserve(batch.events.size());
  for (const KVEvent& e : batch.events) ev.push_back(&e);
  return encode_events(ev, batch.ts, options, "encode_batch");
}

std::vector<std::byte> encode_snapshot(const KVEventSnapshot& snapshot, double ts, const EncodeOptions& options) {
  KVEvent clear;
  clear.type = KVEventType::kAllCleared;
  std::vector<const KVEvent*> ev;
  ev.reserve(snapshot.stored.size() + 1);
  ev.push_back(&clear);
  for (const KVEvent& e : snapshot.stored) {
    if (e.type != KVEventType::kBlockStored) {
      pagedkv::detail::raise(Errc::kInvalidArgument, "encode_snapshot: event seq_no " + std::to_string(e.seq_no) +
                                                " of the snapshot is not a stored block");
    }
    ev.push_back(&e);
  }
  return encode_events(ev, ts, options, "encode_snapshot");
}

WireBatch decode_batch(std::span<const std::byte> payload) {
  msgpack::object_handle oh;
  std::size_t offset = 0;
  try {
    oh = msgpack::unpack(reinterpret_cast<const char*>(payload.data()), payload.size(), offset);
  } catch (const std::exception& ex) {
    pagedkv::detail::raise(Errc::kInvalidArgument, "decode_batch: the " + std::to_string(payload.size()) +
                                              "-byte payload is not one msgpack value (" + ex.what() + ")");
  }
  if (offset != payload.size()) {
    pagedkv::detail::raise(Errc::kInvalidArgument, "decode_batch: " + std::to_string(payload.size() - offset) +
                                              " trailing bytes after the msgpack value (payload of " +
                                              std::to_string(payload.size()) + " bytes)");
  }
  const msgpack::object& root = oh.get();
  if (root.type != object_type::ARRAY || root.via.array.size < 2) {
    pagedkv::detail::raise(Errc::kInvalidArgument,
                  std::string("decode_batch: expected the batch array [ts, events, data_parallel_rank], got ") +
                      type_name(root.type) +
                      (root.type == object_type::ARRAY ? " of " + std::to_string(root.via.array.size) + " elements"
                                                       : std::string()));
  }
  const msgpack::object* a = root.via.array.ptr;
  WireBatch b;
  switch (a[0].type) {
    case object_type::FLOAT32:
    case object_type::FLOAT64: b.ts = a[0].via.f64; break;
    case object_type::POSITIVE_INTEGER: b.ts = static_cast<double>(a[0].via.u64); break;
    case object_type::NEGATIVE_INTEGER: b.ts = static_cast<double>(a[0].via.i64); break;
    default:
      pagedkv::detail::raise(Errc::kInvalidArgument, std::string("decode_batch: ts: expected a number, got ") +
                                                type_name(a[0].type));
  }
  if (a[1].type != object_type::ARRAY) {
    pagedkv::detail::raise(Errc::kInvalidArgument, std::string("decode_batch: events: expected an array, got ") +
                                              type_name(a[1].type));
  }
  if (root.via.array.size >= 3) {
    const msgpack::object& r = a[2];
    if (r.type == object_type::NEGATIVE_INTEGER) {
      b.data_parallel_rank = r.via.i64;
    } else if (r.type == object_type::POSITIVE_INTEGER &&
               r.via.u64 <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      b.data_parallel_rank = static_cast<std::int64_t>(r.via.u64);
    } else if (r.type != object_type::NIL) {
      pagedkv::detail::raise(Errc::kInvalidArgument, std::string("decode_batch: data_parallel_rank: expected an int or nil, "
                                                        "got ") + type_name(r.type));
    }
  }
  const auto& events = a[1].via.array;
  b.events.reserve(events.size);
  for (std::uint32_t i = 0; i < events.size; ++i) {
    if (!decode_event(i, events.ptr[i], b.events)) ++b.num_unknown_events;
  }
  return b;
}

namespace {
[[noreturn]] void keys_fail(std::size_t i, const std::string& why) {
  pagedkv::detail::raise(Errc::kInvalidArgument, "pagedkv_block_keys: block " + std::to_string(i) + ": " + why);
}
}  // namespace

WireBlockKeys pagedkv_block_keys(const WireBlockStored& e, std::size_t i) {
  const auto fail = [i](const std::string& why) { keys_fail(i, why); };
  if (i >= e.block_hashes.size()) {
    fail("out of range (the event has " + std::to_string(e.block_hashes.size()) + " blocks)");
  }
  WireBlockKeys k;
  if (e.extra_keys.empty() || !e.extra_keys[i]) return k;
  bool have_adapter = false;
  bool have_salt = false;
  bool lora_name_pending = e.lora_name.has_value();  // the first string equal to lora_name is the adapter's name
  bool named_adapter = false;
  std::optional<std::string> bare_salt, tagged_salt;
  const auto& keys = *e.extra_keys[i];
  for (std::size_t j = 0; j < keys.size(); ++j) {
    const WireExtraKey& x = keys[j];
    const std::string at = "extra key " + std::to_string(j);
    switch (x.kind) {
      case WireExtraKey::Kind::kUnsigned:
        if (have_adapter) fail(at + ": a second adapter id");
        if (x.unsigned_value == 0) fail(at + ": adapter id 0 (the base model is written as no key)");
        have_adapter = true;
        k.adapter_id = x.unsigned_value;
        break;
      case WireExtraKey::Kind::kIdentifierWithOffset: {
        const bool padded = x.text.size() == 64 && x.text.find_first_not_of('0', 32) == std::string::npos;
        if (x.text.size() != 32 && !padded) {
          fail(at + ": multimodal identifier '" + x.text + "' is not the 32 hex digits of a 16-byte item hash " +
               "(nor those followed by 32 '0', MmIdForm::kHex64)");
        }
        BlockHash h;
        for (std::size_t d = 0; d < 16; ++d) {
          const auto nib = [&](char c) -> int {
            if (c >= '0' && c <= '9') return c - '0';
            if (c >= 'a' && c <= 'f') return c - 'a' + 10;
            if (c >= 'A' && c <= 'F') return c - 'A' + 10;
            keys_fail(i, at + ": multimodal identifier '" + x.text + "' is not hexadecimal");
          };
          h.bytes[d] = static_cast<std::uint8_t>(nib(x.text[2 * d]) * 16 + nib(x.text[2 * d + 1]));
        }
        k.items.emplace_back(h, x.signed_value);
        break;
      }
      case WireExtraKey::Kind::kString:
        if (lora_name_pending && x.text == *e.lora_name) {
          lora_name_pending = false;
          named_adapter = true;
          break;
        }
        if (x.text.starts_with(kDynamoCacheSaltPrefix)) {
          if (tagged_salt) fail(at + ": a second \"dynamo-cache-salt:\" key");
          tagged_salt = x.text.substr(kDynamoCacheSaltPrefix.size());
          break;
        }
        [[fallthrough]];
      case WireExtraKey::Kind::kBytes:
        if (bare_salt) fail(at + ": a second salt (string) key");
        bare_salt = x.text;
        break;
      case WireExtraKey::Kind::kSigned: keys_fail(i, at + ": a negative integer is not a pagedkv key");
      case WireExtraKey::Kind::kOther: keys_fail(i, at + ": not a pagedkv key (int, [hex, offset] or str)");
    }
  }
  if (bare_salt && tagged_salt && *bare_salt != *tagged_salt) {
    fail("the bare salt and the \"dynamo-cache-salt:\" one differ");
  }
  have_salt = bare_salt || tagged_salt;
  if (have_salt) k.salt = bare_salt ? *bare_salt : *tagged_salt;
  if (named_adapter) {
    if (have_adapter) fail("both an adapter id and the adapter's name");
    if (!e.lora_id || *e.lora_id <= 0) fail("the adapter's name without a positive lora_id");
    k.adapter_id = static_cast<std::uint64_t>(*e.lora_id);
  }
  return k;
}

}  // namespace pagedkv::events
