/* Unit tests for the message codec (src/msg.c): every body of docs/PROTOCOL.md, both ways. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>

#include "compress.h"
#include "harness.h"
#include "msg.h"
#include "record.h"

#define VER 1764115200000042ull /* a version as the change counter hands them out */

/* The longest name the encoding allows. */
static uint8_t long_name[TS_MAX_NAME_LEN + 1];

/* A body under test: where it goes, and what a prefix or an extra byte must do. */
typedef struct body_case {
    const char *what;
    int request; /* 1: decoded with ts__msg_request_decode, else ts__msg_reply_decode */
    uint8_t op;
    uint16_t status;
    uint8_t b[4096];
    size_t len;
    size_t prefix_ok_from; /* prefixes this long or longer still decode (len + 1: none) */
    int trailing_ok;       /* 1 when one more byte still decodes (a record or a message) */
} body_case;

/* Decode c's first len bytes as c says. */
static int decode(const body_case *c, size_t len, ts__msg *m)
{
    if (c->request)
        return ts__msg_request_decode(c->op, c->b, len, m);
    return ts__msg_reply_decode(c->op, c->status, c->b, len, m);
}

/*
 * The properties every body shares: it decodes; encoding the decoded message gives the same
 * bytes; every shorter prefix is refused (or accepted, for a record or a message, from where the
 * layout allows); one more byte is refused; a refused decode leaves the output alone.
 */
