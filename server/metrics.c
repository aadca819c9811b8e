/*
 * The metrics page: tensord's counters in the Prometheus text exposition format 0.0.4, served by
 * http.c on GET /metrics. Every value comes from the bookkeeping STATS reads (tsd_stats, the
 * store, the data directory, the streams' and tables' totals), never from a walk over bins,
 * items, streams or connections: the page costs the same however much tensord holds. Numbers
 * are written by hand (no printf per sample), so a page of a few hundred lines takes tens of
 * microseconds of loop time. docs/METRICS.md lists every metric.
 */
#include "http.h"
#include "stream.h"
#include "table.h"

#include <stdio.h>
#include <time.h>

#include "tensorshare/version.h"

/* Bytes; the buffer's first size: a page with a few histograms fits without growing. */
#define TSD_TEXT_FIRST ((size_t)16 << 10)

const uint64_t tsd_lat_bounds_ns[TSD_LAT_BOUNDS] = {
    10000u,     25000u,      50000u,      100000u,     250000u,     500000u,    1000000u,
    2500000u,   5000000u,    10000000u,   25000000u,   50000000u,   100000000u, 250000000u,
    500000000u, 1000000000u, 2500000000u, 5000000000u, 10000000000u};

/* The same bounds in seconds, as the le labels name them (fixed text: series stay the same). */
static const char *const lat_le[TSD_LAT_BOUNDS] = {
    "0.00001", "0.000025", "0.00005", "0.0001", "0.00025", "0.0005", "0.001",
    "0.0025",  "0.005",    "0.01",    "0.025",  "0.05",    "0.1",    "0.25",
    "0.5",     "1",        "2.5",     "5",      "10"};

void tsd_text_free(tsd_text *t)
{
    ts__free(t->p);
    t->p = NULL;
    t->len = t->cap = 0;
}

/* Room for n more bytes; 0, or -1 (failed set) when the buffer cannot grow. */
static int room(tsd_text *t, size_t n)
{
    if (t->failed)
        return -1;
    if (t->len + n <= t->cap)
        return 0;
    size_t cap = t->cap < TSD_TEXT_FIRST ? TSD_TEXT_FIRST : t->cap;
    while (cap < t->len + n)
        cap *= 2;
    char *p = ts__realloc(t->p, cap);
    if (p == NULL) {
        t->failed = 1;
        return -1;
    }
    t->p = p;
    t->cap = cap;
    return 0;
}

static void put_mem(tsd_text *t, const char *s, size_t n)
{
    if (room(t, n) != 0)
        return;
    memcpy(t->p + t->len, s, n);
    t->len += n;
}

static void put_str(tsd_text *t, const char *s)
{
    put_mem(t, s, strlen(s));
}

static void put_u64(tsd_text *t, uint64_t v)
{
    char d[20];
    size_t n = 0;
    do {
        d[sizeof(d) - 1 - n++] = (char)('0' + v % 10u);
        v /= 10u;
    } while (v != 0);
    put_mem(t, d + sizeof(d) - n, n);
}

/* v / 10^digits as a decimal with exactly that many fraction digits (ns as seconds: 9). */
static void put_fixed(tsd_text *t, uint64_t v, unsigned digits)
{
    uint64_t scale = 1;
    for (unsigned i = 0; i < digits; i++)
        scale *= 10u;
    put_u64(t, v / scale);
    char f[20];
    uint64_t r = v % scale;
    for (unsigned i = digits; i > 0; i--) {
        f[i - 1] = (char)('0' + r % 10u);
        r /= 10u;
    }
    put_mem(t, ".", 1);
    put_mem(t, f, digits);
}

/*
 * A label value: backslash, double quote and newline escaped as the format asks. The values
 * tensord writes are opcode and status names and its version, which never hold them, but the
 * page must stay well formed whatever a name table says.
 */
static void put_label_value(tsd_text *t, const char *s)
{
    for (; *s != '\0'; s++) {
        if (*s == '\\')
            put_mem(t, "\\\\", 2);
        else if (*s == '"')
            put_mem(t, "\\\"", 2);
        else if (*s == '\n')
            put_mem(t, "\\n", 2);
        else
            put_mem(t, s, 1);
    }
}

/* The HELP and TYPE lines of a metric family. */
static void family(tsd_text *t, const char *name, const char *type, const char *help)
{
    put_str(t, "# HELP ");
    put_str(t, name);
    put_mem(t, " ", 1);
    put_str(t, help);
    put_str(t, "\n# TYPE ");
    put_str(t, name);
    put_mem(t, " ", 1);
    put_str(t, type);
    put_mem(t, "\n", 1);
}

