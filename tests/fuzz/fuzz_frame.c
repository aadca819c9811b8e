/*
 * Fuzz target: the frame header decoder and the bounded body readers, applied per opcode as
 * docs/PROTOCOL.md lays the bodies out. The input is a byte stream of frames in either direction
 * (the first byte of each header picks it), parsed the way a receiver would: header, limits,
 * optional lz4 body, then the opcode's body layout, records included.
 */
#include "fuzz.h"

#include "compress.h"
#include "proto.h"

/* Frames and raw bodies the target is willing to allocate. */
#define FZ_MAX_BODY ((uint64_t)1 << 22)
/* Frames per input; a stream of empty frames should not turn into a long loop. */
#define FZ_MAX_FRAMES 64

/* A body parser: 0 when the body matches its layout exactly, TS_EPROTO otherwise. */

/* Check that a parse consumed everything and that the reader's error is sticky. */
static int finish(ts__rd *r)
{
    if (r->err != 0) {
        uint8_t b;
        FZ_CHECK(ts__rd_u8(r, &b) == TS_EPROTO);
        FZ_CHECK(ts__rd_bytes(r, 0) == NULL);
        return TS_EPROTO;
    }
    return r->left == 0 ? 0 : TS_EPROTO;
}

/* A bin name: u8 length + bytes, within TS_MAX_NAME_LEN by construction. */
static void name(ts__rd *r)
{
    const char *n;
    size_t len = 0;
    size_t before = r->left;
    if (ts__rd_name(r, &n, &len) == 0) {
        FZ_CHECK(len <= TS_MAX_NAME_LEN);
        FZ_CHECK(before - r->left == len + 1);
    }
}

/* TS_BIN_STATE: u64 version, u32 n_items, u32 0. */
static void bin_state(ts__rd *r)
{
    uint64_t version;
    uint32_t n, rsvd = 0;
    ts__rd_u64(r, &version);
    ts__rd_u32(r, &n);
    if (ts__rd_u32(r, &rsvd) == 0 && rsvd != 0)
        r->err = TS_EPROTO;
}

/* A request body, by opcode. */
static int parse_request(const ts__hdr *h, const uint8_t *body, size_t len)
{
    ts__rd r;
    ts__rd_init(&r, body, len);
    switch (h->opcode) {
    case TS_OP_HELLO: {
        uint8_t max_version, flags;
        uint16_t token_len;
        ts__rd_u8(&r, &max_version);
        ts__rd_u8(&r, &flags);
        if (ts__rd_u16(&r, &token_len) == 0)
            (void)ts__rd_bytes(&r, token_len);
        break;
    }
    case TS_OP_PING:
    case TS_OP_LIST:
    case TS_OP_STATS:
    case TS_OP_SAVE:
        break;
    case TS_OP_PUT:
    case TS_OP_APPEND: {
        name(&r);
        if (r.err != 0)
            break;
        /* The rest of the body is the record. */
        size_t rec_len = r.left;
        const uint8_t *rec = ts__rd_bytes(&r, rec_len);
        FZ_CHECK(rec != NULL);
        if (ts__fz_check_record(rec, rec_len) != 0)
            return TS_EBADRECORD;
        break;
    }
    case TS_OP_GET:
    case TS_OP_PEEK: {
        uint32_t max_items;
        name(&r);
        ts__rd_u32(&r, &max_items);
        break;
    }
    case TS_OP_DELETE:
    case TS_OP_LISTEN:
    case TS_OP_UNLISTEN:
        name(&r);
        break;
    case TS_OP_WAIT: {
        uint64_t after;
        uint32_t timeout_ms;
        name(&r);
        ts__rd_u64(&r, &after);
        ts__rd_u32(&r, &timeout_ms);
        break;
    }
    default:
        return TS_EUNKNOWNOP;
    }
    return finish(&r);
}

/*
 * TS_ITEMS: u64 version, u32 n, u32 remaining, n x u64 item_len, padding to 64, then each record
 * padded to 64. The records are decoded in place, inside the body's buffer.
 */
