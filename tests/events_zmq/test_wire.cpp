// The wire encoding (pagedkv/events_zmq/wire.hpp): golden msgpack bytes per event type and layout, written out
// by hand from the msgpack spec and vLLM's field order (docs/events-wire.md); decoding of payloads as vLLM
// versions produce them; round trips of random batches; the rehash of every stored block from its event; and
// errors that name the bad field.
#include <catch2/catch.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <pagedkv/events_zmq/wire.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include "support/manager_instances.hpp"  // KVCacheManager<> and <Xxh3Hasher> are compiled once (CI build time)

namespace {

using pagedkv::BlockHash;
using pagedkv::KVEvent;
using pagedkv::KVEventBatch;
using pagedkv::KVEventType;
using pagedkv::Medium;
using pagedkv::MultimodalItem;
using pagedkv::TokenId;
namespace ev = pagedkv::events;
using Bytes = std::vector<std::byte>;

/// Builds expected payloads: hex() appends bytes written in hex (spaces ignored), text() appends raw ASCII (the
/// msgpack string headers are written by hand with hex()).
struct Expect {
  Bytes b;
  Expect& hex(std::string_view h) {
    int hi = -1;
    for (const char c : h) {
      if (c == ' ') continue;
      const int v = c <= '9' ? c - '0' : c - 'a' + 10;
      if (hi < 0) {
        hi = v;
      } else {
        b.push_back(static_cast<std::byte>(hi * 16 + v));
        hi = -1;
      }
    }
    REQUIRE(hi < 0);
    return *this;
  }
  Expect& text(std::string_view s) {
    for (const char c : s) b.push_back(static_cast<std::byte>(c));
    return *this;
  }
  Expect& raw(const BlockHash& h) {
    for (const auto x : h.bytes) b.push_back(static_cast<std::byte>(x));
    return *this;
  }
};

std::string dump(const Bytes& b) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  for (const std::byte x : b) {
    s += kDigits[static_cast<unsigned>(x) >> 4];
    s += kDigits[static_cast<unsigned>(x) & 15];
    s += ' ';
  }
  return s;
}

/// bytes[i] = base + i.
BlockHash ramp(std::uint8_t base) {
  BlockHash h;
  for (std::size_t i = 0; i < 16; ++i) h.bytes[i] = static_cast<std::uint8_t>(base + i);
  return h;
}

KVEvent stored(const BlockHash& h, std::optional<BlockHash> parent, std::vector<TokenId> tokens,
               std::uint64_t block_start) {
  KVEvent e;
  e.type = KVEventType::kBlockStored;
  e.hash = h;
  e.parent_hash = parent;
  e.block_size = static_cast<std::uint32_t>(tokens.size());
  e.token_ids = std::move(tokens);
  e.block_start = block_start;
  return e;
}

KVEvent removed(const BlockHash& h) {
  KVEvent e;
  e.type = KVEventType::kBlockRemoved;
  e.hash = h;
  return e;
}

KVEvent cleared() {
  KVEvent e;
  e.type = KVEventType::kAllCleared;
  return e;
}

/// The batch of the two-block golden case: a salted, adapter-keyed first block and its child, both overlapping
/// one image (offset 1, length 2: relative offsets +1 and -1), then a removal and a reset.
KVEventBatch keyed_batch() {
  const MultimodalItem image{ramp(0xa0), 1, 2};
  KVEvent a = stored(ramp(0x20), std::nullopt, {5, 6}, 0);
  a.adapter_id = 7;
  a.multimodal_items = {image};
  a.salt = "s";
  KVEvent b = stored(ramp(0x30), ramp(0x20), {7, 8}, 2);
  b.adapter_id = 7;
  b.multimodal_items = {image};
  KVEventBatch batch;
  batch.seq_no = 9;
  batch.ts = 2.0;
  batch.events = {a, b, removed(ramp(0x10)), cleared()};
  return batch;
}

constexpr std::string_view kImageHex = "a0a1a2a3a4a5a6a7a8a9aaabacadaeaf";

}  // namespace

TEST_CASE("golden: BlockStored, array layout, integer hashes", "[events_zmq][wire][golden]") {
  KVEventBatch batch;
  batch.seq_no = 1;
  batch.ts = 1.5;
  batch.events = {stored(ramp(0x10), std::nullopt, {1, 2, 300, 70000}, 0)};
  Expect x;
  x.hex("93")                           // EventBatch: array(3) [ts, events, data_parallel_rank]
      .hex("cb 3f f8 00 00 00 00 00 00")  // ts: float64 1.5
      .hex("91")                          // events: array(1)
      .hex("9c")                          // BlockStored: array(12)
      .hex("ab").text("BlockStored")      // tag: fixstr(11)
      .hex("91 cf 18 19 1a 1b 1c 1d 1e 1f")  // block_hashes: [uint64 of bytes 8..15, big-endian]
      .hex("c0")                          // parent_block_hash: nil (a first block)
      .hex("94 01 02 cd 01 2c ce 00 01 11 70")  // token_ids: [1, 2, uint16 300, uint32 70000]
      .hex("04")                          // block_size: 4
      .hex("c0")                          // lora_id: nil (base model)
      .hex("a3").text("GPU")              // medium
      .hex("c0")                          // lora_name: nil
      .hex("91 c0")                       // extra_keys: [nil] (one block, no keys)
      .hex("00")                          // group_idx: 0
      .hex("ae").text("full_attention")   // kv_cache_spec_kind (no group_specs: group 0 is full attention)
      .hex("c0")                          // kv_cache_spec_sliding_window: nil
      .hex("00");                         // data_parallel_rank: 0
  const Bytes got = ev::encode_batch(batch);
  INFO(dump(got));
  CHECK(got == x.b);
}

