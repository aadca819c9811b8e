/*
 * Services against a real tensord (include/tensorshare/service.h): calls answered by the
 * registered server with the caller's own request echoed, many calls from several threads at
 * once, two servers sharing the load within their concurrency, a server process killed while it
 * holds a call (the call fails at once with TS_ESERVICE and another server takes the next one),
 * calls to a service without servers (TS_ENOENT, or waiting with TS_CALL_WAIT), timeouts with the
 * late answer dropped, errors answered by the server (every status a server may send ends its
 * call only, the client's other calls and connection untouched), an answer that cannot be sent
 * (answered with an error all the same), the 24-hour limit of a call's timeout, unregistering
 * (one of two servers while calls flow: none fails), and bad input as raw frames (a clear error
 * that names what is wrong, and nothing changed).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "msg.h"
#include "record.h"
#include "tensorshare/service.h"
#include "test_client_util.h"

#define CALL_THREADS 4
#define CALLS_EACH   200
#define LONG_MS      20000
/* ms; how soon a call held by a server that dies must fail (far below its timeout) */
#define GONE_MS 3000

static tsh_server srv;

static int group_setup(void **state)
{
    (void)state;
    return tsh_server_start(&srv, NULL);
}

static int group_teardown(void **state)
{
    (void)state;
    int rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    return rc == 0 ? 0 : -1;
}

static ts_client_t *open_client(void)
{
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, srv.addr, NULL), 0);
    return c;
}

/* ---------------------------------------------------------------------------------------------
 * Servers used by the tests
 */

/* Echo: answer each call with its request, tag + 1000 * id of the server (counted). */
typedef struct echo_server {
    int id;
    tc_latch served;
} echo_server;

static void echo_cb(ts_service_t *svc, ts_call_t *call, ts_value_t *request, void *arg)
{
    (void)svc;
    echo_server *e = arg;
    int64_t tag = tc_tag(request);
    ts_value_t *ans = tc_item(4, (float)tag, tag + 1000 * e->id);
    ts_value_free(request);
    assert_int_equal(ts_call_reply(call, ans), 0);
    ts_value_free(ans);
    tc_latch_add(&e->served, 1);
}

/* Holder: keeps every call it gets until the test answers it (or never does). */
#define HOLD_MAX 64
typedef struct holder {
    pthread_mutex_t mu;
    ts_call_t *calls[HOLD_MAX];
    int64_t tags[HOLD_MAX];
    int n;
    tc_latch got;
} holder;

static void hold_cb(ts_service_t *svc, ts_call_t *call, ts_value_t *request, void *arg)
{
    (void)svc;
    holder *h = arg;
    pthread_mutex_lock(&h->mu);
    assert_true(h->n < HOLD_MAX);
    h->tags[h->n] = tc_tag(request);
    h->calls[h->n++] = call;
    pthread_mutex_unlock(&h->mu);
    ts_value_free(request);
    tc_latch_add(&h->got, 1);
}

static void holder_init(holder *h)
{
    memset(h, 0, sizeof(*h));
    pthread_mutex_init(&h->mu, NULL);
    tc_latch_init(&h->got);
}

static int holder_n(holder *h)
{
    pthread_mutex_lock(&h->mu);
    int n = h->n;
    pthread_mutex_unlock(&h->mu);
    return n;
}

static int64_t holder_tag(holder *h, int i)
{
    pthread_mutex_lock(&h->mu);
    int64_t t = h->tags[i];
    pthread_mutex_unlock(&h->mu);
    return t;
}

static ts_call_t *holder_take(holder *h, int i)
{
    pthread_mutex_lock(&h->mu);
    ts_call_t *c = h->calls[i];
    h->calls[i] = NULL;
    pthread_mutex_unlock(&h->mu);
    return c;
}

static ts_value_t *make_req(int64_t tag)
{
    return tc_item(4, (float)tag, tag);
}

/* ---------------------------------------------------------------------------------------------
 * Tests
 */

typedef struct caller_arg {
    ts_client_t *c;
    int base;
    int bad;
} caller_arg;

static void *caller_main(void *p)
{
    caller_arg *a = p;
    for (int i = 0; i < CALLS_EACH; i++) {
        int64_t tag = a->base + i;
        ts_value_t *req = make_req(tag), *ans = NULL;
        int rc = ts_call(a->c, "echo", req, LONG_MS, 0, &ans);
        ts_value_free(req);
        if (rc != 0 || !tc_check_vec(ans, 4, (float)tag) || tc_tag(ans) != tag + 1000)
            a->bad++;
        ts_value_free(ans);
    }
    return NULL;
}

/* Every call gets its own answer, from several threads sharing one client at once. */
static void test_echo_many(void **state)
{
    (void)state;
    ts_client_t *sc = open_client(), *cc = open_client();
    echo_server e = {.id = 1};
    tc_latch_init(&e.served);
    ts_service_t *svc = NULL;
    assert_int_equal(ts_service_register(&svc, sc, "echo", NULL, echo_cb, &e), 0);
    pthread_t th[CALL_THREADS];
    caller_arg args[CALL_THREADS];
    for (int t = 0; t < CALL_THREADS; t++) {
        args[t] = (caller_arg){.c = cc, .base = t * 100000};
        assert_int_equal(pthread_create(&th[t], NULL, caller_main, &args[t]), 0);
    }
    for (int t = 0; t < CALL_THREADS; t++) {
        pthread_join(th[t], NULL);
        assert_int_equal(args[t].bad, 0);
    }
    assert_int_equal(tc_latch_get(&e.served), CALL_THREADS * CALLS_EACH);
    ts_service_unregister(svc);
    /* No server any more: a call fails at once. */
    ts_value_t *req = make_req(1), *ans = NULL;
    assert_int_equal(ts_call(cc, "echo", req, LONG_MS, 0, &ans), TS_ENOENT);
    assert_non_null(strstr(ts_last_error(), "echo"));
    ts_value_free(req);
    ts_client_free(cc);
    ts_client_free(sc);
    tc_latch_destroy(&e.served);
}

