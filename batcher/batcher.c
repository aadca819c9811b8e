/*
 * The dynamic batching inference manager (include/tensorshare/batcher.h).
 *
 * One mutex guards the whole batcher: the request queue, the deadline heap, the weight updates
 * and the counters. Replica threads hold it only to pick a batch and to record its outcome;
 * models run, rows are copied and callbacks are called without it.
 *
 * A request's life: submit checks it against the schema and queues it (queue + deadline heap);
 * a replica pops it into a batch (it leaves the heap: a request in a forward gets that
 * forward's answer), or the timer thread fails it with TS_ETIMEDOUT at its deadline, or
 * ts_batcher_free cancels it. Exactly one of those three answers it, under the mutex, so the
 * callback runs exactly once.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include "batcher_internal.h"
#include "handoff.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

/* Set on batcher threads, so that a blocking call from a callback fails instead of hanging. */
static _Thread_local int tls_in_batcher;
/*
 * The answering context of this thread when it is a replica's or an answer helper's, else NULL.
 * While its callbacks run (ctx->active), a request they submit goes to the context's list
 * instead of the queue, needs no wake-up, and is queued with the others under one acquisition
 * of the lock when the callbacks are over (see ts_batcher_predict_async_with). Its free list
 * recycles request records on this thread.
 */
static _Thread_local answer_ctx *tls_ctx;

void (*ts__batcher_look_hook)(void);

void ts__batcher_set_err(const char *fmt, ...)
{
    char msg[TS__BERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    ts_set_last_error(msg);
}

int ts__batcher_on_own_thread(void)
{
    return tls_in_batcher;
}

/*
 * Name the calling batcher thread (what top -H, perf and /proc/PID/task/TID/comm show):
 * "ts-replica-N", "ts-answer-N" or "ts-timer". Best effort.
 */
static void name_thread(const char *role, int index)
{
    char name[32];
    if (index >= 0)
        snprintf(name, sizeof(name), "ts-%s-%d", role, index);
    else
        snprintf(name, sizeof(name), "ts-%s", role);
    name[15] = '\0'; /* Linux's limit: 15 bytes and the terminator */
#ifdef __linux__
    (void)pthread_setname_np(pthread_self(), name);
#endif
}

/* ---------------------------------------------------------------------------------------------
 * Requests, the queue and the deadline heap
 */
static void heap_swap(ts_batcher_t *b, size_t i, size_t j)
{
    batch_request *t = b->heap[i];
    b->heap[i] = b->heap[j];
    b->heap[j] = t;
    b->heap[i]->heap_idx = i;
    b->heap[j]->heap_idx = j;
}

static void heap_up(ts_batcher_t *b, size_t i)
{
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (b->heap[p]->deadline_ns <= b->heap[i]->deadline_ns)
            break;
        heap_swap(b, i, p);
        i = p;
    }
}

static void heap_down(ts_batcher_t *b, size_t i)
{
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < b->heap_len && b->heap[l]->deadline_ns < b->heap[m]->deadline_ns)
            m = l;
        if (r < b->heap_len && b->heap[r]->deadline_ns < b->heap[m]->deadline_ns)
            m = r;
        if (m == i)
            return;
        heap_swap(b, i, m);
        i = m;
    }
}

/* Add a request with a deadline. 0 or TS_ENOMEM. Lock held. */
static int heap_push(ts_batcher_t *b, batch_request *r)
{
    if (b->heap_len == b->heap_cap) {
        size_t cap = b->heap_cap ? b->heap_cap * 2 : 64;
        batch_request **h = ts__realloc(b->heap, cap * sizeof(*h));
        if (h == NULL)
            return TS_ENOMEM;
        b->heap = h;
        b->heap_cap = cap;
    }
    r->heap_idx = b->heap_len;
    b->heap[b->heap_len++] = r;
    heap_up(b, r->heap_idx);
    return 0;
}

/* Remove a request from the heap if it is there. Lock held. */
static void heap_remove(ts_batcher_t *b, batch_request *r)
{
    size_t i = r->heap_idx;
    if (i == SIZE_MAX)
        return;
    r->heap_idx = SIZE_MAX;
    b->heap_len--;
    if (i == b->heap_len)
        return;
    b->heap[i] = b->heap[b->heap_len];
    b->heap[i]->heap_idx = i;
    heap_up(b, i);
    heap_down(b, b->heap[i]->heap_idx);
}

/*
 * Remove n requests from the heap at once (those not in it are skipped). A batch usually takes
 * the oldest requests, which are at the top of the heap when every request has the same
 * timeout, and removing them one by one would sift each time; when that costs more than
 * rebuilding the heap from what remains (about n log2 heap_len against heap_len steps), the
 * heap is compacted and rebuilt instead. Lock held.
 */
static void heap_remove_many(ts_batcher_t *b, batch_request **rs, int n)
{
    size_t in_heap = 0;
    for (int i = 0; i < n; i++)
        in_heap += rs[i]->heap_idx != SIZE_MAX;
    if (in_heap == 0)
        return;
    size_t depth = (size_t)(64 - __builtin_clzll((unsigned long long)b->heap_len));
    if (in_heap * depth < b->heap_len) {
        for (int i = 0; i < n; i++)
            heap_remove(b, rs[i]);
        return;
    }
    for (int i = 0; i < n; i++) {
        if (rs[i]->heap_idx != SIZE_MAX) {
            b->heap[rs[i]->heap_idx] = NULL;
            rs[i]->heap_idx = SIZE_MAX;
        }
    }
    size_t len = 0;
    for (size_t i = 0; i < b->heap_len; i++) {
        if (b->heap[i] != NULL) {
            b->heap[len] = b->heap[i];
            b->heap[len]->heap_idx = len;
            len++;
        }
    }
    b->heap_len = len;
    for (size_t i = len / 2; i-- > 0;)
        heap_down(b, i);
}

/*
 * Queue a request behind every request of its priority level and the more urgent ones, ahead of
 * the less urgent ones. Lock held.
 */
static void enqueue(ts_batcher_t *b, batch_request *r)
{
    batch_request *after = NULL;
    for (int p = r->prio; p >= 0 && after == NULL; p--)
        after = b->tails[p];
    r->prev = after;
    r->next = after != NULL ? after->next : b->head;
    if (r->next != NULL)
        r->next->prev = r;
    else
        b->tail = r;
    if (after != NULL)
        after->next = r;
    else
        b->head = r;
    b->tails[r->prio] = r;
    b->queued++;
    b->queued_rows += r->rows;
    atomic_store_explicit(&b->queued_hint, b->queued, memory_order_relaxed);
}

/* Unlink a request from the queue, leaving the heap alone. Lock held. */
static void unlink_queued(ts_batcher_t *b, batch_request *r)
{
    if (b->tails[r->prio] == r)
        b->tails[r->prio] = r->prev != NULL && r->prev->prio == r->prio ? r->prev : NULL;
    if (r->prev != NULL)
        r->prev->next = r->next;
    else
        b->head = r->next;
    if (r->next != NULL)
        r->next->prev = r->prev;
    else
        b->tail = r->prev;
    r->prev = r->next = NULL;
    b->queued--;
    b->queued_rows -= r->rows;
    atomic_store_explicit(&b->queued_hint, b->queued, memory_order_relaxed);
}

/* Unlink a request from the queue and the heap. Lock held. */
static void unqueue(ts_batcher_t *b, batch_request *r)
{
    unlink_queued(b, r);
    heap_remove(b, r);
}

/* Bytes of a request record of b (one leaf per input field). */
static size_t req_size(const ts_batcher_t *b)
{
    return sizeof(batch_request) + (size_t)b->n_in * sizeof(((batch_request *)NULL)->leaf[0]);
}

/*
 * A zeroed request record: on an answering thread of b, one its callbacks' requests left
 * behind (a closed loop of requesters frees a batch's records and allocates as many again on
 * the same thread), else a new one. NULL on ENOMEM.
 */
static batch_request *req_alloc(ts_batcher_t *b)
{
    answer_ctx *c = tls_ctx;
    if (c != NULL && c->b == b && c->free_list != NULL) {
        batch_request *r = c->free_list;
        c->free_list = r->next;
        c->n_free--;
        memset(r, 0, req_size(b));
        return r;
    }
    return ts__calloc(1, req_size(b));
}

/* Free a request record: kept for reuse on an answering thread of b (up to max_free). */
static void req_free(ts_batcher_t *b, batch_request *r)
{
    ts_value_free(r->owned);
    answer_ctx *c = tls_ctx;
    if (c != NULL && c->b == b && c->n_free < c->max_free) {
        r->next = c->free_list;
        c->free_list = r;
        c->n_free++;
        return;
    }
    ts__free(r);
}

/*
 * The lock of a context's list of submitted requests: a spin lock, since it is held for a few
 * instructions (an append, or a cancel's walk) and contended only by a rare cancel, and it costs
 * one atomic exchange per submit where a mutex costs two atomic operations and two calls.
 */
static void ctx_lock(answer_ctx *c)
{
    while (atomic_flag_test_and_set_explicit(&c->lock, memory_order_acquire))
        sched_yield();
}

static void ctx_unlock(answer_ctx *c)
{
    atomic_flag_clear_explicit(&c->lock, memory_order_release);
}

/*
 * Room under max_queued for one more request submitted from c's callbacks: a unit of c's
 * credit, or a block of TS__PENDING_BLOCK units added to b->pending at once (so that submits
 * share no counter per request; units are given back as the requests are queued or cancelled,
 * and the unused ones stay reserved for the next batch). 1, or 0 when the queue is too near its
 * bound for a block (the submit then takes the lock and counts exactly).
 */
static int ctx_reserve(ts_batcher_t *b, answer_ctx *c)
{
    if (c->credit > 0)
        return 1;
    size_t waiting =
        atomic_fetch_add_explicit(&b->pending, TS__PENDING_BLOCK, memory_order_relaxed);
    if (waiting + TS__PENDING_BLOCK + atomic_load_explicit(&b->queued_hint, memory_order_relaxed) >
        b->max_queued) {
        atomic_fetch_sub_explicit(&b->pending, TS__PENDING_BLOCK, memory_order_relaxed);
        return 0;
    }
    c->credit = TS__PENDING_BLOCK;
    return 1;
}

