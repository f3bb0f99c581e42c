// examples/replay/trace.cpp: trace parsing (format detection, validation with file:line errors) and prompt
// synthesis.
#include "trace.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <istream>
#include <limits>
#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>

namespace replay {
namespace {

// Mooncake ids are multiplied by 512 and must stay clear of the Azure / generated-token domain bits (62, 63).
constexpr std::uint64_t kMaxHashId = std::uint64_t{1} << 50;
// Request indices occupy bits 32..61 of the Azure / generated-token keys.
constexpr std::size_t kMaxRequests = std::size_t{1} << 30;

[[noreturn]] void fail(const std::filesystem::path& path, std::size_t line, const std::string& what) {
  throw TraceError(path.string() + ":" + std::to_string(line) + ": " + what);
}

std::string_view trim(std::string_view s) {
  const auto first = s.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos) return {};
  const auto last = s.find_last_not_of(" \t\r\n");
  return s.substr(first, last - first + 1);
}

// `s` for a message, quoted, at most 40 characters of it (a malformed line can be megabytes long).
std::string quote(std::string_view s) {
  constexpr std::size_t kMax = 40;
  if (s.size() <= kMax) return "\"" + std::string(s) + "\"";
  return "\"" + std::string(s.substr(0, kMax)) + "...\" (" + std::to_string(s.size()) + " characters)";
}

// A JSON value for a message: numbers, booleans and null as written, anything else by type (and, for a string,
// quoted and cut). Never serializes a whole nested value.
std::string describe(const nlohmann::json& v) {
  if (v.is_number() || v.is_boolean() || v.is_null()) return v.dump();
  if (v.is_string()) return "the string " + quote(v.get_ref<const std::string&>());
  return std::string("a JSON ") + v.type_name() + " (size " + std::to_string(v.size()) + ")";
}

// Parse all of `s` as an unsigned integer of type T.
template <class T>
bool parse_uint(std::string_view s, T& out) {
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc{} && ptr == s.data() + s.size();
}

std::vector<std::string_view> split_csv(std::string_view line) {
  std::vector<std::string_view> fields;
  std::size_t start = 0;
  while (true) {
    const auto comma = line.find(',', start);
    fields.push_back(trim(line.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start)));
    if (comma == std::string_view::npos) return fields;
    start = comma + 1;
  }
}

// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's days_from_civil).
std::int64_t days_from_civil(std::int64_t y, unsigned m, unsigned d) {
  y -= m <= 2 ? 1 : 0;
  const std::int64_t era = (y >= 0 ? y : y - 399) / 400;
  const auto yoe = static_cast<unsigned>(y - era * 400);
  const unsigned doy = (153 * (m > 2 ? m - 3 : m + 9) + 2) / 5 + d - 1;
  const unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + static_cast<std::int64_t>(doe) - 719468;
}

// "YYYY-MM-DD HH:MM:SS[.f...]" -> milliseconds since the Unix epoch; nullopt if malformed.
std::optional<double> parse_azure_timestamp(std::string_view s) {
  if (s.size() < 19 || s[4] != '-' || s[7] != '-' || s[10] != ' ' || s[13] != ':' || s[16] != ':') {
    return std::nullopt;
  }
  unsigned year = 0, month = 0, day = 0, hour = 0, minute = 0, second = 0;
  if (!parse_uint(s.substr(0, 4), year) || !parse_uint(s.substr(5, 2), month) || !parse_uint(s.substr(8, 2), day) ||
      !parse_uint(s.substr(11, 2), hour) || !parse_uint(s.substr(14, 2), minute) ||
      !parse_uint(s.substr(17, 2), second)) {
    return std::nullopt;
  }
  if (month < 1 || month > 12 || day < 1 || day > 31 || hour > 23 || minute > 59 || second > 60) return std::nullopt;
  double fraction = 0.0;
  if (s.size() > 19) {
    if (s[19] != '.' || s.size() == 20) return std::nullopt;
    double scale = 0.1;
    for (const char c : s.substr(20)) {
      if (c < '0' || c > '9') return std::nullopt;
      fraction += (c - '0') * scale;
      scale /= 10;
    }
  }
  const double seconds = static_cast<double>(days_from_civil(year, month, day)) * 86400.0 + hour * 3600.0 +
                         minute * 60.0 + second + fraction;
  return seconds * 1000.0;
}

