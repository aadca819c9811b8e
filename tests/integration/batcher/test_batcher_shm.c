/*
 * The batcher's same-host slots (ts_batcher_serve_shm) against a real tensord: requesters in
 * other processes answered through the slots; a requester killed mid-request whose slot the
 * next one takes over while the server goes on; a server killed mid-request (its requester
 * fails at once with TS_ECONNRESET, then calls the service); a server that stops cleanly
 * (requesters call the service of the next server); inputs larger than the request area sent
 * through the service, answers larger than the answer area refused; the forced transports.
 *
 * Children are forked before the process starts any thread (the batcher's, a client's) and wait
 * on a pipe; every wait is bounded and every child is reaped or killed by its pid.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"
#include "batcher_test_util.h"
#include "harness.h"
#include "tensorshare/batcher.h"

/* ms; the most any child or step of these tests is waited for */
#define WAIT_MS 20000

/* The model is the shared toy model without an offset: {y = 2 x}, slowed down by tb_delay_us. */
#define DELAY_US 2000 /* us; every batcher's max_delay_us */

/* A batcher of the toy model on two CPU replicas, or NULL (children call it too: no asserts). */
static ts_batcher_t *new_batcher(int max_batch)
{
    return tb_new_batcher(max_batch, DELAY_US, "cpu:2");
}

/* One prediction of rows rows; 1 when it was answered right. */
static int predict_ok(ts_predictor_t *p, int64_t rows, int64_t base, int timeout_ms)
{
    ts_value_t *in = tb_request_try(rows, base), *out = NULL;
    int rc = ts_predictor_predict(p, in, timeout_ms, &out, NULL);
    int ok = rc == 0 && tb_check(out, rows, base, 2.0f);
    if (!ok)
        fprintf(stderr, "predict %lld rows: %s (%s)\n", (long long)rows, ts_err_name(rc),
                ts_last_error());
    ts_value_free(out);
    ts_value_free(in);
    return ok;
}

/* ---------------------------------------------------------------------------------------------
 * Child processes: each waits for a byte on its pipe, runs, and exits with 0 on success.
 */
typedef struct child {
    pid_t pid;
    int to;   /* parent -> child */
    int from; /* child -> parent */
} child;

typedef int (*child_fn)(const char *addr, int index, int in, int out);

static int spawn(child *c, child_fn fn, const char *addr, int index)
{
    int down[2], up[2];
    if (pipe(down) != 0 || pipe(up) != 0)
        return -1;
    fflush(NULL);
    c->pid = fork();
    if (c->pid < 0)
        return -1;
    if (c->pid == 0) {
        close(down[1]);
        close(up[0]);
        _exit(fn(addr, index, down[0], up[1]));
    }
    close(down[0]);
    close(up[1]);
    c->to = down[1];
    c->from = up[0];
    return 0;
}

static void put_byte(int fd, char b)
{
    while (write(fd, &b, 1) < 0 && errno == EINTR) {
    }
}

/* A byte from fd within ms, or 0 (timeout, end of file). */
static char get_byte(int fd, int ms)
{
    struct pollfd pf = {fd, POLLIN, 0};
    char b = 0;
    if (poll(&pf, 1, ms) == 1 && read(fd, &b, 1) == 1)
        return b;
    return 0;
}

/* Wait for the child (at most WAIT_MS, then kill it): its exit code, or -1. */
static int reap(child *c)
{
    int status = 0;
    for (uint64_t until = tb_now_ms() + WAIT_MS; tb_now_ms() < until;) {
        pid_t r = waitpid(c->pid, &status, WNOHANG);
        if (r == c->pid) {
            close(c->to);
            close(c->from);
            return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        }
        tb_sleep_us(5000);
    }
    kill(c->pid, SIGKILL);
    waitpid(c->pid, &status, 0);
    close(c->to);
    close(c->from);
    return -1;
}

