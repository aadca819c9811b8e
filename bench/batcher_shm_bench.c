/*
 * batcher_shm_bench: requesters in other processes on the same host, through the batcher's
 * shared-memory slots against the relay through tensord bins, measured in the same run.
 *
 *   batcher_shm_bench --tensord PATH [--model mlp.pt] [--procs 8] [--requests 2000]
 *                     [--repeats 3] [--max-batch 64] [--placement cpu:1] [--pin]
 *                     [--modes shm,relay]
 *
 * The serving process loads the model (tests/shim's mlp.pt, 8 -> 32 -> 4 float32, as
 * batcher_bench; TS_MODELS_DIR/mlp.pt by default), starts a private tensord, and serves one
 * batcher both ways (ts_batcher_serve and ts_batcher_serve_shm). --procs requester processes,
 * forked before any thread starts, each hold two predictors: one that took a slot and one
 * forced to relay. Each round runs both modes, in alternating order (shm first in odd rounds),
 * every requester in a closed loop of single-row blocking predictions, each answer checked
 * against the model's own answer for that row. The rate is all requests over the wall time
 * from the start command to the last requester's end; CPU per request counts the serving
 * process, the requesters and tensord. Medians over the rounds and their ratio are printed.
 * --pin puts the serving process and tensord on cpu0 and the requesters on cpu1, as
 * bench/run.sh pins batcher_bench.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tensorshare/batcher.h"
#include "tensorshare/tensorshare.h"
#include "tensorshare/torch.h"

#define N_ROWS      16     /* distinct request rows */
#define IN_COLS     8      /* mlp.pt's input width */
#define OUT_COLS    4      /* and output width */
#define MAX_PROCS   64     /* requester processes at most */
#define MAX_REPEATS 32     /* rounds at most */
#define WAIT_MS     120000 /* ms; a round's longest wait for a requester */
#define PREDICT_MS  30000  /* ms; each prediction's deadline */

static float g_rows[N_ROWS][IN_COLS];
static float g_ref[N_ROWS][OUT_COLS];

typedef struct cmd {
    char mode; /* 's' slots, 'r' relay, 'q' quit */
    int requests;
    float ref[N_ROWS][OUT_COLS]; /* the model's answers (first command) */
} cmd;

typedef struct report {
    int ok;
    int done;
    uint64_t cpu_ns;
} report;

typedef struct proc {
    pid_t pid;
    int to, from;
} proc;

