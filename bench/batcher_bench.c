/*
 * batcher_bench: many concurrent single-row requesters on a TorchScript MLP, with dynamic
 * batching versus one forward per request, in process and through tensord, and the limit: the
 * same replicas running full batches back to back with no batcher. Reports throughput, p50/p99
 * latency and the average batch fill, each batched rate relative to the best unbatched rate of
 * the same kind of requester, and each batched rate as a fraction of the limit.
 *
 *   batcher_bench [--model mlp.pt | --mlp 8,2048,2048,2048,4] [--threads 64] [--requests 200]
 *                 [--placement cpu:2] [--max-batch 64] [--max-delay-us 500]
 *                 [--min-delay-us 0] [--amp bfloat16|float16] [--answer-threads 0]
 *                 [--overlap] [--repeats 3] [--pin]
 *                 [--tensord PATH | --server ADDR] [--clients 8] [--modes LIST] [--smoke]
 *
 * The model takes a bare [rows, IN] float32 tensor and returns [rows, OUT]: tests/shim's mlp.pt
 * (8 -> 32 -> 4; TS_MODELS_DIR is used when neither --model nor --mlp is given), any such file,
 * or with --mlp an MLP of the given widths that tests/shim's make_models builds on the spot
 * (TS_MAKE_MODELS names it; by default ../tests/shim/make_models from this program). --threads
 * is the number of requesters. Every answer is checked against the model's own answer for that
 * requester's row (float32; with --amp the replicas run under autocast and the check allows
 * autocast's precision). --pin puts the serving side (replicas, tensord, the serve thread) on
 * cpu0 and the requesters on cpu1, as bench/run.sh does (the batcher's answer helpers, which
 * call the requesters' callbacks, with the requesters). --overlap sets overlap_answers (with
 * --answer-threads 1 or more). TS_BENCH_SIZES=1 in the environment
 * prints each batched run's batch-size histogram per replica (ts_batcher_replica_stats) on
 * stderr, with the time per batch of the input copy, the forward and the answers (slicing the
 * output and the callbacks, which resubmit).
 *
 *   limit     one thread per replica of --placement (the same devices, models made the same way)
 *             runs full --max-batch forwards back to back, copying each batch's rows into a
 *             batch buffer as the batcher does (for a CUDA model the shim's pinned staging and
 *             copies to and from the device are in the forward, as under the batcher); its
 *             rate is rows per second.
 *
 * Two kinds of requester, each with its batched rows and its own unbatched references, all
 * measured in the same run:
 *
 *   blocking  one thread per requester, each calling ts_batcher_predict in a loop (it sleeps
 *             and is woken once per request).
 *     direct    every requester thread has its own copy of the model and calls it itself
 *               (what a program without the batcher does): one forward per request.
 *     single    the batcher with max_batch 1: one forward per request.
 *     batched   the batcher with --max-batch and --max-delay-us.
 *   async     the requesters are small state machines, not threads: each submits one request
 *             with ts_batcher_predict_async, and its completion callback checks the answer and
 *             submits its next request (how actors stepped by an event loop, or the slots of a
 *             vectorized environment, use the batcher). No thread wakes per request.
 *     async-direct   as many threads as there are CPUs, each with its own copy of the model,
 *                    serve the same requesters round-robin, one forward per request, with no
 *                    batcher at all (the fastest unbatched way to serve them here).
 *     async-single   the batcher with max_batch 1 serves the async requesters.
 *     async          the batcher with --max-batch and --max-delay-us.
 *
 * --modes picks among those and limit (comma-separated; default all seven); "remote" adds the
 * blocking single and batched rows through tensord, twice: predictors that call the service
 * NAME (the default transport; group "remote") and predictors that relay through the bins
 * NAME/requests and their reply bins (TS_PREDICTOR_RELAY; group "relay"), with the ratio of the
 * two, and the same for remote actors (group rows "actors max ..."): o->threads asynchronous
 * requesters as in "async", each with its own predictor (as one per actor process; the
 * predictors on the --clients round-robin), submitting its next request from its answer's
 * callback on the client's I/O thread. "remote-service" or
 * "remote-relay" picks one of the transports, "actors" the two remote actor rows alone. --tensord
 * starts a private tensord on a free port, --server uses a running one (either implies "remote").
 * Each repeat runs every selected mode once, in forward order on even repeats and in reverse on odd
 * ones; the summary shows medians over the repeats, and each batched mode's median rate against the
 * better of its two unbatched references. --smoke runs tiny counts once (a test runs it that way).
 *
 * "cpu us" is the CPU time of the whole process (every thread) during the run, per request: it
 * moves less than the rate when other programs share the machine. Latency is from a request's
 * submission to its answer; for async-direct a request is
 * "submitted" when the same requester's previous answer came back, so it includes the wait for
 * the other requesters served before it.
 */
#define _GNU_SOURCE /* sched_setaffinity */
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tensorshare/batcher.h"
#include "tensorshare/tensorshare.h"
#include "tensorshare/torch.h"

#define MAX_THREADS  4096
#define MAX_CLIENTS  64
#define MAX_WORKERS  256        /* async-direct threads */
#define MAX_SAMPLES  (1u << 21) /* latencies kept per run: threads x requests at most */
#define MAX_REPEATS  15
#define N_ROWS       7     /* distinct request rows: requester i sends row i % N_ROWS */
#define MAX_COLS     65536 /* input or output width of a row, at most (--mlp) */
#define MAX_WIDTHS   16    /* layers of --mlp + 1 */
#define WARM_UP_RUNS 3     /* forwards per size before measuring */

/* Static storage: a benchmark needs no allocator of its own. */
static uint64_t g_lat[MAX_SAMPLES];
static int g_in = 8, g_out = 4;          /* row widths: tests/shim's mlp.pt, or --mlp */
static float g_rows[N_ROWS][MAX_COLS];   /* the distinct request rows (read-only when running) */
static float g_expect[N_ROWS][MAX_COLS]; /* the model's answer for each row, one at a time */
static float g_tol_abs = 1e-5f, g_tol_rel = 1e-4f; /* answer check; wider for big models */
static const struct opts *g_opts;                  /* for the model factory */

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
    int threads, requests, max_batch, clients, repeats;
    long delay_us;
    const char *placement;
    const char *server;
    const char *tensord;
    const char *modes;
    const char *mlp; /* --mlp widths, or NULL */
    int pin;         /* serving threads on cpu0, requesters on cpu1 */
    long min_delay_us;
    const char *amp;    /* --amp bfloat16|float16, or NULL */
    int answer_threads; /* the batcher's answer_threads */
    int overlap;        /* the batcher's overlap_answers */
} opts;

