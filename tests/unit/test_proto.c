/* Unit tests for the frame codec and the bounded reader (src/proto.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "proto.h"

static void test_header_round_trip(void **state)
{
    (void)state;
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = TS_OP_PUT,
                 .flags = TS_FLAG_LZ4,
                 .status = 0,
                 .request_id = 0xdeadbeef,
                 .body_len = 0x0102030405060708ull};
    uint8_t buf[TS_HDR_SIZE];
    ts__hdr_encode(&h, buf);
    assert_int_equal(buf[0], TS_MAGIC_REQ);
    assert_int_equal(buf[16], 0x08);
    assert_int_equal(buf[23], 0x01);
    ts__hdr d;
    assert_int_equal(ts__hdr_decode(buf, TS_MAGIC_REQ, &d), 0);
    assert_int_equal(d.opcode, TS_OP_PUT);
    assert_int_equal(d.flags, TS_FLAG_LZ4);
    assert_int_equal(d.request_id, 0xdeadbeef);
    assert_true(d.body_len == 0x0102030405060708ull);
}

static void test_header_rejects(void **state)
{
    (void)state;
    ts__hdr h = {.magic = TS_MAGIC_REQ, .version = TS_PROTO_VERSION, .opcode = TS_OP_PING};
    uint8_t buf[TS_HDR_SIZE], bad[TS_HDR_SIZE];
    ts__hdr_encode(&h, buf);
    ts__hdr d;
    /* Wrong direction. */
    assert_int_equal(ts__hdr_decode(buf, TS_MAGIC_REP, &d), TS_EPROTO);
    /* Bad version, unknown flag, every reserved byte. */
    memcpy(bad, buf, sizeof(buf));
    bad[1] = 2;
    assert_int_equal(ts__hdr_decode(bad, TS_MAGIC_REQ, &d), TS_EPROTO);
    memcpy(bad, buf, sizeof(buf));
    bad[3] = 0x80;
    assert_int_equal(ts__hdr_decode(bad, TS_MAGIC_REQ, &d), TS_EPROTO);
    const int rsvd[] = {6, 7, 12, 13, 14, 15};
    for (size_t i = 0; i < sizeof(rsvd) / sizeof(rsvd[0]); i++) {
        memcpy(bad, buf, sizeof(buf));
        bad[rsvd[i]] = 1;
        assert_int_equal(ts__hdr_decode(bad, TS_MAGIC_REQ, &d), TS_EPROTO);
    }
}

static void test_status_map(void **state)
{
    (void)state;
    for (uint16_t st = 0; st < TS_ST_COUNT_; st++) {
        int err = ts__status_to_err(st);
        assert_true(st == TS_ST_OK ? err == 0 : err < 0);
        assert_string_not_equal(ts__status_name(st), "UNKNOWN");
    }
    assert_int_equal(ts__status_to_err(999), TS_ESERVER);
    assert_int_equal(ts__err_to_status(TS_ENOENT), TS_ST_NOT_FOUND);
    assert_int_equal(ts__status_to_err(ts__err_to_status(TS_EOOM)), TS_EOOM);
    assert_string_equal(ts_err_name(TS_ETIMEDOUT), "ETIMEDOUT");
    assert_string_equal(ts_strerror(12345), "unknown error");
}

static void test_reader_bounds(void **state)
{
    (void)state;
    uint8_t body[] = {3, 'a', 'b', 'c', 1, 0, 0};
    ts__rd r;
    ts__rd_init(&r, body, sizeof(body));
    const char *name;
    size_t len;
    assert_int_equal(ts__rd_name(&r, &name, &len), 0);
    assert_int_equal(len, 3);
    assert_memory_equal(name, "abc", 3);
    uint32_t v;
    assert_int_equal(ts__rd_u32(&r, &v), TS_EPROTO); /* only 3 bytes left */
    uint8_t b;
    assert_int_equal(ts__rd_u8(&r, &b), TS_EPROTO); /* sticky error */
    /* A name longer than the body. */
    uint8_t bad[] = {200, 'x'};
    ts__rd_init(&r, bad, sizeof(bad));
    assert_int_equal(ts__rd_name(&r, &name, &len), TS_EPROTO);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_header_round_trip),
        cmocka_unit_test(test_header_rejects),
        cmocka_unit_test(test_status_map),
        cmocka_unit_test(test_reader_bounds),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
