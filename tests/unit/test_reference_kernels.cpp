// Tests of the CPU reference kernels (pagedkv/reference/*.hpp) against a float64 oracle written here.
//
// Method (docs/contract.md sec. 4): random inputs (never zero: magnitudes in [0.1, 1], random sign); page tables drawn as
// a random permutation of a pool larger than needed, with two sequences sharing their first full blocks; every
// slot of every page that no sequence uses (and block 0, the null block that pads padded tables) is NaN, so a
// kernel that reads past a sequence's length returns NaN and fails. Outputs are pre-filled with NaN so an unwritten
// element fails too. The oracle gathers each sequence's K/V token by token from the pages with its own address
// arithmetic (not KVPoolView::offset) and computes attention in double.
//
// Tolerances: err = max_i |x_i - ref_i| / max(max_i |ref_i|, 1e-30) over a whole output tensor (o of one run);
// err <= 1e-5 for fp32 and <= 1e-2 for fp16 / bf16 (o is rounded to its dtype once). lse is float32 for every
// dtype and is held to max_i |lse_i - ref_i| / max(max_i |ref_i|, 1) <= 1e-5. Any NaN / inf in an output (other
// than the documented lse = -inf of an empty sequence) fails.
//
// Grid (2 kv heads throughout; group 1 / 4 / 8 = 2 / 8 / 16 query heads; layouts: NHD, HND, separate NHD,
// separate HND, and NHD with gaps between heads, tokens, K/V and pages):
//  - decode, one TEST_CASE per dtype (fp32, fp16, bf16): group {1,4,8} x head_dim {64,128,256} x block_size
//    {1,8,16,32,64} = 45 runs each. A run has 5 sequences of 0, 1, k*block_size (<= 128), 200..300 and 2..100
//    tokens (shuffled), and checks CSR and padded tables, each with split-KV off and on (chunk 5..80 tokens,
//    max_num_chunks = needed + 0..2) and with a random length-aware plan (plan_decode on a small random "device",
//    random head tile, executed through decode(p, work_list)), against the oracle and split against no split. The layout is cycled over the
//    runs (each layout meets every value of every other axis); fp16 / group 1 / head_dim 64 runs all 5 layouts.
//  - decode at batch 65 and 256 (fp16 / bf16): ragged lengths through plan_decode's plan for a 132-SM device, every
//    row element by element against the float64 bound of attention_check.hpp, CSR and padded.
//  - prefill: dtype x group x block_size = 45 runs, head_dim and layout cycled. 5 sequences: prefix 0 (q_len =
//    kv_len in 1..24), prefix > 0 with one query (kv 25..100), prefix > 0 with q_len 1..min(kv - 1, 24) (kv
//    2..100), kv 1..60 with no query, and an empty one; CSR and padded tables.
//  - write_kv: dtype x block_size x layout = 75 runs (head_dim drawn from 64/128/256; key/value rows contiguous
//    or with a padded row stride; ~1/4 of slots -1). copy_blocks: dtype x layout = 15 runs, 3 layers.
//    swap_blocks: dtype x layout x direction = 30 runs, 2 layers, dst pool in the next layout (other strides).
//  - validation: every rejected launch returns the expected Status and leaves outputs / pools bitwise unchanged.
//  - local attention ([window]: sliding window W / chunked-local C, AttentionWindow): decode and prefill, dtype x
//    block size {1, 8, 16, 32} x 7 window cases = 84 runs each (edges inside a block and on block boundaries, W = 1,
//    W above every length, C a block multiple or not, W and C together), group / head_dim {32, 64, 128} / layout
//    cycled; pages wholly before the window are the null block 0 (CSR) or ids outside the pool (padded); decode in 4
//    modes (no split, chunk rule with masked chunks, window-aware plan, window-unaware plan); the oracle's window
//    comes from the definition by brute force. Plus first_visible vs brute force, an fp8 pool with windows, and
//    window validation.
//
// Seeds: each run draws a fresh seed (printed on failure via CAPTURE); PAGEDKV_TEST_SEED=<n> pins every run to n.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <pagedkv/reference/all.hpp>
#include <pagedkv/reference/attention_check.hpp>

namespace {

namespace ref = pagedkv::reference;
using pagedkv::DecodeParams;
using pagedkv::DType;
using pagedkv::KVPoolView;
using pagedkv::PageTable;
using pagedkv::PageTableFormat;
using pagedkv::PrefillParams;
using pagedkv::Status;

#define REQUIRE_STATUS(expr, want) REQUIRE(std::string(pagedkv::to_string(expr)) == pagedkv::to_string(want))
#define CHECK_STATUS(expr, want) CHECK(std::string(pagedkv::to_string(expr)) == pagedkv::to_string(want))

/// A non-negative count or index as std::size_t.
constexpr std::size_t sz(std::int64_t x) { return static_cast<std::size_t>(x); }

constexpr double kInf = std::numeric_limits<double>::infinity();

// ----------------------------------------------------------------------------------------------- seeds, names

std::uint64_t fresh_seed() {
  if (const char* env = std::getenv("PAGEDKV_TEST_SEED"); env != nullptr && *env != '\0') {
    return std::strtoull(env, nullptr, 10);
  }
  static std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

std::string dtype_name(DType dt) {
  switch (dt) {
    case DType::kFloat32: return "fp32";
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
  }
  return "?";
}

double tolerance(DType dt) { return dt == DType::kFloat32 ? 1e-5 : 1e-2; }
constexpr double kLseTol = 1e-5;

/// splitmix64 (Steele, Lea, Flood 2014): a small, fast generator, plenty for test data; a
/// UniformRandomBitGenerator, so std::shuffle and the distributions accept it.
struct Rng {
  using result_type = std::uint64_t;
  std::uint64_t state;
  explicit Rng(std::uint64_t seed) : state(seed) {}
  static constexpr result_type min() { return 0; }
  static constexpr result_type max() { return ~result_type{0}; }
  result_type operator()() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
};

int uniform(Rng& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

/// A random value that is never zero: magnitude uniform in [lo, hi), random sign.
float nonzero(Rng& rng, float lo = 0.1f, float hi = 1.0f) {
  const std::uint64_t bits = rng();
  const float m = lo + (hi - lo) * static_cast<float>(bits >> 40) * 0x1p-24f;
  return (bits & 1u) != 0 ? m : -m;
}

// ----------------------------------------------------------------------------------------------- raw buffers

/// A host buffer of `elems` elements of `dtype`, 4-byte aligned, addressed through the reference's load/store.
struct Raw {
  DType dtype = DType::kFloat32;
  std::int64_t elems = 0;
  std::vector<std::uint32_t> words;

  Raw() = default;
  Raw(DType dt, std::int64_t n) : dtype(dt), elems(n) {
    const auto bytes = sz(n) * pagedkv::dtype_size_bytes(dt);
    words.assign((bytes + 3) / 4 + 1, 0u);
    fill_nan();
  }
  void* data() { return words.data(); }
  const void* data() const { return words.data(); }
  void fill_nan() {
    const std::uint32_t w = dtype == DType::kFloat32   ? 0x7fc00000u
                            : dtype == DType::kFloat16 ? 0x7e007e00u
                                                       : 0x7fc07fc0u;
    std::fill(words.begin(), words.end(), w);
  }
  void fill_random(Rng& rng, float lo = 0.1f, float hi = 1.0f) {
    for (std::int64_t i = 0; i < elems; ++i) set(i, nonzero(rng, lo, hi));
  }
  void set(std::int64_t i, float v) { ref::store(words.data(), dtype, i, v); }
  [[nodiscard]] double get(std::int64_t i) const { return ref::load(words.data(), dtype, i); }
  [[nodiscard]] std::vector<double> to_double() const {
    std::vector<double> out(sz(elems));
    for (std::int64_t i = 0; i < elems; ++i) out[i] = get(i);
    return out;
  }
};

// ----------------------------------------------------------------------------------------------- pools

enum class Layout { kNhd, kHnd, kSeparateNhd, kSeparateHnd, kStrided };
constexpr Layout kAllLayouts[] = {Layout::kNhd, Layout::kHnd, Layout::kSeparateNhd, Layout::kSeparateHnd,
                                  Layout::kStrided};

std::string layout_name(Layout l) {
  switch (l) {
    case Layout::kNhd: return "nhd";
    case Layout::kHnd: return "hnd";
    case Layout::kSeparateNhd: return "separate_nhd";
    case Layout::kSeparateHnd: return "separate_hnd";
    case Layout::kStrided: return "strided_nhd_with_gaps";
  }
  return "?";
}

/// One layer's K/V pool in host memory with the test's own address arithmetic. Interleaved layouts keep K and V
/// in `buf[0]`; separate layouts keep K in buf[0] and V in buf[1]. kStrided is NHD with gaps between heads,
/// tokens, K/V and pages (the gaps stay NaN and must never be read or written).
struct TestPool {
  Layout layout;
  DType dtype;
  int num_blocks, block_size, num_kv_heads, head_dim;
  std::int64_t sp = 0, st = 0, sh = 0;  // strides (elements), computed here independently of KVPoolView
  std::int64_t v_off = 0;               // interleaved layouts: element offset of V in buf[0]
  Raw buf[2];
  KVPoolView view;

  TestPool(Layout l, DType dt, int nb, int bs, int h, int d)
      : layout(l), dtype(dt), num_blocks(nb), block_size(bs), num_kv_heads(h), head_dim(d) {
    const std::int64_t page = std::int64_t{bs} * h * d;
    bool separate = false;
    switch (l) {
      case Layout::kNhd: sp = 2 * page, st = std::int64_t{h} * d, sh = d, v_off = page; break;
      case Layout::kHnd: sp = 2 * page, st = d, sh = std::int64_t{bs} * d, v_off = page; break;
      case Layout::kSeparateNhd: sp = page, st = std::int64_t{h} * d, sh = d, separate = true; break;
      case Layout::kSeparateHnd: sp = page, st = d, sh = std::int64_t{bs} * d, separate = true; break;
      case Layout::kStrided: {
        sh = d + 5;
        st = std::int64_t{h} * sh + 7;
        const std::int64_t span = (std::int64_t{bs} - 1) * st + (std::int64_t{h} - 1) * sh + d;
        v_off = span + 13;
        sp = 2 * span + 30;
        break;
      }
    }
    const std::int64_t elems = std::int64_t{nb} * sp + v_off + 64;
    buf[0] = Raw(dt, elems);
    if (separate) buf[1] = Raw(dt, elems);
    switch (l) {
      case Layout::kNhd: view = KVPoolView::nhd(buf[0].data(), dt, nb, bs, h, d); break;
      case Layout::kHnd: view = KVPoolView::hnd(buf[0].data(), dt, nb, bs, h, d); break;
      case Layout::kSeparateNhd: view = KVPoolView::separate_nhd(buf[0].data(), buf[1].data(), dt, nb, bs, h, d); break;
      case Layout::kSeparateHnd: view = KVPoolView::separate_hnd(buf[0].data(), buf[1].data(), dt, nb, bs, h, d); break;
      case Layout::kStrided: {
        view = KVPoolView{buf[0].data(), nullptr, dt, nb, bs, h, d, sp, st, sh};
        view.v = static_cast<char*>(buf[0].data()) + v_off * static_cast<std::int64_t>(pagedkv::dtype_size_bytes(dt));
        break;
      }
    }
  }
  TestPool(const TestPool&) = delete;
  TestPool& operator=(const TestPool&) = delete;

  [[nodiscard]] bool separate() const { return layout == Layout::kSeparateNhd || layout == Layout::kSeparateHnd; }
  Raw& raw(int kv) { return separate() ? buf[kv] : buf[0]; }
  [[nodiscard]] const Raw& raw(int kv) const { return separate() ? buf[kv] : buf[0]; }
  /// Element index of (K or V, block, token in block, head, dim) in raw(kv).
  [[nodiscard]] std::int64_t index(int kv, std::int64_t block, std::int64_t t, std::int64_t h, std::int64_t d) const {
    return (separate() ? 0 : kv * v_off) + block * sp + t * st + h * sh + d;
  }
  [[nodiscard]] double get(int kv, std::int64_t block, std::int64_t t, std::int64_t h, std::int64_t d) const {
    return raw(kv).get(index(kv, block, t, h, d));
  }
  void set(int kv, std::int64_t block, std::int64_t t, std::int64_t h, std::int64_t d, float v) {
    raw(kv).set(index(kv, block, t, h, d), v);
  }
  /// Byte images of both buffers, for "nothing else changed" checks.
  [[nodiscard]] std::vector<std::uint32_t> snapshot() const {
    std::vector<std::uint32_t> s = buf[0].words;
    s.insert(s.end(), buf[1].words.begin(), buf[1].words.end());
    return s;
  }
};

// ----------------------------------------------------------------------------------------------- page tables

/// A batch of sequences laid out in a pool: per-sequence pages, both page-table conventions.
struct PagedBatch {
  int block_size = 0;
  int num_blocks = 0;  // pool size it was drawn from (block 0 = null block, never used)
  std::vector<int> kv_lens;
  std::vector<std::vector<std::int32_t>> pages;
  std::vector<std::int32_t> indptr, indices, last_page_len;  // CSR
  std::vector<std::int32_t> block_tables, seq_lens;          // padded
  int max_blocks_per_seq = 0;

  [[nodiscard]] int batch() const { return static_cast<int>(kv_lens.size()); }
  [[nodiscard]] PageTable table(PageTableFormat f) const {
    return f == PageTableFormat::kCsr
               ? PageTable::csr(batch(), indptr.data(), indices.data(), last_page_len.data())
               : PageTable::padded(batch(), block_tables.data(), max_blocks_per_seq, seq_lens.data());
  }
};

/// Draws the pages of sequences with lengths `lens` (tokens): block ids are a random permutation of
/// [1, num_blocks) for a pool with a few spare blocks; the two sequences with the most full blocks share a random
/// number (>= 1 when both have a full block) of their first blocks (a shared prefix).
PagedBatch make_batch(Rng& rng, const std::vector<int>& lens, int block_size) {
  PagedBatch pb;
  pb.block_size = block_size;
  pb.kv_lens = lens;
  const int n = static_cast<int>(lens.size());
  std::vector<int> npages(sz(n));
  for (int b = 0; b < n; ++b) npages[b] = (lens[b] + block_size - 1) / block_size;
  // Sharing pair: the two sequences with the most full blocks.
  std::vector<int> order(sz(n));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return lens[a] > lens[b]; });
  int owner = -1, sharer = -1, shared = 0;
  if (n >= 2) {
    owner = order[0];
    sharer = order[1];
    const int full = std::min(lens[owner], lens[sharer]) / block_size;
    if (full >= 1) shared = uniform(rng, 1, full);
  }
  const int distinct = std::accumulate(npages.begin(), npages.end(), 0) - shared;
  pb.num_blocks = 1 + distinct + uniform(rng, 3, 9);
  std::vector<std::int32_t> ids(sz(pb.num_blocks - 1));
  std::iota(ids.begin(), ids.end(), 1);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::size_t next = 0;
  pb.pages.resize(sz(n));
  // The owner first, so the sharer can copy its first blocks.
  std::vector<int> fill_order;
  if (owner >= 0) fill_order.push_back(owner);
  for (int b = 0; b < n; ++b)
    if (b != owner) fill_order.push_back(b);
  for (const int b : fill_order) {
    auto& pg = pb.pages[b];
    for (int i = 0; i < npages[b]; ++i) {
      if (b == sharer && i < shared) {
        pg.push_back(pb.pages[owner][i]);
      } else {
        pg.push_back(ids[next++]);
      }
    }
  }
  // CSR.
  pb.indptr.push_back(0);
  for (int b = 0; b < n; ++b) {
    const auto& pg = pb.pages[b];
    pb.indices.insert(pb.indices.end(), pg.begin(), pg.end());
    pb.indptr.push_back(static_cast<std::int32_t>(pb.indices.size()));
    const int len = lens[b];
    pb.last_page_len.push_back(len == 0 ? 0 : len - (npages[b] - 1) * block_size);
  }
  if (pb.indices.empty()) pb.indices.push_back(0);  // keep data() non-null
  // Padded, with 0..2 extra columns of null-block padding.
  pb.max_blocks_per_seq = *std::max_element(npages.begin(), npages.end()) + uniform(rng, 0, 2);
  pb.block_tables.assign(sz(n) * sz(std::max(pb.max_blocks_per_seq, 1)), 0);
  for (int b = 0; b < n; ++b) {
    const auto& pg = pb.pages[b];
    std::copy(pg.begin(), pg.end(), pb.block_tables.begin() + static_cast<std::ptrdiff_t>(b) * pb.max_blocks_per_seq);
    pb.seq_lens.push_back(lens[b]);
  }
  return pb;
}

/// Writes random K and V for every token of every sequence (a shared block is written once); everything else in
/// the pool stays NaN.
void fill_sequences(TestPool& pool, const PagedBatch& pb, Rng& rng) {
  std::vector<char> written(sz(pool.num_blocks) * sz(pool.block_size), 0);
  for (int b = 0; b < pb.batch(); ++b) {
    for (int t = 0; t < pb.kv_lens[b]; ++t) {
      const std::int32_t block = pb.pages[b][t / pool.block_size];
      const int off = t % pool.block_size;
      char& w = written[sz(block) * sz(pool.block_size) + sz(off)];
      if (w != 0) continue;
      w = 1;
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = 0; h < pool.num_kv_heads; ++h) {
          for (int d = 0; d < pool.head_dim; ++d) pool.set(kv, block, off, h, d, nonzero(rng));
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------- the oracle

/// A sequence's first n tokens of one kv head, gathered token by token from its pages into contiguous doubles.
struct Gathered {
  int n = 0;
  int dim = 0;
  std::vector<double> k, v;  // [n, dim]
};

Gathered gather(const TestPool& pool, const std::vector<std::int32_t>& pages, int n, int kvh) {
  Gathered g{n, pool.head_dim, {}, {}};
  g.k.resize(sz(n) * sz(g.dim));
  g.v.resize(g.k.size());
  for (int t = 0; t < n; ++t) {
    const std::int32_t block = pages[t / pool.block_size];
    const std::int64_t k_row = pool.index(0, block, t % pool.block_size, kvh, 0);
    const std::int64_t v_row = pool.index(1, block, t % pool.block_size, kvh, 0);
    double* k = g.k.data() + sz(t) * sz(g.dim);
    double* v = g.v.data() + sz(t) * sz(g.dim);
    for (int d = 0; d < g.dim; ++d) {
      k[d] = pool.raw(0).get(k_row + d);
      v[d] = pool.raw(1).get(v_row + d);
    }
  }
  return g;
}

/// float64 attention of one query row against gathered tokens [begin, end) (end <= g.n). An empty range: o = 0,
/// lse = -inf.
void oracle_attend_range(const Gathered& g, int begin, int end, const double* q, double sm_scale, double* o,
                         double* lse) {
  const auto dim = sz(g.dim);
  std::fill(o, o + dim, 0.0);
  if (end <= begin) {
    *lse = -kInf;
    return;
  }
  std::vector<double> scores(sz(end - begin));
  double* s = scores.data();
  double m = -kInf;
  for (std::size_t i = 0; i < scores.size(); ++i) {
    const double* k = g.k.data() + (sz(begin) + i) * dim;
    double acc = 0;
    for (std::size_t d = 0; d < dim; ++d) acc += q[d] * k[d];
    s[i] = acc * sm_scale;
    m = std::max(m, s[i]);
  }
  double denom = 0;
  for (std::size_t i = 0; i < scores.size(); ++i) {
    const double p = std::exp(s[i] - m);
    const double* v = g.v.data() + (sz(begin) + i) * dim;
    denom += p;
    for (std::size_t d = 0; d < dim; ++d) o[d] += p * v[d];
  }
  for (std::size_t d = 0; d < dim; ++d) o[d] /= denom;
  *lse = m + std::log(denom);
}

/// float64 attention of one query row against the first n gathered tokens (n <= g.n). n == 0: o = 0, lse = -inf.
void oracle_attend(const Gathered& g, int n, const double* q, double sm_scale, double* o, double* lse) {
  oracle_attend_range(g, 0, n, q, sm_scale, o, lse);
}

// ----------------------------------------------------------------------------------------------- comparison

struct Err {
  double err = 0;  // max |x - ref| / max(max |ref|, floor)
  std::int64_t worst = -1;
  std::int64_t non_finite = -1;  // first index where x is NaN/inf though ref is finite (or they disagree on it)
};

/// Normalised max error of `got` against `want`. Elements where `want` is +-inf must match it exactly (lse of an
/// empty sequence); anywhere else `got` must be finite.
Err compare(const std::vector<double>& got, const std::vector<double>& want, double floor) {
  Err e;
  double max_ref = 0, max_diff = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i])) {
      if (got[i] != want[i] && e.non_finite < 0) e.non_finite = static_cast<std::int64_t>(i);
      continue;
    }
    if (!std::isfinite(got[i])) {
      if (e.non_finite < 0) e.non_finite = static_cast<std::int64_t>(i);
      continue;
    }
    max_ref = std::max(max_ref, std::abs(want[i]));
    const double diff = std::abs(got[i] - want[i]);
    if (diff > max_diff) {
      max_diff = diff;
      e.worst = static_cast<std::int64_t>(i);
    }
  }
  e.err = max_diff / std::max(max_ref, floor);
  return e;
}

