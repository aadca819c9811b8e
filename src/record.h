/*
 * The record codec: encoding value trees for the wire, validating received records, and decoding
 * them into read-only value trees that point into the received buffer (no tensor data copied).
 *
 * Record layout (little-endian):
 *   0  u8[4] magic      'T' 'S' 'R' 0x01
 *   4  u32   meta_len   bytes of the value tree that starts at offset 16
 *   8  u64   data_len   bytes of the data area
 *  16  meta             exactly one value (the root), meta_len bytes
 *      zero padding     up to data_start = align64(16 + meta_len)
 *      data area        data_len bytes; record length = data_start + data_len
 *
 * Values in meta: u8 type (ts_type_t), then
 *   MAP     u32 count, count x (u16 key_len, key bytes, value)
 *   LIST    u32 count, count x value
 *   TENSOR  u8 dtype, u8 ndim, u16 0, ndim x u64 dim, u64 data_off, u64 data_len
 *   INT     u64 (two's complement int64)
 *   FLOAT   u64 (IEEE-754 binary64 bits)
 *   STRING  u32 len, bytes
 *   BYTES   u64 data_off, u64 data_len
 * data_off is relative to data_start, a multiple of 64, and not below the end of the previous
 * tensor or bytes value (in tree order); data_off + data_len <= the data area. A tensor's
 * data_len equals prod(shape) * element size (overflow-checked).
 */
#ifndef TS_RECORD_H
#define TS_RECORD_H

#include "common.h"

#include <stdatomic.h>

#define TS_REC_HDR_SIZE 16
#define TS_REC_MAGIC0   'T'
#define TS_REC_MAGIC1   'S'
#define TS_REC_MAGIC2   'R'
#define TS_REC_MAGIC3   0x01

/* What validation learns about a record; decoding needs it to size its one allocation. */
typedef struct ts__rec_info {
    size_t n_nodes;      /* values in the tree */
    size_t n_children;   /* entries of all maps and lists together */
    size_t str_bytes;    /* key and string bytes, plus one NUL each */
    uint64_t data_start; /* offset of the data area */
} ts__rec_info;

/*
 * Check that buf[0..len) is a well-formed record within the limits (max_depth nesting levels,
 * max_ndim dimensions; pass TS_MAX_DEPTH and TS_MAX_NDIM for the protocol's own). Reads only
 * headers and metadata, never tensor data. Returns 0 and fills *info (may be NULL), or
 * TS_EBADRECORD. Never reads outside buf.
 */
int ts__record_validate(const uint8_t *buf, size_t len, int max_depth, int max_ndim,
                        ts__rec_info *info);

/*
 * A shared, refcounted receive buffer. Decoded values point into it; it is freed when the last
 * reference goes. free_fn(data, len) releases the memory (ts__free_aligned when NULL).
 */
typedef struct ts__rbuf {
    atomic_int refs;
    uint8_t *data;
    size_t len;
    void (*free_fn)(void *data, size_t len);
} ts__rbuf;

/* Wrap data (taken over) in a buffer with one reference; NULL on allocation failure. */
ts__rbuf *ts__rbuf_new(uint8_t *data, size_t len, void (*free_fn)(void *data, size_t len));
void ts__rbuf_ref(ts__rbuf *b);
void ts__rbuf_unref(ts__rbuf *b);

/*
 * Decode a validated record at buf->data[off .. off+len) into a read-only tree. The tree takes a
 * reference on buf and releases it in ts__record_tree_free. Returns the root or NULL (ENOMEM or
 * invalid record).
 */
ts_value_t *ts__record_decode(ts__rbuf *buf, size_t off, size_t len, int max_depth, int max_ndim);
/* Free a tree returned by ts__record_decode (pass its root). */
void ts__record_tree_free(ts_value_t *root);

/*
 * An encoding plan for a value tree: a head (record header, meta and its padding) plus the
 * tensor and bytes memory of the tree, in order, each followed by pad_after zero bytes. Writing
 * head, then each segment and its padding, produces the record: this is how a client sends
 * tensors straight from caller memory with writev.
 */
typedef struct ts__seg {
    const void *ptr;
    size_t len;
    size_t pad_after;
} ts__seg;

typedef struct ts__enc {
    uint8_t *head; /* ts__malloc'd */
    size_t head_len;
    ts__seg *segs; /* in head's allocation, after head_len bytes; NULL when nsegs == 0 */
    size_t nsegs;
    uint64_t total; /* record length */
} ts__enc;

/* 64 zero bytes, for padding iovecs. */
extern const uint8_t ts__zeros[TS__ALIGN];

/* Build the plan; TS_EINVAL for a tree beyond the protocol's limits, TS_ENOMEM. */
int ts__record_plan(const ts_value_t *root, ts__enc *e);
/* What ts__record_plan's error rc means, for a message: the limits for TS_EINVAL. */
const char *ts__record_plan_why(int rc);
void ts__enc_free(ts__enc *e);
/* Copy the planned record into out (at least e->total bytes). */
void ts__enc_copy(const ts__enc *e, uint8_t *out);

/* Encode root into one new 64-byte aligned buffer (ts__free_aligned(*out, *len)). */
int ts__record_encode(const ts_value_t *root, uint8_t **out, size_t *len);

/* Internal layout of a value; shared by value.c and record.c. */
#define TS__VF_RECEIVED  0x01 /* lives in a decoded block: read-only, freed with the block */
#define TS__VF_OWNS_DATA 0x02 /* tensor/bytes memory is ours (ts__free_aligned) */
#define TS__VF_ROOT      0x04 /* the first node of a decoded block */

struct ts_value_s {
    uint8_t type;
    uint8_t flags;
    size_t len; /* map/list entries; string/bytes length */
    size_t cap; /* built containers: allocated entries; built tensors: bytes of their memory */
    union {
        int64_t i;
        double f;
        char *str;         /* NUL-terminated */
        const void *bytes; /* BYTES */
        ts_tensor_t tensor;
        struct {
            ts_value_t **items;
            char **keys; /* maps only */
        } c;
    } u;
    /* Foreign owner of tensor memory (DLPack): release(owner) when the value is freed. */
    void (*release)(void *owner);
    void *owner;
    /*
     * Decoded values: the receive buffer the value points into (the tree holds the reference;
     * take one of your own to keep the memory past the tree). NULL for built values.
     */
    ts__rbuf *rbuf;
};

#endif /* TS_RECORD_H */
