/*
 * replay_bench: replay tables (include/tensorshare/replay.h) under 8 inserter and 8 sampler
 * threads with 4 KiB items, printed beside Reverb's published figures.
 *
 *   replay_bench [--tensord PATH] [--seconds S] [--sampler uniform|prioritized]
 *                [--batch N] [--unix] [--smoke]
 *
 * It starts its own tensord (pinned to cpu0 when the machine has two CPUs), creates a table of
 * 100000 items (FIFO remover, no rate limit beyond min_size_to_sample 1000), pre-fills it, and
 * runs 8 inserter threads (one client each, an item of one 4 KiB float32 tensor per insert,
 * random priorities) and 8 sampler threads (one client each, TABLE_SAMPLE of --batch items, 1
 * by default) for --seconds. It prints inserts/s and samples/s (items drawn per second) and
 * the latency of one insert and one sample, beside Reverb's published numbers: about 60K
 * inserts/s and 600K samples/s per server, measured by Reverb's authors on their own hardware
 * (not this machine; the comparison is of orders of magnitude only). --smoke runs half a second
 * and fails when a call fails; it asserts no timing.
 */
#define _GNU_SOURCE
#include "bench.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tensorshare/replay.h"
#include "tensorshare/tensorshare.h"

#ifndef TS_TENSORD_PATH
#define TS_TENSORD_PATH "tensord"
#endif

#define N_INSERTERS   8
#define N_SAMPLERS    8
#define ITEM_FLOATS   1024 /* 4 KiB of float32 per item */
#define CAPACITY      100000
#define PREFILL       1000
#define REVERB_INSERT 60000.0  /* inserts/s per server, Reverb's published figure */
#define REVERB_SAMPLE 600000.0 /* samples/s per server, Reverb's published figure */

static const char *g_addr;
static double g_seconds = 5.0;
static unsigned g_batch = 1;
static atomic_int g_stop;
static atomic_int g_failed;
static atomic_ullong g_inserts, g_samples, g_insert_ns, g_sample_ns, g_sample_calls;

static ts_value_t *make_item(uint32_t seed)
{
    ts_value_t *m = ts_map_new();
    int64_t shape[1] = {ITEM_FLOATS};
    ts_value_t *t = ts_tensor_alloc(TS_FLOAT32, 1, shape);
    if (m == NULL || t == NULL || ts_map_set(m, "obs", t) != 0) {
        ts_value_free(m);
        return NULL;
    }
    float *f = (float *)ts_value_tensor(t)->data;
    for (int i = 0; i < ITEM_FLOATS; i++)
        f[i] = (float)(seed + (uint32_t)i);
    return m;
}

static void *inserter(void *arg)
{
    uintptr_t id = (uintptr_t)arg;
    ts_client_t *c = NULL;
    if (ts_client_open(&c, g_addr, NULL) != 0) {
        atomic_store(&g_failed, 1);
        return NULL;
    }
    ts_value_t *item = make_item((uint32_t)id);
    uint32_t x = (uint32_t)id * 2654435761u + 1;
    while (item != NULL && !atomic_load(&g_stop)) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        uint64_t t0 = bench_now_ns();
        int rc = ts_table_insert(c, "replay", item, (double)(x % 1000) / 100.0, 1000, NULL);
        uint64_t dt = bench_now_ns() - t0;
        if (rc != 0) {
            fprintf(stderr, "insert: %s (%s)\n", ts_strerror(rc), ts_last_error());
            atomic_store(&g_failed, 1);
            break;
        }
        atomic_fetch_add(&g_inserts, 1);
        atomic_fetch_add(&g_insert_ns, dt);
    }
    ts_value_free(item);
    ts_client_free(c);
    return NULL;
}

static void *sampler(void *arg)
{
    (void)arg;
    ts_client_t *c = NULL;
    if (ts_client_open(&c, g_addr, NULL) != 0) {
        atomic_store(&g_failed, 1);
        return NULL;
    }
    while (!atomic_load(&g_stop)) {
        ts_table_sample_t *s = NULL;
        uint64_t t0 = bench_now_ns();
        int rc = ts_table_sample(c, "replay", g_batch, 1000, &s);
        uint64_t dt = bench_now_ns() - t0;
        if (rc != 0) {
            fprintf(stderr, "sample: %s (%s)\n", ts_strerror(rc), ts_last_error());
            atomic_store(&g_failed, 1);
            break;
        }
        atomic_fetch_add(&g_samples, ts_table_sample_count(s));
        atomic_fetch_add(&g_sample_ns, dt);
        atomic_fetch_add(&g_sample_calls, 1);
        ts_table_sample_free(s);
    }
    ts_client_free(c);
    return NULL;
}

