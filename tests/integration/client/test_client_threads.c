/*
 * One client shared by many threads: thousands of mixed blocking and asynchronous operations
 * pipelined on one connection, every result checked; and a listener that must see every change
 * of a single writer, in order, without gaps.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdatomic.h>
#include <stdio.h>

#include "harness.h"
#include "test_client_util.h"

#define N_THREADS 16
#define ROUNDS    60 /* per thread; each round is about 10 operations */

static tsh_server srv;
static ts_client_t *cl;

static int group_setup(void **state)
{
    (void)state;
    if (tsh_server_start(&srv, NULL) != 0)
        return -1;
    return ts_client_open(&cl, srv.addr, NULL) == 0 ? 0 : -1;
}

static int group_teardown(void **state)
{
    (void)state;
    ts_client_free(cl);
    int rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    return rc == 0 ? 0 : -1;
}

typedef struct worker {
    int id;
    long ops;
    long errors; /* results that were wrong; must stay 0 */
    char first_error[200];
    tc_latch async_done;
    atomic_long async_expected;
    atomic_long async_bad;
} worker;

static void werr(worker *w, const char *what, int rc)
{
    if (w->errors++ == 0)
        snprintf(w->first_error, sizeof(w->first_error), "thread %d: %s: %s", w->id, what,
                 ts_strerror(rc));
}

/* Async put/append results: status 0 and a version. */
static void store_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    worker *w = arg;
    if (status != 0 || res->version == 0 || res->n_items == 0)
        atomic_fetch_add(&w->async_bad, 1);
    tc_latch_add(&w->async_done, 1);
}

/* Async peek of the thread's "own" bin: one item tagged with the thread id. */
static void peek_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    worker *w = arg;
    if (status != 0 || ts_items_count(res->items) != 1 ||
        tc_tag(ts_items_at(res->items, 0)) != w->id ||
        !tc_check_vec(ts_items_at(res->items, 0), 32, (float)w->id))
        atomic_fetch_add(&w->async_bad, 1);
    tc_latch_add(&w->async_done, 1);
}

static void ping_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    (void)res;
    worker *w = arg;
    if (status != 0)
        atomic_fetch_add(&w->async_bad, 1);
    tc_latch_add(&w->async_done, 1);
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    char own[32], q[32];
    snprintf(own, sizeof(own), "t/%d/own", w->id);
    snprintf(q, sizeof(q), "t/%d/queue", w->id);
    ts_value_t *mine = tc_item(32, (float)w->id, w->id);
    for (int r = 0; r < ROUNDS; r++) {
        int rc;
        uint64_t v1, v2;
        /* put then append k items to a queue; get must return them in order. */
        if ((rc = ts_put(cl, own, mine, &v1)) != 0)
            werr(w, "put", rc);
        int k = 1 + r % 4;
        for (int i = 0; i < k; i++) {
            ts_value_t *it = tc_item(1 + i, (float)(r * 10 + i), r * 10 + i);
            rc = ts_append(cl, q, it, &v2);
            ts_value_free(it);
            if (rc != 0)
                werr(w, "append", rc);
        }
        ts_items_t *items;
        rc = ts_get(cl, q, 0, &items);
        if (rc != 0) {
            werr(w, "get", rc);
        } else {
            if (ts_items_count(items) != (size_t)k || ts_items_remaining(items) != 0)
                werr(w, "get count", 0);
            for (int i = 0; i < k && i < (int)ts_items_count(items); i++) {
                const ts_value_t *it = ts_items_at(items, (size_t)i);
                if (tc_tag(it) != r * 10 + i || !tc_check_vec(it, 1 + i, (float)(r * 10 + i)))
                    werr(w, "get content", 0);
            }
            ts_items_free(items);
        }
        if ((rc = ts_get(cl, q, 0, &items)) != TS_ENOENT)
            werr(w, "get of an emptied bin", rc);
        /* peek of the own bin, blocking and async. */
        if ((rc = ts_peek(cl, own, 0, &items)) != 0) {
            werr(w, "peek", rc);
        } else {
            if (ts_items_count(items) != 1 || tc_tag(ts_items_at(items, 0)) != w->id)
                werr(w, "peek content", 0);
            ts_items_free(items);
        }
        atomic_fetch_add(&w->async_expected, 3);
        if (ts_peek_async(cl, own, 0, peek_cb, w) != 0 ||
            ts_append_async(cl, "t/shared", mine, r % 2 ? TS_COPY : 0, store_cb, w) != 0 ||
            ts_ping_async(cl, ping_cb, w) != 0)
            werr(w, "async submit", 0);
        /* The version only grows: wait returns at once. */
        uint64_t v3;
        if ((rc = ts_wait(cl, own, v1 - 1, 1000, &v3, NULL)) != 0 || v3 < v1)
            werr(w, "wait", rc);
        if (r % 10 == 0) {
            ts_bin_list_t *list;
            if ((rc = ts_list(cl, &list)) != 0)
                werr(w, "list", rc);
            else
                ts_bin_list_free(list);
        }
        w->ops += 7 + k;
    }
    /* The async appends reference mine without TS_COPY: wait before freeing it. */
    long want = atomic_load(&w->async_expected);
    if (tc_latch_wait(&w->async_done, want, TC_WAIT_MS * 3) != want)
        werr(w, "async callbacks missing", 0);
    w->ops += want;
    ts_value_free(mine);
    return NULL;
}

