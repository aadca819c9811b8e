/*
 * tensorshare streams: one producer feeding many readers through tensord.
 *
 * A stream is a kind of bin that holds an append-only log of entries. Each entry has a 64-bit
 * id: the first entry of a stream gets 1 and every later one the previous id + 1, so the entries
 * a stream keeps are exactly the ids [first_id, last_id]. An entry is a record (a ts_value_t, as
 * an item of a bin) or an end-of-epoch marker (no record, a 64-bit tag such as the epoch
 * number). The stream keeps its newest entries within a replay window (a count, bytes, an age).
 *
 * Readers are members of groups. A group is a cursor the server keeps: every entry goes to
 * exactly one member of each group, and stays pending with that member until it is acknowledged.
 * One group per consumer (group name = consumer name) gives fan-out: every consumer gets every
 * entry, in order. One group of many members gives a work queue. A member that joins again
 * (after a crash, a reconnect) gets first what it had been given and had not acknowledged; a
 * member not seen for its group's lease stops holding the producer back, and its pending entries
 * go to the other members of its group.
 *
 * Credits: with a window W, an append is refused (TS_EAGAIN) while a live group has W entries
 * not acknowledged; ts_stream_credit waits for room. The producer helper below does both.
 *
 * The semantics are those of docs/STREAMS.md; the wire form is docs/PROTOCOL.md 8.23 to 8.32.
 *
 * Conventions are those of tensorshare.h: 0 or a negative TS_E* code with its reason in
 * ts_last_error(), out-parameters written only on success (they may be NULL where a comment
 * says so), borrowed pointer parameters, _free(NULL) is a no-op, and timeouts as tensorshare.h
 * describes. Every blocking call is bounded by the client's request timeout (plus its own wait,
 * where it has one) and returns TS_EDEADLK from a client callback. The waits of ts_stream_credit,
 * ts_stream_read and ts_stream_range take 0 or more ms or TS_TIMEOUT_DEFAULT (TS_TIMEOUT_INFINITE
 * is TS_EINVAL). Names of streams, groups and members are NUL-terminated strings of 1 to 255
 * bytes (NULL or empty: TS_EINVAL; longer: TS_ENAMETOOLONG). Errors from the server: TS_ENOENT
 * (no such stream, group or member), TS_EINVAL (an argument the server refuses: a name that is a
 * plain bin, an id past the newest, a count of 0 or over TS_STREAM_READ_MAX, ...; nothing
 * changed), TS_EAGAIN (the window is full), TS_EOOM, TS_ESAVEFAIL. Added in 0.4.0.
 */
#ifndef TENSORSHARE_STREAM_H
#define TENSORSHARE_STREAM_H

#include <stddef.h>
#include <stdint.h>

#include "tensorshare/tensorshare.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Entries one read returns at most. Added in 0.4.0. */
#define TS_STREAM_READ_MAX 1024
/* The most entries a stream may keep (ts_stream_config_t.max_entries). Added in 0.4.0. */
#define TS_STREAM_ENTRIES_MAX (1u << 24)
/* ms; the lease of a group when none is given. Added in 0.4.0. */
#define TS_STREAM_DEFAULT_LEASE_MS 10000

/* A stream's settings (ts_stream_create). Fill with ts_stream_config_init. Added in 0.4.0. */
typedef struct ts_stream_config_s {
    uint64_t max_entries; /* the replay window in entries: 1..TS_STREAM_ENTRIES_MAX; default 1024 */
    uint64_t max_bytes;   /* record bytes kept at most; 0 (default) = only --max-memory bounds */
    uint32_t max_age_ms;  /* entries older than this are dropped (never the newest); 0 = none */
    uint32_t window;      /* credits: W entries a live group may be behind; 0 (default) = none;
                             at most max_entries */
    uint32_t lease_ms;    /* groups' default lease; 0 = TS_STREAM_DEFAULT_LEASE_MS */
} ts_stream_config_t;

/* Added in 0.4.0. */
TS_EXTERN void ts_stream_config_init(ts_stream_config_t *cfg);

/* A stream's state (replies of create, credit, leave). Added in 0.4.0. */
typedef struct ts_stream_state_s {
    uint64_t first_id;  /* the oldest kept entry (last_id + 1 when none is kept) */
    uint64_t last_id;   /* the newest entry (0 before the first append) */
    uint64_t bytes;     /* record bytes kept */
    uint32_t n_entries; /* entries kept */
    uint32_t n_groups;
    uint32_t n_stale; /* groups with no live member */
    uint32_t credit;  /* appends possible before the window is full; UINT32_MAX: no limit */
    uint32_t window;
} ts_stream_state_t;

