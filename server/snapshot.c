/*
 * Snapshots: every bin written to one file, atomically, without stopping the loop. The file
 * format itself (its layout, checksum, writer and reader) is in snapfile.c; this file runs the
 * jobs around it.
 *
 * Writing. The snapshot is a view of the store (view.c) taken at one moment: the change counter
 * and the SAVEs waiting then go with it, and the loop walks the bins a chunk per turn, taking
 * a reference on every item (items are immutable and their counts atomic) and copying each
 * bin's name, version and item list into the job; a bin about to change before the walk reached
 * it is handed over first, as it was. So clients wait at most one chunk for it, and the file
 * still holds exactly the state of that moment. The walk does as little as it can: names go
 * packed into one buffer sized exactly beforehand, and the sorting by name is left to the
 * worker. The final snapshot at shutdown is walked whole at once (the store is freed right
 * after it, and nobody is served any more). A worker thread (uv_queue_work) sorts the bins, writes
 * the job to PATH.tmp (created afresh: never through a link, never readable by others), fsyncs it,
 * renames it over PATH and fsyncs the directory; the after-work callback, on the loop thread again,
 * answers the SAVE requests the snapshot covers and then drops the references a slice per loop
 * turn. One snapshot is written at a time; requests that arrive meanwhile are answered by the
 * next one.
 *
 * PATH.lock, locked (flock) from start-up to exit, keeps a second tensord from writing the same
 * snapshot. After a failed snapshot, and until one succeeds, writes are refused with
 * SAVE_FAILING when --stop-writes-on-save-error is on (the default): a client then learns that
 * its changes could not be made durable instead of having them acknowledged.
 *
 * Streams (stream.h) go in too, captured whole on the loop when the snapshot is taken (the
 * same moment as the view's): a reference on every record, and their bookkeeping (settings,
 * ids, the entry table with tags and ages, groups, members, pending tables) copied into the
 * job in the file's encoding, which the worker writes without another copy (snap_streams).
 * Replay tables (table.h) go in the same way (snap_tables): a reference on every item's record,
 * and each table's settings, counters and item rows copied (format 3).
 *
 * Loading reads the whole file through snapfile.c's reader into a side list first and links
 * bins into the store only when every byte of it is good: a damaged snapshot is reported and
 * never half-loaded. Streams are rebuilt as the reader hands them over (each record checked and
 * validated before its entry is added, each group whole and checked before it is added); when
 * anything after them turns out bad, every stream rebuilt so far goes again with the bins.
 * A tensor bin goes in flagged as one (format 5) and its item is made on loading as TENSOR_BIN
 * makes one (tsd_rows_tensor_item: a live item in a memfd or on the heap), so that it comes back
 * a tensor bin that WRITE_ROWS writes in place and PUT, APPEND and GET refuse.
 */
#include "server.h"

#include "ps.h"
#include "snapfile.h"
#include "stream.h"
#include "table.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Bytes; the longest --save path (with ".lock" or ".tmp" added it still fits the buffers). */
#define SNAP_PATH_MAX 4000
#define SNAP_PATH_BUF (SNAP_PATH_MAX + 16)
/*
 * Item references dropped per loop turn once a snapshot is written: a million references
 * dropped at once would stall every client for tens of milliseconds.
 */
#define SNAP_UNREF_SLICE 16384

/* ---------------------------------------------------------------------------------------------
 * Writing (worker thread)
 */

/* What the streams hold now, counted to size the job's stream arrays (snap_streams). */
typedef struct stream_count {
    size_t streams, entries, groups, members, pend, name_bytes;
} stream_count;

/* The elements (bytes for tables and snames) that a job's stream arrays have room for. */
typedef struct stream_room {
    size_t streams, groups, members, tables, snames, records;
} stream_room;

struct tsd_snap_job {
    tsd_pass pass; /* first: the view being walked */
    uv_work_t req;
    tsd_server *srv;
    uint64_t counter;
    /*
     * In the name table's order, their names packed in that order in names (the worker points
     * each bin at its name, then sorts them by name).
     */
    tsd_snapfile_bin *bins;
    size_t n_bins;
    uint8_t *names; /* every bin's name, packed */
    size_t names_len, names_cap;
    tsd_item **items; /* one reference each, dropped on the loop thread */
    size_t n_items;
    size_t bins_cap, items_cap; /* room in bins and items */
    size_t n_unref;             /* references already dropped (after the write) */
    uint64_t bytes;
    /*
     * Streams, captured when the snapshot is taken (snap_streams): every array is allocated
     * once at its exact size, so the pointers between them never move. Each stream's
     * first_record counts in records; the worker adds n_items (its records follow the bins'
     * items in the index the writer asks with).
     */
    tsd_snapfile_stream *streams;
    size_t n_streams;
    tsd_snapfile_group *groups;
    tsd_snapfile_member *members;
    uint8_t *tables;    /* entry tables and pending tables, packed */
    uint8_t *snames;    /* stream, group and member names, packed */
    tsd_item **records; /* one reference each, dropped on the loop thread after the items */
    size_t n_records;
    uint64_t stream_bytes;
    uint64_t capture_ns; /* loop time of the streams' capture (in STATS snapshot_loop_us) */
    stream_room s_room;  /* what the stream arrays were allocated for (all 0: none) */
    /*
     * Replay tables, captured with the streams (snap_tables): each table's name and item rows in
     * one block of its own (tables[k].name), its records' references in trecs after the streams'
     * records; first_record counts in trecs until the worker adds n_items + n_records.
     */
    tsd_snapfile_table *rtables;
    size_t n_rtables;
    tsd_item **trecs; /* one reference each, dropped on the loop thread after the records */
    size_t n_trecs;
    uint64_t table_bytes;
    tsd_ps_snap *ps;          /* the parameter server's state (ps.h), or NULL */
    tsd_save_waiter *waiters; /* answered when this snapshot is durable */
    int final;
    struct tsd_snap_job *next_drain;
    /* Set by the worker. */
    int failed;
    char err[SNAP_PATH_BUF + 256];
    uint64_t ms;
};

/* The directory part of path ("." when it has none), into out. */
static void dir_of(const char *path, char *out, size_t cap)
{
    const char *slash = strrchr(path, '/');
    if (slash == NULL) {
        snprintf(out, cap, ".");
        return;
    }
    size_t n = (size_t)(slash - path);
    if (n == 0)
        n = 1; /* "/file" lives in "/" */
    if (n >= cap)
        n = cap - 1;
    memcpy(out, path, n);
    out[n] = '\0';
}

static void job_fail(tsd_snap_job *job, const char *what, const char *file, int e)
{
    job->failed = 1;
    /* A very long path is cut short in the message; that is fine. */
    if (snprintf(job->err, sizeof(job->err), "snapshot: %s %s: %s", what, file, strerror(e)) < 0)
        job->err[0] = '\0';
}

/* The references the job holds: the bins' items, the streams' records, the tables' records. */
static tsd_item *job_ref(const tsd_snap_job *job, size_t index)
{
    if (index < job->n_items)
        return job->items[index];
    index -= job->n_items;
    return index < job->n_records ? job->records[index] : job->trecs[index - job->n_records];
}

/* Free the tables' bookkeeping (not the records' references). */
static void job_free_tables(tsd_snap_job *job)
{
    for (size_t k = 0; job->rtables != NULL && k < job->n_rtables; k++)
        ts__free((void *)job->rtables[k].name);
    ts__free(job->rtables);
    job->rtables = NULL;
}

/* The writer's view of item index: its record. */
static void job_item(void *arg, size_t index, const uint8_t **data, size_t *len)
{
    const tsd_item *it = job_ref(arg, index);
    *data = tsd_item_data(it);
    *len = tsd_item_len(it);
}

/* Free the streams' bookkeeping (not the records' references). */
static void job_free_streams(tsd_snap_job *job)
{
    ts__free(job->streams);
    ts__free(job->groups);
    ts__free(job->members);
    ts__free(job->tables);
    ts__free(job->snames);
    job->streams = NULL;
    job->groups = NULL;
    job->members = NULL;
    job->tables = NULL;
    job->snames = NULL;
    job->s_room.streams = job->s_room.groups = job->s_room.members = 0;
    job->s_room.tables = job->s_room.snames = 0;
}

