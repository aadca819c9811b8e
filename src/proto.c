/* Frame header codec, status tables and the bounded body reader. */
#include "proto.h"

_Static_assert(TS_HDR_SIZE == 24, "the frame header is 24 bytes");

void ts__hdr_encode(const ts__hdr *h, uint8_t out[TS_HDR_SIZE])
{
    out[0] = h->magic;
    out[1] = h->version;
    out[2] = h->opcode;
    out[3] = h->flags;
    ts__put_u16le(out + 4, h->status);
    ts__put_u16le(out + 6, 0);
    ts__put_u32le(out + 8, h->request_id);
    ts__put_u32le(out + 12, 0);
    ts__put_u64le(out + 16, h->body_len);
}

int ts__hdr_decode(const uint8_t in[TS_HDR_SIZE], uint8_t expect_magic, ts__hdr *h)
{
    if (in[0] != expect_magic)
        return TS_EPROTO;
    if (in[1] != TS_PROTO_VERSION)
        return TS_EPROTO;
    if ((in[3] & ~TS_FLAGS_KNOWN) != 0)
        return TS_EPROTO;
    if (ts__get_u16le(in + 6) != 0 || ts__get_u32le(in + 12) != 0)
        return TS_EPROTO;
    h->magic = in[0];
    h->version = in[1];
    h->opcode = in[2];
    h->flags = in[3];
    h->status = ts__get_u16le(in + 4);
    h->request_id = ts__get_u32le(in + 8);
    h->body_len = ts__get_u64le(in + 16);
    return 0;
}

static const struct {
    const char *name;
    int err;
} statuses[TS_ST_COUNT_] = {
    [TS_ST_OK] = {"OK", 0},
    [TS_ST_NOT_FOUND] = {"NOT_FOUND", TS_ENOENT},
    [TS_ST_BAD_REQUEST] = {"BAD_REQUEST", TS_EPROTO},
    [TS_ST_UNKNOWN_OPCODE] = {"UNKNOWN_OPCODE", TS_EUNKNOWNOP},
    [TS_ST_BAD_RECORD] = {"BAD_RECORD", TS_EBADRECORD},
    [TS_ST_TOO_LARGE] = {"TOO_LARGE", TS_EMSGSIZE},
    [TS_ST_OUT_OF_MEMORY] = {"OUT_OF_MEMORY", TS_EOOM},
    [TS_ST_UNSUPPORTED_VERSION] = {"UNSUPPORTED_VERSION", TS_EVERSION},
    [TS_ST_AUTH_REQUIRED] = {"AUTH_REQUIRED", TS_EAUTH},
    [TS_ST_AUTH_FAILED] = {"AUTH_FAILED", TS_EAUTH},
    [TS_ST_TOO_MANY_CLIENTS] = {"TOO_MANY_CLIENTS", TS_ETOOMANY},
    [TS_ST_WRONG_SHARD] = {"WRONG_SHARD", TS_EWRONGSHARD},
    [TS_ST_TIMEOUT] = {"TIMEOUT", TS_ETIMEDOUT},
    [TS_ST_INTERNAL] = {"INTERNAL", TS_ESERVER},
    [TS_ST_SLOW_READER] = {"SLOW_READER", TS_ESLOW},
    [TS_ST_SHUTTING_DOWN] = {"SHUTTING_DOWN", TS_ESHUTDOWN},
    [TS_ST_NAME_TOO_LONG] = {"NAME_TOO_LONG", TS_ENAMETOOLONG},
    [TS_ST_INVALID] = {"INVALID", TS_EINVAL},
    [TS_ST_SAVE_FAILING] = {"SAVE_FAILING", TS_ESAVEFAIL},
    [TS_ST_BACKPRESSURE] = {"BACKPRESSURE", TS_EAGAIN},
    [TS_ST_VERSION_MISMATCH] = {"VERSION_MISMATCH", TS_ECONFLICT},
    [TS_ST_STALE_GRADIENT] = {"STALE_GRADIENT", TS_ESTALE},
    [TS_ST_SERVICE_GONE] = {"SERVICE_GONE", TS_ESERVICE},
};