/* 0 or TS_ENOMEM. */
static int answer_ctx_init(answer_ctx *c, ts_batcher_t *b)
{
    memset(c, 0, sizeof(*c));
    c->b = b;
    int64_t keep = b->max_batch * TS__REQ_CACHE_BATCHES;
    c->max_free = keep < TS__REQ_CACHE_MAX ? (size_t)keep : TS__REQ_CACHE_MAX;
    atomic_flag_clear(&c->lock);
    return 0;
}

/* Free what a context keeps; its list of submitted requests is empty (every thread is gone). */
static void answer_ctx_destroy(answer_ctx *c)
{
    while (c->free_list != NULL) {
        batch_request *r = c->free_list;
        c->free_list = r->next;
        ts__free(r);
    }
}

static int is_preferred(const ts_batcher_t *b, int64_t rows);

/*
 * Queue the requests that c's callbacks submitted, in their order, as the submit itself would
 * have: the deadline heap, the counters, and the wake-ups (the gathering replica when the batch
 * can no longer grow or no more rows are expected; the timer for an earlier deadline; no idle
 * replica, since the replica of this batch comes back to the queue right after, except with
 * overlap_answers, where the helper that calls this wakes one itself). Lock held.
 */
static void answer_ctx_flush(ts_batcher_t *b, answer_ctx *c)
{
    ctx_lock(c);
    batch_request *r = c->head;
    size_t n = c->n;
    c->head = c->tail = NULL;
    c->n = 0;
    ctx_unlock(c);
    if (n == 0)
        return;
    /* One growth of the heap for all of them; should it fail, they wait without a deadline. */
    int heap_ok = 1;
    if (b->heap_len + n > b->heap_cap) {
        size_t cap = b->heap_cap ? b->heap_cap : 64;
        while (cap < b->heap_len + n)
            cap *= 2;
        batch_request **h = ts__realloc(b->heap, cap * sizeof(*h));
        if (h != NULL) {
            b->heap = h;
            b->heap_cap = cap;
        } else {
            heap_ok = 0;
        }
    }
    uint64_t earliest = UINT64_MAX, now = ts__now_ns();
    int expired = 0;
    while (r != NULL) {
        batch_request *next = r->next;
        r->heap_idx = SIZE_MAX;
        if (r->deadline_ns != 0 && r->deadline_ns <= now) {
            /*
             * Its deadline passed while it waited here (the callbacks after it were slow): the
             * timer thread answers it, as it would have at its deadline had it been queued. The
             * replica must not take it into its next batch first.
             */
            r->prev = NULL;
            r->next = b->cancelled;
            r->fail = TS_ETIMEDOUT;
            b->cancelled = r;
            b->st.failed++;
            b->st.timed_out++;
            expired = 1;
            r = next;
            continue;
        }
        if (r->deadline_ns != 0 && heap_ok) {
            r->heap_idx = b->heap_len;
            b->heap[b->heap_len++] = r;
            heap_up(b, r->heap_idx);
            earliest = r->deadline_ns < earliest ? r->deadline_ns : earliest;
        }
        enqueue(b, r);
        r = next;
    }
    atomic_fetch_sub_explicit(&b->pending, n, memory_order_relaxed);
    b->st.submitted += n;
    b->returning = b->returning > n ? b->returning - n : 0;
    if (earliest < b->timer_at || expired) {
        b->timer_at = earliest < b->timer_at ? earliest : b->timer_at;
        pthread_cond_signal(&b->timer_cv);
    }
    if (b->collecting && (b->queued_rows >= b->max_batch || b->returning == 0 ||
                          (b->n_preferred > 0 && is_preferred(b, b->queued_rows))))
        pthread_cond_signal(&b->collect_cv);
}

/*
 * Answer a request that no thread references any more (called without the lock). A failure's
 * message goes to ts_last_error() on this thread, where the callback reads it.
 */
static void answer(ts_batcher_t *b, batch_request *r, int status, ts_value_t *output,
                   int64_t version, const char *msg)
{
    if (status != 0)
        ts_set_last_error(msg != NULL && msg[0] != '\0' ? msg : ts_strerror(status));
    r->cb(b, status, output, version, r->arg);
    req_free(b, r);
}

/* 1 when rc is one of the negative TS_E* codes (what a model or factory must return). */
static int is_ts_error(int rc)
{
    return rc < 0 && strcmp(ts_err_name(rc), "UNKNOWN") != 0;
}

/* ---------------------------------------------------------------------------------------------
 * Weight updates
 */

/*
 * Decide whether an update can be released (no replica reads it and none will). Returns 1 when
 * the caller must call release_weights after unlocking. Lock held.
 */
static int weights_settle(ts_batcher_t *b, weight_update *w)
{
    if (w->done == b->n_rep && w->waiter != NULL && !w->waiter->finished) {
        w->waiter->finished = 1;
        w->waiter->err = w->first_err;
        memcpy(w->waiter->msg, w->err, sizeof(w->err));
        pthread_cond_broadcast(&w->waiter->cv);
    }
    if (w->released || w->users > 0)
        return 0;
    if (w->done < b->n_rep && !w->superseded && !w->withdrawn && !b->stopping)
        return 0;
    w->released = 1;
    if (w->waiter != NULL) {
        w->waiter->finished = 1;
        if (w->done == b->n_rep)
            w->waiter->err = w->first_err;
        w->waiter->released = 1;
        pthread_cond_broadcast(&w->waiter->cv);
        w->waiter = NULL;
    }
    return 1;
}

/*
 * Call the release callback, and free the update unless it is still the latest. No lock.
 * A publish may replace w while the callback runs: it frees w only once rel_done is set, and
 * rel_done is set under the lock together with the check here, so exactly one of the two
 * frees it.
 */
static void release_weights(ts_batcher_t *b, weight_update *w)
{
    if (w->release != NULL)
        w->release(w->params, w->release_arg);
    pthread_mutex_lock(&b->mu);
    w->rel_done = 1;
    int keep = b->wt == w;
    pthread_mutex_unlock(&b->mu);
    if (!keep)
        ts__free(w);
}

/* Load the latest update into a replica if it has not seen it. Lock held (dropped meanwhile). */
static void replica_update(replica *r)
{
    ts_batcher_t *b = r->b;
    weight_update *w = b->wt;
    if (w == NULL || w->gen <= r->gen)
        return;
    r->gen = w->gen;
    /*
     * Released already: its parameters are back with the caller. The latest update is released
     * before every replica has it only when the batcher is stopping (the replicas loading it
     * then finished and nobody else was loading it); a replica coming after must skip it.
     */
    if (w->withdrawn || w->released)
        return;
    w->users++;
    pthread_mutex_unlock(&b->mu);
    /* A model reports why it failed in ts_last_error(); an empty one means it did not say. */
    ts_set_last_error(NULL);
    int rc = TS_ENOTSUP;
    if (r->model->ops->load_weights != NULL)
        rc = r->model->ops->load_weights(r->model, w->params);
    else
        ts_set_last_error("the model has no load_weights (it takes no weights)");
    const char *err = ts_last_error();
    char odd[TS__BERR_LEN];
    if (rc != 0 && !is_ts_error(rc)) {
        snprintf(odd, sizeof(odd), "load_weights returned %d, not a TS_E* code%s%.180s%s", rc,
                 err[0] ? " (" : "", err, err[0] ? ")" : "");
        err = odd;
        rc = TS_EMODEL;
    }
    pthread_mutex_lock(&b->mu);
    w->users--;
    w->done++;
    if (rc == 0) {
        r->version = w->version;
        b->st.weight_loads++;
    } else if (w->first_err == 0) {
        w->first_err = rc;
        snprintf(w->err, sizeof(w->err), "replica %d (%s): %.200s", r->index, r->device,
                 err[0] ? err : ts_strerror(rc));
    }
    if (weights_settle(b, w)) {
        pthread_mutex_unlock(&b->mu);
        release_weights(b, w);
        pthread_mutex_lock(&b->mu);
    }
}

/* Publish an update (with an optional blocking waiter attached). 0, TS_ENOMEM, TS_ECANCELED. */
static int publish(ts_batcher_t *b, const ts_value_t *params, int64_t version,
                   ts_weights_release_cb release, void *arg, weight_waiter *waiter)
{
    weight_update *w = ts__calloc(1, sizeof(*w));
    if (w == NULL)
        return TS_ENOMEM;
    w->params = params;
    w->version = version;
    w->release = release;
    w->release_arg = arg;
    w->waiter = waiter;
    pthread_mutex_lock(&b->mu);
    if (b->stopping) {
        pthread_mutex_unlock(&b->mu);
        ts__free(w);
        ts__batcher_set_err("the batcher is shutting down");
        return TS_ECANCELED;
    }
    if (waiter != NULL)
        waiter->w = w;
    w->gen = ++b->wt_gen;
    weight_update *old = b->wt;
    b->wt = w;
    int rel_old = 0, free_old = 0;
    if (old != NULL) {
        old->superseded = 1;
        /* Released and its callback over: nobody else touches it. Released with the callback
           still running: release_weights frees it, seeing it is no longer the latest. */
        free_old = old->released && old->rel_done;
        rel_old = weights_settle(b, old);
    }
    pthread_cond_broadcast(&b->work_cv);
    pthread_mutex_unlock(&b->mu);
    if (rel_old)
        release_weights(b, old);
    else if (free_old)
        ts__free(old);
    return 0;
}

int ts_batcher_load_weights_async(ts_batcher_t *b, const ts_value_t *params, int64_t version,
                                  ts_weights_release_cb release, void *arg)
{
    if (b == NULL || params == NULL)
        return ts__fail(TS_EINVAL, "a weight update needs a batcher and parameters");
    int rc = publish(b, params, version, release, arg, NULL);
    if (rc != 0)
        ts__batcher_set_err("%s",
                            rc == TS_ECANCELED ? "the batcher is shutting down" : ts_strerror(rc));
    return rc;
}