static void snap_write_file(tsd_snap_job *job);

/*
 * Worker: write the file, then free the bins and their names (the loop needs only the item
 * references from now on): returning tens of megabytes to the system takes milliseconds, which
 * the loop would otherwise spend.
 */
static void snap_write(uv_work_t *req)
{
    tsd_snap_job *job = req->data;
    snap_write_file(job);
    ts__free(job->bins);
    ts__free(job->names);
    job->bins = NULL;
    job->names = NULL;
    job_free_streams(job);
    job_free_tables(job);
}

static void snap_write_file(tsd_snap_job *job)
{
    const char *path = job->srv->cfg.save_path;
    uint64_t t0 = ts__now_ns();
    char tmp[SNAP_PATH_BUF], dir[SNAP_PATH_BUF];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    dir_of(path, dir, sizeof(dir));

    /* The names were packed in the bins' order; the file lists bins in name order. */
    size_t off = 0;
    for (size_t b = 0; b < job->n_bins; b++) {
        job->bins[b].name = job->names + off;
        off += job->bins[b].name_len;
    }
    tsd_snapfile_sort(job->bins, job->n_bins);
    for (size_t k = 0; k < job->n_streams; k++)
        job->streams[k].first_record += job->n_items;
    tsd_snapfile_sort_streams(job->streams, job->n_streams);
    for (size_t k = 0; k < job->n_rtables; k++)
        job->rtables[k].first_record += job->n_items + job->n_records;
    tsd_snapfile_sort_tables(job->rtables, job->n_rtables);

    /*
     * A new file, created here and now: O_EXCL|O_NOFOLLOW never write through a link someone
     * planted at PATH.tmp (its target would be overwritten, and readable by whoever owns it),
     * and mode 0600 keeps the data private. A file left there by a crash (only this process
     * holds the lock, so it is nobody's file in progress) is removed first; unlink removes a
     * link itself, never its target.
     */
    if (unlink(tmp) != 0 && errno != ENOENT) {
        job_fail(job, "removing the old", tmp, errno);
        return;
    }
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        job_fail(job, "creating", tmp, errno);
        return;
    }
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    tsd_snapfile_head head = {
        .counter = job->counter,
        .n_bins = job->n_bins,
        .n_items = job->n_items,
        .bytes = job->bytes,
        .wall_ms = (uint64_t)now.tv_sec * 1000u + (uint64_t)now.tv_nsec / 1000000u,
        .format = TSD_SNAP_FORMAT,
        .n_streams = job->n_streams,
        .n_records = job->n_records,
        .stream_bytes = job->stream_bytes,
        .n_tables = job->n_rtables,
        .n_titems = job->n_trecs,
        .table_bytes = job->table_bytes,
    };
    /* The parameter server's arrays are copied on the pool meanwhile: wait for them. */
    const tsd_snapfile_ps *ps = NULL;
    if (job->ps != NULL && tsd_ps_snapshot_wait(job->ps, &ps) != 0) {
        job_fail(job, "copying the parameter server's state for", tmp, ENOMEM);
        close(fd);
        unlink(tmp);
        return;
    }
    int rc =
        tsd_snapfile_write_ps(fd, &head, job->bins, job->streams, job->rtables, ps, job_item, job);
    if (ps != NULL)
        tsd_ps_snapshot_written(job->ps);
    if (rc != 0) {
        job_fail(job, "writing", tmp, -rc);
        close(fd);
        unlink(tmp);
        return;
    }
    /* Durable before it becomes visible: data, then the name, then the directory entry. */
    if (fsync(fd) != 0) {
        job_fail(job, "fsync of", tmp, errno);
        close(fd);
        unlink(tmp);
        return;
    }
    if (close(fd) != 0) {
        job_fail(job, "closing", tmp, errno);
        unlink(tmp);
        return;
    }
    if (rename(tmp, path) != 0) {
        job_fail(job, "renaming it to", path, errno);
        unlink(tmp);
        return;
    }
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || fsync(dfd) != 0) {
        job_fail(job, "fsync of the directory", dir, errno);
        if (dfd >= 0)
            close(dfd);
        return;
    }
    close(dfd);
    job->ms = (ts__now_ns() - t0) / 1000000u;
}

/* ---------------------------------------------------------------------------------------------
 * Jobs (loop thread)
 */

/* Drop the job's remaining item references (all of them, or up to max) . 1 when none remain. */
static int job_unref(tsd_snap_job *job, size_t max)
{
    size_t total = job->n_items + job->n_records + job->n_trecs;
    size_t end = total - job->n_unref > max ? job->n_unref + max : total;
    for (; job->n_unref < end; job->n_unref++)
        tsd_item_unref(job_ref(job, job->n_unref));
    return job->n_unref == total;
}

static void job_free(tsd_snap_job *job)
{
    (void)job_unref(job, SIZE_MAX);
    tsd_save_waiter *w = job->waiters;
    while (w != NULL) {
        tsd_save_waiter *next = w->next;
        ts__free(w);
        w = next;
    }
    ts__free(job->items);
    ts__free(job->records);
    ts__free(job->trecs);
    ts__free(job->bins);
    ts__free(job->names);
    job_free_streams(job);
    job_free_tables(job);
    tsd_ps_snapshot_free(job->ps);
    ts__free(job);
}

/* Drop the references of written jobs, a slice per loop turn. */
static void on_drain(uv_idle_t *h)
{
    tsd_server *srv = h->data;
    size_t budget = SNAP_UNREF_SLICE;
    while (srv->draining != NULL && budget > 0) {
        tsd_snap_job *job = srv->draining;
        size_t before = job->n_unref;
        int done = job_unref(job, budget);
        budget -= job->n_unref - before;
        if (!done)
            break;
        srv->draining = job->next_drain;
        job_free(job);
    }
    if (srv->draining == NULL)
        uv_idle_stop(h);
}

/* A written job: its references go a slice per loop turn (or at once when there are few). */
static void job_retire(tsd_server *srv, tsd_snap_job *job)
{
    if (job->n_items + job->n_records + job->n_trecs - job->n_unref <= SNAP_UNREF_SLICE ||
        !srv->handles_init) {
        job_free(job);
        return;
    }
    job->next_drain = NULL;
    tsd_snap_job **tail = &srv->draining;
    while (*tail != NULL)
        tail = &(*tail)->next_drain;
    *tail = job;
    uv_idle_start(&srv->drain_idle, on_drain);
}

/* Make room for n elements of size sz in *arr (capacity *cap). 0 or -1. */
static int ensure_room(void **arr, size_t *cap, size_t n, size_t sz)
{
    if (n <= *cap && *arr != NULL)
        return 0;
    size_t want = n > 0 ? n : 1;
    void *na = ts__realloc(*arr, want * sz);
    if (na == NULL)
        return -1;
    *arr = na;
    *cap = want;
    return 0;
}

/*
 * The view's emit (view.c, or a change ahead of the walk): take bin as it is now into the job,
 * a reference per item. 0, or TS_ENOMEM when the job's arrays are full, which cannot happen:
 * snap_take sized them to the view (the bins, items and name bytes of the store at its start).
 */
