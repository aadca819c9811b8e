/*
 * Unit tests for the stream bodies (src/msg_stream.c, docs/PROTOCOL.md 8.23 to 8.32): every
 * request and reply both ways, every strictness rule of the decoders, the size functions, the
 * opcode table's stream entries and status 19.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>

#include "msg.h"
#include "record.h"

/* Bytes; room for every body these tests build (ENTRIES with a few records included). */
#define BUF 8192

/* A body under test and how its prefixes and an extra byte must decode. */
typedef struct body_case {
    const char *what;
    int request; /* 1: ts__msg_request_decode, else ts__msg_reply_decode with TS_ST_OK */
    uint8_t op;
    ts__msg_kind kind;
    uint8_t b[BUF];
    size_t len;
    size_t prefix_ok_from; /* prefixes this long or longer still decode (SIZE_MAX: none) */
    int trailing_ok;       /* 1 when one more byte still decodes (a record) */
} body_case;

static body_case *new_case(const char *what, int request, uint8_t op, ts__msg_kind kind)
{
    body_case *c = calloc(1, sizeof(*c));
    assert_non_null(c);
    c->what = what;
    c->request = request;
    c->op = op;
    c->kind = kind;
    c->prefix_ok_from = SIZE_MAX;
    return c;
}

static int decode(const body_case *c, size_t len, ts__msg *m)
{
    if (c->request)
        return ts__msg_request_decode(c->op, c->b, len, m);
    return ts__msg_reply_decode(c->op, TS_ST_OK, c->b, len, m);
}

/*
 * What every body must do: decode to its kind; encode back to the same bytes (and refuse a
 * buffer one byte short); refuse every shorter prefix, leaving the output alone; refuse one
 * more byte.
 */
static void check_case(body_case *c)
{
    ts__msg m;
    if (decode(c, c->len, &m) != 0)
        fail_msg("%s: the encoded body does not decode", c->what);
    assert_int_equal(m.kind, c->kind);
    if (m.kind != TS_MSG_RECORD) {
        static uint8_t again[BUF];
        size_t n = 0;
        assert_int_equal(ts__msg_encode(&m, again, sizeof(again), &n), 0);
        assert_int_equal(n, c->len);
        assert_memory_equal(again, c->b, c->len);
        if (c->len > 0)
            assert_int_equal(ts__msg_encode(&m, again, c->len - 1, &n), TS_EMSGSIZE);
    }
    for (size_t k = 0; k < c->len; k++) {
        ts__msg d;
        memset(&d, 0xA5, sizeof(d));
        ts__msg before = d;
        int rc = decode(c, k, &d);
        if (k >= c->prefix_ok_from) {
            if (rc != 0)
                fail_msg("%s: a prefix of %zu bytes is refused", c->what, k);
            continue;
        }
        if (rc != TS_EPROTO)
            fail_msg("%s: a prefix of %zu bytes decodes (%d)", c->what, k, rc);
        assert_memory_equal(&d, &before, sizeof(d));
    }
    assert_true(c->len < sizeof(c->b));
    c->b[c->len] = 0;
    int rc = decode(c, c->len + 1, &m);
    if (c->trailing_ok ? rc != 0 : rc != TS_EPROTO)
        fail_msg("%s: a trailing byte gives %d", c->what, rc);
}

/* Encode a record into a fresh allocation (and free the tree). */
static uint8_t *record_of(ts_value_t *v, size_t *len)
{
    uint8_t *rec;
    assert_non_null(v);
    assert_int_equal(ts__record_encode(v, &rec, len), 0);
    ts_value_free(v);
    return rec;
}

#define S(x) (const uint8_t *)(x), (sizeof(x) - 1)

/* A member request naming stream n, group g and member m (NULL: none); other fields 0. */
static ts__msg_stream_member_req who(const char *n, const char *g, const char *m)
{
    ts__msg_stream_member_req q;
    memset(&q, 0, sizeof(q));
    q.name = (const uint8_t *)n;
    q.name_len = strlen(n);
    q.group = (const uint8_t *)g;
    q.group_len = g != NULL ? strlen(g) : 0;
    q.member = (const uint8_t *)m;
    q.member_len = m != NULL ? strlen(m) : 0;
    return q;
}

/* ---------------------------------------------------------------------------------------------
 * Requests
 */

