/*
 * The coordination bodies of src/msg_coord.c (docs/PROTOCOL.md 8.39 to 8.43): every body
 * encodes, decodes through the opcode table, encodes again to the same bytes, refuses every
 * shorter prefix and one byte more; plus the layouts byte by byte and the value limits.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdlib.h>

#include "msg.h"

/* bytes; room for every body these tests build */
#define BUF 4096

/*
 * Decode b[0, len) as a request (reply = 0) or reply with status of op, expect kind, encode
 * again to the same bytes, and refuse every prefix shorter than prefix_ok_from and (but for an
 * upload) one trailing byte.
 */
static void round_trip(uint8_t op, int reply, uint16_t status, const uint8_t *b, size_t len,
                       ts__msg_kind kind, size_t prefix_ok_from)
{
    static uint8_t buf[BUF + 1], again[BUF];
    assert_true(len < BUF);
    memcpy(buf, b, len);
    ts__msg m;
    int rc = reply ? ts__msg_reply_decode(op, status, buf, len, &m)
                   : ts__msg_request_decode(op, buf, len, &m);
    assert_int_equal(rc, 0);
    assert_int_equal(m.kind, kind);
    size_t n = 0;
    assert_int_equal(ts__msg_encode(&m, again, sizeof(again), &n), 0);
    assert_int_equal(n, len);
    assert_memory_equal(again, b, len);
    for (size_t k = 0; k < len; k++) {
        rc = reply ? ts__msg_reply_decode(op, status, buf, k, &m)
                   : ts__msg_request_decode(op, buf, k, &m);
        /* An upload's record may be any length: prefixes that hold the head decode. */
        assert_int_equal(rc, k >= prefix_ok_from ? 0 : TS_EPROTO);
    }
    buf[len] = 0;
    rc = reply ? ts__msg_reply_decode(op, status, buf, len + 1, &m)
               : ts__msg_request_decode(op, buf, len + 1, &m);
    if (kind != TS_MSG_PUT_REQ)
        assert_int_equal(rc, TS_EPROTO);
}

static void test_add(void **state)
{
    (void)state;
    uint8_t b[64];
    size_t len;
    ts__msg_coord_req q = {.name = (const uint8_t *)"ctr", .name_len = 3, .delta = -2};
    assert_int_equal(ts__msg_add_req_size(3), 12);
    assert_int_equal(ts__msg_add_req_encode(b, sizeof(b), &q, &len), 0);
    assert_int_equal(len, 12);
    assert_memory_equal(b,
                        "\x03"
                        "ctr"
                        "\xfe\xff\xff\xff\xff\xff\xff\xff",
                        12);
    round_trip(TS_OP_ADD, 0, 0, b, len, TS_MSG_ADD_REQ, SIZE_MAX);
    ts__msg m;
    assert_int_equal(ts__msg_request_decode(TS_OP_ADD, b, len, &m), 0);
    assert_true(m.u.coord.delta == -2 && m.u.coord.name_len == 3);
    assert_int_equal(ts__msg_add_req_encode(b, 11, &q, &len), TS_EMSGSIZE);
    static uint8_t long_name[TS_MAX_NAME_LEN + 1];
    q.name = long_name;
    q.name_len = sizeof(long_name);
    assert_int_equal(ts__msg_add_req_encode(b, sizeof(b), &q, &len), TS_ENAMETOOLONG);

    ts__msg_add_state st = {.value = INT64_MIN, .version = 77};
    assert_int_equal(ts__msg_add_state_encode(b, sizeof(b), &st, &len), 0);
    assert_int_equal(len, TS_MSG_ADD_STATE_SIZE);
    assert_memory_equal(b,
                        "\0\0\0\0\0\0\0\x80"
                        "\x4d\0\0\0\0\0\0\0",
                        16);
    round_trip(TS_OP_ADD, 1, TS_ST_OK, b, len, TS_MSG_ADD_STATE, SIZE_MAX);
    assert_true(ts__msg_reply_limit(TS_OP_ADD, TS_ST_OK, 1u << 20) == TS_MSG_ADD_STATE_SIZE);
    assert_int_equal(ts__msg_add_state_encode(b, 15, &st, &len), TS_EMSGSIZE);
}

