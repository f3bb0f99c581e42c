// tests/fuzz/replay_input_tests.cpp: pagedkv-replay's input validation (examples/replay/trace.cpp): trace parsing
// errors with file:line and bounded messages, the limit, and the host-memory check that runs before a replay
// allocates anything. The argument checks of main.cpp are run end to end by tests/fuzz/check_replay_args.sh.
#include <catch2/catch.hpp>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unistd.h>

#include "trace.hpp"

namespace {

replay::Trace parse(const std::string& text, std::size_t limit = 0) {
  std::istringstream in(text);
  return replay::parse_trace(in, "t.jsonl", limit);
}

// The TraceError message of parsing `text`, or "" if it parses.
std::string parse_error(const std::string& text) {
  try {
    (void)parse(text);
  } catch (const replay::TraceError& e) {
    return e.what();
  }
  return "";
}

const char* kCsvHeader = "TIMESTAMP,ContextTokens,GeneratedTokens\n";

}  // namespace

TEST_CASE("parse_trace: Mooncake lines, relative arrivals, limit", "[replay][trace]") {
  const std::string text =
      "{\"timestamp\": 100, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [5, 6]}\n"
      "\n"
      "  {\"timestamp\": 102.5, \"input_length\": 1, \"output_length\": 0, \"hash_ids\": [7]}\r\n"
      "{\"timestamp\": 102.5, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [1125899906842623]}\n";
  const replay::Trace t = parse(text);
  REQUIRE(t.format == replay::TraceFormat::kMooncakeJsonl);
  REQUIRE(t.requests.size() == 3);
  CHECK(t.requests[0].arrival_ms == 0.0);
  CHECK(t.requests[1].arrival_ms == 2.5);
  CHECK(t.requests[2].hash_ids == std::vector<std::uint64_t>{(std::uint64_t{1} << 50) - 1});
  CHECK(t.max_total_tokens() == 603);
  CHECK(t.total_input_tokens() == 1113);
  const replay::Trace two = parse(text, 2);
  REQUIRE(two.requests.size() == 2);
  CHECK(two.requests[1].input_tokens == 1);
}

TEST_CASE("parse_trace: malformed Mooncake lines name the file, the line and the value", "[replay][trace]") {
  CHECK(parse_error("{\"timestamp\": 1e400, \"input_length\": 6, \"output_length\": 3, \"hash_ids\": [5]}\n")
            .starts_with("t.jsonl:1: invalid JSON: "));  // a number overflow, not an escaped json exception
  CHECK(parse_error("{\"timestamp\": 0, \"input_length\": 4294967296, \"output_length\": 1, \"hash_ids\": []}") ==
        "t.jsonl:1: field \"input_length\" is too large: 4294967296 > 4294967295");
  CHECK(parse_error("{\"timestamp\": 0, \"input_length\": 1, \"output_length\": -1, \"hash_ids\": [0]}") ==
        "t.jsonl:1: field \"output_length\" must be a non-negative integer, got -1");
  CHECK(parse_error("{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1125899906842624]}") ==
        "t.jsonl:1: hash_ids entries must be integers in [0, 2^50), got 1125899906842624");
  CHECK(parse_error("{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1]}") ==
        "t.jsonl:1: hash_ids has 1 entries, input_length 600 needs ceil(input_length / 512) = 2");
  CHECK(parse_error("{\"timestamp\": 5, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n"
                    "{\"timestamp\": 4, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n") ==
        "t.jsonl:2: timestamps must not decrease (this request arrives before the previous one)");
  CHECK(parse_error("[1, 2]").starts_with("t.jsonl:1: unrecognised trace format"));
  CHECK(parse_error("\n\n").starts_with("t.jsonl: the trace holds no requests"));
}

TEST_CASE("parse_trace: messages quote at most a short piece of the input", "[replay][trace]") {
  // A deeply nested hash id and a megabyte-long field: described, never echoed whole.
  std::string nested = "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [";
  for (int i = 0; i < 5000; ++i) nested += "[";
  for (int i = 0; i < 5000; ++i) nested += "]";
  nested += "]}";
  const std::string e1 = parse_error(nested);
  CHECK(e1 == "t.jsonl:1: hash_ids entries must be integers in [0, 2^50), got a JSON array (size 1)");
  const std::string e2 = parse_error(std::string(kCsvHeader) + "2023-11-16 18:15:46.68," + std::string(1 << 20, '7') + ",1\n");
  CHECK(e2.starts_with("t.jsonl:2: ContextTokens \"7777777777"));
  CHECK(e2.ends_with("...\" (1048576 characters) is not an integer in [0, 2^32)"));
  CHECK(e2.size() < 200);
}

