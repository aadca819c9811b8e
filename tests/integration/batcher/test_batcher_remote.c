/*
 * The batcher through a real tensord: remote predictors (blocking and asynchronous) against a
 * served batcher, schema errors answered remotely, weights followed from a parameters bin,
 * deadlines when nobody serves, cancellation at shutdown, and malformed requests counted and
 * reported.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "common.h"
#include "batcher_test_util.h"
#include "harness.h"
#include "tensorshare/batcher.h"

/*
 * The model: {x: float32[3]} -> {y: float32[3] = x * scale}, slowed down by tb_delay_us; weights
 * {scale: float32}. It takes the shared schema and batcher options, not the shared model, which
 * has no weights to follow.
 */
typedef struct smodel {
    ts_model_t base;
    float scale;
} smodel;

static int sm_forward(ts_model_t *m, const ts_value_t *in, int64_t rows, ts_value_t **out)
{
    if (atomic_load(&tb_delay_us) > 0)
        tb_sleep_us(atomic_load(&tb_delay_us));
    const ts_tensor_t *x = ts_map_get_tensor(in, "x");
    ts_value_t *y = ts_tensor_new(TS_FLOAT32, 2, x->shape, x->data, TS_COPY);
    ts_value_t *o = ts_map_new();
    if (y == NULL || o == NULL) {
        ts_value_free(y);
        ts_value_free(o);
        return TS_ENOMEM;
    }
    float *d = ts_value_tensor(y)->data;
    for (int64_t i = 0; i < rows * 3; i++)
        d[i] *= ((smodel *)m)->scale;
    if (ts_map_set(o, "y", y) != 0) {
        ts_value_free(o);
        return TS_ENOMEM;
    }
    *out = o;
    return 0;
}

static int sm_load(ts_model_t *m, const ts_value_t *params)
{
    const ts_tensor_t *s = ts_map_get_tensor(params, "scale");
    if (s == NULL || s->dtype != TS_FLOAT32) {
        ts_set_last_error("no scale");
        return TS_EINVAL;
    }
    ((smodel *)m)->scale = *(const float *)s->data;
    return 0;
}

static void sm_free(ts_model_t *m)
{
    ts__free(m);
}

static const ts_model_ops_t sm_ops = {sm_forward, sm_load, sm_free};

static int sm_create(const char *device, int replica, ts_model_t **out, void *arg)
{
    (void)arg;
    (void)device;
    (void)replica;
    smodel *m = ts__calloc(1, sizeof(*m));
    if (m == NULL)
        return TS_ENOMEM;
    m->base.ops = &sm_ops;
    m->scale = 1.0f;
    *out = &m->base;
    return 0;
}

typedef struct world {
    tsh_server srv;
    ts_client_t *serve_client; /* the batcher's */
    ts_client_t *client;       /* the workers' */
    ts_batcher_t *b;
} world;

static int setup(void **state)
{
    static world w;
    memset(&w, 0, sizeof(w));
    if (tsh_server_start(&w.srv, NULL) != 0)
        return -1;
    if (ts_client_open(&w.serve_client, w.srv.addr, NULL) != 0 ||
        ts_client_open(&w.client, w.srv.addr, NULL) != 0)
        return -1;
    ts_batcher_options_t cfg;
    tb_options(&cfg, 32, 2000, "cpu:2");
    cfg.create = sm_create;
    if (ts_batcher_new(&w.b, &cfg) != 0)
        return -1;
    if (ts_batcher_serve(w.b, w.serve_client, "policy") != 0)
        return -1;
    *state = &w;
    return 0;
}

static int teardown(void **state)
{
    world *w = *state;
    ts_batcher_free(w->b);
    ts_client_free(w->client);
    ts_client_free(w->serve_client);
    int rc = tsh_server_stop(&w->srv);
    tsh_server_cleanup(&w->srv);
    return rc == 0 ? 0 : -1;
}

typedef struct worker {
    world *w;
    int index;
    int ok;
} worker;

