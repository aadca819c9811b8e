/*
 * RL helpers against a real tensord, trainer and workers in this process: awaiting parameters
 * (timeout versus update), versions that resume after a trainer restart and never go back,
 * staleness filtering and its counters, blocking collect, bin prefixes, back-pressure, and a
 * daemon restart survived and reported.
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
#include <time.h>

#include "harness.h"
#include "tensorshare/rl.h"
#include "tensorshare/tensorshare.h"

#define WAIT_MS 20000 /* generous bound for anything that should happen "soon" */

typedef struct fixture {
    tsh_server srv;
    ts_client_t *tc; /* the trainer's client */
    ts_client_t *wc; /* the worker's client */
} fixture;

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int setup(void **state)
{
    static fixture f;
    memset(&f, 0, sizeof(f));
    if (tsh_server_start(&f.srv, NULL) != 0)
        return -1;
    if (ts_client_open(&f.tc, f.srv.addr, NULL) != 0)
        return -1;
    if (ts_client_open(&f.wc, f.srv.unix_addr, NULL) != 0)
        return -1;
    *state = &f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    kill(f->srv.pid, SIGCONT); /* a test that failed while the daemon was stopped */
    ts_client_free(f->tc);
    ts_client_free(f->wc);
    int rc = tsh_server_stop(&f->srv);
    tsh_server_cleanup(&f->srv);
    return rc == 0 ? 0 : -1;
}

/* Parameters {w: float32[4] filled with x, version_copy: copy}. Owned by the caller. */
static ts_value_t *make_params(float x, int64_t copy)
{
    float w[4] = {x, x, x, x};
    const int64_t shape[1] = {4};
    ts_value_t *p = ts_map_new();
    assert_non_null(p);
    assert_int_equal(ts_map_set(p, "w", ts_tensor_new(TS_FLOAT32, 1, shape, w, TS_COPY)), 0);
    assert_int_equal(ts_map_set(p, "version_copy", ts_int_new(copy)), 0);
    return p;
}

static int64_t publish(ts_rl_trainer_t *t, float x)
{
    int64_t expect = ts_rl_trainer_version(t) + 1;
    ts_value_t *p = make_params(x, expect);
    int64_t v = -2;
    assert_int_equal(ts_rl_trainer_publish(t, p, &v), 0);
    ts_value_free(p);
    assert_int_equal(v, expect);
    return v;
}

static float params_w0(const ts_rl_params_t *p)
{
    const ts_tensor_t *t = ts_map_get_tensor(ts_rl_params_value(p), "w");
    assert_non_null(t);
    assert_int_equal(t->dtype, TS_FLOAT32);
    return ((const float *)t->data)[0];
}

/* Experience {i: int}. */
static void add_item(ts_rl_worker_t *w, int64_t i)
{
    ts_value_t *d = ts_map_new();
    assert_int_equal(ts_map_set(d, "i", ts_int_new(i)), 0);
    assert_int_equal(ts_rl_worker_add(w, d, TS_COPY), 0);
    ts_value_free(d);
}

/* Wait (bounded) until the worker holds at least version v. */
static void wait_worker_version(ts_rl_worker_t *w, int64_t v)
{
    int64_t end = now_ms() + WAIT_MS;
    ts_rl_worker_stats_t st;
    do {
        ts_rl_worker_stats(w, &st);
        if (st.version >= v)
            return;
        sleep_ms(5);
    } while (now_ms() < end);
    fail_msg("worker stuck at version %lld, expected %lld", (long long)st.version, (long long)v);
}

typedef struct publisher {
    ts_rl_trainer_t *t;
    long delay_ms;
    float x;
} publisher;

static void *publish_later(void *arg)
{
    publisher *pb = arg;
    sleep_ms(pb->delay_ms);
    ts_value_t *p = make_params(pb->x, ts_rl_trainer_version(pb->t) + 1);
    int rc = ts_rl_trainer_publish(pb->t, p, NULL);
    ts_value_free(p);
    return rc == 0 ? pb : NULL;
}