// A non-negative integer member `key` of JSON object `obj` that fits T.
template <class T>
T json_uint(const nlohmann::json& obj, const char* key, const std::filesystem::path& path, std::size_t line) {
  const auto it = obj.find(key);
  if (it == obj.end()) fail(path, line, std::string("missing field \"") + key + "\"");
  if (!it->is_number_unsigned()) {
    fail(path, line, std::string("field \"") + key + "\" must be a non-negative integer, got " + describe(*it));
  }
  const auto v = it->get<std::uint64_t>();
  if (v > std::numeric_limits<T>::max()) {
    fail(path, line, std::string("field \"") + key + "\" is too large: " + it->dump() + " > " +
                         std::to_string(std::numeric_limits<T>::max()));
  }
  return static_cast<T>(v);
}

Request parse_mooncake_line(std::string_view text, const std::filesystem::path& path, std::size_t line) {
  nlohmann::json obj;
  try {
    obj = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for a number overflow (1e400)
    fail(path, line, "invalid JSON: " + std::string(e.what()).substr(0, 200));
  }
  if (!obj.is_object()) fail(path, line, "expected a JSON object, got " + std::string(obj.type_name()));
  Request r;
  const auto ts = obj.find("timestamp");
  if (ts == obj.end()) fail(path, line, "missing field \"timestamp\"");
  if (!ts->is_number() || ts->get<double>() < 0) {
    fail(path, line, "field \"timestamp\" must be a non-negative number (ms), got " + describe(*ts));
  }
  r.arrival_ms = ts->get<double>();
  r.input_tokens = json_uint<std::uint32_t>(obj, "input_length", path, line);
  r.output_tokens = json_uint<std::uint32_t>(obj, "output_length", path, line);
  if (r.input_tokens == 0) fail(path, line, "input_length is 0 (a prompt needs at least one token)");
  const auto ids = obj.find("hash_ids");
  if (ids == obj.end()) fail(path, line, "missing field \"hash_ids\"");
  if (!ids->is_array()) fail(path, line, "field \"hash_ids\" must be an array, got " + std::string(ids->type_name()));
  r.hash_ids.reserve(ids->size());
  for (const auto& id : *ids) {
    if (!id.is_number_unsigned() || id.get<std::uint64_t>() >= kMaxHashId) {
      fail(path, line, "hash_ids entries must be integers in [0, 2^50), got " + describe(id));
    }
    r.hash_ids.push_back(id.get<std::uint64_t>());
  }
  const std::size_t needed = (r.input_tokens + kMooncakeBlockTokens - 1) / kMooncakeBlockTokens;
  if (r.hash_ids.size() < needed) {
    fail(path, line, "hash_ids has " + std::to_string(r.hash_ids.size()) + " entries, input_length " +
                         std::to_string(r.input_tokens) + " needs ceil(input_length / 512) = " + std::to_string(needed));
  }
  if (r.hash_ids.size() > needed) {  // refused, not ignored: see load_trace's documentation
    fail(path, line, "hash_ids has " + std::to_string(r.hash_ids.size()) + " entries, " +
                         std::to_string(r.hash_ids.size() - needed) + " more than input_length " +
                         std::to_string(r.input_tokens) + " covers (ceil(input_length / 512) = " +
                         std::to_string(needed) + "): were its ids hashed over blocks of another size than 512 "
                         "tokens?");
  }
  return r;
}

struct AzureColumns {
  std::size_t num_fields = 0;
  std::size_t timestamp = 0;
  std::size_t context = 0;
  std::size_t generated = 0;
};

std::optional<AzureColumns> parse_azure_header(std::string_view header) {
  const auto fields = split_csv(header);
  AzureColumns c;
  c.num_fields = fields.size();
  bool ts = false, ctx = false, gen = false;
  for (std::size_t i = 0; i < fields.size(); ++i) {
    if (fields[i] == "TIMESTAMP") c.timestamp = i, ts = true;
    if (fields[i] == "ContextTokens") c.context = i, ctx = true;
    if (fields[i] == "GeneratedTokens") c.generated = i, gen = true;
  }
  if (!(ts && ctx && gen)) return std::nullopt;
  return c;
}

