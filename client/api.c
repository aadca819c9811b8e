/*
 * The public client operations: each builds a request on the calling thread (encoding the body
 * there, so the I/O thread only writes), hands it to the I/O thread, and either waits for it
 * (blocking forms) or returns (asynchronous forms, completed by callback on the I/O thread).
 */
#include "internal.h"

#include "compress.h"
#include "msg.h"

#include <errno.h>
#include <time.h>

/* Deadline timeout_ms from now, in monotonic nanoseconds. */
static uint64_t deadline_after(int64_t timeout_ms)
{
    return ts__now_ns() + (uint64_t)timeout_ms * 1000000u;
}

/*
 * A new request for op on bin (NULL for requests without a bin), its body encoded by the codec
 * from the name and the fields of args that op's body has (NULL: none). Returns NULL and *rc on
 * failure.
 */
static ts__req *req_new(ts_client_t *c, int kind, uint8_t op, const char *bin,
                        const ts__msg_name_req *args, int *rc)
{
    ts__msg_name_req m;
    memset(&m, 0, sizeof(m));
    if (args != NULL)
        m = *args;
    if (bin != NULL) {
        m.name = (const uint8_t *)bin;
        m.name_len = strlen(bin);
        if (m.name_len > TS_MAX_NAME_LEN) {
            *rc = ts__fail(TS_ENAMETOOLONG, "bin name of %zu bytes (at most %d)", m.name_len,
                           TS_MAX_NAME_LEN);
            return NULL;
        }
    }
    ts__req *r = ts__calloc(1, sizeof(*r));
    if (r == NULL) {
        *rc = ts__fail(TS_ENOMEM, NULL);
        return NULL;
    }
    r->c = c;
    r->kind = kind;
    r->op = op;
    *rc = ts__req_body(r, &m);
    if (*rc != 0) {
        ts__free(r);
        ts__fail(*rc, NULL);
        return NULL;
    }
    r->deadline_ns = deadline_after(c->opts.request_timeout_ms);
    if (kind == TS__K_BLOCK) /* ts__req_free destroys it for this kind */
        pthread_cond_init(&r->cond, &c->condattr);
    return r;
}

/*
 * Attach item's record to a PUT/APPEND request. By default the request keeps the plan, whose
 * segments point at the caller's tensors (sent with writev, never copied). With TS_COPY, or
 * when the body is compressed, the record is copied into one buffer the request owns.
 */
static int attach_record(ts_client_t *c, ts__req *r, const ts_value_t *item, unsigned flags)
{
    ts__enc e;
    int rc = ts__record_plan(item, &e);
    if (rc != 0)
        return rc;
    size_t name_part = r->small_len;
    uint64_t body_len = name_part + e.total;
    size_t cmin = c->opts.compress_min;
    if (cmin > 0 && atomic_load(&c->lz4) && body_len >= cmin && ts__lz4_bound(body_len) != 0) {
        /* The whole body (name included) is one lz4 block; see TS_FLAG_LZ4. */
        size_t raw_len = (size_t)body_len;
        size_t cap = ts__lz4_bound(raw_len);
        uint8_t *raw = ts__malloc_aligned(raw_len);
        uint8_t *z = ts__malloc_aligned(cap);
        if (raw == NULL || z == NULL) {
            ts__free_aligned(raw, raw_len);
            ts__free_aligned(z, cap);
            ts__enc_free(&e);
            return TS_ENOMEM;
        }
        memcpy(raw, r->small + TS_HDR_SIZE, name_part);
        ts__enc_copy(&e, raw + name_part);
        ts__enc_free(&e);
        size_t zlen;
        if (ts__lz4_compress(raw, raw_len, z, cap, &zlen) == 0) {
            ts__free_aligned(raw, raw_len);
            r->flat = z;
            r->flat_len = zlen;
            r->flat_cap = cap;
            r->hflags = TS_FLAG_LZ4;
        } else { /* incompressible: send the copy raw */
            ts__free_aligned(z, cap);
            r->flat = raw;
            r->flat_len = r->flat_cap = raw_len;
        }
        r->small_len = 0;
        r->body_len = r->flat_len;
        return 0;
    }
    if (flags & TS_COPY) {
        r->flat = ts__malloc_aligned((size_t)e.total);
        if (r->flat == NULL) {
            ts__enc_free(&e);
            return TS_ENOMEM;
        }
        ts__enc_copy(&e, r->flat);
        r->flat_len = r->flat_cap = (size_t)e.total;
        ts__enc_free(&e);
        r->body_len = body_len;
        return 0;
    }
    r->enc = e;
    r->borrowed = 1;
    r->body_len = body_len;
    return 0;
}

