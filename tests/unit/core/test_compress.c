/* Unit tests for the lz4 body framing (src/compress.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "compress.h"

/* A deterministic pseudo-random byte stream (xorshift64), so failures reproduce. */
static void fill_random(uint8_t *p, size_t n, uint64_t seed)
{
    uint64_t x = seed | 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p[i] = (uint8_t)(x >> 24);
    }
}

/* Compressible data: runs of a few symbols, like the zero-heavy tensors that benefit. */
static void fill_compressible(uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)((i / 97) % 5 == 0 ? i % 7 : 0);
}

/* Compress src, check the body's framing, decompress it and compare. */
static void round_trip(const uint8_t *src, size_t len)
{
    size_t cap = ts__lz4_bound(len);
    assert_true(cap > TS_LZ4_PREFIX);
    uint8_t *body = ts__malloc(cap);
    assert_non_null(body);
    size_t blen = 0;
    assert_int_equal(ts__lz4_compress(src, len, body, cap, &blen), 0);
    assert_true(blen > TS_LZ4_PREFIX);
    assert_true(blen <= len - len / 16); /* the promised saving */
    uint64_t raw = 0;
    assert_int_equal(ts__lz4_raw_len(body, blen, &raw), 0);
    assert_true(raw == len);
    assert_true(ts__get_u64le(body) == len); /* the prefix is a plain little-endian u64 */
    uint8_t *out = ts__malloc(len);
    assert_non_null(out);
    assert_int_equal(ts__lz4_decompress(body, blen, out, len), 0);
    assert_memory_equal(out, src, len);
    ts__free(out);
    ts__free(body);
}

static void test_round_trip(void **state)
{
    (void)state;
    const size_t sizes[] = {64, 1000, 4096, 65536, 1u << 20, (3u << 20) + 17};
    for (size_t i = 0; i < TS__ARRAY_SIZE(sizes); i++) {
        uint8_t *src = ts__malloc(sizes[i]);
        assert_non_null(src);
        fill_compressible(src, sizes[i]);
        round_trip(src, sizes[i]);
        memset(src, 0, sizes[i]);
        round_trip(src, sizes[i]);
        ts__free(src);
    }
}

static void test_incompressible_is_eagain(void **state)
{
    (void)state;
    const size_t sizes[] = {0, 1, 15, 100, 4096, 1u << 20};
    for (size_t i = 0; i < TS__ARRAY_SIZE(sizes); i++) {
        size_t len = sizes[i];
        uint8_t *src = ts__malloc(len);
        assert_non_null(src);
        fill_random(src, len, 0x1234 + i);
        size_t cap = ts__lz4_bound(len);
        uint8_t *body = ts__malloc(cap);
        assert_non_null(body);
        size_t blen = 12345;
        assert_int_equal(ts__lz4_compress(src, len, body, cap, &blen), TS_EAGAIN);
        assert_int_equal(blen, 12345); /* out-parameter untouched on failure */
        ts__free(body);
        ts__free(src);
    }
}

/* A saving below 1/16 of the input is not worth a compressed frame: TS_EAGAIN, send it raw. */
static void test_small_saving_is_eagain(void **state)
{
    (void)state;
    const size_t len = 65536;
    uint8_t *src = ts__malloc(len);
    uint8_t *body = ts__malloc(ts__lz4_bound(len));
    assert_non_null(src);
    assert_non_null(body);
    /* Random data with 1/32 of it zeroed: lz4 saves a little, but far less than 1/16. */
    fill_random(src, len, 99);
    memset(src + len / 2, 0, len / 32);
    size_t blen;
    assert_int_equal(ts__lz4_compress(src, len, body, ts__lz4_bound(len), &blen), TS_EAGAIN);
    /* With 1/4 zeroed the saving is well above the threshold. */
    memset(src, 0, len / 4);
    assert_int_equal(ts__lz4_compress(src, len, body, ts__lz4_bound(len), &blen), 0);
    ts__free(body);
    ts__free(src);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    uint8_t src[256] = {0};
    uint8_t body[512];
    size_t blen;
    /* No room for the prefix. */
    assert_int_equal(ts__lz4_compress(src, sizeof(src), body, TS_LZ4_PREFIX - 1, &blen), TS_EINVAL);
    /* Room for the prefix but not for the block: the block cannot be written, send it raw. */
    assert_int_equal(ts__lz4_compress(src, sizeof(src), body, TS_LZ4_PREFIX + 1, &blen), TS_EAGAIN);
    /* Inputs beyond what lz4 takes have no bound. */
    assert_int_equal(ts__lz4_bound((size_t)0x7E000000 + 1), 0);
    assert_true(ts__lz4_bound(0) > TS_LZ4_PREFIX);
    /* A body shorter than its prefix. */
    uint64_t raw;
    for (size_t n = 0; n < TS_LZ4_PREFIX; n++)
        assert_int_equal(ts__lz4_raw_len(body, n, &raw), TS_EPROTO);
    uint8_t out[1];
    assert_int_equal(ts__lz4_decompress(body, 7, out, 0), TS_EPROTO);
}

