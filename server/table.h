/*
 * Replay tables (table.c): a bin kind holding items (a record, a priority, a server-given u64 key)
 * sampled by a sampler (uniform, prioritized, FIFO, LIFO), evicted by a remover when full (FIFO,
 * LIFO, lowest priority) or after max_times_sampled draws, with a rate limiter that keeps
 * samples per insert within a band (docs/PROTOCOL.md, the TABLE_* opcodes 0x28 to 0x2D).
 *
 * Tables share the namespace of bins and streams but live in a table of their own
 * (tsd_tables.table); the request handlers refuse a clash with INVALID both ways, DELETE removes
 * a table, LIST shows it (n_items = size, bytes = record bytes, version = inserts).
 *
 * Everything here runs on the loop thread. Memory: records count against --max-memory like
 * items (store.held, through the store's reservation path); the item structs, the arrays (dense
 * items, sum tree, key buckets, the lowest-priority heap) and the waits count as store.overhead
 * (the waits also in STATS watch_bytes).
 */
#ifndef TSD_TABLE_H
#define TSD_TABLE_H

#include <stdint.h>

#include "server.h"
#include "snapfile.h"

typedef struct tsd_table tsd_table;
typedef struct tsd_twait tsd_twait;

/* At start: allocate srv->tables. 0 or TS_ENOMEM. */
int tsd_tables_init(tsd_server *srv);
/* At shutdown, after the connections' waits were answered: close the timer. */
void tsd_tables_stop(tsd_server *srv);
/* At exit: free every table and the state. Safe to call twice. */
void tsd_tables_free(tsd_server *srv);

/* The table named name, or NULL. */
tsd_table *tsd_table_find(tsd_server *srv, const uint8_t *name, size_t len);
/* Handle TABLE_CREATE, SAMPLE, UPDATE, REMOVE, INFO (decoded by tsd_op_dispatch). */
void tsd_table_dispatch(tsd_conn *c, const ts__hdr *h, const ts__msg *m);
/*
 * Finish a TABLE_INSERT whose record was received and validated into item, with the fixed
 * fields (TS_MSG_TABLE_INSERT_FIXED bytes) kept by conn.c: as tsd_op_store, the reference and
 * the store reservation of tsd_item_len(item) are the callee's. Exactly one reply, now or when
 * the rate limiter lets it in (or its timeout ends).
 */
void tsd_table_insert(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t len,
                      const uint8_t *fixed, size_t fixed_len, tsd_item *item);
/*
 * A TABLE_INSERT whose name and fixed_len bytes of fixed fields have arrived (conn.c
 * start_upload), before anything is reserved for its record: 0 when it may go on, else the
 * reason it is refused now (a missing table or another kind of bin, a bad priority or reserved
 * field, a rate limiter that holds inserts back while the insert's timeout is 0). The record is
 * then read and dropped unchecked, and tsd_table_refuse_insert answers with that reason.
 * Added in 0.5.0.
 */
uint16_t tsd_table_insert_check(tsd_server *srv, const uint8_t *name, size_t len,
                                const uint8_t *fixed, size_t fixed_len);
/* Answer a TABLE_INSERT refused by tsd_table_insert_check for reason. Added in 0.5.0. */
void tsd_table_refuse_insert(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t len,
                             uint16_t reason);
/* DELETE of a table: its waits are answered NOT_FOUND, then the reply and a notification. */
void tsd_table_delete(tsd_conn *c, const ts__hdr *h, tsd_table *t);
/* A closing connection: drop its waits without an answer (their records are released). */
void tsd_table_conn_gone(tsd_server *srv, tsd_conn *c);
/* tensord is stopping: answer c's waits SHUTTING_DOWN and drop them. Returns how many. */
size_t tsd_table_conn_stop(tsd_server *srv, tsd_conn *c);
/*
 * A request for another kind of bin names a table: answer INVALID "bin 'x' is a replay table"
 * and return 1; else 0 (nothing sent).
 */
int tsd_table_refuse_name(tsd_conn *c, uint8_t op, uint32_t rid, const uint8_t *name, size_t len);

/* The LIST entry of t (n_items = size, bytes = record bytes, version = inserts). */
void tsd_table_list_entry(const tsd_table *t, ts__msg_list_entry *e);
/* Call fn for each table (stops at the first non-zero return, which is returned). */
int tsd_table_each(tsd_server *srv, int (*fn)(tsd_table *t, void *arg), void *arg);
/* Tables now (LIST sizes its reply with it). */
size_t tsd_table_count(const tsd_server *srv);

/*
 * Snapshots (snapshot.c). Items of t now (size the capture's arrays with it).
 * Added in 0.5.0.
 */
uint32_t tsd_table_size(const tsd_table *t);
/*
 * Capture t into out for the snapshot file: its settings and counters, and per item, in key order,
 * a row of rows (tsd_table_size(t) rows of TSD_SNAP_TITEM_SIZE bytes, ages counted from now, in
 * uv_now ms) and its record in recs (borrowed: the caller takes its own references). out->name
 * is t's, valid only until t changes. Added in 0.5.0.
 */
void tsd_table_capture(const tsd_table *t, uint64_t now, tsd_snapfile_table *out, uint8_t *rows,
                       tsd_item **recs);
/*
 * Loading a snapshot: a table with s's settings and counters (no items yet) into *out. TS_EINVAL
 * when its name is taken (by a table, a bin or a stream), TS_EOOM / TS_ENOMEM. Added in 0.5.0.
 */
int tsd_table_restore(tsd_server *srv, const tsd_snapfile_table *s, tsd_table **out);
/*
 * Add an item to a restored table, after the ones added so far: it (its reference, and a store
 * reservation of tsd_item_len(it)) becomes the table's on success; on failure both stay the
 * caller's. time_ms is its insertion time in uv_now ms. TS_EINVAL for a key not above the last
 * or not below next_key, a priority the table refuses, a full table; TS_EOOM / TS_ENOMEM.
 * Added in 0.5.0.
 */
int tsd_table_restore_item(tsd_server *srv, tsd_table *t, uint64_t key, double priority,
                           uint32_t times_sampled, uint64_t time_ms, tsd_item *it);

typedef struct tsd_table_stats {
    uint64_t tables, items, bytes, inserts, samples, waits;
} tsd_table_stats;
void tsd_table_stats_get(tsd_server *srv, tsd_table_stats *out);

#endif /* TSD_TABLE_H */