int main(int argc, char **argv)
{
    const char *tensord = TS_TENSORD_PATH;
    const char *sampler_name = "uniform";
    int use_unix = 0, smoke = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--tensord") == 0 && i + 1 < argc)
            tensord = argv[++i];
        else if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc)
            g_seconds = strtod(argv[++i], NULL);
        else if (strcmp(argv[i], "--sampler") == 0 && i + 1 < argc)
            sampler_name = argv[++i];
        else if (strcmp(argv[i], "--batch") == 0 && i + 1 < argc)
            g_batch = (unsigned)strtoul(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--unix") == 0)
            use_unix = 1;
        else if (strcmp(argv[i], "--smoke") == 0)
            smoke = 1;
        else {
            fprintf(stderr,
                    "usage: %s [--tensord PATH] [--seconds S] [--sampler uniform|"
                    "prioritized] [--batch N] [--unix] [--smoke]\n",
                    argv[0]);
            return 2;
        }
    }
    if (smoke)
        g_seconds = 0.5;
    if (g_batch < 1 || g_batch > TS_TABLE_SAMPLE_MAX)
        g_batch = 1;
    int port = bench_free_port();
    char port_s[16], sock[128], addr[160];
    snprintf(port_s, sizeof(port_s), "%d", port);
    snprintf(sock, sizeof(sock), "/tmp/replay_bench.%d.sock", (int)getpid());
    char *targv[] = {(char *)tensord, "--port",     port_s,        "--unix", sock,
                     "--max-memory",  "8589934592", "--log-level", "warn",   NULL};
    pid_t pid = bench_spawn(targv, 0, "/tmp/replay_bench.tensord.log");
    if (pid <= 0 || bench_wait_listening(port, NULL, 10.0) != 0) {
        fprintf(stderr,
                "replay_bench: tensord did not start (see /tmp/replay_bench.tensord.log)\n");
        return 1;
    }
    if (use_unix)
        snprintf(addr, sizeof(addr), "unix:%s", sock);
    else
        snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);
    g_addr = addr;
    bench_pin_self(1);

    ts_client_t *c = NULL;
    int rc = ts_client_open(&c, addr, NULL);
    ts_table_config_t cfg;
    ts_table_config_init(&cfg);
    cfg.capacity = CAPACITY;
    cfg.min_size_to_sample = PREFILL;
    cfg.sampler =
        strcmp(sampler_name, "prioritized") == 0 ? TS_TABLE_PRIORITIZED : TS_TABLE_UNIFORM;
    if (rc == 0)
        rc = ts_table_create(c, "replay", &cfg, NULL);
    ts_value_t *item = make_item(7);
    for (int i = 0; rc == 0 && i < PREFILL; i++)
        rc = ts_table_insert(c, "replay", item, 1.0, 1000, NULL);
    ts_value_free(item);
    if (rc != 0) {
        fprintf(stderr, "replay_bench: setup: %s (%s)\n", ts_strerror(rc), ts_last_error());
        bench_stop(pid);
        return 1;
    }
    pthread_t ins[N_INSERTERS], smp[N_SAMPLERS];
    for (uintptr_t i = 0; i < N_INSERTERS; i++)
        pthread_create(&ins[i], NULL, inserter, (void *)(i + 1));
    for (uintptr_t i = 0; i < N_SAMPLERS; i++)
        pthread_create(&smp[i], NULL, sampler, NULL);
    double t0 = bench_now();
    /* Count from a moment when every thread runs (the first 10% is warm-up). */
    while (bench_now() - t0 < g_seconds * 0.1)
        usleep(1000);
    unsigned long long i0 = atomic_load(&g_inserts), s0 = atomic_load(&g_samples);
    double m0 = bench_now();
    while (bench_now() - t0 < g_seconds && !atomic_load(&g_failed))
        usleep(5000);
    unsigned long long i1 = atomic_load(&g_inserts), s1 = atomic_load(&g_samples);
    double m1 = bench_now();
    atomic_store(&g_stop, 1);
    for (int i = 0; i < N_INSERTERS; i++)
        pthread_join(ins[i], NULL);
    for (int i = 0; i < N_SAMPLERS; i++)
        pthread_join(smp[i], NULL);
    ts_value_t *info = NULL;
    int64_t size = 0;
    if (ts_table_info(c, "replay", &info) == 0)
        (void)ts_map_get_int(info, "size", &size);
    ts_value_free(info);
    ts_client_free(c);
    bench_stop(pid);
    unlink(sock);
    if (atomic_load(&g_failed)) {
        fprintf(stderr, "replay_bench: a call failed\n");
        return 1;
    }
    double ips = (double)(i1 - i0) / (m1 - m0), sps = (double)(s1 - s0) / (m1 - m0);
    unsigned long long ni = atomic_load(&g_inserts), nc = atomic_load(&g_sample_calls);
    double ins_us = ni > 0 ? (double)atomic_load(&g_insert_ns) / (double)ni / 1e3 : 0;
    double smp_us = nc > 0 ? (double)atomic_load(&g_sample_ns) / (double)nc / 1e3 : 0;
    printf("replay_bench: 4 KiB items, %d inserters, %d samplers (batch %u, %s sampler), %s, "
           "%.1f s, %ld CPUs; table size at the end %lld\n",
           N_INSERTERS, N_SAMPLERS, g_batch, sampler_name, use_unix ? "unix socket" : "TCP",
           m1 - m0, sysconf(_SC_NPROCESSORS_ONLN), (long long)size);
    printf("| | tensord (this machine) | Reverb (published, their hardware) |\n");
    printf("|---|---|---|\n");
    printf("| inserts/s | %.0f | ~%.0f |\n", ips, REVERB_INSERT);
    printf("| samples/s (items drawn) | %.0f | ~%.0f |\n", sps, REVERB_SAMPLE);
    printf("| mean insert call | %.1f us | |\n", ins_us);
    printf("| mean sample call | %.1f us | |\n", smp_us);
    return 0;
}
