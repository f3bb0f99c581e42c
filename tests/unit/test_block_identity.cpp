// pagedkv/block_identity.hpp against (1) the golden vectors an independent encoder wrote
// (tests/unit/golden/make_block_identity_vectors.py: Python cbor2 + hashlib + xxhash), (2) constants the other
// projects publish (Dynamo's lib/tokens test constants, RFC 8949 Appendix A, the FNV reference values).
#include <catch2/catch.hpp>

#include <cstdint>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <pagedkv/block_identity.hpp>
#include <pagedkv/error.hpp>

using namespace pagedkv::identity;

namespace {

std::string hex(std::span<const std::uint8_t> b) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  for (std::uint8_t x : b) {
    s.push_back(kDigits[x >> 4]);
    s.push_back(kDigits[x & 15]);
  }
  return s;
}

std::vector<std::uint8_t> unhex(const std::string& s) {
  REQUIRE(s.size() % 2 == 0);
  std::vector<std::uint8_t> out;
  for (std::size_t i = 0; i < s.size(); i += 2) out.push_back(static_cast<std::uint8_t>(std::stoul(s.substr(i, 2), nullptr, 16)));
  return out;
}

// "-" = absent, "=" = empty, else hex of UTF-8.
std::optional<std::string> opt_str(const std::string& v) {
  if (v == "-") return std::nullopt;
  if (v == "=") return std::string();
  const auto b = unhex(v);
  return std::string(b.begin(), b.end());
}

std::string str(const std::string& v) { return opt_str(v).value(); }

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  if (s == "-") return out;
  std::string cur;
  std::istringstream in(s);
  while (std::getline(in, cur, sep)) out.push_back(cur);
  return out;
}

std::vector<std::uint32_t> tokens(const std::string& s) {
  std::vector<std::uint32_t> out;
  for (const auto& t : split(s, ',')) out.push_back(static_cast<std::uint32_t>(std::stoull(t)));
  return out;
}

std::vector<std::uint64_t> u64s(const std::string& s) {
  std::vector<std::uint64_t> out;
  for (const auto& t : split(s, ',')) out.push_back(std::stoull(t));
  return out;
}

Sha256Digest digest(const std::string& s) {
  const auto b = unhex(s);
  REQUIRE(b.size() == 32);
  Sha256Digest d{};
  std::copy(b.begin(), b.end(), d.begin());
  return d;
}

struct Vector {
  std::string kind;
  std::map<std::string, std::string> f;
  std::size_t line = 0;
};

std::vector<Vector> load_vectors() {
  std::ifstream in(PAGEDKV_BLOCK_IDENTITY_VECTORS);
  REQUIRE(in.good());
  std::vector<Vector> out;
  std::string line;
  std::size_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    Vector v;
    v.line = n;
    ls >> v.kind;
    std::string kv;
    while (ls >> kv) {
      const auto eq = kv.find('=');
      REQUIRE(eq != std::string::npos);
      v.f[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    out.push_back(std::move(v));
  }
  return out;
}

std::map<std::string, std::size_t> g_checked;  // vectors checked per kind (a vector file with none fails below)

}  // namespace

