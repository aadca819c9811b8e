/*
 * The batcher in process, with a plain C model: batching rule, exactly-own-rows delivery under
 * many submitters, queue delay, schema errors, model failures, weight updates between forwards,
 * deadlines, shutdown and placement.
 */
#define _GNU_SOURCE /* pthread_getname_np */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "common.h"
#include "tensorshare/batcher.h"

/*
 * The test model: input {obs: {x: float32[4], id: int64[]}}, output {y: float32[4] = x * scale,
 * id: int64[] = id, batch: int64[] = rows of the forward}. Weights {scale: float32 scalar}. A NaN
 * in x makes it fail; forward sleeps delay_us (shared by all replicas) first.
 */
typedef struct cmodel {
    ts_model_t base;
    float scale;
    atomic_int busy;
} cmodel;

static atomic_int g_delay_us;
static atomic_int g_forwards;
/* Calls that overlapped another call on the same model (forward or load): must stay 0. */
static atomic_int g_overlaps;
/* Weight loads that read parameters already handed back by their release callback. */
static atomic_int g_loaded_released;
#define RELEASED_SCALE -12345.0f /* what a poisoning release callback writes into "scale" */

static void sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

static int cm_forward_body(cmodel *c, const ts_value_t *in, int64_t rows, ts_value_t **out);
static int cm_run(cmodel *c, const ts_value_t *in, int64_t rows, ts_value_t **out);

static int cm_forward(ts_model_t *m, const ts_value_t *in, int64_t rows, ts_value_t **out)
{
    cmodel *c = (cmodel *)m;
    atomic_fetch_add(&g_forwards, 1);
    int rc = cm_forward_body(c, in, rows, out);
    return rc;
}

static int cm_forward_body(cmodel *c, const ts_value_t *in, int64_t rows, ts_value_t **out)
{
    if (atomic_fetch_add(&c->busy, 1) != 0)
        atomic_fetch_add(&g_overlaps, 1);
    int rc = cm_run(c, in, rows, out);
    atomic_fetch_sub(&c->busy, 1);
    return rc;
}

static int cm_run(cmodel *c, const ts_value_t *in, int64_t rows, ts_value_t **out)
{
    int d = atomic_load(&g_delay_us);
    if (d > 0)
        sleep_us(d);
    const ts_value_t *obs = ts_map_get(in, "obs");
    const ts_tensor_t *x = ts_map_get_tensor(obs, "x");
    const ts_tensor_t *id = ts_map_get_tensor(obs, "id");
    if (x == NULL || id == NULL || x->shape[0] != rows || id->shape[0] != rows) {
        ts_set_last_error("bad batch");
        return TS_EINVAL;
    }
    const float *xs = x->data;
    for (int64_t i = 0; i < rows * 4; i++) {
        if (isnan(xs[i])) {
            ts_set_last_error("NaN in the input");
            return TS_EINVAL;
        }
    }
    int64_t s4[2] = {rows, 4}, s1[1] = {rows};
    ts_value_t *y = ts_tensor_alloc(TS_FLOAT32, 2, s4);
    ts_value_t *ido = ts_tensor_new(TS_INT64, 1, s1, id->data, TS_COPY);
    ts_value_t *bt = ts_tensor_alloc(TS_INT64, 1, s1);
    ts_value_t *o = ts_map_new();
    if (y == NULL || ido == NULL || bt == NULL || o == NULL) {
        ts_value_free(y);
        ts_value_free(ido);
        ts_value_free(bt);
        ts_value_free(o);
        return TS_ENOMEM;
    }
    float *ys = ts_value_tensor(y)->data;
    for (int64_t i = 0; i < rows * 4; i++)
        ys[i] = xs[i] * c->scale;
    int64_t *bs = ts_value_tensor(bt)->data;
    for (int64_t i = 0; i < rows; i++)
        bs[i] = rows;
    if (ts_map_set(o, "y", y) != 0 || ts_map_set(o, "id", ido) != 0 ||
        ts_map_set(o, "batch", bt) != 0) {
        ts_value_free(o);
        return TS_ENOMEM;
    }
    *out = o;
    return 0;
}

static int cm_load(ts_model_t *m, const ts_value_t *params)
{
    const ts_tensor_t *s = ts_map_get_tensor(params, "scale");
    if (s == NULL || s->dtype != TS_FLOAT32 || ts_tensor_numel(s) != 1) {
        ts_set_last_error("missing or bad 'scale'");
        return TS_EINVAL;
    }
    cmodel *c = (cmodel *)m;
    if (atomic_fetch_add(&c->busy, 1) != 0)
        atomic_fetch_add(&g_overlaps, 1);
    c->scale = *(const float *)s->data;
    if (c->scale == RELEASED_SCALE)
        atomic_fetch_add(&g_loaded_released, 1);
    sleep_us(200); /* widen the window in which an overlap would show */
    atomic_fetch_sub(&c->busy, 1);
    return 0;
}

static void cm_free(ts_model_t *m)
{
    ts__free(m);
}

static const ts_model_ops_t cm_ops = {cm_forward, cm_load, cm_free};

static atomic_int g_created;

static int cm_create(const char *device, int replica, ts_model_t **out, void *arg)
{
    (void)arg;
    (void)replica;
    if (strncmp(device, "cpu", 3) != 0) {
        ts__set_errorf("device %s: this model runs on CPU only", device);
        return TS_ENOTSUP;
    }
    cmodel *c = ts__calloc(1, sizeof(*c));
    if (c == NULL)
        return TS_ENOMEM;
    c->base.ops = &cm_ops;
    c->scale = 1.0f;
    atomic_fetch_add(&g_created, 1);
    *out = &c->base;
    return 0;
}

static const ts_field_t in_schema[] = {
    {"obs.x", TS_FLOAT32, 1, {4}},
    {"obs.id", TS_INT64, 0, {0}},
};
static const ts_field_t out_schema[] = {
    {"y", TS_FLOAT32, 1, {4}},
    {"id", TS_INT64, 0, {0}},
    {"batch", TS_INT64, 0, {0}},
};

/* The options of make(): the test schema, no model delay, one priority level. */
static void test_options(ts_batcher_options_t *cfg, const char *placement, int max_batch,
                         int64_t delay_us)
{
    ts_batcher_options_init(cfg);
    cfg->inputs = in_schema;
    cfg->n_inputs = 2;
    cfg->outputs = out_schema;
    cfg->n_outputs = 3;
    cfg->max_batch = max_batch;
    cfg->max_delay_us = delay_us;
    cfg->placement = placement;
    cfg->create = cm_create;
}

static ts_batcher_t *make_with(const ts_batcher_options_t *cfg)
{
    ts_batcher_t *b = NULL;
    int rc = ts_batcher_new(&b, cfg);
    if (rc != 0)
        print_error("ts_batcher_new: %s (%s)\n", ts_strerror(rc), ts_last_error());
    assert_int_equal(rc, 0);
    return b;
}

/*
 * A batcher that holds every partial batch for the whole delay (min_delay_us = max_delay_us),
 * for tests that need a batch to run only when it is full or its delay has passed.
 */
static ts_batcher_t *make_held(const char *placement, int max_batch, int64_t delay_us)
{
    ts_batcher_options_t cfg;
    test_options(&cfg, placement, max_batch, delay_us);
    cfg.min_delay_us = delay_us;
    return make_with(&cfg);
}

static ts_batcher_t *make(const char *placement, int max_batch, int64_t delay_us)
{
    ts_batcher_options_t cfg;
    ts_batcher_options_init(&cfg);
    cfg.inputs = in_schema;
    cfg.n_inputs = 2;
    cfg.outputs = out_schema;
    cfg.n_outputs = 3;
    cfg.max_batch = max_batch;
    cfg.max_delay_us = delay_us;
    cfg.placement = placement;
    cfg.create = cm_create;
    ts_batcher_t *b = NULL;
    int rc = ts_batcher_new(&b, &cfg);
    if (rc != 0)
        print_error("ts_batcher_new: %s (%s)\n", ts_strerror(rc), ts_last_error());
    assert_int_equal(rc, 0);
    return b;
}

/* A request of rows rows: x[r][k] = base + r * 4 + k, id[r] = base + r. */
static ts_value_t *request(int64_t rows, int64_t base)
{
    int64_t s4[2] = {rows, 4}, s1[1] = {rows};
    ts_value_t *x = ts_tensor_alloc(TS_FLOAT32, 2, s4);
    ts_value_t *id = ts_tensor_alloc(TS_INT64, 1, s1);
    assert_non_null(x);
    assert_non_null(id);
    float *xs = ts_value_tensor(x)->data;
    int64_t *ids = ts_value_tensor(id)->data;
    for (int64_t r = 0; r < rows; r++) {
        ids[r] = base + r;
        for (int k = 0; k < 4; k++)
            xs[r * 4 + k] = (float)(base + r * 4 + k);
    }
    ts_value_t *obs = ts_map_new(), *root = ts_map_new();
    assert_int_equal(ts_map_set(obs, "x", x), 0);
    assert_int_equal(ts_map_set(obs, "id", id), 0);
    assert_int_equal(ts_map_set(root, "obs", obs), 0);
    return root;
}

/* Check that out holds exactly the rows of request(rows, base), scaled. 1 when it does. */
static int check_answer(const ts_value_t *out, int64_t rows, int64_t base, float scale)
{
    const ts_tensor_t *y = ts_map_get_tensor(out, "y");
    const ts_tensor_t *id = ts_map_get_tensor(out, "id");
    if (y == NULL || id == NULL || y->shape[0] != rows || id->shape[0] != rows)
        return 0;
    const float *ys = y->data;
    const int64_t *ids = id->data;
    for (int64_t r = 0; r < rows; r++) {
        if (ids[r] != base + r)
            return 0;
        for (int k = 0; k < 4; k++)
            if (ys[r * 4 + k] != (float)(base + r * 4 + k) * scale)
                return 0;
    }
    return 1;
}

static void test_single(void **state)
{
    (void)state;
    ts_batcher_t *b = make("cpu", 8, 100);
    assert_int_equal(ts_batcher_replicas(b), 1);
    assert_string_equal(ts_batcher_device(b, 0), "cpu");
    ts_value_t *in = request(3, 100);
    ts_value_t *out = NULL;
    int64_t version = -1;
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, &version), 0);
    assert_int_equal(version, 0);
    assert_true(check_answer(out, 3, 100, 1.0f));
    ts_value_free(out);
    ts_value_free(in);
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    assert_int_equal(st.requests, 1);
    assert_int_equal(st.batches, 1);
    assert_int_equal(st.rows, 3);
    ts_batcher_free(b);
}

/* 64 threads, each with its own mixed row counts, each must get exactly its rows back. */
typedef struct submitter {
    ts_batcher_t *b;
    int index;
    int n_requests;
    int ok;
    int64_t max_seen_batch;
} submitter;

static void *submit_main(void *arg)
{
    submitter *s = arg;
    s->ok = 1;
    for (int i = 0; i < s->n_requests && s->ok; i++) {
        int64_t rows = 1 + (s->index + i) % 4;
        int64_t base = (int64_t)s->index * 1000000 + i * 100;
        ts_value_t *in = request(rows, base);
        ts_value_t *out = NULL;
        int rc = ts_batcher_predict(s->b, in, 20000, &out, NULL);
        if (rc != 0 || !check_answer(out, rows, base, 1.0f)) {
            s->ok = 0;
        } else {
            const ts_tensor_t *bt = ts_map_get_tensor(out, "batch");
            int64_t n = ((const int64_t *)bt->data)[0];
            if (n > s->max_seen_batch)
                s->max_seen_batch = n;
            if (n > 16 || n < rows)
                s->ok = 0;
        }
        ts_value_free(out);
        ts_value_free(in);
    }
    return NULL;
}

static void run_submitters(ts_batcher_t *b, int n_threads, int n_requests, int64_t *max_batch)
{
    pthread_t th[64];
    submitter s[64];
    memset(s, 0, sizeof(s));
    for (int i = 0; i < n_threads; i++) {
        s[i].b = b;
        s[i].index = i;
        s[i].n_requests = n_requests;
        assert_int_equal(pthread_create(&th[i], NULL, submit_main, &s[i]), 0);
    }
    *max_batch = 0;
    for (int i = 0; i < n_threads; i++) {
        pthread_join(th[i], NULL);
        assert_true(s[i].ok);
        if (s[i].max_seen_batch > *max_batch)
            *max_batch = s[i].max_seen_batch;
    }
}

