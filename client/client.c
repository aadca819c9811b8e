/*
 * The client core: the I/O thread with its own libuv loop, the connection (connect, handshake,
 * reconnect with backoff), writing requests with writev, reading replies into 64-byte aligned
 * buffers, matching replies to requests by id, deadlines, subscriptions and shutdown.
 *
 * Application threads never touch the loop: they hand requests over through the inbox (under
 * mu) and wake the loop with uv_async_send, except that a blocking call may write its frame and
 * read its reply on its own thread when the connection is otherwise idle (see "Direct writes"
 * and "Reading replies on the calling thread"). Everything below that is not marked otherwise
 * runs on the I/O thread.
 */
#include "internal.h"

#include "compress.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* bytes; the most max_reply_bytes may be set to (keeps the compressed-size arithmetic safe) */
#define TS__MAX_REPLY_BODY ((uint64_t)1 << 40)
#define TS__OPEN_GRACE_MS                                                                          \
    2000 /* ms; ts_client_open waits this past the connect timeout for the                         \
            I/O thread's verdict */

/* Bytes of freed large receive buffers kept for reuse, process-wide (two buffers at most). */
#define TS__RECV_CACHE_BYTES ((size_t)512 << 20)

/* Requests gathered into one write at most (see req_send_batch). */
#define TS__SEND_BATCH 64

/* The client whose I/O thread this is (NULL on application threads). */
static _Thread_local ts_client_t *tls_io_client;

static void req_send(ts_client_t *c, ts__req *r);
static void req_complete(ts_client_t *c, ts__req *r, int status);
static void req_finish(ts_client_t *c, ts__req *r, int status);
static void conn_fail(ts_client_t *c, ts__conn *conn, int err, const char *msg);
static void conn_fail_reason(ts_client_t *c, ts__conn *conn, int err, const char *msg,
                             int server_reason);
static void write_handoff(ts_client_t *c, ts__req *r);
static void start_reading(ts_client_t *c);
static void fd_set_blocking(ts_client_t *c, int on);
static void process_stage(ts_client_t *c, ts__conn *conn);
static void start_attempt(ts_client_t *c);
static void io_shutdown(ts_client_t *c);

/* 1 when the environment variable name is set to "0" (a switch that is on by default). */
static int getenv_off(const char *name)
{
    const char *v = getenv(name);
    return v != NULL && strcmp(v, "0") == 0;
}

int ts__on_io_thread(const ts_client_t *c)
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
    if (r->has_enc)
        ts__enc_free(&r->enc);
    if (r->flat != NULL)
        ts__free_aligned(r->flat, r->flat_cap);
    ts__free(r->msg);
    ts_items_free(r->res.items);
    ts_bin_list_free(r->res.bins);
    ts_value_free(r->res.value);
    ts__sub_unref(r->sub);
    if (r->has_cond)
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
static ts__sub *sub_chain_reverse(ts__sub *s)
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
static void sub_event(ts_client_t *c, ts__sub *s, ts_event_t event, int coalesced)
{
    if (s->final_done)
        return;
    ts_notification_t n = {.bin = s->bin,
                           .event = event,
                           .version = s->version,
                           .n_items = s->n_items,
                           .coalesced = coalesced};
    s->cb(c, 0, &n, s->arg);
}

/* Deliver a subscription's final callback (once). */
static void sub_final(ts_client_t *c, ts__sub *s, int status)
{
    if (s->final_done)
        return;
    s->final_done = 1;
    s->cb(c, status, NULL, s->arg);
}

/* ---------------------------------------------------------------------------------------------
 * Deadlines
 */

static void append_waitq(ts_client_t *c, ts__req *r)
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
static void ensure_tick(ts_client_t *c)
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
    int a = r->abandoned;
    pthread_mutex_unlock(&c->mu);
    return a;
}

/*
 * Complete a request with status: remove it from the in-flight map, and finish it now, or once
 * its write has called back (libuv may still read the frame's memory until then).
 */
static void req_complete(ts_client_t *c, ts__req *r, int status)
{
    if (r->in_map) {
        ts__idmap_del(&c->inflight, r->id);
        r->in_map = 0;
    }
    if (r->wpending) {
        r->status = status;
        r->finish_on_write = 1;
        return;
    }
    req_finish(c, r, status);
}

/* Give r the message msg (NULL: none) for ts_client_last_error() and callbacks. */
static void req_set_msg(ts__req *r, const char *msg)
{
    if (msg != NULL && r->msg == NULL)
        r->msg = ts__strndup(msg, strlen(msg)); /* on failure the status alone tells */
}

/*
 * Fail every in-flight request with err (and the message msg, or NULL). They are collected first
 * because completing one runs user code that may queue new requests.
 */
static void fail_inflight(ts_client_t *c, int err, const char *msg)
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
        req_set_msg(r, msg);
        req_complete(c, r, err);
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
    while (expired != NULL) {
        ts__req *r = expired;
        expired = r->next;
        req_finish(c, r, TS_ETIMEDOUT);
    }

    /*
     * Requests in flight, collected by id and looked up again one by one: completing one runs
     * code that may change the map (and a failed write would complete the others already).
     */
    int cut = 0;
    for (;;) {
        uint32_t ids[64];
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
            cut |= r->wpending;
            req_complete(c, r, TS_ETIMEDOUT);
        }
        if (k < TS__ARRAY_SIZE(ids))
            break;
    }
    if (cut && c->conn != NULL)
        conn_fail(c, c->conn, TS_ETIMEDOUT, "a request timed out while its frame was written");

    if (c->waitq_head == NULL && c->inflight.n == 0 && c->tick_on) {
        uv_timer_stop(&c->tick);
        c->tick_on = 0;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Completion
 */

static void send_fire_unlisten(ts_client_t *c, const char *bin, size_t len);

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
        if (status == 0 && !r->abandoned && !c->closing) {
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
    /* An abandoned request is ours to free, unless its caller still waits on it (wwait). */
    int ours = r->abandoned && !r->wwait;
    if (!ours) {
        r->status = status;
        r->done = 1;
        pthread_cond_signal(&r->cond);
    }
    pthread_mutex_unlock(&c->mu);
    if (unlisten != NULL) {
        send_fire_unlisten(c, unlisten->bin, unlisten->bin_len);
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
            sub_event(c, s, TS_EV_RESUBSCRIBED, 0);
        }
    } else if (status == TS_ENOMEM) {
        /* Not the server's verdict: try again on a fresh connection after the backoff. */
        if (c->state == TS__ST_READY && (r->conn == NULL || r->conn == c->conn))
            conn_fail(c, c->conn, TS_ENOMEM, "out of memory while resubscribing");
    } else if (status != TS_ECONNRESET && status != TS_ECANCELED && status != TS_ETIMEDOUT &&
               status != TS_EPROTO) {
        /* The server refused the subscription: it ends here. */
        pthread_mutex_lock(&c->mu);
        int own = s->linked;
        if (own)
            sub_unlink_locked(c, s);
        pthread_mutex_unlock(&c->mu);
        sub_final(c, s, status);
        if (own)
            ts__sub_unref(s);
    }
    /*
     * Connection errors (a malformed reply drops the connection too) leave it for the next
     * reconnect.
     */
}

static void hello_done(ts_client_t *c, ts__req *r, int status);