#define CHECK_CLOSE(got, want, floor, tol)                                                    \
  do {                                                                                        \
    const Err e_ = compare((got), (want), (floor));                                           \
    INFO("max normalised error " << e_.err << " at " << e_.worst << ", tolerance " << (tol)); \
    CHECK(e_.non_finite == -1);                                                               \
    CHECK(e_.err <= (tol));                                                                   \
  } while (0)

std::vector<double> floats_to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

/// Index of the first element where two equally typed vectors differ bitwise, or -1 when they are identical
/// (sizes differing count as a difference at the shorter size). Used instead of CHECK(a == b), whose failure
/// message would print every element of two large buffers.
template <class T>
std::int64_t first_diff(const std::vector<T>& a, const std::vector<T>& b) {
  const std::size_t n = std::min(a.size(), b.size());
  for (std::size_t i = 0; i < n; ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<std::int64_t>(i);
  }
  return a.size() == b.size() ? -1 : static_cast<std::int64_t>(n);
}

// ----------------------------------------------------------------------------------------------- decode runner

struct AttnCase {
  DType dtype;
  int group;
  int head_dim;
  int block_size;
  Layout layout;
};

constexpr int kNumKvHeads = 2;

/// Decode lengths: an empty (padding) sequence, a 1-token one, an exact multiple of block_size (<= 128 tokens,
/// at least one block), a long one of 200..300 tokens and a short one of 2..100 (random lengths are rarely
/// multiples of the block size), shuffled.
std::vector<int> decode_lengths(Rng& rng, int block_size) {
  std::vector<int> lens = {0, 1, block_size * uniform(rng, 1, std::max(1, 128 / block_size)), uniform(rng, 200, 300),
                           uniform(rng, 2, 100)};
  std::shuffle(lens.begin(), lens.end(), rng);
  return lens;
}

void run_decode_case(const AttnCase& c) {
  const std::uint64_t seed = fresh_seed();
  const std::string dtype = dtype_name(c.dtype), layout = layout_name(c.layout);
  CAPTURE(seed, dtype, layout, c.group, c.head_dim, c.block_size);
  Rng rng(seed);
  const int hq = kNumKvHeads * c.group, dim = c.head_dim;
  const PagedBatch pb = make_batch(rng, decode_lengths(rng, c.block_size), c.block_size);
  const int batch = pb.batch();
  CAPTURE(pb.kv_lens);
  TestPool pool(c.layout, c.dtype, pb.num_blocks, c.block_size, kNumKvHeads, dim);
  fill_sequences(pool, pb, rng);
  const auto pool_before = pool.snapshot();
  Raw q(c.dtype, std::int64_t{batch} * hq * dim);
  q.fill_random(rng, 0.1f, 2.0f);
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(dim));

  // Oracle.
  std::vector<double> o_ref(sz(batch) * sz(hq) * sz(dim));
  std::vector<double> lse_ref(sz(batch) * sz(hq));
  const std::vector<double> qd = q.to_double();
  for (int b = 0; b < batch; ++b) {
    const int len = pb.kv_lens[b];
    for (int kvh = 0; kvh < kNumKvHeads; ++kvh) {
      const Gathered g = gather(pool, pb.pages[b], len, kvh);
      for (int h = kvh * c.group; h < (kvh + 1) * c.group; ++h) {  // the query heads of this kv head's group
        const std::size_t row = sz(b) * sz(hq) + sz(h);
        oracle_attend(g, len, qd.data() + row * sz(dim), sm_scale, o_ref.data() + row * sz(dim), &lse_ref[row]);
      }
    }
  }
  const int max_len = *std::max_element(pb.kv_lens.begin(), pb.kv_lens.end());

  for (const PageTableFormat fmt : {PageTableFormat::kCsr, PageTableFormat::kPadded}) {
    const std::string table = fmt == PageTableFormat::kCsr ? "csr" : "padded";
    CAPTURE(table);
    std::vector<double> o_by_split[2];
    for (const bool split : {false, true}) {
      CAPTURE(split);
      Raw o(c.dtype, std::int64_t{batch} * hq * dim);  // NaN-filled: every element must be written
      std::vector<float> lse(sz(batch) * sz(hq), std::numeric_limits<float>::quiet_NaN());
      DecodeParams p;
      p.q = q.data();
      p.o = o.data();
      p.lse = lse.data();
      p.kv = pool.view;
      p.pages = pb.table(fmt);
      p.num_qo_heads = hq;
      p.sm_scale = sm_scale;
      std::vector<float> ws;
      if (split) {
        // Chunks of 5..80 tokens (so long sequences split into several), a little spare chunk capacity.
        p.kv_chunk_size_tokens = uniform(rng, 5, 80);
        p.max_num_chunks =
            static_cast<std::int32_t>(ref::num_kv_chunks(max_len, p.kv_chunk_size_tokens)) + uniform(rng, 0, 2);
        p.workspace_bytes = pagedkv::decode_workspace_bytes(batch, p.max_num_chunks, hq, dim);
        ws.assign(p.workspace_bytes / sizeof(float), std::numeric_limits<float>::quiet_NaN());
        p.workspace = ws.data();
        CAPTURE(p.kv_chunk_size_tokens, p.max_num_chunks);
      }
      REQUIRE_STATUS(ref::decode(p, 2), Status::kSuccess);
      o_by_split[split ? 1 : 0] = o.to_double();
      CHECK_CLOSE(o_by_split[split ? 1 : 0], o_ref, 1e-30, tolerance(c.dtype));
      CHECK_CLOSE(floats_to_double(lse), lse_ref, 1.0, kLseTol);
      // Empty sequences: o exactly 0.
      bool empty_rows_zero = true;
      for (int b = 0; b < batch; ++b) {
        if (pb.kv_lens[b] != 0) continue;
        for (std::int64_t i = std::int64_t{b} * hq * dim; i < std::int64_t{b + 1} * hq * dim; ++i) {
          empty_rows_zero = empty_rows_zero && o.get(i) == 0.0;
        }
      }
      CHECK(empty_rows_zero);
    }
    // Split and no split agree with each other as well as with the oracle.
    double max_ref = 1e-30;
    for (const double x : o_ref) max_ref = std::max(max_ref, std::abs(x));
    const Err e = compare(o_by_split[1], o_by_split[0], max_ref);
    CHECK(e.err <= tolerance(c.dtype));

    // The length-aware plan (pagedkv/decode_plan.hpp), executed by the reference exactly as the CUDA launcher
    // executes it: a small random "device" (1..8 SMs x 1..4 CTAs, chunk floor 1..48 tokens) so these short
    // sequences are really cut, with a random query-head tile. Checks the plan's coverage and merge end to end.
    {
      pagedkv::DecodePlanConfig cfg;
      cfg.num_qo_heads = hq;
      cfg.num_kv_heads = kNumKvHeads;
      cfg.head_dim = dim;
      cfg.heads_per_tile = uniform(rng, 0, c.group);
      cfg.num_sms = uniform(rng, 1, 8);
      cfg.ctas_per_sm = uniform(rng, 1, 4);
      cfg.min_chunk_tokens = uniform(rng, 1, 48);
      cfg.item_overhead_tokens = uniform(rng, 0, 16);
      cfg.max_waves = uniform(rng, 1, 8);
      const pagedkv::DecodePlanCapacity cap = pagedkv::decode_plan_capacity(batch, cfg);
      std::vector<pagedkv::DecodeWorkItem> items(sz(cap.items));
      std::vector<pagedkv::DecodeMergeItem> merges(sz(cap.merges));
      pagedkv::DecodePlanInfo info;
      REQUIRE_STATUS(pagedkv::plan_decode(pb.seq_lens, cfg, {items, merges, cap.partial_rows}, &info),
                     Status::kSuccess);
      CAPTURE(cfg.heads_per_tile, cfg.num_sms, cfg.ctas_per_sm, cfg.min_chunk_tokens, info.num_items, info.num_merges,
              info.chunk_target_tokens);
      Raw o(c.dtype, std::int64_t{batch} * hq * dim);
      std::vector<float> lse(sz(batch) * sz(hq), std::numeric_limits<float>::quiet_NaN());
      std::vector<float> ws(info.workspace_bytes / sizeof(float) + 1, std::numeric_limits<float>::quiet_NaN());
      DecodeParams p;
      p.q = q.data();
      p.o = o.data();
      p.lse = lse.data();
      p.kv = pool.view;
      p.pages = pb.table(fmt);
      p.num_qo_heads = hq;
      p.sm_scale = sm_scale;
      p.workspace = ws.data();
      p.workspace_bytes = ws.size() * sizeof(float);
      REQUIRE_STATUS(ref::decode(p, info.work_list, 2), Status::kSuccess);
      const std::vector<double> o_plan = o.to_double();
      CHECK_CLOSE(o_plan, o_ref, 1e-30, tolerance(c.dtype));
      CHECK_CLOSE(floats_to_double(lse), lse_ref, 1.0, kLseTol);
      CHECK(compare(o_plan, o_by_split[0], max_ref).err <= tolerance(c.dtype));
    }
  }
  CHECK(first_diff(pool.snapshot(), pool_before) == -1);  // decode never writes the pool
}

