/*
 * Requesting predictions from a batcher served through tensord (ts_predictor_*). Built on the
 * public client API only. Three ways, chosen at open (ts_predictor_options_t.transport):
 *
 * The service (the default): each prediction is a call of the service NAME (ts_call_async, with
 * TS_CALL_WAIT so that a server that starts or restarts later takes it), its request
 * {input: <tree>}, its answer {status, version, output | error}. The call's completion may come
 * after the predictor is freed (the client has no way to withdraw a call), so each call has an
 * entry of its own, shared by the completion and the predictor: whichever claims it first (an
 * atomic flag) answers the requester, and a completion that lost never touches the predictor.
 *
 * Same-host slots (shmq.c), for blocking predictions, when the server offers them.
 *
 * The relay (TS_PREDICTOR_RELAY, for servers older than services): a request is appended to
 * NAME/requests with the name of this predictor's own reply bin, and the answers are taken from
 * that bin and handed to their pending requests. The answers are received by a chain of
 * asynchronous calls on the client's I/O thread: a WAIT on the reply bin whose callback issues the
 * GET and, right behind it, the next WAIT; the GET's callback delivers the answers. Receiving on
 * the I/O thread costs no thread switch between the WAIT's reply, the GET and the delivery (a
 * receiving thread that made the two calls blocking was woken twice per answer). When a call of the
 * chain fails (the connection is down), the predictor's thread restarts the chain after a pause,
 * since the I/O thread must not sleep.
 */
#include "batcher_internal.h"
#include "shmq.h"

#include "tensorshare/service.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

typedef struct pending_prediction {
    struct pending_prediction *next;
    int64_t id;
    uint64_t deadline_ns; /* 0: none */
    ts_predictor_cb cb;
    void *arg;
} pending_prediction;

/*
 * One call of the service. Two references: the call's completion and the predictor's list. The
 * one that claims it (claimed 0 -> 1) answers the requester; the entry stays on the list until
 * a completion that claimed it has answered, so that ts_predictor_free waits for that answer.
 */
typedef struct svc_req {
    struct svc_req *prev, *next; /* p->svc_head, under p->mu, until unlinked by its claimer */
    ts_predictor_t *p;           /* valid for the claimer only */
    atomic_int claimed;
    atomic_int refs;
    uint64_t deadline_ns; /* 0: none (the service's own limit) */
    ts_predictor_cb cb;
    void *arg;
} svc_req;

/*
 * ms; the call's timeout for TS_TIMEOUT_INFINITE: the longest tensord accepts (24 hours, as for
 * a WAIT), after which the prediction fails with TS_ETIMEDOUT.
 */
#define TS__SVC_MAX_TIMEOUT_MS ((int)TS_CALL_MAX_TIMEOUT_MS)

struct ts_predictor_s {
    ts_client_t *client;
    char name[TS_MAX_NAME_LEN + 1]; /* the service */
    int relay;                      /* TS_PREDICTOR_RELAY: through the bins, else the service */
    svc_req *svc_head;              /* calls of the service not answered yet, under mu */
    char req_bin[TS_MAX_NAME_LEN + 1];
    char reply_bin[TS_MAX_NAME_LEN + 1];
    pthread_mutex_t mu;
    pthread_cond_t cv; /* appends_inflight and gets_inflight reached 0 */
    pending_prediction *pending;
    int64_t next_id;
    int appends_inflight;
    int gets_inflight; /* GETs of the chain whose callback has not finished */
    atomic_int stop;
    pthread_t th;
    /* The receiving chain (under mu): running, or broken and waiting for the thread. */
    int chain_running;
    int chain_broken;
    uint64_t after;           /* the reply bin's version the next WAIT waits past */
    pthread_cond_t keeper_cv; /* chain_broken set, stop, or an earlier deadline (monotonic) */
    /*
     * The monotonic time (ns) the predictor's thread sleeps until while the chain runs: the
     * nearest deadline, for requests whose chain call waits for a lost connection to come back
     * (the client holds it until the connection returns or its own, longer, deadline).
     */
    uint64_t keeper_until;
    /*
     * Same-host slots (shmq.c): attached at open when the server advertises them here; the
     * slot is claimed and released by the predictor's thread, which holds its owner lock
     * (robust: it must be held by a thread that lives as long as the claim). shm_state, under
     * mu: 0 claiming, 1 claimed, -1 none. shm_mu lets one blocking caller at a time use it.
     */
    shm_client *shm;
    int shm_state;
    int shm_reclaimed;
    pthread_mutex_t shm_mu;
    atomic_uint_fast64_t n_shm, n_relayed, n_oversize, n_service;
};