/* Finish a request: deliver its result to whoever waits for it, then release it. */
static void req_finish(ts_client_t *c, ts__req *r, int status)
{
    switch (r->kind) {
    case TS__K_ASYNC: {
        ts_result_t res = r->res;
        res.message = r->msg;
        memset(&r->res, 0, sizeof(r->res));
        if (r->cb != NULL)
            r->cb(c, status, &res, r->arg);
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
            hello_done(c, r, status);
        ts__req_free(r);
        break;
    case TS__K_RESUB:
        finish_resub(c, r, status);
        ts__req_free(r);
        break;
    case TS__K_UNLISTEN:
        sub_final(c, r->sub, TS_ECANCELED);
        ts__req_free(r);
        break;
    default: /* TS__K_FIRE */
        ts__req_free(r);
        break;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Writing
 */

/*
 * Every write the I/O thread starts is counted in io_writes (under mu) from before uv_write until
 * its callback, so that no blocking caller writes directly while libuv may still have a frame
 * half written (see "Direct writes" below). While the connection is ready, the I/O thread writes
 * only from async_cb, which finishes a pending handoff before anything else.
 */
static void io_write_begin(ts_client_t *c)
{
    pthread_mutex_lock(&c->mu);
    c->io_writes++;
    pthread_mutex_unlock(&c->mu);
}

static void io_write_end(ts_client_t *c)
{
    pthread_mutex_lock(&c->mu);
    c->io_writes--;
    pthread_mutex_unlock(&c->mu);
}

/* A request's frame has been written (or the write failed): release it to the completion. */
static void write_done(ts_client_t *c, ts__req *r)
{
    r->wpending = 0;
    if (r->kind == TS__K_BLOCK) {
        pthread_mutex_lock(&c->mu);
        r->wbusy = 0;
        if (r->abandoned)
            pthread_cond_broadcast(&r->cond);
        pthread_mutex_unlock(&c->mu);
    }
    if (r->finish_on_write)
        req_finish(c, r, r->status); /* r is gone after this */
}

static void write_cb(uv_write_t *w, int status)
{
    ts__req *r = w->data;
    ts_client_t *c = r->c;
    ts__conn *conn = r->conn;
    io_write_end(c);
    write_done(c, r);
    if (status < 0 && conn == c->conn && conn != NULL)
        conn_fail(c, conn, TS_ECONNRESET, "write to the server failed");
}

/* Undo lz4 for a connection that did not agree on it (a reconnect to another server). */
static int inflate_body(ts__req *r)
{
    uint64_t raw;
    if (ts__lz4_raw_len(r->flat, r->flat_len, &raw) != 0 || ts__lz4_bound(raw) == 0)
        return TS_EPROTO;
    uint8_t *out = ts__malloc_aligned(raw);
    if (out == NULL)
        return TS_ENOMEM;
    if (ts__lz4_decompress(r->flat, r->flat_len, out, raw) != 0) {
        ts__free_aligned(out, raw);
        return TS_EPROTO;
    }
    ts__free_aligned(r->flat, r->flat_cap);
    r->flat = out;
    r->flat_len = r->flat_cap = raw;
    r->body_len = r->small_len + raw;
    r->hflags &= (uint8_t)~TS_FLAG_LZ4;
    return 0;
}

/* A write buffer; built by hand because uv_buf_init takes an unsigned int length. */
static uv_buf_t mkbuf(const void *p, size_t len)
{
    uv_buf_t b;
    b.base = (char *)p;
    b.len = len;
    return b;
}

/*
 * Get r ready to be written on the current connection: checks, request id, header. Returns 0
 * when it is, or -1 when r has been completed instead (an error).
 */
static int req_prepare(ts_client_t *c, ts__req *r)
{
    ts__conn *conn = c->conn;
    /* Set first: a HELLO completed with an error below must still end its connection attempt. */
    r->conn = conn;
    if ((r->hflags & TS_FLAG_LZ4) && !conn->lz4) {
        int rc = inflate_body(r);
        if (rc != 0) {
            req_finish(c, r, rc);
            return -1;
        }
    }
    if (r->body_len > conn->max_body) {
        char msg[128];
        int n = snprintf(msg, sizeof(msg), "a %llu-byte frame exceeds the server's limit (%llu)",
                         (unsigned long long)r->body_len, (unsigned long long)conn->max_body);
        r->msg = ts__strndup(msg, (size_t)n);
        req_finish(c, r, TS_EMSGSIZE);
        return -1;
    }
    if (r->kind == TS__K_BLOCK) {
        pthread_mutex_lock(&c->mu);
        int abandoned = r->abandoned;
        if (!abandoned)
            r->wbusy = 1;
        pthread_mutex_unlock(&c->mu);
        if (abandoned) {
            req_finish(c, r, TS_ETIMEDOUT);
            return -1;
        }
    }
    uint32_t id;
    do {
        id = c->next_id++ & ~TS__DIRECT_ID;
    } while (id == 0 || ts__idmap_get(&c->inflight, id) != NULL);
    if (ts__idmap_put(&c->inflight, id, r) != 0) {
        req_finish(c, r, TS_ENOMEM);
        return -1;
    }
    r->id = id;
    r->in_map = 1;

    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = r->op,
                 .flags = r->hflags,
                 .request_id = id,
                 .body_len = r->body_len};
    ts__hdr_encode(&h, r->small);
    return 0;
}

/* Number of write buffers r's frame needs. */
static size_t req_nbufs(const ts__req *r)
{
    return 1 + (r->flat != NULL ? 1 : 0) + (r->has_enc ? 1 + 2 * r->enc.nsegs : 0);
}

/* Header + fixed part, then either one flat buffer or the plan's head and segments. */
static size_t req_fill_bufs(const ts__req *r, uv_buf_t *bufs)
{
    size_t n = 0;
    bufs[n++] = mkbuf(r->small, TS_HDR_SIZE + r->small_len);
    if (r->flat != NULL && r->flat_len > 0)
        bufs[n++] = mkbuf(r->flat, r->flat_len);
    if (r->has_enc) {
        bufs[n++] = mkbuf(r->enc.head, r->enc.head_len);
        for (size_t i = 0; i < r->enc.nsegs; i++) {
            const ts__seg *s = &r->enc.segs[i];
            if (s->len > 0)
                bufs[n++] = mkbuf(s->ptr, s->len);
            if (s->pad_after > 0)
                bufs[n++] = mkbuf(ts__zeros, s->pad_after);
        }
    }
    return n;
}

/* Write r's frame on the current connection (header + fixed part, then the record). */
static void req_send(ts_client_t *c, ts__req *r)
{
    if (req_prepare(c, r) != 0)
        return;
    ts__conn *conn = c->conn;
    uv_buf_t local[32];
    size_t nbufs = req_nbufs(r);
    uv_buf_t *bufs = local;
    if (nbufs > TS__ARRAY_SIZE(local)) {
        bufs = ts__malloc(nbufs * sizeof(*bufs));
        if (bufs == NULL) {
            req_complete(c, r, TS_ENOMEM);
            return;
        }
    }
    size_t n = req_fill_bufs(r, bufs);
    r->w.data = r;
    r->wpending = 1;
    io_write_begin(c);
    /* libuv copies the buffer array; the memory it points to stays ours until write_cb. */
    int rc = uv_write(&r->w, &conn->u.stream, bufs, (unsigned)n, write_cb);
    if (bufs != local)
        ts__free(bufs);
    if (rc != 0) {
        io_write_end(c);
        r->wpending = 0;
        req_complete(c, r, TS_ECONNRESET);
        conn_fail(c, conn, TS_ECONNRESET, uv_strerror(rc));
        return;
    }
    ensure_tick(c);
}

/* Several requests written with one uv_write; freed by its callback. */
typedef struct ts__wbatch {
    uv_write_t w;
    ts_client_t *c;
    ts__conn *conn;
    size_t n;
    ts__req *reqs[];
} ts__wbatch;

static void batch_write_cb(uv_write_t *w, int status)
{
    ts__wbatch *b = w->data;
    ts_client_t *c = b->c;
    ts__conn *conn = b->conn;
    io_write_end(c);
    /* Every request of the batch is released before a failure fails the ones in flight. */
    for (size_t i = 0; i < b->n; i++)
        write_done(c, b->reqs[i]);
    ts__free(b);
    if (status < 0 && conn == c->conn && conn != NULL)
        conn_fail(c, conn, TS_ECONNRESET, "write to the server failed");
}

/*
 * Write n requests on the current connection with one uv_write (one system call when the socket
 * takes it all): a burst of small asynchronous requests, such as a pipeline refilled from
 * completion callbacks, would otherwise cost a write system call each. Requests that fail their
 * checks are completed on the way; the others behave exactly as if sent by req_send.
 */
static void req_send_batch(ts_client_t *c, ts__req **reqs, size_t n)
{
    ts__wbatch *b = n > 1 ? ts__malloc(sizeof(*b) + n * sizeof(ts__req *)) : NULL;
    if (b == NULL) {
        for (size_t i = 0; i < n; i++) {
            if (c->state == TS__ST_READY) {
                req_send(c, reqs[i]);
            } else {
                append_waitq(c, reqs[i]);
                ensure_tick(c);
            }
        }
        return;
    }
    b->c = c;
    b->conn = c->conn;
    b->n = 0;
    size_t nbufs = 0;
    for (size_t i = 0; i < n; i++) {
        if (req_prepare(c, reqs[i]) != 0)
            continue;
        b->reqs[b->n++] = reqs[i];
        nbufs += req_nbufs(reqs[i]);
    }
    if (b->n == 0) {
        ts__free(b);
        return;
    }
    uv_buf_t local[64];
    uv_buf_t *bufs = nbufs > TS__ARRAY_SIZE(local) ? ts__malloc(nbufs * sizeof(*bufs)) : local;
    int rc = UV_ENOMEM;
    if (bufs != NULL) {
        size_t k = 0;
        for (size_t i = 0; i < b->n; i++) {
            b->reqs[i]->wpending = 1;
            k += req_fill_bufs(b->reqs[i], bufs + k);
        }
        b->w.data = b;
        io_write_begin(c);
        /* libuv copies the buffer array; the memory it points to stays ours until the cb. */
        rc = uv_write(&b->w, &b->conn->u.stream, bufs, (unsigned)k, batch_write_cb);
        if (bufs != local)
            ts__free(bufs);
        if (rc != 0)
            io_write_end(c);
    }
    if (rc != 0) {
        ts__conn *conn = b->conn;
        for (size_t i = 0; i < b->n; i++) {
            b->reqs[i]->wpending = 0;
            req_complete(c, b->reqs[i], rc == UV_ENOMEM ? TS_ENOMEM : TS_ECONNRESET);
        }
        ts__free(b);
        if (rc != UV_ENOMEM)
            conn_fail(c, conn, TS_ECONNRESET, uv_strerror(rc));
        return;
    }
    ensure_tick(c);
}

/*
 * Send UNLISTEN for bin and ignore the answer (a listener nobody waits for any more). It goes
 * through the inbox like an application's request, so it is written after a direct write that
 * the I/O thread has yet to finish (see ts__submit_blocking_locked).
 */
static void send_fire_unlisten(ts_client_t *c, const char *bin, size_t len)
{
    if (c->state != TS__ST_READY)
        return; /* the server forgets listeners with their connection */
    ts__req *r = ts__calloc(1, sizeof(*r));
    if (r == NULL)
        return;
    r->c = c;
    r->kind = TS__K_FIRE;
    r->op = TS_OP_UNLISTEN;
    r->small[TS_HDR_SIZE] = (uint8_t)len;
    memcpy(r->small + TS_HDR_SIZE + 1, bin, len);
    r->small_len = 1 + len;
    r->body_len = r->small_len;
    if (ts__submit(c, r) != 0)
        ts__req_free(r);
}

/* ---------------------------------------------------------------------------------------------
 * Direct writes
 *
 * A blocking call spends most of a small round trip waking threads: handing its frame to the I/O
 * thread costs a wake-up before a byte leaves. So a blocking caller writes its frame on the
 * socket itself, holding mu, whenever the I/O thread has nothing in its inbox and no write of its
 * own under way (io_writes == 0): then no frame can be half written, and the I/O thread, which
 * takes mu before every write it starts, cannot start one in the middle of the caller's. Only
 * the reply crosses threads. The request waits in c->direct under an id with TS__DIRECT_ID set;
 * the I/O thread takes it from there when its reply arrives, or fails it when the connection
 * goes. When the socket takes only part of the frame, the rest is handed to the I/O thread
 * (c->handoff), which writes it before anything else.
 */

/*
 * Stop direct writes before the socket closes (the descriptor must not be written after it is
 * closed and perhaps reused). Returns the requests direct writes left waiting, for direct_fail.
 */
static ts__req *direct_stop(ts_client_t *c)
{
    ts__req *list = NULL;
    pthread_mutex_lock(&c->mu);
    if (c->rd_owner == TS__RD_CALLER) {
        /* A caller reads the socket: make its read end at once, and wait until it lets go. */
        shutdown(c->d_fd, SHUT_RDWR);
        while (c->rd_owner == TS__RD_CALLER)
            pthread_cond_wait(&c->rd_cond, &c->mu);
    }
    c->rd_owner = TS__RD_IO; /* a new connection starts with the I/O thread reading */
    c->fd_blocking = 0;      /* a new connection starts non-blocking */
    c->rd_want = 0;
    c->rd_broken = 0;
    c->pb_len = 0;
    c->d_ready = 0;
    c->d_fd = -1;
    if (c->handoff != NULL) {
        list = c->handoff;
        list->next = NULL;
        c->handoff = NULL;
        c->io_writes--;
    }
    for (size_t i = 0; i < c->direct.cap; i++) {
        if (c->direct.keys[i] == 0)
            continue;
        ts__req *r = c->direct.vals[i];
        r->direct = 0;
        r->next = list;
        list = r;
    }
    ts__idmap_free(&c->direct);
    pthread_mutex_unlock(&c->mu);
    return list;
}

static void direct_fail(ts_client_t *c, ts__req *list, int err, const char *msg)
{
    while (list != NULL) {
        ts__req *r = list;
        list = r->next;
        r->next = NULL;
        req_set_msg(r, msg);
        req_finish(c, r, err);
    }
}

/* The direct request waiting for the reply with this id, taken out of c->direct; or NULL. */
static ts__req *direct_take(ts_client_t *c, uint32_t id)
{
    if (!(id & TS__DIRECT_ID))
        return NULL;
    pthread_mutex_lock(&c->mu);
    ts__req *r = ts__idmap_del(&c->direct, id);
    if (r != NULL)
        r->direct = 0;
    pthread_mutex_unlock(&c->mu);
    return r;
}

/* 1 when a request waits for the reply with this id (it stays where it is). */
static int reply_awaited(ts_client_t *c, uint32_t id)
{
    if (ts__idmap_get(&c->inflight, id) != NULL)
        return 1;
    if (!(id & TS__DIRECT_ID))
        return 0;
    pthread_mutex_lock(&c->mu);
    int found = ts__idmap_get(&c->direct, id) != NULL;
    pthread_mutex_unlock(&c->mu);
    return found;
}

/* The request a reply with this id answers, or NULL (one that timed out, say). */
static ts__req *reply_owner(ts_client_t *c, uint32_t id)
{
    ts__req *r = ts__idmap_get(&c->inflight, id);
    return r != NULL ? r : direct_take(c, id);
}

/*
 * Finish a direct write the socket took only part of: from now on r is an ordinary in-flight
 * request of the I/O thread (deadline, cut on timeout), its remaining bytes written by libuv.
 * io_writes already counts this write.
 */
static void write_handoff(ts_client_t *c, ts__req *r)
{
    ts__conn *conn = c->conn;
    if (c->state != TS__ST_READY || conn == NULL) {
        /* The connection went down after the caller wrote part of the frame. */
        io_write_end(c);
        req_finish(c, r, TS_ECONNRESET);
        return;
    }
    r->conn = conn;
    if (ts__idmap_put(&c->inflight, r->id, r) != 0) {
        io_write_end(c);
        req_finish(c, r, TS_ENOMEM);
        conn_fail(c, conn, TS_ENOMEM, "out of memory");
        return;
    }
    r->in_map = 1;
    uv_buf_t bufs[TS__DIRECT_IOV];
    size_t n = req_fill_bufs(r, bufs);
    size_t skip = r->woff;
    size_t i = 0;
    while (skip >= bufs[i].len) {
        skip -= bufs[i].len;
        i++;
    }
    bufs[i].base += skip;
    bufs[i].len -= skip;
    r->w.data = r;
    r->wpending = 1;
    int rc = uv_write(&r->w, &conn->u.stream, bufs + i, (unsigned)(n - i), write_cb);
    if (rc != 0) {
        io_write_end(c);
        r->wpending = 0;
        req_complete(c, r, TS_ECONNRESET);
        conn_fail(c, conn, TS_ECONNRESET, uv_strerror(rc));
        return;
    }
    ensure_tick(c);
}

/* Write r's frame on the socket from the calling thread (mu held). 1 when r is on its way. */
static int direct_write_locked(ts_client_t *c, ts__req *r)
{
    if (!c->d_ready || c->io_writes != 0 || c->inbox_head != NULL || r->sub != NULL ||
        r->body_len > c->d_max_body || ((r->hflags & TS_FLAG_LZ4) && !c->d_lz4) ||
        req_nbufs(r) > TS__DIRECT_IOV)
        return 0;
    uint32_t id;
    do {
        id = c->d_next_id++ | TS__DIRECT_ID;
    } while (ts__idmap_get(&c->direct, id) != NULL);
    if (ts__idmap_put(&c->direct, id, r) != 0)
        return 0;
    r->id = id;
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = r->op,
                 .flags = r->hflags,
                 .request_id = id,
                 .body_len = r->body_len};
    ts__hdr_encode(&h, r->small);

    uv_buf_t bufs[TS__DIRECT_IOV];
    struct iovec iov[TS__DIRECT_IOV];
    size_t n = req_fill_bufs(r, bufs);
    for (size_t i = 0; i < n; i++) {
        iov[i].iov_base = bufs[i].base;
        iov[i].iov_len = bufs[i].len;
    }
    uint64_t total = TS_HDR_SIZE + r->body_len;
    uint64_t sent = 0;
    size_t first = 0;
    for (;;) {
        struct msghdr m;
        memset(&m, 0, sizeof(m));
        m.msg_iov = iov + first;
        m.msg_iovlen = n - first;
        ssize_t k = sendmsg(c->d_fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            break; /* EAGAIN, or a broken connection that the I/O thread will notice */
        }
        sent += (uint64_t)k;
        if (sent == total)
            break;
        size_t left = (size_t)k;
        while (left >= iov[first].iov_len) {
            left -= iov[first].iov_len;
            first++;
        }
        iov[first].iov_base = (char *)iov[first].iov_base + left;
        iov[first].iov_len -= left;
    }
    if (sent == total) {
        r->direct = 1;
        r->rlz4 = c->d_lz4;
        /*
         * When the I/O thread awaits nothing, the caller reads its reply itself too. Not for
         * WAIT and SAVE, whose answers may take long: other replies would wait behind them.
         */
        if (c->rd_owner == TS__RD_FREE && r->op != TS_OP_WAIT && r->op != TS_OP_SAVE) {
            c->rd_owner = TS__RD_CALLER;
            r->self_read = 1;
            r->rfd = c->d_fd;
            r->rblock = c->fd_blocking;
        } else if (c->rd_owner == TS__RD_FREE) {
            c->rd_owner = TS__RD_IO; /* the I/O thread reads the reply: wake it to */
            uv_async_send(&c->async);
        }
        return 1;
    }
    ts__idmap_del(&c->direct, id);
    if (sent == 0)
        return 0; /* nothing went out: the I/O thread sends it the ordinary way */
    r->woff = (size_t)sent;
    r->wbusy = 1;
    c->handoff = r;
    c->io_writes++;
    uv_async_send(&c->async);
    return 1;
}

int ts__submit_blocking_locked(ts_client_t *c, ts__req *r)
{
    if (c->closing)
        return TS_ECANCELED;
    if (direct_write_locked(c, r)) {
        c->waiters++; /* until wait_done (api.c) lets go of the client */
        return 0;
    }
    return ts__submit_locked(c, r);
}

/* ---------------------------------------------------------------------------------------------
 * Reading
 */

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    ts__conn *conn = h->data;
    (void)suggested;
    if (conn->rstate == TS__RS_BODY) {
        /* Large bodies are read straight into their own aligned buffer. */
        buf->base = (char *)conn->body + conn->body_got;
        buf->len = (size_t)(conn->hdr.body_len - conn->body_got);
    } else {
        buf->base = (char *)conn->stage + conn->stage_len;
        buf->len = TS__STAGE_SIZE - conn->stage_len;
    }
}