/* What an append (or a marker) did. Added in 0.4.0. */
typedef struct ts_stream_append_s {
    uint64_t id;       /* the new entry's id */
    uint64_t first_id; /* the oldest kept entry after it */
    uint32_t credit;   /* appends possible after it; UINT32_MAX: no limit */
    uint32_t n_entries;
} ts_stream_append_t;

/* Where a new group starts. Added in 0.4.0. */
typedef enum ts_stream_start_e {
    TS_STREAM_OLDEST = 0, /* at the oldest entry kept (a late joiner replays the window) */
    TS_STREAM_NEWEST = 1  /* with the entries appended after the join */
} ts_stream_start_t;

/* What a join found. Added in 0.4.0. */
typedef struct ts_stream_join_s {
    uint64_t next_id;   /* the next entry the group has never handed out */
    uint64_t floor;     /* the group's oldest unacknowledged entry */
    uint64_t lost;      /* entries the window dropped before the group acknowledged them */
    uint32_t pending;   /* this member's unacknowledged entries (handed out again first) */
    uint32_t members;   /* the group's members */
    uint32_t rows_done; /* rows already consumed of the member's oldest pending entry */
} ts_stream_join_t;

/* What an acknowledgement did. Added in 0.4.0. */
typedef struct ts_stream_ack_s {
    uint64_t acked;   /* entries acknowledged by this call */
    uint64_t floor;   /* the group's oldest unacknowledged entry after it */
    uint32_t pending; /* the member's unacknowledged entries after it */
    uint32_t credit;  /* the stream's credit after it */
} ts_stream_ack_t;

/* Entries returned by a read or a range (opaque; ts_stream_batch_free). Added in 0.4.0. */
typedef struct ts_stream_batch_s ts_stream_batch_t;

/* Added in 0.4.0. */
TS_EXTERN size_t ts_stream_batch_count(const ts_stream_batch_t *b);
/*
 * The oldest and newest ids the stream kept, and the group's lost count, when it was read.
 * Added in 0.4.0.
 */
TS_EXTERN uint64_t ts_stream_batch_first_id(const ts_stream_batch_t *b);
TS_EXTERN uint64_t ts_stream_batch_last_id(const ts_stream_batch_t *b);
TS_EXTERN uint64_t ts_stream_batch_lost(const ts_stream_batch_t *b);
/*
 * Entry i (< count, in id order within each part of the reply: see docs/STREAMS.md).
 * Added in 0.4.0.
 */
TS_EXTERN uint64_t ts_stream_batch_id(const ts_stream_batch_t *b, size_t i);
/*
 * 1 when entry i is an end-of-epoch marker (its value is NULL; its tag is the marker's).
 * Added in 0.4.0.
 */
TS_EXTERN int ts_stream_batch_is_marker(const ts_stream_batch_t *b, size_t i);
TS_EXTERN uint64_t ts_stream_batch_tag(const ts_stream_batch_t *b, size_t i);
/*
 * The record of entry i, valid until ts_stream_batch_free; NULL for a marker or out of range.
 * Added in 0.4.0.
 */
TS_EXTERN const ts_value_t *ts_stream_batch_value(const ts_stream_batch_t *b, size_t i);
/*
 * Times entry i was handed out (1 the first time; 0 from a range), and whether before.
 * Added in 0.4.0.
 */
TS_EXTERN uint32_t ts_stream_batch_deliveries(const ts_stream_batch_t *b, size_t i);
TS_EXTERN int ts_stream_batch_redelivered(const ts_stream_batch_t *b, size_t i);
/* Rows of entry i a member recorded as consumed (ts_stream_ack with rows). Added in 0.4.0. */
TS_EXTERN uint32_t ts_stream_batch_rows_done(const ts_stream_batch_t *b, size_t i);
TS_EXTERN void ts_stream_batch_free(ts_stream_batch_t *b);

/*
 * Create stream name with cfg (NULL: the defaults), or change the settings of an existing one
 * (its retention applies at once). st may be NULL. A plain bin of that name: TS_EINVAL.
 * Added in 0.4.0.
 */
TS_EXTERN int ts_stream_create(ts_client_t *c, const char *name, const ts_stream_config_t *cfg,
                               ts_stream_state_t *st);
/*
 * Append item (its memory is read during the call only). TS_EAGAIN when the window is full
 * (nothing was stored: wait with ts_stream_credit and append again); TS_ENOENT without the
 * stream. res may be NULL.
 * Added in 0.4.0.
 */