static void test_await_timeout_and_update(void **state)
{
    fixture *f = *state;
    ts_rl_worker_t *w = NULL;
    assert_int_equal(ts_rl_worker_new(&w, f->wc, NULL), 0);
    ts_rl_params_t *p = NULL;

    /* Nothing published: no parameters, and waiting times out, visibly. */
    assert_int_equal(ts_rl_worker_params(w, &p), TS_ENOENT);
    assert_int_equal(ts_rl_worker_await(w, 0, &p), TS_ETIMEDOUT);
    assert_int_equal(ts_rl_worker_await(w, 100, &p), TS_ETIMEDOUT);
    assert_null(p);

    ts_rl_trainer_t *t = NULL;
    assert_int_equal(ts_rl_trainer_new(&t, f->tc, NULL), 0);
    assert_int_equal(ts_rl_trainer_version(t), -1);
    assert_int_equal(publish(t, 1.5f), 0);

    /* The first publish is an update. */
    assert_int_equal(ts_rl_worker_await(w, WAIT_MS, &p), 0);
    assert_int_equal(ts_rl_params_version(p), 0);
    assert_true(params_w0(p) == 1.5f);

    /* Nothing newer than what was retrieved: a timeout, not the old parameters again. */
    ts_rl_params_t *q = NULL;
    assert_int_equal(ts_rl_worker_await(w, 150, &q), TS_ETIMEDOUT);
    assert_null(q);

    /* A publish while we wait wakes us with the update. */
    publisher pb = {t, 100, 2.5f};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, publish_later, &pb), 0);
    assert_int_equal(ts_rl_worker_await(w, WAIT_MS, &q), 0);
    void *ret = NULL;
    pthread_join(th, &ret);
    assert_ptr_equal(ret, &pb);
    assert_int_equal(ts_rl_params_version(q), 1);
    assert_true(params_w0(q) == 2.5f);

    /* The old snapshot is still valid while we hold it. */
    assert_true(params_w0(p) == 1.5f);
    ts_rl_params_release(p);

    /* ts_rl_worker_params answers locally with the newest. */
    assert_int_equal(ts_rl_worker_params(w, &p), 0);
    assert_int_equal(ts_rl_params_version(p), 1);
    ts_rl_params_release(p);
    ts_rl_params_release(q);

    ts_rl_worker_stats_t st;
    ts_rl_worker_stats(w, &st);
    assert_int_equal(st.version, 1);
    assert_int_equal(st.retrieved_version, 1);
    assert_int_equal(st.updates, 2);
    assert_int_equal(st.params_failed, 0);
    assert_int_equal(st.connected, 1);
    ts_rl_worker_free(w);
    ts_rl_trainer_free(t);
}

static void test_resume_and_never_backwards(void **state)
{
    fixture *f = *state;
    ts_rl_trainer_t *t = NULL;
    assert_int_equal(ts_rl_trainer_new(&t, f->tc, NULL), 0);
    for (int i = 0; i < 3; i++)
        assert_int_equal(publish(t, (float)i), i);
    ts_rl_trainer_free(t);

    /* A restarted trainer (on a fresh connection) resumes after version 2, not at 0. */
    ts_client_free(f->tc);
    assert_int_equal(ts_client_open(&f->tc, f->srv.addr, NULL), 0);
    assert_int_equal(ts_rl_trainer_new(&t, f->tc, NULL), 0);
    assert_int_equal(ts_rl_trainer_version(t), 2);
    ts_rl_trainer_stats_t ts;
    ts_rl_trainer_stats(t, &ts);
    assert_int_equal(ts.resumed_from, 2);
    assert_int_equal(publish(t, 3.0f), 3);

    ts_rl_worker_t *w = NULL;
    assert_int_equal(ts_rl_worker_new(&w, f->wc, NULL), 0);
    ts_rl_params_t *p = NULL;
    assert_int_equal(ts_rl_worker_params(w, &p), 0); /* published before: there at once */
    assert_int_equal(ts_rl_params_version(p), 3);
    ts_rl_params_release(p);

    /* An older publish (a stale trainer) is ignored by the worker. */
    ts_value_t *old = ts_map_new();
    assert_int_equal(ts_map_set(old, "params", make_params(-1.0f, 1)), 0);
    assert_int_equal(ts_map_set(old, "version", ts_int_new(1)), 0);
    assert_int_equal(ts_put(f->tc, "parameters", old, NULL), 0);
    ts_value_free(old);
    ts_rl_worker_stats_t st;
    int64_t end = now_ms() + WAIT_MS;
    do {
        ts_rl_worker_stats(w, &st);
        sleep_ms(5);
    } while (st.ignored_older == 0 && now_ms() < end);
    assert_int_equal(st.ignored_older, 1);
    assert_int_equal(st.version, 3);
    assert_int_equal(ts_rl_worker_await(w, 0, &p), TS_ETIMEDOUT);
    assert_int_equal(ts_rl_worker_params(w, &p), 0);
    assert_int_equal(ts_rl_params_version(p), 3);
    assert_true(params_w0(p) == 3.0f);
    ts_rl_params_release(p);

    /* The trainer goes on after its own numbering. */
    assert_int_equal(publish(t, 4.0f), 4);
    assert_int_equal(ts_rl_worker_await(w, WAIT_MS, &p), 0);
    assert_int_equal(ts_rl_params_version(p), 4);
    ts_rl_params_release(p);
    ts_rl_worker_free(w);
    ts_rl_trainer_free(t);

    /* Something that is not {params, version} in the bin: the trainer refuses to guess. */
    ts_value_t *junk = ts_int_new(7);
    assert_int_equal(ts_put(f->tc, "parameters", junk, NULL), 0);
    ts_value_free(junk);
    assert_int_equal(ts_rl_trainer_new(&t, f->tc, NULL), TS_EBADRECORD);
    /* The one message channel says why (the RL helpers had none before 0.2). */
    assert_non_null(strstr(ts_last_error(), "parameters"));
    assert_non_null(strstr(ts_last_error(), "{params, version}"));
}

