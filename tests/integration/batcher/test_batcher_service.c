/*
 * Remote predictions through the service NAME against a real tensord: answers equal to the
 * in-process ones (TS_PREDICTOR_SERVICE and AUTO), the answer record a plain ts_call sees, a
 * malformed call answered TS_ESCHEMA, the relay through bins when selected, a serving process
 * killed mid-request (its predictions fail at once with TS_ESERVICE and a second server takes
 * the next), a server stopped with calls in its batcher (nothing touches the client it used
 * once ts_batcher_stop_remote returned), a predictor freed while its calls are still out
 * (their late answers touch nothing freed), and a server stopped while tensord is down (it
 * stops within seconds).
 *
 * The killed server is a child forked before this process starts any thread; every wait is
 * bounded, and the child is killed and reaped by its pid.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"
#include "batcher_test_util.h"
#include "harness.h"
#include "tensorshare/batcher.h"
#include "tensorshare/service.h"

#define WAIT_MS 20000 /* ms; the limit of every wait that should end much sooner */
/* ms; how soon a server stops while tensord is down (the request timeout is 30 s) */
#define STOP_DOWN_MS 5000

/* The model: the shared toy model with offset 1, {y = 2 x + 1}, slowed down by tb_delay_us. */
static float g_offset = 1.0f;

/* A batcher of the toy model on two CPU replicas, or NULL (the forked server calls it too). */
static ts_batcher_t *new_batcher(int max_batch, int64_t version)
{
    ts_batcher_options_t cfg;
    tb_options(&cfg, max_batch, 1000, "cpu:2");
    cfg.version = version;
    cfg.create_arg = &g_offset;
    return tb_batcher(&cfg);
}

/* 1 when a and b hold the same {y} tensor, bit for bit. */
static int same_output(const ts_value_t *a, const ts_value_t *b)
{
    const ts_tensor_t *x = ts_map_get_tensor(a, "y"), *y = ts_map_get_tensor(b, "y");
    return x != NULL && y != NULL && x->dtype == y->dtype && x->ndim == 2 && y->ndim == 2 &&
           x->shape[0] == y->shape[0] && x->shape[1] == y->shape[1] &&
           memcmp(x->data, y->data, (size_t)(x->shape[0] * x->shape[1]) * sizeof(float)) == 0;
}

/* Counts an asynchronous prediction's completion in the tb_tally that arg points to. */
static void on_answer(ts_predictor_t *p, int status, ts_value_t *out, int64_t version, void *arg)
{
    (void)p;
    (void)version;
    tb_tally_add(arg, status, status == 0 && ts_map_get_tensor(out, "y") != NULL);
    ts_value_free(out);
}

/* ---------------------------------------------------------------------------------------------
 * A serving process, killed mid-request (first: it is forked before any thread starts)
 */
typedef struct child {
    pid_t pid;
    int from; /* its "ready" byte */
} child;

/* The child: serve "killme" with a slow model, say 'r', and wait to be killed. */
static void child_main(const char *addr, int out)
{
    atomic_store(&tb_delay_us, 5000000); /* every forward outlasts the test's wait */
    ts_client_t *c = NULL;
    ts_batcher_t *b = new_batcher(4, 0);
    if (b == NULL || ts_client_open(&c, addr, NULL) != 0 || ts_batcher_serve(b, c, "killme") != 0)
        _exit(2);
    char r = 'r';
    if (write(out, &r, 1) != 1)
        _exit(3);
    for (int i = 0; i < 600; i++)
        tb_sleep_us(100000); /* 60 s at most; the parent kills it long before */
    _exit(4);
}

