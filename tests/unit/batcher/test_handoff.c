/*
 * Unit tests of the batcher's hand-off (batcher/handoff.c). CMake builds this file twice: once
 * with the futex hand-off (Linux) and once with TS_HANDOFF_PTHREAD, the condition-variable
 * fallback, so both are exercised on every machine.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdint.h>
#include <unistd.h>

#include "handoff.h"

#define WAITERS       21  /* requesters of one chain: an odd count, several tree levels deep */
#define ROUNDS        8   /* chains posted one after another, to catch a lost wake-up */
#define ALARM_SECONDS 100 /* a lost wake-up hangs: the alarm turns it into a failure */

typedef struct waiter {
    handoff_sync sync;
    pthread_t thread;
    int payload; /* written by the poster before the post, read by the waiter after its wait */
    int seen;
} waiter;

static void *wait_main(void *arg)
{
    waiter *w = arg;
    ts__handoff_wait(&w->sync);
    w->seen = w->payload;
    return NULL;
}

static void test_post_before_wait(void **state)
{
    (void)state;
    handoff_sync s;
    assert_int_equal(ts__handoff_init(&s), 0);
    ts__handoff_post(&s);
    ts__handoff_wait(&s); /* returns at once: the post is not lost */
    ts__handoff_destroy(&s);
}

static void test_one_waiter(void **state)
{
    (void)state;
    waiter w = {.payload = 0};
    assert_int_equal(ts__handoff_init(&w.sync), 0);
    assert_int_equal(pthread_create(&w.thread, NULL, wait_main, &w), 0);
    usleep(1000); /* most often the waiter sleeps by now; either order must work */
    w.payload = 42;
    ts__handoff_post(&w.sync);
    assert_int_equal(pthread_join(w.thread, NULL), 0);
    assert_int_equal(w.seen, 42);
    ts__handoff_destroy(&w.sync);
}

/* Every requester of a chain is woken once the chain ends, and sees what was written before. */
static void test_chain(void **state)
{
    (void)state;
    static waiter ws[WAITERS];
    for (int round = 0; round < ROUNDS; round++) {
        for (int i = 0; i < WAITERS; i++) {
            ws[i].payload = 0;
            ws[i].seen = -1;
            assert_int_equal(ts__handoff_init(&ws[i].sync), 0);
            assert_int_equal(pthread_create(&ws[i].thread, NULL, wait_main, &ws[i]), 0);
        }
        handoff_chain chain;
        ts__handoff_chain_begin(&chain);
        for (int i = 0; i < WAITERS; i++) {
            ws[i].payload = round * 1000 + i;
            ts__handoff_post(&ws[i].sync);
        }
        ts__handoff_chain_end(&chain);
        for (int i = 0; i < WAITERS; i++) {
            assert_int_equal(pthread_join(ws[i].thread, NULL), 0);
            assert_int_equal(ws[i].seen, round * 1000 + i);
            ts__handoff_destroy(&ws[i].sync);
        }
    }
}

/* An empty chain, and a post outside any chain after one ended, both work. */
static void test_empty_chain_then_direct(void **state)
{
    (void)state;
    handoff_chain chain;
    ts__handoff_chain_begin(&chain);
    ts__handoff_chain_end(&chain);
    waiter w = {.payload = 7};
    assert_int_equal(ts__handoff_init(&w.sync), 0);
    assert_int_equal(pthread_create(&w.thread, NULL, wait_main, &w), 0);
    ts__handoff_post(&w.sync);
    assert_int_equal(pthread_join(w.thread, NULL), 0);
    assert_int_equal(w.seen, 7);
    ts__handoff_destroy(&w.sync);
}

int main(void)
{
    alarm(ALARM_SECONDS);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_post_before_wait),
        cmocka_unit_test(test_one_waiter),
        cmocka_unit_test(test_chain),
        cmocka_unit_test(test_empty_chain_then_direct),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
