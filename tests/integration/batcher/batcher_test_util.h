/*
 * The scaffolding that the batcher's integration tests against a real tensord have in common
 * (test_batcher_remote, test_batcher_service, test_batcher_shm, test_remote_answers): bounded
 * sleeps and a monotonic clock, a tensord with a serving and a requesting client, a toy model
 * over the one-field schema {x: float32[3]} whose forward can be slowed down on purpose, batcher
 * options for that schema, request builders and an answer checker, and a tally of asynchronous
 * answers with a bounded wait. Each test used to carry its own copy of these pieces; they live
 * here once so that a change to the model or to the request layout is made in one place and the
 * tests stay comparable. What only one test needs (a model with loadable weights, the forked
 * children and their pipes, a per-request tally) stays in that test.
 *
 * Everything here may be called from any thread, and from a child forked by a test, except
 * where a function says it asserts: those use cmocka's assertions and belong to the process
 * that runs the test.
 */
#ifndef TS_BATCHER_TEST_UTIL_H
#define TS_BATCHER_TEST_UTIL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "harness.h"
#include "tensorshare/batcher.h"

/*
 * A tensord of the test's own and two clients of it: sc for the batcher that serves, c for the
 * requesters (a test may free either early and set it to NULL).
 */
typedef struct tb_world {
    tsh_server srv;
    ts_client_t *sc;
    ts_client_t *c;
} tb_world;

/* Start the tensord and open sc, then c, asserting each step. */
void tb_world_open(tb_world *w);

/* Free c and sc, then stop the tensord (asserting that it stopped cleanly) and clean up. */
void tb_world_close(tb_world *w);

/* The most statuses a tally keeps in order of arrival; later answers are only counted. */
#define TB_TALLY_STATUSES 64
/* Bytes kept of the last failure's message, ample for the reasons the tests look for. */
#define TB_TALLY_MSG 256

/*
 * Microseconds each forward of the toy model sleeps before it computes, read at every forward
 * (so a test can make the batches it is about to send slow, then fast again); 0 by default.
 */
extern atomic_int tb_delay_us;

/* Sleep us microseconds (an interrupted sleep ends early). */
void tb_sleep_us(long us);

/* Milliseconds on the monotonic clock, for deadlines of bounded waits. */
uint64_t tb_now_ms(void);

/*
 * The toy model's factory (a ts_model_create_cb): {x: float32[rows, 3]} -> {y: float32[rows, 3]
 * = 2 x + offset}, after tb_delay_us. create_arg points to the float offset, or is NULL for 0.
 */
int tb_model_create(const char *device, int replica, ts_model_t **out, void *arg);

/* The one-field input schema of the toy model: {"x", TS_FLOAT32, 1, {3}}. */
extern const ts_field_t tb_schema[1];

/*
 * Fill cfg with the defaults, the schema tb_schema, the toy model's factory (change create and
 * create_arg afterwards for another model), max_batch and max_delay_us, and placement unless it
 * is NULL (then the batcher's default stays).
 */
void tb_options(ts_batcher_options_t *cfg, int max_batch, int64_t max_delay_us,
                const char *placement);

/* A new batcher with cfg, or NULL when ts_batcher_new fails (its reason goes to stderr). */
ts_batcher_t *tb_batcher(const ts_batcher_options_t *cfg);

/* A new batcher of the toy model (tb_options, then tb_batcher), or NULL. */
ts_batcher_t *tb_new_batcher(int max_batch, int64_t max_delay_us, const char *placement);

/*
 * A request {x: float32[rows, 3]} whose values count up from base (x[i] = base + i over the
 * rows in order), or NULL when it cannot be allocated. The caller frees it.
 */
ts_value_t *tb_request_try(int64_t rows, int64_t base);

/* tb_request_try, asserting that it was built. */
ts_value_t *tb_request(int64_t rows, int64_t base);

/*
 * 1 when out holds y: float32[rows, 3] equal to scale times the values of
 * tb_request(rows, base), compared exactly; 0 otherwise (out may be NULL).
 */
int tb_check(const ts_value_t *out, int64_t rows, int64_t base, float scale);

/*
 * Completions of asynchronous predictions: how many came, how many were good (as the caller
 * judged them), the statuses of the first TB_TALLY_STATUSES in order, and the last failure's
 * status and message. Fields are read under mu, or without it once the wait says all came.
 */
typedef struct tb_tally {
    pthread_mutex_t mu;
    int done, ok, last_status;
    int statuses[TB_TALLY_STATUSES];
    char last_msg[TB_TALLY_MSG];
} tb_tally;

/* Zero t and initialise its mutex; tb_tally_destroy undoes it. */
void tb_tally_init(tb_tally *t);
void tb_tally_destroy(tb_tally *t);

/*
 * Count one completion with its status, and as good when good is non-zero; a failure's message
 * is ts_last_error() of the calling thread, so call it from the callback itself.
 */
void tb_tally_add(tb_tally *t, int status, int good);

/* Wait until n completions came, at most max_ms: 1 when they did, 0 when time ran out. */
int tb_tally_wait(tb_tally *t, int n, int max_ms);

#endif
