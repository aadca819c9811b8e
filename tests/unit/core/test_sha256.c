/*
 * Unit tests for SHA-256 and HMAC-SHA256 (src/sha256.c) against the published test vectors:
 * FIPS 180-2 appendix B (SHA-256) and RFC 4231 section 4 (HMAC-SHA256).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "sha256.h"

/* The lowercase hex of a digest. */
static void hex(const uint8_t d[TS_SHA256_LEN], char out[2 * TS_SHA256_LEN + 1])
{
    for (size_t i = 0; i < TS_SHA256_LEN; i++)
        snprintf(out + 2 * i, 3, "%02x", d[i]);
}

static void check_sha(const void *data, size_t len, const char *want)
{
    uint8_t d[TS_SHA256_LEN];
    char h[2 * TS_SHA256_LEN + 1];
    ts__sha256(data, len, d);
    hex(d, h);
    assert_string_equal(h, want);
    /* The same bytes fed in uneven pieces (1, 2, 3... bytes) give the same digest. */
    ts__sha256_ctx s;
    ts__sha256_init(&s);
    const uint8_t *p = data;
    for (size_t off = 0, step = 1; off < len; off += step, step++)
        ts__sha256_update(&s, p + off, step < len - off ? step : len - off);
    ts__sha256_final(&s, d);
    hex(d, h);
    assert_string_equal(h, want);
}

static void test_sha256_fips(void **state)
{
    (void)state;
    check_sha("abc", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    check_sha("", 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    const char *two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    check_sha(two, strlen(two), "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    /* One million 'a': many blocks, and a length whose padding needs a block of its own. */
    static uint8_t million[1000000];
    memset(million, 'a', sizeof(million));
    check_sha(million, sizeof(million),
              "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

/* Lengths around the padding boundary (55, 56, 63, 64 bytes), against values from sha256sum. */
static void test_sha256_boundaries(void **state)
{
    (void)state;
    uint8_t a[64];
    memset(a, 'a', sizeof(a));
    check_sha(a, 55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
    check_sha(a, 56, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
    check_sha(a, 63, "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34");
    check_sha(a, 64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");
}

static void check_hmac(const void *key, size_t klen, const void *data, size_t dlen,
                       const char *want)
{
    uint8_t d[TS_SHA256_LEN];
    char h[2 * TS_SHA256_LEN + 1];
    ts__hmac256(key, klen, data, dlen, d);
    hex(d, h);
    assert_string_equal(h, want);
}

static void test_hmac_rfc4231(void **state)
{
    (void)state;
    uint8_t k[131];
    uint8_t d[50];
    /* Test case 1. */
    memset(k, 0x0b, 20);
    check_hmac(k, 20, "Hi There", 8,
               "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
    /* Test case 2: a key shorter than the output. */
    check_hmac("Jefe", 4, "what do ya want for nothing?", 28,
               "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    /* Test case 3. */
    memset(k, 0xaa, 20);
    memset(d, 0xdd, 50);
    check_hmac(k, 20, d, 50, "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
    /* Test case 6: a key longer than a block is hashed first. */
    memset(k, 0xaa, sizeof(k));
    const char *t6 = "Test Using Larger Than Block-Size Key - Hash Key First";
    check_hmac(k, sizeof(k), t6, strlen(t6),
               "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    /* Test case 7: key and data both longer than a block. */
    const char *t7 = "This is a test using a larger than block-size key and a larger than "
                     "block-size data. The key needs to be hashed before being used by the HMAC "
                     "algorithm.";
    check_hmac(k, sizeof(k), t7, strlen(t7),
               "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
}

static void test_ct_equal(void **state)
{
    (void)state;
    uint8_t a[32] = {1, 2, 3}, b[32] = {1, 2, 3};
    assert_true(ts__ct_equal(a, b, sizeof(a)));
    b[31] ^= 1;
    assert_false(ts__ct_equal(a, b, sizeof(a)));
    assert_true(ts__ct_equal(a, b, 0));
    ts__wipe(a, sizeof(a));
    for (size_t i = 0; i < sizeof(a); i++)
        assert_int_equal(a[i], 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sha256_fips),
        cmocka_unit_test(test_sha256_boundaries),
        cmocka_unit_test(test_hmac_rfc4231),
        cmocka_unit_test(test_ct_equal),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
