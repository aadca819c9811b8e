/*
 * The message codec (see msg.h): every body layout of docs/PROTOCOL.md, written once. Decoders
 * read through the bounded reader of proto.h, whose error is sticky, and check the end of the
 * body last; encoders check their room first and then write every byte of the body.
 */
#include "msg.h"

#include <assert.h>
#include <stdio.h>

#include "record.h"

_Static_assert(TS_MSG_HELLO_REP_SIZE == 1 + 1 + 2 + 4 + 8 + 8, "HELLO reply layout");
_Static_assert(TS_BIN_STATE_SIZE == 8 + 4 + 4, "BIN_STATE layout");
_Static_assert(TS_NOTIFY_FIXED == 8 + 4 + 1 + 1 + 1, "NOTIFY fixed part, name length included");
_Static_assert(TS_MSG_LIST_ENTRY_MIN == 1 + 4 + 8 + 8, "LIST entry layout");
_Static_assert(TS_MAX_CTRL_BODY >= 1 + TS_MAX_NAME_LEN + TS_MSG_WAIT_REQ_FIXED,
               "the largest control request fits the control body limit");

/* ---------------------------------------------------------------------------------------------
 * The opcode table (section 8)
 */

static const ts__msg_op ops[] = {
    {TS_OP_HELLO, TS_MSG_HELLO_REQ, TS_MSG_HELLO_REP, 0, 0, 0},
    {TS_OP_AUTH_CHALLENGE, TS_MSG_AUTH_NONCE, TS_MSG_AUTH_NONCE, 0, 0, 0},
    {TS_OP_PING, TS_MSG_EMPTY, TS_MSG_EMPTY, 0, 0, 0},
    {TS_OP_PUT, TS_MSG_PUT_REQ, TS_MSG_BIN_STATE, 1, 1, 0},
    {TS_OP_APPEND, TS_MSG_PUT_REQ, TS_MSG_BIN_STATE, 1, 1, 0},
    {TS_OP_GET, TS_MSG_GET_REQ, TS_MSG_ITEMS, 0, 1, 0},
    {TS_OP_PEEK, TS_MSG_GET_REQ, TS_MSG_ITEMS, 0, 0, 0},
    {TS_OP_DELETE, TS_MSG_NAME_REQ, TS_MSG_BIN_STATE, 0, 1, 0},
    {TS_OP_LIST, TS_MSG_EMPTY, TS_MSG_LIST_REP, 0, 0, 0},
    {TS_OP_LISTEN, TS_MSG_NAME_REQ, TS_MSG_BIN_STATE, 0, 0, 0},
    {TS_OP_UNLISTEN, TS_MSG_NAME_REQ, TS_MSG_EMPTY, 0, 0, 0},
    {TS_OP_WAIT, TS_MSG_WAIT_REQ, TS_MSG_BIN_STATE, 0, 0, 0},
    {TS_OP_STATS, TS_MSG_EMPTY, TS_MSG_RECORD, 0, 0, 0},
    {TS_OP_SAVE, TS_MSG_EMPTY, TS_MSG_EMPTY, 0, 0, 0},
    {TS_OP_GET_REF, TS_MSG_GET_REQ, TS_MSG_REF_ITEMS, 0, 1, 0},
    {TS_OP_PEEK_REF, TS_MSG_GET_REQ, TS_MSG_REF_ITEMS, 0, 0, 0},
    {TS_OP_PUT_FD, TS_MSG_PUT_FD_REQ, TS_MSG_BIN_STATE, 0, 1, 0},
    {TS_OP_APPEND_FD, TS_MSG_PUT_FD_REQ, TS_MSG_BIN_STATE, 0, 1, 0},
    {TS_OP_TENSOR_BIN, TS_MSG_TENSOR_BIN_REQ, TS_MSG_BIN_STATE, 0, 1, 0},
    {TS_OP_READ_ROWS, TS_MSG_READ_ROWS_REQ, TS_MSG_ITEMS, 0, 0, 0},
    {TS_OP_GATHER_ROWS, TS_MSG_PUT_REQ, TS_MSG_ITEMS, 1, 0, 0},
    {TS_OP_WRITE_ROWS, TS_MSG_PUT_REQ, TS_MSG_BIN_STATE, 1, 1, 0},
    {TS_OP_STREAM_CREATE, TS_MSG_STREAM_CREATE_REQ, TS_MSG_STREAM_STATE, 0, 1, 0},
    {TS_OP_STREAM_APPEND, TS_MSG_PUT_REQ, TS_MSG_STREAM_APPEND_STATE, 1, 1, 0},
    {TS_OP_STREAM_MARK, TS_MSG_STREAM_MARK_REQ, TS_MSG_STREAM_APPEND_STATE, 0, 1, 0},
    {TS_OP_STREAM_CREDIT, TS_MSG_STREAM_CREDIT_REQ, TS_MSG_STREAM_STATE, 0, 0, 0},
    {TS_OP_STREAM_JOIN, TS_MSG_STREAM_JOIN_REQ, TS_MSG_STREAM_JOIN_STATE, 0, 1, 0},
    /* A READ moves its group's cursor and pending entries: it changes the store. */
    {TS_OP_STREAM_READ, TS_MSG_STREAM_READ_REQ, TS_MSG_STREAM_ENTRIES, 0, 1, 0},
    {TS_OP_STREAM_ACK, TS_MSG_STREAM_ACK_REQ, TS_MSG_STREAM_ACK_STATE, 0, 1, 0},
    {TS_OP_STREAM_LEAVE, TS_MSG_STREAM_LEAVE_REQ, TS_MSG_STREAM_STATE, 0, 1, 0},
    {TS_OP_STREAM_INFO, TS_MSG_NAME_REQ, TS_MSG_RECORD, 0, 0, 0},
    {TS_OP_STREAM_RANGE, TS_MSG_STREAM_RANGE_REQ, TS_MSG_STREAM_ENTRIES, 0, 0, 0},
    /* Coordination: PUT_IF is an upload with the expected version between name and record. */
    {TS_OP_ADD, TS_MSG_ADD_REQ, TS_MSG_ADD_STATE, 0, 1, 0},
    {TS_OP_PUT_IF, TS_MSG_PUT_REQ, TS_MSG_BIN_STATE, 1, 1, TS_MSG_PUT_IF_FIXED},
    {TS_OP_TAKE, TS_MSG_TAKE_REQ, TS_MSG_ITEMS, 0, 1, 0},
    {TS_OP_MGET, TS_MSG_MGET_REQ, TS_MSG_MGET_REP, 0, 0, 0},
    {TS_OP_BARRIER, TS_MSG_BARRIER_REQ, TS_MSG_BARRIER_STATE, 0, 0, 0},
    /* Services: CALL and REPLY are uploads with fixed fields; a CALL's answer is ITEMS. */
    {TS_OP_SVC_REGISTER, TS_MSG_SVC_REGISTER_REQ, TS_MSG_SVC_STATE, 0, 0, 0},
    {TS_OP_SVC_CALL, TS_MSG_PUT_REQ, TS_MSG_ITEMS, 1, 0, TS_MSG_SVC_CALL_FIXED},
    {TS_OP_SVC_REPLY, TS_MSG_PUT_REQ, TS_MSG_EMPTY, 1, 0, TS_MSG_SVC_REPLY_FIXED},
    /* Parameter server: PS_PUSH, EMB_PULL and EMB_PUSH are uploads (a tensor record). */
    {TS_OP_PS_CREATE, TS_MSG_PS_CREATE_REQ, TS_MSG_BIN_STATE, 0, 1, 0},
    {TS_OP_PS_PUSH, TS_MSG_PUT_REQ, TS_MSG_BIN_STATE, 1, 1, TS_MSG_PS_PUSH_FIXED},
    {TS_OP_PS_PULL, TS_MSG_PS_PULL_REQ, TS_MSG_ITEMS, 0, 0, 0},
    {TS_OP_EMB_CREATE, TS_MSG_EMB_CREATE_REQ, TS_MSG_BIN_STATE, 0, 1, 0},
    {TS_OP_EMB_PULL, TS_MSG_PUT_REQ, TS_MSG_ITEMS, 1, 0, 0},
    {TS_OP_EMB_PUSH, TS_MSG_PUT_REQ, TS_MSG_BIN_STATE, 1, 1, TS_MSG_EMB_PUSH_FIXED},
    /* Replay tables: a SAMPLE changes times_sampled and may evict (max_times_sampled). */
    {TS_OP_TABLE_CREATE, TS_MSG_TABLE_CREATE_REQ, TS_MSG_TABLE_STATE, 0, 1, 0},
    {TS_OP_TABLE_INSERT, TS_MSG_PUT_REQ, TS_MSG_TABLE_STATE, 1, 1, TS_MSG_TABLE_INSERT_FIXED},
    {TS_OP_TABLE_SAMPLE, TS_MSG_TABLE_SAMPLE_REQ, TS_MSG_TABLE_SAMPLES, 0, 1, 0},
    {TS_OP_TABLE_UPDATE, TS_MSG_TABLE_UPDATE_REQ, TS_MSG_TABLE_STATE, 0, 1, 0},
    {TS_OP_TABLE_REMOVE, TS_MSG_TABLE_REMOVE_REQ, TS_MSG_TABLE_STATE, 0, 1, 0},
    {TS_OP_TABLE_INFO, TS_MSG_NAME_REQ, TS_MSG_RECORD, 0, 0, 0},
    {TS_OP_SHARD_MAP, TS_MSG_EMPTY, TS_MSG_SHARD_MAP, 0, 0, 0},
    {TS_OP_NOTIFY, TS_MSG_NONE, TS_MSG_NOTIFY, 0, 0, 0},
    {TS_OP_SVC_REQUEST, TS_MSG_NONE, TS_MSG_SVC_REQUEST, 0, 0, 0},
};