static void test_many_submitters(void **state)
{
    (void)state;
    ts_batcher_t *b = make("cpu:2", 16, 2000);
    atomic_store(&g_forwards, 0);
    int64_t max_batch;
    run_submitters(b, 64, 30, &max_batch);
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    int64_t want_rows = 0;
    for (int t = 0; t < 64; t++)
        for (int i = 0; i < 30; i++)
            want_rows += 1 + (t + i) % 4;
    assert_int_equal(st.requests, 64 * 30);
    assert_int_equal(st.failed, 0);
    assert_int_equal(st.rows, (uint64_t)want_rows);
    assert_int_equal(st.queued, 0);
    /* With 64 submitters and a 2 ms delay, requests must have been batched together. */
    assert_true(st.batches < st.requests);
    assert_true(max_batch > 4);
    print_message("    %llu requests in %llu batches (%.1f rows per batch, %llu full)\n",
                  (unsigned long long)st.requests, (unsigned long long)st.batches,
                  (double)st.rows / (double)st.batches, (unsigned long long)st.full_batches);
    ts_batcher_free(b);
}

/* Asynchronous requests: any number outstanding from one caller. */
typedef struct acount {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done, ok, canceled, timedout, other;
} acount;

typedef struct actx {
    acount *c;
    int64_t rows, base;
    float scale;
    ts_value_t *in;
} actx;

static void async_cb(ts_batcher_t *b, int status, ts_value_t *out, int64_t version, void *arg)
{
    (void)b;
    (void)version;
    actx *a = arg;
    acount *c = a->c;
    int good = status == 0 && check_answer(out, a->rows, a->base, a->scale);
    ts_value_free(out);
    pthread_mutex_lock(&c->mu);
    if (good)
        c->ok++;
    else if (status == TS_ECANCELED && ts_last_error()[0] != '\0')
        c->canceled++;
    else if (status == TS_ETIMEDOUT && ts_last_error()[0] != '\0')
        c->timedout++;
    else
        c->other++;
    c->done++;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

/* One answer more (from a callback). */
static void acount_done(acount *c)
{
    pthread_mutex_lock(&c->mu);
    c->done++;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

static void acount_init(acount *c)
{
    memset(c, 0, sizeof(*c));
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
}

/* Wait until n answers arrived, at most 30 s. 1 when they did. */
static int acount_wait(acount *c, int n)
{
    int ok = 1;
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < 3000 && c->done < n; i++) {
        pthread_mutex_unlock(&c->mu);
        sleep_us(10000);
        pthread_mutex_lock(&c->mu);
    }
    ok = c->done >= n;
    pthread_mutex_unlock(&c->mu);
    return ok;
}

/*
 * n asynchronous requests of 1, 2 and 3 rows in turn (request i's rows start at i * 10), each
 * answer checked row by row by async_cb; returns once all n are answered and correct, with
 * their inputs freed. ctx holds n entries.
 */
static void submit_mixed(ts_batcher_t *b, actx *ctx, int n, acount *c)
{
    acount_init(c);
    for (int i = 0; i < n; i++) {
        ctx[i] = (actx){c, 1 + i % 3, (int64_t)i * 10, 1.0f, NULL};
        ctx[i].in = request(ctx[i].rows, ctx[i].base);
        assert_int_equal(
            ts_batcher_predict_async(b, ctx[i].in, 0, TS_TIMEOUT_DEFAULT, async_cb, &ctx[i]), 0);
    }
    assert_true(acount_wait(c, n));
    assert_int_equal(c->ok, n);
    for (int i = 0; i < n; i++)
        ts_value_free(ctx[i].in);
}

static void test_async(void **state)
{
    (void)state;
    ts_batcher_t *b = make("cpu", 32, 1000);
    enum { N = 200 };
    static actx ctx[N];
    acount c;
    acount_init(&c);
    for (int i = 0; i < N; i++) {
        ctx[i] = (actx){&c, 1 + i % 5, (int64_t)i * 100, 1.0f, NULL};
        ctx[i].in = request(ctx[i].rows, ctx[i].base);
        /* Half retained (borrowed until the callback), half copied and freed at once. */
        unsigned flags = (i % 2) ? TS_COPY : 0;
        assert_int_equal(
            ts_batcher_predict_async(b, ctx[i].in, flags, TS_TIMEOUT_DEFAULT, async_cb, &ctx[i]),
            0);
        if (flags & TS_COPY) {
            ts_value_free(ctx[i].in);
            ctx[i].in = NULL;
        }
    }
    assert_true(acount_wait(&c, N));
    assert_int_equal(c.ok, N);
    for (int i = 0; i < N; i++)
        ts_value_free(ctx[i].in);
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    assert_true(st.batches < N);
    ts_batcher_free(b);
}

static double elapsed_ms(uint64_t t0)
{
    return (double)(ts__now_ns() - t0) / 1e6;
}

/*
 * A lone request held by min_delay waits about max_delay for company, then runs; without
 * min_delay it runs at once (no further request can be expected); a full batch runs at once.
 */
static void test_queue_delay(void **state)
{
    (void)state;
    ts_batcher_t *b = make_held("cpu", 8, 300000); /* 300 ms */
    ts_value_t *in = request(1, 0), *out = NULL;
    uint64_t t0 = ts__now_ns();
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), 0);
    double ms = elapsed_ms(t0);
    print_message("    lone request answered after %.1f ms (max_delay 300 ms)\n", ms);
    assert_true(ms >= 290.0);
    assert_true(ms < 10000.0);
    ts_value_free(out);
    ts_value_free(in);

    ts_batcher_free(b);

    /* A request of max_batch rows fills the batch: no waiting for the (long) delay. */
    b = make("cpu", 8, 20000000); /* 20 s */
    in = request(8, 0);
    t0 = ts__now_ns();
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), 0);
    ms = elapsed_ms(t0);
    assert_true(ms < 10000.0);
    assert_true(check_answer(out, 8, 0, 1.0f));
    ts_value_free(out);
    ts_value_free(in);
    ts_batcher_free(b);

    /* The default rule: a lone request to an idle replica does not wait out a 20 s delay. */
    b = make("cpu", 8, 20000000);
    for (int i = 0; i < 3; i++) {
        in = request(1, 40 + i);
        t0 = ts__now_ns();
        assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), 0);
        assert_true(elapsed_ms(t0) < 10000.0);
        assert_true(check_answer(out, 1, 40 + i, 1.0f));
        ts_value_free(out);
        ts_value_free(in);
    }
    ts_batcher_free(b);

    /* max_delay 0: a lone request runs at once. */
    b = make("cpu", 8, 0);
    in = request(2, 7);
    t0 = ts__now_ns();
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), 0);
    assert_true(elapsed_ms(t0) < 5000.0);
    ts_value_free(out);
    ts_value_free(in);
    ts_batcher_free(b);
}

/* Two requests that fit are one batch; the one that does not fit waits for the next. */
static void test_never_split(void **state)
{
    (void)state;
    /* The held delay keeps the first two together however slow this machine is (a lone first
       request to an idle batcher would otherwise run at once, before the second arrives): the
       third request does not fit, which closes the first batch at once; the third waits alone. */
    ts_batcher_t *b = make_held("cpu", 8, 300000);
    acount c;
    acount_init(&c);
    actx a[3] = {{&c, 3, 0, 1.0f, NULL}, {&c, 4, 1000, 1.0f, NULL}, {&c, 5, 2000, 1.0f, NULL}};
    for (int i = 0; i < 3; i++) {
        a[i].in = request(a[i].rows, a[i].base);
        assert_int_equal(
            ts_batcher_predict_async(b, a[i].in, 0, TS_TIMEOUT_DEFAULT, async_cb, &a[i]), 0);
    }
    assert_true(acount_wait(&c, 3));
    assert_int_equal(c.ok, 3);
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    assert_int_equal(st.batches, 2); /* {3, 4} then {5} */
    assert_int_equal(st.rows, 12);
    for (int i = 0; i < 3; i++)
        ts_value_free(a[i].in);
    ts_batcher_free(b);
}

static void test_schema_errors(void **state)
{
    (void)state;
    ts_batcher_t *b = make("cpu", 8, 100);
    ts_value_t *out = NULL;
    /* Missing field. */
    ts_value_t *in = ts_map_new();
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), TS_ESCHEMA);
    assert_non_null(strstr(ts_last_error(), "obs.x"));
    ts_value_free(in);
    /* Wrong dtype. */
    in = request(2, 0);
    ts_value_t *obs = (ts_value_t *)ts_map_get(in, "obs");
    int64_t s2[2] = {2, 4};
    assert_int_equal(ts_map_set(obs, "x", ts_tensor_alloc(TS_FLOAT64, 2, s2)), 0);
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), TS_ESCHEMA);
    assert_non_null(strstr(ts_last_error(), "float64"));
    /* Wrong per-row shape: the message gives both shapes and the dimension that differs. */
    int64_t s3[2] = {2, 5};
    assert_int_equal(ts_map_set(obs, "x", ts_tensor_alloc(TS_FLOAT32, 2, s3)), 0);
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), TS_ESCHEMA);
    assert_string_equal(ts_last_error(), "field 'obs.x' has per-row shape [5], expected [4] "
                                         "(per-row dimension 0 is 5, expected 4)");
    /* Too few or too many dimensions. */
    int64_t s1[1] = {2};
    assert_int_equal(ts_map_set(obs, "x", ts_tensor_alloc(TS_FLOAT32, 1, s1)), 0);
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), TS_ESCHEMA);
    assert_string_equal(ts_last_error(), "field 'obs.x' has shape [2], expected 2 dimensions (the "
                                         "batch dimension, then the per-row shape [4])");
    int64_t s2x4[2] = {2, 4};
    assert_int_equal(ts_map_set(obs, "x", ts_tensor_alloc(TS_FLOAT32, 2, s2x4)), 0);
    assert_int_equal(ts_map_set(obs, "id", ts_tensor_alloc(TS_INT64, 2, s2x4)), 0);
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), TS_ESCHEMA);
    assert_string_equal(ts_last_error(), "field 'obs.id' has shape [2, 4], expected 1 dimension "
                                         "(the batch dimension: one value per row)");
    assert_int_equal(ts_map_set(obs, "id", ts_tensor_alloc(TS_INT64, 1, s1)), 0);
    /* Row counts that disagree between fields. */
    int64_t s4[2] = {3, 4};
    assert_int_equal(ts_map_set(obs, "x", ts_tensor_alloc(TS_FLOAT32, 2, s4)), 0);
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), TS_ESCHEMA);
    assert_non_null(strstr(ts_last_error(), "as the fields before it"));
    ts_value_free(in);
    /* An extra entry. */
    in = request(2, 0);
    assert_int_equal(ts_map_set(in, "extra", ts_int_new(1)), 0);
    assert_int_equal(ts_batcher_predict_async(b, in, 0, TS_TIMEOUT_DEFAULT, async_cb, NULL),
                     TS_ESCHEMA);
    assert_string_equal(ts_last_error(),
                        "the value has an entry the schema does not name: 'extra'");
    ts_value_free(in);
    /* One deeper, beside the fields of its map: named by its dotted path. */
    in = request(2, 0);
    obs = (ts_value_t *)ts_map_get(in, "obs");
    assert_int_equal(ts_map_set(obs, "more", ts_map_new()), 0);
    assert_int_equal(ts_map_set((ts_value_t *)ts_map_get(obs, "more"), "z", ts_int_new(1)), 0);
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), TS_ESCHEMA);
    assert_string_equal(ts_last_error(),
                        "the value has an entry the schema does not name: 'obs.more'");
    ts_value_free(in);
    /* More rows than max_batch: a request is never split, so it can never run. */
    in = request(9, 0);
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), TS_ESCHEMA);
    ts_value_free(in);
    /* Zero rows. */
    in = request(0, 0);
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), TS_ESCHEMA);
    assert_non_null(strstr(ts_last_error(), "has 0 rows, expected 1 to 8"));
    ts_value_free(in);
    /* A bare tensor where a map is expected. */
    int64_t s5[2] = {1, 4};
    in = ts_tensor_alloc(TS_FLOAT32, 2, s5);
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), TS_ESCHEMA);
    ts_value_free(in);
    /* The batcher still serves good requests, and nothing was counted as a failure. */
    in = request(2, 5);
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), 0);
    assert_true(check_answer(out, 2, 5, 1.0f));
    ts_value_free(out);
    ts_value_free(in);
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    assert_int_equal(st.failed, 0);
    ts_batcher_free(b);
}

/*
 * An output that does not match the output schema fails its batch with TS_EMODEL, and the
 * message says which per-row dimension differs, as a request's schema error does.
 */
static void test_output_schema_mismatch(void **state)
{
    (void)state;
    const ts_field_t wrong_out[] = {
        {"y", TS_FLOAT32, 1, {5}},
        {"id", TS_INT64, 0, {0}},
        {"batch", TS_INT64, 0, {0}},
    };
    ts_batcher_options_t cfg;
    test_options(&cfg, "cpu", 4, 0);
    cfg.outputs = wrong_out;
    ts_batcher_t *b = make_with(&cfg);
    ts_value_t *in = request(2, 0), *out = NULL;
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), TS_EMODEL);
    assert_string_equal(ts_last_error(),
                        "model output does not match the schema: field 'y' has per-row shape "
                        "[4], expected [5] (per-row dimension 0 is 4, expected 5)");
    ts_value_free(in);
    ts_batcher_free(b);
}