/* Two servers of concurrency 2 share 8 calls: each holds at most 2, and both get some. */
static void test_load_sharing(void **state)
{
    (void)state;
    ts_client_t *s1 = open_client(), *s2 = open_client(), *cc = open_client();
    holder h1, h2;
    holder_init(&h1);
    holder_init(&h2);
    ts_service_options_t o;
    ts_service_options_init(&o);
    o.concurrency = 2;
    ts_service_t *v1, *v2;
    assert_int_equal(ts_service_register(&v1, s1, "share", &o, hold_cb, &h1), 0);
    assert_int_equal(ts_service_register(&v2, s2, "share", &o, hold_cb, &h2), 0);
    tc_latch done;
    tc_latch_init(&done);
    for (int i = 0; i < 8; i++) {
        ts_value_t *req = make_req(i);
        assert_int_equal(ts_call_async(cc, "share", req, LONG_MS, 0, TS_COPY, NULL, NULL), 0);
        ts_value_free(req);
    }
    /* 4 are handed at once (2 each); the other 4 wait in tensord for room. */
    assert_int_equal(tc_latch_wait(&h1.got, 2, LONG_MS), 2);
    assert_int_equal(tc_latch_wait(&h2.got, 2, LONG_MS), 2);
    tc_sleep_ms(200);
    assert_int_equal(tc_latch_get(&h1.got) + tc_latch_get(&h2.got), 4);
    /* Answering one call of server 1 hands it the next (in arrival order: tag 4). */
    ts_value_t *ans = make_req(0);
    assert_int_equal(ts_call_reply(holder_take(&h1, 0), ans), 0);
    assert_int_equal(tc_latch_wait(&h1.got, 3, LONG_MS), 3);
    assert_int_equal(holder_tag(&h1, 2), 4);
    assert_int_equal(tc_latch_get(&h2.got), 2);
    /* Answer everything as it comes until all 8 are served. */
    uint64_t t0 = tc_now_ms();
    int answered = 1;
    while (answered < 8 && tc_now_ms() - t0 < LONG_MS) {
        for (holder *h = &h1; h != NULL; h = h == &h1 ? &h2 : NULL) {
            for (int i = 0, n = holder_n(h); i < n; i++) {
                ts_call_t *c = holder_take(h, i);
                if (c != NULL) {
                    assert_int_equal(ts_call_reply(c, ans), 0);
                    answered++;
                }
            }
        }
        tc_sleep_ms(5);
    }
    assert_int_equal(answered, 8);
    assert_int_equal(tc_latch_get(&h1.got) + tc_latch_get(&h2.got), 8);
    assert_true(tc_latch_get(&h1.got) >= 3 && tc_latch_get(&h2.got) >= 2);
    ts_value_free(ans);
    ts_service_unregister(v1);
    ts_service_unregister(v2);
    ts_client_free(cc);
    ts_client_free(s1);
    ts_client_free(s2);
    tc_latch_destroy(&done);
}

/* A child process that serves "fragile" and holds every call; it says "r" when registered and
 * "g" for each call it got, on fd. */
static void child_server(int fd)
{
    ts_client_t *c = NULL;
    if (ts_client_open(&c, srv.addr, NULL) != 0)
        _exit(2);
    holder h;
    holder_init(&h);
    ts_service_t *svc;
    if (ts_service_register(&svc, c, "fragile", NULL, hold_cb, &h) != 0)
        _exit(3);
    if (write(fd, "r", 1) != 1)
        _exit(4);
    for (long seen = 0;;) {
        long n = tc_latch_wait(&h.got, seen + 1, 1000);
        for (; seen < n; seen++)
            if (write(fd, "g", 1) != 1)
                _exit(5);
    }
}

typedef struct gone_arg {
    tc_latch done;
    int status;
    uint64_t at;
    int64_t tag; /* the answer's tag, when there was one */
} gone_arg;

static void gone_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    gone_arg *g = arg;
    g->status = status;
    g->at = tc_now_ms();
    if (status == 0 && res->items != NULL && ts_items_count(res->items) == 1)
        g->tag = tc_tag(ts_items_at(res->items, 0));
    tc_latch_add(&g->done, 1);
}

/* The server holding a call is killed: the call fails at once; another server takes the next. */
static void test_server_killed(void **state)
{
    (void)state;
    int p[2];
    assert_int_equal(pipe(p), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(p[0]);
        child_server(p[1]);
        _exit(0);
    }
    close(p[1]);
    char ch = 0;
    assert_int_equal(read(p[0], &ch, 1), 1);
    assert_int_equal(ch, 'r');
    ts_client_t *cc = open_client(), *sc = open_client();
    gone_arg g = {.status = 1};
    tc_latch_init(&g.done);
    ts_value_t *req = make_req(7);
    assert_int_equal(ts_call_async(cc, "fragile", req, LONG_MS, 0, TS_COPY, gone_cb, &g), 0);
    assert_int_equal(read(p[0], &ch, 1), 1);
    assert_int_equal(ch, 'g');
    /* A second server joins, then the first dies holding the call. */
    echo_server e = {.id = 2};
    tc_latch_init(&e.served);
    ts_service_t *svc;
    assert_int_equal(ts_service_register(&svc, sc, "fragile", NULL, echo_cb, &e), 0);
    uint64_t t0 = tc_now_ms();
    kill(pid, SIGKILL);
    int wst;
    waitpid(pid, &wst, 0);
    close(p[0]);
    assert_int_equal(tc_latch_wait(&g.done, 1, LONG_MS), 1);
    assert_int_equal(g.status, TS_ESERVICE);
    assert_true(g.at - t0 < GONE_MS);
    /* The next call goes to the server that is left. */
    ts_value_t *ans = NULL;
    assert_int_equal(ts_call(cc, "fragile", req, LONG_MS, 0, &ans), 0);
    assert_int_equal(tc_tag(ans), 7 + 2000);
    ts_value_free(ans);
    ts_value_free(req);
    ts_service_unregister(svc);
    ts_client_free(sc);
    ts_client_free(cc);
    tc_latch_destroy(&g.done);
    tc_latch_destroy(&e.served);
}