/* Open a client and a predictor in a child: 0, or an exit code. */
static int child_open(const char *addr, int transport, ts_client_t **c, ts_predictor_t **p)
{
    if (ts_client_open(c, addr, NULL) != 0)
        return 10;
    ts_predictor_options_t po;
    ts_predictor_options_init(&po);
    po.transport = transport;
    int rc = ts_predictor_open_with(p, *c, "policy", &po);
    if (rc != 0) {
        fprintf(stderr, "open: %s (%s)\n", ts_err_name(rc), ts_last_error());
        return 11;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Requesters in several processes
 */
enum { PROC_REQUESTS = 40 };

static int requester_main(const char *addr, int index, int in, int out)
{
    (void)out;
    if (get_byte(in, WAIT_MS) != 'g')
        return 2;
    ts_client_t *c = NULL;
    ts_predictor_t *p = NULL;
    int rc = child_open(addr, TS_PREDICTOR_AUTO, &c, &p);
    ts_predictor_stats_t st;
    if (rc == 0) {
        ts_predictor_stats(p, &st);
        if (st.transport != TS_PREDICTOR_SHM)
            rc = 12;
    }
    for (int i = 0; rc == 0 && i < PROC_REQUESTS; i++)
        if (!predict_ok(p, 1 + (index + i) % 4, index * 10000 + i * 10, WAIT_MS))
            rc = 13;
    if (rc == 0) {
        ts_predictor_stats(p, &st);
        if (st.shm != PROC_REQUESTS || st.relayed != 0 || st.service != 0)
            rc = 14;
    }
    ts_predictor_free(p);
    ts_client_free(c);
    return rc;
}

static void test_shm_processes(void **state)
{
    (void)state;
    tsh_server srv;
    assert_int_equal(tsh_server_start(&srv, NULL), 0);
    enum { N = 4 };
    child k[N];
    for (int i = 0; i < N; i++)
        assert_int_equal(spawn(&k[i], requester_main, srv.addr, i), 0);
    ts_client_t *sc = NULL;
    assert_int_equal(ts_client_open(&sc, srv.addr, NULL), 0);
    ts_batcher_t *b = new_batcher(32);
    assert_non_null(b);
    assert_int_equal(ts_batcher_serve(b, sc, "policy"), 0);
    assert_int_equal(ts_batcher_serve_shm(b, sc, "policy", NULL), 0);
    /* One name offers slots once. */
    assert_int_equal(ts_batcher_serve_shm(b, sc, "policy", NULL), TS_EINVAL);
    for (int i = 0; i < N; i++)
        put_byte(k[i].to, 'g');
    for (int i = 0; i < N; i++)
        assert_int_equal(reap(&k[i]), 0);
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    assert_int_equal(st.requests, N * PROC_REQUESTS);
    ts_batcher_free(b);
    /* Stopping withdrew the descriptor. */
    ts_items_t *items = NULL;
    assert_int_equal(ts_peek(sc, "policy/shm", 0, &items), TS_ENOENT);
    ts_client_free(sc);
    assert_int_equal(tsh_server_stop(&srv), 0);
    tsh_server_cleanup(&srv);
}

/* ---------------------------------------------------------------------------------------------
 * A requester killed mid-request
 */
static int victim_main(const char *addr, int index, int in, int out)
{
    (void)index;
    ts_client_t *c = NULL;
    ts_predictor_t *p = NULL;
    if (get_byte(in, WAIT_MS) != 'g')
        return 2;
    int rc = child_open(addr, TS_PREDICTOR_SHM, &c, &p);
    if (rc != 0)
        return rc;
    put_byte(out, 'r');
    if (get_byte(in, WAIT_MS) != 'g')
        return 3;
    predict_ok(p, 2, 0, WAIT_MS); /* killed while it waits */
    return 4;
}

static int reuser_main(const char *addr, int index, int in, int out)
{
    (void)index;
    (void)out;
    if (get_byte(in, WAIT_MS) != 'g')
        return 2;
    ts_client_t *c = NULL;
    ts_predictor_t *p = NULL;
    /* The only slot was the victim's: SHM succeeds only by taking it over. */
    int rc = child_open(addr, TS_PREDICTOR_SHM, &c, &p);
    ts_predictor_stats_t st;
    if (rc == 0) {
        ts_predictor_stats(p, &st);
        if (st.reclaimed != 1)
            rc = 12;
    }
    for (int i = 0; rc == 0 && i < 20; i++)
        if (!predict_ok(p, 1 + i % 3, 500 + i, WAIT_MS))
            rc = 13;
    if (rc == 0) {
        ts_predictor_stats(p, &st);
        if (st.shm != 20 || st.relayed != 0 || st.service != 0)
            rc = 14;
    }
    ts_predictor_free(p);
    ts_client_free(c);
    return rc;
}

static void test_shm_requester_killed(void **state)
{
    (void)state;
    tsh_server srv;
    assert_int_equal(tsh_server_start(&srv, NULL), 0);
    child victim, reuser;
    assert_int_equal(spawn(&victim, victim_main, srv.addr, 0), 0);
    assert_int_equal(spawn(&reuser, reuser_main, srv.addr, 1), 0);
    ts_client_t *sc = NULL;
    assert_int_equal(ts_client_open(&sc, srv.addr, NULL), 0);
    ts_batcher_t *b = new_batcher(32);
    assert_non_null(b);
    ts_batcher_shm_options_t so;
    ts_batcher_shm_options_init(&so);
    so.slots = 1;
    assert_int_equal(ts_batcher_serve(b, sc, "policy"), 0);
    assert_int_equal(ts_batcher_serve_shm(b, sc, "policy", &so), 0);
    put_byte(victim.to, 'g');
    assert_int_equal(get_byte(victim.from, WAIT_MS), 'r');
    /* Its request will sit in a slow forward when it dies. */
    atomic_store(&tb_delay_us, 300000);
    put_byte(victim.to, 'g');
    ts_batcher_stats_t st;
    uint64_t until = tb_now_ms() + WAIT_MS;
    do {
        tb_sleep_us(2000);
        ts_batcher_stats(b, &st);
    } while (st.submitted < 1 && tb_now_ms() < until);
    assert_int_equal(st.submitted, 1);
    kill(victim.pid, SIGKILL);
    assert_int_equal(reap(&victim), -1);
    atomic_store(&tb_delay_us, 0);
    put_byte(reuser.to, 'g');
    assert_int_equal(reap(&reuser), 0);
    ts_batcher_stats(b, &st);
    assert_int_equal(st.requests, 21); /* the victim's too, answered into the slot */
    ts_batcher_free(b);
    ts_client_free(sc);
    assert_int_equal(tsh_server_stop(&srv), 0);
    tsh_server_cleanup(&srv);
}

/* ---------------------------------------------------------------------------------------------
 * A server killed mid-request, and one that stops cleanly
 */
static int server_main(const char *addr, int index, int in, int out)
{
    (void)index;
    ts_client_t *sc = NULL;
    if (ts_client_open(&sc, addr, NULL) != 0)
        return 10;
    atomic_store(&tb_delay_us, 5000000); /* every forward outlives the test's kill */
    ts_batcher_t *b = new_batcher(32);
    if (b == NULL || ts_batcher_serve(b, sc, "policy") != 0 ||
        ts_batcher_serve_shm(b, sc, "policy", NULL) != 0)
        return 11;
    put_byte(out, 'r');
    get_byte(in, WAIT_MS); /* killed meanwhile */
    return 12;
}

typedef struct killer {
    pid_t pid;
    int after_ms;
} killer;

static void *killer_main(void *arg)
{
    killer *k = arg;
    tb_sleep_us((long)k->after_ms * 1000);
    kill(k->pid, SIGKILL);
    return NULL;
}

static void test_shm_server_killed(void **state)
{
    (void)state;
    tsh_server srv;
    assert_int_equal(tsh_server_start(&srv, NULL), 0);
    child server;
    assert_int_equal(spawn(&server, server_main, srv.addr, 0), 0);
    assert_int_equal(get_byte(server.from, WAIT_MS), 'r');
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, srv.addr, NULL), 0);
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, c, "policy"), 0);
    ts_predictor_stats_t st;
    ts_predictor_stats(p, &st);
    assert_int_equal(st.transport, TS_PREDICTOR_SHM);
    killer k = {server.pid, 300};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, killer_main, &k), 0);
    enum { TIMEOUT_MS = 10000 };
    uint64_t t0 = tb_now_ms();
    ts_value_t *in = tb_request_try(1, 0), *out = NULL;
    int rc = ts_predictor_predict(p, in, TIMEOUT_MS, &out, NULL);
    uint64_t took = tb_now_ms() - t0;
    pthread_join(th, NULL);
    assert_int_equal(rc, TS_ECONNRESET);
    assert_non_null(strstr(ts_last_error(), "died"));
    assert_true(took < TIMEOUT_MS);
    /*
     * From now on the service, which nobody serves: the request's own deadline, or TS_ESERVICE
     * when tensord handed the call to the dead server before it saw its connection close.
     */
    ts_predictor_stats(p, &st);
    assert_int_equal(st.transport, TS_PREDICTOR_SERVICE);
    rc = ts_predictor_predict(p, in, 300, &out, NULL);
    assert_true(rc == TS_ETIMEDOUT || rc == TS_ESERVICE);
    ts_predictor_stats(p, &st);
    assert_int_equal(st.shm, 1);
    assert_int_equal(st.service, 1);
    assert_int_equal(st.relayed, 0);
    ts_value_free(in);
    assert_int_equal(reap(&server), -1);
    /* Its descriptor and object are left behind: a new predictor sees the server is gone. */
    ts_predictor_t *p2 = NULL;
    assert_int_equal(ts_predictor_open(&p2, c, "policy"), 0);
    ts_predictor_stats(p2, &st);
    assert_int_equal(st.transport, TS_PREDICTOR_SERVICE);
    ts_predictor_free(p2);
    /* A killed server leaves its object's name behind: remove it by the descriptor's path. */
    ts_items_t *items = NULL;
    assert_int_equal(ts_peek(c, "policy/shm", 0, &items), 0);
    const char *path = NULL;
    size_t len = 0;
    assert_int_equal(ts_value_string(ts_map_get(ts_items_at(items, 0), "path"), &path, &len), 0);
    assert_int_equal(shm_unlink(path), 0);
    ts_items_free(items);
    ts_predictor_free(p);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&srv), 0);
    tsh_server_cleanup(&srv);
}