/* A failing forward fails the requests of its batch only; the replica keeps serving. */
static void test_model_failure(void **state)
{
    (void)state;
    /* Three requests of 2 rows fill max_batch 6: one batch, however slow the submits (the held
       delay keeps a lone first request from running at once). */
    ts_batcher_t *b = make_held("cpu", 6, 20000000);
    acount c;
    acount_init(&c);
    actx a[3] = {{&c, 2, 0, 1.0f, NULL}, {&c, 2, 100, 1.0f, NULL}, {&c, 2, 200, 1.0f, NULL}};
    for (int i = 0; i < 3; i++)
        a[i].in = request(2, a[i].base);
    float *x1 = ts_value_tensor(ts_map_get(ts_map_get(a[1].in, "obs"), "x"))->data;
    x1[3] = NAN;
    for (int i = 0; i < 3; i++)
        assert_int_equal(
            ts_batcher_predict_async(b, a[i].in, 0, TS_TIMEOUT_DEFAULT, async_cb, &a[i]), 0);
    assert_true(acount_wait(&c, 3));
    /* All three were one batch: all fail. */
    assert_int_equal(c.other, 3);
    for (int i = 0; i < 3; i++)
        ts_value_free(a[i].in);

    ts_value_t *in = request(6, 1), *out = NULL; /* a full batch: no waiting for the delay */
    float *x = ts_value_tensor(ts_map_get(ts_map_get(in, "obs"), "x"))->data;
    x[0] = NAN;
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), TS_EMODEL);
    assert_non_null(strstr(ts_last_error(), "NaN"));
    x[0] = 1.0f;
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), 0);
    ts_value_free(out);
    ts_value_free(in);
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    assert_int_equal(st.failed, 4);
    assert_int_equal(st.requests, 1);
    ts_batcher_free(b);
}

/* A thread making one blocking predict of one row. */
typedef struct pthr {
    ts_batcher_t *b;
    ts_value_t *in;
    int64_t base;
    int rc;
    int ok;
} pthr;

static void *pthr_main(void *arg)
{
    pthr *p = arg;
    ts_value_t *out = NULL;
    p->rc = ts_batcher_predict(p->b, p->in, 20000, &out, NULL);
    p->ok = p->rc == 0 && check_answer(out, 1, p->base, 1.0f);
    ts_value_free(out);
    return NULL;
}

static void start_pthr(pthr *p, pthread_t *th, ts_batcher_t *b, int64_t base)
{
    *p = (pthr){b, request(1, base), base, -1, 0};
    assert_int_equal(pthread_create(th, NULL, pthr_main, p), 0);
}

/*
 * Blocking predicts that share a batch are each woken once with their own rows, or with the
 * batch's error when it fails, also when callbacks of asynchronous requests share the batch.
 */
static void test_predict_batch_wakeups(void **state)
{
    (void)state;
    /* max_batch 4 and a 20 s delay: a batch runs exactly when its fourth row arrives. */
    ts_batcher_t *b = make_held("cpu", 4, 20000000);
    enum { T = 4, ROUNDS = 20 };
    pthread_t th[T];
    pthr p[T];
    for (int round = 0; round < ROUNDS; round++) {
        for (int i = 0; i < T; i++)
            start_pthr(&p[i], &th[i], b, (int64_t)round * 1000 + i * 10);
        for (int i = 0; i < T; i++) {
            pthread_join(th[i], NULL);
            assert_int_equal(p[i].rc, 0);
            assert_true(p[i].ok);
            ts_value_free(p[i].in);
        }
    }

    /* Two blocking predicts, one with a NaN, and two callbacks: one batch, all failing. */
    acount c;
    acount_init(&c);
    actx a[2] = {{&c, 1, 500000, 1.0f, NULL}, {&c, 1, 500100, 1.0f, NULL}};
    p[0] = (pthr){b, request(1, 600000), 600000, -1, 0};
    float *x = ts_value_tensor(ts_map_get(ts_map_get(p[0].in, "obs"), "x"))->data;
    x[0] = NAN;
    assert_int_equal(pthread_create(&th[0], NULL, pthr_main, &p[0]), 0);
    start_pthr(&p[1], &th[1], b, 600100);
    for (int i = 0; i < 2; i++) {
        a[i].in = request(1, a[i].base);
        assert_int_equal(
            ts_batcher_predict_async(b, a[i].in, 0, TS_TIMEOUT_DEFAULT, async_cb, &a[i]), 0);
    }
    for (int i = 0; i < 2; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(p[i].rc, TS_EMODEL);
        ts_value_free(p[i].in);
    }
    assert_true(acount_wait(&c, 2));
    assert_int_equal(c.other, 2);
    for (int i = 0; i < 2; i++)
        ts_value_free(a[i].in);

    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    assert_int_equal(st.requests, T * ROUNDS);
    assert_int_equal(st.failed, 4);
    assert_int_equal(st.batches, ROUNDS + 1);
    assert_int_equal(st.full_batches, ROUNDS + 1);
    ts_batcher_free(b);
}

/* Weights change while 8 threads predict: each answer matches exactly the version it reports. */
typedef struct vsub {
    ts_batcher_t *b;
    int index;
    atomic_int *stop;
    int ok;
    atomic_int n;
    int64_t last_version;
    int versions_seen;
} vsub;

static void *vsub_main(void *arg)
{
    vsub *s = arg;
    s->ok = 1;
    s->last_version = -1;
    for (int i = 0; i < 100000 && !atomic_load(s->stop); i++) {
        int64_t rows = 1 + (s->index + i) % 3;
        int64_t base = (int64_t)s->index * 1000000 + (i % 1000) * 10;
        ts_value_t *in = request(rows, base), *out = NULL;
        int64_t v = -1;
        int rc = ts_batcher_predict(s->b, in, 20000, &out, &v);
        float scale = v == 0 ? 1.0f : (float)v;
        if (rc != 0 || !check_answer(out, rows, base, scale))
            s->ok = 0;
        /* One replica: versions never go back. */
        if (v < s->last_version)
            s->ok = 0;
        if (v != s->last_version)
            s->versions_seen++;
        s->last_version = v;
        atomic_fetch_add(&s->n, 1);
        ts_value_free(out);
        ts_value_free(in);
    }
    return NULL;
}

static ts_value_t *scale_params(float scale)
{
    ts_value_t *p = ts_map_new();
    assert_int_equal(ts_map_set(p, "scale", ts_tensor_new(TS_FLOAT32, 0, NULL, &scale, TS_COPY)),
                     0);
    return p;
}

static void test_weights_midstream(void **state)
{
    (void)state;
    ts_batcher_t *b = make("cpu", 16, 500);
    atomic_int stop = 0;
    vsub s[8];
    pthread_t th[8];
    for (int i = 0; i < 8; i++) {
        s[i] = (vsub){b, i, &stop, 0, 0, 0, 0};
        atomic_init(&s[i].n, 0);
        assert_int_equal(pthread_create(&th[i], NULL, vsub_main, &s[i]), 0);
    }
    for (int v = 1; v <= 20; v++) {
        sleep_us(5000);
        ts_value_t *p = scale_params((float)v);
        assert_int_equal(ts_batcher_load_weights(b, p, v, 20000), 0);
        ts_value_free(p);
        int64_t lo, hi;
        ts_batcher_versions(b, &lo, &hi);
        assert_int_equal(lo, v);
        assert_int_equal(hi, v);
    }
    /* Every requester is answered at least twice more (by version 20), however busy the
       machine: a fixed pause let a starved thread stop with an older last answer. */
    int seen[8];
    for (int i = 0; i < 8; i++)
        seen[i] = atomic_load(&s[i].n);
    for (int i = 0, waited = 0; i < 8 && waited < 10000; waited++) {
        if (atomic_load(&s[i].n) >= seen[i] + 2)
            i++;
        else
            sleep_us(1000);
    }
    atomic_store(&stop, 1);
    int total = 0;
    for (int i = 0; i < 8; i++) {
        pthread_join(th[i], NULL);
        assert_true(s[i].ok);
        assert_int_equal(s[i].last_version, 20);
        total += atomic_load(&s[i].n);
    }
    print_message("    %d answers over 20 weight versions\n", total);
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    assert_int_equal(st.weight_loads, 20);

    /* A bad update is reported with the replica's message; the old weights stay. */
    ts_value_t *bad = ts_map_new();
    assert_int_equal(ts_batcher_load_weights(b, bad, 21, 20000), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "scale"));
    ts_value_free(bad);
    int64_t lo, hi;
    ts_batcher_versions(b, &lo, &hi);
    assert_int_equal(lo, 20);
    ts_batcher_free(b);
}

/* Asynchronous updates: the release callback runs once the replicas are done with them. */
static atomic_int g_released;

static void release_cb(const ts_value_t *params, void *arg)
{
    (void)arg;
    ts_value_free((ts_value_t *)params);
    atomic_fetch_add(&g_released, 1);
}

static void test_weights_async(void **state)
{
    (void)state;
    atomic_store(&g_released, 0);
    ts_batcher_t *b = make("cpu:3", 8, 100);
    for (int v = 1; v <= 50; v++)
        assert_int_equal(
            ts_batcher_load_weights_async(b, scale_params((float)v), v, release_cb, NULL), 0);
    /* Superseded updates are released without being loaded; the last one reaches everyone. */
    int64_t lo = 0;
    for (int i = 0; i < 1000 && lo != 50; i++) {
        ts_batcher_versions(b, &lo, NULL);
        sleep_us(5000);
    }
    assert_int_equal(lo, 50);
    ts_value_t *in = request(1, 3), *out = NULL;
    int64_t v;
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, &v), 0);
    assert_int_equal(v, 50);
    assert_true(check_answer(out, 1, 3, 50.0f));
    ts_value_free(out);
    ts_value_free(in);
    /* One pending update stays unreleased until freed. */
    assert_int_equal(ts_batcher_load_weights_async(b, scale_params(51.0f), 51, release_cb, NULL),
                     0);
    ts_batcher_free(b);
    assert_int_equal(atomic_load(&g_released), 51);
}

/*
 * An update published just before shutdown: the replica that loads it first may release it as
 * the batcher stops (nobody else is loading it), and a replica coming after must then skip it,
 * not load parameters the caller has taken back. The release callback poisons the parameters
 * (and keeps them allocated, so that the check needs no sanitizer); a load that sees the
 * poison counts.
 */
#define SHUTDOWN_ROUNDS 100 /* batchers made and freed; the race needs a few tries to show */

static void poison_release_cb(const ts_value_t *params, void *arg)
{
    (void)arg;
    *(float *)ts_map_get_tensor(params, "scale")->data = RELEASED_SCALE;
    atomic_fetch_add(&g_released, 1);
}

static void test_weights_at_shutdown(void **state)
{
    (void)state;
    atomic_store(&g_loaded_released, 0);
    atomic_store(&g_released, 0);
    ts_value_t *params[SHUTDOWN_ROUNDS];
    for (int i = 0; i < SHUTDOWN_ROUNDS; i++) {
        ts_batcher_t *b = make("cpu:4", 8, 100);
        params[i] = scale_params(2.0f);
        assert_int_equal(ts_batcher_load_weights_async(b, params[i], 2, poison_release_cb, NULL),
                         0);
        if (i % 2 == 1)
            sleep_us(150); /* sometimes while the first replica is still loading */
        ts_batcher_free(b);
    }
    assert_int_equal(atomic_load(&g_released), SHUTDOWN_ROUNDS);
    for (int i = 0; i < SHUTDOWN_ROUNDS; i++)
        ts_value_free(params[i]);
    assert_int_equal(atomic_load(&g_loaded_released), 0);
}

/* A release callback that takes its time, so that new publishes land while it runs. */
static void slow_release_cb(const ts_value_t *params, void *arg)
{
    (void)arg;
    sleep_us(2000);
    ts_value_free((ts_value_t *)params);
    atomic_fetch_add(&g_released, 1);
}

/*
 * An update is released by the replica that loaded it last while the next publish replaces
 * it: each update must be released exactly once and freed exactly once (ASan sees a double
 * free or a read of a freed update).
 */
static void test_weights_release_race(void **state)
{
    (void)state;
    atomic_store(&g_released, 0);
    ts_batcher_t *b = make("cpu:2", 8, 100);
    enum { N = 150 };
    for (int v = 1; v <= N; v++) {
        assert_int_equal(
            ts_batcher_load_weights_async(b, scale_params((float)v), v, slow_release_cb, NULL), 0);
        sleep_us((v % 5) * 300); /* land before, during and after the loads and releases */
    }
    int64_t lo = 0;
    for (int i = 0; i < 2000 && lo != N; i++) {
        ts_batcher_versions(b, &lo, NULL);
        sleep_us(5000);
    }
    assert_int_equal(lo, N);
    ts_batcher_free(b);
    assert_int_equal(atomic_load(&g_released), N);
}

