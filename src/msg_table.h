/*
 * Replay tables (msg_table.c): the bodies of opcodes 0x28 to 0x2D (docs/PROTOCOL.md 8.33 to
 * 8.38). Included by msg.h only (its conventions hold here: strict decoders, encoders that check
 * their room first). TABLE_INSERT is an upload with TS_MSG_TABLE_INSERT_FIXED bytes of fixed
 * fields (ts__msg_upload_*), TABLE_INFO's body a plain name.
 *
 * The decoders check the layout only (lengths, reserved fields, the exact end, n against the
 * per-request limit); the values (capacity 0, an unknown sampler, a NaN priority...) are the
 * server's to refuse with INVALID.
 */
#ifndef TS_MSG_TABLE_H
#define TS_MSG_TABLE_H

/*
 * Table limits (docs/PROTOCOL.md section 12), shared by tensord and the client.
 */
/* Items a table may hold (capacity of TABLE_CREATE is 1..this): 2^24, as a stream's entries. */
#define TS_TABLE_MAX_CAPACITY ((uint64_t)1 << 24)
/* Items per TABLE_SAMPLE reply: bounds the reply's head (40 bytes each) and one request's work. */
#define TS_TABLE_MAX_SAMPLE 1024u
/*
 * Keys per TABLE_UPDATE or TABLE_REMOVE: 200 entries of 16 bytes and the longest name fit the
 * control body limit (TS_MAX_CTRL_BODY); the client splits longer lists into batches.
 */
#define TS_TABLE_MAX_KEYS 200u

#define TS_MSG_TABLE_CREATE_FIXED  48 /* 3 x u64, 3 x f64... see ts__msg_table_create_req */
#define TS_MSG_TABLE_INSERT_FIXED  16 /* f64 priority, u32 timeout_ms, u32 0 after the name */
#define TS_MSG_TABLE_SAMPLE_FIXED  8  /* u32 n, u32 timeout_ms after the name */
#define TS_MSG_TABLE_KEYS_FIXED    8  /* u32 n, u32 0 after the name */
#define TS_MSG_TABLE_STATE_SIZE    40 /* TABLE STATE */
#define TS_MSG_TABLE_SAMPLES_FIXED 16 /* u64 size, u32 n, u32 0 */
#define TS_MSG_TABLE_SAMPLE_HEAD   40 /* bytes per sample head */

/* Samplers and removers (TABLE_CREATE; the server answers INVALID for others). */
#define TS_TABLE_SAMPLER_UNIFORM     0
#define TS_TABLE_SAMPLER_PRIORITIZED 1
#define TS_TABLE_SAMPLER_FIFO        2
#define TS_TABLE_SAMPLER_LIFO        3
#define TS_TABLE_REMOVER_FIFO        0
#define TS_TABLE_REMOVER_LIFO        1
#define TS_TABLE_REMOVER_LOWEST      2 /* the lowest priority (the oldest among equals) */

/*
 * TABLE_CREATE: name, u64 capacity, u64 min_size_to_sample, f64 samples_per_insert,
 * f64 error_buffer, f64 priority_exponent, u32 max_times_sampled, u8 remover, u8 sampler,
 * u16 reserved 0. Doubles travel as the little-endian bytes of their IEEE 754 binary64 form.
 */
typedef struct ts__msg_table_create_req {
    const uint8_t *name; /* borrowed */
    size_t name_len;
    uint64_t capacity;           /* 1..TS_TABLE_MAX_CAPACITY */
    uint64_t min_size_to_sample; /* 1..capacity */
    double samples_per_insert;   /* > 0, finite */
    double error_buffer;         /* 0: no ratio limit; else >= max(1, samples_per_insert) */
    double priority_exponent;    /* >= 0, finite */
    uint32_t max_times_sampled;  /* 0: unlimited */
    uint8_t remover;             /* TS_TABLE_REMOVER_* */
    uint8_t sampler;             /* TS_TABLE_SAMPLER_* */
} ts__msg_table_create_req;
size_t ts__msg_table_create_req_size(size_t name_len);
int ts__msg_table_create_req_encode(uint8_t *out, size_t cap, const ts__msg_table_create_req *m,
                                    size_t *len);
int ts__msg_table_create_req_decode(const uint8_t *body, size_t len, ts__msg_table_create_req *m);

/* TABLE_INSERT's fixed fields (16 bytes): f64 priority, u32 timeout_ms, u32 reserved 0. */
typedef struct ts__msg_table_insert_fixed {
    double priority;
    uint32_t timeout_ms; /* how long the insert may wait for the rate limiter */
} ts__msg_table_insert_fixed;
void ts__msg_table_insert_fixed_encode(uint8_t out[TS_MSG_TABLE_INSERT_FIXED],
                                       const ts__msg_table_insert_fixed *m);
/* TS_EPROTO for a non-zero reserved field. */
int ts__msg_table_insert_fixed_decode(const uint8_t in[TS_MSG_TABLE_INSERT_FIXED],
                                      ts__msg_table_insert_fixed *m);

