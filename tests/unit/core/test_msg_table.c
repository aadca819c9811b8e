/*
 * Unit tests for the replay table bodies (src/msg_table.c, docs/PROTOCOL.md 8.33 to 8.38): every
 * request and reply both ways through the opcode table, every prefix refused, one byte more
 * refused, the strictness rules (reserved fields, n against the limits and the body, padding).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>

#include "msg.h"

#define BUF 4096

/* Decode body (op's request or OK reply), re-encode it, compare; then every prefix and +1 fail. */
static void round_trip(int request, uint8_t op, const uint8_t *b, size_t len)
{
    ts__msg m;
    int rc = request ? ts__msg_request_decode(op, b, len, &m)
                     : ts__msg_reply_decode(op, TS_ST_OK, b, len, &m);
    assert_int_equal(rc, 0);
    uint8_t out[BUF];
    size_t olen = 0;
    assert_int_equal(ts__msg_encode(&m, out, sizeof(out), &olen), 0);
    assert_int_equal(olen, len);
    assert_memory_equal(out, b, len);
    uint8_t *copy = malloc(len + 1);
    assert_non_null(copy);
    memcpy(copy, b, len);
    copy[len] = 0;
    for (size_t k = 0; k < len; k++) {
        rc = request ? ts__msg_request_decode(op, copy, k, &m)
                     : ts__msg_reply_decode(op, TS_ST_OK, copy, k, &m);
        assert_int_equal(rc, TS_EPROTO);
    }
    rc = request ? ts__msg_request_decode(op, copy, len + 1, &m)
                 : ts__msg_reply_decode(op, TS_ST_OK, copy, len + 1, &m);
    assert_int_equal(rc, TS_EPROTO);
    free(copy);
}

static void test_create(void **state)
{
    (void)state;
    ts__msg_table_create_req m = {.name = (const uint8_t *)"replay",
                                  .name_len = 6,
                                  .capacity = 1000,
                                  .min_size_to_sample = 10,
                                  .samples_per_insert = 4.0,
                                  .error_buffer = 8.0,
                                  .priority_exponent = 0.6,
                                  .max_times_sampled = 3,
                                  .remover = TS_TABLE_REMOVER_LOWEST,
                                  .sampler = TS_TABLE_SAMPLER_PRIORITIZED};
    uint8_t b[BUF];
    size_t len = 0;
    assert_int_equal(ts__msg_table_create_req_encode(b, sizeof(b), &m, &len), 0);
    assert_int_equal(len, 1 + 6 + TS_MSG_TABLE_CREATE_FIXED);
    round_trip(1, TS_OP_TABLE_CREATE, b, len);
    ts__msg d;
    assert_int_equal(ts__msg_request_decode(TS_OP_TABLE_CREATE, b, len, &d), 0);
    assert_true(d.u.table_create.priority_exponent == 0.6);
    assert_int_equal(d.u.table_create.sampler, TS_TABLE_SAMPLER_PRIORITIZED);
    /* The reserved u16 must be zero; a short buffer is refused before writing. */
    b[len - 1] = 1;
    assert_int_equal(ts__msg_request_decode(TS_OP_TABLE_CREATE, b, len, &d), TS_EPROTO);
    assert_int_equal(ts__msg_table_create_req_encode(b, len - 1, &m, &len), TS_EMSGSIZE);
}