typedef struct late_reg {
    ts_client_t *c;
    ts_service_t *svc;
    echo_server e;
} late_reg;

static void *register_later(void *p)
{
    late_reg *l = p;
    tc_sleep_ms(300);
    assert_int_equal(ts_service_register(&l->svc, l->c, "later", NULL, echo_cb, &l->e), 0);
    return NULL;
}

/* Without a server: TS_ENOENT at once, or with TS_CALL_WAIT an answer once one registers. */
static void test_wait_for_server(void **state)
{
    (void)state;
    ts_client_t *cc = open_client();
    late_reg l = {.c = open_client(), .e = {.id = 3}};
    tc_latch_init(&l.e.served);
    ts_value_t *req = make_req(5), *ans = NULL;
    assert_int_equal(ts_call(cc, "later", req, LONG_MS, 0, &ans), TS_ENOENT);
    /* Waiting for a server that does not come: TIMEOUT at the call's own timeout. */
    uint64_t t0 = tc_now_ms();
    assert_int_equal(ts_call(cc, "later", req, 200, TS_CALL_WAIT, &ans), TS_ETIMEDOUT);
    assert_true(tc_now_ms() - t0 >= 150);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, register_later, &l), 0);
    assert_int_equal(ts_call(cc, "later", req, LONG_MS, TS_CALL_WAIT, &ans), 0);
    assert_int_equal(tc_tag(ans), 5 + 3000);
    pthread_join(th, NULL);
    ts_value_free(ans);
    ts_value_free(req);
    ts_service_unregister(l.svc);
    ts_client_free(l.c);
    ts_client_free(cc);
    tc_latch_destroy(&l.e.served);
}

/* A call that times out at the server: TS_ETIMEDOUT; the late answer is dropped; the server's
 * place stays taken until it answers. Errors answered by the server reach the caller. */
static void test_timeout_and_errors(void **state)
{
    (void)state;
    ts_client_t *sc = open_client(), *cc = open_client();
    holder h;
    holder_init(&h);
    ts_service_options_t o;
    ts_service_options_init(&o);
    o.concurrency = 1;
    ts_service_t *svc;
    assert_int_equal(ts_service_register(&svc, sc, "slow", &o, hold_cb, &h), 0);
    ts_value_t *req = make_req(9), *ans = NULL;
    uint64_t t0 = tc_now_ms();
    assert_int_equal(ts_call(cc, "slow", req, 300, 0, &ans), TS_ETIMEDOUT);
    assert_true(tc_now_ms() - t0 >= 250);
    assert_int_equal(tc_latch_get(&h.got), 1);
    ts_call_t *first = holder_take(&h, 0);
    assert_true(ts_call_timeout_ms(first) <= 300);
    /* The next call waits for the place; answering the first (late: dropped) frees it. */
    gone_arg g = {.status = 1};
    tc_latch_init(&g.done);
    assert_int_equal(ts_call_async(cc, "slow", req, LONG_MS, 0, TS_COPY, gone_cb, &g), 0);
    tc_sleep_ms(200);
    assert_int_equal(tc_latch_get(&h.got), 1);
    assert_int_equal(ts_call_reply(first, req), 0);
    assert_int_equal(tc_latch_wait(&h.got, 2, LONG_MS), 2);
    assert_int_equal(ts_call_fail(holder_take(&h, 1), TS_EINVAL, "tag 9 is not accepted here"), 0);
    assert_int_equal(tc_latch_wait(&g.done, 1, LONG_MS), 1);
    assert_int_equal(g.status, TS_EINVAL);
    ts_value_free(req);
    ts_service_unregister(svc);
    ts_client_free(cc);
    ts_client_free(sc);
    tc_latch_destroy(&g.done);
}

typedef struct late_answerer {
    holder *h;
    int from, to; /* the held calls it answers, in turn */
    int bad;      /* answers that did not return 0 */
} late_answerer;

static void *answer_late(void *p)
{
    late_answerer *a = p;
    ts_value_t *ans = make_req(1);
    for (int i = a->from; i < a->to; i++) {
        ts_call_t *call = holder_take(a->h, i);
        int rc = i % 2 == 0 ? ts_call_reply(call, ans) : ts_call_fail(call, TS_EINVAL, "late");
        if (rc != 0)
            a->bad++;
    }
    ts_value_free(ans);
    return NULL;
}

/*
 * Calls held by a worker while the program frees the serving client: answering them afterwards
 * (or while ts_client_free runs) drops the answer and returns 0, and their callers get
 * TS_ESERVICE at once. Under the sanitizers this also shows that no freed client is touched.
 */
static void test_answer_after_client_free(void **state)
{
    (void)state;
    enum { HELD = 8 };
    ts_client_t *cc = open_client();
    gone_arg g[HELD];
    ts_value_t *req = make_req(11);
    for (int round = 0; round < 2; round++) {
        ts_client_t *sc = open_client();
        holder h;
        holder_init(&h);
        ts_service_t *svc;
        assert_int_equal(ts_service_register(&svc, sc, "held", NULL, hold_cb, &h), 0);
        for (int i = 0; i < HELD; i++) {
            g[i] = (gone_arg){.status = 1};
            tc_latch_init(&g[i].done);
            assert_int_equal(ts_call_async(cc, "held", req, LONG_MS, 0, TS_COPY, gone_cb, &g[i]),
                             0);
        }
        assert_int_equal(tc_latch_wait(&h.got, HELD, LONG_MS), HELD);
        /* Two answered before, the rest after (round 0) or while the client is freed (1). */
        late_answerer early = {.h = &h, .from = 0, .to = 2};
        (void)answer_late(&early);
        assert_int_equal(early.bad, 0);
        for (int i = 0; i < 2; i++) {
            assert_int_equal(tc_latch_wait(&g[i].done, 1, LONG_MS), 1);
            assert_int_equal(g[i].status, i == 0 ? 0 : TS_EINVAL);
        }
        late_answerer late = {.h = &h, .from = 2, .to = HELD};
        pthread_t th;
        if (round == 1)
            assert_int_equal(pthread_create(&th, NULL, answer_late, &late), 0);
        ts_client_free(sc); /* svc ends with it (service.h) */
        if (round == 1)
            assert_int_equal(pthread_join(th, NULL), 0);
        else
            (void)answer_late(&late);
        assert_int_equal(late.bad, 0);
        for (int i = 0; i < HELD; i++) {
            assert_int_equal(tc_latch_wait(&g[i].done, 1, LONG_MS), 1);
            /* After the free: failed. During it: failed, or answered if it went out first. */
            if (i >= 2 && round == 0)
                assert_int_equal(g[i].status, TS_ESERVICE);
            else if (i >= 2)
                assert_true(g[i].status == TS_ESERVICE ||
                            g[i].status == (i % 2 == 0 ? 0 : TS_EINVAL));
            tc_latch_destroy(&g[i].done);
        }
        tc_latch_destroy(&h.got);
        pthread_mutex_destroy(&h.mu);
    }
    ts_value_free(req);
    ts_client_free(cc);
}

