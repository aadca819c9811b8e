/*
 * Coordination primitives (msg_coord.c): the bodies of opcodes 0x20 to 0x24 (docs/PROTOCOL.md
 * 8.39 to 8.43): ADD, PUT_IF, TAKE, MGET and BARRIER. Included by msg.h; the conventions of
 * msg.h hold (strict decoders that check the layout only, encoders that check their room first).
 *
 *   ADD:     name, i64 delta                          -> ADD STATE: i64 value, u64 version
 *   PUT_IF:  name, u64 expected_version, record       -> BIN_STATE (an upload: upload_fixed 8)
 *   TAKE:    name, u32 max_items, u32 timeout_ms      -> ITEMS
 *   MGET:    u32 n, u32 max_items, n names            -> MGET reply (below)
 *   BARRIER: name, u32 parties, u32 timeout_ms        -> BARRIER STATE: u64 generation,
 *                                                        u32 parties, u32 reserved 0
 *
 * The values (a parties of 0, a max_items of 0 for TAKE...) are the server's to refuse.
 */
#ifndef TS_MSG_COORD_H
#define TS_MSG_COORD_H

#define TS_MSG_ADD_FIXED          8  /* i64 delta after the name */
#define TS_MSG_ADD_STATE_SIZE     16 /* ADD STATE: i64 value, u64 version */
#define TS_MSG_PUT_IF_FIXED       8  /* u64 expected_version between the name and the record */
#define TS_MSG_TAKE_FIXED         8  /* u32 max_items, u32 timeout_ms after the name */
#define TS_MSG_BARRIER_FIXED      8  /* u32 parties, u32 timeout_ms after the name */
#define TS_MSG_BARRIER_STATE_SIZE 16 /* BARRIER STATE: u64 generation, u32 parties, u32 0 */
#define TS_MSG_MGET_FIXED         8  /* u32 n, u32 max_items before the names */
#define TS_MSG_MGET_REP_FIXED     8  /* u32 n, u32 reserved 0 */
#define TS_MSG_MGET_ENTRY         16 /* u8 found, u8 0, u16 0, u32 0, u64 block_len */
#define TS_MGET_MISSING           0  /* MGET entry: no such bin (block_len 0) */
#define TS_MGET_FOUND             1  /* MGET entry: the bin's ITEMS block follows */
/*
 * Names per MGET request: bounds the reply's head (16 bytes each) and the server's work per
 * request. A request must also fit the control body limit (TS_MAX_CTRL_BODY), so 256 names
 * are possible only when they are short (about 15 bytes on average).
 */
#define TS_MGET_MAX_NAMES 256u

/*
 * ADD, TAKE and BARRIER: a name and fixed fields. One struct serves the three; the fields a
 * layout does not have are 0 after decoding and ignored by the encoders.
 */
typedef struct ts__msg_coord_req {
    const uint8_t *name; /* borrowed; not NUL-terminated */
    size_t name_len;
    int64_t delta;       /* ADD */
    uint32_t count;      /* TAKE: max_items (0 = all); BARRIER: parties */
    uint32_t timeout_ms; /* TAKE, BARRIER */
} ts__msg_coord_req;
size_t ts__msg_add_req_size(size_t name_len);
int ts__msg_add_req_encode(uint8_t *out, size_t cap, const ts__msg_coord_req *m, size_t *len);
int ts__msg_add_req_decode(const uint8_t *body, size_t len, ts__msg_coord_req *m);
size_t ts__msg_take_req_size(size_t name_len);
int ts__msg_take_req_encode(uint8_t *out, size_t cap, const ts__msg_coord_req *m, size_t *len);
int ts__msg_take_req_decode(const uint8_t *body, size_t len, ts__msg_coord_req *m);
size_t ts__msg_barrier_req_size(size_t name_len);
int ts__msg_barrier_req_encode(uint8_t *out, size_t cap, const ts__msg_coord_req *m, size_t *len);
int ts__msg_barrier_req_decode(const uint8_t *body, size_t len, ts__msg_coord_req *m);

