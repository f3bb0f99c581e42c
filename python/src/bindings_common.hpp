// python/src/bindings_common.hpp: what the translation units of the nanobind module pagedkv._pagedkv share: the
// input-array type ArrayIn (a numpy array read in place or a converted list) with its caster, and Manager, the
// Python KVCacheManager over every (hasher, eviction) pair (bindings.cpp binds it; bindings_external.cpp adds the
// external-KV methods to the same class). See bindings.cpp's header for the conventions (GIL, mutex, arrays).
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <pagedkv/eviction_priority.hpp>
#include <pagedkv/eviction_slru.hpp>
#include <pagedkv/kv_cache_manager.hpp>

namespace pagedkv::python {

namespace nb = nanobind;

// ---------------------------------------------------------------------------------------------------------------
// Input arrays: a 1-D view of T, borrowed from a numpy array of dtype T or owned after converting a list.

template <class T>
struct ArrayIn {
  using ndarray_type = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
  ndarray_type array;      // keeps a borrowed numpy array alive (the GIL may be released while reading it)
  std::vector<T> owned;    // a converted list or tuple
  const T* data = nullptr;
  std::size_t size = 0;
  [[nodiscard]] std::span<const T> span() const noexcept { return {data, size}; }
};

}  // namespace pagedkv::python

namespace nanobind::detail {

template <class T>
struct type_caster<pagedkv::python::ArrayIn<T>> {
  using Value = pagedkv::python::ArrayIn<T>;
  static constexpr auto Name =
      const_name("numpy.typing.NDArray[numpy.") + const_name<std::is_same_v<T, std::int32_t>>(
                                                      const_name("int32"),
                                                      const_name<std::is_same_v<T, std::int64_t>>(
                                                          const_name("int64"), const_name("uint32"))) +
      const_name("] | collections.abc.Sequence[int]");
  template <class U>
  using Cast = movable_cast_t<U>;
  template <class U>
  static constexpr bool can_cast() { return true; }
  Value value;
  explicit operator Value*() { return &value; }
  explicit operator Value&() { return value; }
  explicit operator Value&&() { return std::move(value); }

  bool from_python(handle src, uint8_t flags, cleanup_list* cleanup) noexcept {
    make_caster<typename Value::ndarray_type> arr;
    // Never let the ndarray caster convert (it would cast int64 token ids to int32 silently, wrapping).
    if (arr.from_python(src, (uint8_t)(flags & ~(uint8_t)cast_flags::convert), cleanup)) {
      value.array = arr.value;
      value.data = value.array.data();
      value.size = value.array.shape(0);
      return true;
    }
    if (!PyList_Check(src.ptr()) && !PyTuple_Check(src.ptr())) return false;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(src.ptr());
    PyObject** items = PySequence_Fast_ITEMS(src.ptr());
    try {
      value.owned.resize(static_cast<std::size_t>(n));
    } catch (...) {
      return false;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      make_caster<T> c;  // range-checked: an int outside T's range is refused
      if (!c.from_python(items[i], flags & ~(uint8_t)cast_flags::convert, cleanup)) return false;
      value.owned[static_cast<std::size_t>(i)] = c.value;
    }
    value.data = value.owned.data();
    value.size = value.owned.size();
    return true;
  }
};

}  // namespace nanobind::detail

namespace pagedkv::python {

// ---------------------------------------------------------------------------------------------------------------
// The manager over every (hasher, eviction) pair, selected by name at construction.

using Id = std::uint32_t;
using Managers = std::variant<KVCacheManager<Sha256Hasher, Id, LruEviction<Id>>,
                              KVCacheManager<Sha256Hasher, Id, SlruEviction<Id>>,
                              KVCacheManager<Sha256Hasher, Id, PriorityLruEviction<Id>>,
                              KVCacheManager<Xxh3Hasher, Id, LruEviction<Id>>,
                              KVCacheManager<Xxh3Hasher, Id, SlruEviction<Id>>,
                              KVCacheManager<Xxh3Hasher, Id, PriorityLruEviction<Id>>>;

// The options of one admission. A RetentionConfig is copied into a C++-owned shared_ptr: the manager keeps it for
// the sequence's life (and its forks'), and releasing a Python-owned one would need the GIL while the manager's
// mutex is held (a deadlock with a thread holding the GIL in a getter); later changes to the Python object do not
// reach admitted sequences.
// `prompt_retention_tokens` / `shared_prefix_boundary`: the sparse window retention's boundaries (AdmitOptions).
inline AdmitOptions admit_options(std::optional<std::size_t> max_cached_tokens, std::optional<std::size_t> num_reserved,
                                  const RetentionConfig* retention = nullptr,
                                  std::optional<std::size_t> prompt_retention_tokens = std::nullopt,
                                  std::size_t shared_prefix_boundary = 0) {
  AdmitOptions o;
  o.max_cached_tokens = max_cached_tokens;
  o.num_reserved_tokens = num_reserved;
  o.prompt_retention_tokens = prompt_retention_tokens;
  o.shared_prefix_boundary = shared_prefix_boundary;
  if (retention != nullptr) o.retention = std::make_shared<const RetentionConfig>(*retention);
  return o;
}

inline Managers make_manager(const CacheConfig& config, const std::string& hasher, const std::string& eviction) {
  int h = -1;
  if (hasher == "sha256") h = 0;
  if (hasher == "xxh3" || hasher == "xxh3_128") h = 1;
  if (h < 0) {
    detail::raise(Errc::kInvalidArgument,
                  "KVCacheManager: hasher = \"" + hasher + "\": expected \"sha256\" or \"xxh3\"");
  }
  int e = -1;
  if (eviction == "lru") e = 0;
  if (eviction == "slru") e = 1;
  if (eviction == "priority") e = 2;
  if (e < 0) {
    detail::raise(Errc::kInvalidArgument, "KVCacheManager: eviction = \"" + eviction +
                                              "\": expected \"lru\", \"slru\" or \"priority\"");
  }
  switch (h * 3 + e) {
    case 0: return Managers(std::in_place_index<0>, config);
    case 1: return Managers(std::in_place_index<1>, config);
    case 2: return Managers(std::in_place_index<2>, config);
    case 3: return Managers(std::in_place_index<3>, config);
    case 4: return Managers(std::in_place_index<4>, config);
    default: return Managers(std::in_place_index<5>, config);
  }
}

class Manager {
 public:
  Manager(const CacheConfig& config, const std::string& hasher, const std::string& eviction)
      : m_(make_manager(config, hasher, eviction)),
        hasher_(m_.index() < 3 ? "sha256" : "xxh3"),
        eviction_(eviction) {}

  // Runs f(manager) with the GIL released and the manager's mutex held.
  template <class F>
  decltype(auto) work(F&& f) {
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mu_);
    return std::visit(std::forward<F>(f), m_);
  }
  // Runs f(manager) with the GIL held (cheap getters) and the mutex held.
  template <class F>
  decltype(auto) peek(F&& f) {
    std::lock_guard<std::mutex> lock(mu_);
    return std::visit(std::forward<F>(f), m_);
  }

  const std::string& hasher() const noexcept { return hasher_; }
  const std::string& eviction() const noexcept { return eviction_; }

 private:
  Managers m_;
  std::mutex mu_;
  std::string hasher_, eviction_;
};

/// Adds the external-KV methods (try_admit_external, complete_external_fill, abort_sequence, leases, save pins,
/// hand-off descriptors, import plans, counters) to `cls` and their types to `m` (bindings_external.cpp).
void bind_external_kv(nb::module_& m, nb::class_<Manager>& cls);

}  // namespace pagedkv::python