static int parse_items(ts__rbuf *buf)
{
    ts__rd r;
    ts__rd_init(&r, buf->data, buf->len);
    uint64_t version;
    uint32_t n, remaining;
    ts__rd_u64(&r, &version);
    ts__rd_u32(&r, &n);
    ts__rd_u32(&r, &remaining);
    if (r.err != 0)
        return TS_EPROTO;
    /* The lengths must be in the body before anything is sized by n. */
    if ((uint64_t)n * 8 > r.left)
        return TS_EPROTO;
    uint64_t head = ts__items_head_size(n);
    if (head > buf->len)
        return TS_EPROTO;
    const uint8_t *lens = ts__rd_bytes(&r, (size_t)n * 8);
    FZ_CHECK(lens != NULL);
    for (uint64_t i = 16 + (uint64_t)n * 8; i < head; i++)
        if (buf->data[i] != 0)
            return TS_EPROTO;
    uint64_t off = head;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t item_len = ts__get_u64le(lens + 8 * (size_t)i), padded, end;
        if (ts__align_up_checked(item_len, TS__ALIGN, &padded) != 0 ||
            __builtin_add_overflow(off, padded, &end) || end > buf->len)
            return TS_EPROTO;
        FZ_CHECK(off % TS__ALIGN == 0);
        if (ts__fz_check_record_in(buf, (size_t)off, (size_t)item_len) != 0)
            return TS_EBADRECORD;
        off = end;
    }
    return off == buf->len ? 0 : TS_EPROTO;
}

/* LIST reply: u32 n, u32 0, n x (name, u32 n_items, u64 bytes, u64 version). */
static int parse_list(const uint8_t *body, size_t len)
{
    ts__rd r;
    ts__rd_init(&r, body, len);
    uint32_t n, rsvd;
    ts__rd_u32(&r, &n);
    if (ts__rd_u32(&r, &rsvd) != 0 || rsvd != 0)
        return TS_EPROTO;
    /* Each entry takes at least 21 bytes: a cheap bound before looping. */
    if ((uint64_t)n * 21 > r.left)
        return TS_EPROTO;
    for (uint32_t i = 0; i < n && r.err == 0; i++) {
        uint32_t items;
        uint64_t bytes, version;
        name(&r);
        ts__rd_u32(&r, &items);
        ts__rd_u64(&r, &bytes);
        ts__rd_u64(&r, &version);
    }
    return finish(&r);
}

/* A reply or notification body, by opcode and status. buf holds the (decompressed) body. */
static int parse_reply(const ts__hdr *h, ts__rbuf *buf)
{
    ts__rd r;
    ts__rd_init(&r, buf->data, buf->len);
    if (h->opcode == TS_OP_NOTIFY) {
        uint64_t version;
        uint32_t n;
        uint8_t event, flags;
        FZ_CHECK(TS_NOTIFY_FIXED == 8 + 4 + 1 + 1 + 1);
        ts__rd_u64(&r, &version);
        ts__rd_u32(&r, &n);
        ts__rd_u8(&r, &event);
        ts__rd_u8(&r, &flags);
        name(&r);
        if (r.err == 0 && (event < TS_NOTE_PUT || event > TS_NOTE_DELETE))
            return TS_EPROTO;
        return finish(&r);
    }
    if (h->status != TS_ST_OK) {
        /* An error reply carries a message, except WAIT's TIMEOUT, which carries the state. */
        FZ_CHECK(ts__status_name(h->status) != NULL);
        FZ_CHECK(ts__status_to_err(h->status) < 0);
        if (h->opcode == TS_OP_WAIT && h->status == TS_ST_TIMEOUT) {
            bin_state(&r);
            return finish(&r);
        }
        return buf->len <= TS_MAX_ERRMSG ? 0 : TS_EPROTO;
    }
    switch (h->opcode) {
    case TS_OP_HELLO: {
        uint8_t version, flags;
        uint16_t r16 = 0;
        uint32_t r32 = 0;
        uint64_t max_body, server_id;
        ts__rd_u8(&r, &version);
        ts__rd_u8(&r, &flags);
        ts__rd_u16(&r, &r16);
        ts__rd_u32(&r, &r32);
        ts__rd_u64(&r, &max_body);
        ts__rd_u64(&r, &server_id);
        if (r.err == 0 && (r16 != 0 || r32 != 0))
            return TS_EPROTO;
        break;
    }
    case TS_OP_PUT:
    case TS_OP_APPEND:
    case TS_OP_DELETE:
    case TS_OP_LISTEN:
    case TS_OP_WAIT:
        bin_state(&r);
        FZ_CHECK(r.err != 0 || buf->len - r.left == TS_BIN_STATE_SIZE);
        break;
    case TS_OP_GET:
    case TS_OP_PEEK:
        return parse_items(buf);
    case TS_OP_LIST:
        return parse_list(buf->data, buf->len);
    case TS_OP_STATS:
        return ts__fz_check_record_in(buf, 0, buf->len);
    case TS_OP_PING:
    case TS_OP_UNLISTEN:
    case TS_OP_SAVE:
        break;
    default:
        return TS_EUNKNOWNOP;
    }
    return finish(&r);
}