Request parse_azure_line(std::string_view text, const AzureColumns& cols, const std::filesystem::path& path,
                         std::size_t line) {
  const auto fields = split_csv(text);
  if (fields.size() != cols.num_fields) {
    fail(path, line, "expected " + std::to_string(cols.num_fields) + " comma-separated fields, got " +
                         std::to_string(fields.size()));
  }
  Request r;
  const auto ms = parse_azure_timestamp(fields[cols.timestamp]);
  if (!ms) {
    fail(path, line, "TIMESTAMP " + quote(fields[cols.timestamp]) + " is not of the form YYYY-MM-DD HH:MM:SS.fffffff");
  }
  r.arrival_ms = *ms;
  if (!parse_uint(fields[cols.context], r.input_tokens)) {
    fail(path, line, "ContextTokens " + quote(fields[cols.context]) + " is not an integer in [0, 2^32)");
  }
  if (!parse_uint(fields[cols.generated], r.output_tokens)) {
    fail(path, line, "GeneratedTokens " + quote(fields[cols.generated]) + " is not an integer in [0, 2^32)");
  }
  if (r.input_tokens == 0) fail(path, line, "ContextTokens is 0 (a prompt needs at least one token)");
  return r;
}

enum class LineRead { kLine, kEnd, kTooLong };

// The next line of `in` into `out`, without its '\n': kLine, kEnd at the end of the input (nothing read), or
// kTooLong once kMaxTraceLineBytes bytes were read without a '\n' (the rest of the line is left unread, so an
// endless input such as /dev/zero is refused after reading the cap, in bounded memory). A read error (a directory
// opened as a file, EIO) throws TraceError naming the file and `line_number`.
LineRead read_line(std::istream& in, std::string& out, const std::filesystem::path& path, std::size_t line_number) {
  out.clear();
  std::streambuf* buf = in.rdbuf();
  if (buf == nullptr) throw TraceError(path.string() + ": no stream to read");
  try {
    for (;;) {
      const int c = buf->sbumpc();  // libstdc++'s filebuf throws std::ios_base::failure on a read error
      if (c == std::char_traits<char>::eof()) {
        in.setstate(std::ios::eofbit);
        return out.empty() ? LineRead::kEnd : LineRead::kLine;  // a last line without '\n' is a line
      }
      if (c == '\n') return LineRead::kLine;
      if (out.size() == kMaxTraceLineBytes) return LineRead::kTooLong;
      out.push_back(static_cast<char>(c));
    }
  } catch (const std::exception& e) {
    fail(path, line_number, std::string("read error: ") + e.what());
  }
}

}  // namespace

const char* to_string(TraceFormat format) noexcept {
  switch (format) {
    case TraceFormat::kMooncakeJsonl: return "mooncake-jsonl";
    case TraceFormat::kAzureCsv: return "azure-csv";
  }
  return "unknown";
}

std::size_t Trace::max_total_tokens() const noexcept {
  std::size_t m = 0;
  for (const Request& r : requests) m = std::max<std::size_t>(m, std::size_t{r.input_tokens} + r.output_tokens);
  return m;
}

std::uint64_t Trace::total_input_tokens() const noexcept {
  std::uint64_t s = 0;
  for (const Request& r : requests) s += r.input_tokens;
  return s;
}

Trace load_trace(const std::filesystem::path& path, std::size_t limit) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw TraceError(path.string() + ": is a directory, not a trace file");
  }
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw TraceError(path.string() + ": cannot open the trace file" +
                     (errno != 0 ? std::string(": ") + std::strerror(errno) : std::string()));
  }
  return parse_trace(in, path, limit);
}

