/*
 * The tensorshare wire protocol: frame header, opcodes, status codes and request/reply body
 * helpers. docs/PROTOCOL.md is the normative description; this file is its C form. Pure
 * functions only: nothing here touches a socket.
 *
 * Frame header, 24 bytes, little-endian:
 *   0  u8  magic       TS_MAGIC_REQ (client to server) or TS_MAGIC_REP (server to client)
 *   1  u8  version     protocol version of the connection (1)
 *   2  u8  opcode      TS_OP_*
 *   3  u8  flags       TS_FLAG_*
 *   4  u16 status      0 in requests; TS_ST_* in replies
 *   6  u16 reserved    must be 0
 *   8  u32 request_id  chosen by the client, echoed in the reply; 0 in notifications
 *  12  u32 reserved    must be 0
 *  16  u64 body_len    bytes of body that follow
 */
#ifndef TS_PROTO_H
#define TS_PROTO_H

#include "common.h"

#define TS_HDR_SIZE      24
#define TS_MAGIC_REQ     0x54 /* 'T' */
#define TS_MAGIC_REP     0x74 /* 't' */
#define TS_PROTO_VERSION 1

#define TS_FLAG_LZ4    0x01 /* body = u64 raw length + one LZ4 block (only once negotiated) */
#define TS_FLAGS_KNOWN 0x01

/* Opcodes (append-only). */
enum {
    TS_OP_HELLO = 0x01,
    /* Token proof: exchange nonces before HELLO (section 4), 0.5.0. */
    TS_OP_AUTH_CHALLENGE = 0x31,
    TS_OP_PING = 0x02,
    TS_OP_PUT = 0x03,
    TS_OP_APPEND = 0x04,
    TS_OP_GET = 0x05,
    TS_OP_PEEK = 0x06,
    TS_OP_DELETE = 0x07,
    TS_OP_LIST = 0x08,
    TS_OP_LISTEN = 0x09,
    TS_OP_UNLISTEN = 0x0A,
    TS_OP_WAIT = 0x0B,
    TS_OP_STATS = 0x0C,
    TS_OP_SAVE = 0x0D,
    TS_OP_GET_REF = 0x0E,     /* GET, large items as file descriptors (unix sockets only) */
    TS_OP_PEEK_REF = 0x0F,    /* PEEK, large items as file descriptors (unix sockets only) */
    TS_OP_PUT_FD = 0x10,      /* PUT of a record held in a memfd sent with the request */
    TS_OP_APPEND_FD = 0x11,   /* APPEND of a record held in a memfd sent with the request */
    TS_OP_TENSOR_BIN = 0x12,  /* create a preallocated tensor bin */
    TS_OP_READ_ROWS = 0x13,   /* rows [start, end) of a tensor in an item */
    TS_OP_GATHER_ROWS = 0x14, /* rows of a tensor in an item, by an index list */
    TS_OP_WRITE_ROWS = 0x15,  /* write rows in place into a tensor bin */
    /* Streams (a bin kind: an append-only log read through server-kept cursors), 0.4.0. */
    TS_OP_STREAM_CREATE = 0x16, /* create a stream or change its settings */
    TS_OP_STREAM_APPEND = 0x17, /* append a record (an upload, like APPEND) */
    TS_OP_STREAM_MARK = 0x18,   /* append a marker entry carrying a u64 tag */
    TS_OP_STREAM_CREDIT = 0x19, /* wait until the stream's window has room */
    TS_OP_STREAM_JOIN = 0x1A,   /* join a group (a cursor) as a member */
    TS_OP_STREAM_READ = 0x1B,   /* hand a member its next entries */
    TS_OP_STREAM_ACK = 0x1C,    /* acknowledge entries (or rows of one entry) */
    TS_OP_STREAM_LEAVE = 0x1D,  /* remove a member, or a whole group */
    TS_OP_STREAM_INFO = 0x1E,   /* settings, groups and members, as a record */
    TS_OP_STREAM_RANGE = 0x1F,  /* kept entries after an id, without a cursor */
    /* Coordination primitives (TCPStore's feature set), 0.4.0. */
    TS_OP_ADD = 0x20,     /* add to a counter (a bin holding one int record) */
    TS_OP_PUT_IF = 0x21,  /* PUT only when the bin's version is the one expected (an upload) */
    TS_OP_TAKE = 0x22,    /* a blocking GET that hands each item to one waiter, in arrival order */
    TS_OP_MGET = 0x23,    /* PEEK several bins in one round trip */
    TS_OP_BARRIER = 0x24, /* wait until a number of parties arrive; reusable */
    /* Services (requests forwarded to a registered process, answers routed back), 0.6.0. */
    TS_OP_SVC_REGISTER = 0x25, /* serve a named service on this connection (or stop) */
    TS_OP_SVC_CALL = 0x26,     /* call a service (an upload: the request record) */
    TS_OP_SVC_REPLY = 0x27,    /* a server's answer to a call it was handed (an upload) */
    /* Replay tables (a bin kind: prioritized experience replay with a rate limiter), 0.4.0. */
    TS_OP_TABLE_CREATE = 0x28, /* create a replay table */
    TS_OP_TABLE_INSERT = 0x29, /* insert a record with a priority (an upload with fixed fields) */
    TS_OP_TABLE_SAMPLE = 0x2A, /* sample items (waits for the rate limiter) */
    TS_OP_TABLE_UPDATE = 0x2B, /* change priorities by key */
    TS_OP_TABLE_REMOVE = 0x2C, /* remove items by key */
    TS_OP_TABLE_INFO = 0x2D,   /* settings, counters and rate limiter state, as a record */
    /* Sharding (docs/PROTOCOL.md section 14), 0.5.0. */
    TS_OP_SHARD_MAP = 0x30, /* the daemon's shard map: epoch, shards, addresses, slot ranges */
    /* Parameter server (server-side optimizer steps and embedding tables), 0.5.0. */
    TS_OP_PS_CREATE = 0x38,  /* make a bin holding a tensor a parameter (optimizer, mode) */
    TS_OP_PS_PUSH = 0x39,    /* push a gradient into a parameter (an upload with fixed fields) */
    TS_OP_PS_PULL = 0x3A,    /* the parameter, or nothing when not newer than a version */
    TS_OP_EMB_CREATE = 0x3B, /* create an embedding table (rows by int64 id, created lazily) */
    TS_OP_EMB_PULL = 0x3C,   /* rows by ids (an upload: the ids tensor) */
    TS_OP_EMB_PUSH = 0x3D,   /* row gradients by ids (an upload with fixed fields) */
    TS_OP_NOTIFY = 0x80,     /* server to client only */
    TS_OP_SVC_REQUEST = 0x81 /* server to client only: a call handed to a service's server */
};