int ts_batcher_load_weights(ts_batcher_t *b, const ts_value_t *params, int64_t version,
                            int timeout_ms)
{
    if (b == NULL || params == NULL)
        return ts__fail(TS_EINVAL, "a weight update needs a batcher and parameters");
    if (timeout_ms == TS_TIMEOUT_DEFAULT)
        timeout_ms = b->timeout_ms;
    if (timeout_ms == 0 || (timeout_ms < 0 && timeout_ms != TS_TIMEOUT_INFINITE))
        return ts__fail(TS_EINVAL,
                        "timeout_ms %d: loading weights needs a positive timeout, "
                        "TS_TIMEOUT_DEFAULT or TS_TIMEOUT_INFINITE",
                        timeout_ms);
    if (tls_in_batcher) {
        ts__batcher_set_err("ts_batcher_load_weights called from a batcher callback");
        return TS_EDEADLK;
    }
    weight_waiter wt;
    memset(&wt, 0, sizeof(wt));
    if (ts__cond_init_monotonic(&wt.cv) != 0)
        return ts__fail(TS_ENOMEM, NULL);
    int rc = publish(b, params, version, NULL, NULL, &wt);
    if (rc != 0) {
        pthread_cond_destroy(&wt.cv);
        ts__batcher_set_err("%s",
                            rc == TS_ECANCELED ? "the batcher is shutting down" : ts_strerror(rc));
        return rc;
    }
    uint64_t deadline = timeout_ms > 0 ? ts__now_ns() + (uint64_t)timeout_ms * 1000000u : 0;
    pthread_mutex_lock(&b->mu);
    int timed_out = 0;
    while (!wt.finished) {
        if (deadline == 0) {
            pthread_cond_wait(&wt.cv, &b->mu);
        } else {
            struct timespec ts = ts__abs_timespec(deadline);
            if (pthread_cond_timedwait(&wt.cv, &b->mu, &ts) == ETIMEDOUT && !wt.finished) {
                timed_out = 1;
                break;
            }
        }
    }
    if (timed_out && !wt.released) {
        /* Withdraw: replicas that have not started loading it skip it from now on. */
        weight_update *w = wt.w;
        w->withdrawn = 1;
        if (weights_settle(b, w)) {
            pthread_mutex_unlock(&b->mu);
            release_weights(b, w);
            pthread_mutex_lock(&b->mu);
        }
    }
    /* params is borrowed for this call only: wait until no replica reads it. */
    while (!wt.released)
        pthread_cond_wait(&wt.cv, &b->mu);
    pthread_mutex_unlock(&b->mu);
    pthread_cond_destroy(&wt.cv);
    if (timed_out) {
        ts__batcher_set_err("weight update not loaded by every replica within %d ms", timeout_ms);
        return TS_ETIMEDOUT;
    }
    if (wt.err != 0)
        ts__batcher_set_err("%s", wt.msg);
    return wt.err;
}

void ts_batcher_versions(ts_batcher_t *b, int64_t *min_version, int64_t *max_version)
{
    pthread_mutex_lock(&b->mu);
    int64_t lo = b->rep[0].version, hi = lo;
    for (int i = 1; i < b->n_rep; i++) {
        if (b->rep[i].version < lo)
            lo = b->rep[i].version;
        if (b->rep[i].version > hi)
            hi = b->rep[i].version;
    }
    pthread_mutex_unlock(&b->mu);
    if (min_version != NULL)
        *min_version = lo;
    if (max_version != NULL)
        *max_version = hi;
}

/* ---------------------------------------------------------------------------------------------
 * Outputs: each requester gets views of its rows of the batch output, sharing it.
 */
/*
 * A batch output's reference count. When helpers answer parts of a batch, each part's views
 * count on a counter of their own (parent: the batch's), so that the callbacks of different
 * threads, which take and drop those references, do not contend for one cache line; the
 * padding keeps two counters off one line.
 */
typedef struct shared_output {
    char pad0[64];
    atomic_int refs;
    struct shared_output *parent; /* holds one reference on it, or NULL */
    ts_value_t *tree;             /* the output (batch counter only) */
    struct output_box *box;       /* batch counter only: where it goes when released */
    struct shared_output *next;   /* in its box */
    char pad1[64];
} shared_output;

/*
 * Where a replica's batch outputs go when their last answer is released, to be freed on the
 * replica's own thread when it starts its next batch. The last answer of a batch is usually
 * released on another thread (a requester's, a helper's, a client's I/O thread); freed there,
 * the output's memory went to that thread's allocator cache, and the model's next forward on
 * the replica took fresh memory instead of memory still in its core's cache: with
 * overlap_answers, a small MLP's 64-row forwards took 10-30 % longer than back to back.
 * A stack pushed by any thread and taken whole by the replica. The box outlives its batcher
 * while outputs are still held (answers kept after ts_batcher_free): each unreleased output
 * holds a reference, the replica one; whoever drops the last frees what is left. Once the
 * batcher has closed it, outputs are freed where they are released.
 */
typedef struct output_box {
    _Atomic(shared_output *) head;
    atomic_int refs;
    atomic_int closed; /* the batcher is gone: outputs are freed where they are released */
} output_box;

static void output_free(shared_output *s)
{
    ts_value_free(s->tree);
    ts__free(s);
}

/* Free every output in the box (on the replica's thread, or by its last holder). */
static void box_drain(output_box *x)
{
    shared_output *s = atomic_exchange_explicit(&x->head, NULL, memory_order_acquire);
    while (s != NULL) {
        shared_output *next = s->next;
        output_free(s);
        s = next;
    }
}

static void box_unref(output_box *x)
{
    if (atomic_fetch_sub_explicit(&x->refs, 1, memory_order_acq_rel) == 1) {
        box_drain(x);
        ts__free(x);
    }
}

static void shared_unref(void *p)
{
    shared_output *s = p;
    if (atomic_fetch_sub(&s->refs, 1) == 1) {
        if (s->parent != NULL)
            shared_unref(s->parent);
        output_box *x = s->box;
        if (x == NULL) {
            output_free(s);
            return;
        }
        if (atomic_load_explicit(&x->closed, memory_order_relaxed)) {
            /* (One pushed while the batcher closes it is freed with the box, by its last user.) */
            output_free(s);
            box_unref(x);
            return;
        }
        shared_output *head = atomic_load_explicit(&x->head, memory_order_relaxed);
        do
            s->next = head;
        while (!atomic_compare_exchange_weak_explicit(&x->head, &head, s, memory_order_release,
                                                      memory_order_relaxed));
        box_unref(x);
    }
}

/* A counter for one part of a batch's answers, holding a reference on s; s itself on ENOMEM. */
static shared_output *shared_part(shared_output *s)
{
    shared_output *p = ts__malloc(sizeof(*p));
    if (p == NULL)
        return s;
    atomic_init(&p->refs, 1);
    p->parent = s;
    p->tree = NULL;
    p->box = NULL;
    atomic_fetch_add(&s->refs, 1);
    return p;
}

/* Rows [off, off+rows) of v as a new tree of views holding a reference on s. NULL on ENOMEM. */
static ts_value_t *slice(const ts_value_t *v, int64_t off, int64_t rows, shared_output *s)
{
    switch (ts_value_type(v)) {
    case TS_TYPE_MAP:
    case TS_TYPE_LIST: {
        int map = ts_value_type(v) == TS_TYPE_MAP;
        ts_value_t *c = map ? ts_map_new() : ts_list_new();
        if (c == NULL)
            return NULL;
        for (size_t i = 0; i < ts_value_len(v); i++) {
            ts_value_t *child = slice(map ? ts_map_value_at(v, i) : ts_list_at(v, i), off, rows, s);
            int rc = map ? ts_map_set(c, ts_map_key_at(v, i), child) : ts_list_push(c, child);
            if (rc != 0) {
                ts_value_free(c);
                return NULL;
            }
        }
        return c;
    }
    case TS_TYPE_TENSOR: {
        const ts_tensor_t *t = ts_value_tensor(v);
        int64_t shape[TS_MAX_NDIM];
        memcpy(shape, t->shape, sizeof(shape));
        shape[0] = rows;
        size_t row_bytes = t->shape[0] > 0 ? ts_tensor_nbytes(t) / (size_t)t->shape[0] : 0;
        const uint8_t *data = t->data;
        if (data != NULL && row_bytes > 0)
            data += (size_t)off * row_bytes;
        else
            data = NULL;
        /* The reference is taken first: the view's release drops it, also on failure below. */
        atomic_fetch_add(&s->refs, 1);
        ts_value_t *c = ts_tensor_new_external(t->dtype, t->ndim, shape, data, shared_unref, s);
        if (c == NULL)
            shared_unref(s);
        return c;
    }
    default:
        return ts_value_clone(v);
    }
}

/* Answer n requests with their rows of out, the first starting at row off. No lock held. */
static void answer_rows(ts_batcher_t *b, batch_request **reqs, int n, int64_t off,
                        const ts_value_t *out, shared_output *s, int64_t version)
{
    for (int i = 0; i < n; i++) {
        batch_request *q = reqs[i];
        ts_value_t *mine = slice(out, off, q->rows, s);
        off += q->rows;
        if (mine == NULL)
            answer(b, q, TS_ENOMEM, NULL, version, "out of memory");
        else
            answer(b, q, 0, mine, version, NULL);
    }
}

/* The parts of one batch still being answered by helpers; the replica waits for 0. */
typedef struct answer_join {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int left;
} answer_join;

/*
 * Take the helpers' next part, or NULL when stopping with none left. ans_mu held; looks for a
 * part without it for up to TS__ANSWER_SPIN_NS, then waits.
 */
static answer_part *next_part(ts_batcher_t *b)
{
    if (b->ans_head == NULL && !b->ans_stop) {
        unsigned seen = atomic_load_explicit(&b->ans_posted, memory_order_relaxed);
        pthread_mutex_unlock(&b->ans_mu);
        uint64_t until = ts__now_ns() + TS__ANSWER_SPIN_NS;
        while (atomic_load_explicit(&b->ans_posted, memory_order_relaxed) == seen &&
               !atomic_load_explicit(&b->stop_flag, memory_order_relaxed) && ts__now_ns() < until)
            sched_yield();
        pthread_mutex_lock(&b->ans_mu);
    }
    while (b->ans_head == NULL && !b->ans_stop)
        pthread_cond_wait(&b->ans_cv, &b->ans_mu);
    answer_part *p = b->ans_head;
    if (p != NULL && (b->ans_head = p->next) == NULL)
        b->ans_tail = NULL;
    return p;
}

