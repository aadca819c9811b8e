/*
 * Snapshots: every bin written to one file, atomically, without stopping the loop.
 *
 * Writing. The loop thread takes a reference on every item (items are immutable and their
 * counts atomic) and copies the bins' names, versions and item lists into a job, in one pass
 * over the name table in whatever order it holds them; that pass is the whole stall clients
 * see, so it does as little as it can: names go packed into one buffer, and the sorting by
 * name is left to the worker. A worker thread (uv_queue_work) sorts the bins, writes the job to
 * PATH.tmp (created afresh: never through a link, never readable by others), fsyncs it, renames
 * it over PATH and fsyncs the directory; the after-work callback, on the loop thread again,
 * answers the SAVE requests the snapshot covers and then drops the references a slice per loop
 * turn. One snapshot is written at a time; requests that arrive meanwhile are answered by the
 * next one.
 *
 * PATH.lock, locked (flock) from start-up to exit, keeps a second tensord from writing the same
 * snapshot. After a failed snapshot, and until one succeeds, writes are refused with
 * SAVE_FAILING when --stop-writes-on-save-error is on (the default): a client then learns that
 * its changes could not be made durable instead of having them acknowledged.
 *
 * The file (all integers little-endian):
 *   header, 64 bytes:
 *      0 u8[8] magic "TSDSNAP\0"     8 u32 format (1)        12 u32 0
 *     16 u64 change counter          24 u64 bins             32 u64 items
 *     40 u64 record bytes            48 u64 wall clock, ms   56 u64 hash of bytes 0..55
 *   then per bin, in name order:
 *     u8 name_len, name, u64 version, u32 n_items, u32 0, n_items x u64 item length,
 *     u64 hash of the bin header so far;
 *     then per item: its record bytes, u64 hash of them
 *   trailer, 32 bytes:
 *      0 u8[8] magic "TSDSEND\0"     8 u64 bins              16 u64 items
 *     24 u64 hash of every section hash above, in order, and of bytes 0..23
 * Every byte is covered by a hash, lengths are checked against the file size before anything
 * is allocated, and the file must end right after the trailer. Loading verifies everything
 * into a side list first and links bins into the store only when the whole file is good: a
 * damaged snapshot is reported and never half-loaded.
 */
#include "server.h"

#include "record.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SNAP_MAGIC     "TSDSNAP"
#define SNAP_END_MAGIC "TSDSEND"
#define SNAP_FORMAT    1
#define SNAP_HDR_SIZE  64
#define SNAP_END_SIZE  32
#define SNAP_WBUF      ((size_t)1 << 20) /* bytes; the writer's buffer for small pieces */
/* Bytes; the longest --save path (with ".lock" or ".tmp" added it still fits the buffers). */
#define SNAP_PATH_MAX 4000
#define SNAP_PATH_BUF (SNAP_PATH_MAX + 16)
/*
 * Item references dropped per loop turn once a snapshot is written: a million references
 * dropped at once would stall every client for tens of milliseconds.
 */
#define SNAP_UNREF_SLICE 16384
/* Bytes per bin name assumed when sizing the first snapshot's name buffer. */
#define SNAP_NAME_GUESS 16
/* Buckets of the name table fetched ahead while the loop takes a snapshot's references. */
#define SNAP_PREFETCH 16

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
 * Writing (worker thread)
 */

typedef struct snap_bin {
    const uint8_t *name; /* set by the worker: names + name_off */
    size_t name_off;     /* where its name starts in the job's names */
    size_t first;        /* index of its first item in the job's items */
    uint64_t version;
    uint32_t n_items;
    uint8_t name_len;
} snap_bin;