/*
 * ns; the predictor's thread sleeps at most this long while the chain runs. Requests whose
 * deadline comes sooner wake it (a signal per request would be a wake-up per request); a nap
 * that ends with nothing due costs one wake-up a second.
 */
#define TS__KEEPER_NAP_NS 1000000000u

static _Thread_local int tls_in_predictor;

/* Remove and return the pending request with this id, or NULL. Lock held. */
static pending_prediction *pend_take(ts_predictor_t *p, int64_t id)
{
    for (pending_prediction **pp = &p->pending; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->id == id) {
            pending_prediction *r = *pp;
            *pp = r->next;
            return r;
        }
    }
    return NULL;
}

/* Hand one reply record to its pending request. */
static void deliver(ts_predictor_t *p, const ts_value_t *rec)
{
    int64_t id, status = TS_EPROTO, version = 0;
    if (ts_map_get_int(rec, "id", &id) != 0)
        return;
    pthread_mutex_lock(&p->mu);
    pending_prediction *r = pend_take(p, id);
    pthread_mutex_unlock(&p->mu);
    if (r == NULL)
        return; /* it timed out already */
    ts_map_get_int(rec, "status", &status);
    ts_map_get_int(rec, "version", &version);
    ts_value_t *out = NULL;
    const char *msg = NULL;
    size_t len;
    if (status == 0) {
        out = ts_value_clone(ts_map_get(rec, "output"));
        if (out == NULL)
            status = ts_map_get(rec, "output") == NULL ? TS_EPROTO : TS_ENOMEM;
    } else if (ts_value_string(ts_map_get(rec, "error"), &msg, &len) != 0) {
        msg = NULL;
    }
    /* A failure's message is set on this thread, where the callback reads it. */
    if (status != 0)
        ts_set_last_error(msg != NULL ? msg : ts_strerror((int)status));
    r->cb(p, (int)status, out, version, r->arg);
    ts__free(r);
}

/* Fail every pending request whose deadline passed (all of them when now_ns is UINT64_MAX). */
static void expire(ts_predictor_t *p, uint64_t t, int status, const char *msg)
{
    for (;;) {
        pending_prediction *r = NULL;
        pthread_mutex_lock(&p->mu);
        for (pending_prediction **pp = &p->pending; *pp != NULL; pp = &(*pp)->next) {
            if ((*pp)->deadline_ns != 0 ? (*pp)->deadline_ns <= t : t == UINT64_MAX) {
                r = *pp;
                *pp = r->next;
                break;
            }
        }
        pthread_mutex_unlock(&p->mu);
        if (r == NULL)
            return;
        ts_set_last_error(msg);
        r->cb(p, status, NULL, 0, r->arg);
        ts__free(r);
    }
}

/* ---------------------------------------------------------------------------------------------
 * The service
 */

static void sreq_unref(svc_req *r)
{
    if (atomic_fetch_sub(&r->refs, 1) == 1)
        ts__free(r);
}

/* 1 when the caller claimed r: it answers the requester, once. */
static int sreq_claim(svc_req *r)
{
    int expect = 0;
    return atomic_compare_exchange_strong(&r->claimed, &expect, 1);
}

/* Unlink r from p's list; wake ts_predictor_free when the list became empty. Lock held. */
static void sreq_unlink(ts_predictor_t *p, svc_req *r)
{
    if (r->prev != NULL)
        r->prev->next = r->next;
    else
        p->svc_head = r->next;
    if (r->next != NULL)
        r->next->prev = r->prev;
    r->prev = r->next = NULL;
    if (p->svc_head == NULL)
        pthread_cond_broadcast(&p->cv);
}

/*
 * Fail every call of the service whose deadline passed, as expire does for the relay (all of
 * them when t is UINT64_MAX). A call claimed by its completion is left to it.
 */
static void svc_expire(ts_predictor_t *p, uint64_t t, int status, const char *msg)
{
    for (;;) {
        svc_req *r = NULL;
        pthread_mutex_lock(&p->mu);
        for (svc_req *q = p->svc_head; q != NULL && r == NULL; q = q->next) {
            int due = q->deadline_ns != 0 ? q->deadline_ns <= t : t == UINT64_MAX;
            if (due && atomic_load(&q->claimed) == 0 && sreq_claim(q)) {
                r = q;
                sreq_unlink(p, r);
            }
        }
        pthread_mutex_unlock(&p->mu);
        if (r == NULL)
            return;
        ts_set_last_error(msg);
        r->cb(p, status, NULL, 0, r->arg);
        sreq_unref(r); /* the list's reference; the completion drops its own */
    }
}