TEST_CASE("golden: BlockStored, map layout, integer hashes", "[events_zmq][wire][golden]") {
  KVEventBatch batch;
  batch.seq_no = 1;
  batch.ts = 1.5;
  batch.events = {stored(ramp(0x10), std::nullopt, {1, 2, 300, 70000}, 0)};
  ev::EncodeOptions opt;
  opt.layout = ev::EventLayout::kMap;
  Expect x;
  x.hex("93 cb 3f f8 00 00 00 00 00 00 91")
      .hex("8b")                                   // BlockStored: map(11), the tag first (msgspec)
      .hex("a4").text("type").hex("ab").text("BlockStored")
      .hex("ac").text("block_hashes").hex("91 cf 18 19 1a 1b 1c 1d 1e 1f")
      .hex("b1").text("parent_block_hash").hex("c0")  // nil is written: the field has no default
      .hex("a9").text("token_ids").hex("94 01 02 cd 01 2c ce 00 01 11 70")
      .hex("aa").text("block_size").hex("04")
      .hex("a7").text("lora_id").hex("c0")
      .hex("a6").text("medium").hex("a3").text("GPU")
      .hex("a9").text("lora_name").hex("c0")
      .hex("aa").text("extra_keys").hex("91 c0")
      .hex("a9").text("group_idx").hex("00")
      .hex("b2").text("kv_cache_spec_kind").hex("ae").text("full_attention")  // window None: omitted
      .hex("00");
  const Bytes got = ev::encode_batch(batch, opt);
  INFO(dump(got));
  CHECK(got == x.b);
}

TEST_CASE("golden: keyed blocks merged into one BlockStored, BlockRemoved, AllBlocksCleared - array, 16-byte hashes",
          "[events_zmq][wire][golden]") {
  ev::EncodeOptions opt;
  opt.hash_format = ev::HashFormat::kBytes16;
  opt.data_parallel_rank = 3;
  Expect x;
  x.hex("93 cb 40 00 00 00 00 00 00 00")  // ts 2.0
      .hex("93")                          // three wire events (the two stored blocks chain: one event)
      .hex("9c ab").text("BlockStored")
      .hex("92 c4 10").raw(ramp(0x20)).hex("c4 10").raw(ramp(0x30))  // block_hashes: [bin16, bin16]
      .hex("c0")                          // parent of the first: none
      .hex("94 05 06 07 08")              // token_ids of both blocks
      .hex("02")                          // block_size
      .hex("07")                          // lora_id: the adapter id
      .hex("a3").text("GPU")
      .hex("c0")                          // lora_name: no resolver given
      .hex("92")                          // extra_keys, one entry per block:
      // [7, ["a0..af" + 32 '0' (MmIdForm::kHex64), +1], "dynamo-cache-salt:s" (SaltForm::kDynamo)]
      .hex("93 07 92 d9 40").text(kImageHex).text(std::string(32, '0')).hex("01 b3").text("dynamo-cache-salt:s")
      .hex("92 07 92 d9 40").text(kImageHex).text(std::string(32, '0')).hex("ff")  //   [7, [.., -1]] (no salt)
      .hex("00")                          // group_idx
      .hex("ae").text("full_attention").hex("c0")  // kv_cache_spec_kind, kv_cache_spec_sliding_window
      .hex("94 ac").text("BlockRemoved")
      .hex("91 c4 10").raw(ramp(0x10))
      .hex("a3").text("GPU")
      .hex("00")
      .hex("91 b0").text("AllBlocksCleared")  // array(1): the tag alone
      .hex("03");                         // data_parallel_rank 3
  const Bytes got = ev::encode_batch(keyed_batch(), opt);
  INFO(dump(got));
  CHECK(got == x.b);
}