static void test_requests(void **state)
{
    (void)state;
    body_case *c;
    ts__msg m;

    /* CREATE: name + 32 bytes, every field where the table puts it. */
    c = new_case("STREAM_CREATE", 1, TS_OP_STREAM_CREATE, TS_MSG_STREAM_CREATE_REQ);
    ts__msg_stream_create_req cq = {S("ev"), 1000, 1u << 20, 60000, 64, 5000, 0};
    assert_int_equal(ts__msg_stream_create_req_size(2), 3 + 32);
    assert_int_equal(ts__msg_stream_create_req_encode(c->b, sizeof(c->b), &cq, &c->len), 0);
    assert_int_equal(c->len, 35);
    assert_memory_equal(c->b,
                        "\x02"
                        "ev"
                        "\xe8\x03\0\0\0\0\0\0"
                        "\0\0\x10\0\0\0\0\0"
                        "\x60\xea\0\0"
                        "\x40\0\0\0"
                        "\x88\x13\0\0"
                        "\0\0\0\0",
                        35);
    check_case(c);
    assert_int_equal(ts__msg_request_decode(c->op, c->b, c->len, &m), 0);
    assert_true(m.u.stream_create.max_entries == 1000 && m.u.stream_create.max_bytes == 1u << 20);
    assert_true(m.u.stream_create.max_age_ms == 60000 && m.u.stream_create.window == 64);
    assert_true(m.u.stream_create.lease_ms == 5000 && m.u.stream_create.flags == 0);
    assert_ptr_equal(m.u.stream_create.name, c->b + 1);
    /* Values are the server's to judge: flags and max_entries 0 decode. */
    ts__put_u32le(c->b + 31, 7);
    ts__put_u64le(c->b + 3, 0);
    assert_int_equal(ts__msg_request_decode(c->op, c->b, c->len, &m), 0);
    assert_true(m.u.stream_create.flags == 7 && m.u.stream_create.max_entries == 0);
    free(c);

    /* APPEND: a PUT body (name, then the record to the end); any prefix past the name is one. */
    c = new_case("STREAM_APPEND", 1, TS_OP_STREAM_APPEND, TS_MSG_PUT_REQ);
    size_t rl;
    uint8_t *rec = record_of(ts_int_new(7), &rl);
    assert_int_equal(ts__msg_put_encode(c->b, sizeof(c->b), S("ev"), rec, rl, &c->len), 0);
    c->prefix_ok_from = 3;
    c->trailing_ok = 1;
    check_case(c);
    assert_int_equal(ts__msg_request_decode(c->op, c->b, c->len, &m), 0);
    assert_true(m.u.put.rec_len == rl);
    assert_memory_equal(m.u.put.record, rec, rl);
    ts__free_aligned(rec, rl);
    free(c);

    c = new_case("STREAM_MARK", 1, TS_OP_STREAM_MARK, TS_MSG_STREAM_MARK_REQ);
    ts__msg_stream_mark_req mq = {S("ev"), 0x0102030405060708ull};
    assert_int_equal(ts__msg_stream_mark_req_size(2), 11);
    assert_int_equal(ts__msg_stream_mark_req_encode(c->b, sizeof(c->b), &mq, &c->len), 0);
    assert_memory_equal(c->b,
                        "\x02"
                        "ev"
                        "\x08\x07\x06\x05\x04\x03\x02\x01",
                        11);
    check_case(c);
    free(c);

    c = new_case("STREAM_CREDIT", 1, TS_OP_STREAM_CREDIT, TS_MSG_STREAM_CREDIT_REQ);
    ts__msg_stream_credit_req crq = {S("ev"), 250};
    assert_int_equal(ts__msg_stream_credit_req_size(2), 7);
    assert_int_equal(ts__msg_stream_credit_req_encode(c->b, sizeof(c->b), &crq, &c->len), 0);
    assert_memory_equal(c->b,
                        "\x02"
                        "ev"
                        "\xfa\0\0\0",
                        7);
    check_case(c);
    free(c);

    c = new_case("STREAM_JOIN", 1, TS_OP_STREAM_JOIN, TS_MSG_STREAM_JOIN_REQ);
    ts__msg_stream_member_req jq = who("ev", "train", "w0");
    jq.start = TS_STREAM_START_NEWEST;
    jq.lease_ms = 30000;
    assert_int_equal(ts__msg_stream_join_req_size(2, 5, 2), 3 + 6 + 3 + 8);
    assert_int_equal(ts__msg_stream_join_req_encode(c->b, sizeof(c->b), &jq, &c->len), 0);
    assert_memory_equal(c->b,
                        "\x02"
                        "ev"
                        "\x05train\x02w0\x01\0\0\0\x30\x75\0\0",
                        20);
    check_case(c);
    assert_int_equal(ts__msg_request_decode(c->op, c->b, c->len, &m), 0);
    assert_true(m.u.stream_member.start == 1 && m.u.stream_member.lease_ms == 30000);
    assert_true(m.u.stream_member.group_len == 5 && m.u.stream_member.member_len == 2);
    assert_ptr_equal(m.u.stream_member.group, c->b + 4);
    assert_ptr_equal(m.u.stream_member.member, c->b + 10);
    /* start is a value (the server answers INVALID past 1), not a layout rule. */
    c->b[12] = 9;
    assert_int_equal(ts__msg_request_decode(c->op, c->b, c->len, &m), 0);
    free(c);

    c = new_case("STREAM_READ", 1, TS_OP_STREAM_READ, TS_MSG_STREAM_READ_REQ);
    ts__msg_stream_member_req rq = who("ev", "g", "m");
    rq.ack_through = 41;
    rq.max_entries = 16;
    rq.timeout_ms = 1000;
    assert_int_equal(ts__msg_stream_read_req_size(2, 1, 1), 3 + 2 + 2 + 16);
    assert_int_equal(ts__msg_stream_read_req_encode(c->b, sizeof(c->b), &rq, &c->len), 0);
    assert_memory_equal(c->b,
                        "\x02"
                        "ev"
                        "\x01g\x01m\x29\0\0\0\0\0\0\0\x10\0\0\0\xe8\x03\0\0",
                        23);
    check_case(c);
    assert_int_equal(ts__msg_request_decode(c->op, c->b, c->len, &m), 0);
    assert_true(m.u.stream_member.ack_through == 41 && m.u.stream_member.max_entries == 16 &&
                m.u.stream_member.timeout_ms == 1000);
    free(c);

    c = new_case("STREAM_ACK", 1, TS_OP_STREAM_ACK, TS_MSG_STREAM_ACK_REQ);
    ts__msg_stream_member_req aq = who("ev", "g", "m");
    aq.first = 5;
    aq.last = 9;
    aq.rows = 0;
    assert_int_equal(ts__msg_stream_ack_req_size(2, 1, 1), 3 + 2 + 2 + 20);
    assert_int_equal(ts__msg_stream_ack_req_encode(c->b, sizeof(c->b), &aq, &c->len), 0);
    assert_memory_equal(c->b,
                        "\x02"
                        "ev"
                        "\x01g\x01m\x05\0\0\0\0\0\0\0\x09\0\0\0\0\0\0\0\0\0\0\0",
                        27);
    check_case(c);
    free(c);

    c = new_case("STREAM_LEAVE", 1, TS_OP_STREAM_LEAVE, TS_MSG_STREAM_LEAVE_REQ);
    ts__msg_stream_member_req lq = who("ev", "g", "m");
    assert_int_equal(ts__msg_stream_leave_req_size(2, 1, 1), 7);
    assert_int_equal(ts__msg_stream_leave_req_encode(c->b, sizeof(c->b), &lq, &c->len), 0);
    assert_memory_equal(c->b,
                        "\x02"
                        "ev"
                        "\x01g\x01m",
                        7);
    check_case(c);
    free(c);

    /* LEAVE with an empty member: the whole group. */
    c = new_case("STREAM_LEAVE group", 1, TS_OP_STREAM_LEAVE, TS_MSG_STREAM_LEAVE_REQ);
    lq.member = NULL;
    lq.member_len = 0;
    assert_int_equal(ts__msg_stream_leave_req_encode(c->b, sizeof(c->b), &lq, &c->len), 0);
    assert_memory_equal(c->b,
                        "\x02"
                        "ev"
                        "\x01g\x00",
                        6);
    check_case(c);
    assert_int_equal(ts__msg_request_decode(c->op, c->b, c->len, &m), 0);
    assert_true(m.u.stream_member.member_len == 0 && m.u.stream_member.member == NULL);
    free(c);

    c = new_case("STREAM_INFO", 1, TS_OP_STREAM_INFO, TS_MSG_NAME_REQ);
    ts__msg_name_req iq = {.name = (const uint8_t *)"ev", .name_len = 2};
    assert_int_equal(ts__msg_name_req_encode(c->b, sizeof(c->b), &iq, &c->len), 0);
    check_case(c);
    free(c);

    c = new_case("STREAM_RANGE", 1, TS_OP_STREAM_RANGE, TS_MSG_STREAM_RANGE_REQ);
    ts__msg_stream_range_req gq = {S("ev"), 100, 1024, 0};
    assert_int_equal(ts__msg_stream_range_req_size(2), 19);
    assert_int_equal(ts__msg_stream_range_req_encode(c->b, sizeof(c->b), &gq, &c->len), 0);
    assert_memory_equal(c->b,
                        "\x02"
                        "ev"
                        "\x64\0\0\0\0\0\0\0\0\x04\0\0\0\0\0\0",
                        19);
    check_case(c);
    free(c);
}

