/*
 * The parameter server against a real tensord (include/tensorshare/ps.h): exact sums and
 * averages of integer-valued gradients from 16 concurrent pushers (async and sync), stale pushes
 * refused with their own status in sync mode, pull-if-newer, a reader that sees the old or the
 * new tensor during updates and never a mix, the momentum and Adam steps, embedding rows created
 * lazily and identically by two daemons, duplicate ids merged on push and restored on pull,
 * --max-memory counting slots and rows, and bad input refused with nothing changed.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "tensorshare/ps.h"
#include "tensorshare/replay.h"
#include "tensorshare/stream.h"
#include "test_client_util.h"

/* concurrent pushers, each with a client (and so a connection) of its own */
#define PUSHERS 16
/* pushes per pusher in the async sum, steps of the sync test */
#define PUSHES_EACH 20
#define SYNC_STEPS  5
/* floats of the dense parameters (the reader test's: large enough for a step to take a while) */
#define N_SMALL  4096
#define N_READER (256 * 1024)

static tsh_server srv;
static ts_client_t *cl;
/* A second daemon some tests start; stopped by their teardown even when the test fails. */
static tsh_server extra;
static ts_client_t *extra_cl;

static int group_setup(void **state)
{
    (void)state;
    if (tsh_server_start(&srv, NULL) != 0)
        return -1;
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = TC_WAIT_MS;
    return ts_client_open(&cl, srv.addr, &o) == 0 ? 0 : -1;
}

static int extra_teardown(void **state)
{
    (void)state;
    ts_client_free(extra_cl);
    extra_cl = NULL;
    if (extra.pid <= 0)
        return 0;
    int rc = tsh_server_stop(&extra);
    tsh_server_cleanup(&extra);
    extra.pid = 0;
    return rc == 0 ? 0 : -1;
}

static int group_teardown(void **state)
{
    (void)state;
    ts_client_free(cl);
    int rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    return rc == 0 ? 0 : -1;
}

/* Put a float32 [n] tensor of value v into bin name; returns its version. */
static uint64_t put_param(const char *name, size_t n, float v)
{
    float *d = malloc(n * sizeof(float));
    assert_non_null(d);
    for (size_t i = 0; i < n; i++)
        d[i] = v;
    int64_t shape[1] = {(int64_t)n};
    ts_value_t *t = ts_tensor_new(TS_FLOAT32, 1, shape, d, TS_BORROW);
    assert_non_null(t);
    uint64_t version = 0;
    assert_int_equal(ts_put(cl, name, t, &version), 0);
    ts_value_free(t);
    free(d);
    return version;
}

/* Pull parameter name (always) into out[n]; returns its version. */
static uint64_t pull_param(ts_client_t *c, const char *name, float *out, size_t n)
{
    ts_items_t *items = NULL;
    uint64_t version = 0;
    assert_int_equal(ts_ps_pull(c, name, 0, &items, &version), 0);
    assert_non_null(items);
    const ts_tensor_t *t = ts_value_tensor(ts_items_at(items, 0));
    assert_non_null(t);
    assert_true(t->dtype == TS_FLOAT32 && t->ndim == 1 && t->shape[0] == (int64_t)n);
    memcpy(out, t->data, n * sizeof(float));
    ts_items_free(items);
    return version;
}

static ts_ps_options_t opts(ts_ps_optimizer_t opt, ts_ps_mode_t mode, double lr)
{
    ts_ps_options_t o;
    ts_ps_options_init(&o);
    o.optimizer = opt;
    o.mode = mode;
    o.lr = lr;
    return o;
}

/* A pusher thread: its own client, PUSHES_EACH (or SYNC_STEPS) pushes of value base + k. */
typedef struct pusher {
    const char *name;
    int index;
    int rounds;
    int sync;
    int rc;
    uint64_t versions[SYNC_STEPS];
} pusher;

static void *push_thread(void *arg)
{
    pusher *p = arg;
    ts_client_t *c = NULL;
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = TC_WAIT_MS;
    p->rc = ts_client_open(&c, srv.addr, &o);
    if (p->rc != 0)
        return NULL;
    float *g = malloc(N_SMALL * sizeof(float));
    int64_t shape[1] = {N_SMALL};
    ts_tensor_t t = {.data = g, .dtype = TS_FLOAT32, .ndim = 1, .shape = {shape[0]}};
    for (int k = 0; k < p->rounds && p->rc == 0; k++) {
        for (size_t i = 0; i < N_SMALL; i++)
            g[i] = (float)(p->index + k + (int)(i % 3));
        uint64_t v = 0;
        p->rc = ts_ps_push(c, p->name, &t, 0, 1.0, &v);
        if (p->sync && k < SYNC_STEPS)
            p->versions[k] = v;
    }
    free(g);
    ts_client_free(c);
    return NULL;
}