// ----------------------------------------------------------------------------------------------- prefill runner

struct PrefillSeq {
  int kv_len;
  int q_len;
};

/// Prefill sequences: prefix 0 (the whole sequence is new), prefix > 0 with one new token, prefix > 0 with
/// several, a sequence with no new tokens, and an empty (padding) one; shuffled.
std::vector<PrefillSeq> prefill_lengths(Rng& rng) {
  const int a = uniform(rng, 1, 24);
  const int kv_b = uniform(rng, 25, 100);
  const int kv_c = uniform(rng, 2, 100);
  std::vector<PrefillSeq> s = {
      {a, a}, {kv_b, 1}, {kv_c, uniform(rng, 1, std::min(kv_c - 1, 24))}, {uniform(rng, 1, 60), 0}, {0, 0}};
  std::shuffle(s.begin(), s.end(), rng);
  return s;
}

void run_prefill_case(const AttnCase& c) {
  const std::uint64_t seed = fresh_seed();
  const std::string dtype = dtype_name(c.dtype), layout = layout_name(c.layout);
  CAPTURE(seed, dtype, layout, c.group, c.head_dim, c.block_size);
  Rng rng(seed);
  const int hq = kNumKvHeads * c.group, dim = c.head_dim;
  const std::vector<PrefillSeq> seqs = prefill_lengths(rng);
  std::vector<int> lens;
  std::vector<std::int32_t> qo_indptr = {0};
  for (const PrefillSeq& s : seqs) {
    lens.push_back(s.kv_len);
    qo_indptr.push_back(qo_indptr.back() + s.q_len);
  }
  CAPTURE(lens, qo_indptr);
  const PagedBatch pb = make_batch(rng, lens, c.block_size);
  const int batch = pb.batch();
  const int total_q = qo_indptr.back();
  TestPool pool(c.layout, c.dtype, pb.num_blocks, c.block_size, kNumKvHeads, dim);
  fill_sequences(pool, pb, rng);
  const auto pool_before = pool.snapshot();
  Raw q(c.dtype, std::int64_t{total_q} * hq * dim);
  q.fill_random(rng, 0.1f, 2.0f);
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(dim));

  std::vector<double> o_ref(sz(total_q) * sz(hq) * sz(dim));
  std::vector<double> lse_ref(sz(total_q) * sz(hq));
  const std::vector<double> qd = q.to_double();
  for (int b = 0; b < batch; ++b) {
    const int q_len = qo_indptr[b + 1] - qo_indptr[b];
    const int len = pb.kv_lens[b];
    for (int kvh = 0; kvh < kNumKvHeads; ++kvh) {
      const Gathered g = gather(pool, pb.pages[b], len, kvh);
      for (int i = 0; i < q_len; ++i) {
        const int pos = len - q_len + i;  // causal: query i attends to tokens [0, pos]
        for (int h = kvh * c.group; h < (kvh + 1) * c.group; ++h) {
          const std::size_t row = (sz(qo_indptr[b]) + sz(i)) * sz(hq) + sz(h);
          oracle_attend(g, pos + 1, qd.data() + row * sz(dim), sm_scale, o_ref.data() + row * sz(dim), &lse_ref[row]);
        }
      }
    }
  }

  for (const PageTableFormat fmt : {PageTableFormat::kCsr, PageTableFormat::kPadded}) {
    const std::string table = fmt == PageTableFormat::kCsr ? "csr" : "padded";
    CAPTURE(table);
    Raw o(c.dtype, std::int64_t{total_q} * hq * dim);
    std::vector<float> lse(sz(total_q) * sz(hq), std::numeric_limits<float>::quiet_NaN());
    PrefillParams p;
    p.q = q.data();
    p.o = o.data();
    p.lse = lse.data();
    p.qo_indptr = qo_indptr.data();
    p.total_q_tokens = total_q;
    p.kv = pool.view;
    p.pages = pb.table(fmt);
    p.num_qo_heads = hq;
    p.sm_scale = sm_scale;
    REQUIRE_STATUS(ref::prefill(p, 2), Status::kSuccess);
    CHECK_CLOSE(o.to_double(), o_ref, 1e-30, tolerance(c.dtype));
    CHECK_CLOSE(floats_to_double(lse), lse_ref, 1.0, kLseTol);
  }
  CHECK(first_diff(pool.snapshot(), pool_before) == -1);
}

/// Cycles the layouts over the generated grid so that every layout meets every value of every other axis.
Layout cycled_layout(int dtype_i, int group_i, int dim_i, int bs_i) {
  return kAllLayouts[(dtype_i + group_i + dim_i + bs_i) % 5];
}

int index_of(DType dt) { return static_cast<int>(dt); }
int index_of(int v, std::initializer_list<int> list) {
  return static_cast<int>(std::find(list.begin(), list.end(), v) - list.begin());
}

}  // namespace

// ================================================================================================= decode

namespace {

/// The decode grid for one dtype: group x head_dim x block_size generated (45 runs), each run checking CSR and
/// padded tables with split-KV off and on. The layout is cycled over the runs so that each layout meets every
/// value of every other axis; the fp16 / group 1 / head_dim 64 slice additionally runs all five layouts at every
/// block size. One TEST_CASE per dtype, so ctest can run them in parallel.
void decode_grid(DType dtype) {
  const int group = GENERATE(1, 4, 8);
  const int head_dim = GENERATE(64, 128, 256);
  const int block_size = GENERATE(1, 8, 16, 32, 64);
  const Layout cycled = cycled_layout(index_of(dtype), index_of(group, {1, 4, 8}), index_of(head_dim, {64, 128, 256}),
                                      index_of(block_size, {1, 8, 16, 32, 64}));
  if (dtype == DType::kFloat16 && group == 1 && head_dim == 64) {
    for (const Layout layout : kAllLayouts) run_decode_case({dtype, group, head_dim, block_size, layout});
  } else {
    run_decode_case({dtype, group, head_dim, block_size, cycled});
  }
}

}  // namespace

TEST_CASE("reference::decode matches the float64 oracle, fp32", "[reference][decode]") { decode_grid(DType::kFloat32); }
TEST_CASE("reference::decode matches the float64 oracle, fp16", "[reference][decode]") { decode_grid(DType::kFloat16); }
TEST_CASE("reference::decode matches the float64 oracle, bf16", "[reference][decode]") {
  decode_grid(DType::kBFloat16);
}

TEST_CASE("reference::decode with block sizes 512-2048 (coarse pages) matches the float64 oracle",
          "[reference][decode][block_size]") {
  // The coarse pages of KV-cache groups (docs/groups.md) reach the kernels at 512-2048 tokens per block; the grid
  // above stops at 64. Lengths: 0, 1, one whole block, 200-300 and 2-100 tokens (partial pages), every mode of
  // run_decode_case (CSR / padded, split off / on, a random plan). The GPU test family block_sizes runs them too.
  const DType dtype = GENERATE(DType::kFloat32, DType::kFloat16, DType::kBFloat16);
  const int block_size = GENERATE(512, 1024, 2048);
  run_decode_case({dtype, 4, 128, block_size, Layout::kNhd});
}

// Batches above 64 (the GPU benchmark's b256 rows are timed at this size): 65 and 256 sequences of ragged lengths
// (1..600 tokens, one of 2000..3000 that the plan splits, one empty) through plan_decode's plan for a 132-SM device
// (6 CTAs per SM, the default cost model, the tensor-core kernel's head tile = the group), CSR and padded tables,
// every (sequence, head) row held element by element to the float64 bound of attention_check.hpp (the check that
// rejects one wrong token) with the output poisoned with NaN beforehand.
TEST_CASE("reference::decode at batch 65 and 256 through plan_decode passes the per-element float64 check",
          "[reference][decode][batch]") {
  const int batch = GENERATE(65, 256);
  const DType dtype = GENERATE(DType::kFloat16, DType::kBFloat16);
  const std::uint64_t seed = fresh_seed();
  const std::string dtype_s = dtype_name(dtype);
  CAPTURE(seed, batch, dtype_s);
  Rng rng(seed);
  constexpr int kGroup = 4, dim = 64, bs = 16;
  const int hq = kNumKvHeads * kGroup;
  std::vector<int> lens(sz(batch));
  for (int& l : lens) l = uniform(rng, 1, 600);
  const int long_b = uniform(rng, 0, batch - 1);
  lens[sz(long_b)] = uniform(rng, 2000, 3000);
  lens[sz((long_b + uniform(rng, 1, batch - 1)) % batch)] = 0;  // a padding sequence
  const PagedBatch pb = make_batch(rng, lens, bs);
  const Layout layout = batch == 65 ? Layout::kNhd : Layout::kHnd;
  TestPool pool(layout, dtype, pb.num_blocks, bs, kNumKvHeads, dim);
  fill_sequences(pool, pb, rng);
  Raw q(dtype, std::int64_t{batch} * hq * dim);
  q.fill_random(rng, 0.1f, 2.0f);
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(dim));
  const std::vector<double> qd = q.to_double();
  std::vector<ref::AttentionOracleRow> want(sz(batch) * sz(hq));
  for (int b = 0; b < batch; ++b) {
    for (int kvh = 0; kvh < kNumKvHeads; ++kvh) {
      const Gathered g = gather(pool, pb.pages[b], pb.kv_lens[b], kvh);
      for (int h = kvh * kGroup; h < (kvh + 1) * kGroup; ++h) {
        const std::size_t row = sz(b) * sz(hq) + sz(h);
        want[row] = ref::attention_oracle_row(qd.data() + row * sz(dim), g.k.data(), g.v.data(), g.n, dim,
                                              static_cast<double>(sm_scale));
      }
    }
  }

  pagedkv::DecodePlanConfig cfg;
  cfg.num_qo_heads = hq;
  cfg.num_kv_heads = kNumKvHeads;
  cfg.head_dim = dim;
  cfg.heads_per_tile = kGroup;
  cfg.num_sms = 132;
  cfg.ctas_per_sm = 6;
  const pagedkv::DecodePlanCapacity cap = pagedkv::decode_plan_capacity(batch, cfg);
  std::vector<pagedkv::DecodeWorkItem> items(sz(cap.items));
  std::vector<pagedkv::DecodeMergeItem> merges(sz(cap.merges));
  pagedkv::DecodePlanInfo info;
  REQUIRE_STATUS(pagedkv::plan_decode(pb.seq_lens, cfg, {items, merges, cap.partial_rows}, &info), Status::kSuccess);
  CAPTURE(info.num_items, info.num_merges, info.chunk_target_tokens);
  CHECK(info.num_merges >= 1);  // the long sequence is split: the merge is part of what is checked
  for (const PageTableFormat fmt : {PageTableFormat::kCsr, PageTableFormat::kPadded}) {
    const std::string table = fmt == PageTableFormat::kCsr ? "csr" : "padded";
    CAPTURE(table);
    Raw o(dtype, std::int64_t{batch} * hq * dim);  // NaN-filled: every element must be written
    std::vector<float> lse(sz(batch) * sz(hq), std::numeric_limits<float>::quiet_NaN());
    std::vector<float> ws(info.workspace_bytes / sizeof(float) + 1, std::numeric_limits<float>::quiet_NaN());
    DecodeParams p;
    p.q = q.data();
    p.o = o.data();
    p.lse = lse.data();
    p.kv = pool.view;
    p.pages = pb.table(fmt);
    p.num_qo_heads = hq;
    p.sm_scale = sm_scale;
    p.workspace = ws.data();
    p.workspace_bytes = ws.size() * sizeof(float);
    REQUIRE_STATUS(ref::decode(p, info.work_list, 2), Status::kSuccess);
    const std::vector<double> od = o.to_double();
    const std::vector<float> of(od.begin(), od.end());  // exact: every value is a T
    int failed = 0;
    std::string first_why;
    for (std::size_t row = 0; row < want.size(); ++row) {
      std::string why;
      if (!ref::attention_row_ok(of.data() + row * sz(dim), lse[row], true, want[row], {dtype, 0x1p-24}, dim, &why)) {
        if (failed++ == 0) first_why = "row " + std::to_string(row) + ": " + why;
      }
    }
    INFO(failed << " of " << want.size() << " rows outside the bound; first: " << first_why);
    CHECK(failed == 0);
  }
}

