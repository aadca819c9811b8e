/*
 * The client core: ownership of requests and subscriptions, deadlines, completion, the inbox and
 * the I/O thread (io_main, io_shutdown), opening and closing a client.
 *
 * The other parts of the I/O thread live beside it: conn.c (connecting, the handshake,
 * reconnecting with backoff, resubscribing), send.c (frames and writes), recv.c (reading and
 * dispatching replies and notifications) and direct.c (the caller-side fast path of blocking
 * calls). Application threads never touch the loop: they hand requests over through the inbox
 * (under mu) and wake the loop with uv_async_send, except for a blocking call's own write and
 * read (direct.c). Everything here that is not marked otherwise runs on the I/O thread.
 */
#include "internal.h"

#include "msg.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* bytes; the most max_reply_bytes may be set to (keeps the compressed-size arithmetic safe) */
#define TS__MAX_REPLY_BODY ((uint64_t)1 << 40)
/* ms; ts_client_open waits this past the connect timeout for the I/O thread's verdict */
#define TS__OPEN_GRACE_MS 2000
/* bytes of freed large receive buffers kept for reuse, process-wide (two buffers at most) */
#define TS__RECV_CACHE_BYTES ((size_t)512 << 20)
/* requests gathered into one write at most (see ts__req_send_batch) */
#define TS__SEND_BATCH 64
/* expired requests the deadline timer collects per pass over the in-flight map */
#define TS__TICK_BATCH 64

/* The client whose I/O thread this is (NULL on application threads). */
static _Thread_local ts_client_t *tls_io_client;

int ts__on_io_thread(const ts_client_t *c)
{
    /* A cluster's shards count as one client: a blocking call from any of their threads waits. */
    return tls_io_client != NULL && (tls_io_client == c || tls_io_client->pub == c->pub);
}

int ts__io_thread_is(const ts_client_t *c)
{
    return tls_io_client == c;
}

/* ---------------------------------------------------------------------------------------------
 * Requests and subscriptions: ownership helpers
 */

void ts__sub_unref(ts__sub *s)
{
    if (s == NULL || atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) != 1)
        return;
    ts__free(s->bin);
    ts__free(s);
}

void ts__req_free(ts__req *r)
{
    if (r == NULL)
        return;
    if (r->enc.head != NULL)
        ts__enc_free(&r->enc);
    if (r->flat != NULL)
        ts__free_aligned(r->flat, r->flat_cap);
    ts__free(r->msg);
    ts_items_free(r->res.items);
    ts_bin_list_free(r->res.bins);
    ts_value_free(r->res.value);
    ts__sub_unref(r->sub);
    ts__free(r->ws_addr);
    ts__shard_map_free(r->shard_map);
    if (r->kind == TS__K_BLOCK)
        pthread_cond_destroy(&r->cond);
    ts__free(r);
}

/* Remove s from c->subs; mu held. The caller owns the list's reference afterwards. */
static void sub_unlink_locked(ts_client_t *c, ts__sub *s)
{
    for (ts__sub **p = &c->subs; *p != NULL; p = &(*p)->next) {
        if (*p == s) {
            *p = s->next;
            break;
        }
    }
    s->next = NULL;
    s->linked = 0;
}

/* Reverse a chain built through io_next (to deliver in subscription order). */
ts__sub *ts__sub_chain_reverse(ts__sub *s)
{
    ts__sub *out = NULL;
    while (s != NULL) {
        ts__sub *next = s->io_next;
        s->io_next = out;
        out = s;
        s = next;
    }
    return out;
}

/* Deliver one notification-shaped event to a subscription's callback. */
void ts__sub_event(ts_client_t *c, ts__sub *s, ts_event_t event, int coalesced)
{
    if (s->final_done)
        return;
    ts_notification_t n = {.bin = s->bin,
                           .event = event,
                           .version = s->version,
                           .n_items = s->n_items,
                           .coalesced = coalesced};
    s->cb(c->pub, 0, &n, s->arg);
}

/* Deliver a subscription's final callback (once). */
void ts__sub_final(ts_client_t *c, ts__sub *s, int status)
{
    if (s->final_done)
        return;
    s->final_done = 1;
    /* The final call always carries a failure; its reason is in ts_last_error(). */
    ts_set_last_error(ts_strerror(status));
    s->cb(c->pub, status, NULL, s->arg);
}

/* ---------------------------------------------------------------------------------------------
 * Deadlines
 */

