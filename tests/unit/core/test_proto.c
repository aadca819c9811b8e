/* Unit tests for the frame codec and the bounded reader (src/proto.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>

#include "auth.h"
#include "compress.h"
#include "harness.h"
#include "proto.h"
#include "record.h"

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

/* Every header byte lands where docs/PROTOCOL.md says, little-endian, field by field. */
static void test_header_layout(void **state)
{
    (void)state;
    ts__hdr h = {.magic = TS_MAGIC_REP,
                 .version = 1,
                 .opcode = 0xA5,
                 .flags = 0x01,
                 .status = 0xB1B2,
                 .request_id = 0xC1C2C3C4,
                 .body_len = 0xD1D2D3D4D5D6D7D8ull};
    uint8_t buf[TS_HDR_SIZE];
    memset(buf, 0xEE, sizeof(buf));
    ts__hdr_encode(&h, buf);
    static const uint8_t expect[TS_HDR_SIZE] = {
        0x74, 0x01, 0xA5, 0x01, 0xB2, 0xB1, 0x00, 0x00, 0xC4, 0xC3, 0xC2, 0xC1,
        0x00, 0x00, 0x00, 0x00, 0xD8, 0xD7, 0xD6, 0xD5, 0xD4, 0xD3, 0xD2, 0xD1,
    };
    assert_memory_equal(buf, expect, sizeof(expect));
    ts__hdr d;
    assert_int_equal(ts__hdr_decode(buf, TS_MAGIC_REP, &d), 0);
    assert_int_equal(d.magic, TS_MAGIC_REP);
    assert_int_equal(d.version, 1);
    assert_int_equal(d.opcode, 0xA5);
    assert_int_equal(d.status, 0xB1B2);
    assert_int_equal(d.request_id, 0xC1C2C3C4);
    assert_true(d.body_len == 0xD1D2D3D4D5D6D7D8ull);
    /* The decoder leaves the opcode, status and length to the caller: any value decodes. */
    buf[2] = 0;
    buf[4] = 0xFF;
    buf[5] = 0xFF;
    memset(buf + 16, 0xFF, 8);
    assert_int_equal(ts__hdr_decode(buf, TS_MAGIC_REP, &d), 0);
    assert_true(d.body_len == UINT64_MAX);
    assert_int_equal(d.status, 0xFFFF);
}

/* Every version but 1, every unknown flag bit, every bit of every reserved byte is refused. */
static void test_header_rejects_exhaustively(void **state)
{
    (void)state;
    ts__hdr h = {.magic = TS_MAGIC_REQ, .version = TS_PROTO_VERSION, .opcode = TS_OP_GET};
    uint8_t buf[TS_HDR_SIZE];
    ts__hdr_encode(&h, buf);
    ts__hdr d;
    for (int m = 0; m < 256; m++) {
        uint8_t bad[TS_HDR_SIZE];
        memcpy(bad, buf, sizeof(bad));
        bad[0] = (uint8_t)m;
        assert_int_equal(ts__hdr_decode(bad, TS_MAGIC_REQ, &d), m == TS_MAGIC_REQ ? 0 : TS_EPROTO);
        bad[0] = buf[0];
        bad[1] = (uint8_t)m;
        assert_int_equal(ts__hdr_decode(bad, TS_MAGIC_REQ, &d), m == 1 ? 0 : TS_EPROTO);
        bad[1] = buf[1];
        bad[3] = (uint8_t)m;
        assert_int_equal(ts__hdr_decode(bad, TS_MAGIC_REQ, &d),
                         (m & ~TS_FLAGS_KNOWN) == 0 ? 0 : TS_EPROTO);
    }
    const int rsvd[] = {6, 7, 12, 13, 14, 15};
    for (size_t i = 0; i < TS__ARRAY_SIZE(rsvd); i++) {
        for (int bit = 0; bit < 8; bit++) {
            uint8_t bad[TS_HDR_SIZE];
            memcpy(bad, buf, sizeof(bad));
            bad[rsvd[i]] = (uint8_t)(1u << bit);
            assert_int_equal(ts__hdr_decode(bad, TS_MAGIC_REQ, &d), TS_EPROTO);
        }
    }
    /* A failed decode leaves the output alone. */
    memset(&d, 0x5A, sizeof(d));
    ts__hdr before = d;
    buf[1] = 2;
    assert_int_equal(ts__hdr_decode(buf, TS_MAGIC_REQ, &d), TS_EPROTO);
    assert_memory_equal(&d, &before, sizeof(d));
}

/* The status table of docs/PROTOCOL.md: numbers, names and the client's error codes. */
static void test_status_table(void **state)
{
    (void)state;
    static const struct {
        uint16_t st;
        const char *name;
        int err;
    } table[] = {
        {0, "OK", 0},
        {1, "NOT_FOUND", TS_ENOENT},
        {2, "BAD_REQUEST", TS_EPROTO},
        {3, "UNKNOWN_OPCODE", TS_EUNKNOWNOP},
        {4, "BAD_RECORD", TS_EBADRECORD},
        {5, "TOO_LARGE", TS_EMSGSIZE},
        {6, "OUT_OF_MEMORY", TS_EOOM},
        {7, "UNSUPPORTED_VERSION", TS_EVERSION},
        {8, "AUTH_REQUIRED", TS_EAUTH},
        {9, "AUTH_FAILED", TS_EAUTH},
        {10, "TOO_MANY_CLIENTS", TS_ETOOMANY},
        {11, "WRONG_SHARD", TS_EWRONGSHARD},
        {12, "TIMEOUT", TS_ETIMEDOUT},
        {13, "INTERNAL", TS_ESERVER},
        {14, "SLOW_READER", TS_ESLOW},
        {15, "SHUTTING_DOWN", TS_ESHUTDOWN},
        {16, "NAME_TOO_LONG", TS_ENAMETOOLONG},
        {17, "INVALID", TS_EINVAL},
        {18, "SAVE_FAILING", TS_ESAVEFAIL},
        {19, "BACKPRESSURE", TS_EAGAIN},
        {20, "VERSION_MISMATCH", TS_ECONFLICT},
        {21, "STALE_GRADIENT", TS_ESTALE},
        {22, "SERVICE_GONE", TS_ESERVICE},
    };
    assert_int_equal(TS__ARRAY_SIZE(table), TS_ST_COUNT_);
    for (size_t i = 0; i < TS__ARRAY_SIZE(table); i++) {
        assert_int_equal(table[i].st, i);
        assert_string_equal(ts__status_name(table[i].st), table[i].name);
        assert_int_equal(ts__status_to_err(table[i].st), table[i].err);
        /* The daemon's mapping back: every status but AUTH_REQUIRED is some error's image. */
        if (table[i].st != TS_ST_AUTH_REQUIRED)
            assert_int_equal(ts__err_to_status(table[i].err), table[i].st);
    }
    /* Local-only errors a daemon may still hit map to sensible statuses. */
    assert_int_equal(ts__err_to_status(TS_ENOMEM), TS_ST_OUT_OF_MEMORY);
    assert_int_equal(ts__err_to_status(TS_ECONNRESET), TS_ST_INTERNAL);
    assert_int_equal(ts__err_to_status(-999999), TS_ST_INTERNAL);
    /* Statuses from a newer server are errors, not success. */
    for (unsigned st = TS_ST_COUNT_; st <= 0xFFFF; st += 97) {
        assert_int_equal(ts__status_to_err((uint16_t)st), TS_ESERVER);
        assert_string_equal(ts__status_name((uint16_t)st), "UNKNOWN");
    }
}

