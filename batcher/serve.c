/*
 * Serving a batcher through tensord (ts_batcher_serve, ts_batcher_follow_weights): the service
 * NAME takes remote predictions (each call is submitted to the batcher and answered from its
 * completion); requests are also taken from NAME/requests and answered into each requester's
 * reply bin (the relay, for predictors that use it); weight updates are followed from a
 * parameters bin. Built on the public client API only, like a user program; the engine learns
 * of it only through ts_batcher_s.remote and remote_stop.
 *
 * The service's calls come on the serving client's I/O thread (ts_service_register's callback),
 * are submitted without a copy of their input (the request record is kept until the answer),
 * and are answered with ts_call_reply on the thread that completes the prediction. Each call
 * stays on the service's list until it is answered, so that stopping can answer the ones still
 * in the batcher (TS_ECANCELED) and wait for answers being sent: nothing calls ts_call_reply on
 * the client once ts_batcher_stop_remote has returned.
 *
 * The relay's requests are taken by a chain of asynchronous calls on the serving client's I/O
 * thread: a WAIT on NAME/requests whose callback issues the GET, whose callback submits the
 * requests to the batcher and issues the next GET (when items remain) or WAIT. No thread is
 * woken between the WAIT's reply, the GET and the submits (a serve thread making the two calls
 * blocking was woken twice per group of requests). The serve thread only starts the chain and
 * restarts it, after a pause, when a call failed (the connection is down).
 */
#include "batcher_internal.h"
#include "shmq.h"

#include "tensorshare/service.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#define TS__GET_BATCHES 4 /* a serve thread takes up to this many max_batch worth of requests */

struct remote_server {
    ts_batcher_t *b;
    ts_client_t *client;
    struct answer_sender *sender; /* one reference */
    char req_bin[TS_MAX_NAME_LEN + 1];
    char params_bin[TS_MAX_NAME_LEN + 1];
    pthread_t serve_th, follow_th;
    int serving, following;
    atomic_int stop;
    ts_batcher_serve_options_t opts; /* copied at ts_batcher_serve_with */
    /* The taking chain, under mu: running, or broken and waiting for the serve thread. */
    pthread_mutex_t mu;
    pthread_cond_t cv; /* chain_running or dispatching became 0, or stop (monotonic) */
    int chain_running, chain_broken;
    int dispatching;        /* the chain is submitting requests it took to the batcher */
    int abandoned;          /* stopping returned before the chain ended: it takes no request */
    atomic_int refs;        /* the batcher's (until stopped) and the chain's while it runs */
    uint64_t after, seen;   /* the WAIT's version, and the version it last reported */
    shm_server *shm;        /* same-host slots (ts_batcher_serve_shm), or NULL */
    struct svc_server *svc; /* the service NAME, or NULL (tensord without services) */
};

/* The items of one ts_get, shared by the requests decoded from them. */
typedef struct shared_items {
    atomic_int refs;
    ts_items_t *items;
} shared_items;

static void ritems_unref(shared_items *r)
{
    if (atomic_fetch_sub(&r->refs, 1) == 1) {
        ts_items_free(r->items);
        ts__free(r);
    }
}

/*
 * The answers of one serving client on their way to tensord. At most one thread other than the
 * client's I/O thread hands answers to the client at a time: while an answer appended from a
 * replica's thread is in flight, the answers that follow it are queued here, and the completion
 * callback of an append (on the I/O thread) hands every queued answer over at once. Appends made
 * on the I/O thread are written together before its loop next waits, so the answers of a batch
 * leave in one write, and the replica wakes the I/O thread about once per batch instead of once
 * per answer (on a shared core each wake-up can preempt the replica). Refcounted: the server,
 * and every request from its submit until its answer's append completed, hold a reference; the
 * answers of requests still queued in the batcher may come after the server has stopped.
 */
typedef struct answer_sender {
    pthread_mutex_t mu;
    ts_client_t *client;
    struct remote_request *head, *tail; /* queued answers, oldest first */
    int inflight;                       /* appends handed to the client, callback not yet run */
    int refs;
} answer_sender;

/* One remote request in the batcher, then its answer on its way to the reply bin. */
typedef struct remote_request {
    struct remote_request *next; /* the sender's queue */
    answer_sender *sender;
    shared_items *items;
    ts_value_t *rec; /* the answer record (with the output views it holds) */
    int64_t id;
    char reply[TS_MAX_NAME_LEN + 1];
} remote_request;

static void sender_unref(answer_sender *s)
{
    pthread_mutex_lock(&s->mu);
    int last = --s->refs == 0;
    pthread_mutex_unlock(&s->mu);
    if (last) {
        pthread_mutex_destroy(&s->mu);
        ts__free(s);
    }
}

static void reply_sent(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    (void)status;
    (void)res;
    ts_value_free(arg); /* the reply record and the output views it holds */
}

/*
 * The answer record {id, status, version, output | error}; output is taken over. NULL when out
 * of memory.
 */
