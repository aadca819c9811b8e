/*
 * The snapshot file format of tensord (the layout is drawn at the top of snapfile.c): the
 * checksum, a writer over a file descriptor and a strict, bounded reader. Nothing here knows
 * the event loop, the store or the server, so the format links into the fuzz target and the
 * unit test without libuv; server/snapshot.c runs the jobs around it.
 *
 * Thread: any; the functions keep no state between calls.
 */
#ifndef TSD_SNAPFILE_H
#define TSD_SNAPFILE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "msg_ps.h"

/*
 * The format version this tensord writes (in the header). It reads every version from
 * TSD_SNAP_FORMAT_MIN on: format 1 (tensorshare 0.1 to 0.3) holds bins only; format 2 adds the
 * streams section after the bins; format 3 (0.5.0) adds the replay tables section after the
 * streams; format 4 (0.6.0) adds the parameter server section after the replay tables; format 5
 * (0.6.0 too) gives each bin a flags word where formats 1 to 4 had a reserved 0 (bit 0: a tensor
 * bin, restored as one), which is the only difference.
 */
#define TSD_SNAP_FORMAT     5
#define TSD_SNAP_FORMAT_MIN 1
#define TSD_SNAP_HDR_SIZE   64 /* bytes of the file header */
#define TSD_SNAP_END_SIZE   32 /* bytes of the trailer */
#define TSD_SNAP_SEC_SIZE   40 /* bytes of the streams section's header (format 2) */
/* Bytes of one row of a stream's entry table: u64 record length (0: a marker), tag, age. */
#define TSD_SNAP_ENTRY_SIZE 24
/* Bytes of one row of a member's pending table: u64 id, u32 deliveries, u32 rows_done. */
#define TSD_SNAP_PEND_SIZE 16
/*
 * Bytes of one row of a replay table's item table (format 3): u64 key, f64 priority, u64 record
 * length, u64 age in ms, u32 times_sampled, u32 0.
 */
#define TSD_SNAP_TITEM_SIZE 40

/*
 * The parameter server's limits (ps.c enforces them on requests, the reader on files). Published
 * versions a parameter remembers with their step counts, to tell a gradient's staleness from the
 * version it was computed on: a sync tolerance must be below it, and an older (or unknown)
 * version counts as this stale.
 */
#define TSD_PS_RING 1024u
/* Gradients per sync step at most: bounds the pushes one step holds waiting. */
#define TSD_PS_MAX_K 65536u
/* floats per embedding row at most (a row of 256 KiB): bounds one row's work and copy. */
#define TSD_PS_MAX_DIM 65536u
/* Rows of one embedding table at most: row indexes are u32. */
#define TSD_PS_MAX_ROWS ((uint64_t)1 << 31)
/* Bytes of one row of a parameter's version ring (format 4): u64 version, u64 step count. */
#define TSD_SNAP_RING_SIZE 16

/*
 * A bin's flags (format 5; the word after its item count). TSD_SNAP_BIN_TENSOR: a tensor bin
 * (TENSOR_BIN): it holds exactly one item, a record whose root is one tensor of a known dtype with
 * 1 to TS_MAX_NDIM dims laid out canonically (ts__rows_rec_size in msg.h), and it comes back as a
 * tensor bin. Other bits are refused.
 */
#define TSD_SNAP_BIN_TENSOR 0x1u
#define TSD_SNAP_BIN_KNOWN  TSD_SNAP_BIN_TENSOR
/* The first format with bin flags (before it the word is a reserved 0). */
#define TSD_SNAP_FORMAT_FLAGS 5

/* A 64-bit hash of len bytes (xxHash64-style); the snapshot checksums. */
uint64_t tsd_hash64(const void *p, size_t len, uint64_t seed);

/* What the file header says (and the trailer repeats). */
typedef struct tsd_snapfile_head {
    uint64_t counter; /* the server's change counter when the snapshot was taken */
    uint64_t n_bins;
    uint64_t n_items; /* over all bins */
    uint64_t bytes;   /* record bytes over all items of bins */
    uint64_t wall_ms; /* wall clock when written, ms since the epoch (informative) */
    /*
     * The format: the reader sets the file's; the writer writes this one (0 means
     * TSD_SNAP_FORMAT; format 1 only without streams, which it cannot hold).
     */
    uint32_t format;
    /* The streams section (format 2; all 0 in format 1). */
    uint64_t n_streams;
    uint64_t n_records;    /* records over all streams' entries (markers hold none) */
    uint64_t stream_bytes; /* their bytes */
    /* The replay tables section (format 3; all 0 before). */
    uint64_t n_tables;
    uint64_t n_titems;    /* items over all tables (each holds one record) */
    uint64_t table_bytes; /* their records' bytes */
    /* The parameter server section (format 4; all 0 before). */
    uint64_t n_params;
    uint64_t n_embs;
    uint64_t n_rows; /* rows over all embedding tables */
} tsd_snapfile_head;

