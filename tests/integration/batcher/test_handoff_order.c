/*
 * The order in which a chain of blocking requesters is published (batcher/handoff.c): a
 * requester that was not asleep yet when its answer was published wakes the requesters below it
 * in the chain's tree at once. Were they published after it, those wake-ups would come before
 * their answers, find nothing, and be lost: they would sleep forever (a blocking
 * ts_batcher_predict that never returns, seen once as a hang of test_never_wait_for_nothing
 * under ThreadSanitizer on two cores, where the answering thread is often preempted in the
 * middle of publishing a batch). The test makes that interleaving happen every time through
 * the publishing hook: right after requester 0 is published, it lets requester 0 run to its
 * end (it was busy elsewhere and wakes its two children as it leaves) before publishing goes
 * on. Every requester must still be woken.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "handoff.h"

#define WAITERS 7    /* requester 0, its children 1 and 2, and theirs: three levels */
#define WAIT_MS 2000 /* ms; how long a woken requester may take to return */

typedef struct waiter {
    handoff_sync sync;
    pthread_t thread;
    atomic_int tid;
    atomic_int returned;
} waiter;

static waiter ws[WAITERS];
static sem_t go0, done0;
static atomic_int let_run;

static struct timespec in_ms(int ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }
    return ts;
}

/* Requester 0: busy elsewhere until the test lets it reach its wait. */
static void *early_main(void *arg)
{
    waiter *w = arg;
    while (sem_wait(&go0) != 0 && errno == EINTR) {
    }
    ts__handoff_wait(&w->sync);
    atomic_store(&w->returned, 1);
    sem_post(&done0);
    return NULL;
}

/* The others: asleep in their wait before the chain is published. */
static void *sleeper_main(void *arg)
{
    waiter *w = arg;
    atomic_store(&w->tid, (int)syscall(SYS_gettid));
    ts__handoff_wait(&w->sync);
    atomic_store(&w->returned, 1);
    return NULL;
}

/* 1 once thread tid sleeps (state S), within WAIT_MS. */
static int asleep(int tid)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/task/%d/stat", tid);
    for (int i = 0; i < WAIT_MS; i++) {
        FILE *f = fopen(path, "r");
        char buf[256] = "";
        size_t n = f != NULL ? fread(buf, 1, sizeof(buf) - 1, f) : 0;
        if (f != NULL)
            fclose(f);
        buf[n] = '\0';
        const char *p = strrchr(buf, ')');
        if (p != NULL && p[1] == ' ' && p[2] == 'S')
            return 1;
        usleep(1000);
    }
    return 0;
}

/* The publishing hook: s is compared, never read (its requester may be gone). */
static void published(handoff_sync *s)
{
    if (s == &ws[0].sync && atomic_exchange(&let_run, 0)) {
        sem_post(&go0);
        struct timespec until = in_ms(WAIT_MS);
        while (sem_timedwait(&done0, &until) != 0 && errno == EINTR) {
        }
    }
}

static void test_early_requester_wakes_published_children(void **state)
{
    (void)state;
    assert_int_equal(sem_init(&go0, 0, 0), 0);
    assert_int_equal(sem_init(&done0, 0, 0), 0);
    for (int i = 0; i < WAITERS; i++) {
        assert_int_equal(ts__handoff_init(&ws[i].sync), 0);
        atomic_init(&ws[i].tid, 0);
        atomic_init(&ws[i].returned, 0);
        assert_int_equal(
            pthread_create(&ws[i].thread, NULL, i == 0 ? early_main : sleeper_main, &ws[i]), 0);
    }
    for (int i = 1; i < WAITERS; i++) {
        while (atomic_load(&ws[i].tid) == 0)
            usleep(100);
        assert_true(asleep(atomic_load(&ws[i].tid)));
    }
    atomic_store(&let_run, 1);
    ts__handoff_published_hook = published;
    handoff_chain chain;
    ts__handoff_chain_begin(&chain);
    for (int i = 0; i < WAITERS; i++)
        ts__handoff_post(&ws[i].sync);
    ts__handoff_chain_end(&chain);
    ts__handoff_published_hook = NULL;
    int lost = 0;
    for (int i = 0; i < WAITERS; i++) {
        struct timespec until = in_ms(WAIT_MS);
        if (pthread_timedjoin_np(ws[i].thread, NULL, &until) != 0) {
            fprintf(stderr, "requester %d was never woken\n", i);
            lost++;
            /* Its answer is published: a wake-up now lets it return, and the test end. */
            syscall(SYS_futex, (uint32_t *)&ws[i].sync.done, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
            pthread_join(ws[i].thread, NULL);
        }
        ts__handoff_destroy(&ws[i].sync);
    }
    assert_int_equal(lost, 0);
    sem_destroy(&go0);
    sem_destroy(&done0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_early_requester_wakes_published_children),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