static int stopper_main(const char *addr, int index, int in, int out)
{
    (void)index;
    if (get_byte(in, WAIT_MS) != 'g')
        return 2;
    ts_client_t *c = NULL;
    ts_predictor_t *p = NULL;
    int rc = child_open(addr, TS_PREDICTOR_AUTO, &c, &p);
    for (int i = 0; rc == 0 && i < 5; i++)
        if (!predict_ok(p, 1, i, WAIT_MS))
            rc = 13;
    put_byte(out, 's');
    if (rc == 0 && get_byte(in, WAIT_MS) != 'g')
        rc = 3;
    for (int i = 0; rc == 0 && i < 5; i++)
        if (!predict_ok(p, 2, 100 + i, WAIT_MS))
            rc = 15;
    ts_predictor_stats_t st;
    if (rc == 0) {
        ts_predictor_stats(p, &st);
        if (st.shm != 5 || st.service != 5 || st.relayed != 0 ||
            st.transport != TS_PREDICTOR_SERVICE)
            rc = 14;
    }
    ts_predictor_free(p);
    ts_client_free(c);
    return rc;
}

static void test_shm_server_stops(void **state)
{
    (void)state;
    tsh_server srv;
    assert_int_equal(tsh_server_start(&srv, NULL), 0);
    child q;
    assert_int_equal(spawn(&q, stopper_main, srv.addr, 0), 0);
    ts_client_t *sc = NULL;
    assert_int_equal(ts_client_open(&sc, srv.addr, NULL), 0);
    ts_batcher_t *b = new_batcher(32);
    assert_non_null(b);
    assert_int_equal(ts_batcher_serve(b, sc, "policy"), 0);
    assert_int_equal(ts_batcher_serve_shm(b, sc, "policy", NULL), 0);
    put_byte(q.to, 'g');
    assert_int_equal(get_byte(q.from, WAIT_MS), 's');
    ts_batcher_free(b);
    /* The next server offers no slots: the requester calls its service. */
    b = new_batcher(32);
    assert_non_null(b);
    assert_int_equal(ts_batcher_serve(b, sc, "policy"), 0);
    put_byte(q.to, 'g');
    assert_int_equal(reap(&q), 0);
    ts_batcher_free(b);
    ts_client_free(sc);
    assert_int_equal(tsh_server_stop(&srv), 0);
    tsh_server_cleanup(&srv);
}