/* Groups and members: 1..255 bytes; empty only for LEAVE's member; reserved bytes of JOIN. */
static void test_group_member_rules(void **state)
{
    (void)state;
    static uint8_t b[BUF];
    static uint8_t long_id[256];
    size_t len;
    ts__msg m;
    memset(long_id, 'x', sizeof(long_id));

    typedef int (*enc_fn)(uint8_t *, size_t, const ts__msg_stream_member_req *, size_t *);
    typedef size_t (*size_fn)(size_t, size_t, size_t);
    static const struct {
        uint8_t op;
        enc_fn enc;
        size_fn size;
        int member_optional;
    } ops[] = {
        {TS_OP_STREAM_JOIN, ts__msg_stream_join_req_encode, ts__msg_stream_join_req_size, 0},
        {TS_OP_STREAM_READ, ts__msg_stream_read_req_encode, ts__msg_stream_read_req_size, 0},
        {TS_OP_STREAM_ACK, ts__msg_stream_ack_req_encode, ts__msg_stream_ack_req_size, 0},
        {TS_OP_STREAM_LEAVE, ts__msg_stream_leave_req_encode, ts__msg_stream_leave_req_size, 1},
    };
    for (size_t i = 0; i < TS__ARRAY_SIZE(ops); i++) {
        /* The longest name, group and member fit the control body limit and round-trip. */
        ts__msg_stream_member_req q = {.name = long_id,
                                       .name_len = 255,
                                       .group = long_id,
                                       .group_len = 255,
                                       .member = long_id,
                                       .member_len = 255};
        assert_int_equal(ops[i].enc(b, sizeof(b), &q, &len), 0);
        assert_int_equal(len, ops[i].size(255, 255, 255));
        assert_true(len <= ts__msg_request_limit(ops[i].op, 1, TS_DEFAULT_MAX_FRAME));
        assert_int_equal(ts__msg_request_decode(ops[i].op, b, len, &m), 0);
        assert_true(m.u.stream_member.group_len == 255 && m.u.stream_member.member_len == 255);

        /* 256 bytes of anything: TS_ENAMETOOLONG, nothing written. */
        memset(b, 0xEE, 16);
        ts__msg_stream_member_req big = q;
        big.group_len = 256;
        assert_int_equal(ops[i].enc(b, sizeof(b), &big, &len), TS_ENAMETOOLONG);
        big = q;
        big.member_len = 256;
        assert_int_equal(ops[i].enc(b, sizeof(b), &big, &len), TS_ENAMETOOLONG);
        big = q;
        big.name_len = 256;
        assert_int_equal(ops[i].enc(b, sizeof(b), &big, &len), TS_ENAMETOOLONG);
        assert_int_equal(b[0], 0xEE);
        /* Too small a buffer: TS_EMSGSIZE, nothing written. */
        assert_int_equal(ops[i].enc(b, ops[i].size(255, 255, 255) - 1, &q, &len), TS_EMSGSIZE);
        assert_int_equal(b[0], 0xEE);

        /* An empty group is never encodable, and malformed on the wire. */
        ts__msg_stream_member_req eg = who("s", NULL, "m");
        assert_int_equal(ops[i].enc(b, sizeof(b), &eg, &len), TS_EINVAL);
        uint8_t wire[64] = {1, 's', 0, 1, 'm'};
        size_t wlen = 5 + (ops[i].size(1, 1, 1) - 6);
        assert_int_equal(ts__msg_request_decode(ops[i].op, wire, wlen, &m), TS_EPROTO);
        /* The same body with a one-byte group decodes (the length bookkeeping is right). */
        uint8_t good[64] = {1, 's', 1, 'g', 1, 'm'};
        assert_int_equal(ts__msg_request_decode(ops[i].op, good, ops[i].size(1, 1, 1), &m), 0);

        /* An empty member: only LEAVE. */
        ts__msg_stream_member_req em = who("s", "g", NULL);
        uint8_t nom[64] = {1, 's', 1, 'g', 0};
        int rc_enc = ops[i].enc(b, sizeof(b), &em, &len);
        int rc_dec = ts__msg_request_decode(ops[i].op, nom, ops[i].size(1, 1, 0), &m);
        if (ops[i].member_optional) {
            assert_int_equal(rc_enc, 0);
            assert_int_equal(rc_dec, 0);
        } else {
            assert_int_equal(rc_enc, TS_EINVAL);
            assert_int_equal(rc_dec, TS_EPROTO);
        }
    }

    /* JOIN's u8 and u16 after start are reserved: any bit set is malformed. */
    ts__msg_stream_member_req jq = who("s", "g", "m");
    assert_int_equal(ts__msg_stream_join_req_encode(b, sizeof(b), &jq, &len), 0);
    size_t tail = len - TS_MSG_STREAM_JOIN_FIXED;
    for (size_t i = tail + 1; i < tail + 4; i++)
        for (int bit = 0; bit < 8; bit++) {
            b[i] = (uint8_t)(1u << bit);
            assert_int_equal(ts__msg_stream_join_req_decode(b, len, &m.u.stream_member), TS_EPROTO);
            b[i] = 0;
        }
    assert_int_equal(ts__msg_stream_join_req_decode(b, len, &m.u.stream_member), 0);

    /* A name's length past the body, in every request with a name first. */
    const uint8_t named[] = {TS_OP_STREAM_CREATE, TS_OP_STREAM_MARK,  TS_OP_STREAM_CREDIT,
                             TS_OP_STREAM_JOIN,   TS_OP_STREAM_READ,  TS_OP_STREAM_ACK,
                             TS_OP_STREAM_LEAVE,  TS_OP_STREAM_RANGE, TS_OP_STREAM_INFO};
    memset(b, 0, 64);
    b[0] = 200;
    for (size_t i = 0; i < TS__ARRAY_SIZE(named); i++)
        assert_int_equal(ts__msg_request_decode(named[i], b, 64, &m), TS_EPROTO);

    /* Names over 255 bytes are refused by the name-first encoders too. */
    ts__msg_stream_create_req cq = {.name = long_id, .name_len = 256};
    assert_int_equal(ts__msg_stream_create_req_encode(b, sizeof(b), &cq, &len), TS_ENAMETOOLONG);
    ts__msg_stream_mark_req mq = {long_id, 256, 1};
    assert_int_equal(ts__msg_stream_mark_req_encode(b, sizeof(b), &mq, &len), TS_ENAMETOOLONG);
    ts__msg_stream_credit_req crq = {long_id, 256, 1};
    assert_int_equal(ts__msg_stream_credit_req_encode(b, sizeof(b), &crq, &len), TS_ENAMETOOLONG);
    ts__msg_stream_range_req rq = {long_id, 256, 0, 1, 0};
    assert_int_equal(ts__msg_stream_range_req_encode(b, sizeof(b), &rq, &len), TS_ENAMETOOLONG);
    cq.name_len = 255;
    assert_int_equal(ts__msg_stream_create_req_encode(b, sizeof(b), &cq, &len), 0);
    assert_true(len <= TS_MAX_CTRL_BODY);
    assert_int_equal(ts__msg_stream_create_req_encode(b, len - 1, &cq, &len), TS_EMSGSIZE);
}