static void *worker_main(void *arg)
{
    worker *k = arg;
    ts_predictor_t *p = NULL;
    k->ok = ts_predictor_open(&p, k->w->client, "policy") == 0;
    for (int i = 0; k->ok && i < 10; i++) {
        int64_t rows = 1 + (k->index + i) % 4, base = k->index * 10000 + i * 100;
        ts_value_t *in = tb_request(rows, base), *out = NULL;
        int64_t version = -1;
        int rc = ts_predictor_predict(p, in, 20000, &out, &version);
        if (rc != 0 || version != 0 || !tb_check(out, rows, base, 1.0f)) {
            print_error("worker %d: rc %s (%s)\n", k->index, ts_err_name(rc), ts_last_error());
            k->ok = 0;
        }
        ts_value_free(out);
        ts_value_free(in);
    }
    ts_predictor_free(p);
    return NULL;
}

static void test_remote_blocking(void **state)
{
    world *w = *state;
    enum { N = 8 };
    worker k[N];
    pthread_t th[N];
    for (int i = 0; i < N; i++) {
        k[i] = (worker){w, i, 0};
        assert_int_equal(pthread_create(&th[i], NULL, worker_main, &k[i]), 0);
    }
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        assert_true(k[i].ok);
    }
    ts_batcher_stats_t st;
    ts_batcher_stats(w->b, &st);
    assert_true(st.requests >= N * 10);
}

/* What one asynchronous prediction expects, and the tally its completion is counted in. */
typedef struct actx {
    tb_tally *c;
    int64_t rows, base;
    float scale;
} actx;

static void remote_cb(ts_predictor_t *p, int status, ts_value_t *out, int64_t version, void *arg)
{
    (void)p;
    (void)version;
    actx *a = arg;
    int good = status == 0 && tb_check(out, a->rows, a->base, a->scale);
    ts_value_free(out);
    tb_tally_add(a->c, status, good);
}

static void test_remote_async(void **state)
{
    world *w = *state;
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, w->client, "policy"), 0);
    enum { N = 100 };
    static actx a[N];
    tb_tally c;
    tb_tally_init(&c);
    for (int i = 0; i < N; i++) {
        a[i] = (actx){&c, 1 + i % 3, (int64_t)i * 10, 1.0f};
        ts_value_t *in = tb_request(a[i].rows, a[i].base);
        assert_int_equal(ts_predictor_predict_async(p, in, 20000, remote_cb, &a[i]), 0);
        ts_value_free(in); /* borrowed for the call only */
    }
    assert_true(tb_tally_wait(&c, N, 30000));
    assert_int_equal(c.ok, N);
    ts_predictor_free(p);
}

static void test_remote_schema_error(void **state)
{
    world *w = *state;
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, w->client, "policy"), 0);
    int64_t shape[2] = {2, 4};
    ts_value_t *in = ts_map_new(), *out = NULL;
    assert_int_equal(ts_map_set(in, "x", ts_tensor_alloc(TS_FLOAT32, 2, shape)), 0);
    assert_int_equal(ts_predictor_predict(p, in, 20000, &out, NULL), TS_ESCHEMA);
    assert_non_null(strstr(ts_last_error(), "shape"));
    ts_value_free(in);
    /* The predictor keeps working. */
    in = tb_request(2, 1);
    assert_int_equal(ts_predictor_predict(p, in, 20000, &out, NULL), 0);
    assert_true(tb_check(out, 2, 1, 1.0f));
    ts_value_free(out);
    ts_value_free(in);
    ts_predictor_free(p);
}

/* A trainer puts {params, version}; the served replicas pick it up between forwards. */
static void test_remote_weights(void **state)
{
    world *w = *state;
    assert_int_equal(ts_batcher_follow_weights(w->b, w->serve_client, "policy/params"), 0);
    float five = 5.0f;
    ts_value_t *rec = ts_map_new(), *params = ts_map_new();
    assert_int_equal(
        ts_map_set(params, "scale", ts_tensor_new(TS_FLOAT32, 0, NULL, &five, TS_COPY)), 0);
    assert_int_equal(ts_map_set(rec, "params", params), 0);
    assert_int_equal(ts_map_set(rec, "version", ts_int_new(5)), 0);
    assert_int_equal(ts_put(w->client, "policy/params", rec, NULL), 0);
    ts_value_free(rec);
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, w->client, "policy"), 0);
    int64_t version = 0;
    int tries = 0;
    for (; tries < 500 && version != 5; tries++) {
        ts_value_t *in = tb_request(1, 3), *out = NULL;
        assert_int_equal(ts_predictor_predict(p, in, 20000, &out, &version), 0);
        /* Every answer is consistent with the version it reports. */
        assert_true(tb_check(out, 1, 3, version == 5 ? 5.0f : 1.0f));
        ts_value_free(out);
        ts_value_free(in);
        if (version != 5)
            tb_sleep_us(20000);
    }
    assert_int_equal(version, 5);
    ts_predictor_free(p);
}