/*
 * Check a reply header against what its opcode and status allow, before its body is read or
 * allocated (docs/PROTOCOL.md sections 5 and 12): fixed replies have their exact size as bound,
 * error bodies TS_MAX_ERRMSG, GET, PEEK, LIST and STATS the client's max_reply_bytes. lz4 says
 * whether the connection agreed on compressed bodies. 0, or TS_EPROTO. No system call, no
 * allocation: both read paths run it on every frame.
 */
static int reply_hdr_check(const ts_client_t *c, const ts__hdr *h, int lz4)
{
    if (h->opcode == 0 ? h->status == TS_ST_OK || h->request_id != 0
                       : h->opcode == TS_OP_NOTIFY && (h->status != 0 || h->request_id != 0))
        return TS_EPROTO; /* a connection-level error frame, or a notification, out of shape */
    uint64_t max = ts__reply_max_body(h->opcode, h->status, c->opts.max_reply_bytes);
    if (h->flags & TS_FLAG_LZ4) {
        if (!lz4)
            return TS_EPROTO;
        /* raw_len, then LZ4's worst case for max bytes (n + n/255 + 16); max <= 2^40. */
        max = 8 + max + max / 255 + 16;
    }
    return h->body_len <= max ? 0 : TS_EPROTO;
}

/*
 * Deliver a NOTIFY frame to the subscription for its bin. Returns 0, or TS_EPROTO when the body
 * is malformed or reports an event the protocol does not define.
 */