static ts_value_t *reply_record(int64_t id, int status, ts_value_t *output, int64_t version,
                                const char *msg)
{
    ts_value_t *rec = ts_map_new();
    int rc = rec != NULL ? 0 : TS_ENOMEM;
    if (rc == 0)
        rc = ts_map_set(rec, "id", ts_int_new(id));
    if (rc == 0)
        rc = ts_map_set(rec, "status", ts_int_new(status));
    if (rc == 0)
        rc = ts_map_set(rec, "version", ts_int_new(version));
    if (rc == 0 && status == 0) {
        rc = ts_map_set(rec, "output", output);
        output = NULL;
    } else if (rc == 0) {
        const char *m = msg != NULL ? msg : ts_strerror(status);
        rc = ts_map_set(rec, "error", ts_string_new(m, strlen(m)));
    }
    ts_value_free(output);
    if (rc != 0) {
        ts_value_free(rec);
        return NULL;
    }
    return rec;
}

/*
 * Append an answer to a reply bin at once (the answers of requests refused at dispatch, on the
 * I/O thread). Failures to send are dropped: the requester's own deadline covers them.
 */
static void send_reply(ts_client_t *client, const char *bin, int64_t id, int status,
                       ts_value_t *output, int64_t version, const char *msg)
{
    ts_value_t *rec = reply_record(id, status, output, version, msg);
    if (rec != NULL && ts_append_async(client, bin, rec, 0, reply_sent, rec) != 0)
        ts_value_free(rec);
}

static void answer_sent(ts_client_t *c, int status, ts_result_t *res, void *arg);

/*
 * One append of the sender finished (r's, sent or failed): free r, and return the answers queued
 * meanwhile, oldest first, now counted in flight, for the caller to send.
 */
static remote_request *answer_finished(remote_request *r)
{
    answer_sender *s = r->sender;
    ts_value_free(r->rec);
    ts__free(r);
    pthread_mutex_lock(&s->mu);
    s->inflight--;
    remote_request *list = s->head;
    for (remote_request *q = list; q != NULL; q = q->next)
        s->inflight++;
    s->head = s->tail = NULL;
    pthread_mutex_unlock(&s->mu);
    sender_unref(s); /* r's reference */
    return list;
}

/*
 * Hand queued answers (counted in flight) to the client, in order. An append the client refuses
 * (it is closing) is dropped like a failed one; the requester's deadline covers it.
 */
static void answers_send(answer_sender *s, remote_request *list)
{
    while (list != NULL) {
        remote_request *q = list;
        list = q->next;
        if (ts_append_async(s->client, q->reply, q->rec, 0, answer_sent, q) != 0) {
            remote_request *more = answer_finished(q);
            if (more != NULL) {
                /* Queued meanwhile: they go after the ones already taken. */
                remote_request *t = more;
                while (t->next != NULL)
                    t = t->next;
                t->next = list;
                list = more;
            }
        }
    }
}

/* An answer's append completed (I/O thread): send what queued up behind it, in one write. */
static void answer_sent(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    (void)status; /* a failed answer is dropped: the requester's deadline covers it */
    (void)res;
    remote_request *r = arg;
    answer_sender *s = r->sender;
    /* The list holds references; s stays alive while answers_send uses it. */
    pthread_mutex_lock(&s->mu);
    s->refs++;
    pthread_mutex_unlock(&s->mu);
    answers_send(s, answer_finished(r));
    sender_unref(s);
}

static void remote_done(ts_batcher_t *b, int status, ts_value_t *output, int64_t version, void *arg)
{
    (void)b;
    remote_request *r = arg;
    answer_sender *s = r->sender;
    ritems_unref(r->items);
    r->items = NULL;
    r->rec = reply_record(r->id, status, output, version, status != 0 ? ts_last_error() : NULL);
    r->next = NULL;
    int oom = r->rec == NULL;
    pthread_mutex_lock(&s->mu);
    s->refs++; /* this call's own, while it may still use s */
    int now = oom || s->inflight == 0;
    if (now)
        s->inflight++;
    else if (s->tail != NULL)
        s->tail->next = r;
    else
        s->head = r;
    if (!now)
        s->tail = r; /* from here on r may be sent and freed by the I/O thread */
    pthread_mutex_unlock(&s->mu);
    if (oom)
        answers_send(s, answer_finished(r)); /* nothing to send: the requester's deadline */
    else if (now)
        answers_send(s, r);
    sender_unref(s);
}

/*
 * Count a malformed request (one refused before it reached the engine) and report it to the
 * serve options' on_malformed with the reason in ts_last_error(). Serve thread only.
 */
