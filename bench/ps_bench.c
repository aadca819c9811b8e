/*
 * ps_bench: the parameter server's three figures (docs/PS.md), each against the same bytes moved
 * by plain PUT and PEEK, in one run on one tensord it starts itself (unix socket):
 *   dense  W workers (threads, a client each) each push a gradient of F floats into one SUM
 *          parameter and pull it, per step; against W workers each PUTting F floats to a bin of
 *          its own and PEEKing it (the socket ceiling of the same transfers)
 *   rows   pulls of K random rows of a [N, D] table (made lazily; the first pulls make rows, so
 *          the table is warmed first) against PEEK of a bin holding K x D floats
 *   ping   PING latency (p50, p99) on its own connection while a SUM parameter of M floats is
 *          pushed to back to back, and without the pushes
 *   --snapshot R  instead of the three: the cost of a snapshot of an Adam table of R rows of D
 *          floats (made by pushes) on a tensord started with --save: the loop time of its
 *          capture (STATS snapshot_loop_us), the writer's time (snapshot_last_ms), how long SAVE
 *          took, the longest PING and the longest one-row EMB_PUSH meanwhile (pushes wait while
 *          the table is copied), three SAVEs with a push between them
 *   --shards S  instead of the three: pulls and pushes of K random rows of a [N, D] table on a
 *          cluster of S tensord (TCP, "--shard i/S", the rows spread by id) against the same on
 *          one tensord (TCP): what splitting the ids and asking the shards at once costs or saves
 * usage: ps_bench [--tensord PATH] [--workers W] [--floats F] [--steps S] [--rows K]
 *                 [--table N] [--dim D] [--pings P] [--big M] [--snapshot R] [--shards S]
 * Nothing here is a test: the figures are only meaningful as ratios taken in the same run.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "tensorshare/ps.h"
#include "tensorshare/tensorshare.h"

#ifndef TS_TENSORD_PATH
#define TS_TENSORD_PATH "tensord"
#endif

static struct {
    const char *tensord;
    int workers, steps, pings;
    long floats, rows, table, dim, big, snap, shards;
    char addr[300];
} g = {TS_TENSORD_PATH, 8, 20, 2000, 1L << 20, 65536, 10000000, 64, 16L << 20, 0, 0, ""};

/* shards the --shards run starts at most (a tensord each) */
#define PS_BENCH_MAX_SHARDS 8

static void die(const char *what, int rc)
{
    fprintf(stderr, "ps_bench: %s: %s (%s)\n", what, ts_strerror(rc), ts_last_error());
    exit(1);
}

static ts_client_t *open_client(void)
{
    ts_client_t *c = NULL;
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = 120000;
    int rc = ts_client_open(&c, g.addr, &o);
    if (rc != 0)
        die("open", rc);
    return c;
}

static void put_floats(ts_client_t *c, const char *name, float *d, int ndim, const int64_t *shape)
{
    ts_value_t *v = ts_tensor_new(TS_FLOAT32, ndim, shape, d, TS_BORROW);
    int rc = ts_put(c, name, v, NULL);
    ts_value_free(v);
    if (rc != 0)
        die("put", rc);
}

/* A worker of the dense case: mode 0 pushes and pulls the parameter, mode 1 puts and peeks. */
typedef struct worker {
    int index, mode;
    pthread_barrier_t *start;
} worker;

static void *dense_worker(void *arg)
{
    worker *w = arg;
    ts_client_t *c = open_client();
    float *g1 = malloc((size_t)g.floats * sizeof(float));
    for (long i = 0; i < g.floats; i++)
        g1[i] = 1.0f;
    ts_tensor_t t = {.data = g1, .dtype = TS_FLOAT32, .ndim = 1, .shape = {g.floats}};
    char bin[32];
    snprintf(bin, sizeof(bin), "plain%d", w->index);
    pthread_barrier_wait(w->start);
    for (int s = 0; s < g.steps; s++) {
        ts_items_t *items = NULL;
        int rc;
        if (w->mode == 0) {
            rc = ts_ps_push(c, "dense", &t, 0, 1.0, NULL);
            if (rc == 0)
                rc = ts_ps_pull(c, "dense", 0, &items, NULL);
        } else {
            put_floats(c, bin, g1, 1, t.shape);
            rc = ts_peek(c, bin, 1, &items);
        }
        if (rc != 0)
            die("dense step", rc);
        ts_items_free(items);
    }
    free(g1);
    ts_client_free(c);
    return NULL;
}

