// examples/pd/wire.cpp: the control channel (wire.hpp).
#include "wire.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace pd {

std::uint64_t Reader::u64() {
  if (in.size() - at < 8) throw std::runtime_error("wire: truncated message at byte " + std::to_string(at));
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= std::uint64_t(std::to_integer<std::uint8_t>(in[at + i])) << (8 * i);
  at += 8;
  return v;
}
std::string Reader::str() {
  const std::uint64_t n = u64();
  if (in.size() - at < n) throw std::runtime_error("wire: string of " + std::to_string(n) + " bytes runs past the end");
  std::string s(reinterpret_cast<const char*>(in.data() + at), n);
  at += n;
  return s;
}
std::vector<std::byte> Reader::bytes() {
  const std::uint64_t n = u64();
  if (in.size() - at < n) throw std::runtime_error("wire: blob of " + std::to_string(n) + " bytes runs past the end");
  std::vector<std::byte> b(in.begin() + static_cast<std::ptrdiff_t>(at), in.begin() + static_cast<std::ptrdiff_t>(at + n));
  at += n;
  return b;
}

void put_fingerprint(Writer& w, const pagedkv::KvLayoutFingerprint& fp) {
  w.u64(fp.block_size);
  w.str(fp.page_layout);
  w.str(fp.dtype);
  w.u64(fp.num_kv_heads);
  w.u64(fp.head_dim);
  w.u64(fp.groups.size());
  for (const pagedkv::KVCacheGroupSpec& g : fp.groups) {
    w.u64(static_cast<std::uint64_t>(g.kind));
    w.u64(g.window_tokens);
    w.u64(g.num_layers);
    w.u64(g.state_bytes);
    w.u64(g.last_checkpoint ? 1 : 0);
    w.u64(g.block_size);
  }
  w.u64(static_cast<std::uint64_t>(fp.hash_algorithm));
  w.u64(fp.hash_seed);
  w.str(fp.hash_seed_text);
}

pagedkv::KvLayoutFingerprint get_fingerprint(Reader& r) {
  pagedkv::KvLayoutFingerprint fp;
  fp.block_size = static_cast<std::uint32_t>(r.u64());
  fp.page_layout = r.str();
  fp.dtype = r.str();
  fp.num_kv_heads = static_cast<std::uint32_t>(r.u64());
  fp.head_dim = static_cast<std::uint32_t>(r.u64());
  const std::uint64_t ng = r.u64();
  if (ng > 64) throw std::runtime_error("wire: fingerprint with " + std::to_string(ng) + " groups");
  for (std::uint64_t i = 0; i < ng; ++i) {
    pagedkv::KVCacheGroupSpec g;
    g.kind = static_cast<pagedkv::AttentionKind>(r.u64());
    g.window_tokens = static_cast<std::uint32_t>(r.u64());
    g.num_layers = static_cast<std::uint32_t>(r.u64());
    g.state_bytes = static_cast<std::size_t>(r.u64());
    g.last_checkpoint = r.u64() != 0;
    g.block_size = static_cast<std::uint32_t>(r.u64());
    fp.groups.push_back(g);
  }
  fp.hash_algorithm = static_cast<pagedkv::BlockIdentityConvention>(r.u64());
  fp.hash_seed = r.u64();
  fp.hash_seed_text = r.str();
  return fp;
}

void put_descriptor(Writer& w, const WireDescriptor& d) {
  w.str(d.remote_engine_id);
  w.str(d.remote_host);
  w.u64(d.remote_port);
  w.u64(d.desc.hold_id);
  w.u64(d.desc.num_tokens);
  w.u64(d.desc.num_groups);
  w.u64(d.desc.blocks.size());
  for (std::size_t i = 0; i < d.desc.blocks.size(); ++i) {
    w.u64(d.desc.blocks[i]);
    w.u64(d.desc.generations[i]);
  }
  w.u64(d.desc.identities.size());
  for (const pagedkv::BlockIdentity& id : d.desc.identities) {
    for (std::uint8_t b : id) w.out.push_back(static_cast<std::byte>(b));
  }
  w.u64(d.desc.tail_tokens.size());
  for (pagedkv::TokenId t : d.desc.tail_tokens) w.u64(t);
  put_fingerprint(w, d.desc.layout);
}