/* ---------------------------------------------------------------------------------------------
 * Fixed replies
 */

static void test_state_replies(void **state)
{
    (void)state;
    body_case *c;
    ts__msg m;

    const uint8_t state_ops[] = {TS_OP_STREAM_CREATE, TS_OP_STREAM_CREDIT, TS_OP_STREAM_LEAVE};
    for (size_t i = 0; i < TS__ARRAY_SIZE(state_ops); i++) {
        c = new_case(ts__op_name(state_ops[i]), 0, state_ops[i], TS_MSG_STREAM_STATE);
        ts__msg_stream_state st = {3, 10, 4096, 8, 2, 1, UINT32_MAX, 0};
        assert_int_equal(ts__msg_stream_state_encode(c->b, sizeof(c->b), &st, &c->len), 0);
        assert_int_equal(c->len, TS_MSG_STREAM_STATE_SIZE);
        assert_memory_equal(c->b,
                            "\x03\0\0\0\0\0\0\0\x0a\0\0\0\0\0\0\0\0\x10\0\0\0\0\0\0"
                            "\x08\0\0\0\x02\0\0\0\x01\0\0\0\xff\xff\xff\xff\0\0\0\0\0\0\0\0",
                            48);
        check_case(c);
        assert_int_equal(ts__msg_reply_decode(c->op, TS_ST_OK, c->b, c->len, &m), 0);
        assert_memory_equal(&m.u.stream_state, &st, sizeof(st));
        for (size_t k = 44; k < 48; k++) {
            c->b[k] = 0x10;
            assert_int_equal(ts__msg_stream_state_decode(c->b, c->len, &m.u.stream_state),
                             TS_EPROTO);
            c->b[k] = 0;
        }
        free(c);
    }

    const uint8_t append_ops[] = {TS_OP_STREAM_APPEND, TS_OP_STREAM_MARK};
    for (size_t i = 0; i < TS__ARRAY_SIZE(append_ops); i++) {
        c = new_case(ts__op_name(append_ops[i]), 0, append_ops[i], TS_MSG_STREAM_APPEND_STATE);
        ts__msg_stream_append_state as = {11, 2, 5, 10};
        assert_int_equal(ts__msg_stream_append_state_encode(c->b, sizeof(c->b), &as, &c->len), 0);
        assert_memory_equal(c->b, "\x0b\0\0\0\0\0\0\0\x02\0\0\0\0\0\0\0\x05\0\0\0\x0a\0\0\0", 24);
        check_case(c);
        assert_int_equal(ts__msg_reply_decode(c->op, TS_ST_OK, c->b, c->len, &m), 0);
        assert_memory_equal(&m.u.stream_append, &as, sizeof(as));
        free(c);
    }

    c = new_case("JOIN STATE", 0, TS_OP_STREAM_JOIN, TS_MSG_STREAM_JOIN_STATE);
    ts__msg_stream_join_state js = {7, 5, 2, 2, 3, 64};
    assert_int_equal(ts__msg_stream_join_state_encode(c->b, sizeof(c->b), &js, &c->len), 0);
    assert_memory_equal(c->b,
                        "\x07\0\0\0\0\0\0\0\x05\0\0\0\0\0\0\0\x02\0\0\0\0\0\0\0"
                        "\x02\0\0\0\x03\0\0\0\x40\0\0\0\0\0\0\0",
                        40);
    check_case(c);
    assert_int_equal(ts__msg_reply_decode(c->op, TS_ST_OK, c->b, c->len, &m), 0);
    /* Field by field: the struct ends in 4 bytes of padding, whose contents mean nothing. */
    assert_int_equal(m.u.stream_join.next_id, js.next_id);
    assert_int_equal(m.u.stream_join.floor, js.floor);
    assert_int_equal(m.u.stream_join.lost, js.lost);
    assert_int_equal(m.u.stream_join.pending, js.pending);
    assert_int_equal(m.u.stream_join.members, js.members);
    assert_int_equal(m.u.stream_join.rows_done, js.rows_done);
    for (size_t k = 36; k < 40; k++) {
        c->b[k] = 1;
        assert_int_equal(ts__msg_stream_join_state_decode(c->b, c->len, &m.u.stream_join),
                         TS_EPROTO);
        c->b[k] = 0;
    }
    free(c);

    c = new_case("ACK STATE", 0, TS_OP_STREAM_ACK, TS_MSG_STREAM_ACK_STATE);
    ts__msg_stream_ack_state ks = {4, 9, 0, 60};
    assert_int_equal(ts__msg_stream_ack_state_encode(c->b, sizeof(c->b), &ks, &c->len), 0);
    assert_memory_equal(c->b, "\x04\0\0\0\0\0\0\0\x09\0\0\0\0\0\0\0\0\0\0\0\x3c\0\0\0", 24);
    check_case(c);
    assert_int_equal(ts__msg_reply_decode(c->op, TS_ST_OK, c->b, c->len, &m), 0);
    assert_memory_equal(&m.u.stream_ack, &ks, sizeof(ks));
    free(c);

    /* STREAM_INFO: a record fills the body, as STATS's does. */
    c = new_case("STREAM_INFO reply", 0, TS_OP_STREAM_INFO, TS_MSG_RECORD);
    size_t rl;
    uint8_t *rec = record_of(ts_int_new(1), &rl);
    memcpy(c->b, rec, rl);
    c->len = rl;
    ts__free_aligned(rec, rl);
    c->prefix_ok_from = TS_REC_HDR_SIZE;
    c->trailing_ok = 1;
    check_case(c);
    free(c);

    /* The encoders of fixed bodies refuse a buffer one byte short. */
    uint8_t b[64];
    size_t len;
    ts__msg_stream_state st = {0};
    ts__msg_stream_append_state as = {0};
    ts__msg_stream_join_state js2 = {0};
    ts__msg_stream_ack_state ks2 = {0};
    assert_int_equal(ts__msg_stream_state_encode(b, 47, &st, &len), TS_EMSGSIZE);
    assert_int_equal(ts__msg_stream_append_state_encode(b, 23, &as, &len), TS_EMSGSIZE);
    assert_int_equal(ts__msg_stream_join_state_encode(b, 39, &js2, &len), TS_EMSGSIZE);
    assert_int_equal(ts__msg_stream_ack_state_encode(b, 23, &ks2, &len), TS_EMSGSIZE);
}