int ts__status_to_err(uint16_t status)
{
    if (status >= TS_ST_COUNT_)
        return TS_ESERVER;
    return statuses[status].err;
}

uint16_t ts__err_to_status(int err)
{
    switch (err) {
    case 0:
        return TS_ST_OK;
    case TS_ENOENT:
        return TS_ST_NOT_FOUND;
    case TS_EPROTO:
        return TS_ST_BAD_REQUEST;
    case TS_EUNKNOWNOP:
        return TS_ST_UNKNOWN_OPCODE;
    case TS_EBADRECORD:
        return TS_ST_BAD_RECORD;
    case TS_EMSGSIZE:
        return TS_ST_TOO_LARGE;
    case TS_EOOM:
    case TS_ENOMEM:
        return TS_ST_OUT_OF_MEMORY;
    case TS_EVERSION:
        return TS_ST_UNSUPPORTED_VERSION;
    case TS_EAUTH:
        return TS_ST_AUTH_FAILED;
    case TS_ETOOMANY:
        return TS_ST_TOO_MANY_CLIENTS;
    case TS_EWRONGSHARD:
        return TS_ST_WRONG_SHARD;
    case TS_ETIMEDOUT:
        return TS_ST_TIMEOUT;
    case TS_ESLOW:
        return TS_ST_SLOW_READER;
    case TS_ESHUTDOWN:
        return TS_ST_SHUTTING_DOWN;
    case TS_ENAMETOOLONG:
        return TS_ST_NAME_TOO_LONG;
    case TS_EINVAL:
        return TS_ST_INVALID;
    case TS_ESAVEFAIL:
        return TS_ST_SAVE_FAILING;
    case TS_EAGAIN:
        return TS_ST_BACKPRESSURE;
    case TS_ECONFLICT:
        return TS_ST_VERSION_MISMATCH;
    case TS_ESTALE:
        return TS_ST_STALE_GRADIENT;
    case TS_ESERVICE:
        return TS_ST_SERVICE_GONE;
    default:
        return TS_ST_INTERNAL;
    }
}

const char *ts__status_name(uint16_t status)
{
    if (status >= TS_ST_COUNT_)
        return "UNKNOWN";
    return statuses[status].name;
}