/* A queued request past its deadline fails with TS_ETIMEDOUT; the running one completes. */
static void test_deadline(void **state)
{
    (void)state;
    ts_batcher_t *b = make("cpu", 1, 0);
    atomic_store(&g_delay_us, 400000);
    acount c;
    acount_init(&c);
    actx a[2] = {{&c, 1, 0, 1.0f, NULL}, {&c, 1, 10, 1.0f, NULL}};
    a[0].in = request(1, 0);
    a[1].in = request(1, 10);
    int f0 = atomic_load(&g_forwards);
    assert_int_equal(ts_batcher_predict_async(b, a[0].in, 0, TS_TIMEOUT_DEFAULT, async_cb, &a[0]),
                     0);
    /*
     * Let the replica take the first one: wait until its forward has begun (a fixed sleep is not
     * enough on a loaded machine, where the second request would join the first one's batch).
     */
    for (int i = 0; i < 10000 && atomic_load(&g_forwards) == f0; i++)
        sleep_us(1000);
    assert_true(atomic_load(&g_forwards) > f0);
    uint64_t t0 = ts__now_ns();
    ts_value_t *out = NULL;
    assert_int_equal(ts_batcher_predict(b, a[1].in, 50, &out, NULL), TS_ETIMEDOUT);
    double ms = elapsed_ms(t0);
    assert_true(ms >= 45.0 && ms < 5000.0);
    assert_true(acount_wait(&c, 1));
    assert_int_equal(c.ok, 1);
    atomic_store(&g_delay_us, 0);
    ts_value_free(a[0].in);
    ts_value_free(a[1].in);
    ts_batcher_free(b);
}

/*
 * Many queued requests with two timeouts, drained by small batches while the short deadlines
 * pass: batches take requests out of a large deadline heap (one by one) and out of a small one
 * (rebuilt), and the timer must still find every short deadline in what remains.
 */
typedef struct dslot {
    acount *c;
    ts_value_t *in;
    int64_t base;
    int status, good;
} dslot;

static void dslot_cb(ts_batcher_t *b, int status, ts_value_t *out, int64_t version, void *arg)
{
    (void)b;
    (void)version;
    dslot *d = arg;
    d->status = status;
    d->good = status == 0 && check_answer(out, 1, d->base, 1.0f);
    ts_value_free(out);
    acount_done(d->c);
}

static void test_deadline_heap(void **state)
{
    (void)state;
    ts_batcher_t *b = make("cpu", 8, 0);
    atomic_store(&g_delay_us, 50000); /* 50 ms per forward: 8 requests per 50 ms */
    enum { N = 200 };
    static dslot d[N + 1];
    acount c;
    acount_init(&c);
    for (int i = 0; i <= N; i++) {
        d[i] = (dslot){&c, NULL, (int64_t)i * 10, -1, 0};
        d[i].in = request(1, d[i].base);
    }
    /* The first keeps the replica busy while the others queue. */
    assert_int_equal(ts_batcher_predict_async(b, d[N].in, 0, TS_TIMEOUT_DEFAULT, dslot_cb, &d[N]),
                     0);
    sleep_us(10000);
    for (int i = 0; i < N; i++) {
        int timeout_ms = i % 2 == 0 ? 125 : 20000;
        assert_int_equal(ts_batcher_predict_async(b, d[i].in, 0, timeout_ms, dslot_cb, &d[i]), 0);
    }
    assert_true(acount_wait(&c, N + 1));
    atomic_store(&g_delay_us, 0);
    int timed_out = 0;
    for (int i = 0; i <= N; i++) {
        if (i % 2 == 1 || i == N)
            assert_true(d[i].good);
        else if (d[i].status == TS_ETIMEDOUT)
            timed_out++;
        else
            assert_true(d[i].good);
        ts_value_free(d[i].in);
    }
    /* By 125 ms at most the first three batches (24 requests) ran: the later short ones expire. */
    print_message("    %d of %d short-deadline requests timed out\n", timed_out, N / 2);
    assert_true(timed_out >= (N - 40) / 2);
    ts_batcher_free(b);
}

/*
 * Requesters that submit their next request from the callback of the previous one (an event
 * loop's actors). The replica that answers them comes back to the queue for what they submit.
 */
typedef struct loop_actor {
    acount *c;
    ts_value_t *in;
    int64_t base;
    int left; /* requests still to submit */
    int bad;
} loop_actor;

static void loop_cb(ts_batcher_t *b, int status, ts_value_t *out, int64_t version, void *arg)
{
    (void)version;
    loop_actor *a = arg;
    if (status != 0 || !check_answer(out, 1, a->base, 1.0f))
        a->bad++;
    ts_value_free(out);
    if (a->left > 0) {
        a->left--;
        if (ts_batcher_predict_async(b, a->in, 0, TS_TIMEOUT_DEFAULT, loop_cb, a) == 0)
            return;
        a->bad++;
    }
    acount_done(a->c);
}

static void run_loop(ts_batcher_t *b, int n_actors, int n_requests)
{
    static loop_actor la[1024];
    assert_true(n_actors <= 1024);
    acount c;
    acount_init(&c);
    for (int i = 0; i < n_actors; i++) {
        la[i] = (loop_actor){&c, NULL, (int64_t)i * 10, n_requests - 1, 0};
        la[i].in = request(1, la[i].base);
    }
    for (int i = 0; i < n_actors; i++)
        assert_int_equal(
            ts_batcher_predict_async(b, la[i].in, 0, TS_TIMEOUT_DEFAULT, loop_cb, &la[i]), 0);
    assert_true(acount_wait(&c, n_actors));
    for (int i = 0; i < n_actors; i++) {
        assert_int_equal(la[i].bad, 0);
        ts_value_free(la[i].in);
    }
}

static void test_closed_loop(void **state)
{
    (void)state;
    /* The delay is 20 s and held, so a batch only runs full: every batch holds all 32 actors. */
    enum { A = 32, R = 50 };
    ts_batcher_t *b = make_held("cpu:2", A, 20000000);
    run_loop(b, A, R);
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    assert_int_equal(st.requests, A * R);
    assert_int_equal(st.batches, R);
    assert_int_equal(st.full_batches, R);
    ts_batcher_free(b);

    /* One actor never fills a batch: held, each request waits out the 2 ms delay, then runs. */
    b = make_held("cpu:2", 8, 2000);
    uint64_t t0 = ts__now_ns();
    run_loop(b, 1, 20);
    double ms = elapsed_ms(t0);
    print_message("    20 lone requests from callbacks answered in %.1f ms\n", ms);
    assert_true(ms >= 36.0 && ms < 10000.0);
    ts_batcher_stats(b, &st);
    assert_int_equal(st.requests, 20);
    ts_batcher_free(b);

    /*
     * The default rule with a 20 s delay and max_batch above the actors: every actor the
     * batcher knows of is waiting once a batch's callbacks have resubmitted, so no batch waits
     * for the delay (50 rounds would take 1000 s).
     */
    b = make("cpu:2", 64, 20000000);
    t0 = ts__now_ns();
    run_loop(b, A, R);
    ts_batcher_free(b);
    /* (A fresh batcher: the 31 actors that stopped would cost the next batch one delay.) */
    b = make("cpu:2", 64, 20000000);
    run_loop(b, 1, 20);
    ms = elapsed_ms(t0);
    print_message("    %d + 20 requests from callbacks, 20 s delay, answered in %.1f ms\n", A * R,
                  ms);
    assert_true(ms < 15000.0);
    ts_batcher_stats(b, &st);
    assert_int_equal(st.requests, 20);
    ts_batcher_free(b);
}

/*
 * answer_threads: large batches are answered in parts by helper threads. Each answer still
 * holds exactly its rows; requesters that submit again from callbacks running on the helpers
 * still come back as full batches (the replica takes the queue once every part is answered).
 */
static void test_answer_threads(void **state)
{
    (void)state;
    ts_batcher_options_t cfg;
    test_options(&cfg, "cpu:2", 256, 20000000);
    cfg.min_delay_us = cfg.max_delay_us; /* batches run only when full */
    cfg.answer_threads = 3;
    ts_batcher_t *b = make_with(&cfg);
    enum { A = 256, R = 20 };
    run_loop(b, A, R);
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    assert_int_equal(st.requests, A * R);
    assert_int_equal(st.batches, R);
    assert_int_equal(st.full_batches, R);
    ts_batcher_free(b);

    /* Mixed row counts from outside the batcher, split answers checked row by row. */
    cfg.min_delay_us = 0;
    cfg.max_delay_us = 1000;
    cfg.answer_threads = 2;
    b = make_with(&cfg);
    enum { N = 600 };
    static actx ctx[N];
    acount c;
    submit_mixed(b, ctx, N, &c);
    cfg.answer_threads = TS_BATCHER_MAX_ANSWER_THREADS + 1;
    ts_batcher_t *bad = NULL;
    assert_int_equal(ts_batcher_new(&bad, &cfg), TS_EINVAL);
    ts_batcher_free(b);
}

/* Where a callback ran: its thread's name (the batcher names its threads). */
typedef struct where {
    acount c;
    char name[32];
    long slack; /* the thread's timer slack in ns (Linux), else -1 */
    int good;
} where;

static void where_cb(ts_batcher_t *b, int status, ts_value_t *out, int64_t version, void *arg)
{
    (void)b;
    (void)version;
    where *w = arg;
    w->good = status == 0 && check_answer(out, 1, 70, 1.0f);
    ts_value_free(out);
    (void)pthread_getname_np(pthread_self(), w->name, sizeof(w->name));
#ifdef __linux__
    w->slack = (long)prctl(PR_GET_TIMERSLACK, 0UL, 0UL, 0UL, 0UL);
#else
    w->slack = -1;
#endif
    acount_done(&w->c);
}

/* A callback that takes its time on the helper, so that answers are being handed out. */
static void slow_cb(ts_batcher_t *b, int status, ts_value_t *out, int64_t version, void *arg)
{
    (void)b;
    (void)status;
    (void)version;
    ts_value_free(out);
    sleep_us(50000);
    atomic_fetch_add((atomic_int *)arg, 1);
}

/* The engine's test hook (batcher/batcher_internal.h; this test links the engine's objects). */
extern void (*ts__batcher_look_hook)(void);

/* The replica's look, held open until the test has published its weights. */
static atomic_int g_looking, g_published;

static void look_hook(void)
{
    atomic_store(&g_looking, 1);
    for (int i = 0; i < 2000 && !atomic_load(&g_published); i++)
        sleep_us(1000);
}

static void *publish_main(void *arg)
{
    ts_batcher_t *b = arg;
    for (int i = 0; i < 2000 && !atomic_load(&g_looking); i++)
        sleep_us(1000);
    ts_value_t *p = scale_params(2.0f);
    /* Published before the look ends, then waited for: the replica must load it. */
    intptr_t rc = ts_batcher_load_weights_async(b, p, 2, release_cb, NULL);
    atomic_store(&g_published, 1);
    return (void *)rc;
}

/*
 * overlap_answers: while a helper hands out answers, the replica looks for their requests before
 * it sleeps. Weights published during that look are loaded right after it, not at the next
 * request (a blocking load would otherwise time out, or wait for the next request forever with
 * TS_TIMEOUT_INFINITE). The test hook holds the look open until the weights are published.
 */
static void test_overlap_weights(void **state)
{
    (void)state;
    ts_batcher_options_t cfg;
    test_options(&cfg, "cpu", 8, 0);
    cfg.answer_threads = 1;
    cfg.overlap_answers = 1;
    ts_batcher_t *b = make_with(&cfg);
    atomic_int answered;
    atomic_init(&answered, 0);
    atomic_store(&g_looking, 0);
    atomic_store(&g_published, 0);
    atomic_store(&g_released, 0);
    ts__batcher_look_hook = look_hook;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, publish_main, b), 0);
    ts_value_t *in = request(1, 4);
    assert_int_equal(ts_batcher_predict_async(b, in, 0, TS_TIMEOUT_DEFAULT, slow_cb, &answered), 0);
    void *rc = NULL;
    pthread_join(th, &rc);
    assert_int_equal((intptr_t)rc, 0);
    assert_true(atomic_load(&g_looking));
    /* Loaded while the helper still sits in the 50 ms callback, with no request queued. */
    int64_t lo = -1;
    for (int i = 0; i < 2000 && lo != 2; i++) {
        ts_batcher_versions(b, &lo, NULL);
        if (lo != 2)
            sleep_us(1000);
    }
    ts__batcher_look_hook = NULL;
    assert_int_equal(lo, 2);
    for (int i = 0; i < 2000 && atomic_load(&answered) < 1; i++)
        sleep_us(1000);
    assert_int_equal(atomic_load(&answered), 1);
    ts_batcher_free(b);
    assert_int_equal(atomic_load(&g_released), 1);
    ts_value_free(in);
}