static int snap_emit(tsd_pass *p, const tsd_bin *bin)
{
    tsd_snap_job *job = (tsd_snap_job *)(void *)p;
    size_t nl = bin->node.name_len;
    if (job->n_bins == job->bins_cap || job->names_cap - job->names_len < nl ||
        job->items_cap - job->n_items < bin->n_items)
        return TS_ENOMEM;
    if (nl > 0)
        memcpy(job->names + job->names_len, bin->node.name, nl);
    job->names_len += nl;
    tsd_snapfile_bin *sb = &job->bins[job->n_bins++];
    sb->name = NULL; /* set by the worker, once the names stop moving */
    sb->name_len = bin->node.name_len;
    sb->version = bin->version;
    sb->n_items = bin->n_items;
    sb->flags = tsd_bin_is_tensor(bin) ? TSD_SNAP_BIN_TENSOR : 0;
    sb->first = job->n_items;
    for (tsd_item *it = bin->head; it != NULL; it = it->next) {
        tsd_item_ref(it);
        job->items[job->n_items++] = it;
        job->bytes += tsd_item_len(it);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Streams, captured on the loop when the snapshot is taken
 */

/* A group's orphans go in the file only while they hold entries. */
static uint32_t members_written(const tsd_stream_group *g)
{
    return g->n_members + (g->orphans.n_pend > 0);
}

static int count_stream(tsd_stream *st, void *arg)
{
    stream_count *n = arg;
    n->streams++;
    n->name_bytes += st->node.name_len;
    n->entries += (size_t)(st->last_id + 1 - st->first_id);
    n->groups += st->n_groups;
    for (uint32_t i = 0; i < st->n_groups; i++) {
        const tsd_stream_group *g = st->groups[i];
        n->name_bytes += g->name_len;
        n->members += members_written(g);
        n->pend += g->orphans.n_pend;
        for (uint32_t k = 0; k < g->n_members; k++) {
            n->name_bytes += g->members[k]->name_len;
            n->pend += g->members[k]->n_pend;
        }
    }
    return 0;
}

/* Where snap_streams writes next: a cursor in each of the job's stream arrays. */
typedef struct stream_fill {
    tsd_snap_job *job;
    uint64_t now;
    size_t groups, members, names, tables;
} stream_fill;

/* m's pending entries as a table of the file, and its entry in the job. */
static void fill_member(stream_fill *f, const tsd_stream_member *m)
{
    tsd_snap_job *job = f->job;
    uint8_t *table = job->tables + f->tables;
    for (uint32_t k = 0; k < m->n_pend; k++) {
        const tsd_stream_pending *p = &m->pend[m->pend_head + k];
        tsd_snapfile_pend_put(table, k, p->id, p->deliveries, p->rows_done);
    }
    f->tables += (size_t)m->n_pend * TSD_SNAP_PEND_SIZE;
    uint8_t *name = job->snames + f->names;
    if (m->name_len > 0)
        memcpy(name, m->name, m->name_len);
    f->names += m->name_len;
    job->members[f->members++] = (tsd_snapfile_member){
        .name = name, .name_len = m->name_len, .pend = table, .n_pend = m->n_pend};
}

static int fill_stream(tsd_stream *st, void *arg)
{
    stream_fill *f = arg;
    tsd_snap_job *job = f->job;
    tsd_snapfile_stream *out = &job->streams[job->n_streams++];
    uint8_t *name = job->snames + f->names;
    memcpy(name, st->node.name, st->node.name_len);
    f->names += st->node.name_len;
    uint64_t n = st->last_id + 1 - st->first_id;
    uint8_t *table = job->tables + f->tables;
    f->tables += (size_t)n * TSD_SNAP_ENTRY_SIZE;
    *out = (tsd_snapfile_stream){.name = name,
                                 .name_len = st->node.name_len,
                                 .max_entries = st->cfg.max_entries,
                                 .max_bytes = st->cfg.max_bytes,
                                 .max_age_ms = st->cfg.max_age_ms,
                                 .window = st->cfg.window,
                                 .lease_ms = st->cfg.lease_ms,
                                 .first_id = st->first_id,
                                 .last_id = st->last_id,
                                 .entries = table,
                                 .first_record = job->n_records,
                                 .groups = job->groups + f->groups,
                                 .n_groups = st->n_groups};
    for (uint64_t k = 0; k < n; k++) {
        const tsd_stream_entry *e = tsd_stream_entry_get(st, st->first_id + k);
        uint64_t age = f->now > e->time_ms ? f->now - e->time_ms : 0;
        uint64_t len = 0;
        if (e->it != NULL) {
            len = tsd_item_len(e->it);
            tsd_item_ref(e->it);
            job->records[job->n_records++] = e->it;
            job->stream_bytes += len;
            out->n_records++;
        }
        tsd_snapfile_entry_put(table, (size_t)k, len, e->tag, age);
    }
    for (uint32_t i = 0; i < st->n_groups; i++) {
        const tsd_stream_group *g = st->groups[i];
        tsd_snapfile_group *og = &job->groups[f->groups++];
        uint8_t *gname = job->snames + f->names;
        memcpy(gname, g->name, g->name_len);
        f->names += g->name_len;
        *og = (tsd_snapfile_group){.name = gname,
                                   .name_len = g->name_len,
                                   .next_id = g->next_id,
                                   .lost = g->lost,
                                   .lease_ms = g->lease_ms,
                                   .members = job->members + f->members,
                                   .n_members = members_written(g)};
        for (uint32_t k = 0; k < g->n_members; k++)
            fill_member(f, g->members[k]);
        if (g->orphans.n_pend > 0)
            fill_member(f, &g->orphans);
    }
    return 0;
}

/* The room the arrays need for what n counted. */
static stream_room room_of(const stream_count *n)
{
    return (stream_room){.streams = n->streams > 0 ? n->streams : 1,
                         .groups = n->groups > 0 ? n->groups : 1,
                         .members = n->members > 0 ? n->members : 1,
                         .tables =
                             n->entries * TSD_SNAP_ENTRY_SIZE + n->pend * TSD_SNAP_PEND_SIZE + 1,
                         .snames = n->name_bytes + 1,
                         /* At most one record per entry (markers hold none). */
                         .records = n->entries > 0 ? n->entries : 1};
}

static int room_fits(const stream_room *need, const stream_room *have)
{
    return need->streams <= have->streams && need->groups <= have->groups &&
           need->members <= have->members && need->tables <= have->tables &&
           need->snames <= have->snames && need->records <= have->records;
}

/*
 * Allocate the job's stream arrays for room, touching every page when touch is set (snap_prep,
 * on the worker: faulting in the pages of a large stream's tables costs several times the
 * capture itself, and the loop should not pay it). 0, or -1 with none allocated.
 */
static int stream_arrays_alloc(tsd_snap_job *job, const stream_room *room, int touch)
{
    job->streams = ts__malloc(room->streams * sizeof(*job->streams));
    job->groups = ts__malloc(room->groups * sizeof(*job->groups));
    job->members = ts__malloc(room->members * sizeof(*job->members));
    job->tables = ts__malloc(room->tables);
    job->snames = ts__malloc(room->snames);
    job->records = ts__malloc(room->records * sizeof(*job->records));
    if (job->streams == NULL || job->groups == NULL || job->members == NULL ||
        job->tables == NULL || job->snames == NULL || job->records == NULL) {
        job_free_streams(job);
        ts__free(job->records);
        job->records = NULL;
        job->s_room.records = 0;
        return -1;
    }
    if (touch) {
        memset(job->tables, 0, room->tables);
        memset(job->records, 0, room->records * sizeof(*job->records));
    }
    job->s_room = *room;
    return 0;
}

/*
 * Capture every stream into job, as it is now: a reference per record (records are immutable,
 * like items) and the bookkeeping copied in the file's encoding. All or nothing: 0, or
 * TS_ENOMEM with nothing taken.
 *
 * Cost on the loop: O(entries + pending entries + groups + members) of all streams at once, in
 * one loop turn (the time goes into STATS snapshot_loop_us): per entry a ring slot read, a
 * reference for a record, 24 bytes of table and 8 of reference array; per pending entry 16
 * bytes; two walks over the groups. Record bytes are never copied. The arrays come from the
 * worker, their pages already touched (snap_prep), as faulting them in on the loop cost four to
 * eight times the capture itself. Measured on a 2-core VM (RelWithDebInfo): a stream of a
 * million entries (markers, or small records) takes 25 to 35 ms of loop time (130 to 240 ms
 * when the arrays are had here: the final snapshot, or a stream that grew past the slack), so
 * a stream at TS_STREAM_MAX_ENTRIES (2^24 entries) holds the loop for about half a second and
 * the job for about 512 MiB. Walking a stream a chunk per turn, as the view walks bins, would
 * need stream.c to hand over a stream about to change before the walk reached it.
 */
static int snap_streams(tsd_server *srv, tsd_snap_job *job)
{
    uint64_t t0 = ts__now_ns();
    stream_count n = {0};
    (void)tsd_stream_each(srv, count_stream, &n);
    stream_room need = room_of(&n);
    if (n.streams == 0 || job->streams == NULL || !room_fits(&need, &job->s_room)) {
        /* None, or more than snap_prep made room for: the arrays are had here, exactly. */
        job_free_streams(job);
        ts__free(job->records);
        job->records = NULL;
        job->s_room.records = 0;
        if (n.streams == 0)
            return 0;
        if (stream_arrays_alloc(job, &need, 0) != 0)
            return TS_ENOMEM;
    }
    stream_fill f = {.job = job, .now = uv_now(srv->loop)};
    (void)tsd_stream_each(srv, fill_stream, &f);
    job->capture_ns = ts__now_ns() - t0;
    return 0;
}

/* Answer the waiters of a finished job. */
/* What the tables hold now, to size the capture. */
typedef struct table_count {
    size_t tables, items;
} table_count;

static int count_table(tsd_table *t, void *arg)
{
    table_count *n = arg;
    n->tables++;
    n->items += tsd_table_size(t);
    return 0;
}

typedef struct table_fill {
    tsd_snap_job *job;
    uint64_t now;
} table_fill;

static int fill_table(tsd_table *t, void *arg)
{
    table_fill *f = arg;
    tsd_snap_job *job = f->job;
    size_t n = tsd_table_size(t);
    tsd_snapfile_table *out = &job->rtables[job->n_rtables];
    tsd_item **recs = job->trecs + job->n_trecs;
    uint8_t *rows = ts__malloc(n * TSD_SNAP_TITEM_SIZE + TS_MAX_NAME_LEN);
    if (rows == NULL)
        return TS_ENOMEM;
    tsd_table_capture(t, f->now, out, rows + TS_MAX_NAME_LEN, recs);
    /* The name goes with the rows: the table may go before the worker writes it. */
    memcpy(rows, out->name, out->name_len);
    out->name = rows;
    out->first_record = job->n_trecs;
    job->n_rtables++;
    for (size_t k = 0; k < n; k++) {
        tsd_item_ref(recs[k]);
        job->table_bytes += tsd_item_len(recs[k]);
    }
    job->n_trecs += n;
    return 0;
}

/*
 * Capture every replay table into job, as it is now, on the loop: a reference per record and a
 * copy of its settings, counters and item rows. O(items of all tables); a table at its largest
 * (2^24 items) costs the loop about what a stream of as many entries does (snap_streams).
 */
static int snap_tables(tsd_server *srv, tsd_snap_job *job)
{
    table_count n = {0};
    (void)tsd_table_each(srv, count_table, &n);
    if (n.tables == 0)
        return 0;
    job->rtables = ts__calloc(n.tables, sizeof(*job->rtables));
    job->trecs = ts__malloc((n.items > 0 ? n.items : 1) * sizeof(*job->trecs));
    if (job->rtables == NULL || job->trecs == NULL)
        return TS_ENOMEM;
    table_fill f = {.job = job, .now = uv_now(srv->loop)};
    return tsd_table_each(srv, fill_table, &f);
}

static void answer(tsd_server *srv, tsd_snap_job *job)
{
    for (tsd_save_waiter *w = job->waiters; w != NULL; w = w->next) {
        if (w->c == NULL)
            continue;
        /* The client learns that it failed; the path and the reason go to the log only. */
        if (job->failed)
            tsd_reply_err(w->c, TS_OP_SAVE, w->rid, TS_ST_INTERNAL,
                          "snapshot failed; see the server log");
        else
            tsd_reply(w->c, TS_OP_SAVE, w->rid, TS_ST_OK, NULL, 0);
    }
    tsd_server_flush(srv);
}

static void snap_done(uv_work_t *req, int status);

/* A snapshot failed: count it, and refuse writes from now on when so configured. */
static void save_failed(tsd_server *srv)
{
    srv->stats.snapshot_failures++;
    srv->stats.save_failures_consecutive++;
    if (!srv->save_failing && srv->cfg.stop_writes_on_save_error && !srv->stopping)
        tsd_log(TSD_LOG_ERROR,
                "refusing every request that changes data (SAVE_FAILING) until a snapshot succeeds "
                "(--stop-writes-on-save-error yes)");
    srv->save_failing = 1;
}

static void save_succeeded(tsd_server *srv)
{
    if (srv->save_failing && srv->cfg.stop_writes_on_save_error)
        tsd_log(TSD_LOG_WARN, "a snapshot succeeded after %llu failed: accepting writes again",
                (unsigned long long)srv->stats.save_failures_consecutive);
    srv->save_failing = 0;
    srv->stats.save_failures_consecutive = 0;
    srv->stats.last_save_time = (uint64_t)time(NULL);
}

/* Preparing a snapshot failed for lack of memory: answer the pending SAVEs. */
static void snap_fail_oom(tsd_server *srv)
{
    srv->stats.out_of_memory++;
    tsd_log(TSD_LOG_ERROR, "snapshot: out of memory preparing it");
    save_failed(srv);
    tsd_save_waiter *w = srv->save_waiters;
    srv->save_waiters = NULL;
    while (w != NULL) {
        tsd_save_waiter *next = w->next;
        if (w->c != NULL)
            tsd_reply_err(w->c, TS_OP_SAVE, w->rid, TS_ST_OUT_OF_MEMORY,
                          "out of memory preparing the snapshot");
        ts__free(w);
        w = next;
    }
    tsd_server_flush(srv);
}

static void snap_walked(tsd_server *srv, tsd_snap_job *job, int status);

/* The view's done (view.c): the walk over several loop turns is over. */
static void snap_view_done(tsd_pass *p, int status)
{
    tsd_snap_job *job = (tsd_snap_job *)(void *)p;
    tsd_server *srv = job->srv;
    int final_waits = srv->final_pending;
    snap_walked(srv, job, status);
    if (srv->snap_job == NULL && final_waits && srv->final_pending) {
        /* The shutdown waited for this snapshot, which failed: go on with the final one. */
        srv->final_pending = 0;
        tsd_snapshot_final(srv);
    }
}

/*
 * Take the snapshot now: this moment's change counter and the pending SAVE waiters go with it,
 * and its view begins (walked over the next loop turns; the final one at once). 0 (the job is
 * srv->snap_job until written), or TS_ENOMEM (the waiters are answered with an error, the job
 * freed) or a libuv code.
 */
static void snap_ps_quiet(void *arg);

static int snap_take(tsd_server *srv, tsd_snap_job *job, int final)
{
    tsd_store *st = &srv->store;
    /* Parameter server jobs change slots in place: none may run at the moment it is taken. */
    job->final = final;
    srv->snap_job = job;
    if (tsd_ps_quiesce(srv, snap_ps_quiet, job) != 0)
        return 0;
    uint64_t ps_t0 = ts__now_ns();
    int ps_rc;
    job->ps = tsd_ps_snapshot_take(srv, final, &ps_rc);
    uint64_t ps_ns = ts__now_ns() - ps_t0;
    job->counter = srv->version;
    job->final = final;
    job->waiters = srv->save_waiters;
    srv->save_waiters = NULL;
    srv->snap_job = job;
    /* The view holds exactly what the store holds now: size the arrays to it. */
    if (ensure_room((void **)&job->bins, &job->bins_cap, st->bins.count, sizeof(*job->bins)) != 0 ||
        ensure_room((void **)&job->items, &job->items_cap, (size_t)st->n_items,
                    sizeof(*job->items)) != 0 ||
        ensure_room((void **)&job->names, &job->names_cap, (size_t)st->name_bytes, 1) != 0 ||
        snap_streams(srv, job) != 0 || snap_tables(srv, job) != 0 || ps_rc != 0) {
        snap_walked(srv, job, TS_ENOMEM);
        return TS_ENOMEM;
    }
    job->capture_ns += ps_ns;
    job->pass.emit = snap_emit;
    job->pass.done = snap_view_done;
    job->pass.per_item = 1; /* snap_emit takes a reference per item */
    if (final) {
        uint64_t t0 = ts__now_ns();
        srv->stats.view_passes++;
        srv->stats.view_turns_last = 1;
        int rc = tsd_store_pass_run(st, &job->pass);
        job->pass.loop_ns = ts__now_ns() - t0;
        snap_walked(srv, job, rc);
        return srv->snap_job == job ? 0 : TS_ENOMEM;
    }
    if (tsd_view_start(srv, &job->pass) == 0)
        return 0;
    snap_walked(srv, job, job->pass.err);
    return srv->snap_job == job ? 0 : TS_ENOMEM;
}

/*
 * The view is complete (status 0): hand the job to the writer. Or it failed: answer its
 * waiters and drop what it took.
 */
static void snap_walked(tsd_server *srv, tsd_snap_job *job, int status)
{
    srv->stats.snapshot_loop_us = (job->pass.loop_ns + job->capture_ns) / 1000u;
    if (status == TS_ECANCELED) {
        /* The store went first (a stop without a final snapshot): there is nothing to write. */
        srv->snap_job = NULL;
        job->failed = 1;
        snprintf(job->err, sizeof(job->err), "snapshot: canceled, tensord is stopping");
        tsd_log(TSD_LOG_ERROR, "%s", job->err);
        save_failed(srv);
        answer(srv, job);
        job_retire(srv, job);
        return;
    }
    if (status != 0) {
        srv->snap_job = NULL;
        /* The waiters it took go back, to be answered with the error. */
        tsd_save_waiter **tail = &job->waiters;
        while (*tail != NULL)
            tail = &(*tail)->next;
        *tail = srv->save_waiters;
        srv->save_waiters = job->waiters;
        job->waiters = NULL;
        job_retire(srv, job);
        snap_fail_oom(srv);
        return;
    }
    int rc = uv_queue_work(srv->loop, &job->req, snap_write, snap_done);
    if (rc != 0) {
        srv->snap_job = NULL;
        job->failed = 1;
        snprintf(job->err, sizeof(job->err), "snapshot: cannot start the writer: %s",
                 uv_strerror(rc));
        tsd_log(TSD_LOG_ERROR, "%s", job->err);
        save_failed(srv);
        answer(srv, job);
        job_retire(srv, job);
    }
}

/*
 * Worker: allocate the job's arrays a little larger than the store is now and touch every
 * page, so that the loop pass writes into memory that is already there. On failure the arrays
 * stay unallocated and the loop allocates them itself.
 */
static void snap_prep(uv_work_t *req)
{
    tsd_snap_job *job = req->data;
    job->bins = ts__malloc(job->bins_cap * sizeof(*job->bins));
    job->items = ts__malloc(job->items_cap * sizeof(*job->items));
    job->names = ts__malloc(job->names_cap);
    if (job->bins == NULL || job->items == NULL || job->names == NULL) {
        ts__free(job->bins);
        ts__free(job->items);
        ts__free(job->names);
        job->bins = NULL;
        job->items = NULL;
        job->names = NULL;
        job->bins_cap = job->items_cap = job->names_cap = 0;
        job->s_room = (stream_room){0};
        return;
    }
    memset(job->bins, 0, job->bins_cap * sizeof(*job->bins));
    memset(job->items, 0, job->items_cap * sizeof(*job->items));
    memset(job->names, 0, job->names_cap);
    /* The streams' arrays likewise (snap_streams allocates them itself when they fall short). */
    if (job->s_room.records > 0) {
        stream_room room = job->s_room;
        job->s_room = (stream_room){0};
        (void)stream_arrays_alloc(job, &room, 1);
    }
}

static void snap_prepped(uv_work_t *req, int status)
{
    (void)status; /* never cancelled; a failed preparation left the arrays to the loop */
    snap_ps_quiet(req->data);
}

/* Take the job now (its arrays prepared, or the parameter server's last running job ended). */
static void snap_ps_quiet(void *arg)
{
    tsd_snap_job *job = arg;
    tsd_server *srv = job->srv;
    if (snap_take(srv, job, job->final) != 0 && srv->snap_job == NULL && srv->final_pending) {
        /* The shutdown waited for this snapshot, which failed to start: go on with the final. */
        srv->final_pending = 0;
        tsd_snapshot_final(srv);
    }
}

/* Room for what the store holds now plus an eighth (it may grow until the pass runs). */
static size_t with_slack(size_t n)
{
    return n + n / 8 + 1024;
}

/*
 * Start a snapshot of the store, taking over the pending SAVE waiters when it is taken. A
 * periodic or SAVE snapshot first has its arrays prepared on the worker (snap_prep) and is
 * taken on the loop turn after; the final one is taken at once, as the store goes right after.
 * 0, or an error (the waiters are answered with it).
 */
static int snap_start(tsd_server *srv, int final)
{
    tsd_snap_job *job = ts__calloc(1, sizeof(*job));
    if (job == NULL) {
        snap_fail_oom(srv);
        return TS_ENOMEM;
    }
    job->srv = srv;
    if (!final) {
        job->bins_cap = with_slack(srv->store.bins.count);
        job->items_cap = with_slack((size_t)srv->store.n_items);
        job->names_cap = with_slack((size_t)srv->store.name_bytes);
        /* Room for the streams as they are now plus the same slack (allocated by snap_prep). */
        stream_count n = {0};
        (void)tsd_stream_each(srv, count_stream, &n);
        if (n.streams > 0) {
            n.streams = with_slack(n.streams);
            n.entries = with_slack(n.entries);
            n.groups = with_slack(n.groups);
            n.members = with_slack(n.members);
            n.pend = with_slack(n.pend);
            n.name_bytes = with_slack(n.name_bytes);
            job->s_room = room_of(&n);
        }
        job->req.data = job;
        srv->snap_job = job; /* counter 0: no SAVE joins it before it is taken */
        if (uv_queue_work(srv->loop, &job->req, snap_prep, snap_prepped) == 0)
            return 0;
        job->bins_cap = job->items_cap = job->names_cap = 0;
        job->s_room = (stream_room){0};
    }
    job->req.data = job;
    return snap_take(srv, job, final);
}

static void snap_done(uv_work_t *req, int status)
{
    tsd_snap_job *job = req->data;
    tsd_server *srv = job->srv;
    srv->snap_job = NULL;
    if (status != 0 && !job->failed) {
        job->failed = 1;
        snprintf(job->err, sizeof(job->err), "snapshot: %s", uv_strerror(status));
    }
    if (job->failed) {
        tsd_log(TSD_LOG_ERROR, "%s", job->err);
        save_failed(srv);
        if (job->final)
            srv->exit_code = 1;
    } else {
        save_succeeded(srv);
        srv->stats.snapshots++;
        srv->stats.snapshot_last_ms = job->ms;
        srv->have_snapshot = 1;
        if (job->counter > srv->saved_version)
            srv->saved_version = job->counter;
        tsd_log(job->final ? TSD_LOG_INFO : TSD_LOG_DEBUG,
                "snapshot written to %s: %zu bins, %zu items, %llu bytes, %zu streams with %zu "
                "records of %llu bytes in %llu ms",
                srv->cfg.save_path, job->n_bins, job->n_items, (unsigned long long)job->bytes,
                job->n_streams, job->n_records, (unsigned long long)job->stream_bytes,
                (unsigned long long)job->ms);
    }
    answer(srv, job);
    job_retire(srv, job);
    if (srv->final_pending) {
        srv->final_pending = 0;
        tsd_snapshot_final(srv);
    } else if (srv->save_waiters != NULL && !srv->stopping) {
        (void)snap_start(srv, 0);
    }
}

void tsd_snapshot_request(tsd_server *srv, tsd_conn *c, uint32_t rid)
{
    tsd_snap_job *job = srv->snap_job;
    /* Nothing changed since the last durable snapshot (and none is being written). */
    if (job == NULL && srv->have_snapshot && srv->version == srv->saved_version) {
        tsd_reply(c, TS_OP_SAVE, rid, TS_ST_OK, NULL, 0);
        return;
    }
    tsd_save_waiter *w = ts__calloc(1, sizeof(*w));
    if (w == NULL) {
        srv->stats.out_of_memory++;
        tsd_reply_err(c, TS_OP_SAVE, rid, TS_ST_OUT_OF_MEMORY, "out of memory queueing SAVE");
        return;
    }
    w->c = c;
    w->rid = rid;
    if (job != NULL && job->counter == srv->version) {
        /* The snapshot being written already holds every change: it answers this one too. */
        w->next = job->waiters;
        job->waiters = w;
        return;
    }
    w->next = srv->save_waiters;
    srv->save_waiters = w;
    if (job == NULL)
        (void)snap_start(srv, 0);
}

void tsd_snapshot_tick(tsd_server *srv)
{
    if (srv->snap_job != NULL || srv->stopping)
        return;
    if (srv->have_snapshot && srv->version == srv->saved_version)
        return;
    (void)snap_start(srv, 0);
}

static void final_after_ps(void *arg)
{
    tsd_snapshot_final(arg);
}

void tsd_snapshot_final(tsd_server *srv)
{
    if (srv->snap_job != NULL) {
        srv->final_pending = 1;
        return;
    }
    if (srv->store_freed)
        return;
    /* Parameter server jobs still running end first; then this is called again. */
    if (tsd_ps_quiesce(srv, final_after_ps, srv) != 0)
        return;
    if (!(srv->have_snapshot && srv->version == srv->saved_version)) {
        tsd_log(TSD_LOG_INFO, "writing the final snapshot to %s", srv->cfg.save_path);
        if (snap_start(srv, 1) != 0)
            srv->exit_code = 1;
    }
    /* The job holds its own references: the bins can go now. */
    tsd_server_free_store(srv);
}

void tsd_snapshot_conn_gone(tsd_server *srv, tsd_conn *c)
{
    for (tsd_save_waiter *w = srv->save_waiters; w != NULL; w = w->next)
        if (w->c == c)
            w->c = NULL;
    if (srv->snap_job != NULL)
        for (tsd_save_waiter *w = srv->snap_job->waiters; w != NULL; w = w->next)
            if (w->c == c)
                w->c = NULL;
}

size_t tsd_snapshot_stop(tsd_server *srv)
{
    size_t n = 0;
    tsd_save_waiter *w = srv->save_waiters;
    srv->save_waiters = NULL;
    while (w != NULL) {
        tsd_save_waiter *next = w->next;
        if (w->c != NULL) {
            tsd_reply_msg(w->c, TS_OP_SAVE, w->rid, TS_ST_SHUTTING_DOWN, TSD_SHUTDOWN_MSG,
                          sizeof(TSD_SHUTDOWN_MSG) - 1);
            n++;
        }
        ts__free(w);
        w = next;
    }
    /* The snapshot being written answers nobody now (answer skips a waiter without c). */
    if (srv->snap_job != NULL) {
        for (w = srv->snap_job->waiters; w != NULL; w = w->next) {
            if (w->c == NULL)
                continue;
            tsd_reply_msg(w->c, TS_OP_SAVE, w->rid, TS_ST_SHUTTING_DOWN, TSD_SHUTDOWN_MSG,
                          sizeof(TSD_SHUTDOWN_MSG) - 1);
            w->c = NULL;
            n++;
        }
    }
    return n;
}

int tsd_writes_refused(const tsd_server *srv)
{
    return srv->save_failing && srv->cfg.stop_writes_on_save_error && srv->cfg.save_path != NULL;
}

void tsd_refuse_write(tsd_conn *c, uint8_t op, uint32_t rid)
{
    c->srv->stats.writes_refused++;
    tsd_reply_err(c, op, rid, TS_ST_SAVE_FAILING,
                  "write refused: the last snapshot failed (see the server log); writes are "
                  "accepted again once a snapshot succeeds");
}

int tsd_snapshot_prepare(tsd_server *srv, char *err, size_t err_cap)
{
    const char *path = srv->cfg.save_path;
    if (strlen(path) > SNAP_PATH_MAX) {
        snprintf(err, err_cap, "--save: the path is longer than %d bytes; refusing to start",
                 SNAP_PATH_MAX);
        return -1;
    }
    char dir[SNAP_PATH_BUF], lock[SNAP_PATH_BUF];
    dir_of(path, dir, sizeof(dir));
    snprintf(lock, sizeof(lock), "%s.lock", path);
    /* Found now, not at the first snapshot, which may come after hours of acknowledged writes. */
    struct stat st;
    if (stat(dir, &st) != 0) {
        snprintf(err, err_cap, "--save %s: the directory %s: %s; refusing to start", path, dir,
                 strerror(errno));
        return -1;
    }
    if (!S_ISDIR(st.st_mode)) {
        snprintf(err, err_cap, "--save %s: %s is not a directory; refusing to start", path, dir);
        return -1;
    }
    /* A directory would only fail at load as a damaged snapshot (exit 3): name the mistake. */
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        snprintf(err, err_cap,
                 "--save %s is a directory: give the path of the snapshot file (for example "
                 "%s/tensord.snap); refusing to start",
                 path, path);
        return -1;
    }
    /*
     * Two daemons writing one snapshot would each overwrite the other's data. The lock lives on
     * a file of its own beside the snapshot (the snapshot itself is replaced by rename) and is
     * held until the process exits; the file is left in place, as removing it would let a
     * third daemon lock a new file while the second still holds the old one.
     */
    int fd = open(lock, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        snprintf(err, err_cap, "--save %s: cannot open the lock file %s: %s; refusing to start",
                 path, lock, strerror(errno));
        return -1;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        close(fd);
        if (e == EWOULDBLOCK)
            snprintf(err, err_cap,
                     "--save %s is in use: another tensord holds its lock %s; refusing to start",
                     path, lock);
        else
            snprintf(err, err_cap, "--save %s: cannot lock %s: %s; refusing to start", path, lock,
                     strerror(e));
        return -1;
    }
    srv->save_lock_fd = fd;
    return 0;
}

void tsd_snapshot_free(tsd_server *srv)
{
    while (srv->draining != NULL) {
        tsd_snap_job *job = srv->draining;
        srv->draining = job->next_drain;
        job_free(job);
    }
    if (srv->save_lock_fd >= 0) {
        close(srv->save_lock_fd);
        srv->save_lock_fd = -1;
    }
}
/* ---------------------------------------------------------------------------------------------
 * Loading (at start-up, before the loop runs)
 */

/* A bin read from the file, not yet in the store. */
typedef struct load_bin {
    size_t name_off; /* its name in the loader's names */
    size_t first;    /* index of its first item in the loader's items */
    uint64_t version;
    uint32_t n_items;
    uint32_t flags; /* TSD_SNAP_BIN_* */
    uint8_t name_len;
} load_bin;

/*
 * What the reader handed over so far. Every array grows with what the file really holds (the
 * reader checks each length against the bytes left before it asks), so a file that claims a
 * million bins in a few bytes costs nothing before it is refused.
 */
typedef struct loader {
    load_bin *bins;
    size_t n_bins, bins_cap;
    uint8_t *names;
    size_t names_len, names_cap;
    tsd_item **items; /* one reference each until linked into the store */
    size_t n_items, items_cap;
    /* Streams, rebuilt in the server as they come (see the top of this file). */
    tsd_server *srv;
    const char *path;
    uint64_t now;   /* uv_now at the load: ages become append times before it */
    tsd_stream *st; /* the stream being rebuilt */
    uint8_t *table; /* its entry table (a copy: the reader's lives for its call only) */
    size_t table_cap;
    uint64_t k, n;    /* its next entry to add, of n */
    size_t n_streams; /* streams rebuilt */
    /* Replay tables, rebuilt as they come, as streams are. */
    tsd_table *tt;                  /* the table being rebuilt */
    uint8_t tname[TS_MAX_NAME_LEN]; /* its name, for messages */
    size_t tname_len;
    uint8_t *trows; /* its item rows (a copy: the reader's live for its call only) */
    size_t trows_cap;
    uint64_t tk; /* its next item, of tn */
    uint64_t tn;
    size_t n_tables; /* tables rebuilt */
    /* Why a rebuild refused the file (else the reader's message stands). */
    char err[SNAP_PATH_BUF + TS_MAX_NAME_LEN * 4 + 128];
} loader;

/* Room for more elements of size sz in *arr (n of *cap in use), at least doubling. 0 or -1. */
static int grow(void **arr, size_t *cap, size_t n, size_t more, size_t sz)
{
    if (*cap - n >= more)
        return 0;
    size_t want = *cap * 2 > n + more ? *cap * 2 : n + more + 16;
    void *na = ts__realloc(*arr, want * sz);
    if (na == NULL)
        return -1;
    *arr = na;
    *cap = want;
    return 0;
}

static int load_on_bin(void *arg, const uint8_t *name, size_t name_len, uint64_t version,
                       uint32_t n_items, uint32_t flags)
{
    loader *ld = arg;
    if (grow((void **)&ld->bins, &ld->bins_cap, ld->n_bins, 1, sizeof(*ld->bins)) != 0 ||
        grow((void **)&ld->names, &ld->names_cap, ld->names_len, name_len, 1) != 0 ||
        grow((void **)&ld->items, &ld->items_cap, ld->n_items, n_items, sizeof(*ld->items)) != 0)
        return -1;
    load_bin *lb = &ld->bins[ld->n_bins++];
    lb->name_off = ld->names_len;
    lb->name_len = (uint8_t)name_len;
    lb->version = version;
    lb->n_items = n_items;
    lb->flags = flags;
    lb->first = ld->n_items;
    if (name_len > 0)
        memcpy(ld->names + ld->names_len, name, name_len);
    ld->names_len += name_len;
    return 0;
}

static uint8_t *load_on_item(void *arg, size_t len)
{
    loader *ld = arg;
    /* Room was made for the bin's items when it began. */
    tsd_item *it = NULL;
    if ((ld->bins[ld->n_bins - 1].flags & TSD_SNAP_BIN_TENSOR) != 0) {
        /*
         * A tensor bin's item is made as TENSOR_BIN makes one (a live item in a memfd or on the
         * heap, or a --data-dir file), with the store reservation that linking it consumes; the
         * reader fills it. --max-memory is lifted during the load, as for every item.
         */
        if (tsd_rows_tensor_item(ld->srv, len, &it) != 0)
            return NULL;
    } else {
        it = tsd_item_new(len);
        if (it == NULL)
            return NULL;
    }
    ld->items[ld->n_items++] = it;
    return tsd_item_data(it);
}

/*
 * A rebuild refused what the file says (TS_EINVAL: a rule the reader does not know, such as a
 * stream's name taken), or failed for memory: say which, for tsd_snapshot_load. -1.
 */
static int load_refused(loader *ld, int rc, const char *what, const uint8_t *name, size_t len)
{
    char pn[TS_MAX_NAME_LEN * 4 + 1];
    tsd_name_printable(name, len, pn, sizeof(pn));
    if (rc == TS_EINVAL)
        snprintf(ld->err, sizeof(ld->err),
                 "snapshot %s is damaged: %s '%s' breaks a rule of streams", ld->path, what, pn);
    else
        snprintf(ld->err, sizeof(ld->err), "snapshot %s: out of memory loading %s '%s'", ld->path,
                 what, pn);
    return -1;
}

/* Add the current stream's markers from entry k up to its next record (or its end). */
static int load_markers(loader *ld)
{
    while (ld->k < ld->n) {
        uint64_t len, tag, age;
        tsd_snapfile_entry_get(ld->table, (size_t)ld->k, &len, &tag, &age);
        if (len != 0)
            return 0;
        uint64_t time = ld->now > age ? ld->now - age : 0;
        int rc =
            tsd_stream_restore_entry(ld->srv, ld->st, ld->st->first_id + ld->k, time, NULL, tag);
        if (rc != 0)
            return load_refused(ld, rc, "stream", ld->st->node.name, ld->st->node.name_len);
        ld->k++;
    }
    return 0;
}

static int load_on_stream(void *arg, const tsd_snapfile_stream *s)
{
    loader *ld = arg;
    if (tsd_stream_find(ld->srv, s->name, s->name_len) != NULL) {
        char pn[TS_MAX_NAME_LEN * 4 + 1];
        tsd_name_printable(s->name, s->name_len, pn, sizeof(pn));
        snprintf(ld->err, sizeof(ld->err), "snapshot %s is damaged: stream '%s' appears twice",
                 ld->path, pn);
        return -1;
    }
    tsd_stream_config cfg = {.max_entries = s->max_entries,
                             .max_bytes = s->max_bytes,
                             .max_age_ms = s->max_age_ms,
                             .window = s->window,
                             .lease_ms = s->lease_ms};
    int rc = tsd_stream_restore(ld->srv, s->name, s->name_len, &cfg, s->first_id, &ld->st);
    if (rc != 0) {
        ld->st = NULL;
        return load_refused(ld, rc, "stream", s->name, s->name_len);
    }
    ld->n_streams++;
    ld->n = s->last_id + 1 - s->first_id;
    ld->k = 0;
    size_t tlen = (size_t)ld->n * TSD_SNAP_ENTRY_SIZE;
    if (grow((void **)&ld->table, &ld->table_cap, 0, tlen, 1) != 0)
        return load_refused(ld, TS_ENOMEM, "stream", s->name, s->name_len);
    if (tlen > 0)
        memcpy(ld->table, s->entries, tlen);
    return load_markers(ld);
}

/*
 * A record of the current stream: its entry is added now, before the reader fills and checks
 * it, which is safe as nothing reads a stream before the load is over, and a record that
 * fails its checks fails the whole load.
 */
static uint8_t *load_on_record(void *arg, size_t len)
{
    loader *ld = arg;
    uint64_t elen, tag, age;
    tsd_snapfile_entry_get(ld->table, (size_t)ld->k, &elen, &tag, &age);
    tsd_item *it = tsd_item_new(len);
    if (it == NULL) {
        (void)load_refused(ld, TS_ENOMEM, "stream", ld->st->node.name, ld->st->node.name_len);
        return NULL;
    }
    tsd_store *store = &ld->srv->store;
    int rc = tsd_store_reserve(store, len);
    uint64_t time = ld->now > age ? ld->now - age : 0;
    if (rc == 0) {
        rc = tsd_stream_restore_entry(ld->srv, ld->st, ld->st->first_id + ld->k, time, it, 0);
        if (rc != 0)
            tsd_store_unreserve(store, len);
    }
    if (rc != 0) {
        tsd_item_unref(it);
        (void)load_refused(ld, rc, "stream", ld->st->node.name, ld->st->node.name_len);
        return NULL;
    }
    ld->k++;
    if (load_markers(ld) != 0)
        return NULL;
    return tsd_item_data(it);
}

static int load_on_group(void *arg, const tsd_snapfile_group *g)
{
    loader *ld = arg;
    tsd_stream_group *sg;
    int rc = tsd_stream_restore_group(ld->srv, ld->st, g->name, g->name_len, g->next_id, g->lost,
                                      g->lease_ms, &sg);
    if (rc != 0)
        return load_refused(ld, rc, "group", g->name, g->name_len);
    for (uint32_t k = 0; k < g->n_members; k++) {
        const tsd_snapfile_member *m = &g->members[k];
        tsd_stream_member *sm;
        rc = tsd_stream_restore_member(ld->srv, ld->st, sg, m->name, m->name_len, &sm);
        for (uint32_t i = 0; rc == 0 && i < m->n_pend; i++) {
            uint64_t id;
            uint32_t deliveries, rows_done;
            tsd_snapfile_pend_get(m->pend, i, &id, &deliveries, &rows_done);
            rc = tsd_stream_restore_pending(ld->srv, ld->st, sg, sm, id, deliveries, rows_done);
        }
        if (rc != 0)
            return load_refused(ld, rc, "member of group", g->name, g->name_len);
    }
    return 0;
}

static int load_on_table(void *arg, const tsd_snapfile_table *t)
{
    loader *ld = arg;
    int rc = tsd_table_restore(ld->srv, t, &ld->tt);
    if (rc != 0) {
        ld->tt = NULL;
        char pn[TS_MAX_NAME_LEN * 4 + 1];
        tsd_name_printable(t->name, t->name_len, pn, sizeof(pn));
        if (rc == TS_EINVAL)
            snprintf(ld->err, sizeof(ld->err),
                     "snapshot %s is damaged: replay table '%s' appears twice or shares its name "
                     "with a stream",
                     ld->path, pn);
        else
            snprintf(ld->err, sizeof(ld->err), "snapshot %s: out of memory loading table '%s'",
                     ld->path, pn);
        return -1;
    }
    ld->n_tables++;
    memcpy(ld->tname, t->name, t->name_len);
    ld->tname_len = t->name_len;
    ld->tk = 0;
    ld->tn = t->n_items;
    size_t tlen = (size_t)t->n_items * TSD_SNAP_TITEM_SIZE;
    if (grow((void **)&ld->trows, &ld->trows_cap, 0, tlen, 1) != 0)
        return load_refused(ld, TS_ENOMEM, "table", t->name, t->name_len);
    if (tlen > 0)
        memcpy(ld->trows, t->items, tlen);
    return 0;
}

/*
 * A record of the current table: its item is added now, before the reader fills and checks it
 * (nothing reads a table before the load is over, and a bad record fails the whole load).
 */
static uint8_t *load_on_trecord(void *arg, size_t len)
{
    loader *ld = arg;
    uint64_t key, rlen, age;
    double prio;
    uint32_t times;
    tsd_snapfile_titem_get(ld->trows, (size_t)ld->tk, &key, &prio, &rlen, &age, &times);
    tsd_item *it = tsd_item_new(len);
    const uint8_t *tname = ld->tname;
    size_t tnl = ld->tname_len;
    if (it == NULL) {
        (void)load_refused(ld, TS_ENOMEM, "table", tname, tnl);
        return NULL;
    }
    tsd_store *store = &ld->srv->store;
    int rc = tsd_store_reserve(store, len);
    uint64_t time = ld->now > age ? ld->now - age : 0;
    if (rc == 0) {
        rc = tsd_table_restore_item(ld->srv, ld->tt, key, prio, times, time, it);
        if (rc != 0)
            tsd_store_unreserve(store, len);
    }
    if (rc != 0) {
        tsd_item_unref(it);
        char pn[TS_MAX_NAME_LEN * 4 + 1];
        tsd_name_printable(tname, tnl, pn, sizeof(pn));
        if (rc == TS_EINVAL)
            snprintf(ld->err, sizeof(ld->err),
                     "snapshot %s is damaged: item %llu of replay table '%s' breaks a rule of "
                     "tables",
                     ld->path, (unsigned long long)ld->tk, pn);
        else
            (void)load_refused(ld, rc, "table", tname, tnl);
        return NULL;
    }
    ld->tk++;
    return tsd_item_data(it);
}

static int load_on_param(void *arg, const tsd_snapfile_param *p)
{
    loader *ld = arg;
    return tsd_ps_restore_param(ld->srv, ld->path, p, ld->err, sizeof(ld->err));
}

static int load_on_emb(void *arg, const tsd_snapfile_emb *t)
{
    loader *ld = arg;
    return tsd_ps_restore_emb(ld->srv, ld->path, t, ld->err, sizeof(ld->err));
}

static void *load_on_ps_array(void *arg, size_t len)
{
    loader *ld = arg;
    void *m = tsd_ps_restore_array(ld->srv, len);
    if (m == NULL)
        snprintf(ld->err, sizeof(ld->err),
                 "snapshot %s: out of memory loading the parameter "
                 "server's state",
                 ld->path);
    return m;
}

static void loader_free(loader *ld)
{
    for (size_t i = 0; i < ld->n_items; i++)
        if (ld->items[i] != NULL)
            tsd_item_unref(ld->items[i]);
    ts__free(ld->items);
    ts__free(ld->bins);
    ts__free(ld->names);
    ts__free(ld->table);
    ts__free(ld->trows);
}

/*
 * The server around store. tsd_snapshot_load is given &srv->store by its only caller
 * (tsd_server_init), and streams live in the server beside the store.
 */
static tsd_server *server_of(tsd_store *store)
{
    return (tsd_server *)(void *)((char *)store - offsetof(tsd_server, store));
}

int tsd_snapshot_load(tsd_store *store, const char *path, uint64_t *counter, char *err,
                      size_t err_cap)
{
    /*
     * O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever, before
     * the check below could refuse it. It changes nothing for a regular file, but is cleared.
     */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        if (errno == ENOENT)
            return 1;
        snprintf(err, err_cap, "snapshot %s: cannot open it: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(err, err_cap, "snapshot %s: not a regular file", path);
        close(fd);
        return -1;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        snprintf(err, err_cap, "snapshot %s: cannot read it: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    tsd_server *srv = server_of(store);
    loader ld = {.srv = srv, .path = path, .now = uv_now(srv->loop)};
    tsd_snapfile_sink sink = {.arg = &ld,
                              .bin = load_on_bin,
                              .item = load_on_item,
                              .stream = load_on_stream,
                              .record = load_on_record,
                              .group = load_on_group,
                              .table = load_on_table,
                              .trecord = load_on_trecord,
                              .param = load_on_param,
                              .emb = load_on_emb,
                              .ps_array = load_on_ps_array,
                              .name_printable = tsd_name_printable};
    tsd_snapfile_head head;
    int rc = -1;
    /*
     * The file is loaded whole whatever --max-memory says, as it always was for bins (tensord
     * warns after the load when it holds more): the limit is lifted while streams are rebuilt,
     * whose bookkeeping would otherwise be refused.
     */
    uint64_t max_memory = store->max_memory;
    store->max_memory = 0;
    int rr = tsd_snapfile_read_fd(fd, (uint64_t)st.st_size, path, &sink, &head, err, err_cap);
    store->max_memory = max_memory;
    if (rr != 0) {
        if (ld.err[0] != '\0')
            snprintf(err, err_cap, "%s", ld.err);
        goto unwind;
    }
    /* Every byte checked: link the bins (names are unique, or the file is damaged). */
    for (size_t b = 0; b < ld.n_bins; b++) {
        const load_bin *lb = &ld.bins[b];
        const uint8_t *name = ld.names + lb->name_off;
        int twice = tsd_store_find(store, name, lb->name_len) != NULL;
        if (twice || tsd_stream_find(srv, name, lb->name_len) != NULL ||
            tsd_table_find(srv, name, lb->name_len) != NULL) {
            char pn[TS_MAX_NAME_LEN * 4 + 1];
            tsd_name_printable(name, lb->name_len, pn, sizeof(pn));
            snprintf(err, err_cap, "snapshot %s is damaged: bin '%s' %s", path, pn,
                     twice ? "appears twice" : "is also a stream or a replay table");
            goto unwind;
        }
        /* A tensor bin's item holds its reservation since it was made (load_on_item). */
        int tensor = (lb->flags & TSD_SNAP_BIN_TENSOR) != 0;
        for (uint32_t i = 0; i < lb->n_items; i++) {
            tsd_item *it = ld.items[lb->first + i];
            if (!tensor)
                store->reserved += tsd_item_len(it); /* tsd_store_add consumes a reservation */
            if (tsd_store_add(store, name, lb->name_len, it, 0, lb->version) == NULL) {
                store->reserved -= tsd_item_len(it);
                snprintf(err, err_cap, "snapshot %s: out of memory loading it", path);
                goto unwind;
            }
            ld.items[lb->first + i] = NULL;
            if (tensor)
                (void)tsd_datadir_commit(srv, it, name, lb->name_len,
                                         TSD_DATADIR_TENSOR | TSD_DATADIR_REPLACE);
        }
    }
    /* The parameters go onto their bins, now in the store. */
    size_t n_params, n_embs;
    if (tsd_ps_restore_finish(srv, path, &n_params, &n_embs, err, err_cap) != 0)
        goto unwind;
    if (n_params > 0 || n_embs > 0)
        tsd_log(TSD_LOG_INFO,
                "snapshot %s: %zu parameters and %zu embedding tables restored (format %u)", path,
                n_params, n_embs, head.format);
    *counter = head.counter;
    if (ld.n_streams > 0)
        tsd_log(TSD_LOG_INFO, "snapshot %s: %zu streams restored (format %u)", path, ld.n_streams,
                head.format);
    if (ld.n_tables > 0)
        tsd_log(TSD_LOG_INFO, "snapshot %s: %zu replay tables restored (format %u)", path,
                ld.n_tables, head.format);
    rc = 0;
    goto out;
unwind:
    /* Nothing half-loaded: what was linked and rebuilt goes again. */
    if (ld.n_streams > 0) {
        tsd_streams_free(srv);
        (void)tsd_streams_init(srv);
    }
    if (ld.n_tables > 0) {
        tsd_tables_free(srv);
        (void)tsd_tables_init(srv);
    }
    tsd_ps_free(srv);
    tsd_store_free(store);
    (void)tsd_store_init(store, store->max_memory);
out:
    loader_free(&ld);
    close(fd);
    return rc;
}