void ts__append_waitq(ts_client_t *c, ts__req *r)
{
    r->next = NULL;
    if (c->waitq_tail != NULL)
        c->waitq_tail->next = r;
    else
        c->waitq_head = r;
    c->waitq_tail = r;
}

static void tick_cb(uv_timer_t *t);

/* Make sure the deadline timer runs while requests are waiting or in flight. */
void ts__ensure_tick(ts_client_t *c)
{
    if (c->tick_on || c->state == TS__ST_CLOSED)
        return;
    c->tick_on = 1;
    uv_timer_start(&c->tick, tick_cb, TS__TICK_MS, TS__TICK_MS);
}

/* 1 when a blocking request's caller has given up on it (it is then freed on completion). */
static int req_abandoned(ts_client_t *c, ts__req *r)
{
    if (r->kind != TS__K_BLOCK)
        return 0;
    pthread_mutex_lock(&c->mu);
    int a = ts__req_abandoned_locked(r);
    pthread_mutex_unlock(&c->mu);
    return a;
}

/*
 * Complete a request with status: remove it from the in-flight map, and finish it now, or once
 * its write has called back (libuv may still read the frame's memory until then).
 */
void ts__req_complete(ts_client_t *c, ts__req *r, int status)
{
    if (r->in_map) {
        ts__idmap_del(&c->inflight, r->id);
        r->in_map = 0;
    }
    if (r->wstate != TS__W_NONE) {
        r->status = status;
        r->wstate = TS__W_FINISH_CB;
        return;
    }
    ts__req_finish(c, r, status);
}

/* Give r the message msg (NULL: none) for ts_last_error() in blocking calls and callbacks. */
void ts__req_set_msg(ts__req *r, const char *msg)
{
    if (msg != NULL && r->msg == NULL)
        r->msg = ts__strndup(msg, strlen(msg)); /* on failure the status alone tells */
}

/*
 * Fail every in-flight request with err (and the message msg, or NULL). They are collected first
 * because completing one runs user code that may queue new requests.
 */
void ts__fail_inflight(ts_client_t *c, int err, const char *msg)
{
    ts__req *list = NULL;
    for (size_t i = 0; i < c->inflight.cap; i++) {
        if (c->inflight.keys[i] == 0)
            continue;
        ts__req *r = c->inflight.vals[i];
        r->in_map = 0;
        r->next = list;
        list = r;
    }
    ts__idmap_free(&c->inflight);
    /* Complete them oldest first (ids grow; the list came out in slot order). */
    ts__req *sorted = NULL;
    while (list != NULL) {
        ts__req *r = list;
        list = r->next;
        ts__req **p = &sorted;
        while (*p != NULL && (*p)->id - r->id < 0x80000000u)
            p = &(*p)->next;
        r->next = *p;
        *p = r;
    }
    while (sorted != NULL) {
        ts__req *r = sorted;
        sorted = r->next;
        r->next = NULL;
        ts__req_set_msg(r, msg);
        ts__req_complete(c, r, err);
    }
}

void ts__fail_list(ts_client_t *c, ts__req *list, int err, const char *msg)
{
    while (list != NULL) {
        ts__req *r = list;
        list = r->next;
        r->next = NULL;
        ts__req_set_msg(r, msg);
        ts__req_finish(c, r, err);
    }
}

