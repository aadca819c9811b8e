/*
 * The snapshot file format: the checksum, the writer and the reader (see snapfile.h). The jobs
 * that decide when to write and what goes in, and that link a loaded file into the store, are
 * in snapshot.c.
 *
 * The file (all integers little-endian):
 *   header, 64 bytes:
 *      0 u8[8] magic "TSDSNAP\0"     8 u32 format (1 to 5)   12 u32 0
 *     16 u64 change counter          24 u64 bins             32 u64 items (of bins)
 *     40 u64 record bytes (of bins)  48 u64 wall clock, ms   56 u64 hash of bytes 0..55
 *   then per bin, in name order:
 *     u8 name_len, name, u64 version, u32 n_items, u32 flags (formats 1 to 4: 0), n_items x u64
 *     item length, u64 hash of the bin header so far;
 *     then per item: its record bytes, u64 hash of them
 *   format 5 bin flags: bit 0 a tensor bin (TENSOR_BIN), which holds exactly one item whose record
 *   is one tensor of a known dtype with 1 to 8 dims, laid out as TENSOR_BIN makes it (msg.h,
 *   ts__rows_rec_size), and is restored as a tensor bin; every other bit must be 0
 *   from format 2 on, the streams section: its header, 40 bytes:
 *      0 u8[8] magic "TSDSTRM\0"     8 u64 streams           16 u64 records (of streams)
 *     24 u64 record bytes (of streams)                       32 u64 hash of bytes 0..31
 *   then per stream, in name order:
 *     u8 name_len (1..255), name, u64 max_entries, u64 max_bytes, u32 max_age_ms, u32 window,
 *     u32 lease_ms, u32 n_groups, u64 first_id, u64 last_id, u64 hash of this header;
 *     the entry table: (last_id + 1 - first_id) rows of 24 bytes, ids first_id.. in order:
 *     u64 record length (0: a marker), u64 tag (a marker's; 0 for a record), u64 age in ms at
 *     the snapshot; u64 hash of the table;
 *     per entry whose length is not 0, in id order: its record bytes, u64 hash of them;
 *     per group: u8 name_len (1..255), name, u64 next_id, u64 lost, u32 lease_ms, u32 n_members,
 *     u64 hash of this header;
 *       per member: u8 name_len (0: the group's orphans, the entries of members that left;
 *       else 1..255), name, u32 n_pending, u32 0, u64 hash of this header; the pending table:
 *       n_pending rows of 16 bytes, ids ascending: u64 id, u32 deliveries, u32 rows_done; u64
 *       hash of the table
 *   from format 3 on, the replay tables section: its header, 40 bytes:
 *      0 u8[8] magic "TSDTABL\0"     8 u64 tables            16 u64 items (of tables)
 *     24 u64 record bytes (of tables)                        32 u64 hash of bytes 0..31
 *   then per table, in name order:
 *     u8 name_len (1..255), name, u64 capacity, u64 min_size_to_sample, f64 samples_per_insert,
 *     f64 error_buffer, f64 priority_exponent, u32 max_times_sampled, u8 remover, u8 sampler,
 *     u16 0, u64 next_key, u64 inserts, u64 samples, u64 deletes, u64 n_items, u64 hash of this
 *     header;
 *     the item table: n_items rows of 40 bytes, keys ascending: u64 key, f64 priority, u64 record
 *     length, u64 age in ms at the snapshot, u32 times_sampled, u32 0; u64 hash of the table;
 *     per item, in key order: its record bytes, u64 hash of them
 *   from format 4 on, the parameter server section: its header, 40 bytes:
 *      0 u8[8] magic "TSDPSRV\0"     8 u64 parameters        16 u64 embedding tables
 *     24 u64 rows (of tables)                                32 u64 hash of bytes 0..31
 *   then per parameter (its bin's name; in the order they were taken):
 *     u8 name_len, name, u8 optimizer, u8 mode, u8 flags, u8 0, u32 sync_k, u32 tolerance,
 *     u32 ring_n, f64 lr, f64 beta1, f64 beta2, f64 eps, u64 numel, u64 adam_t, u64 steps,
 *     u64 bin_version, u64 hash of this header;
 *     the version ring: ring_n rows of 16 bytes, oldest first: u64 version, u64 step count;
 *     u64 hash of it;
 *     per slot of its optimizer (momentum: v; Adam: m, v): numel float32, u64 hash of them
 *   then per embedding table:
 *     u8 name_len, name, u32 dim, u8 optimizer, u8 initializer, u16 0, u64 seed, u64 num_ids,
 *     f64 lr, f64 beta1, f64 beta2, f64 eps, f64 init_scale, u64 version, u64 n_rows, u64 hash
 *     of this header;
 *     the ids: n_rows int64, u64 hash of them; the rows: n_rows x dim x (1 + slots) float32 (each
 *     row its values, then its slots), u64 hash of them; Adam only: n_rows u32 step counts, u64
 *     hash of them
 *   trailer, 32 bytes:
 *      0 u8[8] magic "TSDSEND\0"     8 u64 bins              16 u64 items (of bins)
 *     24 u64 hash of every section hash above, in order, and of bytes 0..23
 * Every byte is covered by a hash. The reader checks every length and count against the bytes
 * left in the file before it reads or allocates anything, so a damaged length can neither make
 * it read out of bounds nor ask for more memory than the file holds; the file must end right
 * after the trailer. Tables of entries and pending entries are hashed apart from the headers
 * before them, so that the writer hashes and writes the tables the snapshot job built without
 * copying them again.
 */
#include "snapfile.h"
#include "names.h"

#include "msg.h"
#include "msg_ps.h"
#include "msg_table.h"
#include "proto.h"
#include "record.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define SNAP_MAGIC     "TSDSNAP"
#define SNAP_END_MAGIC "TSDSEND"
#define SNAP_SEC_MAGIC "TSDSTRM"
#define SNAP_TAB_MAGIC "TSDTABL"
#define SNAP_PS_MAGIC  "TSDPSRV"
/* Bytes of a parameter header without its name and name_len (format 4). */
#define SNAP_PARAM_FIXED 80
/* The fewest bytes a parameter takes: its header (an empty name), one ring row, the hashes. */
#define SNAP_PARAM_MIN (1 + SNAP_PARAM_FIXED + 8 + TSD_SNAP_RING_SIZE + 8)
/* Bytes of an embedding table header without its name and name_len (format 4). */
#define SNAP_EMB_FIXED 80
/* The fewest bytes a table takes: its header (an empty name) and the hashes of ids and rows. */
#define SNAP_EMB_MIN (1 + SNAP_EMB_FIXED + 8 + 8 + 8)
/* Bytes of a table header without its name: 2 u64, 3 f64, u32, 2 u8, u16, 5 u64. */
#define SNAP_TABLE_FIXED 88
/* The fewest bytes a table takes: name_len, a one-byte name, the header, its hashes. */
#define SNAP_TABLE_MIN (1 + 1 + SNAP_TABLE_FIXED + 8 + 8)
/* The fewest bytes one table item takes: its row and a record header with its hash. */
#define SNAP_TITEM_MIN (TSD_SNAP_TITEM_SIZE + TS_REC_HDR_SIZE + 8)
#define SNAP_WBUF      ((size_t)1 << 20) /* bytes; the writer's buffer for small pieces */
/* Bytes handed to one read() or write() call: Linux moves at most about 2 GiB per call. */
#define SNAP_IO_MAX ((size_t)1 << 30)
/* Bytes of a bin header without its name and item lengths: name_len, version, count, 0. */
#define SNAP_BIN_FIXED 17
/* Bytes a bin takes at least: its fixed header and its hash (an empty name, no items). */
#define SNAP_BIN_MIN (SNAP_BIN_FIXED + 8)
/* Bytes an item takes at least: its length, a record header and its hash. */
#define SNAP_ITEM_MIN (8 + TS_REC_HDR_SIZE + 8)
/* Bytes of a stream header without its name: name_len, the settings, n_groups, the two ids. */
#define SNAP_STREAM_FIXED 49
/* Bytes a stream takes at least: its header (a one-byte name), its hash, an empty table's hash. */
#define SNAP_STREAM_MIN (SNAP_STREAM_FIXED + 1 + 8 + 8)
/* Bytes a stream record takes at least: a record header and its hash. */
#define SNAP_RECORD_MIN (TS_REC_HDR_SIZE + 8)
/* Bytes of a group header without its name: name_len, next_id, lost, lease_ms, n_members. */
#define SNAP_GROUP_FIXED 25
#define SNAP_GROUP_MIN   (SNAP_GROUP_FIXED + 1 + 8)
/* Bytes of a member header without its name: name_len, n_pending, 0. */
#define SNAP_MEMBER_FIXED 9
/* Bytes a member takes at least: its header (the orphans' empty name), two hashes. */
#define SNAP_MEMBER_MIN (SNAP_MEMBER_FIXED + 8 + 8)
/* Members of a group in a file: the members a group may have, and its orphans. */
#define SNAP_MAX_MEMBERS (TS_STREAM_MAX_MEMBERS + 1)
/*
 * Bytes of the head of a tensor bin's record at most (ts__rows_rec_head_size of TS_MAX_NDIM
 * dims: the record header and the tensor's meta, 16 + 21 + 8 x 8, rounded up to 64).
 */
#define SNAP_TENSOR_HEAD_MAX 128
/* Bytes of a bin name in a message: each byte may become up to 4 (a UTF-8 sequence). */
#define SNAP_NAME_MSG (TS_MAX_NAME_LEN * 4 + 1)

_Static_assert(TS_MAX_NAME_LEN <= UINT8_MAX, "a bin name's length is one byte in the file");
_Static_assert(sizeof(SNAP_MAGIC) == 8 && sizeof(SNAP_END_MAGIC) == 8 &&
                   sizeof(SNAP_SEC_MAGIC) == 8 && sizeof(SNAP_TAB_MAGIC) == 8 &&
                   sizeof(SNAP_PS_MAGIC) == 8,
               "magics are 8 bytes");
_Static_assert(TS_STREAM_MAX_ID_LEN <= UINT8_MAX, "a group or member name's length is one byte");

/* ---------------------------------------------------------------------------------------------
 * The hash: xxHash64's structure (four lanes of multiply-rotate rounds, a final avalanche), so
 * that checking a multi-gigabyte snapshot costs a fraction of reading it.
 */
static const uint64_t P1 = 0x9E3779B185EBCA87ull;
static const uint64_t P2 = 0xC2B2AE3D27D4EB4Full;
static const uint64_t P3 = 0x165667B19E3779F9ull;
static const uint64_t P4 = 0x85EBCA77C2B2AE63ull;
static const uint64_t P5 = 0x27D4EB2F165667C5ull;