/* ---------------------------------------------------------------------------------------------
 * The batcher freed while requests of the slots are in a forward and queued
 */
static int one_request_main(const char *addr, int index, int in, int out)
{
    (void)out;
    if (get_byte(in, WAIT_MS) != 'g')
        return 2;
    ts_client_t *c = NULL;
    ts_predictor_t *p = NULL;
    int rc = child_open(addr, TS_PREDICTOR_SHM, &c, &p);
    if (rc != 0)
        return rc;
    ts_value_t *x = tb_request_try(1, index * 10), *y = NULL;
    rc = ts_predictor_predict(p, x, WAIT_MS, &y, NULL);
    int code = rc == 0 && tb_check(y, 1, index * 10, 2.0f) ? 0 : rc == TS_ECANCELED ? 20 : 30;
    if (code == 30)
        fprintf(stderr, "child %d: %s (%s)\n", index, ts_err_name(rc), ts_last_error());
    ts_value_free(y);
    ts_value_free(x);
    ts_predictor_free(p);
    ts_client_free(c);
    return code;
}

static void test_shm_free_while_in_flight(void **state)
{
    (void)state;
    tsh_server srv;
    assert_int_equal(tsh_server_start(&srv, NULL), 0);
    child k[2];
    for (int i = 0; i < 2; i++)
        assert_int_equal(spawn(&k[i], one_request_main, srv.addr, i), 0);
    ts_client_t *sc = NULL;
    assert_int_equal(ts_client_open(&sc, srv.addr, NULL), 0);
    ts_batcher_t *b = tb_new_batcher(32, DELAY_US, "cpu:1");
    assert_non_null(b);
    assert_int_equal(ts_batcher_serve(b, sc, "policy"), 0);
    assert_int_equal(ts_batcher_serve_shm(b, sc, "policy", NULL), 0);
    /* The first request sits in a slow forward, the second waits in the queue behind it. */
    atomic_store(&tb_delay_us, 300000);
    put_byte(k[0].to, 'g');
    ts_batcher_stats_t st;
    uint64_t until = tb_now_ms() + WAIT_MS;
    do {
        tb_sleep_us(2000);
        ts_batcher_stats(b, &st);
    } while (st.batches == 0 && st.submitted < 1 && tb_now_ms() < until);
    tb_sleep_us(20000); /* the replica takes it into its forward */
    put_byte(k[1].to, 'g');
    do {
        tb_sleep_us(2000);
        ts_batcher_stats(b, &st);
    } while (st.submitted < 2 && tb_now_ms() < until);
    assert_int_equal(st.submitted, 2);
    /* The slots close and their region stays mapped until both answers are written. */
    ts_batcher_free(b);
    atomic_store(&tb_delay_us, 0);
    assert_int_equal(reap(&k[0]), 0);
    assert_int_equal(reap(&k[1]), 20);
    ts_client_free(sc);
    assert_int_equal(tsh_server_stop(&srv), 0);
    tsh_server_cleanup(&srv);
}

