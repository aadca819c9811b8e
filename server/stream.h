/*
 * Streams (stream.c): a bin kind holding an append-only log of entries with dense 64-bit ids,
 * read through cursors the server keeps (groups of members), with retention and back-pressure
 * (docs/PROTOCOL.md, the STREAM_* opcodes 0x16 to 0x1F).
 *
 * Streams share the namespace of bins but live in a table of their own (tsd_streams.table), so
 * that the store's bins, passes and views stay exactly what they were: a name is a plain bin, a
 * tensor bin, or a stream, never two of them (the request handlers refuse a clash).
 *
 * Everything here runs on the loop thread, and nothing is thread-safe. Memory: the records of
 * entries count against --max-memory like items (store.held, through the store's reservation
 * path: an upload's reservation becomes held bytes); the ring, the groups, members, pending
 * entries and waiters count as store.overhead (the waiters also in STATS watch_bytes). Every
 * count named "bytes" below is of records only.
 *
 * Time: every time here (append time, last_seen, last_delivery, deadlines) is uv_now() of the
 * server's loop, in ms: a monotonic clock that is meaningless across processes. A snapshot keeps
 * ages (now - time) and a load turns them back into times (now - age).
 */
#ifndef TSD_STREAM_H
#define TSD_STREAM_H

#include <stdint.h>

#include "deadline.h"
#include "server.h"

/* ---------------------------------------------------------------------------------------------
 * Data structures
 */

/* One entry: a record, or a marker (no record, a producer's tag). */
typedef struct tsd_stream_entry {
    tsd_item *it;     /* the record (one reference held by the stream); NULL for a marker */
    uint64_t tag;     /* a marker's tag; 0 for a record */
    uint64_t time_ms; /* uv_now when it was appended (age retention) */
} tsd_stream_entry;

/*
 * A pending entry: handed to a member, not acknowledged. Kept in its owner's array, sorted by
 * id (the owner is the member whose array holds it).
 */
typedef struct tsd_stream_pending {
    uint64_t id;
    uint64_t last_delivery; /* uv_now of its last hand-out */
    uint32_t deliveries;    /* hand-outs so far (the wire shows at most 65535) */
    uint32_t rows_done;     /* rows of the entry consumed (STREAM_ACK with rows > 0) */
    uint8_t redeliver;      /* marked for redelivery to its owner first (JOIN, snapshot load) */
} tsd_stream_pending;

/*
 * A member: a named reader of a group. Its pending entries are a sorted array (ids ascending)
 * used as a deque: pend[pend_head .. pend_head + n_pend) are live, the rest is room.
 */
typedef struct tsd_stream_member {
    uint8_t *name; /* name_len bytes (1..255), owned; not NUL-terminated */
    uint8_t name_len;
    uint64_t last_seen; /* uv_now of its last JOIN, READ or ACK */
    tsd_stream_pending *pend;
    uint32_t pend_head, n_pend, pend_cap;
    uint32_t n_redeliver; /* of its pending entries, those marked for redelivery */
    uint32_t n_reading;   /* its STREAM_READs waiting now (it is live while one waits) */
} tsd_stream_member;

/*
 * A group: a cursor on the stream. members[0 .. n_members) are the joined members. Entries of
 * members that left wait in orphans (a member that is never live) until another member claims
 * them. lease_ms is the group's own (set at creation from the stream's, changed by JOIN).
 */
typedef struct tsd_stream_group {
    uint8_t *name; /* owned; 1..255 bytes */
    uint8_t name_len;
    uint64_t next_id; /* the next entry never handed to a member of the group */
    uint64_t lost;    /* entries dropped by retention before the group acknowledged them */
    uint32_t lease_ms;
    tsd_stream_member **members;
    uint32_t n_members, members_cap;
    tsd_stream_member orphans; /* name_len 0: pending entries of members that left */
    /* Caches (stream.c keeps them exact): the smallest pending id, and the newest last_seen. */
    uint64_t floor;       /* smallest pending id of any member or orphan, else next_id */
    uint64_t newest_seen; /* max last_seen over members (0 when none): live iff within lease */
    uint32_t n_reading;   /* STREAM_READs of its members waiting now (live while one waits) */
    /* stream.c's wake-up pass: the pass that found nothing claimable in the group (0: none). */
    uint64_t none_claimable_pass;
} tsd_stream_group;

/* A stream's settings (STREAM_CREATE; lease_ms already defaulted: never 0 here). */
typedef struct tsd_stream_config {
    uint64_t max_entries; /* 1..TS_STREAM_MAX_ENTRIES */
    uint64_t max_bytes;   /* 0 = no byte limit (besides --max-memory) */
    uint32_t max_age_ms;  /* 0 = none */
    uint32_t window;      /* 0 = none; else <= max_entries */
    uint32_t lease_ms;    /* 1..TS_STREAM_MAX_LEASE_MS: the lease of groups created later */
} tsd_stream_config;

