/*
 * The RL worker (include/tensorshare/rl.h): follows the parameters bin and hands out snapshots,
 * and adds experience with bounded asynchronous appends.
 */
#include "rl_internal.h"

#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------
 * Parameter snapshots
 */

struct ts_rl_params_s {
    atomic_int refs;
    int64_t version;
    ts_items_t *items; /* owns the buffer value points into */
    const ts_value_t *value;
};

const ts_value_t *ts_rl_params_value(const ts_rl_params_t *p)
{
    assert(p != NULL);
    return p->value;
}

int64_t ts_rl_params_version(const ts_rl_params_t *p)
{
    assert(p != NULL);
    return p->version;
}

ts_rl_params_t *ts_rl_params_retain(ts_rl_params_t *p)
{
    assert(p != NULL);
    atomic_fetch_add_explicit(&p->refs, 1, memory_order_relaxed);
    return p;
}

void ts_rl_params_release(ts_rl_params_t *p)
{
    if (p == NULL)
        return;
    /* acq_rel: the freeing thread must see every other holder's reads finished. */
    if (atomic_fetch_sub_explicit(&p->refs, 1, memory_order_acq_rel) == 1) {
        ts_items_free(p->items);
        ts__free(p);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Worker
 *
 * State lives under w->mu, which is never held across a client call (a client might call back
 * into us on its I/O thread while we wait for it). The subscription's callback argument is a
 * separate refcounted stub: the subscription can outlive the worker when ts_unlisten fails (its
 * final callback then only comes when the client is freed), and the stub lets the worker detach
 * itself safely. Peek and append callbacks point at the worker directly, and every accepted
 * request gets exactly one callback: ts_rl_worker_free waits for the adds only up to the
 * options' timeout, and when requests are still in flight after that it leaves the struct
 * behind (orphaned), for the last of their callbacks to free. Once closing, callbacks no longer
 * report events: on_event and its argument may be gone when ts_rl_worker_free has returned.
 */

typedef struct rl_sub_s {
    pthread_mutex_t mu; /* held while a notification is handled */
    ts_rl_worker_t *w;  /* NULL once the worker detached */
    int refs;           /* the worker's and the subscription's; under mu */
} rl_sub_t;

struct ts_rl_worker_s {
    ts_client_t *client; /* borrowed */
    char params_bin[TS_MAX_NAME_LEN + 1];
    char data_bin[TS_MAX_NAME_LEN + 1];
    unsigned max_in_flight;
    size_t max_in_flight_bytes;
    int timeout_ms; /* what TS_TIMEOUT_DEFAULT means; >= 0 ms or -1 for no limit */
    int replay;     /* the data bin is a replay table: adds are blocking inserts */
    double priority;
    ts_rl_event_cb on_event;
    void *event_arg;
    rl_sub_t *sub;

    pthread_mutex_t mu;
    pthread_cond_t cond; /* broadcast on: new params, an add or peek answered */
    ts_rl_params_t *current;
    int64_t retrieved;
    int peek_in_flight; /* one read of the parameters bin at a time */
    int peek_again;     /* a change arrived while a read was in flight: read once more */
    int closing;
    int emitting; /* on_event calls running now (ts_rl_worker_free waits for them) */
    int orphaned; /* freed with requests in flight: the last callback frees the struct */
    size_t bytes_in_flight;
    int first_error; /* of an add since the last flush */
    pthread_t io_thread;
    int io_known;
    ts_rl_worker_stats_t stats;
};

/* A pending append's context: who to tell and how many bytes to give back. */
typedef struct rl_add_s {
    ts_rl_worker_t *w;
    size_t bytes;
} rl_add_t;

static void rl_peek_cb(ts_client_t *c, int status, ts_result_t *res, void *arg);

/* Remember the client's I/O thread so blocking calls made on it can refuse. Under w->mu. */
static void rl_note_io_thread(ts_rl_worker_t *w)
{
    if (!w->io_known) {
        w->io_thread = pthread_self();
        w->io_known = 1;
    }
}

/* 1 when the caller runs on the client's I/O thread (blocking there would deadlock). Under mu. */
static int rl_on_io_thread(const ts_rl_worker_t *w)
{
    return w->io_known && pthread_equal(w->io_thread, pthread_self());
}

/*
 * Report an event unless the worker is closing (then on_event may be gone). A failure's message
 * goes to ts_last_error() on this thread first, where the callback reads it (tensorshare.h
 * "Error messages"). Takes w->mu (not held by the caller).
 */
static void rl_emit(ts_rl_worker_t *w, ts_rl_event_t ev, int status, int64_t version)
{
    if (w->on_event == NULL)
        return;
    pthread_mutex_lock(&w->mu);
    int closing = w->closing;
    if (!closing)
        w->emitting++;
    pthread_mutex_unlock(&w->mu);
    if (closing)
        return;
    if (ev == TS_RL_EV_PARAMS_BAD)
        ts__set_errorf("the parameters bin '%s' holds something other than {params, version}",
                       w->params_bin);
    else if (ev == TS_RL_EV_DISCONNECTED)
        ts__set_errorf("the connection to tensord was lost");
    else if (status < 0)
        ts__set_errorf("%s: %s",
                       ev == TS_RL_EV_ADD_FAILED ? "an experience item was not stored"
                                                 : "reading the parameters bin failed",
                       ts_strerror(status));
    w->on_event(w, status, ev, version, w->event_arg);
    pthread_mutex_lock(&w->mu);
    w->emitting--;
    pthread_cond_broadcast(&w->cond);
    pthread_mutex_unlock(&w->mu);
}

/* Free what the worker still holds and the struct itself (nothing may be in flight). */
static void rl_worker_destroy(ts_rl_worker_t *w)
{
    ts_rl_params_release(w->current);
    pthread_cond_destroy(&w->cond);
    pthread_mutex_destroy(&w->mu);
    ts__free(w);
}

/*
 * 1 when a callback that just ended its request must free the worker: it was freed meanwhile,
 * and nothing else is in flight. Under w->mu.
 */
static int rl_last_out(const ts_rl_worker_t *w)
{
    return w->orphaned && w->stats.in_flight == 0 && !w->peek_in_flight;
}

/*
 * A read of the parameters bin could not be sent: report it, then end the read (in that order:
 * once peek_in_flight drops, ts_rl_worker_free may free w).
 */
static void rl_peek_failed(ts_rl_worker_t *w, int rc)
{
    rl_emit(w, TS_RL_EV_PARAMS_FAILED, rc, -1);
    pthread_mutex_lock(&w->mu);
    w->peek_in_flight = 0;
    w->stats.params_failed++;
    pthread_cond_broadcast(&w->cond);
    int last = rl_last_out(w);
    pthread_mutex_unlock(&w->mu);
    if (last)
        rl_worker_destroy(w);
}

/*
 * Ask for a read of the parameters bin, or, when one is in flight already, for one more read
 * after it (so a burst of publishes costs at most two reads, never one per publish).
 */
static void rl_request_peek(ts_rl_worker_t *w)
{
    pthread_mutex_lock(&w->mu);
    if (w->closing) {
        pthread_mutex_unlock(&w->mu);
        return;
    }
    if (w->peek_in_flight) {
        w->peek_again = 1;
        pthread_mutex_unlock(&w->mu);
        return;
    }
    w->peek_in_flight = 1;
    pthread_mutex_unlock(&w->mu);

    int rc = ts_peek_async(w->client, w->params_bin, 0, rl_peek_cb, w);
    if (rc != 0)
        rl_peek_failed(w, rc);
}

/*
 * Install the newest item of a parameters read as the current snapshot when it is newer than
 * what we hold. Takes ownership of items.
 */
static void rl_install(ts_rl_worker_t *w, ts_items_t *items)
{
    size_t n = ts_items_count(items);
    const ts_value_t *params = NULL;
    int64_t v = -1;
    int rc =
        n == 0 ? TS_EBADRECORD : ts__rl_unwrap(ts_items_at(items, n - 1), "params", &params, &v);
    ts_rl_params_t *snap = NULL;
    if (rc == 0) {
        snap = ts__malloc(sizeof(*snap));
        if (snap == NULL)
            rc = TS_ENOMEM;
    }
    if (rc != 0) {
        ts_items_free(items);
        pthread_mutex_lock(&w->mu);
        w->stats.params_failed++;
        pthread_mutex_unlock(&w->mu);
        rl_emit(w, rc == TS_EBADRECORD ? TS_RL_EV_PARAMS_BAD : TS_RL_EV_PARAMS_FAILED, rc, -1);
        return;
    }
    atomic_init(&snap->refs, 1);
    snap->version = v;
    snap->items = items;
    snap->value = params;

    ts_rl_params_t *drop;
    int newer;
    pthread_mutex_lock(&w->mu);
    newer = w->current == NULL || v > w->current->version;
    if (newer) {
        drop = w->current;
        w->current = snap;
        w->stats.version = v;
        w->stats.updates++;
        pthread_cond_broadcast(&w->cond);
    } else {
        /* Versions never go back: an older (or repeated) publish is ignored. */
        drop = snap;
        w->stats.ignored_older++;
    }
    pthread_mutex_unlock(&w->mu);
    ts_rl_params_release(drop);
    if (newer)
        rl_emit(w, TS_RL_EV_PARAMS, 0, v);
}

/* Completion of a parameters read (I/O thread). */
static void rl_peek_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    ts_rl_worker_t *w = arg;
    pthread_mutex_lock(&w->mu);
    rl_note_io_thread(w);
    pthread_mutex_unlock(&w->mu);

    if (status == 0 && res != NULL && res->items != NULL) {
        ts_items_t *items = res->items;
        res->items = NULL; /* keep them: the snapshot points into their buffer */
        rl_install(w, items);
    } else if (status != TS_ENOENT && status != TS_ECANCELED) {
        /* ENOENT: nothing published yet, which is normal before the trainer starts. */
        pthread_mutex_lock(&w->mu);
        w->stats.params_failed++;
        pthread_mutex_unlock(&w->mu);
        rl_emit(w, TS_RL_EV_PARAMS_FAILED, status, -1);
    }

    pthread_mutex_lock(&w->mu);
    int again = w->peek_again && !w->closing;
    w->peek_again = 0;
    if (!again)
        w->peek_in_flight = 0;
    pthread_cond_broadcast(&w->cond);
    int last = rl_last_out(w);
    pthread_mutex_unlock(&w->mu);
    if (last) {
        rl_worker_destroy(w);
        return;
    }
    if (again) {
        int rc = ts_peek_async(w->client, w->params_bin, 0, rl_peek_cb, w);
        if (rc != 0)
            rl_peek_failed(w, rc);
    }
}

/* Drop one reference to the stub; the last frees it. */
static void rl_sub_unref(rl_sub_t *sub)
{
    pthread_mutex_lock(&sub->mu);
    int left = --sub->refs;
    pthread_mutex_unlock(&sub->mu);
    if (left == 0) {
        pthread_mutex_destroy(&sub->mu);
        ts__free(sub);
    }
}

/* Notifications of the parameters bin (I/O thread). */
static void rl_notify_cb(ts_client_t *c, int status, const ts_notification_t *n, void *arg)
{
    (void)c;
    rl_sub_t *sub = arg;
    if (status < 0) {
        rl_sub_unref(sub); /* the subscription's final call */
        return;
    }
    pthread_mutex_lock(&sub->mu);
    ts_rl_worker_t *w = sub->w;
    if (w != NULL && n != NULL) {
        pthread_mutex_lock(&w->mu);
        rl_note_io_thread(w);
        if (n->event == TS_EV_DISCONNECTED)
            w->stats.disconnects++;
        else if (n->event == TS_EV_RESUBSCRIBED)
            w->stats.resubscribes++;
        pthread_mutex_unlock(&w->mu);
        switch (n->event) {
        case TS_EV_PUT:
        case TS_EV_APPEND:
        case TS_EV_ROWS: /* a tensor bin's rows changed in place: read it again too */
            rl_request_peek(w);
            break;
        case TS_EV_RESUBSCRIBED:
            /* Publishes may have happened while we were away: read the bin again. */
            rl_emit(w, TS_RL_EV_RESUBSCRIBED, 0, -1);
            rl_request_peek(w);
            break;
        case TS_EV_DISCONNECTED:
            rl_emit(w, TS_RL_EV_DISCONNECTED, TS_ECONNRESET, -1);
            break;
        case TS_EV_GET:
        case TS_EV_DELETE:
            /*
             * The parameters went away (a trainer cleaning up, an operator): keep acting on
             * the last ones, as a trainer restart must not stop the workers.
             */
            break;
        }
    }
    pthread_mutex_unlock(&sub->mu);
}

static int rl_worker_new(ts_rl_worker_t **out, ts_client_t *c, const ts_rl_options_t *opts)
{
    ts_rl_options_t defaults;
    if (opts == NULL) {
        ts_rl_options_init(&defaults);
        opts = &defaults;
    }
    int timeout_ms;
    int rc = ts__rl_timeout(opts->timeout_ms, RL_DEFAULT_TIMEOUT_MS, &timeout_ms);
    if (rc != 0)
        return rc;
    ts_rl_worker_t *w = ts__calloc(1, sizeof(*w));
    if (w == NULL)
        return TS_ENOMEM;
    w->client = c;
    rc = ts__rl_bin_name(w->params_bin, opts->prefix, opts->params_bin);
    if (rc == 0)
        rc = ts__rl_bin_name(w->data_bin, opts->prefix, opts->data_bin);
    if (rc != 0) {
        ts__free(w);
        return ts__fail(rc, "bin names: prefix plus name must be 1..%d bytes", TS_MAX_NAME_LEN);
    }
    w->max_in_flight = opts->max_in_flight > 0 ? opts->max_in_flight : 1;
    w->max_in_flight_bytes = opts->max_in_flight_bytes;
    w->timeout_ms = timeout_ms;
    w->replay = opts->replay != NULL;
    w->priority = opts->replay_priority;
    w->on_event = opts->on_event;
    w->event_arg = opts->event_arg;
    w->retrieved = -1;
    w->stats.version = -1;
    w->stats.retrieved_version = -1;

    rl_sub_t *sub = ts__calloc(1, sizeof(*sub));
    if (sub == NULL) {
        ts__free(w);
        return TS_ENOMEM;
    }
    if (pthread_mutex_init(&sub->mu, NULL) != 0) {
        ts__free(sub);
        ts__free(w);
        return TS_ENOMEM;
    }
    if (pthread_mutex_init(&w->mu, NULL) != 0) {
        pthread_mutex_destroy(&sub->mu);
        ts__free(sub);
        ts__free(w);
        return TS_ENOMEM;
    }
    if (ts__cond_init_monotonic(&w->cond) != 0) {
        pthread_mutex_destroy(&w->mu);
        pthread_mutex_destroy(&sub->mu);
        ts__free(sub);
        ts__free(w);
        return TS_ENOMEM;
    }
    sub->w = w;
    sub->refs = 2; /* the worker's, and the subscription's once listen succeeds */
    w->sub = sub;

    /*
     * Listen first, then read: a publish between the two is then either in what we read or
     * announced by a notification; the other order could miss it.
     */
    rc = ts_listen(c, w->params_bin, rl_notify_cb, sub);
    if (rc != 0) {
        pthread_cond_destroy(&w->cond);
        pthread_mutex_destroy(&w->mu);
        pthread_mutex_destroy(&sub->mu);
        ts__free(sub);
        ts__free(w);
        return rc;
    }
    ts_items_t *items = NULL;
    rc = ts_peek(c, w->params_bin, 0, &items);
    if (rc == 0)
        rl_install(w, items);
    else if (rc != TS_ENOENT) {
        char msg[TS_MAX_ERROR_LEN + 1];
        snprintf(msg, sizeof(msg), "%s", ts_last_error()); /* the free below may replace it */
        ts_rl_worker_free(w);
        ts_set_last_error(msg);
        return rc;
    }
    *out = w;
    return 0;
}

int ts_rl_worker_new(ts_rl_worker_t **out, ts_client_t *c, const ts_rl_options_t *opts)
{
    assert(out != NULL && c != NULL);
    ts_set_last_error(NULL);
    return ts__rl_done(rl_worker_new(out, c, opts), "ts_rl_worker_new");
}

void ts_rl_worker_free(ts_rl_worker_t *w)
{
    if (w == NULL)
        return;
    /* Leave the adds a bounded time to be answered (and their failures to be reported). */
    (void)ts_rl_worker_flush(w, w->timeout_ms);

    /* From here no event is reported; wait for those being reported now. */
    pthread_mutex_lock(&w->mu);
    assert(!rl_on_io_thread(w));
    w->closing = 1;
    while (w->emitting > 0)
        pthread_cond_wait(&w->cond, &w->mu);
    pthread_mutex_unlock(&w->mu);

    /* After this no notification reaches w (a running one finishes first: it holds sub->mu). */
    (void)ts_unlisten(w->client, w->params_bin);
    pthread_mutex_lock(&w->sub->mu);
    w->sub->w = NULL;
    pthread_mutex_unlock(&w->sub->mu);
    rl_sub_unref(w->sub);

    /*
     * Every accepted request gets exactly one callback (TS_ECANCELED at the latest when the
     * client is freed): when some are still in flight, the last of them frees w.
     */
    pthread_mutex_lock(&w->mu);
    int now = w->stats.in_flight == 0 && !w->peek_in_flight;
    if (!now)
        w->orphaned = 1;
    pthread_mutex_unlock(&w->mu);
    if (now)
        rl_worker_destroy(w);
}

int ts_rl_worker_params(ts_rl_worker_t *w, ts_rl_params_t **out)
{
    assert(w != NULL && out != NULL);
    pthread_mutex_lock(&w->mu);
    ts_rl_params_t *p = w->current;
    if (p == NULL) {
        pthread_mutex_unlock(&w->mu);
        return ts__fail(TS_ENOENT, "no parameters have been published to '%s' yet", w->params_bin);
    }
    ts_rl_params_retain(p);
    w->retrieved = p->version;
    w->stats.retrieved_version = p->version;
    pthread_mutex_unlock(&w->mu);
    *out = p;
    return 0;
}

int ts_rl_worker_await(ts_rl_worker_t *w, int timeout_ms, ts_rl_params_t **out)
{
    assert(w != NULL && out != NULL);
    int rc = ts__rl_timeout(timeout_ms, w->timeout_ms, &timeout_ms);
    if (rc != 0)
        return rc;
    int64_t deadline = ts__rl_deadline(timeout_ms);
    pthread_mutex_lock(&w->mu);
    /* The check and the wait are under one lock, so no update can slip between them. */
    while (w->current == NULL || w->current->version <= w->retrieved) {
        if (timeout_ms == 0) {
            pthread_mutex_unlock(&w->mu);
            return ts__fail(TS_ETIMEDOUT, "no newer parameters");
        }
        if (rl_on_io_thread(w)) {
            pthread_mutex_unlock(&w->mu);
            return ts__fail(TS_EDEADLK, "ts_rl_worker_await called from a client callback");
        }
        if (ts__rl_cond_wait_until(&w->cond, &w->mu, deadline) == ETIMEDOUT &&
            (w->current == NULL || w->current->version <= w->retrieved)) {
            pthread_mutex_unlock(&w->mu);
            return ts__fail(TS_ETIMEDOUT, "no newer parameters within the timeout");
        }
    }
    ts_rl_params_t *p = ts_rl_params_retain(w->current);
    w->retrieved = p->version;
    w->stats.retrieved_version = p->version;
    pthread_mutex_unlock(&w->mu);
    *out = p;
    return 0;
}

/* Completion of an experience append (I/O thread). */
static void rl_add_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    (void)res;
    rl_add_t *a = arg;
    ts_rl_worker_t *w = a->w;
    /* Report before the count drops: from then on ts_rl_worker_free may free w. */
    if (status != 0)
        rl_emit(w, TS_RL_EV_ADD_FAILED, status, -1);
    pthread_mutex_lock(&w->mu);
    rl_note_io_thread(w);
    w->stats.in_flight--;
    w->bytes_in_flight -= a->bytes;
    if (status == 0) {
        w->stats.added++;
    } else {
        w->stats.add_failed++;
        if (w->first_error == 0)
            w->first_error = status;
    }
    pthread_cond_broadcast(&w->cond);
    int last = rl_last_out(w);
    pthread_mutex_unlock(&w->mu);
    ts__free(a);
    if (last)
        rl_worker_destroy(w);
}

