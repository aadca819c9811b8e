/*
 * batcher_bench: many concurrent single-row requesters on a small TorchScript MLP on CPU, with
 * dynamic batching versus one forward per request (max_batch 1), in process and through tensord.
 * Reports throughput, p50/p99 latency and the average batch fill.
 *
 *   batcher_bench --model mlp.pt [--threads 64] [--requests 200] [--placement cpu:2]
 *                 [--max-batch 64] [--max-delay-us 500] [--tensord PATH | --server ADDR]
 *                 [--clients 8] [--modes direct,single,batched] [--smoke]
 *
 * The model takes a bare [rows, 8] float32 tensor and returns [rows, 4] (tests/shim's mlp.pt;
 * TS_MODELS_DIR is used when --model is not given). --tensord starts a private tensord on a
 * free port for the remote rows; without it or --server they are skipped. --smoke runs tiny
 * counts (a test runs it that way).
 *
 * Unbatched baselines, both "one forward per request": "direct" gives every requester its own
 * copy of the model and calls it itself (what a program without the batcher does), "single"
 * is the batcher with max_batch 1. --modes picks the in-process rows (all three by default).
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tensorshare/batcher.h"
#include "tensorshare/tensorshare.h"
#include "tensorshare/torch.h"

#define MAX_THREADS 1024
#define MAX_CLIENTS 64
#define MAX_SAMPLES (1u << 21) /* latencies kept per run: threads x requests at most */

/* Static storage: a benchmark needs no allocator of its own. */
static uint64_t g_lat[MAX_SAMPLES];

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

typedef struct opts {
    const char *model;
    int threads, requests, max_batch, clients;
    long delay_us;
    const char *placement;
    const char *server;
    const char *tensord;
    const char *modes;
} opts;

typedef struct req_thread {
    const opts *o;
    ts_batcher_t *b;       /* in process */
    ts_predictor_t *pred;  /* remote */
    ts_torch_model_t *own; /* direct: this requester's copy of the model */
    int index;
    uint64_t *lat_ns; /* o->requests entries */
    int failures;
} req_thread;