static void run_pushers(const char *name, int rounds, int sync, pusher *ps)
{
    pthread_t th[PUSHERS];
    for (int i = 0; i < PUSHERS; i++) {
        ps[i] = (pusher){.name = name, .index = i, .rounds = rounds, .sync = sync};
        assert_int_equal(pthread_create(&th[i], NULL, push_thread, &ps[i]), 0);
    }
    for (int i = 0; i < PUSHERS; i++) {
        assert_int_equal(pthread_join(th[i], NULL), 0);
        assert_int_equal(ps[i].rc, 0);
    }
}

/* 16 pushers accumulate into one parameter: the result is the exact sum. */
static void test_async_sum_exact(void **state)
{
    (void)state;
    put_param("acc", N_SMALL, 1.0f);
    ts_ps_options_t o = opts(TS_PS_SUM, TS_PS_ASYNC, 0);
    uint64_t v0 = 0;
    assert_int_equal(ts_ps_create(cl, "acc", &o, &v0), 0);
    pusher ps[PUSHERS];
    run_pushers("acc", PUSHES_EACH, 0, ps);
    float *w = malloc(N_SMALL * sizeof(float));
    uint64_t v = pull_param(cl, "acc", w, N_SMALL);
    assert_true(v > v0);
    for (size_t i = 0; i < N_SMALL; i++) {
        double want = 1.0;
        for (int p = 0; p < PUSHERS; p++)
            for (int k = 0; k < PUSHES_EACH; k++)
                want += p + k + (int)(i % 3);
        assert_true(w[i] == (float)want);
    }
    free(w);
}

/* Sync: every step averages 16 gradients; each push returns with the version of its step. */
static void test_sync_average_exact(void **state)
{
    (void)state;
    put_param("sync", N_SMALL, 100.0f);
    ts_ps_options_t o = opts(TS_PS_SGD, TS_PS_SYNC, 1.0);
    o.sync_k = PUSHERS;
    assert_int_equal(ts_ps_create(cl, "sync", &o, NULL), 0);
    pusher ps[PUSHERS];
    run_pushers("sync", SYNC_STEPS, 1, ps);
    float *w = malloc(N_SMALL * sizeof(float));
    (void)pull_param(cl, "sync", w, N_SMALL);
    for (size_t i = 0; i < N_SMALL; i++) {
        /* step k's average: mean(p) + k + i % 3 = 7.5 + k + i % 3 */
        double want = 100.0;
        for (int k = 0; k < SYNC_STEPS; k++)
            want -= 7.5 + k + (int)(i % 3);
        assert_true(w[i] == (float)want);
    }
    free(w);
    /* The pushes of one step all returned the same version, and steps' versions grow. */
    for (int k = 0; k < SYNC_STEPS; k++) {
        for (int p = 1; p < PUSHERS; p++)
            assert_true(ps[p].versions[k] == ps[0].versions[k]);
        if (k > 0)
            assert_true(ps[0].versions[k] > ps[0].versions[k - 1]);
    }
}

/* A sync gradient that lags by more than the tolerance is refused with TS_ESTALE. */
static void test_sync_stale_rejected(void **state)
{
    (void)state;
    uint64_t v0 = put_param("stale", 8, 0.0f);
    ts_ps_options_t o = opts(TS_PS_SUM, TS_PS_SYNC, 0);
    o.sync_k = 1;
    o.tolerance = 1;
    assert_int_equal(ts_ps_create(cl, "stale", &o, NULL), 0);
    float g[8] = {1, 1, 1, 1, 1, 1, 1, 1}, w[8];
    ts_tensor_t t = {.data = g, .dtype = TS_FLOAT32, .ndim = 1, .shape = {8}};
    uint64_t v1 = 0, v2 = 0, v = 0;
    assert_int_equal(ts_ps_push(cl, "stale", &t, v0, 1.0, &v1), 0);
    assert_int_equal(ts_ps_push(cl, "stale", &t, v1, 1.0, &v2), 0);
    assert_true(v2 > v1 && v1 > v0);
    /* Two steps behind, tolerance 1: refused, the current version handed back. */
    assert_int_equal(ts_ps_push(cl, "stale", &t, v0, 1.0, &v), TS_ESTALE);
    assert_true(v == v2);
    assert_true(pull_param(cl, "stale", w, 8) == v2 && w[0] == 2.0f);
    /* One step behind is within the tolerance. */
    assert_int_equal(ts_ps_push(cl, "stale", &t, v1, 1.0, &v), 0);
    assert_true(pull_param(cl, "stale", w, 8) == v && w[7] == 3.0f);
    /* An unknown (older than remembered, or never published) version counts as too old, and
     * so does one above the current version (it counted as current before). */
    assert_int_equal(ts_ps_push(cl, "stale", &t, 1, 1.0, NULL), TS_ESTALE);
    assert_int_equal(ts_ps_push(cl, "stale", &t, v + 1000, 1.0, NULL), TS_ESTALE);
}