/*
 * A server whose connection breaks the protocol while it holds a call: the caller gets
 * TS_ESERVICE at once (PROTOCOL.md section 13), not when tensord's grace period for writing the
 * error ends; the server's socket is left open meanwhile.
 */
static void test_erred_server(void **state)
{
    (void)state;
    int fd = tsh_connect_tcp(srv.port);
    assert_true(fd >= 0);
    assert_int_equal(tsh_hello(fd), 0);
    uint8_t body[512];
    size_t n;
    ts__msg_svc_register_req r = {
        .name = (const uint8_t *)"erred", .name_len = 5, .concurrency = 1};
    assert_int_equal(ts__msg_svc_register_req_encode(body, sizeof(body), &r, &n), 0);
    assert_int_equal(tsh_send(fd, TS_OP_SVC_REGISTER, 1, body, n), 0);
    ts__hdr h;
    uint8_t *rb = NULL;
    size_t rl = 0;
    assert_int_equal(tsh_recv(fd, &h, &rb, &rl), 0);
    assert_int_equal(h.status, TS_ST_OK);
    free(rb);
    ts_client_t *cc = open_client();
    gone_arg g = {.status = 1};
    tc_latch_init(&g.done);
    ts_value_t *req = make_req(3);
    assert_int_equal(ts_call_async(cc, "erred", req, LONG_MS, 0, TS_COPY, gone_cb, &g), 0);
    assert_int_equal(tsh_recv(fd, &h, &rb, &rl), 0);
    assert_int_equal(h.opcode, TS_OP_SVC_REQUEST);
    free(rb);
    uint64_t t0 = tc_now_ms();
    uint8_t junk = 0;
    assert_int_equal(tsh_send(fd, TS_OP_PING, 2, &junk, 1), 0); /* BAD_REQUEST, closing */
    assert_int_equal(tc_latch_wait(&g.done, 1, LONG_MS), 1);
    assert_int_equal(g.status, TS_ESERVICE);
    assert_true(g.at - t0 < GONE_MS);
    assert_int_equal(tsh_recv(fd, &h, &rb, &rl), 0);
    assert_int_equal(h.status, TS_ST_BAD_REQUEST);
    free(rb);
    close(fd);
    ts_value_free(req);
    ts_client_free(cc);
    tc_latch_destroy(&g.done);
}

/* An asynchronous call's status and ts_last_error(), as its callback saw them. */
typedef struct fail_arg {
    tc_latch done;
    int status;
    char msg[128];
} fail_arg;

static void fail_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    (void)res;
    fail_arg *f = arg;
    f->status = status;
    snprintf(f->msg, sizeof(f->msg), "%s", ts_last_error());
    tc_latch_add(&f->done, 1);
}

/* A blocking call of service "relay" on its own thread: its result, tag and message. */
typedef struct blocking_call {
    ts_client_t *c;
    int rc;
    int64_t tag;
    char msg[128];
} blocking_call;

static void *blocking_main(void *p)
{
    blocking_call *b = p;
    ts_value_t *req = make_req(5), *ans = NULL;
    b->rc = ts_call(b->c, "relay", req, LONG_MS, 0, &ans);
    if (b->rc == 0)
        b->tag = tc_tag(ans);
    else
        snprintf(b->msg, sizeof(b->msg), "%s", ts_last_error());
    ts_value_free(ans);
    ts_value_free(req);
    return NULL;
}

/*
 * Every status a server may answer a call with (PROTOCOL.md 8.53; BAD_REQUEST, UNKNOWN_OPCODE and
 * SHUTTING_DOWN included) ends that call only, with the status's error code and the server's
 * message: another call of the same client, in flight meanwhile, gets its answer, and the client
 * keeps its connection (a relayed BAD_REQUEST made it drop the connection as if the reply were
 * malformed, failing the other call with TS_EPROTO and dropping its answer as late). The
 * asynchronous calls' replies are read by the I/O thread; a blocking call alone in flight reads
 * its own (direct.c).
 */