/* The CPU of each role when pinning (bench/run.sh's: servers cpu0, clients cpu1). */
#define SERVER_CPU 0
#define CLIENT_CPU 1

static int g_pin; /* --pin given and at least two CPUs */
/* The role the calling thread was pinned to (-1: none yet; see pinned_forward). */
static _Thread_local int tls_cpu = -1;

/* Pin the calling thread to cpu when pinning (sched_setaffinity(0) is this thread on Linux). */
static void pin_self(int cpu)
{
    if (!g_pin || tls_cpu == cpu)
        return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    (void)sched_setaffinity(0, sizeof(set), &set);
    tls_cpu = cpu;
}

/* Fill the distinct request rows (before any requester runs). */
static void fill_rows(void)
{
    for (int i = 0; i < N_ROWS; i++)
        for (int k = 0; k < g_in; k++)
            g_rows[i][k] = (float)i * 0.1f + (float)(k % 97) * 0.01f;
}

/* The input row of requester i (borrowing g_rows: requests only read it), or NULL. */
static ts_value_t *make_row(int i)
{
    int64_t shape[2] = {1, g_in};
    return ts_tensor_new(TS_FLOAT32, 2, shape, g_rows[i % N_ROWS], TS_BORROW);
}

static float absf(float x)
{
    return x < 0 ? -x : x;
}

/* 1 when out is requester i's expected [1, g_out] answer (a batch may round differently). */
static int answer_ok(const ts_value_t *out, int i)
{
    const ts_tensor_t *t = out != NULL ? ts_value_tensor(out) : NULL;
    if (t == NULL || t->dtype != TS_FLOAT32 || t->ndim != 2 || t->shape[0] != 1 ||
        t->shape[1] != g_out)
        return 0;
    const float *got = t->data, *want = g_expect[i % N_ROWS];
    for (int k = 0; k < g_out; k++)
        if (absf(got[k] - want[k]) > g_tol_abs + g_tol_rel * absf(want[k]))
            return 0;
    return 1;
}

/*
 * Pin every thread of this process whose name begins with prefix to cpu when pinning (the
 * batcher names its threads "ts-replica-N", "ts-answer-N", "ts-timer").
 */
static void pin_named(const char *prefix, int cpu)
{
    if (!g_pin)
        return;
    DIR *d = opendir("/proc/self/task");
    if (d == NULL)
        return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char path[300], comm[32] = "";
        snprintf(path, sizeof(path), "/proc/self/task/%s/comm", e->d_name);
        FILE *f = fopen(path, "r");
        if (f == NULL)
            continue;
        if (fgets(comm, sizeof(comm), f) != NULL && strncmp(comm, prefix, strlen(prefix)) == 0)
            (void)sched_setaffinity((pid_t)strtol(e->d_name, NULL, 10), sizeof(set), &set);
        fclose(f);
    }
    closedir(d);
}

/* ---------------------------------------------------------------------------------------------
 * Blocking requesters: one thread each
 */
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
    pin_self(CLIENT_CPU);
    ts_value_t *in = make_row(t->index);
    for (int i = 0; i < t->o->requests; i++) {
        ts_value_t *out = NULL;
        uint64_t t0 = now_ns();
        int rc = t->own != NULL    ? ts_torch_forward(t->own, in, &out)
                 : t->pred != NULL ? ts_predictor_predict(t->pred, in, 60000, &out, NULL)
                                   : ts_batcher_predict(t->b, in, 60000, &out, NULL);
        t->lat_ns[i] = now_ns() - t0;
        if (rc != 0 || !answer_ok(out, t->index))
            t->failures++;
        ts_value_free(out);
    }
    ts_value_free(in);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Asynchronous requesters: state machines stepped by the batcher's completions
 */
typedef struct actor actor;

typedef struct async_run {
    const opts *o;
    ts_batcher_t *b;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int finished; /* actors done (under mu) */
} async_run;

struct actor {
    async_run *run;
    ts_predictor_t *pred; /* remote actors: the predictor it shares with others, else NULL */
    ts_value_t *in;       /* its row, read by the batcher between a submit and its answer */
    int index;
    int sent; /* requests submitted */
    uint64_t t0;
    uint64_t *lat_ns;
    int failures;
};