/* 1 when an item of size bytes fits the in-flight bounds now. Under w->mu. */
static int rl_has_room(const ts_rl_worker_t *w, size_t bytes)
{
    if (w->stats.in_flight == 0)
        return 1;
    if (w->stats.in_flight >= w->max_in_flight)
        return 0;
    return w->bytes_in_flight + bytes <= w->max_in_flight_bytes;
}

/*
 * An add into a replay table: one blocking insert (the table's rate limiter may hold it on the
 * server), in slices of RL_WAIT_SLICE_MS up to the options' timeout.
 */
static int rl_worker_insert(ts_rl_worker_t *w, const ts_value_t *data, unsigned flags)
{
    if (rl_on_io_thread(w))
        return TS_EDEADLK;
    pthread_mutex_lock(&w->mu);
    int64_t version = w->retrieved;
    pthread_mutex_unlock(&w->mu);
    ts_value_t *rec = ts__rl_wrap("data", data, version);
    if (rec == NULL)
        return TS_ENOMEM;
    int64_t deadline = (flags & TS_RL_NONBLOCK) ? ts__rl_now_ms() : ts__rl_deadline(w->timeout_ms);
    int rc;
    for (;;) {
        int64_t left = deadline < 0 ? RL_WAIT_SLICE_MS : deadline - ts__rl_now_ms();
        if (left < 0)
            left = 0;
        if (left > RL_WAIT_SLICE_MS)
            left = RL_WAIT_SLICE_MS;
        rc = ts_table_insert(w->client, w->data_bin, rec, w->priority, (int)left, NULL);
        if (rc != TS_ETIMEDOUT || (deadline >= 0 && ts__rl_now_ms() >= deadline))
            break;
    }
    ts_value_free(rec);
    pthread_mutex_lock(&w->mu);
    if (rc == 0)
        w->stats.added++;
    else
        w->stats.add_failed++;
    pthread_mutex_unlock(&w->mu);
    return rc;
}

