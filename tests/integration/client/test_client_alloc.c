/*
 * libtensorshare when memory runs out: for every N, the N-th allocation of a client's whole life
 * (open, put, append, peek, get, list, stats, wait, delete, ping, an asynchronous put, listen and
 * unlisten, close) fails, on whichever thread makes it. Every call must then return 0 or a
 * TS_E* code (never hang, crash or leak; ASan checks the leaks at exit), every asynchronous
 * callback must come exactly once, and the sequence must end when no allocation is left to fail.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdatomic.h>
#include <stdio.h>

#include "harness.h"
#include "test_client_util.h"

#define MAX_N 20000 /* allocations; far more than one pass of the sequence makes */

static tsh_server srv;

static int setup(void **state)
{
    (void)state;
    return tsh_server_start(&srv, NULL) == 0 ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    int rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    return rc == 0 ? 0 : -1;
}

/* What the sequence saw in one pass. */
typedef struct pass {
    int calls;
    int failed;       /* calls that returned an error */
    int enomem;       /* of which TS_ENOMEM */
    tc_latch cb;      /* asynchronous completions */
    tc_latch final;   /* final listen callbacks */
    atomic_int notes; /* notifications */
} pass;

/* A call's status must be 0 or a known error; timing out would mean a lost completion. */
static void check_rc(pass *p, const char *what, int rc)
{
    p->calls++;
    if (rc == 0)
        return;
    if (strcmp(ts_err_name(rc), "UNKNOWN") == 0 || rc == TS_ETIMEDOUT) {
        printf("%s: unexpected %d (%s), %s\n", what, rc, ts_err_name(rc), ts_last_error());
        fail();
    }
    p->failed++;
    if (rc == TS_ENOMEM)
        p->enomem++;
}

static void async_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    (void)res;
    pass *p = arg;
    assert_true(status <= 0 && status != TS_ETIMEDOUT);
    tc_latch_add(&p->cb, 1);
}

static void note_cb(ts_client_t *c, int status, const ts_notification_t *n, void *arg)
{
    (void)c;
    pass *p = arg;
    if (status < 0) {
        assert_null(n);
        tc_latch_add(&p->final, 1);
    } else {
        atomic_fetch_add(&p->notes, 1);
    }
}

/* One pass of the sequence; items built by the caller (before failures are armed). */
static void run_pass(pass *p, const ts_value_t *item)
{
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.connect_timeout_ms = 5000;
    o.request_timeout_ms = 15000;
    ts_client_t *c = NULL;
    int rc = ts_client_open(&c, srv.addr, &o);
    check_rc(p, "open", rc);
    if (rc != 0) {
        assert_null(c);
        return;
    }
    uint64_t v = 0;
    check_rc(p, "put", ts_put(c, "a", item, &v));
    check_rc(p, "append", ts_append(c, "a", item, &v));
    ts_items_t *items = NULL;
    rc = ts_peek(c, "a", 0, &items);
    check_rc(p, "peek", rc);
    if (rc == 0) {
        for (size_t i = 0; i < ts_items_count(items); i++)
            assert_true(tc_check_vec(ts_items_at(items, i), 100, 1));
        ts_items_free(items);
    }
    items = NULL;
    rc = ts_get(c, "a", 1, &items);
    check_rc(p, "get", rc);
    if (rc == 0)
        ts_items_free(items);
    ts_bin_list_t *bins = NULL;
    rc = ts_list(c, &bins);
    check_rc(p, "list", rc);
    if (rc == 0)
        ts_bin_list_free(bins);
    ts_value_t *stats = NULL;
    rc = ts_stats(c, &stats);
    check_rc(p, "stats", rc);
    if (rc == 0)
        ts_value_free(stats);
    /* The bin may be gone (when the put failed, the get took the appended item): then the
     * server answers TS_ETIMEDOUT after 200 ms, which is no lost completion. */
    rc = ts_wait(c, "a", 0, 200, &v, NULL);
    check_rc(p, "wait", rc == TS_ETIMEDOUT ? 0 : rc);

    int listening = ts_listen(c, "a", note_cb, p);
    check_rc(p, "listen", listening);
    long queued = 0;
    rc = ts_put_async(c, "a", item, TS_COPY, async_cb, p);
    check_rc(p, "put_async", rc);
    queued += rc == 0;
    rc = ts_ping_async(c, async_cb, p);
    check_rc(p, "ping_async", rc);
    queued += rc == 0;
    check_rc(p, "ping", ts_ping(c));
    uint32_t removed;
    check_rc(p, "delete", ts_delete(c, "a", &removed));
    if (listening == 0)
        check_rc(p, "unlisten", ts_unlisten(c, "a"));
    assert_int_equal(tc_latch_wait(&p->cb, queued, TC_WAIT_MS), queued);
    ts_client_free(c);
    /* Every asynchronous callback exactly once, and one final call per live subscription. */
    assert_int_equal(tc_latch_get(&p->cb), queued);
    assert_int_equal(tc_latch_get(&p->final), listening == 0 ? 1 : 0);
}

static void test_every_allocation_fails_once(void **state)
{
    (void)state;
    ts_value_t *item = tc_item(100, 1, 7);
    assert_non_null(item);
    int passes = 0, with_errors = 0, total_enomem = 0;
    long n;
    for (n = 1; n <= MAX_N; n++) {
        pass p;
        memset(&p, 0, sizeof(p));
        tc_latch_init(&p.cb);
        tc_latch_init(&p.final);
        atomic_init(&p.notes, 0);
        unsigned long before = ts__alloc_count();
        ts__alloc_fail_after(n);
        run_pass(&p, item);
        ts__alloc_fail_after(-1);
        unsigned long made = ts__alloc_count() - before;
        tc_latch_destroy(&p.cb);
        tc_latch_destroy(&p.final);
        passes++;
        with_errors += p.failed > 0;
        total_enomem += p.enomem;
        if (made < (unsigned long)n) {
            /* Nothing failed in this pass: every allocation of the sequence has been tried. */
            assert_int_equal(p.failed, 0);
            break;
        }
    }
    printf("%d passes (every allocation of a %ld-allocation sequence failed once): %d saw an "
           "error, %d TS_ENOMEM in all\n",
           passes, n - 1, with_errors, total_enomem);
    assert_true(n <= MAX_N);
    assert_true(with_errors > 0);
    /* The client still works normally afterwards. */
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, srv.addr, NULL), 0);
    assert_int_equal(ts_put(c, "after", item, NULL), 0);
    assert_int_equal(ts_ping(c), 0);
    ts_client_free(c);
    ts_value_free(item);
}

int main(void)
{
    ts__alloc_count_enable(); /* off unless asked for: this test counts the client's */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_allocation_fails_once),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