/* ---------------------------------------------------------------------------------------------
 * ENTRIES
 */

/* Fill e with n entries over recs: markers at the indexes where recs[i] is NULL. */
static void entries_of(uint32_t n, const uint8_t *const *recs, const size_t *lens,
                       ts__msg_stream_entry *e)
{
    for (uint32_t i = 0; i < n; i++) {
        memset(&e[i], 0, sizeof(e[i]));
        e[i].id = 100 + i;
        e[i].rows_done = i;
        e[i].deliveries = (uint16_t)(i == 2 ? 65535 : 1);
        e[i].flags = i % 2 == 1 ? TS_STREAM_ENTRY_REDELIVERED : 0;
        if (recs[i] == NULL) {
            e[i].kind = TS_STREAM_ENTRY_MARKER;
            e[i].tag = 0xE90C0000u + i;
        } else {
            e[i].kind = TS_STREAM_ENTRY_RECORD;
            e[i].len = lens[i];
            e[i].record = recs[i];
        }
    }
}

static void test_entries_round_trip(void **state)
{
    (void)state;
    /* 0 entries, 1 record, and 5 entries mixing records of odd lengths and markers. */
    size_t l0, l1, l3;
    uint8_t *r0 = record_of(ts_bytes_new("abc", 3, TS_COPY), &l0);
    uint8_t *r1 = record_of(ts_int_new(-5), &l1);
    uint8_t *r3 =
        record_of(ts_bytes_new("0123456789abcdefghijklmnopqrstuvwxyz0123456789", 46, TS_COPY), &l3);
    const uint8_t *recs[5] = {r0, r1, NULL, r3, NULL};
    size_t lens[5] = {l0, l1, 0, l3, 0};
    const uint32_t counts[] = {0, 1, 5};
    const uint8_t ops[] = {TS_OP_STREAM_READ, TS_OP_STREAM_RANGE, TS_OP_STREAM_READ};
    for (size_t k = 0; k < TS__ARRAY_SIZE(counts); k++) {
        uint32_t n = counts[k];
        ts__msg_stream_entry e[5];
        entries_of(n, recs, lens, e);
        body_case *c = new_case(k == 0   ? "ENTRIES 0"
                                : k == 1 ? "ENTRIES 1"
                                         : "ENTRIES 5",
                                0, ops[k], TS_MSG_STREAM_ENTRIES);
        uint64_t size;
        assert_int_equal(ts__msg_stream_entries_size(n, e, &size), 0);
        assert_int_equal(
            ts__msg_stream_entries_encode(c->b, sizeof(c->b), 98, 120, 7, n, e, &c->len), 0);
        assert_true(size == c->len);
        assert_int_equal(c->len % 64, 0);
        check_case(c);

        ts__msg m;
        assert_int_equal(ts__msg_reply_decode(c->op, TS_ST_OK, c->b, c->len, &m), 0);
        const ts__msg_stream_entries *s = &m.u.stream_entries;
        assert_true(s->first_id == 98 && s->last_id == 120 && s->lost == 7 && s->n == n);
        ts__msg_stream_entries_iter it;
        ts__msg_stream_entry d;
        uint32_t seen = 0;
        ts__msg_stream_entries_iter_init(s, &it);
        while (ts__msg_stream_entries_next(s, &it, &d)) {
            ts__msg_stream_entry g;
            ts__msg_stream_entry_get(s, seen, &g);
            assert_memory_equal(&g, &d, sizeof(d));
            assert_true(d.id == e[seen].id && d.len == e[seen].len && d.tag == e[seen].tag);
            assert_true(d.rows_done == e[seen].rows_done && d.deliveries == e[seen].deliveries &&
                        d.kind == e[seen].kind && d.flags == e[seen].flags);
            if (d.kind == TS_STREAM_ENTRY_MARKER) {
                assert_null(d.record);
            } else {
                assert_int_equal((size_t)(d.record - c->b) % TS__ALIGN, 0);
                assert_memory_equal(d.record, recs[seen], lens[seen]);
            }
            seen++;
        }
        assert_int_equal(seen, n);
        free(c);
    }

    /* The head written alone, then filled entry by entry, equals the whole body's head. */
    static uint8_t whole[BUF], head[BUF];
    ts__msg_stream_entry e[5];
    entries_of(5, recs, lens, e);
    size_t wlen, hlen;
    assert_int_equal(ts__msg_stream_entries_encode(whole, sizeof(whole), 1, 5, 0, 5, e, &wlen), 0);
    assert_int_equal(
        ts__msg_stream_entries_head_encode(head, sizeof(head), 1, 5, 0, 5, NULL, &hlen), 0);
    assert_int_equal(hlen, ts__msg_stream_entries_head_size(5));
    for (uint32_t i = 0; i < 5; i++)
        ts__msg_stream_entries_set(head, i, &e[i]);
    assert_memory_equal(head, whole, hlen);
    assert_int_equal(ts__msg_stream_entries_head_encode(head, sizeof(head), 1, 5, 0, 5, e, &hlen),
                     0);
    assert_memory_equal(head, whole, hlen);
    /* Each record starts at the next multiple of 64 after the head and the one before it. */
    size_t off = hlen;
    for (uint32_t i = 0; i < 5; i++) {
        if (recs[i] == NULL)
            continue;
        assert_memory_equal(whole + off, recs[i], lens[i]);
        off += lens[i] + ts__msg_items_pad(lens[i]);
    }
    assert_int_equal(off, wlen);

    ts__free_aligned(r0, l0);
    ts__free_aligned(r1, l1);
    ts__free_aligned(r3, l3);
}

