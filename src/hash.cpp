// SHA256_Init/Update/Final are deprecated in OpenSSL 3.0 but still provided by every 3.x release; for a ~100-byte
// block they cost about 60% of the EVP path (no provider dispatch), on the same SHA-NI block function. Builds
// against an OpenSSL without the deprecated API (OPENSSL_NO_DEPRECATED_3_0) use EVP. See docs/design.md.
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/evp.h>
#include <openssl/opensslconf.h>
#include <openssl/sha.h>

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

#if defined(OPENSSL_NO_DEPRECATED_3_0)
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
#endif

}  // namespace

BlockHash Sha256Hasher::hash(std::span<const std::byte> bytes) noexcept {
#if !defined(OPENSSL_NO_DEPRECATED_3_0)
  SHA256_CTX ctx;
  unsigned char full[SHA256_DIGEST_LENGTH];
  SHA256_Init(&ctx);
  SHA256_Update(&ctx, bytes.data(), bytes.size());
  SHA256_Final(full, &ctx);
  BlockHash out;
  std::memcpy(out.bytes.data(), full, out.bytes.size());
  return out;
#else
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
#endif
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
