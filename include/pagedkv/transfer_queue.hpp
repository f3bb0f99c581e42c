// pagedkv/transfer_queue.hpp: block copies between the device pool and the host tier (offload, onboarding, swap),
// queued by the cache manager, handed to the engine by a build, and pinned until the engine says they completed.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <pagedkv/config.hpp>
#include <pagedkv/detail/reserve.hpp>
#include <pagedkv/hash.hpp>

namespace pagedkv {

/// Why a block is copied between tiers.
enum class TransferKind : std::uint8_t {
  kOffload = 0,  ///< Device -> host: a cached block leaves the device (write-back) or is mirrored (write-through).
  kOnboard = 1,  ///< Host -> device: a prefix hit on a block held only by the host tier.
  kSwapOut = 2,  ///< Device -> host: a running sequence is preempted by swapping (vLLM SOSP'23 sec. 4.5).
  kSwapIn = 3,   ///< Host -> device: a swapped sequence resumes.
};

/// Direction of a transfer kind: true for device -> host.
[[nodiscard]] constexpr bool is_device_to_host(TransferKind k) noexcept {
  return k == TransferKind::kOffload || k == TransferKind::kSwapOut;
}

/// One block copy between the tiers. `device` is a block of the device pool, `host` a block of the host pool; the
/// direction follows `kind`. `hash` is the block's hash when it has one (offloads, onboards and hashed swapped
/// blocks): the destination becomes hit-able under it once the copy completed. `token` is 0 while the copy is
/// queued, then the transfer token of the build that handed it out.
template <BlockIdType Id>
struct Transfer {
  Id device = 0;
  Id host = 0;
  TransferKind kind = TransferKind::kOffload;
  bool hashed = false;
  BlockHash hash;            ///< The block's hash (as its group's device index holds it), when `hashed`.
  std::uint64_t token = 0;
  std::uint32_t group = 0;   ///< KV-cache group of the block (0 with one group).
};

/// The copies between the device pool and the host tier, from queued to completed.
///
/// Life of a transfer: the manager queues it (`push`) while it admits, evicts or preempts; the next
/// `build_batch_metadata` hands every queued transfer to the engine (`issue`: the swap-out and swap-in lists of
/// that step, numbered by a transfer token); the engine executes them at the start of the step, before the step's
/// copy_blocks and kernels, in stream order, and calls `complete_transfers(token)` once they finished; the manager
/// then takes them out (`take_completed`) and unpins their blocks.
/// Thread safety: none (the manager's single writer). Memory: one Transfer (32 bytes) per queued or in-flight copy.
template <BlockIdType Id>
class TransferQueue {
 public:
  using transfer_type = Transfer<Id>;

  /// Queue a transfer (not yet handed out). May throw std::bad_alloc (nothing changed then).
  void push(const transfer_type& t) { queued_.push_back(t); }
  /// Make room for `n` more queued transfers, so that pushing them cannot throw.
  void reserve_more(std::size_t n) { detail::reserve_more(queued_, n); }

  /// Transfers queued and not yet issued.
  [[nodiscard]] std::span<const transfer_type> queued() const noexcept { return queued_; }
  /// Transfers issued and not yet completed.
  [[nodiscard]] std::span<const transfer_type> in_flight() const noexcept { return in_flight_; }
  /// Number of device -> host and host -> device transfers queued.
  [[nodiscard]] std::size_t num_queued(bool device_to_host) const noexcept {
    return static_cast<std::size_t>(std::count_if(queued_.begin(), queued_.end(), [&](const transfer_type& t) {
      return is_device_to_host(t.kind) == device_to_host;
    }));
  }

  /// Hand out every queued transfer under the next token (1, 2, ...; 0 when nothing was queued: no token used).
  /// Returns the token. May throw std::bad_alloc before anything changed (call `reserve_issue` first to make it
  /// no-throw).
  std::uint64_t issue() {
    if (queued_.empty()) return 0;
    const std::uint64_t token = ++last_token_;
    for (transfer_type& t : queued_) t.token = token;
    in_flight_.insert(in_flight_.end(), queued_.begin(), queued_.end());
    queued_.clear();
    return token;
  }
  /// Make room so that the next `issue()` cannot throw, with `extra` more transfers queued before it.
  void reserve_issue(std::size_t extra = 0) { detail::reserve_more(in_flight_, queued_.size() + extra); }

  /// Whether `token` names issued transfers that have not completed.
  [[nodiscard]] bool is_in_flight(std::uint64_t token) const noexcept {
    return token != 0 && std::any_of(in_flight_.begin(), in_flight_.end(),
                                     [&](const transfer_type& t) { return t.token == token; });
  }

  /// Move the in-flight transfers of `token` to the end of `out` (in issue order) and forget them; returns how
  /// many. O(in flight).
  std::size_t take_completed(std::uint64_t token, std::vector<transfer_type>& out) {
    const std::size_t before = out.size();
    for (const transfer_type& t : in_flight_) {
      if (t.token == token) out.push_back(t);
    }
    std::erase_if(in_flight_, [&](const transfer_type& t) { return t.token == token; });
    return out.size() - before;
  }

  /// Drop queued transfers matching `pred` (e.g. an onboarding whose sequence died before any build issued it).
  template <class Pred>
  std::size_t drop_queued_if(Pred&& pred) {
    return std::erase_if(queued_, pred);
  }

  /// The last token handed out (0 before the first).
  [[nodiscard]] std::uint64_t last_token() const noexcept { return last_token_; }

 private:
  std::vector<transfer_type> queued_;
  std::vector<transfer_type> in_flight_;
  std::uint64_t last_token_ = 0;
};

}  // namespace pagedkv