TS_EXTERN int ts_stream_append(ts_client_t *c, const char *name, const ts_value_t *item,
                               ts_stream_append_t *res);
/*
 * Append an end-of-epoch marker with tag (never refused for credit). res may be NULL.
 * Added in 0.4.0.
 */
TS_EXTERN int ts_stream_mark(ts_client_t *c, const char *name, uint64_t tag,
                             ts_stream_append_t *res);
/*
 * Wait at most timeout_ms (0: check once; TS_TIMEOUT_DEFAULT: the request timeout) until the
 * stream has credit for an append. 0 with *st, or TS_ETIMEDOUT (then *st holds the state, credit
 * 0). st may be NULL.
 * Added in 0.4.0.
 */
TS_EXTERN int ts_stream_credit(ts_client_t *c, const char *name, int timeout_ms,
                               ts_stream_state_t *st);
/*
 * Join group as member (creating either when missing; a new group starts at start). lease_ms:
 * 0 keeps the group's lease (the stream's for a new group), else it becomes the group's. res
 * may be NULL.
 * Added in 0.4.0.
 */
TS_EXTERN int ts_stream_join(ts_client_t *c, const char *name, const char *group,
                             const char *member, ts_stream_start_t start, int lease_ms,
                             ts_stream_join_t *res);
/*
 * Read up to max_entries (1..TS_STREAM_READ_MAX) for member of group: first its entries to be
 * handed out again, then the pending entries of members whose lease has passed, then new ones.
 * ack_through > 0 first acknowledges the member's pending entries with ids <= ack_through. When
 * there is nothing, waits at most timeout_ms for an append (0: do not wait; TS_TIMEOUT_DEFAULT:
 * the request timeout), then returns 0 with an empty batch. *out is yours.
 * Added in 0.4.0.
 */
TS_EXTERN int ts_stream_read(ts_client_t *c, const char *name, const char *group,
                             const char *member, uint64_t ack_through, size_t max_entries,
                             int timeout_ms, ts_stream_batch_t **out);
/*
 * rows == 0: acknowledge the member's pending entries with ids in [first, last]. rows > 0 (first
 * == last): record that rows rows of that entry are consumed; it stays pending. res may be NULL.
 * Added in 0.4.0.
 */
TS_EXTERN int ts_stream_ack(ts_client_t *c, const char *name, const char *group, const char *member,
                            uint64_t first, uint64_t last, uint32_t rows, ts_stream_ack_t *res);
/*
 * member leaves group (its pending entries go to the others at once); member NULL removes the
 * whole group with its cursor. st may be NULL.
 * Added in 0.4.0.
 */
TS_EXTERN int ts_stream_leave(ts_client_t *c, const char *name, const char *group,
                              const char *member, ts_stream_state_t *st);
/*
 * The stream's settings, ids, groups and members as a map (docs/STREAMS.md lists the keys).
 * *out is yours (ts_value_free). Added in 0.4.0.
 */
TS_EXTERN int ts_stream_info(ts_client_t *c, const char *name, ts_value_t **out);
/*
 * The kept entries with id > after_id, oldest first, up to max_entries, without a cursor;
 * waits at most timeout_ms when there are none yet. after_id past the newest id: TS_EINVAL.
 * Added in 0.4.0.
 */
TS_EXTERN int ts_stream_range(ts_client_t *c, const char *name, uint64_t after_id,
                              size_t max_entries, int timeout_ms, ts_stream_batch_t **out);

/* ---------------------------------------------------------------------------------------------
 * The producer helper: appends that wait for credit. Added in 0.4.0.
 */
typedef struct ts_stream_producer_s ts_stream_producer_t;

/*
 * A producer of stream name on c (borrowed; it must outlive the producer). cfg non-NULL creates
 * (or reconfigures) the stream; NULL requires it to exist. block_ms: how long one push waits for
 * credit (0: fail with TS_EAGAIN at once; TS_TIMEOUT_INFINITE: as long as it takes, in steps of
 * the request timeout; TS_TIMEOUT_DEFAULT: the request timeout).
 * Added in 0.4.0.
 */
TS_EXTERN int ts_stream_producer_open(ts_stream_producer_t **out, ts_client_t *c, const char *name,
                                      const ts_stream_config_t *cfg, int block_ms);
/*
 * Append item, waiting for credit as block_ms says (TS_ETIMEDOUT: it ran out). id may be NULL.
 * Added in 0.4.0.
 */
