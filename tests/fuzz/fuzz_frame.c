/*
 * Fuzz target: the frame header decoder and the message codec (src/msg.c) on a stream of frames.
 * The input is a byte stream of frames in either direction (the first byte of each header picks
 * it), parsed the way a receiver would: header, limits, optional lz4 body, then the opcode's body
 * with the codec's decoder, records included. The body layouts themselves live only in msg.c.
 */
#include "fuzz.h"

#include "compress.h"
#include "msg.h"
#include "proto.h"

/* Frames and raw bodies the target is willing to allocate. */
#define FZ_MAX_BODY ((uint64_t)1 << 22)
/* Frames per input; a stream of empty frames should not turn into a long loop. */
#define FZ_MAX_FRAMES 64

/*
 * A body that decodes encodes back to the same bytes (the codec's own round trip, seen from a
 * stream of frames). Records and empty bodies have no encoder of their own.
 */
static void round_trip(const ts__msg *m, const uint8_t *body, size_t len)
{
    static uint8_t again[FZ_MAX_BODY];
    size_t n = 0;
    if (m->kind == TS_MSG_EMPTY || m->kind == TS_MSG_RECORD)
        return;
    FZ_CHECK(ts__msg_encode(m, again, sizeof(again), &n) == 0);
    FZ_CHECK(n == len && (n == 0 || memcmp(again, body, n) == 0));
}

/*
 * A request body, by opcode, with the codec's decoder (src/msg.c); a PUT or APPEND record is then
 * checked end to end. Returns 0, TS_EPROTO, TS_EBADRECORD or TS_EUNKNOWNOP.
 */
static int parse_request(const ts__hdr *h, const uint8_t *body, size_t len)
{
    ts__msg m;
    int rc = ts__msg_request_decode(h->opcode, body, len, &m);
    if (rc != 0)
        return rc;
    round_trip(&m, body, len);
    /* Every request but an upload fits the control body limit a server applies. */
    const ts__msg_op *info = ts__msg_op_info(h->opcode);
    FZ_CHECK(info != NULL);
    FZ_CHECK(info->upload || len <= ts__msg_request_limit(h->opcode, 1, UINT64_MAX));
    if (m.kind == TS_MSG_PUT_REQ) {
        FZ_CHECK(m.u.put.head_len + m.u.put.rec_len == len);
        if (ts__fz_check_record(m.u.put.record, (size_t)m.u.put.rec_len) != 0)
            return TS_EBADRECORD;
    }
    return 0;
}

/*
 * A reply or notification body, by opcode and status, with the codec's decoder. buf holds the
 * (decompressed) body; the records of ITEMS and STATS bodies are decoded in place inside it.
 */
static int parse_reply(const ts__hdr *h, ts__rbuf *buf)
{
    if (h->status != TS_ST_OK) {
        FZ_CHECK(ts__status_name(h->status) != NULL);
        FZ_CHECK(ts__status_to_err(h->status) < 0);
    }
    ts__msg m;
    int rc = ts__msg_reply_decode(h->opcode, h->status, buf->data, buf->len, &m);
    if (rc != 0)
        return rc;
    round_trip(&m, buf->data, buf->len);
    if (m.kind == TS_MSG_RECORD)
        return ts__fz_check_record_in(buf, 0, buf->len);
    if (m.kind == TS_MSG_ITEMS) {
        ts__msg_items_iter it;
        size_t off, len;
        ts__msg_items_iter_init(&m.u.items, &it);
        while (ts__msg_items_next(&m.u.items, &it, &off, &len)) {
            FZ_CHECK(off % TS__ALIGN == 0 && len <= buf->len - off);
            if (ts__fz_check_record_in(buf, off, len) != 0)
                return TS_EBADRECORD;
        }
    }
    return 0;
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