static void test_many_threads_one_client(void **state)
{
    (void)state;
    pthread_t th[N_THREADS];
    worker *w = calloc(N_THREADS, sizeof(*w));
    uint64_t t0 = tc_now_ms();
    for (int i = 0; i < N_THREADS; i++) {
        w[i].id = i;
        tc_latch_init(&w[i].async_done);
        assert_int_equal(pthread_create(&th[i], NULL, worker_main, &w[i]), 0);
    }
    long ops = 0, errors = 0, bad = 0;
    for (int i = 0; i < N_THREADS; i++) {
        pthread_join(th[i], NULL);
        ops += w[i].ops;
        errors += w[i].errors;
        bad += atomic_load(&w[i].async_bad);
        if (w[i].errors > 0)
            printf("%s\n", w[i].first_error);
    }
    uint64_t el = tc_now_ms() - t0;
    printf("%d threads, one client: %ld operations in %llu ms, %ld wrong results\n", N_THREADS, ops,
           (unsigned long long)el, errors + bad);
    assert_int_equal(errors, 0);
    assert_int_equal(bad, 0);
    assert_true(ops >= (long)N_THREADS * ROUNDS * 10);
    /* Every async append arrived. */
    uint32_t removed;
    assert_int_equal(ts_delete(cl, "t/shared", &removed), 0);
    assert_int_equal(removed, N_THREADS * ROUNDS);
    for (int i = 0; i < N_THREADS; i++)
        tc_latch_destroy(&w[i].async_done);
    free(w);
}

/* ---------------------------------------------------------------------------------------------
 * Listener order
 */
#define SEQ_WRITES 1500

typedef struct seq {
    pthread_mutex_t mu;
    long seen;
    uint64_t last_version;
    uint32_t last_n;
    long out_of_order, gaps, coalesced;
    tc_latch latch;
} seq;

static void seq_cb(ts_client_t *c, int status, const ts_notification_t *n, void *arg)
{
    (void)c;
    seq *s = arg;
    if (status != 0)
        return;
    pthread_mutex_lock(&s->mu);
    if (s->seen > 0 && n->version <= s->last_version)
        s->out_of_order++;
    /* The writer appends only: each notification has exactly one more item than the last. */
    if (n->event != TS_EV_APPEND || n->n_items != s->last_n + 1)
        s->gaps++;
    s->coalesced += n->coalesced;
    s->last_version = n->version;
    s->last_n = n->n_items;
    s->seen++;
    pthread_mutex_unlock(&s->mu);
    tc_latch_add(&s->latch, 1);
}

static void test_listener_sees_every_change_in_order(void **state)
{
    (void)state;
    ts_client_t *listener, *writer;
    assert_int_equal(ts_client_open(&listener, srv.unix_addr, NULL), 0);
    assert_int_equal(ts_client_open(&writer, srv.addr, NULL), 0);
    seq s;
    memset(&s, 0, sizeof(s));
    pthread_mutex_init(&s.mu, NULL);
    tc_latch_init(&s.latch);
    assert_int_equal(ts_listen(listener, "seq", seq_cb, &s), 0);
    /* Pipelined async appends from one writer: the server applies them in order. */
    ts_value_t *one = ts_int_new(1);
    for (int i = 0; i < SEQ_WRITES; i++)
        assert_int_equal(ts_append_async(writer, "seq", one, 0, NULL, NULL), 0);
    assert_int_equal(ts_ping(writer), 0); /* after every append */
    assert_int_equal(tc_latch_wait(&s.latch, SEQ_WRITES, TC_WAIT_MS * 3), SEQ_WRITES);
    tc_sleep_ms(100);
    pthread_mutex_lock(&s.mu);
    printf("listener: %ld notifications, %ld out of order, %ld gaps, %ld coalesced\n", s.seen,
           s.out_of_order, s.gaps, s.coalesced);
    assert_int_equal(s.seen, SEQ_WRITES);
    assert_int_equal(s.out_of_order, 0);
    assert_int_equal(s.gaps, 0);
    assert_int_equal(s.last_n, SEQ_WRITES);
    pthread_mutex_unlock(&s.mu);
    ts_value_free(one);
    ts_client_free(writer);
    ts_client_free(listener);
    assert_int_equal(ts_delete(cl, "seq", NULL), 0);
    tc_latch_destroy(&s.latch);
    pthread_mutex_destroy(&s.mu);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_many_threads_one_client),
        cmocka_unit_test(test_listener_sees_every_change_in_order),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