static int dispatch_notify(ts_client_t *c, const uint8_t *body, size_t len)
{
    ts__rd rd;
    uint64_t version;
    uint32_t n;
    uint8_t event, flags;
    const char *name;
    size_t nl;
    ts__rd_init(&rd, body, len);
    if (ts__rd_u64(&rd, &version) != 0 || ts__rd_u32(&rd, &n) != 0 || ts__rd_u8(&rd, &event) != 0 ||
        ts__rd_u8(&rd, &flags) != 0 || ts__rd_name(&rd, &name, &nl) != 0 || rd.left != 0)
        return TS_EPROTO;
    /* Events from TS_EV_DISCONNECTED on are the client's own: a server never sends them. */
    if (event == 0 || event >= TS_EV_DISCONNECTED)
        return TS_EPROTO;
    ts__sub *s;
    pthread_mutex_lock(&c->mu);
    for (s = c->subs; s != NULL; s = s->next)
        if (s->live && s->bin_len == nl && memcmp(s->bin, name, nl) == 0)
            break;
    if (s != NULL)
        atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
    pthread_mutex_unlock(&c->mu);
    if (s == NULL)
        return 0; /* unlistened meanwhile, or never ours */
    s->version = version;
    s->n_items = n;
    sub_event(c, s, (ts_event_t)event, (flags & TS_NOTE_FLAG_COALESCED) != 0);
    ts__sub_unref(s);
    return 0;
}

/*
 * The server broke the protocol in its answer to r: drop the connection first (so r's callback
 * already sees it down and what it submits waits for the reconnection), then fail r with
 * TS_EPROTO. The other requests in flight fail with TS_EPROTO too (see conn_fail).
 */
static void proto_fail(ts_client_t *c, ts__conn *conn, ts__req *r, const char *msg)
{
    if (r->in_map) {
        ts__idmap_del(&c->inflight, r->id);
        r->in_map = 0;
    }
    conn_fail(c, conn, TS_EPROTO, msg);
    req_complete(c, r, TS_EPROTO);
}

/*
 * The server's connection-level error frame (opcode 0, request id 0, checked by
 * reply_hdr_check): it closes the connection for a reason of its own (too many clients, a slow
 * reader, shutdown...). The connection goes now, and the requests in flight fail with the
 * status's TS_E* code and the server's message (ts_client_last_error()), not as merely lost.
 */
static void server_closing(ts_client_t *c, ts__conn *conn, const ts__hdr *h, const uint8_t *body,
                           size_t len)
{
    int err = ts__status_to_err(h->status);
    char msg[TS_MAX_ERRMSG + 1];
    if (len > 0 && !(h->flags & TS_FLAG_LZ4))
        snprintf(msg, sizeof(msg), "%.*s", (int)len, (const char *)body); /* len <= 1024 */
    else
        snprintf(msg, sizeof(msg), "the server closed the connection: %s", ts_strerror(err));
    conn_fail_reason(c, conn, err, msg, 1);
}

/* Release a frame body that dispatch owns; a borrowed one lies in the staging buffer. */
static void body_release(uint8_t *body, size_t len, int owned)
{
    if (owned)
        ts__body_free(body, len);
}

/*
 * Apply the reply frame h with body to r: its status, message and results. With owned, body is
 * an aligned allocation that this takes over; otherwise it is borrowed (valid until this
 * returns) and copied only when the reply keeps it (the decoded tensors of GET, PEEK and STATS
 * point into their body). Returns the request's status; *malformed is set when the frame broke
 * the protocol (the connection has to go). Touches nothing but r, so it runs on the I/O thread
 * and on a blocking caller reading its own reply alike.
 */
static int reply_apply(ts__req *r, const ts__hdr *h, uint8_t *body, size_t len, int owned,
                       int *malformed)
{
    *malformed = 0;
    /* What the reply may hold (reply_hdr_check checked the header against it already). */
    uint64_t max = ts__reply_max_body(h->opcode, h->status, r->c->opts.max_reply_bytes);
    if (h->flags & TS_FLAG_LZ4) {
        uint64_t raw = 0;
        uint8_t *out = NULL;
        int rc = ts__lz4_raw_len(body, len, &raw);
        if (rc == 0 && (ts__lz4_bound(raw) == 0 || raw > max))
            rc = TS_EPROTO;
        if (rc == 0 && raw > 0 && (out = ts__malloc_aligned(raw)) == NULL)
            rc = TS_ENOMEM;
        if (rc == 0)
            rc = ts__lz4_decompress(body, len, out, raw);
        body_release(body, len, owned);
        if (rc != 0) {
            ts__free_aligned(out, raw);
            *malformed = rc == TS_EPROTO;
            return rc;
        }
        body = out;
        len = raw;
        owned = 1;
    }
    int status;
    if (len > max) {
        status = TS_EPROTO;
        body_release(body, len, owned);
    } else if (h->status != TS_ST_OK) {
        status = ts__status_to_err(h->status);
        if (r->op == TS_OP_WAIT && h->status == TS_ST_TIMEOUT) {
            /* WAIT's TIMEOUT carries the bin state, exactly. */
            r->have_state = ts__parse_bin_state(body, len, &r->res) == 0;
            if (!r->have_state)
                status = TS_EPROTO;
        } else if (len > 0) {
            r->msg = ts__strndup((const char *)body, len); /* len <= TS_MAX_ERRMSG */
        }
        body_release(body, len, owned);
    } else if (!ts__reply_keeps_body(r->op)) {
        status = ts__reply_parse_view(r, body, len);
        body_release(body, len, owned);
    } else {
        if (!owned) {
            /*
             * A borrowed body lies in a receive buffer: the parser takes over (and frees) what
             * it is given, so it gets a copy, or no buffer at all for an empty body.
             */
            uint8_t *copy = NULL;
            if (len > 0 && (copy = ts__malloc_aligned(len)) == NULL)
                return TS_ENOMEM;
            if (len > 0)
                memcpy(copy, body, len);
            body = copy;
        }
        status = ts__reply_parse(r, body, len);
    }
    /* A HELLO's own completion drops the connection (hello_done). */
    *malformed = status == TS_EPROTO && r->kind != TS__K_HELLO;
    return status;
}

/*
 * Handle one complete frame from conn. With owned, body is an aligned allocation that dispatch
 * takes over; otherwise it is borrowed from the staging buffer (valid until dispatch returns)
 * and copied only when the reply keeps it (the decoded tensors of GET, PEEK and STATS point
 * into their body), so that small replies and notifications cost no allocation. Returns 0, or
 * TS_EPROTO when the frame broke the protocol in a way that ends the connection (already
 * dropped when a request was concerned; the caller drops it otherwise).
 */
static int dispatch(ts_client_t *c, ts__conn *conn, const ts__hdr *h, uint8_t *body, size_t len,
                    int owned)
{
    if (h->opcode == TS_OP_NOTIFY) {
        int rc = dispatch_notify(c, body, len);
        body_release(body, len, owned);
        return rc;
    }
    if (h->opcode == 0) {
        server_closing(c, conn, h, body, len);
        body_release(body, len, owned);
        return TS_EPROTO; /* the connection is gone already */
    }
    ts__req *r = reply_owner(c, h->request_id);
    if (r == NULL) {
        body_release(body, len, owned); /* the answer to a request that timed out */
        return 0;
    }
    if (r->op != h->opcode) {
        body_release(body, len, owned);
        proto_fail(c, conn, r, "the server answered a request with another opcode");
        return TS_EPROTO;
    }
    int malformed = 0;
    int status = reply_apply(r, h, body, len, owned, &malformed);
    if (malformed) {
        proto_fail(c, conn, r,
                   status == TS_EPROTO && (h->flags & TS_FLAG_LZ4)
                       ? "malformed compressed reply from the server"
                       : "malformed reply from the server");
        return TS_EPROTO;
    }
    req_complete(c, r, status);
    return 0;
}

/* Parse every whole frame in the staging buffer; keep a partial one for the next read. */
static void process_stage(ts_client_t *c, ts__conn *conn)
{
    size_t pos = 0;
    while (!conn->closing) {
        size_t avail = conn->stage_len - pos;
        if (conn->discard > 0) {
            size_t k = conn->discard < avail ? (size_t)conn->discard : avail;
            pos += k;
            conn->discard -= k;
            if (conn->discard > 0)
                break;
            continue;
        }
        if (avail < TS_HDR_SIZE)
            break;
        ts__hdr h;
        if (ts__hdr_decode(conn->stage + pos, TS_MAGIC_REP, &h) != 0 ||
            reply_hdr_check(c, &h, conn->lz4) != 0) {
            conn_fail(c, conn, TS_EPROTO, "malformed frame from the server");
            return;
        }
        pos += TS_HDR_SIZE;
        avail -= TS_HDR_SIZE;
        if (h.body_len <= avail) {
            /* The whole body is here: dispatch reads it in place (see dispatch). */
            uint8_t *body = h.body_len > 0 ? conn->stage + pos : NULL;
            pos += (size_t)h.body_len;
            if (dispatch(c, conn, &h, body, (size_t)h.body_len, 0) != 0)
                conn_fail(c, conn, TS_EPROTO, "malformed frame from the server");
            continue;
        }
        if (h.opcode != TS_OP_NOTIFY && h.opcode != 0 && !reply_awaited(c, h.request_id)) {
            /* The late answer to a request that timed out: skip it, buffering nothing. */
            conn->discard = h.body_len;
            continue;
        }
        uint8_t *body = ts__malloc_aligned((size_t)h.body_len);
        if (body == NULL) {
            /* No memory for this body: fail its request and skip the bytes. */
            ts__req *r = h.opcode != TS_OP_NOTIFY ? reply_owner(c, h.request_id) : NULL;
            if (r != NULL)
                req_complete(c, r, TS_ENOMEM);
            conn->discard = h.body_len;
            continue;
        }
        memcpy(body, conn->stage + pos, avail);
        pos += avail;
        conn->hdr = h;
        conn->body = body;
        conn->body_got = avail;
        conn->rstate = TS__RS_BODY;
        break;
    }
    if (conn->closing)
        return;
    memmove(conn->stage, conn->stage + pos, conn->stage_len - pos);
    conn->stage_len -= pos;
}