static void test_server_killed_mid_request(void **state)
{
    (void)state;
    tsh_server srv;
    assert_int_equal(tsh_server_start(&srv, NULL), 0);
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    child k;
    k.pid = fork();
    assert_true(k.pid >= 0);
    if (k.pid == 0) {
        close(fds[0]);
        child_main(srv.addr, fds[1]);
    }
    close(fds[1]);
    k.from = fds[0];
    char r = 0;
    assert_int_equal(read(k.from, &r, 1), 1);
    assert_int_equal(r, 'r');

    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, srv.addr, NULL), 0);
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, c, "killme"), 0);
    static tb_tally t;
    tb_tally_init(&t);
    enum { N = 3 };
    for (int i = 0; i < N; i++) {
        ts_value_t *in = tb_request(1, i);
        assert_int_equal(ts_predictor_predict_async(p, in, WAIT_MS, on_answer, &t), 0);
        ts_value_free(in);
    }
    /* The server holds them (its forwards take 5 s): none is answered yet. */
    tb_sleep_us(300000);
    pthread_mutex_lock(&t.mu);
    assert_int_equal(t.done, 0);
    pthread_mutex_unlock(&t.mu);
    uint64_t t0 = tb_now_ms();
    assert_int_equal(kill(k.pid, SIGKILL), 0);
    assert_int_equal(waitpid(k.pid, NULL, 0), k.pid);
    close(k.from);
    /* Failed at once, not at their 20 s deadline. */
    assert_true(tb_tally_wait(&t, N, 5000));
    assert_true(tb_now_ms() - t0 < 5000);
    for (int i = 0; i < N; i++)
        assert_int_equal(t.statuses[i], TS_ESERVICE);
    assert_int_equal(t.ok, 0);

    /* A second server takes the next prediction (the call waits for it to register). */
    ts_client_t *sc = NULL;
    assert_int_equal(ts_client_open(&sc, srv.addr, NULL), 0);
    ts_batcher_t *b = new_batcher(4, 3);
    assert_non_null(b);
    assert_int_equal(ts_batcher_serve(b, sc, "killme"), 0);
    ts_value_t *in = tb_request(2, 10), *out = NULL;
    int64_t version = -1;
    assert_int_equal(ts_predictor_predict(p, in, WAIT_MS, &out, &version), 0);
    assert_int_equal(version, 3);
    ts_value_t *want = NULL;
    assert_int_equal(ts_batcher_predict(b, in, WAIT_MS, &want, NULL), 0);
    assert_true(same_output(out, want));
    ts_value_free(want);
    ts_value_free(out);
    ts_value_free(in);
    ts_predictor_stats_t st;
    ts_predictor_stats(p, &st);
    assert_int_equal(st.service, N + 1);
    assert_int_equal(st.relayed, 0);
    ts_predictor_free(p);
    ts_batcher_free(b);
    ts_client_free(sc);
    ts_client_free(c);
    tb_tally_destroy(&t);
    assert_int_equal(tsh_server_stop(&srv), 0);
    tsh_server_cleanup(&srv);
}

/* ---------------------------------------------------------------------------------------------
 * Answers through the service and the relay, equal to the in-process ones
 */
/* A tensord with a serving and a requesting client, and a batcher of version 7 not serving yet. */
typedef struct world {
    tb_world t;
    ts_batcher_t *b;
} world;

static void world_open(world *w)
{
    tb_world_open(&w->t);
    w->b = new_batcher(16, 7);
    assert_non_null(w->b);
}

static void world_close(world *w)
{
    ts_batcher_free(w->b);
    tb_world_close(&w->t);
}

/* n blocking predictions of 1 to 4 rows through p, each equal to the batcher's own answer. */
static void predict_equal(world *w, ts_predictor_t *p, int n)
{
    for (int i = 0; i < n; i++) {
        int64_t rows = 1 + i % 4;
        ts_value_t *in = tb_request(rows, i * 100), *out = NULL, *want = NULL;
        int64_t version = -1;
        assert_int_equal(ts_predictor_predict(p, in, WAIT_MS, &out, &version), 0);
        assert_int_equal(version, 7);
        assert_int_equal(ts_batcher_predict(w->b, in, WAIT_MS, &want, NULL), 0);
        assert_true(same_output(out, want));
        ts_value_free(want);
        ts_value_free(out);
        ts_value_free(in);
    }
}

static void test_service_answers_match(void **state)
{
    (void)state;
    world w;
    world_open(&w);
    assert_int_equal(ts_batcher_serve(w.b, w.t.sc, "policy"), 0);
    ts_predictor_options_t po;
    ts_predictor_options_init(&po);
    po.transport = TS_PREDICTOR_SERVICE;
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open_with(&p, w.t.c, "policy", &po), 0);
    predict_equal(&w, p, 12);
    /* Asynchronous ones too, many outstanding. */
    static tb_tally t;
    tb_tally_init(&t);
    for (int i = 0; i < 50; i++) {
        ts_value_t *in = tb_request(1, i);
        assert_int_equal(ts_predictor_predict_async(p, in, WAIT_MS, on_answer, &t), 0);
        ts_value_free(in);
    }
    assert_true(tb_tally_wait(&t, 50, WAIT_MS));
    assert_int_equal(t.ok, 50);
    ts_predictor_stats_t st;
    ts_predictor_stats(p, &st);
    assert_int_equal(st.transport, TS_PREDICTOR_SERVICE);
    assert_int_equal(st.service, 62);
    assert_int_equal(st.relayed, 0);
    assert_int_equal(st.shm, 0);
    ts_predictor_free(p);
    /* AUTO without slots on offer: the service. */
    assert_int_equal(ts_predictor_open(&p, w.t.c, "policy"), 0);
    predict_equal(&w, p, 3);
    ts_predictor_stats(p, &st);
    assert_int_equal(st.transport, TS_PREDICTOR_SERVICE);
    assert_int_equal(st.service, 3);
    ts_predictor_free(p);
    /* No bin was used: neither the requests bin nor a reply bin exists. */
    ts_items_t *items = NULL;
    assert_int_equal(ts_peek(w.t.c, "policy/requests", 0, &items), TS_ENOENT);
    tb_tally_destroy(&t);
    world_close(&w);
}