static void tick_cb(uv_timer_t *t)
{
    ts_client_t *c = t->data;
    uint64_t now = ts__now_ns();

    /* Requests waiting for a connection. */
    ts__req **p = &c->waitq_head;
    ts__req *last = NULL;
    ts__req *expired = NULL;
    while (*p != NULL) {
        ts__req *r = *p;
        if ((r->deadline_ns != 0 && r->deadline_ns <= now) || req_abandoned(c, r)) {
            *p = r->next;
            r->next = expired;
            expired = r;
        } else {
            last = r;
            p = &r->next;
        }
    }
    c->waitq_tail = last;
    if (expired != NULL) {
        /* They waited for a connection in vain: say why there is none, when the client knows. */
        char why[sizeof(c->down_msg) + 64];
        snprintf(why, sizeof(why), TS__NO_CONN_MSG_PREFIX "%s" TS__NO_CONN_MSG_SUFFIX,
                 c->down_msg[0] != '\0' ? c->down_msg : c->address);
        while (expired != NULL) {
            ts__req *r = expired;
            expired = r->next;
            ts__req_set_msg(r, why);
            ts__req_finish(c, r, TS_ETIMEDOUT);
        }
    }

    /*
     * Requests in flight, collected by id and looked up again one by one: completing one runs
     * code that may change the map (and a failed write would complete the others already).
     */
    int cut = 0;
    for (;;) {
        uint32_t ids[TS__TICK_BATCH];
        size_t k = 0;
        for (size_t i = 0; i < c->inflight.cap && k < TS__ARRAY_SIZE(ids); i++) {
            if (c->inflight.keys[i] == 0)
                continue;
            const ts__req *r = c->inflight.vals[i];
            if (r->deadline_ns != 0 && r->deadline_ns <= now)
                ids[k++] = c->inflight.keys[i];
        }
        for (size_t j = 0; j < k; j++) {
            ts__req *r = ts__idmap_get(&c->inflight, ids[j]);
            if (r == NULL)
                continue;
            /* A frame still being written cannot be withdrawn: the connection has to go. */
            cut |= r->wstate != TS__W_NONE;
            ts__req_set_msg(r, TS__NO_REPLY_MSG);
            ts__req_complete(c, r, TS_ETIMEDOUT);
        }
        if (k < TS__ARRAY_SIZE(ids))
            break;
    }
    if (cut && c->conn != NULL)
        ts__conn_fail(c, c->conn, TS_ETIMEDOUT, "a request timed out while its frame was written");

    if (c->waitq_head == NULL && c->inflight.n == 0 && c->tick_on) {
        uv_timer_stop(&c->tick);
        c->tick_on = 0;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Completion
 */

/*
 * The blocking side of completion: hand the result to the waiting thread. Once done is set and
 * mu released, the waiter may free r at any moment, so everything r is needed for comes first.
 */
static void finish_blocking(ts_client_t *c, ts__req *r, int status)
{
    ts__sub *s = r->op == TS_OP_LISTEN ? r->sub : NULL;
    ts__sub *drop = NULL;
    ts__sub *unlisten = NULL;
    pthread_mutex_lock(&c->mu);
    r->wbusy = 0;
    if (s != NULL) {
        if (status == 0 && !ts__req_abandoned_locked(r) && !c->closing) {
            s->live = 1;
            s->on_conn = 1;
            s->version = r->res.version;
            s->n_items = r->res.n_items;
        } else {
            if (s->linked) {
                sub_unlink_locked(c, s);
                drop = s;
            }
            if (status == 0 && !c->closing) {
                /* The server registered a listener nobody waits for: take it back. */
                atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
                unlisten = s;
            } else if (status == 0) {
                status = TS_ECANCELED;
            }
        }
    }
    /* An abandoned request is ours to free, unless its caller still waits on it. */
    int ours = r->bstate == TS__B_ABANDONED;
    if (!ours) {
        r->status = status;
        r->bstate = TS__B_DONE;
        pthread_cond_signal(&r->cond);
    }
    pthread_mutex_unlock(&c->mu);
    if (unlisten != NULL) {
        ts__send_fire_unlisten(c, unlisten->bin, unlisten->bin_len);
        ts__sub_unref(unlisten);
    }
    ts__sub_unref(drop);
    if (ours)
        ts__req_free(r);
}

/* A re-sent LISTEN after a reconnect has its answer. */
static void finish_resub(ts_client_t *c, ts__req *r, int status)
{
    ts__sub *s = r->sub;
    pthread_mutex_lock(&c->mu);
    int linked = s->linked;
    pthread_mutex_unlock(&c->mu);
    if (status == 0) {
        if (linked && !s->final_done) {
            s->on_conn = 1;
            s->version = r->res.version;
            s->n_items = r->res.n_items;
            ts__sub_event(c, s, TS_EV_RESUBSCRIBED, 0);
        }
    } else if (status == TS_ENOMEM) {
        /* Not the server's verdict: try again on a fresh connection after the backoff. */
        if (c->state == TS__ST_READY && (r->conn == NULL || r->conn == c->conn))
            ts__conn_fail(c, c->conn, TS_ENOMEM, "out of memory while resubscribing");
    } else if (status != TS_ECONNRESET && status != TS_ECANCELED && status != TS_ETIMEDOUT &&
               status != TS_EPROTO) {
        /* The server refused the subscription: it ends here. */
        pthread_mutex_lock(&c->mu);
        int own = s->linked;
        if (own)
            sub_unlink_locked(c, s);
        pthread_mutex_unlock(&c->mu);
        ts__sub_final(c, s, status);
        if (own)
            ts__sub_unref(s);
    }
    /*
     * Connection errors (a malformed reply drops the connection too) leave it for the next
     * reconnect.
     */
}

/* Finish a request: deliver its result to whoever waits for it, then release it. */
void ts__req_finish(ts_client_t *c, ts__req *r, int status)
{
    switch (r->kind) {
    case TS__K_ASYNC: {
        /* A cluster's shard that does not own the name: the owner answers instead. */
        if (status == TS_EWRONGSHARD && c->shard != NULL && ts__cluster_redirect_async(c, r))
            break;
        ts_result_t res = r->res;
        memset(&r->res, 0, sizeof(r->res));
        /* A failure's message is read by the callback with ts_last_error() on this thread. */
        if (status < 0)
            ts_set_last_error(r->msg != NULL ? r->msg : ts_strerror(status));
        if (r->cb != NULL)
            r->cb(c->pub, status, &res, r->arg);
        ts_items_free(res.items);
        ts_bin_list_free(res.bins);
        ts_value_free(res.value);
        ts__req_free(r);
        break;
    }
    case TS__K_BLOCK:
        finish_blocking(c, r, status);
        break;
    case TS__K_HELLO:
        if (r->conn == c->conn && c->state == TS__ST_HELLO)
            ts__hello_done(c, r, status);
        ts__req_free(r);
        break;
    case TS__K_RESUB:
        finish_resub(c, r, status);
        ts__req_free(r);
        break;
    case TS__K_UNLISTEN:
        ts__sub_final(c, r->sub, TS_ECANCELED);
        ts__req_free(r);
        break;
    case TS__K_SHARDMAP:
        ts__cluster_map_done(c, r, status);
        ts__req_free(r);
        break;
    default: /* TS__K_FIRE */
        ts__req_free(r);
        break;
    }
}

/* ---------------------------------------------------------------------------------------------
 * The inbox, shutdown and the thread
 */

/* Take an unlisten off the queue: final callback now, then tell the server if connected. */
static void do_unlisten(ts_client_t *c, ts__req *r)
{
    ts__sub_final(c, r->sub, TS_ECANCELED);
    if (c->state != TS__ST_READY) {
        ts__req_free(r);
        return;
    }
    r->kind = TS__K_FIRE;
    ts__req_send(c, r);
}

static void async_cb(uv_async_t *a);

/* Send what callbacks of this loop iteration submitted (see ts__submit_locked). */
static void kick_cb(uv_prepare_t *p)
{
    ts_client_t *c = p->data;
    uv_prepare_stop(p);
    c->kicked = 0;
    async_cb(&c->async);
}

static void async_cb(uv_async_t *a)
{
    ts_client_t *c = a->data;
    pthread_mutex_lock(&c->mu);
    if (c->closing) {
        pthread_mutex_unlock(&c->mu);
        ts__io_shutdown(c);
        return;
    }
    ts__req *list = c->inbox_head;
    c->inbox_head = c->inbox_tail = NULL;
    ts__req *handoff = c->handoff;
    c->handoff = NULL;
    c->io_writes++; /* no direct write until this drain has started its writes */
    int take_back = c->rd_owner == TS__RD_IO && !c->reading;
    int broken = c->rd_broken;
    pthread_mutex_unlock(&c->mu);

    ts__fd_set_blocking(c, 0); /* before any write of this drain */
    if (broken && c->conn != NULL) {
        ts__conn_fail_broken(c, broken);
    } else if (take_back && c->state == TS__ST_READY) {
        ts__start_reading(c); /* a caller handed the socket back */
    }
    if (handoff != NULL)
        ts__write_handoff(c, handoff); /* the rest of a direct write goes first */
    if (c->state == TS__ST_IDLE)
        ts__start_attempt(c);
    ts__req *batch[TS__SEND_BATCH];
    size_t nb = 0;
    while (list != NULL) {
        ts__req *r = list;
        list = r->next;
        r->next = NULL;
        if (r->kind != TS__K_UNLISTEN && c->state == TS__ST_READY && c->waitq_head == NULL) {
            /* Gathered and written together (see ts__req_send_batch). */
            batch[nb++] = r;
            if (nb == TS__SEND_BATCH) {
                ts__req_send_batch(c, batch, nb);
                nb = 0;
            }
            continue;
        }
        if (nb > 0) {
            ts__req_send_batch(c, batch, nb);
            nb = 0;
        }
        const char *down_msg;
        if (c->state == TS__ST_CLOSED) {
            ts__req_finish(c, r, TS_ECANCELED);
        } else if (c->shard != NULL && c->state != TS__ST_READY && r->kind != TS__K_UNLISTEN &&
                   ts__cluster_shard_down(c, &down_msg)) {
            /* A cluster's shard that is down fails its requests at once (docs/CLUSTER.md). */
            ts__req_set_msg(r, down_msg);
            ts__req_finish(c, r, TS_ENOTCONN);
        } else if (r->kind == TS__K_UNLISTEN) {
            do_unlisten(c, r);
        } else if (c->state == TS__ST_READY && c->waitq_head == NULL) {
            ts__req_send(c, r);
        } else {
            ts__append_waitq(c, r);
            ts__ensure_tick(c);
        }
    }
    if (nb > 0)
        ts__req_send_batch(c, batch, nb);
    ts__io_write_end(c);
    ts__io_want_read(c);
}

/* Close everything: pending requests get TS_ECANCELED, subscriptions their final callback. */
void ts__io_shutdown(ts_client_t *c)
{
    if (c->state == TS__ST_CLOSED)
        return;
    c->state = TS__ST_CLOSED;
    c->gen++;
    atomic_store(&c->connected, 0);
    uv_timer_stop(&c->retry);
    uv_timer_stop(&c->tick);
    c->tick_on = 0;
    ts__req *dlist = ts__direct_stop(c); /* before the descriptor closes */
    /* Closing the socket first guarantees that no cancelled put's memory is read any more. */
    if (c->conn != NULL) {
        ts__conn_close(c->conn);
        c->conn = NULL;
    }
    c->reading = 0;
    pthread_mutex_lock(&c->mu);
    c->closing = 1;
    ts__req *list = c->inbox_head;
    c->inbox_head = c->inbox_tail = NULL;
    ts__sub *subs = c->subs;
    c->subs = NULL;
    for (ts__sub *s = subs; s != NULL; s = s->next)
        s->linked = 0;
    pthread_mutex_unlock(&c->mu);
    ts__svc_close(c); /* its registrations (service.c) */

    while (list != NULL) {
        ts__req *r = list;
        list = r->next;
        r->next = NULL;
        ts__req_finish(c, r, TS_ECANCELED);
    }
    while (c->waitq_head != NULL) {
        ts__req *r = c->waitq_head;
        c->waitq_head = r->next;
        r->next = NULL;
        ts__req_finish(c, r, TS_ECANCELED);
    }
    c->waitq_tail = NULL;
    ts__fail_inflight(c, TS_ECANCELED, NULL);
    ts__fail_list(c, dlist, TS_ECANCELED, NULL);
    while (subs != NULL) {
        ts__sub *s = subs;
        subs = s->next;
        s->next = NULL;
        if (s->live)
            ts__sub_final(c, s, TS_ECANCELED);
        ts__sub_unref(s);
    }
    uv_close((uv_handle_t *)&c->async, NULL);
    uv_close((uv_handle_t *)&c->kick, NULL);
    uv_close((uv_handle_t *)&c->quiet, NULL);
    uv_close((uv_handle_t *)&c->tick, NULL);
    uv_close((uv_handle_t *)&c->retry, NULL);
}

static void client_destroy(ts_client_t *c)
{
    /*
     * Threads still blocked in calls on c have had their requests completed (TS_ECANCELED);
     * wait until the last of them has stopped touching c (see wait_done).
     */
    ts__lane_cancel(c); /* a by-reference call blocked on the lane returns now */
    pthread_mutex_lock(&c->mu);
    while (c->waiters > 0)
        pthread_cond_wait(&c->open_cond, &c->mu);
    pthread_mutex_unlock(&c->mu);
    ts__lane_destroy(c);
    ts__client_tls_free(c);
    ts__idmap_free(&c->inflight);
    ts__idmap_free(&c->direct);
    ts__free(c->pb);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->open_cond);
    pthread_cond_destroy(&c->rd_cond);
    pthread_condattr_destroy(&c->condattr);
    ts__free(c->address);
    ts__free(c->host);
    ts__free(c->unix_path);
    ts__free(c->token);
    ts__free(c);
}

static void *io_main(void *arg)
{
    ts_client_t *c = arg;
    /*
     * A write to a connection the server has closed raises SIGPIPE in the writing thread,
     * which would kill the program; blocked here, libuv's writes fail with EPIPE instead
     * (direct writes on other threads pass MSG_NOSIGNAL).
     */
    sigset_t pipe_set;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_set, NULL);
    tls_io_client = c;
    uv_run(&c->loop, UV_RUN_DEFAULT);
    uv_loop_close(&c->loop);
    tls_io_client = NULL;
    if (c->free_on_exit) {
        /* ts_client_free was called from a callback: nobody joins this thread. */
        pthread_detach(pthread_self());
        if (c->shard != NULL)
            ts__cluster_destroy(c->pub); /* every shard client, this one included */
        else
            client_destroy(c);
    }
    return NULL;
}