TEST_CASE("block_identity: canonical CBOR heads match RFC 8949 Appendix A", "[block_identity]") {
  const auto enc = [](auto&& write) {
    CborWriter w;
    write(w);
    return hex(w.data());
  };
  CHECK(enc([](CborWriter& w) { w.uint(0); }) == "00");
  CHECK(enc([](CborWriter& w) { w.uint(23); }) == "17");
  CHECK(enc([](CborWriter& w) { w.uint(24); }) == "1818");
  CHECK(enc([](CborWriter& w) { w.uint(100); }) == "1864");
  CHECK(enc([](CborWriter& w) { w.uint(1000); }) == "1903e8");
  CHECK(enc([](CborWriter& w) { w.uint(1000000); }) == "1a000f4240");
  CHECK(enc([](CborWriter& w) { w.uint(1000000000000); }) == "1b000000e8d4a51000");
  CHECK(enc([](CborWriter& w) { w.uint(18446744073709551615ULL); }) == "1bffffffffffffffff");
  CHECK(enc([](CborWriter& w) { w.sint(-1); }) == "20");
  CHECK(enc([](CborWriter& w) { w.sint(-10); }) == "29");
  CHECK(enc([](CborWriter& w) { w.sint(-100); }) == "3863");
  CHECK(enc([](CborWriter& w) { w.sint(-1000); }) == "3903e7");
  CHECK(enc([](CborWriter& w) { w.sint(INT64_MIN); }) == "3b7fffffffffffffff");
  CHECK(enc([](CborWriter& w) { w.null(); }) == "f6");
  CHECK(enc([](CborWriter& w) { w.text(""); }) == "60");
  CHECK(enc([](CborWriter& w) { w.text("IETF"); }) == "6449455446");
  CHECK(enc([](CborWriter& w) { w.text("\xc3\xbc"); }) == "62c3bc");
  CHECK(enc([](CborWriter& w) {
          const std::uint8_t b[] = {1, 2, 3, 4};
          w.bytes(b);
        }) == "4401020304");
  CHECK(enc([](CborWriter& w) {  // [1, [2, 3], [4, 5]]
          w.array(3);
          w.uint(1);
          w.array(2);
          w.uint(2);
          w.uint(3);
          w.array(2);
          w.uint(4);
          w.uint(5);
        }) == "8301820203820405");
  CHECK(enc([](CborWriter& w) {  // {"a": 1}
          w.map(1);
          w.text("a");
          w.uint(1);
        }) == "a1616101");
  // Boundaries of each head width (shortest form, RFC 8949 4.2.1).
  CHECK(enc([](CborWriter& w) { w.uint(255); }) == "18ff");
  CHECK(enc([](CborWriter& w) { w.uint(256); }) == "190100");
  CHECK(enc([](CborWriter& w) { w.uint(65535); }) == "19ffff");
  CHECK(enc([](CborWriter& w) { w.uint(65536); }) == "1a00010000");
  CHECK(enc([](CborWriter& w) { w.uint(4294967295ULL); }) == "1affffffff");
  CHECK(enc([](CborWriter& w) { w.uint(4294967296ULL); }) == "1b0000000100000000");
  CHECK(enc([](CborWriter& w) { w.sint(-24); }) == "37");
  CHECK(enc([](CborWriter& w) { w.sint(-25); }) == "3818");
  CHECK(enc([](CborWriter& w) { w.array(24); }) == "9818");
}

TEST_CASE("block_identity: FNV-1a 64 reference values", "[block_identity]") {
  const auto f = [](std::string_view s) {
    return fnv1a64({reinterpret_cast<const std::uint8_t*>(s.data()), s.size()});
  };
  CHECK(f("") == 0xcbf29ce484222325ULL);
  CHECK(f("a") == 0xaf63dc4c8601ec8cULL);
  CHECK(f("foobar") == 0x85944171f73967e8ULL);
  CHECK(llmd_init_hash("") == 0xcbf29ce484222325ULL);
}