/*
 * overlap_answers: a replica hands each batch's answers to the helpers and runs its next batch
 * meanwhile. Twice max_batch actors in a closed loop keep two batches in flight; every answer
 * still holds exactly its rows, and the counters add up. Callbacks run on the helpers only
 * (also a lone request's), and the option needs helpers.
 */
static void test_overlap_answers(void **state)
{
    (void)state;
    for (int helpers = 1; helpers <= 3; helpers += 2) {
        ts_batcher_options_t cfg;
        test_options(&cfg, helpers == 1 ? "cpu" : "cpu:2", 128, 500);
        cfg.answer_threads = helpers;
        cfg.overlap_answers = 1;
        ts_batcher_t *b = make_with(&cfg);
        enum { A = 256, R = 30 };
        run_loop(b, A, R);
        ts_batcher_stats_t st;
        ts_batcher_stats(b, &st);
        print_message("    %d helper(s): %llu requests in %llu batches\n", helpers,
                      (unsigned long long)st.requests, (unsigned long long)st.batches);
        assert_int_equal(st.requests, A * R);
        assert_int_equal(st.submitted, st.requests + st.failed);
        assert_int_equal(st.failed, 0);
        assert_int_equal(st.rows, A * R);
        uint64_t batches = 0, requests = 0, out_ns = 0;
        for (int i = 0; i < ts_batcher_replicas(b); i++) {
            ts_batcher_replica_stats_t rs;
            assert_int_equal(ts_batcher_replica_stats(b, i, &rs), 0);
            batches += rs.batches;
            requests += rs.requests;
            out_ns += rs.output_ns;
        }
        assert_int_equal(batches, st.batches);
        assert_int_equal(requests, st.requests);
        assert_true(out_ns > 0); /* counted by the helpers */

        /* Mixed row counts from outside the batcher, answered row by row. */
        enum { N = 600 };
        static actx ctx[N];
        acount c;
        submit_mixed(b, ctx, N, &c);

        /* A lone request is answered by a helper too. */
        static where w;
        memset(&w, 0, sizeof(w));
        acount_init(&w.c);
        ts_value_t *in = request(1, 70);
        assert_int_equal(ts_batcher_predict_async(b, in, 0, TS_TIMEOUT_DEFAULT, where_cb, &w), 0);
        assert_true(acount_wait(&w.c, 1));
        assert_true(w.good);
        assert_int_equal(strncmp(w.name, "ts-answer-", 10), 0);
        ts_value_free(in);
        ts_batcher_free(b);
    }
    ts_batcher_options_t cfg;
    test_options(&cfg, "cpu", 8, 500);
    cfg.overlap_answers = 1; /* without helpers */
    ts_batcher_t *bad = NULL;
    assert_int_equal(ts_batcher_new(&bad, &cfg), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "answer_threads"));
}

/*
 * Replica threads wake from their holds on time: their timer slack is 1 ns (Linux's default of
 * 50 us made a hold of a forward's length last several times that). Without answer helpers the
 * callback runs on the replica's thread, so it reads the replica's own slack.
 */
static void test_replica_timer_slack(void **state)
{
    (void)state;
    ts_batcher_t *b = make("cpu", 8, 500);
    static where w;
    memset(&w, 0, sizeof(w));
    acount_init(&w.c);
    ts_value_t *in = request(1, 70);
    assert_int_equal(ts_batcher_predict_async(b, in, 0, TS_TIMEOUT_DEFAULT, where_cb, &w), 0);
    assert_true(acount_wait(&w.c, 1));
    assert_true(w.good);
    assert_int_equal(strncmp(w.name, "ts-replica-", 11), 0);
#ifdef __linux__
    assert_int_equal(w.slack, 1);
#endif
    ts_value_free(in);
    ts_batcher_free(b);
}

/* Blocking requester threads, each predicting in a loop until told to stop. */
typedef struct loop_thread {
    ts_batcher_t *b;
    int64_t base;
    atomic_int *answered, *stop;
    int bad;
} loop_thread;

static void *loop_thread_main(void *arg)
{
    loop_thread *t = arg;
    ts_value_t *in = request(1, t->base);
    while (!atomic_load(t->stop)) {
        ts_value_t *out = NULL;
        int rc = ts_batcher_predict(t->b, in, 60000, &out, NULL);
        if (rc != 0 || !check_answer(out, 1, t->base, 1.0f))
            t->bad++;
        else
            atomic_fetch_add(t->answered, 1);
        ts_value_free(out);
    }
    ts_value_free(in);
    return NULL;
}

/*
 * Blocking requesters never wait out the delay when all of them are already waiting: 8 threads,
 * max_batch 64 (never full) and a 20 s delay get 240 answers in far less than one delay. (The
 * threads only stop afterwards: a requester that goes away costs the next batch one delay, and
 * the test then fills that batch itself.)
 */
static void test_never_wait_for_nothing(void **state)
{
    (void)state;
    enum { T = 8, N = 240 };
    for (int rep = 0; rep < 2; rep++) {
        ts_batcher_t *b = make(rep == 0 ? "cpu" : "cpu:2", 64, 20000000);
        pthread_t th[T];
        loop_thread lt[T];
        atomic_int answered, stop;
        atomic_init(&answered, 0);
        atomic_init(&stop, 0);
        uint64_t t0 = ts__now_ns();
        for (int i = 0; i < T; i++) {
            lt[i] = (loop_thread){b, (int64_t)i * 100, &answered, &stop, 0};
            assert_int_equal(pthread_create(&th[i], NULL, loop_thread_main, &lt[i]), 0);
        }
        for (int i = 0; i < 15000 && atomic_load(&answered) < N; i++)
            sleep_us(1000);
        double ms = elapsed_ms(t0);
        int got = atomic_load(&answered);
        atomic_store(&stop, 1);
        /* Fill whatever batch the stopping threads leave behind, so that it runs at once. */
        acount c;
        acount_init(&c);
        static actx fill[64];
        for (int i = 0; i < 64; i++) {
            fill[i] = (actx){&c, 1, 500000 + i * 10, 1.0f, request(1, 500000 + i * 10)};
            assert_int_equal(
                ts_batcher_predict_async(b, fill[i].in, 0, TS_TIMEOUT_DEFAULT, async_cb, &fill[i]),
                0);
        }
        for (int i = 0; i < T; i++) {
            pthread_join(th[i], NULL);
            assert_int_equal(lt[i].bad, 0);
        }
        assert_true(acount_wait(&c, 64));
        assert_int_equal(c.ok, 64);
        for (int i = 0; i < 64; i++)
            ts_value_free(fill[i].in);
        ts_batcher_stats_t st;
        ts_batcher_stats(b, &st);
        print_message("    %d blocking requesters on %s: %d answers in %.1f ms, %.1f rows per "
                      "forward\n",
                      T, rep == 0 ? "cpu" : "cpu:2", got, ms, (double)st.rows / (double)st.batches);
        assert_true(got >= N);
        assert_true(ms < 15000.0);
        ts_batcher_free(b);
    }
}

/* The replica is kept busy by a first request while the test queues others behind it. */
static void busy_start(ts_batcher_t *b, actx *blocker, acount *c, int delay_us)
{
    atomic_store(&g_delay_us, delay_us);
    *blocker = (actx){c, 1, 999000, 1.0f, request(1, 999000)};
    assert_int_equal(
        ts_batcher_predict_async(b, blocker->in, 0, TS_TIMEOUT_DEFAULT, async_cb, blocker), 0);
    /* Wait until the replica has taken it: the queue is empty again. */
    ts_batcher_stats_t st;
    for (int i = 0; i < 2000; i++) {
        ts_batcher_stats(b, &st);
        if (st.queued == 0)
            break;
        sleep_us(1000);
    }
    sleep_us(5000);
}

/* The order in which callbacks ran (prio_cb). */
static atomic_int g_order;

typedef struct pslot {
    acount *c;
    ts_value_t *in;
    int64_t base;
    int prio, status, good, order, calls;
} pslot;

static void pslot_cb(ts_batcher_t *b, int status, ts_value_t *out, int64_t version, void *arg)
{
    (void)b;
    (void)version;
    pslot *p = arg;
    p->status = status;
    p->good = status == 0 && check_answer(out, 1, p->base, 1.0f);
    p->order = atomic_fetch_add(&g_order, 1);
    ts_value_free(out);
    pthread_mutex_lock(&p->c->mu);
    p->calls++;
    p->c->done++;
    pthread_cond_broadcast(&p->c->cv);
    pthread_mutex_unlock(&p->c->mu);
}

/* A zero-size-row answer's callback: good is the answer's rows when it is [rows, 3, 0]. */
static void zero_cb(ts_batcher_t *b, int status, ts_value_t *out, int64_t version, void *arg)
{
    (void)b;
    (void)version;
    pslot *p = arg;
    const ts_tensor_t *t = status == 0 ? ts_value_tensor(out) : NULL;
    p->status = status;
    p->good =
        t != NULL && t->ndim == 3 && t->shape[1] == 3 && t->shape[2] == 0 ? (int)t->shape[0] : -1;
    ts_value_free(out);
    pthread_mutex_lock(&p->c->mu);
    p->calls++;
    p->c->done++;
    pthread_cond_broadcast(&p->c->cv);
    pthread_mutex_unlock(&p->c->mu);
}

/* Under load (the replica busy, a queue behind it), every urgent request is served first. */
static void test_priorities(void **state)
{
    (void)state;
    ts_batcher_options_t cfg;
    test_options(&cfg, "cpu", 2, 0);
    cfg.priority_levels = 3;
    cfg.default_priority = 1;
    ts_batcher_t *b = make_with(&cfg);
    acount c, cb;
    acount_init(&c);
    acount_init(&cb);
    actx blocker;
    busy_start(b, &blocker, &cb, 100000);
    atomic_store(&g_delay_us, 2000);
    atomic_store(&g_order, 0);
    enum { N = 12 };
    pslot p[N];
    for (int i = 0; i < N; i++) {
        /* Least urgent first, then the default level, then the most urgent. */
        int prio = i < 4 ? 2 : i < 8 ? -1 : 0;
        p[i] = (pslot){&c, request(1, (int64_t)i * 10), (int64_t)i * 10, prio, -1, 0, -1, 0};
        ts_predict_options_t po;
        ts_predict_options_init(&po);
        po.priority = prio;
        assert_int_equal(ts_batcher_predict_async_with(b, p[i].in, &po, pslot_cb, &p[i], NULL), 0);
    }
    ts_predict_options_t bad;
    ts_predict_options_init(&bad);
    bad.priority = 3;
    assert_int_equal(ts_batcher_predict_async_with(b, p[0].in, &bad, pslot_cb, &p[0], NULL),
                     TS_EINVAL);
    assert_true(acount_wait(&c, N));
    assert_true(acount_wait(&cb, 1));
    for (int i = 0; i < N; i++) {
        assert_true(p[i].good);
        assert_int_equal(p[i].calls, 1);
    }
    /* Ranks 0-3 the urgent ones (8..11), then the default level (4..7), then the rest. */
    for (int i = 0; i < N; i++) {
        int want_lo = i >= 8 ? 0 : i >= 4 ? 4 : 8;
        assert_true(p[i].order >= want_lo && p[i].order < want_lo + 4);
        ts_value_free(p[i].in);
    }
    atomic_store(&g_delay_us, 0);
    ts_value_free(blocker.in);
    ts_batcher_free(b);
}

/*
 * A full queue answers at once (TS_EAGAIN at submit, no callback); a request whose deadline
 * passes in the queue gets TS_ETIMEDOUT once and never an answer later; a cancelled request gets
 * TS_ECANCELED once; a request in a forward cannot be cancelled. The counters add up.
 */