/*
 * An answer helper (opts.answer_threads): answers parts of batches that replicas post. Like a
 * replica's thread, a request submitted from a callback here wakes no replica while the
 * replica waits for the parts (answer_split): it takes the queue again once every part is
 * answered. With overlap_answers the replica does not wait: once a part's callbacks are over,
 * their requests are queued and an idle replica is woken for them, and the part's slot is
 * given back to its replica when its last part is answered.
 */
static void *answerer_main(void *arg)
{
    answer_ctx *c = arg;
    ts_batcher_t *b = c->b;
    tls_in_batcher = 1;
    tls_ctx = c;
    name_thread("answer", (int)(c - b->answerer_ctx));
    pthread_mutex_lock(&b->ans_mu);
    answer_part *p;
    while ((p = next_part(b)) != NULL) {
        pthread_mutex_unlock(&b->ans_mu);
        c->now_ns = ts__now_ns();
        c->active = 1;
        /* Blocking requesters of this part are woken together once its callbacks are over. */
        handoff_chain chain;
        ts__handoff_chain_begin(&chain);
        shared_output *mine = shared_part(p->shared);
        answer_rows(b, p->reqs, p->n, p->off, p->out, mine, p->version);
        if (mine != p->shared)
            shared_unref(mine);
        c->active = 0;
        ts__handoff_chain_end(&chain);
        uint64_t took = ts__now_ns() - c->now_ns;
        /* Queued before the replica resumes: it takes the queue once every part is over. */
        pthread_mutex_lock(&b->mu);
        answer_ctx_flush(b, c);
        if (p->join == NULL) {
            p->rep->st.output_ns += took;
            if (b->head != NULL && !b->collecting)
                pthread_cond_signal(&b->work_cv);
        }
        pthread_mutex_unlock(&b->mu);
        if (p->join == NULL) {
            /* The last reference to the batch output may be the part's. */
            shared_unref(p->shared);
            atomic_fetch_sub_explicit(&b->ans_open, 1, memory_order_relaxed);
            pthread_mutex_lock(&b->ans_mu);
            if (--p->slot->left == 0)
                pthread_cond_broadcast(&b->slot_cv);
            continue;
        }
        answer_join *j = p->join;
        pthread_mutex_lock(&j->mu);
        if (--j->left == 0)
            pthread_cond_signal(&j->cv);
        pthread_mutex_unlock(&j->mu);
        pthread_mutex_lock(&b->ans_mu);
    }
    pthread_mutex_unlock(&b->ans_mu);
    return NULL;
}

/*
 * Cut a batch's n requests (reqs) into parts parts of as equal a count as can be, in order:
 * each is like tmpl, with its own requests and its first row in the batch output.
 */
static void cut_parts(answer_part *part, int parts, batch_request **reqs, int n, answer_part tmpl)
{
    int first = 0;
    int64_t off = 0;
    for (int k = 0; k < parts; k++) {
        int count = n / parts + (k < n % parts);
        part[k] = tmpl;
        part[k].reqs = reqs + first;
        part[k].n = count;
        part[k].off = off;
        for (int i = first; i < first + count; i++)
            off += reqs[i]->rows;
        first += count;
    }
}

/*
 * overlap_answers: hand a batch's n requests (r->picked, its slot's array) to the helpers in
 * parts of at least TS_BATCHER_SPLIT_ANSWERS requests, one per helper at most, and return at
 * once; then make the next slot the one to gather into, waiting until its answers are out. Each
 * part holds a reference on s. No lock held.
 */
static void answer_overlap(ts_batcher_t *b, replica *r, int n, const ts_value_t *out,
                           shared_output *s, int64_t version)
{
    answer_slot *slot = &r->slots[r->slot_next];
    int parts = n / TS_BATCHER_SPLIT_ANSWERS;
    parts = parts < 1 ? 1 : parts > b->n_answerers ? b->n_answerers : parts;
    cut_parts(slot->parts, parts, slot->reqs, n,
              (answer_part){NULL, NULL, 0, 0, out, s, version, NULL, r, slot});
    atomic_fetch_add(&s->refs, parts);
    atomic_fetch_add_explicit(&b->ans_open, parts, memory_order_relaxed);
    pthread_mutex_lock(&b->ans_mu);
    atomic_fetch_add_explicit(&b->ans_posted, (unsigned)parts, memory_order_relaxed);
    slot->left = parts;
    for (int k = 0; k < parts; k++) {
        if (b->ans_tail != NULL)
            b->ans_tail->next = &slot->parts[k];
        else
            b->ans_head = &slot->parts[k];
        b->ans_tail = &slot->parts[k];
    }
    if (parts == 1)
        pthread_cond_signal(&b->ans_cv);
    else
        pthread_cond_broadcast(&b->ans_cv);
    r->slot_next = (r->slot_next + 1) % TS__ANSWER_SLOTS;
    while (r->slots[r->slot_next].left > 0)
        pthread_cond_wait(&b->slot_cv, &b->ans_mu);
    pthread_mutex_unlock(&b->ans_mu);
    r->picked = r->slots[r->slot_next].reqs;
}

/*
 * Answer a batch's n requests from out, in parts: the replica answers the first part, the
 * helpers the others, all at once, and the replica returns when every part is answered (its
 * picked array is reused by its next batch). Parts hold at least TS_BATCHER_SPLIT_ANSWERS
 * requests. No lock held.
 */
static void answer_split(ts_batcher_t *b, replica *r, int n, const ts_value_t *out,
                         shared_output *s, int64_t version)
{
    int parts = n / TS_BATCHER_SPLIT_ANSWERS;
    if (parts > b->n_answerers + 1)
        parts = b->n_answerers + 1;
    if (parts < 2) {
        answer_rows(b, r->picked, n, 0, out, s, version);
        return;
    }
    answer_part part[TS_BATCHER_MAX_ANSWER_THREADS + 1];
    answer_join j;
    pthread_mutex_init(&j.mu, NULL);
    pthread_cond_init(&j.cv, NULL);
    j.left = parts - 1;
    cut_parts(part, parts, r->picked, n,
              (answer_part){NULL, NULL, 0, 0, out, s, version, &j, NULL, NULL});
    pthread_mutex_lock(&b->ans_mu);
    atomic_fetch_add_explicit(&b->ans_posted, (unsigned)(parts - 1), memory_order_relaxed);
    for (int k = parts - 1; k >= 1; k--) {
        part[k].next = b->ans_head;
        if (b->ans_head == NULL)
            b->ans_tail = &part[k];
        b->ans_head = &part[k];
    }
    pthread_cond_broadcast(&b->ans_cv);
    pthread_mutex_unlock(&b->ans_mu);
    shared_output *mine = shared_part(s);
    answer_rows(b, part[0].reqs, part[0].n, part[0].off, out, mine, version);
    if (mine != s)
        shared_unref(mine);
    pthread_mutex_lock(&j.mu);
    while (j.left > 0)
        pthread_cond_wait(&j.cv, &j.mu);
    pthread_mutex_unlock(&j.mu);
    pthread_cond_destroy(&j.cv);
    pthread_mutex_destroy(&j.mu);
}

/* ---------------------------------------------------------------------------------------------
 * Replicas
 */

/* What the queue's head and the requests after it, in order, bring to a batch (fit_rows). */
typedef struct batch_fit {
    int64_t rows;      /* rows of the requests that fit in max_batch */
    int blocked;       /* the next request does not fit: the batch cannot grow */
    int64_t preferred; /* the most of those rows that end on a preferred size, or 0 */
    uint64_t oldest;   /* the earliest arrival among those requests */
} batch_fit;

static int is_preferred(const ts_batcher_t *b, int64_t rows)
{
    for (int i = 0; i < b->n_preferred; i++)
        if (b->preferred[i] == rows)
            return 1;
    return 0;
}

/* Walk the queue's head and the requests after it, in order, while they fit. Lock held. */
static batch_fit fit_rows(const ts_batcher_t *b)
{
    batch_fit f = {0, 0, 0, UINT64_MAX};
    for (const batch_request *r = b->head; r != NULL; r = r->next) {
        if (f.rows + r->rows > b->max_batch) {
            f.blocked = 1;
            break;
        }
        f.rows += r->rows;
        if (r->arrival_ns < f.oldest)
            f.oldest = r->arrival_ns;
        if (b->n_preferred > 0 && is_preferred(b, f.rows))
            f.preferred = f.rows;
    }
    return f;
}

/*
 * Gather one batch into r->picked following the batching rule. Returns the number of requests
 * picked (0 when stopping or the queue emptied). Lock held; may wait on collect_cv.
 *
 * A partial batch waits only while it can still grow and more rows can be expected soon, that is
 * while some requester answered by a batch has not submitted again yet (b->returning > 0): a
 * requester waiting for its answer, or one that went away, cannot add rows, and a closed loop
 * of requesters comes back as soon as its answers are out. When every requester the batcher
 * knows of is already waiting (queued or in a batch), or after a lone request to an idle
 * batcher, the batch runs at once. Nor does it wait for them longer than a forward takes
 * (b->forward_ns, from when this replica started gathering): requesters that come back later
 * lose less by running in the next batch than the batch would lose by waiting (remote
 * requesters, a tensord round trip away, come back much later than a small forward takes, and
 * this is what keeps batching from slowing them down). Nor does it hold at all while holds have
 * lately gained fewer rows than were waiting in the batch (b->hold_gain16): the hold costs every
 * waiting request its length, a rows that joins saves about as much, and a timed sleep meant to
 * last a forward of a few microseconds lasts tens on a busy machine (measured with eight remote
 * blocking requesters: batched 0.81-0.89x of one forward per request with every hold, 0.92-1.10x
 * with this rule). One batch in TS__HOLD_PROBE holds anyway, to see whether holding pays again.
 * It still waits min_delay_ns after its oldest request, never past max_delay_ns; a batch that
 * waited out max_delay_ns shows that the missing requesters are not coming back soon, and the
 * count starts again from zero.
 */
