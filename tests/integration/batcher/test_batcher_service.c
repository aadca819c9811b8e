/*
 * Remote predictions through the service NAME against a real tensord: answers equal to the
 * in-process ones (TS_PREDICTOR_SERVICE and AUTO), the answer record a plain ts_call sees, a
 * malformed call answered TS_ESCHEMA, the relay through bins when selected, a serving process
 * killed mid-request (its predictions fail at once with TS_ESERVICE and a second server takes
 * the next), a server stopped with calls in its batcher (nothing touches the client it used
 * once ts_batcher_stop_remote returned), and a predictor freed while its calls are still out
 * (their late answers touch nothing freed).
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
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "harness.h"
#include "tensorshare/batcher.h"
#include "tensorshare/service.h"

#define WAIT_MS 20000 /* ms; the limit of every wait that should end much sooner */

/* The model: {x: float32[3]} -> {y: float32[3] = 2 x + 1}, after g_delay_us. */
static atomic_int g_delay_us;

static void sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static int m_forward(ts_model_t *m, const ts_value_t *in, int64_t rows, ts_value_t **out)
{
    (void)m;
    if (atomic_load(&g_delay_us) > 0)
        sleep_us(atomic_load(&g_delay_us));
    const ts_tensor_t *x = ts_map_get_tensor(in, "x");
    ts_value_t *y = ts_tensor_new(TS_FLOAT32, 2, x->shape, x->data, TS_COPY);
    ts_value_t *o = ts_map_new();
    if (y == NULL || o == NULL || ts_map_set(o, "y", y) != 0) {
        ts_value_free(o);
        return TS_ENOMEM;
    }
    float *d = ts_value_tensor(y)->data;
    for (int64_t i = 0; i < rows * 3; i++)
        d[i] = 2.0f * d[i] + 1.0f;
    *out = o;
    return 0;
}

static void m_free(ts_model_t *m)
{
    ts__free(m);
}

static const ts_model_ops_t m_ops = {m_forward, NULL, m_free};

static int m_create(const char *device, int replica, ts_model_t **out, void *arg)
{
    (void)device;
    (void)replica;
    (void)arg;
    ts_model_t *m = ts__calloc(1, sizeof(*m));
    if (m == NULL)
        return TS_ENOMEM;
    m->ops = &m_ops;
    *out = m;
    return 0;
}

static const ts_field_t schema[] = {{"x", TS_FLOAT32, 1, {3}}};

static ts_batcher_t *new_batcher(int max_batch, int64_t version)
{
    ts_batcher_options_t cfg;
    ts_batcher_options_init(&cfg);
    cfg.inputs = schema;
    cfg.n_inputs = 1;
    cfg.max_batch = max_batch;
    cfg.max_delay_us = 1000;
    cfg.placement = "cpu:2";
    cfg.version = version;
    cfg.create = m_create;
    ts_batcher_t *b = NULL;
    return ts_batcher_new(&b, &cfg) == 0 ? b : NULL;
}

static ts_value_t *request(int64_t rows, int64_t base)
{
    int64_t shape[2] = {rows, 3};
    ts_value_t *x = ts_tensor_alloc(TS_FLOAT32, 2, shape);
    assert_non_null(x);
    float *d = ts_value_tensor(x)->data;
    for (int64_t i = 0; i < rows * 3; i++)
        d[i] = (float)(base + i);
    ts_value_t *m = ts_map_new();
    assert_int_equal(ts_map_set(m, "x", x), 0);
    return m;
}

/* 1 when a and b hold the same {y} tensor, bit for bit. */
static int same_output(const ts_value_t *a, const ts_value_t *b)
{
    const ts_tensor_t *x = ts_map_get_tensor(a, "y"), *y = ts_map_get_tensor(b, "y");
    return x != NULL && y != NULL && x->dtype == y->dtype && x->ndim == 2 && y->ndim == 2 &&
           x->shape[0] == y->shape[0] && x->shape[1] == y->shape[1] &&
           memcmp(x->data, y->data, (size_t)(x->shape[0] * x->shape[1]) * sizeof(float)) == 0;
}

/* Completions of asynchronous predictions. */
typedef struct tally {
    pthread_mutex_t mu;
    int done, ok, last_status;
    int statuses[64];
    char last_msg[256];
} tally;

static void on_answer(ts_predictor_t *p, int status, ts_value_t *out, int64_t version, void *arg)
{
    (void)p;
    (void)version;
    tally *t = arg;
    pthread_mutex_lock(&t->mu);
    if (t->done < 64)
        t->statuses[t->done] = status;
    t->done++;
    t->ok += status == 0 && ts_map_get_tensor(out, "y") != NULL;
    if (status != 0) {
        t->last_status = status;
        snprintf(t->last_msg, sizeof(t->last_msg), "%s", ts_last_error());
    }
    pthread_mutex_unlock(&t->mu);
    ts_value_free(out);
}