static void test_queue_limits_cancel_timeout(void **state)
{
    (void)state;
    ts_batcher_options_t cfg;
    test_options(&cfg, "cpu", 1, 0);
    cfg.max_queued = 4;
    ts_batcher_t *b = make_with(&cfg);
    acount c, cb;
    acount_init(&c);
    acount_init(&cb);
    actx blocker;
    busy_start(b, &blocker, &cb, 300000);
    pslot p[5];
    uint64_t id[5] = {0};
    for (int i = 0; i < 5; i++) {
        p[i] = (pslot){&c, request(1, (int64_t)i * 10), (int64_t)i * 10, 0, -1, 0, -1, 0};
        ts_predict_options_t po;
        ts_predict_options_init(&po);
        po.timeout_ms = i == 1 ? 50 : 20000;
        uint64_t t0 = ts__now_ns();
        int rc = ts_batcher_predict_async_with(b, p[i].in, &po, pslot_cb, &p[i], &id[i]);
        if (i < 4) {
            assert_int_equal(rc, 0);
            assert_true(id[i] != 0);
        } else {
            /* The fifth finds the queue full: refused at once, with no wait for room. */
            assert_int_equal(rc, TS_EAGAIN);
            assert_true(elapsed_ms(t0) < 1000.0);
        }
    }
    assert_int_equal(ts_batcher_cancel(b, id[2]), 0);
    /* A cancelled request's input is borrowed no longer once cancel returned 0 (batcher.h):
       freeing it before its callback runs must be safe (the ASan build would catch a read). */
    ts_value_free(p[2].in);
    p[2].in = NULL;
    assert_int_equal(ts_batcher_cancel(b, id[2]), TS_ENOENT);
    assert_int_equal(ts_batcher_cancel(b, 0), TS_ENOENT);
    assert_int_equal(ts_batcher_cancel(b, 987654321), TS_ENOENT);
    assert_true(acount_wait(&c, 4));
    assert_true(acount_wait(&cb, 1));
    atomic_store(&g_delay_us, 0);
    sleep_us(20000); /* any late second answer would show in calls */
    assert_int_equal(p[0].status, 0);
    assert_int_equal(p[1].status, TS_ETIMEDOUT);
    assert_int_equal(p[2].status, TS_ECANCELED);
    assert_int_equal(p[3].status, 0);
    assert_int_equal(p[4].calls, 0);
    for (int i = 0; i < 4; i++)
        assert_int_equal(p[i].calls, 1);
    /* Answered requests are no longer queued: cancelling them finds nothing. */
    assert_int_equal(ts_batcher_cancel(b, id[0]), TS_ENOENT);
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    assert_int_equal(st.submitted, 5); /* the blocker and four */
    assert_int_equal(st.submitted, st.requests + st.failed);
    assert_int_equal(st.requests, 3);
    assert_int_equal(st.failed, 2);
    assert_int_equal(st.timed_out, 1);
    assert_int_equal(st.cancelled, 1);
    assert_int_equal(st.rejected, 1);
    assert_int_equal(st.queued, 0);
    for (int i = 0; i < 5; i++)
        ts_value_free(p[i].in);
    ts_value_free(blocker.in);
    ts_batcher_free(b);
}

/*
 * Requests submitted from a callback while its replica answers a batch wait in that thread's
 * own list until the batch's callbacks are over, then join the queue together. They can still
 * be cancelled, from the same callback or from another thread, and a deadline that passes
 * while they wait there still times them out: each is answered exactly once.
 */
typedef struct child_run {
    ts_batcher_t *b;
    pslot kids[4];
    uint64_t ids[4];
    int rcs[4], cancel_rc;
    atomic_int submitted; /* set once the callback has submitted (for the cancelling thread) */
    atomic_int cancelled_by_main;
} child_run;

static void parent_cb(ts_batcher_t *b, int status, ts_value_t *out, int64_t version, void *arg)
{
    (void)status;
    (void)version;
    child_run *cr = arg;
    ts_value_free(out);
    for (int i = 0; i < 4; i++) {
        ts_predict_options_t po;
        ts_predict_options_init(&po);
        po.timeout_ms = i == 0 ? 20 : 20000; /* the first times out while the callback sleeps */
        cr->rcs[i] = ts_batcher_predict_async_with(b, cr->kids[i].in, &po, pslot_cb, &cr->kids[i],
                                                   &cr->ids[i]);
    }
    /* Cancelled from this very callback, before the batch's answering is over. */
    cr->cancel_rc = ts_batcher_cancel(b, cr->ids[1]);
    atomic_store(&cr->submitted, 1);
    /* Meanwhile the main thread cancels the third, and the first's deadline passes. */
    for (int i = 0; i < 500 && !atomic_load(&cr->cancelled_by_main); i++)
        sleep_us(1000);
    sleep_us(40000);
}

static void test_callback_submits_cancel_timeout(void **state)
{
    (void)state;
    for (int helpers = 0; helpers < 3; helpers++) {
        ts_batcher_options_t cfg;
        test_options(&cfg, "cpu", 8, 0);
        cfg.answer_threads = helpers > 0; /* the third round: the helper answers alone */
        cfg.overlap_answers = helpers == 2;
        ts_batcher_t *b = make_with(&cfg);
        static child_run cr;
        memset(&cr, 0, sizeof(cr));
        cr.b = b;
        acount c;
        acount_init(&c);
        for (int i = 0; i < 4; i++)
            cr.kids[i] = (pslot){&c, request(1, 100 + i * 10), 100 + i * 10, 0, -1, 0, -1, 0};
        ts_value_t *in = request(1, 0);
        assert_int_equal(ts_batcher_predict_async(b, in, 0, TS_TIMEOUT_DEFAULT, parent_cb, &cr), 0);
        for (int i = 0; i < 3000 && !atomic_load(&cr.submitted); i++)
            sleep_us(1000);
        assert_true(atomic_load(&cr.submitted));
        /* The third is still waiting in the replica's list: cancelling it finds it. */
        assert_int_equal(ts_batcher_cancel(b, cr.ids[2]), 0);
        atomic_store(&cr.cancelled_by_main, 1);
        assert_true(acount_wait(&c, 4));
        sleep_us(20000); /* any late second answer would show in calls */
        for (int i = 0; i < 4; i++) {
            assert_int_equal(cr.rcs[i], 0);
            assert_int_equal(cr.kids[i].calls, 1);
        }
        assert_int_equal(cr.cancel_rc, 0);
        assert_int_equal(cr.kids[0].status, TS_ETIMEDOUT);
        assert_int_equal(cr.kids[1].status, TS_ECANCELED);
        assert_int_equal(cr.kids[2].status, TS_ECANCELED);
        assert_int_equal(cr.kids[3].status, 0);
        assert_true(cr.kids[3].good);
        assert_int_equal(ts_batcher_cancel(b, cr.ids[3]), TS_ENOENT);
        ts_batcher_stats_t st;
        ts_batcher_stats(b, &st);
        assert_int_equal(st.submitted, 5);
        assert_int_equal(st.submitted, st.requests + st.failed);
        assert_int_equal(st.timed_out, 1);
        assert_int_equal(st.cancelled, 2);
        assert_int_equal(st.queued, 0);
        ts_batcher_free(b);
        ts_value_free(in);
        for (int i = 0; i < 4; i++)
            ts_value_free(cr.kids[i].in);
    }
}

/*
 * The queue bound counts requests that callbacks submit while their batch is being answered
 * (waiting in the answering thread's list, not queued yet): of 150 submitted from one callback
 * to a batcher bounded at 100, exactly 100 are accepted and the rest refused at once with
 * TS_EAGAIN; each accepted one is answered once.
 */
typedef struct flood {
    acount c;
    pslot kids[150];
    int accepted, refused, other;
} flood;

static void flood_cb(ts_batcher_t *b, int status, ts_value_t *out, int64_t version, void *arg)
{
    (void)status;
    (void)version;
    flood *f = arg;
    ts_value_free(out);
    for (int i = 0; i < 150; i++) {
        int rc = ts_batcher_predict_async(b, f->kids[i].in, 0, TS_TIMEOUT_DEFAULT, pslot_cb,
                                          &f->kids[i]);
        if (rc == 0)
            f->accepted++;
        else if (rc == TS_EAGAIN)
            f->refused++;
        else
            f->other++;
    }
}

static void test_callback_submits_queue_bound(void **state)
{
    (void)state;
    ts_batcher_options_t cfg;
    test_options(&cfg, "cpu", 8, 0);
    cfg.max_queued = 100;
    ts_batcher_t *b = make_with(&cfg);
    static flood f;
    memset(&f, 0, sizeof(f));
    acount_init(&f.c);
    for (int i = 0; i < 150; i++)
        f.kids[i] = (pslot){&f.c, request(1, (int64_t)i * 10), (int64_t)i * 10, 0, -1, 0, -1, 0};
    ts_value_t *in = request(1, 5);
    assert_int_equal(ts_batcher_predict_async(b, in, 0, TS_TIMEOUT_DEFAULT, flood_cb, &f), 0);
    assert_true(acount_wait(&f.c, 100));
    sleep_us(20000); /* any late or second answer would show in calls */
    assert_int_equal(f.accepted, 100);
    assert_int_equal(f.refused, 50);
    assert_int_equal(f.other, 0);
    int answered = 0;
    for (int i = 0; i < 150; i++) {
        assert_true(f.kids[i].calls <= 1);
        answered += f.kids[i].calls;
        if (f.kids[i].calls == 1)
            assert_true(f.kids[i].good);
    }
    assert_int_equal(answered, 100);
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    assert_int_equal(st.submitted, 101);
    assert_int_equal(st.rejected, 50);
    assert_int_equal(st.submitted, st.requests + st.failed);
    ts_batcher_free(b);
    ts_value_free(in);
    for (int i = 0; i < 150; i++)
        ts_value_free(f.kids[i].in);
}

/*
 * A batcher freed while a closed loop of requesters runs, their callbacks on the replicas and
 * on answer helpers submitting again: every accepted request is answered exactly once (its rows
 * or TS_ECANCELED), and nothing is answered after ts_batcher_free returns.
 */
typedef struct stop_actor {
    ts_value_t *in;
    int64_t base;
    atomic_int accepted, answered, bad;
} stop_actor;

static void stop_cb(ts_batcher_t *b, int status, ts_value_t *out, int64_t version, void *arg)
{
    (void)version;
    stop_actor *a = arg;
    if (status == 0 ? !check_answer(out, 1, a->base, 1.0f) : status != TS_ECANCELED)
        atomic_fetch_add(&a->bad, 1);
    ts_value_free(out);
    atomic_fetch_add(&a->answered, 1);
    if (status == 0 && ts_batcher_predict_async(b, a->in, 0, TS_TIMEOUT_DEFAULT, stop_cb, a) == 0)
        atomic_fetch_add(&a->accepted, 1);
}

static void test_free_while_answering(void **state)
{
    (void)state;
    enum { A = 200 };
    static stop_actor act[A];
    for (int round = 0; round < 10; round++) {
        ts_batcher_options_t cfg;
        test_options(&cfg, round % 2 ? "cpu:2" : "cpu", 128, 500);
        /* 0, 1 and 2 helpers helping, then 1 and 2 answering alone (overlap_answers) */
        cfg.answer_threads = round < 6 ? round / 2 : round / 2 - 2;
        cfg.overlap_answers = round >= 6;
        ts_batcher_t *b = make_with(&cfg);
        for (int i = 0; i < A; i++) {
            act[i].base = (int64_t)i * 10;
            act[i].in = request(1, act[i].base);
            atomic_init(&act[i].accepted, 1);
            atomic_init(&act[i].answered, 0);
            atomic_init(&act[i].bad, 0);
            assert_int_equal(
                ts_batcher_predict_async(b, act[i].in, 0, TS_TIMEOUT_DEFAULT, stop_cb, &act[i]), 0);
        }
        sleep_us(5000 + (round % 6) * 3000);
        ts_batcher_free(b);
        int total = 0;
        for (int i = 0; i < A; i++) {
            assert_int_equal(atomic_load(&act[i].bad), 0);
            assert_int_equal(atomic_load(&act[i].answered), atomic_load(&act[i].accepted));
            total += atomic_load(&act[i].answered);
            ts_value_free(act[i].in);
        }
        print_message("    round %d: %d answers before and at the free\n", round, total);
    }
}

/*
 * Preferred batch sizes run at once although partial batches are held; the per-replica
 * counters add up to the batcher's.
 */
static void test_preferred_and_replica_stats(void **state)
{
    (void)state;
    ts_batcher_options_t cfg;
    test_options(&cfg, "cpu", 8, 20000000);
    cfg.min_delay_us = 20000000;
    int pref[2] = {4, 3};
    cfg.preferred_batch = pref;
    cfg.n_preferred = 2;
    ts_batcher_t *b = make_with(&cfg);
    acount c;
    acount_init(&c);
    actx a[4];
    for (int i = 0; i < 4; i++) {
        a[i] = (actx){&c, 1, (int64_t)i * 10, 1.0f, request(1, (int64_t)i * 10)};
        assert_int_equal(
            ts_batcher_predict_async(b, a[i].in, 0, TS_TIMEOUT_DEFAULT, async_cb, &a[i]), 0);
    }
    /*
     * Four single rows are answered at once although partial batches wait 20 s: as one batch
     * of the preferred size 4, or, when the replica took the first three as soon as they made
     * the preferred size 3 (a race with this thread's submits on a loaded machine), as 3 + 1.
     */
    assert_true(acount_wait(&c, 4));
    assert_int_equal(c.ok, 4);
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    assert_true(st.batches == 1 || st.batches == 2);
    assert_int_equal(st.rows, 4);
    for (int i = 0; i < 4; i++)
        ts_value_free(a[i].in);
    ts_batcher_free(b);

    /* Invalid preferred sizes and delays are refused. */
    pref[0] = 9;
    assert_int_equal(ts_batcher_new(&b, &cfg), TS_EINVAL);
    cfg.n_preferred = 0;
    cfg.min_delay_us = 30000000;
    assert_int_equal(ts_batcher_new(&b, &cfg), TS_EINVAL);

    /* Per replica: batches, rows, requests and the histogram add up to the totals. */
    b = make("cpu:2", 16, 200);
    enum { N = 300 };
    static actx m[N];
    acount c2;
    submit_mixed(b, m, N, &c2);
    ts_batcher_stats(b, &st);
    uint64_t batches = 0, rows = 0, reqs = 0, hist = 0;
    for (int i = 0; i < ts_batcher_replicas(b); i++) {
        ts_batcher_replica_stats_t rs;
        assert_int_equal(ts_batcher_replica_stats(b, i, &rs), 0);
        batches += rs.batches;
        rows += rs.rows;
        reqs += rs.requests;
        for (int k = 0; k < TS_BATCHER_HIST_BUCKETS; k++)
            hist += rs.batch_sizes[k];
        if (rs.batches > 0)
            assert_true(rs.compute_ns > 0);
    }
    ts_batcher_replica_stats_t none;
    assert_int_equal(ts_batcher_replica_stats(b, 2, &none), TS_EINVAL);
    assert_int_equal(batches, st.batches);
    assert_int_equal(hist, st.batches);
    assert_int_equal(rows, st.rows);
    assert_int_equal(reqs, N);
    assert_int_equal(st.submitted, N);
    assert_int_equal(st.requests, N);
    ts_batcher_free(b);
}