static void malformed(remote_server *rem, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void malformed(remote_server *rem, const char *fmt, ...)
{
    pthread_mutex_lock(&rem->b->mu);
    rem->b->st.malformed++;
    pthread_mutex_unlock(&rem->b->mu);
    if (rem->opts.on_malformed == NULL)
        return;
    char why[TS__BERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    ts__batcher_set_err("%s", why);
    rem->opts.on_malformed(rem->b, TS_ESCHEMA, rem->opts.on_malformed_arg);
}

/*
 * Check one request record and submit it; answer at once when it cannot be submitted. A record
 * that is not a request (not a map, no integer id, no reply bin name, no input, an input that
 * does not match the schema) is malformed: counted, reported, and answered with TS_ESCHEMA when
 * it names a reply bin and an id.
 */
static void dispatch_one(remote_server *rem, shared_items *items, const ts_value_t *rec)
{
    /* An empty map is the wake-up a stopping server of the same name appends: no request. */
    if (ts_value_type(rec) == TS_TYPE_MAP && ts_value_len(rec) == 0)
        return;
    if (ts_value_type(rec) != TS_TYPE_MAP) {
        malformed(rem, "not a map");
        return;
    }
    int64_t id = 0, timeout_ms = 0;
    const char *reply = NULL;
    size_t reply_len = 0;
    if (ts_map_get_int(rec, "id", &id) != 0) {
        malformed(rem, "no integer 'id'");
        return;
    }
    if (ts_value_string(ts_map_get(rec, "reply"), &reply, &reply_len) != 0 || reply_len == 0 ||
        reply_len > TS_MAX_NAME_LEN || memchr(reply, '\0', reply_len) != NULL) {
        malformed(rem, "request %lld: no 'reply' bin name (a string of 1 to %d bytes)",
                  (long long)id, TS_MAX_NAME_LEN);
        return; /* nobody to answer */
    }
    char bin[TS_MAX_NAME_LEN + 1];
    memcpy(bin, reply, reply_len);
    bin[reply_len] = '\0';
    if (ts_map_get(rec, "timeout_ms") != NULL &&
        ts_map_get_int(rec, "timeout_ms", &timeout_ms) != 0)
        timeout_ms = 0; /* not an integer: the batcher's default */
    const ts_value_t *input = ts_map_get(rec, "input");
    if (input == NULL) {
        malformed(rem, "request %lld: no 'input'", (long long)id);
        send_reply(rem->client, bin, id, TS_ESCHEMA, NULL, 0, "the request has no input");
        return;
    }
    remote_request *r = ts__calloc(1, sizeof(*r));
    if (r == NULL) {
        send_reply(rem->client, bin, id, TS_ENOMEM, NULL, 0, "out of memory");
        return;
    }
    r->sender = rem->sender;
    pthread_mutex_lock(&rem->sender->mu);
    rem->sender->refs++;
    pthread_mutex_unlock(&rem->sender->mu);
    r->items = items;
    r->id = id;
    memcpy(r->reply, bin, reply_len + 1);
    atomic_fetch_add(&items->refs, 1);
    /* The record's timeout_ms: milliseconds; 0 or absent: the batcher's default; < 0: none. */
    int t = timeout_ms > INT32_MAX ? INT32_MAX
            : timeout_ms < 0       ? TS_TIMEOUT_INFINITE
            : timeout_ms == 0      ? TS_TIMEOUT_DEFAULT
                                   : (int)timeout_ms;
    int rc = ts_batcher_predict_async(rem->b, input, 0, t, remote_done, r);
    if (rc != 0) {
        /* Copied: reporting a malformed request sets this thread's message again. */
        char why[TS__BERR_LEN];
        snprintf(why, sizeof(why), "%s", ts_last_error());
        if (rc == TS_ESCHEMA)
            malformed(rem, "request %lld: %s", (long long)id, why);
        send_reply(rem->client, bin, id, rc, NULL, 0, why[0] != '\0' ? why : NULL);
        ritems_unref(items);
        ts__free(r);
        sender_unref(rem->sender);
    }
}

static void take_wait_done(ts_client_t *c, int status, ts_result_t *res, void *arg);
static void take_get_done(ts_client_t *c, int status, ts_result_t *res, void *arg);

static void rem_unref(remote_server *rem)
{
    if (atomic_fetch_sub(&rem->refs, 1) != 1)
        return;
    pthread_cond_destroy(&rem->cv);
    pthread_mutex_destroy(&rem->mu);
    sender_unref(rem->sender); /* answers still to come keep it */
    ts__free(rem);
}

/* The chain ends (stopping) or breaks (a call failed): tell the serve thread. */
static void take_stop(remote_server *rem, int broken)
{
    pthread_mutex_lock(&rem->mu);
    rem->chain_running = 0;
    rem->chain_broken = broken && !atomic_load(&rem->stop);
    pthread_cond_broadcast(&rem->cv);
    pthread_mutex_unlock(&rem->mu);
    rem_unref(rem); /* the chain's */
}

/* The chain's next call: a GET when items remain in the bin, else a WAIT (any thread). */
static void take_next(remote_server *rem, int more)
{
    if (atomic_load(&rem->stop)) {
        take_stop(rem, 0);
        return;
    }
    int rc;
    if (more) {
        size_t max_items = (size_t)rem->b->max_batch * TS__GET_BATCHES;
        rc = ts_get_async(rem->client, rem->req_bin, max_items, take_get_done, rem);
    } else {
        pthread_mutex_lock(&rem->mu);
        uint64_t after = rem->after;
        pthread_mutex_unlock(&rem->mu);
        rc = ts_wait_async(rem->client, rem->req_bin, after, TS__REMOTE_WAIT_MS, take_wait_done,
                           rem);
    }
    if (rc != 0)
        take_stop(rem, 1);
}

static void take_wait_done(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    remote_server *rem = arg;
    if (status == TS_ETIMEDOUT || status != 0) {
        if (status == TS_ETIMEDOUT)
            take_next(rem, 0);
        else
            take_stop(rem, 1);
        return;
    }
    pthread_mutex_lock(&rem->mu);
    rem->seen = res->version;
    pthread_mutex_unlock(&rem->mu);
    take_next(rem, 1);
}

static void take_get_done(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    remote_server *rem = arg;
    if (status == TS_ENOENT) {
        /* Another server took them. */
        pthread_mutex_lock(&rem->mu);
        rem->after = rem->seen > rem->after ? rem->seen : rem->after;
        pthread_mutex_unlock(&rem->mu);
        take_next(rem, 0);
        return;
    }
    if (status != 0) {
        take_stop(rem, 1);
        return;
    }
    ts_items_t *items = res->items;
    res->items = NULL; /* kept: the requests borrow their inputs from it */
    pthread_mutex_lock(&rem->mu);
    rem->after = ts_items_version(items);
    /* Once stopping has given up on the chain, the batcher may be gone: take nothing. */
    int gone = rem->abandoned;
    rem->dispatching = !gone;
    pthread_mutex_unlock(&rem->mu);
    int more = ts_items_remaining(items) > 0;
    shared_items *ri = gone ? NULL : ts__malloc(sizeof(*ri));
    if (ri != NULL) {
        atomic_init(&ri->refs, 1);
        ri->items = items;
        for (size_t i = 0; i < ts_items_count(items); i++)
            dispatch_one(rem, ri, ts_items_at(items, i));
        ritems_unref(ri);
    } else {
        ts_items_free(items);
    }
    pthread_mutex_lock(&rem->mu);
    rem->dispatching = 0;
    pthread_cond_broadcast(&rem->cv);
    pthread_mutex_unlock(&rem->mu);
    if (ri == NULL)
        take_stop(rem, !gone);
    else
        take_next(rem, more);
}

/*
 * The serve thread: starts the taking chain, restarts it after a pause when one of its calls
 * failed, and ends with serving; the chain's callbacks do the taking and submitting.
 */
static void *serve_main(void *arg)
{
    remote_server *rem = arg;
    pthread_mutex_lock(&rem->mu);
    for (;;) {
        if (atomic_load(&rem->stop))
            break;
        if (!rem->chain_running) {
            if (rem->chain_broken) {
                pthread_mutex_unlock(&rem->mu);
                ts__remote_pause(TS__REMOTE_RETRY_NS);
                pthread_mutex_lock(&rem->mu);
                if (atomic_load(&rem->stop))
                    break;
            }
            rem->chain_broken = 0;
            rem->chain_running = 1;
            atomic_fetch_add(&rem->refs, 1); /* the chain's, until take_stop */
            pthread_mutex_unlock(&rem->mu);
            take_next(rem, 0);
            pthread_mutex_lock(&rem->mu);
            continue;
        }
        pthread_cond_wait(&rem->cv, &rem->mu);
    }
    /* The chain sees stop at its next callback: remote_stop waits for that (chain_wait). */
    pthread_mutex_unlock(&rem->mu);
    return NULL;
}

/*
 * Wait for the taking chain to end. It ends at its next callback, which comes within
 * TS__REMOTE_WAIT_MS (its WAIT's timeout; the wake-up makes it sooner) while the client is
 * connected. A call of the chain made while the connection is down waits for the reconnection
 * until its deadline (the client's request timeout): while the client is not connected, or after
 * TS__REMOTE_STOP_MS, the chain is left to end by itself. Its callbacks then take no request and
 * touch nothing but rem, which the chain's reference keeps.
 */
static void chain_wait(remote_server *rem)
{
    uint64_t until = ts__now_ns() + (uint64_t)TS__REMOTE_STOP_MS * 1000000u;
    pthread_mutex_lock(&rem->mu);
    for (;;) {
        if (rem->dispatching) {
            pthread_cond_wait(&rem->cv, &rem->mu); /* it submits what it took, then ends */
            continue;
        }
        if (!rem->chain_running)
            break;
        pthread_mutex_unlock(&rem->mu);
        int up = ts_client_connected(rem->client);
        uint64_t now = ts__now_ns();
        pthread_mutex_lock(&rem->mu);
        if (rem->dispatching || !rem->chain_running)
            continue;
        if (!up || now >= until) {
            rem->abandoned = 1;
            break;
        }
        (void)ts__cond_wait_until(&rem->cv, &rem->mu, now + TS__REMOTE_RETRY_NS);
    }
    pthread_mutex_unlock(&rem->mu);
}

/* ---------------------------------------------------------------------------------------------
 * The service NAME
 */

/*
 * The serving side of the service: refcounted by the server and by every call it has taken
 * until that call's prediction completed (completions may come after stopping).
 */
typedef struct svc_server {
    pthread_mutex_t mu;
    pthread_cond_t cv;     /* closed, and the list emptied and replying reached 0 */
    struct svc_call *head; /* calls not answered yet (doubly linked), under mu */
    int replying;          /* completions between taking a call and its ts_call_reply's return */
    int closed;            /* stopping: no call comes any more */
    atomic_int refs;
    ts_batcher_t *b;
    remote_server *rem; /* valid until closed (the callback is not called after that) */
    ts_service_t *reg;
} svc_server;

/* One call taken by the service, in the batcher, until its prediction completes. */
typedef struct svc_call {
    struct svc_call *prev, *next; /* the server's list, while call is not NULL */
    svc_server *ss;
    ts_call_t *call;     /* answered (and set to NULL) exactly once, under ss->mu's claim */
    ts_value_t *request; /* the caller's record, holding the input the batcher reads */
    uint64_t id;         /* the batcher's id of the prediction, for ts_batcher_cancel */
} svc_call;

static void svc_unref(svc_server *ss)
{
    if (atomic_fetch_sub(&ss->refs, 1) != 1)
        return;
    pthread_cond_destroy(&ss->cv);
    pthread_mutex_destroy(&ss->mu);
    ts__free(ss);
}

/* Unlink k (it is on the list). Lock held. */
static void svc_unlink(svc_server *ss, svc_call *k)
{
    if (k->prev != NULL)
        k->prev->next = k->next;
    else
        ss->head = k->next;
    if (k->next != NULL)
        k->next->prev = k->prev;
    k->prev = k->next = NULL;
}

/*
 * Answer call with a prediction's outcome: {status: 0, version, output} (output taken over), or
 * {status: TS_E*, version, error} for a failed one. The protocol's statuses have no TS_ESCHEMA,
 * TS_EMODEL or TS_ECANCELED, so failures travel in the record (ts_call_fail would turn them into
 * TS_ESERVER); only an answer that cannot be built is failed with TS_ENOMEM.
 */
static void svc_answer(ts_call_t *call, int status, ts_value_t *output, int64_t version,
                       const char *msg)
{
    ts_value_t *rec = ts_map_new();
    int rc = rec != NULL ? 0 : TS_ENOMEM;
    if (rc == 0)
        rc = ts_map_set(rec, "status", ts_int_new(status));
    if (rc == 0)
        rc = ts_map_set(rec, "version", ts_int_new(version));
    if (rc == 0 && status == 0) {
        rc = ts_map_set(rec, "output", output);
        output = NULL;
    } else if (rc == 0) {
        const char *m = msg != NULL && msg[0] != '\0' ? msg : ts_strerror(status);
        rc = ts_map_set(rec, "error", ts_string_new(m, strlen(m)));
    }
    ts_value_free(output);
    /*
     * An answer ts_call_reply cannot send (an output that cannot be encoded, no memory) is
     * answered by it with TS_ESERVER and the reason: the caller learns at once and the call stops
     * counting against this server. One the caller no longer waits for is dropped.
     */
    if (rc == 0)
        (void)ts_call_reply(call, rec);
    else
        (void)ts_call_fail(call, TS_ENOMEM, "the server could not build the answer");
    ts_value_free(rec);
}

/* A call's prediction completed (a batcher thread): answer it unless stopping already did. */
static void svc_done(ts_batcher_t *b, int status, ts_value_t *output, int64_t version, void *arg)
{
    (void)b;
    svc_call *k = arg;
    svc_server *ss = k->ss;
    pthread_mutex_lock(&ss->mu);
    ts_call_t *call = k->call;
    k->call = NULL;
    if (call != NULL) {
        svc_unlink(ss, k);
        ss->replying++;
    }
    pthread_mutex_unlock(&ss->mu);
    if (call != NULL) {
        svc_answer(call, status, output, version, status != 0 ? ts_last_error() : NULL);
        pthread_mutex_lock(&ss->mu);
        if (--ss->replying == 0 && ss->closed && ss->head == NULL)
            pthread_cond_broadcast(&ss->cv);
        pthread_mutex_unlock(&ss->mu);
    } else {
        ts_value_free(output); /* answered when its submit failed */
    }
    ts_value_free(k->request);
    ts__free(k);
    svc_unref(ss);
}

/*
 * A call for the service (the serving client's I/O thread, one at a time): check the request
 * {input: <input tree>} and submit the input, borrowed from the request, with the deadline the
 * caller has left. A request that is not a map with an input, or whose input does not match the
 * schema, is malformed: counted, reported, and answered with TS_ESCHEMA.
 */
static void svc_request(ts_service_t *reg, ts_call_t *call, ts_value_t *request, void *arg)
{
    (void)reg;
    svc_server *ss = arg;
    remote_server *rem = ss->rem;
    const ts_value_t *input =
        ts_value_type(request) == TS_TYPE_MAP ? ts_map_get(request, "input") : NULL;
    if (input == NULL) {
        malformed(rem, "call %llu: not a map with an 'input'",
                  (unsigned long long)ts_call_id(call));
        svc_answer(call, TS_ESCHEMA, NULL, 0, "the request is not a map with an 'input'");
        ts_value_free(request);
        return;
    }
    svc_call *k = ts__calloc(1, sizeof(*k));
    if (k == NULL) {
        (void)ts_call_fail(call, TS_ENOMEM, "the server is out of memory");
        ts_value_free(request);
        return;
    }
    k->ss = ss;
    k->call = call;
    k->request = request;
    atomic_fetch_add(&ss->refs, 1);
    pthread_mutex_lock(&ss->mu);
    k->next = ss->head;
    if (ss->head != NULL)
        ss->head->prev = k;
    ss->head = k;
    pthread_mutex_unlock(&ss->mu);
    /* The caller's time left, as the batcher's deadline (tensord answers TIMEOUT at it too). */
    uint32_t left = ts_call_timeout_ms(call);
    int t = left > (uint32_t)INT32_MAX ? INT32_MAX : left == 0 ? 1 : (int)left;
    ts_predict_options_t po;
    ts_predict_options_init(&po);
    po.timeout_ms = t;
    /* The id is written before the prediction can complete (under the batcher's lock). */
    int rc = ts_batcher_predict_async_with(rem->b, input, &po, svc_done, k, &k->id);
    if (rc == 0)
        return; /* from here on k belongs to svc_done */
    char why[TS__BERR_LEN];
    snprintf(why, sizeof(why), "%s", ts_last_error());
    if (rc == TS_ESCHEMA)
        malformed(rem, "call %llu: %s", (unsigned long long)ts_call_id(call), why);
    /* Never submitted, so never completed: stopping cannot have taken it (it waits for this
       callback to return before it looks at the list). */
    pthread_mutex_lock(&ss->mu);
    svc_unlink(ss, k);
    k->call = NULL;
    pthread_mutex_unlock(&ss->mu);
    svc_answer(call, rc, NULL, 0, why);
    ts_value_free(request);
    ts__free(k);
    svc_unref(ss);
}

/* The concurrency the service registers with when the options name none. */
static int svc_default_concurrency(const ts_batcher_t *b)
{
    int64_t n = (int64_t)TS_BATCHER_SERVICE_BATCHES * b->max_batch * b->n_rep;
    if (n < TS_BATCHER_SERVICE_MIN_CONCURRENCY)
        n = TS_BATCHER_SERVICE_MIN_CONCURRENCY;
    return n > TS_SERVICE_MAX_CONCURRENCY ? TS_SERVICE_MAX_CONCURRENCY : (int)n;
}

/*
 * Register the service name on rem's client (a blocking call). 0 and *out; 0 and NULL when
 * tensord does not know services (an older one: only the relay serves); or the error.
 */
static int svc_start(remote_server *rem, const char *name, int concurrency, svc_server **out)
{
    *out = NULL;
    svc_server *ss = ts__calloc(1, sizeof(*ss));
    if (ss == NULL)
        return ts__fail(TS_ENOMEM, NULL);
    pthread_mutex_init(&ss->mu, NULL);
    pthread_cond_init(&ss->cv, NULL);
    atomic_init(&ss->refs, 1);
    ss->rem = rem;
    ss->b = rem->b;
    ts_service_options_t so;
    ts_service_options_init(&so);
    so.concurrency = concurrency > 0 ? concurrency : svc_default_concurrency(rem->b);
    int rc = ts_service_register(&ss->reg, rem->client, name, &so, svc_request, ss);
    if (rc != 0) {
        svc_unref(ss);
        return rc == TS_EUNKNOWNOP ? 0 : rc;
    }
    *out = ss;
    return 0;
}

/*
 * Stop the service: no call is taken once tensord confirms; the calls still queued in the
 * batcher are cancelled (they are answered TS_ECANCELED), and the answers of those in a forward
 * now are waited for, so that nothing uses the client once this returns.
 */
static void svc_stop(svc_server *ss)
{
    if (ss == NULL)
        return;
    ts_service_unregister(ss->reg); /* no callback runs once it returns */
    pthread_mutex_lock(&ss->mu);
    ss->closed = 1;
    size_t n = 0;
    for (const svc_call *k = ss->head; k != NULL; k = k->next)
        n++;
    uint64_t *ids = n > 0 ? ts__calloc(n, sizeof(*ids)) : NULL;
    size_t i = 0;
    for (const svc_call *k = ss->head; k != NULL && ids != NULL; k = k->next)
        ids[i++] = k->id;
    pthread_mutex_unlock(&ss->mu);
    /* Those not queued any more are in a forward (or being answered): they complete soon. */
    for (size_t j = 0; j < i; j++)
        (void)ts_batcher_cancel(ss->b, ids[j]);
    ts__free(ids);
    pthread_mutex_lock(&ss->mu);
    while (ss->head != NULL || ss->replying > 0)
        pthread_cond_wait(&ss->cv, &ss->mu);
    pthread_mutex_unlock(&ss->mu);
    svc_unref(ss);
}

static void params_release(const ts_value_t *params, void *arg)
{
    (void)params;
    ts_items_free(arg);
}

static void *follow_main(void *arg)
{
    remote_server *rem = arg;
    uint64_t after = 0;
    while (!atomic_load(&rem->stop)) {
        uint64_t v = 0;
        int rc = ts_wait(rem->client, rem->params_bin, after, TS__REMOTE_WAIT_MS, &v, NULL);
        if (rc == TS_ETIMEDOUT)
            continue;
        if (rc != 0) {
            ts__remote_pause(TS__REMOTE_RETRY_NS);
            continue;
        }
        ts_items_t *items = NULL;
        rc = ts_peek(rem->client, rem->params_bin, 0, &items);
        if (rc == TS_ENOENT) {
            after = v;
            continue;
        }
        if (rc != 0) {
            ts__remote_pause(TS__REMOTE_RETRY_NS);
            continue;
        }
        after = ts_items_version(items);
        /* The newest item wins (a trainer puts one; appended ones are read newest first). */
        size_t n = ts_items_count(items);
        const ts_value_t *rec = n > 0 ? ts_items_at(items, n - 1) : NULL;
        const ts_value_t *params = rec != NULL ? ts_map_get(rec, "params") : NULL;
        int64_t version = 0;
        if (params == NULL || ts_map_get_int(rec, "version", &version) != 0 ||
            ts_batcher_load_weights_async(rem->b, params, version, params_release, items) != 0)
            ts_items_free(items);
    }
    return NULL;
}

static void remote_stop(ts_batcher_t *b);

/* The batcher's remote state, made on first use. Lock held. */
static remote_server *remote_get(ts_batcher_t *b, ts_client_t *client)
{
    if (b->remote == NULL) {
        remote_server *rem = ts__calloc(1, sizeof(*rem));
        answer_sender *snd = ts__calloc(1, sizeof(*snd));
        if (rem == NULL || snd == NULL) {
            ts__free(rem);
            ts__free(snd);
            return NULL;
        }
        pthread_mutex_init(&snd->mu, NULL);
        snd->client = client;
        snd->refs = 1;
        rem->sender = snd;
        b->remote = rem;
        b->remote->b = b;
        b->remote->client = client;
        b->remote_stop = remote_stop;
        atomic_init(&b->remote->stop, 0);
        atomic_init(&b->remote->refs, 1);
        pthread_mutex_init(&b->remote->mu, NULL);
        ts__cond_init_monotonic(&b->remote->cv);
    }
    return b->remote->client == client ? b->remote : NULL;
}

void ts_batcher_serve_options_init(ts_batcher_serve_options_t *opts)
{
    memset(opts, 0, sizeof(*opts));
}

int ts_batcher_serve(ts_batcher_t *b, ts_client_t *client, const char *name)
{
    return ts_batcher_serve_with(b, client, name, NULL);
}

int ts_batcher_serve_with(ts_batcher_t *b, ts_client_t *client, const char *name,
                          const ts_batcher_serve_options_t *opts)
{
    if (b == NULL || client == NULL || name == NULL || name[0] == '\0' ||
        strlen(name) + strlen(TS_BATCHER_REQ_SUFFIX) > TS_MAX_NAME_LEN) {
        ts__batcher_set_err("serve needs a client and a name of at most %d bytes",
                            (int)(TS_MAX_NAME_LEN - strlen(TS_BATCHER_REQ_SUFFIX)));
        return TS_EINVAL;
    }
    if (opts != NULL &&
        (opts->service_concurrency < 0 || opts->service_concurrency > TS_SERVICE_MAX_CONCURRENCY)) {
        ts__batcher_set_err("service_concurrency %d: 0 (the default) to %d",
                            opts->service_concurrency, TS_SERVICE_MAX_CONCURRENCY);
        return TS_EINVAL;
    }
    /* Reserved under the lock; the service is registered without it (a blocking call). */
    pthread_mutex_lock(&b->mu);
    remote_server *rem = remote_get(b, client);
    int rc = rem == NULL ? TS_EINVAL : rem->serving ? TS_EINVAL : 0;
    if (rc == 0) {
        rem->serving = 1;
        snprintf(rem->req_bin, sizeof(rem->req_bin), "%s%s", name, TS_BATCHER_REQ_SUFFIX);
        if (opts != NULL)
            rem->opts = *opts;
        else
            ts_batcher_serve_options_init(&rem->opts);
    }
    pthread_mutex_unlock(&b->mu);
    if (rc != 0) {
        ts__batcher_set_err("already serving, or another client is in use");
        return rc;
    }
    svc_server *ss = NULL;
    rc = svc_start(rem, name, rem->opts.service_concurrency, &ss);
    pthread_mutex_lock(&b->mu);
    if (rc == 0 && b->remote != rem) {
        rc = TS_EINVAL; /* serving stopped meanwhile: the caller's race */
        ts__batcher_set_err("serving stopped while the service was registered");
    }
    if (rc == 0 && pthread_create(&rem->serve_th, NULL, serve_main, rem) != 0) {
        rc = TS_ENOMEM;
        ts__batcher_set_err("cannot start the serve thread");
    }
    if (rc == 0)
        rem->svc = ss;
    else if (b->remote == rem)
        rem->serving = 0;
    pthread_mutex_unlock(&b->mu);
    if (rc != 0) {
        char why[TS__BERR_LEN];
        snprintf(why, sizeof(why), "%s", ts_last_error());
        svc_stop(ss);
        ts__batcher_set_err("%s", why);
    }
    return rc;
}

int ts_batcher_follow_weights(ts_batcher_t *b, ts_client_t *client, const char *bin)
{
    if (b == NULL || client == NULL || bin == NULL || bin[0] == '\0' ||
        strlen(bin) > TS_MAX_NAME_LEN) {
        ts__batcher_set_err("follow needs a client and a bin name");
        return TS_EINVAL;
    }
    pthread_mutex_lock(&b->mu);
    remote_server *rem = remote_get(b, client);
    int rc = rem == NULL ? TS_EINVAL : rem->following ? TS_EINVAL : 0;
    if (rc == 0) {
        snprintf(rem->params_bin, sizeof(rem->params_bin), "%s", bin);
        if (pthread_create(&rem->follow_th, NULL, follow_main, rem) != 0)
            rc = TS_ENOMEM;
        else
            rem->following = 1;
    }
    pthread_mutex_unlock(&b->mu);
    if (rc != 0)
        ts__batcher_set_err("already following, or another client is in use");
    return rc;
}

int ts_batcher_serve_shm(ts_batcher_t *b, ts_client_t *client, const char *name,
                         const ts_batcher_shm_options_t *opts)
{
    if (b == NULL || client == NULL || name == NULL || name[0] == '\0' ||
        strlen(name) + strlen(TS_BATCHER_REQ_SUFFIX) > TS_MAX_NAME_LEN) {
        ts__batcher_set_err("serve_shm needs a client and a name of at most %d bytes",
                            (int)(TS_MAX_NAME_LEN - strlen(TS_BATCHER_REQ_SUFFIX)));
        return TS_EINVAL;
    }
    pthread_mutex_lock(&b->mu);
    remote_server *rem = remote_get(b, client);
    int rc = rem == NULL || rem->shm != NULL ? TS_EINVAL : 0;
    pthread_mutex_unlock(&b->mu);
    if (rc != 0) {
        ts__batcher_set_err("already offering slots, or another client is in use");
        return rc;
    }
    /*
     * Made without the batcher's lock (it puts the descriptor through the client); two callers
     * at once on one batcher are the caller's race, reported by the check below.
     */
    shm_server *s = NULL;
    rc = ts__shm_serve_start(b, client, name, opts, &s);
    if (rc != 0)
        return rc;
    pthread_mutex_lock(&b->mu);
    rem = b->remote;
    int ok = rem != NULL && rem->shm == NULL;
    if (ok)
        rem->shm = s;
    pthread_mutex_unlock(&b->mu);
    if (!ok) {
        ts__shm_serve_stop(s);
        ts__batcher_set_err("already offering slots, or serving stopped meanwhile");
        return TS_EINVAL;
    }
    return 0;
}

static void remote_stop(ts_batcher_t *b)
{
    pthread_mutex_lock(&b->mu);
    remote_server *rem = b->remote;
    b->remote = NULL;
    pthread_mutex_unlock(&b->mu);
    if (rem == NULL)
        return;
    /* The slots close first: their requesters use the service from now on, while it runs. */
    ts__shm_serve_stop(rem->shm);
    /* Then the service: its calls still in the batcher are answered TS_ECANCELED. */
    svc_stop(rem->svc);
    atomic_store(&rem->stop, 1);
    pthread_mutex_lock(&rem->mu);
    pthread_cond_broadcast(&rem->cv);
    pthread_mutex_unlock(&rem->mu);
    if (rem->serving) {
        /*
         * Wake the taking chain's WAIT: every server of the name skips an empty map without
         * counting it as malformed. Sent without waiting for its answer, and only while
         * connected: made while the connection is down, it would only wait for a reconnection.
         */
        ts_value_t *wake = ts_client_connected(rem->client) ? ts_map_new() : NULL;
        if (wake != NULL)
            (void)ts_append_async(rem->client, rem->req_bin, wake, TS_COPY, NULL, NULL);
        ts_value_free(wake);
        pthread_join(rem->serve_th, NULL);
        chain_wait(rem);
    }
    if (rem->following)
        pthread_join(rem->follow_th, NULL);
    rem_unref(rem); /* the batcher's */
}

void ts_batcher_stop_remote(ts_batcher_t *b)
{
    if (b != NULL)
        remote_stop(b);
}