static int gather(replica *r)
{
    ts_batcher_t *b = r->b;
    int64_t take;
    uint64_t began = ts__now_ns();
    int may_hold = b->hold_gain16 >= 16;
    if (!may_hold && ++b->hold_skips >= TS__HOLD_PROBE) {
        may_hold = 1;
        b->hold_skips = 0;
    }
    int64_t held_from = -1; /* the batch's rows when a hold began; -1: no hold */
    for (;;) {
        if (b->stopping || b->head == NULL)
            return 0;
        if (b->queued_rows >= b->max_batch && b->n_preferred == 0) {
            /* A full batch, or one that cannot grow: no need to walk the queue twice. */
            take = b->max_batch;
            break;
        }
        batch_fit f = fit_rows(b);
        take = f.rows;
        if (f.blocked || f.rows >= b->max_batch)
            break;
        if (f.preferred > 0) {
            take = f.preferred;
            break;
        }
        uint64_t now = ts__now_ns();
        uint64_t flush_at = f.oldest + b->max_delay_ns;
        if (now >= flush_at) {
            b->returning = 0;
            break;
        }
        uint64_t min_at = f.oldest + b->min_delay_ns;
        if (b->returning == 0 || !may_hold) {
            if (now >= min_at)
                break;
            flush_at = min_at < flush_at ? min_at : flush_at;
        } else {
            uint64_t hold_at = began + b->forward_ns;
            hold_at = hold_at > min_at ? hold_at : min_at;
            if (now >= hold_at)
                break;
            flush_at = hold_at < flush_at ? hold_at : flush_at;
            if (held_from < 0)
                held_from = f.rows;
        }
        struct timespec ts = ts__abs_timespec(flush_at);
        pthread_cond_timedwait(&b->collect_cv, &b->mu, &ts);
    }
    int n = 0;
    int64_t rows = 0;
    uint64_t now = ts__now_ns();
    while (b->head != NULL && rows + b->head->rows <= take) {
        batch_request *q = b->head;
        rows += q->rows;
        r->st.queue_ns += now - q->arrival_ns;
        unlink_queued(b, q);
        r->picked[n++] = q;
    }
    heap_remove_many(b, r->picked, n);
    if (held_from >= 0) {
        /* Rows gained per row that waited (held_from >= 1: a hold needs a queued request). */
        uint64_t gained = rows > held_from ? (uint64_t)(rows - held_from) : 0;
        uint64_t per16 = gained * 16u / (uint64_t)(held_from > 0 ? held_from : 1);
        per16 = per16 < TS__HOLD_GAIN_CAP16 ? per16 : TS__HOLD_GAIN_CAP16;
        b->hold_gain16 = (uint32_t)((b->hold_gain16 * 7u + per16) / 8u);
    }
    return n;
}

/* Histogram bucket of a batch of rows rows: 0 for 1, k for 2^(k-1)+1 .. 2^k. */
static int size_bucket(int64_t rows)
{
    int k = rows <= 1 ? 0 : 64 - __builtin_clzll((unsigned long long)(rows - 1));
    return k < TS_BATCHER_HIST_BUCKETS ? k : TS_BATCHER_HIST_BUCKETS - 1;
}

/*
 * Run one batch and answer its requests. Returns the time spent answering (slicing the output and
 * the callbacks), in ns. No lock held.
 */
static uint64_t run_batch(replica *r, int n, int64_t version)
{
    ts_batcher_t *b = r->b;
    char msg[TS__BERR_LEN] = "";
    int64_t rows = 0;
    for (int i = 0; i < n; i++)
        rows += r->picked[i]->rows;
    /* Outputs released since the last batch: their memory is this thread's to reuse. */
    if (atomic_load_explicit(&r->outbox->head, memory_order_relaxed) != NULL)
        box_drain(r->outbox);
    uint64_t t0 = ts__now_ns();
    const ts_value_t *input;
    if (n == 1) {
        /* A lone request is its own batch: no copy. */
        input = r->picked[0]->input;
    } else {
        int64_t off = 0;
        for (int i = 0; i < n; i++) {
            const batch_request *q = r->picked[i];
            for (int f = 0; f < b->n_in; f++) {
                size_t rb = b->in[f].row_bytes;
                if (rb > 0)
                    memcpy((uint8_t *)ts_value_tensor(r->batch_leaf[f])->data + (size_t)off * rb,
                           q->leaf[f]->data, (size_t)q->rows * rb);
            }
            off += q->rows;
        }
        /* The batch tensors were made for max_batch rows and rows <= max_batch: this holds. */
        for (int f = 0; f < b->n_in; f++)
            ts_value_tensor_set_rows(r->batch_leaf[f], rows);
        input = r->batch;
    }
    uint64_t t1 = ts__now_ns();
    ts_value_t *out = NULL;
    ts_set_last_error(NULL);
    int rc = r->model->ops->forward(r->model, input, rows, &out);
    const char *err = ts_last_error();
    if (rc != 0) {
        snprintf(msg, sizeof(msg), "model failed on %s: %.200s", r->device,
                 err[0] ? err : ts_strerror(rc));
        ts_value_free(out);
        out = NULL;
        rc = TS_EMODEL;
    } else if (out == NULL) {
        snprintf(msg, sizeof(msg), "model on %s returned no output", r->device);
        rc = TS_EMODEL;
    } else {
        char why[TS__BERR_LEN - 64];
        if (ts__output_check(b->out, b->n_out, out, rows, why, sizeof(why)) != 0) {
            snprintf(msg, sizeof(msg), "model output does not match the schema: %s", why);
            ts_value_free(out);
            out = NULL;
            rc = TS_EMODEL;
        }
    }
    uint64_t t2 = ts__now_ns();
    /* From here on this thread calls callbacks: what they submit waits in r->ctx. */
    r->ctx.now_ns = t2;
    r->ctx.active = 1;
    pthread_mutex_lock(&b->mu);
    b->st.batches++;
    b->st.rows += (uint64_t)rows;
    if (rows == b->max_batch)
        b->st.full_batches++;
    if (rc == 0)
        b->st.requests += (uint64_t)n;
    else
        b->st.failed += (uint64_t)n;
    b->returning += (size_t)n;
    /* A moving average over about eight forwards, of any replica. */
    uint64_t took = t2 - t1;
    b->forward_ns = b->forward_ns == 0 ? took : (b->forward_ns * 7 + took) / 8;
    r->st.batches++;
    r->st.rows += (uint64_t)rows;
    r->st.requests += (uint64_t)n;
    r->st.input_ns += t1 - t0;
    r->st.compute_ns += t2 - t1;
    r->st.batch_sizes[size_bucket(rows)]++;
    pthread_mutex_unlock(&b->mu);

    if (rc != 0) {
        for (int i = 0; i < n; i++)
            answer(b, r->picked[i], rc, NULL, version, msg);
        return ts__now_ns() - t2;
    }
    if (n == 1 && !b->overlap) {
        answer(b, r->picked[0], 0, out, version, NULL);
        return ts__now_ns() - t2;
    }
    shared_output *s = ts__malloc(sizeof(*s));
    if (s == NULL) {
        ts_value_free(out);
        for (int i = 0; i < n; i++)
            answer(b, r->picked[i], TS_ENOMEM, NULL, version, "out of memory");
        return ts__now_ns() - t2;
    }
    atomic_init(&s->refs, 1);
    s->parent = NULL;
    s->tree = out;
    s->box = r->outbox;
    atomic_fetch_add_explicit(&r->outbox->refs, 1, memory_order_relaxed);
    if (b->overlap) {
        /* The helpers answer it and count their time; this thread goes on to the next batch. */
        answer_overlap(b, r, n, out, s, version);
        shared_unref(s);
        return 0;
    }
    answer_split(b, r, n, out, s, version);
    shared_unref(s);
    return ts__now_ns() - t2;
}