/* Shutdown: everything submitted is answered exactly once, with a result or TS_ECANCELED. */
static void test_shutdown(void **state)
{
    (void)state;
    ts_batcher_t *b = make("cpu:2", 2, 0);
    atomic_store(&g_delay_us, 20000);
    enum { N = 100 };
    static actx ctx[N];
    acount c;
    acount_init(&c);
    for (int i = 0; i < N; i++) {
        ctx[i] = (actx){&c, 1, (int64_t)i * 10, 1.0f, NULL};
        ctx[i].in = request(1, ctx[i].base);
        assert_int_equal(
            ts_batcher_predict_async(b, ctx[i].in, TS_COPY, TS_TIMEOUT_INFINITE, async_cb, &ctx[i]),
            0);
        ts_value_free(ctx[i].in);
    }
    sleep_us(30000);
    ts_batcher_free(b);
    atomic_store(&g_delay_us, 0);
    assert_int_equal(c.done, N);
    assert_int_equal(c.ok + c.canceled, N);
    assert_true(c.canceled > 0);
    print_message("    %d answered, %d canceled at shutdown\n", c.ok, c.canceled);
}

static void test_placement(void **state)
{
    (void)state;
    atomic_store(&g_created, 0);
    ts_batcher_t *b = make("cpu:3,cpu", 4, 0);
    assert_int_equal(ts_batcher_replicas(b), 4);
    assert_int_equal(atomic_load(&g_created), 4);
    assert_null(ts_batcher_device(b, 4));
    ts_batcher_free(b);

    ts_batcher_options_t cfg;
    ts_batcher_options_init(&cfg);
    cfg.inputs = in_schema;
    cfg.n_inputs = 2;
    cfg.create = cm_create;
    const char *bad[] = {"gpu", "cpu:", "cpu:0", "cuda:x", "cpu,", "cpu:2x", "cuda:0*0"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cfg.placement = bad[i];
        assert_int_equal(ts_batcher_new(&b, &cfg), TS_EINVAL);
        assert_non_null(strstr(ts_last_error(), "placement"));
    }
    /* No CUDA device: the forms that need the device count fail clearly. */
    cfg.placement = "cuda*2";
    assert_int_equal(ts_batcher_new(&b, &cfg), TS_ENOTSUP);
    assert_non_null(strstr(ts_last_error(), "no CUDA device"));
    cfg.placement = "cuda/4";
    assert_int_equal(ts_batcher_new(&b, &cfg), TS_ENOTSUP);
    /* An explicit device goes to the factory, which refuses it here, with its message. */
    atomic_store(&g_created, 0);
    cfg.placement = "cpu,cuda:0";
    assert_int_equal(ts_batcher_new(&b, &cfg), TS_ENOTSUP);
    assert_non_null(strstr(ts_last_error(), "cuda:0"));
    assert_int_equal(atomic_load(&g_created), 1); /* the CPU one was made, then freed */
    /* With devices to spread over, the factory sees each one in order. */
    cfg.cuda_devices = 2;
    cfg.placement = "cuda:1*2";
    assert_int_equal(ts_batcher_new(&b, &cfg), TS_ENOTSUP);
    cfg.placement = "cuda:2";
    assert_int_equal(ts_batcher_new(&b, &cfg), TS_EINVAL);
    /* Schema errors. */
    cfg.placement = "cpu";
    const ts_field_t overlap[] = {{"a", TS_FLOAT32, 0, {0}}, {"a.b", TS_FLOAT32, 0, {0}}};
    cfg.inputs = overlap;
    assert_int_equal(ts_batcher_new(&b, &cfg), TS_EINVAL);
    const ts_field_t empty_part[] = {{"a..b", TS_FLOAT32, 0, {0}}};
    cfg.inputs = empty_part;
    cfg.n_inputs = 1;
    assert_int_equal(ts_batcher_new(&b, &cfg), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "bad field name 'a..b'"));
    const ts_field_t bad_dtype[] = {{"a", TS_DTYPE_INVALID, 0, {0}}};
    cfg.inputs = bad_dtype;
    assert_int_equal(ts_batcher_new(&b, &cfg), TS_EINVAL);
    /* A negative or overflowing per-row dimension says so (not "bad field name"). */
    const ts_field_t negative[] = {{"", TS_FLOAT32, 2, {3, -1}}};
    cfg.inputs = negative;
    assert_int_equal(ts_batcher_new(&b, &cfg), TS_EINVAL);
    assert_string_equal(ts_last_error(),
                        "input schema: field '' has a negative per-row dimension 1 (-1)");
    const ts_field_t huge[] = {{"x", TS_FLOAT64, 2, {INT64_MAX / 2, 8}}};
    cfg.inputs = huge;
    assert_int_equal(ts_batcher_new(&b, &cfg), TS_EINVAL);
    assert_string_equal(ts_last_error(), "input schema: field 'x' has a per-row shape whose size "
                                         "in bytes overflows (at per-row dimension 0)");
    cfg.inputs = in_schema;
    cfg.n_inputs = 2;
    cfg.outputs = negative;
    cfg.n_outputs = 1;
    assert_int_equal(ts_batcher_new(&b, &cfg), TS_EINVAL);
    assert_string_equal(ts_last_error(),
                        "output schema: field '' has a negative per-row dimension 1 (-1)");
}

/* A model that answers one row more than its batch has: [rows + 1, 3] float64 zeros. */
static int extra_row_forward(ts_model_t *m, const ts_value_t *in, int64_t rows, ts_value_t **out)
{
    (void)m;
    (void)in;
    int64_t shape[2] = {rows + 1, 3};
    *out = ts_tensor_alloc(TS_FLOAT64, 2, shape);
    return *out != NULL ? 0 : TS_ENOMEM;
}

static const ts_model_ops_t extra_row_ops = {extra_row_forward, NULL, cm_free};

static int extra_row_create(const char *device, int replica, ts_model_t **out, void *arg)
{
    (void)arg;
    (void)device;
    (void)replica;
    cmodel *c = ts__calloc(1, sizeof(*c));
    if (c == NULL)
        return TS_ENOMEM;
    c->base.ops = &extra_row_ops;
    *out = &c->base;
    return 0;
}

/* A factory that breaks the contract: it returns 5, not 0 or a TS_E* code. */
static int five_create(const char *device, int replica, ts_model_t **out, void *arg)
{
    (void)device;
    (void)replica;
    (void)out;
    (void)arg;
    ts_set_last_error("five");
    return 5;
}

/* A model whose load_weights returns 5, not 0 or a TS_E* code. */
static int five_load(ts_model_t *m, const ts_value_t *params)
{
    (void)m;
    (void)params;
    return 5;
}

static const ts_model_ops_t five_load_ops = {extra_row_forward, five_load, cm_free};

static int five_load_create(const char *device, int replica, ts_model_t **out, void *arg)
{
    int rc = extra_row_create(device, replica, out, arg);
    if (rc == 0)
        (*out)->ops = &five_load_ops;
    return rc;
}

/*
 * The options' quiet defaults (batcher.h): placement NULL or "" is "cpu", max_queued 0 the
 * default bound. A factory or load_weights that returns a value other than 0 or a TS_E* code
 * gives TS_EMODEL with a message naming the value, never the value itself.
 */
static void test_option_defaults_and_bad_returns(void **state)
{
    (void)state;
    const ts_field_t in[] = {{"", TS_FLOAT64, 1, {3}}};
    ts_batcher_options_t cfg;
    ts_batcher_options_init(&cfg);
    cfg.inputs = in;
    cfg.n_inputs = 1;
    cfg.create = extra_row_create;
    cfg.max_queued = 0;
    ts_batcher_t *b = NULL;
    const char *cpu[] = {NULL, ""};
    for (int i = 0; i < 2; i++) {
        cfg.placement = cpu[i];
        assert_int_equal(ts_batcher_new(&b, &cfg), 0);
        assert_int_equal(ts_batcher_replicas(b), 1);
        assert_string_equal(ts_batcher_device(b, 0), "cpu");
        ts_batcher_free(b);
    }
    cfg.create = five_create;
    assert_int_equal(ts_batcher_new(&b, &cfg), TS_EMODEL);
    assert_string_equal(
        ts_last_error(),
        "model for replica 0 on cpu: the factory returned 5, not a TS_E* code (five)");
    cfg.create = five_load_create;
    assert_int_equal(ts_batcher_new(&b, &cfg), 0);
    int64_t shape[2] = {1, 3};
    ts_value_t *x = ts_tensor_alloc(TS_FLOAT64, 2, shape);
    assert_int_equal(ts_batcher_load_weights(b, x, 1, TS_TIMEOUT_DEFAULT), TS_EMODEL);
    assert_string_equal(ts_last_error(),
                        "replica 0 (cpu): load_weights returned 5, not a TS_E* code");
    ts_value_free(x);
    ts_batcher_free(b);
}

/*
 * Each bad option of ts_batcher_new gets TS_EINVAL with its own message naming the field and
 * its range; a model without load_weights refuses weights with TS_ENOTSUP, saying so; an
 * output of the wrong row count names the batch's.
 */