static void test_entries_sizes(void **state)
{
    (void)state;
    assert_true(ts__msg_stream_entries_head_size(0) == 64);
    assert_true(ts__msg_stream_entries_head_size(1) == 64);
    assert_true(ts__msg_stream_entries_head_size(2) == 128);
    assert_true(ts__msg_stream_entries_head_size(3) == 128);
    assert_true(ts__msg_stream_entries_head_size(4) == 192);
    assert_true(ts__msg_stream_entries_head_size(TS_STREAM_MAX_READ) == 32832);
    assert_true(ts__msg_stream_entries_head_size(UINT32_MAX) % 64 == 0);

    uint64_t size;
    ts__msg_stream_entry e[3];
    memset(e, 0, sizeof(e));
    e[0].len = 1;
    e[1].kind = TS_STREAM_ENTRY_MARKER;
    e[2].len = 64;
    assert_int_equal(ts__msg_stream_entries_size(3, e, &size), 0);
    assert_true(size == 128 + 64 + 0 + 64);
    assert_int_equal(ts__msg_stream_entries_size(0, NULL, &size), 0);
    assert_true(size == 64);
    /* Lengths whose padding or sum passes 64 bits. */
    e[0].len = UINT64_MAX;
    assert_int_equal(ts__msg_stream_entries_size(1, e, &size), TS_EMSGSIZE);
    e[0].len = UINT64_MAX - 127;
    e[2].len = UINT64_MAX - 127;
    assert_int_equal(ts__msg_stream_entries_size(3, e, &size), TS_EMSGSIZE);
    /* More entries than a reply may carry. */
    static ts__msg_stream_entry many[TS_STREAM_MAX_READ + 1];
    assert_int_equal(ts__msg_stream_entries_size(TS_STREAM_MAX_READ, many, &size), 0);
    assert_true(size == 32832);
    assert_int_equal(ts__msg_stream_entries_size(TS_STREAM_MAX_READ + 1, many, &size), TS_EINVAL);
    static uint8_t b[40000];
    size_t len;
    assert_int_equal(
        ts__msg_stream_entries_head_encode(b, sizeof(b), 0, 0, 0, TS_STREAM_MAX_READ, many, &len),
        0);
    assert_int_equal(ts__msg_stream_entries_head_encode(b, sizeof(b), 0, 0, 0,
                                                        TS_STREAM_MAX_READ + 1, NULL, &len),
                     TS_EINVAL);
    assert_int_equal(
        ts__msg_stream_entries_head_encode(b, 32831, 0, 0, 0, TS_STREAM_MAX_READ, NULL, &len),
        TS_EMSGSIZE);
}

/* A body of two entries (a 70-byte record, then a marker) to break one rule at a time. */
static size_t two_entries(uint8_t *b, size_t cap)
{
    static uint8_t rec[70];
    memset(rec, 0x5A, sizeof(rec));
    ts__msg_stream_entry e[2];
    memset(e, 0, sizeof(e));
    e[0].id = 1;
    e[0].len = sizeof(rec);
    e[0].record = rec;
    e[1].id = 2;
    e[1].kind = TS_STREAM_ENTRY_MARKER;
    e[1].tag = 3;
    size_t len;
    assert_int_equal(ts__msg_stream_entries_encode(b, cap, 1, 2, 0, 2, e, &len), 0);
    assert_int_equal(len, 128 + 128);
    return len;
}

/* Entry i's head in body b. */
static uint8_t *ehead(uint8_t *b, uint32_t i)
{
    return b + TS_MSG_STREAM_ENTRIES_FIXED + (size_t)TS_MSG_STREAM_ENTRY_HEAD * i;
}