/* ADD STATE (16 bytes): the counter's new value and the bin's version after the ADD. */
typedef struct ts__msg_add_state {
    int64_t value;
    uint64_t version;
} ts__msg_add_state;
int ts__msg_add_state_encode(uint8_t *out, size_t cap, const ts__msg_add_state *m, size_t *len);
int ts__msg_add_state_decode(const uint8_t *body, size_t len, ts__msg_add_state *m);

/* BARRIER STATE (16 bytes): the generation released and its parties. */
typedef struct ts__msg_barrier_state {
    uint64_t generation;
    uint32_t parties;
} ts__msg_barrier_state;
int ts__msg_barrier_state_encode(uint8_t *out, size_t cap, const ts__msg_barrier_state *m,
                                 size_t *len);
int ts__msg_barrier_state_decode(const uint8_t *body, size_t len, ts__msg_barrier_state *m);

/*
 * MGET request: u32 n (1 to TS_MGET_MAX_NAMES), u32 max_items (per bin, 0 = all), then n names
 * (u8 length + bytes each), nothing after the last. The decoder checks every name's length
 * against the body; walk them with ts__msg_mget_req_next.
 */
typedef struct ts__msg_mget_req {
    uint32_t n;
    uint32_t max_items;
    const uint8_t *names; /* the n names, borrowed */
    size_t names_len;
} ts__msg_mget_req;
/* The body size for n names of the given lengths. */
size_t ts__msg_mget_req_size(uint32_t n, const size_t *name_lens);
/* TS_EINVAL for n 0 or over TS_MGET_MAX_NAMES; TS_ENAMETOOLONG for a name over 255 bytes. */
int ts__msg_mget_req_encode(uint8_t *out, size_t cap, uint32_t n, uint32_t max_items,
                            const uint8_t *const *names, const size_t *name_lens, size_t *len);
int ts__msg_mget_req_decode(const uint8_t *body, size_t len, ts__msg_mget_req *m);
/* The next name of a decoded request (*off starts at 0): 1 and the name, or 0 after the last. */
int ts__msg_mget_req_next(const ts__msg_mget_req *m, size_t *off, const uint8_t **name,
                          size_t *name_len);

/*
 * MGET reply: u32 n, u32 reserved 0; n entries of TS_MSG_MGET_ENTRY bytes (u8 found, u8 0,
 * u16 0, u32 0, u64 block_len), one per requested name in request order; zeros up to
 * ts__msg_mget_head_size(n) (a multiple of 64); then, for each found bin in order, its block:
 * an ITEMS body (the bin's version, items and remaining, as PEEK gives them) of block_len bytes,
 * a multiple of 64, so that every record stays 64-byte aligned in the reply. A missing bin has
 * block_len 0 and no block.
 */
typedef struct ts__msg_mget_rep {
    uint32_t n;
    const uint8_t *body; /* the whole body, borrowed */
    size_t len;
} ts__msg_mget_rep;
uint64_t ts__msg_mget_head_size(uint32_t n);
/*
 * Write the head for n entries (found[i], block_lens[i]); TS_EINVAL for n over
 * TS_MGET_MAX_NAMES, a found value other than 0/1, a missing bin with a block, or a block_len
 * that is not a multiple of 64 (or under an ITEMS head) for a found bin.
 */
int ts__msg_mget_head_encode(uint8_t *out, size_t cap, uint32_t n, const uint8_t *found,
                             const uint64_t *block_lens, size_t *len);
/*
 * Strict decode: n at most TS_MGET_MAX_NAMES, reserved and padding zero, every entry known, and
 * the blocks one after the other after the head, each a valid ITEMS body, nothing after them.
 */
int ts__msg_mget_rep_decode(const uint8_t *body, size_t len, ts__msg_mget_rep *m);
/*
 * Entry i (< m->n) of a decoded reply: *found, and for a found bin its block decoded into *items
 * (pointing into m->body). Walks the entries before it (O(i)). Never fails after the decoder.
 */
void ts__msg_mget_rep_get(const ts__msg_mget_rep *m, uint32_t i, int *found, ts__msg_items *items);

#endif /* TS_MSG_COORD_H */