static void test_option_messages(void **state)
{
    (void)state;
    const ts_field_t in[] = {{"", TS_FLOAT64, 1, {3}}};
    ts_batcher_options_t cfg;
    ts_batcher_t *b = NULL;
    static const struct {
        int what;
        const char *message;
    } cases[] = {
        {0, "options: max_delay_us -1: 0 or more microseconds"},
        {1, "options: n_preferred 17: 0..16"},
        {2, "options: n_preferred 2 with preferred_batch NULL"},
        {3, "options: answer_threads 65: 0..64"},
        {4, "options: min_delay_us 600: 0..max_delay_us (500)"},
        {5, "options: priority_levels 17: 1..16 (0: the default, 1)"},
        {6, "options: priority_levels -1: 1..16 (0: the default, 1)"},
        {7, "options: default_priority 2: 0..1 (below priority_levels, 2)"},
        {8, "options: max_batch 0: at least 1 row"},
        {9, "options: n_inputs 0: the input schema needs 1..64 fields"},
        {10, "options: create (the model factory) is required"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        ts_batcher_options_init(&cfg);
        cfg.inputs = in;
        cfg.n_inputs = 1;
        cfg.create = extra_row_create;
        switch (cases[i].what) {
        case 0:
            cfg.max_delay_us = -1;
            break;
        case 1:
            cfg.n_preferred = 17;
            break;
        case 2:
            cfg.n_preferred = 2;
            break;
        case 3:
            cfg.answer_threads = 65;
            break;
        case 4:
            cfg.min_delay_us = 600;
            break;
        case 5:
            cfg.priority_levels = 17;
            break;
        case 6:
            cfg.priority_levels = -1;
            break;
        case 7:
            cfg.priority_levels = 2;
            cfg.default_priority = 2;
            break;
        case 8:
            cfg.max_batch = 0;
            break;
        case 9:
            cfg.n_inputs = 0;
            break;
        default:
            cfg.create = NULL;
            break;
        }
        assert_int_equal(ts_batcher_new(&b, &cfg), TS_EINVAL);
        assert_string_equal(ts_last_error(), cases[i].message);
    }
    /* priority_levels 0 is the default, one level. */
    ts_batcher_options_init(&cfg);
    cfg.inputs = in;
    cfg.n_inputs = 1;
    cfg.outputs = in;
    cfg.n_outputs = 1;
    cfg.max_batch = 4;
    cfg.max_delay_us = 0;
    cfg.create = extra_row_create;
    cfg.priority_levels = 0;
    assert_int_equal(ts_batcher_new(&b, &cfg), 0);
    ts_predict_options_t po;
    ts_predict_options_init(&po);
    po.priority = 1;
    int64_t shape[2] = {3, 3};
    ts_value_t *x = ts_tensor_alloc(TS_FLOAT64, 2, shape), *out = NULL;
    assert_int_equal(ts_batcher_predict_async_with(b, x, &po, async_cb, NULL, NULL), TS_EINVAL);
    /* Four rows answered for a batch of three: the batch's count is the one expected. */
    assert_int_equal(ts_batcher_predict(b, x, TS_TIMEOUT_DEFAULT, &out, NULL), TS_EMODEL);
    assert_string_equal(ts_last_error(),
                        "model output does not match the schema: field '' has 4 rows, expected 3");
    /* No load_weights: weights are refused, and the message says why. */
    assert_int_equal(ts_batcher_load_weights(b, x, 1, TS_TIMEOUT_DEFAULT), TS_ENOTSUP);
    assert_string_equal(ts_last_error(),
                        "replica 0 (cpu): the model has no load_weights (it takes no weights)");
    ts_value_free(x);
    ts_batcher_free(b);
}

/* A model over bare tensors, without an output schema: y = 2x for a [rows, 3] float64 input. */
static int bare_forward(ts_model_t *m, const ts_value_t *in, int64_t rows, ts_value_t **out)
{
    (void)m;
    const ts_tensor_t *t = ts_value_tensor(in);
    ts_value_t *o = ts_tensor_new(TS_FLOAT64, 2, t->shape, t->data, TS_COPY);
    if (o == NULL)
        return TS_ENOMEM;
    double *d = ts_value_tensor(o)->data;
    for (int64_t i = 0; i < rows * 3; i++)
        d[i] *= 2;
    ts_value_t *list = ts_list_new();
    ts_list_push(list, o);
    ts_list_push(list, ts_int_new(rows));
    *out = list;
    return 0;
}

static const ts_model_ops_t bare_ops = {bare_forward, NULL, cm_free};

static int bare_create(const char *device, int replica, ts_model_t **out, void *arg)
{
    (void)arg;
    (void)device;
    (void)replica;
    cmodel *c = ts__calloc(1, sizeof(*c));
    if (c == NULL)
        return TS_ENOMEM;
    c->base.ops = &bare_ops;
    *out = &c->base;
    return 0;
}

typedef struct bctx {
    acount *c;
    int i;
} bctx;

static void bare_cb(ts_batcher_t *b, int status, ts_value_t *out, int64_t version, void *arg)
{
    (void)b;
    (void)version;
    bctx *x = arg;
    int good = status == 0 && ts_value_type(out) == TS_TYPE_LIST && ts_value_len(out) == 2;
    if (good) {
        const ts_tensor_t *t = ts_value_tensor(ts_list_at(out, 0));
        int64_t rows = -1;
        good = t != NULL && t->ndim == 2 && t->shape[0] == 2 && t->shape[1] == 3 &&
               ts_value_int(ts_list_at(out, 1), &rows) == 0 && rows == 8;
        for (int k = 0; good && k < 6; k++)
            good = ((const double *)t->data)[k] == 2.0 * (x->i * 10 + k);
    }
    ts_value_free(out);
    pthread_mutex_lock(&x->c->mu);
    x->c->ok += good;
    x->c->done++;
    pthread_mutex_unlock(&x->c->mu);
}

static void test_bare_tensor(void **state)
{
    (void)state;
    const ts_field_t in[] = {{"", TS_FLOAT64, 1, {3}}};
    ts_batcher_options_t cfg;
    ts_batcher_options_init(&cfg);
    cfg.inputs = in;
    cfg.n_inputs = 1;
    cfg.max_batch = 8;
    cfg.max_delay_us = 20000000;         /* the fourth request fills the batch long before this */
    cfg.min_delay_us = cfg.max_delay_us; /* held: the first request waits for the others */
    cfg.create = bare_create;
    ts_batcher_t *b = NULL;
    assert_int_equal(ts_batcher_new(&b, &cfg), 0);
    acount c;
    acount_init(&c);
    bctx x[4];
    for (int i = 0; i < 4; i++) {
        double data[2][3];
        for (int r = 0; r < 2; r++)
            for (int k = 0; k < 3; k++)
                data[r][k] = i * 10 + r * 3 + k;
        int64_t shape[2] = {2, 3};
        ts_value_t *v = ts_tensor_new(TS_FLOAT64, 2, shape, data, TS_BORROW);
        x[i] = (bctx){&c, i};
        assert_int_equal(
            ts_batcher_predict_async(b, v, TS_COPY, TS_TIMEOUT_DEFAULT, bare_cb, &x[i]), 0);
        ts_value_free(v);
    }
    uint64_t t0 = ts__now_ns();
    assert_true(acount_wait(&c, 4));
    assert_true(elapsed_ms(t0) < 15000.0);
    assert_int_equal(c.ok, 4);
    ts_batcher_free(b);
}

/* A model that answers its batch as it is (a copy): y = x. */
static int echo_forward(ts_model_t *m, const ts_value_t *in, int64_t rows, ts_value_t **out)
{
    (void)m;
    (void)rows;
    *out = ts_value_clone(in);
    return *out != NULL ? 0 : TS_ENOMEM;
}

static const ts_model_ops_t echo_ops = {echo_forward, NULL, cm_free};

static int echo_create(const char *device, int replica, ts_model_t **out, void *arg)
{
    (void)arg;
    (void)device;
    (void)replica;
    cmodel *c = ts__calloc(1, sizeof(*c));
    if (c == NULL)
        return TS_ENOMEM;
    c->base.ops = &echo_ops;
    *out = &c->base;
    return 0;
}

/*
 * A per-row dimension may be 0 (batcher.h, ts_field_t): a field of zero-size rows holds no
 * values, and requests of it are batched and answered like any other, each requester getting
 * its own rows back.
 */
static void test_zero_size_rows(void **state)
{
    (void)state;
    const ts_field_t in[] = {{"", TS_FLOAT32, 2, {3, 0}}};
    ts_batcher_options_t cfg;
    ts_batcher_options_init(&cfg);
    cfg.inputs = in;
    cfg.n_inputs = 1;
    cfg.outputs = in;
    cfg.n_outputs = 1;
    cfg.max_batch = 5;
    cfg.max_delay_us = 20000000;         /* the second request fills the batch long before this */
    cfg.min_delay_us = cfg.max_delay_us; /* held: the first request waits for the second */
    cfg.create = echo_create;
    ts_batcher_t *b = make_with(&cfg);
    acount c;
    acount_init(&c);
    pslot p[2];
    for (int i = 0; i < 2; i++) {
        int64_t shape[3] = {2 + i, 3, 0};
        p[i] = (pslot){&c, ts_tensor_alloc(TS_FLOAT32, 3, shape), 0, 0, -1, 0, -1, 0};
        assert_non_null(p[i].in);
        assert_int_equal(
            ts_batcher_predict_async(b, p[i].in, 0, TS_TIMEOUT_DEFAULT, zero_cb, &p[i]), 0);
    }
    assert_true(acount_wait(&c, 2));
    for (int i = 0; i < 2; i++) {
        assert_int_equal(p[i].status, 0);
        assert_int_equal(p[i].good, 2 + i); /* the rows that came back */
        ts_value_free(p[i].in);
    }
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    assert_int_equal(st.batches, 1);
    assert_int_equal(st.rows, 5);
    ts_batcher_free(b);
}

/* A failed prediction's callback: its status and the message it finds in ts_last_error(). */
typedef struct failed_answer {
    atomic_int done;
    int status;
    char message[TS_MAX_ERROR_LEN + 1];
} failed_answer;

static void failed_cb(ts_batcher_t *b, int status, ts_value_t *out, int64_t version, void *arg)
{
    (void)b;
    (void)version;
    failed_answer *f = arg;
    ts_value_free(out);
    f->status = status;
    snprintf(f->message, sizeof(f->message), "%s", ts_last_error());
    atomic_store(&f->done, 1);
}

/*
 * The timeout convention (tensorshare.h "Timeouts") and the one message channel: 0 is refused
 * by calls that cannot answer without waiting, TS_TIMEOUT_DEFAULT is the options' timeout_ms,
 * and a model's ts_set_last_error() reaches the requester's callback through ts_last_error().
 */
static void test_timeouts_and_messages(void **state)
{
    (void)state;
    ts_batcher_options_t cfg;
    ts_batcher_options_init(&cfg);
    cfg.inputs = in_schema;
    cfg.n_inputs = 2;
    cfg.create = cm_create;
    ts_batcher_t *b = NULL;
    cfg.timeout_ms = 0;
    assert_int_equal(ts_batcher_new(&b, &cfg), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "timeout_ms"));
    cfg.timeout_ms = -7;
    assert_int_equal(ts_batcher_new(&b, &cfg), TS_EINVAL);
    cfg.timeout_ms = TS_TIMEOUT_INFINITE;
    assert_int_equal(ts_batcher_new(&b, &cfg), 0);
    ts_batcher_free(b);
    cfg.timeout_ms = TS_TIMEOUT_DEFAULT;
    assert_int_equal(ts_batcher_new(&b, &cfg), 0);

    ts_value_t *in = request(2, 0), *out = NULL;
    ts_set_last_error(NULL);
    assert_int_equal(ts_batcher_predict(b, in, 0, &out, NULL), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "timeout_ms"));
    assert_int_equal(ts_batcher_predict_async(b, in, 0, 0, failed_cb, NULL), TS_EINVAL);
    assert_int_equal(ts_batcher_predict_async(b, in, 0, -3, failed_cb, NULL), TS_EINVAL);
    assert_int_equal(ts_batcher_load_weights(b, in, 1, 0), TS_EINVAL);
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_INFINITE, &out, NULL), 0);
    ts_value_free(out);
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), 0);
    ts_value_free(out);

    /* The model's own message, set with ts_set_last_error, in the callback and after predict. */
    float *x = ts_value_tensor(ts_map_get(ts_map_get(in, "obs"), "x"))->data;
    x[0] = NAN;
    failed_answer f;
    memset(&f, 0, sizeof(f));
    atomic_init(&f.done, 0);
    assert_int_equal(ts_batcher_predict_async(b, in, 0, 20000, failed_cb, &f), 0);
    for (int i = 0; i < 20000 && !atomic_load(&f.done); i++)
        sleep_us(1000); /* at most 20 s */
    assert_int_equal(atomic_load(&f.done), 1);
    assert_int_equal(f.status, TS_EMODEL);
    assert_non_null(strstr(f.message, "NaN in the input"));
    ts_set_last_error(NULL);
    assert_int_equal(ts_batcher_predict(b, in, TS_TIMEOUT_DEFAULT, &out, NULL), TS_EMODEL);
    assert_non_null(strstr(ts_last_error(), "NaN in the input"));
    ts_value_free(in);
    ts_batcher_free(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_single),
        cmocka_unit_test(test_many_submitters),
        cmocka_unit_test(test_async),
        cmocka_unit_test(test_queue_delay),
        cmocka_unit_test(test_never_split),
        cmocka_unit_test(test_schema_errors),
        cmocka_unit_test(test_model_failure),
        cmocka_unit_test(test_output_schema_mismatch),
        cmocka_unit_test(test_predict_batch_wakeups),
        cmocka_unit_test(test_weights_midstream),
        cmocka_unit_test(test_weights_async),
        cmocka_unit_test(test_weights_at_shutdown),
        cmocka_unit_test(test_weights_release_race),
        cmocka_unit_test(test_deadline),
        cmocka_unit_test(test_deadline_heap),
        cmocka_unit_test(test_closed_loop),
        cmocka_unit_test(test_never_wait_for_nothing),
        cmocka_unit_test(test_answer_threads),
        cmocka_unit_test(test_overlap_answers),
        cmocka_unit_test(test_overlap_weights),
        cmocka_unit_test(test_replica_timer_slack),
        cmocka_unit_test(test_callback_submits_cancel_timeout),
        cmocka_unit_test(test_callback_submits_queue_bound),
        cmocka_unit_test(test_free_while_answering),
        cmocka_unit_test(test_priorities),
        cmocka_unit_test(test_queue_limits_cancel_timeout),
        cmocka_unit_test(test_preferred_and_replica_stats),
        cmocka_unit_test(test_shutdown),
        cmocka_unit_test(test_placement),
        cmocka_unit_test(test_bare_tensor),
        cmocka_unit_test(test_zero_size_rows),
        cmocka_unit_test(test_timeouts_and_messages),
        cmocka_unit_test(test_option_messages),
        cmocka_unit_test(test_option_defaults_and_bad_returns),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    if (atomic_load(&g_overlaps) != 0) {
        print_error("%d model calls overlapped on one model\n", atomic_load(&g_overlaps));
        failed++;
    }
    return failed;
}