/*
 * A call's completion (the client's I/O thread): the answer record {status, version, output |
 * error}, or the call's own failure (TS_ESERVICE when the server holding it left, TS_ETIMEDOUT,
 * TS_ECONNRESET, ... with the client's message already set on this thread).
 */
static void svc_answered(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    svc_req *r = arg;
    if (!sreq_claim(r)) {
        sreq_unref(r); /* answered already (deadline, or freed): p may be gone */
        return;
    }
    ts_predictor_t *p = r->p;
    int64_t st = status, version = 0;
    ts_value_t *out = NULL;
    if (status == 0) {
        const ts_value_t *rec = res != NULL && res->items != NULL && ts_items_count(res->items) == 1
                                    ? ts_items_at(res->items, 0)
                                    : NULL;
        if (rec == NULL || ts_map_get_int(rec, "status", &st) != 0 || st > 0 || st < INT32_MIN)
            st = TS_EPROTO;
        if (rec != NULL)
            ts_map_get_int(rec, "version", &version);
        const char *msg = NULL;
        size_t len = 0;
        if (st == 0) {
            out = ts_value_clone(ts_map_get(rec, "output"));
            if (out == NULL)
                st = ts_map_get(rec, "output") == NULL ? TS_EPROTO : TS_ENOMEM;
        } else if (rec == NULL || ts_value_string(ts_map_get(rec, "error"), &msg, &len) != 0) {
            msg = NULL;
        }
        if (st != 0 && msg != NULL)
            ts__set_errorf("%.*s", (int)(len < TS__BERR_LEN ? len : TS__BERR_LEN), msg);
        else if (st == TS_EPROTO)
            ts_set_last_error("the service's answer is not a prediction");
        else if (st != 0)
            ts_set_last_error(ts_strerror((int)st));
    }
    int was = tls_in_predictor;
    tls_in_predictor = 1; /* a blocking predict from this callback must fail */
    r->cb(p, (int)st, out, version, r->arg);
    tls_in_predictor = was;
    /* Unlinked only now: ts_predictor_free waits for this answer before it frees p. */
    pthread_mutex_lock(&p->mu);
    sreq_unlink(p, r);
    pthread_mutex_unlock(&p->mu);
    sreq_unref(r);
    sreq_unref(r);
}

/* Send one prediction as a call of the service; t: milliseconds, or -1 for none. */
static int svc_predict(ts_predictor_t *p, const ts_value_t *input, int t, ts_predictor_cb cb,
                       void *arg)
{
    svc_req *r = ts__calloc(1, sizeof(*r));
    ts_value_t *rec = ts_map_new();
    int rc = r != NULL && rec != NULL ? 0 : TS_ENOMEM;
    if (rc == 0)
        rc = ts_map_set(rec, "input", ts_value_borrow(input));
    if (rc != 0) {
        ts__free(r);
        ts_value_free(rec);
        return ts__fail(rc, "building the request failed: %s", ts_strerror(rc));
    }
    r->p = p;
    atomic_init(&r->claimed, 0);
    atomic_init(&r->refs, 2);
    r->deadline_ns = t > 0 ? ts__now_ns() + (uint64_t)t * 1000000u : 0;
    r->cb = cb;
    r->arg = arg;
    pthread_mutex_lock(&p->mu);
    r->next = p->svc_head;
    if (p->svc_head != NULL)
        p->svc_head->prev = r;
    p->svc_head = r;
    if (r->deadline_ns != 0 && r->deadline_ns < p->keeper_until) {
        p->keeper_until = r->deadline_ns; /* the thread recomputes it when woken */
        pthread_cond_signal(&p->keeper_cv);
    }
    pthread_mutex_unlock(&p->mu);
    int wire = t > 0 && t < TS__SVC_MAX_TIMEOUT_MS ? t : TS__SVC_MAX_TIMEOUT_MS;
    /* TS_COPY: the request is encoded now, so input stays borrowed for this call only. */
    rc = ts_call_async(p->client, p->name, rec, wire, TS_CALL_WAIT, TS_COPY, svc_answered, r);
    ts_value_free(rec);
    if (rc == 0) {
        atomic_fetch_add(&p->n_service, 1);
        return 0;
    }
    char why[TS__BERR_LEN];
    snprintf(why, sizeof(why), "%s", ts_last_error());
    int mine = sreq_claim(r);
    if (mine) {
        pthread_mutex_lock(&p->mu);
        sreq_unlink(p, r);
        pthread_mutex_unlock(&p->mu);
        sreq_unref(r);
    }
    sreq_unref(r); /* the completion's: never called */
    if (!mine)
        return 0; /* its deadline passed meanwhile: the callback had its answer */
    ts__batcher_set_err("sending the request failed: %s", why);
    return rc;
}