struct tsd_snap_job {
    uv_work_t req;
    tsd_server *srv;
    uint64_t counter;
    snap_bin *bins; /* in the name table's order; the worker sorts them by name */
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

typedef struct snap_writer {
    int fd;
    uint8_t *buf;
    size_t len;
    int failed;
    int err_no;
} snap_writer;

/* Write all bytes, retrying short writes and EINTR. 0 or -1 (errno set). */
static int write_all(int fd, const uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static void w_flush(snap_writer *w)
{
    if (w->failed || w->len == 0)
        return;
    if (write_all(w->fd, w->buf, w->len) != 0) {
        w->failed = 1;
        w->err_no = errno;
    }
    w->len = 0;
}

/* Append bytes: small ones are gathered in the buffer, large ones go straight out. */
static void w_put(snap_writer *w, const void *p, size_t n)
{
    if (w->failed)
        return;
    if (w->len + n > SNAP_WBUF) {
        w_flush(w);
        if (w->failed)
            return;
    }
    if (n >= SNAP_WBUF / 2) {
        if (write_all(w->fd, p, n) != 0) {
            w->failed = 1;
            w->err_no = errno;
        }
        return;
    }
    memcpy(w->buf + w->len, p, n);
    w->len += n;
}

static void w_u64(snap_writer *w, uint64_t v)
{
    uint8_t b[8];
    ts__put_u64le(b, v);
    w_put(w, b, 8);
}

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

/* By name, bytewise, a shorter name first when one is a prefix of the other. */
static int snap_bin_cmp(const void *a, const void *b)
{
    const snap_bin *x = a;
    const snap_bin *y = b;
    size_t n = x->name_len < y->name_len ? x->name_len : y->name_len;
    int r = n > 0 ? memcmp(x->name, y->name, n) : 0;
    if (r != 0)
        return r;
    return (x->name_len > y->name_len) - (x->name_len < y->name_len);
}

static void job_fail(tsd_snap_job *job, const char *what, const char *file, int e)
{
    job->failed = 1;
    /* A very long path is cut short in the message; that is fine. */
    if (snprintf(job->err, sizeof(job->err), "snapshot: %s %s: %s", what, file, strerror(e)) < 0)
        job->err[0] = '\0';
}

static void snap_write(uv_work_t *req)
{
    tsd_snap_job *job = req->data;
    const char *path = job->srv->cfg.save_path;
    uint64_t t0 = ts__now_ns();
    char tmp[SNAP_PATH_BUF], dir[SNAP_PATH_BUF];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    dir_of(path, dir, sizeof(dir));

    /* The file lists bins in name order; sorting here keeps it off the loop. */
    for (size_t b = 0; b < job->n_bins; b++)
        job->bins[b].name = job->names + job->bins[b].name_off;
    if (job->n_bins > 1)
        qsort(job->bins, job->n_bins, sizeof(*job->bins), snap_bin_cmp);

    snap_writer w = {.fd = -1};
    w.buf = ts__malloc(SNAP_WBUF);
    if (w.buf == NULL) {
        job_fail(job, "allocating a buffer for", tmp, ENOMEM);
        return;
    }
    /*
     * A new file, created here and now: O_EXCL|O_NOFOLLOW never write through a link someone
     * planted at PATH.tmp (its target would be overwritten, and readable by whoever owns it),
     * and mode 0600 keeps the data private. A file left there by a crash (only this process
     * holds the lock, so it is nobody's file in progress) is removed first; unlink removes a
     * link itself, never its target.
     */
    if (unlink(tmp) != 0 && errno != ENOENT) {
        job_fail(job, "removing the old", tmp, errno);
        ts__free(w.buf);
        return;
    }
    w.fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (w.fd < 0) {
        job_fail(job, "creating", tmp, errno);
        ts__free(w.buf);
        return;
    }

    uint8_t hdr[SNAP_HDR_SIZE];
    memset(hdr, 0, sizeof(hdr));
    memcpy(hdr, SNAP_MAGIC, sizeof(SNAP_MAGIC));
    ts__put_u32le(hdr + 8, SNAP_FORMAT);
    ts__put_u64le(hdr + 16, job->counter);
    ts__put_u64le(hdr + 24, job->n_bins);
    ts__put_u64le(hdr + 32, job->n_items);
    ts__put_u64le(hdr + 40, job->bytes);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    ts__put_u64le(hdr + 48, (uint64_t)now.tv_sec * 1000u + (uint64_t)now.tv_nsec / 1000000u);
    uint64_t h = tsd_hash64(hdr, 56, 0);
    ts__put_u64le(hdr + 56, h);
    w_put(&w, hdr, sizeof(hdr));
    uint64_t acc = chain(0, h);

    /* The bin header's fixed part plus the largest item list, hashed as one piece. */
    uint8_t *bh = NULL;
    size_t bh_cap = 0;
    for (size_t b = 0; b < job->n_bins && !w.failed; b++) {
        const snap_bin *sb = &job->bins[b];
        size_t need = 1 + (size_t)sb->name_len + 16 + (size_t)sb->n_items * 8;
        if (need > bh_cap) {
            uint8_t *nb = ts__realloc(bh, need);
            if (nb == NULL) {
                w.failed = 1;
                w.err_no = ENOMEM;
                break;
            }
            bh = nb;
            bh_cap = need;
        }
        uint8_t *p = bh;
        *p++ = sb->name_len;
        memcpy(p, sb->name, sb->name_len);
        p += sb->name_len;
        ts__put_u64le(p, sb->version);
        ts__put_u32le(p + 8, sb->n_items);
        ts__put_u32le(p + 12, 0);
        p += 16;
        for (uint32_t i = 0; i < sb->n_items; i++, p += 8)
            ts__put_u64le(p, tsd_item_len(job->items[sb->first + i]));
        h = tsd_hash64(bh, need, 0);
        w_put(&w, bh, need);
        w_u64(&w, h);
        acc = chain(acc, h);
        for (uint32_t i = 0; i < sb->n_items; i++) {
            const tsd_item *it = job->items[sb->first + i];
            h = tsd_hash64(tsd_item_data(it), tsd_item_len(it), 0);
            w_put(&w, tsd_item_data(it), tsd_item_len(it));
            w_u64(&w, h);
            acc = chain(acc, h);
        }
    }
    ts__free(bh);

    uint8_t end[SNAP_END_SIZE];
    memcpy(end, SNAP_END_MAGIC, sizeof(SNAP_END_MAGIC));
    ts__put_u64le(end + 8, job->n_bins);
    ts__put_u64le(end + 16, job->n_items);
    ts__put_u64le(end + 24, chain(acc, tsd_hash64(end, 24, 0)));
    w_put(&w, end, sizeof(end));
    w_flush(&w);
    ts__free(w.buf);

    if (w.failed) {
        job_fail(job, "writing", tmp, w.err_no);
        close(w.fd);
        unlink(tmp);
        return;
    }
    /* Durable before it becomes visible: data, then the name, then the directory entry. */
    if (fsync(w.fd) != 0) {
        job_fail(job, "fsync of", tmp, errno);
        close(w.fd);
        unlink(tmp);
        return;
    }
    if (close(w.fd) != 0) {
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

/* Append a bin's name to the job's packed names. 0 or -1 (out of memory). */
static int job_add_name(tsd_snap_job *job, const uint8_t *name, size_t len)
{
    if (job->names_cap - job->names_len < len) {
        size_t cap = job->names_cap * 2 + len + 4096;
        uint8_t *nn = ts__realloc(job->names, cap);
        if (nn == NULL)
            return -1;
        job->names = nn;
        job->names_cap = cap;
    }
    memcpy(job->names + job->names_len, name, len);
    job->names_len += len;
    return 0;
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
 * Take references to everything the store holds now, into job (its arrays are allocated, or
 * grown, here when the worker did not prepare them large enough). 0, or -1 on allocation
 * failure (the references taken so far stay in the job, dropped by job_free).
 *
 * This runs on the loop and every client waits for it: one pass over the name table, a few
 * bytes copied and a reference taken per item, nothing sorted. Fresh memory would cost a page
 * fault per page on top (more than the pass itself on some machines), so the arrays normally
 * come from the worker, allocated and touched there (snap_prep).
 */
static int job_fill(tsd_server *srv, tsd_snap_job *job)
{
    job->counter = srv->version;
    const tsd_htab *tab = &srv->store.bins;
    size_t n = tab->count;
    if (ensure_room((void **)&job->bins, &job->bins_cap, n, sizeof(*job->bins)) != 0 ||
        ensure_room((void **)&job->items, &job->items_cap, (size_t)srv->store.n_items,
                    sizeof(*job->items)) != 0)
        return -1;
    for (size_t k = 0; tab->buckets != NULL && k <= tab->mask; k++) {
        /*
         * The pass is bound by memory latency (bin, name, item header: each a cache miss), so
         * fetch ahead: the bin SNAP_PREFETCH buckets on, and the name and first item of the
         * one half as far on, which is in cache by now.
         */
        if (k + SNAP_PREFETCH <= tab->mask && tab->buckets[k + SNAP_PREFETCH] != NULL)
            __builtin_prefetch(tab->buckets[k + SNAP_PREFETCH]);
        if (k + SNAP_PREFETCH / 2 <= tab->mask && tab->buckets[k + SNAP_PREFETCH / 2] != NULL) {
            const tsd_hnode *ahead = tab->buckets[k + SNAP_PREFETCH / 2];
            __builtin_prefetch(ahead->name);
            __builtin_prefetch(((const tsd_bin *)(const void *)ahead)->head, 1);
        }
        for (tsd_hnode *node = tab->buckets[k]; node != NULL; node = node->next) {
            const tsd_bin *bin = (const tsd_bin *)(const void *)node;
            /* n_bins == n cannot happen: the table counts its nodes. */
            if (job->n_bins == n || job_add_name(job, node->name, node->name_len) != 0)
                return -1;
            snap_bin *sb = &job->bins[job->n_bins++];
            sb->name = NULL;
            sb->name_off = job->names_len - node->name_len;
            sb->name_len = node->name_len;
            sb->version = bin->version;
            sb->n_items = bin->n_items;
            sb->first = job->n_items;
            for (tsd_item *it = bin->head; it != NULL; it = it->next) {
                if (job->n_items == job->items_cap)
                    return -1; /* cannot happen: the store counts its items */
                tsd_item_ref(it);
                job->items[job->n_items++] = it;
                job->bytes += tsd_item_len(it);
            }
        }
    }
    srv->snap_names_hint = job->names_len;
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

/*
 * Take the snapshot now (the loop pass) and hand it to the writer, with the pending SAVE
 * waiters. 0, TS_ENOMEM (the waiters are answered with an error, the job freed) or a libuv
 * code.
 */
static int snap_take(tsd_server *srv, tsd_snap_job *job, int final)
{
    uint64_t t0 = ts__now_ns();
    int rc = job_fill(srv, job);
    srv->stats.snapshot_loop_us = (ts__now_ns() - t0) / 1000u;
    if (rc != 0) {
        srv->snap_job = NULL;
        job_free(job);
        snap_fail_oom(srv);
        return TS_ENOMEM;
    }
    job->final = final;
    job->waiters = srv->save_waiters;
    srv->save_waiters = NULL;
    rc = uv_queue_work(srv->loop, &job->req, snap_write, snap_done);
    if (rc != 0) {
        srv->snap_job = NULL;
        job->failed = 1;
        snprintf(job->err, sizeof(job->err), "snapshot: cannot start the writer: %s",
                 uv_strerror(rc));
        tsd_log(TSD_LOG_ERROR, "%s", job->err);
        save_failed(srv);
        answer(srv, job);
        job_free(job);
        return rc;
    }
    srv->snap_job = job;
    return 0;
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
    if (snap_take(srv, job, 0) != 0 && srv->final_pending) {
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
        /* Names: as many bytes as last time, or a guess of 16 per bin before the first one. */
        size_t names = srv->snap_names_hint != 0 ? srv->snap_names_hint
                                                 : srv->store.bins.count * SNAP_NAME_GUESS;
        job->names_cap = with_slack(names) + 4096;
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

typedef struct snap_reader {
    int fd;
    const char *path;
    uint64_t left; /* bytes of the file not yet read */
    char *err;
    size_t err_cap;
} snap_reader;

/* Read exactly n bytes; -1 with a message naming what was being read. */
static int r_read(snap_reader *r, void *dst, size_t n, const char *what)
{
    if (n > r->left) {
        snprintf(r->err, r->err_cap,
                 "snapshot %s is truncated: %s needs %zu bytes, only %llu remain", r->path, what, n,
                 (unsigned long long)r->left);
        return -1;
    }
    uint8_t *p = dst;
    size_t got = 0;
    while (got < n) {
        ssize_t k = read(r->fd, p + got, n - got > ((size_t)1 << 30) ? ((size_t)1 << 30) : n - got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            snprintf(r->err, r->err_cap, "snapshot %s: reading %s: %s", r->path, what,
                     k == 0 ? "unexpected end of file" : strerror(errno));
            return -1;
        }
        got += (size_t)k;
    }
    r->left -= n;
    return 0;
}

static int bad(snap_reader *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int bad(snap_reader *r, const char *fmt, ...)
{
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    snprintf(r->err, r->err_cap, "snapshot %s is damaged: %s", r->path, msg);
    return -1;
}

/* A length that points past the end: the file was cut short, or a length was damaged. */
static int cut(snap_reader *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int cut(snap_reader *r, const char *fmt, ...)
{
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    snprintf(r->err, r->err_cap, "snapshot %s is truncated or damaged: %s", r->path, msg);
    return -1;
}

/* A bin read from the file, not yet in the store. */
typedef struct load_bin {
    uint8_t name_len;
    uint8_t name[TS_MAX_NAME_LEN];
    uint64_t version;
    uint32_t n_items;
    tsd_item **items;
} load_bin;

static void load_bins_free(load_bin *lb, size_t n)
{
    for (size_t b = 0; b < n; b++) {
        for (uint32_t i = 0; i < lb[b].n_items; i++)
            tsd_item_unref(lb[b].items[i]);
        ts__free(lb[b].items);
    }
    ts__free(lb);
}

/* Read and check one bin (header, item lengths, items) into lb. 0 or -1. */
static int load_bin_read(snap_reader *r, load_bin *lb, size_t index, uint64_t *acc,
                         uint64_t *items_seen, uint64_t items_total)
{
    uint8_t fixed[1 + TS_MAX_NAME_LEN + 16];
    char what[64];
    snprintf(what, sizeof(what), "the header of bin %zu", index);
    if (r_read(r, fixed, 1, what) != 0)
        return -1;
    size_t nl = fixed[0];
    if (r_read(r, fixed + 1, nl + 16, what) != 0)
        return -1;
    uint32_t n = ts__get_u32le(fixed + 1 + nl + 8);
    if (n > items_total - *items_seen || (uint64_t)n * 16 > r->left)
        return cut(r, "bin %zu claims %u items, more than the rest of the file can hold", index, n);
    size_t hlen = 1 + nl + 16 + (size_t)n * 8;
    uint8_t *hb = ts__malloc(hlen);
    lb->items = ts__calloc(n > 0 ? n : 1, sizeof(*lb->items));
    if (hb == NULL || lb->items == NULL) {
        ts__free(hb);
        snprintf(r->err, r->err_cap, "snapshot %s: out of memory loading it", r->path);
        return -1;
    }
    memcpy(hb, fixed, 1 + nl + 16);
    uint8_t hash[8];
    if (r_read(r, hb + 1 + nl + 16, (size_t)n * 8, what) != 0 || r_read(r, hash, 8, what) != 0) {
        ts__free(hb);
        return -1;
    }
    uint64_t h = tsd_hash64(hb, hlen, 0);
    if (h != ts__get_u64le(hash)) {
        ts__free(hb);
        return bad(r, "checksum mismatch in the header of bin %zu", index);
    }
    *acc = chain(*acc, h);
    lb->name_len = (uint8_t)nl;
    memcpy(lb->name, hb + 1, nl);
    lb->version = ts__get_u64le(hb + 1 + nl);
    char pn[TS_MAX_NAME_LEN * 4 + 1];
    tsd_name_printable(lb->name, nl, pn, sizeof(pn));
    for (uint32_t i = 0; i < n; i++) {
        uint64_t len = ts__get_u64le(hb + 1 + nl + 16 + (size_t)i * 8);
        if (len > r->left || len < TS_REC_HDR_SIZE) {
            ts__free(hb);
            return cut(r, "item %u of bin '%s' claims %llu bytes (%llu remain in the file)", i, pn,
                       (unsigned long long)len, (unsigned long long)r->left);
        }
        tsd_item *it = tsd_item_new((size_t)len);
        if (it == NULL) {
            ts__free(hb);
            snprintf(r->err, r->err_cap, "snapshot %s: out of memory loading a %llu-byte item",
                     r->path, (unsigned long long)len);
            return -1;
        }
        lb->items[lb->n_items++] = it;
        snprintf(what, sizeof(what), "item %u of bin %zu", i, index);
        uint8_t *data = tsd_item_data(it);
        if (r_read(r, data, (size_t)len, what) != 0 || r_read(r, hash, 8, what) != 0) {
            ts__free(hb);
            return -1;
        }
        h = tsd_hash64(data, (size_t)len, 0);
        if (h != ts__get_u64le(hash)) {
            ts__free(hb);
            return bad(r, "checksum mismatch in item %u of bin '%s'", i, pn);
        }
        if (ts__record_validate(data, (size_t)len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL) != 0) {
            ts__free(hb);
            return bad(r, "item %u of bin '%s' is not a valid record", i, pn);
        }
        *acc = chain(*acc, h);
        (*items_seen)++;
    }
    ts__free(hb);
    return 0;
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
    snap_reader r = {
        .fd = fd, .path = path, .left = (uint64_t)st.st_size, .err = err, .err_cap = err_cap};
    load_bin *lb = NULL;
    size_t n_loaded = 0;
    int rc = -1;

    uint8_t hdr[SNAP_HDR_SIZE];
    if (r_read(&r, hdr, sizeof(hdr), "the file header") != 0)
        goto out;
    if (memcmp(hdr, SNAP_MAGIC, sizeof(SNAP_MAGIC)) != 0) {
        bad(&r, "not a tensord snapshot (bad magic)");
        goto out;
    }
    if (tsd_hash64(hdr, 56, 0) != ts__get_u64le(hdr + 56)) {
        bad(&r, "checksum mismatch in the file header");
        goto out;
    }
    if (ts__get_u32le(hdr + 8) != SNAP_FORMAT) {
        snprintf(err, err_cap, "snapshot %s: format %u is not supported (this tensord reads %d)",
                 path, ts__get_u32le(hdr + 8), SNAP_FORMAT);
        goto out;
    }
    uint64_t saved_counter = ts__get_u64le(hdr + 16);
    uint64_t n_bins = ts__get_u64le(hdr + 24);
    uint64_t n_items = ts__get_u64le(hdr + 32);
    /* Each bin takes at least 25 bytes and each item 8 + 8 + a record header. */
    if (n_bins > r.left / 25 || n_items > r.left / (16 + TS_REC_HDR_SIZE)) {
        cut(&r, "the header claims %llu bins and %llu items, more than the file can hold",
            (unsigned long long)n_bins, (unsigned long long)n_items);
        goto out;
    }
    uint64_t acc = chain(0, ts__get_u64le(hdr + 56));
    lb = ts__calloc(n_bins > 0 ? (size_t)n_bins : 1, sizeof(*lb));
    if (lb == NULL) {
        snprintf(err, err_cap, "snapshot %s: out of memory loading it", path);
        goto out;
    }
    uint64_t items_seen = 0;
    for (size_t b = 0; b < n_bins; b++) {
        n_loaded = b + 1;
        if (load_bin_read(&r, &lb[b], b, &acc, &items_seen, n_items) != 0)
            goto out;
    }
    uint8_t end[SNAP_END_SIZE];
    if (r_read(&r, end, sizeof(end), "the trailer") != 0)
        goto out;
    if (memcmp(end, SNAP_END_MAGIC, sizeof(SNAP_END_MAGIC)) != 0 ||
        ts__get_u64le(end + 8) != n_bins || ts__get_u64le(end + 16) != n_items ||
        items_seen != n_items) {
        bad(&r, "the trailer does not match the contents");
        goto out;
    }
    if (chain(acc, tsd_hash64(end, 24, 0)) != ts__get_u64le(end + 24)) {
        bad(&r, "checksum mismatch in the trailer");
        goto out;
    }
    if (r.left != 0) {
        bad(&r, "%llu unexpected bytes after the trailer", (unsigned long long)r.left);
        goto out;
    }
    /* Every byte checked: link the bins (names are unique, or the file is damaged). */
    for (size_t b = 0; b < n_bins; b++) {
        if (tsd_store_find(store, lb[b].name, lb[b].name_len) != NULL) {
            char pn[TS_MAX_NAME_LEN * 4 + 1];
            tsd_name_printable(lb[b].name, lb[b].name_len, pn, sizeof(pn));
            bad(&r, "bin '%s' appears twice", pn);
            goto unwind;
        }
        for (uint32_t i = 0; i < lb[b].n_items; i++) {
            tsd_item *it = lb[b].items[i];
            store->reserved += tsd_item_len(it); /* tsd_store_add consumes a reservation */
            if (tsd_store_add(store, lb[b].name, lb[b].name_len, it, 0, lb[b].version) == NULL) {
                store->reserved -= tsd_item_len(it);
                snprintf(err, err_cap, "snapshot %s: out of memory loading it", path);
                goto unwind;
            }
            lb[b].items[i] = NULL;
        }
    }
    *counter = saved_counter;
    rc = 0;
    goto out;
unwind:
    /* Nothing half-loaded: what was linked goes again. */
    tsd_store_free(store);
    (void)tsd_store_init(store, store->max_memory);
out:
    if (lb != NULL) {
        for (size_t b = 0; b < n_loaded; b++) {
            for (uint32_t i = 0; i < lb[b].n_items; i++)
                if (lb[b].items[i] != NULL)
                    tsd_item_unref(lb[b].items[i]);
            lb[b].n_items = 0;
        }
        load_bins_free(lb, n_loaded);
    }
    close(fd);
    return rc;
}
