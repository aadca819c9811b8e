/*
 * The message codec: one encoder and one strict decoder for every frame body of
 * docs/PROTOCOL.md (sections 4, 5, 8 and 12), and one table of what each opcode carries. Pure
 * functions over byte buffers: nothing here touches a socket, and nothing allocates.
 *
 * Every body layout of the protocol is written down here and nowhere else. Encoders write field
 * by field, little-endian (common.h), into a buffer the caller gives with its capacity; the
 * matching ts__msg_*_size function says how much room they need. Decoders take the body bytes
 * and fill a small struct whose pointers point into those bytes (so the body must outlive it).
 * Every decoder is strict: each length is checked against the body before it is used (in 64-bit
 * arithmetic that cannot overflow), reserved fields must be 0, zero padding must be zero, and the
 * body must end exactly after its last field. A decoder returns 0, or TS_EPROTO for a body that
 * breaks its layout (TS_EAGAIN only where a streaming head asks for more bytes), and sets its
 * output only on success. Encoders return 0, TS_ENAMETOOLONG for a name over TS_MAX_NAME_LEN
 * bytes, TS_EMSGSIZE when the buffer is too small (nothing is written then), or TS_EINVAL for
 * an argument no body can carry.
 *
 * Thread: none of these keep state; any thread may call them.
 *
 * Who uses it: tensord parses every request body and writes every reply and notification body
 * through it (server/conn.c, ops.c, output.c, notify.c), and its request header check is
 * ts__msg_request_check; the client builds every request body (client/send.c ts__req_body,
 * client/conn.c for HELLO) and parses every reply body (client/reply.c, recv.c) through it, with
 * the per-opcode reply bounds of ts__msg_reply_limit. The fuzz targets (fuzz_msg, fuzz_frame,
 * fuzz_reply, fuzz_client_read), the corpus generator and test_msg call the same functions.
 * tests/unit/core/test_proto.c builds the section 15 examples field by field on purpose (it
 * labels each field for the dump): an independent check of the same dumps.
 */
#ifndef TS_MSG_H
#define TS_MSG_H

#include <stdarg.h>

#include "proto.h"

/* ---------------------------------------------------------------------------------------------
 * Sizes and limits of the bodies (bytes)
 */
#define TS_MSG_HELLO_REQ_FIXED 4  /* u8 max_version, u8 flags, u16 token_len */
#define TS_MSG_HELLO_REP_SIZE  24 /* the HELLO reply, section 4 */
#define TS_MSG_GET_REQ_FIXED   4  /* the u32 max_items after the name */
#define TS_MSG_WAIT_REQ_FIXED  12 /* u64 after_version, u32 timeout_ms after the name */
#define TS_MSG_ITEMS_FIXED     16 /* u64 version, u32 n_items, u32 remaining */
#define TS_MSG_LIST_FIXED      8  /* u32 n, u32 reserved */
#define TS_MSG_LIST_ENTRY_MIN  21 /* an entry with an empty name: u8, u32, u64, u64 */
/*
 * Bytes; the body limit of every request but PUT and APPEND (a name and a few integers fit with
 * room to spare), fixed by section 12 so that control frames live in a small input buffer.
 */
#define TS_MAX_CTRL_BODY 4096
/* The largest HELLO token: the whole pre-HELLO body limit less the fixed fields. */
#define TS_MAX_TOKEN_LEN (TS_MAX_PREAUTH_BODY - TS_MSG_HELLO_REQ_FIXED)
/* The token proof (section 4, 0.5.0): AUTH_CHALLENGE's nonces and HMAC-SHA256 tags. */
#define TS_MSG_AUTH_NONCE_SIZE  32 /* bytes; AUTH_CHALLENGE's body, both ways */
#define TS_MSG_TOKEN_PROOF_SIZE 32 /* bytes; HELLO's proof, and the server's after the reply */

/* ---------------------------------------------------------------------------------------------
 * The opcode table
 */

/* The shapes a body can have; each has one encoder and one decoder below. */
typedef enum ts__msg_kind {
    TS_MSG_NONE = 0,       /* no such frame (an unknown opcode, or a reply to NOTIFY) */
    TS_MSG_EMPTY,          /* no bytes at all */
    TS_MSG_HELLO_REQ,      /* max_version, flags, token */
    TS_MSG_HELLO_REP,      /* version, flags, max_body, server_id [, server proof] */
    TS_MSG_AUTH_NONCE,     /* AUTH_CHALLENGE: a 32-byte nonce, both ways (0.5.0) */
    TS_MSG_NAME_REQ,       /* name (DELETE, LISTEN, UNLISTEN) */
    TS_MSG_GET_REQ,        /* name, u32 max_items (GET, PEEK) */
    TS_MSG_WAIT_REQ,       /* name, u64 after_version, u32 timeout_ms */
    TS_MSG_PUT_REQ,        /* name, then a record to the end of the body (PUT, APPEND) */
    TS_MSG_BIN_STATE,      /* u64 version, u32 n_items, u32 reserved */
    TS_MSG_ITEMS,          /* the ITEMS reply of GET and PEEK */
    TS_MSG_LIST_REP,       /* the LIST reply */
    TS_MSG_RECORD,         /* one record filling the body (the STATS reply) */
    TS_MSG_NOTIFY,         /* the NOTIFY body */
    TS_MSG_ERROR,          /* an error message of at most TS_MAX_ERRMSG bytes */
    TS_MSG_REF_ITEMS,      /* the reply of GET_REF and PEEK_REF (msg_ref.c) */
    TS_MSG_PUT_FD_REQ,     /* name, u64 record_len (PUT_FD, APPEND_FD; one descriptor attached) */
    TS_MSG_TENSOR_BIN_REQ, /* name, dtype, ndim, dims (TENSOR_BIN; msg_rows.c) */
    TS_MSG_READ_ROWS_REQ,  /* name, item, key, start, end (READ_ROWS; msg_rows.c) */
    /* Streams (msg_stream.c). STREAM_APPEND is a TS_MSG_PUT_REQ, STREAM_INFO a TS_MSG_NAME_REQ. */
    TS_MSG_STREAM_CREATE_REQ,   /* name, max_entries, max_bytes, max_age_ms, window, lease, flags */
    TS_MSG_STREAM_MARK_REQ,     /* name, u64 tag */
    TS_MSG_STREAM_CREDIT_REQ,   /* name, u32 timeout_ms */
    TS_MSG_STREAM_JOIN_REQ,     /* name, group, member, start, lease_ms */
    TS_MSG_STREAM_READ_REQ,     /* name, group, member, ack_through, max_entries, timeout_ms */
    TS_MSG_STREAM_ACK_REQ,      /* name, group, member, first, last, rows */
    TS_MSG_STREAM_LEAVE_REQ,    /* name, group, member (empty: the whole group) */
    TS_MSG_STREAM_RANGE_REQ,    /* name, after_id, max_entries, timeout_ms */
    TS_MSG_STREAM_STATE,        /* STREAM STATE, 48 bytes */
    TS_MSG_STREAM_APPEND_STATE, /* APPEND STATE, 24 bytes (STREAM_APPEND, STREAM_MARK) */
    TS_MSG_STREAM_JOIN_STATE,   /* JOIN STATE, 40 bytes */
    TS_MSG_STREAM_ACK_STATE,    /* ACK STATE, 24 bytes */
    TS_MSG_STREAM_ENTRIES,      /* ENTRIES (STREAM_READ, STREAM_RANGE) */
    /* Coordination (msg_coord.c). PUT_IF is a TS_MSG_PUT_REQ with upload_fixed 8. */
    TS_MSG_ADD_REQ,       /* name, i64 delta */
    TS_MSG_ADD_STATE,     /* ADD STATE, 16 bytes */
    TS_MSG_TAKE_REQ,      /* name, u32 max_items, u32 timeout_ms */
    TS_MSG_MGET_REQ,      /* u32 n, u32 max_items, n names */
    TS_MSG_MGET_REP,      /* the MGET reply */
    TS_MSG_BARRIER_REQ,   /* name, u32 parties, u32 timeout_ms */
    TS_MSG_BARRIER_STATE, /* BARRIER STATE, 16 bytes */
    /* Parameter server (msg_ps.c). PS_PUSH, EMB_PULL and EMB_PUSH are uploads. */
    TS_MSG_PS_CREATE_REQ,  /* name, 48 fixed bytes */
    TS_MSG_PS_PULL_REQ,    /* name, u64 if_newer_than */
    TS_MSG_EMB_CREATE_REQ, /* name, 64 fixed bytes */
    /* Replay tables (msg_table.c). TABLE_INSERT is an upload, TABLE_INFO a TS_MSG_NAME_REQ. */
    TS_MSG_TABLE_CREATE_REQ, /* name, capacity, rate limiter, sampler, remover... */
    TS_MSG_TABLE_SAMPLE_REQ, /* name, u32 n, u32 timeout_ms */
    TS_MSG_TABLE_UPDATE_REQ, /* name, n x (u64 key, f64 priority) */
    TS_MSG_TABLE_REMOVE_REQ, /* name, n x u64 key */
    TS_MSG_TABLE_STATE,      /* TABLE STATE, 40 bytes */
    TS_MSG_TABLE_SAMPLES,    /* SAMPLES (TABLE_SAMPLE) */
    /* Sharding (msg_shard.c). */
    TS_MSG_SHARD_MAP,   /* the SHARD_MAP reply */
    TS_MSG_WRONG_SHARD, /* the body of status WRONG_SHARD (slot, owner, address, message) */
    /* Services (msg_svc.c). SVC_CALL and SVC_REPLY are uploads; a CALL's answer is ITEMS. */
    TS_MSG_SVC_REGISTER_REQ, /* name, u32 concurrency, u32 flags */
    TS_MSG_SVC_STATE,        /* SERVICE STATE, 16 bytes */
    TS_MSG_SVC_REQUEST       /* the SVC_REQUEST push: head, then the request's record */
} ts__msg_kind;