/* A push waiting in a sync step, on a client of its own. */
typedef struct waiting_push {
    const char *name;
    int rc;
} waiting_push;

static void *push_one(void *arg)
{
    waiting_push *w = arg;
    ts_client_t *c = NULL;
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = TC_WAIT_MS;
    w->rc = ts_client_open(&c, srv.addr, &o);
    if (w->rc != 0)
        return NULL;
    float g[4] = {1, 1, 1, 1};
    ts_tensor_t t = {.data = g, .dtype = TS_FLOAT32, .ndim = 1, .shape = {4}};
    w->rc = ts_ps_push(c, w->name, &t, 0, 1.0, NULL);
    ts_client_free(c);
    return NULL;
}

/* A sync step whose parameter's bin goes away answers its waiting pushes instead of hanging. */
static void test_sync_step_of_deleted_bin(void **state)
{
    (void)state;
    put_param("gone", 4, 0.0f);
    ts_ps_options_t o = opts(TS_PS_SUM, TS_PS_SYNC, 0);
    o.sync_k = 2;
    assert_int_equal(ts_ps_create(cl, "gone", &o, NULL), 0);
    waiting_push w = {.name = "gone", .rc = 1};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, push_one, &w), 0);
    /* Let the first push reach the server and wait there (a sync step needs two). */
    tc_sleep_ms(300);
    /* The DELETE answers the waiting push at once (it waited for the next push before). */
    assert_int_equal(ts_delete(cl, "gone", NULL), 0);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(w.rc, TS_ENOENT);
    float g[4] = {1, 1, 1, 1};
    ts_tensor_t t = {.data = g, .dtype = TS_FLOAT32, .ndim = 1, .shape = {4}};
    assert_int_equal(ts_ps_push(cl, "gone", &t, 0, 1.0, NULL), TS_ENOENT);
    /* A PUT of another size does the same (INVALID); one of the same size keeps the step. */
    put_param("gone", 4, 0.0f);
    w.rc = 1;
    assert_int_equal(pthread_create(&th, NULL, push_one, &w), 0);
    tc_sleep_ms(300);
    put_param("gone", 5, 0.0f);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(w.rc, TS_EINVAL);
}

static void test_pull_if_newer(void **state)
{
    (void)state;
    uint64_t v0 = put_param("pin", 4, 3.0f);
    ts_items_t *items = (ts_items_t *)&items; /* must be overwritten */
    uint64_t v = 0;
    assert_int_equal(ts_ps_pull(cl, "pin", v0, &items, &v), 0);
    assert_null(items);
    assert_true(v == v0);
    assert_int_equal(ts_ps_pull(cl, "pin", v0 - 1, &items, &v), 0);
    assert_non_null(items);
    assert_true(v == v0 && ts_items_count(items) == 1);
    ts_items_free(items);
    assert_int_equal(ts_ps_pull(cl, "no_such_bin", 0, &items, &v), TS_ENOENT);
}

/* A reader pulling while pushes apply sees whole tensors: every element equal. */
typedef struct reader_arg {
    atomic_int stop; /* set by the main thread, read by the reader */
    int pulls, bad;
} reader_arg;

static void *reader_thread(void *arg)
{
    reader_arg *r = arg;
    ts_client_t *c = NULL;
    if (ts_client_open(&c, srv.addr, NULL) != 0) {
        r->bad = -1;
        return NULL;
    }
    uint64_t deadline = tc_now_ms() + TC_WAIT_MS;
    while (!atomic_load(&r->stop) && tc_now_ms() < deadline) {
        ts_items_t *items = NULL;
        if (ts_ps_pull(c, "big", 0, &items, NULL) != 0 || items == NULL) {
            r->bad++;
            break;
        }
        const ts_tensor_t *t = ts_value_tensor(ts_items_at(items, 0));
        const float *d = t->data;
        for (int64_t i = 1; i < t->shape[0]; i++)
            if (d[i] != d[0]) {
                r->bad++;
                break;
            }
        ts_items_free(items);
        r->pulls++;
    }
    ts_client_free(c);
    return NULL;
}

static void test_reader_sees_whole_tensors(void **state)
{
    (void)state;
    put_param("big", N_READER, 0.0f);
    ts_ps_options_t o = opts(TS_PS_SUM, TS_PS_ASYNC, 0);
    assert_int_equal(ts_ps_create(cl, "big", &o, NULL), 0);
    reader_arg r = {0};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, reader_thread, &r), 0);
    float *g = malloc(N_READER * sizeof(float));
    for (size_t i = 0; i < N_READER; i++)
        g[i] = 1.0f;
    ts_tensor_t t = {.data = g, .dtype = TS_FLOAT32, .ndim = 1, .shape = {N_READER}};
    for (int k = 0; k < 40; k++)
        assert_int_equal(ts_ps_push(cl, "big", &t, 0, 1.0, NULL), 0);
    atomic_store(&r.stop, 1);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(r.bad, 0);
    assert_true(r.pulls > 0);
    free(g);
    float *w = malloc(N_READER * sizeof(float));
    (void)pull_param(cl, "big", w, N_READER);
    assert_true(w[0] == 40.0f && w[N_READER - 1] == 40.0f);
    free(w);
}

