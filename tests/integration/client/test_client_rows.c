/*
 * The C client's tensor bins and rows against a real tensord (tensorshare.h "Tensor bins and
 * rows"): create, write, read, gather over TCP and the unix socket, every bad argument refused
 * locally or by the server with its code and message, the refusal of put/append/get, a listener
 * that sees one TS_EV_ROWS per write, and threads of two clients writing disjoint rows at once.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "harness.h"
#include "test_client_util.h"

#define ROWS 64
#define COLS 8

static tsh_server srv;
static ts_client_t *tcp, *ux;

static int group_setup(void **state)
{
    (void)state;
    if (tsh_server_start(&srv, NULL) != 0)
        return -1;
    if (ts_client_open(&tcp, srv.addr, NULL) != 0)
        return -1;
    return ts_client_open(&ux, srv.unix_addr, NULL) == 0 ? 0 : -1;
}

static int group_teardown(void **state)
{
    (void)state;
    ts_client_free(tcp);
    ts_client_free(ux);
    int rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    return rc == 0 ? 0 : -1;
}

static void make_bin(ts_client_t *c, const char *name)
{
    int64_t shape[2] = {ROWS, COLS};
    uint64_t v = 0;
    assert_int_equal(ts_tensor_bin_create(c, name, TS_FLOAT32, 2, shape, &v), 0);
    assert_true(v > 0);
}

/* k rows of COLS floats, row i all base + i. */
static ts_value_t *rows_of(int64_t k, float base)
{
    int64_t shape[2] = {k, COLS};
    ts_value_t *t = ts_tensor_alloc(TS_FLOAT32, 2, shape);
    assert_non_null(t);
    float *d = ts_value_tensor(t)->data;
    for (int64_t i = 0; i < k; i++)
        for (int j = 0; j < COLS; j++)
            d[i * COLS + j] = base + (float)i;
    return t;
}

/* The one tensor of a rows reply. */
static const ts_tensor_t *reply_tensor(const ts_items_t *it)
{
    assert_int_equal(ts_items_count(it), 1);
    const ts_tensor_t *t = ts_value_tensor(ts_items_at(it, 0));
    assert_non_null(t);
    return t;
}

static void check_rw(ts_client_t *c, const char *name)
{
    make_bin(c, name);
    ts_value_t *w = rows_of(3, 5.0f);
    uint64_t v = 0;
    assert_int_equal(ts_rows_write(c, name, 10, w, &v), 0);
    ts_value_free(w);
    ts_items_t *it = NULL;
    assert_int_equal(ts_rows_read(c, name, 0, NULL, 9, 14, &it), 0);
    const ts_tensor_t *t = reply_tensor(it);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->shape[0], 5);
    assert_int_equal(t->shape[1], COLS);
    const float *d = t->data;
    assert_true(d[0] == 0.0f && d[COLS] == 5.0f && d[3 * COLS + 7] == 7.0f && d[4 * COLS] == 0.0f);
    assert_true(ts_items_version(it) == v);
    ts_items_free(it);
    int64_t ix[3] = {12, 0, 12};
    assert_int_equal(ts_rows_gather(c, name, -1, "", ix, 3, &it), 0);
    t = reply_tensor(it);
    assert_int_equal(t->shape[0], 3);
    d = t->data;
    assert_true(d[0] == 7.0f && d[COLS] == 0.0f && d[2 * COLS] == 7.0f);
    ts_items_free(it);
    /* No index at all: a tensor of 0 rows. */
    assert_int_equal(ts_rows_gather(c, name, 0, NULL, NULL, 0, &it), 0);
    assert_int_equal(reply_tensor(it)->shape[0], 0);
    ts_items_free(it);
    /* ts_peek shows the whole tensor. */
    assert_int_equal(ts_peek(c, name, 0, &it), 0);
    assert_int_equal(reply_tensor(it)->shape[0], ROWS);
    ts_items_free(it);
}

static void test_rows_tcp(void **state)
{
    (void)state;
    check_rw(tcp, "rows/tcp");
}

static void test_rows_unix(void **state)
{
    (void)state;
    check_rw(ux, "rows/unix");
}