TEST_CASE("golden: BlockRemoved and AllBlocksCleared, map layout", "[events_zmq][wire][golden]") {
  KVEventBatch batch;
  batch.seq_no = 2;
  batch.ts = 1.5;
  batch.events = {removed(ramp(0x10)), removed(ramp(0x20)), cleared()};
  ev::EncodeOptions opt;
  opt.layout = ev::EventLayout::kMap;
  Expect x;
  x.hex("93 cb 3f f8 00 00 00 00 00 00 92")
      .hex("84 a4").text("type").hex("ac").text("BlockRemoved")  // two removals of one tier: one event
      .hex("ac").text("block_hashes").hex("92 cf 18 19 1a 1b 1c 1d 1e 1f cf 28 29 2a 2b 2c 2d 2e 2f")
      .hex("a6").text("medium").hex("a3").text("GPU")
      .hex("a9").text("group_idx").hex("00")
      .hex("81 a4").text("type").hex("b0").text("AllBlocksCleared")
      .hex("00");
  const Bytes got = ev::encode_batch(batch, opt);
  INFO(dump(got));
  CHECK(got == x.b);
  // Unmerged, each removal is its own event.
  opt.merge_runs = false;
  const ev::WireBatch d = ev::decode_batch(ev::encode_batch(batch, opt));
  REQUIRE(d.events.size() == 3);
  CHECK(std::get<ev::WireBlockRemoved>(d.events[0]).block_hashes.size() == 1);
  CHECK(std::get<ev::WireBlockRemoved>(d.events[1]).block_hashes.size() == 1);
}

TEST_CASE("golden: lora_name, CPU tier, a non-UTF-8 salt as bytes", "[events_zmq][wire][golden]") {
  KVEvent e = stored(ramp(0x10), std::nullopt, {1}, 0);
  e.adapter_id = 300;
  e.medium = Medium::kCpu;
  e.group = 2;
  e.salt = std::string("\xff", 1);
  KVEventBatch batch;
  batch.ts = 1.5;
  batch.events = {e};
  ev::EncodeOptions opt;
  opt.lora_name = [](std::uint64_t id) -> std::optional<std::string> {
    return id == 300 ? std::optional<std::string>("sql") : std::nullopt;
  };
  opt.group_specs = {ev::GroupSpec{}, ev::GroupSpec{}, ev::GroupSpec{"sliding_window", 128}};
  opt.main_groups_only = false;  // written as vLLM does (by default only main-attention groups are)
  Expect x;
  x.hex("93 cb 3f f8 00 00 00 00 00 00 91 9c ab").text("BlockStored")
      .hex("91 cf 18 19 1a 1b 1c 1d 1e 1f c0 91 01 01")
      .hex("cd 01 2c")                  // lora_id 300
      .hex("a3").text("CPU")
      .hex("a3").text("sql")            // lora_name from the resolver
      .hex("91 92 a3").text("sql")      // extra_keys: [["sql", bin(ff)]]: the name where vLLM puts it, and a
      .hex("c4 01 ff")                  //   non-UTF-8 salt bare as bytes (it cannot carry Dynamo's text prefix)
      .hex("02")                        // group_idx 2
      .hex("ae").text("sliding_window").hex("cc 80")  // kv_cache_spec_kind, kv_cache_spec_sliding_window 128
      .hex("00");
  const Bytes got = ev::encode_batch(batch, opt);
  INFO(dump(got));
  CHECK(got == x.b);
  const ev::WireBatch d = ev::decode_batch(got);
  const auto keys = ev::pagedkv_block_keys(std::get<ev::WireBlockStored>(d.events.at(0)), 0);
  CHECK(keys.adapter_id == 300);
  CHECK(keys.salt == e.salt);
  const auto& s = std::get<ev::WireBlockStored>(d.events.at(0));
  CHECK(s.kv_cache_spec_kind == std::optional<std::string>("sliding_window"));
  CHECK(s.kv_cache_spec_sliding_window == std::optional<std::int64_t>(128));
  // By default a sliding-window group's events are not written (Dynamo ignores them; llm-d would mis-index them).
  opt.main_groups_only = true;
  CHECK(ev::decode_batch(ev::encode_batch(batch, opt)).events.empty());
  opt.main_groups_only = false;
  // A group the table does not cover is refused, naming it.
  opt.group_specs.resize(2);
  CHECK_THROWS_WITH(ev::encode_batch(batch, opt), Catch::Contains("KV-cache group 2") &&
                                                      Catch::Contains("group_specs has 2 entries"));
}

TEST_CASE("issue 21: salt forms, LoRA names and 64-hex multimodal ids round-trip to pagedkv's keys",
          "[events_zmq][wire]") {
  KVEvent e = stored(ramp(0x10), std::nullopt, {1, 2}, 0);
  e.adapter_id = 9;
  e.salt = "sql";  // equal to the adapter's name: told apart by position, as Dynamo does
  e.multimodal_items = {pagedkv::MultimodalItem{ramp(0xa0), 1, 3}};
  KVEventBatch batch;
  batch.events = {e};
  ev::EncodeOptions opt;
  opt.lora_name = [](std::uint64_t) -> std::optional<std::string> { return "sql"; };
  const auto form = GENERATE(ev::SaltForm::kDynamo, ev::SaltForm::kVllm, ev::SaltForm::kBoth);
  const auto mm = GENERATE(ev::MmIdForm::kHex64, ev::MmIdForm::kHex32);
  opt.salt_form = form;
  opt.mm_id_form = mm;
  INFO("salt form " << ev::to_string(form) << ", mm ids " << ev::to_string(mm));
  const ev::WireBatch d = ev::decode_batch(ev::encode_batch(batch, opt));
  const auto& s = std::get<ev::WireBlockStored>(d.events.at(0));
  REQUIRE(s.extra_keys.at(0).has_value());
  const auto& k = *s.extra_keys[0];
  // vLLM's order: lora_name, items, salt.
  CHECK(k.at(0).kind == ev::WireExtraKey::Kind::kString);
  CHECK(k.at(0).text == "sql");
  CHECK(k.at(1).kind == ev::WireExtraKey::Kind::kIdentifierWithOffset);
  CHECK(k.at(1).text.size() == (mm == ev::MmIdForm::kHex64 ? 64u : 32u));
  CHECK(k.at(1).text.substr(0, 32) == ramp(0xa0).hex());
  CHECK(k.at(1).signed_value == 1);
  const std::size_t n_salt = form == ev::SaltForm::kBoth ? 2 : 1;
  REQUIRE(k.size() == 2 + n_salt);
  if (form != ev::SaltForm::kVllm) CHECK(k.back().text == "dynamo-cache-salt:sql");
  if (form != ev::SaltForm::kDynamo) CHECK(k.at(2).text == "sql");
  const auto keys = ev::pagedkv_block_keys(s, 0);
  CHECK(keys.adapter_id == 9);
  CHECK(keys.salt == "sql");
  REQUIRE(keys.items.size() == 1);
  CHECK(keys.items[0].first == ramp(0xa0));
  CHECK(keys.items[0].second == 1);
}