/* Seconds for g.steps steps of W workers in mode. */
static double dense_run(int mode)
{
    pthread_t th[64];
    worker w[64];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)g.workers + 1);
    for (int i = 0; i < g.workers; i++) {
        w[i] = (worker){i, mode, &start};
        pthread_create(&th[i], NULL, dense_worker, &w[i]);
    }
    pthread_barrier_wait(&start);
    double t0 = bench_now();
    for (int i = 0; i < g.workers; i++)
        pthread_join(th[i], NULL);
    double dt = bench_now() - t0;
    pthread_barrier_destroy(&start);
    return dt;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static volatile int pushing;

static void *big_pusher(void *arg)
{
    (void)arg;
    ts_client_t *c = open_client();
    float *d = malloc((size_t)g.big * sizeof(float));
    for (long i = 0; i < g.big; i++)
        d[i] = 1.0f;
    ts_tensor_t t = {.data = d, .dtype = TS_FLOAT32, .ndim = 1, .shape = {g.big}};
    while (pushing) {
        int rc = ts_ps_push(c, "big", &t, 0, 1.0, NULL);
        if (rc != 0)
            die("big push", rc);
    }
    free(d);
    ts_client_free(c);
    return NULL;
}

/* PING latencies (microseconds): p50 into *p50, p99 returned. */
static double ping_p99(ts_client_t *c, double *p50)
{
    double *lat = malloc((size_t)g.pings * sizeof(double));
    for (int i = 0; i < g.pings; i++) {
        double t0 = bench_now();
        int rc = ts_ping(c);
        if (rc != 0)
            die("ping", rc);
        lat[i] = (bench_now() - t0) * 1e6;
        usleep(500);
    }
    qsort(lat, (size_t)g.pings, sizeof(double), cmp_double);
    *p50 = lat[g.pings / 2];
    double p99 = lat[(size_t)((double)g.pings * 0.99)];
    free(lat);
    return p99;
}

/* The longest PING and one-row EMB_PUSH (ms) while snap_busy, each on its own client. */
static volatile int snap_busy;
static double snap_ping_max, snap_push_max;

static void *snap_pinger(void *arg)
{
    (void)arg;
    ts_client_t *c = open_client();
    while (snap_busy) {
        double t0 = bench_now();
        int rc = ts_ping(c);
        if (rc != 0)
            die("ping", rc);
        double ms = (bench_now() - t0) * 1e3;
        if (ms > snap_ping_max)
            snap_ping_max = ms;
        usleep(200);
    }
    ts_client_free(c);
    return NULL;
}

static void *snap_pusher(void *arg)
{
    (void)arg;
    ts_client_t *c = open_client();
    float *gr = calloc((size_t)g.dim, sizeof(float));
    int64_t id = 1;
    while (snap_busy) {
        double t0 = bench_now();
        int rc = ts_emb_push(c, "snapemb", &id, 1, (uint32_t)g.dim, gr, 1.0, NULL);
        if (rc != 0)
            die("emb push", rc);
        double ms = (bench_now() - t0) * 1e3;
        if (ms > snap_push_max)
            snap_push_max = ms;
        usleep(1000);
    }
    free(gr);
    ts_client_free(c);
    return NULL;
}

static long long stat_of(ts_client_t *c, const char *key)
{
    ts_value_t *v = NULL;
    int64_t x = -1;
    int rc = ts_stats(c, &v);
    if (rc != 0)
        die("stats", rc);
    (void)ts_map_get_int(v, key, &x);
    ts_value_free(v);
    return (long long)x;
}