/* One sample without labels: "name value". */
static void sample(tsd_text *t, const char *name, uint64_t v)
{
    put_str(t, name);
    put_mem(t, " ", 1);
    put_u64(t, v);
    put_mem(t, "\n", 1);
}

/* A family of one unlabelled sample. */
static void single(tsd_text *t, const char *name, const char *type, const char *help, uint64_t v)
{
    family(t, name, type, help);
    sample(t, name, v);
}

/* "name{label="value"" (the caller closes the braces, after more labels or none). */
static void open_labels(tsd_text *t, const char *name, const char *label, const char *value)
{
    put_str(t, name);
    put_mem(t, "{", 1);
    put_str(t, label);
    put_mem(t, "=\"", 2);
    put_label_value(t, value);
    put_mem(t, "\"", 1);
}

/* One sample with one label. */
static void labelled(tsd_text *t, const char *name, const char *label, const char *value,
                     uint64_t v)
{
    open_labels(t, name, label, value);
    put_mem(t, "} ", 2);
    put_u64(t, v);
    put_mem(t, "\n", 1);
}

/* The opcodes the codec names (requests and NOTIFY), in numeric order. */
static int op_named(unsigned op)
{
    return strcmp(ts__op_name((uint8_t)op), "UNKNOWN") != 0;
}

static void operations(tsd_text *t, const tsd_stats *st)
{
    family(t, "tensord_operations_total", "counter",
           "Requests handled, by opcode (as STATS ops_*), refused ones included.");
    for (unsigned op = 1; op < TS__ARRAY_SIZE(st->ops); op++)
        if (op_named(op))
            labelled(t, "tensord_operations_total", "op", ts__op_name((uint8_t)op), st->ops[op]);
    family(t, "tensord_errors_total", "counter",
           "Frames sent with a status other than OK, by status name (replies and "
           "connection-level frames).");
    for (unsigned s = 1; s < TSD_STATUS_SLOTS && s < TS_ST_COUNT_; s++)
        labelled(t, "tensord_errors_total", "status", ts__status_name((uint16_t)s), st->errors[s]);
}

/* The latency histograms: one per opcode that has been measured at least once. */
static void latency(tsd_text *t, const tsd_stats *st)
{
    static const char name[] = "tensord_operation_duration_seconds";
    family(t, name, "histogram",
           "Loop time from a request's frame being complete (uploads: their header) to its "
           "reply being queued, or to the request being parked for a reply later (WAIT, TAKE, "
           "BARRIER, stream and table waits, SAVE, LIST off the loop), by opcode.");
    for (unsigned op = 0; op < TS__ARRAY_SIZE(st->latency); op++) {
        const tsd_latency *l = &st->latency[op];
        uint64_t count = 0;
        for (unsigned b = 0; b <= TSD_LAT_BOUNDS; b++)
            count += l->n[b];
        /* Unknown opcodes (answered UNKNOWN_OPCODE) would all carry one label: left out. */
        if (count == 0 || !op_named(op))
            continue;
        const char *opn = ts__op_name((uint8_t)op);
        uint64_t cum = 0;
        for (unsigned b = 0; b <= TSD_LAT_BOUNDS; b++) {
            cum += l->n[b];
            open_labels(t, "tensord_operation_duration_seconds_bucket", "op", opn);
            put_str(t, ",le=\"");
            put_str(t, b < TSD_LAT_BOUNDS ? lat_le[b] : "+Inf");
            put_str(t, "\"} ");
            put_u64(t, cum);
            put_mem(t, "\n", 1);
        }
        open_labels(t, "tensord_operation_duration_seconds_sum", "op", opn);
        put_mem(t, "} ", 2);
        put_fixed(t, l->sum_ns, 9);
        put_mem(t, "\n", 1);
        labelled(t, "tensord_operation_duration_seconds_count", "op", opn, count);
    }
}