/* What a plain ts_call sees: the answer record, and TS_ESCHEMA for a malformed request. */
static void test_service_record(void **state)
{
    (void)state;
    world w;
    world_open(&w);
    ts_batcher_serve_options_t so;
    ts_batcher_serve_options_init(&so);
    so.service_concurrency = 8;
    assert_int_equal(ts_batcher_serve_with(w.b, w.t.sc, "policy", &so), 0);
    ts_value_t *req = ts_map_new(), *ans = NULL;
    assert_int_equal(ts_map_set(req, "input", tb_request(2, 5)), 0);
    assert_int_equal(ts_call(w.t.c, "policy", req, WAIT_MS, 0, &ans), 0);
    int64_t status = -1, version = -1;
    assert_int_equal(ts_map_get_int(ans, "status", &status), 0);
    assert_int_equal(ts_map_get_int(ans, "version", &version), 0);
    assert_int_equal(status, 0);
    assert_int_equal(version, 7);
    const ts_tensor_t *y = ts_map_get_tensor(ts_map_get(ans, "output"), "y");
    assert_non_null(y);
    assert_int_equal(y->shape[0], 2);
    assert_true(((const float *)y->data)[0] == 11.0f); /* 2 * 5 + 1 */
    ts_value_free(ans);
    ts_value_free(req);
    /* Not a map with an input: TS_ESCHEMA in the record, counted as malformed. */
    req = ts_int_new(3);
    assert_int_equal(ts_call(w.t.c, "policy", req, WAIT_MS, 0, &ans), 0);
    assert_int_equal(ts_map_get_int(ans, "status", &status), 0);
    assert_int_equal(status, TS_ESCHEMA);
    assert_non_null(ts_map_get(ans, "error"));
    ts_value_free(ans);
    ts_value_free(req);
    ts_batcher_stats_t bst;
    ts_batcher_stats(w.b, &bst);
    assert_int_equal(bst.malformed, 1);
    /* An input that does not match the schema: TS_ESCHEMA to the predictor, with the reason. */
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, w.t.c, "policy"), 0);
    int64_t shape[2] = {1, 4};
    ts_value_t *in = ts_map_new(), *out = NULL;
    assert_int_equal(ts_map_set(in, "x", ts_tensor_alloc(TS_FLOAT32, 2, shape)), 0);
    assert_int_equal(ts_predictor_predict(p, in, WAIT_MS, &out, NULL), TS_ESCHEMA);
    assert_non_null(strstr(ts_last_error(), "shape"));
    ts_value_free(in);
    ts_predictor_free(p);
    /* A bad concurrency is refused. */
    ts_batcher_t *b2 = new_batcher(4, 0);
    so.service_concurrency = -1;
    assert_int_equal(ts_batcher_serve_with(b2, w.t.sc, "other", &so), TS_EINVAL);
    ts_batcher_free(b2);
    world_close(&w);
}

static void test_relay_when_selected(void **state)
{
    (void)state;
    world w;
    world_open(&w);
    assert_int_equal(ts_batcher_serve(w.b, w.t.sc, "policy"), 0);
    ts_predictor_options_t po;
    ts_predictor_options_init(&po);
    po.transport = TS_PREDICTOR_RELAY;
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open_with(&p, w.t.c, "policy", &po), 0);
    predict_equal(&w, p, 8);
    ts_predictor_stats_t st;
    ts_predictor_stats(p, &st);
    assert_int_equal(st.transport, TS_PREDICTOR_RELAY);
    assert_int_equal(st.relayed, 8);
    assert_int_equal(st.service, 0);
    ts_predictor_free(p);
    world_close(&w);
}

/* ---------------------------------------------------------------------------------------------
 * Stopping with calls outstanding, on both sides
 */

/*
 * The server stops with calls in its batcher (one in a 300 ms forward, the others queued) and
 * frees its client at once: the queued ones are answered TS_ECANCELED, the one in the forward
 * gets its answer or TS_ECANCELED, and nothing calls ts_call_reply on the freed client (ASan).
 */