const char *ts__op_name(uint8_t op)
{
    switch (op) {
    case TS_OP_HELLO:
        return "HELLO";
    case TS_OP_AUTH_CHALLENGE:
        return "AUTH_CHALLENGE";
    case TS_OP_PING:
        return "PING";
    case TS_OP_PUT:
        return "PUT";
    case TS_OP_APPEND:
        return "APPEND";
    case TS_OP_GET:
        return "GET";
    case TS_OP_PEEK:
        return "PEEK";
    case TS_OP_DELETE:
        return "DELETE";
    case TS_OP_LIST:
        return "LIST";
    case TS_OP_LISTEN:
        return "LISTEN";
    case TS_OP_UNLISTEN:
        return "UNLISTEN";
    case TS_OP_WAIT:
        return "WAIT";
    case TS_OP_STATS:
        return "STATS";
    case TS_OP_SAVE:
        return "SAVE";
    case TS_OP_GET_REF:
        return "GET_REF";
    case TS_OP_PEEK_REF:
        return "PEEK_REF";
    case TS_OP_PUT_FD:
        return "PUT_FD";
    case TS_OP_APPEND_FD:
        return "APPEND_FD";
    case TS_OP_TENSOR_BIN:
        return "TENSOR_BIN";
    case TS_OP_READ_ROWS:
        return "READ_ROWS";
    case TS_OP_GATHER_ROWS:
        return "GATHER_ROWS";
    case TS_OP_WRITE_ROWS:
        return "WRITE_ROWS";
    case TS_OP_STREAM_CREATE:
        return "STREAM_CREATE";
    case TS_OP_STREAM_APPEND:
        return "STREAM_APPEND";
    case TS_OP_STREAM_MARK:
        return "STREAM_MARK";
    case TS_OP_STREAM_CREDIT:
        return "STREAM_CREDIT";
    case TS_OP_STREAM_JOIN:
        return "STREAM_JOIN";
    case TS_OP_STREAM_READ:
        return "STREAM_READ";
    case TS_OP_STREAM_ACK:
        return "STREAM_ACK";
    case TS_OP_STREAM_LEAVE:
        return "STREAM_LEAVE";
    case TS_OP_STREAM_INFO:
        return "STREAM_INFO";
    case TS_OP_STREAM_RANGE:
        return "STREAM_RANGE";
    case TS_OP_ADD:
        return "ADD";
    case TS_OP_PUT_IF:
        return "PUT_IF";
    case TS_OP_TAKE:
        return "TAKE";
    case TS_OP_MGET:
        return "MGET";
    case TS_OP_BARRIER:
        return "BARRIER";
    case TS_OP_TABLE_CREATE:
        return "TABLE_CREATE";
    case TS_OP_TABLE_INSERT:
        return "TABLE_INSERT";
    case TS_OP_TABLE_SAMPLE:
        return "TABLE_SAMPLE";
    case TS_OP_TABLE_UPDATE:
        return "TABLE_UPDATE";
    case TS_OP_TABLE_REMOVE:
        return "TABLE_REMOVE";
    case TS_OP_TABLE_INFO:
        return "TABLE_INFO";
    case TS_OP_SHARD_MAP:
        return "SHARD_MAP";
    case TS_OP_PS_CREATE:
        return "PS_CREATE";
    case TS_OP_PS_PUSH:
        return "PS_PUSH";
    case TS_OP_PS_PULL:
        return "PS_PULL";
    case TS_OP_EMB_CREATE:
        return "EMB_CREATE";
    case TS_OP_EMB_PULL:
        return "EMB_PULL";
    case TS_OP_EMB_PUSH:
        return "EMB_PUSH";
    case TS_OP_NOTIFY:
        return "NOTIFY";
    case TS_OP_SVC_REGISTER:
        return "SVC_REGISTER";
    case TS_OP_SVC_CALL:
        return "SVC_CALL";
    case TS_OP_SVC_REPLY:
        return "SVC_REPLY";
    case TS_OP_SVC_REQUEST:
        return "SVC_REQUEST";
    default:
        return "UNKNOWN";
    }
}

const uint8_t *ts__rd_bytes(ts__rd *r, size_t n)
{
    if (r->err || r->left < n) {
        r->err = TS_EPROTO;
        return NULL;
    }
    const uint8_t *p = r->p;
    r->p += n;
    r->left -= n;
    return p;
}

int ts__rd_u8(ts__rd *r, uint8_t *v)
{
    const uint8_t *p = ts__rd_bytes(r, 1);
    if (p == NULL)
        return TS_EPROTO;
    *v = p[0];
    return 0;
}

int ts__rd_u16(ts__rd *r, uint16_t *v)
{
    const uint8_t *p = ts__rd_bytes(r, 2);
    if (p == NULL)
        return TS_EPROTO;
    *v = ts__get_u16le(p);
    return 0;
}

int ts__rd_u32(ts__rd *r, uint32_t *v)
{
    const uint8_t *p = ts__rd_bytes(r, 4);
    if (p == NULL)
        return TS_EPROTO;
    *v = ts__get_u32le(p);
    return 0;
}

int ts__rd_u64(ts__rd *r, uint64_t *v)
{
    const uint8_t *p = ts__rd_bytes(r, 8);
    if (p == NULL)
        return TS_EPROTO;
    *v = ts__get_u64le(p);
    return 0;
}

int ts__rd_name(ts__rd *r, const char **name, size_t *len)
{
    uint8_t n;
    if (ts__rd_u8(r, &n) != 0)
        return TS_EPROTO;
    const uint8_t *p = ts__rd_bytes(r, n);
    if (p == NULL)
        return TS_EPROTO;
    *name = (const char *)p;
    *len = n;
    return 0;
}