Trace parse_trace(std::istream& in, const std::filesystem::path& path, std::size_t limit) {
  Trace trace;
  trace.path = path;
  std::optional<AzureColumns> azure;
  bool detected = false;
  double first_ms = 0.0;
  double previous_ms = 0.0;
  std::string raw;
  std::size_t line = 0;
  while (limit == 0 || trace.requests.size() < limit) {
    const LineRead got = read_line(in, raw, path, line + 1);
    if (got == LineRead::kEnd) break;
    ++line;
    if (got == LineRead::kTooLong) {
      fail(path, line, "line longer than " + std::to_string(kMaxTraceLineBytes) + " bytes (" +
                           std::to_string(kMaxTraceLineBytes >> 20) + " MiB, the cap on a trace line): not a " +
                           "trace file?");
    }
    const std::string_view text = trim(raw);
    if (text.empty()) continue;
    if (!detected) {
      detected = true;
      if (text.front() == '{') {
        trace.format = TraceFormat::kMooncakeJsonl;
      } else if ((azure = parse_azure_header(text))) {
        trace.format = TraceFormat::kAzureCsv;
        continue;
      } else {
        fail(path, line, "unrecognised trace format: expected a Mooncake JSON object per line "
                         "({\"timestamp\": ..., \"input_length\": ..., \"output_length\": ..., \"hash_ids\": [...]}) "
                         "or an Azure CSV header with TIMESTAMP, ContextTokens, GeneratedTokens");
      }
    }
    Request r = trace.format == TraceFormat::kMooncakeJsonl ? parse_mooncake_line(text, path, line)
                                                            : parse_azure_line(text, *azure, path, line);
    if (trace.requests.empty()) first_ms = r.arrival_ms;
    if (!trace.requests.empty() && r.arrival_ms < previous_ms) {
      fail(path, line, "timestamps must not decrease (this request arrives before the previous one)");
    }
    previous_ms = r.arrival_ms;
    r.arrival_ms -= first_ms;
    if (trace.requests.size() == kMaxRequests) fail(path, line, "more than 2^30 requests");
    trace.requests.push_back(std::move(r));
  }
  if (trace.requests.empty()) throw TraceError(path.string() + ": the trace holds no requests");
  return trace;
}

namespace {

// The first "<key> <n> kB" value of /proc/meminfo in bytes, or nullopt.
std::optional<std::uint64_t> meminfo_bytes(const char* key) {
  std::ifstream in("/proc/meminfo");
  std::string name, unit;
  std::uint64_t kib = 0;
  while (in >> name >> kib) {
    std::getline(in, unit);
    if (name == key) return kib * 1024;
  }
  return std::nullopt;
}

// A cgroup v2 file holding one number ("max" = no limit), or nullopt.
std::optional<std::uint64_t> cgroup_value(const char* file) {
  std::ifstream in(std::string("/sys/fs/cgroup/") + file);
  std::string v;
  if (!(in >> v) || v == "max") return std::nullopt;
  std::uint64_t n = 0;
  if (!parse_uint(std::string_view(v), n)) return std::nullopt;
  return n;
}

std::string gib(std::uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

}  // namespace

std::uint64_t host_memory_available_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  const std::uint64_t physical = pages > 0 && page_size > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page_size)
                                                            : std::numeric_limits<std::uint64_t>::max();
  std::uint64_t avail = meminfo_bytes("MemAvailable:").value_or(physical);
  for (const int resource : {RLIMIT_AS, RLIMIT_DATA}) {
    rlimit lim{};
    if (getrlimit(resource, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
      avail = std::min<std::uint64_t>(avail, lim.rlim_cur);
    }
  }
  if (const auto max = cgroup_value("memory.max")) {
    const std::uint64_t used = cgroup_value("memory.current").value_or(0);
    avail = std::min(avail, *max > used ? *max - used : 0);
  }
  return avail != 0 ? avail : physical;
}

void check_host_memory(std::uint64_t needed_bytes, std::uint64_t available_bytes, const std::string& what,
                       const std::string& hint) {
  if (needed_bytes <= available_bytes) return;
  throw MemoryError(what + " needs about " + gib(needed_bytes) + " of host memory, but only " +
                          gib(available_bytes) + " are available (" + hint + ")");
}

LongestRequest longest_request(const Trace& trace) noexcept {
  LongestRequest l;
  for (std::size_t i = 0; i < trace.requests.size(); ++i) {
    const std::uint64_t t = std::uint64_t{trace.requests[i].input_tokens} + trace.requests[i].output_tokens;
    if (t > l.tokens) l = {i, t};
  }
  return l;
}

void synthesize_prompt(const Trace& trace, std::size_t index, std::vector<pagedkv::TokenId>& out) {
  const Request& r = trace.requests[index];
  out.resize(r.input_tokens);
  if (trace.format == TraceFormat::kMooncakeJsonl) {
    for (std::size_t pos = 0; pos < out.size(); ++pos) {
      out[pos] = mooncake_token(r.hash_ids[pos / kMooncakeBlockTokens], pos % kMooncakeBlockTokens);
    }
    return;
  }
  const std::uint64_t base = (std::uint64_t{1} << 63) | (static_cast<std::uint64_t>(index) << 32);
  for (std::size_t pos = 0; pos < out.size(); ++pos) {
    out[pos] = static_cast<pagedkv::TokenId>(splitmix64(base | pos) & 0x7fffffffULL);
  }
}

}  // namespace replay