/* The message of a finished request for ts_last_error(): the server's, or the code's. */
static void keep_message(const ts__req *r)
{
    if (r->msg != NULL)
        ts__set_last_error(r->msg, strlen(r->msg));
    else if (r->status < 0)
        ts_set_last_error(ts_strerror(r->status));
    else
        ts__set_last_error(NULL, 0);
}

/*
 * A blocking caller is done with c (mu held): after mu is released, c is never touched again,
 * so a ts_client_free running on another thread may then free it (see client_destroy).
 */
static void leave_client_locked(ts_client_t *c)
{
    if (--c->waiters == 0 && c->closing)
        pthread_cond_broadcast(&c->open_cond);
}

/*
 * Submit a blocking request and wait for it. Returns its status; r stays the caller's to read
 * and free, except when the wait gave up (TS_ETIMEDOUT with *gone = 1): r then belongs to the
 * I/O thread, which frees it once it is done with it.
 */
static int wait_done(ts_client_t *c, ts__req *r, int self_read, int *gone)
{
    *gone = 0;
    uint64_t until = r->deadline_ns + (uint64_t)TS__BLOCK_GRACE_MS * 1000000u;
    struct timespec ts = {(time_t)(until / 1000000000u), (long)(until % 1000000000u)};
    struct timespec dl = {(time_t)(r->deadline_ns / 1000000000u),
                          (long)(r->deadline_ns % 1000000000u)};
    ts__sub *drop = NULL;
    if (self_read && ts__self_read(c, r) == TS__SELF_TIMEOUT) {
        pthread_mutex_lock(&c->mu);
        leave_client_locked(c);
        pthread_mutex_unlock(&c->mu);
        ts_set_last_error(TS__NO_REPLY_MSG);
        return TS_ETIMEDOUT; /* r is the caller's again */
    }
    pthread_mutex_lock(&c->mu);
    while (r->bstate != TS__B_DONE) {
        /*
         * A request the caller wrote itself (TS__B_DIRECT) waits for its reply in c->direct,
         * where no deadline timer sees it: at its deadline the caller takes it back and gives up.
         */
        int direct = r->bstate == TS__B_DIRECT;
        if (pthread_cond_timedwait(&r->cond, &c->mu, direct ? &dl : &ts) != ETIMEDOUT ||
            r->bstate == TS__B_DONE)
            continue;
        if (ts__direct_withdraw_locked(c, r)) {
            leave_client_locked(c);
            pthread_mutex_unlock(&c->mu);
            ts_set_last_error(TS__NO_REPLY_MSG);
            return TS_ETIMEDOUT; /* a late reply finds no request and is dropped */
        }
        if (!direct)
            break;
        /* The I/O thread took it meanwhile (its reply, or a lost connection): wait for that. */
    }
    if (r->bstate != TS__B_DONE) {
        /*
         * The I/O thread did not answer in time (a callback holds it up). Give the request up;
         * if the I/O thread is writing our memory right now, wait for that write to end.
         */
        r->bstate = TS__B_ABANDONED_WAIT;
        if (r->sub != NULL && r->sub->linked) {
            for (ts__sub **p = &c->subs; *p != NULL; p = &(*p)->next) {
                if (*p == r->sub) {
                    *p = r->sub->next;
                    break;
                }
            }
            r->sub->linked = 0;
            drop = r->sub;
        }
        /*
         * In TS__B_ABANDONED_WAIT the I/O thread does not free r: a completion meanwhile makes
         * it TS__B_DONE and leaves it to us; otherwise r is the I/O thread's (TS__B_ABANDONED)
         * once we let go of mu.
         */
        while (r->wbusy && r->borrowed && r->bstate != TS__B_DONE)
            pthread_cond_wait(&r->cond, &c->mu);
        if (r->bstate != TS__B_DONE)
            r->bstate = TS__B_ABANDONED;
        *gone = r->bstate != TS__B_DONE;
        leave_client_locked(c);
        pthread_mutex_unlock(&c->mu);
        ts__sub_unref(drop);
        ts_set_last_error(TS__NO_REPLY_MSG);
        return TS_ETIMEDOUT;
    }
    leave_client_locked(c);
    pthread_mutex_unlock(&c->mu);
    keep_message(r);
    return r->status;
}

