/*
 * How a served batcher sends its answers through tensord: the answers that follow one in flight
 * are queued and handed to the client together from the completion of that append. Checked
 * here: many requests outstanding on one predictor and on several, answered by two replicas in
 * any order, each exactly once with its own rows; and a connection lost while a batch's answers
 * are queued or in flight, after which every request has had exactly one callback (its answer or
 * its error) and the server answers new requests again (no answer is left stuck in the queue).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "common.h"
#include "batcher_test_util.h"
#include "harness.h"
#include "tensorshare/batcher.h"

/* The model is the shared toy model without an offset: {y = 2 x}, slowed down by tb_delay_us. */
#define DELAY_US 1000 /* us; every batcher's max_delay_us */

enum { MAX_REQ = 512 };

/* Every request's callbacks: how many, and whether the answer was its own. */
typedef struct tally {
    atomic_int calls[MAX_REQ];
    atomic_int good[MAX_REQ];
    atomic_int failed[MAX_REQ];
    atomic_int total;
} tally;

typedef struct slot {
    tally *t;
    int index;
} slot;

static void on_answer(ts_predictor_t *p, int status, ts_value_t *out, int64_t version, void *arg)
{
    (void)p;
    (void)version;
    slot *s = arg;
    int good = status == 0 && tb_check(out, 1, (int64_t)s->index * 10, 2.0f);
    ts_value_free(out);
    atomic_fetch_add(&s->t->calls[s->index], 1);
    atomic_fetch_add(good ? &s->t->good[s->index] : &s->t->failed[s->index], 1);
    atomic_fetch_add(&s->t->total, 1);
}

/* Wait until n callbacks came, at most max_ms. */
static int wait_total(tally *t, int n, int max_ms)
{
    for (int i = 0; i < max_ms / 5; i++) {
        if (atomic_load(&t->total) >= n)
            return 1;
        tb_sleep_us(5000);
    }
    return atomic_load(&t->total) >= n;
}

/*
 * 4 predictors on one client with 100 requests outstanding each, two replicas with a forward
 * slow enough that answers queue behind the one in flight: every request is answered once,
 * with its own rows, whatever order the answers come in.
 */
static void test_many_outstanding_answered_once(void **state)
{
    (void)state;
    tb_world w;
    tb_world_open(&w);
    atomic_store(&tb_delay_us, 300);
    ts_batcher_t *b = tb_new_batcher(16, DELAY_US, "cpu:2");
    assert_non_null(b);
    assert_int_equal(ts_batcher_serve(b, w.sc, "many"), 0);
    enum { P = 4, PER = 100, N = P * PER };
    static tally t;
    memset(&t, 0, sizeof(t));
    static slot s[N];
    ts_predictor_t *p[P];
    for (int i = 0; i < P; i++)
        assert_int_equal(ts_predictor_open(&p[i], w.c, "many"), 0);
    for (int i = 0; i < N; i++) {
        s[i] = (slot){&t, i};
        ts_value_t *in = tb_request(1, (int64_t)i * 10);
        assert_int_equal(ts_predictor_predict_async(p[i % P], in, 20000, on_answer, &s[i]), 0);
        ts_value_free(in);
    }
    assert_true(wait_total(&t, N, 30000));
    tb_sleep_us(50000); /* a second answer to any request would come now */
    for (int i = 0; i < N; i++) {
        assert_int_equal(atomic_load(&t.calls[i]), 1);
        assert_int_equal(atomic_load(&t.good[i]), 1);
    }
    for (int i = 0; i < P; i++)
        ts_predictor_free(p[i]);
    ts_batcher_free(b);
    atomic_store(&tb_delay_us, 0);
    tb_world_close(&w);
}

/*
 * tensord is killed while the batcher computes a batch of 64, so that the batch's answers are
 * appended (and queued behind the first) while the serving connection is down. Every request
 * gets exactly one callback, its answer or an error, and once tensord is back the same server
 * answers new requests: no answer was left queued with nobody to send it, and no answer to a
 * call of the lost connection reaches a call of the new one. The predictor calls the service.
 */
static void test_lost_connection_answers_in_flight(void **state)
{
    (void)state;
    tb_world w;
    tb_world_open(&w);
    atomic_store(&tb_delay_us, 300000);
    ts_batcher_t *b = tb_new_batcher(64, DELAY_US, "cpu:1");
    assert_non_null(b);
    assert_int_equal(ts_batcher_serve(b, w.sc, "lost"), 0);
    ts_predictor_t *p = NULL;
    ts_predictor_options_t po;
    ts_predictor_options_init(&po);
    po.transport = TS_PREDICTOR_SERVICE;
    assert_int_equal(ts_predictor_open_with(&p, w.c, "lost", &po), 0);
    enum { N = 64 };
    static tally t;
    memset(&t, 0, sizeof(t));
    static slot s[N];
    for (int i = 0; i < N; i++) {
        s[i] = (slot){&t, i};
        ts_value_t *in = tb_request(1, (int64_t)i * 10);
        assert_int_equal(ts_predictor_predict_async(p, in, 3000, on_answer, &s[i]), 0);
        ts_value_free(in);
    }
    /* Wait until the batcher holds them all (the requests bin is drained), then kill tensord. */
    ts_batcher_stats_t st;
    for (int i = 0; i < 400; i++) {
        ts_batcher_stats(b, &st);
        if (st.submitted >= N)
            break;
        tb_sleep_us(5000);
    }
    assert_true(st.submitted >= N);
    tsh_server_kill(&w.srv);
    assert_true(wait_total(&t, N, 10000));
    tb_sleep_us(50000);
    for (int i = 0; i < N; i++)
        assert_int_equal(atomic_load(&t.calls[i]), 1);
    atomic_store(&tb_delay_us, 0);
    assert_int_equal(tsh_server_restart(&w.srv, NULL), 0);
    /* Both clients reconnect; the server then answers again (one forward of 1 row). */
    ts_value_t *in = tb_request(1, 70), *out = NULL;
    int rc = -1;
    for (int i = 0; i < 40 && rc != 0; i++) {
        out = NULL;
        rc = ts_predictor_predict(p, in, 500, &out, NULL);
        ts_value_free(out);
    }
    assert_int_equal(rc, 0);
    /* And a burst of answers to one batch still all arrive. */
    static tally t2;
    memset(&t2, 0, sizeof(t2));
    static slot s2[N];
    for (int i = 0; i < N; i++) {
        s2[i] = (slot){&t2, i};
        ts_value_t *x = tb_request(1, (int64_t)i * 10);
        assert_int_equal(ts_predictor_predict_async(p, x, 10000, on_answer, &s2[i]), 0);
        ts_value_free(x);
    }
    assert_true(wait_total(&t2, N, 15000));
    for (int i = 0; i < N; i++)
        assert_int_equal(atomic_load(&t2.good[i]), 1);
    ts_value_free(in);
    ts_predictor_free(p);
    ts_batcher_free(b);
    tb_world_close(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_many_outstanding_answered_once),
        cmocka_unit_test(test_lost_connection_answers_in_flight),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