/* What one opcode carries (section 8's table). */
typedef struct ts__msg_op {
    uint8_t op;
    uint8_t request; /* ts__msg_kind of the request body (TS_MSG_NONE for NOTIFY) */
    uint8_t reply;   /* ts__msg_kind of a reply with status OK (or of NOTIFY itself) */
    /*
     * 1 when the body is an upload whose size is bounded by max_body (PUT, APPEND, GATHER_ROWS,
     * WRITE_ROWS, STREAM_APPEND).
     */
    uint8_t upload;
    /* 1 when a successful request changes the store (GET, PUT, APPEND, DELETE). */
    uint8_t changes;
    /*
     * Uploads only: the bytes of fixed fields between the name and the record (0 for PUT,
     * APPEND and the other "name, then record" bodies; at most TS_MSG_MAX_UPLOAD_FIXED). The
     * server keeps them for the handler (tsd_conn cur_fixed), compressed bodies included.
     */
    uint8_t upload_fixed;
} ts__msg_op;

/*
 * bytes; the largest fixed part of an upload (ts__msg_op upload_fixed): the server keeps it in
 * each connection, and a head (u8 + name + fixed) stays well within its input buffer.
 */
#define TS_MSG_MAX_UPLOAD_FIXED 32

/* The entry of op, or NULL for an opcode the protocol does not define. */
const ts__msg_op *ts__msg_op_info(uint8_t op);

/*
 * The body kind of a reply to op with status: the opcode's OK body for TS_ST_OK (TS_MSG_NONE for
 * an opcode without one, 0 included), TS_MSG_BIN_STATE for WAIT's TIMEOUT and PUT_IF's
 * VERSION_MISMATCH, TS_MSG_WRONG_SHARD for WRONG_SHARD (opcode 0 aside), and TS_MSG_ERROR for
 * every other status (known or not) of every other opcode (known or not, 0 included: errors that
 * belong to no request). NOTIFY gives TS_MSG_NOTIFY with status 0 and TS_MSG_NONE otherwise.
 */
ts__msg_kind ts__msg_reply_kind(uint8_t op, uint16_t status);

/*
 * bytes; the largest STATS reply a client takes: a flat map of a few dozen counters is about
 * 1 KiB today, so 1 MiB leaves room for the keys to grow while a broken server cannot make a
 * client buffer more.
 */
#define TS_MSG_MAX_STATS_REPLY ((uint64_t)1 << 20)
/* bytes; the largest NOTIFY body: the fixed part and a name of TS_MAX_NAME_LEN bytes */
#define TS_MSG_MAX_NOTIFY (TS_NOTIFY_FIXED + TS_MAX_NAME_LEN)

/*
 * The largest body (bytes, after decompression) a reply to op with status may have, from the
 * kind ts__msg_reply_kind gives: the exact size of the fixed bodies (HELLO, BIN_STATE, the four
 * stream states), 0 for empty ones and for frames no reply carries, TS_MAX_ERRMSG for error
 * messages, TS_MSG_MAX_NOTIFY for NOTIFY, and large (a client's max_reply_bytes) for the bodies
 * that grow with the store (ITEMS, REF_ITEMS, LIST, ENTRIES, STREAM_INFO's record; a STATS
 * record up to TS_MSG_MAX_STATS_REPLY). A receiver
 * checks a reply's header against it before it reads or allocates the body.
 */
uint64_t ts__msg_reply_limit(uint8_t op, uint16_t status, uint64_t large);

/*
 * The largest request body (bytes, after decompression) a server accepts for op: before HELLO
 * has succeeded (helloed = 0) TS_MAX_PREAUTH_BODY for any opcode; afterwards max_frame for PUT
 * and APPEND and TS_MAX_CTRL_BODY for the other requests (never more than max_frame).
 */
uint64_t ts__msg_request_limit(uint8_t op, int helloed, uint64_t max_frame);

/* ---------------------------------------------------------------------------------------------
 * The request header check (docs/PROTOCOL.md section 5): what a server decides from a request's
 * 24 header bytes and the state of its connection, before it reads or allocates the body
 */

/* What the server knows of the connection a header arrives on. */
typedef struct ts__msg_conn_state {
    int helloed;        /* HELLO has succeeded on it */
    int lz4;            /* HELLO granted LZ4 */
    uint64_t max_frame; /* bytes; the body limit of PUT and APPEND (tensord --max-frame) */
} ts__msg_conn_state;

/*
 * The rules a request header can break, in the order they are checked: when a header breaks
 * several, the first in this order decides the status (section 5 lists the same order).
 */
typedef enum ts__msg_hdr_rule {
    TS_HDR_OK = 0,
    TS_HDR_MAGIC,        /* magic is not TS_MAGIC_REQ: BAD_REQUEST */
    TS_HDR_VERSION,      /* version is not TS_PROTO_VERSION: UNSUPPORTED_VERSION */
    TS_HDR_FLAGS,        /* a flag bit other than TS_FLAG_LZ4: BAD_REQUEST */
    TS_HDR_RESERVED,     /* a reserved field is not 0: BAD_REQUEST */
    TS_HDR_STATUS,       /* status is not 0: BAD_REQUEST */
    TS_HDR_PREAUTH_SIZE, /* before HELLO, body_len > TS_MAX_PREAUTH_BODY: TOO_LARGE */
    TS_HDR_NOT_HELLO,    /* before HELLO, not HELLO nor AUTH_CHALLENGE: BAD_REQUEST */
    TS_HDR_LZ4,          /* TS_FLAG_LZ4 although HELLO did not grant it: BAD_REQUEST */
    TS_HDR_MAX_FRAME,    /* body_len > max_frame (any opcode): TOO_LARGE */
    TS_HDR_OPCODE,       /* not a request opcode (unknown, or NOTIFY): UNKNOWN_OPCODE */
    TS_HDR_CTRL_SIZE     /* body_len > TS_MAX_CTRL_BODY, not PUT/APPEND: TOO_LARGE */
} ts__msg_hdr_rule;