TS_EXTERN int ts_stream_producer_push(ts_stream_producer_t *p, const ts_value_t *item,
                                      uint64_t *id);
/* Append an end-of-epoch marker with tag. id may be NULL. Added in 0.4.0. */
TS_EXTERN int ts_stream_producer_end_epoch(ts_stream_producer_t *p, uint64_t tag, uint64_t *id);
/* Times a push found the window full and waited (for statistics). Added in 0.4.0. */
TS_EXTERN uint64_t ts_stream_producer_waits(const ts_stream_producer_t *p);
TS_EXTERN void ts_stream_producer_free(ts_stream_producer_t *p);

/* ---------------------------------------------------------------------------------------------
 * The consumer helper: batches at the consumer's own size, acknowledged as they are used.
 * Added in 0.4.0.
 */
typedef struct ts_stream_consumer_s ts_stream_consumer_t;

/* Added in 0.4.0. */
typedef struct ts_stream_consumer_options_s {
    ts_stream_start_t start; /* where a new group starts; default TS_STREAM_OLDEST */
    int lease_ms;            /* 0 (default): the group's lease */
    /*
     * Rows per batch: 0 (default) hands out entries as they were appended. B > 0 re-slices: every
     * tensor of an entry (its root, or the tensors of its root map; all with the same first
     * dimension) is cut and joined along the first dimension into batches of exactly B rows,
     * whatever the producer's batch size; a batch never spans a marker, so the last batch of an
     * epoch may be shorter.
     */
    uint32_t batch_rows;
    uint32_t prefetch; /* entries asked for per read: 1..TS_STREAM_READ_MAX; default 4 */
    int timeout_ms;    /* how long next waits for an entry; default TS_TIMEOUT_DEFAULT */
} ts_stream_consumer_options_t;

/* Added in 0.4.0. */
TS_EXTERN void ts_stream_consumer_options_init(ts_stream_consumer_options_t *o);

/*
 * Join group as member of stream name on c (borrowed; it must outlive the consumer). opts may be
 * NULL. A consumer that joins again resumes exactly after what it had acknowledged, rows
 * included.
 * Added in 0.4.0.
 */
TS_EXTERN int ts_stream_consumer_open(ts_stream_consumer_t **out, ts_client_t *c, const char *name,
                                      const char *group, const char *member,
                                      const ts_stream_consumer_options_t *opts);

/* What ts_stream_consumer_next handed out. Added in 0.4.0. */
typedef struct ts_stream_item_s {
    int end_of_epoch;  /* 1: a marker; value is NULL and tag is the marker's */
    uint64_t tag;      /* the marker's tag */
    uint64_t first_id; /* the entries the batch's rows came from: [first_id, last_id] */
    uint64_t last_id;
    uint64_t lost; /* entries the group lost to the window so far */
} ts_stream_item_t;

/*
 * The next batch (or marker). *value is yours (ts_value_free), NULL for a marker. Everything
 * handed out counts as consumed: the entries handed out whole are acknowledged with the
 * consumer's next read from the server; the rows used of an entry handed out in part only by
 * ts_stream_consumer_commit (or close). So after a crash a consumer gets again what it handed
 * out since its last read or commit (at least once; exactly once up to the last commit). An
 * entry that cannot be re-sliced (not a tensor or a map of tensors, a first dimension that
 * differs between its tensors, keys, dtypes or trailing shapes unlike the batch's first entry)
 * gives TS_EINVAL, every time: read such a stream with batch_rows 0. TS_ETIMEDOUT when nothing
 * came within the timeout (a batch being built is kept for the next call). info may be NULL.
 * One thread at a time per consumer; many consumers (and producers) may share a client.
 * Added in 0.4.0.
 */
TS_EXTERN int ts_stream_consumer_next(ts_stream_consumer_t *s, ts_value_t **value,
                                      ts_stream_item_t *info);
/*
 * Acknowledge now everything handed out (whole entries, and the rows used of a partly used one),
 * so that a restart resumes right after it.
 * Added in 0.4.0.
 */
TS_EXTERN int ts_stream_consumer_commit(ts_stream_consumer_t *s);
/*
 * Commit, then free (the member stays in its group; leave = 1 leaves it). NULL is a no-op.
 * Added in 0.4.0.
 */
TS_EXTERN void ts_stream_consumer_close(ts_stream_consumer_t *s, int leave);

#ifdef __cplusplus
}
#endif

#endif /* TENSORSHARE_STREAM_H */