static void test_opcode_table(void **state)
{
    (void)state;
    static const struct {
        uint8_t op;
        const char *name;
    } table[] = {
        {0x01, "HELLO"},         {0x02, "PING"},          {0x03, "PUT"},
        {0x04, "APPEND"},        {0x05, "GET"},           {0x06, "PEEK"},
        {0x07, "DELETE"},        {0x08, "LIST"},          {0x09, "LISTEN"},
        {0x0A, "UNLISTEN"},      {0x0B, "WAIT"},          {0x0C, "STATS"},
        {0x0D, "SAVE"},          {0x0E, "GET_REF"},       {0x0F, "PEEK_REF"},
        {0x10, "PUT_FD"},        {0x11, "APPEND_FD"},     {0x12, "TENSOR_BIN"},
        {0x13, "READ_ROWS"},     {0x14, "GATHER_ROWS"},   {0x15, "WRITE_ROWS"},
        {0x16, "STREAM_CREATE"}, {0x17, "STREAM_APPEND"}, {0x18, "STREAM_MARK"},
        {0x19, "STREAM_CREDIT"}, {0x1A, "STREAM_JOIN"},   {0x1B, "STREAM_READ"},
        {0x1C, "STREAM_ACK"},    {0x1D, "STREAM_LEAVE"},  {0x1E, "STREAM_INFO"},
        {0x1F, "STREAM_RANGE"},  {0x20, "ADD"},           {0x21, "PUT_IF"},
        {0x22, "TAKE"},          {0x23, "MGET"},          {0x24, "BARRIER"},
        {0x25, "SVC_REGISTER"},  {0x26, "SVC_CALL"},      {0x27, "SVC_REPLY"},
        {0x81, "SVC_REQUEST"},   {0x28, "TABLE_CREATE"},  {0x29, "TABLE_INSERT"},
        {0x2A, "TABLE_SAMPLE"},  {0x2B, "TABLE_UPDATE"},  {0x2C, "TABLE_REMOVE"},
        {0x2D, "TABLE_INFO"},    {0x30, "SHARD_MAP"},     {0x31, "AUTH_CHALLENGE"},
        {0x38, "PS_CREATE"},     {0x39, "PS_PUSH"},       {0x3A, "PS_PULL"},
        {0x3B, "EMB_CREATE"},    {0x3C, "EMB_PULL"},      {0x3D, "EMB_PUSH"},
        {0x80, "NOTIFY"},
    };
    int known = 0;
    for (int op = 0; op < 256; op++) {
        const char *n = ts__op_name((uint8_t)op);
        assert_non_null(n);
        known += strcmp(n, "UNKNOWN") != 0;
    }
    assert_int_equal(known, TS__ARRAY_SIZE(table));
    for (size_t i = 0; i < TS__ARRAY_SIZE(table); i++)
        assert_string_equal(ts__op_name(table[i].op), table[i].name);
    /* Body sizes fixed by the layouts. */
    assert_int_equal(TS_BIN_STATE_SIZE, 8 + 4 + 4);
    assert_int_equal(TS_NOTIFY_FIXED, 8 + 4 + 1 + 1 + 1);
    assert_int_equal(ts__items_head_size(0), 64);
    assert_int_equal(ts__items_head_size(6), 64);
    assert_int_equal(ts__items_head_size(7), 128);
    assert_int_equal(ts__items_head_size(UINT32_MAX),
                     ts__align_up(16 + 8 * (size_t)UINT32_MAX, 64));
}

static void test_reader_values(void **state)
{
    (void)state;
    static const uint8_t body[] = {0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08,
                                   0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x0E, 0x0F};
    ts__rd r;
    ts__rd_init(&r, body, sizeof(body));
    uint8_t a;
    uint16_t b;
    uint32_t c;
    uint64_t d;
    assert_int_equal(ts__rd_u8(&r, &a), 0);
    assert_int_equal(a, 0x01);
    assert_int_equal(ts__rd_u16(&r, &b), 0);
    assert_int_equal(b, 0x0302);
    assert_int_equal(ts__rd_u32(&r, &c), 0);
    assert_int_equal(c, 0x07060504);
    assert_int_equal(ts__rd_u64(&r, &d), 0);
    assert_true(d == 0x0F0E0D0C0B0A0908ull);
    assert_int_equal(r.left, 0);
    /* Zero bytes can always be taken at the end, until an error. */
    assert_non_null(ts__rd_bytes(&r, 0));
    assert_int_equal(ts__rd_u8(&r, &a), TS_EPROTO);
    assert_null(ts__rd_bytes(&r, 0));
    /* Out-parameters stay untouched on failure. */
    d = 42;
    assert_int_equal(ts__rd_u64(&r, &d), TS_EPROTO);
    assert_true(d == 42);
    /* A read larger than what is left fails without moving. */
    ts__rd_init(&r, body, 7);
    assert_int_equal(ts__rd_u64(&r, &d), TS_EPROTO);
    assert_int_equal(r.left, 7);
    assert_ptr_equal(r.p, body);
    assert_null(ts__rd_bytes(&r, SIZE_MAX));
}

static void test_reader_names(void **state)
{
    (void)state;
    uint8_t body[1 + 255 + 1];
    body[0] = 255;
    memset(body + 1, 'n', 255);
    body[256] = 0;
    ts__rd r;
    const char *name;
    size_t len;
    /* The longest name the encoding allows, then an empty one. */
    ts__rd_init(&r, body, sizeof(body));
    assert_int_equal(ts__rd_name(&r, &name, &len), 0);
    assert_int_equal(len, TS_MAX_NAME_LEN);
    assert_ptr_equal(name, body + 1);
    assert_int_equal(ts__rd_name(&r, &name, &len), 0);
    assert_int_equal(len, 0);
    assert_int_equal(r.left, 0);
    /* One byte short of the announced length; a missing length byte. */
    ts__rd_init(&r, body, 255);
    assert_int_equal(ts__rd_name(&r, &name, &len), TS_EPROTO);
    ts__rd_init(&r, body, 0);
    assert_int_equal(ts__rd_name(&r, &name, &len), TS_EPROTO);
}

/* ----------------------------------------------------------------------------------------------
 * The hex dumps of docs/PROTOCOL.md. Each example frame is built here with the real codec
 * (ts__hdr_encode, ts__record_encode, ts__lz4_compress) and compared with the bytes the document
 * shows under its "<!-- example: NAME -->" marker, so the document cannot drift from the code.
 */