static void test_put_if(void **state)
{
    (void)state;
    /* name "k", expected version 5, then a (not validated here) record of 16 bytes */
    static const uint8_t fx[8] = {5, 0, 0, 0, 0, 0, 0, 0};
    static const uint8_t rec[16] = {'T', 'S', 'R', 1};
    uint8_t b[64];
    size_t len;
    assert_int_equal(ts__msg_upload_encode(b, sizeof(b), (const uint8_t *)"k", 1, fx,
                                           TS_MSG_PUT_IF_FIXED, rec, sizeof(rec), &len),
                     0);
    assert_int_equal(len, 26);
    ts__msg m;
    assert_int_equal(ts__msg_request_decode(TS_OP_PUT_IF, b, len, &m), 0);
    assert_int_equal(m.kind, TS_MSG_PUT_REQ);
    assert_true(m.u.put.fixed_len == 8 && ts__get_u64le(m.u.put.fixed) == 5);
    assert_true(m.u.put.rec_len == 16 && m.u.put.record == b + 10);
    round_trip(TS_OP_PUT_IF, 0, 0, b, len, TS_MSG_PUT_REQ, 10);
    /* A body ending inside the version is malformed. */
    assert_int_equal(ts__msg_request_decode(TS_OP_PUT_IF, b, 9, &m), TS_EPROTO);
    assert_int_equal(ts__msg_request_decode(TS_OP_PUT_IF, b, 10, &m), 0);
    /* The reply: a BIN_STATE for OK and for VERSION_MISMATCH. */
    assert_int_equal(ts__msg_reply_kind(TS_OP_PUT_IF, TS_ST_OK), TS_MSG_BIN_STATE);
    assert_int_equal(ts__msg_reply_kind(TS_OP_PUT_IF, TS_ST_VERSION_MISMATCH), TS_MSG_BIN_STATE);
    assert_int_equal(ts__msg_reply_kind(TS_OP_PUT_IF, TS_ST_INVALID), TS_MSG_ERROR);
    assert_int_equal(ts__msg_reply_kind(TS_OP_PUT, TS_ST_VERSION_MISMATCH), TS_MSG_ERROR);
    assert_true(ts__msg_reply_limit(TS_OP_PUT_IF, TS_ST_VERSION_MISMATCH, 1u << 20) ==
                TS_BIN_STATE_SIZE);
    assert_int_equal(ts__msg_bin_state_encode(b, sizeof(b), 9, 1, &len), 0);
    round_trip(TS_OP_PUT_IF, 1, TS_ST_VERSION_MISMATCH, b, len, TS_MSG_BIN_STATE, SIZE_MAX);
    /* The status maps to its own error code and back. */
    assert_int_equal(ts__status_to_err(TS_ST_VERSION_MISMATCH), TS_ECONFLICT);
    assert_int_equal(ts__err_to_status(TS_ECONFLICT), TS_ST_VERSION_MISMATCH);
    assert_string_equal(ts__status_name(TS_ST_VERSION_MISMATCH), "VERSION_MISMATCH");
    assert_string_equal(ts__op_name(TS_OP_ADD), "ADD");
    assert_string_equal(ts__op_name(TS_OP_PUT_IF), "PUT_IF");
    /* Upload limits apply: max_frame, not the control limit. */
    assert_true(ts__msg_request_limit(TS_OP_PUT_IF, 1, (uint64_t)1 << 30) == (uint64_t)1 << 30);
    assert_true(ts__msg_request_limit(TS_OP_ADD, 1, (uint64_t)1 << 30) == TS_MAX_CTRL_BODY);
}

static void test_take_barrier(void **state)
{
    (void)state;
    uint8_t b[64];
    size_t len;
    ts__msg_coord_req q = {
        .name = (const uint8_t *)"q", .name_len = 1, .count = 2, .timeout_ms = 0x01020304};
    assert_int_equal(ts__msg_take_req_size(1), 10);
    assert_int_equal(ts__msg_take_req_encode(b, sizeof(b), &q, &len), 0);
    assert_memory_equal(b, "\x01q\x02\0\0\0\x04\x03\x02\x01", 10);
    round_trip(TS_OP_TAKE, 0, 0, b, len, TS_MSG_TAKE_REQ, SIZE_MAX);
    assert_int_equal(ts__msg_barrier_req_encode(b, sizeof(b), &q, &len), 0);
    round_trip(TS_OP_BARRIER, 0, 0, b, len, TS_MSG_BARRIER_REQ, SIZE_MAX);
    ts__msg_barrier_state bs = {.generation = 3, .parties = 64};
    assert_int_equal(ts__msg_barrier_state_encode(b, sizeof(b), &bs, &len), 0);
    assert_memory_equal(b, "\x03\0\0\0\0\0\0\0\x40\0\0\0\0\0\0\0", 16);
    round_trip(TS_OP_BARRIER, 1, TS_ST_OK, b, len, TS_MSG_BARRIER_STATE, SIZE_MAX);
    b[12] = 1; /* reserved */
    ts__msg m;
    assert_int_equal(ts__msg_reply_decode(TS_OP_BARRIER, TS_ST_OK, b, 16, &m), TS_EPROTO);
    /* TAKE's OK reply is ITEMS; its TIMEOUT carries a message, as every error. */
    assert_int_equal(ts__msg_reply_kind(TS_OP_TAKE, TS_ST_OK), TS_MSG_ITEMS);
    assert_int_equal(ts__msg_reply_kind(TS_OP_TAKE, TS_ST_TIMEOUT), TS_MSG_ERROR);
    assert_int_equal(ts__msg_reply_kind(TS_OP_BARRIER, TS_ST_TIMEOUT), TS_MSG_ERROR);
}