WireDescriptor get_descriptor(Reader& r) {
  WireDescriptor d;
  d.remote_engine_id = r.str();
  d.remote_host = r.str();
  d.remote_port = r.u64();
  d.desc.hold_id = r.u64();
  d.desc.num_tokens = static_cast<std::size_t>(r.u64());
  d.desc.num_groups = static_cast<std::size_t>(r.u64());
  const std::uint64_t nb = r.u64();
  if (nb > r.in.size()) throw std::runtime_error("wire: descriptor with " + std::to_string(nb) + " blocks");
  for (std::uint64_t i = 0; i < nb; ++i) {
    d.desc.blocks.push_back(static_cast<std::uint32_t>(r.u64()));
    d.desc.generations.push_back(static_cast<std::uint32_t>(r.u64()));
  }
  const std::uint64_t ni = r.u64();
  if (ni * 32 > r.in.size() - r.at) throw std::runtime_error("wire: descriptor identities run past the end");
  for (std::uint64_t i = 0; i < ni; ++i) {
    pagedkv::BlockIdentity id{};
    for (auto& b : id) b = std::to_integer<std::uint8_t>(r.in[r.at++]);
    d.desc.identities.push_back(id);
  }
  const std::uint64_t nt = r.u64();
  if (nt > (r.in.size() - r.at) / 8) throw std::runtime_error("wire: descriptor tail tokens run past the end");
  for (std::uint64_t i = 0; i < nt; ++i) d.desc.tail_tokens.push_back(static_cast<pagedkv::TokenId>(r.u64()));
  d.desc.layout = get_fingerprint(r);
  return d;
}

Channel::~Channel() {
  if (fd_ >= 0) ::close(fd_);
}

int Channel::listen_loopback(std::uint16_t port, std::uint16_t* bound) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket: " + std::string(std::strerror(errno)));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 1) != 0) {
    const std::string e = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error("bind/listen 127.0.0.1:" + std::to_string(port) + ": " + e);
  }
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  *bound = ntohs(a.sin_port);
  return fd;
}

Channel Channel::accept_one(int listen_fd, int timeout_ms) {
  pollfd p{listen_fd, POLLIN, 0};
  if (::poll(&p, 1, timeout_ms) <= 0) throw std::runtime_error("no decode engine connected in time");
  const int fd = ::accept(listen_fd, nullptr, nullptr);
  if (fd < 0) throw std::runtime_error("accept: " + std::string(std::strerror(errno)));
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return Channel(fd);
}

Channel Channel::connect_loopback(std::uint16_t port, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return Channel(fd);
    }
    ::close(fd);
    if (std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error("connect 127.0.0.1:" + std::to_string(port) + ": no prefill engine listening");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

bool Channel::send(Msg type, std::span<const std::byte> payload) {
  Writer w;
  w.out.reserve(12 + payload.size());
  const auto t = static_cast<std::uint32_t>(type);
  for (int i = 0; i < 4; ++i) w.out.push_back(static_cast<std::byte>((t >> (8 * i)) & 0xff));
  w.u64(payload.size());
  w.out.insert(w.out.end(), payload.begin(), payload.end());
  const std::byte* p = w.out.data();
  std::size_t n = w.out.size();
  while (n > 0) {
    const ssize_t s = ::send(fd_, p, n, MSG_NOSIGNAL);
    if (s <= 0) return false;
    p += s;
    n -= static_cast<std::size_t>(s);
  }
  return true;
}

std::optional<std::pair<Msg, std::vector<std::byte>>> Channel::recv(int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    if (buf_.size() >= 12) {
      std::uint32_t t = 0;
      std::uint64_t n = 0;
      for (int i = 0; i < 4; ++i) t |= std::uint32_t(std::to_integer<std::uint8_t>(buf_[i])) << (8 * i);
      for (int i = 0; i < 8; ++i) n |= std::uint64_t(std::to_integer<std::uint8_t>(buf_[4 + i])) << (8 * i);
      if (n > (1u << 28)) throw std::runtime_error("wire: message of " + std::to_string(n) + " bytes");
      if (buf_.size() >= 12 + n) {
        std::vector<std::byte> payload(buf_.begin() + 12, buf_.begin() + 12 + static_cast<std::ptrdiff_t>(n));
        buf_.erase(buf_.begin(), buf_.begin() + 12 + static_cast<std::ptrdiff_t>(n));
        return std::make_pair(static_cast<Msg>(t), std::move(payload));
      }
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd p{fd_, POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::max<std::int64_t>(0, left.count())));
    if (r <= 0) return std::nullopt;
    std::byte tmp[65536];
    const ssize_t got = ::recv(fd_, tmp, sizeof tmp, 0);
    if (got <= 0) throw std::runtime_error("the peer closed the control channel");
    buf_.insert(buf_.end(), tmp, tmp + got);
  }
}

}  // namespace pd