#define EX_VERSION   1764115200000042ull /* a change counter that started at 2025-11-26 00:00 */
#define EX_SERVER_ID 0x0123456789ABCDEFull

typedef struct span {
    size_t off, len;
    const char *label;
} span;

/* An example frame under construction: bytes plus labelled spans (for the dump generator). */
typedef struct fb {
    uint8_t b[2048];
    size_t n;
    span s[64];
    size_t ns;
} fb;

static void fb_put(fb *f, const void *p, size_t n, const char *label)
{
    assert_true(f->n + n <= sizeof(f->b) && f->ns < TS__ARRAY_SIZE(f->s));
    if (n > 0)
        memcpy(f->b + f->n, p, n);
    f->s[f->ns++] = (span){f->n, n, label};
    f->n += n;
}

static void fb_u8(fb *f, uint8_t v, const char *label)
{
    fb_put(f, &v, 1, label);
}

static void fb_u16(fb *f, uint16_t v, const char *label)
{
    uint8_t x[2];
    ts__put_u16le(x, v);
    fb_put(f, x, 2, label);
}

static void fb_u32(fb *f, uint32_t v, const char *label)
{
    uint8_t x[4];
    ts__put_u32le(x, v);
    fb_put(f, x, 4, label);
}

static void fb_u64(fb *f, uint64_t v, const char *label)
{
    uint8_t x[8];
    ts__put_u64le(x, v);
    fb_put(f, x, 8, label);
}

static void fb_name(fb *f, const char *name)
{
    uint8_t x[1 + TS_MAX_NAME_LEN];
    size_t n = strlen(name);
    x[0] = (uint8_t)n;
    memcpy(x + 1, name, n);
    fb_put(f, x, 1 + n, "name");
}

static void fb_zeros(fb *f, size_t n, const char *label)
{
    fb_put(f, ts__zeros, n, label);
}

/* Encode v as a record into f (and free v); returns the record's length. */
static size_t fb_record(fb *f, ts_value_t *v)
{
    uint8_t *rec;
    size_t len;
    assert_non_null(v);
    assert_int_equal(ts__record_encode(v, &rec, &len), 0);
    fb_put(f, rec, len, "record");
    ts__free_aligned(rec, len);
    ts_value_free(v);
    return len;
}

/* The frame: a header (the real encoder) followed by body's bytes and spans. */
static void fb_frame(fb *out, uint8_t magic, uint8_t op, uint8_t flags, uint16_t status,
                     uint32_t rid, const fb *body)
{
    ts__hdr h = {.magic = magic,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .flags = flags,
                 .status = status,
                 .request_id = rid,
                 .body_len = body->n};
    uint8_t hdr[TS_HDR_SIZE];
    ts__hdr_encode(&h, hdr);
    out->n = 0;
    out->ns = 0;
    fb_put(out, hdr, sizeof(hdr), "header");
    for (size_t i = 0; i < body->ns; i++)
        fb_put(out, body->b + body->s[i].off, body->s[i].len, body->s[i].label);
}

static void fb_bin_state(fb *f, uint64_t version, uint32_t n)
{
    fb_u64(f, version, "version");
    fb_u32(f, n, "n_items");
    fb_u32(f, 0, "reserved");
}

/* The record of the PUT example: {"w": float32[2] {1, 2}, "step": 7}. */
static ts_value_t *params_record(void)
{
    static const float w[2] = {1.0f, 2.0f};
    ts_value_t *m = ts_map_new();
    assert_int_equal(ts_map_set(m, "w", ts_tensor_new(TS_FLOAT32, 1, (int64_t[]){2}, w, 0)), 0);
    assert_int_equal(ts_map_set(m, "step", ts_int_new(7)), 0);
    return m;
}

/* An ITEMS body holding the given records. */
static void fb_items(fb *f, uint64_t version, uint32_t remaining, ts_value_t **recs, uint32_t n)
{
    uint8_t *enc[4];
    size_t len[4];
    assert_true(n <= 4);
    for (uint32_t i = 0; i < n; i++) {
        assert_int_equal(ts__record_encode(recs[i], &enc[i], &len[i]), 0);
        ts_value_free(recs[i]);
    }
    fb_u64(f, version, "version");
    fb_u32(f, n, "n_items");
    fb_u32(f, remaining, "remaining");
    for (uint32_t i = 0; i < n; i++)
        fb_u64(f, len[i], "item_len");
    fb_zeros(f, (size_t)ts__items_head_size(n) - (16 + 8 * (size_t)n), "padding");
    for (uint32_t i = 0; i < n; i++) {
        fb_put(f, enc[i], len[i], "record");
        if (len[i] % TS__ALIGN != 0)
            fb_zeros(f, ts__align_up(len[i], TS__ALIGN) - len[i], "padding");
        ts__free_aligned(enc[i], len[i]);
    }
}

/* Build the example called name into out; 0, or -1 for an unknown name. */
/* The bits of a double, as the table bodies carry it (little-endian binary64). */
static uint64_t f64_bits(double d)
{
    uint64_t u;
    memcpy(&u, &d, sizeof(u));
    return u;
}

