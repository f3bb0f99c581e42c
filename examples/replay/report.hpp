// examples/replay/report.hpp: result rows (printed as an aligned table or as JSON lines), the library-time
// stopwatch, and the progress line.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace replay {

/// One named figure of a result row: an integer, a real (printed with `decimals` in tables, full precision in
/// JSON), or a string.
struct Field {
  std::string name;
  std::variant<std::int64_t, double, std::string> value;
  int decimals = 0;
};

/// The results of one configuration (one table row, one JSON object), fields in column order.
class Row {
 public:
  /// Append an integer field.
  template <std::integral T>
  Row& add(std::string name, T value) {
    return add_integer(std::move(name), static_cast<std::int64_t>(value));
  }
  /// Append a real field, shown with `decimals` digits after the point in tables.
  Row& add(std::string name, double value, int decimals);
  /// Append a string field.
  Row& add(std::string name, std::string value);
  Row& add(std::string name, const char* value) { return add(std::move(name), std::string(value)); }

  [[nodiscard]] const std::vector<Field>& fields() const noexcept { return fields_; }

 private:
  Row& add_integer(std::string name, std::int64_t value);
  std::vector<Field> fields_;
};

/// Print `rows` as an aligned table: one header line (the union of field names, in first-seen order), then one
/// line per row; numbers right-aligned, strings left-aligned, "-" where a row lacks a field.
void print_table(std::ostream& out, const std::vector<Row>& rows);

/// Print `rows` as JSON Lines: one compact object per row, fields in order, reals at full precision.
void print_json_lines(std::ostream& out, const std::vector<Row>& rows);

/// Accumulates the wall time spent inside library calls (std::chrono::steady_clock). Wrap each call, or each
/// batch of calls with no other work between them, in `measure` or a start()/stop() pair; never wrap trace
/// parsing or token synthesis.
class LibraryTimer {
 public:
  using clock = std::chrono::steady_clock;

  void start() noexcept { started_ = clock::now(); }
  void stop() noexcept { total_ += clock::now() - started_; }
  /// Run `f()` on the clock and return its result.
  template <class F>
  decltype(auto) measure(F&& f) {
    start();
    if constexpr (std::is_void_v<std::invoke_result_t<F&>>) {
      f();
      stop();
    } else {
      decltype(auto) result = f();
      stop();
      return result;
    }
  }
  /// Seconds accumulated so far.
  [[nodiscard]] double seconds() const noexcept { return std::chrono::duration<double>(total_).count(); }

 private:
  clock::time_point started_{};
  clock::duration total_{};
};

/// A one-line progress report on stderr, rewritten in place with '\r'. Silent for the first second (short runs
/// print nothing) and when disabled; updates at most ten times a second; erased by `finish()` or the destructor.
class Progress {
 public:
  /// `label` names the work (e.g. "prefix synthetic_trace"); `total` is the number of units (requests).
  Progress(std::string label, std::size_t total, bool enabled);
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  ~Progress() { finish(); }

  /// Report `done` units finished. Cheap when nothing is printed: one clock read.
  void update(std::size_t done);
  /// Erase the line if one was printed.
  void finish();

 private:
  std::string label_;
  std::size_t total_;
  bool enabled_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point begin_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace replay