static void test_mget(void **state)
{
    (void)state;
    static uint8_t b[BUF];
    size_t len;
    const uint8_t *names[2] = {(const uint8_t *)"a", (const uint8_t *)"bc"};
    size_t lens[2] = {1, 2};
    assert_int_equal(ts__msg_mget_req_size(2, lens), 13);
    assert_int_equal(ts__msg_mget_req_encode(b, sizeof(b), 2, 5, names, lens, &len), 0);
    assert_memory_equal(b,
                        "\x02\0\0\0\x05\0\0\0\x01"
                        "a\x02"
                        "bc",
                        13);
    round_trip(TS_OP_MGET, 0, 0, b, len, TS_MSG_MGET_REQ, SIZE_MAX);
    ts__msg m;
    assert_int_equal(ts__msg_request_decode(TS_OP_MGET, b, len, &m), 0);
    size_t off = 0, nl;
    const uint8_t *nm;
    assert_int_equal(ts__msg_mget_req_next(&m.u.mget_req, &off, &nm, &nl), 1);
    assert_true(nl == 1 && nm[0] == 'a');
    assert_int_equal(ts__msg_mget_req_next(&m.u.mget_req, &off, &nm, &nl), 1);
    assert_true(nl == 2 && nm[1] == 'c');
    assert_int_equal(ts__msg_mget_req_next(&m.u.mget_req, &off, &nm, &nl), 0);
    /* n 0 and n over the limit are malformed; encoders refuse them. */
    ts__put_u32le(b, 0);
    assert_int_equal(ts__msg_request_decode(TS_OP_MGET, b, len, &m), TS_EPROTO);
    ts__put_u32le(b, TS_MGET_MAX_NAMES + 1);
    assert_int_equal(ts__msg_request_decode(TS_OP_MGET, b, len, &m), TS_EPROTO);
    assert_int_equal(ts__msg_mget_req_encode(b, sizeof(b), 0, 0, names, lens, &len), TS_EINVAL);

    /* A reply: bin 0 found with one 16-byte record, bin 1 missing, bin 2 found and empty. */
    static const uint8_t rec[16] = {'T', 'S', 'R', 1};
    const uint8_t *recs[1] = {rec};
    uint64_t rl[1] = {16};
    uint8_t blk0[256], blk2[128];
    size_t l0, l2;
    assert_int_equal(ts__msg_items_encode(blk0, sizeof(blk0), 9, 0, 1, recs, rl, &l0), 0);
    assert_int_equal(ts__msg_items_encode(blk2, sizeof(blk2), 4, 0, 0, NULL, NULL, &l2), 0);
    uint8_t found[3] = {TS_MGET_FOUND, TS_MGET_MISSING, TS_MGET_FOUND};
    uint64_t blens[3] = {l0, 0, l2};
    size_t hl;
    assert_int_equal(ts__msg_mget_head_encode(b, sizeof(b), 3, found, blens, &hl), 0);
    assert_int_equal(hl, 64);
    memcpy(b + hl, blk0, l0);
    memcpy(b + hl + l0, blk2, l2);
    len = hl + l0 + l2;
    assert_int_equal(len % 64, 0);
    round_trip(TS_OP_MGET, 1, TS_ST_OK, b, len, TS_MSG_MGET_REP, SIZE_MAX);
    assert_int_equal(ts__msg_reply_decode(TS_OP_MGET, TS_ST_OK, b, len, &m), 0);
    int f;
    ts__msg_items it;
    ts__msg_mget_rep_get(&m.u.mget_rep, 0, &f, &it);
    assert_true(f && it.version == 9 && it.n_items == 1);
    ts__msg_mget_rep_get(&m.u.mget_rep, 1, &f, &it);
    assert_false(f);
    ts__msg_mget_rep_get(&m.u.mget_rep, 2, &f, &it);
    assert_true(f && it.version == 4 && it.n_items == 0);
    /* A missing bin with a block, and a block that is not a multiple of 64, are refused. */
    blens[1] = 64;
    assert_int_equal(ts__msg_mget_head_encode(b, sizeof(b), 3, found, blens, &hl), TS_EINVAL);
    blens[1] = 0;
    blens[0] = l0 + 1;
    assert_int_equal(ts__msg_mget_head_encode(b, sizeof(b), 3, found, blens, &hl), TS_EINVAL);
    assert_true(ts__msg_reply_limit(TS_OP_MGET, TS_ST_OK, 12345) == 12345);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_add),
        cmocka_unit_test(test_put_if),
        cmocka_unit_test(test_take_barrier),
        cmocka_unit_test(test_mget),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