/*
 * Check a request header p (TS_HDR_SIZE bytes) arriving on a connection in state st. Returns
 * TS_ST_OK and fills *h when the frame may proceed; otherwise the status to answer (the server
 * then closes the connection) and *h is untouched. *rule (may be NULL) is the rule that decided,
 * TS_HDR_OK on success. Pure: the same bytes and state always give the same answer.
 */
uint16_t ts__msg_request_check(const uint8_t *p, const ts__msg_conn_state *st, ts__hdr *h,
                               ts__msg_hdr_rule *rule);
/* The status a broken rule is answered with (TS_ST_OK for TS_HDR_OK). */
uint16_t ts__msg_hdr_rule_status(ts__msg_hdr_rule rule);

/* ---------------------------------------------------------------------------------------------
 * Bodies
 */

/*
 * Pieces every body codec shares (msg.c; the other msg_*.c files use them).
 * ts__msg_rd_end: 0 when r read its whole body without error, else TS_EPROTO.
 * ts__msg_put_name: write a name (u8 length, then its bytes) at p and return the bytes written;
 * the caller checked name_len <= 255 and the room. ts__msg_all_zero: 1 when the n bytes at p are
 * all zero (reserved fields and padding). Pure functions, any thread. Added in 0.5.0.
 */
int ts__msg_rd_end(const ts__rd *r);
size_t ts__msg_put_name(uint8_t *p, const uint8_t *name, size_t name_len);
int ts__msg_all_zero(const uint8_t *p, size_t n);
/*
 * Start a body that is a name, then fixed_len bytes of fields: TS_ENAMETOOLONG for a name over
 * TS_MAX_NAME_LEN, else TS_EMSGSIZE when the 1 + name_len + fixed_len bytes do not fit in cap
 * (nothing is written after either); else write the name and return 0 with *fields pointing
 * where the fields go, which the caller then writes in full. Pure, any thread.
 */
int ts__msg_name_head_encode(uint8_t *out, size_t cap, const uint8_t *name, size_t name_len,
                             size_t fixed_len, uint8_t **fields);
/*
 * Read a u8 length and its bytes into *s (NULL when empty) and *len; a name shorter than min_len
 * (1 for a stream group or member, which may not be empty) sets r's error. Added in 0.5.0.
 */
void ts__msg_rd_str(ts__rd *r, size_t min_len, const uint8_t **s, size_t *len);

/* Empty bodies (PING, LIST, STATS and SAVE requests; PING, UNLISTEN and SAVE replies). */
int ts__msg_empty_decode(const uint8_t *body, size_t len);

/*
 * HELLO request. Flag bits the server does not know are kept (it MUST ignore them). A token over
 * TS_MAX_TOKEN_LEN bytes is refused both ways: no such body fits the pre-HELLO limit.
 */
typedef struct ts__msg_hello_req {
    uint8_t max_version;
    uint8_t flags;
    uint16_t token_len;
    const uint8_t *token; /* borrowed from the body; NULL when token_len is 0 */
} ts__msg_hello_req;
size_t ts__msg_hello_req_size(size_t token_len);
/* TS_EINVAL for a token longer than TS_MAX_TOKEN_LEN. */
int ts__msg_hello_req_encode(uint8_t *out, size_t cap, const ts__msg_hello_req *m, size_t *len);
int ts__msg_hello_req_decode(const uint8_t *body, size_t len, ts__msg_hello_req *m);

/*
 * HELLO reply (24 bytes; both reserved fields 0). With TS_HELLO_TOKEN_PROOF in flags it is 56
 * bytes: the server's proof follows (section 4).
 */
typedef struct ts__msg_hello_rep {
    uint8_t version;
    uint8_t flags;
    uint64_t max_body;
    uint64_t server_id;
    /* TS_MSG_TOKEN_PROOF_SIZE bytes (borrowed) when flags has TS_HELLO_TOKEN_PROOF, else NULL. */
    const uint8_t *proof;
} ts__msg_hello_rep;
int ts__msg_hello_rep_encode(uint8_t *out, size_t cap, const ts__msg_hello_rep *m, size_t *len);
int ts__msg_hello_rep_decode(const uint8_t *body, size_t len, ts__msg_hello_rep *m);

/* AUTH_CHALLENGE request and reply: exactly TS_MSG_AUTH_NONCE_SIZE bytes. Added in 0.5.0. */
typedef struct ts__msg_auth_nonce {
    const uint8_t *nonce; /* borrowed from the body */
} ts__msg_auth_nonce;
int ts__msg_auth_nonce_decode(const uint8_t *body, size_t len, ts__msg_auth_nonce *m);

/*
 * The requests whose body starts with a bin name: DELETE, LISTEN, UNLISTEN (name only), GET and
 * PEEK (max_items), WAIT (after_version, timeout_ms). One struct serves all; the fields a layout
 * does not have are 0 after decoding and ignored by the encoders.
 */
typedef struct ts__msg_name_req {
    const uint8_t *name; /* borrowed; not NUL-terminated */
    size_t name_len;     /* at most TS_MAX_NAME_LEN */
    uint32_t max_items;  /* GET, PEEK: 0 = all */
    uint64_t after_version;
    uint32_t timeout_ms;
} ts__msg_name_req;
size_t ts__msg_name_req_size(size_t name_len);
int ts__msg_name_req_encode(uint8_t *out, size_t cap, const ts__msg_name_req *m, size_t *len);
int ts__msg_name_req_decode(const uint8_t *body, size_t len, ts__msg_name_req *m);
size_t ts__msg_get_req_size(size_t name_len);
int ts__msg_get_req_encode(uint8_t *out, size_t cap, const ts__msg_name_req *m, size_t *len);
int ts__msg_get_req_decode(const uint8_t *body, size_t len, ts__msg_name_req *m);
size_t ts__msg_wait_req_size(size_t name_len);
int ts__msg_wait_req_encode(uint8_t *out, size_t cap, const ts__msg_name_req *m, size_t *len);
int ts__msg_wait_req_decode(const uint8_t *body, size_t len, ts__msg_name_req *m);

/*
 * PUT and APPEND: name, then the record up to the end of the body. The record itself is checked
 * by ts__record_validate, not here (a bad record is BAD_RECORD, a bad layout BAD_REQUEST).
 */
typedef struct ts__msg_put_req {
    const uint8_t *name; /* borrowed */
    size_t name_len;
    const uint8_t *fixed;  /* borrowed; the fixed fields after the name, NULL when fixed_len 0 */
    size_t fixed_len;      /* the opcode's upload_fixed */
    size_t head_len;       /* bytes before the record: 1 + name_len + fixed_len */
    uint64_t rec_len;      /* body_len - head_len */
    const uint8_t *record; /* borrowed; NULL from ts__msg_put_head_decode */
} ts__msg_put_req;
/* The head (name) of a PUT body for name_len: 1 + name_len bytes. */
size_t ts__msg_put_head_size(size_t name_len);
/* Write the head only (the record follows it, e.g. from its own buffer with writev). */
int ts__msg_put_head_encode(uint8_t *out, size_t cap, const uint8_t *name, size_t name_len,
                            size_t *len);
/* The whole body, head and record. */
int ts__msg_put_encode(uint8_t *out, size_t cap, const uint8_t *name, size_t name_len,
                       const uint8_t *rec, size_t rec_len, size_t *len);