TEST_CASE("the snapshot payload is AllBlocksCleared followed by the stored blocks", "[events_zmq][wire]") {
  pagedkv::KVEventSnapshot snap;
  snap.seq_no = 41;
  snap.stored = {stored(ramp(0x10), std::nullopt, {1, 2}, 0), stored(ramp(0x20), ramp(0x10), {3, 4}, 2),
                 stored(ramp(0x40), std::nullopt, {9, 9}, 0)};
  const ev::WireBatch d = ev::decode_batch(ev::encode_snapshot(snap, 3.0));
  CHECK(d.ts == 3.0);
  REQUIRE(d.events.size() == 3);  // cleared, [0x10 -> 0x20] (chained), [0x40]
  CHECK(std::holds_alternative<ev::WireAllBlocksCleared>(d.events[0]));
  CHECK(std::get<ev::WireBlockStored>(d.events[1]).block_hashes.size() == 2);
  CHECK(std::get<ev::WireBlockStored>(d.events[2]).block_hashes.size() == 1);
  snap.stored.push_back(removed(ramp(0x50)));
  CHECK_THROWS_WITH(ev::encode_snapshot(snap, 0.0), Catch::Contains("not a stored block"));
}

TEST_CASE("decodes payloads as vLLM versions publish them", "[events_zmq][wire][vllm]") {
  SECTION("vLLM >= 0.24: tagged maps, 32-byte hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), extra fields") {
    Expect p;
    p.hex("93 cb 41 da a9 87 55 00 00 00 91")  // ts 1.789e9-ish
        .hex("8c a4").text("type").hex("ab").text("BlockStored")
        .hex("ac").text("block_hashes").hex("91 c4 20")
        .hex("00 01 02 03 04 05 06 07 08 09 0a 0b 0c 0d 0e 0f 10 11 12 13 14 15 16 17 18 19 1a 1b 1c 1d 1e 1f")
        .hex("b1").text("parent_block_hash").hex("c0")
        .hex("a9").text("token_ids").hex("92 cd 97 c4 cc c6")  // [38852, 198]
        .hex("aa").text("block_size").hex("02")
        .hex("a7").text("lora_id").hex("c0")
        .hex("a6").text("medium").hex("a3").text("GPU")
        .hex("a9").text("lora_name").hex("c0")
        .hex("aa").text("extra_keys").hex("91 c0")
        .hex("a9").text("group_idx").hex("00")
        .hex("b2").text("kv_cache_spec_kind").hex("ae").text("full_attention")  // unknown to us: ignored
        .hex("a8").text("locality").hex("a5").text("LOCAL")
        .hex("00");
    const ev::WireBatch d = ev::decode_batch(p.b);
    REQUIRE(d.events.size() == 1);
    const auto& s = std::get<ev::WireBlockStored>(d.events[0]);
    REQUIRE(s.block_hashes.size() == 1);
    CHECK(s.block_hashes[0].key == 0x18191a1b1c1d1e1fULL);  // int.from_bytes(h, "big") & (2**64 - 1)
    CHECK_FALSE(s.block_hashes[0].full.has_value());        // 32 bytes: not a pagedkv 16-byte hash
    CHECK(s.token_ids == std::vector<TokenId>{38852, 198});
    CHECK(s.block_size == 2);
    CHECK(s.medium == std::optional<std::string>("GPU"));
    CHECK(s.group_idx == std::optional<std::int64_t>(0));
    REQUIRE(s.extra_keys.size() == 1);
    CHECK_FALSE(s.extra_keys[0].has_value());
    CHECK(d.data_parallel_rank == std::optional<std::int64_t>(0));
  }
  SECTION("vLLM 0.8: [ts, events] without a rank, a 6-element BlockStored, BlockRemoved without medium") {
    Expect p;
    p.hex("92 cb 3f f8 00 00 00 00 00 00 94")
        .hex("96 ab").text("BlockStored").hex("91 7b c0 92 01 02 02 c0")  // [123], nil, [1, 2], 2, nil
        .hex("92 ac").text("BlockRemoved").hex("91 d3 ff ff ff ff ff ff ff fe")  // [int64 -2]
        .hex("92 ac").text("BlockUpdated").hex("01")  // a tag this decoder does not know
        .hex("91 b0").text("AllBlocksCleared");
    const ev::WireBatch d = ev::decode_batch(p.b);
    CHECK_FALSE(d.data_parallel_rank.has_value());
    CHECK(d.num_unknown_events == 1);
    REQUIRE(d.events.size() == 3);
    const auto& s = std::get<ev::WireBlockStored>(d.events[0]);
    CHECK(s.block_hashes.at(0).key == 123);
    CHECK_FALSE(s.medium.has_value());
    CHECK_FALSE(s.group_idx.has_value());
    CHECK(s.extra_keys.empty());
    CHECK(std::get<ev::WireBlockRemoved>(d.events[1]).block_hashes.at(0).key == ~std::uint64_t{1});  // -2 as u64
    CHECK(std::holds_alternative<ev::WireAllBlocksCleared>(d.events[2]));
  }
  SECTION("vLLM 0.23 array with kv_cache_spec trailing fields and vLLM-style extra keys") {
    Expect p;
    p.hex("93 cb 3f f8 00 00 00 00 00 00 91")
        .hex("9c ab").text("BlockStored")
        .hex("91 cf ff ff ff ff ff ff ff ff c0 91 05 01")  // [2^64 - 1], nil, [5], 1
        .hex("c0 a3").text("GPU").hex("a4").text("lora")    // lora_id nil, medium, lora_name "lora"
        .hex("91 94 a4").text("lora")                        // extra_keys: [["lora", ["img", -3], "salt", bin]]
        .hex("92 a3").text("img").hex("fd")
        .hex("a4").text("salt").hex("c4 02 ab cd")
        .hex("00 ae").text("full_attention").hex("c0")      // group_idx, kind, sliding window
        .hex("01");
    const ev::WireBatch d = ev::decode_batch(p.b);
    const auto& s = std::get<ev::WireBlockStored>(d.events.at(0));
    CHECK(s.block_hashes.at(0).key == ~std::uint64_t{0});
    CHECK(s.lora_name == std::optional<std::string>("lora"));
    REQUIRE(s.extra_keys.size() == 1);
    REQUIRE(s.extra_keys[0].has_value());
    const auto& k = *s.extra_keys[0];
    REQUIRE(k.size() == 4);
    CHECK(k[0].kind == ev::WireExtraKey::Kind::kString);
    CHECK(k[1].kind == ev::WireExtraKey::Kind::kIdentifierWithOffset);
    CHECK(k[1].text == "img");
    CHECK(k[1].signed_value == -3);
    CHECK(k[3].kind == ev::WireExtraKey::Kind::kBytes);
    CHECK(s.group_idx == std::optional<std::int64_t>(0));
    CHECK(d.data_parallel_rank == std::optional<std::int64_t>(1));
    // vLLM's keys are not pagedkv's: asking for pagedkv keys says why.
    CHECK_THROWS_WITH(ev::pagedkv_block_keys(s, 0), Catch::Contains("not the 32 hex digits"));
  }
}