/* One bin handed to the writer. */
typedef struct tsd_snapfile_bin {
    const uint8_t *name; /* name_len bytes, borrowed */
    size_t first;        /* index of its first item, as the item function counts them */
    uint64_t version;
    uint32_t n_items; /* its items are first .. first + n_items - 1 */
    uint32_t flags;   /* TSD_SNAP_BIN_*; 0 in formats before 5 */
    uint8_t name_len;
} tsd_snapfile_bin;

/*
 * The writer's access to item index (0 .. n_items - 1 over the whole snapshot): its record
 * bytes (borrowed until the writer returns) and their length.
 */
typedef void (*tsd_snapfile_item_fn)(void *arg, size_t index, const uint8_t **data, size_t *len);

/*
 * Streams (format 2). A stream's entries and its members' pending entries travel as tables
 * already in the file's encoding (rows written with tsd_snapfile_entry_put and
 * tsd_snapfile_pend_put), so that the writer hashes and writes them without another copy,
 * and the reader hands them on as they are in the file.
 */

/* Row k of an entry table: a record's length (0 for a marker), a marker's tag, the age in ms. */
static inline void tsd_snapfile_entry_put(uint8_t *table, size_t k, uint64_t len, uint64_t tag,
                                          uint64_t age_ms)
{
    uint8_t *p = table + k * TSD_SNAP_ENTRY_SIZE;
    ts__put_u64le(p, len);
    ts__put_u64le(p + 8, tag);
    ts__put_u64le(p + 16, age_ms);
}

static inline void tsd_snapfile_entry_get(const uint8_t *table, size_t k, uint64_t *len,
                                          uint64_t *tag, uint64_t *age_ms)
{
    const uint8_t *p = table + k * TSD_SNAP_ENTRY_SIZE;
    *len = ts__get_u64le(p);
    *tag = ts__get_u64le(p + 8);
    *age_ms = ts__get_u64le(p + 16);
}

/* Row k of a pending table: the entry's id, its deliveries, its rows done. */
static inline void tsd_snapfile_pend_put(uint8_t *table, size_t k, uint64_t id, uint32_t deliveries,
                                         uint32_t rows_done)
{
    uint8_t *p = table + k * TSD_SNAP_PEND_SIZE;
    ts__put_u64le(p, id);
    ts__put_u32le(p + 8, deliveries);
    ts__put_u32le(p + 12, rows_done);
}

static inline void tsd_snapfile_pend_get(const uint8_t *table, size_t k, uint64_t *id,
                                         uint32_t *deliveries, uint32_t *rows_done)
{
    const uint8_t *p = table + k * TSD_SNAP_PEND_SIZE;
    *id = ts__get_u64le(p);
    *deliveries = ts__get_u32le(p + 8);
    *rows_done = ts__get_u32le(p + 12);
}

/* A member of a group: its name (name_len 0: the group's orphans) and pending entries. */
typedef struct tsd_snapfile_member {
    const uint8_t *name; /* name_len bytes, borrowed */
    const uint8_t *pend; /* n_pend rows of TSD_SNAP_PEND_SIZE bytes, ids ascending; borrowed */
    uint32_t n_pend;
    uint8_t name_len;
} tsd_snapfile_member;

/* A group of a stream: its cursor and members. */
typedef struct tsd_snapfile_group {
    const uint8_t *name; /* name_len bytes (1..255), borrowed */
    const tsd_snapfile_member *members;
    uint64_t next_id;
    uint64_t lost;
    uint32_t lease_ms;
    uint32_t n_members; /* the orphans included, when written */
    uint8_t name_len;
} tsd_snapfile_group;