static void test_entries_strict(void **state)
{
    (void)state;
    static uint8_t b[1024];
    ts__msg_stream_entries s;
    size_t len = two_entries(b, sizeof(b));
    assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), 0);

    /* Truncated anywhere, or one byte more: refused. */
    for (size_t k = 0; k < len; k++)
        assert_int_equal(ts__msg_stream_entries_decode(b, k, &s), TS_EPROTO);
    b[len] = 0;
    assert_int_equal(ts__msg_stream_entries_decode(b, len + 1, &s), TS_EPROTO);
    /* A whole 64 bytes of zeros more is still trailing garbage, not a record. */
    memset(b + len, 0, 64);
    assert_int_equal(ts__msg_stream_entries_decode(b, len + 64, &s), TS_EPROTO);

    /* The reserved u32 of the fixed part. */
    for (size_t k = 28; k < 32; k++) {
        b[k] = 0x01;
        assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), TS_EPROTO);
        b[k] = 0;
    }
    /* The head's padding (after two entry heads: bytes 96..127) and the record's (198..255). */
    for (size_t k = 96; k < 128; k++) {
        b[k] = 0x80;
        assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), TS_EPROTO);
        b[k] = 0;
    }
    for (size_t k = 128 + 70; k < 256; k++) {
        b[k] = 0x02;
        assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), TS_EPROTO);
        b[k] = 0;
    }
    assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), 0);

    /* Kind 0 or 1 only; flags 0x01 only. */
    for (int kind = 2; kind < 256; kind += 37) {
        ehead(b, 1)[30] = (uint8_t)kind;
        assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), TS_EPROTO);
    }
    ehead(b, 1)[30] = TS_STREAM_ENTRY_MARKER;
    for (int bit = 1; bit < 8; bit++) {
        ehead(b, 0)[31] = (uint8_t)(1u << bit);
        assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), TS_EPROTO);
    }
    ehead(b, 0)[31] = TS_STREAM_ENTRY_REDELIVERED;
    assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), 0);
    ehead(b, 0)[31] = 0;

    /* A marker has no bytes: len 64 after it would be a well-laid-out record, still refused. */
    ts__put_u64le(ehead(b, 1) + 8, 64);
    memset(b + len, 0, 64);
    assert_int_equal(ts__msg_stream_entries_decode(b, len + 64, &s), TS_EPROTO);
    ts__put_u64le(ehead(b, 1) + 8, 0);
    /* A record has tag 0. */
    ts__put_u64le(ehead(b, 0) + 16, 1);
    assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), TS_EPROTO);
    ts__put_u64le(ehead(b, 0) + 16, 0);

    /*
     * Record lengths that do not lay the records out exactly: one that runs past the body
     * (overlapping where the next would start), one whose padding wraps, one short (the body then
     * holds bytes no entry claims).
     */
    ts__put_u64le(ehead(b, 0) + 8, 129);
    assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), TS_EPROTO);
    ts__put_u64le(ehead(b, 0) + 8, UINT64_MAX - 10);
    assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), TS_EPROTO);
    ts__put_u64le(ehead(b, 0) + 8, UINT64_MAX - 63);
    assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), TS_EPROTO);
    memset(b + 128, 0, 128);
    ts__put_u64le(ehead(b, 0) + 8, 0);
    assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), TS_EPROTO);
    ts__put_u64le(ehead(b, 0) + 8, 64);
    assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), TS_EPROTO);
    ts__put_u64le(ehead(b, 0) + 8, 128);
    assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), 0);

    /* n past the limit, and an n whose heads cannot be in the body. */
    ts__put_u32le(b + 24, TS_STREAM_MAX_READ + 1);
    assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), TS_EPROTO);
    ts__put_u32le(b + 24, UINT32_MAX);
    assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), TS_EPROTO);
    ts__put_u32le(b + 24, 9);
    assert_int_equal(ts__msg_stream_entries_decode(b, len, &s), TS_EPROTO);

    /* The encoders refuse what the decoder refuses. */
    uint8_t out[512];
    size_t n;
    ts__msg_stream_entry e = {0};
    e.kind = 2;
    assert_int_equal(ts__msg_stream_entries_encode(out, sizeof(out), 0, 0, 0, 1, &e, &n),
                     TS_EINVAL);
    assert_int_equal(ts__msg_stream_entries_head_encode(out, sizeof(out), 0, 0, 0, 1, &e, &n),
                     TS_EINVAL);
    e.kind = TS_STREAM_ENTRY_RECORD;
    e.flags = 0x02;
    assert_int_equal(ts__msg_stream_entries_encode(out, sizeof(out), 0, 0, 0, 1, &e, &n),
                     TS_EINVAL);
    e.flags = 0;
    e.tag = 5;
    assert_int_equal(ts__msg_stream_entries_encode(out, sizeof(out), 0, 0, 0, 1, &e, &n),
                     TS_EINVAL);
    e.tag = 0;
    e.kind = TS_STREAM_ENTRY_MARKER;
    e.len = 1;
    e.record = out;
    assert_int_equal(ts__msg_stream_entries_encode(out, sizeof(out), 0, 0, 0, 1, &e, &n),
                     TS_EINVAL);
    e.len = 0;
    e.tag = 5;
    assert_int_equal(ts__msg_stream_entries_encode(out, sizeof(out), 0, 0, 0, 1, &e, &n), 0);
    assert_int_equal(n, 64);
    /* A buffer that holds the head but not the records. */
    static uint8_t rec[100];
    ts__msg_stream_entry r = {.id = 1, .len = sizeof(rec), .record = rec};
    assert_int_equal(ts__msg_stream_entries_encode(out, 64 + 127, 0, 0, 0, 1, &r, &n), TS_EMSGSIZE);
    assert_int_equal(ts__msg_stream_entries_encode(out, 64 + 128, 0, 0, 0, 1, &r, &n), 0);
}

/* ---------------------------------------------------------------------------------------------
 * The opcode table, reply limits, status 19, the shared limits
 */

