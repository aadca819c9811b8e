/*
 * coord_bench: counter increments per second, tensord's ADD (through libtensorshare, ts_add)
 * against Redis INCR (a minimal RESP client on a plain socket), in one run. Both servers run
 * pinned to cpu0 and every client thread to cpu1 (--no-pin turns that off); each client thread
 * has its own connection and one request in flight (closed loop), so the figure is what a job
 * of C processes incrementing one counter sees. The systems alternate within each repeat and
 * the table shows medians. Nothing here is a test: the numbers are only meaningful as ratios
 * taken in the same run.
 *
 *   bench/run.sh coord [--repeats N] [--clients C] [--secs S] [--no-pin] [--smoke]
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench.h"
#include "tensorshare/coord.h"
#include "tensorshare/tensorshare.h"

/* Defaults: repeats of the alternation, client threads, seconds per measurement. */
#define COORD_REPEATS 5
#define COORD_CLIENTS 4
#define COORD_SECS    2.0
/* bytes; room for one Redis reply line (":<int64>\r\n") */
#define COORD_REPLY_CAP 64
/* at most this many client threads */
#define COORD_MAX_CLIENTS 64

static struct {
    const char *tensord, *redis;
    char dir[128];
    int repeats, clients;
    double secs;
} g;

typedef struct server {
    pid_t pid;
    bench_target t;
} server;

typedef struct worker {
    int sys; /* 0 tensord, 1 redis */
    const bench_target *t;
    double secs;
    long ops;
    int failed;
} worker;

static atomic_int go;

static int start_tensord(server *s)
{
    s->pid = bench_start_tensord("coord_bench", g.tensord, g.dir, "tensord", 0, &s->t);
    return s->pid > 0 ? 0 : -1;
}

static int start_redis(server *s)
{
    s->pid = bench_start_redis("coord_bench", g.redis, g.dir, "redis", 0, &s->t);
    return s->pid > 0 ? 0 : -1;
}

/*
 * One Redis INCR round trip on fd: 0, or -1. The reply (":<n>\r\n") comes in one segment, read
 * with as few calls as it takes, as a real client's buffered reader would.
 */
static int redis_incr(int fd)
{
    static const char req[] = "*2\r\n$4\r\nINCR\r\n$3\r\nctr\r\n";
    if (bench_write_all(fd, req, sizeof(req) - 1, 0) != 0)
        return -1;
    char buf[COORD_REPLY_CAP];
    size_t n = 0;
    while (n < 2 || buf[n - 1] != '\n') {
        if (n >= sizeof(buf))
            return -1;
        ssize_t r = read(fd, buf + n, sizeof(buf) - n);
        if (r <= 0)
            return -1;
        n += (size_t)r;
    }
    return buf[0] == ':' ? 0 : -1;
}

static void *work(void *arg)
{
    worker *w = arg;
    bench_pin_self(1);
    ts_client_t *c = NULL;
    int fd = -1;
    char addr[64];
    if (w->sys == 0) {
        snprintf(addr, sizeof(addr), "127.0.0.1:%d", w->t->port);
        if (ts_client_open(&c, addr, NULL) != 0) {
            w->failed = 1;
            return NULL;
        }
    } else if ((fd = bench_connect_tcp(w->t->port)) < 0) {
        w->failed = 1;
        return NULL;
    }
    while (!atomic_load(&go))
        ;
    double end = bench_now() + w->secs;
    long ops = 0;
    while (bench_now() < end) {
        /* 16 operations between clock reads: the clock costs little next to a round trip. */
        for (int i = 0; i < 16; i++) {
            int rc = w->sys == 0 ? ts_add(c, "ctr", 1, NULL, NULL) : redis_incr(fd);
            if (rc != 0) {
                w->failed = 1;
                goto out;
            }
            ops++;
        }
    }
out:
    w->ops = ops;
    if (c != NULL)
        ts_client_free(c);
    if (fd >= 0)
        close(fd);
    return NULL;
}