static void *requester(void *arg)
{
    req_thread *t = arg;
    float row[8];
    for (int k = 0; k < 8; k++)
        row[k] = (float)(t->index % 7) * 0.1f + (float)k * 0.01f;
    int64_t shape[2] = {1, 8};
    ts_value_t *in = ts_tensor_new(TS_FLOAT32, 2, shape, row, TS_BORROW);
    for (int i = 0; i < t->o->requests; i++) {
        ts_value_t *out = NULL;
        uint64_t t0 = now_ns();
        int rc = t->own != NULL    ? ts_torch_forward(t->own, in, &out)
                 : t->pred != NULL ? ts_predictor_predict(t->pred, in, 60000, &out, NULL)
                                   : ts_batcher_predict(t->b, in, 60000, &out, NULL);
        t->lat_ns[i] = now_ns() - t0;
        if (rc != 0)
            t->failures++;
        ts_value_free(out);
    }
    ts_value_free(in);
    return NULL;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* One measurement: a fresh batcher, the requesters, the numbers. 0 or -1. */
static int run(const opts *o, ts_torch_model_t *proto, const char *mode, int max_batch,
               long delay_us, ts_client_t **clients, ts_client_t *serve_client)
{
    static int serial;
    ts_field_t in = {"", TS_FLOAT32, 1, {8}};
    ts_field_t out = {"", TS_FLOAT32, 1, {4}};
    ts_batcher_config_t cfg;
    ts_batcher_config_init(&cfg);
    cfg.inputs = &in;
    cfg.n_inputs = 1;
    cfg.outputs = &out;
    cfg.n_outputs = 1;
    cfg.max_batch = max_batch;
    cfg.max_delay_us = delay_us;
    cfg.placement = o->placement;
    cfg.cuda_devices = ts_torch_cuda_device_count();
    cfg.create = ts_torch_model_create;
    cfg.create_arg = proto;
    ts_batcher_t *b = NULL;
    int rc = ts_batcher_new(&b, &cfg);
    if (rc != 0) {
        fprintf(stderr, "batcher_bench: %s: %s\n", ts_strerror(rc), ts_batcher_last_error());
        return -1;
    }
    char name[64];
    snprintf(name, sizeof(name), "bench%d-%d", (int)getpid(), serial++);
    if (serve_client != NULL && (rc = ts_batcher_serve(b, serve_client, name)) != 0) {
        fprintf(stderr, "batcher_bench: serve: %s\n", ts_strerror(rc));
        ts_batcher_free(b);
        return -1;
    }
    static req_thread t[MAX_THREADS];
    static pthread_t th[MAX_THREADS];
    uint64_t *lat = g_lat;
    for (int i = 0; i < o->threads; i++) {
        t[i] = (req_thread){o, b, NULL, NULL, i, lat + (size_t)i * (size_t)o->requests, 0};
        if (serve_client != NULL &&
            ts_predictor_open(&t[i].pred, clients[i % o->clients], name) != 0) {
            fprintf(stderr, "batcher_bench: predictor %d failed\n", i);
            t[i].pred = NULL;
        }
    }
    uint64_t t0 = now_ns();
    for (int i = 0; i < o->threads; i++)
        pthread_create(&th[i], NULL, requester, &t[i]);
    int failures = 0;
    for (int i = 0; i < o->threads; i++) {
        pthread_join(th[i], NULL);
        failures += t[i].failures;
    }
    double secs = (double)(now_ns() - t0) / 1e9;
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    for (int i = 0; i < o->threads; i++)
        ts_predictor_free(t[i].pred);
    ts_batcher_free(b);
    size_t n = (size_t)o->threads * (size_t)o->requests;
    qsort(lat, n, sizeof(*lat), cmp_u64);
    char batching[48];
    if (max_batch == 1)
        snprintf(batching, sizeof(batching), "one forward/request");
    else
        snprintf(batching, sizeof(batching), "max %d, %ld us", max_batch, delay_us);
    printf("%-10s  %-20s  %8zu  %7.2f  %9.0f  %8.0f  %8.0f  %10.2f  %s\n", mode, batching, n, secs,
           (double)n / secs, (double)lat[n / 2] / 1e3, (double)lat[n * 99 / 100] / 1e3,
           st.batches ? (double)st.rows / (double)st.batches : 0.0, failures ? "FAILURES" : "");
    fflush(stdout);
    return failures == 0 ? 0 : -1;
}

/* The direct baseline: each requester runs its own copy of the model, no batcher. 0 or -1. */
static int run_direct(const opts *o, ts_torch_model_t *proto)
{
    static req_thread t[MAX_THREADS];
    static pthread_t th[MAX_THREADS];
    int failures = 0;
    for (int i = 0; i < o->threads; i++) {
        t[i] = (req_thread){o, NULL, NULL, NULL, i, g_lat + (size_t)i * (size_t)o->requests, 0};
        if (ts_torch_clone(&t[i].own, proto, "cpu") != 0) {
            fprintf(stderr, "batcher_bench: clone: %s\n", ts_torch_last_error());
            failures = 1;
        }
    }
    uint64_t t0 = now_ns();
    for (int i = 0; i < o->threads && failures == 0; i++)
        pthread_create(&th[i], NULL, requester, &t[i]);
    for (int i = 0; i < o->threads && failures == 0; i++)
        pthread_join(th[i], NULL);
    double secs = (double)(now_ns() - t0) / 1e9;
    for (int i = 0; i < o->threads; i++) {
        failures += t[i].failures;
        ts_torch_model_free(t[i].own);
    }
    if (failures != 0)
        return -1;
    size_t n = (size_t)o->threads * (size_t)o->requests;
    qsort(g_lat, n, sizeof(*g_lat), cmp_u64);
    printf("%-10s  %-20s  %8zu  %7.2f  %9.0f  %8.0f  %8.0f  %10.2f  %s\n", "in-process",
           "direct, own model", n, secs, (double)n / secs, (double)g_lat[n / 2] / 1e3,
           (double)g_lat[n * 99 / 100] / 1e3, 1.0, "");
    fflush(stdout);
    return 0;
}

/* Start tensord on a free port; fills addr. Returns the pid or -1. */
static pid_t spawn_tensord(const char *exe, char *dir, size_t dirlen, char *addr, size_t addrlen)
{
    snprintf(dir, dirlen, "/tmp/tsbench.XXXXXX");
    if (mkdtemp(dir) == NULL)
        return -1;
    char port_file[600];
    snprintf(port_file, sizeof(port_file), "%s/port", dir);
    pid_t pid = fork();
    if (pid == 0) {
        execl(exe, exe, "--port", "0", "--port-file", port_file, (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 1000; i++) {
        FILE *f = fopen(port_file, "r");
        int port = 0;
        if (f != NULL) {
            if (fscanf(f, "%d", &port) != 1)
                port = 0;
            fclose(f);
        }
        if (port > 0) {
            snprintf(addr, addrlen, "127.0.0.1:%d", port);
            return pid;
        }
        sleep_ms(10);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
}

static int parse_int(const char *s, int lo, int hi, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || errno != 0 || v < lo || v > hi)
        return -1;
    *out = (int)v;
    return 0;
}

int main(int argc, char **argv)
{
    opts o = {NULL, 64, 200, 64, 8, 500, "cpu:2", NULL, NULL, "direct,single,batched"};
    int smoke = 0, delay = 500;
    char model_buf[600];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        int bad = 0, takes = 1;
        if (strcmp(a, "--smoke") == 0) {
            smoke = 1;
            takes = 0;
        } else if (strcmp(a, "--model") == 0) {
            o.model = v;
        } else if (strcmp(a, "--placement") == 0) {
            o.placement = v;
        } else if (strcmp(a, "--server") == 0) {
            o.server = v;
        } else if (strcmp(a, "--modes") == 0) {
            o.modes = v;
        } else if (strcmp(a, "--tensord") == 0) {
            o.tensord = v;
        } else if (strcmp(a, "--threads") == 0) {
            bad = parse_int(v, 1, MAX_THREADS, &o.threads);
        } else if (strcmp(a, "--requests") == 0) {
            bad = parse_int(v, 1, 10000000, &o.requests);
        } else if (strcmp(a, "--max-batch") == 0) {
            bad = parse_int(v, 1, 1 << 16, &o.max_batch);
        } else if (strcmp(a, "--max-delay-us") == 0) {
            bad = parse_int(v, 0, 10000000, &delay);
        } else if (strcmp(a, "--clients") == 0) {
            bad = parse_int(v, 1, MAX_CLIENTS, &o.clients);
        } else {
            bad = 1;
        }
        if (bad) {
            fprintf(stderr,
                    "batcher_bench: bad argument '%s' (see the comment at the top of "
                    "bench/batcher_bench.c)\n",
                    a);
            return 2;
        }
        i += takes;
    }
    o.delay_us = delay;
    if ((uint64_t)o.threads * (uint64_t)o.requests > MAX_SAMPLES) {
        fprintf(stderr, "batcher_bench: threads x requests must stay below %u\n", MAX_SAMPLES);
        return 2;
    }
    if (smoke) {
        o.requests = 3;
        o.clients = 2;
    }
    if (o.model == NULL && getenv("TS_MODELS_DIR") != NULL) {
        snprintf(model_buf, sizeof(model_buf), "%s/mlp.pt", getenv("TS_MODELS_DIR"));
        o.model = model_buf;
    }
    if (o.model == NULL) {
        fprintf(stderr, "batcher_bench: --model FILE (or TS_MODELS_DIR) is required\n");
        return 2;
    }
    ts_torch_set_num_threads(1); /* replicas are the parallelism; see docs/BATCHER.md */
    ts_torch_model_t *proto = NULL;
    int rc = ts_torch_load_file(&proto, o.model, "cpu");
    if (rc != 0) {
        fprintf(stderr, "batcher_bench: %s: %s\n", o.model, ts_torch_last_error());
        return 1;
    }
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    printf("batcher_bench: %d requester threads x %d single-row requests, model %s, "
           "placement %s, %ld CPUs\n",
           o.threads, o.requests, o.model, o.placement, cpus);
    printf("%-10s  %-20s  %8s  %7s  %9s  %8s  %8s  %10s\n", "mode", "batching", "requests",
           "seconds", "req/s", "p50 us", "p99 us", "rows/batch");
    int failed = 0;
    if (strstr(o.modes, "direct") != NULL)
        failed |= run_direct(&o, proto);
    if (strstr(o.modes, "single") != NULL)
        failed |= run(&o, proto, "in-process", 1, 0, NULL, NULL);
    if (strstr(o.modes, "batched") != NULL)
        failed |= run(&o, proto, "in-process", o.max_batch, o.delay_us, NULL, NULL);

    char dir[64] = "", addr[64];
    pid_t td = -1;
    if (o.server == NULL && o.tensord != NULL) {
        td = spawn_tensord(o.tensord, dir, sizeof(dir), addr, sizeof(addr));
        if (td < 0) {
            fprintf(stderr, "batcher_bench: could not start %s\n", o.tensord);
            failed = 1;
        } else {
            o.server = addr;
        }
    }
    if (o.server != NULL) {
        ts_client_t *serve = NULL, *clients[MAX_CLIENTS] = {NULL};
        rc = ts_client_open(&serve, o.server, NULL);
        for (int i = 0; rc == 0 && i < o.clients; i++)
            rc = ts_client_open(&clients[i], o.server, NULL);
        if (rc != 0) {
            fprintf(stderr, "batcher_bench: connecting to %s: %s\n", o.server, ts_strerror(rc));
            failed = 1;
        } else {
            failed |= run(&o, proto, "remote", 1, 0, clients, serve);
            failed |= run(&o, proto, "remote", o.max_batch, o.delay_us, clients, serve);
        }
        for (int i = 0; i < o.clients; i++)
            ts_client_free(clients[i]);
        ts_client_free(serve);
    }
    if (td > 0) {
        kill(td, SIGTERM);
        waitpid(td, NULL, 0);
        char port_file[600];
        snprintf(port_file, sizeof(port_file), "%s/port", dir);
        unlink(port_file);
        rmdir(dir);
    }
    ts_torch_model_free(proto);
    return failed ? 1 : 0;
}