/*
 * Decode the head of a body of body_len bytes of which the first avail are at p, as a streaming
 * receiver has them: 0 with name, head_len and rec_len (record = NULL); TS_EAGAIN when avail does
 * not yet hold the head; TS_EPROTO when body_len cannot hold the name its first byte announces.
 */
int ts__msg_put_head_decode(const uint8_t *p, size_t avail, uint64_t body_len, ts__msg_put_req *m);
/* Decode a whole body held in memory (record points into it). */
int ts__msg_put_decode(const uint8_t *body, size_t len, ts__msg_put_req *m);

/*
 * Uploads with fixed fields (ts__msg_op upload_fixed > 0): name, then fixed_len bytes of fixed
 * fields, then the record to the end of the body. The ts__msg_put_* functions above are these
 * with fixed_len 0. fixed_len over TS_MSG_MAX_UPLOAD_FIXED is TS_EINVAL for the encoders (the
 * decoders assert it: it comes from the opcode table, not the wire). The head encoder writes
 * zeros for the fixed fields when fixed is NULL (the caller fills them in afterwards). The
 * decoders are as ts__msg_put_head_decode and ts__msg_put_decode, with the fixed fields part of
 * the head: a body too short for them is TS_EPROTO.
 */
size_t ts__msg_upload_head_size(size_t name_len, size_t fixed_len);
int ts__msg_upload_head_encode(uint8_t *out, size_t cap, const uint8_t *name, size_t name_len,
                               const uint8_t *fixed, size_t fixed_len, size_t *len);
int ts__msg_upload_encode(uint8_t *out, size_t cap, const uint8_t *name, size_t name_len,
                          const uint8_t *fixed, size_t fixed_len, const uint8_t *rec,
                          size_t rec_len, size_t *len);
int ts__msg_upload_head_decode(const uint8_t *p, size_t avail, uint64_t body_len, size_t fixed_len,
                               ts__msg_put_req *m);
int ts__msg_upload_decode(const uint8_t *body, size_t len, size_t fixed_len, ts__msg_put_req *m);

/* BIN_STATE (16 bytes: version, n_items, reserved 0). */
typedef struct ts__msg_bin_state {
    uint64_t version;
    uint32_t n_items;
} ts__msg_bin_state;
int ts__msg_bin_state_encode(uint8_t *out, size_t cap, uint64_t version, uint32_t n_items,
                             size_t *len);
int ts__msg_bin_state_decode(const uint8_t *body, size_t len, ts__msg_bin_state *m);

/*
 * ITEMS (GET and PEEK replies): version, n_items, remaining, n_items u64 lengths, zeros up to
 * ts__items_head_size(n_items), then each record followed by zeros up to a multiple of 64.
 */
typedef struct ts__msg_items {
    uint64_t version;
    uint32_t n_items;
    uint32_t remaining;
    const uint8_t *body; /* the whole body, borrowed */
    size_t len;
} ts__msg_items;
/* A walk over a decoded ITEMS body: start with ts__msg_items_iter_init. */
typedef struct ts__msg_items_iter {
    uint32_t i;
    uint64_t off; /* body offset of the next record, a multiple of 64 */
} ts__msg_items_iter;
/*
 * The body size for n items of the given lengths, in *size; TS_EMSGSIZE when it does not fit in
 * 64 bits (or, on the way, in size_t).
 */
int ts__msg_items_size(uint32_t n, const uint64_t *item_lens, uint64_t *size);
/*
 * Write the head: the fixed fields, every item length (0 when item_lens is NULL: fill them in
 * with ts__msg_items_set_len) and the zero padding; ts__items_head_size(n) bytes.
 */
int ts__msg_items_head_encode(uint8_t *out, size_t cap, uint64_t version, uint32_t n,
                              uint32_t remaining, const uint64_t *item_lens, size_t *len);
/* Set item i's length in a head written by ts__msg_items_head_encode (i < its n). */
void ts__msg_items_set_len(uint8_t *head, uint32_t i, uint64_t item_len);
/* The zero bytes that follow a record of rec_len bytes in an ITEMS body (0 to 63). */
size_t ts__msg_items_pad(uint64_t rec_len);
/*
 * Records padded with zeros to a multiple of 64, one after the other, as ITEMS, REF_ITEMS,
 * ENTRIES, SAMPLES and the SVC_REQUEST push lay them out. Pure, any thread.
 * ts__msg_add_padded: add rec_len, padded, to *total; TS_EMSGSIZE (*total unchanged) when that
 * would wrap 64 bits.
 * ts__msg_put_padded: write rec_len bytes of rec and their padding at out + *off (*off <= cap)
 * and move *off past them; TS_EMSGSIZE, with nothing written, when they do not fit in cap.
 * ts__msg_skip_padded: step *off (<= len) over a record of rec_len bytes and its padding in a
 * body of len bytes; TS_EPROTO when they run past the body (checked without wrapping) or the
 * padding is not all zero.
 */
int ts__msg_add_padded(uint64_t *total, uint64_t rec_len);
int ts__msg_put_padded(uint8_t *out, size_t cap, size_t *off, const uint8_t *rec, uint64_t rec_len);
int ts__msg_skip_padded(const uint8_t *body, size_t len, uint64_t *off, uint64_t rec_len);
/*
 * The check of a head that a count n sizes (ITEMS, REF_ITEMS, ENTRIES, SAMPLES, MGET's reply):
 * 0 when its head bytes lie inside a body of len bytes and are zero from used (its fields' end,
 * <= head) on; else TS_EPROTO. Pure, any thread.
 */
int ts__msg_head_check(const uint8_t *body, size_t len, uint64_t used, uint64_t head);
/* The whole body from records in memory. */
int ts__msg_items_encode(uint8_t *out, size_t cap, uint64_t version, uint32_t remaining, uint32_t n,
                         const uint8_t *const *recs, const uint64_t *rec_lens, size_t *len);
int ts__msg_items_decode(const uint8_t *body, size_t len, ts__msg_items *m);
void ts__msg_items_iter_init(const ts__msg_items *m, ts__msg_items_iter *it);
/*
 * The next record of a decoded body: 1 with its body offset and length (the record is at
 * m->body + *off), or 0 after the last one. Never fails: ts__msg_items_decode checked them all.
 */
int ts__msg_items_next(const ts__msg_items *m, ts__msg_items_iter *it, size_t *off, size_t *len);

/* LIST reply: n, reserved 0, then n entries (name, u32 n_items, u64 bytes, u64 version). */
typedef struct ts__msg_list_entry {
    const uint8_t *name; /* borrowed */
    size_t name_len;
    uint32_t n_items;
    uint64_t bytes;
    uint64_t version;
} ts__msg_list_entry;
typedef struct ts__msg_list {
    uint32_t n;
    const uint8_t *entries; /* the bytes of the n entries, borrowed */
    size_t entries_len;
} ts__msg_list;
typedef struct ts__msg_list_iter {
    uint32_t i;
    size_t off;
} ts__msg_list_iter;
int ts__msg_list_head_encode(uint8_t *out, size_t cap, uint32_t n, size_t *len);
size_t ts__msg_list_entry_size(size_t name_len);
int ts__msg_list_entry_encode(uint8_t *out, size_t cap, const ts__msg_list_entry *e, size_t *len);
int ts__msg_list_decode(const uint8_t *body, size_t len, ts__msg_list *m);
/* The next entry of a decoded list: 1 and *e, or 0 after the last. */
int ts__msg_list_next(const ts__msg_list *m, ts__msg_list_iter *it, ts__msg_list_entry *e);

/* A body that is one record (the STATS reply): at least a record header; see ts__record_*. */
int ts__msg_record_decode(const uint8_t *body, size_t len);