/*
 * The timeout convention (tensorshare.h "Timeouts"): TS_TIMEOUT_DEFAULT is the options'
 * timeout_ms, 0 checks once, other negative values are refused with a message.
 */
static void test_timeout_convention(void **state)
{
    fixture *f = *state;
    ts_rl_options_t o;
    ts_rl_options_init(&o);
    o.timeout_ms = 300;
    ts_rl_trainer_t *t = NULL;
    assert_int_equal(ts_rl_trainer_new(&t, f->tc, &o), 0);
    ts_rl_worker_t *w = NULL;
    assert_int_equal(ts_rl_worker_new(&w, f->wc, &o), 0);
    ts_rl_batch_t *b = NULL;
    int64_t t0 = now_ms();
    assert_int_equal(ts_rl_trainer_collect(t, 0, TS_TIMEOUT_DEFAULT, &b), TS_ETIMEDOUT);
    int64_t el = now_ms() - t0;
    assert_true(el >= 250 && el < 5000);
    assert_true(strlen(ts_last_error()) > 0);
    ts_rl_params_t *p = NULL;
    t0 = now_ms();
    assert_int_equal(ts_rl_worker_await(w, TS_TIMEOUT_DEFAULT, &p), TS_ETIMEDOUT);
    el = now_ms() - t0;
    assert_true(el >= 250 && el < 5000);
    assert_int_equal(ts_rl_worker_await(w, 0, &p), TS_ETIMEDOUT);
    assert_int_equal(ts_rl_worker_flush(w, TS_TIMEOUT_DEFAULT), 0);

    assert_int_equal(ts_rl_trainer_collect(t, 0, -5, &b), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "timeout_ms"));
    assert_int_equal(ts_rl_worker_await(w, -5, &p), TS_EINVAL);
    assert_int_equal(ts_rl_worker_flush(w, -5), TS_EINVAL);
    ts_rl_worker_free(w);
    ts_rl_trainer_free(t);

    o.timeout_ms = -5;
    assert_int_equal(ts_rl_trainer_new(&t, f->tc, &o), TS_EINVAL);
    assert_int_equal(ts_rl_worker_new(&w, f->wc, &o), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "timeout_ms"));
}