static void test_relayed_status(void **state)
{
    (void)state;
    static const int errs[] = {
        TS_ENOENT,    TS_EPROTO,       TS_EUNKNOWNOP, TS_EBADRECORD, TS_EMSGSIZE, TS_EOOM,
        TS_EVERSION,  TS_EAUTH,        TS_ETOOMANY,   TS_ETIMEDOUT,  TS_ESERVER,  TS_ESLOW,
        TS_ESHUTDOWN, TS_ENAMETOOLONG, TS_EINVAL,     TS_ESAVEFAIL,  TS_EAGAIN,   TS_ESERVICE};
    const int n = (int)(sizeof(errs) / sizeof(errs[0]));
    ts_client_t *sc = open_client(), *cc = open_client();
    holder h;
    holder_init(&h);
    ts_service_t *svc;
    assert_int_equal(ts_service_register(&svc, sc, "relay", NULL, hold_cb, &h), 0);
    int64_t conns = tc_stat_int(sc, "connections_total");
    int64_t late = tc_stat_int(sc, "service_late_answers");
    /* One call stays in flight throughout. */
    gone_arg g = {.status = 1};
    tc_latch_init(&g.done);
    ts_value_t *req = make_req(1), *ans = make_req(77);
    assert_int_equal(ts_call_async(cc, "relay", req, LONG_MS, 0, TS_COPY, gone_cb, &g), 0);
    assert_int_equal(tc_latch_wait(&h.got, 1, LONG_MS), 1);
    for (int i = 0; i < n; i++) {
        fail_arg f = {.status = 1};
        tc_latch_init(&f.done);
        assert_int_equal(ts_call_async(cc, "relay", req, LONG_MS, 0, TS_COPY, fail_cb, &f), 0);
        assert_int_equal(tc_latch_wait(&h.got, 2 + i, LONG_MS), 2 + i);
        char msg[64];
        snprintf(msg, sizeof(msg), "refused by the service (%s)", ts_err_name(errs[i]));
        assert_int_equal(ts_call_fail(holder_take(&h, 1 + i), errs[i], msg), 0);
        assert_int_equal(tc_latch_wait(&f.done, 1, LONG_MS), 1);
        assert_int_equal(f.status, errs[i]);
        assert_string_equal(f.msg, msg);
        tc_latch_destroy(&f.done);
    }
    /* The call held all along is answered, on the same connection. */
    assert_int_equal(tc_latch_get(&g.done), 0);
    assert_int_equal(ts_call_reply(holder_take(&h, 0), ans), 0);
    assert_int_equal(tc_latch_wait(&g.done, 1, LONG_MS), 1);
    assert_int_equal(g.status, 0);
    assert_int_equal(g.tag, 77);
    /* Blocking calls alone in flight: a relayed BAD_REQUEST, then an answer. */
    for (int k = 0; k < 2; k++) {
        blocking_call b = {.c = cc, .rc = 1};
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, blocking_main, &b), 0);
        assert_int_equal(tc_latch_wait(&h.got, 2 + n + k, LONG_MS), 2 + n + k);
        ts_call_t *call = holder_take(&h, 1 + n + k);
        if (k == 0)
            assert_int_equal(ts_call_fail(call, TS_EPROTO, "a bad request, says the service"), 0);
        else
            assert_int_equal(ts_call_reply(call, ans), 0);
        assert_int_equal(pthread_join(th, NULL), 0);
        if (k == 0) {
            assert_int_equal(b.rc, TS_EPROTO);
            assert_string_equal(b.msg, "a bad request, says the service");
        } else {
            assert_int_equal(b.rc, 0);
            assert_int_equal(b.tag, 77);
        }
    }
    /* Not one reconnection, and no answer dropped as late. */
    assert_int_equal(ts_client_connected(cc), 1);
    assert_int_equal(tc_stat_int(sc, "connections_total"), conns);
    assert_int_equal(tc_stat_int(sc, "service_late_answers"), late);
    ts_value_free(ans);
    ts_value_free(req);
    ts_service_unregister(svc);
    ts_client_free(cc);
    ts_client_free(sc);
    tc_latch_destroy(&g.done);
}

/* Counts the outcomes of calls: done, and how many failed. */
typedef struct flow_tally {
    tc_latch done;
    atomic_int failed;
    atomic_int last_failure;
} flow_tally;

static void flow_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    (void)res;
    flow_tally *t = arg;
    if (status != 0) {
        atomic_fetch_add(&t->failed, 1);
        atomic_store(&t->last_failure, status);
    }
    tc_latch_add(&t->done, 1);
}

/*
 * One of two servers unregisters while calls keep coming: no call fails. The calls tensord
 * hands it before it has the unregistration are still its to answer (they were refused with
 * TS_ESERVICE), and the later ones go to the other server.
 */
static void test_unregister_while_calls_flow(void **state)
{
    (void)state;
    enum { ROUNDS = 6, CALLS = 600, WINDOW = 32 };
    ts_client_t *cc = open_client();
    ts_value_t *req = make_req(3);
    for (int round = 0; round < ROUNDS; round++) {
        ts_client_t *s1 = open_client(), *s2 = open_client();
        echo_server e1 = {.id = 1}, e2 = {.id = 2};
        tc_latch_init(&e1.served);
        tc_latch_init(&e2.served);
        ts_service_t *v1, *v2;
        assert_int_equal(ts_service_register(&v1, s1, "flow", NULL, echo_cb, &e1), 0);
        assert_int_equal(ts_service_register(&v2, s2, "flow", NULL, echo_cb, &e2), 0);
        static flow_tally t;
        tc_latch_init(&t.done);
        atomic_init(&t.failed, 0);
        atomic_init(&t.last_failure, 0);
        for (int i = 0; i < CALLS; i++) {
            /* At most WINDOW outstanding, so that calls are in flight all along. */
            assert_true(tc_latch_wait(&t.done, i - WINDOW + 1, LONG_MS) >= i - WINDOW + 1);
            assert_int_equal(ts_call_async(cc, "flow", req, LONG_MS, 0, TS_COPY, flow_cb, &t), 0);
            if (i == CALLS / 3)
                ts_service_unregister(v1);
        }
        assert_int_equal(tc_latch_wait(&t.done, CALLS, LONG_MS), CALLS);
        assert_int_equal(atomic_load(&t.failed), 0);
        assert_true(tc_latch_get(&e1.served) > 0 && tc_latch_get(&e2.served) > 0);
        ts_service_unregister(v2);
        ts_client_free(s1);
        ts_client_free(s2);
        tc_latch_destroy(&t.done);
        tc_latch_destroy(&e1.served);
        tc_latch_destroy(&e2.served);
    }
    ts_value_free(req);
    ts_client_free(cc);
}