TEST_CASE("parse_trace: Azure CSV columns, extremes and errors", "[replay][trace]") {
  const replay::Trace t = parse("GeneratedTokens,TIMESTAMP,Extra,ContextTokens\n"
                                "7,2023-11-16 18:15:46.5,x,4294967295\n"
                                "0,2023-11-16 18:15:47,,1\n");
  REQUIRE(t.format == replay::TraceFormat::kAzureCsv);
  REQUIRE(t.requests.size() == 2);
  CHECK(t.requests[0].input_tokens == 4294967295U);  // parses: the replay's memory check refuses it (below)
  CHECK(t.requests[0].output_tokens == 7);
  CHECK(t.requests[1].arrival_ms == Approx(500.0));
  const replay::LongestRequest l = replay::longest_request(t);
  CHECK(l.index == 0);
  CHECK(l.tokens == 4294967302ULL);
  CHECK(parse_error(std::string(kCsvHeader) + "2023-11-16 18:15:46.68,4294967296,0\n") ==
        "t.jsonl:2: ContextTokens \"4294967296\" is not an integer in [0, 2^32)");
  CHECK(parse_error(std::string(kCsvHeader) + "2023-13-16 18:15:46.68,4,0\n") ==
        "t.jsonl:2: TIMESTAMP \"2023-13-16 18:15:46.68\" is not of the form YYYY-MM-DD HH:MM:SS.fffffff");
  CHECK(parse_error(std::string(kCsvHeader) + "2023-11-16 18:15:46.68,0,5\n") ==
        "t.jsonl:2: ContextTokens is 0 (a prompt needs at least one token)");
  CHECK(parse_error(std::string(kCsvHeader) + "2023-11-16 18:15:46.68,4\n") ==
        "t.jsonl:2: expected 3 comma-separated fields, got 2");
}

TEST_CASE("check_host_memory: refuses more than is available, naming both sizes", "[replay][memory]") {
  const std::uint64_t gib = std::uint64_t{1} << 30;
  CHECK_NOTHROW(replay::check_host_memory(4 * gib, 4 * gib, "x", "y"));
  try {
    replay::check_host_memory(128 * gib, 22 * gib + gib / 2, "request 0 of big.csv", "use --limit");
    FAIL("no exception");
  } catch (const std::length_error& e) {
    CHECK(std::string(e.what()) ==
          "request 0 of big.csv needs about 128.0 GiB of host memory, but only 22.5 GiB are available (use --limit)");
  }
  // The request of 2^32 - 1 tokens that once died with std::bad_alloc: the estimate the replay checks first.
  CHECK(std::uint64_t{4294967295U} * replay::kHostBytesPerRequestToken > 100 * gib);
}

TEST_CASE("host_memory_available_bytes: positive and at most the physical memory", "[replay][memory]") {
  const std::uint64_t avail = replay::host_memory_available_bytes();
  const std::uint64_t physical =
      static_cast<std::uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<std::uint64_t>(sysconf(_SC_PAGE_SIZE));
  CHECK(avail > 0);
  CHECK(avail <= physical);
}

TEST_CASE("parse_trace: hash_ids beyond the prompt are refused, naming the line and the counts", "[replay][trace]") {
  // 600 tokens need ceil(600 / 512) = 2 ids; a third means input_length and hash_ids disagree.
  const std::string msg =
      parse_error("{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1, 2]}\n"
                  "{\"timestamp\": 1, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1, 2, 3]}\n");
  CHECK(msg.starts_with("t.jsonl:2: hash_ids has 3 entries, 1 more than input_length"));
  CHECK(parse_error("{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [9]}\n").empty());
}

TEST_CASE("parse_trace: a line past the cap is refused after reading the cap, naming the line", "[replay][trace]") {
  // No line break at all (what /dev/zero or a binary file gives): refused once kMaxTraceLineBytes were read.
  std::string text = "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n";
  text.append(replay::kMaxTraceLineBytes + 10, 'x');
  const std::string msg = parse_error(text);
  CHECK(msg.starts_with("t.jsonl:2: line longer than " + std::to_string(replay::kMaxTraceLineBytes) + " bytes"));
  // A line exactly at the cap is read (and then judged on its content).
  std::string at_cap = "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}";
  at_cap.append(replay::kMaxTraceLineBytes - at_cap.size(), ' ');
  CHECK(parse_error(at_cap + "\n").empty());
}