/* Nobody serves this name: the predictor's own deadline answers. */
static void test_remote_deadline(void **state)
{
    world *w = *state;
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, w->client, "nobody"), 0);
    ts_value_t *in = tb_request(1, 0), *out = NULL;
    uint64_t t0 = ts__now_ns();
    assert_int_equal(ts_predictor_predict(p, in, 300, &out, NULL), TS_ETIMEDOUT);
    double ms = (double)(ts__now_ns() - t0) / 1e6;
    assert_true(ms >= 290.0 && ms < 10000.0);
    ts_value_free(in);
    ts_predictor_free(p);
    ts_delete(w->client, "nobody/requests", NULL);
}

/* Freeing the predictor cancels what it still waits for. */
static void test_predictor_free_cancels(void **state)
{
    world *w = *state;
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, w->client, "nobody2"), 0);
    tb_tally c;
    tb_tally_init(&c);
    actx a[5];
    for (int i = 0; i < 5; i++) {
        a[i] = (actx){&c, 1, 0, 1.0f};
        ts_value_t *in = tb_request(1, 0);
        assert_int_equal(ts_predictor_predict_async(p, in, TS_TIMEOUT_INFINITE, remote_cb, &a[i]),
                         0);
        ts_value_free(in);
    }
    ts_predictor_free(p);
    assert_int_equal(c.done, 5);
    assert_int_equal(c.last_status, TS_ECANCELED);
    ts_delete(w->client, "nobody2/requests", NULL);
}

/*
 * tensord restarts under a served batcher and a predictor: the predictor's receiving chain
 * breaks, is restarted by its thread, and predictions are answered again once both clients
 * have reconnected; freeing afterwards works.
 */
static void test_remote_survives_restart(void **state)
{
    (void)state;
    tb_world w;
    tb_world_open(&w);
    ts_batcher_options_t cfg;
    tb_options(&cfg, 8, 1000, NULL);
    cfg.create = sm_create;
    ts_batcher_t *b = NULL;
    assert_int_equal(ts_batcher_new(&b, &cfg), 0);
    assert_int_equal(ts_batcher_serve(b, w.sc, "restart"), 0);
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, w.c, "restart"), 0);
    ts_value_t *in = tb_request(1, 40), *out = NULL;
    assert_int_equal(ts_predictor_predict(p, in, 10000, &out, NULL), 0);
    ts_value_free(out);
    tsh_server_kill(&w.srv);
    assert_int_equal(tsh_server_restart(&w.srv, NULL), 0);
    /* The reply bin went with the old server: the chain waits on the new one's. */
    int rc = -1;
    for (int i = 0; i < 40 && rc != 0; i++) {
        out = NULL;
        rc = ts_predictor_predict(p, in, 500, &out, NULL);
        ts_value_free(out);
    }
    assert_int_equal(rc, 0);
    ts_value_free(in);
    ts_predictor_free(p);
    ts_batcher_free(b);
    tb_world_close(&w);
}

/* A second batcher on the same model, one row per forward and no batching delay. */
static ts_batcher_t *one_row_batcher(void)
{
    ts_batcher_options_t cfg;
    tb_options(&cfg, 1, 0, NULL);
    cfg.create = sm_create;
    ts_batcher_t *b = NULL;
    assert_int_equal(ts_batcher_new(&b, &cfg), 0);
    return b;
}

/* A batcher shut down with remote requests queued answers them with TS_ECANCELED. */
static void test_remote_shutdown(void **state)
{
    world *w = *state;
    ts_batcher_t *b = one_row_batcher();
    assert_int_equal(ts_batcher_serve(b, w->serve_client, "slow"), 0);
    atomic_store(&tb_delay_us, 100000);
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, w->client, "slow"), 0);
    tb_tally c;
    tb_tally_init(&c);
    actx a[10];
    for (int i = 0; i < 10; i++) {
        a[i] = (actx){&c, 1, i, 1.0f};
        ts_value_t *in = tb_request(1, i);
        assert_int_equal(ts_predictor_predict_async(p, in, 30000, remote_cb, &a[i]), 0);
        ts_value_free(in);
    }
    /* Wait until the server holds them (the first is in a forward), then stop it. */
    for (int i = 0; i < 500; i++) {
        ts_batcher_stats_t st;
        ts_batcher_stats(b, &st);
        if (st.queued >= 5)
            break;
        tb_sleep_us(10000);
    }
    ts_batcher_free(b);
    atomic_store(&tb_delay_us, 0);
    assert_true(tb_tally_wait(&c, 10, 20000));
    assert_true(c.ok >= 1);
    assert_int_equal(c.last_status, TS_ECANCELED);
    ts_predictor_free(p);
}