static void read_cb(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf)
{
    ts__conn *conn = stream->data;
    ts_client_t *c = conn->c;
    (void)buf;
    if (conn->closing || nread == 0)
        return;
    if (nread < 0) {
        conn_fail(c, conn, TS_ECONNRESET,
                  nread == UV_EOF ? "the server closed the connection" : uv_strerror((int)nread));
        return;
    }
    if (conn->rstate == TS__RS_BODY) {
        conn->body_got += (size_t)nread;
        if (conn->body_got < conn->hdr.body_len)
            return;
        uint8_t *body = conn->body;
        ts__hdr h = conn->hdr;
        conn->body = NULL;
        conn->rstate = TS__RS_HDR;
        if (dispatch(c, conn, &h, body, (size_t)h.body_len, 1) != 0)
            conn_fail(c, conn, TS_EPROTO, "malformed frame from the server");
        return;
    }
    conn->stage_len += (size_t)nread;
    process_stage(c, conn);
}

/* ---------------------------------------------------------------------------------------------
 * Connections
 */

/* One of the connection's handles has closed; the last one frees it. */
static void conn_release(ts__conn *conn)
{
    if (--conn->handles > 0)
        return;
    if (conn->body != NULL)
        ts__body_free(conn->body, (size_t)conn->hdr.body_len);
    ts__free(conn->stage);
    ts__free(conn);
}

static void conn_close_cb(uv_handle_t *h)
{
    conn_release(h->data);
}

static void hup_close_cb(uv_handle_t *h)
{
    ts__conn *conn = h->data;
    close(conn->hup_fd);
    conn->hup_fd = -1;
    conn_release(conn);
}

/* Close a connection; its memory goes in the close callbacks. */
static void conn_close(ts__conn *conn)
{
    if (conn->closing)
        return;
    conn->closing = 1;
    if (conn->hup_fd >= 0)
        uv_close((uv_handle_t *)&conn->hup, hup_close_cb);
    uv_close(&conn->u.handle, conn_close_cb);
}

static ts__conn *conn_new(ts_client_t *c)
{
    ts__conn *conn = ts__calloc(1, sizeof(*conn));
    if (conn == NULL)
        return NULL;
    conn->stage = ts__malloc(TS__STAGE_SIZE);
    if (conn->stage == NULL) {
        ts__free(conn);
        return NULL;
    }
    conn->c = c;
    conn->max_body = TS_MAX_PREAUTH_BODY;
    conn->hup_fd = -1;
    conn->handles = 1;
    return conn;
}

/* What a failed connect means to the caller. */
static int map_connect_err(int uverr)
{
    switch (uverr) {
    case UV_ECONNREFUSED:
    case UV_ENOENT: /* no socket file: nothing listens there */
        return TS_ECONNREFUSED;
    case UV_ETIMEDOUT:
        return TS_ETIMEDOUT;
    case UV_ENOMEM:
        return TS_ENOMEM;
    case UV_EACCES:
        return TS_EACCES;
    default:
        return TS_ENOTCONN;
    }
}

/* Record why opening failed and end the I/O thread (first connection only). */
static void open_failed(ts_client_t *c, int err, const char *msg)
{
    pthread_mutex_lock(&c->mu);
    c->open_done = 1;
    c->open_status = err;
    snprintf(c->open_msg, sizeof(c->open_msg), "%s: %s", c->address,
             msg != NULL ? msg : ts_strerror(err));
    pthread_cond_broadcast(&c->open_cond);
    pthread_mutex_unlock(&c->mu);
    io_shutdown(c);
}

static void retry_cb(uv_timer_t *t);

/*
 * The connection (or the attempt to make one) failed: fail what is in flight, tell the
 * subscriptions, and schedule the next attempt. conn may be NULL while resolving.
 */
static void conn_fail(ts_client_t *c, ts__conn *conn, int err, const char *msg)
{
    conn_fail_reason(c, conn, err, msg, 0);
}

/*
 * conn_fail, where server_reason says that err and msg are the server's own reason for closing
 * (its connection-level error frame): the requests in flight then fail with err and carry msg,
 * instead of the TS_ECONNRESET of a connection that was merely lost.
 */
static void conn_fail_reason(ts_client_t *c, ts__conn *conn, int err, const char *msg,
                             int server_reason)
{
    if (conn != c->conn || c->state == TS__ST_CLOSED) {
        if (conn != NULL)
            conn_close(conn);
        return;
    }
    ts__req *dlist = direct_stop(c); /* before the descriptor closes */
    if (conn != NULL)
        conn_close(conn);
    int was_ready = c->state == TS__ST_READY;
    c->conn = NULL;
    c->reading = 0;
    c->gen++;
    c->state = TS__ST_BACKOFF;
    atomic_store(&c->connected, 0);
    uv_timer_stop(&c->retry);
    /* After a protocol violation any reply in flight may be the broken one: say so. */
    int ferr = server_reason || err == TS_EPROTO ? err : TS_ECONNRESET;
    const char *fmsg = server_reason ? msg : NULL;
    fail_inflight(c, ferr, fmsg);
    direct_fail(c, dlist, ferr, fmsg);
    if (server_reason) {
        /*
         * The server turned the client away (a refused handshake on a reconnection, or its
         * reason for closing): the calls waiting for a connection learn why now, rather than
         * at their deadlines.
         */
        ts__req *w = c->waitq_head;
        c->waitq_head = c->waitq_tail = NULL;
        while (w != NULL) {
            ts__req *r = w;
            w = r->next;
            r->next = NULL;
            req_set_msg(r, msg);
            req_finish(c, r, err);
        }
    }
    if (was_ready) {
        /* Collect first: callbacks may unlisten (which unlinks) while we walk. */
        ts__sub *chain = NULL;
        pthread_mutex_lock(&c->mu);
        for (ts__sub *s = c->subs; s != NULL; s = s->next) {
            if (!s->live || !s->on_conn)
                continue;
            s->on_conn = 0;
            atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
            s->io_next = chain;
            chain = s;
        }
        pthread_mutex_unlock(&c->mu);
        chain = sub_chain_reverse(chain);
        while (chain != NULL) {
            ts__sub *s = chain;
            chain = s->io_next;
            sub_event(c, s, TS_EV_DISCONNECTED, 0);
            ts__sub_unref(s);
        }
    }
    if (!c->ever_ready) {
        open_failed(c, err, msg);
        return;
    }
    if (c->state == TS__ST_BACKOFF) {
        uv_timer_start(&c->retry, retry_cb, (uint64_t)c->backoff_ms, 0);
        c->backoff_ms = c->backoff_ms * 2 > c->opts.reconnect_max_ms ? c->opts.reconnect_max_ms
                                                                     : c->backoff_ms * 2;
    }
}

/* Re-send LISTEN for every subscription on a fresh connection. */
static void resubscribe(ts_client_t *c)
{
    ts__req *list = NULL;
    int oom = 0;
    pthread_mutex_lock(&c->mu);
    for (ts__sub *s = c->subs; s != NULL; s = s->next) {
        if (!s->live)
            continue;
        ts__req *r = ts__calloc(1, sizeof(*r));
        if (r == NULL) {
            oom = 1;
            break;
        }
        r->c = c;
        r->kind = TS__K_RESUB;
        r->op = TS_OP_LISTEN;
        r->small[TS_HDR_SIZE] = (uint8_t)s->bin_len;
        memcpy(r->small + TS_HDR_SIZE + 1, s->bin, s->bin_len);
        r->small_len = 1 + s->bin_len;
        r->body_len = r->small_len;
        atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
        r->sub = s;
        r->next = list;
        list = r;
    }
    pthread_mutex_unlock(&c->mu);
    if (oom) {
        /*
         * A subscription left out would miss its changes for as long as this connection lasts:
         * drop it and try again after the backoff instead.
         */
        while (list != NULL) {
            ts__req *r = list;
            list = r->next;
            ts__req_free(r);
        }
        conn_fail(c, c->conn, TS_ENOMEM, "out of memory while resubscribing");
        return;
    }
    while (list != NULL && c->state == TS__ST_READY) {
        ts__req *r = list;
        list = r->next;
        r->next = NULL;
        req_send(c, r);
    }
    while (list != NULL) {
        ts__req *r = list;
        list = r->next;
        ts__req_free(r);
    }
}

/* The handshake succeeded: the connection is ready for requests. */
static void go_ready(ts_client_t *c)
{
    c->state = TS__ST_READY;
    uv_timer_stop(&c->retry);
    c->backoff_ms = c->opts.reconnect_min_ms;
    atomic_store(&c->connected, 1);
    if (!c->ever_ready) {
        c->ever_ready = 1;
        pthread_mutex_lock(&c->mu);
        c->open_done = 1;
        c->open_status = 0;
        pthread_cond_broadcast(&c->open_cond);
        pthread_mutex_unlock(&c->mu);
    }
    resubscribe(c);
    /* Requests that waited for the connection go out in the order they were made. */
    while (c->state == TS__ST_READY && c->waitq_head != NULL) {
        ts__req *r = c->waitq_head;
        c->waitq_head = r->next;
        if (c->waitq_head == NULL)
            c->waitq_tail = NULL;
        r->next = NULL;
        req_send(c, r);
    }
    uv_os_fd_t fd;
    ts__conn *conn = c->conn;
    if (c->state == TS__ST_READY && !getenv_off("TS_CLIENT_DIRECT") &&
        uv_fileno(&conn->u.handle, &fd) == 0) {
        /* The hang-up watcher lets the I/O thread stop reading while nothing is awaited. */
        int dup_fd = c->pb != NULL ? dup(fd) : -1;
        if (dup_fd >= 0 && uv_poll_init(&c->loop, &conn->hup, dup_fd) == 0) {
            conn->hup.data = conn;
            conn->hup_fd = dup_fd;
            conn->handles++;
        } else if (dup_fd >= 0) {
            close(dup_fd);
        }
        pthread_mutex_lock(&c->mu);
        c->d_ready = 1;
        c->d_fd = fd;
        c->d_lz4 = conn->lz4;
        c->d_max_body = conn->max_body;
        pthread_mutex_unlock(&c->mu);
    }
}