/* Momentum and Adam steps as docs/PS.md writes them (float32 arithmetic). */
static void test_momentum_adam(void **state)
{
    (void)state;
    put_param("mom", 2, 1.0f);
    ts_ps_options_t o = opts(TS_PS_MOMENTUM, TS_PS_ASYNC, 0.5);
    o.beta1 = 0.5;
    assert_int_equal(ts_ps_create(cl, "mom", &o, NULL), 0);
    float g[2] = {1.0f, -2.0f}, w[2];
    ts_tensor_t t = {.data = g, .dtype = TS_FLOAT32, .ndim = 1, .shape = {2}};
    assert_int_equal(ts_ps_push(cl, "mom", &t, 0, 1.0, NULL), 0);
    assert_int_equal(ts_ps_push(cl, "mom", &t, 0, 1.0, NULL), 0);
    (void)pull_param(cl, "mom", w, 2);
    /* v1 = g, w1 = 1 - 0.5 g; v2 = 1.5 g, w2 = w1 - 0.75 g = 1 - 1.25 g */
    assert_true(w[0] == -0.25f && w[1] == 3.5f);

    put_param("adam", 2, 1.0f);
    o = opts(TS_PS_ADAM, TS_PS_ASYNC, 0.1);
    assert_int_equal(ts_ps_create(cl, "adam", &o, NULL), 0);
    for (int k = 0; k < 3; k++)
        assert_int_equal(ts_ps_push(cl, "adam", &t, 0, 1.0, NULL), 0);
    (void)pull_param(cl, "adam", w, 2);
    /* A constant gradient: every bias-corrected step is lr * g / (|g| + eps'), about 0.1. */
    assert_true(fabsf(w[0] - 0.7f) < 1e-5f && fabsf(w[1] - 1.3f) < 1e-5f);
    /* Creating again zeroes the slots: the next step is again exactly one lr. */
    assert_int_equal(ts_ps_create(cl, "adam", &o, NULL), 0);
    assert_int_equal(ts_ps_push(cl, "adam", &t, 0, 1.0, NULL), 0);
    (void)pull_param(cl, "adam", w, 2);
    assert_true(fabsf(w[0] - 0.6f) < 1e-5f && fabsf(w[1] - 1.4f) < 1e-5f);
    /*
     * The first step from 0 is lr exactly, to a few float32 ulps (PS.md: 1 - beta computed in
     * double and rounded once; 1.0f - 0.999f would make it 0.10000066).
     */
    put_param("adam0", 2, 0.0f);
    assert_int_equal(ts_ps_create(cl, "adam0", &o, NULL), 0);
    assert_int_equal(ts_ps_push(cl, "adam0", &t, 0, 1.0, NULL), 0);
    (void)pull_param(cl, "adam0", w, 2);
    assert_true(fabsf(w[0] + 0.1f) < 3e-8f && fabsf(w[1] - 0.1f) < 3e-8f);
}

/* Rows are made lazily by a counter-based initializer: two daemons give identical rows. */
static void test_emb_lazy_identical(void **state)
{
    (void)state;
    assert_int_equal(tsh_server_start(&extra, NULL), 0);
    assert_int_equal(ts_client_open(&extra_cl, extra.addr, NULL), 0);
    ts_client_t *c2 = extra_cl;
    ts_emb_options_t o;
    ts_emb_options_init(&o, 16);
    o.seed = 42;
    o.init = TS_PS_INIT_NORMAL;
    o.init_scale = 1.0;
    assert_int_equal(ts_emb_create(cl, "emb", &o), 0);
    assert_int_equal(ts_emb_create(cl, "emb", &o), 0); /* the same settings again: fine */
    assert_int_equal(ts_emb_create(c2, "emb", &o), 0);
    /* The daemons see the ids in different orders. */
    int64_t ids[6] = {3, 1000000007, 0, 77, 5, 1ll << 40};
    int64_t rev[6] = {1ll << 40, 5, 77, 0, 1000000007, 3};
    float a[6 * 16], b[6 * 16], a2[6 * 16];
    assert_int_equal(ts_emb_pull(cl, "emb", ids, 6, 16, a, NULL), 0);
    assert_int_equal(ts_emb_pull(c2, "emb", rev, 6, 16, b, NULL), 0);
    for (int i = 0; i < 6; i++)
        assert_memory_equal(a + i * 16, b + (5 - i) * 16, 16 * sizeof(float));
    /* The same rows again (they exist now), and rows differ between ids. */
    assert_int_equal(ts_emb_pull(cl, "emb", ids, 6, 16, a2, NULL), 0);
    assert_memory_equal(a, a2, sizeof(a));
    assert_true(memcmp(a, a + 16, 16 * sizeof(float)) != 0);
    double sum = 0, sq = 0;
    for (int i = 0; i < 6 * 16; i++) {
        sum += a[i];
        sq += (double)a[i] * a[i];
    }
    assert_true(fabs(sum / 96) < 0.5 && sq / 96 > 0.3 && sq / 96 < 3.0); /* roughly N(0, 1) */
    /* Other settings under the same name are refused. */
    o.seed = 43;
    assert_int_equal(ts_emb_create(cl, "emb", &o), TS_EINVAL);
}