static void *replica_main(void *arg)
{
    replica *r = arg;
    ts_batcher_t *b = r->b;
    tls_in_batcher = 1;
    tls_ctx = &r->ctx;
    name_thread("replica", r->index);
#ifdef __linux__
    /*
     * A hold is a timed wait of about a forward (gather), tens of microseconds. Linux lets a
     * thread's timed sleeps end up to its timer slack late, 50 us by default, so holds lasted two
     * to four times what the rule says; with remote blocking requesters the extra wait made
     * batched answers slower than one forward per request. 1 ns: wake up on time.
     */
    (void)prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
#endif
    pthread_mutex_lock(&b->mu);
    int looked = 0; /* looked for requests since the last wait or batch (overlap_answers) */
    for (;;) {
        replica_update(r);
        if (b->stopping)
            break;
        if (b->wt != NULL && b->wt->gen > r->gen)
            continue; /* a newer update came while loading */
        if (b->head == NULL && !b->collecting && b->overlap && !looked &&
            atomic_load_explicit(&b->ans_open, memory_order_relaxed) > 0) {
            /*
             * Answers are being handed out: their callbacks' requests are about to come. Then
             * back to the top, with the lock: a weight update published meanwhile broadcast to
             * nobody, and is loaded there before this thread sleeps.
             */
            pthread_mutex_unlock(&b->mu);
            if (ts__batcher_look_hook != NULL)
                ts__batcher_look_hook();
            uint64_t until = ts__now_ns() + TS__ANSWER_SPIN_NS;
            while (atomic_load_explicit(&b->queued_hint, memory_order_relaxed) == 0 &&
                   atomic_load_explicit(&b->ans_open, memory_order_relaxed) > 0 &&
                   !atomic_load_explicit(&b->stop_flag, memory_order_relaxed) &&
                   ts__now_ns() < until)
                sched_yield();
            pthread_mutex_lock(&b->mu);
            looked = 1;
            continue;
        }
        if (b->head == NULL || b->collecting) {
            pthread_cond_wait(&b->work_cv, &b->mu);
            looked = 0;
            continue;
        }
        looked = 0;
        b->collecting = 1;
        int n = gather(r);
        b->collecting = 0;
        /* Another idle replica may gather the next batch while this one runs. */
        if (b->head != NULL)
            pthread_cond_signal(&b->work_cv);
        if (n == 0)
            continue;
        int64_t version = r->version;
        pthread_mutex_unlock(&b->mu);
        /* Blocking requesters of this batch are woken together once its callbacks are over. */
        handoff_chain chain;
        ts__handoff_chain_begin(&chain);
        uint64_t out_ns = run_batch(r, n, version); /* activates r->ctx */
        r->ctx.active = 0;
        ts__handoff_chain_end(&chain);
        pthread_mutex_lock(&b->mu);
        answer_ctx_flush(b, &r->ctx);
        r->st.output_ns += out_ns;
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

/* The timer thread: fails queued requests at their deadline. */
static void *timer_main(void *arg)
{
    ts_batcher_t *b = arg;
    tls_in_batcher = 1;
    name_thread("timer", -1);
    pthread_mutex_lock(&b->mu);
    while (!b->stopping) {
        if (b->cancelled != NULL) {
            /* Cancelled requests are answered here, never inside ts_batcher_cancel. */
            batch_request *c = b->cancelled;
            b->cancelled = c->next;
            c->next = NULL;
            pthread_mutex_unlock(&b->mu);
            if (c->fail == TS_ETIMEDOUT)
                answer(b, c, TS_ETIMEDOUT, NULL, 0, "deadline passed while the request was queued");
            else
                answer(b, c, TS_ECANCELED, NULL, 0, "the request was cancelled");
            pthread_mutex_lock(&b->mu);
            continue;
        }
        if (b->heap_len == 0) {
            b->timer_at = UINT64_MAX;
            pthread_cond_wait(&b->timer_cv, &b->mu);
            continue;
        }
        batch_request *r = b->heap[0];
        if (r->deadline_ns > ts__now_ns()) {
            /* A request taken from the heap leaves this wait early at worst, never late. */
            b->timer_at = r->deadline_ns;
            struct timespec ts = ts__abs_timespec(r->deadline_ns);
            pthread_cond_timedwait(&b->timer_cv, &b->mu, &ts);
            continue;
        }
        unqueue(b, r);
        b->st.failed++;
        b->st.timed_out++;
        if (b->collecting)
            pthread_cond_signal(&b->collect_cv);
        pthread_mutex_unlock(&b->mu);
        answer(b, r, TS_ETIMEDOUT, NULL, 0, "deadline passed while the request was queued");
        pthread_mutex_lock(&b->mu);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Creation and shutdown
 */
void ts_batcher_options_init(ts_batcher_options_t *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->max_batch = TS__DEFAULT_MAX_BATCH;
    cfg->max_delay_us = TS__DEFAULT_DELAY_US;
    cfg->placement = "cpu";
    cfg->timeout_ms = TS__DEFAULT_TIMEOUT_MS;
    cfg->max_queued = TS__DEFAULT_MAX_QUEUED;
    cfg->priority_levels = 1;
}

void ts_predict_options_init(ts_predict_options_t *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->timeout_ms = TS_TIMEOUT_DEFAULT;
    opts->priority = -1;
}

static void stop_threads(ts_batcher_t *b)
{
    pthread_mutex_lock(&b->mu);
    b->stopping = 1;
    atomic_store(&b->stop_flag, 1);
    pthread_cond_broadcast(&b->work_cv);
    pthread_cond_broadcast(&b->collect_cv);
    pthread_cond_broadcast(&b->timer_cv);
    pthread_mutex_unlock(&b->mu);
    for (int i = 0; i < b->n_rep; i++)
        if (b->rep[i].started)
            pthread_join(b->rep[i].thread, NULL);
    if (b->timer_started)
        pthread_join(b->timer, NULL);
    /* The helpers last: a replica finishing its batch may still wait for them. */
    pthread_mutex_lock(&b->ans_mu);
    b->ans_stop = 1;
    pthread_cond_broadcast(&b->ans_cv);
    pthread_mutex_unlock(&b->ans_mu);
    for (int i = 0; i < b->n_answerers; i++)
        pthread_join(b->answerers[i], NULL);
}

static void destroy(ts_batcher_t *b)
{
    /* Cancel what is still queued; every thread is gone, so no lock is needed. */
    /* Every answering thread queued its callbacks' requests before it stopped: none are left. */
    for (int i = 0; i < b->n_rep; i++)
        answer_ctx_flush(b, &b->rep[i].ctx);
    for (int i = 0; i < b->n_answerer_ctx; i++)
        answer_ctx_flush(b, &b->answerer_ctx[i]);
    while (b->cancelled != NULL) {
        batch_request *r = b->cancelled;
        b->cancelled = r->next;
        if (r->fail == TS_ETIMEDOUT)
            answer(b, r, TS_ETIMEDOUT, NULL, 0, "deadline passed while the request was queued");
        else
            answer(b, r, TS_ECANCELED, NULL, 0, "the request was cancelled");
    }
    while (b->head != NULL) {
        batch_request *r = b->head;
        unqueue(b, r);
        b->st.failed++;
        b->st.cancelled++;
        answer(b, r, TS_ECANCELED, NULL, 0, "the batcher is shutting down");
    }
    weight_update *w = b->wt;
    if (w != NULL) {
        int rel = weights_settle(b, w);
        b->wt = NULL;
        if (rel)
            release_weights(b, w); /* frees it: no longer the latest */
        else
            ts__free(w);
    }
    for (int i = 0; i < b->n_rep; i++) {
        replica *r = &b->rep[i];
        if (r->model != NULL && r->model->ops->free != NULL)
            r->model->ops->free(r->model);
        ts_value_free(r->batch);
        ts__free(r->batch_leaf);
        if (r->slots != NULL) {
            /* The first slot's array is the one picked was made with. */
            r->picked = r->slots[0].reqs;
            for (int k = 1; k < TS__ANSWER_SLOTS; k++)
                ts__free(r->slots[k].reqs);
            for (int k = 0; k < TS__ANSWER_SLOTS; k++)
                ts__free(r->slots[k].parts);
            ts__free(r->slots);
        }
        ts__free(r->picked);
        if (r->outbox != NULL) {
            atomic_store(&r->outbox->closed, 1);
            box_drain(r->outbox);
            box_unref(r->outbox); /* frees it unless answers are still held */
        }
        answer_ctx_destroy(&r->ctx);
    }
    ts__free(b->rep);
    ts__free(b->answerers);
    for (int i = 0; i < b->n_answerer_ctx; i++)
        answer_ctx_destroy(&b->answerer_ctx[i]);
    ts__free(b->answerer_ctx);
    pthread_cond_destroy(&b->ans_cv);
    pthread_cond_destroy(&b->slot_cv);
    pthread_mutex_destroy(&b->ans_mu);
    ts__free(b->heap);
    ts__schema_free(b->in, b->n_in);
    ts__schema_free(b->out, b->n_out);
    pthread_cond_destroy(&b->work_cv);
    pthread_cond_destroy(&b->collect_cv);
    pthread_cond_destroy(&b->timer_cv);
    pthread_mutex_destroy(&b->mu);
    ts__free(b);
}

int ts_batcher_new(ts_batcher_t **out, const ts_batcher_options_t *cfg)
{
    ts_set_last_error(NULL);
    if (out == NULL || cfg == NULL) {
        ts__batcher_set_err("ts_batcher_new needs out and options");
        return TS_EINVAL;
    }
    if (cfg->create == NULL) {
        ts__batcher_set_err("options: create (the model factory) is required");
        return TS_EINVAL;
    }
    if (cfg->n_inputs < 1) {
        ts__batcher_set_err("options: n_inputs %d: the input schema needs 1..%d fields",
                            cfg->n_inputs, TS_BATCHER_MAX_FIELDS);
        return TS_EINVAL;
    }
    if (cfg->max_batch < 1) {
        ts__batcher_set_err("options: max_batch %d: at least 1 row", cfg->max_batch);
        return TS_EINVAL;
    }
    if (cfg->max_delay_us < 0) {
        ts__batcher_set_err("options: max_delay_us %lld: 0 or more microseconds",
                            (long long)cfg->max_delay_us);
        return TS_EINVAL;
    }
    if (cfg->min_delay_us < 0 || cfg->min_delay_us > cfg->max_delay_us) {
        ts__batcher_set_err("options: min_delay_us %lld: 0..max_delay_us (%lld)",
                            (long long)cfg->min_delay_us, (long long)cfg->max_delay_us);
        return TS_EINVAL;
    }
    if (cfg->priority_levels < 0 || cfg->priority_levels > TS_BATCHER_MAX_PRIORITIES) {
        ts__batcher_set_err("options: priority_levels %d: 1..%d (0: the default, 1)",
                            cfg->priority_levels, TS_BATCHER_MAX_PRIORITIES);
        return TS_EINVAL;
    }
    int levels = cfg->priority_levels > 0 ? cfg->priority_levels : 1;
    if (cfg->default_priority < 0 || cfg->default_priority >= levels) {
        ts__batcher_set_err("options: default_priority %d: 0..%d (below priority_levels, %d)",
                            cfg->default_priority, levels - 1, levels);
        return TS_EINVAL;
    }
    if (cfg->n_preferred < 0 || cfg->n_preferred > TS_BATCHER_MAX_PREFERRED) {
        ts__batcher_set_err("options: n_preferred %d: 0..%d", cfg->n_preferred,
                            TS_BATCHER_MAX_PREFERRED);
        return TS_EINVAL;
    }
    if (cfg->n_preferred > 0 && cfg->preferred_batch == NULL) {
        ts__batcher_set_err("options: n_preferred %d with preferred_batch NULL", cfg->n_preferred);
        return TS_EINVAL;
    }
    if (cfg->answer_threads < 0 || cfg->answer_threads > TS_BATCHER_MAX_ANSWER_THREADS) {
        ts__batcher_set_err("options: answer_threads %d: 0..%d", cfg->answer_threads,
                            TS_BATCHER_MAX_ANSWER_THREADS);
        return TS_EINVAL;
    }
    if (cfg->overlap_answers && cfg->answer_threads < 1) {
        ts__batcher_set_err("overlap_answers needs answer_threads >= 1 (the helpers answer)");
        return TS_EINVAL;
    }
    for (int i = 0; i < cfg->n_preferred; i++) {
        if (cfg->preferred_batch[i] < 1 || cfg->preferred_batch[i] > cfg->max_batch) {
            ts__batcher_set_err("preferred batch size %d is not within 1..max_batch (%d)",
                                cfg->preferred_batch[i], cfg->max_batch);
            return TS_EINVAL;
        }
    }
    if (cfg->timeout_ms <= 0 && cfg->timeout_ms != TS_TIMEOUT_INFINITE &&
        cfg->timeout_ms != TS_TIMEOUT_DEFAULT) {
        ts__batcher_set_err("timeout_ms must be positive, TS_TIMEOUT_DEFAULT or "
                            "TS_TIMEOUT_INFINITE (got %d)",
                            cfg->timeout_ms);
        return TS_EINVAL;
    }
    char(*devs)[TS__DEVICE_LEN] = ts__calloc(TS__MAX_REPLICAS, TS__DEVICE_LEN);
    if (devs == NULL)
        return ts__fail(TS_ENOMEM, NULL);
    int n_rep = 0;
    int rc = ts__placement_parse(cfg->placement, cfg->cuda_devices, devs, &n_rep);
    if (rc != 0) {
        ts__free(devs);
        return rc;
    }
    ts_batcher_t *b = ts__calloc(1, sizeof(*b));
    if (b == NULL) {
        ts__free(devs);
        return ts__fail(TS_ENOMEM, NULL);
    }
    pthread_mutex_init(&b->mu, NULL);
    pthread_mutex_init(&b->ans_mu, NULL);
    pthread_cond_init(&b->ans_cv, NULL);
    pthread_cond_init(&b->slot_cv, NULL);
    ts__cond_init_monotonic(&b->work_cv);
    ts__cond_init_monotonic(&b->collect_cv);
    ts__cond_init_monotonic(&b->timer_cv);
    b->timer_at = UINT64_MAX;
    b->max_batch = cfg->max_batch;
    b->max_delay_ns = (uint64_t)cfg->max_delay_us * 1000u;
    b->min_delay_ns = (uint64_t)cfg->min_delay_us * 1000u;
    b->hold_gain16 = 16; /* holds pay until they show otherwise */
    b->levels = levels;
    b->default_prio = cfg->default_priority;
    atomic_init(&b->next_id, 1);
    atomic_init(&b->pending, 0);
    atomic_init(&b->queued_hint, 0);
    atomic_init(&b->stop_flag, 0);
    atomic_init(&b->ans_posted, 0);
    atomic_init(&b->ans_open, 0);
    /* Ascending, duplicates dropped (insertion sort of at most TS_BATCHER_MAX_PREFERRED). */
    for (int i = 0; i < cfg->n_preferred; i++) {
        int64_t v = cfg->preferred_batch[i];
        int j = b->n_preferred;
        if (is_preferred(b, v))
            continue;
        while (j > 0 && b->preferred[j - 1] > v) {
            b->preferred[j] = b->preferred[j - 1];
            j--;
        }
        b->preferred[j] = v;
        b->n_preferred++;
    }
    b->timeout_ms =
        cfg->timeout_ms == TS_TIMEOUT_DEFAULT ? TS__DEFAULT_TIMEOUT_MS : cfg->timeout_ms;
    b->max_queued = cfg->max_queued > 0 ? cfg->max_queued : TS__DEFAULT_MAX_QUEUED;
    b->st.max_batch = (uint32_t)cfg->max_batch;
    rc = ts__schema_copy(cfg->inputs, cfg->n_inputs, "input", &b->in);
    if (rc == 0) {
        b->n_in = cfg->n_inputs;
        rc = ts__schema_copy(cfg->outputs, cfg->n_outputs, "output", &b->out);
    }
    if (rc == 0) {
        b->n_out = cfg->n_outputs;
        b->rep = ts__calloc((size_t)n_rep, sizeof(*b->rep));
        rc = b->rep != NULL ? 0 : TS_ENOMEM;
    }
    for (int i = 0; rc == 0 && i < n_rep; i++) {
        replica *r = &b->rep[i];
        r->b = b;
        if (answer_ctx_init(&r->ctx, b) != 0) {
            rc = TS_ENOMEM;
            break;
        }
        b->n_rep = i + 1;
        r->index = i;
        r->version = cfg->version;
        memcpy(r->device, devs[i], TS__DEVICE_LEN);
        r->batch_leaf = ts__calloc((size_t)b->n_in, sizeof(*r->batch_leaf));
        r->picked = ts__calloc((size_t)b->max_batch, sizeof(*r->picked));
        r->outbox = ts__calloc(1, sizeof(*r->outbox));
        if (r->outbox != NULL) {
            atomic_init(&r->outbox->head, NULL);
            atomic_init(&r->outbox->refs, 1);
            atomic_init(&r->outbox->closed, 0);
        }
        if (r->batch_leaf == NULL || r->picked == NULL || r->outbox == NULL ||
            (r->batch = ts__schema_alloc(b->in, b->n_in, b->max_batch, r->batch_leaf)) == NULL) {
            rc = TS_ENOMEM;
            break;
        }
        char err[TS__BERR_LEN] = "";
        ts_model_t *m = NULL;
        /* The factory says why it failed in ts_last_error() (empty: it did not say). */
        ts_set_last_error(NULL);
        rc = cfg->create(r->device, i, &m, cfg->create_arg);
        if (rc != 0 && !is_ts_error(rc)) {
            /* Callers test for TS_E* codes: a positive or unknown one would pass as another. */
            const char *said = ts_last_error();
            snprintf(err, sizeof(err), "the factory returned %d, not a TS_E* code%s%.180s%s", rc,
                     said[0] ? " (" : "", said, said[0] ? ")" : "");
            rc = TS_EMODEL;
        } else if (rc != 0) {
            snprintf(err, sizeof(err), "%s", ts_last_error());
        } else if (m == NULL || m->ops == NULL || m->ops->forward == NULL) {
            rc = TS_EINVAL;
            snprintf(err, sizeof(err), "the factory returned no usable model");
        }
        if (rc != 0) {
            ts__batcher_set_err("model for replica %d on %s: %s", i, r->device,
                                err[0] ? err : ts_strerror(rc));
            break;
        }
        r->model = m;
    }
    ts__free(devs);
    if (rc == 0 && cfg->answer_threads > 0) {
        b->answerers = ts__calloc((size_t)cfg->answer_threads, sizeof(*b->answerers));
        b->answerer_ctx = ts__calloc((size_t)cfg->answer_threads, sizeof(*b->answerer_ctx));
        rc = b->answerers != NULL && b->answerer_ctx != NULL ? 0 : TS_ENOMEM;
        for (int i = 0; rc == 0 && i < cfg->answer_threads; i++) {
            if (answer_ctx_init(&b->answerer_ctx[i], b) != 0) {
                rc = TS_ENOMEM;
                break;
            }
            b->n_answerer_ctx = i + 1;
            if (pthread_create(&b->answerers[i], NULL, answerer_main, &b->answerer_ctx[i]) != 0)
                rc = TS_ENOMEM;
            else
                b->n_answerers = i + 1;
        }
    }
    /* Helpers before replicas: a replica's first batch may already go to them. */
    b->overlap = cfg->overlap_answers && b->n_answerers > 0;
    for (int i = 0; rc == 0 && b->overlap && i < b->n_rep; i++) {
        replica *r = &b->rep[i];
        r->slots = ts__calloc(TS__ANSWER_SLOTS, sizeof(*r->slots));
        rc = r->slots != NULL ? 0 : TS_ENOMEM;
        for (int k = 0; rc == 0 && k < TS__ANSWER_SLOTS; k++) {
            answer_slot *sl = &r->slots[k];
            sl->reqs = k == 0 ? r->picked : ts__calloc((size_t)b->max_batch, sizeof(*sl->reqs));
            sl->parts = ts__calloc((size_t)b->n_answerers, sizeof(*sl->parts));
            rc = sl->reqs != NULL && sl->parts != NULL ? 0 : TS_ENOMEM;
        }
    }
    for (int i = 0; rc == 0 && i < b->n_rep; i++) {
        if (pthread_create(&b->rep[i].thread, NULL, replica_main, &b->rep[i]) != 0)
            rc = TS_ENOMEM;
        else
            b->rep[i].started = 1;
    }
    if (rc == 0) {
        if (pthread_create(&b->timer, NULL, timer_main, b) != 0)
            rc = TS_ENOMEM;
        else
            b->timer_started = 1;
    }
    if (rc != 0) {
        if (rc == TS_ENOMEM && ts_last_error()[0] == '\0')
            ts__batcher_set_err("out of memory");
        stop_threads(b);
        destroy(b);
        return rc;
    }
    *out = b;
    return 0;
}

void ts_batcher_free(ts_batcher_t *b)
{
    if (b == NULL)
        return;
    /* Serving threads submit to the engine: they stop first (set only by serve.c). */
    pthread_mutex_lock(&b->mu);
    void (*remote_stop)(ts_batcher_t *) = b->remote_stop;
    pthread_mutex_unlock(&b->mu);
    if (remote_stop != NULL)
        remote_stop(b);
    stop_threads(b);
    destroy(b);
}

int ts_batcher_replicas(const ts_batcher_t *b)
{
    return b->n_rep;
}

const char *ts_batcher_device(const ts_batcher_t *b, int i)
{
    return i >= 0 && i < b->n_rep ? b->rep[i].device : NULL;
}

void ts_batcher_stats(ts_batcher_t *b, ts_batcher_stats_t *out)
{
    pthread_mutex_lock(&b->mu);
    *out = b->st;
    out->queued = (uint32_t)b->queued;
    pthread_mutex_unlock(&b->mu);
}

int ts_batcher_replica_stats(ts_batcher_t *b, int i, ts_batcher_replica_stats_t *out)
{
    if (b == NULL || out == NULL || i < 0 || i >= b->n_rep) {
        ts__batcher_set_err("replica %d: out of range", i);
        return TS_EINVAL;
    }
    pthread_mutex_lock(&b->mu);
    *out = b->rep[i].st;
    pthread_mutex_unlock(&b->mu);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Submitting
 */
int ts_batcher_predict_async(ts_batcher_t *b, const ts_value_t *input, unsigned flags,
                             int timeout_ms, ts_predict_cb cb, void *arg)
{
    ts_predict_options_t po;
    ts_predict_options_init(&po);
    po.flags = flags;
    po.timeout_ms = timeout_ms;
    return ts_batcher_predict_async_with(b, input, &po, cb, arg, NULL);
}

int ts_batcher_predict_async_with(ts_batcher_t *b, const ts_value_t *input,
                                  const ts_predict_options_t *opts, ts_predict_cb cb, void *arg,
                                  uint64_t *id)
{
    ts_predict_options_t defaults;
    if (opts == NULL) {
        ts_predict_options_init(&defaults);
        opts = &defaults;
    }
    unsigned flags = opts->flags;
    int timeout_ms = opts->timeout_ms;
    if (b == NULL || input == NULL || cb == NULL) {
        ts__batcher_set_err("a prediction needs a batcher, an input and a callback");
        return TS_EINVAL;
    }
    if (timeout_ms == 0 ||
        (timeout_ms < 0 && timeout_ms != TS_TIMEOUT_INFINITE && timeout_ms != TS_TIMEOUT_DEFAULT)) {
        ts__batcher_set_err("timeout_ms %d: a prediction needs a positive timeout, "
                            "TS_TIMEOUT_DEFAULT or TS_TIMEOUT_INFINITE",
                            timeout_ms);
        return TS_EINVAL;
    }
    if (opts->priority >= b->levels || opts->priority < -1) {
        ts__batcher_set_err("priority %d: this batcher has levels 0..%d (or -1 for the default)",
                            opts->priority, b->levels - 1);
        return TS_EINVAL;
    }
    batch_request *r = req_alloc(b);
    if (r == NULL)
        return ts__fail(TS_ENOMEM, NULL);
    if (flags & TS_COPY) {
        r->owned = ts_value_clone(input);
        if (r->owned == NULL) {
            req_free(b, r);
            return ts__fail(TS_ENOMEM, NULL);
        }
        input = r->owned;
    }
    r->input = input;
    r->cb = cb;
    r->arg = arg;
    r->heap_idx = SIZE_MAX;
    r->prio = opts->priority >= 0 ? opts->priority : b->default_prio;
    char msg[TS__BERR_LEN];
    int rc =
        ts__schema_check(b->in, b->n_in, input, b->max_batch, &r->rows, r->leaf, msg, sizeof(msg));
    if (rc != 0) {
        ts__batcher_set_err("%s", msg);
        req_free(b, r);
        return rc;
    }
    int t = timeout_ms == TS_TIMEOUT_DEFAULT ? b->timeout_ms : timeout_ms;
    answer_ctx *c = tls_ctx;
    if (c != NULL && (c->b != b || !c->active))
        c = NULL;
    /*
     * From a callback, the time its thread began answering stands for the arrival: one clock
     * read per batch instead of one per request (a clock read costs as much as a tenth of the
     * rest of a submit on a virtual machine). It is earlier than the submit by at most the
     * time the batch's callbacks take, so a deadline computed from it is never late.
     */
    r->arrival_ns = c != NULL ? c->now_ns : ts__now_ns();
    r->deadline_ns = t > 0 ? r->arrival_ns + (uint64_t)t * 1000000u : 0;
    /*
     * Submitted from a callback that a replica or an answer helper is calling: the request
     * joins the thread's list, without the batcher's lock, and the thread queues the whole
     * list under one acquisition of the lock once its callbacks are over (answer_ctx_flush):
     * with a thousand requesters answered by one batch, a thousand acquisitions of the one
     * lock (contended when helpers answer parts of the batch at once) become one per thread
     * and batch. Nothing is woken here: that thread's replica takes the queue right after
     * (with overlap_answers the helper wakes an idle replica once it has queued them). The
     * queue bound counts these requests too; near it, or when stopping, the submit takes the
     * lock as any other.
     */
    if (c != NULL && !atomic_load_explicit(&b->stop_flag, memory_order_relaxed) &&
        ctx_reserve(b, c)) {
        c->credit--;
        /* Ids come from a block of the thread's own: no shared counter per request. */
        if (c->id_next == c->id_end) {
            c->id_next = atomic_fetch_add_explicit(&b->next_id, TS__ID_BLOCK, memory_order_relaxed);
            c->id_end = c->id_next + TS__ID_BLOCK;
        }
        r->id = c->id_next++;
        if (id != NULL)
            *id = r->id;
        r->heap_idx = SIZE_MAX;
        r->next = NULL;
        ctx_lock(c);
        r->prev = c->tail;
        if (c->tail != NULL)
            c->tail->next = r;
        else
            c->head = r;
        c->tail = r;
        c->n++;
        ctx_unlock(c);
        return 0;
    }
    pthread_mutex_lock(&b->mu);
    if (b->stopping ||
        b->queued + atomic_load_explicit(&b->pending, memory_order_relaxed) >= b->max_queued) {
        rc = b->stopping ? TS_ECANCELED : TS_EAGAIN;
        if (!b->stopping)
            b->st.rejected++;
        pthread_mutex_unlock(&b->mu);
        ts__batcher_set_err("%s",
                            b->stopping ? "the batcher is shutting down" : "the queue is full");
        req_free(b, r);
        return rc;
    }
    if (r->deadline_ns != 0) {
        if (heap_push(b, r) != 0) {
            pthread_mutex_unlock(&b->mu);
            req_free(b, r);
            return ts__fail(TS_ENOMEM, NULL);
        }
        /*
         * Wake the timer only for a deadline earlier than the one it sleeps until: with one
         * timeout for every request, deadlines arrive in order and it almost never is.
         */
        if (r->deadline_ns < b->timer_at) {
            b->timer_at = r->deadline_ns;
            pthread_cond_signal(&b->timer_cv);
        }
    }
    enqueue(b, r);
    r->id = atomic_fetch_add_explicit(&b->next_id, 1, memory_order_relaxed);
    if (id != NULL)
        *id = r->id;
    b->st.submitted++;
    if (b->returning > 0)
        b->returning--;
    /*
     * The gathering replica sleeps until its delay ends or the batch cannot grow; waking it
     * for every arrival would cost a context switch per request. The queue's rows reach
     * max_batch exactly when the batch from its head is full or the next request does not fit.
     *
     * A request submitted from a callback of this batcher's replica thread (a requester that
     * submits its next request as soon as it has its answer) wakes no idle replica: that
     * replica comes back to the queue right after its batch's callbacks and takes what they
     * queued, and if more than one batch is waiting it wakes another replica then. In a closed
     * loop the requests of a batch thus come back as the next batch without any thread being
     * woken, and idle replicas are not woken one by one to gather a few rows each.
     */
    if (b->collecting) {
        /* ... nor while more rows can be expected: see gather() for when they cannot. */
        if (b->queued_rows >= b->max_batch || b->returning == 0 ||
            (b->n_preferred > 0 && is_preferred(b, b->queued_rows)))
            pthread_cond_signal(&b->collect_cv);
    } else if (c == NULL) {
        pthread_cond_signal(&b->work_cv);
    }
    pthread_mutex_unlock(&b->mu);
    return 0;
}

/* Take the request id out of c's list of submitted requests, or NULL. Batcher's lock held. */
static batch_request *ctx_take(answer_ctx *c, uint64_t id)
{
    ctx_lock(c);
    batch_request *r = c->head;
    while (r != NULL && r->id != id)
        r = r->next;
    if (r != NULL) {
        if (r->prev != NULL)
            r->prev->next = r->next;
        else
            c->head = r->next;
        if (r->next != NULL)
            r->next->prev = r->prev;
        else
            c->tail = r->prev;
        r->prev = r->next = NULL;
        c->n--;
    }
    ctx_unlock(c);
    return r;
}

int ts_batcher_cancel(ts_batcher_t *b, uint64_t id)
{
    pthread_mutex_lock(&b->mu);
    batch_request *r = b->head;
    while (r != NULL && r->id != id)
        r = r->next;
    if (r != NULL) {
        unqueue(b, r);
    } else if (id != 0 && atomic_load_explicit(&b->pending, memory_order_relaxed) > 0) {
        /* Not queued yet: perhaps submitted from a callback and waiting in its thread's list. */
        for (int i = 0; r == NULL && i < b->n_rep + b->n_answerer_ctx; i++)
            r = ctx_take(i < b->n_rep ? &b->rep[i].ctx : &b->answerer_ctx[i - b->n_rep], id);
        if (r != NULL) {
            atomic_fetch_sub_explicit(&b->pending, 1, memory_order_relaxed);
            b->st.submitted++;
            if (b->returning > 0)
                b->returning--;
        }
    }
    if (r == NULL || id == 0) {
        pthread_mutex_unlock(&b->mu);
        ts__batcher_set_err("request %llu is not queued (in a batch, answered or unknown)",
                            (unsigned long long)id);
        return TS_ENOENT;
    }
    b->st.failed++;
    b->st.cancelled++;
    /* The timer thread answers it (pushed on the front: the order of cancellations is free). */
    r->next = b->cancelled;
    b->cancelled = r;
    pthread_cond_signal(&b->timer_cv);
    if (b->collecting)
        pthread_cond_signal(&b->collect_cv);
    pthread_mutex_unlock(&b->mu);
    return 0;
}

/* A blocking predict waiting for its answer. */
typedef struct blocking_predict {
    handoff_sync sync;
    int status;
    ts_value_t *output;
    int64_t version;
    char msg[TS__BERR_LEN];
} blocking_predict;

static void blocking_predict_cb(ts_batcher_t *b, int status, ts_value_t *output, int64_t version,
                                void *arg)
{
    (void)b;
    blocking_predict *s = arg;
    s->status = status;
    s->output = output;
    s->version = version;
    /* The failure's message is this (batcher) thread's; the waiting caller sets it on its own. */
    if (status != 0)
        snprintf(s->msg, sizeof(s->msg), "%s", ts_last_error());
    ts__handoff_post(&s->sync);
}

int ts_batcher_predict(ts_batcher_t *b, const ts_value_t *input, int timeout_ms,
                       ts_value_t **output, int64_t *version)
{
    if (tls_in_batcher) {
        ts__batcher_set_err("ts_batcher_predict called from a batcher callback");
        return TS_EDEADLK;
    }
    blocking_predict s;
    s.msg[0] = '\0';
    if (ts__handoff_init(&s.sync) != 0)
        return ts__fail(TS_ENOMEM, NULL);
    int rc = ts_batcher_predict_async(b, input, 0, timeout_ms, blocking_predict_cb, &s);
    /* The timer thread answers at the deadline, and shutdown cancels: this wait ends. */
    if (rc == 0)
        ts__handoff_wait(&s.sync);
    ts__handoff_destroy(&s.sync);
    if (rc != 0)
        return rc;
    if (s.status != 0) {
        ts__batcher_set_err("%s", s.msg);
        return s.status;
    }
    *output = s.output;
    if (version != NULL)
        *version = s.version;
    return 0;
}