static inline uint64_t rotl64(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t h_round(uint64_t acc, uint64_t in)
{
    acc += in * P2;
    acc = rotl64(acc, 31);
    return acc * P1;
}

static inline uint64_t h_merge(uint64_t acc, uint64_t v)
{
    acc ^= h_round(0, v);
    return acc * P1 + P4;
}

uint64_t tsd_hash64(const void *data, size_t len, uint64_t seed)
{
    const uint8_t *p = data;
    const uint8_t *end = p + len;
    uint64_t h;
    if (len >= 32) {
        uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
        const uint8_t *limit = end - 32;
        do {
            v1 = h_round(v1, ts__get_u64le(p));
            v2 = h_round(v2, ts__get_u64le(p + 8));
            v3 = h_round(v3, ts__get_u64le(p + 16));
            v4 = h_round(v4, ts__get_u64le(p + 24));
            p += 32;
        } while (p <= limit);
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = h_merge(h, v1);
        h = h_merge(h, v2);
        h = h_merge(h, v3);
        h = h_merge(h, v4);
    } else {
        h = seed + P5;
    }
    h += (uint64_t)len;
    while (p + 8 <= end) {
        h ^= h_round(0, ts__get_u64le(p));
        h = rotl64(h, 27) * P1 + P4;
        p += 8;
    }
    if (p + 4 <= end) {
        h ^= (uint64_t)ts__get_u32le(p) * P1;
        h = rotl64(h, 23) * P2 + P3;
        p += 4;
    }
    while (p < end) {
        h ^= (uint64_t)(*p) * P5;
        h = rotl64(h, 11) * P1;
        p++;
    }
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

/* The trailer's running hash: fold one section hash in. */
static uint64_t chain(uint64_t acc, uint64_t h)
{
    uint8_t b[16];
    ts__put_u64le(b, acc);
    ts__put_u64le(b + 8, h);
    return tsd_hash64(b, sizeof(b), 0);
}

/* ---------------------------------------------------------------------------------------------
 * Writing
 */

static int bin_cmp(const void *a, const void *b)
{
    const tsd_snapfile_bin *x = a;
    const tsd_snapfile_bin *y = b;
    return tsd_name_cmp(x->name, x->name_len, y->name, y->name_len);
}

void tsd_snapfile_sort(tsd_snapfile_bin *bins, size_t n)
{
    if (n > 1)
        qsort(bins, n, sizeof(*bins), bin_cmp);
}

static int stream_cmp(const void *a, const void *b)
{
    const tsd_snapfile_stream *x = a;
    const tsd_snapfile_stream *y = b;
    return tsd_name_cmp(x->name, x->name_len, y->name, y->name_len);
}

void tsd_snapfile_sort_streams(tsd_snapfile_stream *streams, size_t n)
{
    if (n > 1)
        qsort(streams, n, sizeof(*streams), stream_cmp);
}

static int table_cmp(const void *a, const void *b)
{
    const tsd_snapfile_table *x = a;
    const tsd_snapfile_table *y = b;
    return tsd_name_cmp(x->name, x->name_len, y->name, y->name_len);
}

void tsd_snapfile_sort_tables(tsd_snapfile_table *tables, size_t n)
{
    if (n > 1)
        qsort(tables, n, sizeof(*tables), table_cmp);
}

typedef struct snap_writer {
    int fd;
    uint8_t *buf;
    size_t len;
    int err; /* 0, or the negated errno of the first failure; nothing is written after one */
} snap_writer;

/* Write all bytes, retrying short writes and EINTR. 0 or a negated errno. */
static int write_all(int fd, const uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n > SNAP_IO_MAX ? SNAP_IO_MAX : n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return -errno;
        if (w == 0)
            return -EIO; /* a regular file that takes nothing: treat it as an I/O error */
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static void w_flush(snap_writer *w)
{
    if (w->err != 0 || w->len == 0)
        return;
    w->err = write_all(w->fd, w->buf, w->len);
    w->len = 0;
}

/*
 * Append bytes: small ones are gathered in the buffer, large ones go straight out, after what
 * the buffer holds (a piece of half the buffer or more that still fitted beside it once went
 * out first, which put a record ahead of its own bin header in the file).
 */
static void w_put(snap_writer *w, const void *p, size_t n)
{
    if (w->err != 0)
        return;
    if (n >= SNAP_WBUF / 2 || w->len + n > SNAP_WBUF) {
        w_flush(w);
        if (w->err != 0)
            return;
    }
    if (n >= SNAP_WBUF / 2) {
        w->err = write_all(w->fd, p, n);
        return;
    }
    if (n > 0)
        memcpy(w->buf + w->len, p, n);
    w->len += n;
}

static void w_u64(snap_writer *w, uint64_t v)
{
    uint8_t b[8];
    ts__put_u64le(b, v);
    w_put(w, b, 8);
}

/* A hash of bytes that may be none (p may then be NULL). */
static uint64_t hash_of(const uint8_t *p, size_t n)
{
    static const uint8_t none[1];
    return tsd_hash64(n > 0 ? p : none, n, 0);
}

/* Write a piece and its hash, folding the hash into the trailer's. */
static void w_piece(snap_writer *w, uint64_t *acc, const uint8_t *p, size_t n)
{
    uint64_t h = hash_of(p, n);
    w_put(w, p, n);
    w_u64(w, h);
    *acc = chain(*acc, h);
}

/*
 * The start of every named header: name_len, then the name (none when name_len is 0, and the
 * pointer may then be NULL). Returns where the header's fields go.
 */
static uint8_t *put_name(uint8_t *p, const uint8_t *name, uint8_t name_len)
{
    *p++ = name_len;
    if (name_len > 0)
        memcpy(p, name, name_len);
    return p + name_len;
}

/* One group: its header, then each member's header and pending table. */
static void write_group(snap_writer *w, uint64_t *acc, const tsd_snapfile_group *g)
{
    uint8_t b[SNAP_GROUP_FIXED + UINT8_MAX];
    uint8_t *p = put_name(b, g->name, g->name_len);
    ts__put_u64le(p, g->next_id);
    ts__put_u64le(p + 8, g->lost);
    ts__put_u32le(p + 16, g->lease_ms);
    ts__put_u32le(p + 20, g->n_members);
    w_piece(w, acc, b, SNAP_GROUP_FIXED + (size_t)g->name_len);
    for (uint32_t k = 0; k < g->n_members; k++) {
        const tsd_snapfile_member *m = &g->members[k];
        p = put_name(b, m->name, m->name_len);
        ts__put_u32le(p, m->n_pend);
        ts__put_u32le(p + 4, 0);
        w_piece(w, acc, b, SNAP_MEMBER_FIXED + (size_t)m->name_len);
        w_piece(w, acc, m->pend, (size_t)m->n_pend * TSD_SNAP_PEND_SIZE);
    }
}

/* One stream: its header, entry table, records and groups. */
static void write_stream(snap_writer *w, uint64_t *acc, const tsd_snapfile_stream *st,
                         tsd_snapfile_item_fn item, void *arg)
{
    uint8_t b[SNAP_STREAM_FIXED + UINT8_MAX];
    uint8_t *p = put_name(b, st->name, st->name_len);
    ts__put_u64le(p, st->max_entries);
    ts__put_u64le(p + 8, st->max_bytes);
    ts__put_u32le(p + 16, st->max_age_ms);
    ts__put_u32le(p + 20, st->window);
    ts__put_u32le(p + 24, st->lease_ms);
    ts__put_u32le(p + 28, st->n_groups);
    ts__put_u64le(p + 32, st->first_id);
    ts__put_u64le(p + 40, st->last_id);
    w_piece(w, acc, b, SNAP_STREAM_FIXED + (size_t)st->name_len);
    size_t n = (size_t)(st->last_id + 1 - st->first_id);
    w_piece(w, acc, st->entries, n * TSD_SNAP_ENTRY_SIZE);
    size_t rec = st->first_record;
    for (size_t k = 0; k < n && w->err == 0; k++) {
        if (ts__get_u64le(st->entries + k * TSD_SNAP_ENTRY_SIZE) == 0)
            continue; /* a marker */
        const uint8_t *data;
        size_t len;
        item(arg, rec++, &data, &len);
        w_piece(w, acc, data, len);
    }
    for (uint32_t g = 0; g < st->n_groups && w->err == 0; g++)
        write_group(w, acc, &st->groups[g]);
}

/* A section's 40-byte header: magic, its three counts, the hash of those 32 bytes. */
static void write_section(snap_writer *w, uint64_t *acc, const char *magic, uint64_t n,
                          uint64_t records, uint64_t bytes)
{
    uint8_t sec[TSD_SNAP_SEC_SIZE];
    memcpy(sec, magic, 8);
    ts__put_u64le(sec + 8, n);
    ts__put_u64le(sec + 16, records);
    ts__put_u64le(sec + 24, bytes);
    uint64_t h = tsd_hash64(sec, 32, 0);
    ts__put_u64le(sec + 32, h);
    w_put(w, sec, sizeof(sec));
    *acc = chain(*acc, h);
}

/* One replay table: its header, its item table, its records. */
static void write_table(snap_writer *w, uint64_t *acc, const tsd_snapfile_table *t,
                        tsd_snapfile_item_fn item, void *arg)
{
    uint8_t hb[1 + UINT8_MAX + SNAP_TABLE_FIXED];
    uint8_t *p = put_name(hb, t->name, t->name_len);
    ts__put_u64le(p, t->capacity);
    ts__put_u64le(p + 8, t->min_size);
    ts__put_f64le(p + 16, t->spi);
    ts__put_f64le(p + 24, t->error_buffer);
    ts__put_f64le(p + 32, t->exponent);
    ts__put_u32le(p + 40, t->max_times);
    p[44] = t->remover;
    p[45] = t->sampler;
    ts__put_u16le(p + 46, 0);
    ts__put_u64le(p + 48, t->next_key);
    ts__put_u64le(p + 56, t->inserts);
    ts__put_u64le(p + 64, t->samples);
    ts__put_u64le(p + 72, t->deletes);
    ts__put_u64le(p + 80, t->n_items);
    w_piece(w, acc, hb, 1 + (size_t)t->name_len + SNAP_TABLE_FIXED);
    w_piece(w, acc, t->items, (size_t)t->n_items * TSD_SNAP_TITEM_SIZE);
    for (uint64_t k = 0; k < t->n_items && w->err == 0; k++) {
        const uint8_t *data;
        size_t len;
        item(arg, t->first_record + (size_t)k, &data, &len);
        w_piece(w, acc, data, len);
    }
}

/* One parameter: its header, ring and slots. */
static void write_param(snap_writer *w, uint64_t *acc, const tsd_snapfile_param *q)
{
    uint8_t hb[1 + UINT8_MAX + SNAP_PARAM_FIXED];
    uint8_t *p = put_name(hb, q->name, q->name_len);
    p[0] = q->opt;
    p[1] = q->mode;
    p[2] = q->flags;
    p[3] = 0;
    ts__put_u32le(p + 4, q->k);
    ts__put_u32le(p + 8, q->tolerance);
    ts__put_u32le(p + 12, q->ring_n);
    ts__put_f64le(p + 16, q->lr);
    ts__put_f64le(p + 24, q->beta1);
    ts__put_f64le(p + 32, q->beta2);
    ts__put_f64le(p + 40, q->eps);
    ts__put_u64le(p + 48, q->numel);
    ts__put_u64le(p + 56, q->adam_t);
    ts__put_u64le(p + 64, q->steps);
    ts__put_u64le(p + 72, q->bin_version);
    w_piece(w, acc, hb, 1 + (size_t)q->name_len + SNAP_PARAM_FIXED);
    w_piece(w, acc, q->ring, (size_t)q->ring_n * TSD_SNAP_RING_SIZE);
    for (uint32_t k = 0; k < tsd_snapfile_slots(q->opt); k++)
        w_piece(w, acc, (const uint8_t *)q->slot[k], (size_t)q->numel * sizeof(float));
}

/* One embedding table: its header, ids, rows and step counts. */
static void write_emb(snap_writer *w, uint64_t *acc, const tsd_snapfile_emb *t)
{
    uint8_t hb[1 + UINT8_MAX + SNAP_EMB_FIXED];
    uint8_t *p = put_name(hb, t->name, t->name_len);
    ts__put_u32le(p, t->dim);
    p[4] = t->opt;
    p[5] = t->init;
    ts__put_u16le(p + 6, 0);
    ts__put_u64le(p + 8, t->seed);
    ts__put_u64le(p + 16, t->num_ids);
    ts__put_f64le(p + 24, t->lr);
    ts__put_f64le(p + 32, t->beta1);
    ts__put_f64le(p + 40, t->beta2);
    ts__put_f64le(p + 48, t->eps);
    ts__put_f64le(p + 56, t->init_scale);
    ts__put_u64le(p + 64, t->version);
    ts__put_u64le(p + 72, t->n_rows);
    w_piece(w, acc, hb, 1 + (size_t)t->name_len + SNAP_EMB_FIXED);
    size_t n = (size_t)t->n_rows;
    size_t stride = (size_t)t->dim * (1 + tsd_snapfile_slots(t->opt));
    w_piece(w, acc, (const uint8_t *)t->ids, n * sizeof(int64_t));
    w_piece(w, acc, (const uint8_t *)t->rows, n * stride * sizeof(float));
    if (t->opt == TS_PS_OPT_ADAM)
        w_piece(w, acc, (const uint8_t *)t->steps, n * sizeof(uint32_t));
}

int tsd_snapfile_write(int fd, const tsd_snapfile_head *head, const tsd_snapfile_bin *bins,
                       const tsd_snapfile_stream *streams, tsd_snapfile_item_fn item, void *arg)
{
    if (head->n_tables != 0)
        return -EINVAL;
    return tsd_snapfile_write_all(fd, head, bins, streams, NULL, item, arg);
}

int tsd_snapfile_write_all(int fd, const tsd_snapfile_head *head, const tsd_snapfile_bin *bins,
                           const tsd_snapfile_stream *streams, const tsd_snapfile_table *tables,
                           tsd_snapfile_item_fn item, void *arg)
{
    return tsd_snapfile_write_ps(fd, head, bins, streams, tables, NULL, item, arg);
}

int tsd_snapfile_write_ps(int fd, const tsd_snapfile_head *head, const tsd_snapfile_bin *bins,
                          const tsd_snapfile_stream *streams, const tsd_snapfile_table *tables,
                          const tsd_snapfile_ps *ps, tsd_snapfile_item_fn item, void *arg)
{
    uint32_t format = head->format != 0 ? head->format : TSD_SNAP_FORMAT;
    size_t n_params = ps != NULL ? ps->n_params : 0, n_embs = ps != NULL ? ps->n_embs : 0;
    if (format < TSD_SNAP_FORMAT_MIN || format > TSD_SNAP_FORMAT ||
        (format == 1 && head->n_streams != 0) || (format < 3 && head->n_tables != 0) ||
        (format < 4 && (n_params != 0 || n_embs != 0)))
        return -EINVAL;
    for (size_t b = 0; b < head->n_bins; b++)
        if ((bins[b].flags & ~TSD_SNAP_BIN_KNOWN) != 0 ||
            (format < TSD_SNAP_FORMAT_FLAGS && bins[b].flags != 0))
            return -EINVAL;
    snap_writer w = {.fd = fd};
    w.buf = ts__malloc(SNAP_WBUF);
    if (w.buf == NULL)
        return -ENOMEM;

    uint8_t hdr[TSD_SNAP_HDR_SIZE];
    memset(hdr, 0, sizeof(hdr));
    memcpy(hdr, SNAP_MAGIC, sizeof(SNAP_MAGIC));
    ts__put_u32le(hdr + 8, format);
    ts__put_u64le(hdr + 16, head->counter);
    ts__put_u64le(hdr + 24, head->n_bins);
    ts__put_u64le(hdr + 32, head->n_items);
    ts__put_u64le(hdr + 40, head->bytes);
    ts__put_u64le(hdr + 48, head->wall_ms);
    uint64_t h = tsd_hash64(hdr, 56, 0);
    ts__put_u64le(hdr + 56, h);
    w_put(&w, hdr, sizeof(hdr));
    uint64_t acc = chain(0, h);

    /* The bin header's fixed part plus the largest item list, hashed as one piece. */
    uint8_t *bh = NULL;
    size_t bh_cap = 0;
    for (size_t b = 0; b < head->n_bins && w.err == 0; b++) {
        const tsd_snapfile_bin *sb = &bins[b];
        size_t need = SNAP_BIN_FIXED + (size_t)sb->name_len + (size_t)sb->n_items * 8;
        if (need > bh_cap) {
            uint8_t *nb = ts__realloc(bh, need);
            if (nb == NULL) {
                w.err = -ENOMEM;
                break;
            }
            bh = nb;
            bh_cap = need;
        }
        uint8_t *p = put_name(bh, sb->name, sb->name_len);
        ts__put_u64le(p, sb->version);
        ts__put_u32le(p + 8, sb->n_items);
        ts__put_u32le(p + 12, sb->flags);
        p += 16;
        for (uint32_t i = 0; i < sb->n_items; i++, p += 8) {
            const uint8_t *data;
            size_t len;
            item(arg, sb->first + i, &data, &len);
            ts__put_u64le(p, len);
        }
        w_piece(&w, &acc, bh, need);
        for (uint32_t i = 0; i < sb->n_items; i++) {
            const uint8_t *data;
            size_t len;
            item(arg, sb->first + i, &data, &len);
            w_piece(&w, &acc, data, len);
        }
    }
    ts__free(bh);

    if (format >= 2) {
        write_section(&w, &acc, SNAP_SEC_MAGIC, head->n_streams, head->n_records,
                      head->stream_bytes);
        for (uint64_t k = 0; k < head->n_streams && w.err == 0; k++)
            write_stream(&w, &acc, &streams[k], item, arg);
    }

    if (format >= 3) {
        write_section(&w, &acc, SNAP_TAB_MAGIC, head->n_tables, head->n_titems, head->table_bytes);
        for (uint64_t k = 0; k < head->n_tables && w.err == 0; k++)
            write_table(&w, &acc, &tables[k], item, arg);
    }

    if (format >= 4) {
        uint64_t rows = 0;
        for (size_t k = 0; k < n_embs; k++)
            rows += ps->embs[k].n_rows;
        write_section(&w, &acc, SNAP_PS_MAGIC, n_params, n_embs, rows);
        for (size_t k = 0; k < n_params && w.err == 0; k++)
            write_param(&w, &acc, &ps->params[k]);
        for (size_t k = 0; k < n_embs && w.err == 0; k++)
            write_emb(&w, &acc, &ps->embs[k]);
    }

    uint8_t end[TSD_SNAP_END_SIZE];
    memcpy(end, SNAP_END_MAGIC, sizeof(SNAP_END_MAGIC));
    ts__put_u64le(end + 8, head->n_bins);
    ts__put_u64le(end + 16, head->n_items);
    ts__put_u64le(end + 24, chain(acc, tsd_hash64(end, 24, 0)));
    w_put(&w, end, sizeof(end));
    w_flush(&w);
    ts__free(w.buf);
    return w.err;
}

/* ---------------------------------------------------------------------------------------------
 * Reading
 */

typedef struct snap_reader {
    int fd;             /* the file, or -1 when reading mem */
    const uint8_t *mem; /* the file's bytes, when reading from memory */
    uint64_t left;      /* bytes of the file not yet read */
    const char *label;
    const tsd_snapfile_sink *sink;
    char *err;
    size_t err_cap;
    int rc;          /* what the reader returns when it fails */
    uint32_t format; /* the file's, once its header is read */
} snap_reader;

static void fail(snap_reader *r, int rc, const char *kind, const char *fmt, va_list ap)
{
    char msg[600];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    snprintf(r->err, r->err_cap, "snapshot %s%s%s", r->label, kind, msg);
    r->rc = rc;
}

/* Something the file says is wrong. -1. */
static int bad(snap_reader *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int bad(snap_reader *r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fail(r, TS_EPROTO, " is damaged: ", fmt, ap);
    va_end(ap);
    return -1;
}

/* A length that points past the end: the file was cut short, or a length was damaged. -1. */
static int cut(snap_reader *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int cut(snap_reader *r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fail(r, TS_EPROTO, " is truncated or damaged: ", fmt, ap);
    va_end(ap);
    return -1;
}

/* Anything else: out of memory, a failed read. -1. */
static int other(snap_reader *r, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int other(snap_reader *r, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fail(r, rc, ": ", fmt, ap);
    va_end(ap);
    return -1;
}

/* Read exactly n bytes; -1 with a message naming what was being read. */
static int r_read(snap_reader *r, void *dst, size_t n, const char *what)
{
    if (n > r->left) {
        snprintf(r->err, r->err_cap,
                 "snapshot %s is truncated: %s needs %zu bytes, only %llu remain", r->label, what,
                 n, (unsigned long long)r->left);
        r->rc = TS_EPROTO;
        return -1;
    }
    if (r->mem != NULL) {
        if (n > 0)
            memcpy(dst, r->mem, n);
        r->mem += n;
        r->left -= n;
        return 0;
    }
    uint8_t *p = dst;
    size_t got = 0;
    while (got < n) {
        ssize_t k = read(r->fd, p + got, n - got > SNAP_IO_MAX ? SNAP_IO_MAX : n - got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return other(r, -errno, "reading %s: %s", what, strerror(errno));
        if (k == 0) /* the file shrank since its size was taken */
            return other(r, TS_EPROTO, "reading %s: unexpected end of file", what);
        got += (size_t)k;
    }
    r->left -= n;
    return 0;
}

/* name as it appears in messages. */
static void printable(const snap_reader *r, const uint8_t *name, size_t len, char *out, size_t cap)
{
    if (r->sink->name_printable != NULL) {
        r->sink->name_printable(name, len, out, cap);
        return;
    }
    size_t o = 0;
    for (size_t i = 0; i < len && o + 1 < cap; i++)
        out[o++] = name[i] >= 0x20 && name[i] < 0x7F ? (char)name[i] : '?';
    out[o] = '\0';
}

/* What the reader has met so far, checked against the header at the end. */
typedef struct snap_count {
    uint64_t items_total; /* the header's item count */
    uint64_t counter;     /* the header's change counter: no bin's version is above it */
    uint64_t items_seen;
    uint64_t bytes_seen;
    uint64_t acc; /* the trailer's running hash */
    uint8_t *hb;  /* the current bin's header, grown as needed */
    size_t hb_cap;
    /* Streams: the section's record count, and what the streams held so far. */
    uint64_t recs_total, recs_seen, sbytes_seen;
    /* Replay tables: the section's item count, and what the tables held so far. */
    uint64_t titems_total, titems_seen, tbytes_seen;
    /* The parameter server: the section's row count, and the rows of tables so far. */
    uint64_t rows_total, rows_seen;
    uint8_t *tb; /* the current stream's entry table */
    size_t tb_cap;
    /* The current stream's group names so far (each name_len bytes at its offset in gnames). */
    uint8_t *gnames;
    size_t gnames_len, gnames_cap;
    size_t goff[TS_STREAM_MAX_GROUPS];
    uint8_t glen[TS_STREAM_MAX_GROUPS];
    uint32_t n_gnames;
    /* The current group: its members, their names and pending tables, offsets into those. */
    tsd_snapfile_member *mem; /* SNAP_MAX_MEMBERS of them, allocated at the first group */
    size_t *moff, *poff;
    uint8_t *mnames;
    size_t mnames_len, mnames_cap;
    uint8_t *pend;
    size_t pend_len, pend_cap;
    uint64_t *ids; /* every pending id of the group, sorted to find one pending twice */
    size_t ids_cap;
} snap_count;

static void count_free(snap_count *c)
{
    ts__free(c->hb);
    ts__free(c->tb);
    ts__free(c->gnames);
    ts__free(c->mem);
    ts__free(c->moff);
    ts__free(c->poff);
    ts__free(c->mnames);
    ts__free(c->pend);
    ts__free(c->ids);
}

/*
 * Room for need bytes in *buf (capacity *cap), at least doubling. The caller has checked that
 * what grows is no more than the file's bytes still to be read. 0 or -1 (out of memory).
 */
static int r_grow(snap_reader *r, void **buf, size_t *cap, size_t need)
{
    if (need <= *cap && *buf != NULL)
        return 0;
    size_t want = *cap * 2 > need ? *cap * 2 : need;
    if (want == 0)
        want = 1;
    void *nb = ts__realloc(*buf, want);
    if (nb == NULL)
        return other(r, TS_ENOMEM, "out of memory loading it");
    *buf = nb;
    *cap = want;
    return 0;
}

/*
 * 1 when rec (len bytes, a valid record) is what a tensor bin holds: a root that is one tensor of
 * a known dtype with 1 to TS_MAX_NDIM dims, laid out exactly as TENSOR_BIN lays it out (its head
 * byte for byte, then the data to the record's end), which is what WRITE_ROWS writes into.
 */
static int tensor_record(const uint8_t *rec, size_t len)
{
    /* The meta after the record header: type, dtype, ndim, 2 reserved, the dims. */
    if (len < TS_REC_HDR_SIZE + 3)
        return 0;
    const uint8_t *meta = rec + TS_REC_HDR_SIZE;
    uint8_t dtype = meta[1];
    unsigned ndim = meta[2];
    if (ndim < 1 || ndim > TS_MAX_NDIM || ts_dtype_size((ts_dtype_t)dtype) == 0)
        return 0;
    size_t head = ts__rows_rec_head_size(ndim);
    uint8_t want[SNAP_TENSOR_HEAD_MAX];
    if (head > sizeof(want) || head > len)
        return 0;
    uint64_t dims[TS_MAX_NDIM];
    for (unsigned i = 0; i < ndim; i++)
        dims[i] = ts__get_u64le(meta + 5 + (size_t)i * 8);
    uint64_t size;
    if (ts__rows_rec_size(dtype, ndim, dims, &size) != 0 || size != len)
        return 0;
    ts__rows_rec_head_write(want, dtype, ndim, dims, len - head);
    return memcmp(want, rec, head) == 0;
}

/* Read and check one bin (header, item lengths, items), handing it to the sink. 0 or -1. */
static int read_bin(snap_reader *r, snap_count *c, uint64_t index)
{
    uint8_t fixed[SNAP_BIN_FIXED + TS_MAX_NAME_LEN];
    char what[64];
    snprintf(what, sizeof(what), "the header of bin %llu", (unsigned long long)index);
    if (r_read(r, fixed, 1, what) != 0)
        return -1;
    size_t nl = fixed[0];
    if (r_read(r, fixed + 1, nl + 16, what) != 0)
        return -1;
    uint32_t n = ts__get_u32le(fixed + 1 + nl + 8);
    /*
     * Each item needs its length, a record header and a hash, and the bin its own hash: check
     * before allocating the list.
     */
    if (n > c->items_total - c->items_seen || (uint64_t)n * SNAP_ITEM_MIN + 8 > r->left)
        return cut(r, "bin %llu claims %u items, more than the rest of the file can hold",
                   (unsigned long long)index, n);
    size_t hlen = SNAP_BIN_FIXED + nl + (size_t)n * 8;
    if (hlen > c->hb_cap) {
        uint8_t *nb = ts__realloc(c->hb, hlen);
        if (nb == NULL)
            return other(r, TS_ENOMEM, "out of memory loading it");
        c->hb = nb;
        c->hb_cap = hlen;
    }
    uint8_t *hb = c->hb;
    memcpy(hb, fixed, SNAP_BIN_FIXED + nl);
    uint8_t hash[8];
    if (r_read(r, hb + SNAP_BIN_FIXED + nl, (size_t)n * 8, what) != 0 ||
        r_read(r, hash, 8, what) != 0)
        return -1;
    uint64_t h = tsd_hash64(hb, hlen, 0);
    if (h != ts__get_u64le(hash))
        return bad(r, "checksum mismatch in the header of bin %llu", (unsigned long long)index);
    const uint8_t *name = hb + 1;
    char pn[SNAP_NAME_MSG];
    printable(r, name, nl, pn, sizeof(pn));
    uint32_t flags = ts__get_u32le(hb + 1 + nl + 12);
    if (r->format < TSD_SNAP_FORMAT_FLAGS && flags != 0)
        return bad(r, "bin '%s': a reserved field is not 0", pn);
    if ((flags & ~TSD_SNAP_BIN_KNOWN) != 0)
        return bad(r, "bin '%s': unknown flags 0x%x", pn, (unsigned)(flags & ~TSD_SNAP_BIN_KNOWN));
    c->acc = chain(c->acc, h);
    uint64_t version = ts__get_u64le(hb + 1 + nl);
    /* Every version was taken from the counter the header saved: a greater one would repeat. */
    if (version > c->counter)
        return bad(r, "bin '%s' has version %llu, above the file's change counter %llu", pn,
                   (unsigned long long)version, (unsigned long long)c->counter);
    int tensor = (flags & TSD_SNAP_BIN_TENSOR) != 0;
    if (tensor && n != 1)
        return bad(r, "bin '%s' is marked a tensor bin but holds %u items, not 1", pn, n);
    /* The whole item list first: no allocation for a bin whose lengths cannot all fit. */
    uint64_t need = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t len = ts__get_u64le(hb + SNAP_BIN_FIXED + nl + (size_t)i * 8);
        if (len > r->left || len < TS_REC_HDR_SIZE || len + 8 > r->left - need)
            return cut(r, "item %u of bin '%s' claims %llu bytes (%llu remain in the file)", i, pn,
                       (unsigned long long)len, (unsigned long long)(r->left - need));
        need += len + 8;
    }
    if (r->sink->bin(r->sink->arg, name, nl, version, n, flags) != 0)
        return other(r, TS_ENOMEM, "out of memory loading it");
    for (uint32_t i = 0; i < n; i++) {
        size_t len = (size_t)ts__get_u64le(hb + SNAP_BIN_FIXED + nl + (size_t)i * 8);
        uint8_t *data = r->sink->item(r->sink->arg, len);
        if (data == NULL)
            return other(r, TS_ENOMEM, "out of memory loading a %zu-byte item", len);
        snprintf(what, sizeof(what), "item %u of bin %llu", i, (unsigned long long)index);
        if (r_read(r, data, len, what) != 0 || r_read(r, hash, 8, what) != 0)
            return -1;
        h = tsd_hash64(data, len, 0);
        if (h != ts__get_u64le(hash))
            return bad(r, "checksum mismatch in item %u of bin '%s'", i, pn);
        /* The validator and limits a PUT of this record meets. */
        if (ts__record_validate(data, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL) != 0)
            return bad(r, "item %u of bin '%s' is not a valid record", i, pn);
        if (tensor && !tensor_record(data, len))
            return bad(r,
                       "bin '%s' is marked a tensor bin but its record is not one tensor of a "
                       "known dtype with 1 to %d dims laid out as TENSOR_BIN makes it",
                       pn, TS_MAX_NDIM);
        c->acc = chain(c->acc, h);
        c->items_seen++;
        c->bytes_seen += len;
    }
    return 0;
}

/* What a group's checks need to know of its stream. */
typedef struct snap_in_stream {
    uint64_t first_id, last_id;
    const char *pn; /* its name, printable */
} snap_in_stream;

/* Read a piece of n bytes into p and its hash; check the hash and fold it in. 0 or -1. */
static int read_hashed(snap_reader *r, snap_count *c, uint8_t *p, size_t n, const char *what)
{
    uint8_t hash[8];
    if (r_read(r, p, n, what) != 0 || r_read(r, hash, 8, what) != 0)
        return -1;
    uint64_t h = hash_of(p, n);
    if (h != ts__get_u64le(hash))
        return bad(r, "checksum mismatch in %s", what);
    c->acc = chain(c->acc, h);
    return 0;
}

/*
 * Read a header that starts with its name: name_len, the name, then rest bytes of fields, into
 * fx (room for 1 + 255 + rest), with the hash of all of it; check the hash and fold it in.
 * Returns the name's length, or -1.
 */
static int read_named(snap_reader *r, snap_count *c, uint8_t *fx, size_t rest, const char *what)
{
    if (r_read(r, fx, 1, what) != 0)
        return -1;
    size_t nl = fx[0];
    if (r_read(r, fx + 1, nl + rest, what) != 0)
        return -1;
    uint8_t hash[8];
    if (r_read(r, hash, 8, what) != 0)
        return -1;
    uint64_t h = tsd_hash64(fx, 1 + nl + rest, 0);
    if (h != ts__get_u64le(hash))
        return bad(r, "checksum mismatch in %s", what);
    c->acc = chain(c->acc, h);
    return (int)nl;
}

static int u64_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* One member of a group into c's member buffers (k-th). 0 or -1. */
static int read_member(snap_reader *r, snap_count *c, const snap_in_stream *in, const char *gpn,
                       uint64_t next_id, uint32_t k, int *orphans)
{
    char what[2 * SNAP_NAME_MSG + 96];
    uint8_t mh[SNAP_MEMBER_FIXED + UINT8_MAX];
    snprintf(what, sizeof(what), "the header of member %u of group '%s' of stream '%s'", k, gpn,
             in->pn);
    int got = read_named(r, c, mh, SNAP_MEMBER_FIXED - 1, what);
    if (got < 0)
        return -1;
    size_t nl = (size_t)got;
    uint32_t n_pend = ts__get_u32le(mh + 1 + nl);
    if (ts__get_u32le(mh + 1 + nl + 4) != 0)
        return bad(r, "member %u of group '%s' of stream '%s': a reserved field is not 0", k, gpn,
                   in->pn);
    if (nl == 0 && (*orphans)++ > 0)
        return bad(r, "group '%s' of stream '%s' lists its orphaned entries twice", gpn, in->pn);
    /* Pending ids are distinct ids below next_id: never more than the ids handed out. */
    if (n_pend > next_id - in->first_id)
        return bad(r,
                   "member %u of group '%s' of stream '%s' has %u pending entries, more than "
                   "the %llu ids handed out",
                   k, gpn, in->pn, n_pend, (unsigned long long)(next_id - in->first_id));
    size_t tlen = (size_t)n_pend * TSD_SNAP_PEND_SIZE;
    if (tlen + 8 > r->left)
        return cut(r, "member %u of group '%s' of stream '%s' claims %u pending entries", k, gpn,
                   in->pn, n_pend);
    if (r_grow(r, (void **)&c->mnames, &c->mnames_cap, c->mnames_len + nl) != 0 ||
        r_grow(r, (void **)&c->pend, &c->pend_cap, c->pend_len + tlen) != 0)
        return -1;
    if (nl > 0)
        memcpy(c->mnames + c->mnames_len, mh + 1, nl);
    c->moff[k] = c->mnames_len;
    c->mnames_len += nl;
    c->poff[k] = c->pend_len;
    snprintf(what, sizeof(what), "the pending entries of member %u of group '%s' of stream '%s'", k,
             gpn, in->pn);
    uint8_t *table = c->pend + c->pend_len;
    if (read_hashed(r, c, table, tlen, what) != 0)
        return -1;
    uint64_t prev = 0;
    for (uint32_t i = 0; i < n_pend; i++) {
        uint64_t id;
        uint32_t deliveries, rows_done;
        tsd_snapfile_pend_get(table, i, &id, &deliveries, &rows_done);
        if (id < in->first_id || id >= next_id || id <= prev)
            return bad(r,
                       "member %u of group '%s' of stream '%s': pending id %llu is not above the "
                       "one before it inside [first_id %llu, next_id %llu)",
                       k, gpn, in->pn, (unsigned long long)id, (unsigned long long)in->first_id,
                       (unsigned long long)next_id);
        prev = id;
    }
    c->pend_len += tlen;
    c->mem[k] = (tsd_snapfile_member){.n_pend = n_pend, .name_len = (uint8_t)nl};
    return 0;
}

/*
 * One group of a stream, whole, checked, then handed to the sink. Names are compared one
 * against another: at most 1024 groups and 1025 members bound the work (the server's own
 * look-ups of them are linear too).
 */
static int read_group(snap_reader *r, snap_count *c, const snap_in_stream *in, uint32_t gi)
{
    char what[SNAP_NAME_MSG + 64];
    uint8_t fx[SNAP_GROUP_FIXED + UINT8_MAX];
    snprintf(what, sizeof(what), "the header of group %u of stream '%s'", gi, in->pn);
    int got = read_named(r, c, fx, SNAP_GROUP_FIXED - 1, what);
    if (got < 0)
        return -1;
    size_t nl = (size_t)got;
    if (nl == 0)
        return bad(r, "group %u of stream '%s' has an empty name", gi, in->pn);
    const uint8_t *name = fx + 1;
    const uint8_t *q = fx + 1 + nl;
    tsd_snapfile_group g = {.name = name,
                            .name_len = (uint8_t)nl,
                            .next_id = ts__get_u64le(q),
                            .lost = ts__get_u64le(q + 8),
                            .lease_ms = ts__get_u32le(q + 16),
                            .n_members = ts__get_u32le(q + 20)};
    char gpn[SNAP_NAME_MSG];
    printable(r, name, nl, gpn, sizeof(gpn));
    if (g.next_id < in->first_id || g.next_id > in->last_id + 1)
        return bad(r, "group '%s' of stream '%s': next_id %llu is outside [%llu, %llu]", gpn,
                   in->pn, (unsigned long long)g.next_id, (unsigned long long)in->first_id,
                   (unsigned long long)(in->last_id + 1));
    if (g.lease_ms < 1 || g.lease_ms > TS_STREAM_MAX_LEASE_MS)
        return bad(r, "group '%s' of stream '%s': lease_ms %u is out of range", gpn, in->pn,
                   g.lease_ms);
    if (g.n_members > SNAP_MAX_MEMBERS)
        return bad(r, "group '%s' of stream '%s' has %u members, more than %u", gpn, in->pn,
                   g.n_members, SNAP_MAX_MEMBERS);
    if ((uint64_t)g.n_members * SNAP_MEMBER_MIN > r->left)
        return cut(r, "group '%s' of stream '%s' claims %u members", gpn, in->pn, g.n_members);
    for (uint32_t j = 0; j < c->n_gnames; j++)
        if (c->glen[j] == nl && memcmp(c->gnames + c->goff[j], name, nl) == 0)
            return bad(r, "group '%s' appears twice in stream '%s'", gpn, in->pn);
    if (r_grow(r, (void **)&c->gnames, &c->gnames_cap, c->gnames_len + nl) != 0)
        return -1;
    memcpy(c->gnames + c->gnames_len, name, nl);
    c->goff[c->n_gnames] = c->gnames_len;
    c->glen[c->n_gnames++] = (uint8_t)nl;
    c->gnames_len += nl;

    if (c->mem == NULL) {
        c->mem = ts__calloc(SNAP_MAX_MEMBERS, sizeof(*c->mem));
        c->moff = ts__calloc(SNAP_MAX_MEMBERS, sizeof(*c->moff));
        c->poff = ts__calloc(SNAP_MAX_MEMBERS, sizeof(*c->poff));
        if (c->mem == NULL || c->moff == NULL || c->poff == NULL)
            return other(r, TS_ENOMEM, "out of memory loading it");
    }
    c->mnames_len = c->pend_len = 0;
    int orphans = 0;
    uint64_t total = 0;
    uint32_t with_pend = 0;
    for (uint32_t k = 0; k < g.n_members; k++) {
        if (read_member(r, c, in, gpn, g.next_id, k, &orphans) != 0)
            return -1;
        total += c->mem[k].n_pend;
        with_pend += c->mem[k].n_pend > 0;
    }
    /* The buffers stop moving now: point the members into them. */
    for (uint32_t k = 0; k < g.n_members; k++) {
        c->mem[k].name = c->mnames + c->moff[k];
        c->mem[k].pend = c->pend + c->poff[k];
    }
    for (uint32_t k = 1; k < g.n_members; k++) {
        const tsd_snapfile_member *m = &c->mem[k];
        for (uint32_t j = 0; j < k && m->name_len > 0; j++)
            if (c->mem[j].name_len == m->name_len &&
                memcmp(c->mem[j].name, m->name, m->name_len) == 0) {
                char mpn[SNAP_NAME_MSG];
                printable(r, m->name, m->name_len, mpn, sizeof(mpn));
                return bad(r, "member '%s' appears twice in group '%s' of stream '%s'", mpn, gpn,
                           in->pn);
            }
    }
    /* An entry is pending with one member of a group at most (each list is sorted already). */
    if (with_pend > 1) {
        if (total > g.next_id - in->first_id)
            return bad(r,
                       "group '%s' of stream '%s' has %llu pending entries, more than the %llu "
                       "ids handed out",
                       gpn, in->pn, (unsigned long long)total,
                       (unsigned long long)(g.next_id - in->first_id));
        if (r_grow(r, (void **)&c->ids, &c->ids_cap, (size_t)total * sizeof(uint64_t)) != 0)
            return -1;
        size_t n = 0;
        for (uint32_t k = 0; k < g.n_members; k++)
            for (uint32_t i = 0; i < c->mem[k].n_pend; i++) {
                uint32_t d, rd;
                tsd_snapfile_pend_get(c->mem[k].pend, i, &c->ids[n++], &d, &rd);
            }
        qsort(c->ids, n, sizeof(*c->ids), u64_cmp);
        for (size_t i = 1; i < n; i++)
            if (c->ids[i] == c->ids[i - 1])
                return bad(r, "group '%s' of stream '%s': entry %llu is pending twice", gpn, in->pn,
                           (unsigned long long)c->ids[i]);
    }
    g.members = c->mem;
    if (r->sink->group(r->sink->arg, &g) != 0)
        return other(r, TS_ENOMEM, "out of memory loading it");
    return 0;
}

/* One stream: header, entry table, records, groups. 0 or -1. */
static int read_stream(snap_reader *r, snap_count *c, uint64_t index)
{
    char what[SNAP_NAME_MSG + 64];
    uint8_t fx[SNAP_STREAM_FIXED + UINT8_MAX];
    snprintf(what, sizeof(what), "the header of stream %llu", (unsigned long long)index);
    int got = read_named(r, c, fx, SNAP_STREAM_FIXED - 1, what);
    if (got < 0)
        return -1;
    size_t nl = (size_t)got;
    if (nl == 0)
        return bad(r, "stream %llu has an empty name", (unsigned long long)index);
    const uint8_t *q = fx + 1 + nl;
    tsd_snapfile_stream st = {.name = fx + 1,
                              .name_len = (uint8_t)nl,
                              .max_entries = ts__get_u64le(q),
                              .max_bytes = ts__get_u64le(q + 8),
                              .max_age_ms = ts__get_u32le(q + 16),
                              .window = ts__get_u32le(q + 20),
                              .lease_ms = ts__get_u32le(q + 24),
                              .n_groups = ts__get_u32le(q + 28),
                              .first_id = ts__get_u64le(q + 32),
                              .last_id = ts__get_u64le(q + 40)};
    char pn[SNAP_NAME_MSG];
    printable(r, st.name, nl, pn, sizeof(pn));
    /* The settings STREAM_CREATE accepts. */
    if (st.max_entries < 1 || st.max_entries > TS_STREAM_MAX_ENTRIES ||
        st.window > st.max_entries || st.lease_ms < 1 || st.lease_ms > TS_STREAM_MAX_LEASE_MS)
        return bad(r,
                   "stream '%s': a setting is out of range (max_entries %llu, window %u, "
                   "lease_ms %u)",
                   pn, (unsigned long long)st.max_entries, st.window, st.lease_ms);
    /* Ids start at 1 and are dense: the kept ones are first_id..last_id, maybe none. */
    if (st.first_id < 1 || st.last_id == UINT64_MAX || st.last_id < st.first_id - 1)
        return bad(r, "stream '%s': first_id %llu and last_id %llu break the id rules", pn,
                   (unsigned long long)st.first_id, (unsigned long long)st.last_id);
    uint64_t n = st.last_id + 1 - st.first_id;
    if (n > TS_STREAM_MAX_ENTRIES)
        return bad(r, "stream '%s' keeps %llu entries, more than %llu", pn, (unsigned long long)n,
                   (unsigned long long)TS_STREAM_MAX_ENTRIES);
    if (st.n_groups > TS_STREAM_MAX_GROUPS)
        return bad(r, "stream '%s' has %u groups, more than %u", pn, st.n_groups,
                   TS_STREAM_MAX_GROUPS);
    size_t tlen = (size_t)n * TSD_SNAP_ENTRY_SIZE;
    if (tlen + 8 > r->left)
        return cut(r, "stream '%s' claims %llu entries, more than the rest of the file can hold",
                   pn, (unsigned long long)n);
    if (r_grow(r, (void **)&c->tb, &c->tb_cap, tlen) != 0)
        return -1;
    snprintf(what, sizeof(what), "the entries of stream '%s'", pn);
    if (read_hashed(r, c, c->tb, tlen, what) != 0)
        return -1;
    /* Every record's length against the rest of the file before any is asked for. */
    uint64_t need = 0;
    for (uint64_t k = 0; k < n; k++) {
        uint64_t len, tag, age;
        tsd_snapfile_entry_get(c->tb, (size_t)k, &len, &tag, &age);
        if (len == 0)
            continue; /* a marker */
        if (tag != 0)
            return bad(r, "entry %llu of stream '%s' is a record with a tag",
                       (unsigned long long)(st.first_id + k), pn);
        if (len < TS_REC_HDR_SIZE || len > r->left || len + 8 > r->left - need)
            return cut(r, "entry %llu of stream '%s' claims %llu bytes (%llu remain in the file)",
                       (unsigned long long)(st.first_id + k), pn, (unsigned long long)len,
                       (unsigned long long)(r->left - need));
        need += len + 8;
        st.n_records++;
    }
    if (st.n_records > c->recs_total - c->recs_seen)
        return bad(r, "stream '%s' holds more records than the streams section claims", pn);
    if ((uint64_t)st.n_groups * SNAP_GROUP_MIN > r->left - need)
        return cut(r, "stream '%s' claims %u groups, more than the rest of the file can hold", pn,
                   st.n_groups);
    if (r->sink->stream == NULL || r->sink->record == NULL || r->sink->group == NULL)
        return other(r, TS_EINVAL, "it holds streams, which this reader does not take");
    st.entries = c->tb;
    if (r->sink->stream(r->sink->arg, &st) != 0)
        return other(r, TS_ENOMEM, "out of memory loading it");
    for (uint64_t k = 0; k < n; k++) {
        uint64_t len, tag, age;
        tsd_snapfile_entry_get(c->tb, (size_t)k, &len, &tag, &age);
        if (len == 0)
            continue;
        uint64_t id = st.first_id + k;
        uint8_t *data = r->sink->record(r->sink->arg, (size_t)len);
        if (data == NULL)
            return other(r, TS_ENOMEM, "out of memory loading a %llu-byte entry",
                         (unsigned long long)len);
        snprintf(what, sizeof(what), "entry %llu of stream '%s'", (unsigned long long)id, pn);
        if (read_hashed(r, c, data, (size_t)len, what) != 0)
            return -1;
        /* The validator and limits a STREAM_APPEND of this record meets. */
        if (ts__record_validate(data, (size_t)len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL) != 0)
            return bad(r, "entry %llu of stream '%s' is not a valid record", (unsigned long long)id,
                       pn);
        c->recs_seen++;
        c->sbytes_seen += len;
    }
    snap_in_stream in = {.first_id = st.first_id, .last_id = st.last_id, .pn = pn};
    c->n_gnames = 0;
    c->gnames_len = 0;
    for (uint32_t g = 0; g < st.n_groups; g++)
        if (read_group(r, c, &in, g) != 0)
            return -1;
    return 0;
}

/*
 * A section's 40-byte header (the streams', the tables'): its magic, its hash (folded in), and
 * its three counts: what it holds, its records, their bytes. 0 or -1.
 */
static int read_section(snap_reader *r, snap_count *c, const char *magic, const char *what,
                        uint64_t counts[3])
{
    uint8_t sec[TSD_SNAP_SEC_SIZE];
    if (r_read(r, sec, sizeof(sec), what) != 0)
        return -1;
    if (memcmp(sec, magic, 8) != 0)
        return bad(r, "%s is missing (bad magic)", what);
    uint64_t h = tsd_hash64(sec, 32, 0);
    if (h != ts__get_u64le(sec + 32))
        return bad(r, "checksum mismatch in the header of %s", what);
    c->acc = chain(c->acc, h);
    for (int i = 0; i < 3; i++)
        counts[i] = ts__get_u64le(sec + 8 + 8 * i);
    return 0;
}

/* The streams section (format 2): its header, every stream, the sums against the header. */
static int read_streams(snap_reader *r, snap_count *c, tsd_snapfile_head *head)
{
    uint64_t n[3];
    if (read_section(r, c, SNAP_SEC_MAGIC, "the streams section", n) != 0)
        return -1;
    head->n_streams = n[0];
    head->n_records = n[1];
    head->stream_bytes = n[2];
    if (head->n_streams > r->left / SNAP_STREAM_MIN || head->n_records > r->left / SNAP_RECORD_MIN)
        return cut(r,
                   "the streams section claims %llu streams and %llu records, more than the "
                   "file can hold",
                   (unsigned long long)head->n_streams, (unsigned long long)head->n_records);
    c->recs_total = head->n_records;
    for (uint64_t k = 0; k < head->n_streams; k++)
        if (read_stream(r, c, k) != 0)
            return -1;
    if (c->recs_seen != head->n_records || c->sbytes_seen != head->stream_bytes)
        return bad(r,
                   "the streams section claims %llu records of %llu bytes, the streams hold "
                   "%llu of %llu",
                   (unsigned long long)head->n_records, (unsigned long long)head->stream_bytes,
                   (unsigned long long)c->recs_seen, (unsigned long long)c->sbytes_seen);
    return 0;
}

/* The settings TABLE_CREATE accepts (table.c op_create): NULL, or what is wrong. */
static const char *table_settings_bad(const tsd_snapfile_table *t)
{
    double spi = t->spi, eb = t->error_buffer;
    if (t->capacity < 1 || t->capacity > TS_TABLE_MAX_CAPACITY)
        return "capacity";
    if (t->min_size < 1 || t->min_size > t->capacity)
        return "min_size_to_sample";
    if (!isfinite(spi) || spi <= 0.0)
        return "samples_per_insert";
    if (!isfinite(eb) || eb < 0.0 || (eb != 0.0 && eb < (spi > 1.0 ? spi : 1.0)))
        return "error_buffer";
    if (!isfinite(t->exponent) || t->exponent < 0.0)
        return "priority_exponent";
    if (t->sampler > TS_TABLE_SAMPLER_LIFO)
        return "sampler";
    if (t->remover > TS_TABLE_REMOVER_LOWEST)
        return "remover";
    return NULL;
}

/* Read and check one replay table (header, item table, records), handing it to the sink. */
static int read_table(snap_reader *r, snap_count *c, uint64_t index)
{
    char what[SNAP_NAME_MSG + 64];
    uint8_t fx[1 + UINT8_MAX + SNAP_TABLE_FIXED];
    snprintf(what, sizeof(what), "the header of replay table %llu", (unsigned long long)index);
    int got = read_named(r, c, fx, SNAP_TABLE_FIXED, what);
    if (got < 0)
        return -1;
    size_t nl = (size_t)got;
    if (nl == 0)
        return bad(r, "replay table %llu has an empty name", (unsigned long long)index);
    const uint8_t *q = fx + 1 + nl;
    tsd_snapfile_table t = {.name = fx + 1,
                            .name_len = (uint8_t)nl,
                            .capacity = ts__get_u64le(q),
                            .min_size = ts__get_u64le(q + 8),
                            .spi = ts__get_f64le(q + 16),
                            .error_buffer = ts__get_f64le(q + 24),
                            .exponent = ts__get_f64le(q + 32),
                            .max_times = ts__get_u32le(q + 40),
                            .remover = q[44],
                            .sampler = q[45],
                            .next_key = ts__get_u64le(q + 48),
                            .inserts = ts__get_u64le(q + 56),
                            .samples = ts__get_u64le(q + 64),
                            .deletes = ts__get_u64le(q + 72),
                            .n_items = ts__get_u64le(q + 80)};
    char pn[SNAP_NAME_MSG];
    printable(r, t.name, nl, pn, sizeof(pn));
    const char *setting = table_settings_bad(&t);
    if (setting != NULL || ts__get_u16le(q + 46) != 0)
        return bad(r, "replay table '%s': %s is out of range", pn,
                   setting != NULL ? setting : "a reserved field");
    /* Its size is what it holds: inserts less deletes, at most its capacity. */
    if (t.n_items > t.capacity || t.deletes > t.inserts || t.inserts - t.deletes != t.n_items ||
        t.next_key < 1 || t.inserts > t.next_key - 1)
        return bad(r,
                   "replay table '%s': %llu items, %llu inserts, %llu deletes and next key %llu "
                   "do not agree",
                   pn, (unsigned long long)t.n_items, (unsigned long long)t.inserts,
                   (unsigned long long)t.deletes, (unsigned long long)t.next_key);
    if (t.n_items > (r->left - 8) / SNAP_TITEM_MIN || t.n_items > c->titems_total - c->titems_seen)
        return cut(r, "replay table '%s' claims %llu items, more than the file can hold", pn,
                   (unsigned long long)t.n_items);
    size_t tlen = (size_t)t.n_items * TSD_SNAP_TITEM_SIZE;
    if (r_grow(r, (void **)&c->tb, &c->tb_cap, tlen) != 0)
        return -1;
    snprintf(what, sizeof(what), "the items of replay table '%s'", pn);
    if (read_hashed(r, c, c->tb, tlen, what) != 0)
        return -1;
    /* Every row's rules, and every record's length against the rest, before any is asked for. */
    uint64_t need = 0, prev = 0;
    for (uint64_t k = 0; k < t.n_items; k++) {
        uint64_t key, len, age;
        double prio;
        uint32_t times;
        tsd_snapfile_titem_get(c->tb, (size_t)k, &key, &prio, &len, &age, &times);
        if (key <= prev || key >= t.next_key || !isfinite(prio) || prio < 0.0 ||
            (t.max_times != 0 && times >= t.max_times) ||
            ts__get_u32le(c->tb + k * TSD_SNAP_TITEM_SIZE + 36) != 0)
            return bad(r, "item %llu of replay table '%s' (key %llu) breaks a rule of tables",
                       (unsigned long long)k, pn, (unsigned long long)key);
        prev = key;
        if (len < TS_REC_HDR_SIZE || len > r->left || len + 8 > r->left - need)
            return cut(r, "item %llu of replay table '%s' claims %llu bytes (%llu remain)",
                       (unsigned long long)k, pn, (unsigned long long)len,
                       (unsigned long long)(r->left - need));
        need += len + 8;
    }
    if (r->sink->table == NULL || r->sink->trecord == NULL)
        return other(r, TS_EINVAL, "it holds replay tables, which this reader does not take");
    t.items = c->tb;
    if (r->sink->table(r->sink->arg, &t) != 0)
        return other(r, TS_ENOMEM, "out of memory loading it");
    for (uint64_t k = 0; k < t.n_items; k++) {
        uint64_t key, len, age;
        double prio;
        uint32_t times;
        tsd_snapfile_titem_get(c->tb, (size_t)k, &key, &prio, &len, &age, &times);
        uint8_t *data = r->sink->trecord(r->sink->arg, (size_t)len);
        if (data == NULL)
            return other(r, TS_ENOMEM, "out of memory loading a %llu-byte table item",
                         (unsigned long long)len);
        snprintf(what, sizeof(what), "item %llu of replay table '%s'", (unsigned long long)k, pn);
        if (read_hashed(r, c, data, (size_t)len, what) != 0)
            return -1;
        /* The validator and limits a TABLE_INSERT of this record meets. */
        if (ts__record_validate(data, (size_t)len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL) != 0)
            return bad(r, "%s is not a valid record", what);
        c->titems_seen++;
        c->tbytes_seen += len;
    }
    return 0;
}

/* The replay tables section (format 3): its header, every table, the sums against it. */
static int read_tables(snap_reader *r, snap_count *c, tsd_snapfile_head *head)
{
    uint64_t n[3];
    if (read_section(r, c, SNAP_TAB_MAGIC, "the replay tables section", n) != 0)
        return -1;
    head->n_tables = n[0];
    head->n_titems = n[1];
    head->table_bytes = n[2];
    if (head->n_tables > r->left / SNAP_TABLE_MIN || head->n_titems > r->left / SNAP_TITEM_MIN)
        return cut(r,
                   "the replay tables section claims %llu tables and %llu items, more than the "
                   "file can hold",
                   (unsigned long long)head->n_tables, (unsigned long long)head->n_titems);
    c->titems_total = head->n_titems;
    for (uint64_t k = 0; k < head->n_tables; k++)
        if (read_table(r, c, k) != 0)
            return -1;
    if (c->titems_seen != head->n_titems || c->tbytes_seen != head->table_bytes)
        return bad(r,
                   "the replay tables section claims %llu items of %llu bytes, the tables hold "
                   "%llu of %llu",
                   (unsigned long long)head->n_titems, (unsigned long long)head->table_bytes,
                   (unsigned long long)c->titems_seen, (unsigned long long)c->tbytes_seen);
    return 0;
}

/* The optimizer settings PS_CREATE and EMB_CREATE accept (ps.c): NULL, or what is wrong. */
static const char *ps_optimizer_bad(uint8_t opt, double lr, double beta1, double beta2, double eps)
{
    if (opt >= TS_PS_OPT_COUNT_)
        return "the optimizer";
    if (!isfinite(lr) || lr < 0)
        return "the learning rate";
    if ((opt == TS_PS_OPT_MOMENTUM || opt == TS_PS_OPT_ADAM) && !(beta1 >= 0 && beta1 < 1))
        return "beta1";
    if (opt == TS_PS_OPT_ADAM && (!(beta2 >= 0 && beta2 < 1) || !(eps > 0) || !isfinite(eps)))
        return "beta2 or eps";
    return NULL;
}

/*
 * Read the next array of a parameter or table (n bytes, checked against the bytes left) into
 * memory from the sink, with its hash. 0 with *out, or -1.
 */
static int read_ps_array(snap_reader *r, snap_count *c, uint64_t n, const char *what, void **out)
{
    if (n > r->left || r->left - n < 8)
        return cut(r, "%s claims %llu bytes (%llu remain)", what, (unsigned long long)n,
                   (unsigned long long)r->left);
    void *m = r->sink->ps_array(r->sink->arg, (size_t)n);
    if (m == NULL)
        return other(r, TS_ENOMEM, "out of memory loading %s", what);
    if (read_hashed(r, c, m, (size_t)n, what) != 0)
        return -1;
    *out = m;
    return 0;
}

/* Read and check one parameter (header, ring, slots), handing it to the sink. 0 or -1. */
static int read_param(snap_reader *r, snap_count *c, uint64_t index)
{
    char what[SNAP_NAME_MSG + 64];
    uint8_t fx[1 + UINT8_MAX + SNAP_PARAM_FIXED];
    snprintf(what, sizeof(what), "the header of parameter %llu", (unsigned long long)index);
    int got = read_named(r, c, fx, SNAP_PARAM_FIXED, what);
    if (got < 0)
        return -1;
    size_t nl = (size_t)got;
    const uint8_t *q = fx + 1 + nl;
    tsd_snapfile_param p = {.name = fx + 1,
                            .name_len = (uint8_t)nl,
                            .opt = q[0],
                            .mode = q[1],
                            .flags = q[2],
                            .k = ts__get_u32le(q + 4),
                            .tolerance = ts__get_u32le(q + 8),
                            .ring_n = ts__get_u32le(q + 12),
                            .lr = ts__get_f64le(q + 16),
                            .beta1 = ts__get_f64le(q + 24),
                            .beta2 = ts__get_f64le(q + 32),
                            .eps = ts__get_f64le(q + 40),
                            .numel = ts__get_u64le(q + 48),
                            .adam_t = ts__get_u64le(q + 56),
                            .steps = ts__get_u64le(q + 64),
                            .bin_version = ts__get_u64le(q + 72)};
    char pn[SNAP_NAME_MSG];
    printable(r, p.name, nl, pn, sizeof(pn));
    const char *setting = ps_optimizer_bad(p.opt, p.lr, p.beta1, p.beta2, p.eps);
    if (setting == NULL && (p.mode >= TS_PS_MODE_COUNT_ || (p.flags & ~TS_PS_FLAGS_KNOWN) != 0))
        setting = "the mode or the flags";
    if (setting == NULL && q[3] != 0)
        setting = "a reserved field";
    if (setting == NULL &&
        (p.mode == TS_PS_MODE_SYNC ? p.k < 1 || p.k > TSD_PS_MAX_K || p.tolerance >= TSD_PS_RING
                                   : p.k != 1))
        setting = "sync_k or the tolerance";
    if (setting == NULL && p.opt != TS_PS_OPT_ADAM && p.adam_t != 0)
        setting = "the Adam step count";
    if (setting == NULL && (p.ring_n < 1 || p.ring_n > TSD_PS_RING))
        setting = "the version ring's length";
    if (setting != NULL)
        return bad(r, "parameter '%s': %s is out of range", pn, setting);
    uint32_t slots = tsd_snapfile_slots(p.opt);
    /* The ring and every slot against the bytes left, before anything is asked for. */
    uint64_t ring_len = (uint64_t)p.ring_n * TSD_SNAP_RING_SIZE;
    uint64_t avail = ring_len + 8 <= r->left ? r->left - ring_len - 8 : 0;
    if (ring_len + 8 > r->left ||
        (slots > 0 && (avail < 8 * (uint64_t)slots ||
                       p.numel > (avail - 8 * (uint64_t)slots) / slots / sizeof(float))))
        return cut(r, "parameter '%s' claims %llu elements, more than the file can hold", pn,
                   (unsigned long long)p.numel);
    if (r_grow(r, (void **)&c->tb, &c->tb_cap, (size_t)ring_len) != 0)
        return -1;
    snprintf(what, sizeof(what), "the version ring of parameter '%s'", pn);
    if (read_hashed(r, c, c->tb, (size_t)ring_len, what) != 0)
        return -1;
    /* Versions rise, step counts never fall, and neither passes the parameter's own. */
    uint64_t pv = 0, ps = 0;
    for (uint32_t k = 0; k < p.ring_n; k++) {
        uint64_t v = ts__get_u64le(c->tb + (size_t)k * TSD_SNAP_RING_SIZE);
        uint64_t st = ts__get_u64le(c->tb + (size_t)k * TSD_SNAP_RING_SIZE + 8);
        if ((k > 0 && v <= pv) || st < ps || st > p.steps || v > p.bin_version)
            return bad(r, "parameter '%s': entry %u of its version ring breaks a rule", pn, k);
        pv = v;
        ps = st;
    }
    if (r->sink->param == NULL || r->sink->ps_array == NULL)
        return other(r, TS_EINVAL,
                     "it holds parameter server state, which this reader does not "
                     "take");
    p.ring = c->tb;
    if (r->sink->param(r->sink->arg, &p) != 0)
        return other(r, TS_ENOMEM, "out of memory loading parameter '%s'", pn);
    for (uint32_t k = 0; k < slots; k++) {
        void *m;
        snprintf(what, sizeof(what), "slot %u of parameter '%s'", k, pn);
        if (read_ps_array(r, c, p.numel * sizeof(float), what, &m) != 0)
            return -1;
    }
    return 0;
}

/* Read and check one embedding table (header, ids, rows, step counts) into the sink. */
static int read_emb(snap_reader *r, snap_count *c, uint64_t index)
{
    char what[SNAP_NAME_MSG + 64];
    uint8_t fx[1 + UINT8_MAX + SNAP_EMB_FIXED];
    snprintf(what, sizeof(what), "the header of embedding table %llu", (unsigned long long)index);
    int got = read_named(r, c, fx, SNAP_EMB_FIXED, what);
    if (got < 0)
        return -1;
    size_t nl = (size_t)got;
    const uint8_t *q = fx + 1 + nl;
    tsd_snapfile_emb t = {.name = fx + 1,
                          .name_len = (uint8_t)nl,
                          .dim = ts__get_u32le(q),
                          .opt = q[4],
                          .init = q[5],
                          .seed = ts__get_u64le(q + 8),
                          .num_ids = ts__get_u64le(q + 16),
                          .lr = ts__get_f64le(q + 24),
                          .beta1 = ts__get_f64le(q + 32),
                          .beta2 = ts__get_f64le(q + 40),
                          .eps = ts__get_f64le(q + 48),
                          .init_scale = ts__get_f64le(q + 56),
                          .version = ts__get_u64le(q + 64),
                          .n_rows = ts__get_u64le(q + 72)};
    char pn[SNAP_NAME_MSG];
    printable(r, t.name, nl, pn, sizeof(pn));
    const char *setting = ps_optimizer_bad(t.opt, t.lr, t.beta1, t.beta2, t.eps);
    if (setting == NULL && (t.dim < 1 || t.dim > TSD_PS_MAX_DIM))
        setting = "dim";
    if (setting == NULL && (t.init >= TS_PSW_INIT_COUNT_ || !isfinite(t.init_scale) ||
                            t.init_scale < 0 || t.num_ids > (uint64_t)INT64_MAX))
        setting = "the initializer, its scale or num_ids";
    if (setting == NULL && ts__get_u16le(q + 6) != 0)
        setting = "a reserved field";
    if (setting == NULL &&
        (t.n_rows > TSD_PS_MAX_ROWS || (t.num_ids != 0 && t.n_rows > t.num_ids) ||
         t.n_rows > c->rows_total - c->rows_seen))
        setting = "the row count";
    if (setting != NULL)
        return bad(r, "embedding table '%s': %s is out of range", pn, setting);
    uint32_t slots = tsd_snapfile_slots(t.opt);
    /* At most 2^31 rows of at most 3 x 2^16 floats: no product below overflows. */
    uint64_t ids_len = t.n_rows * sizeof(int64_t);
    uint64_t rows_len = t.n_rows * t.dim * (1 + slots) * sizeof(float);
    uint64_t steps_len = t.opt == TS_PS_OPT_ADAM ? t.n_rows * sizeof(uint32_t) : 0;
    uint64_t total = ids_len + rows_len + steps_len + (t.opt == TS_PS_OPT_ADAM ? 24 : 16);
    if (total > r->left)
        return cut(r, "embedding table '%s' claims %llu rows, more than the file can hold", pn,
                   (unsigned long long)t.n_rows);
    if (r->sink->emb == NULL || r->sink->ps_array == NULL)
        return other(r, TS_EINVAL,
                     "it holds parameter server state, which this reader does not "
                     "take");
    if (r->sink->emb(r->sink->arg, &t) != 0)
        return other(r, TS_ENOMEM, "out of memory loading embedding table '%s'", pn);
    void *m;
    snprintf(what, sizeof(what), "the ids of embedding table '%s'", pn);
    if (read_ps_array(r, c, ids_len, what, &m) != 0)
        return -1;
    uint64_t limit = t.num_ids != 0 ? t.num_ids : (uint64_t)INT64_MAX;
    for (uint64_t k = 0; k < t.n_rows; k++) {
        int64_t id = (int64_t)ts__get_u64le((const uint8_t *)m + k * sizeof(int64_t));
        if (id < 0 || (uint64_t)id >= limit)
            return bad(r, "embedding table '%s': row %llu has id %lld, out of range", pn,
                       (unsigned long long)k, (long long)id);
    }
    snprintf(what, sizeof(what), "the rows of embedding table '%s'", pn);
    if (read_ps_array(r, c, rows_len, what, &m) != 0)
        return -1;
    if (t.opt == TS_PS_OPT_ADAM) {
        snprintf(what, sizeof(what), "the step counts of embedding table '%s'", pn);
        if (read_ps_array(r, c, steps_len, what, &m) != 0)
            return -1;
    }
    c->rows_seen += t.n_rows;
    return 0;
}

/* The parameter server section (format 4): its header, every parameter and table. */
static int read_ps(snap_reader *r, snap_count *c, tsd_snapfile_head *head)
{
    uint64_t n[3];
    if (read_section(r, c, SNAP_PS_MAGIC, "the parameter server section", n) != 0)
        return -1;
    head->n_params = n[0];
    head->n_embs = n[1];
    head->n_rows = n[2];
    if (head->n_params > r->left / SNAP_PARAM_MIN || head->n_embs > r->left / SNAP_EMB_MIN ||
        head->n_rows > r->left / (sizeof(int64_t) + sizeof(float)))
        return cut(r,
                   "the parameter server section claims %llu parameters, %llu tables and %llu "
                   "rows, more than the file can hold",
                   (unsigned long long)head->n_params, (unsigned long long)head->n_embs,
                   (unsigned long long)head->n_rows);
    c->rows_total = head->n_rows;
    for (uint64_t k = 0; k < head->n_params; k++)
        if (read_param(r, c, k) != 0)
            return -1;
    for (uint64_t k = 0; k < head->n_embs; k++)
        if (read_emb(r, c, k) != 0)
            return -1;
    if (c->rows_seen != head->n_rows)
        return bad(r, "the parameter server section claims %llu rows, the tables hold %llu",
                   (unsigned long long)head->n_rows, (unsigned long long)c->rows_seen);
    return 0;
}

static int read_all(snap_reader *r, tsd_snapfile_head *out)
{
    uint8_t hdr[TSD_SNAP_HDR_SIZE];
    if (r_read(r, hdr, sizeof(hdr), "the file header") != 0)
        return -1;
    if (memcmp(hdr, SNAP_MAGIC, sizeof(SNAP_MAGIC)) != 0)
        return bad(r, "not a tensord snapshot (bad magic)");
    if (tsd_hash64(hdr, 56, 0) != ts__get_u64le(hdr + 56))
        return bad(r, "checksum mismatch in the file header");
    uint32_t format = ts__get_u32le(hdr + 8);
    if (format < TSD_SNAP_FORMAT_MIN || format > TSD_SNAP_FORMAT) {
        snprintf(r->err, r->err_cap,
                 "snapshot %s: format %u is not supported (this tensord reads %d to %d)", r->label,
                 format, TSD_SNAP_FORMAT_MIN, TSD_SNAP_FORMAT);
        r->rc = TS_EPROTO;
        return -1;
    }
    if (ts__get_u32le(hdr + 12) != 0)
        return bad(r, "a reserved field of the file header is not 0");
    r->format = format;
    tsd_snapfile_head head = {
        .counter = ts__get_u64le(hdr + 16),
        .n_bins = ts__get_u64le(hdr + 24),
        .n_items = ts__get_u64le(hdr + 32),
        .bytes = ts__get_u64le(hdr + 40),
        .wall_ms = ts__get_u64le(hdr + 48),
        .format = format,
    };
    /* Each bin and each item takes a minimum number of bytes: both counts are bounded. */
    if (head.n_bins > r->left / SNAP_BIN_MIN || head.n_items > r->left / SNAP_ITEM_MIN)
        return cut(r, "the header claims %llu bins and %llu items, more than the file can hold",
                   (unsigned long long)head.n_bins, (unsigned long long)head.n_items);
    snap_count c = {.items_total = head.n_items,
                    .counter = head.counter,
                    .acc = chain(0, ts__get_u64le(hdr + 56))};
    int rc = 0;
    for (uint64_t b = 0; b < head.n_bins && rc == 0; b++)
        rc = read_bin(r, &c, b);
    if (rc == 0 && format >= 2)
        rc = read_streams(r, &c, &head);
    if (rc == 0 && format >= 3)
        rc = read_tables(r, &c, &head);
    if (rc == 0 && format >= 4)
        rc = read_ps(r, &c, &head);
    count_free(&c);
    if (rc != 0)
        return -1;
    uint8_t end[TSD_SNAP_END_SIZE];
    if (r_read(r, end, sizeof(end), "the trailer") != 0)
        return -1;
    if (memcmp(end, SNAP_END_MAGIC, sizeof(SNAP_END_MAGIC)) != 0 ||
        ts__get_u64le(end + 8) != head.n_bins || ts__get_u64le(end + 16) != head.n_items ||
        c.items_seen != head.n_items)
        return bad(r, "the trailer does not match the contents");
    if (chain(c.acc, tsd_hash64(end, 24, 0)) != ts__get_u64le(end + 24))
        return bad(r, "checksum mismatch in the trailer");
    if (c.bytes_seen != head.bytes)
        return bad(r, "the header claims %llu record bytes, the items hold %llu",
                   (unsigned long long)head.bytes, (unsigned long long)c.bytes_seen);
    if (r->left != 0)
        return bad(r, "%llu unexpected bytes after the trailer", (unsigned long long)r->left);
    *out = head;
    return 0;
}

int tsd_snapfile_read_fd(int fd, uint64_t size, const char *label, const tsd_snapfile_sink *sink,
                         tsd_snapfile_head *head, char *err, size_t err_cap)
{
    snap_reader r = {.fd = fd,
                     .left = size,
                     .label = label,
                     .sink = sink,
                     .err = err,
                     .err_cap = err_cap,
                     .rc = TS_EPROTO};
    return read_all(&r, head) == 0 ? 0 : r.rc;
}

int tsd_snapfile_read_mem(const uint8_t *p, size_t len, const char *label,
                          const tsd_snapfile_sink *sink, tsd_snapfile_head *head, char *err,
                          size_t err_cap)
{
    /* A non-NULL base even for an empty file, so r_read knows it reads memory. */
    static const uint8_t empty[1];
    snap_reader r = {.fd = -1,
                     .mem = p != NULL ? p : empty,
                     .left = len,
                     .label = label,
                     .sink = sink,
                     .err = err,
                     .err_cap = err_cap,
                     .rc = TS_EPROTO};
    return read_all(&r, head) == 0 ? 0 : r.rc;
}