/* Bad answers: tag 1 is answered NULL, tag 2 with a list nested 40 deep; others echoed. */
typedef struct bad_server {
    pthread_mutex_t mu;
    int rc[2];                         /* ts_call_reply's status for tags 1 and 2 */
    char why[2][TS_MAX_ERROR_LEN + 1]; /* and its message */
    tc_latch served;
} bad_server;

static void bad_cb(ts_service_t *svc, ts_call_t *call, ts_value_t *request, void *arg)
{
    (void)svc;
    bad_server *b = arg;
    int64_t tag = tc_tag(request);
    ts_value_free(request);
    ts_value_t *ans = NULL;
    if (tag == 2) {
        ans = ts_list_new();
        for (int i = 0; i < 39; i++) {
            ts_value_t *outer = ts_list_new();
            assert_int_equal(ts_list_push(outer, ans), 0);
            ans = outer;
        }
    } else if (tag != 1) {
        ans = make_req(tag);
    }
    int rc = ts_call_reply(call, ans);
    if (tag == 1 || tag == 2) {
        pthread_mutex_lock(&b->mu);
        b->rc[tag - 1] = rc;
        snprintf(b->why[tag - 1], sizeof(b->why[0]), "%s", ts_last_error());
        pthread_mutex_unlock(&b->mu);
    }
    ts_value_free(ans);
    tc_latch_add(&b->served, 1);
}

/*
 * An answer ts_call_reply cannot send (NULL, or nested too deep to encode) still answers the
 * call: its caller gets TS_ESERVER at once with the reason, the server gets the error back, and
 * the server's one place is free again, so the next call is answered.
 */
static void test_answer_that_cannot_be_sent(void **state)
{
    (void)state;
    ts_client_t *sc = open_client(), *cc = open_client();
    bad_server b;
    memset(&b, 0, sizeof(b));
    pthread_mutex_init(&b.mu, NULL);
    tc_latch_init(&b.served);
    ts_service_options_t o;
    ts_service_options_init(&o);
    o.concurrency = 1;
    ts_service_t *svc;
    assert_int_equal(ts_service_register(&svc, sc, "bad", &o, bad_cb, &b), 0);
    const char *want[2] = {
        "the service's answer could not be sent: no answer (NULL)",
        "the service's answer could not be sent: the answer cannot be encoded: nested deeper "
        "than 32 levels, or more than 4 GiB of keys, strings and shapes"};
    for (int tag = 1; tag <= 2; tag++) {
        ts_value_t *req = make_req(tag), *ans = NULL;
        uint64_t t0 = tc_now_ms();
        assert_int_equal(ts_call(cc, "bad", req, LONG_MS, 0, &ans), TS_ESERVER);
        assert_true(tc_now_ms() - t0 < GONE_MS);
        assert_string_equal(ts_last_error(), want[tag - 1]);
        assert_null(ans);
        pthread_mutex_lock(&b.mu);
        assert_int_equal(b.rc[tag - 1], TS_EINVAL);
        assert_string_equal(b.why[tag - 1], want[tag - 1] + strlen("the service's answer "
                                                                   "could not be sent: "));
        pthread_mutex_unlock(&b.mu);
        /* The place is free: the next call is answered (not held behind the first). */
        ts_value_free(req);
        req = make_req(7);
        assert_int_equal(ts_call(cc, "bad", req, LONG_MS, 0, &ans), 0);
        assert_int_equal(tc_tag(ans), 7);
        ts_value_free(ans);
        ts_value_free(req);
    }
    assert_int_equal(tc_latch_get(&b.served), 4);
    ts_service_unregister(svc);
    ts_client_free(cc);
    ts_client_free(sc);
    tc_latch_destroy(&b.served);
    pthread_mutex_destroy(&b.mu);
}

/*
 * A call's timeout is at most 24 hours, tensord's limit: a longer one is refused by the client
 * at once, and TS_TIMEOUT_DEFAULT of a client whose request timeout is longer calls with 24
 * hours (tensord refused the request timeout as it was).
 */
static void test_call_timeout_limit(void **state)
{
    (void)state;
    ts_client_options_t co;
    ts_client_options_init(&co);
    co.request_timeout_ms = 100000000; /* 27.8 hours */
    ts_client_t *sc = open_client(), *cc = NULL;
    assert_int_equal(ts_client_open(&cc, srv.addr, &co), 0);
    echo_server e = {.id = 1};
    tc_latch_init(&e.served);
    ts_service_t *svc;
    assert_int_equal(ts_service_register(&svc, sc, "day", NULL, echo_cb, &e), 0);
    ts_value_t *req = make_req(5), *ans = NULL;
    assert_int_equal(ts_call(cc, "day", req, TS_TIMEOUT_DEFAULT, 0, &ans), 0);
    assert_int_equal(tc_tag(ans), 1005);
    ts_value_free(ans);
    ans = NULL;
    assert_int_equal(ts_call(cc, "day", req, (int)TS_CALL_MAX_TIMEOUT_MS, 0, &ans), 0);
    ts_value_free(ans);
    ans = NULL;
    uint64_t t0 = tc_now_ms();
    assert_int_equal(ts_call(cc, "day", req, (int)TS_CALL_MAX_TIMEOUT_MS + 1, 0, &ans), TS_EINVAL);
    assert_string_equal(ts_last_error(), "timeout_ms 86400001: a call needs 1 to 86400000 "
                                         "milliseconds (24 hours) or TS_TIMEOUT_DEFAULT");
    assert_int_equal(ts_call_async(cc, "day", req, INT32_MAX, 0, TS_COPY, NULL, NULL), TS_EINVAL);
    assert_true(tc_now_ms() - t0 < 1000);
    assert_null(ans);
    assert_int_equal(tc_latch_get(&e.served), 2);
    ts_value_free(req);
    ts_service_unregister(svc);
    ts_client_free(cc);
    ts_client_free(sc);
    tc_latch_destroy(&e.served);
}

/*
 * A call ends within its timeout and 100 ms even when tensord does not answer (stopped), not
 * after the client's request timeout more; the client works again once tensord resumes.
 */