/* Wire status codes (u16, append-only); the client maps them to TS_E* codes. */
enum {
    TS_ST_OK = 0,
    TS_ST_NOT_FOUND = 1,
    TS_ST_BAD_REQUEST = 2,
    TS_ST_UNKNOWN_OPCODE = 3,
    TS_ST_BAD_RECORD = 4,
    TS_ST_TOO_LARGE = 5,
    TS_ST_OUT_OF_MEMORY = 6,
    TS_ST_UNSUPPORTED_VERSION = 7,
    TS_ST_AUTH_REQUIRED = 8,
    TS_ST_AUTH_FAILED = 9,
    TS_ST_TOO_MANY_CLIENTS = 10,
    TS_ST_WRONG_SHARD = 11,
    TS_ST_TIMEOUT = 12,
    TS_ST_INTERNAL = 13,
    TS_ST_SLOW_READER = 14,
    TS_ST_SHUTTING_DOWN = 15,
    TS_ST_NAME_TOO_LONG = 16,
    TS_ST_INVALID = 17, /* a well-formed request with an invalid argument */
    /* A write refused because the server's snapshots are failing (--stop-writes-on-save-error). */
    TS_ST_SAVE_FAILING = 18,
    /* A STREAM_APPEND refused because a live group is a whole window behind (TS_EAGAIN). */
    TS_ST_BACKPRESSURE = 19,
    /* A PUT_IF whose expected version is not the bin's (TS_ECONFLICT; the body is a BIN_STATE). */
    TS_ST_VERSION_MISMATCH = 20,
    /* A PS_PUSH whose gradient lags the parameter by more than its tolerance (TS_ESTALE; the
     * body is a BIN_STATE with the parameter's current version). */
    TS_ST_STALE_GRADIENT = 21,
    /* A call whose service server disconnected (or stopped serving) while it held or awaited the
     * call (TS_ESERVICE). */
    TS_ST_SERVICE_GONE = 22,
    TS_ST_COUNT_
};

/* Notification event codes (the same numbers as ts_event_t). */
enum {
    TS_NOTE_PUT = 1,
    TS_NOTE_APPEND = 2,
    TS_NOTE_GET = 3,
    TS_NOTE_DELETE = 4,
    TS_NOTE_ROWS = 5 /* rows written in place into a tensor bin */
};
#define TS_NOTE_FLAG_COALESCED 0x01

/*
 * Protocol limits that are fixed by the encoding (configurable limits live in the daemon). The bin
 * name limit TS_MAX_NAME_LEN is public, in tensorshare.h.
 */
#define TS_MAX_PREAUTH_BODY  4096                /* bytes; any frame body before HELLO completes */
#define TS_MAX_ERRMSG        1024                /* bytes; error reply bodies */
#define TS_DEFAULT_MAX_FRAME ((uint64_t)1 << 30) /* bytes; default body limit, 1 GiB */