/* What the malformed-request callback saw. */
typedef struct mal_log {
    pthread_mutex_t mu;
    int calls;
    int status;
    char last[3][256];
} mal_log;

static void on_malformed(ts_batcher_t *b, int status, void *arg)
{
    (void)b;
    mal_log *m = arg;
    pthread_mutex_lock(&m->mu);
    if (m->calls < 3)
        snprintf(m->last[m->calls], sizeof(m->last[0]), "%s", ts_last_error());
    m->calls++;
    m->status = status;
    pthread_mutex_unlock(&m->mu);
}

/*
 * Three malformed requests (not a map, no reply bin, no input) are counted in the serving
 * statistics and reported to on_malformed with their reasons; the one that names a reply bin is
 * answered with TS_ESCHEMA.
 */
static void test_remote_malformed(void **state)
{
    world *w = *state;
    ts_batcher_t *b = one_row_batcher();
    static mal_log m;
    memset(&m, 0, sizeof(m));
    pthread_mutex_init(&m.mu, NULL);
    ts_batcher_serve_options_t so;
    ts_batcher_serve_options_init(&so);
    so.on_malformed = on_malformed;
    so.on_malformed_arg = &m;
    assert_int_equal(ts_batcher_serve_with(b, w->serve_client, "bad", &so), 0);

    ts_value_t *bad = ts_int_new(7);
    assert_int_equal(ts_append(w->client, "bad/requests", bad, NULL), 0);
    ts_value_free(bad);
    bad = ts_map_new();
    assert_int_equal(ts_map_set(bad, "id", ts_int_new(5)), 0);
    assert_int_equal(ts_append(w->client, "bad/requests", bad, NULL), 0);
    assert_int_equal(ts_map_set(bad, "reply", ts_string_new("bad/reply/x", 11)), 0);
    assert_int_equal(ts_append(w->client, "bad/requests", bad, NULL), 0);
    ts_value_free(bad);

    ts_batcher_stats_t st;
    memset(&st, 0, sizeof(st));
    for (int i = 0; i < 1000; i++) {
        ts_batcher_stats(b, &st);
        if (st.malformed >= 3)
            break;
        tb_sleep_us(10000);
    }
    assert_int_equal(st.malformed, 3);
    ts_items_t *answer = NULL;
    int rc = TS_ENOENT;
    for (int i = 0; i < 1000 && rc == TS_ENOENT; i++) {
        rc = ts_get(w->client, "bad/reply/x", 0, &answer);
        if (rc == TS_ENOENT)
            tb_sleep_us(10000);
    }
    assert_int_equal(rc, 0);
    int64_t status = 0, id = 0;
    assert_int_equal(ts_map_get_int(ts_items_at(answer, 0), "status", &status), 0);
    assert_int_equal(ts_map_get_int(ts_items_at(answer, 0), "id", &id), 0);
    assert_int_equal(status, TS_ESCHEMA);
    assert_int_equal(id, 5);
    ts_items_free(answer);
    ts_batcher_free(b);

    /* ts_batcher_free joined the serve thread: every call has returned. */
    assert_int_equal(m.calls, 3);
    assert_int_equal(m.status, TS_ESCHEMA);
    assert_string_equal(m.last[0], "not a map");
    assert_non_null(strstr(m.last[1], "request 5: no 'reply' bin name"));
    assert_string_equal(m.last[2], "request 5: no 'input'");
    pthread_mutex_destroy(&m.mu);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_remote_blocking),
        cmocka_unit_test(test_remote_async),
        cmocka_unit_test(test_remote_schema_error),
        cmocka_unit_test(test_remote_weights),
        cmocka_unit_test(test_remote_deadline),
        cmocka_unit_test(test_predictor_free_cancels),
        cmocka_unit_test(test_remote_shutdown),
        cmocka_unit_test(test_remote_malformed),
        cmocka_unit_test(test_remote_survives_restart),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
