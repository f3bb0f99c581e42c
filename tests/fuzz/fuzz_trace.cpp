// tests/fuzz/fuzz_trace.cpp: libFuzzer target for pagedkv-replay's trace parsers (examples/replay/trace.cpp):
// the input is a trace file's content, Mooncake JSONL or Azure CSV.
//
// A parse either throws replay::TraceError whose message starts with "<file>:" (and, past the format detection,
// "<file>:<line>: ") or returns a trace that keeps every documented promise:
//  - at least one request, arrival times finite, starting at 0 and never decreasing, prompts of >= 1 token;
//  - Mooncake: hash_ids below 2^50 covering ceil(input_length / 512) blocks; Azure: no hash_ids;
//  - a limit keeps exactly the first requests; a Mooncake trace written back as JSONL parses to the same trace;
//  - max_total_tokens / total_input_tokens agree with the requests; synthesized prompts (small requests) have the
//    right length, non-negative token ids, and Mooncake prompts are their blocks' token runs.
// Any other exception, or a sanitizer report, is a finding.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trace.hpp"

namespace {

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "\n==== pagedkv trace fuzz: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

void check(bool ok, const std::string& what) {
  if (!ok) finding(what);
}

bool same_requests(const replay::Request& a, const replay::Request& b) {
  return a.arrival_ms == b.arrival_ms && a.input_tokens == b.input_tokens && a.output_tokens == b.output_tokens &&
         a.hash_ids == b.hash_ids;
}

void check_trace(const replay::Trace& t, const std::string& text) {
  check(!t.requests.empty(), "a parsed trace without requests");
  const bool mooncake = t.format == replay::TraceFormat::kMooncakeJsonl;
  double prev = 0.0;
  std::uint64_t input_sum = 0;
  std::size_t max_total = 0;
  for (std::size_t i = 0; i < t.requests.size(); ++i) {
    const replay::Request& r = t.requests[i];
    check(std::isfinite(r.arrival_ms), "request " + std::to_string(i) + " arrives at a non-finite time");
    check(i != 0 || r.arrival_ms == 0.0, "the first request does not arrive at 0");
    check(r.arrival_ms >= prev, "request " + std::to_string(i) + " arrives before the previous one");
    prev = r.arrival_ms;
    check(r.input_tokens >= 1, "request " + std::to_string(i) + " has an empty prompt");
    if (mooncake) {
      const std::size_t need = (std::size_t{r.input_tokens} + replay::kMooncakeBlockTokens - 1) / replay::kMooncakeBlockTokens;
      check(r.hash_ids.size() >= need, "request " + std::to_string(i) + " has too few hash_ids");
      for (std::uint64_t id : r.hash_ids) check(id < (std::uint64_t{1} << 50), "a hash_id >= 2^50");
    } else {
      check(r.hash_ids.empty(), "an Azure request with hash_ids");
    }
    input_sum += r.input_tokens;
    max_total = std::max<std::size_t>(max_total, std::size_t{r.input_tokens} + r.output_tokens);
  }
  check(t.total_input_tokens() == input_sum, "total_input_tokens");
  check(t.max_total_tokens() == max_total, "max_total_tokens");

  // A limit keeps exactly the first requests.
  const std::size_t limit = 1 + text.size() % t.requests.size();
  std::istringstream in(text);
  const replay::Trace part = replay::parse_trace(in, "fuzz-input", limit);
  check(part.requests.size() == limit && part.format == t.format, "--limit " + std::to_string(limit));
  for (std::size_t i = 0; i < limit; ++i) check(same_requests(part.requests[i], t.requests[i]), "a limited parse differs");

  // Mooncake round trip: written back as JSONL (relative timestamps), the trace parses to itself.
  if (mooncake) {
    std::string out;
    for (const replay::Request& r : t.requests) {
      nlohmann::json j;
      j["timestamp"] = r.arrival_ms;
      j["input_length"] = r.input_tokens;
      j["output_length"] = r.output_tokens;
      j["hash_ids"] = r.hash_ids;
      out += j.dump() + "\n";
    }
    std::istringstream again(out);
    const replay::Trace back = replay::parse_trace(again, "round-trip", 0);
    check(back.requests.size() == t.requests.size(), "round trip changed the number of requests");
    for (std::size_t i = 0; i < back.requests.size(); ++i) {
      check(same_requests(back.requests[i], t.requests[i]), "round trip changed request " + std::to_string(i));
    }
  }

  // Prompt synthesis of the first few small requests.
  std::vector<pagedkv::TokenId> prompt;
  for (std::size_t i = 0; i < std::min<std::size_t>(t.requests.size(), 4); ++i) {
    const replay::Request& r = t.requests[i];
    if (r.input_tokens > 4096) continue;
    replay::synthesize_prompt(t, i, prompt);
    check(prompt.size() == r.input_tokens, "synthesized prompt length");
    for (std::size_t p = 0; p < prompt.size(); ++p) {
      check(prompt[p] >= 0, "a negative synthesized token id");
      if (mooncake) {
        check(prompt[p] == replay::mooncake_token(r.hash_ids[p / replay::kMooncakeBlockTokens], p % replay::kMooncakeBlockTokens),
              "a Mooncake prompt that is not its blocks' token runs");
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::istringstream in(text);
  try {
    const replay::Trace t = replay::parse_trace(in, "fuzz-input", 0);
    check_trace(t, text);
  } catch (const replay::TraceError& e) {
    const std::string msg = e.what();
    check(msg.rfind("fuzz-input:", 0) == 0, "a TraceError message that does not start with the file name: " + msg);
    check(msg.size() <= 4096, "a TraceError message of " + std::to_string(msg.size()) + " bytes");
  }
  return 0;
}