static uint64_t clock_ns(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void pin(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    (void)sched_setaffinity(0, sizeof(set), &set);
}

static int io_all(int fd, void *buf, size_t len, int writing)
{
    char *p = buf;
    while (len > 0) {
        ssize_t n = writing ? write(fd, p, len) : read(fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int answer_ok(const ts_value_t *out, int row)
{
    const ts_tensor_t *t = ts_value_tensor(out);
    if (t == NULL || t->dtype != TS_FLOAT32 || t->ndim != 2 || t->shape[0] != 1 ||
        t->shape[1] != OUT_COLS)
        return 0;
    for (int k = 0; k < OUT_COLS; k++) {
        float a = ((const float *)t->data)[k], e = g_ref[row][k];
        float d = a > e ? a - e : e - a, m = e < 0 ? -e : e;
        if (d > 1e-5f + 1e-4f * m)
            return 0;
    }
    return 1;
}

/* A requester process: serves commands until 'q' or end of file. */
static int requester(const char *addr, int index, int in, int out)
{
    ts_client_t *c = NULL;
    ts_predictor_t *shm = NULL, *relay = NULL;
    for (;;) {
        cmd k;
        if (io_all(in, &k, sizeof(k), 0) != 0 || k.mode == 'q')
            break;
        if (c == NULL) {
            memcpy(g_ref, k.ref, sizeof(g_ref));
            ts_predictor_options_t po;
            ts_predictor_options_init(&po);
            po.transport = TS_PREDICTOR_SHM;
            int rc = ts_client_open(&c, addr, NULL);
            if (rc == 0)
                rc = ts_predictor_open_with(&shm, c, "bench", &po);
            po.transport = TS_PREDICTOR_RELAY;
            if (rc == 0)
                rc = ts_predictor_open_with(&relay, c, "bench", &po);
            if (rc != 0) {
                fprintf(stderr, "requester %d: %s (%s)\n", index, ts_err_name(rc), ts_last_error());
                return 1;
            }
        }
        ts_predictor_t *p = k.mode == 's' ? shm : relay;
        report r = {1, 0, 0};
        uint64_t cpu0 = clock_ns(CLOCK_PROCESS_CPUTIME_ID);
        for (int i = 0; i < k.requests && r.ok; i++) {
            int row = (index + i) % N_ROWS;
            int64_t shape[2] = {1, IN_COLS};
            ts_value_t *x = ts_tensor_new(TS_FLOAT32, 2, shape, g_rows[row], TS_BORROW);
            ts_value_t *y = NULL;
            int rc = ts_predictor_predict(p, x, PREDICT_MS, &y, NULL);
            if (rc != 0 || !answer_ok(y, row)) {
                fprintf(stderr, "requester %d: %s (%s)\n", index, ts_err_name(rc),
                        rc != 0 ? ts_last_error() : "wrong answer");
                r.ok = 0;
            } else {
                r.done++;
            }
            ts_value_free(y);
            ts_value_free(x);
        }
        r.cpu_ns = clock_ns(CLOCK_PROCESS_CPUTIME_ID) - cpu0;
        if (k.mode == 's') {
            ts_predictor_stats_t st;
            ts_predictor_stats(shm, &st);
            if (st.relayed != 0 || st.transport != TS_PREDICTOR_SHM) {
                fprintf(stderr, "requester %d: the slot was not used\n", index);
                r.ok = 0;
            }
        }
        if (io_all(out, &r, sizeof(r), 1) != 0)
            break;
    }
    ts_predictor_free(shm);
    ts_predictor_free(relay);
    ts_client_free(c);
    return 0;
}

static pid_t spawn_tensord(const char *exe, char *dir, size_t dirlen, char *addr, size_t alen)
{
    snprintf(dir, dirlen, "/tmp/tsshmbench.XXXXXX");
    if (mkdtemp(dir) == NULL)
        return -1;
    char port_file[600];
    snprintf(port_file, sizeof(port_file), "%s/port", dir);
    pid_t pid = fork();
    if (pid == 0) {
        execl(exe, exe, "--port", "0", "--port-file", port_file, (char *)NULL);
        _exit(127);
    }
    for (int i = 0; pid > 0 && i < 1000; i++) {
        FILE *f = fopen(port_file, "r");
        int port = 0;
        if (f != NULL) {
            if (fscanf(f, "%d", &port) != 1)
                port = 0;
            fclose(f);
        }
        if (port > 0) {
            snprintf(addr, alen, "127.0.0.1:%d", port);
            return pid;
        }
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    return -1;
}

/* A process's user + system CPU from /proc/PID/stat, in ns (0 when unreadable). */
static uint64_t proc_cpu_ns(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')');
    unsigned long ut = 0, st = 0;
    /* After the name: state and 10 fields, then utime and stime (fields 14 and 15). */
    if (p == NULL ||
        sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
        return 0;
    return (uint64_t)(ut + st) * (1000000000u / (uint64_t)sysconf(_SC_CLK_TCK));
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static int parse_int(const char *s, int lo, int hi, int *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || v < lo || v > hi)
        return -1;
    *out = (int)v;
    return 0;
}

int main(int argc, char **argv)
{
    const char *tensord = NULL, *model = NULL, *placement = "cpu:1";
    int procs = 8, requests = 2000, repeats = 3, max_batch = 64, do_pin = 0;
    const char *modes = "shm,relay";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (strcmp(a, "--pin") == 0) {
            do_pin = 1;
            continue;
        }
        if (v == NULL)
            bad = 1;
        else if (strcmp(a, "--tensord") == 0)
            tensord = v;
        else if (strcmp(a, "--model") == 0)
            model = v;
        else if (strcmp(a, "--placement") == 0)
            placement = v;
        else if (strcmp(a, "--modes") == 0)
            modes = v;
        else if (strcmp(a, "--procs") == 0)
            bad = parse_int(v, 1, MAX_PROCS, &procs);
        else if (strcmp(a, "--requests") == 0)
            bad = parse_int(v, 1, 100000000, &requests);
        else if (strcmp(a, "--repeats") == 0)
            bad = parse_int(v, 1, MAX_REPEATS, &repeats);
        else if (strcmp(a, "--max-batch") == 0)
            bad = parse_int(v, 1, 65536, &max_batch);
        else
            bad = 1;
        if (bad) {
            fprintf(stderr, "usage: batcher_shm_bench --tensord PATH [--model mlp.pt] [--procs 8] "
                            "[--requests 2000] [--repeats 3] [--max-batch 64] [--placement cpu:1] "
                            "[--pin] [--modes shm,relay]\n");
            return 2;
        }
        i++;
    }
    char model_buf[600];
    if (model == NULL) {
        const char *dir = getenv("TS_MODELS_DIR");
        snprintf(model_buf, sizeof(model_buf), "%s/mlp.pt", dir != NULL ? dir : "/tmp/models");
        model = model_buf;
    }
    if (tensord == NULL) {
        fprintf(stderr, "batcher_shm_bench: --tensord PATH is required\n");
        return 2;
    }
    for (int i = 0; i < N_ROWS; i++)
        for (int k = 0; k < IN_COLS; k++)
            g_rows[i][k] = (float)i * 0.1f + (float)k * 0.01f;
    if (do_pin)
        pin(0);
    char dir[512], addr[64];
    pid_t td = spawn_tensord(tensord, dir, sizeof(dir), addr, sizeof(addr));
    if (td < 0) {
        fprintf(stderr, "batcher_shm_bench: could not start %s\n", tensord);
        return 1;
    }
    /* The requesters, before this process starts any thread. */
    proc pr[MAX_PROCS];
    for (int i = 0; i < procs; i++) {
        int down[2], up[2];
        if (pipe(down) != 0 || pipe(up) != 0)
            return 1;
        fflush(NULL);
        pr[i].pid = fork();
        if (pr[i].pid == 0) {
            close(down[1]);
            close(up[0]);
            if (do_pin)
                pin(1);
            _exit(requester(addr, i, down[0], up[1]));
        }
        close(down[0]);
        close(up[1]);
        pr[i].to = down[1];
        pr[i].from = up[0];
    }
    int rc = 1;
    ts_torch_model_t *m = NULL;
    ts_client_t *sc = NULL;
    ts_batcher_t *b = NULL;
    ts_torch_set_num_threads(1);
    if (ts_torch_load_file(&m, model, "cpu") != 0) {
        fprintf(stderr, "batcher_shm_bench: %s: %s\n", model, ts_last_error());
        goto out;
    }
    cmd k;
    memset(&k, 0, sizeof(k));
    for (int i = 0; i < N_ROWS; i++) {
        int64_t shape[2] = {1, IN_COLS};
        ts_value_t *x = ts_tensor_new(TS_FLOAT32, 2, shape, g_rows[i], TS_BORROW), *y = NULL;
        if (ts_torch_forward(m, x, &y) != 0 || ts_value_tensor(y) == NULL) {
            fprintf(stderr, "batcher_shm_bench: forward: %s\n", ts_last_error());
            goto out;
        }
        memcpy(k.ref[i], ts_value_tensor(y)->data, sizeof(k.ref[i]));
        ts_value_free(x);
        ts_value_free(y);
    }
    static const ts_field_t in_schema[] = {{"", TS_FLOAT32, 1, {IN_COLS}}};
    static const ts_field_t out_schema[] = {{"", TS_FLOAT32, 1, {OUT_COLS}}};
    ts_batcher_options_t bo;
    ts_batcher_options_init(&bo);
    bo.inputs = in_schema;
    bo.n_inputs = 1;
    bo.outputs = out_schema;
    bo.n_outputs = 1;
    bo.max_batch = max_batch;
    bo.placement = placement;
    bo.create = ts_torch_model_create;
    bo.create_arg = m;
    ts_batcher_shm_options_t so;
    ts_batcher_shm_options_init(&so);
    so.slots = procs;
    if (ts_client_open(&sc, addr, NULL) != 0 || ts_batcher_new(&b, &bo) != 0 ||
        ts_batcher_serve(b, sc, "bench") != 0 || ts_batcher_serve_shm(b, sc, "bench", &so) != 0) {
        fprintf(stderr, "batcher_shm_bench: serving: %s\n", ts_last_error());
        goto out;
    }
    printf("batcher_shm_bench: %d requester processes x %d single-row requests, model %s, "
           "placement %s, max batch %d%s\n",
           procs, requests, model, placement, max_batch, do_pin ? ", pinned" : "");
    printf("| round | mode | req/s | cpu us/req (server + requesters + tensord) | rows/forward |\n"
           "|---|---|---|---|---|\n");
    double rate[2][MAX_REPEATS], cpu[2][MAX_REPEATS];
    /* A short warm-up of both paths (connections, slots, the replicas' first forwards). */
    for (int w = 0; w < 2; w++) {
        cmd wk = k;
        wk.mode = w == 0 ? 's' : 'r';
        wk.requests = 20;
        for (int i = 0; i < procs; i++)
            io_all(pr[i].to, &wk, sizeof(wk), 1);
        for (int i = 0; i < procs; i++) {
            report r;
            if (io_all(pr[i].from, &r, sizeof(r), 0) != 0 || !r.ok)
                goto out;
        }
    }
    for (int round = 0; round < repeats; round++) {
        for (int j = 0; j < 2; j++) {
            int mi = (round % 2 == 0) ? j : 1 - j; /* 0 slots, 1 relay */
            if (strstr(modes, mi == 0 ? "shm" : "relay") == NULL) {
                rate[mi][round] = cpu[mi][round] = 0;
                continue;
            }
            cmd rk = k;
            rk.mode = mi == 0 ? 's' : 'r';
            rk.requests = requests;
            ts_batcher_stats_t s0, s1;
            ts_batcher_stats(b, &s0);
            uint64_t t0 = clock_ns(CLOCK_MONOTONIC), c0 = clock_ns(CLOCK_PROCESS_CPUTIME_ID);
            uint64_t d0 = proc_cpu_ns(td);
            for (int i = 0; i < procs; i++)
                io_all(pr[i].to, &rk, sizeof(rk), 1);
            uint64_t child_cpu = 0;
            for (int i = 0; i < procs; i++) {
                report r;
                struct pollfd pf = {pr[i].from, POLLIN, 0};
                if (poll(&pf, 1, WAIT_MS) != 1 || io_all(pr[i].from, &r, sizeof(r), 0) != 0 ||
                    !r.ok) {
                    fprintf(stderr, "batcher_shm_bench: requester %d failed\n", i);
                    goto out;
                }
                child_cpu += r.cpu_ns;
            }
            uint64_t wall = clock_ns(CLOCK_MONOTONIC) - t0;
            uint64_t own = clock_ns(CLOCK_PROCESS_CPUTIME_ID) - c0, dcpu = proc_cpu_ns(td) - d0;
            ts_batcher_stats(b, &s1);
            double n = (double)procs * requests;
            rate[mi][round] = n / ((double)wall / 1e9);
            cpu[mi][round] = (double)(own + child_cpu + dcpu) / 1e3 / n;
            uint64_t fw = s1.batches - s0.batches;
            printf("| %d | %s | %.0f | %.1f (%.1f + %.1f + %.1f) | %.1f |\n", round + 1,
                   mi == 0 ? "shm" : "relay", rate[mi][round], cpu[mi][round],
                   (double)own / 1e3 / n, (double)child_cpu / 1e3 / n, (double)dcpu / 1e3 / n,
                   fw > 0 ? (double)(s1.rows - s0.rows) / (double)fw : 0.0);
            fflush(stdout);
        }
    }
    double rs = median(rate[0], repeats), rr = median(rate[1], repeats);
    double cs = median(cpu[0], repeats), cr = median(cpu[1], repeats);
    printf("\nmedians over %d rounds: shm %.0f req/s (%.1f us CPU/req), relay %.0f req/s "
           "(%.1f us CPU/req): shm / relay = %.1fx rate, %.1fx less CPU per request\n",
           repeats, rs, cs, rr, cr, rr > 0 ? rs / rr : 0.0, cs > 0 ? cr / cs : 0.0);
    rc = 0;
out:
    for (int i = 0; i < procs; i++) {
        cmd q;
        memset(&q, 0, sizeof(q));
        q.mode = 'q';
        io_all(pr[i].to, &q, sizeof(q), 1);
        close(pr[i].to);
    }
    for (int i = 0; i < procs; i++) {
        int st;
        waitpid(pr[i].pid, &st, 0);
        close(pr[i].from);
    }
    ts_batcher_free(b);
    ts_client_free(sc);
    ts_torch_model_free(m);
    kill(td, SIGTERM);
    waitpid(td, NULL, 0);
    char pf[600];
    snprintf(pf, sizeof(pf), "%s/port", dir);
    unlink(pf);
    rmdir(dir);
    return rc;
}
