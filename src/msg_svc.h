/*
 * Services (msg_svc.c): the bodies of opcodes 0x25 to 0x27 and of the SVC_REQUEST push 0x81
 * (docs/PROTOCOL.md 8.51 to 8.54). Included by msg.h; its conventions hold (strict decoders that
 * check the layout only, encoders that check their room first).
 *
 *   SVC_REGISTER: name, u32 concurrency, u32 flags 0    -> SERVICE STATE: u32 servers,
 *                                                          u32 queued, u64 calls
 *   SVC_CALL:     name, u32 timeout_ms, u32 flags, record (an upload: upload_fixed 8)
 *                                                       -> ITEMS with the answer's record
 *   SVC_REPLY:    name, u64 call_id, u16 status, u16 0, u32 0, then the answer's record (status
 *                 0) or a message of 1 to TS_MAX_ERRMSG bytes (an upload: upload_fixed 16)
 *                                                       -> empty
 *   SVC_REQUEST (push, request id 0): u64 call_id, u32 timeout_ms, u32 0, u64 rec_len, name,
 *                 zeros up to a multiple of 64 bytes (the head), then the request's record and
 *                 zeros up to a multiple of 64 bytes (as in ITEMS)
 *
 * The values (a concurrency over the limit, unknown flags, a status no service may send) are
 * the server's to refuse.
 */
#ifndef TS_MSG_SVC_H
#define TS_MSG_SVC_H

#define TS_MSG_SVC_REGISTER_FIXED 8  /* u32 concurrency, u32 flags after the name */
#define TS_MSG_SVC_STATE_SIZE     16 /* SERVICE STATE: u32 servers, u32 queued, u64 calls */
#define TS_MSG_SVC_CALL_FIXED     8  /* u32 timeout_ms, u32 flags between the name and record */
#define TS_MSG_SVC_REPLY_FIXED    16 /* u64 call_id, u16 status, u16 0, u32 0 */
#define TS_MSG_SVC_PUSH_FIXED     24 /* u64 call_id, u32 timeout_ms, u32 0, u64 rec_len */

/* SVC_CALL flags: wait (up to the timeout) for a server when the service has none. */
#define TS_SVC_CALL_WAIT        0x01u
#define TS_SVC_CALL_FLAGS_KNOWN 0x01u

/* Calls one server of a service may hold unanswered at most (SVC_REGISTER's concurrency). */
#define TS_SVC_MAX_CONCURRENCY 65536u

/* SVC_REGISTER: a service name, the server's concurrency (0: stop serving it) and flags. */
typedef struct ts__msg_svc_register_req {
    const uint8_t *name; /* borrowed; not NUL-terminated */
    size_t name_len;
    uint32_t concurrency;
    uint32_t flags;
} ts__msg_svc_register_req;
size_t ts__msg_svc_register_req_size(size_t name_len);
int ts__msg_svc_register_req_encode(uint8_t *out, size_t cap, const ts__msg_svc_register_req *m,
                                    size_t *len);
int ts__msg_svc_register_req_decode(const uint8_t *body, size_t len, ts__msg_svc_register_req *m);

/* SERVICE STATE (16 bytes): the service after the request. */
typedef struct ts__msg_svc_state {
    uint32_t servers; /* connections serving it */
    uint32_t queued;  /* calls waiting for a server */
    uint64_t calls;   /* calls answered by its servers since it was first registered */
} ts__msg_svc_state;
int ts__msg_svc_state_encode(uint8_t *out, size_t cap, const ts__msg_svc_state *m, size_t *len);
int ts__msg_svc_state_decode(const uint8_t *body, size_t len, ts__msg_svc_state *m);

/* The fixed fields of SVC_CALL (8 bytes) and SVC_REPLY (16 bytes). */
typedef struct ts__msg_svc_call_fixed {
    uint32_t timeout_ms;
    uint32_t flags;
} ts__msg_svc_call_fixed;
void ts__msg_svc_call_fixed_encode(uint8_t out[TS_MSG_SVC_CALL_FIXED],
                                   const ts__msg_svc_call_fixed *m);
void ts__msg_svc_call_fixed_decode(const uint8_t in[TS_MSG_SVC_CALL_FIXED],
                                   ts__msg_svc_call_fixed *m);
typedef struct ts__msg_svc_reply_fixed {
    uint64_t call_id;
    uint16_t status;
    uint16_t reserved16; /* must be 0 */
    uint32_t reserved32; /* must be 0 */
} ts__msg_svc_reply_fixed;
void ts__msg_svc_reply_fixed_encode(uint8_t out[TS_MSG_SVC_REPLY_FIXED],
                                    const ts__msg_svc_reply_fixed *m);
void ts__msg_svc_reply_fixed_decode(const uint8_t in[TS_MSG_SVC_REPLY_FIXED],
                                    ts__msg_svc_reply_fixed *m);
/*
 * 1 when an SVC_REPLY with these fixed fields carries a message rather than a record (its
 * status is not OK). Receivers then skip record validation and bound the rest by TS_MAX_ERRMSG.
 */
int ts__msg_svc_reply_is_error(const uint8_t fixed[TS_MSG_SVC_REPLY_FIXED]);
/*
 * 1 when a service may answer a call with status (SVC_REPLY): every status but OK whose reply
 * body is an error message (WRONG_SHARD, VERSION_MISMATCH and STALE_GRADIENT carry other bodies),
 * below TS_ST_COUNT_.
 */
int ts__msg_svc_status_allowed(uint16_t status);

/* SVC_REQUEST's head: the fixed fields and the service name, padded to 64 bytes. */
typedef struct ts__msg_svc_push {
    uint64_t call_id;
    uint32_t timeout_ms; /* what was left of the caller's timeout when the call was handed over */
    const uint8_t *name; /* borrowed */
    size_t name_len;
    uint64_t rec_len;
    size_t head_len;       /* bytes before the record */
    const uint8_t *record; /* borrowed; into the body */
} ts__msg_svc_push;
/* Bytes of the head for a name of name_len bytes: a multiple of 64. */
size_t ts__msg_svc_push_head_size(size_t name_len);
/* Write the head (m's call_id, timeout_ms, name, rec_len) into out; *len the head's size. */
int ts__msg_svc_push_head_encode(uint8_t *out, size_t cap, const ts__msg_svc_push *m, size_t *len);
/*
 * Decode a whole SVC_REQUEST body: the head (reserved fields and padding zero, a name of 1 to
 * 255 bytes), rec_len bytes of record and its zero padding (ts__msg_items_pad), to the end of
 * the body. 0, or TS_EPROTO.
 */
int ts__msg_svc_push_decode(const uint8_t *body, size_t len, ts__msg_svc_push *m);

#endif /* TS_MSG_SVC_H */