/* NOTIFY. Any event and any flags decode: a client MUST ignore those it does not know. */
typedef struct ts__msg_notify {
    uint64_t version;
    uint32_t n_items;
    uint8_t event; /* TS_NOTE_* */
    uint8_t flags; /* TS_NOTE_FLAG_* */
    const uint8_t *name;
    size_t name_len;
} ts__msg_notify;
size_t ts__msg_notify_size(size_t name_len);
int ts__msg_notify_encode(uint8_t *out, size_t cap, const ts__msg_notify *m, size_t *len);
int ts__msg_notify_decode(const uint8_t *body, size_t len, ts__msg_notify *m);

/*
 * Error body: a message for people, 0 to TS_MAX_ERRMSG bytes, not NUL-terminated. The decoder
 * refuses a longer body. ts__msg_error_vformat formats into out[TS_MAX_ERRMSG] and returns the
 * message's length (cut at TS_MAX_ERRMSG - 1 bytes, as vsnprintf leaves room for its NUL).
 */
int ts__msg_error_encode(uint8_t *out, size_t cap, const char *msg, size_t msg_len, size_t *len);
size_t ts__msg_error_vformat(char out[TS_MAX_ERRMSG], const char *fmt, va_list ap)
    __attribute__((format(printf, 2, 0)));
typedef struct ts__msg_error {
    const char *msg; /* borrowed; not NUL-terminated */
    size_t len;
} ts__msg_error;
int ts__msg_error_decode(const uint8_t *body, size_t len, ts__msg_error *m);

/* ---------------------------------------------------------------------------------------------
 * By reference (msg_ref.c): the REF_ITEMS reply of GET_REF/PEEK_REF and the PUT_FD/APPEND_FD
 * request (docs/PROTOCOL.md section 8, the 0x0E-0x11 entries)
 *
 * REF_ITEMS: u64 version, u32 n_items, u32 remaining, u32 n_fds, u32 reserved 0; n_items
 * entries of TS_MSG_REF_ENTRY bytes (u8 where, u8 flags, u16 0, u32 0, u64 offset, u64 length,
 * u64 file_len); zeros up to ts__msg_ref_head_size(n_items); then the inline records in entry
 * order, each followed by zeros up to a multiple of 64. Entries with where = TS_REF_FD name
 * bytes [offset, offset + length) of a file of file_len bytes received as a descriptor: the
 * i-th such entry uses the i-th descriptor of the frame (SCM_RIGHTS).
 */
#define TS_MAX_REF_ITEMS    64u   /* items per REF_ITEMS reply (and descriptors per frame) */
#define TS_MSG_REF_FIXED    24    /* bytes before the entries */
#define TS_MSG_REF_ENTRY    32    /* bytes per entry */
#define TS_REF_INLINE       0     /* where: the record is in the body */
#define TS_REF_FD           1     /* where: the record is in a descriptor */
#define TS_REF_LIVE         0x01u /* flags: a tensor bin's item, changed in place by row writes */
#define TS_REF_FILE_ALIGN   4096u /* bytes; descriptor offsets are multiples of this */
#define TS_MSG_PUT_FD_FIXED 8     /* the u64 record_len after the name */

typedef struct ts__msg_ref_entry {
    uint8_t where;     /* TS_REF_INLINE or TS_REF_FD */
    uint8_t flags;     /* TS_REF_LIVE */
    uint64_t offset;   /* inline: body offset (multiple of 64); fd: file offset (of 4096) */
    uint64_t length;   /* record bytes */
    uint64_t file_len; /* fd: bytes of the file that may be mapped; inline: 0 */
} ts__msg_ref_entry;

typedef struct ts__msg_ref_items {
    uint64_t version;
    uint32_t n_items;
    uint32_t remaining;
    uint32_t n_fds;
    const uint8_t *body; /* the whole body, borrowed */
    size_t len;
} ts__msg_ref_items;

/* The head size for n entries: fixed part, entries, zeros to a multiple of 64. */
uint64_t ts__msg_ref_head_size(uint32_t n);
/*
 * The body size for n entries (*size); only inline entries' lengths count beyond the head.
 * TS_EINVAL for n over TS_MAX_REF_ITEMS or a where other than inline/fd; TS_EMSGSIZE when it
 * does not fit 64 bits.
 */
int ts__msg_ref_size(uint32_t n, const ts__msg_ref_entry *e, uint64_t *size);
/*
 * Write the head: fixed fields, the n entries as given (inline offsets are set here, in entry
 * order from the head's end; n_fds is counted here), zeros. ts__msg_ref_head_size(n) bytes.
 * The inline records follow, each padded with ts__msg_items_pad(length) zeros. The entries'
 * offsets are written back into e. TS_EINVAL: n over TS_MAX_REF_ITEMS, an unknown where or
 * flag, an fd entry whose offset is not a multiple of TS_REF_FILE_ALIGN or whose
 * offset + length passes file_len.
 */
int ts__msg_ref_head_encode(uint8_t *out, size_t cap, uint64_t version, uint32_t remaining,
                            uint32_t n, ts__msg_ref_entry *e, size_t *len);
/* The whole body: recs[i] holds the record of each inline entry i (others ignored). */
int ts__msg_ref_encode(uint8_t *out, size_t cap, uint64_t version, uint32_t remaining, uint32_t n,
                       ts__msg_ref_entry *e, const uint8_t *const *recs, size_t *len);
/*
 * Strict decode: n_items at most TS_MAX_REF_ITEMS, reserved fields and padding zero, known where
 * and flags, n_fds = the fd entries, inline records laid out in entry order right after the head,
 * fd entries with aligned offsets inside file_len, nothing after the last record.
 */
int ts__msg_ref_decode(const uint8_t *body, size_t len, ts__msg_ref_items *m);
/* Entry i (< m->n_items) of a decoded body; inline records are at m->body + e->offset. */
void ts__msg_ref_entry_get(const ts__msg_ref_items *m, uint32_t i, ts__msg_ref_entry *e);

/* PUT_FD and APPEND_FD: name, u64 record_len. */
typedef struct ts__msg_put_fd_req {
    const uint8_t *name; /* borrowed */
    size_t name_len;
    uint64_t rec_len; /* bytes [0, rec_len) of the attached memfd hold the record */
} ts__msg_put_fd_req;
size_t ts__msg_put_fd_req_size(size_t name_len);
int ts__msg_put_fd_req_encode(uint8_t *out, size_t cap, const ts__msg_put_fd_req *m, size_t *len);
int ts__msg_put_fd_req_decode(const uint8_t *body, size_t len, ts__msg_put_fd_req *m);
/* Descriptors a request of op carries: 1 for PUT_FD and APPEND_FD, else 0. */
unsigned ts__msg_request_fds(uint8_t op);

/* ---------------------------------------------------------------------------------------------
 * Tensor bins and rows (msg_rows.c): the TENSOR_BIN and READ_ROWS requests, and records whose
 * root is one tensor (docs/PROTOCOL.md 8.19 to 8.22). GATHER_ROWS and WRITE_ROWS bodies are a
 * name and a record, as PUT's (TS_MSG_PUT_REQ, received like an upload).
 */
#define TS_MSG_TENSOR_BIN_FIXED 4  /* u8 dtype, u8 ndim, u16 reserved after the name */
#define TS_MSG_READ_ROWS_FIXED  22 /* i32 item, u16 key_len, u64 start, u64 end */
/*
 * Bytes; the longest READ_ROWS key. A map key may be longer (u16), but a READ_ROWS body must fit
 * the control body limit with a name of TS_MAX_NAME_LEN bytes, and 1024 leaves room to spare.
 */
#define TS_MSG_MAX_ROWS_KEY 1024