/* Duplicate ids: merged into one step on push, each place filled on pull. */
static void test_emb_duplicates(void **state)
{
    (void)state;
    ts_emb_options_t o;
    ts_emb_options_init(&o, 2);
    o.init = TS_PS_INIT_ZEROS;
    o.optimizer = TS_PS_MOMENTUM;
    o.lr = 1.0;
    o.beta1 = 0.5;
    assert_int_equal(ts_emb_create(cl, "dup", &o), 0);
    int64_t ids[3] = {5, 5, 7};
    float g[6] = {1, 10, 2, 20, 3, 30};
    uint64_t v1 = 0, v2 = 0;
    assert_int_equal(ts_emb_push(cl, "dup", ids, 3, 2, g, 1.0, &v1), 0);
    /*
     * Merged: row 5 gets one momentum step with g = (3, 30): v = g, w = -g. Two separate steps
     * would give v = 0.5 * 1 + 2 = 2.5, w = -1 - 2.5 = -3.5 in its first column.
     */
    int64_t q[5] = {7, 5, 7, 9, 5};
    float out[10];
    assert_int_equal(ts_emb_pull(cl, "dup", q, 5, 2, out, &v2), 0);
    assert_true(v2 == v1);
    float want[10] = {-3, -30, -3, -30, -3, -30, 0, 0, -3, -30};
    assert_memory_equal(out, want, sizeof(want));
    /* A scale multiplies the gradients. */
    float g2[2] = {1, 1};
    int64_t one[1] = {9};
    assert_int_equal(ts_emb_push(cl, "dup", one, 1, 2, g2, -2.0, NULL), 0);
    assert_int_equal(ts_emb_pull(cl, "dup", one, 1, 2, out, NULL), 0);
    assert_true(out[0] == 2.0f && out[1] == 2.0f);
    /* On a single server, errors come as the server gave them (no cluster shard named). */
    uint64_t vs[1];
    size_t nv = 0;
    assert_int_equal(ts_emb_versions(cl, "nonesuch", vs, 1, &nv), TS_ENOENT);
    assert_string_equal(ts_last_error(), "EMB_PULL: no embedding table nonesuch (EMB_CREATE)");
}