static void test_stop_remote_with_calls(void **state)
{
    (void)state;
    world w;
    world_open(&w);
    ts_batcher_t *b = new_batcher(1, 0);
    assert_non_null(b);
    assert_int_equal(ts_batcher_serve(b, w.t.sc, "slow"), 0);
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, w.t.c, "slow"), 0);
    atomic_store(&tb_delay_us, 300000);
    static tb_tally t;
    tb_tally_init(&t);
    enum { N = 6 };
    for (int i = 0; i < N; i++) {
        ts_value_t *in = tb_request(1, i);
        assert_int_equal(ts_predictor_predict_async(p, in, WAIT_MS, on_answer, &t), 0);
        ts_value_free(in);
    }
    for (int i = 0; i < 500; i++) {
        ts_batcher_stats_t st;
        ts_batcher_stats(b, &st);
        if (st.submitted >= N)
            break;
        tb_sleep_us(5000);
    }
    ts_batcher_stop_remote(b);
    ts_client_free(w.t.sc);
    w.t.sc = NULL;
    assert_true(tb_tally_wait(&t, N, WAIT_MS));
    assert_true(t.ok <= 2);
    assert_int_equal(t.last_status, TS_ECANCELED);
    ts_batcher_free(b); /* the forward's completion ran or runs now: it finds its call answered */
    atomic_store(&tb_delay_us, 0);
    ts_predictor_free(p);
    tb_tally_destroy(&t);
    world_close(&w);
}

/*
 * The predictor is freed while its calls are in a slow forward: they complete with
 * TS_ECANCELED in ts_predictor_free, and their answers, which come later, touch nothing freed.
 */
static void test_predictor_free_with_calls_out(void **state)
{
    (void)state;
    world w;
    world_open(&w);
    assert_int_equal(ts_batcher_serve(w.b, w.t.sc, "policy"), 0);
    atomic_store(&tb_delay_us, 200000);
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, w.t.c, "policy"), 0);
    static tb_tally t;
    tb_tally_init(&t);
    enum { N = 5 };
    for (int i = 0; i < N; i++) {
        ts_value_t *in = tb_request(1, i);
        assert_int_equal(ts_predictor_predict_async(p, in, TS_TIMEOUT_INFINITE, on_answer, &t), 0);
        ts_value_free(in);
    }
    tb_sleep_us(50000);
    ts_predictor_free(p);
    assert_int_equal(t.done, N);
    assert_int_equal(t.last_status, TS_ECANCELED);
    tb_sleep_us(500000); /* the answers arrive now, for a predictor that is gone */
    atomic_store(&tb_delay_us, 0);
    /* The client and the server carry on. */
    assert_int_equal(ts_predictor_open(&p, w.t.c, "policy"), 0);
    predict_equal(&w, p, 2);
    ts_predictor_free(p);
    tb_tally_destroy(&t);
    world_close(&w);
}

/*
 * tensord is gone (killed) when the server stops: ts_batcher_stop_remote returns within a few
 * seconds, not after the client's request timeout (30 s) for each of its calls (unregistering,
 * waking the taking chain, the chain's WAIT made while the connection was down).
 */
static void test_stop_remote_while_tensord_down(void **state)
{
    (void)state;
    world w;
    world_open(&w);
    assert_int_equal(ts_batcher_serve(w.b, w.t.sc, "down"), 0);
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, w.t.c, "down"), 0);
    predict_equal(&w, p, 1);
    tsh_server_kill(&w.t.srv);
    uint64_t t0 = tb_now_ms();
    while (ts_client_connected(w.t.sc) && tb_now_ms() - t0 < WAIT_MS)
        tb_sleep_us(10000);
    assert_false(ts_client_connected(w.t.sc));
    tb_sleep_us(300000); /* the taking chain starts again: its WAIT waits for a reconnection */
    t0 = tb_now_ms();
    ts_batcher_stop_remote(w.b);
    ts_predictor_free(p);
    assert_true(tb_now_ms() - t0 < STOP_DOWN_MS);
    /* tensord comes back: the chain's WAIT goes out and ends, touching nothing freed. */
    assert_int_equal(tsh_server_restart(&w.t.srv, NULL), 0);
    t0 = tb_now_ms();
    while (!ts_client_connected(w.t.sc) && tb_now_ms() - t0 < WAIT_MS)
        tb_sleep_us(10000);
    tb_sleep_us(500000);
    world_close(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        /* First: it forks before this process has started any thread. */
        cmocka_unit_test(test_server_killed_mid_request),
        cmocka_unit_test(test_service_answers_match),
        cmocka_unit_test(test_service_record),
        cmocka_unit_test(test_relay_when_selected),
        cmocka_unit_test(test_stop_remote_with_calls),
        cmocka_unit_test(test_predictor_free_with_calls_out),
        cmocka_unit_test(test_stop_remote_while_tensord_down),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