static void hello_done(ts_client_t *c, ts__req *r, int status)
{
    ts__conn *conn = c->conn;
    if (status != 0) {
        char msg[TS_MAX_ERRMSG + 64];
        /* The server's message alone when it already begins with what the status says. */
        const char *what = ts_strerror(status);
        if (r->msg != NULL && strncmp(r->msg, what, strlen(what)) == 0)
            snprintf(msg, sizeof(msg), "handshake refused: %s", r->msg);
        else
            snprintf(msg, sizeof(msg), "handshake refused: %s%s%s", what,
                     r->msg != NULL ? ": " : "", r->msg != NULL ? r->msg : "");
        /* The server's own verdict (not a lost or broken connection) reaches the callers. */
        int verdict = status != TS_EPROTO && status != TS_ETIMEDOUT && status != TS_ENOMEM &&
                      status != TS_ECONNRESET;
        conn_fail_reason(c, conn, status, msg, verdict);
        return;
    }
    conn->lz4 = (r->hello_flags & TS_HELLO_LZ4) != 0 && c->opts.compress_min > 0;
    conn->max_body = r->hello_max_body != 0 ? r->hello_max_body : TS_DEFAULT_MAX_FRAME;
    atomic_store(&c->lz4, conn->lz4);
    go_ready(c);
}

/* Connected: start reading and send HELLO. */
static void send_hello(ts_client_t *c, ts__conn *conn)
{
    ts__req *r = ts__calloc(1, sizeof(*r));
    if (r == NULL) {
        conn_fail(c, conn, TS_ENOMEM, "out of memory");
        return;
    }
    r->c = c;
    r->kind = TS__K_HELLO;
    r->op = TS_OP_HELLO;
    uint8_t *b = r->small + TS_HDR_SIZE;
    b[0] = TS_PROTO_VERSION;
    b[1] = c->opts.compress_min > 0 ? TS_HELLO_LZ4 : 0;
    ts__put_u16le(b + 2, (uint16_t)c->token_len);
    r->small_len = 4;
    if (c->token_len > 0) {
        r->flat = ts__malloc_aligned(c->token_len);
        if (r->flat == NULL) {
            ts__req_free(r);
            conn_fail(c, conn, TS_ENOMEM, "out of memory");
            return;
        }
        memcpy(r->flat, c->token, c->token_len);
        r->flat_len = r->flat_cap = c->token_len;
    }
    r->body_len = r->small_len + r->flat_len;
    c->state = TS__ST_HELLO;
    req_send(c, r);
}

static void connect_cb(uv_connect_t *req, int status)
{
    ts__conn *conn = req->data;
    ts_client_t *c = conn->c;
    if (conn->closing)
        return;
    if (status < 0) {
        conn_fail(c, conn, map_connect_err(status), uv_strerror(status));
        return;
    }
    int rc = uv_read_start(&conn->u.stream, alloc_cb, read_cb);
    if (rc != 0) {
        conn_fail(c, conn, TS_ECONNRESET, uv_strerror(rc));
        return;
    }
    c->reading = 1;
    send_hello(c, conn);
}

/* Connect a new TCP handle to addr. */
static void connect_tcp(ts_client_t *c, const struct sockaddr *addr)
{
    ts__conn *conn = conn_new(c);
    if (conn == NULL) {
        conn_fail(c, NULL, TS_ENOMEM, "out of memory");
        return;
    }
    uv_tcp_init(&c->loop, &conn->u.tcp);
    conn->u.handle.data = conn;
    conn->connect.data = conn;
    /* Small requests must not wait for Nagle's algorithm. */
    uv_tcp_nodelay(&conn->u.tcp, 1);
    c->conn = conn;
    int rc = uv_tcp_connect(&conn->connect, &conn->u.tcp, addr, connect_cb);
    if (rc != 0)
        conn_fail(c, conn, map_connect_err(rc), uv_strerror(rc));
}

typedef struct resolve_req {
    uv_getaddrinfo_t req;
    ts_client_t *c;
    unsigned gen;
} resolve_req;

static void resolve_cb(uv_getaddrinfo_t *req, int status, struct addrinfo *res)
{
    resolve_req *rr = (resolve_req *)req;
    ts_client_t *c = rr->c;
    int current = rr->gen == c->gen && c->state == TS__ST_CONNECTING;
    ts__free(rr);
    if (!current) {
        uv_freeaddrinfo(res);
        return;
    }
    if (status < 0 || res == NULL) {
        char msg[128];
        snprintf(msg, sizeof(msg), "cannot resolve %s: %s", c->host, uv_strerror(status));
        uv_freeaddrinfo(res);
        conn_fail(c, NULL, TS_ENOTCONN, msg);
        return;
    }
    /* tensord binds 127.0.0.1 by default, while "localhost" often lists ::1 first. */
    const struct addrinfo *pick = res;
    for (const struct addrinfo *ai = res; ai != NULL; ai = ai->ai_next) {
        if (ai->ai_family == AF_INET) {
            pick = ai;
            break;
        }
    }
    connect_tcp(c, pick->ai_addr);
    uv_freeaddrinfo(res);
}

/* Start one connection attempt, bounded by the connect timeout. */
static void start_attempt(ts_client_t *c)
{
    c->gen++;
    c->state = TS__ST_CONNECTING;
    uv_timer_start(&c->retry, retry_cb, (uint64_t)c->opts.connect_timeout_ms, 0);
    if (c->unix_path != NULL) {
        ts__conn *conn = conn_new(c);
        if (conn == NULL) {
            conn_fail(c, NULL, TS_ENOMEM, "out of memory");
            return;
        }
        uv_pipe_init(&c->loop, &conn->u.pipe, 0);
        conn->u.handle.data = conn;
        conn->connect.data = conn;
        c->conn = conn;
        uv_pipe_connect(&conn->connect, &conn->u.pipe, c->unix_path, connect_cb);
        return;
    }
    /* Numeric addresses need no resolver (and no thread pool). */
    struct sockaddr_storage ss;
    if (uv_ip4_addr(c->host, c->port, (struct sockaddr_in *)&ss) == 0 ||
        uv_ip6_addr(c->host, c->port, (struct sockaddr_in6 *)&ss) == 0) {
        connect_tcp(c, (const struct sockaddr *)&ss);
        return;
    }
    resolve_req *rr = ts__calloc(1, sizeof(*rr));
    if (rr == NULL) {
        conn_fail(c, NULL, TS_ENOMEM, "out of memory");
        return;
    }
    rr->c = c;
    rr->gen = c->gen;
    char port[16];
    snprintf(port, sizeof(port), "%d", c->port);
    struct addrinfo hints;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int rc = uv_getaddrinfo(&c->loop, &rr->req, resolve_cb, c->host, port, &hints);
    if (rc != 0) {
        ts__free(rr);
        conn_fail(c, NULL, TS_ENOTCONN, uv_strerror(rc));
    }
}

/* The one timer of the connection: the connect timeout while connecting, else the backoff. */
static void retry_cb(uv_timer_t *t)
{
    ts_client_t *c = t->data;
    if (c->state == TS__ST_BACKOFF)
        start_attempt(c);
    else if (c->state == TS__ST_CONNECTING || c->state == TS__ST_HELLO)
        conn_fail(c, c->conn, TS_ETIMEDOUT, "connect timed out");
}

/* ---------------------------------------------------------------------------------------------
 * The inbox, shutdown and the thread
 */

/* Take an unlisten off the queue: final callback now, then tell the server if connected. */
static void do_unlisten(ts_client_t *c, ts__req *r)
{
    sub_final(c, r->sub, TS_ECANCELED);
    if (c->state != TS__ST_READY) {
        ts__req_free(r);
        return;
    }
    r->kind = TS__K_FIRE;
    req_send(c, r);
}

/* ---------------------------------------------------------------------------------------------
 * Reading replies on the calling thread
 *
 * A blocking caller that wrote its frame directly still had to be woken by the I/O thread once
 * the reply was in: one thread crossing per call. So when the I/O thread has nothing to wait
 * for (no request in flight, no subscription, nothing queued), it stops reading the socket
 * (quiet_cb) and marks the reading side free; the next blocking caller takes it (rd_owner,
 * under mu, in direct_write_locked), reads its own reply (ts__self_read), and gives the socket
 * back free, or to the I/O thread when that has started to wait for something meanwhile
 * (rd_want) or when what arrived was not the caller's reply (the bytes read so far go back in
 * pb). While nobody reads, a duplicate of the socket is watched for the peer's hang-up only, so a
 * lost server is still noticed at once.
 */

static void hup_cb(uv_poll_t *p, int status, int events);

/* A caller gave up in the middle of a frame (rd_broken holds why): end the connection. */
static void conn_fail_broken(ts_client_t *c, int why)
{
    const char *msg = why == TS_EPROTO      ? "malformed reply from the server"
                      : why == TS_ETIMEDOUT ? "a reply was cut short by its request's deadline"
                      : why == TS_ENOMEM    ? "out of memory for a reply"
                                            : "the connection broke in the middle of a reply";
    conn_fail(c, c->conn, why, msg);
}