int tsd_metrics_render(const tsd_server *srv, tsd_text *t)
{
    const tsd_stats *st = &srv->stats;
    const tsd_store *store = &srv->store;

    family(t, "tensord_build_info", "gauge", "Always 1; the version label is tensord's.");
    labelled(t, "tensord_build_info", "version", TS_VERSION_STRING, 1);
    uint64_t up_ms = srv->start_ns != 0 ? (ts__now_ns() - srv->start_ns) / 1000000u : 0;
    family(t, "tensord_uptime_seconds", "gauge", "Seconds since tensord started.");
    put_str(t, "tensord_uptime_seconds ");
    put_fixed(t, up_ms, 3);
    put_mem(t, "\n", 1);

    operations(t, st);
    single(t, "tensord_protocol_errors_total", "counter",
           "Connections closed for breaking the protocol.", st->protocol_errors);
    single(t, "tensord_auth_failures_total", "counter", "HELLOs refused for a wrong token.",
           st->auth_failures);
    single(t, "tensord_oom_rejections_total", "counter",
           "Writes refused OUT_OF_MEMORY at --max-memory or --max-disk.", st->oom_rejections);
    single(t, "tensord_writes_refused_total", "counter",
           "Writes refused SAVE_FAILING while snapshots fail.", st->writes_refused);
    single(t, "tensord_received_bytes_total", "counter",
           "Bytes read from clients of the binary protocol.", st->bytes_received);
    single(t, "tensord_sent_bytes_total", "counter",
           "Bytes of frames written to clients of the binary protocol.", st->bytes_sent);

    single(t, "tensord_connections", "gauge",
           "Binary protocol connections open now, before and after HELLO.", srv->n_conns);
    single(t, "tensord_connections_unauthenticated", "gauge",
           "Of those, connections that have not completed HELLO.", srv->n_unauth);
    single(t, "tensord_connections_total", "counter", "Binary protocol connections accepted.",
           st->connections_total);
    single(t, "tensord_connections_rejected_total", "counter",
           "Connections refused TOO_MANY_CLIENTS (--max-clients, --max-unauth-clients).",
           st->rejected_clients);
    single(t, "tensord_slow_readers_total", "counter",
           "Connections cut off SLOW_READER (--max-output, --output-soft).", st->slow_readers);

    single(t, "tensord_bins", "gauge", "Bins held.", store->bins.count);
    single(t, "tensord_items", "gauge", "Items held in bins.", store->n_items);
    single(t, "tensord_stored_bytes", "gauge",
           "Record bytes held in memory (bins, stream entries, table items, queued calls).",
           store->held);
    single(t, "tensord_memory_used_bytes", "gauge",
           "Bytes counted against --max-memory (items, bookkeeping, queued output, uploads, "
           "connections).",
           tsd_store_used(store));
    single(t, "tensord_memory_limit_bytes", "gauge", "--max-memory; 0 means unlimited.",
           store->max_memory);
    tsd_datadir_stats ds;
    tsd_datadir_stats_get(srv, &ds);
    single(t, "tensord_disk_bytes", "gauge", "Bytes of --data-dir files (0 without one).",
           ds.disk_bytes);
    single(t, "tensord_disk_limit_bytes", "gauge",
           "--max-disk; 0 means unlimited or no --data-dir.", ds.max_disk);
    tsd_reclaim_stats rs;
    tsd_reclaim_stats_get(&rs);
    single(t, "tensord_reclaim_pending_bytes", "gauge",
           "Memory of dropped items still being given back by the reclaim thread.",
           rs.pending_bytes);
    const tsd_streams *sx = srv->streams;
    single(t, "tensord_streams", "gauge", "Streams.", sx != NULL ? sx->table.count : 0);
    single(t, "tensord_stream_entries", "gauge", "Entries kept in streams.",
           sx != NULL ? sx->entries : 0);
    single(t, "tensord_tables", "gauge", "Replay tables.", tsd_table_count(srv));
    single(t, "tensord_waiters", "gauge", "WAIT requests pending.", st->waiters);
    single(t, "tensord_listeners", "gauge", "Subscriptions (LISTEN).", st->listeners);

    single(t, "tensord_notifications_sent_total", "counter", "NOTIFY frames queued to listeners.",
           st->notifications_sent);
    single(t, "tensord_notifications_coalesced_total", "counter",
           "Changes folded into a notification held for a listener that reads slowly.",
           st->notes_coalesced);

    single(t, "tensord_snapshots_total", "counter", "Snapshots written (--save).", st->snapshots);
    single(t, "tensord_snapshot_failures_total", "counter", "Snapshots that failed (--save).",
           st->snapshot_failures);
    single(t, "tensord_snapshot_last_success_timestamp_seconds", "gauge",
           "Unix time of the last snapshot written by this process; 0 means none yet.",
           st->last_save_time);
    family(t, "tensord_snapshot_age_seconds", "gauge",
           "Seconds since the last snapshot written by this process (absent until one is).");
    if (st->last_save_time != 0) {
        time_t now = time(NULL);
        uint64_t n = (uint64_t)now > st->last_save_time ? (uint64_t)now - st->last_save_time : 0;
        sample(t, "tensord_snapshot_age_seconds", n);
    }

    tsd_http_stats hs;
    tsd_http_stats_get(srv, &hs);
    single(t, "tensord_http_requests_total", "counter", "HTTP requests answered (any status).",
           hs.requests);
    single(t, "tensord_http_connections", "gauge", "HTTP connections open now.", hs.connections);
    single(t, "tensord_http_connections_rejected_total", "counter",
           "HTTP connections closed at once: the HTTP connection limit was reached.", hs.rejected);

    latency(t, st);
    return t->failed ? TS_ENOMEM : 0;
}