static void test_rows_errors(void **state)
{
    (void)state;
    make_bin(tcp, "rows/err");
    int64_t shape[2] = {ROWS, COLS};
    /* Refused locally. */
    assert_int_equal(ts_tensor_bin_create(tcp, "rows/x", TS_FLOAT32, 0, shape, NULL), TS_EINVAL);
    assert_int_equal(ts_tensor_bin_create(tcp, "rows/x", TS_FLOAT32, 9, shape, NULL), TS_EINVAL);
    assert_int_equal(ts_tensor_bin_create(tcp, "rows/x", TS_DTYPE_INVALID, 2, shape, NULL),
                     TS_EINVAL);
    int64_t neg[1] = {-1};
    assert_int_equal(ts_tensor_bin_create(tcp, "rows/x", TS_FLOAT32, 1, neg, NULL), TS_EINVAL);
    ts_items_t *it = NULL;
    assert_int_equal(ts_rows_read(tcp, "rows/err", 0, NULL, 5, 4, &it), TS_EINVAL);
    assert_int_equal(ts_rows_gather(tcp, "rows/err", 0, NULL, NULL, 3, &it), TS_EINVAL);
    ts_value_t *scalar = ts_int_new(1);
    assert_int_equal(ts_rows_write(tcp, "rows/err", 0, scalar, NULL), TS_EINVAL);
    ts_value_free(scalar);
    /* Refused by the server, with its reason. */
    assert_int_equal(ts_tensor_bin_create(tcp, "rows/err", TS_FLOAT32, 2, shape, NULL), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "exists"));
    int64_t huge[1] = {(int64_t)1 << 52};
    assert_int_equal(ts_tensor_bin_create(tcp, "rows/x", TS_UINT8, 1, huge, NULL), TS_EOOM);
    assert_int_equal(ts_rows_read(tcp, "rows/err", 0, NULL, 0, ROWS + 1, &it), TS_EINVAL);
    assert_int_equal(ts_rows_read(tcp, "rows/err", 1, NULL, 0, 1, &it), TS_EINVAL);
    assert_int_equal(ts_rows_read(tcp, "rows/none", 0, NULL, 0, 1, &it), TS_ENOENT);
    int64_t bad[2] = {0, ROWS};
    assert_int_equal(ts_rows_gather(tcp, "rows/err", 0, NULL, bad, 2, &it), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "position 1"));
    ts_value_t *w = rows_of(2, 1.0f);
    assert_int_equal(ts_rows_write(tcp, "rows/err", ROWS - 1, w, NULL), TS_EINVAL);
    ts_value_free(w);
    int64_t sh3[2] = {1, COLS + 1};
    w = ts_tensor_alloc(TS_FLOAT32, 2, sh3);
    assert_int_equal(ts_rows_write(tcp, "rows/err", 0, w, NULL), TS_EINVAL);
    ts_value_free(w);
    w = ts_tensor_alloc(TS_FLOAT64, 2, shape);
    assert_int_equal(ts_rows_write(tcp, "rows/err", 0, w, NULL), TS_EINVAL);
    ts_value_free(w);
    /* A tensor bin refuses put, append and get; a plain bin refuses row writes. */
    ts_value_t *one = ts_int_new(1);
    assert_int_equal(ts_put(tcp, "rows/err", one, NULL), TS_EINVAL);
    assert_int_equal(ts_append(tcp, "rows/err", one, NULL), TS_EINVAL);
    assert_int_equal(ts_get(tcp, "rows/err", 0, &it), TS_EINVAL);
    assert_int_equal(ts_put(tcp, "rows/plain", one, NULL), 0);
    w = rows_of(1, 1.0f);
    assert_int_equal(ts_rows_write(tcp, "rows/plain", 0, w, NULL), TS_EINVAL);
    ts_value_free(w);
    assert_int_equal(ts_rows_read(tcp, "rows/plain", 0, NULL, 0, 1, &it), TS_EINVAL);
    ts_value_free(one);
    /* The connection is fine after all that. */
    assert_int_equal(ts_ping(tcp), 0);
}

typedef struct rnotes {
    pthread_mutex_t mu;
    int rows, puts, other;
    uint64_t last;
    tc_latch latch;
} rnotes;

static void rnotes_cb(ts_client_t *c, int status, const ts_notification_t *n, void *arg)
{
    (void)c;
    rnotes *r = arg;
    if (status != 0)
        return;
    pthread_mutex_lock(&r->mu);
    if (n->event == TS_EV_ROWS) {
        r->rows++;
        r->last = n->version;
        r->other += n->n_items != 1;
    } else if (n->event == TS_EV_PUT) {
        r->puts++;
    } else {
        r->other++;
    }
    pthread_mutex_unlock(&r->mu);
    tc_latch_add(&r->latch, 1);
}

static void test_rows_listener(void **state)
{
    (void)state;
    rnotes r;
    memset(&r, 0, sizeof(r));
    pthread_mutex_init(&r.mu, NULL);
    tc_latch_init(&r.latch);
    assert_int_equal(ts_listen(ux, "rows/ev", rnotes_cb, &r), 0);
    make_bin(tcp, "rows/ev");
    enum { WRITES = 10 };
    uint64_t v = 0;
    for (int i = 0; i < WRITES; i++) {
        ts_value_t *w = rows_of(1, (float)i);
        assert_int_equal(ts_rows_write(tcp, "rows/ev", i, w, &v), 0);
        ts_value_free(w);
    }
    assert_true(tc_latch_wait(&r.latch, 1 + WRITES, 10000) >= 1 + WRITES);
    /* A wait for a version before the last write returns at once with it. */
    uint64_t got = 0;
    assert_int_equal(ts_wait(tcp, "rows/ev", v - 1, 1000, &got, NULL), 0);
    assert_true(got == v);
    pthread_mutex_lock(&r.mu);
    assert_int_equal(r.puts, 1);
    assert_int_equal(r.rows, WRITES);
    assert_int_equal(r.other, 0);
    assert_true(r.last == v);
    pthread_mutex_unlock(&r.mu);
    assert_int_equal(ts_unlisten(ux, "rows/ev"), 0);
    tc_sleep_ms(50);
    pthread_mutex_destroy(&r.mu);
    tc_latch_destroy(&r.latch);
}

