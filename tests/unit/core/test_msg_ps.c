/*
 * The parameter server bodies of src/msg_ps.c (docs/PROTOCOL.md 8.45 to 8.50): every request
 * encodes, decodes through the opcode table, encodes again to the same bytes, refuses every
 * shorter prefix, one byte more and a reserved field that is not zero; the layouts byte by byte;
 * the fixed fields of the uploads; STALE_GRADIENT's bin state.
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
 * Decode b[0, len) as a request of op, expect kind, encode again to the same bytes, refuse every
 * shorter prefix and one trailing byte.
 */
static void round_trip(uint8_t op, const uint8_t *b, size_t len, ts__msg_kind kind)
{
    static uint8_t buf[BUF + 1], again[BUF];
    assert_true(len < BUF);
    memcpy(buf, b, len);
    ts__msg m;
    assert_int_equal(ts__msg_request_decode(op, buf, len, &m), 0);
    assert_int_equal(m.kind, kind);
    size_t n = 0;
    assert_int_equal(ts__msg_encode(&m, again, sizeof(again), &n), 0);
    assert_int_equal(n, len);
    assert_memory_equal(again, b, len);
    for (size_t k = 0; k < len; k++)
        assert_int_equal(ts__msg_request_decode(op, buf, k, &m), TS_EPROTO);
    buf[len] = 0;
    assert_int_equal(ts__msg_request_decode(op, buf, len + 1, &m), TS_EPROTO);
}

/* Every byte of b[from, to) set to 1 in turn must make the body TS_EPROTO. */
static void reserved_refused(uint8_t op, const uint8_t *b, size_t len, size_t from, size_t to)
{
    uint8_t buf[BUF];
    ts__msg m;
    for (size_t i = from; i < to; i++) {
        memcpy(buf, b, len);
        buf[i] = 1;
        assert_int_equal(ts__msg_request_decode(op, buf, len, &m), TS_EPROTO);
    }
}

static void test_ps_create(void **state)
{
    (void)state;
    uint8_t b[128];
    size_t len;
    ts__msg_ps_create_req q = {.name = (const uint8_t *)"w",
                               .name_len = 1,
                               .optimizer = TS_PS_OPT_ADAM,
                               .mode = TS_PS_MODE_SYNC,
                               .flags = TS_PS_FLAG_LR_STALENESS,
                               .sync_k = 4,
                               .tolerance = 2,
                               .lr = 0.5,
                               .beta1 = 0.25,
                               .beta2 = 2.0,
                               .eps = -1.0};
    assert_int_equal(ts__msg_ps_create_req_size(1), 2 + 48);
    assert_int_equal(ts__msg_ps_create_req_encode(b, sizeof(b), &q, &len), 0);
    assert_int_equal(len, 50);
    static const uint8_t want[50] = {0x01, 'w', 3, 1, 1, 0, 4,    0,    0,
                                     0,    2,   0, 0, 0, 0, 0,    0,    0, /* head */
                                     0,    0,   0, 0, 0, 0, 0xe0, 0x3f,    /* lr 0.5 */
                                     0,    0,   0, 0, 0, 0, 0xd0, 0x3f,    /* beta1 0.25 */
                                     0,    0,   0, 0, 0, 0, 0,    0x40,    /* beta2 2 */
                                     0,    0,   0, 0, 0, 0, 0xf0, 0xbf};   /* eps -1 */
    assert_memory_equal(b, want, 50);
    round_trip(TS_OP_PS_CREATE, b, len, TS_MSG_PS_CREATE_REQ);
    reserved_refused(TS_OP_PS_CREATE, b, len, 2 + 3, 2 + 4);
    reserved_refused(TS_OP_PS_CREATE, b, len, 2 + 12, 2 + 16);
    ts__msg m;
    assert_int_equal(ts__msg_request_decode(TS_OP_PS_CREATE, b, len, &m), 0);
    assert_true(m.u.ps_create.sync_k == 4 && m.u.ps_create.tolerance == 2 &&
                m.u.ps_create.lr == 0.5 && m.u.ps_create.eps == -1.0 &&
                m.u.ps_create.optimizer == TS_PS_OPT_ADAM && m.u.ps_create.flags == 1);
    assert_int_equal(ts__msg_ps_create_req_encode(b, 49, &q, &len), TS_EMSGSIZE);
    static uint8_t long_name[TS_MAX_NAME_LEN + 1];
    q.name = long_name;
    q.name_len = sizeof(long_name);
    assert_int_equal(ts__msg_ps_create_req_encode(b, sizeof(b), &q, &len), TS_ENAMETOOLONG);
}

static void test_emb_create(void **state)
{
    (void)state;
    uint8_t b[128];
    size_t len;
    ts__msg_ps_create_req q = {.name = (const uint8_t *)"emb",
                               .name_len = 3,
                               .dim = 64,
                               .optimizer = TS_PS_OPT_SGD,
                               .init = TS_PSW_INIT_NORMAL,
                               .seed = 0x0102030405060708ull,
                               .num_ids = 1000,
                               .lr = 1.0,
                               .init_scale = 0.5};
    assert_int_equal(ts__msg_emb_create_req_size(3), 4 + 64);
    assert_int_equal(ts__msg_emb_create_req_encode(b, sizeof(b), &q, &len), 0);
    assert_int_equal(len, 68);
    static const uint8_t head[4 + 24] = {3, 'e', 'm', 'b', 64, 0, 0,    0,    1, 2, 0, 0, 8, 7,
                                         6, 5,   4,   3,   2,  1, 0xe8, 0x03, 0, 0, 0, 0, 0, 0};
    assert_memory_equal(b, head, sizeof(head));
    assert_memory_equal(b + 28, "\0\0\0\0\0\0\xf0\x3f", 8); /* lr 1.0 */
    assert_memory_equal(b + 60, "\0\0\0\0\0\0\xe0\x3f", 8); /* init_scale 0.5 */
    round_trip(TS_OP_EMB_CREATE, b, len, TS_MSG_EMB_CREATE_REQ);
    reserved_refused(TS_OP_EMB_CREATE, b, len, 4 + 6, 4 + 8);
    ts__msg m;
    assert_int_equal(ts__msg_request_decode(TS_OP_EMB_CREATE, b, len, &m), 0);
    assert_true(m.u.ps_create.dim == 64 && m.u.ps_create.seed == 0x0102030405060708ull &&
                m.u.ps_create.num_ids == 1000 && m.u.ps_create.init == TS_PSW_INIT_NORMAL &&
                m.u.ps_create.init_scale == 0.5);
}

