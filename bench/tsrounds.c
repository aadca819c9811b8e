/*
 * tsrounds: a fixed number of small rounds through libtensorshare against a running tensord,
 * and the client process's CPU time per round. Unlike tsbench (fixed time, ops per second),
 * the amount of work is fixed, so the program can also run under `valgrind` to count the heap
 * allocations of the client per round, a figure that the load of a shared machine cannot
 * disturb. docs/PERFORMANCE.md shows how it is used.
 *
 *   tsrounds ADDRESS ROUNDS MODE
 *     pipeline  64 B put then get pairs, 16 in flight, refilled from their callbacks
 *     blocking  64 B ts_put then ts_get pairs on the calling thread
 *     notify    ts_put to a bin that a second client listens to; each waits for its callback
 */
#include <tensorshare/tensorshare.h>

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define DEPTH 16 /* requests in flight in pipeline mode, as in tsbench's small case */

static ts_value_t *g_tensor;
static atomic_long g_left;  /* pairs still to start in pipeline mode */
static atomic_long g_done;  /* pairs finished, or notifications received */
static atomic_int g_failed; /* a request failed */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
}

/* The bin of pipeline slot i: every slot has its own, so a get always finds its put's item. */
static void slot_bin(uintptr_t slot, char out[8])
{
    out[0] = 'r';
    out[1] = (char)('a' + slot);
    out[2] = '\0';
}

/*
 * Completion of a pipelined request; arg is the slot times two, plus one for a get. A put is
 * followed by the get of its slot; a finished get starts the slot's next put while rounds remain.
 */
static void on_result(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    uintptr_t a = (uintptr_t)arg;
    char bin[8];
    slot_bin(a >> 1, bin);
    if (status != 0) {
        atomic_store(&g_failed, 1);
        atomic_fetch_add(&g_done, 1);
        return;
    }
    if ((a & 1) == 0) {
        if (ts_get_async(c, bin, 0, on_result, (void *)(a | 1)) != 0)
            atomic_store(&g_failed, 1);
        return;
    }
    ts_items_free(res->items);
    res->items = NULL;
    atomic_fetch_add(&g_done, 1);
    if (atomic_fetch_sub(&g_left, 1) > 0 &&
        ts_put_async(c, bin, g_tensor, 0, on_result, (void *)(a & ~(uintptr_t)1)) != 0)
        atomic_store(&g_failed, 1);
}

static void on_note(ts_client_t *c, int status, const ts_notification_t *n, void *arg)
{
    (void)c;
    (void)n;
    (void)arg;
    if (status == 0)
        atomic_fetch_add(&g_done, 1);
}

/* Wait until g_done reaches target (at most 600 s). 0, or -1 on timeout or failure. */
static int wait_done(long target)
{
    double end = now_s() + 600;
    while (atomic_load(&g_done) < target && !atomic_load(&g_failed)) {
        if (now_s() > end)
            return -1;
        usleep(50);
    }
    return atomic_load(&g_failed) ? -1 : 0;
}

static int run_pipeline(ts_client_t *c, long rounds)
{
    long first = rounds < DEPTH ? rounds : DEPTH;
    atomic_store(&g_left, rounds - first);
    for (long i = 0; i < first; i++) {
        char bin[8];
        slot_bin((uintptr_t)i, bin);
        if (ts_put_async(c, bin, g_tensor, 0, on_result, (void *)(uintptr_t)(2 * i)) != 0)
            return -1;
    }
    return wait_done(rounds);
}

static int run_blocking(ts_client_t *c, long rounds)
{
    for (long i = 0; i < rounds; i++) {
        uint64_t version;
        ts_items_t *items;
        if (ts_put(c, "rb", g_tensor, &version) != 0 || ts_get(c, "rb", 0, &items) != 0)
            return -1;
        ts_items_free(items);
    }
    return 0;
}

static int run_notify(ts_client_t *c, const char *address, long rounds)
{
    ts_client_t *l;
    if (ts_client_open(&l, address, NULL) != 0)
        return -1;
    int rc = ts_listen(l, "rn", on_note, NULL);
    for (long i = 0; i < rounds && rc == 0; i++) {
        uint64_t version;
        rc = ts_put(c, "rn", g_tensor, &version);
        if (rc == 0)
            rc = wait_done(i + 1);
    }
    ts_client_free(l);
    return rc;
}

int main(int argc, char **argv)
{
    char *end = NULL;
    long rounds = argc == 4 ? strtol(argv[2], &end, 10) : 0;
    if (argc != 4 || end == NULL || *end != '\0' || rounds <= 0) {
        fprintf(stderr, "usage: tsrounds ADDRESS ROUNDS pipeline|blocking|notify\n");
        return 2;
    }
    ts_client_t *c;
    if (ts_client_open(&c, argv[1], NULL) != 0) {
        fprintf(stderr, "tsrounds: cannot connect to %s\n", argv[1]);
        return 1;
    }
    int64_t shape[1] = {16}; /* 64 bytes of float32 */
    g_tensor = ts_tensor_alloc(TS_FLOAT32, 1, shape);
    if (g_tensor == NULL) {
        ts_client_free(c);
        return 1;
    }
    double t0 = now_s(), c0 = cpu_s();
    int rc;
    if (strcmp(argv[3], "pipeline") == 0)
        rc = run_pipeline(c, rounds);
    else if (strcmp(argv[3], "blocking") == 0)
        rc = run_blocking(c, rounds);
    else if (strcmp(argv[3], "notify") == 0)
        rc = run_notify(c, argv[1], rounds);
    else
        rc = -2;
    double wall = now_s() - t0, cpu = cpu_s() - c0;
    ts_client_free(c);
    ts_value_free(g_tensor);
    if (rc != 0) {
        fprintf(stderr, "tsrounds: %s\n", rc == -2 ? "unknown mode" : "a request failed");
        return 1;
    }
    printf("%s: %ld rounds, %.3f s wall, client cpu %.2f us per round\n", argv[3], rounds, wall,
           cpu / (double)rounds * 1e6);
    return 0;
}