/* ---------------------------------------------------------------------------------------------
 * Sizes and transports (requester and server in this process: the same host too)
 */
static void test_shm_sizes_and_transports(void **state)
{
    (void)state;
    tb_world w;
    tb_world_open(&w);
    ts_predictor_t *p = NULL;
    ts_predictor_options_t po;
    ts_predictor_options_init(&po);
    po.transport = TS_PREDICTOR_SHM;
    /* Nobody offers slots yet. */
    assert_int_equal(ts_predictor_open_with(&p, w.c, "policy", &po), TS_ENOTSUP);
    ts_batcher_t *b = new_batcher(2048);
    assert_non_null(b);
    ts_batcher_shm_options_t so;
    ts_batcher_shm_options_init(&so);
    so.request_bytes = 5000; /* rounded up to 8192: about 600 rows of x */
    so.answer_bytes = 4096;  /* about 300 rows of y */
    assert_int_equal(ts_batcher_serve(b, w.sc, "policy"), 0);
    assert_int_equal(ts_batcher_serve_shm(b, w.sc, "policy", &so), 0);
    /* The descriptor gives the areas' sizes, rounded up to pages as batcher.h says. */
    ts_items_t *desc = NULL;
    assert_int_equal(ts_peek(w.c, "policy/shm", 1, &desc), 0);
    int64_t req_bytes = 0, ans_bytes = 0;
    assert_int_equal(ts_map_get_int(ts_items_at(desc, 0), "request_bytes", &req_bytes), 0);
    assert_int_equal(ts_map_get_int(ts_items_at(desc, 0), "answer_bytes", &ans_bytes), 0);
    assert_int_equal(req_bytes, 8192);
    assert_int_equal(ans_bytes, 4096);
    ts_items_free(desc);
    assert_int_equal(ts_predictor_open(&p, w.c, "policy"), 0);
    ts_predictor_stats_t st;
    assert_true(predict_ok(p, 1, 7, WAIT_MS));
    assert_true(predict_ok(p, 1000, 0, WAIT_MS)); /* 12 000 bytes: through the service */
    ts_predictor_stats(p, &st);
    assert_int_equal(st.shm, 1);
    assert_int_equal(st.service, 1);
    assert_int_equal(st.relayed, 0);
    assert_int_equal(st.oversize, 1);
    assert_int_equal(st.transport, TS_PREDICTOR_SHM);
    /* Fits the request area, not the answer area: refused with a clear error. */
    ts_value_t *in = tb_request_try(400, 0), *out = NULL;
    assert_int_equal(ts_predictor_predict(p, in, WAIT_MS, &out, NULL), TS_EMSGSIZE);
    assert_non_null(strstr(ts_last_error(), "answer area"));
    ts_value_free(in);
    /* A schema error comes back through the slot as through the relay. */
    in = ts_map_new();
    ts_map_set(in, "z", ts_int_new(1));
    assert_int_equal(ts_predictor_predict(p, in, WAIT_MS, &out, NULL), TS_ESCHEMA);
    ts_value_free(in);
    assert_true(predict_ok(p, 3, 70, WAIT_MS)); /* the slot still works */
    ts_predictor_free(p);
    /* Forced relay. */
    po.transport = TS_PREDICTOR_RELAY;
    assert_int_equal(ts_predictor_open_with(&p, w.c, "policy", &po), 0);
    assert_true(predict_ok(p, 2, 9, WAIT_MS));
    ts_predictor_stats(p, &st);
    assert_int_equal(st.shm, 0);
    assert_int_equal(st.relayed, 1);
    assert_int_equal(st.transport, TS_PREDICTOR_RELAY);
    ts_predictor_free(p);
    po.transport = 7;
    assert_int_equal(ts_predictor_open_with(&p, w.c, "policy", &po), TS_EINVAL);
    ts_batcher_free(b);
    tb_world_close(&w);
}