/* A stream: its settings, ids, entries (records through the item function) and groups. */
typedef struct tsd_snapfile_stream {
    const uint8_t *name; /* name_len bytes (1..255), borrowed */
    uint64_t max_entries, max_bytes;
    uint32_t max_age_ms, window, lease_ms;
    uint64_t first_id, last_id; /* last_id + 1 - first_id entries (first_id >= 1) */
    const uint8_t *entries;     /* that many rows of TSD_SNAP_ENTRY_SIZE bytes; borrowed */
    /*
     * Writer: the item index (as the item function counts) of its first record; the records of
     * its entries whose length is not 0 are first, first + 1, ... in id order. Reader: its
     * records (the entries whose length is not 0).
     */
    size_t first_record;
    uint64_t n_records;
    const tsd_snapfile_group *groups; /* writer: n_groups of them; reader: NULL (see group) */
    uint32_t n_groups;
    uint8_t name_len;
} tsd_snapfile_stream;

/* Row k of a replay table's item table (format 3). */
static inline void tsd_snapfile_titem_put(uint8_t *table, size_t k, uint64_t key, double priority,
                                          uint64_t len, uint64_t age_ms, uint32_t times_sampled)
{
    uint8_t *p = table + k * TSD_SNAP_TITEM_SIZE;
    uint64_t bits;
    memcpy(&bits, &priority, sizeof(bits));
    ts__put_u64le(p, key);
    ts__put_u64le(p + 8, bits);
    ts__put_u64le(p + 16, len);
    ts__put_u64le(p + 24, age_ms);
    ts__put_u32le(p + 32, times_sampled);
    ts__put_u32le(p + 36, 0);
}

static inline void tsd_snapfile_titem_get(const uint8_t *table, size_t k, uint64_t *key,
                                          double *priority, uint64_t *len, uint64_t *age_ms,
                                          uint32_t *times_sampled)
{
    const uint8_t *p = table + k * TSD_SNAP_TITEM_SIZE;
    uint64_t bits = ts__get_u64le(p + 8);
    *key = ts__get_u64le(p);
    memcpy(priority, &bits, sizeof(*priority));
    *len = ts__get_u64le(p + 16);
    *age_ms = ts__get_u64le(p + 24);
    *times_sampled = ts__get_u32le(p + 32);
}

/*
 * A replay table (format 3): its settings (as TABLE_CREATE gave them), the counters its rate
 * limiter works from, and its items in key order with their records.
 */
typedef struct tsd_snapfile_table {
    const uint8_t *name; /* name_len bytes (1..255), borrowed */
    uint64_t capacity, min_size;
    double spi, error_buffer, exponent;
    uint32_t max_times;
    uint8_t remover, sampler;
    uint64_t next_key, inserts, samples, deletes;
    uint64_t n_items;
    const uint8_t *items; /* n_items rows of TSD_SNAP_TITEM_SIZE bytes, keys ascending; borrowed */
    /* Writer: the item index (as the item function counts) of its first record. */
    size_t first_record;
    uint8_t name_len;
} tsd_snapfile_table;

/* Float slots an optimizer keeps per value (TS_PS_OPT_*): Adam 2, momentum 1, else 0. */
static inline uint32_t tsd_snapfile_slots(uint8_t opt)
{
    return opt == TS_PS_OPT_ADAM ? 2u : opt == TS_PS_OPT_MOMENTUM ? 1u : 0u;
}

/*
 * A dense parameter (format 4): the settings PS_CREATE gave it, its step counts, its version
 * ring, the version of its bin that its slots belong to, and its slots. A sync step being formed
 * is not part of it. Float arrays are in the host's byte order, which is little-endian wherever
 * tensord runs (records' tensors are too).
 */
typedef struct tsd_snapfile_param {
    const uint8_t *name; /* name_len bytes (the bin's name), borrowed */
    uint8_t opt, mode, flags;
    uint32_t k, tolerance;
    double lr, beta1, beta2, eps;
    uint64_t numel;
    uint64_t adam_t;      /* Adam steps taken (0 for other optimizers) */
    uint64_t steps;       /* optimizer steps applied */
    uint64_t bin_version; /* the bin's version that the slots belong to */
    uint32_t ring_n;      /* 1 .. TSD_PS_RING */
    const uint8_t *ring;  /* ring_n rows of TSD_SNAP_RING_SIZE bytes, oldest first; borrowed */
    const float *slot[2]; /* writer: numel floats each, tsd_snapfile_slots(opt) of them */
    uint8_t name_len;
} tsd_snapfile_param;