TEST_CASE("reference::decode is bit-identical for every thread count", "[reference][decode][threads]") {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  Rng rng(seed);
  const int bs = 16, dim = 64, hq = 8;
  const PagedBatch pb = make_batch(rng, decode_lengths(rng, bs), bs);
  TestPool pool(Layout::kNhd, DType::kFloat32, pb.num_blocks, bs, kNumKvHeads, dim);
  fill_sequences(pool, pb, rng);
  Raw q(DType::kFloat32, std::int64_t{pb.batch()} * hq * dim);
  q.fill_random(rng);
  std::vector<std::uint32_t> first;
  std::vector<float> first_lse;
  for (const int threads : {1, 2, 3, 7, 0}) {
    CAPTURE(threads);
    Raw o(DType::kFloat32, std::int64_t{pb.batch()} * hq * dim);
    std::vector<float> lse(sz(pb.batch() * hq));
    DecodeParams p;
    p.q = q.data();
    p.o = o.data();
    p.lse = lse.data();
    p.kv = pool.view;
    p.pages = pb.table(PageTableFormat::kCsr);
    p.num_qo_heads = hq;
    p.sm_scale = 0.125f;
    REQUIRE_STATUS(ref::decode(p, threads), Status::kSuccess);
    if (first.empty()) {
      first = o.words;
      first_lse = lse;
    } else {
      CHECK(first_diff(o.words, first) == -1);
      CHECK(std::memcmp(lse.data(), first_lse.data(), lse.size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("reference::decode split-KV partials land in the documented workspace layout", "[reference][decode][split]") {
  // One sequence of 10 tokens, chunk 4: chunks [0,4) [4,8) [8,10). Each partial (o, lse) must equal a no-split decode
  // of just that chunk's tokens, which we get by running decode on a page table holding only those tokens.
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  Rng rng(seed);
  const int bs = 2, dim = 8, hq = 2, len = 10, chunk = 4, max_chunks = 4;
  const PagedBatch pb = make_batch(rng, {len}, bs);
  TestPool pool(Layout::kNhd, DType::kFloat32, pb.num_blocks, bs, kNumKvHeads, dim);
  fill_sequences(pool, pb, rng);
  Raw q(DType::kFloat32, std::int64_t{hq} * dim);
  q.fill_random(rng);
  Raw o(DType::kFloat32, std::int64_t{hq} * dim);
  std::vector<float> lse(hq);
  std::vector<float> ws(pagedkv::decode_workspace_bytes(1, max_chunks, hq, dim) / sizeof(float), -12345.f);
  DecodeParams p;
  p.q = q.data();
  p.o = o.data();
  p.lse = lse.data();
  p.kv = pool.view;
  p.pages = pb.table(PageTableFormat::kCsr);
  p.num_qo_heads = hq;
  p.sm_scale = 0.3f;
  p.kv_chunk_size_tokens = chunk;
  p.max_num_chunks = max_chunks;
  p.workspace = ws.data();
  p.workspace_bytes = ws.size() * sizeof(float);
  REQUIRE_STATUS(ref::decode(p), Status::kSuccess);
  const float* part_o = ws.data();                            // [1, max_chunks, hq, dim]
  const float* part_lse = ws.data() + max_chunks * hq * dim;  // [1, max_chunks, hq]
  for (int c = 0; c < 3; ++c) {
    // Tokens [4c, min(4c + 4, 10)) are pages [2c, 2c + 2) (block size 2, chunk 4).
    const int t0 = c * chunk, t1 = std::min(t0 + chunk, len);
    std::vector<std::int32_t> indptr = {0, (t1 - t0 + bs - 1) / bs};
    std::vector<std::int32_t> idx(pb.pages[0].begin() + t0 / bs, pb.pages[0].begin() + (t1 + bs - 1) / bs);
    std::vector<std::int32_t> last = {t1 - t0 - (indptr[1] - 1) * bs};
    Raw o_c(DType::kFloat32, std::int64_t{hq} * dim);
    std::vector<float> lse_c(hq);
    DecodeParams pc = p;
    pc.pages = PageTable::csr(1, indptr.data(), idx.data(), last.data());
    pc.o = o_c.data();
    pc.lse = lse_c.data();
    pc.kv_chunk_size_tokens = 0;
    REQUIRE_STATUS(ref::decode(pc), Status::kSuccess);
    for (int h = 0; h < hq; ++h) {
      CHECK(part_lse[c * hq + h] == lse_c[h]);
      for (int d = 0; d < dim; ++d) CHECK(part_o[(c * hq + h) * dim + d] == o_c.get(h * dim + d));
    }
  }
  // The unused chunk slot 3 is neither written nor needed.
  for (int h = 0; h < hq; ++h) CHECK(part_lse[3 * hq + h] == -12345.f);
}

TEST_CASE("reference::decode rejects bad launches and writes nothing", "[reference][decode][validation]") {
  Rng rng(7);
  const int bs = 4, dim = 16, hq = 4;
  const PagedBatch pb = make_batch(rng, {9, 3}, bs);
  TestPool pool(Layout::kNhd, DType::kFloat16, pb.num_blocks, bs, kNumKvHeads, dim);
  fill_sequences(pool, pb, rng);
  Raw q(DType::kFloat16, 2 * hq * dim);
  q.fill_random(rng);
  Raw o(DType::kFloat16, 2 * hq * dim);
  std::vector<float> lse(2 * hq, 42.f);
  std::vector<float> ws(pagedkv::decode_workspace_bytes(2, 3, hq, dim) / sizeof(float), 42.f);
  DecodeParams p;
  p.q = q.data();
  p.o = o.data();
  p.lse = lse.data();
  p.kv = pool.view;
  p.pages = pb.table(PageTableFormat::kCsr);
  p.num_qo_heads = hq;
  p.sm_scale = 0.25f;
  p.kv_chunk_size_tokens = 4;
  p.max_num_chunks = 3;
  p.workspace = ws.data();
  p.workspace_bytes = ws.size() * sizeof(float);
  REQUIRE_STATUS(ref::validate(p), Status::kSuccess);
  const auto o_before = o.words;
  const auto ws_before = ws;
  const auto lse_before = lse;
  std::vector<std::int32_t> bad_indices = pb.indices;
  std::vector<std::int32_t> bad_last = pb.last_page_len;
  std::vector<std::int32_t> bad_seq_lens;

  Status want = Status::kInvalidValue;
  int threads = 0;
  SECTION("group size: num_qo_heads % num_kv_heads != 0") { p.num_qo_heads = 3; }
  SECTION("null q") { p.q = nullptr; }
  SECTION("null o") { p.o = nullptr; }
  SECTION("null k") { p.kv.k = nullptr; }
  SECTION("head_dim 0") { p.kv.head_dim = 0; }
  SECTION("block_size 0") { p.kv.block_size = 0; }
  SECTION("negative block_size") { p.kv.block_size = -4; }
  SECTION("overlapping strides") { p.kv.stride_head = dim - 1; }
  SECTION("page stride too small") { p.kv.stride_page = std::int64_t{bs} * kNumKvHeads * dim - 1; }
  SECTION("V overlapping K") { p.kv.v = static_cast<char*>(p.kv.k) + 2; }
  SECTION("workspace too small") { p.workspace_bytes -= 4; }
  SECTION("null workspace") { p.workspace = nullptr; }
  SECTION("misaligned workspace") { p.workspace = reinterpret_cast<char*>(ws.data()) + 2; }
  SECTION("more chunks than max_num_chunks") { p.kv_chunk_size_tokens = 2; }  // 9 tokens -> 5 chunks > 3
  SECTION("negative chunk size") { p.kv_chunk_size_tokens = -1; }
  SECTION("block id out of range") {
    bad_indices[1] = pb.num_blocks;
    p.pages.indices = bad_indices.data();
  }
  SECTION("last_page_len 0 on a non-empty sequence") {
    bad_last[0] = 0;
    p.pages.last_page_len = bad_last.data();
  }
  SECTION("last_page_len > block_size") {
    bad_last[1] = bs + 1;
    p.pages.last_page_len = bad_last.data();
  }
  SECTION("padded: seq_len longer than the table row") {
    bad_seq_lens = {9, pb.max_blocks_per_seq * bs + 1};
    p.pages = PageTable::padded(2, pb.block_tables.data(), pb.max_blocks_per_seq, bad_seq_lens.data());
    CHECK_STATUS(ref::validate(p), Status::kInvalidValue);
  }
  SECTION("non-finite sm_scale") { p.sm_scale = std::numeric_limits<float>::infinity(); }
  SECTION("negative thread count") { threads = -1; }
  SECTION("dtype outside the enum is unsupported") {
    p.kv.dtype = static_cast<DType>(9);
    want = Status::kUnsupported;
  }
  CHECK_STATUS(ref::decode(p, threads), want);
  CHECK(first_diff(o.words, o_before) == -1);
  CHECK(first_diff(lse, lse_before) == -1);
  CHECK(std::memcmp(ws.data(), ws_before.data(), ws.size() * sizeof(float)) == 0);
}

TEST_CASE("reference::decode without split needs no workspace, and an all-empty batch is fine",
          "[reference][decode][validation]") {
  Rng rng(11);
  const PagedBatch pb = make_batch(rng, {0, 0, 5}, 4);
  TestPool pool(Layout::kHnd, DType::kBFloat16, pb.num_blocks, 4, 1, 32);
  fill_sequences(pool, pb, rng);
  Raw q(DType::kBFloat16, 3 * 2 * 32);
  q.fill_random(rng);
  Raw o(DType::kBFloat16, 3 * 2 * 32);
  DecodeParams p;
  p.q = q.data();
  p.o = o.data();
  p.kv = pool.view;
  p.pages = pb.table(PageTableFormat::kPadded);
  p.num_qo_heads = 2;
  p.sm_scale = 0.2f;
  REQUIRE_STATUS(ref::decode(p), Status::kSuccess);  // lse null, workspace null
  for (std::int64_t i = 0; i < 2 * 2 * 32; ++i) CHECK(o.get(i) == 0.0);
  for (std::int64_t i = 2 * 2 * 32; i < 3 * 2 * 32; ++i) CHECK(std::isfinite(o.get(i)));
  p.pages.batch_size = 0;
  p.q = nullptr;
  p.o = nullptr;
  CHECK_STATUS(ref::decode(p), Status::kSuccess);
}

// ================================================================================================= prefill

TEST_CASE("reference::prefill matches the float64 oracle (causal, prefix 0 and > 0)", "[reference][prefill]") {
  // dtype x group x block_size generated (45 runs); head_dim and layout cycled so that each head_dim and each
  // layout meets every value of every generated axis.
  const DType dtype = GENERATE(DType::kFloat32, DType::kFloat16, DType::kBFloat16);
  const int group = GENERATE(1, 4, 8);
  const int bs_i = GENERATE(0, 1, 2, 3, 4);
  const int block_size = std::array<int, 5>{1, 8, 16, 32, 64}[bs_i];
  const int dim_i = (index_of(dtype) + index_of(group, {1, 4, 8}) + bs_i) % 3;
  const int head_dim = std::array<int, 3>{64, 128, 256}[dim_i];
  run_prefill_case({dtype, group, head_dim, block_size,
                    cycled_layout(index_of(dtype), index_of(group, {1, 4, 8}), 2 * dim_i, bs_i)});
}

TEST_CASE("reference::prefill rejects bad launches and writes nothing", "[reference][prefill][validation]") {
  Rng rng(5);
  const int bs = 4, dim = 16, hq = 2;
  const PagedBatch pb = make_batch(rng, {6, 3}, bs);
  TestPool pool(Layout::kSeparateNhd, DType::kFloat32, pb.num_blocks, bs, kNumKvHeads, dim);
  fill_sequences(pool, pb, rng);
  std::vector<std::int32_t> qo_indptr = {0, 2, 5};
  Raw q(DType::kFloat32, 5 * hq * dim);
  q.fill_random(rng);
  Raw o(DType::kFloat32, 5 * hq * dim);
  std::vector<float> lse(5 * hq, 42.f);
  PrefillParams p;
  p.q = q.data();
  p.o = o.data();
  p.lse = lse.data();
  p.qo_indptr = qo_indptr.data();
  p.total_q_tokens = 5;
  p.kv = pool.view;
  p.pages = pb.table(PageTableFormat::kCsr);
  p.num_qo_heads = hq;
  p.sm_scale = 0.25f;
  REQUIRE_STATUS(ref::validate(p), Status::kSuccess);
  const auto o_before = o.words;
  const auto lse_before = lse;
  Status want = Status::kInvalidValue;
  SECTION("q_len > kv_len") {  // seq 1: 4 queries, 3 kv tokens
    qo_indptr = {0, 2, 6};
    p.total_q_tokens = 6;
  }  // seq 1: 4 queries, 3 kv tokens
  SECTION("total_q_tokens != qo_indptr[batch]") { p.total_q_tokens = 4; }
  SECTION("qo_indptr[0] != 0") { qo_indptr = {1, 2, 5}; }
  SECTION("decreasing qo_indptr") {
    qo_indptr = {0, 3, 2};
    p.total_q_tokens = 2;
  }
  SECTION("null qo_indptr") { p.qo_indptr = nullptr; }
  SECTION("null q") { p.q = nullptr; }
  SECTION("null o") { p.o = nullptr; }
  SECTION("null v") { p.kv.v = nullptr; }
  SECTION("group size") { p.num_qo_heads = 3; }
  SECTION("head_dim negative") { p.kv.head_dim = -1; }
  SECTION("NaN sm_scale") { p.sm_scale = std::numeric_limits<float>::quiet_NaN(); }
  SECTION("dtype outside the enum") {
    p.kv.dtype = static_cast<DType>(3);
    want = Status::kUnsupported;
  }
  CHECK_STATUS(ref::prefill(p), want);
  CHECK(first_diff(o.words, o_before) == -1);
  CHECK(first_diff(lse, lse_before) == -1);
}

// ================================================================================================= write_kv

TEST_CASE("reference::write_kv scatters rows by slot, skips -1, touches nothing else", "[reference][write_kv]") {
  const DType dtype = GENERATE(DType::kFloat32, DType::kFloat16, DType::kBFloat16);
  const int block_size = GENERATE(1, 8, 16, 32, 64);
  const int li = GENERATE(0, 1, 2, 3, 4);
  const Layout layout = kAllLayouts[li];
  const std::uint64_t seed = fresh_seed();
  const std::string dtype_s = dtype_name(dtype), layout_s = layout_name(layout);
  CAPTURE(seed, dtype_s, layout_s, block_size);
  Rng rng(seed);
  const int dim = std::array<int, 3>{64, 128, 256}[sz(uniform(rng, 0, 2))];
  const int heads = kNumKvHeads, num_blocks = uniform(rng, 3, 40 / std::max(1, block_size / 8) + 3);
  const int num_tokens = std::min(40, num_blocks * block_size);
  TestPool pool(layout, dtype, num_blocks, block_size, heads, dim);
  // Old content: random bits everywhere (gaps included), so any stray write shows up.
  for (Raw& r : pool.buf)
    for (auto& w : r.words) w = static_cast<std::uint32_t>(rng());
  TestPool expect(layout, dtype, num_blocks, block_size, heads, dim);
  for (int i = 0; i < 2; ++i) expect.buf[i].words = pool.buf[i].words;
  // Distinct random slots, about a quarter of them -1 (padding).
  std::vector<std::int64_t> all_slots(sz(num_blocks) * sz(block_size));
  std::iota(all_slots.begin(), all_slots.end(), 0);
  std::shuffle(all_slots.begin(), all_slots.end(), rng);
  std::vector<std::int64_t> slots(all_slots.begin(), all_slots.begin() + num_tokens);
  for (auto& s : slots)
    if (uniform(rng, 0, 3) == 0) s = -1;
  const bool padded_rows = (rng() & 1u) != 0;
  const std::int64_t stride = padded_rows ? std::int64_t{heads} * dim + 3 : 0;
  const std::int64_t row = stride != 0 ? stride : std::int64_t{heads} * dim;
  CAPTURE(padded_rows);
  Raw key(dtype, num_tokens * row), value(dtype, num_tokens * row);
  key.fill_random(rng);
  value.fill_random(rng);

  pagedkv::WriteKVParams p;
  p.key = key.data();
  p.value = value.data();
  p.stride_token_elems = stride;
  p.slot_mapping = slots.data();
  p.num_tokens = num_tokens;
  p.kv = pool.view;
  REQUIRE_STATUS(ref::write_kv(p), Status::kSuccess);

  // Expected: the old image with exactly the listed rows replaced (bitwise).
  for (int t = 0; t < num_tokens; ++t) {
    const std::int64_t s = slots[t];
    if (s < 0) continue;
    for (int h = 0; h < heads; ++h) {
      for (int d = 0; d < dim; ++d) {
        expect.set(0, s / block_size, s % block_size, h, d,
                   static_cast<float>(key.get(t * row + std::int64_t{h} * dim + d)));
        expect.set(1, s / block_size, s % block_size, h, d,
                   static_cast<float>(value.get(t * row + std::int64_t{h} * dim + d)));
      }
    }
  }
  CHECK(first_diff(pool.snapshot(), expect.snapshot()) == -1);
}

TEST_CASE("reference::write_kv rejects bad launches and writes nothing", "[reference][write_kv][validation]") {
  const int bs = 4, heads = 2, dim = 8, nb = 5;
  TestPool pool(Layout::kHnd, DType::kFloat16, nb, bs, heads, dim);
  Rng rng(3);
  for (auto& w : pool.buf[0].words) w = static_cast<std::uint32_t>(rng());
  const auto before = pool.snapshot();
  Raw key(DType::kFloat16, 3 * heads * dim), value(DType::kFloat16, 3 * heads * dim);
  key.fill_random(rng);
  value.fill_random(rng);
  std::vector<std::int64_t> slots = {0, -1, 7};
  pagedkv::WriteKVParams p;
  p.key = key.data();
  p.value = value.data();
  p.slot_mapping = slots.data();
  p.num_tokens = 3;
  p.kv = pool.view;
  REQUIRE_STATUS(ref::validate(p), Status::kSuccess);
  SECTION("slot == num_blocks * block_size (after valid ones)") { slots[2] = nb * bs; }
  SECTION("slot far out of range") { slots[2] = std::int64_t{1} << 40; }
  SECTION("null key") { p.key = nullptr; }
  SECTION("null value") { p.value = nullptr; }
  SECTION("null slot_mapping") { p.slot_mapping = nullptr; }
  SECTION("row stride shorter than a row") { p.stride_token_elems = heads * dim - 1; }
  SECTION("negative num_tokens") { p.num_tokens = -1; }
  SECTION("num_blocks 0") { p.kv.num_blocks = 0; }
  CHECK_STATUS(ref::write_kv(p), Status::kInvalidValue);
  CHECK(first_diff(pool.snapshot(), before) == -1);
}

// ================================================================================================= copy / swap

namespace {

/// Expected pool image after copying block `src` of `from` onto block `dst` of `to` (element by element through the
/// test's own indexing).
void model_copy(const TestPool& from, int src, TestPool& to, int dst) {
  for (int kv = 0; kv < 2; ++kv) {
    for (int t = 0; t < from.block_size; ++t) {
      for (int h = 0; h < from.num_kv_heads; ++h) {
        for (int d = 0; d < from.head_dim; ++d) {
          const auto& rf = from.raw(kv);
          auto& rt = to.raw(kv);
          const std::size_t es = pagedkv::dtype_size_bytes(from.dtype);
          std::memcpy(reinterpret_cast<char*>(rt.words.data()) + sz(to.index(kv, dst, t, h, d)) * es,
                      reinterpret_cast<const char*>(rf.words.data()) + sz(from.index(kv, src, t, h, d)) * es, es);
        }
      }
    }
  }
}

void randomize(TestPool& pool, Rng& rng) {
  for (Raw& r : pool.buf)
    for (auto& w : r.words) w = static_cast<std::uint32_t>(rng());
}

void copy_image(const TestPool& from, TestPool& to) {
  for (int i = 0; i < 2; ++i) to.buf[i].words = from.buf[i].words;
}

}  // namespace

TEST_CASE("reference::copy_blocks copies exactly the listed blocks of every layer", "[reference][copy_blocks]") {
  const DType dtype = GENERATE(DType::kFloat32, DType::kFloat16, DType::kBFloat16);
  const int li = GENERATE(0, 1, 2, 3, 4);
  const Layout layout = kAllLayouts[li];
  const std::uint64_t seed = fresh_seed();
  const std::string dtype_s = dtype_name(dtype), layout_s = layout_name(layout);
  CAPTURE(seed, dtype_s, layout_s);
  Rng rng(seed);
  const int nb = 24, bs = std::array<int, 3>{1, 16, 32}[sz(uniform(rng, 0, 2))], heads = 2, dim = 64;
  const int num_layers = 3;
  std::vector<std::unique_ptr<TestPool>> pools, expect;
  std::vector<KVPoolView> views;
  for (int l = 0; l < num_layers; ++l) {
    pools.push_back(std::make_unique<TestPool>(layout, dtype, nb, bs, heads, dim));
    randomize(*pools.back(), rng);
    expect.push_back(std::make_unique<TestPool>(layout, dtype, nb, bs, heads, dim));
    copy_image(*pools.back(), *expect.back());
    views.push_back(pools.back()->view);
  }
  // Six sources and six other destinations from a shuffled pool, one source copied to a second destination,
  // padding pairs (src -1, dst anything) interleaved.
  std::vector<std::int32_t> ids(nb - 1);
  std::iota(ids.begin(), ids.end(), 1);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<std::int32_t> mapping;
  for (int i = 0; i < 6; ++i) {
    mapping.insert(mapping.end(), {ids[i], ids[12 + i]});
    if (i % 2 == 0) mapping.insert(mapping.end(), {-1, ids[20]});  // padding: dst ignored
  }
  mapping.insert(mapping.end(), {ids[0], ids[18]});  // the same source to a second destination
  mapping.insert(mapping.end(), {-1, -1});
  // Shuffle the pair order (so neither end of the list is always padding).
  std::vector<std::array<std::int32_t, 2>> pairs;
  for (std::size_t i = 0; i < mapping.size(); i += 2) pairs.push_back({mapping[i], mapping[i + 1]});
  std::shuffle(pairs.begin(), pairs.end(), rng);
  mapping.clear();
  for (const auto& pr : pairs) mapping.insert(mapping.end(), {pr[0], pr[1]});
  const auto capacity = static_cast<std::int32_t>(mapping.size() / 2);
  for (int l = 0; l < num_layers; ++l) {
    for (std::int32_t i = 0; i < capacity; ++i) {
      if (mapping[2 * i] >= 0) model_copy(*pools[l], mapping[2 * i], *expect[l], mapping[2 * i + 1]);
    }
  }
  pagedkv::CopyBlocksParams p;
  p.layers = views.data();
  p.num_layers = num_layers;
  p.block_mapping = mapping.data();
  p.capacity = capacity;
  REQUIRE_STATUS(ref::copy_blocks(p), Status::kSuccess);
  for (int l = 0; l < num_layers; ++l) CHECK(first_diff(pools[l]->snapshot(), expect[l]->snapshot()) == -1);
}

TEST_CASE("reference::copy_blocks rejects bad copy lists and writes nothing", "[reference][copy_blocks][validation]") {
  Rng rng(9);
  TestPool a(Layout::kNhd, DType::kBFloat16, 8, 4, 2, 16), b(Layout::kNhd, DType::kBFloat16, 8, 4, 2, 16);
  randomize(a, rng);
  randomize(b, rng);
  const auto a0 = a.snapshot(), b0 = b.snapshot();
  std::vector<KVPoolView> views = {a.view, b.view};
  std::vector<std::int32_t> mapping = {1, 2, -1, 0, 3, 4};
  pagedkv::CopyBlocksParams p;
  p.layers = views.data();
  p.num_layers = 2;
  p.block_mapping = mapping.data();
  p.capacity = 3;
  REQUIRE_STATUS(ref::validate(p), Status::kSuccess);
  SECTION("dst out of range") { mapping[5] = 8; }
  SECTION("src out of range") { mapping[4] = 8; }
  SECTION("negative dst with a real src") { mapping[5] = -1; }
  SECTION("dst twice") { mapping[5] = 2; }
  SECTION("dst also a src") { mapping[4] = 2; }
  SECTION("layers differ in shape") { views[1].num_blocks = 7; }
  SECTION("null mapping") { p.block_mapping = nullptr; }
  SECTION("null layers") { p.layers = nullptr; }
  CHECK_STATUS(ref::copy_blocks(p), Status::kInvalidValue);
  CHECK(first_diff(a.snapshot(), a0) == -1);
  CHECK(first_diff(b.snapshot(), b0) == -1);
}

TEST_CASE("reference::swap_blocks moves exactly the listed blocks between pools", "[reference][swap_blocks]") {
  // The dst pool uses the next layout in the list (e.g. an NHD device pool swapped into an HND host pool): the
  // strides of the two sides may differ, as the CUDA launcher allows.
  const DType dtype = GENERATE(DType::kFloat32, DType::kFloat16, DType::kBFloat16);
  const int li = GENERATE(0, 1, 2, 3, 4);
  const auto direction = GENERATE(pagedkv::SwapDirection::kDeviceToHost, pagedkv::SwapDirection::kHostToDevice);
  const Layout layout = kAllLayouts[li];
  const Layout dst_layout = kAllLayouts[(li + 1) % 5];
  const std::uint64_t seed = fresh_seed();
  const std::string dtype_s = dtype_name(dtype), layout_s = layout_name(layout), dst_layout_s = layout_name(dst_layout);
  CAPTURE(seed, dtype_s, layout_s, dst_layout_s, direction == pagedkv::SwapDirection::kDeviceToHost);
  Rng rng(seed);
  const int bs = 8, heads = 2, dim = 32, num_layers = 2;
  // Device pool 12 blocks, host pool 20 blocks (sizes differ; the block shape is the same).
  const int src_nb = direction == pagedkv::SwapDirection::kDeviceToHost ? 12 : 20;
  const int dst_nb = direction == pagedkv::SwapDirection::kDeviceToHost ? 20 : 12;
  std::vector<std::unique_ptr<TestPool>> src, dst, expect;
  std::vector<KVPoolView> src_views, dst_views;
  for (int l = 0; l < num_layers; ++l) {
    src.push_back(std::make_unique<TestPool>(layout, dtype, src_nb, bs, heads, dim));
    dst.push_back(std::make_unique<TestPool>(dst_layout, dtype, dst_nb, bs, heads, dim));
    expect.push_back(std::make_unique<TestPool>(dst_layout, dtype, dst_nb, bs, heads, dim));
    randomize(*src.back(), rng);
    randomize(*dst.back(), rng);
    copy_image(*dst.back(), *expect.back());
    src_views.push_back(src.back()->view);
    dst_views.push_back(dst.back()->view);
  }
  std::vector<std::int32_t> s_ids(sz(src_nb)), d_ids(sz(dst_nb));
  std::iota(s_ids.begin(), s_ids.end(), 0);
  std::iota(d_ids.begin(), d_ids.end(), 0);
  std::shuffle(s_ids.begin(), s_ids.end(), rng);
  std::shuffle(d_ids.begin(), d_ids.end(), rng);
  std::vector<std::int32_t> mapping;
  for (std::size_t i = 0; i < 7; ++i) mapping.insert(mapping.end(), {s_ids[i], d_ids[i]});
  mapping.insert(mapping.end(), {-1, d_ids[9]});  // padding
  const auto src_before_0 = src[0]->snapshot();
  for (int l = 0; l < num_layers; ++l) {
    for (std::size_t i = 0; i < mapping.size(); i += 2) {
      if (mapping[i] >= 0) model_copy(*src[l], mapping[i], *expect[l], mapping[i + 1]);
    }
  }
  pagedkv::SwapBlocksParams p;
  p.src_layers = src_views.data();
  p.dst_layers = dst_views.data();
  p.num_layers = num_layers;
  p.block_mapping = mapping.data();
  p.num_pairs = static_cast<std::int32_t>(mapping.size() / 2);
  p.direction = direction;
  REQUIRE_STATUS(ref::swap_blocks(p), Status::kSuccess);
  for (int l = 0; l < num_layers; ++l) CHECK(first_diff(dst[l]->snapshot(), expect[l]->snapshot()) == -1);
  CHECK(first_diff(src[0]->snapshot(), src_before_0) == -1);
}

TEST_CASE("reference::swap_blocks rejects bad launches and writes nothing", "[reference][swap_blocks][validation]") {
  Rng rng(13);
  TestPool dev(Layout::kHnd, DType::kFloat16, 6, 4, 2, 16), host(Layout::kHnd, DType::kFloat16, 10, 4, 2, 16);
  randomize(dev, rng);
  randomize(host, rng);
  const auto dev0 = dev.snapshot(), host0 = host.snapshot();
  KVPoolView src = dev.view, dst = host.view;
  std::vector<std::int32_t> mapping = {1, 9, 5, 0};
  pagedkv::SwapBlocksParams p;
  p.src_layers = &src;
  p.dst_layers = &dst;
  p.num_layers = 1;
  p.block_mapping = mapping.data();
  p.num_pairs = 2;
  REQUIRE_STATUS(ref::validate(p), Status::kSuccess);
  Status want = Status::kInvalidValue;
  SECTION("src out of range of the src pool") { mapping[2] = 6; }
  SECTION("dst out of range of the dst pool") { mapping[1] = 10; }
  SECTION("dst twice") { mapping[3] = 9; }
  SECTION("different block shape") { dst.head_dim = 8; }
  SECTION("different dtype") { dst.dtype = DType::kBFloat16; }
  SECTION("bad direction") { p.direction = static_cast<pagedkv::SwapDirection>(2); }
  SECTION("null dst layers") { p.dst_layers = nullptr; }
  SECTION("dtype outside the enum") {
    src.dtype = dst.dtype = static_cast<DType>(7);
    want = Status::kUnsupported;
  }
  CHECK_STATUS(ref::swap_blocks(p), want);
  CHECK(first_diff(dev.snapshot(), dev0) == -1);
  CHECK(first_diff(host.snapshot(), host0) == -1);
}

// ================================================================================================= local attention
// Sliding windows and chunked-local attention (AttentionWindow): decode and prefill against the float64 oracle over
// the visible keys only, with every page wholly before the window replaced in the page table: by the null block 0
// in the CSR table (what the manager writes for a sliding-window group) and by ids that are not even in the pool
// in the padded table (-1, INT32_MAX, num_blocks + 7), so a kernel that dereferences such an entry reads NaN (block
// 0) or crashes / trips ASan. Everything else in the pool that no sequence uses is NaN, as above.

namespace {

using pagedkv::AttentionWindow;

/// The first key the query at position `pos` sees, straight from the definition and independent of the library
/// (brute force): the smallest t <= pos such that every u in [t, pos] is visible, u visible iff pos - u < W (when
/// W > 0) and u / C == pos / C (when C > 0). The oracles and the null-page placement of these tests use this, never
/// AttentionWindow::first_visible, so a wrong mask in the library cannot agree with itself.
std::int64_t oracle_first_visible(std::int64_t pos, const AttentionWindow& w) {
  const auto visible = [&](std::int64_t u) {
    const bool in_window = w.sliding_window_tokens <= 0 || pos - u < w.sliding_window_tokens;
    const std::int64_t c = w.attention_chunk_tokens;
    const bool in_chunk = c <= 0 || u / c == pos / c;
    return in_window && in_chunk;
  };
  std::int64_t t = pos;
  while (t > 0 && visible(t - 1)) --t;
  return t;
}

/// The first key any of the last num_queries positions of a kv_len-token sequence sees (0 when nothing is read).
std::int64_t oracle_first_needed(std::int64_t kv_len, std::int64_t num_queries, const AttentionWindow& w) {
  return kv_len == 0 || num_queries == 0 ? 0 : oracle_first_visible(kv_len - num_queries, w);
}

/// One window configuration of the grid, relative to the block size.
struct WindowCase {
  const char* name;
  int window;  // sliding_window_tokens
  int chunk;   // attention_chunk_tokens
};

/// The 7 window configurations of the grid at block size bs: window edges inside a block and at a block boundary,
/// W = 1, W above every length, chunk sizes that are and are not multiples of bs, and both limits at once.
WindowCase window_case(int i, int bs) {
  switch (i) {
    case 0: return {"W inside a block", bs == 1 ? 3 : 2 * bs + bs / 2 + 1, 0};
    case 1: return {"W = 2 blocks", 2 * bs, 0};
    case 2: return {"W = 1 (each query sees itself)", 1, 0};
    case 3: return {"W above every length", 100000, 0};
    case 4: return {"C = 3 blocks", 0, 3 * bs};
    case 5: return {"C not a multiple of the block size", 0, bs == 1 ? 5 : 2 * bs + 3};
    default: return {"W and C together", bs + 3, 4 * bs + 2};
  }
}
constexpr int kNumWindowCases = 7;

/// Decode lengths that put the window edge everywhere that matters: padding (0), 1 token, W - 1, W, W + 1 (all of
/// the sequence visible, exactly W, one token masked), W + k*bs (first visible token on a block boundary), W + k*bs
/// + r (inside a block), C and C + 1 (the query at the end / the start of a chunk), 2C + r, 3C, and a long one.
std::vector<int> window_decode_lengths(Rng& rng, int bs, const AttentionWindow& w, int max_len = 600) {
  std::vector<int> lens = {0, 1, uniform(rng, 150, 300)};
  const auto add = [&](std::int64_t v) {
    if (v >= 1 && v <= max_len) lens.push_back(static_cast<int>(v));
  };
  const int W = w.sliding_window_tokens, C = w.attention_chunk_tokens;
  if (W > 0) {
    add(W - 1);
    add(W);
    add(W + 1);
    add(W + std::int64_t{bs} * uniform(rng, 1, 3));
    if (bs > 1) add(W + std::int64_t{bs} * uniform(rng, 1, 3) + uniform(rng, 1, bs - 1));
  }
  if (C > 0) {
    add(C);
    add(C + 1);
    add(2 * std::int64_t{C} + uniform(rng, 2, std::max(2, C)));
    add(3 * std::int64_t{C});
  }
  std::shuffle(lens.begin(), lens.end(), rng);
  return lens;
}

/// The page tables of `pb` with every page wholly before first_read[b] (tokens) replaced: CSR entries by the null
/// block 0, padded entries by ids outside the pool. Both tables must never be dereferenced there.
struct WindowTables {
  std::vector<std::int32_t> indices, block_tables;
  int nulled_pages = 0;
  WindowTables(const PagedBatch& pb, const std::vector<std::int64_t>& first_read) {
    indices = pb.indices;
    block_tables = pb.block_tables;
    const std::int32_t garbage[] = {-1, std::numeric_limits<std::int32_t>::max(), pb.num_blocks + 7};
    for (int b = 0; b < pb.batch(); ++b) {
      const std::int64_t skip = first_read[sz(b)] / pb.block_size;
      for (std::int64_t i = 0; i < skip; ++i) {
        indices[sz(pb.indptr[sz(b)] + i)] = 0;
        block_tables[sz(std::int64_t{b} * pb.max_blocks_per_seq + i)] = garbage[(b + i) % 3];
        ++nulled_pages;
      }
    }
  }
  [[nodiscard]] PageTable table(const PagedBatch& pb, PageTableFormat f) const {
    return f == PageTableFormat::kCsr
               ? PageTable::csr(pb.batch(), pb.indptr.data(), indices.data(), pb.last_page_len.data())
               : PageTable::padded(pb.batch(), block_tables.data(), pb.max_blocks_per_seq, pb.seq_lens.data());
  }
};

/// What a windowed grid saw, summed over its runs, so the test can insist that the interesting paths ran.
struct WindowStats {
  int nulled_pages = 0;     // page-table entries replaced (never to be read)
  int masked_chunks = 0;    // chunk-rule chunks wholly before the window (masked partials merged with weight 0)
  int split_plans = 0;      // window-aware plans that split some request
  int multi_chunk_rows = 0; // prefill steps whose queries span >= 2 attention chunks
};

struct WindowRun {
  DType dtype;
  int group, head_dim, block_size;
  Layout layout;
  WindowCase wc;
  int max_len = 600;  // longest sequence window_decode_lengths may add
};

void run_window_decode_case(const WindowRun& c, WindowStats& stats) {
  const std::uint64_t seed = fresh_seed();
  const std::string dtype = dtype_name(c.dtype), layout = layout_name(c.layout), window_case_name = c.wc.name;
  CAPTURE(seed, dtype, layout, c.group, c.head_dim, c.block_size, window_case_name, c.wc.window, c.wc.chunk);
  Rng rng(seed);
  const AttentionWindow w{c.wc.window, c.wc.chunk};
  const int hq = kNumKvHeads * c.group, dim = c.head_dim;
  const PagedBatch pb = make_batch(rng, window_decode_lengths(rng, c.block_size, w, c.max_len), c.block_size);
  const int batch = pb.batch();
  CAPTURE(pb.kv_lens);
  TestPool pool(c.layout, c.dtype, pb.num_blocks, c.block_size, kNumKvHeads, dim);
  fill_sequences(pool, pb, rng);
  const auto pool_before = pool.snapshot();
  std::vector<std::int64_t> first(sz(batch));
  for (int b = 0; b < batch; ++b) first[sz(b)] = oracle_first_needed(pb.kv_lens[b], 1, w);
  const WindowTables wt(pb, first);
  stats.nulled_pages += wt.nulled_pages;
  Raw q(c.dtype, std::int64_t{batch} * hq * dim);
  q.fill_random(rng, 0.1f, 2.0f);
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(dim));

  // Oracle: the query at kv_len - 1 against keys [first, kv_len), gathered through the *original* pages.
  std::vector<double> o_ref(sz(batch) * sz(hq) * sz(dim));
  std::vector<double> lse_ref(sz(batch) * sz(hq));
  const std::vector<double> qd = q.to_double();
  for (int b = 0; b < batch; ++b) {
    const int len = pb.kv_lens[b];
    for (int kvh = 0; kvh < kNumKvHeads; ++kvh) {
      const Gathered g = gather(pool, pb.pages[b], len, kvh);
      for (int h = kvh * c.group; h < (kvh + 1) * c.group; ++h) {
        const std::size_t row = sz(b) * sz(hq) + sz(h);
        oracle_attend_range(g, static_cast<int>(first[sz(b)]), len, qd.data() + row * sz(dim), sm_scale,
                            o_ref.data() + row * sz(dim), &lse_ref[row]);
      }
    }
  }
  double max_ref = 1e-30;
  for (const double x : o_ref) max_ref = std::max(max_ref, std::abs(x));
  const int max_len = *std::max_element(pb.kv_lens.begin(), pb.kv_lens.end());

  for (const PageTableFormat fmt : {PageTableFormat::kCsr, PageTableFormat::kPadded}) {
    const std::string table = fmt == PageTableFormat::kCsr ? "csr, null block 0" : "padded, ids outside the pool";
    CAPTURE(table);
    DecodeParams base;
    base.q = q.data();
    base.kv = pool.view;
    base.pages = wt.table(pb, fmt);
    base.num_qo_heads = hq;
    base.sm_scale = sm_scale;
    base.window = w;
    std::vector<double> o_nosplit;
    // mode 0: no split; 1: chunk rule (chunks before the window are masked); 2: plan with the window; 3: plan made
    // without the window (its items before the window are masked by the executor).
    for (int mode = 0; mode < 4; ++mode) {
      CAPTURE(mode);
      Raw o(c.dtype, std::int64_t{batch} * hq * dim);  // NaN-filled: every element must be written
      std::vector<float> lse(sz(batch) * sz(hq), std::numeric_limits<float>::quiet_NaN());
      DecodeParams p = base;
      p.o = o.data();
      p.lse = lse.data();
      std::vector<float> ws;
      std::vector<pagedkv::DecodeWorkItem> items;
      std::vector<pagedkv::DecodeMergeItem> merges;
      Status st = Status::kInvalidValue;
      if (mode <= 1) {
        if (mode == 1) {
          p.kv_chunk_size_tokens = uniform(rng, 3, 40);
          p.max_num_chunks = static_cast<std::int32_t>(ref::num_kv_chunks(max_len, p.kv_chunk_size_tokens));
          p.workspace_bytes = pagedkv::decode_workspace_bytes(batch, p.max_num_chunks, hq, dim);
          ws.assign(p.workspace_bytes / sizeof(float) + 1, std::numeric_limits<float>::quiet_NaN());
          p.workspace = ws.data();
          for (int b = 0; b < batch; ++b) {
            if (ref::num_kv_chunks(pb.kv_lens[b], p.kv_chunk_size_tokens) >= 2) {
              stats.masked_chunks += static_cast<int>(first[sz(b)] / p.kv_chunk_size_tokens);
            }
          }
          CAPTURE(p.kv_chunk_size_tokens);
        }
        st = ref::decode(p, 2);
      } else {
        pagedkv::DecodePlanConfig cfg;
        cfg.num_qo_heads = hq;
        cfg.num_kv_heads = kNumKvHeads;
        cfg.head_dim = dim;
        cfg.heads_per_tile = uniform(rng, 0, c.group);
        cfg.num_sms = uniform(rng, 1, 8);
        cfg.ctas_per_sm = uniform(rng, 1, 4);
        cfg.min_chunk_tokens = uniform(rng, 1, 8);
        cfg.item_overhead_tokens = uniform(rng, 0, 16);
        cfg.max_waves = uniform(rng, 1, 8);
        if (mode == 2) cfg.window = w;
        const pagedkv::DecodePlanCapacity cap = pagedkv::decode_plan_capacity(batch, cfg);
        items.resize(sz(cap.items));
        merges.resize(sz(cap.merges));
        pagedkv::DecodePlanInfo info;
        REQUIRE_STATUS(pagedkv::plan_decode(pb.seq_lens, cfg, {items, merges, cap.partial_rows}, &info),
                       Status::kSuccess);
        CAPTURE(cfg.num_sms, cfg.ctas_per_sm, cfg.min_chunk_tokens, info.num_items, info.num_merges);
        if (mode == 2) {
          stats.split_plans += info.num_merges > 0 ? 1 : 0;
          // The plan covers visible tokens only: no item reaches before its request's window.
          int before_window = 0;
          for (int i = 0; i < info.num_items; ++i) {
            before_window += items[sz(i)].kv_begin < first[sz(items[sz(i)].request)] ? 1 : 0;
          }
          CHECK(before_window == 0);
        }
        ws.assign(info.workspace_bytes / sizeof(float) + 1, std::numeric_limits<float>::quiet_NaN());
        p.workspace = ws.data();
        p.workspace_bytes = ws.size() * sizeof(float);
        st = ref::decode(p, info.work_list, 2);
      }
      REQUIRE_STATUS(st, Status::kSuccess);
      const std::vector<double> got = o.to_double();
      CHECK_CLOSE(got, o_ref, 1e-30, tolerance(c.dtype));
      CHECK_CLOSE(floats_to_double(lse), lse_ref, 1.0, kLseTol);
      if (mode == 0) {
        o_nosplit = got;
      } else {
        CHECK(compare(got, o_nosplit, max_ref).err <= tolerance(c.dtype));
      }
    }
  }
  CHECK(first_diff(pool.snapshot(), pool_before) == -1);
}

void window_decode_grid(DType dtype, WindowStats& stats) {
  const int bs_i = GENERATE(0, 1, 2, 3);
  const int case_i = GENERATE(range(0, kNumWindowCases));
  const int block_size = std::array<int, 4>{1, 8, 16, 32}[sz(bs_i)];
  const int group = std::array<int, 3>{1, 4, 8}[sz((bs_i + case_i + index_of(dtype)) % 3)];
  const int head_dim = std::array<int, 3>{32, 64, 128}[sz((case_i + index_of(dtype)) % 3)];
  run_window_decode_case({dtype, group, head_dim, block_size, kAllLayouts[(bs_i + case_i) % 5],
                          window_case(case_i, block_size)},
                         stats);
}

}  // namespace

TEST_CASE("reference::decode with windows above 700 tokens matches the float64 oracle", "[reference][decode][window]") {
  // The grid below keeps sequences under 600 tokens; these windows need longer ones (up to 3C): W = 1000, W = 4096,
  // C = 8192, W = 1500 with C = 4096, block size 16, every decode mode of run_window_decode_case. The GPU family
  // cuda.window runs the same window cases.
  static WindowStats stats;
  const DType dtype = GENERATE(DType::kFloat32, DType::kFloat16, DType::kBFloat16);
  const int case_i = GENERATE(0, 1, 2, 3);
  const WindowCase cases[] = {{"W = 1000", 1000, 0}, {"W = 4096", 4096, 0}, {"C = 8192", 0, 8192},
                              {"W = 1500 with C = 4096", 1500, 4096}};
  WindowRun run{dtype, 4, 64, 16, kAllLayouts[sz(case_i) % 5], cases[case_i]};
  run.max_len = 30000;
  run_window_decode_case(run, stats);
}

TEST_CASE("reference::decode with sliding windows and chunked-local attention matches the float64 oracle",
          "[reference][decode][window]") {
  // dtype x block size {1, 8, 16, 32} x 7 window cases = 84 runs; each: CSR (null block 0) and padded (ids outside
  // the pool) tables x {no split, chunk rule, window-aware plan, window-unaware plan}.
  static WindowStats stats;  // Catch2 re-enters the test case once per GENERATE value: accumulate over all of them
  static int runs = 0;
  const DType dtype = GENERATE(DType::kFloat32, DType::kFloat16, DType::kBFloat16);
  window_decode_grid(dtype, stats);
  if (++runs == 3 * 4 * kNumWindowCases) {
    // The grid really exercised what it is about.
    CHECK(stats.nulled_pages >= 200);
    CHECK(stats.masked_chunks >= 100);
    CHECK(stats.split_plans >= 30);  // typically ~50 of the 168 window-aware plans split
  }
}

namespace {

/// Ragged prefill steps for a window: a whole prompt long enough to cross several windows / chunks, a cached prefix
/// followed by several queries whose first window starts inside a block, one query after a prefix, a sequence with
/// no query, and padding; shuffled. q_len <= kv_len throughout.
std::vector<PrefillSeq> window_prefill_lengths(Rng& rng, const AttentionWindow& w) {
  const int W = w.sliding_window_tokens, C = w.attention_chunk_tokens;
  int whole = uniform(rng, 40, 100);
  if (C > 0) whole = std::max(whole, 2 * C + uniform(rng, 1, 30));          // >= 3 chunks
  if (W > 0 && W < 1000) whole = std::max(whole, W + uniform(rng, 1, 40));  // the window slides
  const int kv_b = uniform(rng, 60, 240);
  const int kv_c = uniform(rng, 20, 200);
  std::vector<PrefillSeq> s = {{std::min(whole, 400), std::min(whole, 400)},
                               {kv_b, uniform(rng, 2, std::min(kv_b - 1, 70))},
                               {kv_c, 1},
                               {uniform(rng, 1, 60), 0},
                               {0, 0}};
  std::shuffle(s.begin(), s.end(), rng);
  return s;
}

void run_window_prefill_case(const WindowRun& c, WindowStats& stats) {
  const std::uint64_t seed = fresh_seed();
  const std::string dtype = dtype_name(c.dtype), layout = layout_name(c.layout), window_case_name = c.wc.name;
  CAPTURE(seed, dtype, layout, c.group, c.head_dim, c.block_size, window_case_name, c.wc.window, c.wc.chunk);
  Rng rng(seed);
  const AttentionWindow w{c.wc.window, c.wc.chunk};
  const int hq = kNumKvHeads * c.group, dim = c.head_dim;
  const std::vector<PrefillSeq> seqs = window_prefill_lengths(rng, w);
  std::vector<int> lens;
  std::vector<std::int32_t> qo_indptr = {0};
  for (const PrefillSeq& sq : seqs) {
    lens.push_back(sq.kv_len);
    qo_indptr.push_back(qo_indptr.back() + sq.q_len);
  }
  CAPTURE(lens, qo_indptr);
  const PagedBatch pb = make_batch(rng, lens, c.block_size);
  const int batch = pb.batch();
  const int total_q = qo_indptr.back();
  TestPool pool(c.layout, c.dtype, pb.num_blocks, c.block_size, kNumKvHeads, dim);
  fill_sequences(pool, pb, rng);
  const auto pool_before = pool.snapshot();
  std::vector<std::int64_t> first(sz(batch));
  for (int b = 0; b < batch; ++b) {
    const int q_len = qo_indptr[sz(b) + 1] - qo_indptr[sz(b)];
    first[sz(b)] = oracle_first_needed(lens[sz(b)], q_len, w);
    if (c.wc.chunk > 0 && q_len > 0) {
      const int last = lens[sz(b)] - 1, earliest = lens[sz(b)] - q_len;
      stats.multi_chunk_rows += last / c.wc.chunk > earliest / c.wc.chunk ? 1 : 0;
    }
  }
  const WindowTables wt(pb, first);
  stats.nulled_pages += wt.nulled_pages;
  Raw q(c.dtype, std::int64_t{total_q} * hq * dim);
  q.fill_random(rng, 0.1f, 2.0f);
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(dim));

  std::vector<double> o_ref(sz(total_q) * sz(hq) * sz(dim));
  std::vector<double> lse_ref(sz(total_q) * sz(hq));
  const std::vector<double> qd = q.to_double();
  for (int b = 0; b < batch; ++b) {
    const int q_len = qo_indptr[sz(b) + 1] - qo_indptr[sz(b)];
    const int len = pb.kv_lens[b];
    for (int kvh = 0; kvh < kNumKvHeads; ++kvh) {
      const Gathered g = gather(pool, pb.pages[b], len, kvh);
      for (int i = 0; i < q_len; ++i) {
        const int pos = len - q_len + i;  // sees [first_visible(pos), pos]
        const auto lo = static_cast<int>(oracle_first_visible(pos, w));
        for (int h = kvh * c.group; h < (kvh + 1) * c.group; ++h) {
          const std::size_t row = (sz(qo_indptr[sz(b)]) + sz(i)) * sz(hq) + sz(h);
          oracle_attend_range(g, lo, pos + 1, qd.data() + row * sz(dim), sm_scale, o_ref.data() + row * sz(dim),
                              &lse_ref[row]);
        }
      }
    }
  }

  for (const PageTableFormat fmt : {PageTableFormat::kCsr, PageTableFormat::kPadded}) {
    const std::string table = fmt == PageTableFormat::kCsr ? "csr, null block 0" : "padded, ids outside the pool";
    CAPTURE(table);
    Raw o(c.dtype, std::int64_t{total_q} * hq * dim);
    std::vector<float> lse(sz(total_q) * sz(hq), std::numeric_limits<float>::quiet_NaN());
    PrefillParams p;
    p.q = q.data();
    p.o = o.data();
    p.lse = lse.data();
    p.qo_indptr = qo_indptr.data();
    p.total_q_tokens = total_q;
    p.kv = pool.view;
    p.pages = wt.table(pb, fmt);
    p.num_qo_heads = hq;
    p.sm_scale = sm_scale;
    p.window = w;
    REQUIRE_STATUS(ref::prefill(p, 2), Status::kSuccess);
    CHECK_CLOSE(o.to_double(), o_ref, 1e-30, tolerance(c.dtype));
    CHECK_CLOSE(floats_to_double(lse), lse_ref, 1.0, kLseTol);
  }
  CHECK(first_diff(pool.snapshot(), pool_before) == -1);
}

}  // namespace

TEST_CASE("reference::prefill with sliding windows and chunked-local attention matches the float64 oracle",
          "[reference][prefill][window]") {
  // dtype x block size {1, 8, 16, 32} x 7 window cases = 84 runs, CSR and padded tables each; ragged steps whose
  // queries span several windows / chunks.
  static WindowStats stats;
  static int runs = 0;
  const DType dtype = GENERATE(DType::kFloat32, DType::kFloat16, DType::kBFloat16);
  const int bs_i = GENERATE(0, 1, 2, 3);
  const int case_i = GENERATE(range(0, kNumWindowCases));
  const int block_size = std::array<int, 4>{1, 8, 16, 32}[sz(bs_i)];
  const int group = std::array<int, 2>{1, 4}[sz((bs_i + case_i + index_of(dtype)) % 2)];
  const int head_dim = std::array<int, 3>{32, 64, 128}[sz((bs_i + index_of(dtype)) % 3)];
  run_window_prefill_case({dtype, group, head_dim, block_size, kAllLayouts[(bs_i + case_i + 1) % 5],
                           window_case(case_i, block_size)},
                          stats);
  if (++runs == 3 * 4 * kNumWindowCases) {
    CHECK(stats.nulled_pages >= 100);
    CHECK(stats.multi_chunk_rows >= 36);  // every chunked run has a whole prompt of >= 3 chunks
  }
}

TEST_CASE("reference::decode and plans reject bad windows and uncovered keys, and write nothing",
          "[reference][decode][window][validation]") {
  Rng rng(17);
  const int bs = 4, dim = 16, hq = 4;
  const PagedBatch pb = make_batch(rng, {11, 3}, bs);
  TestPool pool(Layout::kNhd, DType::kFloat32, pb.num_blocks, bs, kNumKvHeads, dim);
  fill_sequences(pool, pb, rng);
  const AttentionWindow w{5, 0};  // sequence 0: query at 10 sees [6, 11): page 0 [0, 4) is never read
  REQUIRE(w.first_needed_token(11, 1) == 6);
  std::vector<std::int32_t> indices = pb.indices;
  indices[sz(pb.indptr[0])] = 0;  // the null block, as the manager writes it
  Raw q(DType::kFloat32, 2 * hq * dim);
  q.fill_random(rng);
  Raw o(DType::kFloat32, 2 * hq * dim);
  std::vector<float> lse(2 * hq, 42.f);
  DecodeParams p;
  p.q = q.data();
  p.o = o.data();
  p.lse = lse.data();
  p.kv = pool.view;
  p.pages = PageTable::csr(2, pb.indptr.data(), indices.data(), pb.last_page_len.data());
  p.num_qo_heads = hq;
  p.sm_scale = 0.25f;
  p.window = w;
  REQUIRE_STATUS(ref::validate(p), Status::kSuccess);
  // A plan for this window (it starts at token 6, so it covers nothing the window hides).
  pagedkv::DecodePlanConfig cfg;
  cfg.num_qo_heads = hq;
  cfg.num_kv_heads = kNumKvHeads;
  cfg.head_dim = dim;
  cfg.num_sms = 2;
  cfg.min_chunk_tokens = 2;
  cfg.window = w;
  const pagedkv::DecodePlanCapacity cap = pagedkv::decode_plan_capacity(2, cfg);
  std::vector<pagedkv::DecodeWorkItem> items(sz(cap.items));
  std::vector<pagedkv::DecodeMergeItem> merges(sz(cap.merges));
  pagedkv::DecodePlanInfo info;
  REQUIRE_STATUS(pagedkv::plan_decode(pb.seq_lens, cfg, {items, merges, cap.partial_rows}, &info), Status::kSuccess);
  std::vector<float> ws(info.workspace_bytes / sizeof(float) + 1, 42.f);
  p.workspace = ws.data();
  p.workspace_bytes = ws.size() * sizeof(float);
  REQUIRE_STATUS(ref::validate(p, info.work_list), Status::kSuccess);
  const auto o_before = o.words;
  const auto lse_before = lse;
  const auto ws_before = ws;
  bool with_plan = false;
  SECTION("negative sliding window") { p.window.sliding_window_tokens = -1; }
  SECTION("negative attention chunk") { p.window.attention_chunk_tokens = -3; }
  SECTION("an id outside the pool inside the window") { indices[sz(pb.indptr[0]) + 1] = pb.num_blocks; }
  SECTION("the window's plan run without the window leaves keys [0, 6) uncovered") {
    p.window = AttentionWindow{};
    with_plan = true;
  }
  SECTION("a plan for a narrower window than the launch's leaves key 5 uncovered") {
    p.window.sliding_window_tokens = 6;
    with_plan = true;
  }
  const Status got = with_plan ? ref::decode(p, info.work_list) : ref::decode(p);
  CHECK_STATUS(got, Status::kInvalidValue);
  CHECK(first_diff(o.words, o_before) == -1);
  CHECK(first_diff(lse, lse_before) == -1);
  CHECK(std::memcmp(ws.data(), ws_before.data(), ws.size() * sizeof(float)) == 0);
}

TEST_CASE("reference::prefill rejects bad windows and ids inside the window, accepts anything before it",
          "[reference][prefill][window][validation]") {
  Rng rng(23);
  const int bs = 4, dim = 16, hq = 2;
  const PagedBatch pb = make_batch(rng, {14, 3}, bs);
  TestPool pool(Layout::kHnd, DType::kBFloat16, pb.num_blocks, bs, kNumKvHeads, dim);
  fill_sequences(pool, pb, rng);
  std::vector<std::int32_t> qo_indptr = {0, 3, 5};  // sequence 0: queries at 11, 12, 13
  const AttentionWindow w{4, 0};                    // the query at 11 sees [8, 12): pages 0 and 1 are never read
  REQUIRE(w.first_needed_token(14, 3) == 8);
  std::vector<std::int32_t> indices = pb.indices;
  indices[sz(pb.indptr[0])] = -5;                        // not even a block id: never read, never checked
  indices[sz(pb.indptr[0]) + 1] = pb.num_blocks + 1000;  // likewise
  Raw q(DType::kBFloat16, 5 * hq * dim);
  q.fill_random(rng);
  Raw o(DType::kBFloat16, 5 * hq * dim);
  std::vector<float> lse(5 * hq, 42.f);
  PrefillParams p;
  p.q = q.data();
  p.o = o.data();
  p.lse = lse.data();
  p.qo_indptr = qo_indptr.data();
  p.total_q_tokens = 5;
  p.kv = pool.view;
  p.pages = PageTable::csr(2, pb.indptr.data(), indices.data(), pb.last_page_len.data());
  p.num_qo_heads = hq;
  p.sm_scale = 0.25f;
  p.window = w;
  REQUIRE_STATUS(ref::validate(p), Status::kSuccess);
  const auto o_before = o.words;
  const auto lse_before = lse;
  SECTION("negative sliding window") { p.window.sliding_window_tokens = -2; }
  SECTION("negative attention chunk") { p.window.attention_chunk_tokens = -1; }
  SECTION("a wider window reaches the bad ids") { p.window.sliding_window_tokens = 5; }
  SECTION("an earlier query reaches the bad ids") {
    qo_indptr = {0, 4, 6};  // queries at 10..13: the one at 10 sees [7, 11), page 1
    p.total_q_tokens = 6;
  }
  SECTION("no window") { p.window = AttentionWindow{}; }
  CHECK_STATUS(ref::prefill(p), Status::kInvalidValue);
  CHECK(first_diff(o.words, o_before) == -1);
  CHECK(first_diff(lse, lse_before) == -1);
}

TEST_CASE("reference decode and prefill with a window over an fp8 e4m3 pool match the float64 oracle",
          "[reference][fp8][window]") {
  // Separate NHD fp8 pools, unused bytes 0x7f (e4m3 NaN), power-of-two scales (dequantization exact), pages before
  // the window replaced by the null block 0 (whose bytes are NaN too). The oracle uses the dequantized values.
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  Rng rng(seed);
  const int bs = 8, hkv = 2, group = 2, hq = hkv * group, dim = 32;
  const float k_scale = 1.f / 256, v_scale = 1.f / 128;
  for (const DType dt : {DType::kFloat32, DType::kBFloat16}) {
    for (const AttentionWindow w : {AttentionWindow{13, 0}, AttentionWindow{0, 20}, AttentionWindow{11, 24}}) {
      const std::string dtype = dtype_name(dt);
      CAPTURE(dtype, w.sliding_window_tokens, w.attention_chunk_tokens);
      const std::vector<int> lens = {0, 1, 13, 14, 45, 70};
      const std::vector<int> q_lens = {0, 1, 5, 1, 30, 47};  // prefill: the last q_len tokens of each are queries
      const int batch = static_cast<int>(lens.size());
      std::vector<std::vector<std::int32_t>> pages(sz(batch));
      int nb = 1;
      for (int b = 0; b < batch; ++b) {
        for (int i = 0; i < (lens[sz(b)] + bs - 1) / bs; ++i) pages[sz(b)].push_back(nb++);
      }
      const std::size_t page_bytes = sz(bs) * sz(hkv) * sz(dim);
      std::vector<std::uint8_t> kb(sz(nb) * page_bytes, 0x7f), vb(kb.size(), 0x7f);
      std::vector<double> kd(kb.size(), std::nan("")), vd(kb.size(), std::nan(""));  // dequantized, for the oracle
      const auto at = [&](std::int32_t blk, int t, int h, int d) {
        return sz(blk) * page_bytes + (sz(t) * sz(hkv) + sz(h)) * sz(dim) + sz(d);
      };
      for (int b = 0; b < batch; ++b) {
        for (int t = 0; t < lens[sz(b)]; ++t) {
          for (int h = 0; h < hkv; ++h) {
            for (int d = 0; d < dim; ++d) {
              const std::size_t i = at(pages[sz(b)][sz(t / bs)], t % bs, h, d);
              kb[i] = ref::float_to_fp8_e4m3_bits(nonzero(rng) / k_scale);
              vb[i] = ref::float_to_fp8_e4m3_bits(nonzero(rng) / v_scale);
              kd[i] = static_cast<double>(ref::fp8_e4m3_bits_to_float(kb[i])) * k_scale;
              vd[i] = static_cast<double>(ref::fp8_e4m3_bits_to_float(vb[i])) * v_scale;
            }
          }
        }
      }
      const KVPoolView kv = KVPoolView::separate_nhd(kb.data(), vb.data(), dt, nb, bs, hkv, dim,
                                                     pagedkv::KVDType::kFp8E4M3, k_scale, v_scale);
      // float64 attention of query row `qrow` (double) of sequence b against keys [lo, hi).
      const auto oracle = [&](int b, int kvh, const double* qv, std::int64_t lo, std::int64_t hi, double scale,
                              double* o, double* lse) {
        std::fill(o, o + dim, 0.0);
        double m = -kInf;
        std::vector<double> s(sz(hi - lo));
        for (std::int64_t t = lo; t < hi; ++t) {
          double acc = 0;
          for (int d = 0; d < dim; ++d) acc += qv[d] * kd[at(pages[sz(b)][sz(t / bs)], static_cast<int>(t % bs), kvh, d)];
          s[sz(t - lo)] = acc * scale;
          m = std::max(m, s[sz(t - lo)]);
        }
        double den = 0;
        for (std::int64_t t = lo; t < hi; ++t) {
          const double e = std::exp(s[sz(t - lo)] - m);
          den += e;
          for (int d = 0; d < dim; ++d) o[d] += e * vd[at(pages[sz(b)][sz(t / bs)], static_cast<int>(t % bs), kvh, d)];
        }
        for (int d = 0; d < dim; ++d) o[d] /= den;
        *lse = m + std::log(den);
      };
      // CSR table with the null block before each sequence's first needed token (decode and prefill differ).
      const auto table = [&](bool prefill, std::vector<std::int32_t>& indptr, std::vector<std::int32_t>& indices,
                             std::vector<std::int32_t>& last) {
        indptr = {0};
        indices.clear();
        last.clear();
        for (int b = 0; b < batch; ++b) {
          const std::int64_t first = oracle_first_needed(lens[sz(b)], prefill ? q_lens[sz(b)] : 1, w);
          for (std::size_t i = 0; i < pages[sz(b)].size(); ++i) {
            indices.push_back(static_cast<std::int64_t>(i) < first / bs ? 0 : pages[sz(b)][i]);
          }
          indptr.push_back(static_cast<std::int32_t>(indices.size()));
          last.push_back(lens[sz(b)] == 0 ? 0 : lens[sz(b)] - (static_cast<int>(pages[sz(b)].size()) - 1) * bs);
        }
      };
      const float sm_scale = 1.f / std::sqrt(static_cast<float>(dim));
      {  // decode
        std::vector<std::int32_t> indptr, indices, last;
        table(false, indptr, indices, last);
        Raw q(dt, std::int64_t{batch} * hq * dim), o(dt, std::int64_t{batch} * hq * dim);
        q.fill_random(rng);
        const std::vector<double> qd = q.to_double();
        std::vector<float> lse(sz(batch) * sz(hq), std::numeric_limits<float>::quiet_NaN());
        DecodeParams p;
        p.q = q.data();
        p.o = o.data();
        p.lse = lse.data();
        p.kv = kv;
        p.pages = PageTable::csr(batch, indptr.data(), indices.data(), last.data());
        p.num_qo_heads = hq;
        p.sm_scale = sm_scale;
        p.window = w;
        REQUIRE_STATUS(ref::decode(p, 2), Status::kSuccess);
        std::vector<double> o_ref(sz(batch) * sz(hq) * sz(dim)), lse_ref(sz(batch) * sz(hq));
        for (int b = 0; b < batch; ++b) {
          for (int h = 0; h < hq; ++h) {
            const std::size_t row = sz(b) * sz(hq) + sz(h);
            if (lens[sz(b)] == 0) {
              lse_ref[row] = -kInf;
              continue;
            }
            oracle(b, h / group, qd.data() + row * sz(dim), oracle_first_needed(lens[sz(b)], 1, w), lens[sz(b)], sm_scale,
                   o_ref.data() + row * sz(dim), &lse_ref[row]);
          }
        }
        CHECK_CLOSE(o.to_double(), o_ref, 1e-30, tolerance(dt));
        CHECK_CLOSE(floats_to_double(lse), lse_ref, 1.0, kLseTol);
      }
      {  // prefill
        std::vector<std::int32_t> indptr, indices, last, qo_indptr = {0};
        table(true, indptr, indices, last);
        for (const int ql : q_lens) qo_indptr.push_back(qo_indptr.back() + ql);
        const int total_q = qo_indptr.back();
        Raw q(dt, std::int64_t{total_q} * hq * dim), o(dt, std::int64_t{total_q} * hq * dim);
        q.fill_random(rng);
        const std::vector<double> qd = q.to_double();
        std::vector<float> lse(sz(total_q) * sz(hq), std::numeric_limits<float>::quiet_NaN());
        PrefillParams p;
        p.q = q.data();
        p.o = o.data();
        p.lse = lse.data();
        p.qo_indptr = qo_indptr.data();
        p.total_q_tokens = total_q;
        p.kv = kv;
        p.pages = PageTable::csr(batch, indptr.data(), indices.data(), last.data());
        p.num_qo_heads = hq;
        p.sm_scale = sm_scale;
        p.window = w;
        REQUIRE_STATUS(ref::prefill(p, 2), Status::kSuccess);
        std::vector<double> o_ref(sz(total_q) * sz(hq) * sz(dim)), lse_ref(sz(total_q) * sz(hq));
        for (int b = 0; b < batch; ++b) {
          for (int i = 0; i < q_lens[sz(b)]; ++i) {
            const int pos = lens[sz(b)] - q_lens[sz(b)] + i;
            for (int h = 0; h < hq; ++h) {
              const std::size_t row = (sz(qo_indptr[sz(b)]) + sz(i)) * sz(hq) + sz(h);
              oracle(b, h / group, qd.data() + row * sz(dim), oracle_first_visible(pos, w), pos + 1, sm_scale,
                     o_ref.data() + row * sz(dim), &lse_ref[row]);
            }
          }
        }
        CHECK_CLOSE(o.to_double(), o_ref, 1e-30, tolerance(dt));
        CHECK_CLOSE(floats_to_double(lse), lse_ref, 1.0, kLseTol);
      }
    }
  }
}

TEST_CASE("AttentionWindow::first_visible and first_needed_token follow the definition", "[reference][window]") {
  // Every position up to 300 against the brute-force definition, for windows and chunks around the interesting
  // sizes (1, block-like powers of two, odd sizes, larger than every position), alone and together.
  int checked = 0;
  for (const int W : {0, 1, 2, 3, 7, 16, 33, 128, 1000}) {
    for (const int C : {0, 1, 2, 5, 16, 24, 100, 1000}) {
      const AttentionWindow w{W, C};
      CHECK(w.enabled() == (W > 0 || C > 0));
      for (std::int64_t pos = 0; pos <= 300; ++pos) {
        const std::int64_t want = oracle_first_visible(pos, w);
        if (w.first_visible(pos) != want) {
          FAIL("W " << W << ", C " << C << ", pos " << pos << ": " << w.first_visible(pos) << " != " << want);
        }
        for (const std::int64_t q : {1, 2, 17}) {
          if (pos + 1 >= q && w.first_needed_token(pos + 1, q) != oracle_first_needed(pos + 1, q, w)) {
            FAIL("first_needed_token(" << pos + 1 << ", " << q << ") with W " << W << ", C " << C);
          }
        }
        ++checked;
      }
    }
  }
  CHECK(checked == 9 * 8 * 301);
  // The conventions spelled out: W counts the visible keys including the query (vLLM sliding_window; FlashInfer
  // window_left = W - 1); C cuts positions into [kC, (k + 1)C) (Llama 4 attention_chunk_size).
  CHECK(AttentionWindow{4096, 0}.first_visible(5000) == 5000 - 4095);
  CHECK(AttentionWindow{1, 0}.first_visible(9) == 9);
  CHECK(AttentionWindow{0, 8192}.first_visible(8191) == 0);
  CHECK(AttentionWindow{0, 8192}.first_visible(8192) == 8192);
  CHECK(AttentionWindow{}.first_needed_token(0, 0) == 0);
  CHECK(AttentionWindow{3, 0}.first_needed_token(10, 20) == 0);  // more queries than keys: counts as kv_len
  CHECK_FALSE(AttentionWindow{-1, 0}.valid());
  CHECK_FALSE(AttentionWindow{0, -1}.valid());
}