static void check_case(body_case *c)
{
    ts__msg m;
    if (decode(c, c->len, &m) != 0)
        fail_msg("%s: the encoded body does not decode", c->what);
    if (m.kind != TS_MSG_EMPTY && m.kind != TS_MSG_RECORD) {
        uint8_t again[4096];
        size_t n = 0;
        assert_int_equal(ts__msg_encode(&m, again, sizeof(again), &n), 0);
        assert_int_equal(n, c->len);
        assert_memory_equal(again, c->b, c->len);
        /* Too small a buffer is refused, not overrun. */
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

static body_case *new_case(const char *what, int request, uint8_t op, uint16_t status)
{
    body_case *c = calloc(1, sizeof(*c));
    assert_non_null(c);
    c->what = what;
    c->request = request;
    c->op = op;
    c->status = status;
    c->prefix_ok_from = SIZE_MAX;
    return c;
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

static void test_round_trip_every_body(void **state)
{
    (void)state;
    body_case *c;
    size_t n;

    c = new_case("HELLO request", 1, TS_OP_HELLO, 0);
    ts__msg_hello_req hq = {.max_version = 1,
                            .flags = TS_HELLO_LZ4 | 0x80,
                            .token_len = 5,
                            .token = (const uint8_t *)"token"};
    assert_int_equal(ts__msg_hello_req_size(5), 9);
    assert_int_equal(ts__msg_hello_req_encode(c->b, sizeof(c->b), &hq, &c->len), 0);
    assert_memory_equal(c->b, "\x01\x81\x05\x00token", 9);
    check_case(c);
    free(c);

    c = new_case("HELLO request, no token", 1, TS_OP_HELLO, 0);
    hq = (ts__msg_hello_req){.max_version = 7};
    assert_int_equal(ts__msg_hello_req_encode(c->b, sizeof(c->b), &hq, &c->len), 0);
    check_case(c);
    free(c);

    c = new_case("HELLO reply", 0, TS_OP_HELLO, TS_ST_OK);
    ts__msg_hello_rep hr = {.version = 1, .flags = 1, .max_body = 1ull << 30, .server_id = 9};
    assert_int_equal(ts__msg_hello_rep_encode(c->b, sizeof(c->b), &hr, &c->len), 0);
    assert_int_equal(c->len, 24);
    assert_memory_equal(c->b, "\x01\x01\0\0\0\0\0\0\0\0\0\x40\0\0\0\0\x09\0\0\0\0\0\0\0", 24);
    check_case(c);
    ts__msg m;
    assert_int_equal(ts__msg_reply_decode(TS_OP_HELLO, 0, c->b, c->len, &m), 0);
    assert_int_equal(m.kind, TS_MSG_HELLO_REP);
    assert_true(m.u.hello_rep.max_body == 1ull << 30 && m.u.hello_rep.server_id == 9);
    free(c);

    const uint8_t name_ops[] = {TS_OP_DELETE, TS_OP_LISTEN, TS_OP_UNLISTEN};
    for (size_t i = 0; i < TS__ARRAY_SIZE(name_ops); i++) {
        c = new_case(ts__op_name(name_ops[i]), 1, name_ops[i], 0);
        ts__msg_name_req nq = {.name = (const uint8_t *)"params", .name_len = 6};
        assert_int_equal(ts__msg_name_req_size(6), 7);
        assert_int_equal(ts__msg_name_req_encode(c->b, sizeof(c->b), &nq, &c->len), 0);
        assert_memory_equal(c->b, "\x06params", 7);
        check_case(c);
        free(c);
    }

    const uint8_t get_ops[] = {TS_OP_GET, TS_OP_PEEK};
    for (size_t i = 0; i < TS__ARRAY_SIZE(get_ops); i++) {
        c = new_case(ts__op_name(get_ops[i]), 1, get_ops[i], 0);
        ts__msg_name_req gq = {.name = long_name, .name_len = TS_MAX_NAME_LEN, .max_items = 3};
        assert_int_equal(ts__msg_get_req_encode(c->b, sizeof(c->b), &gq, &c->len), 0);
        assert_int_equal(c->len, ts__msg_get_req_size(TS_MAX_NAME_LEN));
        check_case(c);
        assert_int_equal(ts__msg_request_decode(get_ops[i], c->b, c->len, &m), 0);
        assert_int_equal(m.u.name_req.name_len, TS_MAX_NAME_LEN);
        assert_ptr_equal(m.u.name_req.name, c->b + 1);
        assert_int_equal(m.u.name_req.max_items, 3);
        free(c);
    }

    c = new_case("WAIT request", 1, TS_OP_WAIT, 0);
    ts__msg_name_req wq = {
        .name = (const uint8_t *)"p", .name_len = 1, .after_version = VER, .timeout_ms = 5000};
    assert_int_equal(ts__msg_wait_req_encode(c->b, sizeof(c->b), &wq, &c->len), 0);
    assert_int_equal(c->len, ts__msg_wait_req_size(1));
    check_case(c);
    assert_int_equal(ts__msg_wait_req_decode(c->b, c->len, &wq), 0);
    assert_true(wq.after_version == VER && wq.timeout_ms == 5000);
    free(c);

    /* PUT and APPEND: any prefix that holds the name is a (shorter) record. */
    const uint8_t put_ops[] = {TS_OP_PUT, TS_OP_APPEND};
    for (size_t i = 0; i < TS__ARRAY_SIZE(put_ops); i++) {
        c = new_case(ts__op_name(put_ops[i]), 1, put_ops[i], 0);
        size_t rl;
        uint8_t *rec = record_of(ts_int_new(42), &rl);
        assert_int_equal(
            ts__msg_put_encode(c->b, sizeof(c->b), (const uint8_t *)"log", 3, rec, rl, &c->len), 0);
        assert_int_equal(c->len, ts__msg_put_head_size(3) + rl);
        c->prefix_ok_from = ts__msg_put_head_size(3);
        c->trailing_ok = 1;
        check_case(c);
        assert_int_equal(ts__msg_request_decode(put_ops[i], c->b, c->len, &m), 0);
        assert_int_equal(m.u.put.head_len, 4);
        assert_true(m.u.put.rec_len == rl);
        assert_memory_equal(m.u.put.record, rec, rl);
        ts__free_aligned(rec, rl);
        free(c);
    }

    /* BIN_STATE: the OK reply of five opcodes and WAIT's TIMEOUT. */
    const uint8_t state_ops[] = {TS_OP_PUT, TS_OP_APPEND, TS_OP_DELETE, TS_OP_LISTEN, TS_OP_WAIT};
    for (size_t i = 0; i <= TS__ARRAY_SIZE(state_ops); i++) {
        int timeout = i == TS__ARRAY_SIZE(state_ops);
        c = new_case(timeout ? "WAIT TIMEOUT" : ts__op_name(state_ops[i]), 0,
                     timeout ? TS_OP_WAIT : state_ops[i], timeout ? TS_ST_TIMEOUT : TS_ST_OK);
        assert_int_equal(ts__msg_bin_state_encode(c->b, sizeof(c->b), VER, 3, &c->len), 0);
        assert_int_equal(c->len, TS_BIN_STATE_SIZE);
        check_case(c);
        assert_int_equal(ts__msg_reply_decode(c->op, c->status, c->b, c->len, &m), 0);
        assert_int_equal(m.kind, TS_MSG_BIN_STATE);
        assert_true(m.u.state.version == VER && m.u.state.n_items == 3);
        free(c);
    }

    /* ITEMS with 0, 1 and 7 records (7 lengths spill the head into a second 64 bytes). */
    for (uint32_t k = 0; k < 3; k++) {
        uint32_t nrec = k == 0 ? 0 : k == 1 ? 1 : 7;
        const uint8_t *recs[7];
        uint64_t lens[7];
        size_t rl[7];
        for (uint32_t i = 0; i < nrec; i++) {
            /* Byte strings of odd lengths give records that need padding. */
            recs[i] =
                record_of(i % 2 == 0 ? ts_int_new(i) : ts_bytes_new("abcdefg", i, TS_COPY), &rl[i]);
            lens[i] = rl[i];
        }
        c = new_case(k == 0   ? "ITEMS 0"
                     : k == 1 ? "ITEMS 1"
                              : "ITEMS 7",
                     0, k == 1 ? TS_OP_PEEK : TS_OP_GET, TS_ST_OK);
        uint64_t size;
        assert_int_equal(ts__msg_items_size(nrec, lens, &size), 0);
        assert_int_equal(
            ts__msg_items_encode(c->b, sizeof(c->b), VER, 2, nrec, recs, lens, &c->len), 0);
        assert_true(size == c->len);
        assert_int_equal(c->len % 64, 0);
        check_case(c);
        ts__msg_items it;
        assert_int_equal(ts__msg_items_decode(c->b, c->len, &it), 0);
        assert_int_equal(it.n_items, nrec);
        assert_int_equal(it.remaining, 2);
        ts__msg_items_iter iter;
        size_t off, len;
        uint32_t seen = 0;
        ts__msg_items_iter_init(&it, &iter);
        while (ts__msg_items_next(&it, &iter, &off, &len)) {
            assert_int_equal(off % TS__ALIGN, 0);
            assert_int_equal(len, rl[seen]);
            assert_memory_equal(c->b + off, recs[seen], len);
            seen++;
        }
        assert_int_equal(seen, nrec);
        for (uint32_t i = 0; i < nrec; i++)
            ts__free_aligned((void *)recs[i], rl[i]);
        free(c);
    }

    /* LIST with two entries, one of them with an empty name. */
    c = new_case("LIST reply", 0, TS_OP_LIST, TS_ST_OK);
    assert_int_equal(ts__msg_list_head_encode(c->b, sizeof(c->b), 2, &c->len), 0);
    ts__msg_list_entry e1 = {(const uint8_t *)"log", 3, 3, 192, VER + 1};
    ts__msg_list_entry e2 = {(const uint8_t *)"", 0, 1, 136, VER};
    assert_int_equal(ts__msg_list_entry_encode(c->b + c->len, sizeof(c->b) - c->len, &e1, &n), 0);
    assert_int_equal(n, ts__msg_list_entry_size(3));
    c->len += n;
    assert_int_equal(ts__msg_list_entry_encode(c->b + c->len, sizeof(c->b) - c->len, &e2, &n), 0);
    c->len += n;
    check_case(c);
    ts__msg_list l;
    assert_int_equal(ts__msg_list_decode(c->b, c->len, &l), 0);
    ts__msg_list_iter li = {0, 0};
    ts__msg_list_entry e;
    assert_int_equal(ts__msg_list_next(&l, &li, &e), 1);
    assert_true(e.name_len == 3 && memcmp(e.name, "log", 3) == 0 && e.n_items == 3 &&
                e.bytes == 192 && e.version == VER + 1);
    assert_int_equal(ts__msg_list_next(&l, &li, &e), 1);
    assert_true(e.name_len == 0 && e.n_items == 1 && e.bytes == 136 && e.version == VER);
    assert_int_equal(ts__msg_list_next(&l, &li, &e), 0);
    free(c);

    c = new_case("LIST reply, empty", 0, TS_OP_LIST, TS_ST_OK);
    assert_int_equal(ts__msg_list_head_encode(c->b, sizeof(c->b), 0, &c->len), 0);
    check_case(c);
    free(c);

    /* NOTIFY: events and flags the decoder does not know still decode. */
    const uint8_t events[] = {TS_NOTE_PUT, TS_NOTE_DELETE, 0, 200};
    for (size_t i = 0; i < TS__ARRAY_SIZE(events); i++) {
        c = new_case("NOTIFY", 0, TS_OP_NOTIFY, 0);
        ts__msg_notify nt = {
            VER, 2, events[i], (uint8_t)(i == 3 ? 0xFF : 1), (const uint8_t *)"params", 6};
        assert_int_equal(ts__msg_notify_encode(c->b, sizeof(c->b), &nt, &c->len), 0);
        assert_int_equal(c->len, ts__msg_notify_size(6));
        check_case(c);
        free(c);
    }

    /* Empty bodies, both ways. */
    const uint8_t empty_req[] = {TS_OP_PING, TS_OP_LIST, TS_OP_STATS, TS_OP_SAVE};
    for (size_t i = 0; i < TS__ARRAY_SIZE(empty_req); i++) {
        c = new_case(ts__op_name(empty_req[i]), 1, empty_req[i], 0);
        check_case(c);
        free(c);
    }
    const uint8_t empty_rep[] = {TS_OP_PING, TS_OP_UNLISTEN, TS_OP_SAVE};
    for (size_t i = 0; i < TS__ARRAY_SIZE(empty_rep); i++) {
        c = new_case(ts__op_name(empty_rep[i]), 0, empty_rep[i], TS_ST_OK);
        check_case(c);
        free(c);
    }

    /* STATS: a record fills the body; at least its header must be there. */
    c = new_case("STATS reply", 0, TS_OP_STATS, TS_ST_OK);
    size_t rl;
    uint8_t *rec = record_of(ts_int_new(1), &rl);
    memcpy(c->b, rec, rl);
    c->len = rl;
    ts__free_aligned(rec, rl);
    c->prefix_ok_from = TS_REC_HDR_SIZE;
    c->trailing_ok = 1;
    check_case(c);
    free(c);

    /* Error bodies: any prefix of a message is a message. */
    c = new_case("error reply", 0, TS_OP_GET, TS_ST_NOT_FOUND);
    assert_int_equal(ts__msg_error_encode(c->b, sizeof(c->b), "no such bin", 11, &c->len), 0);
    c->prefix_ok_from = 0;
    c->trailing_ok = 1;
    check_case(c);
    free(c);
}

/* Every byte of every reserved field and every padding byte must be 0. */
static void test_reserved_fields(void **state)
{
    (void)state;
    uint8_t b[512];
    size_t len;
    ts__msg_hello_rep hr = {.version = 1, .max_body = 1, .server_id = 2};
    assert_int_equal(ts__msg_hello_rep_encode(b, sizeof(b), &hr, &len), 0);
    for (int i = 2; i < 8; i++)
        for (int bit = 0; bit < 8; bit++) {
            b[i] = (uint8_t)(1u << bit);
            assert_int_equal(ts__msg_hello_rep_decode(b, len, &hr), TS_EPROTO);
            b[i] = 0;
        }

    ts__msg_bin_state st;
    assert_int_equal(ts__msg_bin_state_encode(b, sizeof(b), VER, 1, &len), 0);
    for (int i = 12; i < 16; i++) {
        b[i] = 0x80;
        assert_int_equal(ts__msg_bin_state_decode(b, len, &st), TS_EPROTO);
        b[i] = 0;
    }
    assert_int_equal(ts__msg_bin_state_decode(b, len, &st), 0);

    ts__msg_list l;
    assert_int_equal(ts__msg_list_head_encode(b, sizeof(b), 0, &len), 0);
    for (int i = 4; i < 8; i++) {
        b[i] = 1;
        assert_int_equal(ts__msg_list_decode(b, len, &l), TS_EPROTO);
        b[i] = 0;
    }

    /* ITEMS: the head's padding and the padding after a record. */
    size_t rl;
    uint8_t *rec = record_of(ts_bytes_new("abc", 3, TS_COPY), &rl);
    assert_true(rl % 64 != 0);
    uint64_t rlen = rl;
    const uint8_t *recs[1] = {rec};
    assert_int_equal(ts__msg_items_encode(b, sizeof(b), VER, 0, 1, recs, &rlen, &len), 0);
    ts__msg_items it;
    assert_int_equal(ts__msg_items_decode(b, len, &it), 0);
    for (size_t i = 24; i < 64; i++) {
        b[i] = 1;
        assert_int_equal(ts__msg_items_decode(b, len, &it), TS_EPROTO);
        b[i] = 0;
    }
    for (size_t i = 64 + rl; i < len; i++) {
        b[i] = 0x40;
        assert_int_equal(ts__msg_items_decode(b, len, &it), TS_EPROTO);
        b[i] = 0;
    }
    ts__free_aligned(rec, rl);
}

/* Lengths that would overflow or point past the body are refused before anything uses them. */
static void test_length_overflow(void **state)
{
    (void)state;
    uint8_t b[256];
    ts__msg_items it;
    ts__msg_list l;
    uint64_t size;

    /* ITEMS: n so large the lengths cannot be in the body. */
    memset(b, 0, sizeof(b));
    ts__put_u32le(b + 8, UINT32_MAX);
    assert_int_equal(ts__msg_items_decode(b, sizeof(b), &it), TS_EPROTO);
    ts__put_u32le(b + 8, 6); /* 6 lengths fill the first 64 bytes */
    /* An item length whose padding wraps, one that ends past the body, one at the limit. */
    ts__put_u64le(b + 16, UINT64_MAX - 10);
    assert_int_equal(ts__msg_items_decode(b, 128, &it), TS_EPROTO);
    ts__put_u64le(b + 16, UINT64_MAX - 63);
    assert_int_equal(ts__msg_items_decode(b, 128, &it), TS_EPROTO);
    ts__put_u64le(b + 16, 65);
    assert_int_equal(ts__msg_items_decode(b, 128, &it), TS_EPROTO);
    ts__put_u64le(b + 16, 64);
    assert_int_equal(ts__msg_items_decode(b, 128, &it), 0);
    /* The second item's offset plus its length wraps. */
    ts__put_u64le(b + 24, UINT64_MAX - 127);
    assert_int_equal(ts__msg_items_decode(b, 128, &it), TS_EPROTO);
    /* The size function refuses totals over 64 bits. */
    uint64_t lens[2] = {UINT64_MAX - 100, 1000};
    assert_int_equal(ts__msg_items_size(2, lens, &size), TS_EMSGSIZE);
    lens[0] = UINT64_MAX;
    assert_int_equal(ts__msg_items_size(1, lens, &size), TS_EMSGSIZE);
    assert_int_equal(ts__msg_items_size(0, NULL, &size), 0);
    assert_true(size == 64);

    /* LIST: a count no body could hold, and one entry short. */
    memset(b, 0, sizeof(b));
    ts__put_u32le(b, UINT32_MAX);
    assert_int_equal(ts__msg_list_decode(b, sizeof(b), &l), TS_EPROTO);
    ts__put_u32le(b, 2);
    assert_int_equal(ts__msg_list_decode(b, 8 + 21, &l), TS_EPROTO);
    assert_int_equal(ts__msg_list_decode(b, 8 + 42, &l), 0);
    /* An entry whose name runs past the body. */
    b[8] = 200;
    assert_int_equal(ts__msg_list_decode(b, 8 + 42, &l), TS_EPROTO);

    /* HELLO: a token length past the body. */
    ts__msg_hello_req hq;
    uint8_t h[8] = {1, 0, 0xFF, 0xFF, 'a', 'b', 'c', 'd'};
    assert_int_equal(ts__msg_hello_req_decode(h, sizeof(h), &hq), TS_EPROTO);
    ts__put_u16le(h + 2, 4);
    assert_int_equal(ts__msg_hello_req_decode(h, sizeof(h), &hq), 0);
    assert_int_equal(hq.token_len, 4);
    assert_ptr_equal(hq.token, h + 4);
    /* A token longer than the pre-HELLO limit allows, even when the body holds it. */
    static uint8_t big[TS_MSG_HELLO_REQ_FIXED + TS_MAX_TOKEN_LEN + 1];
    ts__put_u16le(big + 2, TS_MAX_TOKEN_LEN + 1);
    assert_int_equal(ts__msg_hello_req_decode(big, sizeof(big), &hq), TS_EPROTO);
    ts__put_u16le(big + 2, TS_MAX_TOKEN_LEN);
    assert_int_equal(ts__msg_hello_req_decode(big, sizeof(big) - 1, &hq), 0);

    /* PUT: the streaming head asks for more bytes only when the body can hold them. */
    ts__msg_put_req p;
    uint8_t ph[4] = {3, 'a', 'b', 'c'};
    assert_int_equal(ts__msg_put_head_decode(ph, 0, 0, &p), TS_EPROTO);
    assert_int_equal(ts__msg_put_head_decode(ph, 0, 100, &p), TS_EAGAIN);
    assert_int_equal(ts__msg_put_head_decode(ph, 1, 3, &p), TS_EPROTO);
    assert_int_equal(ts__msg_put_head_decode(ph, 2, 100, &p), TS_EAGAIN);
    assert_int_equal(ts__msg_put_head_decode(ph, 4, 4, &p), 0);
    assert_true(p.rec_len == 0 && p.head_len == 4 && p.record == NULL);
    assert_int_equal(ts__msg_put_head_decode(ph, 4, UINT64_MAX, &p), 0);
    assert_true(p.rec_len == UINT64_MAX - 4);
    assert_ptr_equal(p.name, ph + 1);

    /* Error messages: at most TS_MAX_ERRMSG bytes. */
    static uint8_t msg[TS_MAX_ERRMSG + 1];
    ts__msg_error er;
    size_t len;
    assert_int_equal(ts__msg_error_decode(msg, TS_MAX_ERRMSG, &er), 0);
    assert_int_equal(ts__msg_error_decode(msg, TS_MAX_ERRMSG + 1, &er), TS_EPROTO);
    assert_int_equal(
        ts__msg_error_encode(msg, sizeof(msg), (const char *)msg, TS_MAX_ERRMSG + 1, &len),
        TS_EINVAL);
}

/* Names: 0 to 255 bytes encode and decode; 256 is refused by every encoder. */
static void test_name_limits(void **state)
{
    (void)state;
    uint8_t b[600];
    size_t len;
    ts__msg_name_req q = {.name = long_name, .name_len = TS_MAX_NAME_LEN};
    assert_int_equal(ts__msg_name_req_encode(b, sizeof(b), &q, &len), 0);
    assert_int_equal(len, 256);
    assert_int_equal(b[0], 255);
    ts__msg_name_req d;
    assert_int_equal(ts__msg_name_req_decode(b, len, &d), 0);
    assert_int_equal(d.name_len, TS_MAX_NAME_LEN);
    /* The length byte says more than the body has. */
    assert_int_equal(ts__msg_name_req_decode(b, len - 1, &d), TS_EPROTO);
    b[0] = 0;
    assert_int_equal(ts__msg_name_req_decode(b, 1, &d), 0);
    assert_int_equal(d.name_len, 0);
    assert_int_equal(ts__msg_name_req_decode(b, 0, &d), TS_EPROTO);

    static uint8_t too_long[TS_MAX_NAME_LEN + 1];
    q.name = too_long;
    q.name_len = TS_MAX_NAME_LEN + 1;
    assert_int_equal(ts__msg_name_req_encode(b, sizeof(b), &q, &len), TS_ENAMETOOLONG);
    assert_int_equal(ts__msg_get_req_encode(b, sizeof(b), &q, &len), TS_ENAMETOOLONG);
    assert_int_equal(ts__msg_wait_req_encode(b, sizeof(b), &q, &len), TS_ENAMETOOLONG);
    assert_int_equal(ts__msg_put_head_encode(b, sizeof(b), too_long, sizeof(too_long), &len),
                     TS_ENAMETOOLONG);
    assert_int_equal(ts__msg_put_encode(b, sizeof(b), too_long, sizeof(too_long), NULL, 0, &len),
                     TS_ENAMETOOLONG);
    ts__msg_notify nt = {.name = too_long, .name_len = sizeof(too_long)};
    assert_int_equal(ts__msg_notify_encode(b, sizeof(b), &nt, &len), TS_ENAMETOOLONG);
    ts__msg_list_entry e = {.name = too_long, .name_len = sizeof(too_long)};
    assert_int_equal(ts__msg_list_entry_encode(b, sizeof(b), &e, &len), TS_ENAMETOOLONG);
    /* A buffer one byte short is refused before anything is written. */
    memset(b, 0xEE, sizeof(b));
    q.name_len = 10;
    assert_int_equal(ts__msg_wait_req_encode(b, ts__msg_wait_req_size(10) - 1, &q, &len),
                     TS_EMSGSIZE);
    assert_int_equal(b[0], 0xEE);
    /* HELLO tokens are bounded by the pre-HELLO body limit. */
    ts__msg_hello_req hq = {.token_len = TS_MAX_TOKEN_LEN + 1, .token = too_long};
    assert_int_equal(ts__msg_hello_req_encode(b, sizeof(b), &hq, &len), TS_EINVAL);
}

/* The opcode table of section 8 and the body limits of section 12. */
static void test_opcode_table(void **state)
{
    (void)state;
    static const struct {
        uint8_t op;
        ts__msg_kind req, rep;
        int upload, changes;
    } want[] = {
        {TS_OP_HELLO, TS_MSG_HELLO_REQ, TS_MSG_HELLO_REP, 0, 0},
        {TS_OP_PING, TS_MSG_EMPTY, TS_MSG_EMPTY, 0, 0},
        {TS_OP_PUT, TS_MSG_PUT_REQ, TS_MSG_BIN_STATE, 1, 1},
        {TS_OP_APPEND, TS_MSG_PUT_REQ, TS_MSG_BIN_STATE, 1, 1},
        {TS_OP_GET, TS_MSG_GET_REQ, TS_MSG_ITEMS, 0, 1},
        {TS_OP_PEEK, TS_MSG_GET_REQ, TS_MSG_ITEMS, 0, 0},
        {TS_OP_DELETE, TS_MSG_NAME_REQ, TS_MSG_BIN_STATE, 0, 1},
        {TS_OP_LIST, TS_MSG_EMPTY, TS_MSG_LIST_REP, 0, 0},
        {TS_OP_LISTEN, TS_MSG_NAME_REQ, TS_MSG_BIN_STATE, 0, 0},
        {TS_OP_UNLISTEN, TS_MSG_NAME_REQ, TS_MSG_EMPTY, 0, 0},
        {TS_OP_WAIT, TS_MSG_WAIT_REQ, TS_MSG_BIN_STATE, 0, 0},
        {TS_OP_STATS, TS_MSG_EMPTY, TS_MSG_RECORD, 0, 0},
        {TS_OP_SAVE, TS_MSG_EMPTY, TS_MSG_EMPTY, 0, 0},
        {TS_OP_GET_REF, TS_MSG_GET_REQ, TS_MSG_REF_ITEMS, 0, 1},
        {TS_OP_PEEK_REF, TS_MSG_GET_REQ, TS_MSG_REF_ITEMS, 0, 0},
        {TS_OP_PUT_FD, TS_MSG_PUT_FD_REQ, TS_MSG_BIN_STATE, 0, 1},
        {TS_OP_APPEND_FD, TS_MSG_PUT_FD_REQ, TS_MSG_BIN_STATE, 0, 1},
        {TS_OP_TENSOR_BIN, TS_MSG_TENSOR_BIN_REQ, TS_MSG_BIN_STATE, 0, 1},
        {TS_OP_READ_ROWS, TS_MSG_READ_ROWS_REQ, TS_MSG_ITEMS, 0, 0},
        {TS_OP_GATHER_ROWS, TS_MSG_PUT_REQ, TS_MSG_ITEMS, 1, 0},
        {TS_OP_WRITE_ROWS, TS_MSG_PUT_REQ, TS_MSG_BIN_STATE, 1, 1},
        {TS_OP_STREAM_CREATE, TS_MSG_STREAM_CREATE_REQ, TS_MSG_STREAM_STATE, 0, 1},
        {TS_OP_STREAM_APPEND, TS_MSG_PUT_REQ, TS_MSG_STREAM_APPEND_STATE, 1, 1},
        {TS_OP_STREAM_MARK, TS_MSG_STREAM_MARK_REQ, TS_MSG_STREAM_APPEND_STATE, 0, 1},
        {TS_OP_STREAM_CREDIT, TS_MSG_STREAM_CREDIT_REQ, TS_MSG_STREAM_STATE, 0, 0},
        {TS_OP_STREAM_JOIN, TS_MSG_STREAM_JOIN_REQ, TS_MSG_STREAM_JOIN_STATE, 0, 1},
        {TS_OP_STREAM_READ, TS_MSG_STREAM_READ_REQ, TS_MSG_STREAM_ENTRIES, 0, 1},
        {TS_OP_STREAM_ACK, TS_MSG_STREAM_ACK_REQ, TS_MSG_STREAM_ACK_STATE, 0, 1},
        {TS_OP_STREAM_LEAVE, TS_MSG_STREAM_LEAVE_REQ, TS_MSG_STREAM_STATE, 0, 1},
        {TS_OP_STREAM_INFO, TS_MSG_NAME_REQ, TS_MSG_RECORD, 0, 0},
        {TS_OP_STREAM_RANGE, TS_MSG_STREAM_RANGE_REQ, TS_MSG_STREAM_ENTRIES, 0, 0},
        {TS_OP_ADD, TS_MSG_ADD_REQ, TS_MSG_ADD_STATE, 0, 1},
        {TS_OP_PUT_IF, TS_MSG_PUT_REQ, TS_MSG_BIN_STATE, 1, 1},
        {TS_OP_TAKE, TS_MSG_TAKE_REQ, TS_MSG_ITEMS, 0, 1},
        {TS_OP_MGET, TS_MSG_MGET_REQ, TS_MSG_MGET_REP, 0, 0},
        {TS_OP_BARRIER, TS_MSG_BARRIER_REQ, TS_MSG_BARRIER_STATE, 0, 0},
        {TS_OP_SVC_REGISTER, TS_MSG_SVC_REGISTER_REQ, TS_MSG_SVC_STATE, 0, 0},
        {TS_OP_SVC_CALL, TS_MSG_PUT_REQ, TS_MSG_ITEMS, 1, 0},
        {TS_OP_SVC_REPLY, TS_MSG_PUT_REQ, TS_MSG_EMPTY, 1, 0},
        {TS_OP_TABLE_CREATE, TS_MSG_TABLE_CREATE_REQ, TS_MSG_TABLE_STATE, 0, 1},
        {TS_OP_TABLE_INSERT, TS_MSG_PUT_REQ, TS_MSG_TABLE_STATE, 1, 1},
        {TS_OP_TABLE_SAMPLE, TS_MSG_TABLE_SAMPLE_REQ, TS_MSG_TABLE_SAMPLES, 0, 1},
        {TS_OP_TABLE_UPDATE, TS_MSG_TABLE_UPDATE_REQ, TS_MSG_TABLE_STATE, 0, 1},
        {TS_OP_TABLE_REMOVE, TS_MSG_TABLE_REMOVE_REQ, TS_MSG_TABLE_STATE, 0, 1},
        {TS_OP_TABLE_INFO, TS_MSG_NAME_REQ, TS_MSG_RECORD, 0, 0},
        {TS_OP_SHARD_MAP, TS_MSG_EMPTY, TS_MSG_SHARD_MAP, 0, 0},
        {TS_OP_AUTH_CHALLENGE, TS_MSG_AUTH_NONCE, TS_MSG_AUTH_NONCE, 0, 0},
        {TS_OP_PS_CREATE, TS_MSG_PS_CREATE_REQ, TS_MSG_BIN_STATE, 0, 1},
        {TS_OP_PS_PUSH, TS_MSG_PUT_REQ, TS_MSG_BIN_STATE, 1, 1},
        {TS_OP_PS_PULL, TS_MSG_PS_PULL_REQ, TS_MSG_ITEMS, 0, 0},
        {TS_OP_EMB_CREATE, TS_MSG_EMB_CREATE_REQ, TS_MSG_BIN_STATE, 0, 1},
        {TS_OP_EMB_PULL, TS_MSG_PUT_REQ, TS_MSG_ITEMS, 1, 0},
        {TS_OP_EMB_PUSH, TS_MSG_PUT_REQ, TS_MSG_BIN_STATE, 1, 1},
        {TS_OP_NOTIFY, TS_MSG_NONE, TS_MSG_NOTIFY, 0, 0},
        {TS_OP_SVC_REQUEST, TS_MSG_NONE, TS_MSG_SVC_REQUEST, 0, 0},
    };
    int known = 0;
    for (int op = 0; op < 256; op++)
        known += ts__msg_op_info((uint8_t)op) != NULL;
    assert_int_equal(known, TS__ARRAY_SIZE(want));
    for (size_t i = 0; i < TS__ARRAY_SIZE(want); i++) {
        const ts__msg_op *o = ts__msg_op_info(want[i].op);
        assert_non_null(o);
        assert_int_equal(o->request, want[i].req);
        assert_int_equal(o->reply, want[i].rep);
        assert_int_equal(o->upload, want[i].upload);
        assert_int_equal(o->changes, want[i].changes);
        /* Fixed fields after the name are for uploads only, and bounded. */
        assert_true(o->upload_fixed <= TS_MSG_MAX_UPLOAD_FIXED);
        if (!o->upload || want[i].op <= TS_OP_STREAM_RANGE)
            assert_int_equal(o->upload_fixed, 0);
        if (want[i].op == TS_OP_PUT_IF)
            assert_int_equal(o->upload_fixed, TS_MSG_PUT_IF_FIXED);
        assert_int_equal(ts__msg_reply_kind(want[i].op, TS_ST_OK), want[i].rep);
        /* Every other status carries a message, except WAIT's TIMEOUT. */
        for (uint16_t st = 1; st < TS_ST_COUNT_ + 3; st++) {
            ts__msg_kind k = ts__msg_reply_kind(want[i].op, st);
            if (want[i].op == TS_OP_NOTIFY || want[i].op == TS_OP_SVC_REQUEST)
                assert_int_equal(k, TS_MSG_NONE);
            else if (want[i].op == TS_OP_WAIT && st == TS_ST_TIMEOUT)
                assert_int_equal(k, TS_MSG_BIN_STATE);
            else if (want[i].op == TS_OP_PUT_IF && st == TS_ST_VERSION_MISMATCH)
                assert_int_equal(k, TS_MSG_BIN_STATE);
            else if (want[i].op == TS_OP_PS_PUSH && st == TS_ST_STALE_GRADIENT)
                assert_int_equal(k, TS_MSG_BIN_STATE);
            else if (st == TS_ST_WRONG_SHARD)
                assert_int_equal(k, TS_MSG_WRONG_SHARD);
            else
                assert_int_equal(k, TS_MSG_ERROR);
        }
        /* Limits: 4096 before HELLO, then max_frame for uploads and 4096 for the rest. */
        uint64_t mf = (uint64_t)1 << 30;
        assert_true(ts__msg_request_limit(want[i].op, 0, mf) == TS_MAX_PREAUTH_BODY);
        assert_true(ts__msg_request_limit(want[i].op, 1, mf) ==
                    (want[i].upload ? mf : TS_MAX_CTRL_BODY));
        assert_true(ts__msg_request_limit(want[i].op, 1, 100) == 100);
    }
    /*
     * Connection-level errors (opcode 0) and errors about unknown opcodes (0x7F, which no
     * feature has) carry a message.
     */
    assert_int_equal(ts__msg_reply_kind(0, TS_ST_TOO_MANY_CLIENTS), TS_MSG_ERROR);
    assert_int_equal(ts__msg_reply_kind(0x7F, TS_ST_UNKNOWN_OPCODE), TS_MSG_ERROR);
    assert_int_equal(ts__msg_reply_kind(0, TS_ST_OK), TS_MSG_NONE);
    assert_int_equal(ts__msg_reply_kind(0x7F, TS_ST_OK), TS_MSG_NONE);
    ts__msg m;
    assert_int_equal(ts__msg_request_decode(0x7F, NULL, 0, &m), TS_EUNKNOWNOP);
    assert_int_equal(ts__msg_request_decode(TS_OP_NOTIFY, NULL, 0, &m), TS_EUNKNOWNOP);
    assert_int_equal(ts__msg_reply_decode(0x7F, TS_ST_OK, NULL, 0, &m), TS_EUNKNOWNOP);
    assert_int_equal(ts__msg_reply_decode(0, TS_ST_SHUTTING_DOWN, (const uint8_t *)"bye", 3, &m),
                     0);
    assert_int_equal(m.kind, TS_MSG_ERROR);
    assert_int_equal(m.u.error.len, 3);
}

/* Call ts__msg_error_vformat through a variadic wrapper, as the daemon does. */
static size_t fmt(char out[TS_MAX_ERRMSG], const char *f, ...)
    __attribute__((format(printf, 2, 3)));
static size_t fmt(char out[TS_MAX_ERRMSG], const char *f, ...)
{
    va_list ap;
    va_start(ap, f);
    size_t n = ts__msg_error_vformat(out, f, ap);
    va_end(ap);
    return n;
}

static void test_error_format(void **state)
{
    (void)state;
    char out[TS_MAX_ERRMSG];
    assert_int_equal(fmt(out, "no such bin: %s", "x"), 14);
    assert_memory_equal(out, "no such bin: x", 14);
    /* A long message is cut to fit, so it always decodes. */
    size_t n = fmt(out, "%2000d", 1);
    assert_int_equal(n, TS_MAX_ERRMSG - 1);
    ts__msg_error er;
    assert_int_equal(ts__msg_error_decode((const uint8_t *)out, n, &er), 0);
}

/* ----------------------------------------------------------------------------------------------
 * The examples of docs/PROTOCOL.md section 15, seen by the codec: every body the document shows
 * decodes with the decoder its opcode and status pick, and encodes back to the same bytes.
 */

/* Bytes; the largest example frame the document holds, with room to spare. */
#define DOC_MAX_FRAME 2048

static int hex_digit(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/*
 * Parse the dump of the fenced block that starts at or after p: lines of a four-digit offset,
 * then two-digit hex bytes up to the first other word. Returns the byte count, or -1.
 */
static long parse_dump(const char *p, uint8_t *out, size_t cap)
{
    p = strstr(p, "```");
    if (p == NULL || (p = strchr(p, '\n')) == NULL)
        return -1;
    size_t n = 0;
    for (p++; *p != '\0' && strncmp(p, "```", 3) != 0;) {
        const char *eol = strchr(p, '\n');
        if (eol == NULL)
            return -1;
        p += 4; /* the offset column; test_proto.c checks it */
        for (;;) {
            while (*p == ' ')
                p++;
            if (hex_digit(p[0]) < 0 || hex_digit(p[1]) < 0 || (p[2] != ' ' && p[2] != '\n'))
                break;
            if (n >= cap)
                return -1;
            out[n++] = (uint8_t)(hex_digit(p[0]) * 16 + hex_digit(p[1]));
            p += 2;
        }
        p = eol + 1;
    }
    return (long)n;
}

static void test_protocol_doc_bodies(void **state)
{
    (void)state;
    char *doc = tsh_read_source_file("docs/PROTOCOL.md", NULL);
    assert_non_null(doc);
    static uint8_t frame[DOC_MAX_FRAME], raw[DOC_MAX_FRAME], again[DOC_MAX_FRAME];
    const char *mark = "<!-- example: ";
    int examples = 0;
    uint64_t kinds_seen = 0; /* a bit per ts__msg_kind (fewer than 64) */
    for (const char *p = doc; (p = strstr(p, mark)) != NULL; p++) {
        char name[64] = {0};
        const char *end = strstr(p, " -->");
        assert_non_null(end);
        size_t nl = (size_t)(end - p) - strlen(mark);
        assert_true(nl < sizeof(name));
        memcpy(name, p + strlen(mark), nl);
        long n = parse_dump(end, frame, sizeof(frame));
        if (n < TS_HDR_SIZE)
            fail_msg("docs/PROTOCOL.md: example %s has no frame", name);
        ts__hdr h;
        uint8_t magic = frame[0] == TS_MAGIC_REP ? TS_MAGIC_REP : TS_MAGIC_REQ;
        assert_int_equal(ts__hdr_decode(frame, magic, &h), 0);
        assert_true(h.body_len == (uint64_t)n - TS_HDR_SIZE);
        const uint8_t *body = frame + TS_HDR_SIZE;
        size_t len = (size_t)h.body_len;
        if (h.flags & TS_FLAG_LZ4) {
            uint64_t raw_len;
            assert_int_equal(ts__lz4_raw_len(body, len, &raw_len), 0);
            assert_true(raw_len <= sizeof(raw));
            assert_int_equal(ts__lz4_decompress(body, len, raw, (size_t)raw_len), 0);
            body = raw;
            len = (size_t)raw_len;
        }
        ts__msg m;
        int rc = magic == TS_MAGIC_REQ ? ts__msg_request_decode(h.opcode, body, len, &m)
                                       : ts__msg_reply_decode(h.opcode, h.status, body, len, &m);
        if (rc != 0)
            fail_msg("docs/PROTOCOL.md: the body of example %s does not decode (%d)", name, rc);
        assert_true(m.kind < 64);
        kinds_seen |= (uint64_t)1 << m.kind;
        size_t elen = 0;
        assert_int_equal(ts__msg_encode(&m, again, sizeof(again), &elen), 0);
        if (m.kind == TS_MSG_EMPTY)
            assert_int_equal(len, 0);
        else if (m.kind == TS_MSG_RECORD)
            assert_int_equal(ts__record_validate(body, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), 0);
        else if (elen != len || memcmp(again, body, len) != 0)
            fail_msg("docs/PROTOCOL.md: example %s is not what the encoder writes", name);
        if (m.kind == TS_MSG_PUT_REQ)
            assert_int_equal(ts__record_validate(m.u.put.record, (size_t)m.u.put.rec_len,
                                                 TS_MAX_DEPTH, TS_MAX_NDIM, NULL),
                             0);
        examples++;
    }
    free(doc);
    /* The document shows every kind of body there is. */
    assert_true(examples >= 30);
    for (int k = TS_MSG_EMPTY; k <= TS_MSG_ERROR; k++)
        if (!(kinds_seen & ((uint64_t)1 << k)))
            fail_msg("docs/PROTOCOL.md: no example of body kind %d", k);
}

static int setup(void **state)
{
    (void)state;
    memset(long_name, 'n', sizeof(long_name));
    return 0;
}

/* The REF_ITEMS reply and the PUT_FD request (msg_ref.c): round trips and strictness. */
static void test_ref_bodies(void **state)
{
    (void)state;
    static uint8_t buf[4096];
    static const uint8_t rec[100] = {1, 2, 3};
    ts__msg_ref_entry e[3] = {
        {.where = TS_REF_FD, .flags = 0, .offset = 4096, .length = 5000, .file_len = 12288},
        {.where = TS_REF_INLINE, .length = sizeof(rec)},
        {.where = TS_REF_FD, .flags = TS_REF_LIVE, .offset = 0, .length = 7, .file_len = 4096},
    };
    const uint8_t *recs[3] = {NULL, rec, NULL};
    size_t len;
    assert_int_equal(ts__msg_ref_encode(buf, sizeof(buf), 42, 9, 3, e, recs, &len), 0);
    assert_int_equal(ts__msg_ref_head_size(3), 128);
    assert_int_equal(len, 128 + 128);
    assert_int_equal(e[1].offset, 128);
    ts__msg_ref_items m;
    assert_int_equal(ts__msg_ref_decode(buf, len, &m), 0);
    assert_true(m.version == 42);
    assert_int_equal(m.n_items, 3);
    assert_int_equal(m.remaining, 9);
    assert_int_equal(m.n_fds, 2);
    ts__msg_ref_entry g;
    ts__msg_ref_entry_get(&m, 2, &g);
    assert_int_equal(g.where, TS_REF_FD);
    assert_int_equal(g.flags, TS_REF_LIVE);
    assert_int_equal(g.length, 7);
    ts__msg_ref_entry_get(&m, 1, &g);
    assert_memory_equal(buf + g.offset, rec, sizeof(rec));
    /* Through the opcode table, and back to the same bytes. */
    ts__msg d;
    assert_int_equal(ts__msg_reply_decode(TS_OP_PEEK_REF, TS_ST_OK, buf, len, &d), 0);
    assert_int_equal(d.kind, TS_MSG_REF_ITEMS);
    static uint8_t again[4096];
    size_t alen;
    assert_int_equal(ts__msg_encode(&d, again, sizeof(again), &alen), 0);
    assert_int_equal(alen, len);
    assert_memory_equal(again, buf, len);
    /* Strictness: each broken rule is refused. */
    static uint8_t bad[4096];
    size_t offs[] = {
        16,        /* n_fds */
        20,        /* reserved */
        24 + 1,    /* entry 0 flags */
        24 + 2,    /* entry 0 reserved */
        24 + 8,    /* entry 0 offset (no longer page-aligned) */
        56 + 0,    /* entry 1 where */
        56 + 8,    /* entry 1 offset (not where the record is) */
        56 + 24,   /* entry 1 file_len */
        120,       /* padding of the head */
        128 + 100, /* padding of the inline record */
    };
    for (size_t i = 0; i < TS__ARRAY_SIZE(offs); i++) {
        memcpy(bad, buf, len);
        bad[offs[i]] ^= 0x02; /* 0x01 would be the valid flag LIVE */
        assert_int_equal(ts__msg_ref_decode(bad, len, &m), TS_EPROTO);
    }
    assert_int_equal(ts__msg_ref_decode(buf, len - 1, &m), TS_EPROTO);
    assert_int_equal(ts__msg_ref_decode(buf, 23, &m), TS_EPROTO);
    /* A file entry must lie inside its file; at most TS_MAX_REF_ITEMS entries. */
    e[0].file_len = 4096 + 4999;
    assert_int_equal(ts__msg_ref_encode(buf, sizeof(buf), 42, 9, 3, e, recs, &len), TS_EINVAL);
    e[0].offset = UINT64_MAX - 4095;
    e[0].file_len = UINT64_MAX;
    assert_int_equal(ts__msg_ref_encode(buf, sizeof(buf), 42, 9, 3, e, recs, &len), TS_EINVAL);
    memset(bad, 0, sizeof(bad));
    ts__put_u32le(bad + 8, TS_MAX_REF_ITEMS + 1);
    assert_int_equal(ts__msg_ref_decode(bad, sizeof(bad), &m), TS_EPROTO);
    assert_int_equal(ts__msg_ref_encode(buf, 10, 1, 0, 0, e, recs, &len), TS_EMSGSIZE);

    /* PUT_FD: name, u64 record_len, nothing more. */
    ts__msg_put_fd_req q = {.name = (const uint8_t *)"frames", .name_len = 6, .rec_len = 77};
    assert_int_equal(ts__msg_put_fd_req_encode(buf, sizeof(buf), &q, &len), 0);
    assert_int_equal(len, ts__msg_put_fd_req_size(6));
    assert_int_equal(ts__msg_request_decode(TS_OP_APPEND_FD, buf, len, &d), 0);
    assert_int_equal(d.kind, TS_MSG_PUT_FD_REQ);
    assert_true(d.u.put_fd.rec_len == 77);
    assert_int_equal(d.u.put_fd.name_len, 6);
    assert_int_equal(ts__msg_put_fd_req_decode(buf, len - 1, &d.u.put_fd), TS_EPROTO);
    buf[len] = 0;
    assert_int_equal(ts__msg_put_fd_req_decode(buf, len + 1, &d.u.put_fd), TS_EPROTO);
    assert_int_equal(ts__msg_request_fds(TS_OP_PUT_FD), 1);
    assert_int_equal(ts__msg_request_fds(TS_OP_GET_REF), 0);
}

/*
 * Uploads with fixed fields between the name and the record: encode, decode whole and as a
 * streaming head at every split, and refuse bodies too short for the fixed part.
 */
static void test_upload_fixed(void **state)
{
    (void)state;
    static const uint8_t rec[5] = {1, 2, 3, 4, 5};
    static const uint8_t fx[8] = {0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88};
    uint8_t b[64];
    size_t len;
    assert_int_equal(ts__msg_upload_head_size(3, 8), 12);
    assert_int_equal(ts__msg_upload_encode(b, sizeof(b), (const uint8_t *)"abc", 3, fx, 8, rec,
                                           sizeof(rec), &len),
                     0);
    assert_int_equal(len, 17);
    assert_int_equal(b[0], 3);
    assert_memory_equal(b + 4, fx, 8);
    assert_memory_equal(b + 12, rec, 5);
    ts__msg_put_req m;
    assert_int_equal(ts__msg_upload_decode(b, len, 8, &m), 0);
    assert_true(m.name == b + 1 && m.name_len == 3 && m.fixed == b + 4 && m.fixed_len == 8);
    assert_true(m.head_len == 12 && m.rec_len == 5 && m.record == b + 12);
    /* With fixed_len 0 the same bytes are a PUT body whose record starts after the name. */
    assert_int_equal(ts__msg_put_decode(b, len, &m), 0);
    assert_true(m.fixed == NULL && m.fixed_len == 0 && m.head_len == 4 && m.rec_len == 13);
    /* Streaming: more bytes are asked for until the fixed fields are in. */
    for (size_t avail = 0; avail <= len; avail++) {
        int rc = ts__msg_upload_head_decode(b, avail, len, 8, &m);
        assert_int_equal(rc, avail < 12 ? TS_EAGAIN : 0);
        if (rc == 0)
            assert_true(m.fixed == b + 4 && m.record == NULL && m.rec_len == 5);
    }
    /* A body that cannot hold the fixed fields is malformed, whatever has arrived. */
    assert_int_equal(ts__msg_upload_head_decode(b, 1, 11, 8, &m), TS_EPROTO);
    assert_int_equal(ts__msg_upload_decode(b, 11, 8, &m), TS_EPROTO);
    assert_int_equal(ts__msg_upload_decode(b, 12, 8, &m), 0);
    assert_true(m.rec_len == 0);
    /* The head encoder writes zeros when no fixed bytes are given; limits. */
    memset(b, 0xEE, sizeof(b));
    assert_int_equal(
        ts__msg_upload_head_encode(b, sizeof(b), (const uint8_t *)"x", 1, NULL, 8, &len), 0);
    assert_int_equal(len, 10);
    static const uint8_t zero[8];
    assert_memory_equal(b + 2, zero, 8);
    assert_int_equal(ts__msg_upload_head_encode(b, 9, (const uint8_t *)"x", 1, NULL, 8, &len),
                     TS_EMSGSIZE);
    assert_int_equal(ts__msg_upload_head_encode(b, sizeof(b), (const uint8_t *)"x", 1, NULL,
                                                TS_MSG_MAX_UPLOAD_FIXED + 1, &len),
                     TS_EINVAL);
    static uint8_t too_long[TS_MAX_NAME_LEN + 1];
    assert_int_equal(
        ts__msg_upload_encode(b, sizeof(b), too_long, sizeof(too_long), fx, 8, NULL, 0, &len),
        TS_ENAMETOOLONG);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip_every_body), cmocka_unit_test(test_reserved_fields),
        cmocka_unit_test(test_length_overflow),       cmocka_unit_test(test_name_limits),
        cmocka_unit_test(test_opcode_table),          cmocka_unit_test(test_error_format),
        cmocka_unit_test(test_protocol_doc_bodies),   cmocka_unit_test(test_ref_bodies),
        cmocka_unit_test(test_upload_fixed),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