/* Bad input gets a clear error and changes nothing. */
static void test_bad_input(void **state)
{
    (void)state;
    put_param("bad", 4, 5.0f);
    ts_ps_options_t o = opts(TS_PS_SGD, TS_PS_ASYNC, 1.0);
    assert_int_equal(ts_ps_create(cl, "bad", &o, NULL), 0);
    float w[4], g[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    uint64_t v0 = pull_param(cl, "bad", w, 4);
    /* Another shape. */
    ts_tensor_t t = {.data = g, .dtype = TS_FLOAT32, .ndim = 1, .shape = {8}};
    assert_int_equal(ts_ps_push(cl, "bad", &t, 0, 1.0, NULL), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "shape"));
    t.ndim = 2;
    t.shape[0] = 2;
    t.shape[1] = 2;
    assert_int_equal(ts_ps_push(cl, "bad", &t, 0, 1.0, NULL), TS_EINVAL);
    /* Another dtype (refused by the client before it sends). */
    t.ndim = 1;
    t.shape[0] = 4;
    t.dtype = TS_FLOAT64;
    assert_int_equal(ts_ps_push(cl, "bad", &t, 0, 1.0, NULL), TS_EINVAL);
    t.dtype = TS_FLOAT32;
    /* A NaN, an infinity, a non-finite scale. */
    g[2] = NAN;
    assert_int_equal(ts_ps_push(cl, "bad", &t, 0, 1.0, NULL), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "NaN"));
    g[2] = INFINITY;
    assert_int_equal(ts_ps_push(cl, "bad", &t, 0, 1.0, NULL), TS_EINVAL);
    g[2] = 1;
    assert_int_equal(ts_ps_push(cl, "bad", &t, 0, NAN, NULL), TS_EINVAL);
    assert_true(pull_param(cl, "bad", w, 4) == v0 && w[2] == 5.0f);
    /* Not a parameter; a missing bin; a bin that is not one float32 tensor. */
    put_param("plain", 4, 0.0f);
    assert_int_equal(ts_ps_push(cl, "plain", &t, 0, 1.0, NULL), TS_ENOENT);
    assert_int_equal(ts_ps_create(cl, "missing", &o, NULL), TS_ENOENT);
    ts_value_t *iv = ts_int_new(3);
    assert_int_equal(ts_put(cl, "notatensor", iv, NULL), 0);
    ts_value_free(iv);
    assert_int_equal(ts_ps_create(cl, "notatensor", &o, NULL), TS_EINVAL);
    /* Bad settings. */
    o.lr = -1;
    assert_int_equal(ts_ps_create(cl, "plain", &o, NULL), TS_EINVAL);
    o = opts(TS_PS_SGD, TS_PS_SYNC, 1.0);
    o.sync_k = 0;
    assert_int_equal(ts_ps_create(cl, "plain", &o, NULL), TS_EINVAL);
    o.sync_k = 2;
    o.tolerance = 5000;
    assert_int_equal(ts_ps_create(cl, "plain", &o, NULL), TS_EINVAL);

    /* Tables: unknown, ids out of range (no row made), another dim. */
    int64_t ids[2] = {1, 2};
    float rows[4];
    assert_int_equal(ts_emb_pull(cl, "no_table", ids, 2, 2, rows, NULL), TS_ENOENT);
    ts_emb_options_t e;
    ts_emb_options_init(&e, 2);
    e.num_ids = 100;
    e.init = TS_PS_INIT_ZEROS;
    assert_int_equal(ts_emb_create(cl, "ranged", &e), 0);
    int64_t out_of_range[2] = {99, 100};
    assert_int_equal(ts_emb_pull(cl, "ranged", out_of_range, 2, 2, rows, NULL), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "out of range"));
    int64_t neg[1] = {-1};
    assert_int_equal(ts_emb_pull(cl, "ranged", neg, 1, 2, rows, NULL), TS_EINVAL);
    float gg[4] = {1, 2, 3, NAN};
    uint64_t tv0 = 0, tv1 = 0;
    assert_int_equal(ts_emb_pull(cl, "ranged", ids, 2, 2, rows, &tv0), 0);
    assert_int_equal(ts_emb_push(cl, "ranged", ids, 2, 2, gg, 1.0, NULL), TS_EINVAL);
    assert_int_equal(ts_emb_push(cl, "ranged", out_of_range, 2, 2, gg, 1.0, NULL), TS_EINVAL);
    assert_int_equal(ts_emb_pull(cl, "ranged", ids, 2, 2, rows, &tv1), 0);
    assert_true(tv1 == tv0 && rows[0] == 0 && rows[3] == 0);
    assert_int_equal(ts_emb_pull(cl, "ranged", ids, 2, 3, rows, NULL), TS_EINVAL);
    e.dim = 0;
    assert_int_equal(ts_emb_create(cl, "zero_dim", &e), TS_EINVAL);
}

/*
 * A stream's or a replay table's name is no parameter's: every PS_ request on one is refused
 * INVALID as a PUT is (PS_CREATE and PS_PULL were NOT_FOUND "no such bin", PS_PUSH
 * on a stream NOT_FOUND "not a parameter"), with nothing changed. Embedding tables have names of
 * their own: one named as a stream or a replay table is made, pulled and pushed (EMB_PULL and
 * EMB_PUSH on a replay table's name were INVALID).
 */
static void test_other_kinds(void **state)
{
    (void)state;
    assert_int_equal(ts_stream_create(cl, "kind/s", NULL, NULL), 0);
    assert_int_equal(ts_table_create(cl, "kind/t", NULL, NULL), 0);
    ts_ps_options_t o = opts(TS_PS_SGD, TS_PS_ASYNC, 1.0);
    float g[4] = {1, 1, 1, 1};
    ts_tensor_t t = {.data = g, .dtype = TS_FLOAT32, .ndim = 1, .shape = {4}};
    const char *names[2] = {"kind/s", "kind/t"};
    const char *msgs[2] = {"bin 'kind/s' is a stream", "bin 'kind/t' is a replay table"};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(ts_ps_create(cl, names[i], &o, NULL), TS_EINVAL);
        assert_string_equal(ts_last_error(), msgs[i]);
        assert_int_equal(ts_ps_push(cl, names[i], &t, 0, 1.0, NULL), TS_EINVAL);
        assert_string_equal(ts_last_error(), msgs[i]);
        ts_items_t *items = NULL;
        assert_int_equal(ts_ps_pull(cl, names[i], 0, &items, NULL), TS_EINVAL);
        assert_string_equal(ts_last_error(), msgs[i]);
        assert_null(items);

        ts_emb_options_t e;
        ts_emb_options_init(&e, 2);
        e.init = TS_PS_INIT_ZEROS;
        e.lr = 1.0;
        assert_int_equal(ts_emb_create(cl, names[i], &e), 0);
        int64_t ids[1] = {7};
        float rows[2] = {5, 5}, grads[2] = {1, 2};
        uint64_t v0 = 0, v1 = 0;
        assert_int_equal(ts_emb_pull(cl, names[i], ids, 1, 2, rows, &v0), 0);
        assert_true(rows[0] == 0 && rows[1] == 0);
        assert_int_equal(ts_emb_push(cl, names[i], ids, 1, 2, grads, 1.0, &v1), 0);
        assert_true(v1 > v0);
        assert_int_equal(ts_emb_pull(cl, names[i], ids, 1, 2, rows, NULL), 0);
        assert_true(rows[0] == -1 && rows[1] == -2);
    }
    /* The stream and the table are as they were. */
    ts_stream_state_t ss;
    assert_int_equal(ts_stream_credit(cl, "kind/s", 0, &ss), 0);
    assert_int_equal(ss.last_id, 0);
    uint64_t key = 1;
    ts_table_state_t ts;
    assert_int_equal(ts_table_remove(cl, "kind/t", 1, &key, &ts), 0);
    assert_true(ts.size == 0 && ts.inserts == 0 && ts.skipped == 1);
}