/* Build a compressed body of len compressible bytes; the caller frees *body. */
static size_t make_body(size_t len, uint8_t **src, uint8_t **body)
{
    *src = ts__malloc(len);
    assert_non_null(*src);
    fill_compressible(*src, len);
    *body = ts__malloc(ts__lz4_bound(len));
    assert_non_null(*body);
    size_t blen;
    assert_int_equal(ts__lz4_compress(*src, len, *body, ts__lz4_bound(len), &blen), 0);
    return blen;
}

static void test_wrong_announced_length(void **state)
{
    (void)state;
    const size_t len = 8192;
    uint8_t *src, *body;
    size_t blen = make_body(len, &src, &body);
    uint8_t *out = ts__malloc(len + 1);
    assert_non_null(out);
    /* The destination must be exactly the announced length. */
    assert_int_equal(ts__lz4_decompress(body, blen, out, len - 1), TS_EPROTO);
    assert_int_equal(ts__lz4_decompress(body, blen, out, len + 1), TS_EPROTO);
    /* The announced length must be what the block really holds, in both directions. */
    ts__put_u64le(body, len + 1);
    assert_int_equal(ts__lz4_decompress(body, blen, out, len + 1), TS_EPROTO);
    ts__put_u64le(body, len - 1);
    assert_int_equal(ts__lz4_decompress(body, blen, out, len - 1), TS_EPROTO);
    /* An absurd announced length is refused before lz4 sees it. */
    ts__put_u64le(body, UINT64_MAX);
    assert_int_equal(ts__lz4_decompress(body, blen, out, len), TS_EPROTO);
    ts__put_u64le(body, len);
    assert_int_equal(ts__lz4_decompress(body, blen, out, len), 0);
    assert_memory_equal(out, src, len);
    ts__free(out);
    ts__free(body);
    ts__free(src);
}

static void test_corrupt_block(void **state)
{
    (void)state;
    const size_t len = 8192;
    uint8_t *src, *body;
    size_t blen = make_body(len, &src, &body);
    uint8_t *out = ts__malloc(len);
    assert_non_null(out);
    /* Every truncation of the block is refused. */
    for (size_t cut = TS_LZ4_PREFIX; cut < blen; cut++)
        assert_int_equal(ts__lz4_decompress(body, cut, out, len), TS_EPROTO);
    /* Trailing garbage after the block is refused too. */
    uint8_t *longer = ts__malloc(blen + 1);
    assert_non_null(longer);
    memcpy(longer, body, blen);
    longer[blen] = 0x42;
    assert_int_equal(ts__lz4_decompress(longer, blen + 1, out, len), TS_EPROTO);
    ts__free(longer);
    /* A first token that claims a match before the start of the output is refused. */
    uint8_t bad[TS_LZ4_PREFIX + 4];
    ts__put_u64le(bad, 64);
    bad[8] = 0x0F; /* no literals, match length 4 + 15 + ... */
    bad[9] = 0xFF; /* offset 0xFFFF: nothing to copy from */
    bad[10] = 0xFF;
    bad[11] = 0x00;
    assert_int_equal(ts__lz4_decompress(bad, sizeof(bad), out, 64), TS_EPROTO);
    /* Single-byte corruption may still decode (lz4 has no checksum), but never out of bounds. */
    int refused = 0;
    for (size_t i = TS_LZ4_PREFIX; i < blen; i++) {
        uint8_t saved = body[i];
        body[i] ^= 0xA5;
        int rc = ts__lz4_decompress(body, blen, out, len);
        assert_true(rc == 0 || rc == TS_EPROTO);
        refused += rc != 0;
        body[i] = saved;
    }
    assert_true(refused > 0);
    ts__free(out);
    ts__free(body);
    ts__free(src);
}

/* An empty raw body is a valid (if pointless) compressed body: one empty-literal token. */
static void test_empty_block(void **state)
{
    (void)state;
    uint8_t body[TS_LZ4_PREFIX + 1] = {0};
    uint8_t out[1];
    assert_int_equal(ts__lz4_decompress(body, sizeof(body), out, 0), 0);
    ts__put_u64le(body, 1);
    assert_int_equal(ts__lz4_decompress(body, sizeof(body), out, 1), TS_EPROTO);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_incompressible_is_eagain),
        cmocka_unit_test(test_small_saving_is_eagain),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_wrong_announced_length),
        cmocka_unit_test(test_corrupt_block),
        cmocka_unit_test(test_empty_block),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
