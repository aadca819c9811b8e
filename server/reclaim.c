/*
 * Giving large memory back off the loop thread. Unmapping a multi-megabyte mapping whose pages
 * are present, and closing the last descriptor of a memfd, cost the kernel time in proportion
 * to the pages (about 75 ms for 1 GiB of memfd pages on the 2-core development VM), and a loop
 * thread that spends it serves nobody meanwhile. The loop thread hands such releases to one
 * reclaim thread instead, in order, and goes on at once.
 *
 * Pending releases are bounded: while TSD_RECLAIM_MAX_PENDING bytes or TSD_RECLAIM_MAX_JOBS
 * releases are queued, a new release happens at once on the loop thread, so memory handed back can
 * never pile up faster than the kernel takes it. Without the thread (it failed to start, or a unit
 * test drives the store without a server) every release happens at once, as it did before.
 */
#define _GNU_SOURCE
#include "server.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct reclaim_job {
    struct reclaim_job *next;
    void *addr; /* a mapping to unmap (RECLAIM_UNMAP), or a buffer for ts__free_aligned */
    size_t len;
    int fd; /* closed after the unmap; -1 when none */
    int kind;
} reclaim_job;

enum { RECLAIM_UNMAP = 0, RECLAIM_FREE_ALIGNED = 1 };

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    int running;  /* the thread exists (loop thread's view; set and cleared there) */
    int stopping; /* under mu: the thread ends once the queue is empty */
    reclaim_job *head, *tail;
    _Atomic uint64_t pending_bytes; /* queued and not yet released */
    _Atomic uint32_t pending_jobs;  /* their count (each may hold a descriptor) */
    uint64_t jobs;                  /* loop thread: releases handed to the thread */
    uint64_t bytes;                 /* loop thread: their bytes */
} rc = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void release_now(int kind, void *addr, size_t len, int fd)
{
    if (kind == RECLAIM_FREE_ALIGNED) {
        ts__free_aligned(addr, len);
        return;
    }
    if (addr != NULL)
        (void)munmap(addr, len);
    if (fd >= 0)
        (void)close(fd);
}

static void *reclaim_main(void *arg)
{
    (void)arg;
    /*
     * Lowest priority: the loop thread, woken on the same CPU, takes it over at once, and the
     * releases use the time nobody else wants (the pending bound keeps them from starving).
     */
#ifdef SCHED_IDLE
    struct sched_param sp = {.sched_priority = 0};
    (void)pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp);
#endif
    pthread_mutex_lock(&rc.mu);
    for (;;) {
        while (rc.head == NULL && !rc.stopping)
            pthread_cond_wait(&rc.cv, &rc.mu);
        reclaim_job *j = rc.head;
        if (j == NULL)
            break; /* stopping, and nothing left */
        rc.head = j->next;
        if (rc.head == NULL)
            rc.tail = NULL;
        pthread_mutex_unlock(&rc.mu);
        release_now(j->kind, j->addr, j->len, j->fd);
        atomic_fetch_sub_explicit(&rc.pending_bytes, (uint64_t)j->len, memory_order_relaxed);
        atomic_fetch_sub_explicit(&rc.pending_jobs, 1, memory_order_relaxed);
        ts__free(j);
        pthread_mutex_lock(&rc.mu);
    }
    pthread_mutex_unlock(&rc.mu);
    return NULL;
}

int tsd_reclaim_start(void)
{
    if (rc.running)
        return 0;
    /* Comparison aid (bench/zc_bench's drop case): TSD_RECLAIM_OFF=1 keeps every release here. */
    const char *off = getenv("TSD_RECLAIM_OFF");
    if (off != NULL && off[0] != '\0' && strcmp(off, "0") != 0) {
        tsd_log(TSD_LOG_WARN, "TSD_RECLAIM_OFF: large buffers are given back on the loop thread");
        return -1;
    }
    /* The signals stay the loop thread's (libuv's handlers), as for the thread pool. */
    sigset_t old;
    tsd_signals_block(&old);
    rc.stopping = 0;
    int err = pthread_create(&rc.thread, NULL, reclaim_main, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err != 0) {
        tsd_log(TSD_LOG_WARN,
                "cannot start the reclaim thread (%s): large buffers are given back on the "
                "loop thread",
                strerror(err));
        return -1;
    }
    rc.running = 1;
    return 0;
}

void tsd_reclaim_stop(void)
{
    if (!rc.running)
        return;
    pthread_mutex_lock(&rc.mu);
    rc.stopping = 1;
    pthread_cond_signal(&rc.cv);
    pthread_mutex_unlock(&rc.mu);
    (void)pthread_join(rc.thread, NULL);
    rc.running = 0;
}

static void reclaim(int kind, void *addr, size_t len, int fd)
{
    if (!rc.running || len < TSD_RECLAIM_MIN ||
        atomic_load_explicit(&rc.pending_bytes, memory_order_relaxed) >= TSD_RECLAIM_MAX_PENDING ||
        atomic_load_explicit(&rc.pending_jobs, memory_order_relaxed) >= TSD_RECLAIM_MAX_JOBS) {
        release_now(kind, addr, len, fd);
        return;
    }
    reclaim_job *j = ts__malloc(sizeof(*j));
    if (j == NULL) {
        release_now(kind, addr, len, fd);
        return;
    }
    j->next = NULL;
    j->addr = addr;
    j->len = len;
    j->fd = fd;
    j->kind = kind;
    atomic_fetch_add_explicit(&rc.pending_bytes, (uint64_t)len, memory_order_relaxed);
    atomic_fetch_add_explicit(&rc.pending_jobs, 1, memory_order_relaxed);
    rc.jobs++;
    rc.bytes += len;
    pthread_mutex_lock(&rc.mu);
    if (rc.tail != NULL)
        rc.tail->next = j;
    else
        rc.head = j;
    rc.tail = j;
    pthread_cond_signal(&rc.cv);
    pthread_mutex_unlock(&rc.mu);
}

void tsd_reclaim_unmap(void *addr, size_t len, int fd)
{
    reclaim(RECLAIM_UNMAP, addr, len, fd);
}

void tsd_reclaim_free_aligned(void *p, size_t len)
{
    reclaim(RECLAIM_FREE_ALIGNED, p, len, -1);
}

void tsd_reclaim_stats_get(tsd_reclaim_stats *st)
{
    st->pending_bytes = atomic_load_explicit(&rc.pending_bytes, memory_order_relaxed);
    st->jobs = rc.jobs;
    st->bytes = rc.bytes;
}
