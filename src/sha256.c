/*
 * SHA-256 and HMAC-SHA256 (see sha256.h). A plain portable implementation: the token proof
 * hashes a few hundred bytes per connection, so speed does not matter here, clarity does.
 */
#include "sha256.h"

#include <string.h>

/* The first 32 bits of the fractional parts of the cube roots of the first 64 primes. */
static const uint32_t k_round[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u,
    0xab1c5ed5u, 0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu,
    0x9bdc06a7u, 0xc19bf174u, 0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu,
    0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau, 0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u,
    0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u, 0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu,
    0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u, 0xa2bfe8a1u, 0xa81a664bu,
    0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u, 0x19a4c116u,
    0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u,
    0xc67178f2u};

static uint32_t rotr(uint32_t x, unsigned n)
{
    return (x >> n) | (x << (32 - n));
}

static uint32_t load_be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static void store_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* One 64-byte block into the state. */
static void compress_block(uint32_t h[8], const uint8_t *block)
{
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = load_be32(block + 4 * i);
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t s1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
        uint32_t ch = (e & f) ^ (~e & g);
        uint32_t t1 = hh + s1 + ch + k_round[i] + w[i];
        uint32_t s0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
        uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
        uint32_t t2 = s0 + maj;
        hh = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a;
    h[1] += b;
    h[2] += c;
    h[3] += d;
    h[4] += e;
    h[5] += f;
    h[6] += g;
    h[7] += hh;
    ts__wipe(w, sizeof(w));
}

void ts__sha256_init(ts__sha256_ctx *s)
{
    /* The first 32 bits of the fractional parts of the square roots of the first 8 primes. */
    static const uint32_t iv[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                                   0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
    memcpy(s->h, iv, sizeof(iv));
    s->total = 0;
    s->buf_len = 0;
}

void ts__sha256_update(ts__sha256_ctx *s, const void *data, size_t len)
{
    const uint8_t *p = data;
    s->total += len;
    if (s->buf_len > 0) {
        size_t take = TS_SHA256_BLOCK - s->buf_len;
        if (take > len)
            take = len;
        memcpy(s->buf + s->buf_len, p, take);
        s->buf_len += take;
        p += take;
        len -= take;
        if (s->buf_len < TS_SHA256_BLOCK)
            return;
        compress_block(s->h, s->buf);
        s->buf_len = 0;
    }
    for (; len >= TS_SHA256_BLOCK; p += TS_SHA256_BLOCK, len -= TS_SHA256_BLOCK)
        compress_block(s->h, p);
    if (len > 0) {
        memcpy(s->buf, p, len);
        s->buf_len = len;
    }
}

void ts__sha256_final(ts__sha256_ctx *s, uint8_t out[TS_SHA256_LEN])
{
    uint64_t bits = s->total * 8;
    /* Padding: one 1 bit, zeros up to 56 bytes into a block, then the length in bits (u64 BE). */
    s->buf[s->buf_len++] = 0x80;
    if (s->buf_len > TS_SHA256_BLOCK - 8) {
        memset(s->buf + s->buf_len, 0, TS_SHA256_BLOCK - s->buf_len);
        compress_block(s->h, s->buf);
        s->buf_len = 0;
    }
    memset(s->buf + s->buf_len, 0, TS_SHA256_BLOCK - 8 - s->buf_len);
    store_be32(s->buf + 56, (uint32_t)(bits >> 32));
    store_be32(s->buf + 60, (uint32_t)bits);
    compress_block(s->h, s->buf);
    for (int i = 0; i < 8; i++)
        store_be32(out + 4 * i, s->h[i]);
    ts__wipe(s, sizeof(*s));
}

void ts__sha256(const void *data, size_t len, uint8_t out[TS_SHA256_LEN])
{
    ts__sha256_ctx s;
    ts__sha256_init(&s);
    ts__sha256_update(&s, data, len);
    ts__sha256_final(&s, out);
}

void ts__hmac256_init(ts__hmac256_ctx *m, const void *key, size_t key_len)
{
    uint8_t k[TS_SHA256_BLOCK] = {0};
    if (key_len > TS_SHA256_BLOCK)
        ts__sha256(key, key_len, k); /* RFC 2104: a longer key is replaced by its hash */
    else if (key_len > 0)
        memcpy(k, key, key_len);
    uint8_t pad[TS_SHA256_BLOCK];
    for (size_t i = 0; i < TS_SHA256_BLOCK; i++)
        pad[i] = (uint8_t)(k[i] ^ 0x36);
    ts__sha256_init(&m->inner);
    ts__sha256_update(&m->inner, pad, sizeof(pad));
    for (size_t i = 0; i < TS_SHA256_BLOCK; i++)
        pad[i] = (uint8_t)(k[i] ^ 0x5c);
    ts__sha256_init(&m->outer);
    ts__sha256_update(&m->outer, pad, sizeof(pad));
    ts__wipe(k, sizeof(k));
    ts__wipe(pad, sizeof(pad));
}

void ts__hmac256_update(ts__hmac256_ctx *m, const void *data, size_t len)
{
    ts__sha256_update(&m->inner, data, len);
}

void ts__hmac256_final(ts__hmac256_ctx *m, uint8_t out[TS_SHA256_LEN])
{
    uint8_t ih[TS_SHA256_LEN];
    ts__sha256_final(&m->inner, ih);
    ts__sha256_update(&m->outer, ih, sizeof(ih));
    ts__sha256_final(&m->outer, out);
    ts__wipe(ih, sizeof(ih));
}

void ts__hmac256(const void *key, size_t key_len, const void *data, size_t len,
                 uint8_t out[TS_SHA256_LEN])
{
    ts__hmac256_ctx m;
    ts__hmac256_init(&m, key, key_len);
    ts__hmac256_update(&m, data, len);
    ts__hmac256_final(&m, out);
}

int ts__ct_equal(const void *a, const void *b, size_t n)
{
    const volatile uint8_t *x = a, *y = b;
    uint8_t diff = 0;
    for (size_t i = 0; i < n; i++)
        diff |= (uint8_t)(x[i] ^ y[i]);
    return diff == 0;
}

void ts__wipe(void *p, size_t n)
{
    /* Stores through a volatile pointer are observable behaviour: the compiler keeps them. */
    volatile uint8_t *q = p;
    for (size_t i = 0; i < n; i++)
        q[i] = 0;
}
