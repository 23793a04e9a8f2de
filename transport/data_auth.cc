#include "transport/data_auth.h"

#include <sodium.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace conveyor::transport::auth {

namespace {

void ensure_sodium() {
  // sodium_init is idempotent and thread-safe; it fails only without a source of randomness.
  static const bool ready = sodium_init() >= 0;
  if (!ready) std::abort();
}

// HMAC-SHA256(key, label | sender id | receiver id | receiver nonce | sender nonce).
Key handshake_hmac(const Key& key, std::string_view label, const Handshake& h) {
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, key.data(), key.size());
  crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char*>(label.data()), label.size());
  crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char*>(&h.sender_id), sizeof(h.sender_id));
  crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char*>(&h.receiver_id), sizeof(h.receiver_id));
  crypto_auth_hmacsha256_update(&st, h.receiver_nonce.data(), h.receiver_nonce.size());
  crypto_auth_hmacsha256_update(&st, h.sender_nonce.data(), h.sender_nonce.size());
  Key out{};
  crypto_auth_hmacsha256_final(&st, out.data());
  return out;
}

}  // namespace

Key derive_key(std::string_view secret) {
  ensure_sodium();
  static constexpr std::string_view kLabel = "conveyor data plane v1";
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, reinterpret_cast<const unsigned char*>(secret.data()), secret.size());
  crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char*>(kLabel.data()), kLabel.size());
  Key out{};
  crypto_auth_hmacsha256_final(&st, out.data());
  return out;
}

Nonce random_nonce() {
  ensure_sodium();
  Nonce n{};
  randombytes_buf(n.data(), n.size());
  return n;
}

Proof hello_proof(const Key& key, const Handshake& h) { return handshake_hmac(key, "hello", h); }

Key session_key(const Key& key, const Handshake& h) { return handshake_hmac(key, "session", h); }

Mac message_mac(const Key& session, std::span<const std::span<const std::byte>> parts) {
  crypto_generichash_state st;
  crypto_generichash_init(&st, session.data(), session.size(), sizeof(Mac));
  for (const auto& part : parts)
    crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(part.data()), part.size());
  Mac out{};
  crypto_generichash_final(&st, out.data(), out.size());
  return out;
}

bool equal(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b) {
  return a.size() == b.size() && sodium_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace conveyor::transport::auth