/* The parameter server examples: a connection of their own, request ids from 2. */
static int build_ps_example(const char *name, fb *out)
{
    const uint8_t Q = TS_MAGIC_REQ, P = TS_MAGIC_REP;
    const uint64_t v1 = 1764160000000001ull;
    static const float grad[2] = {1.0f, 2.0f};
    static const int64_t ids[2] = {7, 3}, one_id[1] = {7};
    static const float row_grad[4] = {0.5f, -0.5f, 1.0f, -1.0f};
    /* The rows of ids 7 and 3 by the uniform initializer, seed 42, scale 0.05 (docs/PS.md). */
    static const float rows[8] = {-0x1.0e6fcap-6f, -0x1.cb453p-6f,  -0x1.a89998p-6f,
                                  0x1.779408p-5f,  -0x1.09ff72p-5f, -0x1.bd20d2p-7f,
                                  0x1.5545b6p-5f,  0x1.1d354ap-5f};
    fb b = {.n = 0};
    if (strcmp(name, "ps-create-req") == 0) {
        fb_name(&b, "w");
        fb_u8(&b, 1, "optimizer"); /* SGD */
        fb_u8(&b, 1, "mode");      /* sync */
        fb_u8(&b, 0, "flags");
        fb_u8(&b, 0, "reserved");
        fb_u32(&b, 2, "sync_k");
        fb_u32(&b, 1, "tolerance");
        fb_u32(&b, 0, "reserved");
        fb_u64(&b, f64_bits(0.5), "lr");
        fb_u64(&b, f64_bits(0.9), "beta1");
        fb_u64(&b, f64_bits(0.999), "beta2");
        fb_u64(&b, f64_bits(1e-8), "eps");
        fb_frame(out, Q, TS_OP_PS_CREATE, 0, 0, 2, &b);
    } else if (strcmp(name, "ps-create-rep") == 0) {
        fb_bin_state(&b, v1, 1);
        fb_frame(out, P, TS_OP_PS_CREATE, 0, 0, 2, &b);
    } else if (strcmp(name, "ps-push-req") == 0) {
        fb_name(&b, "w");
        fb_u64(&b, v1, "base_version");
        fb_u64(&b, f64_bits(1.0), "scale");
        assert_int_equal(fb_record(&b, ts_tensor_new(TS_FLOAT32, 1, (int64_t[]){2}, grad, 0)), 72);
        fb_frame(out, Q, TS_OP_PS_PUSH, 0, 0, 3, &b);
    } else if (strcmp(name, "ps-push-rep-stale") == 0) {
        fb_bin_state(&b, v1 + 4, 1);
        fb_frame(out, P, TS_OP_PS_PUSH, 0, TS_ST_STALE_GRADIENT, 4, &b);
    } else if (strcmp(name, "ps-pull-req") == 0) {
        fb_name(&b, "w");
        fb_u64(&b, v1 + 4, "if_newer_than");
        fb_frame(out, Q, TS_OP_PS_PULL, 0, 0, 5, &b);
    } else if (strcmp(name, "ps-pull-rep-not-newer") == 0) {
        fb_items(&b, v1 + 4, 1, NULL, 0);
        fb_frame(out, P, TS_OP_PS_PULL, 0, 0, 5, &b);
    } else if (strcmp(name, "emb-create-req") == 0) {
        fb_name(&b, "emb");
        fb_u32(&b, 4, "dim");
        fb_u8(&b, 1, "optimizer"); /* SGD */
        fb_u8(&b, 1, "init");      /* uniform */
        fb_u16(&b, 0, "reserved");
        fb_u64(&b, 42, "seed");
        fb_u64(&b, 0, "num_ids");
        fb_u64(&b, f64_bits(0.01), "lr");
        fb_u64(&b, f64_bits(0.9), "beta1");
        fb_u64(&b, f64_bits(0.999), "beta2");
        fb_u64(&b, f64_bits(1e-8), "eps");
        fb_u64(&b, f64_bits(0.05), "init_scale");
        fb_frame(out, Q, TS_OP_EMB_CREATE, 0, 0, 6, &b);
    } else if (strcmp(name, "emb-create-rep") == 0) {
        fb_bin_state(&b, v1 + 5, 0);
        fb_frame(out, P, TS_OP_EMB_CREATE, 0, 0, 6, &b);
    } else if (strcmp(name, "emb-pull-req") == 0) {
        fb_name(&b, "emb");
        assert_int_equal(fb_record(&b, ts_tensor_new(TS_INT64, 1, (int64_t[]){2}, ids, 0)), 80);
        fb_frame(out, Q, TS_OP_EMB_PULL, 0, 0, 7, &b);
    } else if (strcmp(name, "emb-pull-rep") == 0) {
        ts_value_t *r[1] = {ts_tensor_new(TS_FLOAT32, 2, (int64_t[]){2, 4}, rows, 0)};
        fb_items(&b, v1 + 5, 1, r, 1);
        fb_frame(out, P, TS_OP_EMB_PULL, 0, 0, 7, &b);
    } else if (strcmp(name, "emb-push-req") == 0) {
        fb_name(&b, "emb");
        fb_u64(&b, f64_bits(1.0), "scale");
        ts_value_t *l = ts_list_new();
        assert_int_equal(ts_list_push(l, ts_tensor_new(TS_INT64, 1, (int64_t[]){1}, one_id, 0)), 0);
        assert_int_equal(
            ts_list_push(l, ts_tensor_new(TS_FLOAT32, 2, (int64_t[]){1, 4}, row_grad, 0)), 0);
        assert_int_equal(fb_record(&b, l), 208);
        fb_frame(out, Q, TS_OP_EMB_PUSH, 0, 0, 8, &b);
    } else if (strcmp(name, "emb-push-rep") == 0) {
        fb_bin_state(&b, v1 + 6, 0);
        fb_frame(out, P, TS_OP_EMB_PUSH, 0, 0, 8, &b);
    } else {
        return -1;
    }
    return 0;
}

/* The examples of services (section 15, "Services"); -1 for a name that is not one of them. */
static int build_svc_example(const char *name, fb *out)
{
    const uint8_t Q = TS_MAGIC_REQ, P = TS_MAGIC_REP;
    fb b = {.n = 0};
    if (strcmp(name, "svc-register-req") == 0) {
        fb_name(&b, "double");
        fb_u32(&b, 8, "concurrency");
        fb_u32(&b, 0, "flags");
        fb_frame(out, Q, TS_OP_SVC_REGISTER, 0, 0, 2, &b);
    } else if (strcmp(name, "svc-register-rep") == 0) {
        fb_u32(&b, 1, "servers");
        fb_u32(&b, 0, "queued");
        fb_u64(&b, 0, "calls");
        fb_frame(out, P, TS_OP_SVC_REGISTER, 0, 0, 2, &b);
    } else if (strcmp(name, "svc-call-req") == 0) {
        fb_name(&b, "double");
        fb_u32(&b, 1000, "timeout_ms");
        fb_u32(&b, 0, "flags");
        assert_int_equal(fb_record(&b, ts_int_new(21)), 64);
        fb_frame(out, Q, TS_OP_SVC_CALL, 0, 0, 2, &b);
    } else if (strcmp(name, "svc-request-push") == 0) {
        fb_u64(&b, 1, "call_id");
        fb_u32(&b, 998, "timeout_ms");
        fb_u32(&b, 0, "reserved");
        fb_u64(&b, 64, "rec_len");
        fb_name(&b, "double");
        fb_zeros(&b, ts__msg_svc_push_head_size(6) - (24 + 7), "padding");
        assert_int_equal(fb_record(&b, ts_int_new(21)), 64);
        fb_frame(out, P, TS_OP_SVC_REQUEST, 0, 0, 0, &b);
    } else if (strcmp(name, "svc-reply-req") == 0) {
        fb_name(&b, "double");
        fb_u64(&b, 1, "call_id");
        fb_u16(&b, 0, "status");
        fb_u16(&b, 0, "reserved");
        fb_u32(&b, 0, "reserved");
        assert_int_equal(fb_record(&b, ts_int_new(42)), 64);
        fb_frame(out, Q, TS_OP_SVC_REPLY, 0, 0, 3, &b);
    } else if (strcmp(name, "svc-reply-rep") == 0) {
        fb_frame(out, P, TS_OP_SVC_REPLY, 0, 0, 3, &b);
    } else if (strcmp(name, "svc-call-rep") == 0) {
        ts_value_t *r[1] = {ts_int_new(42)};
        fb_items(&b, 1, 0, r, 1);
        fb_frame(out, P, TS_OP_SVC_CALL, 0, 0, 2, &b);
    } else if (strcmp(name, "svc-call-rep-gone") == 0) {
        static const char msg[] =
            "service double: the server handling the call disconnected before answering";
        fb_put(&b, msg, sizeof(msg) - 1, "message");
        fb_frame(out, P, TS_OP_SVC_CALL, 0, TS_ST_SERVICE_GONE, 4, &b);
    } else {
        return -1;
    }
    return 0;
}