int ts__submit_locked(ts_client_t *c, ts__req *r)
{
    if (c->closing)
        return TS_ECANCELED;
    r->next = NULL;
    if (r->kind == TS__K_BLOCK)
        c->waiters++; /* until wait_done (api.c) lets go of the client */
    if (c->inbox_tail != NULL)
        c->inbox_tail->next = r;
    else
        c->inbox_head = r;
    c->inbox_tail = r;
    if (tls_io_client == c) {
        /*
         * From a callback: the loop is running on this very thread, so the kick handle sends the
         * request before the loop waits again, together with whatever else the callbacks of
         * this iteration submit, without a system call to wake the loop.
         */
        if (!c->kicked) {
            c->kicked = 1;
            uv_prepare_start(&c->kick, kick_cb);
        }
        return 0;
    }
    /* Under mu, so the I/O thread cannot have closed the handle (it sets closing first). */
    uv_async_send(&c->async);
    return 0;
}

int ts__submit(ts_client_t *c, ts__req *r)
{
    pthread_mutex_lock(&c->mu);
    int rc = ts__submit_locked(c, r);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * Opening and closing
 */

void ts_client_options_init(ts_client_options_t *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->connect_timeout_ms = 5000;
    opts->request_timeout_ms = 30000;
    opts->reconnect_min_ms = 50;
    opts->reconnect_max_ms = 2000;
    opts->auth_token = NULL;
    opts->compress_min = 0;
    opts->max_reply_bytes = TS_DEFAULT_MAX_REPLY_BYTES;
}

/*
 * A timeout option: positive milliseconds, or TS_TIMEOUT_DEFAULT for the default already in
 * *out. 0 or TS_EINVAL (0 and TS_TIMEOUT_INFINITE are refused: every request needs a deadline).
 */
static int option_timeout(int value, const char *name, int *out)
{
    if (value == TS_TIMEOUT_DEFAULT)
        return 0;
    if (value <= 0)
        return ts__fail(TS_EINVAL, "%s %d: expected positive milliseconds or TS_TIMEOUT_DEFAULT",
                        name, value);
    *out = value;
    return 0;
}

/*
 * The length of token without its trailing spaces, tabs, CRs and LFs: tensord drops the same
 * from its own token, so that a token file written with a newline works on both sides.
 */
static size_t token_trim(const char *t, size_t n)
{
    while (n > 0 && (t[n - 1] == '\n' || t[n - 1] == '\r' || t[n - 1] == ' ' || t[n - 1] == '\t'))
        n--;
    return n;
}

/* Copy opts with defaults for unset fields. */
static int setup_options(ts_client_t *c, const ts_client_options_t *opts)
{
    ts_client_options_init(&c->opts);
    if (opts != NULL) {
        int rc = option_timeout(opts->connect_timeout_ms, "connect_timeout_ms",
                                &c->opts.connect_timeout_ms);
        if (rc == 0)
            rc = option_timeout(opts->request_timeout_ms, "request_timeout_ms",
                                &c->opts.request_timeout_ms);
        if (rc == 0)
            rc = option_timeout(opts->reconnect_min_ms, "reconnect_min_ms",
                                &c->opts.reconnect_min_ms);
        if (rc == 0)
            rc = option_timeout(opts->reconnect_max_ms, "reconnect_max_ms",
                                &c->opts.reconnect_max_ms);
        if (rc != 0)
            return rc;
        if (c->opts.reconnect_max_ms < c->opts.reconnect_min_ms)
            return ts__fail(TS_EINVAL, "reconnect_max_ms %d is below reconnect_min_ms %d",
                            c->opts.reconnect_max_ms, c->opts.reconnect_min_ms);
        c->opts.compress_min = opts->compress_min;
        if (opts->max_reply_bytes > 0)
            c->opts.max_reply_bytes = opts->max_reply_bytes < TS__MAX_REPLY_BODY
                                          ? opts->max_reply_bytes
                                          : TS__MAX_REPLY_BODY;
    }
    c->opts.auth_token = NULL;
    int from_env = opts == NULL || opts->auth_token == NULL;
    const char *token = from_env ? getenv("TS_AUTH_TOKEN") : opts->auth_token;
    if (token != NULL && token[0] != '\0') {
        /* tensord's rule (server/main.c): a newline left by an editor or echo is not part of it. */
        c->token_len = token_trim(token, strlen(token));
        if (c->token_len == 0)
            return ts__fail(TS_EINVAL, "%s is empty after trimming trailing whitespace",
                            from_env ? "TS_AUTH_TOKEN" : "auth_token");
        if (c->token_len > TS_MAX_TOKEN_LEN)
            return ts__fail(TS_EINVAL, "auth token longer than %d bytes", TS_MAX_TOKEN_LEN);
        c->token = ts__strndup(token, c->token_len);
        if (c->token == NULL)
            return TS_ENOMEM;
    }
    return 0;
}

/* Set up the loop and its handles (on the opening thread, before the I/O thread exists). */
static int setup_loop(ts_client_t *c)
{
    int rc = uv_loop_init(&c->loop);
    if (rc != 0)
        return TS_ENOMEM;
    uv_async_init(&c->loop, &c->async, async_cb);
    c->async.data = c;
    uv_timer_init(&c->loop, &c->tick);
    c->tick.data = c;
    uv_timer_init(&c->loop, &c->retry);
    c->retry.data = c;
    uv_prepare_init(&c->loop, &c->kick);
    c->kick.data = c;
    uv_prepare_init(&c->loop, &c->quiet);
    c->quiet.data = c;
    uv_prepare_start(&c->quiet, ts__quiet_cb);
    return 0;
}

int ts__client_start(ts_client_t **out, const char *address, const ts_client_options_t *opts,
                     ts_client_t *pub, struct ts__cluster_shard *shard)
{
    /*
     * Large received bodies are released into a small process-wide cache, so that pulling the
     * same tensors again reuses the last buffer instead of faulting in and zeroing a fresh one.
     */
    ts__alloc_cache_enable(TS__RECV_CACHE_BYTES);
    ts_client_t *c = ts__calloc(1, sizeof(*c));
    if (c == NULL)
        return ts__fail(TS_ENOMEM, NULL);
    int rc = (c->address = ts__strndup(address, strlen(address))) == NULL ? TS_ENOMEM : 0;
    if (rc == 0) {
        rc = ts__parse_address(c, address);
        if (rc == TS_EINVAL)
            ts__set_errorf("malformed address '%s'", address);
    }
    if (rc == 0)
        rc = setup_options(c, opts);
    if (rc == 0)
        rc = ts__client_tls_setup(c, opts);
    if (rc != 0) {
        ts__free(c->address);
        ts__free(c->host);
        ts__free(c->unix_path);
        ts__free(c->token);
        ts__free(c);
        if (ts_last_error()[0] == '\0')
            ts_set_last_error(ts_strerror(rc));
        return rc;
    }
    c->pub = pub != NULL ? pub : c;
    c->shard = shard;
    /*
     * The benchmark switch TS_CLIENT_DIRECT=0 (docs/PERFORMANCE.md) is read here once, not on
     * every reconnect (see direct_allowed).
     */
    const char *direct = getenv("TS_CLIENT_DIRECT");
    c->direct_allowed = (direct == NULL || strcmp(direct, "0") != 0) && !c->tls;
    pthread_mutex_init(&c->mu, NULL);
    pthread_condattr_init(&c->condattr);
    pthread_condattr_setclock(&c->condattr, CLOCK_MONOTONIC);
    pthread_cond_init(&c->open_cond, &c->condattr);
    pthread_cond_init(&c->rd_cond, NULL);
    ts__lane_init(c);
    c->backoff_ms = c->opts.reconnect_min_ms;
    c->next_id = 1;
    c->d_next_id = 1;
    c->pb = ts__malloc(TS__STAGE_SIZE); /* NULL: replies are always read by the I/O thread */
    c->d_fd = -1;
    c->state = TS__ST_IDLE;
    if (setup_loop(c) != 0) {
        client_destroy(c);
        return ts__fail(TS_ENOMEM, "cannot set up the client's event loop");
    }
    uv_async_send(&c->async); /* the first thing the I/O thread does is connect */
    if (pthread_create(&c->thread, NULL, io_main, c) != 0) {
        uv_close((uv_handle_t *)&c->async, NULL);
        uv_close((uv_handle_t *)&c->kick, NULL);
        uv_close((uv_handle_t *)&c->quiet, NULL);
        uv_close((uv_handle_t *)&c->tick, NULL);
        uv_close((uv_handle_t *)&c->retry, NULL);
        uv_run(&c->loop, UV_RUN_DEFAULT);
        uv_loop_close(&c->loop);
        client_destroy(c);
        return ts__fail(TS_EAGAIN, "cannot start the client's I/O thread");
    }
    *out = c;
    return 0;
}

int ts__client_wait_open(ts_client_t *c, char *msg, size_t cap)
{
    uint64_t until =
        ts__now_ns() + (uint64_t)(c->opts.connect_timeout_ms + TS__OPEN_GRACE_MS) * 1000000u;
    struct timespec ts = {(time_t)(until / 1000000000u), (long)(until % 1000000000u)};
    pthread_mutex_lock(&c->mu);
    while (!c->open_done) {
        if (pthread_cond_timedwait(&c->open_cond, &c->mu, &ts) != 0 && !c->open_done) {
            c->open_status = TS_ETIMEDOUT;
            snprintf(c->open_msg, sizeof(c->open_msg), "%s: connect timed out", c->address);
            /* A plain client gives up; a cluster's shard goes on trying in the background. */
            if (!c->closing && c->shard == NULL) {
                c->closing = 1;
                uv_async_send(&c->async);
            }
            break;
        }
    }
    int rc = c->open_status;
    snprintf(msg, cap, "%s", c->open_msg);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

void ts__client_stop(ts_client_t *c)
{
    pthread_mutex_lock(&c->mu);
    if (!c->closing) {
        c->closing = 1;
        uv_async_send(&c->async);
    }
    pthread_mutex_unlock(&c->mu);
}

void ts__client_join(ts_client_t *c)
{
    pthread_join(c->thread, NULL);
}

void ts__client_destroy(ts_client_t *c)
{
    client_destroy(c);
}

int ts__client_setup_options(ts_client_t *c, const ts_client_options_t *opts)
{
    return setup_options(c, opts);
}

int ts_client_open(ts_client_t **out, const char *address, const ts_client_options_t *opts)
{
    if (out == NULL)
        return ts__fail(TS_EINVAL, "ts_client_open needs a place for the client (out is NULL)");
    if (address == NULL)
        return ts__fail(TS_EINVAL, "ts_client_open needs an address");
    ts__set_last_error(NULL, 0);
    if (ts__cluster_address(address))
        return ts__cluster_open(out, address, opts);
    ts_client_t *c;
    int rc = ts__client_start(&c, address, opts, NULL, NULL);
    if (rc != 0)
        return rc;
    char msg[sizeof(c->open_msg)];
    rc = ts__client_wait_open(c, msg, sizeof(msg));
    if (rc != 0) {
        pthread_join(c->thread, NULL);
        client_destroy(c);
        ts__set_last_error(msg, strnlen(msg, sizeof(msg)));
        if (msg[0] == '\0')
            ts_set_last_error(ts_strerror(rc));
        return rc;
    }
    *out = c;
    return 0;
}

void ts_client_free(ts_client_t *c)
{
    if (c == NULL)
        return;
    if (c->cl != NULL) {
        ts__cluster_free(c);
        return;
    }
    pthread_mutex_lock(&c->mu);
    int already = c->closing;
    if (!already) {
        c->closing = 1;
        uv_async_send(&c->async);
    }
    pthread_mutex_unlock(&c->mu);
    if (already)
        return; /* a second call (from a cancellation callback): the first one finishes */
    if (ts__on_io_thread(c)) {
        /* From a callback: the I/O thread finishes the job once the callback returns. */
        c->free_on_exit = 1;
        return;
    }
    pthread_join(c->thread, NULL);
    client_destroy(c);
}

int ts_client_connected(ts_client_t *c)
{
    if (c != NULL && c->cl != NULL)
        return ts__cluster_connected(c);
    return c != NULL && atomic_load(&c->connected) ? 1 : 0;
}