/*
 * TENSOR_BIN: name, u8 dtype, u8 ndim, u16 reserved 0, ndim x u64 dim. The decoder takes any
 * ndim whose dims the body holds exactly (the server answers INVALID outside 1..TS_MAX_NDIM) and
 * keeps the first TS_MAX_NDIM dims; the encoder refuses ndim over TS_MAX_NDIM (TS_EINVAL).
 */
typedef struct ts__msg_tensor_bin_req {
    const uint8_t *name; /* borrowed */
    size_t name_len;
    uint8_t dtype;
    uint8_t ndim;
    uint64_t dims[TS_MAX_NDIM];
} ts__msg_tensor_bin_req;
size_t ts__msg_tensor_bin_req_size(size_t name_len, unsigned ndim);
int ts__msg_tensor_bin_req_encode(uint8_t *out, size_t cap, const ts__msg_tensor_bin_req *m,
                                  size_t *len);
int ts__msg_tensor_bin_req_decode(const uint8_t *body, size_t len, ts__msg_tensor_bin_req *m);

/*
 * READ_ROWS: name, i32 item (0 = oldest, -1 = newest), u16 key_len, key (empty: the root is the
 * tensor), u64 start, u64 end. A key over TS_MSG_MAX_ROWS_KEY bytes is malformed (decoder) or
 * TS_EINVAL (encoder).
 */
typedef struct ts__msg_read_rows_req {
    const uint8_t *name; /* borrowed */
    size_t name_len;
    int32_t item;
    const uint8_t *key; /* borrowed; NULL when key_len is 0 */
    size_t key_len;
    uint64_t start;
    uint64_t end;
} ts__msg_read_rows_req;
size_t ts__msg_read_rows_req_size(size_t name_len, size_t key_len);
int ts__msg_read_rows_req_encode(uint8_t *out, size_t cap, const ts__msg_read_rows_req *m,
                                 size_t *len);
int ts__msg_read_rows_req_decode(const uint8_t *body, size_t len, ts__msg_read_rows_req *m);

/*
 * A record whose root is one tensor (dtype, ndim dims), laid out canonically: the 16-byte
 * header, the tensor's meta, zeros up to ts__rows_rec_head_size(ndim) (the data area, a multiple
 * of 64), then the data. ts__rows_tensor_bytes: the data bytes, multiplied as record rule 10
 * does (TS_EINVAL: unknown dtype or ndim over TS_MAX_NDIM; TS_EMSGSIZE: a dim over 2^63 - 1 or
 * an overflow). ts__rows_rec_size: the whole record (also TS_EMSGSIZE past size_t).
 * ts__rows_rec_head_write writes the head (ts__rows_rec_head_size bytes) for data_len bytes of
 * data; the caller writes the data after it.
 */
int ts__rows_tensor_bytes(uint8_t dtype, unsigned ndim, const uint64_t *dims, uint64_t *bytes);
size_t ts__rows_rec_head_size(unsigned ndim);
int ts__rows_rec_size(uint8_t dtype, unsigned ndim, const uint64_t *dims, uint64_t *size);
void ts__rows_rec_head_write(uint8_t *out, uint8_t dtype, unsigned ndim, const uint64_t *dims,
                             uint64_t data_len);

/* ---------------------------------------------------------------------------------------------
 * Streams (msg_stream.c): the bodies of opcodes 0x16 to 0x1F (docs/PROTOCOL.md 8.23 to 8.32)
 *
 * Requests start with the stream's name (u8 length + bytes, as everywhere). group and member
 * travel the same way but must not be empty (TS_STREAM_MAX_ID_LEN bytes at most), except the
 * member of STREAM_LEAVE, which is empty to remove the whole group. The decoders check the layout
 * only (lengths, reserved fields, the exact end); the values (max_entries 0, start > 1, a window
 * over max_entries, flags...) are the server's to refuse with INVALID. The encoders refuse a name,
 * group or member over 255 bytes (TS_ENAMETOOLONG) and an empty group or member (TS_EINVAL).
 */
#define TS_MSG_STREAM_CREATE_FIXED  32 /* u64 max_entries, u64 max_bytes, 4 x u32 after the name */
#define TS_MSG_STREAM_MARK_FIXED    8  /* u64 tag after the name */
#define TS_MSG_STREAM_CREDIT_FIXED  4  /* u32 timeout_ms after the name */
#define TS_MSG_STREAM_JOIN_FIXED    8  /* u8 start, u8 0, u16 0, u32 lease_ms after the member */
#define TS_MSG_STREAM_READ_FIXED    16 /* u64 ack_through, u32 max_entries, u32 timeout_ms */
#define TS_MSG_STREAM_ACK_FIXED     20 /* u64 first, u64 last, u32 rows after the member */
#define TS_MSG_STREAM_RANGE_FIXED   16 /* u64 after_id, u32 max_entries, u32 timeout_ms */
#define TS_MSG_STREAM_STATE_SIZE    48 /* STREAM STATE */
#define TS_MSG_STREAM_APPEND_SIZE   24 /* APPEND STATE */
#define TS_MSG_STREAM_JOIN_SIZE     40 /* JOIN STATE */
#define TS_MSG_STREAM_ACK_SIZE      24 /* ACK STATE */
#define TS_MSG_STREAM_ENTRIES_FIXED 32 /* u64 first_id, u64 last_id, u64 lost, u32 n, u32 0 */
#define TS_MSG_STREAM_ENTRY_HEAD    32 /* bytes per entry head */

/* STREAM_JOIN start values (the server answers INVALID for others). */
#define TS_STREAM_START_OLDEST 0 /* the oldest kept entry */
#define TS_STREAM_START_NEWEST 1 /* only entries appended after the JOIN */
/* ENTRIES entry kinds and flags. */
#define TS_STREAM_ENTRY_RECORD      0
#define TS_STREAM_ENTRY_MARKER      1
#define TS_STREAM_ENTRY_REDELIVERED 0x01u /* flags: handed to a member before */

/* STREAM_CREATE: name, u64 max_entries, u64 max_bytes, u32 max_age_ms, u32 window, u32 lease_ms,
 * u32 flags. */
typedef struct ts__msg_stream_create_req {
    const uint8_t *name; /* borrowed */
    size_t name_len;
    uint64_t max_entries;
    uint64_t max_bytes;  /* 0: no byte limit */
    uint32_t max_age_ms; /* 0: no age limit */
    uint32_t window;     /* 0: no back-pressure */
    uint32_t lease_ms;   /* 0: TS_STREAM_DEFAULT_LEASE_MS */
    uint32_t flags;      /* 0 (others: INVALID from the server) */
} ts__msg_stream_create_req;
size_t ts__msg_stream_create_req_size(size_t name_len);
int ts__msg_stream_create_req_encode(uint8_t *out, size_t cap, const ts__msg_stream_create_req *m,
                                     size_t *len);
int ts__msg_stream_create_req_decode(const uint8_t *body, size_t len, ts__msg_stream_create_req *m);

/* STREAM_MARK: name, u64 tag. */
typedef struct ts__msg_stream_mark_req {
    const uint8_t *name; /* borrowed */
    size_t name_len;
    uint64_t tag;
} ts__msg_stream_mark_req;
size_t ts__msg_stream_mark_req_size(size_t name_len);
int ts__msg_stream_mark_req_encode(uint8_t *out, size_t cap, const ts__msg_stream_mark_req *m,
                                   size_t *len);
int ts__msg_stream_mark_req_decode(const uint8_t *body, size_t len, ts__msg_stream_mark_req *m);

/* STREAM_CREDIT: name, u32 timeout_ms. */
typedef struct ts__msg_stream_credit_req {
    const uint8_t *name; /* borrowed */
    size_t name_len;
    uint32_t timeout_ms;
} ts__msg_stream_credit_req;
size_t ts__msg_stream_credit_req_size(size_t name_len);
int ts__msg_stream_credit_req_encode(uint8_t *out, size_t cap, const ts__msg_stream_credit_req *m,
                                     size_t *len);