static int build_example(const char *name, fb *out)
{
    const uint8_t Q = TS_MAGIC_REQ, P = TS_MAGIC_REP;
    fb b = {.n = 0};
    if (strcmp(name, "hello-req") == 0) {
        fb_u8(&b, 1, "max_version");
        fb_u8(&b, TS_HELLO_LZ4, "flags");
        fb_u16(&b, 0, "token_len");
        fb_frame(out, Q, TS_OP_HELLO, 0, 0, 1, &b);
    } else if (strcmp(name, "hello-rep") == 0) {
        fb_u8(&b, 1, "version");
        fb_u8(&b, TS_HELLO_LZ4, "flags");
        fb_u16(&b, 0, "reserved");
        fb_u32(&b, 0, "reserved");
        fb_u64(&b, TS_DEFAULT_MAX_FRAME, "max_body");
        fb_u64(&b, EX_SERVER_ID, "server_id");
        fb_frame(out, P, TS_OP_HELLO, 0, 0, 1, &b);
    } else if (strncmp(name, "auth-", 5) == 0 || strncmp(name, "hello-proof-", 12) == 0) {
        /* The token proof (section 4): token "s3cret-token", nonces 00..1f and 80..9f. */
        uint8_t cn[TS_MSG_AUTH_NONCE_SIZE], sn[TS_MSG_AUTH_NONCE_SIZE];
        uint8_t proof[TS_MSG_TOKEN_PROOF_SIZE];
        for (int i = 0; i < TS_MSG_AUTH_NONCE_SIZE; i++) {
            cn[i] = (uint8_t)i;
            sn[i] = (uint8_t)(0x80 + i);
        }
        int req = strstr(name, "-req") != NULL;
        if (strncmp(name, "auth-", 5) == 0) {
            fb_put(&b, req ? cn : sn, TS_MSG_AUTH_NONCE_SIZE, "nonce");
            fb_frame(out, req ? Q : P, TS_OP_AUTH_CHALLENGE, 0, 0, 1, &b);
            return 0;
        }
        ts__auth_proof("s3cret-token", 12, req ? TS_AUTH_CLIENT : TS_AUTH_SERVER, cn, sn, proof);
        if (req) {
            fb_u8(&b, 1, "max_version");
            fb_u8(&b, TS_HELLO_TOKEN_PROOF, "flags");
            fb_u16(&b, TS_MSG_TOKEN_PROOF_SIZE, "token_len");
        } else {
            fb_u8(&b, 1, "version");
            fb_u8(&b, TS_HELLO_TOKEN_PROOF, "flags");
            fb_u16(&b, 0, "reserved");
            fb_u32(&b, 0, "reserved");
            fb_u64(&b, TS_DEFAULT_MAX_FRAME, "max_body");
            fb_u64(&b, EX_SERVER_ID, "server_id");
        }
        fb_put(&b, proof, sizeof(proof), "proof");
        fb_frame(out, req ? Q : P, TS_OP_HELLO, 0, 0, 2, &b);
    } else if (strcmp(name, "ping-req") == 0) {
        fb_frame(out, Q, TS_OP_PING, 0, 0, 2, &b);
    } else if (strcmp(name, "ping-rep") == 0) {
        fb_frame(out, P, TS_OP_PING, 0, 0, 2, &b);
    } else if (strcmp(name, "put-req") == 0) {
        fb_name(&b, "params");
        fb_record(&b, params_record());
        fb_frame(out, Q, TS_OP_PUT, 0, 0, 3, &b);
    } else if (strcmp(name, "put-rep") == 0) {
        fb_bin_state(&b, EX_VERSION, 1);
        fb_frame(out, P, TS_OP_PUT, 0, 0, 3, &b);
    } else if (strcmp(name, "append-req") == 0) {
        fb_name(&b, "log");
        fb_record(&b, ts_int_new(42));
        fb_frame(out, Q, TS_OP_APPEND, 0, 0, 4, &b);
    } else if (strcmp(name, "append-rep") == 0) {
        fb_bin_state(&b, EX_VERSION + 1, 3);
        fb_frame(out, P, TS_OP_APPEND, 0, 0, 4, &b);
    } else if (strcmp(name, "get-req") == 0) {
        fb_name(&b, "params");
        fb_u32(&b, 0, "max_items");
        fb_frame(out, Q, TS_OP_GET, 0, 0, 5, &b);
    } else if (strcmp(name, "get-rep") == 0) {
        ts_value_t *recs[1] = {params_record()};
        fb_items(&b, EX_VERSION + 2, 0, recs, 1);
        fb_frame(out, P, TS_OP_GET, 0, 0, 5, &b);
    } else if (strcmp(name, "peek-req") == 0) {
        fb_name(&b, "log");
        fb_u32(&b, 1, "max_items");
        fb_frame(out, Q, TS_OP_PEEK, 0, 0, 6, &b);
    } else if (strcmp(name, "peek-rep") == 0) {
        ts_value_t *recs[1] = {ts_int_new(40)};
        fb_items(&b, EX_VERSION + 1, 3, recs, 1);
        fb_frame(out, P, TS_OP_PEEK, 0, 0, 6, &b);
    } else if (strcmp(name, "delete-req") == 0) {
        /* The GET above took the last item of params: the bin no longer exists. */
        fb_name(&b, "params");
        fb_frame(out, Q, TS_OP_DELETE, 0, 0, 7, &b);
    } else if (strcmp(name, "delete-rep") == 0) {
        fb_bin_state(&b, 0, 0);
        fb_frame(out, P, TS_OP_DELETE, 0, 0, 7, &b);
    } else if (strcmp(name, "list-req") == 0) {
        fb_frame(out, Q, TS_OP_LIST, 0, 0, 8, &b);
    } else if (strcmp(name, "list-rep") == 0) {
        /* Only log is left: three 64-byte records, last changed by the APPEND. */
        fb_u32(&b, 1, "n");
        fb_u32(&b, 0, "reserved");
        fb_name(&b, "log");
        fb_u32(&b, 3, "n_items");
        fb_u64(&b, 192, "bytes");
        fb_u64(&b, EX_VERSION + 1, "version");
        fb_frame(out, P, TS_OP_LIST, 0, 0, 8, &b);
    } else if (strcmp(name, "listen-req") == 0) {
        fb_name(&b, "params");
        fb_frame(out, Q, TS_OP_LISTEN, 0, 0, 9, &b);
    } else if (strcmp(name, "listen-rep") == 0) {
        fb_bin_state(&b, 0, 0); /* params does not exist */
        fb_frame(out, P, TS_OP_LISTEN, 0, 0, 9, &b);
    } else if (strcmp(name, "notify") == 0) {
        /* Another client's PUT: the next change after the GET (DELETE of a missing bin took none).
         */
        fb_u64(&b, EX_VERSION + 3, "version");
        fb_u32(&b, 1, "n_items");
        fb_u8(&b, TS_NOTE_PUT, "event");
        fb_u8(&b, 0, "flags");
        fb_name(&b, "params");
        fb_frame(out, P, TS_OP_NOTIFY, 0, 0, 0, &b);
    } else if (strcmp(name, "unlisten-req") == 0) {
        fb_name(&b, "params");
        fb_frame(out, Q, TS_OP_UNLISTEN, 0, 0, 10, &b);
    } else if (strcmp(name, "unlisten-rep") == 0) {
        fb_frame(out, P, TS_OP_UNLISTEN, 0, 0, 10, &b);
    } else if (strcmp(name, "wait-req") == 0) {
        fb_name(&b, "params");
        fb_u64(&b, EX_VERSION, "after_version");
        fb_u32(&b, 5000, "timeout_ms");
        fb_frame(out, Q, TS_OP_WAIT, 0, 0, 11, &b);
    } else if (strcmp(name, "wait-rep") == 0) {
        fb_bin_state(&b, EX_VERSION + 3, 1);
        fb_frame(out, P, TS_OP_WAIT, 0, 0, 11, &b);
    } else if (strcmp(name, "wait-rep-timeout") == 0) {
        fb_bin_state(&b, 0, 0); /* had nobody created params */
        fb_frame(out, P, TS_OP_WAIT, 0, TS_ST_TIMEOUT, 11, &b);
    } else if (strcmp(name, "stats-req") == 0) {
        fb_frame(out, Q, TS_OP_STATS, 0, 0, 12, &b);
    } else if (strcmp(name, "stats-rep") == 0) {
        ts_value_t *m = ts_map_new();
        assert_int_equal(ts_map_set(m, "uptime_s", ts_int_new(3600)), 0);
        assert_int_equal(ts_map_set(m, "bins", ts_int_new(2)), 0);
        fb_record(&b, m);
        fb_frame(out, P, TS_OP_STATS, 0, 0, 12, &b);
    } else if (strcmp(name, "save-req") == 0) {
        fb_frame(out, Q, TS_OP_SAVE, 0, 0, 13, &b);
    } else if (strcmp(name, "save-rep") == 0) {
        fb_frame(out, P, TS_OP_SAVE, 0, 0, 13, &b);
    } else if (strcmp(name, "error-rep") == 0) {
        fb_put(&b, "no such bin", 11, "message");
        fb_frame(out, P, TS_OP_GET, 0, TS_ST_NOT_FOUND, 14, &b);
    } else if (strcmp(name, "put-lz4-req") == 0) {
        /* The raw body; the compressed form is checked by decompressing the document's. */
        fb_name(&b, "zeros");
        fb_record(&b, ts_tensor_alloc(TS_FLOAT32, 1, (int64_t[]){64}));
        fb_frame(out, Q, TS_OP_PUT, TS_FLAG_LZ4, 0, 15, &b);
    } else if (strcmp(name, "stream-create-req") == 0) {
        /* Streams: a connection of their own, request ids from 1 again (HELLO took 1). */
        fb_name(&b, "ev");
        fb_u64(&b, 1000, "max_entries");
        fb_u64(&b, 0, "max_bytes");
        fb_u32(&b, 0, "max_age_ms");
        fb_u32(&b, 64, "window");
        fb_u32(&b, 0, "lease_ms");
        fb_u32(&b, 0, "flags");
        fb_frame(out, Q, TS_OP_STREAM_CREATE, 0, 0, 2, &b);
    } else if (strcmp(name, "stream-create-rep") == 0) {
        /* A new stream: nothing kept (first_id = last_id + 1), no group, so no limit on credit. */
        fb_u64(&b, 1, "first_id");
        fb_u64(&b, 0, "last_id");
        fb_u64(&b, 0, "bytes");
        fb_u32(&b, 0, "n_entries");
        fb_u32(&b, 0, "n_groups");
        fb_u32(&b, 0, "n_stale");
        fb_u32(&b, UINT32_MAX, "credit");
        fb_u32(&b, 64, "window");
        fb_u32(&b, 0, "reserved");
        fb_frame(out, P, TS_OP_STREAM_CREATE, 0, 0, 2, &b);
    } else if (strcmp(name, "stream-append-req") == 0) {
        /* After STREAM_JOIN(ev, train, w0, start 0) as request 3. */
        fb_name(&b, "ev");
        fb_record(&b, ts_int_new(42));
        fb_frame(out, Q, TS_OP_STREAM_APPEND, 0, 0, 4, &b);
    } else if (strcmp(name, "stream-append-rep") == 0) {
        /* Entry 1; the live group train now lags by 1 entry: credit 64 - 1. */
        fb_u64(&b, 1, "id");
        fb_u64(&b, 1, "first_id");
        fb_u32(&b, 63, "credit");
        fb_u32(&b, 1, "n_entries");
        fb_frame(out, P, TS_OP_STREAM_APPEND, 0, 0, 4, &b);
    } else if (strcmp(name, "stream-read-req") == 0) {
        /* After STREAM_MARK(ev, tag 1) as request 5: entry 2 is a marker. */
        fb_name(&b, "ev");
        fb_name(&b, "train");
        fb_name(&b, "w0");
        fb_u64(&b, 0, "ack_through");
        fb_u32(&b, 16, "max_entries");
        fb_u32(&b, 1000, "timeout_ms");
        fb_frame(out, Q, TS_OP_STREAM_READ, 0, 0, 6, &b);
    } else if (strcmp(name, "stream-read-rep") == 0) {
        fb_u64(&b, 1, "first_id");
        fb_u64(&b, 2, "last_id");
        fb_u64(&b, 0, "lost");
        fb_u32(&b, 2, "n");
        fb_u32(&b, 0, "reserved");
        /* Entry 1: the 64-byte record of the int 42, handed out for the first time. */
        fb_u64(&b, 1, "id");
        fb_u64(&b, 64, "len");
        fb_u64(&b, 0, "tag");
        fb_u32(&b, 0, "rows_done");
        fb_u16(&b, 1, "deliveries");
        fb_u8(&b, 0, "kind"); /* a record */
        fb_u8(&b, 0, "flags");
        /* Entry 2: the marker with tag 1, no bytes. */
        fb_u64(&b, 2, "id");
        fb_u64(&b, 0, "len");
        fb_u64(&b, 1, "tag");
        fb_u32(&b, 0, "rows_done");
        fb_u16(&b, 1, "deliveries");
        fb_u8(&b, 1, "kind"); /* a marker */
        fb_u8(&b, 0, "flags");
        fb_zeros(&b, 128 - (32 + 2 * 32), "padding");
        assert_int_equal(fb_record(&b, ts_int_new(42)), 64);
        fb_frame(out, P, TS_OP_STREAM_READ, 0, 0, 6, &b);
    } else if (strcmp(name, "add-req") == 0) {
        /* Coordination: a connection of its own, request ids from 2 (HELLO took 1). */
        fb_name(&b, "step");
        fb_u64(&b, 1, "delta");
        fb_frame(out, Q, TS_OP_ADD, 0, 0, 2, &b);
    } else if (strcmp(name, "add-rep") == 0) {
        fb_u64(&b, 1, "value");
        fb_u64(&b, 1764160000000001ull, "version");
        fb_frame(out, P, TS_OP_ADD, 0, 0, 2, &b);
    } else if (strcmp(name, "put-if-rep-mismatch") == 0) {
        fb_bin_state(&b, 1764160000000001ull, 1);
        fb_frame(out, P, TS_OP_PUT_IF, 0, TS_ST_VERSION_MISMATCH, 3, &b);
    } else if (strcmp(name, "table-create-req") == 0) {
        /* Replay tables: a connection of their own, request ids from 1 again (HELLO took 1). */
        fb_name(&b, "rb");
        fb_u64(&b, 1000, "capacity");
        fb_u64(&b, 1, "min_size_to_sample");
        fb_u64(&b, f64_bits(1.0), "samples_per_insert");
        fb_u64(&b, f64_bits(1.0), "error_buffer");
        fb_u64(&b, f64_bits(0.6), "priority_exponent");
        fb_u32(&b, 0, "max_times_sampled");
        fb_u8(&b, 0, "remover"); /* FIFO */
        fb_u8(&b, 1, "sampler"); /* PRIORITIZED */
        fb_u16(&b, 0, "reserved");
        fb_frame(out, Q, TS_OP_TABLE_CREATE, 0, 0, 2, &b);
    } else if (strcmp(name, "table-create-rep") == 0) {
        for (int i = 0; i < 4; i++)
            fb_u64(&b, 0, "key, size, inserts, samples");
        fb_u32(&b, 0, "done");
        fb_u32(&b, 0, "skipped");
        fb_frame(out, P, TS_OP_TABLE_CREATE, 0, 0, 2, &b);
    } else if (strcmp(name, "table-insert-req") == 0) {
        fb_name(&b, "rb");
        fb_u64(&b, f64_bits(2.5), "priority");
        fb_u32(&b, 1000, "timeout_ms");
        fb_u32(&b, 0, "reserved");
        fb_record(&b, ts_int_new(42));
        fb_frame(out, Q, TS_OP_TABLE_INSERT, 0, 0, 3, &b);
    } else if (strcmp(name, "table-insert-rep") == 0) {
        fb_u64(&b, 1, "key");
        fb_u64(&b, 1, "size");
        fb_u64(&b, 1, "inserts");
        fb_u64(&b, 0, "samples");
        fb_u32(&b, 1, "done");
        fb_u32(&b, 0, "skipped");
        fb_frame(out, P, TS_OP_TABLE_INSERT, 0, 0, 3, &b);
    } else if (strcmp(name, "table-sample-req") == 0) {
        fb_name(&b, "rb");
        fb_u32(&b, 2, "n");
        fb_u32(&b, 1000, "timeout_ms");
        fb_frame(out, Q, TS_OP_TABLE_SAMPLE, 0, 0, 4, &b);
    } else if (strcmp(name, "table-sample-rep") == 0) {
        fb_u64(&b, 1, "size");
        fb_u32(&b, 1, "n");
        fb_u32(&b, 0, "reserved");
        fb_u64(&b, 1, "key");
        fb_u64(&b, 64, "len");
        fb_u64(&b, f64_bits(1.0), "probability");
        fb_u64(&b, 5, "age_ms");
        fb_u32(&b, 1, "times_sampled");
        fb_u32(&b, 0, "reserved");
        fb_zeros(&b, 64 - (16 + 40), "padding");
        assert_int_equal(fb_record(&b, ts_int_new(42)), 64);
        fb_frame(out, P, TS_OP_TABLE_SAMPLE, 0, 0, 4, &b);
    } else if (strcmp(name, "shard-map-req") == 0) {
        /* Sharding: shard 1 of a two-line map file, epoch 3; a connection of its own. */
        fb_frame(out, Q, TS_OP_SHARD_MAP, 0, 0, 2, &b);
    } else if (strcmp(name, "shard-map-rep") == 0) {
        fb_u64(&b, 3, "map_epoch");
        fb_u16(&b, 2, "n_shards");
        fb_u16(&b, 1, "self");
        fb_u32(&b, 0, "reserved");
        fb_u16(&b, 13, "addr_len");
        fb_u16(&b, 1, "n_ranges");
        fb_put(&b, "10.0.0.1:8000", 13, "address");
        fb_u16(&b, 0, "first");
        fb_u16(&b, 8191, "last");
        fb_u16(&b, 13, "addr_len");
        fb_u16(&b, 1, "n_ranges");
        fb_put(&b, "10.0.0.2:8000", 13, "address");
        fb_u16(&b, 8192, "first");
        fb_u16(&b, 16383, "last");
        fb_frame(out, P, TS_OP_SHARD_MAP, 0, 0, 2, &b);
    } else if (strcmp(name, "wrong-shard-rep") == 0) {
        static const char msg[] =
            "params: slot 1749 belongs to shard 0 (10.0.0.1:8000), not to shard 1 of 2";
        fb_u16(&b, 1749, "slot");
        fb_u16(&b, 0, "owner");
        fb_u16(&b, 13, "addr_len");
        fb_u16(&b, 0, "reserved");
        fb_u64(&b, 3, "map_epoch");
        fb_put(&b, "10.0.0.1:8000", 13, "address");
        fb_put(&b, msg, sizeof(msg) - 1, "message");
        fb_frame(out, P, TS_OP_GET, 0, TS_ST_WRONG_SHARD, 3, &b);
    } else if (strncmp(name, "ps-", 3) == 0 || strncmp(name, "emb-", 4) == 0) {
        return build_ps_example(name, out);
    } else if (strncmp(name, "svc-", 4) == 0) {
        return build_svc_example(name, out);
    } else {
        return -1;
    }
    return 0;
}