/* The WAIT's time limit: TS__REMOTE_WAIT_MS, or less to the nearest deadline. Lock held. */
static int wait_ms_locked(ts_predictor_t *p)
{
    int wait_ms = TS__REMOTE_WAIT_MS;
    uint64_t t = ts__now_ns();
    for (const pending_prediction *r = p->pending; r != NULL; r = r->next) {
        if (r->deadline_ns != 0) {
            uint64_t left = r->deadline_ns > t ? (r->deadline_ns - t) / 1000000u + 1 : 0;
            if (left < (uint64_t)wait_ms)
                wait_ms = (int)left;
        }
    }
    /* 0 would only ask once; a deadline just past is expired when this WAIT returns. */
    return wait_ms > 0 ? wait_ms : 1;
}

/* A GET of the chain completed: ts_predictor_free waits for the last one. */
static void get_finished(ts_predictor_t *p)
{
    pthread_mutex_lock(&p->mu);
    if (--p->gets_inflight == 0 && p->appends_inflight == 0)
        pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void chain_wait_done(ts_client_t *c, int status, ts_result_t *res, void *arg);
static void chain_get_done(ts_client_t *c, int status, ts_result_t *res, void *arg);

/* The chain ends (stopping) or breaks (a call failed): tell the predictor's thread. */
static void chain_stop(ts_predictor_t *p, int broken)
{
    pthread_mutex_lock(&p->mu);
    p->chain_running = 0;
    p->chain_broken = broken && !atomic_load(&p->stop);
    pthread_cond_broadcast(&p->keeper_cv);
    pthread_mutex_unlock(&p->mu);
}

/* Issue the chain's next WAIT (any thread). */
static void chain_arm(ts_predictor_t *p)
{
    if (atomic_load(&p->stop)) {
        chain_stop(p, 0);
        return;
    }
    pthread_mutex_lock(&p->mu);
    int wait_ms = wait_ms_locked(p);
    uint64_t after = p->after;
    pthread_mutex_unlock(&p->mu);
    if (ts_wait_async(p->client, p->reply_bin, after, wait_ms, chain_wait_done, p) != 0)
        chain_stop(p, 1);
}

/* Expire overdue requests on the I/O thread, where a blocking predict must fail. */
static void chain_expire(ts_predictor_t *p)
{
    int was = tls_in_predictor;
    tls_in_predictor = 1;
    expire(p, ts__now_ns(), TS_ETIMEDOUT, "no answer before the deadline");
    tls_in_predictor = was;
}

static void chain_wait_done(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    ts_predictor_t *p = arg;
    chain_expire(p);
    if (atomic_load(&p->stop)) {
        chain_stop(p, 0);
        return;
    }
    if (status == TS_ETIMEDOUT) {
        chain_arm(p);
        return;
    }
    if (status != 0) {
        chain_stop(p, 1);
        return;
    }
    /*
     * Take the answers, and wait for the next ones at once: the GET and the next WAIT leave in
     * one write (both are issued on the I/O thread), and the WAIT is at the server before the
     * GET's reply is read. The GET takes every item, so the bin is gone when the WAIT arrives
     * behind it (requests of a connection take effect in order) and the WAIT answers the next
     * answer's append; one appended in between makes it answer at once.
     */
    pthread_mutex_lock(&p->mu);
    p->after = res->version;
    p->gets_inflight++;
    pthread_mutex_unlock(&p->mu);
    if (ts_get_async(c, p->reply_bin, 0, chain_get_done, p) != 0) {
        get_finished(p);
        chain_stop(p, 1);
        return;
    }
    chain_arm(p);
}

static void chain_get_done(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    ts_predictor_t *p = arg;
    /*
     * A failed GET needs nothing more: the WAIT behind it fails too when the connection went,
     * and TS_ENOENT means that nothing was left to take (only the wake-up item of free).
     */
    if (status == 0) {
        int was = tls_in_predictor;
        tls_in_predictor = 1;
        for (size_t i = 0; i < ts_items_count(res->items); i++)
            deliver(p, ts_items_at(res->items, i));
        tls_in_predictor = was;
        chain_expire(p);
    }
    get_finished(p); /* the last use of p */
}

/*
 * The predictor's thread: starts the receiving chain, restarts it after a pause when one of its
 * calls failed, and ends with the predictor. The chain's callbacks do the receiving.
 */
static void *receive_main(void *arg)
{
    ts_predictor_t *p = arg;
    tls_in_predictor = 1;
    int claimed = 0, reclaimed = 0;
    if (p->shm != NULL)
        claimed = ts__shm_claim(p->shm, &reclaimed) == 0;
    pthread_mutex_lock(&p->mu);
    p->shm_state = claimed ? 1 : -1;
    p->shm_reclaimed = reclaimed;
    pthread_cond_broadcast(&p->cv);
    for (;;) {
        if (atomic_load(&p->stop))
            break;
        if (p->relay && !p->chain_running) {
            if (p->chain_broken) {
                /* The connection is down: wait before asking again, without the lock. */
                pthread_mutex_unlock(&p->mu);
                expire(p, ts__now_ns(), TS_ETIMEDOUT, "no answer before the deadline");
                ts__remote_pause(TS__REMOTE_RETRY_NS);
                pthread_mutex_lock(&p->mu);
                if (atomic_load(&p->stop))
                    break;
            }
            p->chain_broken = 0;
            p->chain_running = 1;
            pthread_mutex_unlock(&p->mu);
            chain_arm(p);
            pthread_mutex_lock(&p->mu);
            continue;
        }
        /*
         * While the chain runs, its WAIT is bounded by the nearest deadline; but a call made
         * while the connection is down waits for the reconnection, so this thread fails the
         * requests whose deadline passes meanwhile.
         */
        uint64_t until = ts__now_ns() + TS__KEEPER_NAP_NS;
        for (const pending_prediction *r = p->pending; r != NULL; r = r->next)
            if (r->deadline_ns != 0 && r->deadline_ns < until)
                until = r->deadline_ns;
        /* Calls of the service: tensord answers at their deadline, unless the connection is
           down (the client then holds a call made meanwhile up to its own, later, limit). */
        for (const svc_req *r = p->svc_head; r != NULL; r = r->next)
            if (r->deadline_ns != 0 && r->deadline_ns < until)
                until = r->deadline_ns;
        p->keeper_until = until;
        if (ts__cond_wait_until(&p->keeper_cv, &p->mu, until) == ETIMEDOUT) {
            pthread_mutex_unlock(&p->mu);
            expire(p, ts__now_ns(), TS_ETIMEDOUT, "no answer before the deadline");
            svc_expire(p, ts__now_ns(), TS_ETIMEDOUT, "no answer before the deadline");
            pthread_mutex_lock(&p->mu);
        }
    }
    /* The chain sees stop at its next callback (ts_predictor_free wakes its WAIT). */
    while (p->chain_running)
        pthread_cond_wait(&p->keeper_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    if (claimed)
        ts__shm_release(p->shm); /* on the thread that holds it */
    return NULL;
}

void ts_predictor_options_init(ts_predictor_options_t *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->transport = TS_PREDICTOR_AUTO;
}

int ts_predictor_open(ts_predictor_t **out, ts_client_t *client, const char *name)
{
    return ts_predictor_open_with(out, client, name, NULL);
}

int ts_predictor_open_with(ts_predictor_t **out, ts_client_t *client, const char *name,
                           const ts_predictor_options_t *opts)
{
    int transport = opts != NULL ? opts->transport : TS_PREDICTOR_AUTO;
    if (transport != TS_PREDICTOR_AUTO && transport != TS_PREDICTOR_RELAY &&
        transport != TS_PREDICTOR_SHM && transport != TS_PREDICTOR_SERVICE) {
        ts__batcher_set_err("transport %d: not a ts_predictor_transport_t", transport);
        return TS_EINVAL;
    }
    /* Room for "NAME/reply/" + 16 hex digits, and for "NAME/requests". */
    if (out == NULL || client == NULL || name == NULL || name[0] == '\0' ||
        strlen(name) + 7 + 16 > TS_MAX_NAME_LEN) {
        ts__batcher_set_err("a predictor needs a client and a short enough name");
        return TS_EINVAL;
    }
    ts_predictor_t *p = ts__calloc(1, sizeof(*p));
    if (p == NULL)
        return ts__fail(TS_ENOMEM, NULL);
    p->client = client;
    p->relay = transport == TS_PREDICTOR_RELAY;
    snprintf(p->name, sizeof(p->name), "%s", name);
    snprintf(p->req_bin, sizeof(p->req_bin), "%s%s", name, TS_BATCHER_REQ_SUFFIX);
    /* A reply bin name nobody else picks: time, address and a process-wide counter, mixed. */
    static atomic_uint_fast64_t counter;
    uint64_t x = ts__now_ns() ^ ((uint64_t)(uintptr_t)p << 16) ^
                 (atomic_fetch_add(&counter, 1) * 0x9E3779B97F4A7C15u);
    x ^= (uint64_t)getpid() << 40;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9u;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBu;
    x ^= x >> 31;
    snprintf(p->reply_bin, sizeof(p->reply_bin), "%s/reply/%016llx", name, (unsigned long long)x);
    pthread_mutex_init(&p->mu, NULL);
    ts__cond_init_monotonic(&p->cv);
    ts__cond_init_monotonic(&p->keeper_cv);
    p->keeper_until = UINT64_MAX;
    p->next_id = 1;
    atomic_init(&p->stop, 0);
    atomic_init(&p->n_shm, 0);
    atomic_init(&p->n_relayed, 0);
    atomic_init(&p->n_oversize, 0);
    atomic_init(&p->n_service, 0);
    pthread_mutex_init(&p->shm_mu, NULL);
    if (transport == TS_PREDICTOR_AUTO || transport == TS_PREDICTOR_SHM) {
        int rc = ts__shm_attach(client, name, &p->shm);
        if (rc != 0 && transport == TS_PREDICTOR_SHM) {
            char why[TS__BERR_LEN];
            snprintf(why, sizeof(why), "%s", ts_last_error());
            pthread_mutex_destroy(&p->shm_mu);
            pthread_cond_destroy(&p->keeper_cv);
            pthread_cond_destroy(&p->cv);
            pthread_mutex_destroy(&p->mu);
            ts__free(p);
            ts__batcher_set_err("no shared-memory slot: %s", why);
            return TS_ENOTSUP;
        }
    }
    if (pthread_create(&p->th, NULL, receive_main, p) != 0) {
        ts__shm_detach(p->shm);
        pthread_mutex_destroy(&p->shm_mu);
        pthread_cond_destroy(&p->keeper_cv);
        pthread_cond_destroy(&p->cv);
        pthread_mutex_destroy(&p->mu);
        ts__free(p);
        return ts__fail(TS_ENOMEM, "cannot start the receiver thread");
    }
    /* The thread claims the slot (it holds the claim): wait for the outcome. */
    pthread_mutex_lock(&p->mu);
    while (p->shm != NULL && p->shm_state == 0)
        pthread_cond_wait(&p->cv, &p->mu);
    int have_slot = p->shm_state == 1;
    pthread_mutex_unlock(&p->mu);
    if (p->shm != NULL && !have_slot) {
        /* No slot was free: the mapping is of no use (the thread no longer touches it). */
        ts__shm_detach(p->shm);
        p->shm = NULL;
    }
    if (transport == TS_PREDICTOR_SHM && !have_slot) {
        ts_predictor_free(p);
        ts__batcher_set_err("no shared-memory slot: every slot is taken");
        return TS_ENOTSUP;
    }
    *out = p;
    return 0;
}

void ts_predictor_stats(ts_predictor_t *p, ts_predictor_stats_t *out)
{
    memset(out, 0, sizeof(*out));
    out->shm = atomic_load(&p->n_shm);
    out->relayed = atomic_load(&p->n_relayed);
    out->oversize = atomic_load(&p->n_oversize);
    out->service = atomic_load(&p->n_service);
    pthread_mutex_lock(&p->mu);
    int slot = p->shm_state == 1;
    out->reclaimed = (uint64_t)p->shm_reclaimed;
    pthread_mutex_unlock(&p->mu);
    out->transport = slot && !ts__shm_gone(p->shm) ? TS_PREDICTOR_SHM
                     : p->relay                    ? TS_PREDICTOR_RELAY
                                                   : TS_PREDICTOR_SERVICE;
}

void ts_predictor_free(ts_predictor_t *p)
{
    if (p == NULL)
        return;
    atomic_store(&p->stop, 1);
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->keeper_cv);
    pthread_mutex_unlock(&p->mu);
    if (p->relay) {
        /* Wake the receiver from its ts_wait: an item without a pending id is ignored. */
        ts_value_t *wake = ts_map_new();
        if (wake != NULL && ts_map_set(wake, "id", ts_int_new(0)) == 0)
            ts_append(p->client, p->reply_bin, wake, NULL);
        ts_value_free(wake);
    }
    pthread_join(p->th, NULL);
    /* Appends still in flight call back into p: wait for them (bounded by the client). */
    pthread_mutex_lock(&p->mu);
    while (p->appends_inflight > 0 || p->gets_inflight > 0)
        pthread_cond_wait(&p->cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    expire(p, UINT64_MAX, TS_ECANCELED, "the predictor was freed");
    /*
     * Calls of the service cannot be withdrawn: the ones not answered yet are cancelled here
     * (their completions, later, find them claimed and leave p alone), and an answer being
     * delivered now is waited for.
     */
    svc_expire(p, UINT64_MAX, TS_ECANCELED, "the predictor was freed");
    pthread_mutex_lock(&p->mu);
    while (p->svc_head != NULL)
        pthread_cond_wait(&p->cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    if (p->relay)
        ts_delete(p->client, p->reply_bin, NULL);
    ts__shm_detach(p->shm); /* the thread released the slot */
    pthread_mutex_destroy(&p->shm_mu);
    pthread_cond_destroy(&p->keeper_cv);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    ts__free(p);
}

typedef struct sent_request {
    ts_predictor_t *p;
    int64_t id;
} sent_request;

static void request_sent(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    (void)res;
    sent_request *s = arg;
    ts_predictor_t *p = s->p;
    pending_prediction *r = NULL;
    pthread_mutex_lock(&p->mu);
    if (status != 0)
        r = pend_take(p, s->id);
    pthread_mutex_unlock(&p->mu);
    if (r != NULL) {
        /* On the client's I/O thread: a blocking predict from this callback must fail. */
        int was = tls_in_predictor;
        tls_in_predictor = 1;
        ts__set_errorf("sending the request failed: %s", ts_strerror(status));
        r->cb(p, status, NULL, 0, r->arg);
        tls_in_predictor = was;
        ts__free(r);
    }
    pthread_mutex_lock(&p->mu);
    if (--p->appends_inflight == 0 && p->gets_inflight == 0)
        pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    ts__free(s);
}

int ts_predictor_predict_async(ts_predictor_t *p, const ts_value_t *input, int timeout_ms,
                               ts_predictor_cb cb, void *arg)
{
    if (p == NULL || input == NULL || cb == NULL)
        return ts__fail(TS_EINVAL, "a prediction needs a predictor, an input and a callback");
    if (timeout_ms == 0 ||
        (timeout_ms < 0 && timeout_ms != TS_TIMEOUT_INFINITE && timeout_ms != TS_TIMEOUT_DEFAULT))
        return ts__fail(TS_EINVAL,
                        "timeout_ms %d: a prediction needs a positive timeout, "
                        "TS_TIMEOUT_DEFAULT or TS_TIMEOUT_INFINITE",
                        timeout_ms);
    /* The request record carries the deadline to the server: -1 there means none. */
    int t = timeout_ms == TS_TIMEOUT_DEFAULT    ? TS_PREDICTOR_DEFAULT_TIMEOUT_MS
            : timeout_ms == TS_TIMEOUT_INFINITE ? -1
                                                : timeout_ms;
    if (!p->relay)
        return svc_predict(p, input, t, cb, arg);
    pending_prediction *r = ts__calloc(1, sizeof(*r));
    sent_request *s = ts__calloc(1, sizeof(*s));
    ts_value_t *rec = ts_map_new();
    if (r == NULL || s == NULL || rec == NULL) {
        ts__free(r);
        ts__free(s);
        ts_value_free(rec);
        return ts__fail(TS_ENOMEM, NULL);
    }
    pthread_mutex_lock(&p->mu);
    int64_t id = p->next_id++;
    pthread_mutex_unlock(&p->mu);
    int rc = ts_map_set(rec, "id", ts_int_new(id));
    if (rc == 0)
        rc = ts_map_set(rec, "reply", ts_string_new(p->reply_bin, strlen(p->reply_bin)));
    if (rc == 0)
        rc = ts_map_set(rec, "timeout_ms", ts_int_new(t));
    if (rc == 0)
        rc = ts_map_set(rec, "input", ts_value_borrow(input));
    if (rc != 0) {
        ts__free(r);
        ts__free(s);
        ts_value_free(rec);
        return ts__fail(rc, "building the request failed: %s", ts_strerror(rc));
    }
    r->id = id;
    r->deadline_ns = t > 0 ? ts__now_ns() + (uint64_t)t * 1000000u : 0;
    r->cb = cb;
    r->arg = arg;
    s->p = p;
    s->id = id;
    pthread_mutex_lock(&p->mu);
    r->next = p->pending;
    p->pending = r;
    p->appends_inflight++;
    if (r->deadline_ns != 0 && r->deadline_ns < p->keeper_until) {
        p->keeper_until = r->deadline_ns; /* the thread recomputes it when woken */
        pthread_cond_signal(&p->keeper_cv);
    }
    pthread_mutex_unlock(&p->mu);
    /* TS_COPY: the request is encoded and its tensors copied now, so input stays borrowed. */
    rc = ts_append_async(p->client, p->req_bin, rec, TS_COPY, request_sent, s);
    ts_value_free(rec);
    if (rc == 0)
        atomic_fetch_add(&p->n_relayed, 1);
    if (rc != 0) {
        pthread_mutex_lock(&p->mu);
        pending_prediction *mine = pend_take(p, id);
        p->appends_inflight--;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        ts__free(mine);
        ts__free(s);
        ts__batcher_set_err("sending the request failed: %s", ts_strerror(rc));
        return rc;
    }
    return 0;
}

typedef struct blocking_prediction {
    pthread_mutex_t *mu; /* the predictor's: it outlives the wait */
    pthread_cond_t cv;
    int done, status;
    ts_value_t *output;
    int64_t version;
    char msg[TS__BERR_LEN];
} blocking_prediction;

static void psync_cb(ts_predictor_t *p, int status, ts_value_t *output, int64_t version, void *arg)
{
    (void)p;
    blocking_prediction *s = arg;
    pthread_mutex_lock(s->mu);
    s->status = status;
    s->output = output;
    s->version = version;
    /* The message is this thread's; the waiting caller sets it on its own thread. */
    snprintf(s->msg, sizeof(s->msg), "%s", status != 0 ? ts_last_error() : "");
    s->done = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(s->mu);
}

int ts_predictor_predict(ts_predictor_t *p, const ts_value_t *input, int timeout_ms,
                         ts_value_t **output, int64_t *version)
{
    if (tls_in_predictor || ts__batcher_on_own_thread()) {
        ts__batcher_set_err("ts_predictor_predict called from a callback");
        return TS_EDEADLK;
    }
    /*
     * The same-host slot first: one blocking caller at a time (the others call the service);
     * an input the slot cannot take, and a request the closed slots never took, go through the
     * service.
     */
    if (p->shm != NULL && pthread_mutex_trylock(&p->shm_mu) == 0) {
        int sent = 0, rc = TS_ECONNRESET;
        pthread_mutex_lock(&p->mu);
        int slot = p->shm_state == 1;
        pthread_mutex_unlock(&p->mu);
        if (slot && !ts__shm_gone(p->shm)) {
            if (timeout_ms == 0 || (timeout_ms < 0 && timeout_ms != TS_TIMEOUT_INFINITE &&
                                    timeout_ms != TS_TIMEOUT_DEFAULT)) {
                pthread_mutex_unlock(&p->shm_mu);
                return ts__fail(TS_EINVAL,
                                "timeout_ms %d: a prediction needs a positive timeout, "
                                "TS_TIMEOUT_DEFAULT or TS_TIMEOUT_INFINITE",
                                timeout_ms);
            }
            rc = ts__shm_predict(p->shm, input, timeout_ms, output, version, &sent);
        }
        pthread_mutex_unlock(&p->shm_mu);
        if (sent) {
            atomic_fetch_add(&p->n_shm, 1);
            return rc;
        }
        if (rc == TS_EMSGSIZE)
            atomic_fetch_add(&p->n_oversize, 1);
    }
    blocking_prediction s;
    memset(&s, 0, sizeof(s));
    s.mu = &p->mu;
    if (ts__cond_init_monotonic(&s.cv) != 0)
        return ts__fail(TS_ENOMEM, NULL);
    int rc = ts_predictor_predict_async(p, input, timeout_ms, psync_cb, &s);
    if (rc == 0) {
        /* The receiver thread answers at the deadline at the latest; free cancels. */
        pthread_mutex_lock(&p->mu);
        while (!s.done)
            pthread_cond_wait(&s.cv, &p->mu);
        pthread_mutex_unlock(&p->mu);
        rc = s.status;
    }
    pthread_cond_destroy(&s.cv);
    if (rc != 0) {
        if (s.done)
            ts__batcher_set_err("%s", s.msg);
        return rc;
    }
    *output = s.output;
    if (version != NULL)
        *version = s.version;
    return 0;
}