static void test_filter_and_collect(void **state)
{
    fixture *f = *state;
    ts_rl_options_t o;
    ts_rl_options_init(&o);
    o.staleness_tolerance = 1;
    ts_rl_trainer_t *t = NULL;
    assert_int_equal(ts_rl_trainer_new(&t, f->tc, &o), 0);
    ts_rl_worker_t *w = NULL;
    assert_int_equal(ts_rl_worker_new(&w, f->wc, NULL), 0);

    /* Empty: no wait and a short wait both time out. */
    ts_rl_batch_t *b = NULL;
    assert_int_equal(ts_rl_trainer_collect(t, 0, 0, &b), TS_ETIMEDOUT);
    assert_int_equal(ts_rl_trainer_collect(t, 0, 100, &b), TS_ETIMEDOUT);
    assert_null(b);

    /* Before the first publish everything passes, tagged -1. */
    add_item(w, 100);
    assert_int_equal(ts_rl_worker_flush(w, WAIT_MS), 0);
    assert_int_equal(ts_rl_trainer_collect(t, 0, WAIT_MS, &b), 0);
    assert_int_equal(ts_rl_batch_count(b), 1);
    assert_int_equal(ts_rl_batch_version(b, 0), -1);
    ts_rl_batch_free(b);

    assert_int_equal(publish(t, 0.0f), 0);
    add_item(w, 1); /* still tagged -1: nothing retrieved yet */
    add_item(w, 2);
    ts_rl_params_t *p = NULL;
    assert_int_equal(ts_rl_worker_await(w, WAIT_MS, &p), 0);
    ts_rl_params_release(p);
    add_item(w, 3); /* tagged 0 */
    add_item(w, 4);
    add_item(w, 5);
    assert_int_equal(publish(t, 1.0f), 1);
    assert_int_equal(publish(t, 2.0f), 2);
    wait_worker_version(w, 2);
    assert_int_equal(ts_rl_worker_await(w, WAIT_MS, &p), 0);
    assert_int_equal(ts_rl_params_version(p), 2);
    ts_rl_params_release(p);
    add_item(w, 6); /* tagged 2 */
    add_item(w, 7);
    assert_int_equal(ts_rl_worker_flush(w, WAIT_MS), 0);
    /* And one item that is not {data, version} at all. */
    ts_value_t *junk = ts_string_new("junk", 4);
    assert_int_equal(ts_append(f->tc, "data", junk, NULL), 0);
    ts_value_free(junk);

    /* Newest is 2 with tolerance 1: versions 1 and 2 pass; -1 and 0 are stale. */
    size_t kept = 0, dropped = 0;
    int64_t end = now_ms() + WAIT_MS;
    while (kept < 2 && now_ms() < end) {
        int rc = ts_rl_trainer_collect(t, 0, 1000, &b);
        if (rc == TS_ETIMEDOUT)
            continue;
        assert_int_equal(rc, 0);
        for (size_t i = 0; i < ts_rl_batch_count(b); i++) {
            assert_int_equal(ts_rl_batch_version(b, i), 2);
            int64_t x;
            assert_int_equal(ts_map_get_int(ts_rl_batch_data(b, i), "i", &x), 0);
            assert_int_equal(x, 6 + (int64_t)kept);
            kept++;
        }
        assert_null(ts_rl_batch_data(b, ts_rl_batch_count(b)));
        dropped += ts_rl_batch_dropped(b);
        ts_rl_batch_free(b);
    }
    assert_int_equal(kept, 2);
    assert_int_equal(dropped, 6);
    ts_rl_trainer_stats_t st;
    ts_rl_trainer_stats(t, &st);
    assert_int_equal(st.received, 3);
    assert_int_equal(st.dropped_stale, 5);
    assert_int_equal(st.dropped_malformed, 1);
    assert_int_equal(st.newest_seen, 2);
    assert_int_equal(st.published, 3);

    /* A blocking collect is woken by the daemon when an item arrives. */
    ts_rl_worker_stats_t ws;
    ts_rl_worker_stats(w, &ws);
    assert_int_equal(ws.added, 8);
    assert_int_equal(ws.add_failed, 0);
    pthread_t th;
    publisher pb = {t, 100, 3.0f};
    assert_int_equal(pthread_create(&th, NULL, publish_later, &pb), 0);
    pthread_join(th, NULL);
    wait_worker_version(w, 3);
    assert_int_equal(ts_rl_worker_params(w, &p), 0);
    ts_rl_params_release(p);
    add_item(w, 8);
    assert_int_equal(ts_rl_trainer_collect(t, 5, WAIT_MS, &b), 0);
    assert_int_equal(ts_rl_batch_count(b), 1);
    assert_int_equal(ts_rl_batch_version(b, 0), 3);
    ts_rl_batch_free(b);

    /* max_items bounds one batch. */
    for (int i = 0; i < 5; i++)
        add_item(w, 10 + i);
    assert_int_equal(ts_rl_worker_flush(w, WAIT_MS), 0);
    assert_int_equal(ts_rl_trainer_collect(t, 2, WAIT_MS, &b), 0);
    assert_int_equal(ts_rl_batch_count(b), 2);
    ts_rl_batch_free(b);
    assert_int_equal(ts_rl_trainer_collect(t, 0, WAIT_MS, &b), 0);
    assert_int_equal(ts_rl_batch_count(b), 3);
    ts_rl_batch_free(b);

    ts_rl_worker_free(w);
    ts_rl_trainer_free(t);
}

/* A blocking collect that an add from another thread wakes up. */
typedef struct adder {
    ts_rl_worker_t *w;
    long delay_ms;
} adder;

static void *add_later(void *arg)
{
    adder *a = arg;
    sleep_ms(a->delay_ms);
    ts_value_t *d = ts_int_new(42);
    int rc = ts_rl_worker_add(a->w, d, TS_COPY);
    ts_value_free(d);
    if (rc == 0)
        rc = ts_rl_worker_flush(a->w, WAIT_MS);
    return rc == 0 ? a : NULL;
}