const ts__msg_op *ts__msg_op_info(uint8_t op)
{
    for (size_t i = 0; i < TS__ARRAY_SIZE(ops); i++)
        if (ops[i].op == op)
            return &ops[i];
    return NULL;
}

ts__msg_kind ts__msg_reply_kind(uint8_t op, uint16_t status)
{
    /* A PS_PUSH refused as stale carries the parameter's state with its current version. */
    if (op == TS_OP_PS_PUSH && status == TS_ST_STALE_GRADIENT)
        return TS_MSG_BIN_STATE;
    if (op == TS_OP_NOTIFY) /* notifications always carry status 0 (section 8.14) */
        return status == TS_ST_OK ? TS_MSG_NOTIFY : TS_MSG_NONE;
    if (op == TS_OP_SVC_REQUEST) /* so do the calls pushed to a service's server (8.54) */
        return status == TS_ST_OK ? TS_MSG_SVC_REQUEST : TS_MSG_NONE;
    if (status != TS_ST_OK) {
        /*
         * Error replies echo the request's opcode, even one the server does not know, and
         * opcode 0 carries the errors that belong to no request (sections 5 and 13).
         */
        if (op == TS_OP_WAIT && status == TS_ST_TIMEOUT)
            return TS_MSG_BIN_STATE;
        /* A PUT_IF that lost carries the bin's state with its current version. */
        if (op == TS_OP_PUT_IF && status == TS_ST_VERSION_MISMATCH)
            return TS_MSG_BIN_STATE;
        /* A sharded daemon names the slot's owner (section 14); opcode 0 never carries it. */
        if (op != 0 && status == TS_ST_WRONG_SHARD)
            return TS_MSG_WRONG_SHARD;
        return TS_MSG_ERROR;
    }
    const ts__msg_op *info = ts__msg_op_info(op);
    return info != NULL ? (ts__msg_kind)info->reply : TS_MSG_NONE;
}

uint64_t ts__msg_reply_limit(uint8_t op, uint16_t status, uint64_t large)
{
    switch (ts__msg_reply_kind(op, status)) {
    case TS_MSG_HELLO_REP: /* 56 with the server's token proof */
        return TS_MSG_HELLO_REP_SIZE + TS_MSG_TOKEN_PROOF_SIZE;
    case TS_MSG_AUTH_NONCE:
        return TS_MSG_AUTH_NONCE_SIZE;
    case TS_MSG_BIN_STATE:
        return TS_BIN_STATE_SIZE;
    case TS_MSG_ADD_STATE:
        return TS_MSG_ADD_STATE_SIZE;
    case TS_MSG_BARRIER_STATE:
        return TS_MSG_BARRIER_STATE_SIZE;
    case TS_MSG_MGET_REP:
        return large;
    case TS_MSG_STREAM_STATE:
        return TS_MSG_STREAM_STATE_SIZE;
    case TS_MSG_STREAM_APPEND_STATE:
        return TS_MSG_STREAM_APPEND_SIZE;
    case TS_MSG_STREAM_JOIN_STATE:
        return TS_MSG_STREAM_JOIN_SIZE;
    case TS_MSG_STREAM_ACK_STATE:
        return TS_MSG_STREAM_ACK_SIZE;
    case TS_MSG_TABLE_STATE:
        return TS_MSG_TABLE_STATE_SIZE;
    case TS_MSG_TABLE_SAMPLES:
    case TS_MSG_SVC_REQUEST:
        return large;
    case TS_MSG_SVC_STATE:
        return TS_MSG_SVC_STATE_SIZE;
    case TS_MSG_ITEMS:
    case TS_MSG_REF_ITEMS:
    case TS_MSG_LIST_REP:
    case TS_MSG_STREAM_ENTRIES:
        return large;
    case TS_MSG_RECORD:
        /* STREAM_INFO's record grows with the stream's groups and members, as LIST does. */
        if (op == TS_OP_STREAM_INFO)
            return large;
        return large < TS_MSG_MAX_STATS_REPLY ? large : TS_MSG_MAX_STATS_REPLY;
    case TS_MSG_NOTIFY:
        return TS_MSG_MAX_NOTIFY;
    case TS_MSG_ERROR:
    case TS_MSG_WRONG_SHARD: /* kept within an error message's limit on purpose */
        return TS_MAX_ERRMSG;
    case TS_MSG_SHARD_MAP:
        return TS_MSG_SHARD_MAP_MAX;
    default: /* empty bodies, and frames no reply carries */
        return 0;
    }
}

uint64_t ts__msg_request_limit(uint8_t op, int helloed, uint64_t max_frame)
{
    uint64_t limit;
    const ts__msg_op *info = ts__msg_op_info(op);
    if (!helloed)
        limit = TS_MAX_PREAUTH_BODY;
    else if (info != NULL && info->upload) /* PUT, APPEND, GATHER_ROWS, WRITE_ROWS */
        limit = max_frame;
    else
        limit = TS_MAX_CTRL_BODY;
    return limit < max_frame ? limit : max_frame;
}

/* ---------------------------------------------------------------------------------------------
 * The request header check
 */

uint16_t ts__msg_hdr_rule_status(ts__msg_hdr_rule rule)
{
    switch (rule) {
    case TS_HDR_OK:
        return TS_ST_OK;
    case TS_HDR_VERSION:
        return TS_ST_UNSUPPORTED_VERSION;
    case TS_HDR_PREAUTH_SIZE:
    case TS_HDR_MAX_FRAME:
    case TS_HDR_CTRL_SIZE:
        return TS_ST_TOO_LARGE;
    case TS_HDR_OPCODE:
        return TS_ST_UNKNOWN_OPCODE;
    case TS_HDR_MAGIC:
    case TS_HDR_FLAGS:
    case TS_HDR_RESERVED:
    case TS_HDR_STATUS:
    case TS_HDR_NOT_HELLO:
    case TS_HDR_LZ4:
    default:
        return TS_ST_BAD_REQUEST;
    }
}

/* The first rule p breaks on a connection in state st, in the documented order. */
static ts__msg_hdr_rule request_rule(const uint8_t *p, const ts__msg_conn_state *st)
{
    uint8_t op = p[2], flags = p[3];
    uint64_t body_len = ts__get_u64le(p + 16);
    if (p[0] != TS_MAGIC_REQ)
        return TS_HDR_MAGIC;
    if (p[1] != TS_PROTO_VERSION)
        return TS_HDR_VERSION;
    if ((flags & ~TS_FLAGS_KNOWN) != 0)
        return TS_HDR_FLAGS;
    if (ts__get_u16le(p + 6) != 0 || ts__get_u32le(p + 12) != 0)
        return TS_HDR_RESERVED;
    if (ts__get_u16le(p + 4) != 0)
        return TS_HDR_STATUS;
    if (!st->helloed) {
        /* The size first: an oversized body is refused before anything else is looked at. */
        if (body_len > TS_MAX_PREAUTH_BODY)
            return TS_HDR_PREAUTH_SIZE;
        if (op != TS_OP_HELLO && op != TS_OP_AUTH_CHALLENGE)
            return TS_HDR_NOT_HELLO;
    }
    if ((flags & TS_FLAG_LZ4) && !st->lz4)
        return TS_HDR_LZ4;
    if (body_len > st->max_frame)
        return TS_HDR_MAX_FRAME;
    const ts__msg_op *info = ts__msg_op_info(op);
    if (info == NULL || info->request == TS_MSG_NONE)
        return TS_HDR_OPCODE;
    if (!info->upload && body_len > TS_MAX_CTRL_BODY)
        return TS_HDR_CTRL_SIZE;
    return TS_HDR_OK;
}

