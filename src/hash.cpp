#include <openssl/evp.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstdio>
#include <cstdlib>
#include <memory>

#include <pagedkv/hash.hpp>

namespace pagedkv {

std::string BlockHash::hex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(32, '0');
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    s[2 * i] = kDigits[bytes[i] >> 4];
    s[2 * i + 1] = kDigits[bytes[i] & 0xf];
  }
  return s;
}

namespace {

// One fetched SHA-256 implementation per process and one reusable digest context per thread: EVP_Digest() would
// otherwise look the algorithm up and allocate a context on every call (several hundred ns).
struct Sha256Context {
  EVP_MD* md = nullptr;
  EVP_MD_CTX* ctx = nullptr;
  Sha256Context() {
    md = EVP_MD_fetch(nullptr, "SHA256", nullptr);
    ctx = EVP_MD_CTX_new();
    if (md == nullptr || ctx == nullptr) {
      std::fputs("pagedkv: OpenSSL could not provide SHA-256\n", stderr);
      std::abort();
    }
  }
  ~Sha256Context() {
    EVP_MD_CTX_free(ctx);
    EVP_MD_free(md);
  }
  Sha256Context(const Sha256Context&) = delete;
  Sha256Context& operator=(const Sha256Context&) = delete;
};

}  // namespace

BlockHash Sha256Hasher::hash(std::span<const std::byte> bytes) noexcept {
  thread_local Sha256Context c;
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  const bool ok = EVP_DigestInit_ex2(c.ctx, c.md, nullptr) == 1 &&
                  EVP_DigestUpdate(c.ctx, bytes.data(), bytes.size()) == 1 &&
                  EVP_DigestFinal_ex(c.ctx, digest, &len) == 1;
  if (!ok || len < 16) {
    std::fputs("pagedkv: SHA-256 failed inside OpenSSL\n", stderr);
    std::abort();
  }
  BlockHash h;
  std::memcpy(h.bytes.data(), digest, h.bytes.size());
  return h;
}

BlockHash Xxh3Hasher::hash(std::span<const std::byte> bytes) noexcept {
  const XXH128_hash_t d = XXH3_128bits(bytes.data(), bytes.size());
  XXH128_canonical_t canon;
  XXH128_canonicalFromHash(&canon, d);  // big-endian canonical form: identical bytes on every platform
  BlockHash h;
  std::memcpy(h.bytes.data(), canon.digest, h.bytes.size());
  return h;
}

}  // namespace pagedkv