static const char *const example_names[] = {
    "hello-req",
    "hello-rep",
    "ping-req",
    "ping-rep",
    "put-req",
    "put-rep",
    "append-req",
    "append-rep",
    "get-req",
    "get-rep",
    "peek-req",
    "peek-rep",
    "delete-req",
    "delete-rep",
    "list-req",
    "list-rep",
    "listen-req",
    "listen-rep",
    "notify",
    "unlisten-req",
    "unlisten-rep",
    "wait-req",
    "wait-rep",
    "wait-rep-timeout",
    "stats-req",
    "stats-rep",
    "save-req",
    "save-rep",
    "error-rep",
    "put-lz4-req",
    "stream-create-req",
    "stream-create-rep",
    "stream-append-req",
    "stream-append-rep",
    "stream-read-req",
    "stream-read-rep",
    "add-req",
    "add-rep",
    "put-if-rep-mismatch",
    "table-create-req",
    "table-create-rep",
    "table-insert-req",
    "table-insert-rep",
    "table-sample-req",
    "table-sample-rep",
    "shard-map-req",
    "shard-map-rep",
    "wrong-shard-rep",
    "ps-create-req",
    "ps-create-rep",
    "ps-push-req",
    "ps-push-rep-stale",
    "ps-pull-req",
    "ps-pull-rep-not-newer",
    "emb-create-req",
    "emb-create-rep",
    "emb-pull-req",
    "emb-pull-rep",
    "emb-push-req",
    "emb-push-rep",
    "auth-challenge-req",
    "auth-challenge-rep",
    "hello-proof-req",
    "hello-proof-rep",
    "svc-register-req",
    "svc-register-rep",
    "svc-call-req",
    "svc-request-push",
    "svc-reply-req",
    "svc-reply-rep",
    "svc-call-rep",
    "svc-call-rep-gone",
};

