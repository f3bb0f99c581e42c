// examples/replay/report.cpp: table and JSON-lines printing, progress line.
#include "report.hpp"

#include <algorithm>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace replay {

Row& Row::add_integer(std::string name, std::int64_t value) {
  fields_.push_back({std::move(name), value, 0});
  return *this;
}

Row& Row::add(std::string name, double value, int decimals) {
  fields_.push_back({std::move(name), value, decimals});
  return *this;
}

Row& Row::add(std::string name, std::string value) {
  fields_.push_back({std::move(name), std::move(value), 0});
  return *this;
}

namespace {

std::string format_cell(const Field& f) {
  if (const auto* i = std::get_if<std::int64_t>(&f.value)) return std::to_string(*i);
  if (const auto* d = std::get_if<double>(&f.value)) {
    std::ostringstream s;
    s << std::fixed << std::setprecision(f.decimals) << *d;
    return s.str();
  }
  return std::get<std::string>(f.value);
}

}  // namespace

void print_table(std::ostream& out, const std::vector<Row>& rows) {
  // Columns: the union of field names in first-seen order; whether a column holds strings (left-aligned).
  std::vector<std::string> names;
  std::vector<bool> is_text;
  for (const Row& r : rows) {
    for (const Field& f : r.fields()) {
      if (std::find(names.begin(), names.end(), f.name) == names.end()) {
        names.push_back(f.name);
        is_text.push_back(std::holds_alternative<std::string>(f.value));
      }
    }
  }
  std::vector<std::vector<std::string>> cells(rows.size(), std::vector<std::string>(names.size(), "-"));
  std::vector<std::size_t> width(names.size());
  for (std::size_t c = 0; c < names.size(); ++c) width[c] = names[c].size();
  for (std::size_t r = 0; r < rows.size(); ++r) {
    for (const Field& f : rows[r].fields()) {
      const auto c = static_cast<std::size_t>(std::find(names.begin(), names.end(), f.name) - names.begin());
      cells[r][c] = format_cell(f);
      width[c] = std::max(width[c], cells[r][c].size());
    }
  }
  const auto print_line = [&](const std::vector<std::string>& line) {
    for (std::size_t c = 0; c < line.size(); ++c) {
      if (c > 0) out << "  ";
      out << (is_text[c] ? std::left : std::right) << std::setw(static_cast<int>(width[c])) << line[c];
    }
    out << std::right << '\n';
  };
  print_line(names);
  for (const auto& line : cells) print_line(line);
  out.flush();
}

void print_json_lines(std::ostream& out, const std::vector<Row>& rows) {
  for (const Row& r : rows) {
    nlohmann::ordered_json obj = nlohmann::ordered_json::object();
    for (const Field& f : r.fields()) {
      std::visit([&](const auto& v) { obj[f.name] = v; }, f.value);
    }
    out << obj.dump() << '\n';
  }
  out.flush();
}

Progress::Progress(std::string label, std::size_t total, bool enabled)
    : label_(std::move(label)),
      total_(total),
      enabled_(enabled),
      begin_(std::chrono::steady_clock::now()),
      last_(begin_) {}

void Progress::update(std::size_t done) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (now - begin_ < std::chrono::seconds(1) || now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  shown_ = true;
  const double elapsed = std::chrono::duration<double>(now - begin_).count();
  const double percent = total_ == 0 ? 100.0 : 100.0 * static_cast<double>(done) / static_cast<double>(total_);
  std::fprintf(stderr, "\r%s: %zu/%zu requests (%.1f%%), %.1f s", label_.c_str(), done, total_, percent, elapsed);
  std::fflush(stderr);
}

void Progress::finish() {
  if (!shown_) return;
  shown_ = false;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
}

}  // namespace replay