static void test_collect_wakes_on_add(void **state)
{
    fixture *f = *state;
    ts_rl_options_t o;
    ts_rl_options_init(&o);
    o.staleness_tolerance = TS_RL_NO_FILTER;
    ts_rl_trainer_t *t = NULL;
    assert_int_equal(ts_rl_trainer_new(&t, f->tc, &o), 0);
    ts_rl_worker_t *w = NULL;
    assert_int_equal(ts_rl_worker_new(&w, f->wc, &o), 0);
    for (int round = 0; round < 3; round++) {
        adder a = {w, 50 + 50 * round};
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, add_later, &a), 0);
        ts_rl_batch_t *b = NULL;
        assert_int_equal(ts_rl_trainer_collect(t, 0, WAIT_MS, &b), 0);
        assert_int_equal(ts_rl_batch_count(b), 1);
        int64_t x;
        assert_int_equal(ts_value_int(ts_rl_batch_data(b, 0), &x), 0);
        assert_int_equal(x, 42);
        ts_rl_batch_free(b);
        void *ret = NULL;
        pthread_join(th, &ret);
        assert_ptr_equal(ret, &a);
    }
    ts_rl_worker_free(w);
    ts_rl_trainer_free(t);
}

static void test_prefixes_separate_experiments(void **state)
{
    fixture *f = *state;
    ts_rl_options_t oa, ob;
    ts_rl_options_init(&oa);
    ts_rl_options_init(&ob);
    oa.prefix = "expA/";
    ob.prefix = "expB/";
    ob.params_bin = "weights";
    ob.data_bin = "rollouts";
    ts_rl_trainer_t *ta = NULL, *tb = NULL;
    ts_rl_worker_t *wa = NULL, *wb = NULL;
    assert_int_equal(ts_rl_trainer_new(&ta, f->tc, &oa), 0);
    assert_int_equal(ts_rl_trainer_new(&tb, f->tc, &ob), 0);
    assert_int_equal(ts_rl_worker_new(&wa, f->wc, &oa), 0);
    assert_int_equal(ts_rl_worker_new(&wb, f->wc, &ob), 0);

    assert_int_equal(publish(ta, 1.0f), 0);
    assert_int_equal(publish(ta, 2.0f), 1);
    assert_int_equal(publish(tb, 9.0f), 0);
    ts_rl_params_t *p = NULL;
    assert_int_equal(ts_rl_worker_await(wa, WAIT_MS, &p), 0);
    wait_worker_version(wa, 1);
    ts_rl_params_release(p);
    assert_int_equal(ts_rl_worker_params(wa, &p), 0);
    assert_true(params_w0(p) == 2.0f);
    ts_rl_params_release(p);
    assert_int_equal(ts_rl_worker_await(wb, WAIT_MS, &p), 0);
    assert_int_equal(ts_rl_params_version(p), 0);
    assert_true(params_w0(p) == 9.0f);
    ts_rl_params_release(p);

    add_item(wa, 1);
    add_item(wb, 2);
    assert_int_equal(ts_rl_worker_flush(wa, WAIT_MS), 0);
    assert_int_equal(ts_rl_worker_flush(wb, WAIT_MS), 0);
    ts_rl_batch_t *b = NULL;
    int64_t x;
    assert_int_equal(ts_rl_trainer_collect(tb, 0, WAIT_MS, &b), 0);
    assert_int_equal(ts_rl_batch_count(b), 1);
    assert_int_equal(ts_map_get_int(ts_rl_batch_data(b, 0), "i", &x), 0);
    assert_int_equal(x, 2);
    ts_rl_batch_free(b);
    assert_int_equal(ts_rl_trainer_collect(ta, 0, WAIT_MS, &b), 0);
    assert_int_equal(ts_rl_batch_count(b), 1);
    assert_int_equal(ts_map_get_int(ts_rl_batch_data(b, 0), "i", &x), 0);
    assert_int_equal(x, 1);
    ts_rl_batch_free(b);

    /* The bins are where the names say. */
    ts_items_t *items = NULL;
    assert_int_equal(ts_peek(f->tc, "expB/weights", 0, &items), 0);
    ts_items_free(items);
    assert_int_equal(ts_peek(f->tc, "expA/parameters", 0, &items), 0);
    ts_items_free(items);
    assert_int_equal(ts_peek(f->tc, "parameters", 0, &items), TS_ENOENT);

    /* Names past the protocol's 255 bytes are refused up front. */
    char longp[300];
    memset(longp, 'x', sizeof(longp) - 1);
    longp[sizeof(longp) - 1] = '\0';
    ts_rl_options_t ol;
    ts_rl_options_init(&ol);
    ol.prefix = longp;
    ts_rl_trainer_t *tl = NULL;
    assert_int_equal(ts_rl_trainer_new(&tl, f->tc, &ol), TS_ENAMETOOLONG);

    ts_rl_worker_free(wa);
    ts_rl_worker_free(wb);
    ts_rl_trainer_free(ta);
    ts_rl_trainer_free(tb);
}

