/*
 * The STATS reply: a record holding one map of integer counters, encoded with the same record
 * codec as any item, so every client can read it with the code it already has.
 */
#include "server.h"
#include "service.h"
#include "stream.h"
#include "table.h"

#include "record.h"

/* Add key = v to map. 0 or TS_ENOMEM. */
static int put_int(ts_value_t *map, const char *key, uint64_t v)
{
    return ts_map_set(map, key, ts_int_new(v > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)v));
}

/* Build the counters map; NULL on allocation failure. */
static ts_value_t *build(tsd_server *srv)
{
    static const struct {
        const char *key;
        uint8_t op;
    } ops[] = {
        {"ops_hello", TS_OP_HELLO},
        {"ops_auth_challenge", TS_OP_AUTH_CHALLENGE},
        {"ops_ping", TS_OP_PING},
        {"ops_put", TS_OP_PUT},
        {"ops_append", TS_OP_APPEND},
        {"ops_get", TS_OP_GET},
        {"ops_peek", TS_OP_PEEK},
        {"ops_delete", TS_OP_DELETE},
        {"ops_list", TS_OP_LIST},
        {"ops_listen", TS_OP_LISTEN},
        {"ops_unlisten", TS_OP_UNLISTEN},
        {"ops_wait", TS_OP_WAIT},
        {"ops_stats", TS_OP_STATS},
        {"ops_save", TS_OP_SAVE},
        {"ops_get_ref", TS_OP_GET_REF},
        {"ops_peek_ref", TS_OP_PEEK_REF},
        {"ops_put_fd", TS_OP_PUT_FD},
        {"ops_append_fd", TS_OP_APPEND_FD},
        {"ops_tensor_bin", TS_OP_TENSOR_BIN},
        {"ops_read_rows", TS_OP_READ_ROWS},
        {"ops_gather_rows", TS_OP_GATHER_ROWS},
        {"ops_write_rows", TS_OP_WRITE_ROWS},
        {"ops_stream_create", TS_OP_STREAM_CREATE},
        {"ops_stream_append", TS_OP_STREAM_APPEND},
        {"ops_stream_mark", TS_OP_STREAM_MARK},
        {"ops_stream_credit", TS_OP_STREAM_CREDIT},
        {"ops_stream_join", TS_OP_STREAM_JOIN},
        {"ops_stream_read", TS_OP_STREAM_READ},
        {"ops_stream_ack", TS_OP_STREAM_ACK},
        {"ops_stream_leave", TS_OP_STREAM_LEAVE},
        {"ops_stream_info", TS_OP_STREAM_INFO},
        {"ops_stream_range", TS_OP_STREAM_RANGE},
        {"ops_add", TS_OP_ADD},
        {"ops_put_if", TS_OP_PUT_IF},
        {"ops_take", TS_OP_TAKE},
        {"ops_mget", TS_OP_MGET},
        {"ops_barrier", TS_OP_BARRIER},
        {"ops_table_create", TS_OP_TABLE_CREATE},
        {"ops_table_insert", TS_OP_TABLE_INSERT},
        {"ops_table_sample", TS_OP_TABLE_SAMPLE},
        {"ops_table_update", TS_OP_TABLE_UPDATE},
        {"ops_table_remove", TS_OP_TABLE_REMOVE},
        {"ops_table_info", TS_OP_TABLE_INFO},
        {"ops_svc_register", TS_OP_SVC_REGISTER},
        {"ops_svc_call", TS_OP_SVC_CALL},
        {"ops_svc_reply", TS_OP_SVC_REPLY},
        {"ops_shard_map", TS_OP_SHARD_MAP},
        {"ops_ps_create", TS_OP_PS_CREATE},
        {"ops_ps_push", TS_OP_PS_PUSH},
        {"ops_ps_pull", TS_OP_PS_PULL},
        {"ops_emb_create", TS_OP_EMB_CREATE},
        {"ops_emb_pull", TS_OP_EMB_PULL},
        {"ops_emb_push", TS_OP_EMB_PUSH},
    };
    ts_value_t *m = ts_map_new();
    if (m == NULL)
        return NULL;
    const tsd_stats *st = &srv->stats;
    uint64_t uptime_ms = (ts__now_ns() - srv->start_ns) / 1000000u;
    int rc = 0;
    rc |= put_int(m, "uptime_ms", uptime_ms);
    rc |= put_int(m, "uptime_s", uptime_ms / 1000u);
    rc |= put_int(m, "server_id", srv->server_id & (uint64_t)INT64_MAX);
    rc |= put_int(m, "version", srv->version);
    rc |= put_int(m, "connections", srv->n_conns);
    rc |= put_int(m, "connections_total", st->connections_total);
    rc |= put_int(m, "rejected_clients", st->rejected_clients);
    rc |= put_int(m, "bins", srv->store.bins.count);
    rc |= put_int(m, "items", srv->store.n_items);
    rc |= put_int(m, "bytes", srv->store.held);
    rc |= put_int(m, "bytes_reserved", srv->store.reserved);
    /* Everything counted against max_memory, and its parts besides bytes and bytes_reserved. */
    rc |= put_int(m, "used_memory", tsd_store_used(&srv->store));
    rc |= put_int(m, "overhead_bytes", srv->store.overhead);
    rc |= put_int(m, "output_bytes", srv->store.output);
    rc |= put_int(m, "connection_bytes", srv->store.conns);
    rc |= put_int(m, "orphaned_bytes", srv->store.orphaned_bytes);
    rc |= put_int(m, "connections_unauth", srv->n_unauth);
    rc |= put_int(m, "max_memory", srv->store.max_memory);
    /* Small records live in slabs (server/slab.c): their own footprint. */
    tsd_slab_stats ss;
    tsd_slab_stats_get(&ss);
    rc |= put_int(m, "slabs", ss.slabs);
    rc |= put_int(m, "slab_bytes", ss.mapped);
    rc |= put_int(m, "slab_meta_bytes", ss.meta);
    rc |= put_int(m, "slab_slots_used", ss.slots_used);
    rc |= put_int(m, "slab_empty_kept_bytes", ss.empty_kept);
    rc |= put_int(m, "max_frame", srv->cfg.max_frame);
    rc |= put_int(m, "listeners", st->listeners);
    rc |= put_int(m, "waiters", st->waiters);
    rc |= put_int(m, "watch_bytes", st->watch_bytes);
    rc |= put_int(m, "wake_deferred", st->wake_deferred);
    rc |= put_int(m, "lists_offloop", st->lists_offloop);
    for (size_t i = 0; i < TS__ARRAY_SIZE(ops); i++)
        rc |= put_int(m, ops[i].key, st->ops[ops[i].op]);
    rc |= put_int(m, "notifications_sent", st->notifications_sent);
    rc |= put_int(m, "protocol_errors", st->protocol_errors);
    rc |= put_int(m, "oom_rejections", st->oom_rejections);
    rc |= put_int(m, "slow_readers", st->slow_readers);
    rc |= put_int(m, "bytes_received", st->bytes_received);
    rc |= put_int(m, "bytes_sent", st->bytes_sent);
    rc |= put_int(m, "body_timeouts", st->body_timeouts);
    rc |= put_int(m, "auth_failures", st->auth_failures);
    rc |= put_int(m, "hello_timeouts", st->hello_timeouts);
    rc |= put_int(m, "notes_coalesced", st->notes_coalesced);
    rc |= put_int(m, "out_of_memory", st->out_of_memory);
    rc |= put_int(m, "accept_pauses", st->accept_pauses);
    rc |= put_int(m, "snapshots", st->snapshots);
    rc |= put_int(m, "snapshot_failures", st->snapshot_failures);
    rc |= put_int(m, "snapshot_last_ms", st->snapshot_last_ms);
    rc |= put_int(m, "saved_version", srv->saved_version);
    /* Whether writes are being refused because snapshots fail (--stop-writes-on-save-error). */
    rc |= put_int(m, "last_save_ok", !srv->save_failing);
    rc |= put_int(m, "last_save_time", st->last_save_time);
    rc |= put_int(m, "save_failures_consecutive", st->save_failures_consecutive);
    rc |= put_int(m, "writes_refused", st->writes_refused);
    /* Sharding (shard.c): this daemon's place in its map; shards 0 when not sharded. */
    const ts__shard_map *map = srv->cfg.shard_map;
    rc |= put_int(m, "shard", map != NULL ? srv->cfg.shard_self : 0);
    rc |= put_int(m, "shards", map != NULL ? map->n_shards : 0);
    rc |= put_int(m, "map_epoch", map != NULL ? map->epoch : 0);
    rc |= put_int(m, "wrong_shard", st->wrong_shard);
    rc |= put_int(m, "snapshot_loop_us", st->snapshot_loop_us);
    /* Views (LISTs of many bins, snapshots) walked a chunk per loop turn (view.c). */
    rc |= put_int(m, "view_passes", st->view_passes);
    rc |= put_int(m, "view_active", srv->store.n_passes);
    rc |= put_int(m, "view_captures", srv->store.captures);
    rc |= put_int(m, "view_turns_last", st->view_turns_last);
    rc |= put_int(m, "view_turn_max_us", st->view_turn_max_us);
    /* The data directory's files (--data-dir; all 0 without one). */
    tsd_datadir_stats ds;
    tsd_datadir_stats_get(srv, &ds);
    rc |= put_int(m, "disk_bytes", ds.disk_bytes);
    rc |= put_int(m, "disk_files", ds.files);
    rc |= put_int(m, "max_disk", ds.max_disk);
    rc |= put_int(m, "disk_loaded", ds.loaded);
    rc |= put_int(m, "disk_damaged", ds.damaged);
    rc |= put_int(m, "disk_refused", ds.refused);
    /* Shared memory: memfd items, descriptors held, sent and received (shm.c). */
    tsd_shm_stats sh;
    tsd_shm_stats_get(&sh);
    rc |= put_int(m, "shm_items", sh.items);
    rc |= put_int(m, "shm_bytes", sh.bytes);
    rc |= put_int(m, "shm_pool_bytes", sh.pool_bytes);
    rc |= put_int(m, "fds_held", sh.fds_held);
    rc |= put_int(m, "fds_budget", sh.fds_budget);
    rc |= put_int(m, "fds_sent", sh.fds_sent);
    rc |= put_int(m, "fds_received", sh.fds_received);
    rc |= put_int(m, "fds_pending", sh.fds_pending);
    rc |= put_int(m, "puts_fd", sh.puts_fd);
    /* Large releases on the reclaim thread (reclaim.c). */
    tsd_reclaim_stats rs;
    tsd_reclaim_stats_get(&rs);
    rc |= put_int(m, "reclaim_pending_bytes", rs.pending_bytes);
    rc |= put_int(m, "reclaim_jobs", rs.jobs);
    rc |= put_int(m, "reclaim_bytes", rs.bytes);
    /* Streams (stream.c): stream_groups_stale is counted now; stream_waits are pending reads,
     * ranges and credit waits (also in watch_bytes). */
    tsd_stream_stats ss2;
    tsd_stream_stats_get(srv, &ss2);
    rc |= put_int(m, "streams", ss2.streams);
    rc |= put_int(m, "stream_entries", ss2.entries);
    rc |= put_int(m, "stream_bytes", ss2.bytes);
    rc |= put_int(m, "stream_groups", ss2.groups);
    rc |= put_int(m, "stream_groups_stale", ss2.groups_stale);
    rc |= put_int(m, "stream_backpressure", ss2.backpressure);
    rc |= put_int(m, "stream_entries_lost", ss2.lost);
    rc |= put_int(m, "stream_waits", ss2.waits);
    /* Replay tables (table.c): table_waits are inserts and samples held by rate limiters. */
    tsd_table_stats ts2;
    tsd_table_stats_get(srv, &ts2);
    rc |= put_int(m, "tables", ts2.tables);
    rc |= put_int(m, "table_items", ts2.items);
    rc |= put_int(m, "table_bytes", ts2.bytes);
    rc |= put_int(m, "table_inserts", ts2.inserts);
    rc |= put_int(m, "table_samples", ts2.samples);
    rc |= put_int(m, "table_waits", ts2.waits);
    /* Services (service.c): service_calls_waiting and service_calls_handed are calls now. */
    tsd_svc_stats sv;
    tsd_svc_stats_get(srv, &sv);
    rc |= put_int(m, "services", sv.services);
    rc |= put_int(m, "service_servers", sv.servers);
    rc |= put_int(m, "service_calls_waiting", sv.queued);
    rc |= put_int(m, "service_calls_handed", sv.handed);
    rc |= put_int(m, "service_calls", sv.calls);
    rc |= put_int(m, "service_answers", sv.answered);
    rc |= put_int(m, "service_calls_gone", sv.gone);
    rc |= put_int(m, "service_timeouts", sv.timeouts);
    rc |= put_int(m, "service_late_answers", sv.late_replies);
    /* Allocations since start-up ended (the allocation-failure tests size their runs by it). */
    rc |= put_int(m, "allocations", ts__alloc_count() - srv->alloc_base);
    if (rc != 0) {
        ts_value_free(m);
        return NULL;
    }
    return m;
}

void tsd_stats_reply(tsd_conn *c, const ts__hdr *h)
{
    ts_value_t *m = build(c->srv);
    uint8_t *rec = NULL;
    size_t len = 0;
    if (m == NULL || ts__record_encode(m, &rec, &len) != 0) {
        ts_value_free(m);
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INTERNAL, "out of memory in STATS");
        return;
    }
    ts_value_free(m);
    tsd_reply(c, h->opcode, h->request_id, TS_ST_OK, rec, len);
    ts__free_aligned(rec, len);
}