/* --snapshot: a tensord with --save, an Adam table of g.snap rows, three timed SAVEs. */
static int snapshot_run(void)
{
    char dir[] = "/tmp/ps_bench.XXXXXX";
    if (mkdtemp(dir) == NULL)
        return 1;
    char sock[200], save[200], log[200];
    snprintf(sock, sizeof(sock), "%s/t.sock", dir);
    snprintf(save, sizeof(save), "%s/snap", dir);
    snprintf(log, sizeof(log), "%s/tensord.log", dir);
    char *argv[] = {(char *)g.tensord, "--port", "0",           "--unix", sock, "--save", save,
                    "--save-interval", "0",      "--log-level", "warn",   NULL};
    pid_t pid = bench_spawn(argv, 0, log);
    if (pid < 0 || bench_wait_listening(0, sock, BENCH_START_S) != 0) {
        fprintf(stderr, "ps_bench: tensord did not start; see %s\n", log);
        bench_stop(pid);
        return 1;
    }
    snprintf(g.addr, sizeof(g.addr), "unix:%s", sock);
    bench_print_machine();
    ts_client_t *c = open_client();
    ts_emb_options_t e;
    ts_emb_options_init(&e, (uint32_t)g.dim);
    e.optimizer = TS_PS_ADAM;
    int rc = ts_emb_create(c, "snapemb", &e);
    if (rc != 0)
        die("emb create", rc);
    /* Every row made and given Adam state, a chunk of ids per push. */
    const long chunk = 65536;
    int64_t *ids = malloc((size_t)chunk * sizeof(int64_t));
    float *gr = malloc((size_t)chunk * (size_t)g.dim * sizeof(float));
    for (long i = 0; i < chunk * g.dim; i++)
        gr[i] = 0.01f * (float)(i % 7);
    double t0 = bench_now();
    for (long first = 0; first < g.snap; first += chunk) {
        long n = g.snap - first < chunk ? g.snap - first : chunk;
        for (long i = 0; i < n; i++)
            ids[i] = first + i;
        rc = ts_emb_push(c, "snapemb", ids, (size_t)n, (uint32_t)g.dim, gr, 1.0, NULL);
        if (rc != 0)
            die("emb push", rc);
    }
    printf("snapshot: an Adam table of %ld rows x %ld floats (%.0f MiB of rows and slots) made "
           "in %.1f s\n",
           g.snap, g.dim, (double)g.snap * (double)g.dim * 12 / 1048576, bench_now() - t0);
    for (int r = 0; r < 3; r++) {
        int64_t one = 2;
        if ((rc = ts_emb_push(c, "snapemb", &one, 1, (uint32_t)g.dim, gr, 1.0, NULL)) != 0)
            die("emb push", rc);
        snap_busy = 1;
        snap_ping_max = snap_push_max = 0;
        pthread_t tp, tq;
        pthread_create(&tp, NULL, snap_pinger, NULL);
        pthread_create(&tq, NULL, snap_pusher, NULL);
        usleep(100000);
        t0 = bench_now();
        if ((rc = ts_save(c)) != 0)
            die("save", rc);
        double save_ms = (bench_now() - t0) * 1e3;
        usleep(100000);
        snap_busy = 0;
        pthread_join(tp, NULL);
        pthread_join(tq, NULL);
        printf("snapshot %d: loop %lld us (snapshot_loop_us), writer %lld ms (snapshot_last_ms), "
               "SAVE answered in %.0f ms; longest PING meanwhile %.1f ms, longest one-row "
               "EMB_PUSH %.0f ms\n",
               r + 1, stat_of(c, "snapshot_loop_us"), stat_of(c, "snapshot_last_ms"), save_ms,
               snap_ping_max, snap_push_max);
    }
    free(ids);
    free(gr);
    ts_client_free(c);
    bench_stop(pid);
    unlink(save);
    char p[320];
    snprintf(p, sizeof(p), "%s.lock", save);
    unlink(p);
    unlink(log);
    rmdir(dir);
    return 0;
}