typedef struct tsd_swait tsd_swait;

/*
 * A stream. Entries are a ring: entry id (first_id <= id <= last_id) is
 * ring[(ring_head + (id - first_id)) & (ring_cap - 1)]; ring_cap is a power of two (or 0).
 * n_entries = last_id + 1 - first_id.
 */
typedef struct tsd_stream {
    tsd_hnode node; /* first: in tsd_streams.table (name owned, after the struct) */
    tsd_server *srv;
    tsd_stream_config cfg;
    uint64_t first_id; /* oldest kept id; last_id + 1 when none is kept */
    uint64_t last_id;  /* newest id given (0 before the first entry) */
    uint64_t bytes;    /* record bytes of the kept entries */
    tsd_stream_entry *ring;
    uint64_t ring_head, ring_cap;
    tsd_stream_group **groups;
    uint32_t n_groups, groups_cap;
    tsd_swait *waits, *waits_tail; /* pending READ/RANGE/CREDIT requests, oldest first */
    uv_timer_t *lease_timer;       /* armed for the next lease end that matters; NULL when none */
    uint64_t lease_due;            /* uv_now the lease timer fires at (0 = not armed) */
    uint64_t cost;                 /* bytes of bookkeeping counted in store.overhead */
} tsd_stream;

/* stream.c's server-wide state (tsd_server.streams). */
typedef struct tsd_streams {
    tsd_htab table; /* tsd_stream by name */
    /* Pending waits by deadline: a binary min-heap and one timer (allocated while needed). */
    tsd_deadlines deadlines;
    /* Counters for STATS (the rest is computed when asked). */
    uint64_t entries;      /* entries kept, all streams */
    uint64_t bytes;        /* record bytes kept, all streams */
    uint64_t backpressure; /* STREAM_APPENDs answered BACKPRESSURE */
    uint64_t lost;         /* entries dropped before some group acknowledged them (per group) */
    uint64_t n_waits;      /* pending READ/RANGE/CREDIT requests */
} tsd_streams;

/* ---------------------------------------------------------------------------------------------
 * Life cycle and hooks (server.c, ops.c, conn.c, notify.c, stats.c)
 */

/* At start: allocate srv->streams. 0 or TS_ENOMEM. */
int tsd_streams_init(tsd_server *srv);
/*
 * At shutdown (tsd_server_stop, after the connections were told): close the timers so that the
 * loop can run out. Waits were answered by tsd_stream_conn_stop already.
 */
void tsd_streams_stop(tsd_server *srv);
/* At exit: free every stream (entries, groups) and the state. Safe to call twice. */
void tsd_streams_free(tsd_server *srv);
/* The cron (every TSD_CRON_MS): age retention of every stream. */
void tsd_streams_cron(tsd_server *srv);

/* The stream named name, or NULL. */
tsd_stream *tsd_stream_find(tsd_server *srv, const uint8_t *name, size_t len);

/*
 * Handle a STREAM_* control request (every one but STREAM_APPEND) decoded into m by
 * tsd_op_dispatch: exactly one reply, now or when its wait ends.
 */
void tsd_stream_dispatch(tsd_conn *c, const ts__hdr *h, const ts__msg *m);
/*
 * STREAM_APPEND's early check, once the header and the name are in (conn.c), before any byte of
 * the record is reserved: 0 when the upload may go on; else the status it will be answered with
 * (TS_ST_NOT_FOUND, TS_ST_INVALID for a plain bin's name, TS_ST_BACKPRESSURE) once its body has
 * been read and dropped (tsd_stream_refuse_append).
 */
uint16_t tsd_stream_append_check(tsd_server *srv, const uint8_t *name, size_t len);
/* Answer a STREAM_APPEND refused by tsd_stream_append_check (its body was dropped). */
void tsd_stream_refuse_append(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t len,
                              uint16_t status);
/*
 * Finish a STREAM_APPEND whose record has been received and validated into item: as
 * tsd_op_store, the reference and the store reservation of tsd_item_len(item) are the callee's.
 * The stream and its credit are checked again (they may have changed while the body arrived).
 */
void tsd_stream_append(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t len,
                       tsd_item *item);
/* DELETE of a stream: remove it, answer its waits NOT_FOUND, reply and notify (event 4). */
void tsd_stream_delete(tsd_conn *c, const ts__hdr *h, tsd_stream *st);
/* A closing connection: drop its pending waits (no answer: nobody reads it). */
void tsd_stream_conn_gone(tsd_server *srv, tsd_conn *c);
/* tensord is stopping: answer c's pending waits SHUTTING_DOWN and drop them. Returns how many. */
size_t tsd_stream_conn_stop(tsd_server *srv, tsd_conn *c);