/* The tables of names and error codes answer for every number. */
static void tables(const ts__hdr *h)
{
    FZ_CHECK(ts__op_name(h->opcode) != NULL);
    FZ_CHECK(ts__status_name(h->status) != NULL);
    int err = ts__status_to_err(h->status);
    FZ_CHECK(h->status == TS_ST_OK ? err == 0 : err < 0);
    if (h->status < TS_ST_COUNT_ && h->status != TS_ST_AUTH_REQUIRED)
        FZ_CHECK(ts__err_to_status(err) == h->status ||
                 (h->status == TS_ST_INTERNAL && err == TS_ESERVER));
}

/*
 * Parse one frame at in[0..len). Returns the bytes it took, or 0 when the stream cannot go on
 * (a bad header, an incomplete frame, a body beyond the limits).
 */
static size_t one_frame(const uint8_t *in, size_t len)
{
    if (len < TS_HDR_SIZE)
        return 0;
    uint8_t magic = in[0] == TS_MAGIC_REP ? TS_MAGIC_REP : TS_MAGIC_REQ;
    ts__hdr h;
    if (ts__hdr_decode(in, magic, &h) != 0) {
        /* A header refused in one direction is refused in the other. */
        FZ_CHECK(ts__hdr_decode(in, magic == TS_MAGIC_REQ ? TS_MAGIC_REP : TS_MAGIC_REQ, &h) ==
                 TS_EPROTO);
        return 0;
    }
    /* A header that decodes encodes back to the same 24 bytes. */
    uint8_t again[TS_HDR_SIZE];
    ts__hdr_encode(&h, again);
    FZ_CHECK(memcmp(again, in, TS_HDR_SIZE) == 0);
    tables(&h);
    if (h.body_len > FZ_MAX_BODY || h.body_len > len - TS_HDR_SIZE)
        return 0;

    /* The body lands in an aligned receive buffer, as the client's does. */
    size_t blen = (size_t)h.body_len;
    const uint8_t *body = in + TS_HDR_SIZE;
    uint8_t *data;
    size_t dlen;
    if (h.flags & TS_FLAG_LZ4) {
        uint64_t raw;
        if (ts__lz4_raw_len(body, blen, &raw) != 0 || raw > FZ_MAX_BODY)
            return TS_HDR_SIZE + blen;
        dlen = (size_t)raw;
        data = ts__malloc_aligned(dlen);
        FZ_CHECK(data != NULL);
        if (ts__lz4_decompress(body, blen, data, dlen) != 0) {
            ts__free_aligned(data, dlen);
            return TS_HDR_SIZE + blen;
        }
    } else {
        dlen = blen;
        data = ts__malloc_aligned(dlen);
        FZ_CHECK(data != NULL);
        if (dlen > 0)
            memcpy(data, body, dlen);
    }
    ts__rbuf *buf = ts__rbuf_new(data, dlen, NULL);
    FZ_CHECK(buf != NULL);
    int rc;
    if (h.magic == TS_MAGIC_REQ)
        rc = h.status == 0 ? parse_request(&h, data, dlen) : TS_EPROTO;
    else
        rc = parse_reply(&h, buf);
    FZ_CHECK(rc == 0 || rc == TS_EPROTO || rc == TS_EBADRECORD || rc == TS_EUNKNOWNOP);
    ts__rbuf_unref(buf);
    return TS_HDR_SIZE + blen;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    size_t pos = 0;
    for (int i = 0; i < FZ_MAX_FRAMES && pos < size; i++) {
        size_t took = one_frame(data + pos, size - pos);
        if (took == 0)
            break;
        pos += took;
    }
    return 0;
}