/*
 * An embedding table (format 4): its settings, version and rows. Row k has id ids[k], its dim
 * values and slots at rows + k * dim * (1 + slots), and (Adam) its step count steps[k].
 */
typedef struct tsd_snapfile_emb {
    const uint8_t *name; /* name_len bytes, borrowed */
    uint32_t dim;
    uint8_t opt, init;
    uint64_t seed, num_ids;
    double lr, beta1, beta2, eps, init_scale;
    uint64_t version;
    uint64_t n_rows;
    /* Writer only (the reader hands them through the sink's ps_array). */
    const int64_t *ids;
    const float *rows;
    const uint32_t *steps; /* Adam only */
    uint8_t name_len;
} tsd_snapfile_emb;

/* The parameter server's state handed to the writer. */
typedef struct tsd_snapfile_ps {
    const tsd_snapfile_param *params;
    size_t n_params;
    const tsd_snapfile_emb *embs;
    size_t n_embs;
} tsd_snapfile_ps;

/*
 * Sort bins into the file's order: by name, bytewise, a shorter name first when one is a prefix
 * of the other. The writer writes bins in the order given, so call this first.
 */
void tsd_snapfile_sort(tsd_snapfile_bin *bins, size_t n);
/* The same order for streams (call it first too: one snapshot has one encoding). */
void tsd_snapfile_sort_streams(tsd_snapfile_stream *streams, size_t n);
/* The same order for replay tables. */
void tsd_snapfile_sort_tables(tsd_snapfile_table *tables, size_t n);

/*
 * Write a whole snapshot to fd (at its current offset): the header from head (head->n_bins is
 * the length of bins; n_items and bytes must be the sums over the bins' items, as the reader
 * checks them), every bin and its items, then (format 2) the streams section: head->n_streams
 * streams (n_records and stream_bytes the sums over their records), each with its entry table,
 * records and groups; the trailer. Nothing is checked here beyond the format: the caller hands
 * what a server holds, which keeps the rules the reader checks. Writes go through a 1 MiB
 * buffer; large pieces go straight to the file. Neither syncs nor closes fd. Returns 0,
 * -ENOMEM, -EINVAL (format 1 with streams, or an unknown format), or the negated errno of the
 * write that failed.
 * tsd_snapfile_write_all writes format 3's replay tables section after the streams:
 * head->n_tables tables (n_titems and table_bytes the sums over their items), each with its item
 * table and records; tsd_snapfile_write is it without tables (head->n_tables 0). -EINVAL also for
 * tables in a format before 3.
 */
int tsd_snapfile_write(int fd, const tsd_snapfile_head *head, const tsd_snapfile_bin *bins,
                       const tsd_snapfile_stream *streams, tsd_snapfile_item_fn item, void *arg);
int tsd_snapfile_write_all(int fd, const tsd_snapfile_head *head, const tsd_snapfile_bin *bins,
                           const tsd_snapfile_stream *streams, const tsd_snapfile_table *tables,
                           tsd_snapfile_item_fn item, void *arg);
/*
 * tsd_snapfile_write_all with format 4's parameter server section after the replay tables: every
 * parameter of ps (its header, ring and slots), then every embedding table (its header, ids,
 * rows and Adam step counts); ps may be NULL (an empty section). head's n_params, n_embs and
 * n_rows are ignored: the section's counts come from ps. -EINVAL for a non-empty ps in a format
 * before 4, and for a bin with flags in a format before 5.
 */
int tsd_snapfile_write_ps(int fd, const tsd_snapfile_head *head, const tsd_snapfile_bin *bins,
                          const tsd_snapfile_stream *streams, const tsd_snapfile_table *tables,
                          const tsd_snapfile_ps *ps, tsd_snapfile_item_fn item, void *arg);

/*
 * What the reader hands its caller as it decodes, in file order. The reader checks every
 * length against the bytes left in the file before it calls item (so the memory it asks for
 * never exceeds the file's size in all), and a bin's header checksum before it calls bin.
 */