uint16_t ts__msg_request_check(const uint8_t *p, const ts__msg_conn_state *st, ts__hdr *h,
                               ts__msg_hdr_rule *rule)
{
    ts__msg_hdr_rule r = request_rule(p, st);
    if (rule != NULL)
        *rule = r;
    if (r != TS_HDR_OK)
        return ts__msg_hdr_rule_status(r);
    /* Every rule ts__hdr_decode applies was checked above, so it cannot fail here. */
    int rc = ts__hdr_decode(p, TS_MAGIC_REQ, h);
    assert(rc == 0);
    (void)rc;
    return TS_ST_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Shared pieces
 */

/* 0 when the reader read the whole body without error, else TS_EPROTO. */
int ts__msg_rd_end(const ts__rd *r)
{
    return r->err == 0 && r->left == 0 ? 0 : TS_EPROTO;
}

/* Check that a name can be encoded and that need bytes fit in cap. */
static int room(size_t need, size_t cap, size_t name_len)
{
    if (name_len > TS_MAX_NAME_LEN)
        return TS_ENAMETOOLONG;
    return need <= cap ? 0 : TS_EMSGSIZE;
}

/* Write a name (u8 length + bytes) at p; returns the bytes written. */
size_t ts__msg_put_name(uint8_t *p, const uint8_t *name, size_t name_len)
{
    p[0] = (uint8_t)name_len;
    if (name_len > 0)
        memcpy(p + 1, name, name_len);
    return 1 + name_len;
}

int ts__msg_name_head_encode(uint8_t *out, size_t cap, const uint8_t *name, size_t name_len,
                             size_t fixed_len, uint8_t **fields)
{
    if (name_len > TS_MAX_NAME_LEN)
        return TS_ENAMETOOLONG;
    /* Written so that no fixed_len a caller could pass makes the sum wrap. */
    if (fixed_len > cap || 1 + name_len > cap - fixed_len)
        return TS_EMSGSIZE;
    *fields = out + ts__msg_put_name(out, name, name_len);
    return 0;
}

/* 1 when the n bytes at p are all zero. */
int ts__msg_all_zero(const uint8_t *p, size_t n)
{
    uint8_t acc = 0;
    for (size_t i = 0; i < n; i++)
        acc |= p[i];
    return acc == 0;
}

void ts__msg_rd_str(ts__rd *r, size_t min_len, const uint8_t **s, size_t *len)
{
    const char *p = NULL;
    size_t n = 0;
    if (ts__rd_name(r, &p, &n) != 0)
        return;
    if (n < min_len) {
        r->err = TS_EPROTO;
        return;
    }
    *s = n > 0 ? (const uint8_t *)p : NULL;
    *len = n;
}

int ts__msg_empty_decode(const uint8_t *body, size_t len)
{
    (void)body;
    return len == 0 ? 0 : TS_EPROTO;
}

/* ---------------------------------------------------------------------------------------------
 * HELLO
 */

size_t ts__msg_hello_req_size(size_t token_len)
{
    return TS_MSG_HELLO_REQ_FIXED + token_len;
}

int ts__msg_hello_req_encode(uint8_t *out, size_t cap, const ts__msg_hello_req *m, size_t *len)
{
    if (m->token_len > TS_MAX_TOKEN_LEN)
        return TS_EINVAL;
    size_t need = ts__msg_hello_req_size(m->token_len);
    if (need > cap)
        return TS_EMSGSIZE;
    out[0] = m->max_version;
    out[1] = m->flags;
    ts__put_u16le(out + 2, m->token_len);
    if (m->token_len > 0)
        memcpy(out + TS_MSG_HELLO_REQ_FIXED, m->token, m->token_len);
    *len = need;
    return 0;
}

int ts__msg_hello_req_decode(const uint8_t *body, size_t len, ts__msg_hello_req *m)
{
    ts__rd r;
    uint8_t max_version = 0, flags = 0;
    uint16_t token_len = 0;
    ts__rd_init(&r, body, len);
    ts__rd_u8(&r, &max_version);
    ts__rd_u8(&r, &flags);
    ts__rd_u16(&r, &token_len);
    const uint8_t *token = ts__rd_bytes(&r, token_len);
    /* A longer token could not have come in a body within the pre-HELLO limit. */
    if (ts__msg_rd_end(&r) != 0 || token_len > TS_MAX_TOKEN_LEN)
        return TS_EPROTO;
    m->max_version = max_version;
    m->flags = flags;
    m->token_len = token_len;
    m->token = token_len > 0 ? token : NULL;
    return 0;
}

int ts__msg_hello_rep_encode(uint8_t *out, size_t cap, const ts__msg_hello_rep *m, size_t *len)
{
    int proof = (m->flags & TS_HELLO_TOKEN_PROOF) != 0;
    if (proof && m->proof == NULL)
        return TS_EINVAL;
    if (cap < TS_MSG_HELLO_REP_SIZE + (proof ? TS_MSG_TOKEN_PROOF_SIZE : 0))
        return TS_EMSGSIZE;
    if (proof)
        memcpy(out + TS_MSG_HELLO_REP_SIZE, m->proof, TS_MSG_TOKEN_PROOF_SIZE);
    out[0] = m->version;
    out[1] = m->flags;
    ts__put_u16le(out + 2, 0);
    ts__put_u32le(out + 4, 0);
    ts__put_u64le(out + 8, m->max_body);
    ts__put_u64le(out + 16, m->server_id);
    *len = TS_MSG_HELLO_REP_SIZE + (proof ? TS_MSG_TOKEN_PROOF_SIZE : 0);
    return 0;
}

int ts__msg_hello_rep_decode(const uint8_t *body, size_t len, ts__msg_hello_rep *m)
{
    ts__rd r;
    uint8_t version = 0, flags = 0;
    uint16_t r16 = 0;
    uint32_t r32 = 0;
    uint64_t max_body = 0, server_id = 0;
    ts__rd_init(&r, body, len);
    ts__rd_u8(&r, &version);
    ts__rd_u8(&r, &flags);
    ts__rd_u16(&r, &r16);
    ts__rd_u32(&r, &r32);
    ts__rd_u64(&r, &max_body);
    ts__rd_u64(&r, &server_id);
    /* The server's token proof follows exactly when the flag is granted. */
    const uint8_t *proof = NULL;
    if (flags & TS_HELLO_TOKEN_PROOF)
        proof = ts__rd_bytes(&r, TS_MSG_TOKEN_PROOF_SIZE);
    if (ts__msg_rd_end(&r) != 0 || r16 != 0 || r32 != 0)
        return TS_EPROTO;
    m->version = version;
    m->flags = flags;
    m->max_body = max_body;
    m->server_id = server_id;
    m->proof = proof;
    return 0;
}

int ts__msg_auth_nonce_decode(const uint8_t *body, size_t len, ts__msg_auth_nonce *m)
{
    if (len != TS_MSG_AUTH_NONCE_SIZE)
        return TS_EPROTO;
    m->nonce = body;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Requests that start with a name
 */

/* The fixed bytes after the name, by layout. */
enum { NAME_ONLY = 0, NAME_GET = TS_MSG_GET_REQ_FIXED, NAME_WAIT = TS_MSG_WAIT_REQ_FIXED };

static int name_req_encode(uint8_t *out, size_t cap, const ts__msg_name_req *m, size_t *len,
                           size_t tail)
{
    uint8_t *p;
    int rc = ts__msg_name_head_encode(out, cap, m->name, m->name_len, tail, &p);
    if (rc != 0)
        return rc;
    if (tail == NAME_GET) {
        ts__put_u32le(p, m->max_items);
    } else if (tail == NAME_WAIT) {
        ts__put_u64le(p, m->after_version);
        ts__put_u32le(p + 8, m->timeout_ms);
    }
    *len = 1 + m->name_len + tail;
    return 0;
}

static int name_req_decode(const uint8_t *body, size_t len, ts__msg_name_req *m, size_t tail)
{
    ts__rd r;
    const char *name = NULL;
    size_t name_len = 0;
    uint32_t max_items = 0, timeout_ms = 0;
    uint64_t after = 0;
    ts__rd_init(&r, body, len);
    ts__rd_name(&r, &name, &name_len);
    if (tail == NAME_GET) {
        ts__rd_u32(&r, &max_items);
    } else if (tail == NAME_WAIT) {
        ts__rd_u64(&r, &after);
        ts__rd_u32(&r, &timeout_ms);
    }
    if (ts__msg_rd_end(&r) != 0)
        return TS_EPROTO;
    m->name = (const uint8_t *)name;
    m->name_len = name_len;
    m->max_items = max_items;
    m->after_version = after;
    m->timeout_ms = timeout_ms;
    return 0;
}

size_t ts__msg_name_req_size(size_t name_len)
{
    return 1 + name_len;
}

int ts__msg_name_req_encode(uint8_t *out, size_t cap, const ts__msg_name_req *m, size_t *len)
{
    return name_req_encode(out, cap, m, len, NAME_ONLY);
}

int ts__msg_name_req_decode(const uint8_t *body, size_t len, ts__msg_name_req *m)
{
    return name_req_decode(body, len, m, NAME_ONLY);
}

size_t ts__msg_get_req_size(size_t name_len)
{
    return 1 + name_len + NAME_GET;
}

int ts__msg_get_req_encode(uint8_t *out, size_t cap, const ts__msg_name_req *m, size_t *len)
{
    return name_req_encode(out, cap, m, len, NAME_GET);
}

int ts__msg_get_req_decode(const uint8_t *body, size_t len, ts__msg_name_req *m)
{
    return name_req_decode(body, len, m, NAME_GET);
}

size_t ts__msg_wait_req_size(size_t name_len)
{
    return 1 + name_len + NAME_WAIT;
}

int ts__msg_wait_req_encode(uint8_t *out, size_t cap, const ts__msg_name_req *m, size_t *len)
{
    return name_req_encode(out, cap, m, len, NAME_WAIT);
}

int ts__msg_wait_req_decode(const uint8_t *body, size_t len, ts__msg_name_req *m)
{
    return name_req_decode(body, len, m, NAME_WAIT);
}

/* ---------------------------------------------------------------------------------------------
 * PUT and APPEND
 */

size_t ts__msg_upload_head_size(size_t name_len, size_t fixed_len)
{
    return 1 + name_len + fixed_len;
}

int ts__msg_upload_head_encode(uint8_t *out, size_t cap, const uint8_t *name, size_t name_len,
                               const uint8_t *fixed, size_t fixed_len, size_t *len)
{
    if (fixed_len > TS_MSG_MAX_UPLOAD_FIXED)
        return TS_EINVAL;
    uint8_t *p;
    int rc = ts__msg_name_head_encode(out, cap, name, name_len, fixed_len, &p);
    if (rc != 0)
        return rc;
    if (fixed != NULL && fixed_len > 0)
        memcpy(p, fixed, fixed_len);
    else if (fixed_len > 0)
        memset(p, 0, fixed_len);
    *len = ts__msg_upload_head_size(name_len, fixed_len);
    return 0;
}

int ts__msg_upload_encode(uint8_t *out, size_t cap, const uint8_t *name, size_t name_len,
                          const uint8_t *fixed, size_t fixed_len, const uint8_t *rec,
                          size_t rec_len, size_t *len)
{
    if (name_len > TS_MAX_NAME_LEN)
        return TS_ENAMETOOLONG;
    if (fixed_len > TS_MSG_MAX_UPLOAD_FIXED)
        return TS_EINVAL;
    size_t head = 1 + name_len + fixed_len;
    if (rec_len > cap || head > cap - rec_len)
        return TS_EMSGSIZE;
    size_t hl;
    (void)ts__msg_upload_head_encode(out, cap, name, name_len, fixed, fixed_len, &hl);
    if (rec_len > 0)
        memcpy(out + head, rec, rec_len);
    *len = head + rec_len;
    return 0;
}

int ts__msg_upload_head_decode(const uint8_t *p, size_t avail, uint64_t body_len, size_t fixed_len,
                               ts__msg_put_req *m)
{
    assert(fixed_len <= TS_MSG_MAX_UPLOAD_FIXED);
    /* What the body announces is judged first: a body too short for its head never becomes OK. */
    if (body_len < 1)
        return TS_EPROTO;
    if (avail < 1)
        return TS_EAGAIN;
    size_t name_len = p[0];
    size_t head = 1 + name_len + fixed_len;
    if (body_len < (uint64_t)head)
        return TS_EPROTO;
    if (avail < head)
        return TS_EAGAIN;
    m->name = p + 1;
    m->name_len = name_len;
    m->fixed = fixed_len > 0 ? p + 1 + name_len : NULL;
    m->fixed_len = fixed_len;
    m->head_len = head;
    m->rec_len = body_len - head;
    m->record = NULL;
    return 0;
}

int ts__msg_upload_decode(const uint8_t *body, size_t len, size_t fixed_len, ts__msg_put_req *m)
{
    ts__msg_put_req d;
    int rc = ts__msg_upload_head_decode(body, len, len, fixed_len, &d);
    if (rc != 0)
        return TS_EPROTO; /* the whole body is here: missing bytes are missing for good */
    d.record = body + d.head_len;
    *m = d;
    return 0;
}

size_t ts__msg_put_head_size(size_t name_len)
{
    return ts__msg_upload_head_size(name_len, 0);
}

int ts__msg_put_head_encode(uint8_t *out, size_t cap, const uint8_t *name, size_t name_len,
                            size_t *len)
{
    return ts__msg_upload_head_encode(out, cap, name, name_len, NULL, 0, len);
}

int ts__msg_put_encode(uint8_t *out, size_t cap, const uint8_t *name, size_t name_len,
                       const uint8_t *rec, size_t rec_len, size_t *len)
{
    return ts__msg_upload_encode(out, cap, name, name_len, NULL, 0, rec, rec_len, len);
}

int ts__msg_put_head_decode(const uint8_t *p, size_t avail, uint64_t body_len, ts__msg_put_req *m)
{
    return ts__msg_upload_head_decode(p, avail, body_len, 0, m);
}

int ts__msg_put_decode(const uint8_t *body, size_t len, ts__msg_put_req *m)
{
    return ts__msg_upload_decode(body, len, 0, m);
}

/* ---------------------------------------------------------------------------------------------
 * BIN_STATE
 */

int ts__msg_bin_state_encode(uint8_t *out, size_t cap, uint64_t version, uint32_t n_items,
                             size_t *len)
{
    if (cap < TS_BIN_STATE_SIZE)
        return TS_EMSGSIZE;
    ts__put_u64le(out, version);
    ts__put_u32le(out + 8, n_items);
    ts__put_u32le(out + 12, 0);
    *len = TS_BIN_STATE_SIZE;
    return 0;
}

int ts__msg_bin_state_decode(const uint8_t *body, size_t len, ts__msg_bin_state *m)
{
    ts__rd r;
    uint64_t version = 0;
    uint32_t n = 0, rsvd = 0;
    ts__rd_init(&r, body, len);
    ts__rd_u64(&r, &version);
    ts__rd_u32(&r, &n);
    ts__rd_u32(&r, &rsvd);
    if (ts__msg_rd_end(&r) != 0 || rsvd != 0)
        return TS_EPROTO;
    m->version = version;
    m->n_items = n;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * ITEMS
 */

/* The head size for n items, which always fits 64 bits (n < 2^32). */
static uint64_t items_head(uint32_t n)
{
    return ((uint64_t)TS_MSG_ITEMS_FIXED + 8 * (uint64_t)n + (TS__ALIGN - 1)) &
           ~(uint64_t)(TS__ALIGN - 1);
}

size_t ts__msg_items_pad(uint64_t rec_len)
{
    return (size_t)((TS__ALIGN - rec_len % TS__ALIGN) % TS__ALIGN);
}

int ts__msg_add_padded(uint64_t *total, uint64_t rec_len)
{
    uint64_t padded, sum;
    if (ts__align_up_checked(rec_len, TS__ALIGN, &padded) != 0 ||
        __builtin_add_overflow(*total, padded, &sum))
        return TS_EMSGSIZE;
    *total = sum;
    return 0;
}

int ts__msg_put_padded(uint8_t *out, size_t cap, size_t *off, const uint8_t *rec, uint64_t rec_len)
{
    size_t pad = ts__msg_items_pad(rec_len);
    /* Each side is checked against what is left, so no sum can wrap. */
    if (rec_len > cap - *off || pad > cap - *off - (size_t)rec_len)
        return TS_EMSGSIZE;
    if (rec_len > 0)
        memcpy(out + *off, rec, (size_t)rec_len);
    memset(out + *off + rec_len, 0, pad);
    *off += (size_t)rec_len + pad;
    return 0;
}

int ts__msg_skip_padded(const uint8_t *body, size_t len, uint64_t *off, uint64_t rec_len)
{
    uint64_t padded, end;
    if (ts__align_up_checked(rec_len, TS__ALIGN, &padded) != 0 ||
        __builtin_add_overflow(*off, padded, &end) || end > len)
        return TS_EPROTO;
    if (!ts__msg_all_zero(body + *off + rec_len, (size_t)(padded - rec_len)))
        return TS_EPROTO;
    *off = end;
    return 0;
}

int ts__msg_head_check(const uint8_t *body, size_t len, uint64_t used, uint64_t head)
{
    /* The bounds first: the padding is only read once it is known to be in the body. */
    if (head > len || !ts__msg_all_zero(body + used, (size_t)(head - used)))
        return TS_EPROTO;
    return 0;
}

int ts__msg_items_size(uint32_t n, const uint64_t *item_lens, uint64_t *size)
{
    uint64_t total = items_head(n);
    for (uint32_t i = 0; i < n; i++)
        if (ts__msg_add_padded(&total, item_lens[i]) != 0)
            return TS_EMSGSIZE;
#if SIZE_MAX < UINT64_MAX
    if (total > SIZE_MAX)
        return TS_EMSGSIZE;
#endif
    *size = total;
    return 0;
}

int ts__msg_items_head_encode(uint8_t *out, size_t cap, uint64_t version, uint32_t n,
                              uint32_t remaining, const uint64_t *item_lens, size_t *len)
{
    uint64_t head = items_head(n);
    if (head > cap)
        return TS_EMSGSIZE;
    memset(out, 0, (size_t)head);
    ts__put_u64le(out, version);
    ts__put_u32le(out + 8, n);
    ts__put_u32le(out + 12, remaining);
    if (item_lens != NULL)
        for (uint32_t i = 0; i < n; i++)
            ts__msg_items_set_len(out, i, item_lens[i]);
    *len = (size_t)head;
    return 0;
}

void ts__msg_items_set_len(uint8_t *head, uint32_t i, uint64_t item_len)
{
    ts__put_u64le(head + TS_MSG_ITEMS_FIXED + 8 * (size_t)i, item_len);
}

int ts__msg_items_encode(uint8_t *out, size_t cap, uint64_t version, uint32_t remaining, uint32_t n,
                         const uint8_t *const *recs, const uint64_t *rec_lens, size_t *len)
{
    uint64_t total;
    if (ts__msg_items_size(n, rec_lens, &total) != 0 || total > cap)
        return TS_EMSGSIZE;
    size_t off;
    int rc = ts__msg_items_head_encode(out, cap, version, n, remaining, rec_lens, &off);
    assert(rc == 0);
    (void)rc;
    /* total <= cap bounds every running offset: no record can fail to fit. */
    for (uint32_t i = 0; i < n; i++)
        (void)ts__msg_put_padded(out, cap, &off, recs[i], rec_lens[i]);
    *len = off;
    return 0;
}

int ts__msg_items_decode(const uint8_t *body, size_t len, ts__msg_items *m)
{
    ts__rd r;
    uint64_t version = 0;
    uint32_t n = 0, remaining = 0;
    ts__rd_init(&r, body, len);
    ts__rd_u64(&r, &version);
    ts__rd_u32(&r, &n);
    ts__rd_u32(&r, &remaining);
    if (r.err != 0)
        return TS_EPROTO;
    /* The lengths must lie in the body before anything is sized or walked by n. */
    uint64_t head = items_head(n);
    if (ts__msg_head_check(body, len, TS_MSG_ITEMS_FIXED + 8 * (uint64_t)n, head) != 0)
        return TS_EPROTO;
    uint64_t off = head;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t rec_len = ts__get_u64le(body + TS_MSG_ITEMS_FIXED + 8 * (size_t)i);
        if (ts__msg_skip_padded(body, len, &off, rec_len) != 0)
            return TS_EPROTO;
    }
    if (off != len)
        return TS_EPROTO;
    m->version = version;
    m->n_items = n;
    m->remaining = remaining;
    m->body = body;
    m->len = len;
    return 0;
}

void ts__msg_items_iter_init(const ts__msg_items *m, ts__msg_items_iter *it)
{
    it->i = 0;
    it->off = items_head(m->n_items);
}

int ts__msg_items_next(const ts__msg_items *m, ts__msg_items_iter *it, size_t *off, size_t *len)
{
    if (it->i >= m->n_items)
        return 0;
    uint64_t rec_len = ts__get_u64le(m->body + TS_MSG_ITEMS_FIXED + 8 * (size_t)it->i);
    *off = (size_t)it->off;
    *len = (size_t)rec_len;
    it->off += rec_len + ts__msg_items_pad(rec_len);
    it->i++;
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * LIST
 */

int ts__msg_list_head_encode(uint8_t *out, size_t cap, uint32_t n, size_t *len)
{
    if (cap < TS_MSG_LIST_FIXED)
        return TS_EMSGSIZE;
    ts__put_u32le(out, n);
    ts__put_u32le(out + 4, 0);
    *len = TS_MSG_LIST_FIXED;
    return 0;
}

size_t ts__msg_list_entry_size(size_t name_len)
{
    return TS_MSG_LIST_ENTRY_MIN + name_len;
}

int ts__msg_list_entry_encode(uint8_t *out, size_t cap, const ts__msg_list_entry *e, size_t *len)
{
    /* The fields after the name: all of an entry's least size but the name's length byte. */
    uint8_t *p;
    int rc =
        ts__msg_name_head_encode(out, cap, e->name, e->name_len, TS_MSG_LIST_ENTRY_MIN - 1, &p);
    if (rc != 0)
        return rc;
    ts__put_u32le(p, e->n_items);
    ts__put_u64le(p + 4, e->bytes);
    ts__put_u64le(p + 12, e->version);
    *len = ts__msg_list_entry_size(e->name_len);
    return 0;
}

/* Read one entry; the reader's error says whether it was there. */
static void list_entry(ts__rd *r, ts__msg_list_entry *e)
{
    const char *name = NULL;
    e->name_len = 0;
    ts__rd_name(r, &name, &e->name_len);
    e->name = (const uint8_t *)name;
    e->n_items = 0;
    e->bytes = 0;
    e->version = 0;
    ts__rd_u32(r, &e->n_items);
    ts__rd_u64(r, &e->bytes);
    ts__rd_u64(r, &e->version);
}

int ts__msg_list_decode(const uint8_t *body, size_t len, ts__msg_list *m)
{
    ts__rd r;
    uint32_t n = 0, rsvd = 0;
    ts__rd_init(&r, body, len);
    ts__rd_u32(&r, &n);
    ts__rd_u32(&r, &rsvd);
    if (r.err != 0 || rsvd != 0)
        return TS_EPROTO;
    /* Every entry takes at least TS_MSG_LIST_ENTRY_MIN bytes: a huge n fails before the walk. */
    if ((uint64_t)n * TS_MSG_LIST_ENTRY_MIN > r.left)
        return TS_EPROTO;
    const uint8_t *entries = r.p;
    size_t entries_len = r.left;
    for (uint32_t i = 0; i < n && r.err == 0; i++) {
        ts__msg_list_entry e;
        list_entry(&r, &e);
    }
    if (ts__msg_rd_end(&r) != 0)
        return TS_EPROTO;
    m->n = n;
    m->entries = entries;
    m->entries_len = entries_len;
    return 0;
}

int ts__msg_list_next(const ts__msg_list *m, ts__msg_list_iter *it, ts__msg_list_entry *e)
{
    if (it->i >= m->n)
        return 0;
    ts__rd r;
    ts__rd_init(&r, m->entries + it->off, m->entries_len - it->off);
    list_entry(&r, e);
    assert(r.err == 0); /* ts__msg_list_decode walked the same entries */
    it->off = m->entries_len - r.left;
    it->i++;
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * Records, NOTIFY, errors
 */

int ts__msg_record_decode(const uint8_t *body, size_t len)
{
    (void)body;
    return len >= TS_REC_HDR_SIZE ? 0 : TS_EPROTO;
}

size_t ts__msg_notify_size(size_t name_len)
{
    return TS_NOTIFY_FIXED + name_len;
}

int ts__msg_notify_encode(uint8_t *out, size_t cap, const ts__msg_notify *m, size_t *len)
{
    size_t need = ts__msg_notify_size(m->name_len);
    int rc = room(need, cap, m->name_len);
    if (rc != 0)
        return rc;
    ts__put_u64le(out, m->version);
    ts__put_u32le(out + 8, m->n_items);
    out[12] = m->event;
    out[13] = m->flags;
    ts__msg_put_name(out + 14, m->name, m->name_len);
    *len = need;
    return 0;
}

int ts__msg_notify_decode(const uint8_t *body, size_t len, ts__msg_notify *m)
{
    ts__rd r;
    uint64_t version = 0;
    uint32_t n = 0;
    uint8_t event = 0, flags = 0;
    const char *name = NULL;
    size_t name_len = 0;
    ts__rd_init(&r, body, len);
    ts__rd_u64(&r, &version);
    ts__rd_u32(&r, &n);
    ts__rd_u8(&r, &event);
    ts__rd_u8(&r, &flags);
    ts__rd_name(&r, &name, &name_len);
    if (ts__msg_rd_end(&r) != 0)
        return TS_EPROTO;
    m->version = version;
    m->n_items = n;
    m->event = event;
    m->flags = flags;
    m->name = (const uint8_t *)name;
    m->name_len = name_len;
    return 0;
}

int ts__msg_error_encode(uint8_t *out, size_t cap, const char *msg, size_t msg_len, size_t *len)
{
    if (msg_len > TS_MAX_ERRMSG)
        return TS_EINVAL;
    if (msg_len > cap)
        return TS_EMSGSIZE;
    if (msg_len > 0)
        memcpy(out, msg, msg_len);
    *len = msg_len;
    return 0;
}

size_t ts__msg_error_vformat(char out[TS_MAX_ERRMSG], const char *fmt, va_list ap)
{
    int n = vsnprintf(out, TS_MAX_ERRMSG, fmt, ap);
    if (n < 0)
        return 0;
    return (size_t)n >= TS_MAX_ERRMSG ? TS_MAX_ERRMSG - 1 : (size_t)n;
}

int ts__msg_error_decode(const uint8_t *body, size_t len, ts__msg_error *m)
{
    if (len > TS_MAX_ERRMSG)
        return TS_EPROTO;
    m->msg = (const char *)body;
    m->len = len;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * By kind
 */

static int decode_kind(ts__msg_kind kind, const uint8_t *body, size_t len, ts__msg *m)
{
    ts__msg d;
    memset(&d, 0, sizeof(d));
    d.kind = kind;
    int rc;
    switch (kind) {
    case TS_MSG_EMPTY:
        rc = ts__msg_empty_decode(body, len);
        break;
    case TS_MSG_HELLO_REQ:
        rc = ts__msg_hello_req_decode(body, len, &d.u.hello_req);
        break;
    case TS_MSG_HELLO_REP:
        rc = ts__msg_hello_rep_decode(body, len, &d.u.hello_rep);
        break;
    case TS_MSG_AUTH_NONCE:
        rc = ts__msg_auth_nonce_decode(body, len, &d.u.auth_nonce);
        break;
    case TS_MSG_NAME_REQ:
        rc = ts__msg_name_req_decode(body, len, &d.u.name_req);
        break;
    case TS_MSG_GET_REQ:
        rc = ts__msg_get_req_decode(body, len, &d.u.name_req);
        break;
    case TS_MSG_WAIT_REQ:
        rc = ts__msg_wait_req_decode(body, len, &d.u.name_req);
        break;
    case TS_MSG_ADD_REQ:
        rc = ts__msg_add_req_decode(body, len, &d.u.coord);
        break;
    case TS_MSG_TAKE_REQ:
        rc = ts__msg_take_req_decode(body, len, &d.u.coord);
        break;
    case TS_MSG_BARRIER_REQ:
        rc = ts__msg_barrier_req_decode(body, len, &d.u.coord);
        break;
    case TS_MSG_ADD_STATE:
        rc = ts__msg_add_state_decode(body, len, &d.u.add_state);
        break;
    case TS_MSG_BARRIER_STATE:
        rc = ts__msg_barrier_state_decode(body, len, &d.u.barrier_state);
        break;
    case TS_MSG_PS_CREATE_REQ:
        rc = ts__msg_ps_create_req_decode(body, len, &d.u.ps_create);
        break;
    case TS_MSG_EMB_CREATE_REQ:
        rc = ts__msg_emb_create_req_decode(body, len, &d.u.ps_create);
        break;
    case TS_MSG_PS_PULL_REQ:
        rc = ts__msg_ps_pull_req_decode(body, len, &d.u.ps_pull);
        break;
    case TS_MSG_MGET_REQ:
        rc = ts__msg_mget_req_decode(body, len, &d.u.mget_req);
        break;
    case TS_MSG_MGET_REP:
        rc = ts__msg_mget_rep_decode(body, len, &d.u.mget_rep);
        break;
    case TS_MSG_PUT_REQ:
        rc = ts__msg_put_decode(body, len, &d.u.put);
        break;
    case TS_MSG_BIN_STATE:
        rc = ts__msg_bin_state_decode(body, len, &d.u.state);
        break;
    case TS_MSG_ITEMS:
        rc = ts__msg_items_decode(body, len, &d.u.items);
        break;
    case TS_MSG_LIST_REP:
        rc = ts__msg_list_decode(body, len, &d.u.list);
        break;
    case TS_MSG_RECORD:
        rc = ts__msg_record_decode(body, len);
        break;
    case TS_MSG_NOTIFY:
        rc = ts__msg_notify_decode(body, len, &d.u.notify);
        break;
    case TS_MSG_ERROR:
        rc = ts__msg_error_decode(body, len, &d.u.error);
        break;
    case TS_MSG_REF_ITEMS:
        rc = ts__msg_ref_decode(body, len, &d.u.ref_items);
        break;
    case TS_MSG_PUT_FD_REQ:
        rc = ts__msg_put_fd_req_decode(body, len, &d.u.put_fd);
        break;
    case TS_MSG_TENSOR_BIN_REQ:
        rc = ts__msg_tensor_bin_req_decode(body, len, &d.u.tensor_bin);
        break;
    case TS_MSG_READ_ROWS_REQ:
        rc = ts__msg_read_rows_req_decode(body, len, &d.u.read_rows);
        break;
    case TS_MSG_STREAM_CREATE_REQ:
        rc = ts__msg_stream_create_req_decode(body, len, &d.u.stream_create);
        break;
    case TS_MSG_STREAM_MARK_REQ:
        rc = ts__msg_stream_mark_req_decode(body, len, &d.u.stream_mark);
        break;
    case TS_MSG_STREAM_CREDIT_REQ:
        rc = ts__msg_stream_credit_req_decode(body, len, &d.u.stream_credit);
        break;
    case TS_MSG_STREAM_JOIN_REQ:
        rc = ts__msg_stream_join_req_decode(body, len, &d.u.stream_member);
        break;
    case TS_MSG_STREAM_READ_REQ:
        rc = ts__msg_stream_read_req_decode(body, len, &d.u.stream_member);
        break;
    case TS_MSG_STREAM_ACK_REQ:
        rc = ts__msg_stream_ack_req_decode(body, len, &d.u.stream_member);
        break;
    case TS_MSG_STREAM_LEAVE_REQ:
        rc = ts__msg_stream_leave_req_decode(body, len, &d.u.stream_member);
        break;
    case TS_MSG_STREAM_RANGE_REQ:
        rc = ts__msg_stream_range_req_decode(body, len, &d.u.stream_range);
        break;
    case TS_MSG_STREAM_STATE:
        rc = ts__msg_stream_state_decode(body, len, &d.u.stream_state);
        break;
    case TS_MSG_STREAM_APPEND_STATE:
        rc = ts__msg_stream_append_state_decode(body, len, &d.u.stream_append);
        break;
    case TS_MSG_STREAM_JOIN_STATE:
        rc = ts__msg_stream_join_state_decode(body, len, &d.u.stream_join);
        break;
    case TS_MSG_STREAM_ACK_STATE:
        rc = ts__msg_stream_ack_state_decode(body, len, &d.u.stream_ack);
        break;
    case TS_MSG_STREAM_ENTRIES:
        rc = ts__msg_stream_entries_decode(body, len, &d.u.stream_entries);
        break;
    case TS_MSG_TABLE_CREATE_REQ:
        rc = ts__msg_table_create_req_decode(body, len, &d.u.table_create);
        break;
    case TS_MSG_TABLE_SAMPLE_REQ:
        rc = ts__msg_table_sample_req_decode(body, len, &d.u.table_sample);
        break;
    case TS_MSG_TABLE_UPDATE_REQ:
        rc = ts__msg_table_update_req_decode(body, len, &d.u.table_keys);
        break;
    case TS_MSG_TABLE_REMOVE_REQ:
        rc = ts__msg_table_remove_req_decode(body, len, &d.u.table_keys);
        break;
    case TS_MSG_TABLE_STATE:
        rc = ts__msg_table_state_decode(body, len, &d.u.table_state);
        break;
    case TS_MSG_TABLE_SAMPLES:
        rc = ts__msg_table_samples_decode(body, len, &d.u.table_samples);
        break;
    case TS_MSG_SHARD_MAP:
        rc = ts__msg_shard_map_decode(body, len, &d.u.shard_map);
        break;
    case TS_MSG_WRONG_SHARD:
        rc = ts__msg_wrong_shard_decode(body, len, &d.u.wrong_shard);
        break;
    case TS_MSG_SVC_REGISTER_REQ:
        rc = ts__msg_svc_register_req_decode(body, len, &d.u.svc_register);
        break;
    case TS_MSG_SVC_STATE:
        rc = ts__msg_svc_state_decode(body, len, &d.u.svc_state);
        break;
    case TS_MSG_SVC_REQUEST:
        rc = ts__msg_svc_push_decode(body, len, &d.u.svc_push);
        break;
    case TS_MSG_NONE:
    default:
        return TS_EUNKNOWNOP;
    }
    if (rc != 0)
        return rc;
    *m = d;
    return 0;
}

int ts__msg_request_decode(uint8_t op, const uint8_t *body, size_t len, ts__msg *m)
{
    const ts__msg_op *info = ts__msg_op_info(op);
    if (info == NULL)
        return TS_EUNKNOWNOP;
    if (info->request == TS_MSG_PUT_REQ && info->upload_fixed > 0) {
        /* An upload with fixed fields: the opcode, not only the kind, says how many. */
        ts__msg d;
        memset(&d, 0, sizeof(d));
        d.kind = TS_MSG_PUT_REQ;
        int rc = ts__msg_upload_decode(body, len, info->upload_fixed, &d.u.put);
        if (rc != 0)
            return rc;
        *m = d;
        return 0;
    }
    return decode_kind((ts__msg_kind)info->request, body, len, m);
}

int ts__msg_reply_decode(uint8_t op, uint16_t status, const uint8_t *body, size_t len, ts__msg *m)
{
    return decode_kind(ts__msg_reply_kind(op, status), body, len, m);
}

/* Re-encode a decoded ITEMS body from the records it points to. */
static int items_encode_again(const ts__msg_items *it, uint8_t *out, size_t cap, size_t *len)
{
    size_t off;
    int rc =
        ts__msg_items_head_encode(out, cap, it->version, it->n_items, it->remaining, NULL, &off);
    if (rc != 0)
        return rc;
    ts__msg_items_iter iter;
    size_t roff, rlen;
    ts__msg_items_iter_init(it, &iter);
    for (uint32_t i = 0; ts__msg_items_next(it, &iter, &roff, &rlen); i++) {
        if (ts__msg_put_padded(out, cap, &off, it->body + roff, rlen) != 0)
            return TS_EMSGSIZE;
        ts__msg_items_set_len(out, i, rlen);
    }
    *len = off;
    return 0;
}

/* Re-encode a decoded LIST body entry by entry. */
static int list_encode_again(const ts__msg_list *l, uint8_t *out, size_t cap, size_t *len)
{
    size_t off;
    int rc = ts__msg_list_head_encode(out, cap, l->n, &off);
    ts__msg_list_iter it = {0, 0};
    ts__msg_list_entry e;
    while (rc == 0 && ts__msg_list_next(l, &it, &e)) {
        size_t n;
        rc = ts__msg_list_entry_encode(out + off, cap - off, &e, &n);
        off += rc == 0 ? n : 0;
    }
    if (rc == 0)
        *len = off;
    return rc;
}

/* Re-encode a decoded REF_ITEMS body from its entries and the inline records it points to. */
static int ref_encode_again(const ts__msg_ref_items *r, uint8_t *out, size_t cap, size_t *len)
{
    ts__msg_ref_entry e[TS_MAX_REF_ITEMS];
    const uint8_t *recs[TS_MAX_REF_ITEMS];
    for (uint32_t i = 0; i < r->n_items; i++) {
        ts__msg_ref_entry_get(r, i, &e[i]);
        recs[i] = e[i].where == TS_REF_INLINE ? r->body + e[i].offset : NULL;
    }
    return ts__msg_ref_encode(out, cap, r->version, r->remaining, r->n_items, e, recs, len);
}

/* Re-encode a decoded ENTRIES body from its entry heads and the records it points to. */
static int entries_encode_again(const ts__msg_stream_entries *s, uint8_t *out, size_t cap,
                                size_t *len)
{
    size_t off;
    int rc = ts__msg_stream_entries_head_encode(out, cap, s->first_id, s->last_id, s->lost, s->n,
                                                NULL, &off);
    if (rc != 0)
        return rc;
    ts__msg_stream_entries_iter it;
    ts__msg_stream_entry e;
    ts__msg_stream_entries_iter_init(s, &it);
    for (uint32_t i = 0; ts__msg_stream_entries_next(s, &it, &e); i++) {
        if (ts__msg_put_padded(out, cap, &off, e.record, e.len) != 0)
            return TS_EMSGSIZE;
        ts__msg_stream_entries_set(out, i, &e);
    }
    *len = off;
    return 0;
}

/* Re-encode a decoded TABLE_UPDATE or TABLE_REMOVE body (its entries are copied as they are). */
static int keys_encode_again(const ts__msg_table_keys_req *k, uint8_t *out, size_t cap, size_t *len)
{
    uint64_t none = 0;
    double nonep = 0.0;
    int rc = ts__msg_table_keys_req_encode(out, cap, k->name, k->name_len, 0, &none,
                                           k->with_priority ? &nonep : NULL, len);
    size_t each = k->with_priority ? 16u : 8u;
    if (rc != 0)
        return rc;
    if ((size_t)k->n * each > cap - *len)
        return TS_EMSGSIZE;
    ts__put_u32le(out + 1 + k->name_len, k->n);
    if (k->n > 0)
        memcpy(out + *len, k->pairs, (size_t)k->n * each);
    *len += (size_t)k->n * each;
    return 0;
}

/* Re-encode a decoded SAMPLES body from its heads and the records it points to. */
static int samples_encode_again(const ts__msg_table_samples *s, uint8_t *out, size_t cap,
                                size_t *len)
{
    size_t off;
    int rc = ts__msg_table_samples_head_encode(out, cap, s->size, s->n, NULL, &off);
    for (uint32_t i = 0; rc == 0 && i < s->n; i++) {
        ts__msg_table_sample e;
        ts__msg_table_sample_get(s, i, &e);
        if (ts__msg_put_padded(out, cap, &off, e.record, e.len) != 0)
            return TS_EMSGSIZE;
        ts__msg_table_samples_set(out, i, &e);
    }
    if (rc == 0)
        *len = off;
    return rc;
}

/* Re-encode a decoded MGET request from its names. */
static int mget_req_encode_again(const ts__msg_mget_req *q, uint8_t *out, size_t cap, size_t *len)
{
    const uint8_t *names[TS_MGET_MAX_NAMES];
    size_t lens[TS_MGET_MAX_NAMES];
    size_t off = 0;
    uint32_t i = 0;
    while (i < q->n && ts__msg_mget_req_next(q, &off, &names[i], &lens[i]))
        i++;
    return ts__msg_mget_req_encode(out, cap, q->n, q->max_items, names, lens, len);
}

/* Re-encode a decoded MGET reply: its head, then each found bin's ITEMS block again. */
static int mget_rep_encode_again(const ts__msg_mget_rep *r, uint8_t *out, size_t cap, size_t *len)
{
    uint8_t found[TS_MGET_MAX_NAMES];
    uint64_t blens[TS_MGET_MAX_NAMES];
    ts__msg_items items[TS_MGET_MAX_NAMES];
    for (uint32_t i = 0; i < r->n; i++) {
        int f;
        ts__msg_mget_rep_get(r, i, &f, &items[i]);
        found[i] = f ? TS_MGET_FOUND : TS_MGET_MISSING;
        blens[i] = f ? items[i].len : 0;
    }
    size_t off;
    int rc = ts__msg_mget_head_encode(out, cap, r->n, found, blens, &off);
    for (uint32_t i = 0; rc == 0 && i < r->n; i++) {
        if (!found[i])
            continue;
        size_t n;
        rc = items_encode_again(&items[i], out + off, cap - off, &n);
        off += rc == 0 ? n : 0;
    }
    if (rc == 0)
        *len = off;
    return rc;
}

int ts__msg_encode(const ts__msg *m, uint8_t *out, size_t cap, size_t *len)
{
    switch (m->kind) {
    case TS_MSG_EMPTY:
    case TS_MSG_RECORD:
        *len = 0;
        return 0;
    case TS_MSG_HELLO_REQ:
        return ts__msg_hello_req_encode(out, cap, &m->u.hello_req, len);
    case TS_MSG_HELLO_REP:
        return ts__msg_hello_rep_encode(out, cap, &m->u.hello_rep, len);
    case TS_MSG_AUTH_NONCE:
        if (cap < TS_MSG_AUTH_NONCE_SIZE)
            return TS_EMSGSIZE;
        memcpy(out, m->u.auth_nonce.nonce, TS_MSG_AUTH_NONCE_SIZE);
        *len = TS_MSG_AUTH_NONCE_SIZE;
        return 0;
    case TS_MSG_NAME_REQ:
        return ts__msg_name_req_encode(out, cap, &m->u.name_req, len);
    case TS_MSG_GET_REQ:
        return ts__msg_get_req_encode(out, cap, &m->u.name_req, len);
    case TS_MSG_WAIT_REQ:
        return ts__msg_wait_req_encode(out, cap, &m->u.name_req, len);
    case TS_MSG_ADD_REQ:
        return ts__msg_add_req_encode(out, cap, &m->u.coord, len);
    case TS_MSG_TAKE_REQ:
        return ts__msg_take_req_encode(out, cap, &m->u.coord, len);
    case TS_MSG_BARRIER_REQ:
        return ts__msg_barrier_req_encode(out, cap, &m->u.coord, len);
    case TS_MSG_ADD_STATE:
        return ts__msg_add_state_encode(out, cap, &m->u.add_state, len);
    case TS_MSG_BARRIER_STATE:
        return ts__msg_barrier_state_encode(out, cap, &m->u.barrier_state, len);
    case TS_MSG_PS_CREATE_REQ:
        return ts__msg_ps_create_req_encode(out, cap, &m->u.ps_create, len);
    case TS_MSG_EMB_CREATE_REQ:
        return ts__msg_emb_create_req_encode(out, cap, &m->u.ps_create, len);
    case TS_MSG_PS_PULL_REQ:
        return ts__msg_ps_pull_req_encode(out, cap, &m->u.ps_pull, len);
    case TS_MSG_MGET_REQ:
        return mget_req_encode_again(&m->u.mget_req, out, cap, len);
    case TS_MSG_MGET_REP:
        return mget_rep_encode_again(&m->u.mget_rep, out, cap, len);
    case TS_MSG_PUT_REQ:
        return ts__msg_upload_encode(out, cap, m->u.put.name, m->u.put.name_len, m->u.put.fixed,
                                     m->u.put.fixed_len, m->u.put.record, (size_t)m->u.put.rec_len,
                                     len);
    case TS_MSG_BIN_STATE:
        return ts__msg_bin_state_encode(out, cap, m->u.state.version, m->u.state.n_items, len);
    case TS_MSG_ITEMS:
        return items_encode_again(&m->u.items, out, cap, len);
    case TS_MSG_LIST_REP:
        return list_encode_again(&m->u.list, out, cap, len);
    case TS_MSG_NOTIFY:
        return ts__msg_notify_encode(out, cap, &m->u.notify, len);
    case TS_MSG_ERROR:
        return ts__msg_error_encode(out, cap, m->u.error.msg, m->u.error.len, len);
    case TS_MSG_REF_ITEMS:
        return ref_encode_again(&m->u.ref_items, out, cap, len);
    case TS_MSG_PUT_FD_REQ:
        return ts__msg_put_fd_req_encode(out, cap, &m->u.put_fd, len);
    case TS_MSG_TENSOR_BIN_REQ:
        return ts__msg_tensor_bin_req_encode(out, cap, &m->u.tensor_bin, len);
    case TS_MSG_READ_ROWS_REQ:
        return ts__msg_read_rows_req_encode(out, cap, &m->u.read_rows, len);
    case TS_MSG_STREAM_CREATE_REQ:
        return ts__msg_stream_create_req_encode(out, cap, &m->u.stream_create, len);
    case TS_MSG_STREAM_MARK_REQ:
        return ts__msg_stream_mark_req_encode(out, cap, &m->u.stream_mark, len);
    case TS_MSG_STREAM_CREDIT_REQ:
        return ts__msg_stream_credit_req_encode(out, cap, &m->u.stream_credit, len);
    case TS_MSG_STREAM_JOIN_REQ:
        return ts__msg_stream_join_req_encode(out, cap, &m->u.stream_member, len);
    case TS_MSG_STREAM_READ_REQ:
        return ts__msg_stream_read_req_encode(out, cap, &m->u.stream_member, len);
    case TS_MSG_STREAM_ACK_REQ:
        return ts__msg_stream_ack_req_encode(out, cap, &m->u.stream_member, len);
    case TS_MSG_STREAM_LEAVE_REQ:
        return ts__msg_stream_leave_req_encode(out, cap, &m->u.stream_member, len);
    case TS_MSG_STREAM_RANGE_REQ:
        return ts__msg_stream_range_req_encode(out, cap, &m->u.stream_range, len);
    case TS_MSG_STREAM_STATE:
        return ts__msg_stream_state_encode(out, cap, &m->u.stream_state, len);
    case TS_MSG_STREAM_APPEND_STATE:
        return ts__msg_stream_append_state_encode(out, cap, &m->u.stream_append, len);
    case TS_MSG_STREAM_JOIN_STATE:
        return ts__msg_stream_join_state_encode(out, cap, &m->u.stream_join, len);
    case TS_MSG_STREAM_ACK_STATE:
        return ts__msg_stream_ack_state_encode(out, cap, &m->u.stream_ack, len);
    case TS_MSG_STREAM_ENTRIES:
        return entries_encode_again(&m->u.stream_entries, out, cap, len);
    case TS_MSG_TABLE_CREATE_REQ:
        return ts__msg_table_create_req_encode(out, cap, &m->u.table_create, len);
    case TS_MSG_TABLE_SAMPLE_REQ:
        return ts__msg_table_sample_req_encode(out, cap, &m->u.table_sample, len);
    case TS_MSG_TABLE_UPDATE_REQ:
    case TS_MSG_TABLE_REMOVE_REQ:
        return keys_encode_again(&m->u.table_keys, out, cap, len);
    case TS_MSG_TABLE_STATE:
        return ts__msg_table_state_encode(out, cap, &m->u.table_state, len);
    case TS_MSG_TABLE_SAMPLES:
        return samples_encode_again(&m->u.table_samples, out, cap, len);
    case TS_MSG_SHARD_MAP:
        return ts__msg_shard_map_encode_again(&m->u.shard_map, out, cap, len);
    case TS_MSG_WRONG_SHARD:
        return ts__msg_wrong_shard_encode(out, cap, &m->u.wrong_shard, len);
    case TS_MSG_SVC_REGISTER_REQ:
        return ts__msg_svc_register_req_encode(out, cap, &m->u.svc_register, len);
    case TS_MSG_SVC_STATE:
        return ts__msg_svc_state_encode(out, cap, &m->u.svc_state, len);
    case TS_MSG_SVC_REQUEST: {
        const ts__msg_svc_push *q = &m->u.svc_push;
        size_t off;
        int rc = ts__msg_svc_push_head_encode(out, cap, q, &off);
        if (rc == 0)
            rc = ts__msg_put_padded(out, cap, &off, q->record, q->rec_len);
        if (rc == 0)
            *len = off;
        return rc;
    }
    case TS_MSG_NONE:
    default:
        return TS_EINVAL;
    }
}