int ts__msg_stream_credit_req_decode(const uint8_t *body, size_t len, ts__msg_stream_credit_req *m);

/*
 * The requests addressed to a member of a group: STREAM_JOIN, STREAM_READ, STREAM_ACK and
 * STREAM_LEAVE share this struct; each uses the fields its layout names and its decoder sets the
 * others to 0. Pointers are borrowed (into the body for a decoded one).
 *   JOIN:  name, group, member, u8 start, u8 0, u16 0, u32 lease_ms
 *   READ:  name, group, member, u64 ack_through, u32 max_entries, u32 timeout_ms
 *   ACK:   name, group, member, u64 first, u64 last, u32 rows
 *   LEAVE: name, group, member (member_len 0: the whole group)
 */
typedef struct ts__msg_stream_member_req {
    const uint8_t *name;
    size_t name_len;
    const uint8_t *group;
    size_t group_len;
    const uint8_t *member; /* NULL when member_len is 0 (LEAVE only) */
    size_t member_len;
    uint8_t start;        /* JOIN: TS_STREAM_START_* */
    uint32_t lease_ms;    /* JOIN: 0 = the stream's lease */
    uint64_t ack_through; /* READ: 0 = none */
    uint32_t max_entries; /* READ */
    uint32_t timeout_ms;  /* READ */
    uint64_t first;       /* ACK */
    uint64_t last;        /* ACK */
    uint32_t rows;        /* ACK: 0 = acknowledge [first, last] */
} ts__msg_stream_member_req;
size_t ts__msg_stream_join_req_size(size_t name_len, size_t group_len, size_t member_len);
size_t ts__msg_stream_read_req_size(size_t name_len, size_t group_len, size_t member_len);
size_t ts__msg_stream_ack_req_size(size_t name_len, size_t group_len, size_t member_len);
size_t ts__msg_stream_leave_req_size(size_t name_len, size_t group_len, size_t member_len);
int ts__msg_stream_join_req_encode(uint8_t *out, size_t cap, const ts__msg_stream_member_req *m,
                                   size_t *len);
int ts__msg_stream_read_req_encode(uint8_t *out, size_t cap, const ts__msg_stream_member_req *m,
                                   size_t *len);
int ts__msg_stream_ack_req_encode(uint8_t *out, size_t cap, const ts__msg_stream_member_req *m,
                                  size_t *len);
int ts__msg_stream_leave_req_encode(uint8_t *out, size_t cap, const ts__msg_stream_member_req *m,
                                    size_t *len);
int ts__msg_stream_join_req_decode(const uint8_t *body, size_t len, ts__msg_stream_member_req *m);
int ts__msg_stream_read_req_decode(const uint8_t *body, size_t len, ts__msg_stream_member_req *m);
int ts__msg_stream_ack_req_decode(const uint8_t *body, size_t len, ts__msg_stream_member_req *m);
int ts__msg_stream_leave_req_decode(const uint8_t *body, size_t len, ts__msg_stream_member_req *m);

/* STREAM_RANGE: name, u64 after_id, u32 max_entries, u32 timeout_ms. */
typedef struct ts__msg_stream_range_req {
    const uint8_t *name; /* borrowed */
    size_t name_len;
    uint64_t after_id;
    uint32_t max_entries;
    uint32_t timeout_ms;
} ts__msg_stream_range_req;
size_t ts__msg_stream_range_req_size(size_t name_len);
int ts__msg_stream_range_req_encode(uint8_t *out, size_t cap, const ts__msg_stream_range_req *m,
                                    size_t *len);
int ts__msg_stream_range_req_decode(const uint8_t *body, size_t len, ts__msg_stream_range_req *m);

/*
 * STREAM STATE (48 bytes; STREAM_CREATE, STREAM_CREDIT, STREAM_LEAVE): u64 first_id, u64 last_id,
 * u64 bytes, u32 n_entries, u32 n_groups, u32 n_stale, u32 credit, u32 window, u32 reserved 0.
 */
typedef struct ts__msg_stream_state {
    uint64_t first_id;
    uint64_t last_id;
    uint64_t bytes; /* record bytes kept */
    uint32_t n_entries;
    uint32_t n_groups;
    uint32_t n_stale;
    uint32_t credit; /* UINT32_MAX: unlimited */
    uint32_t window;
} ts__msg_stream_state;
int ts__msg_stream_state_encode(uint8_t *out, size_t cap, const ts__msg_stream_state *m,
                                size_t *len);
int ts__msg_stream_state_decode(const uint8_t *body, size_t len, ts__msg_stream_state *m);

/* APPEND STATE (24 bytes; STREAM_APPEND, STREAM_MARK): u64 id, u64 first_id, u32 credit,
 * u32 n_entries. */
typedef struct ts__msg_stream_append_state {
    uint64_t id;       /* the new entry's */
    uint64_t first_id; /* after retention */
    uint32_t credit;   /* after this append */
    uint32_t n_entries;
} ts__msg_stream_append_state;
int ts__msg_stream_append_state_encode(uint8_t *out, size_t cap,
                                       const ts__msg_stream_append_state *m, size_t *len);
int ts__msg_stream_append_state_decode(const uint8_t *body, size_t len,
                                       ts__msg_stream_append_state *m);

/* JOIN STATE (40 bytes): u64 next_id, u64 floor, u64 lost, u32 pending, u32 members,
 * u32 rows_done, u32 reserved 0. */
typedef struct ts__msg_stream_join_state {
    uint64_t next_id;   /* the group's */
    uint64_t floor;     /* the group's */
    uint64_t lost;      /* the group's, since it was created */
    uint32_t pending;   /* this member's */
    uint32_t members;   /* the group's */
    uint32_t rows_done; /* of the member's oldest pending entry */
} ts__msg_stream_join_state;
int ts__msg_stream_join_state_encode(uint8_t *out, size_t cap, const ts__msg_stream_join_state *m,
                                     size_t *len);
int ts__msg_stream_join_state_decode(const uint8_t *body, size_t len, ts__msg_stream_join_state *m);

/* ACK STATE (24 bytes): u64 acked, u64 floor, u32 pending, u32 credit. */
typedef struct ts__msg_stream_ack_state {
    uint64_t acked;   /* entries acknowledged by this request */
    uint64_t floor;   /* the group's, after */
    uint32_t pending; /* this member's, after */
    uint32_t credit;  /* the stream's, after */
} ts__msg_stream_ack_state;
int ts__msg_stream_ack_state_encode(uint8_t *out, size_t cap, const ts__msg_stream_ack_state *m,
                                    size_t *len);
int ts__msg_stream_ack_state_decode(const uint8_t *body, size_t len, ts__msg_stream_ack_state *m);

/*
 * ENTRIES (STREAM_READ, STREAM_RANGE): u64 first_id, u64 last_id, u64 lost, u32 n, u32 reserved
 * 0; n entry heads of TS_MSG_STREAM_ENTRY_HEAD bytes (u64 id, u64 len, u64 tag, u32 rows_done,
 * u16 deliveries, u8 kind, u8 flags); zeros up to ts__msg_stream_entries_head_size(n); then each
 * record in entry order, each followed by zeros up to a multiple of 64 (ts__msg_items_pad);
 * markers take no bytes. n is at most TS_STREAM_MAX_READ; a marker has len 0, a record tag 0.
 */