typedef struct tsd_snapfile_sink {
    void *arg; /* passed to the functions; the reader never reads it */
    /*
     * A bin begins: its name (borrowed for the call), version, item count and flags
     * (TSD_SNAP_BIN_*, only known bits; 0 before format 5); its n_items items come next. A bin
     * flagged TSD_SNAP_BIN_TENSOR has one item, which the reader refuses after reading it unless
     * it is a tensor bin's record. 0 to go on, anything else stops the reader (out of memory).
     */
    int (*bin)(void *arg, const uint8_t *name, size_t name_len, uint64_t version, uint32_t n_items,
               uint32_t flags);
    /*
     * Memory for the next item's len bytes (TS_REC_HDR_SIZE <= len <= the bytes left): the
     * reader reads the record into it, then checks its checksum and validates it as tensord
     * validates a PUT. The memory belongs to the caller from this call on, whatever the reader
     * finds afterwards. NULL stops the reader (out of memory).
     */
    uint8_t *(*item)(void *arg, size_t len);
    /*
     * Format 2 (required when the file holds a stream; a file with one is refused when they
     * are NULL). A stream begins: s (borrowed for the call, groups NULL) has passed every check
     * of its header and entry table; its s->n_records records come next through record (as
     * items do through item, each checked and validated after it is read), then its
     * s->n_groups groups through group, each whole and checked (names, ids, pending entries)
     * before the call. 0 to go on, anything else stops the reader (out of memory).
     */
    int (*stream)(void *arg, const tsd_snapfile_stream *s);
    uint8_t *(*record)(void *arg, size_t len);
    int (*group)(void *arg, const tsd_snapfile_group *g);
    /*
     * Format 3 (required when the file holds a replay table, as for streams). A table begins: t
     * (borrowed for the call) has passed every check of its header and item table; its
     * t->n_items records come next through trecord, each checked and validated after it is
     * read. 0 to go on, anything else stops the reader.
     */
    int (*table)(void *arg, const tsd_snapfile_table *t);
    uint8_t *(*trecord)(void *arg, size_t len);
    /*
     * Format 4 (required when the file's parameter server section is not empty). A parameter
     * begins: p (borrowed for the call, its ring included) has passed every check of its header
     * and ring; then ps_array is asked for memory for each of its tsd_snapfile_slots(p->opt)
     * slots (numel floats each), in order. A table begins: t has passed every check of its
     * header; then ps_array is asked for its ids (n_rows int64), its rows (n_rows x dim x
     * (1 + slots) floats) and, for Adam, its step counts (n_rows u32). Each array is read into
     * that memory and its checksum checked (the ids also each in [0, num_ids), or below 2^63 when
     * num_ids is 0) before the next call; the memory belongs to the caller from its call on. The
     * reader does not look for duplicate names or ids: the caller does as it rebuilds. 0 (or
     * memory) to go on; -1 (or NULL) stops the reader.
     */
    int (*param)(void *arg, const tsd_snapfile_param *p);
    int (*emb)(void *arg, const tsd_snapfile_emb *t);
    void *(*ps_array)(void *arg, size_t len);
    /*
     * Optional: how bin names are written into error messages (tensord passes
     * tsd_name_printable); when NULL, bytes outside printable ASCII appear as '?'.
     */
    void (*name_printable)(const uint8_t *name, size_t len, char *out, size_t cap);
} tsd_snapfile_sink;

/*
 * Read the snapshot in the size bytes of fd from its current offset, or in p[0..len), handing
 * each bin and item, then each stream, record and group to sink. The whole file must be good:
 * every checksum, the counts and sums against the header, the streams section and the trailer,
 * every record valid, every stream rule (settings in range, entries dense from first_id to
 * last_id, group and member names 1..255 bytes and unique but for one orphans member, pending
 * ids ascending per member, inside [first_id, next_id) and never twice in a group), nothing
 * after the trailer. Returns 0
 * and fills *head, or fails with a message in err naming label (the file's path) and the
 * problem ("... is truncated: ...", "... is damaged: ...", or "format N is not supported"):
 * TS_EPROTO for a bad file, TS_ENOMEM when sink refused (or the reader's own buffer could not
 * be had), the negated errno of a failed read. After a failure the caller frees whatever its
 * sink took; nothing it was handed is known to be good.
 */
int tsd_snapfile_read_fd(int fd, uint64_t size, const char *label, const tsd_snapfile_sink *sink,
                         tsd_snapfile_head *head, char *err, size_t err_cap);
int tsd_snapfile_read_mem(const uint8_t *p, size_t len, const char *label,
                          const tsd_snapfile_sink *sink, tsd_snapfile_head *head, char *err,
                          size_t err_cap);

#endif /* TSD_SNAPFILE_H */