static int tally_wait(tally *t, int n, int max_ms)
{
    uint64_t end = now_ms() + (uint64_t)max_ms;
    for (;;) {
        pthread_mutex_lock(&t->mu);
        int d = t->done;
        pthread_mutex_unlock(&t->mu);
        if (d >= n)
            return 1;
        if (now_ms() > end)
            return 0;
        sleep_us(2000);
    }
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
    atomic_store(&g_delay_us, 5000000); /* every forward outlasts the test's wait */
    ts_client_t *c = NULL;
    ts_batcher_t *b = new_batcher(4, 0);
    if (b == NULL || ts_client_open(&c, addr, NULL) != 0 || ts_batcher_serve(b, c, "killme") != 0)
        _exit(2);
    char r = 'r';
    if (write(out, &r, 1) != 1)
        _exit(3);
    for (int i = 0; i < 600; i++)
        sleep_us(100000); /* 60 s at most; the parent kills it long before */
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
    static tally t;
    memset(&t, 0, sizeof(t));
    pthread_mutex_init(&t.mu, NULL);
    enum { N = 3 };
    for (int i = 0; i < N; i++) {
        ts_value_t *in = request(1, i);
        assert_int_equal(ts_predictor_predict_async(p, in, WAIT_MS, on_answer, &t), 0);
        ts_value_free(in);
    }
    /* The server holds them (its forwards take 5 s): none is answered yet. */
    sleep_us(300000);
    pthread_mutex_lock(&t.mu);
    assert_int_equal(t.done, 0);
    pthread_mutex_unlock(&t.mu);
    uint64_t t0 = now_ms();
    assert_int_equal(kill(k.pid, SIGKILL), 0);
    assert_int_equal(waitpid(k.pid, NULL, 0), k.pid);
    close(k.from);
    /* Failed at once, not at their 20 s deadline. */
    assert_true(tally_wait(&t, N, 5000));
    assert_true(now_ms() - t0 < 5000);
    for (int i = 0; i < N; i++)
        assert_int_equal(t.statuses[i], TS_ESERVICE);
    assert_int_equal(t.ok, 0);

    /* A second server takes the next prediction (the call waits for it to register). */
    ts_client_t *sc = NULL;
    assert_int_equal(ts_client_open(&sc, srv.addr, NULL), 0);
    ts_batcher_t *b = new_batcher(4, 3);
    assert_non_null(b);
    assert_int_equal(ts_batcher_serve(b, sc, "killme"), 0);
    ts_value_t *in = request(2, 10), *out = NULL;
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
    pthread_mutex_destroy(&t.mu);
    assert_int_equal(tsh_server_stop(&srv), 0);
    tsh_server_cleanup(&srv);
}

/* ---------------------------------------------------------------------------------------------
 * Answers through the service and the relay, equal to the in-process ones
 */
typedef struct world {
    tsh_server srv;
    ts_client_t *sc, *c;
    ts_batcher_t *b;
} world;

static int world_open(world *w)
{
    memset(w, 0, sizeof(*w));
    if (tsh_server_start(&w->srv, NULL) != 0)
        return -1;
    if (ts_client_open(&w->sc, w->srv.addr, NULL) != 0 ||
        ts_client_open(&w->c, w->srv.addr, NULL) != 0)
        return -1;
    w->b = new_batcher(16, 7);
    return w->b != NULL ? 0 : -1;
}

static void world_close(world *w)
{
    ts_batcher_free(w->b);
    ts_client_free(w->c);
    ts_client_free(w->sc);
    assert_int_equal(tsh_server_stop(&w->srv), 0);
    tsh_server_cleanup(&w->srv);
}

/* n blocking predictions of 1 to 4 rows through p, each equal to the batcher's own answer. */
static void predict_equal(world *w, ts_predictor_t *p, int n)
{
    for (int i = 0; i < n; i++) {
        int64_t rows = 1 + i % 4;
        ts_value_t *in = request(rows, i * 100), *out = NULL, *want = NULL;
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
    assert_int_equal(world_open(&w), 0);
    assert_int_equal(ts_batcher_serve(w.b, w.sc, "policy"), 0);
    ts_predictor_options_t po;
    ts_predictor_options_init(&po);
    po.transport = TS_PREDICTOR_SERVICE;
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open_with(&p, w.c, "policy", &po), 0);
    predict_equal(&w, p, 12);
    /* Asynchronous ones too, many outstanding. */
    static tally t;
    memset(&t, 0, sizeof(t));
    pthread_mutex_init(&t.mu, NULL);
    for (int i = 0; i < 50; i++) {
        ts_value_t *in = request(1, i);
        assert_int_equal(ts_predictor_predict_async(p, in, WAIT_MS, on_answer, &t), 0);
        ts_value_free(in);
    }
    assert_true(tally_wait(&t, 50, WAIT_MS));
    assert_int_equal(t.ok, 50);
    ts_predictor_stats_t st;
    ts_predictor_stats(p, &st);
    assert_int_equal(st.transport, TS_PREDICTOR_SERVICE);
    assert_int_equal(st.service, 62);
    assert_int_equal(st.relayed, 0);
    assert_int_equal(st.shm, 0);
    ts_predictor_free(p);
    /* AUTO without slots on offer: the service. */
    assert_int_equal(ts_predictor_open(&p, w.c, "policy"), 0);
    predict_equal(&w, p, 3);
    ts_predictor_stats(p, &st);
    assert_int_equal(st.transport, TS_PREDICTOR_SERVICE);
    assert_int_equal(st.service, 3);
    ts_predictor_free(p);
    /* No bin was used: neither the requests bin nor a reply bin exists. */
    ts_items_t *items = NULL;
    assert_int_equal(ts_peek(w.c, "policy/requests", 0, &items), TS_ENOENT);
    pthread_mutex_destroy(&t.mu);
    world_close(&w);
}