static void test_call_timeout_when_tensord_is_stopped(void **state)
{
    (void)state;
    ts_client_options_t co;
    ts_client_options_init(&co);
    co.request_timeout_ms = 5000;
    ts_client_t *cc = NULL;
    assert_int_equal(ts_client_open(&cc, srv.addr, &co), 0);
    ts_value_t *req = make_req(3), *ans = NULL;
    assert_int_equal(kill(srv.pid, SIGSTOP), 0);
    uint64_t t0 = tc_now_ms();
    int rc = ts_call(cc, "stopped", req, 300, 0, &ans);
    uint64_t el = tc_now_ms() - t0;
    assert_int_equal(kill(srv.pid, SIGCONT), 0);
    assert_int_equal(rc, TS_ETIMEDOUT);
    assert_null(ans);
    assert_true(el >= 250 && el < 2000);
    /* Resumed: tensord's late answer (nobody serves "stopped") is dropped; the client goes on. */
    assert_int_equal(ts_ping(cc), 0);
    assert_int_equal(ts_call(cc, "stopped", req, 300, 0, &ans), TS_ENOENT);
    ts_value_free(req);
    ts_client_free(cc);
}

/* Bad input as raw frames: a clear error, nothing registered or called. */
static void test_bad_input(void **state)
{
    (void)state;
    int fd = tsh_connect_tcp(srv.port);
    assert_true(fd >= 0);
    assert_int_equal(tsh_hello(fd), 0);
    uint8_t body[512];
    size_t n;
    ts__hdr h;
    uint8_t *rb;
    size_t rl;
    /* REGISTER: concurrency over the limit, flags, an empty name. */
    ts__msg_svc_register_req r = {.name = (const uint8_t *)"x", .name_len = 1};
    const uint32_t concs[] = {TS_SVC_MAX_CONCURRENCY + 1, 1, 1};
    const uint32_t flags[] = {0, 2, 0};
    for (int i = 0; i < 3; i++) {
        r.concurrency = concs[i];
        r.flags = flags[i];
        r.name_len = i == 2 ? 0 : 1;
        assert_int_equal(ts__msg_svc_register_req_encode(body, sizeof(body), &r, &n), 0);
        assert_int_equal(tsh_send(fd, TS_OP_SVC_REGISTER, 10 + (uint32_t)i, body, n), 0);
        assert_int_equal(tsh_recv(fd, &h, &rb, &rl), 0);
        assert_int_equal(h.request_id, 10 + (uint32_t)i);
        assert_int_equal(h.status, TS_ST_INVALID);
        free(rb);
    }
    /* Unregistering what this connection does not serve. */
    r.concurrency = 0;
    r.flags = 0;
    r.name_len = 1;
    assert_int_equal(ts__msg_svc_register_req_encode(body, sizeof(body), &r, &n), 0);
    assert_int_equal(tsh_send(fd, TS_OP_SVC_REGISTER, 20, body, n), 0);
    assert_int_equal(tsh_recv(fd, &h, &rb, &rl), 0);
    assert_int_equal(h.status, TS_ST_NOT_FOUND);
    free(rb);
    /* CALL with timeout 0, and with unknown flags. */
    ts_value_t *v = make_req(1);
    uint8_t *rec;
    size_t rec_len;
    assert_int_equal(ts__record_encode(v, &rec, &rec_len), 0);
    ts_value_free(v);
    const uint32_t touts[] = {0, 1000};
    const uint32_t cflags[] = {0, 0x80};
    for (int i = 0; i < 2; i++) {
        uint8_t fixed[TS_MSG_SVC_CALL_FIXED];
        ts__msg_svc_call_fixed f = {.timeout_ms = touts[i], .flags = cflags[i]};
        ts__msg_svc_call_fixed_encode(fixed, &f);
        uint8_t *up = malloc(rec_len + 300);
        assert_int_equal(ts__msg_upload_encode(up, rec_len + 300, (const uint8_t *)"x", 1, fixed,
                                               sizeof(fixed), rec, rec_len, &n),
                         0);
        assert_int_equal(tsh_send(fd, TS_OP_SVC_CALL, 30 + (uint32_t)i, up, n), 0);
        free(up);
        assert_int_equal(tsh_recv(fd, &h, &rb, &rl), 0);
        assert_int_equal(h.request_id, 30 + (uint32_t)i);
        assert_int_equal(h.status, TS_ST_INVALID);
        free(rb);
    }
    /*
     * REPLY for a call nobody handed us, with a status no service may send, and with a reserved
     * field set (status 0 or an error): each message names only what is wrong.
     */
    const uint16_t sts[] = {TS_ST_OK, TS_ST_WRONG_SHARD, TS_ST_OK, TS_ST_INVALID};
    const uint16_t res16[] = {0, 0, 1, 0};
    const uint32_t res32[] = {0, 0, 0, 7};
    const uint16_t want[] = {TS_ST_NOT_FOUND, TS_ST_INVALID, TS_ST_INVALID, TS_ST_INVALID};
    char wrong_status[64];
    snprintf(wrong_status, sizeof(wrong_status),
             "SVC_REPLY: status %u is not one a service may answer with",
             (unsigned)TS_ST_WRONG_SHARD);
    const char *want_msg[] = {
        "SVC_REPLY: call 12345 is not awaiting an answer from this connection", wrong_status,
        "SVC_REPLY: the reserved fields must be 0 (got 1 and 0)",
        "SVC_REPLY: the reserved fields must be 0 (got 0 and 7)"};
    for (int i = 0; i < 4; i++) {
        uint8_t fixed[TS_MSG_SVC_REPLY_FIXED];
        ts__msg_svc_reply_fixed f = {
            .call_id = 12345, .status = sts[i], .reserved16 = res16[i], .reserved32 = res32[i]};
        ts__msg_svc_reply_fixed_encode(fixed, &f);
        uint8_t *up = malloc(rec_len + 300);
        assert_int_equal(ts__msg_upload_encode(up, rec_len + 300, (const uint8_t *)"x", 1, fixed,
                                               sizeof(fixed), rec, rec_len, &n),
                         0);
        assert_int_equal(tsh_send(fd, TS_OP_SVC_REPLY, 40 + (uint32_t)i, up, n), 0);
        free(up);
        assert_int_equal(tsh_recv(fd, &h, &rb, &rl), 0);
        assert_int_equal(h.request_id, 40 + (uint32_t)i);
        assert_int_equal(h.status, want[i]);
        assert_int_equal(rl, strlen(want_msg[i]));
        assert_memory_equal(rb, want_msg[i], rl);
        free(rb);
    }
    /* An error REPLY whose message is longer than an error message: BAD_REQUEST and closed. */
    {
        uint8_t fixed[TS_MSG_SVC_REPLY_FIXED];
        ts__msg_svc_reply_fixed f = {.call_id = 1, .status = TS_ST_INVALID};
        ts__msg_svc_reply_fixed_encode(fixed, &f);
        size_t ml = TS_MAX_ERRMSG + 1;
        uint8_t *msg = calloc(1, ml);
        memset(msg, 'm', ml);
        uint8_t *up = malloc(ml + 300);
        assert_int_equal(ts__msg_upload_encode(up, ml + 300, (const uint8_t *)"x", 1, fixed,
                                               sizeof(fixed), msg, ml, &n),
                         0);
        assert_int_equal(tsh_send(fd, TS_OP_SVC_REPLY, 50, up, n), 0);
        free(up);
        free(msg);
        assert_int_equal(tsh_recv(fd, &h, &rb, &rl), 0);
        assert_int_equal(h.request_id, 50);
        assert_int_equal(h.status, TS_ST_BAD_REQUEST);
        free(rb);
        assert_int_equal(tsh_wait_closed(fd, 5000), 1);
    }
    ts__free_aligned(rec, rec_len);
    close(fd);
    /* Nothing was registered: the service "x" has no server. */
    ts_client_t *cc = open_client();
    ts_value_t *req = make_req(1), *ans = NULL;
    assert_int_equal(ts_call(cc, "x", req, 1000, 0, &ans), TS_ENOENT);
    /* The client refuses what the server would. */
    assert_int_equal(ts_call(cc, "", req, 1000, 0, &ans), TS_EINVAL);
    assert_int_equal(ts_call(cc, "x", req, 0, 0, &ans), TS_EINVAL);
    ts_value_free(req);
    ts_service_t *svc;
    ts_service_options_t o;
    ts_service_options_init(&o);
    o.concurrency = 0;
    assert_int_equal(ts_service_register(&svc, cc, "x", &o, echo_cb, NULL), TS_EINVAL);
    ts_client_free(cc);
}

