/*
 * Services on the client (include/tensorshare/service.h). Calling is an upload like PUT (the
 * service's name and the fixed fields in the request's head, the record sent from the caller's
 * memory or a copy); its answer is an ITEMS body that reply.c parses like a GET's. Serving is a
 * registration kept in c->svcs (under mu), registered again after every reconnection; each
 * SVC_REQUEST push (recv.c) is decoded in place and handed to the registration's callback on
 * the I/O thread, and an answer is an SVC_REPLY upload whose reply is ignored.
 *
 * Threads: ts_call, ts_service_register and ts_service_unregister block (any thread, never a
 * client callback); ts_call_async, ts_call_reply and ts_call_fail do not (any thread).
 *
 * A call may be answered after its client is freed (a worker thread still holding it while the
 * program shuts down): calls reach the client only through its anchor, which the client lets go
 * of when it closes, so such an answer is dropped like one for a lost connection.
 */
#include "tensorshare/service.h"

#include "internal.h"

#include "msg.h"

/*
 * What the calls of a client hold of it, one per client that serves (c->svc_anchor). Answers
 * are sent under the read lock while c is set; the client's closing clears c under the write
 * lock (ts__svc_close), so no answer reaches a client being freed.
 */
typedef struct ts__svc_anchor {
    atomic_int refs;       /* the client's (until it closes) and one per registration */
    atomic_int gone;       /* set before c is cleared, so that answers stop taking the lock */
    pthread_rwlock_t lock; /* read: an answer being sent; write: the client closing */
    ts_client_t *c;        /* under lock; NULL once the client has closed */
} ts__svc_anchor;

static void anchor_unref(ts__svc_anchor *a)
{
    if (atomic_fetch_sub_explicit(&a->refs, 1, memory_order_acq_rel) != 1)
        return;
    pthread_rwlock_destroy(&a->lock);
    ts__free(a);
}

/* c's anchor, made on first use, with a reference for the caller; NULL without memory. Under mu. */
static ts__svc_anchor *anchor_get_locked(ts_client_t *c)
{
    ts__svc_anchor *a = c->svc_anchor;
    if (a == NULL) {
        a = ts__calloc(1, sizeof(*a));
        if (a == NULL)
            return NULL;
        if (pthread_rwlock_init(&a->lock, NULL) != 0) {
            ts__free(a);
            return NULL;
        }
        atomic_init(&a->refs, 1); /* the client's */
        atomic_init(&a->gone, 0);
        a->c = c;
        c->svc_anchor = a;
    }
    atomic_fetch_add_explicit(&a->refs, 1, memory_order_relaxed);
    return a;
}

/* A registration (ts_service_register). */
struct ts_service_s {
    ts_service_t *next;     /* in c->svcs, under mu */
    atomic_int refs;        /* the list's (while linked) and one per unanswered call */
    ts_client_t *c;         /* the (shard) client it is registered on */
    ts__svc_anchor *anchor; /* a reference: how its calls reach c */
    char *name;
    size_t name_len;
    uint32_t concurrency;
    ts_service_cb cb;
    void *arg;
    int linked;  /* in c->svcs (under mu) */
    int leaving; /* being unregistered: still served, not registered again (under mu) */
    int in_cb;   /* callbacks running now (under mu) */
    pthread_cond_t cb_done;
};

/* A call handed to this client. */
struct ts_call_s {
    ts_service_t *svc; /* a reference */
    uint64_t id;
    uint32_t timeout_ms;
    unsigned epoch; /* c->svc_epoch when it was handed over: its connection */
};

/*
 * The client to answer call on, with its anchor's read lock held (release it with
 * call_leave), or NULL when the answer is to be dropped: the client has closed, or call came on
 * a connection that is gone (tensord failed it when the connection closed, so it is not sent on
 * a later connection).
 */
static ts_client_t *call_enter(const ts_call_t *call)
{
    ts__svc_anchor *a = call->svc->anchor;
    if (atomic_load_explicit(&a->gone, memory_order_acquire))
        return NULL;
    pthread_rwlock_rdlock(&a->lock);
    ts_client_t *c = a->c;
    if (c != NULL && atomic_load_explicit(&c->svc_epoch, memory_order_acquire) == call->epoch)
        return c;
    pthread_rwlock_unlock(&a->lock);
    return NULL;
}

static void call_leave(const ts_call_t *call)
{
    pthread_rwlock_unlock(&call->svc->anchor->lock);
}