/*
 * Stream limits (docs/PROTOCOL.md section 12), shared by tensord and the client. They bound what
 * one stream can make the server keep or send, so that every walk over a stream's groups,
 * members or entries has a known worst case.
 */
/* Entries per STREAM_READ/STREAM_RANGE reply: bounds the reply's head (32 bytes each). */
#define TS_STREAM_MAX_READ 1024u
/* Bytes of records gathered per read reply; one entry always goes even if larger. */
#define TS_STREAM_READ_BYTES ((uint64_t)64 << 20)
/* Entries a stream may keep (max_entries of STREAM_CREATE is 1..this): 2^24. */
#define TS_STREAM_MAX_ENTRIES ((uint64_t)1 << 24)
/* Groups per stream and members per group: a STREAM_INFO reply stays bounded. */
#define TS_STREAM_MAX_GROUPS  1024u
#define TS_STREAM_MAX_MEMBERS 1024u
/* ms; the longest lease (24 h): a member silent longer than a day is gone. */
#define TS_STREAM_MAX_LEASE_MS 86400000u
/*
 * ms; the lease of a stream created with lease_ms 0. Spelled exactly as the public
 * include/tensorshare/stream.h spells it, so that a file including both sees one definition.
 */
#define TS_STREAM_DEFAULT_LEASE_MS 10000
/* Bytes of a group or member name (u8 length on the wire, like a bin name). */
#define TS_STREAM_MAX_ID_LEN 255u

typedef struct ts__hdr {
    uint8_t magic;
    uint8_t version;
    uint8_t opcode;
    uint8_t flags;
    uint16_t status;
    uint32_t request_id;
    uint64_t body_len;
} ts__hdr;

/* Write h into out[TS_HDR_SIZE]; reserved fields are written as 0. */
void ts__hdr_encode(const ts__hdr *h, uint8_t out[TS_HDR_SIZE]);

/*
 * Parse and check a header. expect_magic is the direction the reader accepts. Returns 0 and fills
 * *h, or TS_EPROTO when the magic, version or a reserved field is wrong, or a flag is unknown.
 * Body length limits are the caller's (they depend on the connection's state).
 */
int ts__hdr_decode(const uint8_t in[TS_HDR_SIZE], uint8_t expect_magic, ts__hdr *h);

/* The TS_E* code for a wire status (TS_ST_OK gives 0; unknown codes give TS_ESERVER). */
int ts__status_to_err(uint16_t status);
/* The wire status for a TS_E* code (used by the daemon). */
uint16_t ts__err_to_status(int err);
/* A short name for a status, e.g. "NOT_FOUND". */
const char *ts__status_name(uint16_t status);
/* A short name for an opcode, e.g. "PUT", or "UNKNOWN". */
const char *ts__op_name(uint8_t op);

/*
 * A bounded reader over a body: every read checks the remaining length first, so decoders never
 * read past the end. After a failed read, r->err is set and every later read fails too.
 */
typedef struct ts__rd {
    const uint8_t *p;
    size_t left;
    int err;
} ts__rd;

static inline void ts__rd_init(ts__rd *r, const void *p, size_t len)
{
    r->p = p;
    r->left = len;
    r->err = 0;
}
int ts__rd_u8(ts__rd *r, uint8_t *v);
int ts__rd_u16(ts__rd *r, uint16_t *v);
int ts__rd_u32(ts__rd *r, uint32_t *v);
int ts__rd_u64(ts__rd *r, uint64_t *v);
/* Return a pointer to the next n bytes and skip them, or NULL. */
const uint8_t *ts__rd_bytes(ts__rd *r, size_t n);
/* A bin name: u8 length + bytes. *name points into the body (not NUL-terminated). */
int ts__rd_name(ts__rd *r, const char **name, size_t *len);

/*
 * Body layouts: every frame body is encoded and decoded by src/msg.h (one encoder and one strict
 * decoder per body, with the layouts of docs/PROTOCOL.md written there and nowhere else). The
 * constants below are the few fixed sizes both sides name.
 */
#define TS_HELLO_LZ4      0x01
#define TS_HELLO_FDS      0x02 /* the connection carries file descriptors (unix sockets) */
#define TS_BIN_STATE_SIZE 16
#define TS_NOTIFY_FIXED   15 /* bytes before the name in a NOTIFY body */

/* HELLO flag: the token field holds an HMAC-SHA256 proof, not the token (section 4; 0.5.0). */
#define TS_HELLO_TOKEN_PROOF 0x04

/* Size of an ITEMS reply's fixed part for n items, padded to 64 (the first item's offset). */
static inline uint64_t ts__items_head_size(uint32_t n)
{
    return ts__align_up(16 + (size_t)n * 8, TS__ALIGN);
}

#endif /* TS_PROTO_H */