TEST_CASE("block_identity: Dynamo's published lib/tokens constants", "[block_identity]") {
  // ai-dynamo/dynamo lib/tokens/src/lib.rs, mod tests: TEST_SALT_HASH = 1337, HASH_1_4 = hash([1,2,3,4], 1337), ...
  const std::vector<std::uint32_t> t14{1, 2, 3, 4}, t58{5, 6, 7, 8}, t912{9, 10, 11, 12};
  constexpr std::uint64_t kHash14 = 14643705804678351452ULL;
  constexpr std::uint64_t kHash58 = 16777012769546811212ULL;
  constexpr std::uint64_t kHash912 = 483935686894639516ULL;
  CHECK(dynamo_tokens_hash(t14, 1337) == kHash14);
  CHECK(dynamo_tokens_hash(t58, 1337) == kHash58);
  CHECK(dynamo_tokens_hash(t912, 1337) == kHash912);
  CHECK(dynamo_tokens_hash(t14) == kHash14);  // the default seed is XXH3_SEED = 1337
  // Older lib/tokens (revision 9acecc75): the chain step is seeded with the salt hash (1337 in the test), which is
  // also the kv-router's chain seed (compute_hash with XXH3_SEED).
  CHECK(dynamo_sequence_hash(kHash14, kHash58, 1337) == 4945711292740353085ULL);
  CHECK(dynamo_sequence_hash(4945711292740353085ULL, kHash912, 1337) == 12583592247330656132ULL);
  // Newest lib/tokens (revision 05039e48): constant chain seed 0.
  CHECK(dynamo_sequence_hash(kHash14, kHash58, 0) == 13257339816715102022ULL);
  CHECK(dynamo_sequence_hash(13257339816715102022ULL, kHash912, 0) == 18362646011897812054ULL);
  // The request-level form gives the same chain.
  const std::vector<std::uint32_t> all{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
  const DynamoBlockHashes r = dynamo_request_hashes(all, 4, 1337, 0);
  CHECK(r.tokens_hashes == std::vector<std::uint64_t>{kHash14, kHash58, kHash912});
  CHECK(r.sequence_hashes == std::vector<std::uint64_t>{kHash14, 13257339816715102022ULL, 18362646011897812054ULL});
  // Salt: no LoRA and no salt is the plain router seed; each term changes it.
  CHECK(dynamo_salt_hash("", "") == kDynamoXxh3Seed);
  CHECK(dynamo_salt_hash("lora", "") != kDynamoXxh3Seed);
  CHECK(dynamo_salt_hash("x", "") != dynamo_salt_hash("", "x"));  // inner seeds 0 vs 1 keep them apart
}

TEST_CASE("block_identity: vLLM NONE_HASH and event form", "[block_identity]") {
  const Sha256Digest none = vllm_none_hash();
  // 0x6e = text string of 14 bytes; the digest itself is checked against Python in the golden vectors.
  CHECK(none == vllm_none_hash("vllm-none-hash"));
  CHECK(none != vllm_none_hash("0"));
  Sha256Digest d{};
  for (std::size_t i = 0; i < d.size(); ++i) d[i] = static_cast<std::uint8_t>(i);
  CHECK(vllm_event_hash(d) == 0x18191a1b1c1d1e1fULL);  // bytes 24..31, big-endian
}

TEST_CASE("block_identity: bad input is rejected with the value named", "[block_identity]") {
  const std::vector<std::uint32_t> t{1, 2, 3};
  CHECK_THROWS_WITH(vllm_request_block_hashes(t, 0, {}, vllm_none_hash()), Catch::Contains("block_size must be >= 1"));
  CHECK_THROWS_WITH(dynamo_request_hashes(t, 0, 1337), Catch::Contains("block_size must be >= 1"));
  CHECK_THROWS_WITH(llmd_request_keys(t, 0, "", "m"), Catch::Contains("block_size must be >= 1"));
  VllmRequestKeys k;
  k.mm = {{"a", 2, 1}, {"b", 1, 1}};
  CHECK_THROWS_WITH(vllm_request_block_hashes(t, 1, k, vllm_none_hash()),
                    Catch::Contains("item 1 at offset 1 is not sorted"));
  // Fewer tokens than a block: no block, no error.
  CHECK(vllm_request_block_hashes(t, 4, {}, vllm_none_hash()).empty());
  CHECK(llmd_request_keys(t, 4, "", "m").empty());
}

TEST_CASE("block_identity: golden vectors from an independent encoder (cbor2, hashlib, xxhash)", "[block_identity]") {
  const std::vector<Vector> vectors = load_vectors();
  REQUIRE(vectors.size() > 200);
  for (const Vector& v : vectors) {
    INFO("vector line " << v.line << " (" << v.kind << ")");
    const auto& f = v.f;
    if (v.kind == "vllm_none_hash") {
      CHECK(hex(vllm_none_hash(str(f.at("seed")))) == f.at("digest"));
    } else if (v.kind == "vllm_block") {
      VllmExtraKeys e;
      e.lora_name = opt_str(f.at("lora"));
      for (const auto& item : split(f.at("mm"), ';')) {
        const auto colon = item.find(':');
        const auto b = unhex(item.substr(0, colon));
        const std::string off = item.substr(colon + 1);
        e.mm.push_back({std::string(b.begin(), b.end()),
                        off == "_" ? std::nullopt : std::optional<std::int64_t>(std::stoll(off))});
      }
      e.cache_salt = opt_str(f.at("salt"));
      if (f.at("embeds") != "-") e.prompt_embeds_hash = digest(f.at("embeds"));
      const Sha256Digest parent = digest(f.at("parent"));
      const auto t = tokens(f.at("tokens"));
      CHECK(hex(vllm_block_cbor(parent, t, &e)) == f.at("cbor"));
      const Sha256Digest d = vllm_block_hash(parent, t, &e);
      CHECK(hex(d) == f.at("digest"));
      CHECK(vllm_event_hash(d) == std::stoull(f.at("event")));
    } else if (v.kind == "vllm_request") {
      VllmRequestKeys k;
      k.lora_name = opt_str(f.at("lora"));
      k.cache_salt = opt_str(f.at("salt")).value_or("");
      k.mm_bare_identifiers = f.at("bare") == "1";
      for (const auto& item : split(f.at("mm"), ';')) {
        const auto parts = split(item, ':');
        REQUIRE(parts.size() == 3);
        const auto b = unhex(parts[0]);
        k.mm.push_back({std::string(b.begin(), b.end()), std::stoull(parts[1]), std::stoull(parts[2])});
      }
      const auto got = vllm_request_block_hashes(tokens(f.at("tokens")), std::stoull(f.at("block_size")), k,
                                                 vllm_none_hash(str(f.at("seed"))));
      std::vector<std::string> got_hex;
      for (const auto& d : got) got_hex.push_back(hex(d));
      CHECK(got_hex == split(f.at("digests"), ','));
    } else if (v.kind == "dynamo_salt") {
      CHECK(dynamo_salt_hash(opt_str(f.at("lora")).value_or(""), opt_str(f.at("salt")).value_or("")) ==
            std::stoull(f.at("seed")));
    } else if (v.kind == "dynamo_tokens") {
      const auto mm = u64s(f.at("mm"));
      CHECK(dynamo_tokens_hash(tokens(f.at("tokens")), std::stoull(f.at("seed")), mm) == std::stoull(f.at("hash")));
    } else if (v.kind == "dynamo_seq") {
      CHECK(dynamo_sequence_hash(std::stoull(f.at("parent")), std::stoull(f.at("block")),
                                 std::stoull(f.at("chain_seed"))) == std::stoull(f.at("hash")));
    } else if (v.kind == "dynamo_request") {
      const auto r = dynamo_request_hashes(tokens(f.at("tokens")), std::stoull(f.at("block_size")),
                                           std::stoull(f.at("seed")), std::stoull(f.at("chain_seed")));
      CHECK(r.tokens_hashes == u64s(f.at("tokens_hashes")));
      CHECK(r.sequence_hashes == u64s(f.at("sequence_hashes")));
    } else if (v.kind == "llmd_init") {
      CHECK(llmd_init_hash(str(f.at("seed"))) == std::stoull(f.at("hash")));
    } else if (v.kind == "llmd_root") {
      CHECK(hex(llmd_root_cbor(str(f.at("seed")), str(f.at("model")))) == f.at("cbor"));
      CHECK(llmd_root_hash(str(f.at("seed")), str(f.at("model"))) == std::stoull(f.at("hash")));
    } else if (v.kind == "llmd_block") {
      std::vector<std::string> mm;
      for (const auto& id : split(f.at("mm"), ',')) mm.push_back(str(id));
      const auto t = tokens(f.at("tokens"));
      CHECK(hex(llmd_block_cbor(std::stoull(f.at("parent")), t, mm)) == f.at("cbor"));
      CHECK(llmd_block_key(std::stoull(f.at("parent")), t, mm) == std::stoull(f.at("hash")));
    } else if (v.kind == "llmd_request") {
      CHECK(llmd_request_keys(tokens(f.at("tokens")), std::stoull(f.at("block_size")), str(f.at("seed")),
                              str(f.at("model"))) == u64s(f.at("keys")));
    } else {
      FAIL("unknown vector kind " << v.kind);
    }
    ++g_checked[v.kind];
  }
  // Every kind is present (a generator that silently dropped one would otherwise pass).
  for (const char* k : {"vllm_none_hash", "vllm_block", "vllm_request", "dynamo_salt", "dynamo_tokens", "dynamo_seq",
                        "dynamo_request", "llmd_init", "llmd_root", "llmd_block", "llmd_request"}) {
    INFO(k);
    CHECK(g_checked[k] > 0);
  }
}

TEST_CASE("block_identity: llm-d newest multimodal features: [parent, tokens, [{Hash, Offset}]] in canonical CBOR, hand-written",
          "[block_identity][llmd]") {
  const std::vector<std::uint32_t> t{1, 2};
  const std::vector<pagedkv::identity::LlmdMmHash> mm{{"img", -3}};
  // 83 (array 3) 05 (parent) 82 01 02 (tokens) 81 (one feature) a2 (map 2) "Hash" "img" "Offset" -3 (0x22)
  CHECK(hex(pagedkv::identity::llmd_block_cbor_mm(5, t, mm)) ==
        "8305820102" "81a2" "6448617368" "63696d67" "664f6666736574" "22");
  CHECK(pagedkv::identity::llmd_block_cbor_mm(5, t, {}) == pagedkv::identity::llmd_block_cbor(5, t));
  CHECK(pagedkv::identity::llmd_block_key_mm(5, t, mm) ==
        pagedkv::identity::fnv1a64(pagedkv::identity::llmd_block_cbor_mm(5, t, mm)));
  CHECK(pagedkv::identity::llmd_block_key_mm(5, t, mm) != pagedkv::identity::llmd_block_key(5, t));
}