/* What a plain ts_call sees: the answer record, and TS_ESCHEMA for a malformed request. */
static void test_service_record(void **state)
{
    (void)state;
    world w;
    assert_int_equal(world_open(&w), 0);
    ts_batcher_serve_options_t so;
    ts_batcher_serve_options_init(&so);
    so.service_concurrency = 8;
    assert_int_equal(ts_batcher_serve_with(w.b, w.sc, "policy", &so), 0);
    ts_value_t *req = ts_map_new(), *ans = NULL;
    assert_int_equal(ts_map_set(req, "input", request(2, 5)), 0);
    assert_int_equal(ts_call(w.c, "policy", req, WAIT_MS, 0, &ans), 0);
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
    assert_int_equal(ts_call(w.c, "policy", req, WAIT_MS, 0, &ans), 0);
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
    assert_int_equal(ts_predictor_open(&p, w.c, "policy"), 0);
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
    assert_int_equal(ts_batcher_serve_with(b2, w.sc, "other", &so), TS_EINVAL);
    ts_batcher_free(b2);
    world_close(&w);
}

static void test_relay_when_selected(void **state)
{
    (void)state;
    world w;
    assert_int_equal(world_open(&w), 0);
    assert_int_equal(ts_batcher_serve(w.b, w.sc, "policy"), 0);
    ts_predictor_options_t po;
    ts_predictor_options_init(&po);
    po.transport = TS_PREDICTOR_RELAY;
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open_with(&p, w.c, "policy", &po), 0);
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
    assert_int_equal(world_open(&w), 0);
    ts_batcher_t *b = new_batcher(1, 0);
    assert_non_null(b);
    assert_int_equal(ts_batcher_serve(b, w.sc, "slow"), 0);
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, w.c, "slow"), 0);
    atomic_store(&g_delay_us, 300000);
    static tally t;
    memset(&t, 0, sizeof(t));
    pthread_mutex_init(&t.mu, NULL);
    enum { N = 6 };
    for (int i = 0; i < N; i++) {
        ts_value_t *in = request(1, i);
        assert_int_equal(ts_predictor_predict_async(p, in, WAIT_MS, on_answer, &t), 0);
        ts_value_free(in);
    }
    for (int i = 0; i < 500; i++) {
        ts_batcher_stats_t st;
        ts_batcher_stats(b, &st);
        if (st.submitted >= N)
            break;
        sleep_us(5000);
    }
    ts_batcher_stop_remote(b);
    ts_client_free(w.sc);
    w.sc = NULL;
    assert_true(tally_wait(&t, N, WAIT_MS));
    assert_true(t.ok <= 2);
    assert_int_equal(t.last_status, TS_ECANCELED);
    ts_batcher_free(b); /* the forward's completion ran or runs now: it finds its call answered */
    atomic_store(&g_delay_us, 0);
    ts_predictor_free(p);
    pthread_mutex_destroy(&t.mu);
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
    assert_int_equal(world_open(&w), 0);
    assert_int_equal(ts_batcher_serve(w.b, w.sc, "policy"), 0);
    atomic_store(&g_delay_us, 200000);
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, w.c, "policy"), 0);
    static tally t;
    memset(&t, 0, sizeof(t));
    pthread_mutex_init(&t.mu, NULL);
    enum { N = 5 };
    for (int i = 0; i < N; i++) {
        ts_value_t *in = request(1, i);
        assert_int_equal(ts_predictor_predict_async(p, in, TS_TIMEOUT_INFINITE, on_answer, &t), 0);
        ts_value_free(in);
    }
    sleep_us(50000);
    ts_predictor_free(p);
    assert_int_equal(t.done, N);
    assert_int_equal(t.last_status, TS_ECANCELED);
    sleep_us(500000); /* the answers arrive now, for a predictor that is gone */
    atomic_store(&g_delay_us, 0);
    /* The client and the server carry on. */
    assert_int_equal(ts_predictor_open(&p, w.c, "policy"), 0);
    predict_equal(&w, p, 2);
    ts_predictor_free(p);
    pthread_mutex_destroy(&t.mu);
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
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
