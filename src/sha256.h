/*
 * SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), written here so that the token proof of the
 * HELLO handshake (docs/PROTOCOL.md section 4) needs no cryptographic library: a build without
 * OpenSSL still never sends the token in clear. Pure functions on caller memory; thread-safe.
 */
#ifndef TS_SHA256_H
#define TS_SHA256_H

#include <stddef.h>
#include <stdint.h>

#define TS_SHA256_LEN   32 /* bytes of a digest */
#define TS_SHA256_BLOCK 64 /* bytes of a compression block (HMAC pads keys to this) */

/* An incremental hash: init, any number of updates, final. No allocation. */
typedef struct ts__sha256_ctx {
    uint32_t h[8];
    uint64_t total; /* bytes hashed so far */
    uint8_t buf[TS_SHA256_BLOCK];
    size_t buf_len;
} ts__sha256_ctx;

void ts__sha256_init(ts__sha256_ctx *s);
void ts__sha256_update(ts__sha256_ctx *s, const void *data, size_t len);
/* Write the digest to out and wipe s. */
void ts__sha256_final(ts__sha256_ctx *s, uint8_t out[TS_SHA256_LEN]);
/* The digest of len bytes at data. */
void ts__sha256(const void *data, size_t len, uint8_t out[TS_SHA256_LEN]);

/* An incremental HMAC-SHA256: the key may have any length (a longer one is hashed first). */
typedef struct ts__hmac256_ctx {
    ts__sha256_ctx inner, outer;
} ts__hmac256_ctx;

void ts__hmac256_init(ts__hmac256_ctx *m, const void *key, size_t key_len);
void ts__hmac256_update(ts__hmac256_ctx *m, const void *data, size_t len);
/* Write the tag to out and wipe m. */
void ts__hmac256_final(ts__hmac256_ctx *m, uint8_t out[TS_SHA256_LEN]);
/* The tag of len bytes at data under key. */
void ts__hmac256(const void *key, size_t key_len, const void *data, size_t len,
                 uint8_t out[TS_SHA256_LEN]);

/* 1 when the n bytes at a and b are equal; the time taken does not depend on where they differ. */
int ts__ct_equal(const void *a, const void *b, size_t n);

/* Overwrite n bytes at p with zeros in a way the compiler may not drop (secrets, keys). */
void ts__wipe(void *p, size_t n);

#endif /* TS_SHA256_H */