static void test_backpressure(void **state)
{
    fixture *f = *state;
    ts_rl_options_t o;
    ts_rl_options_init(&o);
    o.max_in_flight = 2;
    o.timeout_ms = 200;
    o.staleness_tolerance = TS_RL_NO_FILTER;
    ts_rl_worker_t *w = NULL;
    assert_int_equal(ts_rl_worker_new(&w, f->wc, &o), 0);
    ts_rl_trainer_t *t = NULL;
    assert_int_equal(ts_rl_trainer_new(&t, f->tc, &o), 0);

    /* A stopped daemon answers nothing, so the adds stay in flight. */
    assert_int_equal(kill(f->srv.pid, SIGSTOP), 0);
    add_item(w, 0);
    add_item(w, 1);
    ts_value_t *d = ts_int_new(2);
    assert_int_equal(ts_rl_worker_add(w, d, TS_COPY | TS_RL_NONBLOCK), TS_EAGAIN);
    assert_int_equal(ts_rl_worker_add(w, d, TS_COPY), TS_ETIMEDOUT);
    ts_value_free(d);
    assert_int_equal(ts_rl_worker_flush(w, 0), TS_ETIMEDOUT);
    ts_rl_worker_stats_t st;
    ts_rl_worker_stats(w, &st);
    assert_int_equal(st.in_flight, 2);
    assert_int_equal(kill(f->srv.pid, SIGCONT), 0);

    assert_int_equal(ts_rl_worker_flush(w, WAIT_MS), 0);
    ts_rl_worker_stats(w, &st);
    assert_int_equal(st.in_flight, 0);
    assert_int_equal(st.added, 2);
    size_t got = 0;
    int64_t end = now_ms() + WAIT_MS;
    while (got < 2 && now_ms() < end) {
        ts_rl_batch_t *b = NULL;
        if (ts_rl_trainer_collect(t, 0, 1000, &b) != 0)
            continue;
        got += ts_rl_batch_count(b);
        ts_rl_batch_free(b);
    }
    assert_int_equal(got, 2);
    ts_rl_worker_free(w);
    ts_rl_trainer_free(t);
}

/* Counts of the worker's events, written on the I/O thread. */
typedef struct events {
    atomic_int params, disconnected, resubscribed, add_failed, params_failed;
} events;

static void on_event(ts_rl_worker_t *w, int status, ts_rl_event_t ev, int64_t version, void *arg)
{
    (void)w;
    (void)status;
    (void)version;
    events *e = arg;
    switch (ev) {
    case TS_RL_EV_PARAMS:
        atomic_fetch_add(&e->params, 1);
        break;
    case TS_RL_EV_DISCONNECTED:
        atomic_fetch_add(&e->disconnected, 1);
        break;
    case TS_RL_EV_RESUBSCRIBED:
        atomic_fetch_add(&e->resubscribed, 1);
        break;
    case TS_RL_EV_ADD_FAILED:
        atomic_fetch_add(&e->add_failed, 1);
        break;
    case TS_RL_EV_PARAMS_FAILED:
    case TS_RL_EV_PARAMS_BAD:
        atomic_fetch_add(&e->params_failed, 1);
        break;
    }
}