static void test_stream_ops(void **state)
{
    (void)state;
    static const struct {
        uint8_t op;
        const char *name;
        ts__msg_kind req, rep;
        int upload, changes;
        uint64_t limit; /* OK reply limit with large = 1 GiB */
    } want[] = {
        {TS_OP_STREAM_CREATE, "STREAM_CREATE", TS_MSG_STREAM_CREATE_REQ, TS_MSG_STREAM_STATE, 0, 1,
         48},
        {TS_OP_STREAM_APPEND, "STREAM_APPEND", TS_MSG_PUT_REQ, TS_MSG_STREAM_APPEND_STATE, 1, 1,
         24},
        {TS_OP_STREAM_MARK, "STREAM_MARK", TS_MSG_STREAM_MARK_REQ, TS_MSG_STREAM_APPEND_STATE, 0, 1,
         24},
        {TS_OP_STREAM_CREDIT, "STREAM_CREDIT", TS_MSG_STREAM_CREDIT_REQ, TS_MSG_STREAM_STATE, 0, 0,
         48},
        {TS_OP_STREAM_JOIN, "STREAM_JOIN", TS_MSG_STREAM_JOIN_REQ, TS_MSG_STREAM_JOIN_STATE, 0, 1,
         40},
        {TS_OP_STREAM_READ, "STREAM_READ", TS_MSG_STREAM_READ_REQ, TS_MSG_STREAM_ENTRIES, 0, 1,
         (uint64_t)1 << 30},
        {TS_OP_STREAM_ACK, "STREAM_ACK", TS_MSG_STREAM_ACK_REQ, TS_MSG_STREAM_ACK_STATE, 0, 1, 24},
        {TS_OP_STREAM_LEAVE, "STREAM_LEAVE", TS_MSG_STREAM_LEAVE_REQ, TS_MSG_STREAM_STATE, 0, 1,
         48},
        {TS_OP_STREAM_INFO, "STREAM_INFO", TS_MSG_NAME_REQ, TS_MSG_RECORD, 0, 0, (uint64_t)1 << 30},
        {TS_OP_STREAM_RANGE, "STREAM_RANGE", TS_MSG_STREAM_RANGE_REQ, TS_MSG_STREAM_ENTRIES, 0, 0,
         (uint64_t)1 << 30},
    };
    const uint64_t large = (uint64_t)1 << 30, mf = (uint64_t)1 << 28;
    assert_int_equal(TS__ARRAY_SIZE(want), 10);
    for (size_t i = 0; i < TS__ARRAY_SIZE(want); i++) {
        assert_int_equal(want[i].op, 0x16 + i);
        const ts__msg_op *o = ts__msg_op_info(want[i].op);
        assert_non_null(o);
        assert_string_equal(ts__op_name(want[i].op), want[i].name);
        assert_int_equal(o->request, want[i].req);
        assert_int_equal(o->reply, want[i].rep);
        assert_int_equal(o->upload, want[i].upload);
        assert_int_equal(o->changes, want[i].changes);
        assert_int_equal(ts__msg_reply_kind(want[i].op, TS_ST_OK), want[i].rep);
        assert_true(ts__msg_reply_limit(want[i].op, TS_ST_OK, large) == want[i].limit);
        /* Every error, BACKPRESSURE included, carries a message (no TIMEOUT body here), but
         * WRONG_SHARD, whose body says where the stream lives. */
        for (uint16_t st = 1; st <= TS_ST_COUNT_; st++) {
            if (st == TS_ST_WRONG_SHARD) {
                assert_int_equal(ts__msg_reply_kind(want[i].op, st), TS_MSG_WRONG_SHARD);
                continue;
            }
            assert_int_equal(ts__msg_reply_kind(want[i].op, st), TS_MSG_ERROR);
            assert_true(ts__msg_reply_limit(want[i].op, st, large) == TS_MAX_ERRMSG);
        }
        assert_true(ts__msg_request_limit(want[i].op, 0, mf) == TS_MAX_PREAUTH_BODY);
        assert_true(ts__msg_request_limit(want[i].op, 1, mf) ==
                    (want[i].upload ? mf : TS_MAX_CTRL_BODY));
        assert_int_equal(ts__msg_request_fds(want[i].op), 0);
    }
    /* A STATS record keeps its own cap; STREAM_INFO's grows with the client's limit. */
    assert_true(ts__msg_reply_limit(TS_OP_STATS, TS_ST_OK, large) == TS_MSG_MAX_STATS_REPLY);
    assert_true(ts__msg_reply_limit(TS_OP_STREAM_INFO, TS_ST_OK, 100) == 100);

    /* The header check admits the new opcodes after HELLO, with their body limits. */
    uint8_t h[TS_HDR_SIZE];
    ts__hdr hdr = {TS_MAGIC_REQ, TS_PROTO_VERSION, TS_OP_STREAM_READ, 0, 0, 1, 100};
    ts__msg_conn_state cs = {1, 0, mf};
    ts__hdr out;
    ts__hdr_encode(&hdr, h);
    assert_int_equal(ts__msg_request_check(h, &cs, &out, NULL), TS_ST_OK);
    hdr.body_len = TS_MAX_CTRL_BODY + 1;
    ts__hdr_encode(&hdr, h);
    assert_int_equal(ts__msg_request_check(h, &cs, &out, NULL), TS_ST_TOO_LARGE);
    hdr.opcode = TS_OP_STREAM_APPEND;
    ts__hdr_encode(&hdr, h);
    assert_int_equal(ts__msg_request_check(h, &cs, &out, NULL), TS_ST_OK);
    hdr.opcode = 0x7F; /* no feature has it */
    hdr.body_len = 0;
    ts__hdr_encode(&hdr, h);
    assert_int_equal(ts__msg_request_check(h, &cs, &out, NULL), TS_ST_UNKNOWN_OPCODE);

    /* Status 19: BACKPRESSURE, TS_EAGAIN both ways; its body is a message. */
    assert_int_equal(TS_ST_BACKPRESSURE, 19);
    assert_string_equal(ts__status_name(TS_ST_BACKPRESSURE), "BACKPRESSURE");
    assert_int_equal(ts__status_to_err(TS_ST_BACKPRESSURE), TS_EAGAIN);
    assert_int_equal(ts__err_to_status(TS_EAGAIN), TS_ST_BACKPRESSURE);
    static const char msg[] = "stream 'ev' is full: group 'g' is 64 entries behind (window 64)";
    ts__msg m;
    assert_int_equal(ts__msg_reply_decode(TS_OP_STREAM_APPEND, TS_ST_BACKPRESSURE,
                                          (const uint8_t *)msg, sizeof(msg) - 1, &m),
                     0);
    assert_int_equal(m.kind, TS_MSG_ERROR);
    assert_int_equal(m.u.error.len, sizeof(msg) - 1);

    /* The shared limits, as section 12 states them. */
    assert_int_equal(TS_STREAM_MAX_READ, 1024);
    assert_true(TS_STREAM_READ_BYTES == 64ull * 1024 * 1024);
    assert_true(TS_STREAM_MAX_ENTRIES == 16777216ull);
    assert_int_equal(TS_STREAM_MAX_GROUPS, 1024);
    assert_int_equal(TS_STREAM_MAX_MEMBERS, 1024);
    assert_int_equal(TS_STREAM_MAX_LEASE_MS, 86400000);
    assert_int_equal(TS_STREAM_DEFAULT_LEASE_MS, 10000);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_requests),      cmocka_unit_test(test_group_member_rules),
        cmocka_unit_test(test_state_replies), cmocka_unit_test(test_entries_round_trip),
        cmocka_unit_test(test_entries_sizes), cmocka_unit_test(test_entries_strict),
        cmocka_unit_test(test_stream_ops),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