static void svc_unref(ts_service_t *s)
{
    if (atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) != 1)
        return;
    if (s->anchor != NULL)
        anchor_unref(s->anchor);
    pthread_cond_destroy(&s->cb_done);
    ts__free(s->name);
    ts__free(s);
}

/* Check a service name: 1 to 255 bytes. 0 and *len, or the error. */
static int check_name(const char *s, size_t *len)
{
    if (s == NULL || s[0] == '\0')
        return ts__fail(TS_EINVAL, "no service name");
    size_t n = strlen(s);
    if (n > TS_MAX_NAME_LEN)
        return ts__fail(TS_ENAMETOOLONG, "service name of %zu bytes (at most %d)", n,
                        TS_MAX_NAME_LEN);
    *len = n;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Calling
 */

/*
 * The wire timeout of timeout_ms: 1 to TS_CALL_MAX_TIMEOUT_MS, or TS_TIMEOUT_DEFAULT (the request
 * timeout, at most TS_CALL_MAX_TIMEOUT_MS: tensord refuses longer calls). 0 and *wire, or
 * TS_EINVAL.
 */
static int call_timeout(const ts_client_t *c, int timeout_ms, uint32_t *wire)
{
    if (timeout_ms == TS_TIMEOUT_DEFAULT) {
        uint32_t t = (uint32_t)c->opts.request_timeout_ms;
        *wire = t > TS_CALL_MAX_TIMEOUT_MS ? TS_CALL_MAX_TIMEOUT_MS : t;
        return 0;
    }
    if (timeout_ms <= 0 || (uint32_t)timeout_ms > TS_CALL_MAX_TIMEOUT_MS)
        return ts__fail(TS_EINVAL,
                        "timeout_ms %d: a call needs 1 to %u milliseconds (24 hours) or "
                        "TS_TIMEOUT_DEFAULT",
                        timeout_ms, (unsigned)TS_CALL_MAX_TIMEOUT_MS);
    *wire = (uint32_t)timeout_ms;
    return 0;
}

/*
 * How long past a call's timeout the client still waits for tensord's answer (its TIMEOUT, or the
 * server's answer that crossed it) before it gives up itself.
 */
#define TS__CALL_GRACE_MS 100u

/* The SVC_CALL request (kind, record attached per copy_flags), or NULL and *rc. */
static ts__req *call_req(ts_client_t *c, int kind, const char *service, const ts_value_t *request,
                         int timeout_ms, unsigned flags, unsigned copy_flags, int *rc)
{
    size_t nl = 0;
    uint32_t wire = 0;
    if ((*rc = check_name(service, &nl)) != 0 || (*rc = call_timeout(c, timeout_ms, &wire)) != 0)
        return NULL;
    if (request == NULL || (flags & ~(unsigned)TS_CALL_WAIT) != 0) {
        *rc = ts__fail(TS_EINVAL, "a call needs a request and known flags (got 0x%x)", flags);
        return NULL;
    }
    ts__req *r = ts__api_req_new(c, kind, TS_OP_SVC_CALL, service, rc);
    if (r == NULL)
        return NULL;
    ts__msg_svc_call_fixed f = {.timeout_ms = wire, .flags = flags};
    ts__msg_svc_call_fixed_encode(ts__req_upload_fixed(r), &f);
    *rc = ts__api_attach_record(c, r, request, copy_flags);
    if (*rc != 0) {
        ts__req_free(r);
        *rc = ts__fail(*rc, "the request cannot be encoded: %s", ts__record_plan_why(*rc));
        return NULL;
    }
    /*
     * tensord answers by the call's timeout; the client gives up TS__CALL_GRACE_MS after it
     * (tensord paused or unreachable), so the call ends within its timeout and the grace.
     */
    r->deadline_ns = ts__now_ns() + ((uint64_t)wire + TS__CALL_GRACE_MS) * 1000000u;
    return r;
}

int ts_call(ts_client_t *c, const char *service, const ts_value_t *request, int timeout_ms,
            unsigned flags, ts_value_t **answer)
{
    c = ts__route(c, service);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    if (answer == NULL)
        return ts__fail(TS_EINVAL, "no place for the answer");
    ts__req *r = call_req(c, TS__K_BLOCK, service, request, timeout_ms, flags, TS_BORROW, &rc);
    if (r == NULL)
        return rc;
    ts__req *done;
    if ((rc = ts__api_run_blocking(c, r, &done)) != 0)
        return rc;
    ts_items_t *items = done->res.items;
    if (items == NULL || items->count != 1) {
        ts__req_free(done);
        return ts__fail(TS_EPROTO, "the answer to a call holds no record");
    }
    *answer = items->items[0];
    items->items[0] = NULL;
    items->count = 0;
    ts__req_free(done);
    return 0;
}

int ts_call_async(ts_client_t *c, const char *service, const ts_value_t *request, int timeout_ms,
                  unsigned flags, unsigned copy_flags, ts_result_cb cb, void *arg)
{
    c = ts__route(c, service);
    int rc = ts__api_check_call(c, 0);
    if (rc != 0)
        return rc;
    if (copy_flags != TS_BORROW && copy_flags != TS_COPY)
        return ts__fail(TS_EINVAL, "copy_flags must be TS_BORROW or TS_COPY");
    ts__req *r = call_req(c, TS__K_ASYNC, service, request, timeout_ms, flags, copy_flags, &rc);
    if (r == NULL)
        return rc;
    return ts__api_run_async(c, r, cb, arg);
}

/* ---------------------------------------------------------------------------------------------
 * Serving
 */

void ts_service_options_init(ts_service_options_t *opts)
{
    if (opts != NULL)
        opts->concurrency = TS_SERVICE_DEFAULT_CONCURRENCY;
}

/* Encode an SVC_REGISTER body into r's small buffer. */
static void register_body(ts__req *r, const char *name, size_t nl, uint32_t concurrency)
{
    ts__msg_svc_register_req m = {
        .name = (const uint8_t *)name, .name_len = nl, .concurrency = concurrency, .flags = 0};
    size_t len;
    /* The name was checked and the small buffer holds a name and 32 bytes of fields. */
    (void)ts__msg_svc_register_req_encode(r->small + TS_HDR_SIZE, sizeof(r->small) - TS_HDR_SIZE,
                                          &m, &len);
    r->small_len = len;
    r->body_len = len;
}

/* Unlink s from its client's list (mu held); the list's reference becomes the caller's. */
static int unlink_locked(ts_service_t *s)
{
    if (!s->linked)
        return 0;
    for (ts_service_t **p = &s->c->svcs; *p != NULL; p = &(*p)->next) {
        if (*p == s) {
            *p = s->next;
            break;
        }
    }
    s->next = NULL;
    s->linked = 0;
    return 1;
}

int ts_service_register(ts_service_t **out, ts_client_t *c, const char *service,
                        const ts_service_options_t *opts, ts_service_cb cb, void *arg)
{
    c = ts__route(c, service);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    size_t nl = 0;
    if ((rc = check_name(service, &nl)) != 0)
        return rc;
    ts_service_options_t o;
    ts_service_options_init(&o);
    if (opts != NULL)
        o = *opts;
    if (out == NULL || cb == NULL || o.concurrency < 1 ||
        o.concurrency > TS_SERVICE_MAX_CONCURRENCY)
        return ts__fail(TS_EINVAL,
                        "a registration needs out, a callback and a concurrency of 1 "
                        "to %d",
                        TS_SERVICE_MAX_CONCURRENCY);
    ts_service_t *s = ts__calloc(1, sizeof(*s));
    if (s == NULL || (s->name = ts__strndup(service, nl)) == NULL) {
        ts__free(s);
        return ts__fail(TS_ENOMEM, NULL);
    }
    s->c = c;
    s->name_len = nl;
    s->concurrency = (uint32_t)o.concurrency;
    s->cb = cb;
    s->arg = arg;
    atomic_init(&s->refs, 1);
    pthread_cond_init(&s->cb_done, &c->condattr);
    ts__req *r = ts__api_req_new(c, TS__K_BLOCK, TS_OP_PING, NULL, &rc);
    if (r == NULL) {
        svc_unref(s);
        return rc;
    }
    r->op = TS_OP_SVC_REGISTER;
    register_body(r, service, nl, s->concurrency);
    /* Linked first: calls may be handed over as soon as tensord has the registration. */
    pthread_mutex_lock(&c->mu);
    ts_service_t *other = c->svcs;
    while (other != NULL && strcmp(other->name, service) != 0)
        other = other->next;
    if (other != NULL || c->closing || (s->anchor = anchor_get_locked(c)) == NULL) {
        rc = other != NULL ? TS_EINVAL : c->closing ? TS_ECANCELED : TS_ENOMEM;
        pthread_mutex_unlock(&c->mu);
        ts__req_free(r);
        svc_unref(s);
        return ts__fail(rc,
                        rc == TS_EINVAL   ? "this client already serves '%s'"
                        : rc == TS_ENOMEM ? "no memory to register '%s'"
                                          : "the client is closing (%s)",
                        service);
    }
    s->linked = 1;
    s->next = c->svcs;
    c->svcs = s;
    pthread_mutex_unlock(&c->mu);
    ts__req *done;
    rc = ts__api_run_blocking(c, r, &done);
    if (done != NULL)
        ts__req_free(done);
    if (rc != 0) {
        pthread_mutex_lock(&c->mu);
        int had = unlink_locked(s);
        pthread_mutex_unlock(&c->mu);
        if (had)
            svc_unref(s);
        return rc;
    }
    *out = s;
    return 0;
}

void ts_service_unregister(ts_service_t *s)
{
    if (s == NULL)
        return;
    ts_client_t *c = s->c;
    int io = ts__on_io_thread(c);
    pthread_mutex_lock(&c->mu);
    /*
     * Tell tensord while the registration still takes calls: a call tensord hands before it has
     * the unregistration is this server's to answer (it was not refused). A reconnection
     * meanwhile does not register it again.
     */
    int had = s->linked && !s->leaving;
    s->leaving = 1;
    /* Only while connected: otherwise the registration ended with the connection. */
    int tell = had && (io || atomic_load(&c->connected));
    pthread_mutex_unlock(&c->mu);
    if (tell && io) {
        /* From a callback: tell tensord without waiting for its answer. */
        ts__req *r = ts__calloc(1, sizeof(*r));
        if (r != NULL) {
            r->c = c;
            r->kind = TS__K_FIRE;
            r->op = TS_OP_SVC_REGISTER;
            register_body(r, s->name, s->name_len, 0);
            if (ts__submit(c, r) != 0)
                ts__req_free(r);
        }
    } else if (tell && ts__api_check_call(c, 1) == 0) {
        int rc;
        ts__req *r = ts__api_req_new(c, TS__K_BLOCK, TS_OP_PING, NULL, &rc);
        if (r != NULL) {
            r->op = TS_OP_SVC_REGISTER;
            register_body(r, s->name, s->name_len, 0);
            ts__req *done;
            (void)ts__api_run_blocking(c, r, &done); /* a lost connection ended it anyway */
            if (done != NULL)
                ts__req_free(done);
        }
    }
    pthread_mutex_lock(&c->mu);
    int unlinked = had && unlink_locked(s);
    /* No callback runs once this returns (one may be running on the I/O thread now). */
    while (s->in_cb > 0 && !io)
        pthread_cond_wait(&s->cb_done, &c->mu);
    pthread_mutex_unlock(&c->mu);
    if (unlinked)
        svc_unref(s);
}

/* An SVC_REPLY on c for call with the fixed fields of status; r's tail is set by the caller. */
static ts__req *reply_req(ts_client_t *c, ts_call_t *call, uint16_t status, int *rc)
{
    ts_service_t *s = call->svc;
    ts__req *r = ts__api_req_new(c, TS__K_ASYNC, TS_OP_SVC_REPLY, s->name, rc);
    if (r == NULL)
        return NULL;
    ts__msg_svc_reply_fixed f = {.call_id = call->id, .status = status};
    ts__msg_svc_reply_fixed_encode(ts__req_upload_fixed(r), &f);
    return r;
}

static void call_release(ts_call_t *call)
{
    svc_unref(call->svc);
    ts__free(call);
}

/* Send r, an answer on c: one the closing client no longer sends is dropped (0). */
static int reply_send(ts_client_t *c, ts__req *r)
{
    int rc = ts__api_run_async(c, r, NULL, NULL);
    if (rc == TS_ECANCELED)
        ts__set_last_error(NULL, 0);
    return rc == TS_ECANCELED ? 0 : rc;
}

/* Send an error answer for call on c: status and msg (len bytes). 0 or the error. */
static int fail_send(ts_client_t *c, ts_call_t *call, uint16_t status, const char *msg, size_t len)
{
    int rc;
    ts__req *r = reply_req(c, call, status, &rc);
    if (r == NULL)
        return rc;
    r->flat = ts__malloc_aligned(len);
    if (r->flat == NULL) {
        ts__req_free(r);
        return ts__fail(TS_ENOMEM, NULL);
    }
    memcpy(r->flat, msg, len);
    r->flat_len = r->flat_cap = len;
    r->body_len = r->small_len + len;
    return reply_send(c, r);
}

int ts_call_reply(ts_call_t *call, const ts_value_t *answer)
{
    if (call == NULL)
        return ts__fail(TS_EINVAL, "no call");
    ts_client_t *c = call_enter(call);
    int rc = 0;
    if (answer == NULL) {
        rc = ts__fail(TS_EINVAL, "no answer (NULL)");
    } else if (c != NULL) {
        ts__req *r = reply_req(c, call, TS_ST_OK, &rc);
        if (r != NULL) {
            rc = ts__api_attach_record(c, r, answer, TS_COPY);
            if (rc != 0) {
                ts__req_free(r);
                rc = ts__fail(rc, "the answer cannot be encoded: %s", ts__record_plan_why(rc));
            } else {
                rc = reply_send(c, r);
            }
        }
    }
    if (rc != 0 && c != NULL) {
        /*
         * The call is answered all the same, with the reason as an error, so that its caller
         * learns it at once and tensord frees the server's place (it counts the call against
         * this server until an answer comes). The server gets its own error back.
         */
        char why[TS_MAX_ERROR_LEN + 1];
        snprintf(why, sizeof(why), "%s", ts_last_error());
        char msg[TS_MAX_ERRMSG];
        int n = snprintf(msg, sizeof(msg), "the service's answer could not be sent: %s", why);
        size_t len = n < 0 ? 0 : (size_t)n >= sizeof(msg) ? sizeof(msg) - 1 : (size_t)n;
        (void)fail_send(c, call, TS_ST_INTERNAL, msg, len);
        rc = ts__fail(rc, "%s", why);
    }
    if (c != NULL)
        call_leave(call);
    call_release(call);
    return rc;
}

int ts_call_fail(ts_call_t *call, int err, const char *msg)
{
    if (call == NULL)
        return ts__fail(TS_EINVAL, "no call");
    ts_client_t *c = call_enter(call);
    if (c == NULL) {
        call_release(call);
        return 0;
    }
    uint16_t status = ts__err_to_status(err);
    if (!ts__msg_svc_status_allowed(status))
        status = TS_ST_INTERNAL;
    if (msg == NULL || msg[0] == '\0')
        msg = ts_strerror(err);
    int rc = fail_send(c, call, status, msg, strnlen(msg, TS_MAX_ERRMSG));
    call_leave(call);
    call_release(call);
    return rc;
}

uint32_t ts_call_timeout_ms(const ts_call_t *call)
{
    return call != NULL ? call->timeout_ms : 0;
}

uint64_t ts_call_id(const ts_call_t *call)
{
    return call != NULL ? call->id : 0;
}

/* ---------------------------------------------------------------------------------------------
 * The I/O thread's side
 */

/* Answer a call this client cannot serve (no registration, or no memory) with an error. */
static void refuse(ts_client_t *c, const ts__msg_svc_push *m, uint16_t status, const char *msg)
{
    int rc;
    char name[TS_MAX_NAME_LEN + 1];
    memcpy(name, m->name, m->name_len);
    name[m->name_len] = '\0';
    ts__req *r = ts__api_req_new(c, TS__K_FIRE, TS_OP_SVC_REPLY, name, &rc);
    if (r == NULL)
        return;
    ts__msg_svc_reply_fixed f = {.call_id = m->call_id, .status = status};
    ts__msg_svc_reply_fixed_encode(ts__req_upload_fixed(r), &f);
    size_t len = strlen(msg);
    r->flat = ts__malloc_aligned(len);
    if (r->flat == NULL) {
        ts__req_free(r);
        return;
    }
    memcpy(r->flat, msg, len);
    r->flat_len = r->flat_cap = len;
    r->body_len = r->small_len + len;
    if (ts__submit(c, r) != 0)
        ts__req_free(r);
}

int ts__svc_push(ts_client_t *c, uint8_t *body, size_t len, int owned)
{
    ts__msg_svc_push m;
    if (ts__msg_svc_push_decode(body, len, &m) != 0) {
        if (owned)
            ts__body_free(body, len);
        return TS_EPROTO;
    }
    pthread_mutex_lock(&c->mu);
    ts_service_t *s = c->svcs;
    while (s != NULL && (s->name_len != m.name_len || memcmp(s->name, m.name, m.name_len) != 0))
        s = s->next;
    if (s != NULL) {
        atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
        s->in_cb++;
    }
    pthread_mutex_unlock(&c->mu);
    if (s == NULL) {
        refuse(c, &m, TS_ST_SERVICE_GONE, "the client no longer serves this service");
        if (owned)
            ts__body_free(body, len);
        return 0;
    }
    /* The record's tensors point into its buffer: a borrowed body is copied first. */
    uint8_t *buf = body;
    size_t off = m.head_len;
    size_t blen = len;
    if (!owned) {
        blen = (size_t)m.rec_len > 0 ? (size_t)m.rec_len : 1;
        buf = ts__malloc_aligned(blen);
        if (buf != NULL)
            memcpy(buf, m.record, (size_t)m.rec_len);
        off = 0;
    }
    ts__rbuf *rb = buf != NULL ? ts__rbuf_new(buf, blen, NULL) : NULL;
    ts_value_t *v = rb != NULL
                        ? ts__record_decode(rb, off, (size_t)m.rec_len, TS_MAX_DEPTH, TS_MAX_NDIM)
                        : NULL;
    ts_call_t *call = v != NULL ? ts__calloc(1, sizeof(*call)) : NULL;
    if (rb != NULL)
        ts__rbuf_unref(rb); /* the decoded tree keeps it alive */
    else if (buf != NULL)
        ts__body_free(buf, blen);
    int rc = 0;
    if (call == NULL) {
        ts_value_free(v);
        refuse(c, &m, v == NULL && rb != NULL ? TS_ST_BAD_RECORD : TS_ST_INTERNAL,
               "the serving client could not take the request (out of memory or a bad record)");
    } else {
        call->svc = s; /* the reference taken above */
        call->id = m.call_id;
        call->timeout_ms = m.timeout_ms;
        call->epoch = atomic_load_explicit(&c->svc_epoch, memory_order_acquire);
        s->cb(s, call, v, s->arg);
    }
    pthread_mutex_lock(&c->mu);
    if (--s->in_cb == 0)
        pthread_cond_broadcast(&s->cb_done);
    pthread_mutex_unlock(&c->mu);
    if (call == NULL)
        svc_unref(s);
    return rc;
}

void ts__svc_reregister(ts_client_t *c)
{
    /* Calls handed on the connection before this one can no longer be answered (call_stale). */
    atomic_fetch_add_explicit(&c->svc_epoch, 1, memory_order_acq_rel);
    ts__req *list = NULL;
    pthread_mutex_lock(&c->mu);
    for (ts_service_t *s = c->svcs; s != NULL; s = s->next) {
        if (s->leaving)
            continue; /* being unregistered: the registration ended with the connection */
        ts__req *r = ts__calloc(1, sizeof(*r));
        if (r == NULL)
            break; /* not registered on this connection: its callers wait or fail */
        r->c = c;
        r->kind = TS__K_FIRE;
        r->op = TS_OP_SVC_REGISTER;
        register_body(r, s->name, s->name_len, s->concurrency);
        r->next = list;
        list = r;
    }
    pthread_mutex_unlock(&c->mu);
    while (list != NULL) {
        ts__req *r = list;
        list = r->next;
        r->next = NULL;
        if (c->state == TS__ST_READY)
            ts__req_send(c, r);
        else
            ts__req_free(r);
    }
}

void ts__svc_close(ts_client_t *c)
{
    pthread_mutex_lock(&c->mu);
    ts_service_t *list = c->svcs;
    c->svcs = NULL;
    for (ts_service_t *s = list; s != NULL; s = s->next)
        s->linked = 0;
    ts__svc_anchor *a = c->svc_anchor;
    c->svc_anchor = NULL;
    pthread_mutex_unlock(&c->mu);
    if (a != NULL) {
        /* Answers being sent finish first; later ones find no client and are dropped. */
        atomic_store_explicit(&a->gone, 1, memory_order_release);
        pthread_rwlock_wrlock(&a->lock);
        a->c = NULL;
        pthread_rwlock_unlock(&a->lock);
        anchor_unref(a);
    }
    while (list != NULL) {
        ts_service_t *s = list;
        list = s->next;
        s->next = NULL;
        svc_unref(s);
    }
}