static void test_daemon_restart(void **state)
{
    fixture *f = *state;
    events ev;
    memset(&ev, 0, sizeof(ev));
    ts_rl_options_t o;
    ts_rl_options_init(&o);
    o.on_event = on_event;
    o.event_arg = &ev;
    o.staleness_tolerance = TS_RL_NO_FILTER;
    ts_rl_worker_t *w = NULL;
    assert_int_equal(ts_rl_worker_new(&w, f->wc, &o), 0);
    ts_rl_trainer_t *t = NULL;
    assert_int_equal(ts_rl_trainer_new(&t, f->tc, &o), 0);
    assert_int_equal(publish(t, 1.0f), 0);
    ts_rl_params_t *p = NULL;
    assert_int_equal(ts_rl_worker_await(w, WAIT_MS, &p), 0);
    ts_rl_params_release(p);
    /* The event is emitted right after the snapshot is installed, which await may beat. */
    int64_t end = now_ms() + WAIT_MS;
    while (atomic_load(&ev.params) == 0 && now_ms() < end)
        sleep_ms(5);
    assert_int_equal(atomic_load(&ev.params), 1);

    tsh_server_kill(&f->srv);

    /* While the daemon is down the worker keeps acting on the last parameters. */
    assert_int_equal(ts_rl_worker_params(w, &p), 0);
    assert_int_equal(ts_rl_params_version(p), 0);
    assert_true(params_w0(p) == 1.0f);
    ts_rl_params_release(p);
    /*
     * An add now is refused at once, or fails later and is reported, or is delivered once the
     * daemon is back: never lost silently.
     */
    ts_value_t *d = ts_map_new();
    assert_int_equal(ts_map_set(d, "i", ts_int_new(99)), 0);
    int add_rc = ts_rl_worker_add(w, d, TS_COPY);
    ts_value_free(d);

    assert_int_equal(tsh_server_restart(&f->srv, NULL), 0);
    int flush_rc = ts_rl_worker_flush(w, WAIT_MS);
    assert_true(flush_rc != TS_ETIMEDOUT);
    int reported = add_rc != 0 || flush_rc != 0;
    if (flush_rc != 0) {
        ts_rl_worker_stats_t fs;
        ts_rl_worker_stats(w, &fs);
        assert_int_equal(fs.add_failed, 1);
        assert_int_equal(atomic_load(&ev.add_failed), 1);
    }

    /* The loss and the recovery are reported, not hidden. */
    ts_rl_worker_stats_t st;
    end = now_ms() + WAIT_MS;
    do {
        ts_rl_worker_stats(w, &st);
        sleep_ms(10);
    } while ((st.resubscribes == 0 || !st.connected || atomic_load(&ev.resubscribed) == 0) &&
             now_ms() < end);
    assert_true(st.disconnects >= 1);
    assert_true(st.resubscribes >= 1);
    assert_int_equal(st.connected, 1);
    assert_true(atomic_load(&ev.disconnected) >= 1);
    assert_true(atomic_load(&ev.resubscribed) >= 1);

    /* The trainer goes on (its client reconnects too); versions continue. */
    int rc;
    int64_t v = -1;
    end = now_ms() + WAIT_MS;
    do {
        ts_value_t *np = make_params(2.0f, -1);
        rc = ts_rl_trainer_publish(t, np, &v);
        ts_value_free(np);
        if (rc != 0)
            sleep_ms(50);
    } while (rc != 0 && now_ms() < end);
    assert_int_equal(rc, 0);
    assert_true(v >= 1);
    assert_int_equal(ts_rl_worker_await(w, WAIT_MS, &p), 0);
    assert_int_equal(ts_rl_params_version(p), v);
    assert_true(params_w0(p) == 2.0f);
    ts_rl_params_release(p);

    add_item(w, 7);
    assert_int_equal(ts_rl_worker_flush(w, WAIT_MS), 0);
    int seen7 = 0, seen99 = 0;
    end = now_ms() + WAIT_MS;
    while (!seen7 && now_ms() < end) {
        ts_rl_batch_t *b = NULL;
        rc = ts_rl_trainer_collect(t, 0, 1000, &b);
        if (rc != 0)
            continue;
        for (size_t i = 0; i < ts_rl_batch_count(b); i++) {
            int64_t x = -1;
            assert_int_equal(ts_map_get_int(ts_rl_batch_data(b, i), "i", &x), 0);
            seen7 += x == 7;
            seen99 += x == 99;
        }
        ts_rl_batch_free(b);
    }
    assert_int_equal(seen7, 1);
    /* The add made during the outage was reported as failed or arrived, exactly once. */
    assert_true(reported ? seen99 == 0 : seen99 == 1);
    ts_rl_worker_free(w);
    ts_rl_trainer_free(t);
}

/*
 * ts_rl_worker_free waits for the adds in flight only up to the worker's timeout_ms (0: not at
 * all), however long the client's request timeout. The adds still in flight are answered later
 * (the daemon resumes) or cancelled (the client is freed while the daemon is still stopped),
 * without any event after the free and without touching freed memory (the sanitizer builds).
 */
static void test_free_waits_only_the_worker_timeout(void **state)
{
    fixture *f = *state;
    static const int timeouts[] = {0, 300};
    for (size_t k = 0; k < sizeof(timeouts) / sizeof(timeouts[0]); k++) {
        ts_client_options_t co;
        ts_client_options_init(&co);
        co.request_timeout_ms = 10000; /* what the free waited for before */
        ts_client_t *c = NULL;
        assert_int_equal(ts_client_open(&c, f->srv.addr, &co), 0);
        events ev;
        memset(&ev, 0, sizeof(ev));
        ts_rl_options_t o;
        ts_rl_options_init(&o);
        o.prefix = k == 0 ? "answered/" : "cancelled/";
        o.timeout_ms = timeouts[k];
        o.on_event = on_event;
        o.event_arg = &ev;
        ts_rl_worker_t *w = NULL;
        assert_int_equal(ts_rl_worker_new(&w, c, &o), 0);

        assert_int_equal(kill(f->srv.pid, SIGSTOP), 0);
        add_item(w, 1);
        add_item(w, 2);
        int64_t start = now_ms();
        ts_rl_worker_free(w);
        int64_t took = now_ms() - start;
        if (k == 0) {
            assert_int_equal(kill(f->srv.pid, SIGCONT), 0);
            /* Both adds arrive after the free, their callbacks finding the worker gone. */
            size_t n = 0;
            int64_t end = now_ms() + WAIT_MS;
            while (n < 2 && now_ms() < end) {
                ts_items_t *items = NULL;
                if (ts_peek(f->tc, "answered/data", 0, &items) == 0)
                    n = ts_items_count(items);
                ts_items_free(items);
                if (n < 2)
                    sleep_ms(10);
            }
            assert_int_equal(n, 2);
            ts_client_free(c);
        } else {
            ts_client_free(c); /* cancels the adds: TS_ECANCELED, no add_failed event */
            assert_int_equal(kill(f->srv.pid, SIGCONT), 0);
        }
        assert_true(took >= timeouts[k]);
        assert_true(took < timeouts[k] + 3000);
        assert_int_equal(atomic_load(&ev.add_failed), 0);
    }
}