/* ---------------------------------------------------------------------------------------------
 * A requester looks for its answer before sleeping, and backs off after misses (shmq.c,
 * TS__SHM_WAIT_SPIN_NS and TS__SHM_WAIT_SPIN_BACKOFF): quick answers (caught by the look), slow
 * ones (the look misses, the requester sleeps and is woken), then quick ones again (answered
 * while the requester sleeps without looking, until a look catches one). Every answer comes
 * through the slot and is right; a deadline shorter than the forward still ends the wait.
 */
#define LOOK_QUICK 40   /* requests answered at once */
#define LOOK_SLOW  10   /* requests whose forward takes SLOW_US */
#define SLOW_US    3000 /* us; far longer than the 100 us look */

static void test_shm_look_then_sleep(void **state)
{
    (void)state;
    tb_world w;
    tb_world_open(&w);
    ts_batcher_t *b = new_batcher(64);
    assert_non_null(b);
    assert_int_equal(ts_batcher_serve(b, w.sc, "policy"), 0);
    assert_int_equal(ts_batcher_serve_shm(b, w.sc, "policy", NULL), 0);
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, w.c, "policy"), 0);
    int n = 0;
    for (int i = 0; i < LOOK_QUICK; i++, n++)
        assert_true(predict_ok(p, 1, n, WAIT_MS));
    atomic_store(&tb_delay_us, SLOW_US);
    for (int i = 0; i < LOOK_SLOW; i++, n++)
        assert_true(predict_ok(p, 1, n, WAIT_MS));
    /* A 1 ms deadline against a 50 ms forward: the look and the sleep both end by it. */
    atomic_store(&tb_delay_us, 50000);
    ts_value_t *in = tb_request_try(1, 0), *out = NULL;
    assert_int_equal(ts_predictor_predict(p, in, 1, &out, NULL), TS_ETIMEDOUT);
    ts_value_free(in);
    atomic_store(&tb_delay_us, 0);
    /* The late answer of the timed-out request lands in the slot and is not taken for a new one. */
    for (int i = 0; i < 2 * LOOK_QUICK + 64; i++, n++)
        assert_true(predict_ok(p, 1, n, WAIT_MS));
    ts_predictor_stats_t st;
    ts_predictor_stats(p, &st);
    assert_int_equal(st.shm, n + 1);
    assert_int_equal(st.relayed, 0);
    assert_int_equal(st.service, 0);
    ts_predictor_free(p);
    ts_batcher_free(b);
    tb_world_close(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shm_processes),
        cmocka_unit_test(test_shm_requester_killed),
        cmocka_unit_test(test_shm_server_killed),
        cmocka_unit_test(test_shm_server_stops),
        cmocka_unit_test(test_shm_free_while_in_flight),
        cmocka_unit_test(test_shm_sizes_and_transports),
        cmocka_unit_test(test_shm_look_then_sleep),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