/*
 * tensord restarts: a call in flight fails with the connection, and the server's client
 * registers again by itself once it has reconnected, so a later call is answered.
 */
static void test_register_again_after_restart(void **state)
{
    (void)state;
    /* A fresh tensord, so that the call held across the restart is the first of its run. */
    tsh_server_kill(&srv);
    assert_int_equal(tsh_server_restart(&srv, NULL), 0);
    ts_client_t *sc = open_client(), *cc = open_client();
    holder h;
    holder_init(&h);
    ts_service_t *svc;
    assert_int_equal(ts_service_register(&svc, sc, "phoenix", NULL, hold_cb, &h), 0);
    gone_arg g = {.status = 1};
    tc_latch_init(&g.done);
    ts_value_t *req = make_req(11), *ans = NULL;
    assert_int_equal(ts_call_async(cc, "phoenix", req, LONG_MS, 0, TS_COPY, gone_cb, &g), 0);
    assert_int_equal(tc_latch_wait(&h.got, 1, LONG_MS), 1);
    tsh_server_kill(&srv);
    assert_int_equal(tsh_server_restart(&srv, NULL), 0);
    assert_int_equal(tc_latch_wait(&g.done, 1, LONG_MS), 1);
    assert_true(g.status != 0);
    /* Once the server's client is back, calls reach it again (the caller waits for it). */
    gone_arg g2 = {.status = 1};
    tc_latch_init(&g2.done);
    assert_int_equal(
        ts_call_async(cc, "phoenix", req, LONG_MS, TS_CALL_WAIT, TS_COPY, gone_cb, &g2), 0);
    assert_int_equal(tc_latch_wait(&h.got, 2, LONG_MS), 2);
    assert_int_equal(holder_tag(&h, 1), 11);
    /* The call held across the restart cannot be answered any more: its answer goes nowhere,
     * in particular not to the new call (the first of the new tensord, as the old one was). */
    ts_value_t *stale = make_req(999);
    assert_int_equal(ts_call_reply(holder_take(&h, 0), stale), 0);
    ts_value_free(stale);
    tc_sleep_ms(300);
    assert_int_equal(tc_latch_get(&g2.done), 0);
    assert_int_equal(ts_call_reply(holder_take(&h, 1), req), 0);
    assert_int_equal(tc_latch_wait(&g2.done, 1, LONG_MS), 1);
    assert_int_equal(g2.status, 0);
    assert_int_equal(g2.tag, 11);
    (void)ans;
    ts_value_free(req);
    ts_service_unregister(svc);
    ts_client_free(cc);
    ts_client_free(sc);
    tc_latch_destroy(&g.done);
    tc_latch_destroy(&g2.done);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_echo_many),
        cmocka_unit_test(test_load_sharing),
        cmocka_unit_test(test_server_killed),
        cmocka_unit_test(test_wait_for_server),
        cmocka_unit_test(test_timeout_and_errors),
        cmocka_unit_test(test_answer_after_client_free),
        cmocka_unit_test(test_erred_server),
        cmocka_unit_test(test_relayed_status),
        cmocka_unit_test(test_unregister_while_calls_flow),
        cmocka_unit_test(test_answer_that_cannot_be_sent),
        cmocka_unit_test(test_call_timeout_limit),
        cmocka_unit_test(test_call_timeout_when_tensord_is_stopped),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_register_again_after_restart),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