/* The I/O thread reads the socket again (it holds the reading side). */
static void start_reading(ts_client_t *c)
{
    ts__conn *conn = c->conn;
    if (c->reading || conn == NULL || conn->closing)
        return;
    if (conn->hup_on) {
        uv_poll_stop(&conn->hup);
        conn->hup_on = 0;
    }
    fd_set_blocking(c, 0); /* libuv reads and writes non-blocking */
    pthread_mutex_lock(&c->mu);
    int broken = c->rd_broken;
    size_t n = broken ? 0 : c->pb_len;
    if (n > 0)
        memcpy(conn->stage + conn->stage_len, c->pb, n);
    c->pb_len = 0;
    pthread_mutex_unlock(&c->mu);
    if (broken) {
        /* The stream is no longer at a frame boundary: never read on from there. */
        conn_fail_broken(c, broken);
        return;
    }
    int rc = uv_read_start(&conn->u.stream, alloc_cb, read_cb);
    if (rc != 0) {
        conn_fail(c, conn, TS_ECONNRESET, uv_strerror(rc));
        return;
    }
    c->reading = 1;
    if (n > 0) {
        conn->stage_len += n;
        process_stage(c, conn);
    }
}

/* The I/O thread has something to wait for: get the reading side back, now or from the caller. */
static void io_want_read(ts_client_t *c)
{
    if (c->reading || c->state != TS__ST_READY)
        return;
    pthread_mutex_lock(&c->mu);
    int take = c->rd_owner != TS__RD_CALLER;
    if (take)
        c->rd_owner = TS__RD_IO;
    else
        c->rd_want = 1;
    pthread_mutex_unlock(&c->mu);
    if (take)
        start_reading(c);
}

static void hup_cb(uv_poll_t *p, int status, int events)
{
    ts__conn *conn = p->data;
    ts_client_t *c = conn->c;
    (void)status;
    (void)events;
    uv_poll_stop(p); /* level-triggered: it would fire again at once */
    conn->hup_on = 0;
    conn->hup_seen = 1; /* never quiet again: the end of the stream must be read */
    if (conn == c->conn)
        io_want_read(c); /* reading finds the end of the stream (or a caller does) */
}

/* Before the loop waits: stop reading when nothing is awaited (see above). */
static void quiet_cb(uv_prepare_t *p)
{
    ts_client_t *c = p->data;
    ts__conn *conn = c->conn;
    if (!c->reading || c->state != TS__ST_READY || conn == NULL || conn->hup_fd < 0 ||
        conn->hup_seen || c->inflight.n != 0 || c->waitq_head != NULL ||
        conn->rstate != TS__RS_HDR || conn->stage_len != 0 || conn->discard != 0)
        return;
    pthread_mutex_lock(&c->mu);
    int idle = c->d_ready && c->rd_owner == TS__RD_IO && !c->rd_want && c->subs == NULL &&
               c->inbox_head == NULL && c->handoff == NULL && c->direct.n == 0;
    if (idle)
        c->rd_owner = TS__RD_FREE;
    pthread_mutex_unlock(&c->mu);
    if (!idle)
        return;
    uv_read_stop(&conn->u.stream);
    c->reading = 0;
    if (uv_poll_start(&conn->hup, UV_DISCONNECT, hup_cb) == 0) {
        conn->hup_on = 1;
        fd_set_blocking(c, 1);
    } else {
        io_want_read(c);
    }
}

/*
 * Put the socket in blocking mode or back (I/O thread; see fd_blocking). A blocking receive
 * gives up after TS__RCV_SLICE_MS, so a caller still checks its deadline that often.
 */
#define TS__RCV_SLICE_MS 50
static void fd_set_blocking(ts_client_t *c, int on)
{
    pthread_mutex_lock(&c->mu);
    int was = c->fd_blocking;
    int fd = c->d_fd;
    pthread_mutex_unlock(&c->mu);
    if (was == on || fd < 0)
        return;
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return;
    if (on) {
        struct timeval tv = {0, TS__RCV_SLICE_MS * 1000};
        if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
            fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0)
            return;
    } else if (fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0) {
        return;
    }
    pthread_mutex_lock(&c->mu);
    c->fd_blocking = on;
    pthread_mutex_unlock(&c->mu);
}

/* Wait until fd is readable (or hung up): 1, 0 when the deadline passed, -1 on an error. */
static int wait_readable(int fd, uint64_t deadline_ns)
{
    for (;;) {
        uint64_t now = ts__now_ns();
        if (now >= deadline_ns)
            return 0;
        uint64_t ms = (deadline_ns - now + 999999u) / 1000000u;
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int k = poll(&pfd, 1, ms > INT_MAX ? INT_MAX : (int)ms);
        if (k > 0)
            return 1;
        if (k < 0 && errno != EINTR)
            return -1;
    }
}

/* Why a read on the calling thread stopped short. */
enum { RR_OK = 0, RR_EOF, RR_ERR, RR_DEADLINE };

/*
 * Read between min and max bytes into buf (min: block for them). Returns bytes read; *why.
 * With ready, data is expected at once (the rest of a frame): recv first, poll only when the
 * socket runs dry; otherwise (a reply not yet sent) poll first, which saves a recv that would
 * find nothing.
 */
static size_t read_some(int fd, uint8_t *buf, size_t min, size_t max, uint64_t deadline, int ready,
                        int block, int *why)
{
    size_t got = 0;
    *why = RR_OK;
    while (got < min) {
        if (!ready && !block) {
            int w = wait_readable(fd, deadline);
            if (w <= 0) {
                *why = w == 0 ? RR_DEADLINE : RR_ERR;
                break;
            }
        }
        /* With block, the socket was in blocking mode: recv waits (a slice at most). */
        ssize_t k = recv(fd, buf + got, max - got, block && !ready ? 0 : MSG_DONTWAIT);
        if (k > 0) {
            got += (size_t)k;
            ready = 1;
        } else if (k == 0) {
            *why = RR_EOF;
            break;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            if (block && !ready && ts__now_ns() >= deadline) {
                *why = RR_DEADLINE;
                break;
            }
            if (block && !ready)
                block = 0; /* a slice passed, or the socket is non-blocking again: poll */
            ready = 0;
        } else if (errno != EINTR) {
            *why = RR_ERR;
            break;
        }
    }
    return got;
}

/*
 * Give the reading side back (mu held): free, or to the I/O thread when it waits for something
 * or has bytes to process.
 */
static void release_reading_locked(ts_client_t *c)
{
    if (c->rd_want || c->rd_broken || c->pb_len > 0 || c->direct.n > 0 || c->subs != NULL ||
        c->inbox_head != NULL || c->handoff != NULL) {
        c->rd_owner = TS__RD_IO;
        c->rd_want = 0;
        if (!c->closing)
            uv_async_send(&c->async);
    } else {
        c->rd_owner = TS__RD_FREE;
    }
    pthread_cond_broadcast(&c->rd_cond);
}

int ts__self_read(ts_client_t *c, ts__req *r)
{
    /* The reading side is this thread's: so is c->pb, which holds nothing (see quiet_cb). */
    uint8_t *buf = c->pb;
    int why;
    int fd = r->rfd;
    size_t got =
        read_some(fd, buf, TS_HDR_SIZE, TS__STAGE_SIZE, r->deadline_ns, 0, r->rblock, &why);
    ts__hdr h;
    int mine = got >= TS_HDR_SIZE && ts__hdr_decode(buf, TS_MAGIC_REP, &h) == 0 &&
               h.opcode == r->op && h.request_id == r->id && reply_hdr_check(c, &h, r->rlz4) == 0;
    if (!mine) {
        /*
         * Not (all of) our reply: what was read stays for the I/O thread, which reads on; a
         * reply that is ours reaches r through c->direct as usual. So does everything that
         * breaks the protocol at the header (a malformed header, a body over its reply's bound,
         * a connection-level error): the I/O thread fails the connection and r with it, exactly
         * as if it had read the frame itself.
         */
        pthread_mutex_lock(&c->mu);
        int timeout = why == RR_DEADLINE && r->direct;
        if (timeout) {
            ts__idmap_del(&c->direct, r->id);
            r->direct = 0;
        }
        c->pb_len = got;
        r->self_read = 0;
        release_reading_locked(c);
        pthread_mutex_unlock(&c->mu);
        return timeout ? TS__SELF_TIMEOUT : TS__SELF_WAIT;
    }
    size_t blen = (size_t)h.body_len;
    size_t have = got - TS_HDR_SIZE;
    uint8_t *body = buf + TS_HDR_SIZE;
    int owned = 0;
    int status = 0;
    if (have < blen) {
        body = ts__malloc_aligned(blen);
        if (body == NULL) {
            status = TS_ENOMEM; /* the rest of the frame cannot be kept: the connection goes */
            why = RR_ERR;
        } else {
            owned = 1;
            memcpy(body, buf + TS_HDR_SIZE, have);
            have +=
                read_some(fd, body + have, blen - have, blen - have, r->deadline_ns, 1, 0, &why);
        }
    }
    size_t extra = have > blen ? have - blen : 0; /* the start of the next frame */
    int cut = have < blen;
    int malformed = 0;
    if (cut) {
        if (owned)
            ts__body_free(body, blen);
        if (status == 0)
            status = why == RR_DEADLINE ? TS_ETIMEDOUT : TS_ECONNRESET;
    } else {
        /* A body still in buf is parsed (or copied) before buf is handed on below. */
        status = reply_apply(r, &h, body, blen, owned, &malformed);
    }
    pthread_mutex_lock(&c->mu);
    /* Ours since the header was read: nobody else takes a request out of c->direct meanwhile. */
    ts__idmap_del(&c->direct, r->id);
    r->direct = 0;
    r->self_read = 0;
    if (cut && c->closing)
        status = TS_ECANCELED; /* ts_client_free shut the socket under us */
    if (cut || malformed) {
        /* Part of a frame is gone: the connection cannot go on. */
        c->rd_broken = malformed             ? TS_EPROTO
                       : why == RR_DEADLINE  ? TS_ETIMEDOUT
                       : status == TS_ENOMEM ? TS_ENOMEM
                                             : TS_ECONNRESET;
    } else if (extra > 0) {
        memmove(buf, buf + TS_HDR_SIZE + blen, extra);
        c->pb_len = extra;
    }
    release_reading_locked(c);
    r->status = status;
    r->done = 1;
    pthread_mutex_unlock(&c->mu);
    return TS__SELF_DONE;
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
        io_shutdown(c);
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

    fd_set_blocking(c, 0); /* before any write of this drain */
    if (broken && c->conn != NULL) {
        conn_fail_broken(c, broken);
    } else if (take_back && c->state == TS__ST_READY) {
        start_reading(c); /* a caller handed the socket back */
    }
    if (handoff != NULL)
        write_handoff(c, handoff); /* the rest of a direct write goes first */
    if (c->state == TS__ST_IDLE)
        start_attempt(c);
    ts__req *batch[TS__SEND_BATCH];
    size_t nb = 0;
    while (list != NULL) {
        ts__req *r = list;
        list = r->next;
        r->next = NULL;
        if (r->kind != TS__K_UNLISTEN && c->state == TS__ST_READY && c->waitq_head == NULL) {
            /* Gathered and written together (see req_send_batch). */
            batch[nb++] = r;
            if (nb == TS__SEND_BATCH) {
                req_send_batch(c, batch, nb);
                nb = 0;
            }
            continue;
        }
        if (nb > 0) {
            req_send_batch(c, batch, nb);
            nb = 0;
        }
        if (c->state == TS__ST_CLOSED) {
            req_finish(c, r, TS_ECANCELED);
        } else if (r->kind == TS__K_UNLISTEN) {
            do_unlisten(c, r);
        } else if (c->state == TS__ST_READY && c->waitq_head == NULL) {
            req_send(c, r);
        } else {
            append_waitq(c, r);
            ensure_tick(c);
        }
    }
    if (nb > 0)
        req_send_batch(c, batch, nb);
    io_write_end(c);
    io_want_read(c);
}