typedef struct writer {
    ts_client_t *c;
    int first; /* rows [first, first + ROWS / 4) */
    int rc;
} writer;

static void *writer_main(void *arg)
{
    writer *w = arg;
    for (int round = 0; round < 5 && w->rc == 0; round++)
        for (int i = 0; i < ROWS / 4 && w->rc == 0; i++) {
            ts_value_t *t = rows_of(1, (float)(1000 * w->first + 10 * i + round));
            w->rc = ts_rows_write(w->c, "rows/conc", w->first + i, t, NULL);
            ts_value_free(t);
        }
    return NULL;
}

/* Four threads on two clients write disjoint quarters at once; each quarter is its writer's. */
static void test_rows_concurrent(void **state)
{
    (void)state;
    make_bin(tcp, "rows/conc");
    writer ws[4];
    pthread_t th[4];
    for (int k = 0; k < 4; k++) {
        ws[k] = (writer){.c = k % 2 ? ux : tcp, .first = k * (ROWS / 4), .rc = 0};
        assert_int_equal(pthread_create(&th[k], NULL, writer_main, &ws[k]), 0);
    }
    for (int k = 0; k < 4; k++) {
        pthread_join(th[k], NULL);
        assert_int_equal(ws[k].rc, 0);
    }
    ts_items_t *it;
    assert_int_equal(ts_rows_read(tcp, "rows/conc", 0, NULL, 0, ROWS, &it), 0);
    const float *d = reply_tensor(it)->data;
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < ROWS / 4; i++)
            assert_true(d[(k * (ROWS / 4) + i) * COLS] ==
                        (float)(1000 * k * (ROWS / 4) + 10 * i + 4));
    ts_items_free(it);
}

typedef struct aslot {
    tc_latch done;
    int status[4];
    uint64_t version[4];
    ts_items_t *items[4];
} aslot;

static aslot as;

static void acb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    int i = (int)(intptr_t)arg;
    as.status[i] = status;
    as.version[i] = res->version;
    as.items[i] = res->items;
    res->items = NULL; /* keep */
    tc_latch_add(&as.done, 1);
}

/* The asynchronous forms: one callback each, with the blocking forms' results. */
static void test_rows_async(void **state)
{
    (void)state;
    memset(&as, 0, sizeof(as));
    tc_latch_init(&as.done);
    int64_t shape[2] = {ROWS, COLS};
    assert_int_equal(
        ts_tensor_bin_create_async(ux, "rows/async", TS_FLOAT32, 2, shape, acb, (void *)0), 0);
    assert_true(tc_latch_wait(&as.done, 1, 10000) >= 1);
    assert_int_equal(as.status[0], 0);
    ts_value_t *w = rows_of(2, 30.0f);
    /* TS_COPY: the rows may be freed as soon as the call returns. */
    assert_int_equal(ts_rows_write_async(ux, "rows/async", 4, w, TS_COPY, acb, (void *)1), 0);
    ts_value_free(w);
    assert_true(tc_latch_wait(&as.done, 2, 10000) >= 2);
    assert_int_equal(as.status[1], 0);
    assert_true(as.version[1] > as.version[0]);
    assert_int_equal(ts_rows_read_async(tcp, "rows/async", 0, NULL, 4, 6, acb, (void *)2), 0);
    int64_t ix[2] = {5, 4}; /* borrowed: kept alive until the callback */
    assert_int_equal(
        ts_rows_gather_async(tcp, "rows/async", 0, NULL, ix, 2, TS_BORROW, acb, (void *)3), 0);
    assert_true(tc_latch_wait(&as.done, 4, 10000) >= 4);
    assert_int_equal(as.status[2], 0);
    assert_int_equal(as.status[3], 0);
    const float *d = reply_tensor(as.items[2])->data;
    assert_true(d[0] == 30.0f && d[COLS] == 31.0f);
    d = reply_tensor(as.items[3])->data;
    assert_true(d[0] == 31.0f && d[COLS] == 30.0f);
    ts_items_free(as.items[2]);
    ts_items_free(as.items[3]);
    /* A bad argument fails the call; the callback is never called. */
    assert_int_equal(ts_rows_read_async(tcp, "rows/async", 0, NULL, 3, 2, acb, (void *)2),
                     TS_EINVAL);
    assert_int_equal(ts_rows_write_async(tcp, NULL, 0, NULL, 0, acb, (void *)1), TS_EINVAL);
    tc_sleep_ms(20);
    assert_int_equal(tc_latch_get(&as.done), 4);
    tc_latch_destroy(&as.done);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows_tcp),        cmocka_unit_test(test_rows_unix),
        cmocka_unit_test(test_rows_errors),     cmocka_unit_test(test_rows_listener),
        cmocka_unit_test(test_rows_concurrent), cmocka_unit_test(test_rows_async),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