static int rl_worker_add(ts_rl_worker_t *w, const ts_value_t *data, unsigned flags)
{
    if (w->replay)
        return rl_worker_insert(w, data, flags);
    rl_add_t *a = ts__malloc(sizeof(*a));
    if (a == NULL)
        return TS_ENOMEM;
    a->w = w;

    /*
     * Build with the current tag first to learn the size; the tag is rewritten below if
     * another thread retrieves newer parameters while we wait for room.
     */
    pthread_mutex_lock(&w->mu);
    int64_t version = w->retrieved;
    pthread_mutex_unlock(&w->mu);
    ts_value_t *rec = ts__rl_wrap("data", data, version);
    if (rec == NULL) {
        ts__free(a);
        return TS_ENOMEM;
    }
    a->bytes = ts_value_encoded_size(rec);
    if (a->bytes == 0) {
        ts_value_free(rec);
        ts__free(a);
        return TS_EMSGSIZE;
    }

    int64_t deadline = ts__rl_deadline(w->timeout_ms);
    int rc = 0, reserved = 0;
    pthread_mutex_lock(&w->mu);
    while (!rl_has_room(w, a->bytes)) {
        if (flags & TS_RL_NONBLOCK) {
            rc = ts__fail(TS_EAGAIN, "max_in_flight adds are in flight already");
            break;
        }
        if (rl_on_io_thread(w)) {
            rc = TS_EDEADLK;
            break;
        }
        if (ts__rl_cond_wait_until(&w->cond, &w->mu, deadline) == ETIMEDOUT &&
            !rl_has_room(w, a->bytes)) {
            rc = TS_ETIMEDOUT;
            break;
        }
    }
    if (rc == 0) {
        w->stats.in_flight++;
        w->bytes_in_flight += a->bytes;
        reserved = 1;
        version = w->retrieved;
    }
    pthread_mutex_unlock(&w->mu);
    if (rc == 0)
        rc = ts_map_set(rec, "version", ts_int_new(version));
    if (rc == 0)
        rc = ts_append_async(w->client, w->data_bin, rec, flags & TS_COPY, rl_add_cb, a);
    ts_value_free(rec); /* the request holds what it needs (metadata encoded, data pointers) */
    if (rc != 0) {
        pthread_mutex_lock(&w->mu);
        if (reserved) {
            /* The request was not accepted: give its slot back. */
            w->stats.in_flight--;
            w->bytes_in_flight -= a->bytes;
            pthread_cond_broadcast(&w->cond);
        }
        pthread_mutex_unlock(&w->mu);
        ts__free(a);
    }
    return rc;
}