/* The PUT example, written out by hand: the codec must produce exactly these bytes. */
static void test_put_example_bytes(void **state)
{
    (void)state;
    static const uint8_t expect[167] = {
        /* header: 'T', version 1, PUT, flags 0, status 0, id 3, body_len 143 */
        0x54, 0x01, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x8f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        /* name "params" */
        0x06, 'p', 'a', 'r', 'a', 'm', 's',
        /* record header: "TSR\1", meta_len 52, data_len 8 */
        'T', 'S', 'R', 0x01, 0x34, 0x00, 0x00, 0x00, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        /* map of 2; "w": tensor float32 [2] at 0, 8 bytes; "step": int 7 */
        0x01, 0x02, 0x00, 0x00, 0x00, 0x01, 0x00, 'w', 0x03, 0x09, 0x01, 0x00, 0x00, 0x02, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x08,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00, 's', 't', 'e', 'p', 0x04, 0x07, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        /* 60 bytes of padding up to the data area at record offset 128, then 1.0f and 2.0f */
        [159] = 0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0x40};
    fb f;
    assert_int_equal(build_example("put-req", &f), 0);
    assert_int_equal(f.n, sizeof(expect));
    assert_memory_equal(f.b, expect, sizeof(expect));
    /* And the frame parses back: header, name, record. */
    ts__hdr h;
    assert_int_equal(ts__hdr_decode(f.b, TS_MAGIC_REQ, &h), 0);
    assert_true(h.body_len == f.n - TS_HDR_SIZE);
    ts__rd r;
    ts__rd_init(&r, f.b + TS_HDR_SIZE, (size_t)h.body_len);
    const char *name;
    size_t nlen;
    assert_int_equal(ts__rd_name(&r, &name, &nlen), 0);
    assert_int_equal(ts__record_validate(r.p, r.left, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), 0);
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Length of the token at p (up to whitespace or end of line). */
static size_t token_len(const char *p)
{
    size_t n = 0;
    while (p[n] != '\0' && p[n] != ' ' && p[n] != '\t' && p[n] != '\n')
        n++;
    return n;
}

/*
 * Parse the dump that follows "<!-- example: NAME -->" in doc: a fenced block whose lines are
 * "OFFSET  XX XX ...  annotation", OFFSET four hex digits equal to the bytes so far, then bytes
 * (two hex digits each) up to the first other token. Returns the byte count (out holds them), or
 * -1 when the marker is missing, twice present, or the block is malformed.
 */
static long parse_example(const char *doc, const char *name, uint8_t *out, size_t cap)
{
    char marker[128];
    snprintf(marker, sizeof(marker), "<!-- example: %s -->", name);
    const char *m = strstr(doc, marker);
    if (m == NULL || strstr(m + 1, marker) != NULL)
        return -1;
    const char *p = strstr(m, "```");
    if (p == NULL)
        return -1;
    p = strchr(p, '\n');
    size_t n = 0;
    while (p != NULL && *++p != '\0' && strncmp(p, "```", 3) != 0) {
        const char *eol = strchr(p, '\n');
        /* The offset column. */
        size_t tl = token_len(p);
        if (tl != 4)
            return -1;
        unsigned long off = strtoul(p, NULL, 16);
        if (off != n)
            return -1;
        p += tl;
        for (;;) {
            while (*p == ' ' || *p == '\t')
                p++;
            if (token_len(p) != 2 || hexval(p[0]) < 0 || hexval(p[1]) < 0)
                break;
            if (n >= cap)
                return -1;
            out[n++] = (uint8_t)(hexval(p[0]) * 16 + hexval(p[1]));
            p += 2;
        }
        p = eol;
    }
    return p == NULL ? -1 : (long)n;
}

static void test_protocol_doc_examples(void **state)
{
    (void)state;
    char *doc = tsh_read_source_file("docs/PROTOCOL.md", NULL);
    assert_non_null(doc);
    uint8_t bytes[2048];
    for (size_t i = 0; i < TS__ARRAY_SIZE(example_names); i++) {
        const char *name = example_names[i];
        fb f;
        assert_int_equal(build_example(name, &f), 0);
        long n = parse_example(doc, name, bytes, sizeof(bytes));
        if (n < 0)
            fail_msg("docs/PROTOCOL.md: example %s is missing or malformed", name);
        if (strcmp(name, "put-lz4-req") == 0) {
            /* The document shows lz4's output; it must decompress to the raw body built here. */
            assert_true((size_t)n > TS_HDR_SIZE);
            assert_memory_equal(bytes, f.b, 16); /* header up to body_len */
            ts__hdr h;
            assert_int_equal(ts__hdr_decode(bytes, TS_MAGIC_REQ, &h), 0);
            assert_int_equal(h.flags, TS_FLAG_LZ4);
            assert_true(h.body_len == (uint64_t)n - TS_HDR_SIZE);
            size_t raw_len = f.n - TS_HDR_SIZE;
            uint8_t raw[2048];
            assert_int_equal(
                ts__lz4_decompress(bytes + TS_HDR_SIZE, (size_t)h.body_len, raw, raw_len), 0);
            assert_memory_equal(raw, f.b + TS_HDR_SIZE, raw_len);
            continue;
        }
        if ((size_t)n != f.n || memcmp(bytes, f.b, f.n) != 0) {
            for (size_t k = 0; k < f.n && k < (size_t)n; k++)
                if (bytes[k] != f.b[k]) {
                    fail_msg("docs/PROTOCOL.md: example %s differs at byte %zu (0x%02x, expected "
                             "0x%02x)",
                             name, k, bytes[k], f.b[k]);
                }
            fail_msg("docs/PROTOCOL.md: example %s has %ld bytes, expected %zu", name, n, f.n);
        }
    }
    /* Every example in the document is one the test knows. */
    size_t markers = 0;
    for (const char *p = doc; (p = strstr(p, "<!-- example: ")) != NULL; p++)
        markers++;
    assert_int_equal(markers, TS__ARRAY_SIZE(example_names));
    free(doc);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_header_round_trip),
        cmocka_unit_test(test_header_rejects),
        cmocka_unit_test(test_status_map),
        cmocka_unit_test(test_reader_bounds),
        cmocka_unit_test(test_header_layout),
        cmocka_unit_test(test_header_rejects_exhaustively),
        cmocka_unit_test(test_status_table),
        cmocka_unit_test(test_opcode_table),
        cmocka_unit_test(test_reader_values),
        cmocka_unit_test(test_reader_names),
        cmocka_unit_test(test_put_example_bytes),
        cmocka_unit_test(test_protocol_doc_examples),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