/* Submit a blocking request and wait for it (see wait_done). */
static int block_on(ts_client_t *c, ts__req *r, int *gone)
{
    *gone = 0;
    pthread_mutex_lock(&c->mu);
    int rc = ts__submit_blocking_locked(c, r);
    /* Read under mu: once the I/O thread has r, it may move bstate at any time. */
    int self_read = r->bstate == TS__B_SELF_READ;
    pthread_mutex_unlock(&c->mu);
    if (rc != 0)
        return ts__fail(rc, NULL);
    return wait_done(c, r, self_read, gone);
}

/*
 * Check the arguments every operation shares, and clear the thread's message (a failure below
 * sets its own).
 */
static int check_call(ts_client_t *c, int blocking)
{
    if (c == NULL)
        return ts__fail(TS_EINVAL, "no client");
    if (blocking && ts__on_io_thread(c))
        return ts__fail(TS_EDEADLK, "blocking call made from a client callback");
    ts__set_last_error(NULL, 0);
    return 0;
}

/* TS_EINVAL for a request of op called without what (a bin name, out, ...), with that message. */
static int missing(uint8_t op, const char *what)
{
    return ts__fail(TS_EINVAL, "%s needs %s (got NULL)", ts__op_name(op), what);
}

/*
 * Run a blocking request to the end. On success (and for a WAIT that timed out on the server,
 * which carries the bin's state) r is returned in *out for the caller to read and free; else
 * *out is NULL.
 */
static int run_blocking(ts_client_t *c, ts__req *r, ts__req **out)
{
    *out = NULL;
    int gone;
    /* A cluster's shard client follows WRONG_SHARD redirects (r may end on another shard). */
    int rc = c->shard != NULL ? ts__cluster_block(c, r, &gone) : block_on(c, r, &gone);
    if (gone)
        return rc;
    /*
     * WAIT's TIMEOUT, PUT_IF's VERSION_MISMATCH and PS_PUSH's STALE_GRADIENT carry the bin's
     * state: the caller reads it.
     */
    if (rc == 0 || ((r->op == TS_OP_WAIT || r->op == TS_OP_PUT_IF || r->op == TS_OP_PS_PUSH) &&
                    r->have_state)) {
        *out = r;
        return rc;
    }
    ts__req_free(r);
    return rc;
}