int ts_rl_worker_add(ts_rl_worker_t *w, const ts_value_t *data, unsigned flags)
{
    assert(w != NULL && data != NULL);
    ts_set_last_error(NULL);
    return ts__rl_done(rl_worker_add(w, data, flags), "ts_rl_worker_add");
}

int ts_rl_worker_flush(ts_rl_worker_t *w, int timeout_ms)
{
    assert(w != NULL);
    int rc = ts__rl_timeout(timeout_ms, w->timeout_ms, &timeout_ms);
    if (rc != 0)
        return rc;
    int64_t deadline = ts__rl_deadline(timeout_ms);
    pthread_mutex_lock(&w->mu);
    while (w->stats.in_flight > 0) {
        if (timeout_ms == 0 || rl_on_io_thread(w)) {
            rc = timeout_ms == 0 ? TS_ETIMEDOUT : TS_EDEADLK;
            break;
        }
        if (ts__rl_cond_wait_until(&w->cond, &w->mu, deadline) == ETIMEDOUT &&
            w->stats.in_flight > 0) {
            rc = TS_ETIMEDOUT;
            break;
        }
    }
    if (rc == 0) {
        rc = w->first_error;
        w->first_error = 0;
    }
    pthread_mutex_unlock(&w->mu);
    if (rc == TS_ETIMEDOUT)
        ts__set_errorf("adds still in flight after the timeout");
    else if (rc == TS_EDEADLK)
        ts__set_errorf("ts_rl_worker_flush called from a client callback");
    else if (rc != 0)
        ts__set_errorf("an experience item was not stored: %s", ts_strerror(rc));
    return rc;
}

void ts_rl_worker_stats(ts_rl_worker_t *w, ts_rl_worker_stats_t *out)
{
    assert(w != NULL && out != NULL);
    pthread_mutex_lock(&w->mu);
    *out = w->stats;
    pthread_mutex_unlock(&w->mu);
    out->connected = ts_client_connected(w->client);
}