/* Start tensord on a free TCP port with the extra arguments a (NULL-terminated); its pid. */
static pid_t start_tcp(const char *dir, const char *tag, const char *const *a, int *port)
{
    char ps[16], log[300];
    *port = bench_free_port();
    snprintf(ps, sizeof(ps), "%d", *port);
    snprintf(log, sizeof(log), "%s/%s.log", dir, tag);
    char *argv[16] = {(char *)g.tensord, "--port", ps, "--log-level", "warn"};
    int n = 5;
    for (; a != NULL && *a != NULL && n < 15; a++)
        argv[n++] = (char *)*a;
    argv[n] = NULL;
    pid_t pid = bench_spawn(argv, 0, log);
    if (pid < 0 || bench_wait_listening(*port, NULL, BENCH_START_S) != 0) {
        fprintf(stderr, "ps_bench: tensord did not start; see %s\n", log);
        bench_stop(pid);
        return -1;
    }
    return pid;
}

/* Mean seconds of reps pulls (push 0) or pushes of g.rows random rows on c, the table warmed. */
static double rows_time(ts_client_t *c, int push, int reps)
{
    int64_t *ids = malloc((size_t)g.rows * sizeof(int64_t));
    float *buf = malloc((size_t)g.rows * (size_t)g.dim * sizeof(float));
    for (long i = 0; i < g.rows * g.dim; i++)
        buf[i] = 0.001f * (float)(i % 5);
    uint64_t seed = 88172645463325252ull;
    double total = 0;
    int rc;
    for (int r = 0; r < reps + 1; r++) {
        for (long i = 0; i < g.rows; i++) {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ids[i] = (int64_t)(seed % (uint64_t)g.table);
        }
        /* Make the rows first: the steady state of a trained table. */
        if ((rc = ts_emb_pull(c, "emb", ids, (size_t)g.rows, (uint32_t)g.dim, buf, NULL)) != 0)
            die("emb pull", rc);
        double t0 = bench_now();
        rc = push ? ts_emb_push(c, "emb", ids, (size_t)g.rows, (uint32_t)g.dim, buf, 1.0, NULL)
                  : ts_emb_pull(c, "emb", ids, (size_t)g.rows, (uint32_t)g.dim, buf, NULL);
        if (rc != 0)
            die(push ? "emb push" : "emb pull", rc);
        if (r > 0)
            total += bench_now() - t0;
    }
    free(ids);
    free(buf);
    return total / reps;
}

static int shards_run(void)
{
    if (g.shards < 1 || g.shards > PS_BENCH_MAX_SHARDS) {
        fprintf(stderr, "ps_bench: 1 to %d shards\n", PS_BENCH_MAX_SHARDS);
        return 2;
    }
    char dir[] = "/tmp/ps_bench.XXXXXX";
    if (mkdtemp(dir) == NULL)
        return 1;
    pid_t pids[PS_BENCH_MAX_SHARDS + 1];
    int n = 0, port, ok = 1;
    char list[PS_BENCH_MAX_SHARDS * 24] = "", one[32] = "";
    for (long i = 0; i < g.shards && ok; i++) {
        char spec[48], tag[32];
        snprintf(spec, sizeof(spec), "%ld/%ld", i, g.shards);
        snprintf(tag, sizeof(tag), "shard%ld", i);
        const char *a[] = {"--shard", spec, NULL};
        pids[n] = start_tcp(dir, tag, a, &port);
        ok = pids[n] > 0;
        n += ok;
        size_t l = strlen(list);
        snprintf(list + l, sizeof(list) - l, "%s127.0.0.1:%d", i > 0 ? "," : "", port);
    }
    if (ok) {
        pids[n] = start_tcp(dir, "one", NULL, &port);
        ok = pids[n] > 0;
        n += ok;
        snprintf(one, sizeof(one), "127.0.0.1:%d", port);
    }
    if (!ok) {
        for (int i = 0; i < n; i++)
            bench_stop(pids[i]);
        return 1;
    }
    bench_print_machine();
    double t[2][2];
    const char *addrs[2] = {one, list};
    for (int k = 0; k < 2; k++) {
        snprintf(g.addr, sizeof(g.addr), "%s", addrs[k]);
        ts_client_t *c = open_client();
        ts_emb_options_t e;
        ts_emb_options_init(&e, (uint32_t)g.dim);
        e.num_ids = (uint64_t)g.table;
        int rc = ts_emb_create(c, "emb", &e);
        if (rc != 0)
            die("emb create", rc);
        t[k][0] = rows_time(c, 0, 5);
        t[k][1] = rows_time(c, 1, 5);
        ts_client_free(c);
    }
    printf("rows on %ld shards (TCP): pull of %ld random rows of [%ld, %ld]: %.2f ms (one "
           "tensord: %.2f ms, %.2fx); push of as many row gradients (SGD): %.2f ms (one tensord: "
           "%.2f ms, %.2fx)\n",
           g.shards, g.rows, g.table, g.dim, t[1][0] * 1e3, t[0][0] * 1e3, t[1][0] / t[0][0],
           t[1][1] * 1e3, t[0][1] * 1e3, t[1][1] / t[0][1]);
    for (int i = 0; i < n; i++)
        bench_stop(pids[i]);
    for (long i = 0; i <= g.shards; i++) {
        char log[300];
        if (i < g.shards)
            snprintf(log, sizeof(log), "%s/shard%ld.log", dir, i);
        else
            snprintf(log, sizeof(log), "%s/one.log", dir);
        unlink(log);
    }
    rmdir(dir);
    return 0;
}