static void test_ps_pull(void **state)
{
    (void)state;
    uint8_t b[64];
    size_t len;
    ts__msg_ps_pull_req q = {.name = (const uint8_t *)"w", .name_len = 1, .if_newer_than = 258};
    assert_int_equal(ts__msg_ps_pull_req_encode(b, sizeof(b), &q, &len), 0);
    assert_int_equal(len, 10);
    assert_memory_equal(b, "\x01w\x02\x01\0\0\0\0\0\0", 10);
    round_trip(TS_OP_PS_PULL, b, len, TS_MSG_PS_PULL_REQ);
    q.name_len = 0;
    assert_int_equal(ts__msg_ps_pull_req_encode(b, sizeof(b), &q, &len), 0);
    round_trip(TS_OP_PS_PULL, b, len, TS_MSG_PS_PULL_REQ);
}

static void test_uploads(void **state)
{
    (void)state;
    /* The three uploads: name, fixed fields, then any record; the table says how many. */
    assert_int_equal(ts__msg_op_info(TS_OP_PS_PUSH)->upload_fixed, TS_MSG_PS_PUSH_FIXED);
    assert_int_equal(ts__msg_op_info(TS_OP_EMB_PUSH)->upload_fixed, TS_MSG_EMB_PUSH_FIXED);
    assert_int_equal(ts__msg_op_info(TS_OP_EMB_PULL)->upload_fixed, 0);
    assert_true(ts__msg_op_info(TS_OP_PS_PUSH)->upload && ts__msg_op_info(TS_OP_EMB_PULL)->upload);
    uint8_t f[TS_MSG_PS_PUSH_FIXED];
    ts__msg_ps_push_fixed p = {.base_version = 7, .scale = -0.5}, back;
    ts__msg_ps_push_fixed_encode(f, &p);
    assert_memory_equal(f, "\x07\0\0\0\0\0\0\0\0\0\0\0\0\0\xe0\xbf", 16);
    ts__msg_ps_push_fixed_decode(f, &back);
    assert_true(back.base_version == 7 && back.scale == -0.5);
    uint8_t e[TS_MSG_EMB_PUSH_FIXED];
    ts__msg_emb_push_fixed_encode(e, 2.0);
    assert_true(ts__msg_emb_push_fixed_decode(e) == 2.0);

    /* A PS_PUSH body too short for its fixed fields is BAD_REQUEST material. */
    uint8_t b[64] = {1, 'w'};
    ts__msg m;
    assert_int_equal(ts__msg_request_decode(TS_OP_PS_PUSH, b, 2 + 15, &m), TS_EPROTO);
    assert_int_equal(ts__msg_request_decode(TS_OP_PS_PUSH, b, 2 + 16, &m), 0);
    assert_int_equal(m.u.put.fixed_len, 16);
    assert_int_equal(m.u.put.rec_len, 0);
}

static void test_replies(void **state)
{
    (void)state;
    /* STALE_GRADIENT carries a bin state; other errors a message; OK bodies by the table. */
    assert_int_equal(ts__msg_reply_kind(TS_OP_PS_PUSH, TS_ST_STALE_GRADIENT), TS_MSG_BIN_STATE);
    assert_int_equal(ts__msg_reply_kind(TS_OP_PS_PUSH, TS_ST_INVALID), TS_MSG_ERROR);
    assert_int_equal(ts__msg_reply_kind(TS_OP_PS_PULL, TS_ST_STALE_GRADIENT), TS_MSG_ERROR);
    assert_int_equal(ts__msg_reply_kind(TS_OP_PS_PUSH, TS_ST_OK), TS_MSG_BIN_STATE);
    assert_int_equal(ts__msg_reply_kind(TS_OP_PS_PULL, TS_ST_OK), TS_MSG_ITEMS);
    assert_int_equal(ts__msg_reply_kind(TS_OP_EMB_PULL, TS_ST_OK), TS_MSG_ITEMS);
    assert_int_equal(ts__msg_reply_kind(TS_OP_EMB_CREATE, TS_ST_OK), TS_MSG_BIN_STATE);
    assert_int_equal(ts__status_to_err(TS_ST_STALE_GRADIENT), TS_ESTALE);
    assert_int_equal(ts__err_to_status(TS_ESTALE), TS_ST_STALE_GRADIENT);
    assert_string_equal(ts__status_name(TS_ST_STALE_GRADIENT), "STALE_GRADIENT");
    assert_string_equal(ts__op_name(TS_OP_EMB_PUSH), "EMB_PUSH");
    assert_int_equal(TS_ESTALE, -116);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ps_create), cmocka_unit_test(test_emb_create),
        cmocka_unit_test(test_ps_pull),   cmocka_unit_test(test_uploads),
        cmocka_unit_test(test_replies),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