/* One collect on its own thread, with what it returned and said. */
typedef struct collect_run {
    ts_rl_trainer_t *t;
    int timeout_ms;
    int rc;
    int no_reply;
    int64_t took;
    char msg[TS_MAX_ERROR_LEN + 1];
} collect_run;

static void *collect_main(void *arg)
{
    collect_run *r = arg;
    ts_rl_batch_t *b = NULL;
    int64_t start = now_ms();
    r->rc = ts_rl_trainer_collect(r->t, 0, r->timeout_ms, &b);
    r->took = now_ms() - start;
    r->no_reply = ts_last_error_no_reply();
    snprintf(r->msg, sizeof(r->msg), "%s", ts_last_error());
    ts_rl_batch_free(b);
    return NULL;
}

/*
 * A collect against a tensord that stops answering (SIGSTOP) returns within its timeout plus
 * one request timeout (rl.h), saying that no reply came: stopped while the collect waits (it
 * took another request timeout for one more get before), and stopped before it starts (timeout
 * 0 asks once). A tensord that answers still gives "no experience kept".
 */
static void test_collect_bounded_when_tensord_does_not_answer(void **state)
{
    fixture *f = *state;
    enum { R = 1000, W = 500, SLACK = 400 };
    ts_client_options_t co;
    ts_client_options_init(&co);
    co.request_timeout_ms = R;
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, f->srv.addr, &co), 0);
    ts_rl_options_t o;
    ts_rl_options_init(&o);
    o.prefix = "stall/";
    ts_rl_trainer_t *t = NULL;
    assert_int_equal(ts_rl_trainer_new(&t, c, &o), 0);

    collect_run run = {.t = t, .timeout_ms = W};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, collect_main, &run), 0);
    sleep_ms(150); /* the get found nothing; the collect waits on the daemon */
    assert_int_equal(kill(f->srv.pid, SIGSTOP), 0);
    pthread_join(th, NULL);
    assert_int_equal(run.rc, TS_ETIMEDOUT);
    assert_string_equal(run.msg, "no reply within the request timeout");
    assert_int_equal(run.no_reply, 1);
    printf("collect(%d ms), daemon stopped during its wait: %lld ms\n", W, (long long)run.took);
    assert_true(run.took >= W && run.took < W + R + SLACK);

    collect_run zero = {.t = t, .timeout_ms = 0};
    collect_main(&zero);
    assert_int_equal(zero.rc, TS_ETIMEDOUT);
    assert_string_equal(zero.msg, "no reply within the request timeout");
    assert_int_equal(zero.no_reply, 1);
    assert_true(zero.took >= R - 50 && zero.took < R + SLACK);
    assert_int_equal(kill(f->srv.pid, SIGCONT), 0);

    collect_run live = {.t = t, .timeout_ms = 100};
    collect_main(&live);
    assert_int_equal(live.rc, TS_ETIMEDOUT);
    assert_string_equal(live.msg, "no experience kept in 'stall/data' within the timeout");
    assert_int_equal(live.no_reply, 0);
    ts_rl_trainer_free(t);
    ts_client_free(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_await_timeout_and_update, setup, teardown),
        cmocka_unit_test_setup_teardown(test_resume_and_never_backwards, setup, teardown),
        cmocka_unit_test_setup_teardown(test_filter_and_collect, setup, teardown),
        cmocka_unit_test_setup_teardown(test_collect_wakes_on_add, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prefixes_separate_experiments, setup, teardown),
        cmocka_unit_test_setup_teardown(test_backpressure, setup, teardown),
        cmocka_unit_test_setup_teardown(test_timeout_convention, setup, teardown),
        cmocka_unit_test_setup_teardown(test_daemon_restart, setup, teardown),
        cmocka_unit_test_setup_teardown(test_free_waits_only_the_worker_timeout, setup, teardown),
        cmocka_unit_test_setup_teardown(test_collect_bounded_when_tensord_does_not_answer, setup,
                                        teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