static void actor_finish(actor *a)
{
    async_run *r = a->run;
    pthread_mutex_lock(&r->mu);
    if (++r->finished == r->o->threads)
        pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static void actor_answer(ts_batcher_t *b, int status, ts_value_t *output, int64_t version,
                         void *arg);
static void remote_actor_answer(ts_predictor_t *p, int status, ts_value_t *output, int64_t version,
                                void *arg);

/* Submit the actor's next request at time now, or finish it. */
static void actor_step(actor *a, uint64_t now)
{
    if (a->sent == a->run->o->requests) {
        actor_finish(a);
        return;
    }
    a->sent++;
    a->t0 = now;
    int rc = a->pred != NULL
                 ? ts_predictor_predict_async(a->pred, a->in, 60000, remote_actor_answer, a)
                 : ts_batcher_predict_async(a->run->b, a->in, 0, 60000, actor_answer, a);
    if (rc != 0) {
        a->failures += a->run->o->requests - a->sent + 1;
        actor_finish(a);
    }
}

static void actor_answer(ts_batcher_t *b, int status, ts_value_t *output, int64_t version,
                         void *arg)
{
    (void)b;
    (void)version;
    actor *a = arg;
    uint64_t now = now_ns(); /* the answer's arrival and the next request's submission */
    a->lat_ns[a->sent - 1] = now - a->t0;
    if (status != 0 || !answer_ok(output, a->index))
        a->failures++;
    ts_value_free(output);
    actor_step(a, now);
}

/* A remote actor's answer, on its client's I/O thread: the same as in process. */
static void remote_actor_answer(ts_predictor_t *p, int status, ts_value_t *output, int64_t version,
                                void *arg)
{
    (void)p;
    actor_answer(NULL, status, output, version, arg);
}

/*
 * Run the actors on b until each has had o->requests answers; with preds (n_preds of them),
 * remote actors, actor i through preds[i % n_preds]. Returns the failures.
 */
static int run_actors(const opts *o, ts_batcher_t *b, ts_predictor_t **preds, int n_preds,
                      uint64_t *lat)
{
    static actor act[MAX_THREADS];
    async_run r;
    r.o = o;
    r.b = b;
    r.finished = 0;
    pthread_mutex_init(&r.mu, NULL);
    pthread_cond_init(&r.cv, NULL);
    for (int i = 0; i < o->threads; i++) {
        act[i] = (actor){&r, preds != NULL ? preds[i % n_preds] : NULL, NULL, i, 0,
                         0,  lat + (size_t)i * (size_t)o->requests,     0};
        act[i].in = make_row(i);
    }
    for (int i = 0; i < o->threads; i++)
        actor_step(&act[i], now_ns());
    pthread_mutex_lock(&r.mu);
    while (r.finished < o->threads)
        pthread_cond_wait(&r.cv, &r.mu);
    pthread_mutex_unlock(&r.mu);
    int failures = 0;
    for (int i = 0; i < o->threads; i++) {
        failures += act[i].failures;
        ts_value_free(act[i].in);
    }
    pthread_cond_destroy(&r.cv);
    pthread_mutex_destroy(&r.mu);
    return failures;
}

/* async-direct: worker w serves actors w, w + n, w + 2n, ... round-robin on its own model. */
typedef struct direct_worker {
    const opts *o;
    ts_torch_model_t *own;
    int first, step;
    uint64_t start;
    uint64_t *lat;
    int failures;
} direct_worker;

/* One async-direct requester; each is touched by one worker only. */
typedef struct direct_actor {
    _Alignas(64) uint64_t since; /* its request's submission: its previous answer */
    ts_value_t *in;
} direct_actor;

static direct_actor g_dact[MAX_THREADS];

static void *direct_worker_main(void *arg)
{
    direct_worker *w = arg;
    const opts *o = w->o;
    pin_self(SERVER_CPU); /* these threads do the serving: the replicas' CPU */
    for (int i = w->first; i < o->threads; i += w->step) {
        g_dact[i].in = make_row(i);
        g_dact[i].since = w->start;
    }
    for (int k = 0; k < o->requests; k++) {
        for (int i = w->first; i < o->threads; i += w->step) {
            ts_value_t *out = NULL;
            int rc = ts_torch_forward(w->own, g_dact[i].in, &out);
            uint64_t t = now_ns();
            w->lat[(size_t)i * (size_t)o->requests + (size_t)k] = t - g_dact[i].since;
            g_dact[i].since = t;
            if (rc != 0 || !answer_ok(out, i))
                w->failures++;
            ts_value_free(out);
        }
    }
    for (int i = w->first; i < o->threads; i += w->step)
        ts_value_free(g_dact[i].in);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Measurements
 */
typedef enum kind {
    K_LIMIT,
    K_DIRECT,
    K_BLOCKING,
    K_ASYNC_DIRECT,
    K_ASYNC,
    K_REMOTE,
    K_REMOTE_ASYNC
} kind;

typedef struct result {
    double rate, cpu_us, p50_us, p99_us, fill; /* cpu_us: process CPU time per request */
} result;

/* The measured stretch of a run: wall-clock time and the CPU time of the whole process. */
typedef struct span {
    uint64_t wall0, cpu0;
    double secs, cpu_secs;
} span;

static uint64_t cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void span_start(span *s)
{
    s->wall0 = now_ns();
    s->cpu0 = cpu_ns();
}

static void span_stop(span *s)
{
    s->cpu_secs = (double)(cpu_ns() - s->cpu0) / 1e9;
    s->secs = (double)(now_ns() - s->wall0) / 1e9;
}

/* One row of the table: a mode and its results over the repeats. */
typedef struct mcase {
    const char *token; /* its name in --modes */
    const char *group; /* the kind of requester: blocking, async, remote */
    kind k;
    int batched;   /* --max-batch and --max-delay-us, or one forward per request */
    int transport; /* remote: the predictors' ts_predictor_transport_t */
    int on;
    int n; /* repeats measured */
    result r[MAX_REPEATS];
} mcase;

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    if (n == 0)
        return 0;
    qsort(v, (size_t)n, sizeof(*v), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static void describe(const opts *o, const mcase *c, char *buf, size_t len)
{
    if (c->k == K_LIMIT)
        snprintf(buf, len, "full %d-row forwards", o->max_batch);
    else if (c->k == K_DIRECT)
        snprintf(buf, len, "direct, own model");
    else if (c->k == K_ASYNC_DIRECT)
        snprintf(buf, len, "direct, thread per CPU");
    else if (c->k == K_REMOTE_ASYNC)
        snprintf(buf, len, "actors max %d, %ld us", o->max_batch, o->delay_us);
    else if (!c->batched)
        snprintf(buf, len, "one forward/request");
    else if (o->min_delay_us > 0)
        snprintf(buf, len, "max %d, %ld-%ld us", o->max_batch, o->min_delay_us, o->delay_us);
    else
        snprintf(buf, len, "max %d, %ld us", o->max_batch, o->delay_us);
}

/* Sort the latencies of a run and fill res. */
static void finish_result(const opts *o, const span *sp, double fill, result *res)
{
    size_t n = (size_t)o->threads * (size_t)o->requests;
    qsort(g_lat, n, sizeof(*g_lat), cmp_u64);
    res->rate = (double)n / sp->secs;
    res->cpu_us = sp->cpu_secs * 1e6 / (double)n;
    res->p50_us = (double)g_lat[n / 2] / 1e3;
    res->p99_us = (double)g_lat[n * 99 / 100] / 1e3;
    res->fill = fill;
}

/* A copy of the prototype for a direct mode, warmed up on single rows (see warm_up). 0 or -1. */
static int clone_warm(ts_torch_model_t **out, ts_torch_model_t *proto)
{
    *out = NULL;
    if (ts_torch_clone(out, proto, "cpu") != 0) {
        fprintf(stderr, "batcher_bench: clone: %s\n", ts_last_error());
        return -1;
    }
    ts_value_t *in = make_row(0);
    int rc = in != NULL ? 0 : TS_ENOMEM;
    for (int k = 0; k < WARM_UP_RUNS && rc == 0; k++) {
        ts_value_t *o = NULL;
        rc = ts_torch_forward(*out, in, &o);
        ts_value_free(o);
    }
    ts_value_free(in);
    return rc == 0 ? 0 : -1;
}

/* Blocking requester threads: own models (direct), the batcher, or predictors. */
static int run_threads(const opts *o, ts_torch_model_t *proto, ts_batcher_t *b,
                       ts_client_t **clients, const char *name, int transport, span *sp)
{
    ts_predictor_options_t po;
    ts_predictor_options_init(&po);
    po.transport = transport;
    static req_thread t[MAX_THREADS];
    static pthread_t th[MAX_THREADS];
    int failures = 0, started = 0;
    /* Predictors' receiver threads are the clients' side: they inherit the client CPU. */
    pin_self(CLIENT_CPU);
    for (int i = 0; i < o->threads; i++) {
        t[i] = (req_thread){o, b, NULL, NULL, i, g_lat + (size_t)i * (size_t)o->requests, 0};
        if (proto != NULL && clone_warm(&t[i].own, proto) != 0)
            failures++;
        if (clients != NULL &&
            ts_predictor_open_with(&t[i].pred, clients[i % o->clients], name, &po) != 0) {
            fprintf(stderr, "batcher_bench: predictor %d failed\n", i);
            failures++;
        }
    }
    span_start(sp);
    /* The requester threads inherit the client CPU; the main thread goes back to serving. */
    pin_self(CLIENT_CPU);
    for (; failures == 0 && started < o->threads; started++)
        pthread_create(&th[started], NULL, requester, &t[started]);
    pin_self(SERVER_CPU);
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    span_stop(sp);
    for (int i = 0; i < o->threads; i++) {
        failures += t[i].failures;
        ts_torch_model_free(t[i].own);
        ts_predictor_free(t[i].pred);
    }
    return failures;
}

/* async-direct: one thread per CPU, each with its own model, serving the actors round-robin. */
static int run_async_direct(const opts *o, ts_torch_model_t *proto, span *sp)
{
    static direct_worker w[MAX_WORKERS];
    static pthread_t th[MAX_WORKERS];
    long cpus = g_pin ? 1 : sysconf(_SC_NPROCESSORS_ONLN); /* pinned: the server CPU only */
    int n = cpus < 1 ? 1 : cpus > MAX_WORKERS ? MAX_WORKERS : (int)cpus;
    if (n > o->threads)
        n = o->threads;
    int failures = 0;
    for (int i = 0; i < n; i++) {
        w[i] = (direct_worker){o, NULL, i, n, 0, g_lat, 0};
        if (clone_warm(&w[i].own, proto) != 0)
            failures++;
    }
    span_start(sp);
    for (int i = 0; failures == 0 && i < n; i++) {
        w[i].start = sp->wall0;
        pthread_create(&th[i], NULL, direct_worker_main, &w[i]);
    }
    for (int i = 0; failures == 0 && i < n; i++)
        pthread_join(th[i], NULL);
    span_stop(sp);
    for (int i = 0; i < n; i++) {
        failures += w[i].failures;
        ts_torch_model_free(w[i].own);
    }
    return failures;
}

/*
 * Run a model a few times on 1, 2 and max_batch rows before the clock starts: TorchScript's
 * profiling executor runs a graph's first calls slowly while it specializes it, and every mode
 * makes fresh copies of the model. 0 or a TS_E* code.
 */
static int warm_up(ts_model_t *m, int max_batch)
{
    int64_t sizes[3] = {1, 2, max_batch};
    int rc = 0;
    for (int i = 0; i < 3 && rc == 0; i++) {
        int64_t shape[2] = {sizes[i], g_in};
        ts_value_t *in = ts_tensor_alloc(TS_FLOAT32, 2, shape);
        for (int k = 0; k < WARM_UP_RUNS && rc == 0; k++) {
            ts_value_t *out = NULL;
            rc = in != NULL ? m->ops->forward(m, in, sizes[i], &out) : TS_ENOMEM;
            ts_value_free(out);
        }
        ts_value_free(in);
    }
    return rc;
}

/* The batcher's model factory: a copy of the prototype, warmed up. */
static int warm_create(const char *device, int replica, ts_model_t **out, void *arg)
{
    const opts *o = g_opts;
    int rc = ts_torch_model_create(device, replica, out, arg);
    if (rc == 0 && (rc = warm_up(*out, o->max_batch)) != 0)
        ts_set_last_error("warm-up forward failed");
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * The limit: what the replicas can do with no batcher at all
 */

/* A model that is never run: ts_batcher_new with it only expands the placement into devices. */
static int stub_forward(ts_model_t *m, const ts_value_t *in, int64_t rows, ts_value_t **out)
{
    (void)m, (void)in, (void)rows, (void)out;
    return TS_ENOTSUP;
}

static void stub_free(ts_model_t *m)
{
    (void)m;
}

static const ts_model_ops_t stub_ops = {stub_forward, NULL, stub_free};
static ts_model_t g_stub = {&stub_ops, NULL};

static int stub_create(const char *device, int replica, ts_model_t **out, void *arg)
{
    (void)device, (void)replica, (void)arg;
    *out = &g_stub;
    return 0;
}

/* One replica of the limit row: its model, its batch buffer and its share of the batches. */
typedef struct limit_worker {
    ts_model_t *model;
    ts_value_t *batch; /* max_batch rows of g_in floats, as the batcher's batch buffer */
    int batches, max_batch;
    uint64_t *lat; /* per batch */
    int failures;
} limit_worker;

/*
 * Back-to-back forwards of full batches: each batch first copies its rows one request at a time
 * into the batch buffer (the batcher's input copy); the model's forward then does whatever it
 * does with its input and output (for a CUDA model: pinned staging, the host-to-device copy and
 * the copy of the output back to host memory, as under the batcher).
 */
static void *limit_main(void *arg)
{
    limit_worker *w = arg;
    float *dst = (float *)ts_value_tensor(w->batch)->data;
    size_t row_bytes = (size_t)g_in * sizeof(float);
    for (int k = 0; k < w->batches; k++) {
        uint64_t t0 = now_ns();
        for (int i = 0; i < w->max_batch; i++)
            memcpy(dst + (size_t)i * (size_t)g_in, g_rows[i % N_ROWS], row_bytes);
        ts_value_t *out = NULL;
        int rc = w->model->ops->forward(w->model, w->batch, w->max_batch, &out);
        const ts_tensor_t *t = rc == 0 && out != NULL ? ts_value_tensor(out) : NULL;
        if (t == NULL || t->ndim != 2 || t->shape[0] != w->max_batch || t->shape[1] != g_out)
            w->failures++;
        ts_value_free(out);
        w->lat[k] = now_ns() - t0;
    }
    return NULL;
}

/*
 * The limit row: one thread per replica of --placement (the same devices, models made and warmed
 * up by the same factory) runs full max_batch batches back to back, as many rows in all as the
 * other modes' requests. Its "requests" are rows; its latencies are per batch. 0 or -1.
 */
static int run_limit(const opts *o, ts_torch_model_t *proto, result *res)
{
    ts_field_t in = {"", TS_FLOAT32, 1, {g_in}};
    ts_batcher_options_t cfg;
    ts_batcher_options_init(&cfg);
    cfg.inputs = &in;
    cfg.n_inputs = 1;
    cfg.placement = o->placement;
    cfg.cuda_devices = ts_torch_cuda_device_count();
    cfg.create = stub_create;
    ts_batcher_t *devs = NULL;
    if (ts_batcher_new(&devs, &cfg) != 0) {
        fprintf(stderr, "batcher_bench: limit: %s\n", ts_last_error());
        return -1;
    }
    static limit_worker w[MAX_WORKERS];
    static pthread_t th[MAX_WORKERS];
    int n = ts_batcher_replicas(devs);
    n = n > MAX_WORKERS ? MAX_WORKERS : n;
    uint64_t rows = (uint64_t)o->threads * (uint64_t)o->requests;
    uint64_t total = (rows + (uint64_t)o->max_batch - 1) / (uint64_t)o->max_batch;
    int per = (int)((total + (uint64_t)n - 1) / (uint64_t)n);
    if (per < 1)
        per = 1;
    int failures = 0, made = 0;
    for (; made < n && failures == 0; made++) {
        int64_t shape[2] = {o->max_batch, g_in};
        w[made] = (limit_worker){NULL,         ts_tensor_alloc(TS_FLOAT32, 2, shape), per,
                                 o->max_batch, g_lat + (size_t)made * (size_t)per,    0};
        if (w[made].batch == NULL || (size_t)(made + 1) * (size_t)per > MAX_SAMPLES ||
            warm_create(ts_batcher_device(devs, made), made, &w[made].model, proto) != 0) {
            fprintf(stderr, "batcher_bench: limit: replica %d: %s\n", made, ts_last_error());
            failures++;
        }
    }
    ts_batcher_free(devs);
    span sp;
    span_start(&sp);
    int started = 0;
    for (; failures == 0 && started < n; started++)
        pthread_create(&th[started], NULL, limit_main, &w[started]);
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    span_stop(&sp);
    for (int i = 0; i < made; i++) {
        failures += w[i].failures;
        if (w[i].model != NULL)
            w[i].model->ops->free(w[i].model);
        ts_value_free(w[i].batch);
    }
    if (failures != 0)
        return -1;
    size_t nb = (size_t)n * (size_t)per;
    qsort(g_lat, nb, sizeof(*g_lat), cmp_u64);
    double done = (double)nb * (double)o->max_batch;
    res->rate = done / sp.secs;
    res->cpu_us = sp.cpu_secs * 1e6 / done;
    res->p50_us = (double)g_lat[nb / 2] / 1e3;
    res->p99_us = (double)g_lat[nb * 99 / 100] / 1e3;
    res->fill = o->max_batch;
    return 0;
}

/* One measurement of one mode: a fresh batcher where it needs one. 0 or -1. */
static int measure(const opts *o, ts_torch_model_t *proto, const mcase *c, ts_client_t **clients,
                   ts_client_t *serve_client, result *res)
{
    static int serial;
    span sp = {0, 0, 0, 0};
    int failures;
    if (c->k == K_LIMIT)
        return run_limit(o, proto, res);
    if (c->k == K_DIRECT || c->k == K_ASYNC_DIRECT) {
        failures = c->k == K_DIRECT ? run_threads(o, proto, NULL, NULL, NULL, 0, &sp)
                                    : run_async_direct(o, proto, &sp);
        if (failures == 0)
            finish_result(o, &sp, 1.0, res);
        return failures == 0 ? 0 : -1;
    }
    ts_field_t in = {"", TS_FLOAT32, 1, {g_in}};
    ts_field_t out = {"", TS_FLOAT32, 1, {g_out}};
    ts_batcher_options_t cfg;
    ts_batcher_options_init(&cfg);
    cfg.inputs = &in;
    cfg.n_inputs = 1;
    cfg.outputs = &out;
    cfg.n_outputs = 1;
    cfg.max_batch = c->batched ? o->max_batch : 1;
    cfg.max_delay_us = c->batched ? o->delay_us : 0;
    cfg.min_delay_us = c->batched ? o->min_delay_us : 0;
    cfg.answer_threads = o->answer_threads;
    cfg.overlap_answers = o->overlap && o->answer_threads > 0;
    cfg.placement = o->placement;
    cfg.cuda_devices = ts_torch_cuda_device_count();
    cfg.create = warm_create;
    cfg.create_arg = proto;
    ts_batcher_t *b = NULL;
    int rc = ts_batcher_new(&b, &cfg);
    if (rc != 0) {
        fprintf(stderr, "batcher_bench: %s: %s\n", ts_strerror(rc), ts_last_error());
        return -1;
    }
    /* The helpers run the requesters' callbacks: the client CPU (the replicas stay on cpu0). */
    pin_named("ts-answer-", CLIENT_CPU);
    char name[64];
    snprintf(name, sizeof(name), "bench%d-%d", (int)getpid(), serial++);
    int remote = c->k == K_REMOTE || c->k == K_REMOTE_ASYNC;
    if (remote && (rc = ts_batcher_serve(b, serve_client, name)) != 0) {
        fprintf(stderr, "batcher_bench: serve: %s\n", ts_strerror(rc));
        ts_batcher_free(b);
        return -1;
    }
    if (c->k == K_ASYNC) {
        span_start(&sp);
        failures = run_actors(o, b, NULL, 0, g_lat);
        span_stop(&sp);
    } else if (c->k == K_REMOTE_ASYNC) {
        /*
         * One predictor per actor (as one per actor process), on the clients round-robin; the
         * actors' callbacks run on their client's I/O thread.
         */
        static ts_predictor_t *preds[MAX_THREADS];
        ts_predictor_options_t po;
        ts_predictor_options_init(&po);
        po.transport = c->transport;
        failures = 0;
        pin_self(CLIENT_CPU);
        for (int i = 0; i < o->threads; i++)
            preds[i] = NULL;
        for (int i = 0; i < o->threads && failures == 0; i++)
            failures = ts_predictor_open_with(&preds[i], clients[i % o->clients], name, &po) != 0;
        if (failures == 0) {
            span_start(&sp);
            failures = run_actors(o, b, preds, o->threads, g_lat);
            span_stop(&sp);
        }
        for (int i = 0; i < o->threads; i++)
            ts_predictor_free(preds[i]);
        pin_self(SERVER_CPU);
    } else {
        failures =
            run_threads(o, NULL, b, c->k == K_REMOTE ? clients : NULL, name, c->transport, &sp);
    }
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    if (getenv("TS_BENCH_SIZES") != NULL) {
        /* The batch sizes of every replica (ts_batcher_replica_stats), on stderr. */
        for (int i = 0; i < ts_batcher_replicas(b); i++) {
            ts_batcher_replica_stats_t rs;
            if (ts_batcher_replica_stats(b, i, &rs) != 0)
                continue;
            fprintf(stderr, "%s replica %d: %llu batches, sizes", c->token, i,
                    (unsigned long long)rs.batches);
            for (int k = 0; k < TS_BATCHER_HIST_BUCKETS; k++)
                if (rs.batch_sizes[k] > 0)
                    fprintf(stderr, " <=%ld:%llu", 1L << k, (unsigned long long)rs.batch_sizes[k]);
            /* Where a batch's time went: the input copy, the forward, the answers. */
            double nb = rs.batches > 0 ? (double)rs.batches : 1.0;
            fprintf(stderr, "; us per batch: copy %.1f, forward %.1f, answers %.1f\n",
                    (double)rs.input_ns / nb / 1e3, (double)rs.compute_ns / nb / 1e3,
                    (double)rs.output_ns / nb / 1e3);
        }
    }
    ts_batcher_free(b);
    if (failures != 0)
        return -1;
    finish_result(o, &sp, st.batches ? (double)st.rows / (double)st.batches : 0.0, res);
    return 0;
}

static void print_row(const opts *o, const mcase *c, const char *what, const result *r)
{
    char batching[48];
    describe(o, c, batching, sizeof(batching));
    printf("%-8s  %-22s  %6s  %9.0f  %7.2f  %8.0f  %8.0f  %10.2f\n", c->group, batching, what,
           r->rate, r->cpu_us, r->p50_us, r->p99_us, r->fill);
    fflush(stdout);
}

/* 1 when token is one of the comma-separated names in list. */
static int listed(const char *list, const char *token)
{
    size_t n = strlen(token);
    for (const char *p = list; *p;) {
        const char *end = strchr(p, ',');
        size_t len = end != NULL ? (size_t)(end - p) : strlen(p);
        if (len == n && strncmp(p, token, n) == 0)
            return 1;
        p += len + (end != NULL);
    }
    return 0;
}

/* Medians of a mode over its repeats. */
static result medians(const mcase *c)
{
    double v[5][MAX_REPEATS];
    for (int i = 0; i < c->n; i++) {
        v[0][i] = c->r[i].rate;
        v[1][i] = c->r[i].cpu_us;
        v[2][i] = c->r[i].p50_us;
        v[3][i] = c->r[i].p99_us;
        v[4][i] = c->r[i].fill;
    }
    return (result){median(v[0], c->n), median(v[1], c->n), median(v[2], c->n), median(v[3], c->n),
                    median(v[4], c->n)};
}

/*
 * A batched mode's median rate against the best median rate among the unbatched modes refs
 * (n of them; those not run are skipped), and its median CPU time per request against the
 * lowest among them (less sensitive to other load on the machine than the rates).
 */
static void print_ratio(const char *group, const char *against, const mcase *batched,
                        const mcase *const *refs, int n)
{
    const mcase *best = NULL, *leanest = NULL;
    double ref = 0, ref_cpu = 0;
    for (int i = 0; i < n; i++) {
        if (refs[i]->n == 0)
            continue;
        result m = medians(refs[i]);
        if (best == NULL || m.rate > ref) {
            ref = m.rate;
            best = refs[i];
        }
        if (leanest == NULL || m.cpu_us < ref_cpu) {
            ref_cpu = m.cpu_us;
            leanest = refs[i];
        }
    }
    if (batched->n == 0 || best == NULL)
        return;
    result m = medians(batched);
    printf("%-8s  batched %.0f req/s = %.2fx the best unbatched %s (%s, %.0f req/s); CPU per "
           "request %.2f us = 1/%.1f of the least (%s, %.2f us)\n",
           group, m.rate, m.rate / ref, against, best->token, ref, m.cpu_us,
           m.cpu_us > 0 ? ref_cpu / m.cpu_us : 0.0, leanest->token, ref_cpu);
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
        /* The child inherits the server CPU from the main thread when pinning. */
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

/*
 * Build an MLP of the given widths ("8,2048,2048,2048,4") with tests/shim's make_models: the one
 * named by TS_MAKE_MODELS, or the one of this build tree (../tests/shim/make_models from this
 * program). Fills dir (a fresh temporary directory) and path (the model in it), and sets g_in,
 * g_out and, for wide layers, a looser answer check. 0 or -1.
 */
static int make_mlp(const char *widths, char *dir, size_t dirlen, char *path, size_t pathlen)
{
    int w[MAX_WIDTHS], n = 0, widest = 0, bad = 0;
    const char *p = widths;
    while (!bad && *p != '\0') {
        char *end;
        long v = strtol(p, &end, 10);
        bad = end == p || v < 1 || v > MAX_COLS || (*end != ',' && *end != '\0') ||
              n == MAX_WIDTHS || (*end == ',' && end[1] == '\0');
        if (!bad) {
            w[n++] = (int)v;
            widest = v > widest ? (int)v : widest;
            p = *end == ',' ? end + 1 : end;
        }
    }
    if (bad || n < 2) {
        fprintf(stderr, "batcher_bench: --mlp wants 2 to %d widths like 8,2048,2048,2048,4\n",
                MAX_WIDTHS);
        return -1;
    }
    char maker[600];
    const char *env = getenv("TS_MAKE_MODELS");
    if (env != NULL) {
        snprintf(maker, sizeof(maker), "%s", env);
    } else {
        char self[512];
        ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
        self[len > 0 ? len : 0] = '\0';
        char *slash = strrchr(self, '/');
        if (slash != NULL)
            *slash = '\0';
        snprintf(maker, sizeof(maker), "%s/../tests/shim/make_models", self);
    }
    snprintf(dir, dirlen, "/tmp/tsbench-mlp.XXXXXX");
    if (mkdtemp(dir) == NULL)
        return -1;
    snprintf(path, pathlen, "%s/mlp.pt", dir);
    pid_t pid = fork();
    if (pid == 0) {
        execl(maker, maker, "--mlp", widths, path, (char *)NULL);
        _exit(127);
    }
    int st = 0;
    if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "batcher_bench: %s --mlp failed (set TS_MAKE_MODELS to make_models)\n",
                maker);
        rmdir(dir);
        dir[0] = '\0';
        return -1;
    }
    g_in = w[0];
    g_out = w[n - 1];
    if (widest > 64) {
        /* Sums over wide layers round differently in a batch than alone. */
        g_tol_abs = 1e-4f;
        g_tol_rel = 1e-3f;
    }
    return 0;
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
    opts o = {NULL, 64, 200, 64, 8, 3, 500, "cpu:2", NULL, NULL, NULL, NULL, 0, 0, NULL, 0, 0};
    int min_delay = 0;
    int smoke = 0, delay = 500;
    char model_buf[600];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        int bad = 0, takes = 1;
        if (strcmp(a, "--smoke") == 0) {
            smoke = 1;
            takes = 0;
        } else if (strcmp(a, "--pin") == 0) {
            o.pin = 1;
            takes = 0;
        } else if (strcmp(a, "--overlap") == 0) {
            o.overlap = 1;
            takes = 0;
        } else if (strcmp(a, "--model") == 0) {
            o.model = v;
        } else if (strcmp(a, "--mlp") == 0) {
            o.mlp = v;
        } else if (strcmp(a, "--amp") == 0) {
            o.amp = v;
            bad = strcmp(v, "bfloat16") != 0 && strcmp(v, "float16") != 0;
        } else if (strcmp(a, "--answer-threads") == 0) {
            bad = parse_int(v, 0, TS_BATCHER_MAX_ANSWER_THREADS, &o.answer_threads);
        } else if (strcmp(a, "--min-delay-us") == 0) {
            bad = parse_int(v, 0, 10000000, &min_delay);
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
        } else if (strcmp(a, "--repeats") == 0) {
            bad = parse_int(v, 1, MAX_REPEATS, &o.repeats);
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
    o.min_delay_us = min_delay;
    if (smoke) {
        o.requests = 3;
        o.clients = 2;
        o.repeats = 1;
    }
    if ((uint64_t)o.threads * (uint64_t)o.requests > MAX_SAMPLES) {
        fprintf(stderr, "batcher_bench: threads x requests must stay below %u\n", MAX_SAMPLES);
        return 2;
    }
    char mlp_dir[64] = "";
    if (o.mlp != NULL) {
        if (make_mlp(o.mlp, mlp_dir, sizeof(mlp_dir), model_buf, sizeof(model_buf)) != 0)
            return 1;
        o.model = model_buf;
    }
    if (o.model == NULL && getenv("TS_MODELS_DIR") != NULL) {
        snprintf(model_buf, sizeof(model_buf), "%s/mlp.pt", getenv("TS_MODELS_DIR"));
        o.model = model_buf;
    }
    if (o.model == NULL) {
        fprintf(stderr, "batcher_bench: --model FILE (or TS_MODELS_DIR) is required\n");
        return 2;
    }
    g_opts = &o;
    g_pin = o.pin && sysconf(_SC_NPROCESSORS_ONLN) >= 2;
    /*
     * The latency samples' pages, touched once now: a page fault costs microseconds on a
     * virtual machine, and the first mode to write a million samples would pay 2 000 of them.
     */
    size_t samples = (size_t)o.threads * (size_t)o.requests;
    memset(g_lat, 0, (samples < MAX_SAMPLES ? samples : MAX_SAMPLES) * sizeof(*g_lat));
    /* The main thread creates the serving threads (replicas, tensord, serving): they inherit. */
    pin_self(SERVER_CPU);
    fill_rows();
    ts_torch_set_num_threads(1); /* replicas are the parallelism; see docs/BATCHER.md */
    ts_torch_model_t *proto = NULL;
    int rc = ts_torch_load_file(&proto, o.model, "cpu");
    if (rc != 0) {
        fprintf(stderr, "batcher_bench: %s: %s\n", o.model, ts_last_error());
        return 1;
    }
    /* The expected answers: the model on each distinct row alone. */
    for (int i = 0; i < N_ROWS && rc == 0; i++) {
        ts_value_t *in = make_row(i), *out = NULL;
        rc = ts_torch_forward(proto, in, &out);
        const ts_tensor_t *t = rc == 0 ? ts_value_tensor(out) : NULL;
        if (t != NULL && t->dtype == TS_FLOAT32 && t->ndim == 2 && t->shape[0] == 1 &&
            t->shape[1] == g_out)
            memcpy(g_expect[i], t->data, (size_t)g_out * sizeof(float));
        else
            rc = rc != 0 ? rc : TS_EINVAL;
        ts_value_free(in);
        ts_value_free(out);
    }
    if (rc != 0) {
        fprintf(stderr, "batcher_bench: %s does not map [1, %d] float32 to [1, %d]\n", o.model,
                g_in, g_out);
        ts_torch_model_free(proto);
        return 1;
    }

    if (o.amp != NULL) {
        /* The expected answers stay float32: the check is widened to autocast's precision. */
        rc = ts_torch_set_autocast(proto, strcmp(o.amp, "float16") == 0 ? TS_FLOAT16 : TS_BFLOAT16);
        if (rc != 0) {
            fprintf(stderr, "batcher_bench: --amp %s: %s\n", o.amp, ts_last_error());
            ts_torch_model_free(proto);
            return 1;
        }
        /* Wide layers in float16 or bfloat16 drift further than small ones. */
        int wide = g_tol_abs > 1e-5f;
        g_tol_abs = wide ? 1e-1f : 3e-2f;
        g_tol_rel = wide ? 1e-1f : 3e-2f;
    }
    int failed = 0;
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
    ts_client_t *serve = NULL, *clients[MAX_CLIENTS] = {NULL};
    if (o.server != NULL) {
        rc = ts_client_open(&serve, o.server, NULL);
        pin_self(CLIENT_CPU); /* the requesters' connections: their I/O threads */
        for (int i = 0; rc == 0 && i < o.clients; i++)
            rc = ts_client_open(&clients[i], o.server, NULL);
        pin_self(SERVER_CPU);
        if (rc != 0) {
            fprintf(stderr, "batcher_bench: connecting to %s: %s\n", o.server, ts_strerror(rc));
            failed = 1;
        }
    }

    static mcase cases[] = {
        {.token = "limit", .group = "limit", .k = K_LIMIT, .batched = 1},
        {.token = "direct", .group = "blocking", .k = K_DIRECT, .batched = 0},
        {.token = "single", .group = "blocking", .k = K_BLOCKING, .batched = 0},
        {.token = "batched", .group = "blocking", .k = K_BLOCKING, .batched = 1},
        {.token = "async-direct", .group = "async", .k = K_ASYNC_DIRECT, .batched = 0},
        {.token = "async-single", .group = "async", .k = K_ASYNC, .batched = 0},
        {.token = "async", .group = "async", .k = K_ASYNC, .batched = 1},
        {.token = "remote-service",
         .group = "remote",
         .k = K_REMOTE,
         .batched = 0,
         .transport = TS_PREDICTOR_SERVICE},
        {.token = "remote-service",
         .group = "remote",
         .k = K_REMOTE,
         .batched = 1,
         .transport = TS_PREDICTOR_SERVICE},
        {.token = "remote-relay",
         .group = "relay",
         .k = K_REMOTE,
         .batched = 0,
         .transport = TS_PREDICTOR_RELAY},
        {.token = "remote-relay",
         .group = "relay",
         .k = K_REMOTE,
         .batched = 1,
         .transport = TS_PREDICTOR_RELAY},
        {.token = "remote-service",
         .group = "remote",
         .k = K_REMOTE_ASYNC,
         .batched = 1,
         .transport = TS_PREDICTOR_SERVICE},
        {.token = "remote-relay",
         .group = "relay",
         .k = K_REMOTE_ASYNC,
         .batched = 1,
         .transport = TS_PREDICTOR_RELAY},
    };
    const int n_cases = (int)(sizeof(cases) / sizeof(cases[0]));
    for (int i = 0; i < n_cases; i++) {
        mcase *c = &cases[i];
        if (c->k == K_REMOTE || c->k == K_REMOTE_ASYNC)
            c->on = serve != NULL && !failed &&
                    (o.modes == NULL || listed(o.modes, "remote") || listed(o.modes, c->token) ||
                     (c->k == K_REMOTE_ASYNC && listed(o.modes, "actors")));
        else
            c->on = o.modes == NULL || listed(o.modes, c->token);
    }

    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    printf("batcher_bench: %d requesters x %d single-row requests, model %s, placement %s, "
           "%ld CPUs, %d repeats\n",
           o.threads, o.requests, o.model, o.placement, cpus, o.repeats);
    printf("%-8s  %-22s  %6s  %9s  %7s  %8s  %8s  %10s\n", "requester", "batching", "repeat",
           "req/s", "cpu us", "p50 us", "p99 us", "rows/batch");
    for (int rep = 0; rep < o.repeats; rep++) {
        for (int j = 0; j < n_cases; j++) {
            mcase *c = &cases[rep % 2 == 0 ? j : n_cases - 1 - j];
            if (!c->on)
                continue;
            result r;
            if (measure(&o, proto, c, clients, serve, &r) != 0) {
                fprintf(stderr, "batcher_bench: %s: failures\n", c->token);
                failed = 1;
                continue;
            }
            c->r[c->n++] = r;
            char what[16];
            snprintf(what, sizeof(what), "#%d", rep + 1);
            print_row(&o, c, what, &r);
        }
    }
    printf("\nmedians over %d repeats\n", o.repeats);
    for (int i = 0; i < n_cases; i++) {
        if (cases[i].n > 0) {
            result m = medians(&cases[i]);
            print_row(&o, &cases[i], "median", &m);
        }
    }
    /* Each batched mode against its own unbatched references, then the async one against every
       unbatched in-process mode (a 64-thread program gets a bigger share of a busy machine). */
    const mcase *blocking_refs[] = {&cases[1], &cases[2]};
    const mcase *async_refs[] = {&cases[4], &cases[5]};
    const mcase *all_refs[] = {&cases[1], &cases[2], &cases[4], &cases[5]};
    const mcase *remote_refs[] = {&cases[7]};
    const mcase *relay_refs[] = {&cases[9]};
    print_ratio("blocking", "blocking mode", &cases[3], blocking_refs, 2);
    print_ratio("async", "async mode", &cases[6], async_refs, 2);
    print_ratio("async", "in-process mode", &cases[6], all_refs, 4);
    print_ratio("remote", "remote mode", &cases[8], remote_refs, 1);
    print_ratio("relay", "relay mode", &cases[10], relay_refs, 1);
    /* The service against the relay, each row against its own, measured in the same run. */
    for (int i = 0; i < 3; i++) {
        const mcase *svc = i < 2 ? &cases[7 + i] : &cases[11];
        const mcase *rel = i < 2 ? &cases[9 + i] : &cases[12];
        if (svc->n == 0 || rel->n == 0)
            continue;
        result ms = medians(svc), mr = medians(rel);
        printf("remote    %-22s  service %.0f req/s = %.2fx the relay through bins (%.0f "
               "req/s); CPU per request %.1f vs %.1f us; p50 %.0f vs %.0f us\n",
               i == 0   ? "one forward/request"
               : i == 1 ? "batched"
                        : "actors, batched",
               ms.rate, mr.rate > 0 ? ms.rate / mr.rate : 0.0, mr.rate, ms.cpu_us, mr.cpu_us,
               ms.p50_us, mr.p50_us);
    }
    /* Every batched mode against the limit row: the same replicas with no batcher. */
    if (cases[0].n > 0) {
        double limit = medians(&cases[0]).rate;
        const mcase *batched[] = {&cases[3],  &cases[6],  &cases[8],
                                  &cases[10], &cases[11], &cases[12]};
        for (int i = 0; i < 6; i++) {
            if (batched[i]->n == 0)
                continue;
            result m = medians(batched[i]);
            printf("%-8s  batched %.0f req/s = %.2fx the limit (%.0f rows/s, full %d-row "
                   "forwards on %s)\n",
                   batched[i]->group, m.rate, limit > 0 ? m.rate / limit : 0.0, limit, o.max_batch,
                   o.placement);
        }
    }

    for (int i = 0; i < o.clients; i++)
        ts_client_free(clients[i]);
    ts_client_free(serve);
    if (td > 0) {
        kill(td, SIGTERM);
        waitpid(td, NULL, 0);
        char port_file[600];
        snprintf(port_file, sizeof(port_file), "%s/port", dir);
        unlink(port_file);
        rmdir(dir);
    }
    ts_torch_model_free(proto);
    if (mlp_dir[0] != '\0') {
        unlink(model_buf);
        rmdir(mlp_dir);
    }
    return failed ? 1 : 0;
}