typedef struct ts__msg_stream_entry {
    uint64_t id;
    uint64_t len;        /* record bytes; 0 for a marker */
    uint64_t tag;        /* a marker's tag; 0 for a record */
    uint32_t rows_done;  /* rows of the entry already consumed (STREAM_ACK rows) */
    uint16_t deliveries; /* times handed out, this one included (saturates at 65535) */
    uint8_t kind;        /* TS_STREAM_ENTRY_RECORD or TS_STREAM_ENTRY_MARKER */
    uint8_t flags;       /* TS_STREAM_ENTRY_REDELIVERED */
    /*
     * The record's bytes: given to ts__msg_stream_entries_encode (ignored by the head encoder
     * and set_entry); set by the accessors to point into the decoded body (NULL for a marker).
     */
    const uint8_t *record;
} ts__msg_stream_entry;

typedef struct ts__msg_stream_entries {
    uint64_t first_id;
    uint64_t last_id;
    uint64_t lost; /* the group's (0 for STREAM_RANGE) */
    uint32_t n;
    const uint8_t *body; /* the whole body, borrowed */
    size_t len;
} ts__msg_stream_entries;

/* A walk over a decoded ENTRIES body: start with ts__msg_stream_entries_iter_init. */
typedef struct ts__msg_stream_entries_iter {
    uint32_t i;
    uint64_t off; /* body offset of the next record, a multiple of 64 */
} ts__msg_stream_entries_iter;

/* The head size for n entries: fixed part, entry heads, zeros to a multiple of 64. */
uint64_t ts__msg_stream_entries_head_size(uint32_t n);
/*
 * The body size for n entries (*size): the head and each record's length padded to 64.
 * TS_EINVAL for n over TS_STREAM_MAX_READ; TS_EMSGSIZE when it does not fit 64 bits or size_t.
 */
int ts__msg_stream_entries_size(uint32_t n, const ts__msg_stream_entry *e, uint64_t *size);
/*
 * Write the head: the fixed fields, the n entry heads (all zero when e is NULL: fill them in
 * with ts__msg_stream_entries_set) and the zero padding; ts__msg_stream_entries_head_size(n)
 * bytes. The server writes this, then queues each record (by reference) followed by
 * ts__msg_items_pad(len) zeros. TS_EINVAL: n over TS_STREAM_MAX_READ, or an entry with an unknown
 * kind or flag, a marker with len != 0, a record with tag != 0. TS_EMSGSIZE: cap too small.
 */
int ts__msg_stream_entries_head_encode(uint8_t *out, size_t cap, uint64_t first_id,
                                       uint64_t last_id, uint64_t lost, uint32_t n,
                                       const ts__msg_stream_entry *e, size_t *len);
/*
 * Write entry i's head into a head written by ts__msg_stream_entries_head_encode (i < its n).
 * The caller passes an entry the rules above allow (asserted).
 */
void ts__msg_stream_entries_set(uint8_t *head, uint32_t i, const ts__msg_stream_entry *e);
/* The whole body, from e[i].record for every record entry. */
int ts__msg_stream_entries_encode(uint8_t *out, size_t cap, uint64_t first_id, uint64_t last_id,
                                  uint64_t lost, uint32_t n, const ts__msg_stream_entry *e,
                                  size_t *len);
/*
 * Strict decode: n at most TS_STREAM_MAX_READ, reserved field and padding zero, every entry's kind
 * and flags known, a marker's len 0 and a record's tag 0, the records one after the other right
 * after the head, each padded with zeros to 64, nothing after the last. Records are not validated
 * (see ts__record_validate).
 */
int ts__msg_stream_entries_decode(const uint8_t *body, size_t len, ts__msg_stream_entries *m);
void ts__msg_stream_entries_iter_init(const ts__msg_stream_entries *m,
                                      ts__msg_stream_entries_iter *it);
/*
 * The next entry of a decoded body: 1 and *e (e->record points into m->body, NULL for a marker),
 * or 0 after the last. Never fails: the decoder checked them all.
 */
int ts__msg_stream_entries_next(const ts__msg_stream_entries *m, ts__msg_stream_entries_iter *it,
                                ts__msg_stream_entry *e);
/* Entry i (< m->n) of a decoded body, as _next gives it; walks the i entries before it (O(i)). */
void ts__msg_stream_entry_get(const ts__msg_stream_entries *m, uint32_t i, ts__msg_stream_entry *e);

/* Replay tables: their bodies are declared in msg_table.h (opcodes 0x28 to 0x2D). */
#include "msg_table.h"

/* Coordination primitives: their bodies are declared in msg_coord.h (opcodes 0x20 to 0x24). */
#include "msg_coord.h"
#include "msg_ps.h"

/* Sharding: SHARD_MAP's reply and WRONG_SHARD's body are declared in msg_shard.h. */
#include "msg_shard.h"

/* Services: their bodies are declared in msg_svc.h (opcodes 0x25 to 0x27, the push 0x81). */
#include "msg_svc.h"

/* ---------------------------------------------------------------------------------------------
 * Decoding by opcode: the table above picks the decoder
 */
typedef struct ts__msg {
    ts__msg_kind kind;
    union {
        ts__msg_hello_req hello_req;
        ts__msg_hello_rep hello_rep;
        ts__msg_auth_nonce auth_nonce;
        ts__msg_name_req name_req; /* NAME_REQ, GET_REQ, WAIT_REQ */
        ts__msg_put_req put;
        ts__msg_bin_state state;
        ts__msg_items items;
        ts__msg_list list;
        ts__msg_notify notify;
        ts__msg_error error;
        ts__msg_ref_items ref_items;
        ts__msg_put_fd_req put_fd;
        ts__msg_tensor_bin_req tensor_bin;
        ts__msg_read_rows_req read_rows;
        ts__msg_stream_create_req stream_create;
        ts__msg_stream_mark_req stream_mark;
        ts__msg_stream_credit_req stream_credit;
        ts__msg_stream_member_req stream_member; /* JOIN, READ, ACK, LEAVE */
        ts__msg_stream_range_req stream_range;
        ts__msg_stream_state stream_state;
        ts__msg_stream_append_state stream_append;
        ts__msg_stream_join_state stream_join;
        ts__msg_stream_ack_state stream_ack;
        ts__msg_stream_entries stream_entries;
        ts__msg_table_create_req table_create;
        ts__msg_table_sample_req table_sample;
        ts__msg_table_keys_req table_keys; /* UPDATE, REMOVE */
        ts__msg_table_state table_state;
        ts__msg_table_samples table_samples;
        ts__msg_coord_req coord; /* ADD, TAKE, BARRIER */
        ts__msg_add_state add_state;
        ts__msg_mget_req mget_req;
        ts__msg_mget_rep mget_rep;
        ts__msg_barrier_state barrier_state;
        ts__msg_ps_create_req ps_create; /* PS_CREATE, EMB_CREATE */
        ts__msg_ps_pull_req ps_pull;
        ts__msg_shard_map shard_map;
        ts__msg_wrong_shard wrong_shard;
        ts__msg_svc_register_req svc_register;
        ts__msg_svc_state svc_state;
        ts__msg_svc_push svc_push;
    } u;
} ts__msg;

/*
 * Decode a request body of op: 0 and *m; TS_EUNKNOWNOP for an opcode that has no request
 * (NOTIFY, unknown ones); TS_EPROTO for a malformed body. A PUT record is not validated.
 */
int ts__msg_request_decode(uint8_t op, const uint8_t *body, size_t len, ts__msg *m);
/*
 * Decode a reply body of op with status (or a NOTIFY body): as above. A STATS record and the
 * ITEMS records are not validated (see ts__record_validate).
 */
int ts__msg_reply_decode(uint8_t op, uint16_t status, const uint8_t *body, size_t len, ts__msg *m);
/*
 * Encode m (as decoded) again: 0 and *len, or the encoders' errors. For TS_MSG_RECORD and
 * TS_MSG_EMPTY the caller copies the body itself; this writes nothing for them.
 */
int ts__msg_encode(const ts__msg *m, uint8_t *out, size_t cap, size_t *len);

#endif /* TS_MSG_H */