/* Close everything: pending requests get TS_ECANCELED, subscriptions their final callback. */
static void io_shutdown(ts_client_t *c)
{
    if (c->state == TS__ST_CLOSED)
        return;
    c->state = TS__ST_CLOSED;
    c->gen++;
    atomic_store(&c->connected, 0);
    uv_timer_stop(&c->retry);
    uv_timer_stop(&c->tick);
    c->tick_on = 0;
    ts__req *dlist = direct_stop(c); /* before the descriptor closes */
    /* Closing the socket first guarantees that no cancelled put's memory is read any more. */
    if (c->conn != NULL) {
        conn_close(c->conn);
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

    while (list != NULL) {
        ts__req *r = list;
        list = r->next;
        r->next = NULL;
        req_finish(c, r, TS_ECANCELED);
    }
    while (c->waitq_head != NULL) {
        ts__req *r = c->waitq_head;
        c->waitq_head = r->next;
        r->next = NULL;
        req_finish(c, r, TS_ECANCELED);
    }
    c->waitq_tail = NULL;
    fail_inflight(c, TS_ECANCELED, NULL);
    direct_fail(c, dlist, TS_ECANCELED, NULL);
    while (subs != NULL) {
        ts__sub *s = subs;
        subs = s->next;
        s->next = NULL;
        if (s->live)
            sub_final(c, s, TS_ECANCELED);
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
    pthread_mutex_lock(&c->mu);
    while (c->waiters > 0)
        pthread_cond_wait(&c->open_cond, &c->mu);
    pthread_mutex_unlock(&c->mu);
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

void ts_options_init(ts_options_t *opts)
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

/* Split address into host/port or a unix path. 0 or TS_EINVAL. */
static int parse_address(ts_client_t *c, const char *address)
{
    const char *a = address;
    if (strncmp(a, "unix://", 7) == 0 || strncmp(a, "unix:", 5) == 0) {
        a += strncmp(a, "unix://", 7) == 0 ? 7 : 5;
        if (a[0] == '\0')
            return TS_EINVAL;
        c->unix_path = ts__strndup(a, strlen(a));
        return c->unix_path != NULL ? 0 : TS_ENOMEM;
    }
    if (strncmp(a, "tcp://", 6) == 0)
        a += 6;
    const char *colon = strrchr(a, ':');
    if (colon == NULL || colon == a || colon[1] == '\0')
        return TS_EINVAL;
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (*end != '\0' || port <= 0 || port > 65535)
        return TS_EINVAL;
    const char *h = a;
    size_t hl = (size_t)(colon - a);
    if (h[0] == '[') { /* [v6-address]:port */
        if (hl < 3 || h[hl - 1] != ']')
            return TS_EINVAL;
        h++;
        hl -= 2;
    }
    c->host = ts__strndup(h, hl);
    c->port = (int)port;
    return c->host != NULL ? 0 : TS_ENOMEM;
}

/* Copy opts with defaults for unset fields. */
static int setup_options(ts_client_t *c, const ts_options_t *opts)
{
    ts_options_init(&c->opts);
    if (opts != NULL) {
        if (opts->connect_timeout_ms > 0)
            c->opts.connect_timeout_ms = opts->connect_timeout_ms;
        if (opts->request_timeout_ms > 0)
            c->opts.request_timeout_ms = opts->request_timeout_ms;
        if (opts->reconnect_min_ms > 0)
            c->opts.reconnect_min_ms = opts->reconnect_min_ms;
        if (opts->reconnect_max_ms > 0)
            c->opts.reconnect_max_ms = opts->reconnect_max_ms;
        c->opts.compress_min = opts->compress_min;
        if (opts->max_reply_bytes > 0)
            c->opts.max_reply_bytes = opts->max_reply_bytes < TS__MAX_REPLY_BODY
                                          ? opts->max_reply_bytes
                                          : TS__MAX_REPLY_BODY;
    }
    if (c->opts.reconnect_max_ms < c->opts.reconnect_min_ms)
        c->opts.reconnect_max_ms = c->opts.reconnect_min_ms;
    c->opts.auth_token = NULL;
    const char *token =
        opts != NULL && opts->auth_token != NULL ? opts->auth_token : getenv("TS_AUTH_TOKEN");
    if (token != NULL && token[0] != '\0') {
        c->token_len = strlen(token);
        if (c->token_len > TS__MAX_TOKEN)
            return TS_EINVAL;
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
    uv_prepare_start(&c->quiet, quiet_cb);
    return 0;
}

int ts_client_open(ts_client_t **out, const char *address, const ts_options_t *opts)
{
    if (out == NULL || address == NULL)
        return TS_EINVAL;
    ts__set_last_error(NULL, 0);
    /*
     * Large received bodies are released into a small process-wide cache, so that pulling the
     * same tensors again reuses the last buffer instead of faulting in and zeroing a fresh one.
     */
    ts__alloc_cache_enable(TS__RECV_CACHE_BYTES);
    ts_client_t *c = ts__calloc(1, sizeof(*c));
    if (c == NULL)
        return TS_ENOMEM;
    int rc = (c->address = ts__strndup(address, strlen(address))) == NULL ? TS_ENOMEM : 0;
    if (rc == 0)
        rc = parse_address(c, address);
    if (rc == 0)
        rc = setup_options(c, opts);
    if (rc != 0) {
        ts__free(c->address);
        ts__free(c->host);
        ts__free(c->unix_path);
        ts__free(c->token);
        ts__free(c);
        return rc;
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_condattr_init(&c->condattr);
    pthread_condattr_setclock(&c->condattr, CLOCK_MONOTONIC);
    pthread_cond_init(&c->open_cond, &c->condattr);
    pthread_cond_init(&c->rd_cond, NULL);
    c->backoff_ms = c->opts.reconnect_min_ms;
    c->next_id = 1;
    c->d_next_id = 1;
    c->pb = ts__malloc(TS__STAGE_SIZE); /* NULL: replies are always read by the I/O thread */
    c->d_fd = -1;
    c->state = TS__ST_IDLE;
    if (setup_loop(c) != 0) {
        client_destroy(c);
        return TS_ENOMEM;
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
        return TS_EAGAIN;
    }

    uint64_t until =
        ts__now_ns() + (uint64_t)(c->opts.connect_timeout_ms + TS__OPEN_GRACE_MS) * 1000000u;
    struct timespec ts = {(time_t)(until / 1000000000u), (long)(until % 1000000000u)};
    pthread_mutex_lock(&c->mu);
    while (!c->open_done) {
        if (pthread_cond_timedwait(&c->open_cond, &c->mu, &ts) != 0 && !c->open_done) {
            c->open_status = TS_ETIMEDOUT;
            snprintf(c->open_msg, sizeof(c->open_msg), "%s: connect timed out", c->address);
            if (!c->closing) {
                c->closing = 1;
                uv_async_send(&c->async);
            }
            break;
        }
    }
    rc = c->open_status;
    char msg[sizeof(c->open_msg)];
    memcpy(msg, c->open_msg, sizeof(msg));
    pthread_mutex_unlock(&c->mu);
    if (rc != 0) {
        pthread_join(c->thread, NULL);
        client_destroy(c);
        ts__set_last_error(msg, strnlen(msg, sizeof(msg)));
        return rc;
    }
    *out = c;
    return 0;
}

void ts_client_free(ts_client_t *c)
{
    if (c == NULL)
        return;
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
    return c != NULL && atomic_load(&c->connected) ? 1 : 0;
}