/* --max-memory counts optimizer slots and embedding rows. */
static void test_max_memory(void **state)
{
    (void)state;
    const char *args[] = {"--max-memory", "8388608", NULL};
    assert_int_equal(tsh_server_start(&extra, args), 0);
    assert_int_equal(ts_client_open(&extra_cl, extra.addr, NULL), 0);
    ts_client_t *c = extra_cl;
    /* 1.5 MiB of parameter; Adam's two slots (3 MiB) fit, a second such parameter's do not. */
    size_t n = 384 * 1024;
    float *d = calloc(n, sizeof(float));
    int64_t shape[1] = {(int64_t)n};
    ts_value_t *t = ts_tensor_new(TS_FLOAT32, 1, shape, d, TS_BORROW);
    assert_int_equal(ts_put(c, "p1", t, NULL), 0);
    assert_int_equal(ts_put(c, "p2", t, NULL), 0);
    ts_value_free(t);
    ts_ps_options_t o = opts(TS_PS_ADAM, TS_PS_ASYNC, 0.1);
    assert_int_equal(ts_ps_create(c, "p1", &o, NULL), 0);
    /*
     * Creating it again (while the limit would not hold the slots twice) gives back the old
     * slots and counts the new ones: no drift beyond the few KiB of queued replies, far below
     * the parameter's 16 KiB of bookkeeping.
     */
    int64_t used = tc_stat_int(c, "used_memory");
    assert_int_equal(ts_ps_create(c, "p1", &o, NULL), 0);
    assert_true(llabs(tc_stat_int(c, "used_memory") - used) < 8192);
    assert_int_equal(ts_ps_create(c, "p2", &o, NULL), TS_EOOM);
    /* SGD has no slots: it fits. */
    o.optimizer = TS_PS_SGD;
    assert_int_equal(ts_ps_create(c, "p2", &o, NULL), 0);
    /* Rows: 64 floats each; 64k new rows (16 MiB and more) cannot be made, nothing is. */
    ts_emb_options_t e;
    ts_emb_options_init(&e, 64);
    assert_int_equal(ts_emb_create(c, "rows", &e), 0);
    size_t k = 65536;
    int64_t *ids = malloc(k * sizeof(int64_t));
    float *out = malloc(k * 64 * sizeof(float));
    for (size_t i = 0; i < k; i++)
        ids[i] = (int64_t)i;
    assert_int_equal(ts_emb_pull(c, "rows", ids, k, 64, out, NULL), TS_EOOM);
    assert_int_equal(ts_emb_pull(c, "rows", ids, 1024, 64, out, NULL), 0);
    free(ids);
    free(out);
    free(d);
}

/*
 * A step's new value counts what its buffer really takes: a parameter of 4 MiB + 64 bytes of
 * data sits in a 6 MiB buffer, so while a step runs the old value and the waiting gradient (12
 * MiB with their buffers) and the new value (6 MiB) need over 18 MiB: under --max-memory 17m
 * the push is refused with nothing changed (counting only the new value's record, about 16.8
 * MB, it went through), and under 20m it is applied and used_memory stays under the limit.
 */