/* TABLE_SAMPLE: name, u32 n (1..TS_TABLE_MAX_SAMPLE), u32 timeout_ms. */
typedef struct ts__msg_table_sample_req {
    const uint8_t *name; /* borrowed */
    size_t name_len;
    uint32_t n;
    uint32_t timeout_ms;
} ts__msg_table_sample_req;
size_t ts__msg_table_sample_req_size(size_t name_len);
int ts__msg_table_sample_req_encode(uint8_t *out, size_t cap, const ts__msg_table_sample_req *m,
                                    size_t *len);
int ts__msg_table_sample_req_decode(const uint8_t *body, size_t len, ts__msg_table_sample_req *m);

/*
 * TABLE_UPDATE and TABLE_REMOVE: name, u32 n (1..TS_TABLE_MAX_KEYS), u32 reserved 0, then n
 * entries: TABLE_UPDATE's are (u64 key, f64 priority), 16 bytes; TABLE_REMOVE's a u64 key.
 * keys (and priorities) point into the body; read them with ts__msg_table_key_at.
 */
typedef struct ts__msg_table_keys_req {
    const uint8_t *name; /* borrowed */
    size_t name_len;
    uint32_t n;
    int with_priority;    /* 1 for TABLE_UPDATE */
    const uint8_t *pairs; /* borrowed; n entries of 16 (UPDATE) or 8 (REMOVE) bytes */
} ts__msg_table_keys_req;
size_t ts__msg_table_keys_req_size(size_t name_len, uint32_t n, int with_priority);
/* keys[n]; priorities[n] for TABLE_UPDATE (NULL for TABLE_REMOVE). */
int ts__msg_table_keys_req_encode(uint8_t *out, size_t cap, const uint8_t *name, size_t name_len,
                                  uint32_t n, const uint64_t *keys, const double *priorities,
                                  size_t *len);
int ts__msg_table_update_req_decode(const uint8_t *body, size_t len, ts__msg_table_keys_req *m);
int ts__msg_table_remove_req_decode(const uint8_t *body, size_t len, ts__msg_table_keys_req *m);
/* Entry i (< m->n): its key, and its priority (0 for TABLE_REMOVE). */
void ts__msg_table_key_at(const ts__msg_table_keys_req *m, uint32_t i, uint64_t *key,
                          double *priority);

/*
 * TABLE STATE (40 bytes; TABLE_CREATE, TABLE_INSERT, TABLE_UPDATE, TABLE_REMOVE): u64 key (the
 * inserted item's; 0 otherwise), u64 size, u64 inserts, u64 samples, u32 done (items inserted,
 * updated or removed by this request), u32 skipped (keys it named that the table does not hold).
 */
typedef struct ts__msg_table_state {
    uint64_t key;
    uint64_t size;
    uint64_t inserts;
    uint64_t samples;
    uint32_t done;
    uint32_t skipped;
} ts__msg_table_state;
int ts__msg_table_state_encode(uint8_t *out, size_t cap, const ts__msg_table_state *m, size_t *len);
int ts__msg_table_state_decode(const uint8_t *body, size_t len, ts__msg_table_state *m);

/*
 * SAMPLES (TABLE_SAMPLE): u64 size (the table's after the sample), u32 n (1..TS_TABLE_MAX_SAMPLE),
 * u32 reserved 0; n heads of TS_MSG_TABLE_SAMPLE_HEAD bytes (u64 key, u64 len, f64 probability,
 * u64 age_ms, u32 times_sampled, u32 reserved 0); zeros up to ts__msg_table_samples_head_size(n)
 * (a multiple of 64); then each record, each followed by zeros up to a multiple of 64.
 */
typedef struct ts__msg_table_sample {
    uint64_t key;
    uint64_t len;
    double probability;     /* of this item being picked by this draw */
    uint64_t age_ms;        /* since it was inserted */
    uint32_t times_sampled; /* this draw included */
    const uint8_t *record;  /* the accessors point it into the body */
} ts__msg_table_sample;

typedef struct ts__msg_table_samples {
    uint64_t size;
    uint32_t n;
    const uint8_t *body; /* the whole body, borrowed */
    size_t len;
} ts__msg_table_samples;

uint64_t ts__msg_table_samples_head_size(uint32_t n);
/* The head: fixed part, n sample heads (e may be NULL: zeros, see _set), zero padding. */
int ts__msg_table_samples_head_encode(uint8_t *out, size_t cap, uint64_t size, uint32_t n,
                                      const ts__msg_table_sample *e, size_t *len);
void ts__msg_table_samples_set(uint8_t *head, uint32_t i, const ts__msg_table_sample *e);
/* The whole body, from e[i].record. */
int ts__msg_table_samples_encode(uint8_t *out, size_t cap, uint64_t size, uint32_t n,
                                 const ts__msg_table_sample *e, size_t *len);
/* Strict decode: n 1..TS_TABLE_MAX_SAMPLE, reserved and padding zero, records back to back. */
int ts__msg_table_samples_decode(const uint8_t *body, size_t len, ts__msg_table_samples *m);
/* Sample i (< m->n); walks the records before it (O(i)). */
void ts__msg_table_sample_get(const ts__msg_table_samples *m, uint32_t i, ts__msg_table_sample *e);

#endif /* TS_MSG_TABLE_H */
