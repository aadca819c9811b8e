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
 * Loading reads the whole file through snapfile.c's reader into a side list first and links
 * bins into the store only when every byte of it is good: a damaged snapshot is reported and
 * never half-loaded.
 */
#include "server.h"

#include "snapfile.h"

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

/* The writer's view of item index: its record. */
static void job_item(void *arg, size_t index, const uint8_t **data, size_t *len)
{
    const tsd_snap_job *job = arg;
    const tsd_item *it = job->items[index];
    *data = tsd_item_data(it);
    *len = tsd_item_len(it);
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
    };
    int rc = tsd_snapfile_write(fd, &head, job->bins, job_item, job);
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
    size_t end = job->n_items - job->n_unref > max ? job->n_unref + max : job->n_items;
    for (; job->n_unref < end; job->n_unref++)
        tsd_item_unref(job->items[job->n_unref]);
    return job->n_unref == job->n_items;
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
    ts__free(job->bins);
    ts__free(job->names);
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
    if (job->n_items - job->n_unref <= SNAP_UNREF_SLICE || !srv->handles_init) {
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
    sb->first = job->n_items;
    for (tsd_item *it = bin->head; it != NULL; it = it->next) {
        tsd_item_ref(it);
        job->items[job->n_items++] = it;
        job->bytes += tsd_item_len(it);
    }
    return 0;
}

/* Answer the waiters of a finished job. */
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
                "refusing writes (PUT, APPEND, GET, DELETE) until a snapshot succeeds "
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
static int snap_take(tsd_server *srv, tsd_snap_job *job, int final)
{
    tsd_store *st = &srv->store;
    job->counter = srv->version;
    job->final = final;
    job->waiters = srv->save_waiters;
    srv->save_waiters = NULL;
    srv->snap_job = job;
    /* The view holds exactly what the store holds now: size the arrays to it. */
    if (ensure_room((void **)&job->bins, &job->bins_cap, st->bins.count, sizeof(*job->bins)) != 0 ||
        ensure_room((void **)&job->items, &job->items_cap, (size_t)st->n_items,
                    sizeof(*job->items)) != 0 ||
        ensure_room((void **)&job->names, &job->names_cap, (size_t)st->name_bytes, 1) != 0) {
        snap_walked(srv, job, TS_ENOMEM);
        return TS_ENOMEM;
    }
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
    srv->stats.snapshot_loop_us = job->pass.loop_ns / 1000u;
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
        return;
    }
    memset(job->bins, 0, job->bins_cap * sizeof(*job->bins));
    memset(job->items, 0, job->items_cap * sizeof(*job->items));
    memset(job->names, 0, job->names_cap);
}

static void snap_prepped(uv_work_t *req, int status)
{
    tsd_snap_job *job = req->data;
    tsd_server *srv = job->srv;
    (void)status; /* never cancelled; a failed preparation left the arrays to the loop */
    if (snap_take(srv, job, 0) != 0 && srv->snap_job == NULL && srv->final_pending) {
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
        job->req.data = job;
        srv->snap_job = job; /* counter 0: no SAVE joins it before it is taken */
        if (uv_queue_work(srv->loop, &job->req, snap_prep, snap_prepped) == 0)
            return 0;
        job->bins_cap = job->items_cap = job->names_cap = 0;
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
                "snapshot written to %s: %zu bins, %zu items, %llu bytes in %llu ms",
                srv->cfg.save_path, job->n_bins, job->n_items, (unsigned long long)job->bytes,
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

void tsd_snapshot_final(tsd_server *srv)
{
    if (srv->snap_job != NULL) {
        srv->final_pending = 1;
        return;
    }
    if (srv->store_freed)
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
                       uint32_t n_items)
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
    tsd_item *it = tsd_item_new(len);
    if (it == NULL)
        return NULL;
    ld->items[ld->n_items++] = it;
    return tsd_item_data(it);
}

static void loader_free(loader *ld)
{
    for (size_t i = 0; i < ld->n_items; i++)
        if (ld->items[i] != NULL)
            tsd_item_unref(ld->items[i]);
    ts__free(ld->items);
    ts__free(ld->bins);
    ts__free(ld->names);
}

int tsd_snapshot_load(tsd_store *store, const char *path, uint64_t *counter, char *err,
                      size_t err_cap)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
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
    loader ld = {0};
    tsd_snapfile_sink sink = {
        .arg = &ld, .bin = load_on_bin, .item = load_on_item, .name_printable = tsd_name_printable};
    tsd_snapfile_head head;
    int rc = -1;
    if (tsd_snapfile_read_fd(fd, (uint64_t)st.st_size, path, &sink, &head, err, err_cap) != 0)
        goto out;
    /* Every byte checked: link the bins (names are unique, or the file is damaged). */
    for (size_t b = 0; b < ld.n_bins; b++) {
        const load_bin *lb = &ld.bins[b];
        const uint8_t *name = ld.names + lb->name_off;
        if (tsd_store_find(store, name, lb->name_len) != NULL) {
            char pn[TS_MAX_NAME_LEN * 4 + 1];
            tsd_name_printable(name, lb->name_len, pn, sizeof(pn));
            snprintf(err, err_cap, "snapshot %s is damaged: bin '%s' appears twice", path, pn);
            goto unwind;
        }
        for (uint32_t i = 0; i < lb->n_items; i++) {
            tsd_item *it = ld.items[lb->first + i];
            store->reserved += tsd_item_len(it); /* tsd_store_add consumes a reservation */
            if (tsd_store_add(store, name, lb->name_len, it, 0, lb->version) == NULL) {
                store->reserved -= tsd_item_len(it);
                snprintf(err, err_cap, "snapshot %s: out of memory loading it", path);
                goto unwind;
            }
            ld.items[lb->first + i] = NULL;
        }
    }
    *counter = head.counter;
    rc = 0;
    goto out;
unwind:
    /* Nothing half-loaded: what was linked goes again. */
    tsd_store_free(store);
    (void)tsd_store_init(store, store->max_memory);
out:
    loader_free(&ld);
    close(fd);
    return rc;
}
