/*
 * The RL helpers collecting experience through a replay table (ts_rl_options_t.replay): the
 * trainer creates the table, workers insert (blocking while the rate limiter holds them back),
 * collect draws with keys that ts_table_update takes, the staleness filter still applies, and a
 * second trainer uses the existing table.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdint.h>
#include <string.h>

#include "harness.h"
#include "tensorshare/replay.h"
#include "tensorshare/rl.h"

static tsh_server srv;
static ts_client_t *cl;

static int setup(void **state)
{
    (void)state;
    if (tsh_server_start(&srv, NULL) != 0)
        return -1;
    return ts_client_open(&cl, srv.addr, NULL) == 0 ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    ts_client_free(cl);
    int rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    return rc == 0 ? 0 : -1;
}

static void test_collect_through_table(void **state)
{
    (void)state;
    ts_table_config_t tc;
    ts_table_config_init(&tc);
    tc.capacity = 100;
    tc.sampler = TS_TABLE_FIFO;
    tc.min_size_to_sample = 2;
    tc.samples_per_insert = 1;
    tc.error_buffer = 4; /* band [-2, 6] */
    ts_rl_options_t o;
    ts_rl_options_init(&o);
    o.prefix = "rep/";
    o.replay = &tc;
    o.timeout_ms = 2000;
    ts_rl_trainer_t *t = NULL;
    assert_int_equal(ts_rl_trainer_new(&t, cl, &o), 0);
    ts_value_t *p = ts_map_new();
    assert_int_equal(ts_map_set(p, "w", ts_int_new(1)), 0);
    int64_t v = -1;
    assert_int_equal(ts_rl_trainer_publish(t, p, &v), 0);
    ts_value_free(p);

    ts_rl_worker_t *w = NULL;
    assert_int_equal(ts_rl_worker_new(&w, cl, &o), 0);
    ts_rl_params_t *params = NULL;
    assert_int_equal(ts_rl_worker_await(w, 2000, &params), 0);
    ts_rl_params_release(params);
    /* Nothing collected yet: fewer than min_size_to_sample items. */
    ts_rl_batch_t *b = NULL;
    assert_int_equal(ts_rl_trainer_collect(t, 1, 50, &b), TS_ETIMEDOUT);
    for (int i = 0; i < 6; i++) {
        ts_value_t *d = ts_int_new(i);
        assert_int_equal(ts_rl_worker_add(w, d, TS_COPY), 0);
        ts_value_free(d);
    }
    /* The band's top: (6 + 1) x 1 - 0 > 6, so a seventh insert waits; nonblocking it fails. */
    ts_value_t *d = ts_int_new(6);
    assert_int_equal(ts_rl_worker_add(w, d, TS_COPY | TS_RL_NONBLOCK), TS_ETIMEDOUT);
    ts_value_free(d);
    assert_int_equal(ts_rl_trainer_collect(t, 3, 1000, &b), 0);
    assert_int_equal(ts_rl_batch_count(b), 3);
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(ts_rl_batch_key(b, i), 1); /* FIFO: the oldest, drawn again */
        assert_int_equal(ts_rl_batch_version(b, i), v);
    }
    ts_rl_batch_free(b);
    /* The trainer's priorities go to the table by key. */
    uint64_t key = 1;
    double pr = 5;
    ts_table_state_t st;
    assert_int_equal(ts_table_update(cl, "rep/data", 1, &key, &pr, &st), 0);
    assert_int_equal(st.done, 1);

    /* A second trainer takes the table as it is. */
    ts_rl_trainer_t *t2 = NULL;
    assert_int_equal(ts_rl_trainer_new(&t2, cl, &o), 0);
    ts_rl_trainer_free(t2);
    ts_rl_worker_free(w);
    ts_rl_trainer_free(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_collect_through_table),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