int main(int argc, char **argv)
{
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *f = argv[i], *v = argv[i + 1];
        if (strcmp(f, "--tensord") == 0)
            g.tensord = v;
        else if (strcmp(f, "--workers") == 0)
            g.workers = (int)strtol(v, NULL, 10);
        else if (strcmp(f, "--floats") == 0)
            g.floats = strtol(v, NULL, 10);
        else if (strcmp(f, "--steps") == 0)
            g.steps = (int)strtol(v, NULL, 10);
        else if (strcmp(f, "--rows") == 0)
            g.rows = strtol(v, NULL, 10);
        else if (strcmp(f, "--table") == 0)
            g.table = strtol(v, NULL, 10);
        else if (strcmp(f, "--dim") == 0)
            g.dim = strtol(v, NULL, 10);
        else if (strcmp(f, "--pings") == 0)
            g.pings = (int)strtol(v, NULL, 10);
        else if (strcmp(f, "--big") == 0)
            g.big = strtol(v, NULL, 10);
        else if (strcmp(f, "--snapshot") == 0)
            g.snap = strtol(v, NULL, 10);
        else if (strcmp(f, "--shards") == 0)
            g.shards = strtol(v, NULL, 10);
        else {
            fprintf(stderr, "ps_bench: unknown flag %s\n", f);
            return 2;
        }
    }
    if (g.workers < 1 || g.workers > 64 || g.steps < 1 || g.pings < 100) {
        fprintf(stderr, "ps_bench: 1 to 64 workers, 1 step and 100 pings at least\n");
        return 2;
    }
    if (g.snap > 0)
        return snapshot_run();
    if (g.shards > 0)
        return shards_run();
    char dir[] = "/tmp/ps_bench.XXXXXX";
    if (mkdtemp(dir) == NULL)
        return 1;
    bench_target t;
    pid_t pid = bench_start_tensord("ps_bench", g.tensord, dir, "tensord", 1, &t);
    if (pid < 0)
        return 1;
    snprintf(g.addr, sizeof(g.addr), "unix:%s", t.unix_path);
    bench_print_machine();
    ts_client_t *c = open_client();

    /* dense */
    float *zero = calloc((size_t)g.floats, sizeof(float));
    int64_t shape[2] = {g.floats, 0};
    put_floats(c, "dense", zero, 1, shape);
    ts_ps_options_t o;
    ts_ps_options_init(&o);
    o.optimizer = TS_PS_SUM;
    int rc = ts_ps_create(c, "dense", &o, NULL);
    if (rc != 0)
        die("create", rc);
    double mb = (double)g.floats * 4 * 2 * g.workers * g.steps / 1e6;
    double ps_s = dense_run(0), plain_s = dense_run(1);
    printf("dense: %d workers x %d steps, push %ld floats + pull: %.1f steps/s, %.0f MB/s; "
           "plain put+peek of the same bytes: %.1f steps/s, %.0f MB/s; the parameter server at "
           "%.2fx the plain rate\n",
           g.workers, g.steps, g.floats, g.workers * g.steps / ps_s, mb / ps_s,
           g.workers * g.steps / plain_s, mb / plain_s, plain_s / ps_s);
    free(zero);

    /* rows */
    ts_emb_options_t e;
    ts_emb_options_init(&e, (uint32_t)g.dim);
    e.num_ids = (uint64_t)g.table;
    if ((rc = ts_emb_create(c, "emb", &e)) != 0)
        die("emb create", rc);
    int64_t *ids = malloc((size_t)g.rows * sizeof(int64_t));
    float *out = malloc((size_t)g.rows * (size_t)g.dim * sizeof(float));
    uint64_t seed = 88172645463325252ull;
    int reps = 5;
    double emb_s = 0, peek_s = 0;
    for (int r = 0; r < reps + 1; r++) {
        for (long i = 0; i < g.rows; i++) {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ids[i] = (int64_t)(seed % (uint64_t)g.table);
        }
        /* Once to make the rows, then timed: the steady state of a trained table. */
        if ((rc = ts_emb_pull(c, "emb", ids, (size_t)g.rows, (uint32_t)g.dim, out, NULL)) != 0)
            die("emb pull", rc);
        double t0 = bench_now();
        if ((rc = ts_emb_pull(c, "emb", ids, (size_t)g.rows, (uint32_t)g.dim, out, NULL)) != 0)
            die("emb pull", rc);
        if (r > 0)
            emb_s += bench_now() - t0;
    }
    int64_t rshape[2] = {g.rows, g.dim};
    put_floats(c, "rows_plain", out, 2, rshape);
    for (int r = 0; r < reps + 1; r++) {
        ts_items_t *items = NULL;
        double t0 = bench_now();
        if ((rc = ts_peek(c, "rows_plain", 1, &items)) != 0)
            die("peek", rc);
        memcpy(out, ts_value_tensor(ts_items_at(items, 0))->data,
               (size_t)g.rows * (size_t)g.dim * sizeof(float));
        if (r > 0)
            peek_s += bench_now() - t0;
        ts_items_free(items);
    }
    printf("rows: pull %ld random rows of [%ld, %ld]: %.2f ms; peek of the same %.1f MB: %.2f ms; "
           "%.2fx the peek's time\n",
           g.rows, g.table, g.dim, emb_s / reps * 1e3, (double)g.rows * (double)g.dim * 4 / 1e6,
           peek_s / reps * 1e3, emb_s / peek_s);
    free(ids);
    free(out);

    /* ping under accumulation */
    float *bz = calloc((size_t)g.big, sizeof(float));
    int64_t bshape[1] = {g.big};
    put_floats(c, "big", bz, 1, bshape);
    free(bz);
    if ((rc = ts_ps_create(c, "big", &o, NULL)) != 0)
        die("create big", rc);
    double q50, q99 = ping_p99(c, &q50);
    pushing = 1;
    pthread_t th;
    pthread_create(&th, NULL, big_pusher, NULL);
    usleep(200000);
    double b50, b99 = ping_p99(c, &b50);
    pushing = 0;
    pthread_join(th, NULL);
    printf("ping: quiet p50 %.0f us, p99 %.0f us; while %ld-float (%.0f MiB) SUM pushes are "
           "applied back to back: p50 %.0f us, p99 %.0f us\n",
           q50, q99, g.big, (double)g.big * 4 / 1048576, b50, b99);
    ts_client_free(c);
    bench_stop(pid);
    return 0;
}