/* Submit an asynchronous request; on failure it is freed and the callback never called. */
static int run_async(ts_client_t *c, ts__req *r, ts_result_cb cb, void *arg)
{
    r->cb = cb;
    r->arg = arg;
    int rc = ts__submit(c, r);
    if (rc != 0) {
        ts__req_free(r);
        ts__fail(rc, NULL);
    }
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * Blocking operations
 */

/*
 * The PUT or APPEND (op) request of kind on bin with item's record attached per flags (see
 * attach_record), made after the call checks. NULL and *rc on failure: TS_EINVAL without a bin or
 * an item, or the error with its message set.
 */
static ts__req *store_req(ts_client_t *c, int kind, uint8_t op, const char *bin,
                          const ts_value_t *item, unsigned flags, int *rc)
{
    if (bin == NULL || item == NULL) {
        *rc = missing(op, bin == NULL ? "a bin name" : "an item");
        return NULL;
    }
    ts__req *r = req_new(c, kind, op, bin, NULL, rc);
    if (r == NULL)
        return NULL;
    *rc = attach_record(c, r, item, flags);
    if (*rc != 0) {
        ts__req_free(r);
        *rc = ts__fail(*rc, "the item cannot be encoded: %s", ts__record_plan_why(*rc));
        return NULL;
    }
    return r;
}

static int store_op(ts_client_t *c, uint8_t op, const char *bin, const ts_value_t *item,
                    uint64_t *version)
{
    c = ts__route(c, bin);
    int rc = check_call(c, 1);
    if (rc != 0)
        return rc;
    /* The call waits, so the tensors are sent straight from the caller's memory. */
    ts__req *r = store_req(c, TS__K_BLOCK, op, bin, item, TS_BORROW, &rc);
    if (r == NULL)
        return rc;
    ts__req *done;
    rc = run_blocking(c, r, &done);
    if (rc == 0) {
        if (version != NULL)
            *version = done->res.version;
        ts__req_free(done);
    }
    return rc;
}

int ts_put(ts_client_t *c, const char *bin, const ts_value_t *item, uint64_t *version)
{
    return store_op(c, TS_OP_PUT, bin, item, version);
}

int ts_append(ts_client_t *c, const char *bin, const ts_value_t *item, uint64_t *version)
{
    return store_op(c, TS_OP_APPEND, bin, item, version);
}

/* The arguments of GET and PEEK: max_items (0 = all), at most what the u32 field carries. */
static ts__msg_name_req max_items_args(size_t max_items)
{
    ts__msg_name_req m;
    memset(&m, 0, sizeof(m));
    m.max_items = max_items > UINT32_MAX ? UINT32_MAX : (uint32_t)max_items;
    return m;
}

/*
 * Run a blocking request without a record: op on bin (NULL for none) with the arguments args.
 * lacks is what the caller's own argument check found missing (NULL: nothing), reported after
 * the call checks like everywhere else.
 * Returns 0 with *done the completed request (free it with ts__req_free), or an error.
 */
static int simple_blocking(ts_client_t *c, const char *lacks, uint8_t op, const char *bin,
                           const ts__msg_name_req *args, ts__req **done)
{
    c = ts__route(c, bin);
    int rc = check_call(c, 1);
    if (rc != 0)
        return rc;
    if (lacks != NULL)
        return missing(op, lacks);
    ts__req *r = req_new(c, TS__K_BLOCK, op, bin, args, &rc);
    if (r == NULL)
        return rc;
    return run_blocking(c, r, done);
}

static int fetch_op(ts_client_t *c, uint8_t op, const char *bin, size_t max_items, ts_items_t **out)
{
    ts__msg_name_req args = max_items_args(max_items);
    ts__req *done;
    int rc = simple_blocking(c,
                             bin == NULL   ? "a bin name"
                             : out == NULL ? "an out pointer"
                                           : NULL,
                             op, bin, &args, &done);
    if (rc == 0) {
        *out = done->res.items;
        done->res.items = NULL;
        ts__req_free(done);
    }
    return rc;
}

int ts_get(ts_client_t *c, const char *bin, size_t max_items, ts_items_t **out)
{
    return fetch_op(c, TS_OP_GET, bin, max_items, out);
}

int ts_peek(ts_client_t *c, const char *bin, size_t max_items, ts_items_t **out)
{
    return fetch_op(c, TS_OP_PEEK, bin, max_items, out);
}

int ts_delete(ts_client_t *c, const char *bin, uint32_t *n_removed)
{
    ts__req *done;
    int rc = simple_blocking(c, bin == NULL ? "a bin name" : NULL, TS_OP_DELETE, bin, NULL, &done);
    if (rc == 0) {
        if (n_removed != NULL)
            *n_removed = done->res.n_items;
        ts__req_free(done);
    }
    return rc;
}

int ts_list(ts_client_t *c, ts_bin_list_t **out)
{
    if (c != NULL && c->cl != NULL)
        return ts__cluster_list(c, out);
    ts__req *done;
    int rc =
        simple_blocking(c, out == NULL ? "an out pointer" : NULL, TS_OP_LIST, NULL, NULL, &done);
    if (rc == 0) {
        *out = done->res.bins;
        done->res.bins = NULL;
        ts__req_free(done);
    }
    return rc;
}

/*
 * A WAIT request for bin after after_version; its deadline leaves a margin. timeout_ms follows
 * tensorshare.h "Timeouts": TS_TIMEOUT_DEFAULT is the request timeout, 0 is sent as 0 (the
 * server checks once and answers at once), and TS_TIMEOUT_INFINITE as the largest u32, which
 * the server caps (tensord: 24 hours) and then answers TIMEOUT.
 */
static ts__req *wait_req(ts_client_t *c, int kind, const char *bin, uint64_t after_version,
                         int timeout_ms, int *rc)
{
    uint32_t wire_ms;
    if (timeout_ms == TS_TIMEOUT_DEFAULT) {
        wire_ms = (uint32_t)c->opts.request_timeout_ms;
    } else if (timeout_ms == TS_TIMEOUT_INFINITE) {
        wire_ms = UINT32_MAX;
    } else if (timeout_ms >= 0) {
        wire_ms = (uint32_t)timeout_ms;
    } else {
        *rc = ts__fail(TS_EINVAL,
                       "timeout_ms %d: expected milliseconds >= 0, TS_TIMEOUT_DEFAULT or "
                       "TS_TIMEOUT_INFINITE",
                       timeout_ms);
        return NULL;
    }
    ts__msg_name_req args;
    memset(&args, 0, sizeof(args));
    args.after_version = after_version;
    args.timeout_ms = wire_ms;
    ts__req *r = req_new(c, kind, TS_OP_WAIT, bin, &args, rc);
    if (r == NULL)
        return NULL;
    /* The server answers at wire_ms; the usual request timeout is the margin for that. */
    r->deadline_ns = deadline_after((int64_t)wire_ms + c->opts.request_timeout_ms);
    return r;
}

int ts_wait(ts_client_t *c, const char *bin, uint64_t after_version, int timeout_ms,
            uint64_t *version, uint32_t *n_items)
{
    c = ts__route(c, bin);
    int rc = check_call(c, 1);
    if (rc != 0)
        return rc;
    if (bin == NULL)
        return missing(TS_OP_WAIT, "a bin name");
    ts__req *r = wait_req(c, TS__K_BLOCK, bin, after_version, timeout_ms, &rc);
    if (r == NULL)
        return rc;
    ts__req *done;
    rc = run_blocking(c, r, &done);
    if (done != NULL) { /* success, or the server's TIMEOUT with the bin's state */
        if (version != NULL)
            *version = done->res.version;
        if (n_items != NULL)
            *n_items = done->res.n_items;
        ts__req_free(done);
    }
    return rc;
}

int ts_stats(ts_client_t *c, ts_value_t **out)
{
    if (c != NULL && c->cl != NULL)
        return ts__cluster_stats(c, out);
    ts__req *done;
    int rc =
        simple_blocking(c, out == NULL ? "an out pointer" : NULL, TS_OP_STATS, NULL, NULL, &done);
    if (rc == 0) {
        *out = done->res.value;
        done->res.value = NULL;
        ts__req_free(done);
    }
    return rc;
}

/* PING or SAVE (op): a request without a bin or results, sent to every shard of a cluster. */
static int server_op(ts_client_t *c, uint8_t op)
{
    if (c != NULL && c->cl != NULL)
        return ts__cluster_each(c, op);
    ts__req *done;
    int rc = simple_blocking(c, NULL, op, NULL, NULL, &done);
    if (rc == 0)
        ts__req_free(done);
    return rc;
}

int ts_ping(ts_client_t *c)
{
    return server_op(c, TS_OP_PING);
}

int ts_save(ts_client_t *c)
{
    return server_op(c, TS_OP_SAVE);
}

/* ---------------------------------------------------------------------------------------------
 * Asynchronous operations
 */

static int store_async(ts_client_t *c, uint8_t op, const char *bin, const ts_value_t *item,
                       unsigned flags, ts_result_cb cb, void *arg)
{
    c = ts__route(c, bin);
    int rc = check_call(c, 0);
    if (rc != 0)
        return rc;
    ts__req *r = store_req(c, TS__K_ASYNC, op, bin, item, flags, &rc);
    if (r == NULL)
        return rc;
    return run_async(c, r, cb, arg);
}

int ts_put_async(ts_client_t *c, const char *bin, const ts_value_t *item, unsigned flags,
                 ts_result_cb cb, void *arg)
{
    return store_async(c, TS_OP_PUT, bin, item, flags, cb, arg);
}

int ts_append_async(ts_client_t *c, const char *bin, const ts_value_t *item, unsigned flags,
                    ts_result_cb cb, void *arg)
{
    return store_async(c, TS_OP_APPEND, bin, item, flags, cb, arg);
}

static int simple_async(ts_client_t *c, uint8_t op, const char *bin, const ts__msg_name_req *args,
                        ts_result_cb cb, void *arg)
{
    if (c != NULL && c->cl != NULL && bin == NULL)
        return ts__cluster_fanout_async(c, op, cb, arg); /* LIST, STATS, PING */
    c = ts__route(c, bin);
    int rc = check_call(c, 0);
    if (rc != 0)
        return rc;
    ts__req *r = req_new(c, TS__K_ASYNC, op, bin, args, &rc);
    if (r == NULL)
        return rc;
    return run_async(c, r, cb, arg);
}

/* GET or PEEK (op), as fetch_op but completed by cb. */
static int fetch_async(ts_client_t *c, uint8_t op, const char *bin, size_t max_items,
                       ts_result_cb cb, void *arg)
{
    if (bin == NULL)
        return missing(op, "a bin name");
    ts__msg_name_req args = max_items_args(max_items);
    return simple_async(c, op, bin, &args, cb, arg);
}

int ts_get_async(ts_client_t *c, const char *bin, size_t max_items, ts_result_cb cb, void *arg)
{
    return fetch_async(c, TS_OP_GET, bin, max_items, cb, arg);
}

int ts_peek_async(ts_client_t *c, const char *bin, size_t max_items, ts_result_cb cb, void *arg)
{
    return fetch_async(c, TS_OP_PEEK, bin, max_items, cb, arg);
}

int ts_delete_async(ts_client_t *c, const char *bin, ts_result_cb cb, void *arg)
{
    if (bin == NULL)
        return missing(TS_OP_DELETE, "a bin name");
    return simple_async(c, TS_OP_DELETE, bin, NULL, cb, arg);
}

int ts_list_async(ts_client_t *c, ts_result_cb cb, void *arg)
{
    return simple_async(c, TS_OP_LIST, NULL, NULL, cb, arg);
}

int ts_stats_async(ts_client_t *c, ts_result_cb cb, void *arg)
{
    return simple_async(c, TS_OP_STATS, NULL, NULL, cb, arg);
}

int ts_ping_async(ts_client_t *c, ts_result_cb cb, void *arg)
{
    return simple_async(c, TS_OP_PING, NULL, NULL, cb, arg);
}

int ts_wait_async(ts_client_t *c, const char *bin, uint64_t after_version, int timeout_ms,
                  ts_result_cb cb, void *arg)
{
    c = ts__route(c, bin);
    int rc = check_call(c, 0);
    if (rc != 0)
        return rc;
    if (bin == NULL)
        return missing(TS_OP_WAIT, "a bin name");
    ts__req *r = wait_req(c, TS__K_ASYNC, bin, after_version, timeout_ms, &rc);
    if (r == NULL)
        return rc;
    return run_async(c, r, cb, arg);
}

/* ---------------------------------------------------------------------------------------------
 * Subscriptions
 */

/*
 * ts_listen on one client. For a cluster's shard client that answers WRONG_SHARD, *next gets
 * the shard client to try instead (NULL: none).
 */
static int listen_on(ts_client_t *c, const char *bin, ts_notify_cb cb, void *arg,
                     ts_client_t **next)
{
    *next = NULL;
    int rc = check_call(c, 1);
    if (rc != 0)
        return rc;
    if (bin == NULL || cb == NULL)
        return missing(TS_OP_LISTEN, bin == NULL ? "a bin name" : "a callback");
    ts__req *r = req_new(c, TS__K_BLOCK, TS_OP_LISTEN, bin, NULL, &rc);
    if (r == NULL)
        return rc;
    ts__sub *s = ts__calloc(1, sizeof(*s));
    if (s == NULL || (s->bin = ts__strndup(bin, strlen(bin))) == NULL) {
        ts__free(s);
        ts__req_free(r);
        return ts__fail(TS_ENOMEM, NULL);
    }
    s->bin_len = strlen(bin);
    s->cb = cb;
    s->arg = arg;
    atomic_init(&s->refs, 2); /* the list's and the request's */
    r->sub = s;

    pthread_mutex_lock(&c->mu);
    ts__sub *other = c->subs;
    while (other != NULL && strcmp(other->bin, bin) != 0)
        other = other->next;
    if (other != NULL || c->closing) {
        rc = c->closing ? TS_ECANCELED : TS_EINVAL;
        pthread_mutex_unlock(&c->mu);
        atomic_store(&s->refs, 1);
        ts__req_free(r);
        return ts__fail(rc,
                        rc == TS_EINVAL ? "this client already listens to '%s'"
                                        : "the client is closing (%s)",
                        bin);
    }
    s->linked = 1;
    s->next = c->subs;
    c->subs = s;
    /* Linked and queued in one critical section, so a closing client cannot strand it. */
    ts__submit_locked(c, r); /* cannot fail: closing was checked under the same lock */
    pthread_mutex_unlock(&c->mu);

    int gone;
    rc = wait_done(c, r, 0, &gone); /* a LISTEN is never written directly */
    /* A failed LISTEN unlinked the subscription on the I/O thread (or in block_on). */
    if (!gone && rc == TS_EWRONGSHARD && c->shard != NULL)
        *next = ts__cluster_learn(c, r);
    if (!gone)
        ts__req_free(r);
    return rc;
}

int ts_listen(ts_client_t *c, const char *bin, ts_notify_cb cb, void *arg)
{
    if (c == NULL || c->cl == NULL) {
        ts_client_t *unused;
        return listen_on(c, bin, cb, arg, &unused);
    }
    /* A cluster: the owner of the bin's slot, after at most TS__CLUSTER_REDIRECTS redirects. */
    int rc = ts__cluster_enter(c);
    if (rc != 0)
        return ts__fail(rc, "the client is closing");
    ts_client_t *sc = ts__route(c, bin);
    for (int hops = 0;; hops++) {
        ts_client_t *next;
        rc = listen_on(sc, bin, cb, arg, &next);
        if (rc != TS_EWRONGSHARD || next == NULL || next == sc || hops == TS__CLUSTER_REDIRECTS)
            break;
        sc = next;
    }
    ts__cluster_leave(c);
    return rc;
}

int ts_unlisten(ts_client_t *c, const char *bin)
{
    c = ts__route(c, bin);
    int rc = check_call(c, 0);
    if (rc != 0)
        return rc;
    if (bin == NULL)
        return missing(TS_OP_UNLISTEN, "a bin name");
    ts__req *r = req_new(c, TS__K_UNLISTEN, TS_OP_UNLISTEN, bin, NULL, &rc);
    if (r == NULL)
        return rc;
    r->deadline_ns = 0;
    pthread_mutex_lock(&c->mu);
    ts__sub **p = &c->subs;
    while (*p != NULL && !((*p)->live && strcmp((*p)->bin, bin) == 0))
        p = &(*p)->next;
    ts__sub *s = *p;
    if (s == NULL || c->closing) {
        rc = c->closing ? TS_ECANCELED : TS_ENOENT;
        pthread_mutex_unlock(&c->mu);
        ts__req_free(r);
        return ts__fail(rc,
                        rc == TS_ENOENT ? "this client does not listen to '%s'"
                                        : "the client is closing (%s)",
                        bin);
    }
    *p = s->next;
    s->next = NULL;
    s->linked = 0;
    r->sub = s; /* the list's reference moves to the request */
    rc = ts__submit_locked(c, r);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * The request machinery for the other operation files (rows.c); see internal.h.
 */

int ts__api_check_call(ts_client_t *c, int blocking)
{
    return check_call(c, blocking);
}

/*
 * The wire form of a wait of timeout_ms (tensorshare.h "Timeouts": 0 does not wait,
 * TS_TIMEOUT_DEFAULT is the request timeout, any other negative value, TS_TIMEOUT_INFINITE
 * included, is refused with TS_EINVAL). One copy for every operation that sends a wait.
 */
int ts__wire_timeout(const ts_client_t *c, int timeout_ms, uint32_t *wire)
{
    if (timeout_ms == TS_TIMEOUT_DEFAULT)
        *wire = (uint32_t)c->opts.request_timeout_ms;
    else if (timeout_ms >= 0)
        *wire = (uint32_t)timeout_ms;
    else
        return ts__fail(TS_EINVAL,
                        "timeout_ms %d: expected milliseconds >= 0 or TS_TIMEOUT_DEFAULT",
                        timeout_ms);
    return 0;
}

ts__req *ts__api_req_new(ts_client_t *c, int kind, uint8_t op, const char *bin, int *rc)
{
    return req_new(c, kind, op, bin, NULL, rc);
}

/*
 * The names of streams, their groups and members, and of replay tables: 1 to TS_MAX_NAME_LEN
 * bytes, what naming the object in the messages. One copy, so that stream.c and replay.c refuse a
 * name in the same words.
 */
int ts__api_check_id(const char *what, const char *s, size_t *len)
{
    if (s == NULL || s[0] == '\0')
        return ts__fail(TS_EINVAL, "no %s name (1 to %d bytes)", what, TS_MAX_NAME_LEN);
    size_t n = strlen(s);
    if (n > TS_MAX_NAME_LEN)
        return ts__fail(TS_ENAMETOOLONG, "%s name of %zu bytes (at most %d)", what, n,
                        TS_MAX_NAME_LEN);
    *len = n;
    return 0;
}

int ts__api_info(ts_client_t *c, uint8_t op, const char *what, const char *name, ts_value_t **out)
{
    c = ts__route(c, name);
    int rc = check_call(c, 1);
    if (rc != 0)
        return rc;
    size_t len;
    if ((rc = ts__api_check_id(what, name, &len)) != 0)
        return rc;
    if (out == NULL)
        return ts__fail(TS_EINVAL, "no output");
    ts__req *r = req_new(c, TS__K_BLOCK, op, name, NULL, &rc);
    ts__req *done;
    if (r == NULL || (rc = run_blocking(c, r, &done)) != 0)
        return rc;
    *out = done->res.value;
    done->res.value = NULL;
    ts__req_free(done);
    return 0;
}

int ts__api_borrow_record(ts__req *r, const ts_value_t *item)
{
    ts__enc e;
    int rc = ts__record_plan(item, &e);
    if (rc != 0) {
        ts__req_free(r);
        return ts__fail(rc, "the item cannot be encoded: %s", ts__record_plan_why(rc));
    }
    r->body_len = r->small_len + e.total;
    r->enc = e;
    r->borrowed = 1;
    return 0;
}

void ts__req_hold_for(const ts_client_t *c, ts__req *r, uint32_t wait_ms)
{
    if (wait_ms > 0)
        r->deadline_ns =
            ts__now_ns() + ((uint64_t)wait_ms + (uint64_t)c->opts.request_timeout_ms) * 1000000u;
}

ts__req *ts__api_flat_req(ts_client_t *c, int kind, uint8_t op, size_t cap, ts__flat_enc encode,
                          const void *ctx, uint32_t wait_ms, int *rc)
{
    /* Made as a PING (no name, no upload head), then given its opcode and flat body. */
    ts__req *r = req_new(c, kind, TS_OP_PING, NULL, NULL, rc);
    if (r == NULL)
        return NULL;
    r->op = op;
    r->flat = ts__malloc_aligned(cap);
    if (r->flat == NULL) {
        ts__req_free(r);
        *rc = ts__fail(TS_ENOMEM, NULL);
        return NULL;
    }
    r->flat_cap = cap;
    size_t n = cap;
    if (encode != NULL && (*rc = encode(r->flat, cap, ctx, &n)) != 0) {
        ts__req_free(r);
        ts__fail(*rc, "the %s request cannot be encoded: %s", ts__op_name(op), ts_strerror(*rc));
        return NULL;
    }
    r->flat_len = n;
    r->small_len = 0;
    r->body_len = n;
    ts__req_hold_for(c, r, wait_ms);
    return r;
}

int ts__api_attach_record(ts_client_t *c, ts__req *r, const ts_value_t *item, unsigned flags)
{
    return attach_record(c, r, item, flags);
}

int ts__api_run_blocking(ts_client_t *c, ts__req *r, ts__req **out)
{
    return run_blocking(c, r, out);
}

int ts__api_run_async(ts_client_t *c, ts__req *r, ts_result_cb cb, void *arg)
{
    return run_async(c, r, cb, arg);
}

int ts__api_block_on(ts_client_t *c, ts__req *r, int *gone)
{
    return block_on(c, r, gone);
}

void ts__api_run_blocking_all(ts_client_t *const *cs, ts__req **rs, size_t n, int *rcs)
{
    /* All submitted first, so the shards work on them at the same time. */
    for (size_t i = 0; i < n; i++) {
        rcs[i] = ts__submit(cs[i], rs[i]);
        if (rcs[i] != 0) {
            ts__req_free(rs[i]);
            rs[i] = NULL;
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (rs[i] == NULL)
            continue;
        int gone;
        rcs[i] = wait_done(cs[i], rs[i], 0, &gone);
        if (gone)
            rs[i] = NULL;
    }
}