TEST_CASE("malformed payloads are rejected with the field named", "[events_zmq][wire][errors]") {
  const auto fails_with = [](const Expect& p, const std::string& needle) {
    INFO(dump(p.b));
    try {
      (void)ev::decode_batch(p.b);
      FAIL("decoded a malformed payload");
    } catch (const pagedkv::Error& e) {
      CHECK(e.code() == pagedkv::Errc::kInvalidArgument);
      CHECK_THAT(std::string(e.what()), Catch::Contains(needle));
    }
  };
  fails_with(Expect{}.hex("93 cb 3f f8"), "not one msgpack value");
  fails_with(Expect{}.hex("93 cb 3f f8 00 00 00 00 00 00 90 00 00"), "trailing bytes");
  fails_with(Expect{}.hex("a3").text("abc"), "expected the batch array");
  fails_with(Expect{}.hex("93 a1").text("x").hex("90 00"), "ts: expected a number");
  fails_with(Expect{}.hex("93 00 80 00"), "events: expected an array");
  fails_with(Expect{}.hex("93 00 91 05 00"), "expected a tagged array or map");
  fails_with(Expect{}.hex("93 00 91 91 05 00"), "must start with the event type name");
  fails_with(Expect{}.hex("93 00 91 81 a1").text("x").hex("01 00"), "field type: missing");
  fails_with(Expect{}.hex("93 00 91 92 ab").text("BlockStored").hex("90 00"), "field token_ids: missing");
  fails_with(Expect{}.hex("93 00 91 95 ab").text("BlockStored").hex("91 01 c0 93 01 02 03 02 00"),
             "holds 3 tokens for 1 blocks of 2");
  fails_with(Expect{}.hex("93 00 91 95 ab").text("BlockStored").hex("91 a1").text("h").hex("c0 91 01 01 00"),
             "expected an integer or bytes block hash");
  fails_with(Expect{}.hex("93 00 91 95 ab").text("BlockStored").hex("91 01 c0 91 ce 80 00 00 00 01 00"),
             "does not fit int32");
  fails_with(Expect{}.hex("93 00 91 95 ab").text("BlockStored").hex("91 01 c0 91 01 00 00"),
             "block size 0 is not in");
  fails_with(Expect{}.hex("93 00 91 99 ab").text("BlockStored").hex("91 01 c0 91 01 01 c0 c0 c0 92 c0 c0 00"),
             "extra_keys: has 2 entries for 1 block hashes");
  fails_with(Expect{}.hex("93 00 91 92 ac").text("BlockRemoved").hex("c0 00"), "expected an array of block hashes");
  fails_with(Expect{}.hex("93 00 90 a1").text("x"), "data_parallel_rank: expected an int or nil");
  // A stored event whose tokens do not fill its block cannot be encoded.
  KVEventBatch bad;
  bad.events = {stored(ramp(1), std::nullopt, {1, 2}, 0)};
  bad.events[0].block_size = 3;
  CHECK_THROWS_WITH(ev::encode_batch(bad), Catch::Contains("holds 2 token ids for block_size 3"));
}