static void test_step_counts_buffer(void **state)
{
    (void)state;
    size_t n = 1024 * 1024 + 16;
    float *d = calloc(n, sizeof(float));
    int64_t shape[1] = {(int64_t)n};
    ts_tensor_t g = {.data = d, .dtype = TS_FLOAT32, .ndim = 1, .shape = {(int64_t)n}};
    const char *limits[2] = {"17m", "20m"};
    for (int i = 0; i < 2; i++) {
        const char *args[] = {"--max-memory", limits[i], NULL};
        assert_int_equal(tsh_server_start(&extra, args), 0);
        assert_int_equal(ts_client_open(&extra_cl, extra.addr, NULL), 0);
        ts_value_t *t = ts_tensor_new(TS_FLOAT32, 1, shape, d, TS_BORROW);
        uint64_t v0 = 0;
        assert_int_equal(ts_put(extra_cl, "big", t, &v0), 0);
        ts_value_free(t);
        ts_ps_options_t o = opts(TS_PS_SGD, TS_PS_ASYNC, 0.1);
        assert_int_equal(ts_ps_create(extra_cl, "big", &o, NULL), 0);
        uint64_t v = 0;
        int rc = ts_ps_push(extra_cl, "big", &g, 0, 1.0, &v);
        assert_int_equal(rc, i == 0 ? TS_EOOM : 0);
        int64_t max = i == 0 ? 17 << 20 : 20 << 20;
        assert_true(tc_stat_int(extra_cl, "used_memory") <= max);
        ts_client_free(extra_cl);
        extra_cl = NULL;
        assert_int_equal(tsh_server_stop(&extra), 0);
        tsh_server_cleanup(&extra);
        memset(&extra, 0, sizeof(extra));
    }
    free(d);
}

/*
 * Rows that exist are read and updated near the limit: 512 rows of 32 KiB (16 MiB) under
 * --max-memory 44m, then a pull of all 512 (a 16 MiB reply, in an 18 MiB buffer) and a push to
 * all 512 (a 16 MiB gradient) go through, though room for 512 more rows (the arrays doubled to
 * 32 MiB) would not fit with them; 512 new ids are refused, with nothing made.
 */
static void test_existing_rows_near_limit(void **state)
{
    (void)state;
    const char *args[] = {"--max-memory", "44m", NULL};
    assert_int_equal(tsh_server_start(&extra, args), 0);
    assert_int_equal(ts_client_open(&extra_cl, extra.addr, NULL), 0);
    enum { DIM = 8192, N = 512 };
    ts_emb_options_t e;
    ts_emb_options_init(&e, DIM);
    assert_int_equal(ts_emb_create(extra_cl, "near", &e), 0);
    int64_t *ids = malloc(N * sizeof(int64_t));
    float *rows = malloc((size_t)N * DIM * sizeof(float));
    float *again = malloc((size_t)N * DIM * sizeof(float));
    float *grads = calloc((size_t)N * DIM, sizeof(float));
    assert_non_null(ids);
    assert_non_null(rows);
    assert_non_null(again);
    assert_non_null(grads);
    for (int64_t i = 0; i < N; i++)
        ids[i] = i;
    for (int64_t i = 0; i < N; i += 128) /* made a quarter at a time */
        assert_int_equal(ts_emb_pull(extra_cl, "near", ids + i, 128, DIM, rows, NULL), 0);
    int64_t overhead = tc_stat_int(extra_cl, "overhead_bytes");
    assert_int_equal(ts_emb_pull(extra_cl, "near", ids, N, DIM, rows, NULL), 0);
    assert_int_equal(ts_emb_push(extra_cl, "near", ids, N, DIM, grads, 1.0, NULL), 0);
    assert_int_equal(ts_emb_pull(extra_cl, "near", ids, N, DIM, again, NULL), 0);
    assert_memory_equal(rows, again, (size_t)N * DIM * sizeof(float)); /* zero gradients */
    /* The arrays did not grow for rows that were there. */
    assert_int_equal(tc_stat_int(extra_cl, "overhead_bytes"), overhead);
    for (int64_t i = 0; i < N; i++)
        ids[i] = N + i;
    assert_int_equal(ts_emb_pull(extra_cl, "near", ids, N, DIM, rows, NULL), TS_EOOM);
    assert_int_equal(tc_stat_int(extra_cl, "overhead_bytes"), overhead);
    assert_true(tc_stat_int(extra_cl, "used_memory") <= 44 << 20);
    free(ids);
    free(rows);
    free(again);
    free(grads);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_async_sum_exact),
        cmocka_unit_test(test_sync_average_exact),
        cmocka_unit_test(test_sync_stale_rejected),
        cmocka_unit_test(test_sync_step_of_deleted_bin),
        cmocka_unit_test(test_pull_if_newer),
        cmocka_unit_test(test_reader_sees_whole_tensors),
        cmocka_unit_test(test_momentum_adam),
        cmocka_unit_test_teardown(test_emb_lazy_identical, extra_teardown),
        cmocka_unit_test(test_emb_duplicates),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_other_kinds),
        cmocka_unit_test_teardown(test_max_memory, extra_teardown),
        cmocka_unit_test_teardown(test_step_counts_buffer, extra_teardown),
        cmocka_unit_test_teardown(test_existing_rows_near_limit, extra_teardown),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