/* The LIST entry values of a stream: n_items = entries kept, bytes, version = last_id. */
uint32_t tsd_stream_n_entries(const tsd_stream *st);
/*
 * Every stream, sorted by name as LIST sorts (bytes, a prefix first), into a new array (*out,
 * ts__free it; NULL when there is none). 0 or TS_ENOMEM.
 */
int tsd_stream_sorted(tsd_server *srv, tsd_stream ***out, size_t *n);
/*
 * A plain-bin request (PUT, APPEND, GET, PEEK, the by-reference and row requests) names a
 * stream: answer INVALID "bin 'x' is a stream" and return 1; else 0 (nothing sent).
 */
int tsd_stream_refuse_name(tsd_conn *c, uint8_t op, uint32_t rid, const uint8_t *name, size_t len);

typedef struct tsd_stream_stats {
    uint64_t streams, entries, bytes, groups, groups_stale, backpressure, lost, waits;
} tsd_stream_stats;
/* STATS values (groups_stale is computed now: O(groups)). */
void tsd_stream_stats_get(tsd_server *srv, tsd_stream_stats *out);

/* ---------------------------------------------------------------------------------------------
 * Walking streams (snapshots): read the structures above directly. The order of the table walk
 * is unspecified; entries go from first_id to last_id; groups are st->groups[0 .. n_groups);
 * members g->members[0 .. n_members) and g->orphans (name_len 0: entries of members that left);
 * a member's pending entries are m->pend[m->pend_head + k] for k < m->n_pend, ids ascending.
 */

/* Call fn for each stream (stop at the first non-zero return, which is returned). */
int tsd_stream_each(tsd_server *srv, int (*fn)(tsd_stream *st, void *arg), void *arg);
/* The entry with id (first_id <= id <= last_id), else NULL. */
tsd_stream_entry *tsd_stream_entry_get(const tsd_stream *st, uint64_t id);
/* 1 when g has a live member now (now = uv_now). */
int tsd_stream_group_live(const tsd_stream_group *g, uint64_t now);

/* ---------------------------------------------------------------------------------------------
 * Rebuilding streams (snapshot loading). Call in this order for one stream: restore, then every
 * entry in id order, then its groups, each group's members, each member's pending entries in id
 * order. Each returns 0, TS_EINVAL for a value that breaks the rules (the caller rejects the
 * snapshot), TS_EOOM past --max-memory, or TS_ENOMEM.
 */

/*
 * A new empty stream with settings cfg (checked as STREAM_CREATE checks them) whose next entry
 * gets id first_id (>= 1): first_id = last_id + 1 of the saved stream when it kept no entry.
 * TS_EINVAL also when the name is taken (by a bin or a stream).
 */
int tsd_stream_restore(tsd_server *srv, const uint8_t *name, size_t len,
                       const tsd_stream_config *cfg, uint64_t first_id, tsd_stream **out);
/*
 * Add entry id (must be last_id + 1) with append time time_ms: a record it (the caller's
 * reference and a store reservation of tsd_item_len(it), made with tsd_store_reserve, are
 * taken on success) or a marker (it NULL, tag). No retention is applied.
 */
int tsd_stream_restore_entry(tsd_server *srv, tsd_stream *st, uint64_t id, uint64_t time_ms,
                             tsd_item *it, uint64_t tag);
/*
 * Add group name with next_id (first_id <= next_id <= last_id + 1), lost, lease_ms
 * (1..TS_STREAM_MAX_LEASE_MS).
 */
int tsd_stream_restore_group(tsd_server *srv, tsd_stream *st, const uint8_t *name, size_t len,
                             uint64_t next_id, uint64_t lost, uint32_t lease_ms,
                             tsd_stream_group **out);
/*
 * Add member name to g, live from now (last_seen = uv_now). name_len 0 gives g's orphans
 * (entries of members that had left).
 */
int tsd_stream_restore_member(tsd_server *srv, tsd_stream *st, tsd_stream_group *g,
                              const uint8_t *name, size_t len, tsd_stream_member **out);
/*
 * Add a pending entry of m: id kept (first_id <= id < g->next_id), above m's previous ones, and
 * not pending elsewhere in g (the caller's snapshot guarantees it; a duplicate is TS_EINVAL only
 * within m). Marked for redelivery (after a restart every pending entry goes to its owner again).
 */
int tsd_stream_restore_pending(tsd_server *srv, tsd_stream *st, tsd_stream_group *g,
                               tsd_stream_member *m, uint64_t id, uint32_t deliveries,
                               uint32_t rows_done);

#endif /* TSD_STREAM_H */