namespace {

/// One block as both sides see it, for comparing a KVEventBatch with its decoded payload.
struct BlockRecord {
  char type = 0;  // 'S' stored, 'R' removed, 'C' cleared
  std::uint64_t key = 0;
  std::optional<BlockHash> full;
  std::optional<std::uint64_t> parent_key;
  std::vector<TokenId> tokens;
  std::uint32_t block_size = 0;
  std::optional<std::int64_t> lora_id;
  std::optional<std::string> medium;
  std::optional<std::int64_t> group;
  std::uint64_t adapter = 0;
  std::vector<std::pair<BlockHash, std::int64_t>> items;
  std::string salt;
  bool operator==(const BlockRecord&) const = default;
};

std::vector<BlockRecord> records_of(const KVEventBatch& b, ev::HashFormat f) {
  std::vector<BlockRecord> out;
  for (const KVEvent& e : b.events) {
    BlockRecord r;
    if (e.type == KVEventType::kAllCleared) {
      r.type = 'C';
      out.push_back(r);
      continue;
    }
    r.key = ev::wire_key(e.hash);
    if (f == ev::HashFormat::kBytes16) r.full = e.hash;
    r.medium = pagedkv::to_string(e.medium);
    r.group = e.group;
    if (e.type == KVEventType::kBlockRemoved) {
      r.type = 'R';
      out.push_back(r);
      continue;
    }
    r.type = 'S';
    if (e.parent_hash) r.parent_key = ev::wire_key(*e.parent_hash);
    r.tokens = e.token_ids;
    r.block_size = e.block_size;
    if (e.adapter_id != 0) r.lora_id = static_cast<std::int64_t>(e.adapter_id);
    r.adapter = e.adapter_id;
    for (const MultimodalItem& m : e.multimodal_items) {
      r.items.emplace_back(m.item_hash, static_cast<std::int64_t>(m.offset_tokens - e.block_start));
    }
    if (e.block_start == 0) r.salt = e.salt;
    out.push_back(r);
  }
  return out;
}

std::vector<BlockRecord> records_of(const ev::WireBatch& b) {
  std::vector<BlockRecord> out;
  for (const ev::WireEvent& w : b.events) {
    if (std::holds_alternative<ev::WireAllBlocksCleared>(w)) {
      BlockRecord x;
      x.type = 'C';
      out.push_back(x);
    } else if (const auto* r = std::get_if<ev::WireBlockRemoved>(&w)) {
      for (const ev::WireHash& h : r->block_hashes) {
        BlockRecord x;
        x.type = 'R';
        x.key = h.key;
        x.full = h.full;
        x.medium = r->medium;
        x.group = r->group_idx;
        out.push_back(x);
      }
    } else {
      const auto& s = std::get<ev::WireBlockStored>(w);
      for (std::size_t i = 0; i < s.block_hashes.size(); ++i) {
        BlockRecord x;
        x.type = 'S';
        x.key = s.block_hashes[i].key;
        x.full = s.block_hashes[i].full;
        if (i > 0) {
          x.parent_key = s.block_hashes[i - 1].key;
        } else if (s.parent_block_hash) {
          x.parent_key = s.parent_block_hash->key;
        }
        const auto t = s.block_tokens(i);
        x.tokens.assign(t.begin(), t.end());
        x.block_size = s.block_size;
        x.lora_id = s.lora_id;
        x.medium = s.medium;
        x.group = s.group_idx;
        const ev::WireBlockKeys k = ev::pagedkv_block_keys(s, i);
        x.adapter = k.adapter_id;
        x.items = k.items;
        x.salt = k.salt;
        out.push_back(x);
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE("random batches survive encode -> decode block for block, in every layout and hash format",
          "[events_zmq][wire][roundtrip]") {
  std::mt19937_64 rng(20261123);
  const auto random_hash = [&] {
    BlockHash h;
    for (auto& x : h.bytes) x = static_cast<std::uint8_t>(rng());
    return h;
  };
  std::size_t merged_events = 0;
  for (int round = 0; round < 300; ++round) {
    KVEventBatch batch;
    batch.seq_no = static_cast<std::uint64_t>(round) + 1;
    batch.ts = 1.7e9 + round * 0.25;
    const std::uint32_t bs = 1 + static_cast<std::uint32_t>(rng() % 17);
    std::optional<KVEvent> prev;  // the previous stored event, to continue its chain sometimes
    const int n = static_cast<int>(rng() % 12);
    for (int k = 0; k < n; ++k) {
      const auto r = rng() % 10;
      if (r < 6) {
        KVEvent e;
        e.type = KVEventType::kBlockStored;
        e.hash = random_hash();
        e.block_size = bs;
        const bool chain = prev && rng() % 3 != 0;
        if (chain) {
          e = *prev;
          e.hash = random_hash();
          e.parent_hash = prev->hash;
          e.block_start = prev->block_start + bs;
          e.salt.clear();
        } else {
          if (rng() % 2) e.parent_hash = random_hash();
          e.block_start = e.parent_hash ? bs * (1 + rng() % 40) : 0;
          e.adapter_id = rng() % 3 == 0 ? rng() % 1000 + 1 : 0;
          e.medium = rng() % 4 == 0 ? Medium::kCpu : Medium::kGpu;
          e.group = static_cast<std::uint32_t>(rng() % 2);
          e.salt = e.block_start == 0 && rng() % 2 ? "tenant-" + std::to_string(rng() % 5) : "";
        }
        e.token_ids.clear();
        for (std::uint32_t t = 0; t < bs; ++t) e.token_ids.push_back(static_cast<TokenId>(rng() % 200000) - 1000);
        e.multimodal_items.clear();
        if (rng() % 3 == 0) {
          const std::uint64_t len = 1 + rng() % (3 * bs);
          const std::uint64_t lo = e.block_start >= len - 1 ? e.block_start - (len - 1) : 0;
          const std::uint64_t off = lo + rng() % (e.block_start + bs - lo);  // overlaps the block
          e.multimodal_items.push_back(MultimodalItem{random_hash(), off, len});
        }
        prev = e;
        batch.events.push_back(e);
      } else if (r < 9) {
        KVEvent e = removed(random_hash());
        e.medium = rng() % 4 == 0 ? Medium::kCpu : Medium::kGpu;
        batch.events.push_back(e);
      } else {
        batch.events.push_back(cleared());
      }
    }
    for (const auto layout : {ev::EventLayout::kArray, ev::EventLayout::kMap}) {
      for (const auto format : {ev::HashFormat::kUint64, ev::HashFormat::kBytes16}) {
        for (const bool merge : {true, false}) {
          ev::EncodeOptions opt;
          opt.layout = layout;
          opt.hash_format = format;
          opt.merge_runs = merge;
          opt.data_parallel_rank = static_cast<std::int32_t>(round % 4);
          const Bytes payload = ev::encode_batch(batch, opt);
          const ev::WireBatch d = ev::decode_batch(payload);
          CHECK(d.ts == batch.ts);
          CHECK(d.data_parallel_rank == std::optional<std::int64_t>(round % 4));
          CHECK(d.num_unknown_events == 0);
          REQUIRE(records_of(d) == records_of(batch, format));
          if (merge) {
            merged_events += batch.events.size() - d.events.size();
          } else {
            CHECK(d.events.size() == batch.events.size());
          }
        }
      }
    }
  }
  CHECK(merged_events > 100);  // runs were actually merged
}

TEMPLATE_TEST_CASE("every stored block of a manager's events recomputes from its wire event",
                   "[events_zmq][wire][rehash]", pagedkv::Sha256Hasher, pagedkv::Xxh3Hasher) {
  constexpr std::uint64_t kSeed = 0x5eed;
  pagedkv::CacheConfig c;
  c.num_blocks = 48;
  c.block_size = 4;
  c.hash_seed = kSeed;
  c.enable_events = true;
  pagedkv::KVCacheManager<TestType> m(c);
  std::mt19937_64 rng(7);
  std::vector<pagedkv::RequestKeys> keys(4);
  keys[1].salt = "tenant";
  keys[2].adapter_id = 9;
  keys[3].multimodal = {MultimodalItem{ramp(0x60), 2, 7}, MultimodalItem{ramp(0x70), 11, 3}};
  keys[3].salt = "t3";
  std::map<std::uint64_t, BlockHash> full_of;  // key -> full hash, to chain the 64-bit form
  std::size_t checked = 0;
  std::vector<std::int32_t> indptr(2), indices(64), lpl(1), qo(2);
  std::vector<std::int64_t> slots(256);
  for (std::uint64_t seq = 1; seq <= 150; ++seq) {
    std::vector<TokenId> prompt(16 + rng() % 30);
    for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<TokenId>(i < 8 ? i : rng() % 5);
    if (!m.try_admit(seq, prompt, &keys[rng() % keys.size()]).admitted()) continue;
    pagedkv::BatchMetadataBuffers buf;
    buf.indptr = indptr;
    buf.indices = indices;
    buf.last_page_len = lpl;
    buf.qo_indptr = qo;
    buf.slot_mapping = slots;
    const pagedkv::SeqId id = seq;
    (void)m.build_batch_metadata({&id, 1}, buf);
    m.free(seq);
    const auto batch = m.take_event_batch(0.0);
    if (!batch) continue;
    for (const auto format : {ev::HashFormat::kBytes16, ev::HashFormat::kUint64}) {
      ev::EncodeOptions opt;
      opt.hash_format = format;
      const ev::WireBatch d = ev::decode_batch(ev::encode_batch(*batch, opt));
      for (const ev::WireEvent& w : d.events) {
        const auto* s = std::get_if<ev::WireBlockStored>(&w);
        if (s == nullptr) continue;
        for (std::size_t i = 0; i < s->block_hashes.size(); ++i) {
          if (format == ev::HashFormat::kBytes16) {  // from the event alone
            const BlockHash h = ev::rehash_wire_block<TestType>(*s, i, kSeed);
            CHECK(h == *s->block_hashes[i].full);
            full_of[s->block_hashes[i].key] = h;
            ++checked;
          } else {  // 64-bit keys: the parent's full hash comes from the chain seen so far
            std::optional<BlockHash> parent;
            if (i > 0) {
              parent = full_of.at(s->block_hashes[i - 1].key);
            } else if (s->parent_block_hash) {
              parent = full_of.at(s->parent_block_hash->key);
            }
            const BlockHash h = ev::rehash_wire_block<TestType>(*s, i, kSeed, parent ? &*parent : nullptr);
            CHECK(ev::wire_key(h) == s->block_hashes[i].key);
            CHECK(h == full_of.at(s->block_hashes[i].key));  // the same hash the 16-byte form carried
          }
        }
      }
    }
  }
  CHECK(checked > 100);
  // With 64-bit keys and no parent given, a non-first block cannot be recomputed: the error says so.
  pagedkv::KVEventBatch b;
  b.events = {stored(ramp(0x10), ramp(0x20), {1, 2, 3, 4}, 4)};
  const ev::WireBatch d = ev::decode_batch(ev::encode_batch(b));
  CHECK_THROWS_WITH(ev::rehash_wire_block<TestType>(std::get<ev::WireBlockStored>(d.events[0]), 0, kSeed),
                    Catch::Contains("sent as a 64-bit integer"));
  CHECK_THROWS_WITH(ev::rehash_wire_block<TestType>(std::get<ev::WireBlockStored>(d.events[0]), 1, kSeed),
                    Catch::Contains("index out of range"));
}

TEST_CASE("a block's BlockStored is written after its parent's when both are in one batch", "[events_zmq][wire]") {
  // Write-back offload completes a freed sequence's blocks last block first: the host tier reports C, B, A for
  // the chain A <- B <- C. A router applies each store by looking its parent up, so the encoder writes A, B, C.
  KVEvent a = stored(ramp(0x10), std::nullopt, {1}, 0);
  KVEvent b = stored(ramp(0x20), ramp(0x10), {2}, 1);
  KVEvent c = stored(ramp(0x30), ramp(0x20), {3}, 2);
  for (KVEvent* e : {&a, &b, &c}) e->medium = Medium::kCpu;
  const auto order = [](const KVEventBatch& batch) {
    ev::EncodeOptions opt;
    opt.merge_runs = false;
    std::vector<std::uint64_t> keys;
    for (const ev::WireEvent& w : ev::decode_batch(ev::encode_batch(batch, opt)).events) {
      if (const auto* s = std::get_if<ev::WireBlockStored>(&w)) keys.push_back(s->block_hashes.at(0).key);
      if (std::holds_alternative<ev::WireBlockRemoved>(w)) keys.push_back(0);
      if (std::holds_alternative<ev::WireAllBlocksCleared>(w)) keys.push_back(1);
    }
    return keys;
  };
  const std::uint64_t ka = ev::wire_key(a.hash), kb = ev::wire_key(b.hash), kc = ev::wire_key(c.hash);
  KVEventBatch batch;
  batch.events = {c, b, a};
  CHECK(order(batch) == std::vector<std::uint64_t>{ka, kb, kc});
  batch.events = {b, c, removed(ramp(0x40)), a};  // other blocks' events are passed, in their order
  CHECK(order(batch) == std::vector<std::uint64_t>{0, ka, kb, kc});
  // Never past an event of the block itself, nor past a reset: those stay in place.
  batch.events = {b, removed(ramp(0x20)), a};
  CHECK(order(batch) == std::vector<std::uint64_t>{kb, 0, ka});
  batch.events = {b, cleared(), a};
  CHECK(order(batch) == std::vector<std::uint64_t>{kb, 1, ka});
  // Merged, the reordered chain becomes one event.
  batch.events = {c, b, a};
  const ev::WireBatch d = ev::decode_batch(ev::encode_batch(batch));
  REQUIRE(d.events.size() == 1);
  CHECK(std::get<ev::WireBlockStored>(d.events[0]).block_hashes.size() == 3);
}