static void test_sample_and_keys(void **state)
{
    (void)state;
    uint8_t b[BUF];
    size_t len = 0;
    ts__msg_table_sample_req s = {
        .name = (const uint8_t *)"t", .name_len = 1, .n = 7, .timeout_ms = 250};
    assert_int_equal(ts__msg_table_sample_req_encode(b, sizeof(b), &s, &len), 0);
    round_trip(1, TS_OP_TABLE_SAMPLE, b, len);

    uint64_t keys[TS_TABLE_MAX_KEYS];
    double prio[TS_TABLE_MAX_KEYS];
    for (uint32_t i = 0; i < TS_TABLE_MAX_KEYS; i++) {
        keys[i] = 1000 + i;
        prio[i] = i * 0.5;
    }
    char name[256];
    memset(name, 'n', 255);
    assert_int_equal(ts__msg_table_keys_req_encode(b, sizeof(b), (const uint8_t *)name, 255,
                                                   TS_TABLE_MAX_KEYS, keys, prio, &len),
                     0);
    assert_true(len <= TS_MAX_CTRL_BODY);
    round_trip(1, TS_OP_TABLE_UPDATE, b, len);
    ts__msg d;
    assert_int_equal(ts__msg_request_decode(TS_OP_TABLE_UPDATE, b, len, &d), 0);
    uint64_t k;
    double p;
    ts__msg_table_key_at(&d.u.table_keys, 3, &k, &p);
    assert_int_equal(k, 1003);
    assert_true(p == 1.5);
    assert_int_equal(ts__msg_table_keys_req_encode(b, sizeof(b), (const uint8_t *)"t", 1,
                                                   TS_TABLE_MAX_KEYS + 1, keys, prio, &len),
                     TS_EINVAL);
    assert_int_equal(
        ts__msg_table_keys_req_encode(b, sizeof(b), (const uint8_t *)"t", 1, 3, keys, NULL, &len),
        0);
    round_trip(1, TS_OP_TABLE_REMOVE, b, len);
    /* A REMOVE body is not an UPDATE body (entries of 8 bytes, not 16). */
    assert_int_equal(ts__msg_request_decode(TS_OP_TABLE_UPDATE, b, len, &d), TS_EPROTO);
    /* n over the limit, reserved not zero. */
    ts__put_u32le(b + 2, TS_TABLE_MAX_KEYS + 1);
    assert_int_equal(ts__msg_request_decode(TS_OP_TABLE_REMOVE, b, len, &d), TS_EPROTO);
    ts__put_u32le(b + 2, 3);
    ts__put_u32le(b + 6, 1);
    assert_int_equal(ts__msg_request_decode(TS_OP_TABLE_REMOVE, b, len, &d), TS_EPROTO);

    ts__msg_table_insert_fixed f = {.priority = NAN, .timeout_ms = 9}, g;
    uint8_t fx[TS_MSG_TABLE_INSERT_FIXED];
    ts__msg_table_insert_fixed_encode(fx, &f);
    assert_int_equal(ts__msg_table_insert_fixed_decode(fx, &g), 0);
    assert_true(isnan(g.priority));
    assert_int_equal(g.timeout_ms, 9);
    fx[15] = 1;
    assert_int_equal(ts__msg_table_insert_fixed_decode(fx, &g), TS_EPROTO);
    const ts__msg_op *o = ts__msg_op_info(TS_OP_TABLE_INSERT);
    assert_non_null(o);
    assert_int_equal(o->upload_fixed, TS_MSG_TABLE_INSERT_FIXED);
}

static void test_replies(void **state)
{
    (void)state;
    uint8_t b[BUF];
    size_t len = 0;
    ts__msg_table_state st = {
        .key = 5, .size = 4, .inserts = 9, .samples = 12, .done = 1, .skipped = 2};
    assert_int_equal(ts__msg_table_state_encode(b, sizeof(b), &st, &len), 0);
    assert_int_equal(len, TS_MSG_TABLE_STATE_SIZE);
    round_trip(0, TS_OP_TABLE_INSERT, b, len);
    assert_int_equal(ts__msg_reply_limit(TS_OP_TABLE_UPDATE, TS_ST_OK, 1 << 20),
                     TS_MSG_TABLE_STATE_SIZE);

    uint8_t r1[100], r2[1];
    memset(r1, 0xab, sizeof(r1));
    r2[0] = 7;
    ts__msg_table_sample e[3] = {
        {.key = 1,
         .len = sizeof(r1),
         .probability = 0.25,
         .age_ms = 10,
         .times_sampled = 1,
         .record = r1},
        {.key = 2, .len = 0, .probability = 0.5, .age_ms = 0, .times_sampled = 3, .record = NULL},
        {.key = 3, .len = 1, .probability = 1.0, .age_ms = 7, .times_sampled = 2, .record = r2},
    };
    assert_int_equal(ts__msg_table_samples_encode(b, sizeof(b), 42, 3, e, &len), 0);
    assert_int_equal(len, ts__msg_table_samples_head_size(3) + 128 + 0 + 64);
    round_trip(0, TS_OP_TABLE_SAMPLE, b, len);
    ts__msg d;
    assert_int_equal(ts__msg_reply_decode(TS_OP_TABLE_SAMPLE, TS_ST_OK, b, len, &d), 0);
    assert_int_equal(d.u.table_samples.size, 42);
    ts__msg_table_sample g;
    ts__msg_table_sample_get(&d.u.table_samples, 2, &g);
    assert_int_equal(g.key, 3);
    assert_int_equal(g.record[0], 7);
    assert_true(g.probability == 1.0);
    /* Padding must be zero; n 0 is refused. */
    b[ts__msg_table_samples_head_size(3) + 100] = 1;
    assert_int_equal(ts__msg_reply_decode(TS_OP_TABLE_SAMPLE, TS_ST_OK, b, len, &d), TS_EPROTO);
    assert_int_equal(ts__msg_table_samples_head_encode(b, sizeof(b), 0, 0, NULL, &len), TS_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create),
        cmocka_unit_test(test_sample_and_keys),
        cmocka_unit_test(test_replies),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