/* Increments per second of g.clients threads against t (sys 0 tensord, 1 redis); <0 on failure. */
static double measure(int sys, const bench_target *t)
{
    worker w[COORD_MAX_CLIENTS];
    pthread_t th[COORD_MAX_CLIENTS];
    atomic_store(&go, 0);
    for (int i = 0; i < g.clients; i++) {
        w[i] = (worker){.sys = sys, .t = t, .secs = g.secs};
        if (pthread_create(&th[i], NULL, work, &w[i]) != 0)
            return -1;
    }
    usleep(200000); /* every connection is open before the clock starts */
    double t0 = bench_now();
    atomic_store(&go, 1);
    long ops = 0;
    int failed = 0;
    for (int i = 0; i < g.clients; i++) {
        pthread_join(th[i], NULL);
        ops += w[i].ops;
        failed |= w[i].failed;
    }
    double dt = bench_now() - t0;
    return failed ? -1 : (double)ops / dt;
}

static const char *find_in_path(const char *prog)
{
    static const char *dirs[] = {"/usr/bin", "/usr/local/bin", "/usr/sbin", "/bin"};
    static char buf[256];
    for (size_t i = 0; i < sizeof(dirs) / sizeof(dirs[0]); i++) {
        snprintf(buf, sizeof(buf), "%s/%s", dirs[i], prog);
        if (access(buf, X_OK) == 0)
            return buf;
    }
    return NULL;
}

int main(int argc, char **argv)
{
    g.tensord = TS_TENSORD_PATH;
    g.repeats = COORD_REPEATS;
    g.clients = COORD_CLIENTS;
    g.secs = COORD_SECS;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--tensord") == 0 && i + 1 < argc)
            g.tensord = argv[++i];
        else if (strcmp(argv[i], "--repeats") == 0 && i + 1 < argc)
            g.repeats = (int)strtol(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--clients") == 0 && i + 1 < argc)
            g.clients = (int)strtol(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--secs") == 0 && i + 1 < argc)
            g.secs = strtod(argv[++i], NULL);
        else if (strcmp(argv[i], "--no-pin") == 0)
            bench_set_pinning(0);
        else if (strcmp(argv[i], "--smoke") == 0) {
            g.repeats = 1;
            g.secs = 0.3;
        } else {
            fprintf(stderr, "usage: coord_bench [--tensord PATH] [--repeats N] [--clients C] "
                            "[--secs S] [--no-pin] [--smoke]\n");
            return 2;
        }
    }
    if (g.repeats < 1 || g.repeats > 100 || g.clients < 1 || g.clients > COORD_MAX_CLIENTS ||
        !(g.secs > 0)) {
        fprintf(stderr, "coord_bench: repeats 1..100, clients 1..%d, secs > 0\n",
                COORD_MAX_CLIENTS);
        return 2;
    }
    g.redis = find_in_path("redis-server");
    snprintf(g.dir, sizeof(g.dir), "/tmp/coord_bench.%ld", (long)getpid());
    if (mkdir(g.dir, 0700) != 0 && errno != EEXIST)
        return 1;
    server ts, rd = {.pid = -1};
    if (start_tensord(&ts) != 0) {
        fprintf(stderr, "coord_bench: tensord did not start (see %s)\n", g.dir);
        return 1;
    }
    int have_redis = g.redis != NULL && start_redis(&rd) == 0;
    double vt[100], vr[100];
    int nr = 0;
    for (int r = 0; r < g.repeats; r++) {
        /* Alternate which system goes first, so that neither always meets a warm cache. */
        if (r % 2 == 1 && have_redis)
            vr[nr] = measure(1, &rd.t);
        vt[r] = measure(0, &ts.t);
        if (r % 2 == 0 && have_redis)
            vr[nr] = measure(1, &rd.t);
        if (have_redis)
            nr++;
        printf("repeat %d: tensord ADD %.0f/s%s", r + 1, vt[r], have_redis ? "" : "\n");
        if (have_redis)
            printf(", redis INCR %.0f/s\n", vr[nr - 1]);
        fflush(stdout);
    }
    double mt = bench_median(vt, (size_t)g.repeats);
    printf("\n| case | tensord ADD | Redis INCR | ratio |\n|---|---|---|---|\n");
    if (have_redis) {
        double mr = bench_median(vr, (size_t)nr);
        printf("| %d clients, 1 in flight each, %s | %.0f ops/s | %.0f ops/s | %.2fx |\n",
               g.clients, bench_pinning() ? "pinned" : "unpinned", mt, mr, mr > 0 ? mt / mr : 0.0);
    } else {
        printf("| %d clients | %.0f ops/s | not measured (no redis-server) | |\n", g.clients, mt);
    }
    bench_stop(ts.pid);
    if (rd.pid > 0)
        bench_stop(rd.pid);
    return 0;
}
