/*
 * tsbench: one run that measures tensord against the socket ceiling and Redis and prints the
 * table of docs/PERFORMANCE.md.
 *
 *   tsbench [--smoke] [--repeats N] [--tensord PATH] [--redis PATH | --no-redis] [--no-pin]
 *           [--skip LIST] [--raw]
 *
 * Every server runs pinned to cpu0 and every client thread to cpu1. Each case runs the systems
 * alternately (tensord first on even repeats, the references first on odd ones), and the table
 * shows medians over the repeats. Ratios are "tensord relative to the reference", oriented so
 * that a number above 1 means tensord is better. --smoke runs tiny sizes once (a few seconds),
 * needs no Redis, and exits non-zero if any transfer failed: it keeps the benchmark from rotting.
 */
#define _GNU_SOURCE
#include "bench.h"

#include <pthread.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tensorshare/tensorshare.h"

#define MAX_REPEATS 15

#ifndef TS_TENSORD_PATH
#define TS_TENSORD_PATH "tensord"
#endif

/* A system under test: how it was started and where it listens. */
typedef struct server {
    const char *name;
    pid_t pid;
    bench_target t;
} server;

static struct {
    int smoke;
    int repeats;
    int raw;
    const char *tensord;
    const char *redis;
    const char *skip;
    char dir[128];
    char self[512];
    int failures;
} g = {.repeats = 5};

/* ---------------------------------------------------------------------------------------------
 * Servers
 */

static int start_tensord(server *s)
{
    static int seq;
    char tag[32];
    snprintf(tag, sizeof(tag), "tensord%d", ++seq);
    s->name = "tensord";
    s->pid = bench_start_tensord("tsbench", g.tensord, g.dir, tag, 1, &s->t);
    return s->pid > 0 ? 0 : -1;
}

static int start_ceiling(server *s)
{
    char port_file[256], log[256];
    snprintf(port_file, sizeof(port_file), "%s/ceiling.port", g.dir);
    snprintf(s->t.unix_path, sizeof(s->t.unix_path), "%s/ceiling.sock", g.dir);
    snprintf(log, sizeof(log), "%s/ceiling.log", g.dir);
    char *argv[] = {g.self, "ceiling-server", port_file, s->t.unix_path, NULL};
    s->name = "ceiling";
    s->pid = bench_spawn(argv, 0, log);
    s->t.port = s->pid > 0 ? bench_read_port_file(port_file) : -1;
    if (s->t.port < 0 || bench_wait_listening(0, s->t.unix_path, 15) != 0) {
        fprintf(stderr, "tsbench: the ceiling server did not start; see %s\n", log);
        bench_stop(s->pid);
        s->pid = -1;
        return -1;
    }
    return 0;
}

static int start_redis(server *s)
{
    static int seq;
    char tag[32];
    snprintf(tag, sizeof(tag), "redis%d", ++seq);
    s->name = "redis";
    s->pid = -1;
    if (g.redis == NULL)
        return -1;
    s->pid = bench_start_redis("tsbench", g.redis, g.dir, tag, 1, &s->t);
    return s->pid > 0 ? 0 : -1;
}

static void stop_server(server *s)
{
    if (s->pid > 0)
        bench_stop(s->pid);
    s->pid = -1;
}

/* ---------------------------------------------------------------------------------------------
 * Results and the table
 */

/* The runs of one system in one case. */
typedef struct runs {
    double v[MAX_REPEATS];
    double v2[MAX_REPEATS];
    int n;
    int failed;
    int absent; /* the system was not measured (no Redis) */
} runs;

static void add_run(runs *r, bench_result res, const char *what, const char *sys)
{
    if (!res.ok) {
        r->failed++;
        fprintf(stderr, "tsbench: %s: %s run failed\n", what, sys);
        return;
    }
    if (r->n < MAX_REPEATS) {
        r->v[r->n] = res.value;
        r->v2[r->n] = res.value2;
        r->n++;
    }
    if (g.raw)
        fprintf(stderr, "raw: %-28s %-8s %.6g %.6g\n", what, sys, res.value, res.value2);
}

static double med(runs *r, int second)
{
    if (r->absent || r->n == 0)
        return NAN;
    double tmp[MAX_REPEATS];
    memcpy(tmp, second ? r->v2 : r->v, sizeof(double) * (size_t)r->n);
    return bench_median(tmp, (size_t)r->n);
}

/* Lines of the table, printed at the end. */
static char table[200][256];
static int n_lines;

static void line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void line(const char *fmt, ...)
{
    if (n_lines >= (int)(sizeof(table) / sizeof(table[0])))
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(table[n_lines++], sizeof(table[0]), fmt, ap);
    va_end(ap);
}

static const char *fmt_num(char *buf, size_t cap, double v, const char *f)
{
    if (isnan(v))
        snprintf(buf, cap, "-");
    else
        snprintf(buf, cap, f, v);
    return buf;
}

/* "pass"/"MISS" against a minimum ratio, or "-" when there is nothing to compare. */
static const char *verdict(double ratio, double min)
{
    if (isnan(ratio) || min <= 0)
        return "-";
    return ratio >= min ? "pass" : "MISS";
}

static int skipped(const char *name)
{
    return g.skip != NULL && strstr(g.skip, name) != NULL;
}

static const char *size_name(size_t size, char *buf, size_t cap)
{
    if (size >= ((size_t)1 << 20))
        snprintf(buf, cap, "%zu MiB", size >> 20);
    else
        snprintf(buf, cap, "%zu KiB", size >> 10);
    return buf;
}

/* ---------------------------------------------------------------------------------------------
 * Cases
 */

/* Rounds per run for a transfer size: about a quarter to half a second of work. */
static int iters_for(size_t size)
{
    if (g.smoke)
        return 5;
    if (size <= 64 * 1024)
        return 1000;
    if (size <= ((size_t)4 << 20))
        return 200;
    return 8;
}

/*
 * One put-then-get run on system kind (0 tensord, 1 ceiling, 2 redis); with --raw, also the CPU
 * time per round of each side, which load on a shared machine disturbs less than wall time.
 */
static bench_result putget_run(server *s, int kind, int use_unix, size_t size, int iters)
{
    double c0 = bench_cpu_self(), s0 = bench_cpu_pid(s->pid);
    bench_result r = kind == 0   ? ts_bench_putget(&s->t, use_unix, size, iters, 0, 0)
                     : kind == 1 ? ceiling_putget(&s->t, use_unix, size, iters)
                                 : redis_putget(&s->t, use_unix, size, iters);
    double c1 = bench_cpu_self(), s1 = bench_cpu_pid(s->pid);
    if (g.raw && r.ok)
        fprintf(stderr,
                "raw: %s %zu B %s cpu per round (incl. setup): client %.1f us, server %.1f us\n",
                s->name, size, use_unix ? "unix" : "tcp", (c1 - c0) / (iters + 2) * 1e6,
                (s1 - s0) / (iters + 2) * 1e6);
    return r;
}

static void case_putget(server *ts, server *ce, server *rd, size_t size, int use_unix,
                        double target)
{
    char sz[32], what[64];
    size_name(size, sz, sizeof(sz));
    snprintf(what, sizeof(what), "put+get %s %s", sz, use_unix ? "unix" : "tcp");
    runs a = {0}, b = {0}, c = {0};
    c.absent = rd->pid <= 0;
    int it = iters_for(size);
    for (int r = 0; r < g.repeats; r++) {
        if (r % 2 == 0)
            add_run(&a, putget_run(ts, 0, use_unix, size, it), what, "tensord");
        add_run(&b, putget_run(ce, 1, use_unix, size, it), what, "ceiling");
        if (!c.absent)
            add_run(&c, putget_run(rd, 2, use_unix, size, it), what, "redis");
        if (r % 2 == 1)
            add_run(&a, putget_run(ts, 0, use_unix, size, it), what, "tensord");
    }
    g.failures += a.failed + b.failed;
    double ta = med(&a, 0), tb = med(&b, 0), tc = med(&c, 0);
    double rb = tb / ta, rc = tc / ta;
    char s1[32], s2[32], s3[32], s4[32], s5[32], s6[32];
    line("| %s | %s ms | %s GB/s | %s ms | %s ms | %s | %s | %s |", what,
         fmt_num(s1, sizeof(s1), ta * 1e3, "%.3f"),
         fmt_num(s2, sizeof(s2), 2.0 * (double)size / ta / 1e9, "%.2f"),
         fmt_num(s3, sizeof(s3), tb * 1e3, "%.3f"), fmt_num(s4, sizeof(s4), tc * 1e3, "%.3f"),
         fmt_num(s5, sizeof(s5), rb, "%.2fx"), fmt_num(s6, sizeof(s6), rc, "%.2fx"),
         target > 0 ? verdict(rb, target) : "-");
}

/* One run of a small-operation case; with --raw, also the CPU time per operation of each side. */
static bench_result small_run(server *s, int use_unix, int nclients, int depth, double secs,
                              int redis)
{
    double c0 = bench_cpu_self(), s0 = bench_cpu_pid(s->pid), x0 = bench_ctxsw_self();
    bench_result r = redis ? redis_small(&s->t, use_unix, nclients, depth, secs)
                           : ts_bench_small(&s->t, use_unix, nclients, depth, secs);
    double c1 = bench_cpu_self(), s1 = bench_cpu_pid(s->pid), x1 = bench_ctxsw_self();
    double ops = r.value * secs;
    if (g.raw && r.ok && ops > 0)
        fprintf(stderr,
                "raw: %s cpu per op: client %.2f us, server %.2f us; client context switches "
                "per op %.3f\n",
                s->name, (c1 - c0) / ops * 1e6, (s1 - s0) / ops * 1e6, (x1 - x0) / ops);
    return r;
}

static void case_small(server *ts, server *rd, int nclients, int depth, int use_unix)
{
    char what[64];
    snprintf(what, sizeof(what), "64 B put/get, %d client%s, %s, %s", nclients,
             nclients > 1 ? "s" : "", depth > 1 ? "pipeline 16" : "blocking",
             use_unix ? "unix" : "tcp");
    runs a = {0}, c = {0};
    c.absent = rd->pid <= 0;
    double secs = g.smoke ? 0.2 : 1.5;
    for (int r = 0; r < g.repeats; r++) {
        if (r % 2 == 0)
            add_run(&a, small_run(ts, use_unix, nclients, depth, secs, 0), what, "tensord");
        if (!c.absent)
            add_run(&c, small_run(rd, use_unix, nclients, depth, secs, 1), what, "redis");
        if (r % 2 == 1)
            add_run(&a, small_run(ts, use_unix, nclients, depth, secs, 0), what, "tensord");
    }
    g.failures += a.failed;
    double va = med(&a, 0), vc = med(&c, 0);
    char s1[32], s2[32], s3[32];
    line("| %s | %s ops/s | %s ops/s | %s | %s |", what, fmt_num(s1, sizeof(s1), va, "%.0f"),
         fmt_num(s2, sizeof(s2), vc, "%.0f"), fmt_num(s3, sizeof(s3), va / vc, "%.2fx"),
         verdict(va / vc, 1.0));
}

static void case_notify(server *ts, server *rd, int use_unix)
{
    const char *what = use_unix ? "notify unix" : "notify tcp";
    runs a = {0}, c = {0};
    c.absent = rd->pid <= 0;
    int n = g.smoke ? 50 : 2000;
    for (int r = 0; r < g.repeats; r++) {
        if (r % 2 == 0)
            add_run(&a, ts_bench_notify(&ts->t, use_unix, n, 1000), what, "tensord");
        if (!c.absent)
            add_run(&c, redis_notify(&rd->t, use_unix, n, 1000), what, "redis");
        if (r % 2 == 1)
            add_run(&a, ts_bench_notify(&ts->t, use_unix, n, 1000), what, "tensord");
    }
    g.failures += a.failed;
    double p50a = med(&a, 0), p99a = med(&a, 1), p50c = med(&c, 0), p99c = med(&c, 1);
    char s[6][32];
    line("| put to callback, %s, p50 | %s us | %s us | %s | %s |", use_unix ? "unix" : "tcp",
         fmt_num(s[0], 32, p50a, "%.1f"), fmt_num(s[1], 32, p50c, "%.1f"),
         fmt_num(s[2], 32, p50c / p50a, "%.2fx"), verdict(p50c / p50a, 1.0));
    line("| put to callback, %s, p99 | %s us | %s us | %s | %s |", use_unix ? "unix" : "tcp",
         fmt_num(s[3], 32, p99a, "%.1f"), fmt_num(s[4], 32, p99c, "%.1f"),
         fmt_num(s[5], 32, p99c / p99a, "%.2fx"), verdict(p99c / p99a, 1.0 / 1.2));
}

/* Read n RESP integer replies (":N\r\n") from fd, the only bytes it will send. 0 or -1. */
static int resp_read_ints(int fd, size_t n)
{
    char buf[4096];
    size_t got = 0;
    int line_start = 1;
    while (got < n) {
        ssize_t k = read(fd, buf, sizeof(buf));
        if (k <= 0)
            return -1;
        for (ssize_t i = 0; i < k; i++) {
            if (line_start && buf[i] != ':')
                return -1;
            line_start = buf[i] == '\n';
            got += (size_t)line_start;
        }
    }
    return 0;
}

/*
 * The same on Redis: values of size bytes pushed (RPUSH, pipelines of 64) onto lists of per_bin
 * elements each. 0 or -1.
 */
static int redis_store_binned(const bench_target *t, size_t size, size_t total, size_t per_bin)
{
    int fd = bench_connect(t, 0);
    uint8_t *val = bench_alloc(size);
    size_t per = 64, cap = per * (size + 96);
    char *batch = malloc(cap);
    int rc = -1;
    if (fd >= 0 && val != NULL && batch != NULL) {
        bench_fill(val, size, 0, 9);
        size_t n = total / size;
        rc = 0;
        for (size_t i = 0; i < n && rc == 0; i += per) {
            size_t m = n - i < per ? n - i : per, k = 0;
            for (size_t q = 0; q < m; q++) {
                char key[32];
                int kl = snprintf(key, sizeof(key), "m:%zu", (i + q) / per_bin);
                k += (size_t)snprintf(batch + k, cap - k,
                                      "*3\r\n$5\r\nRPUSH\r\n$%d\r\n%s\r\n$%zu\r\n", kl, key, size);
                memcpy(batch + k, val, size);
                k += size;
                memcpy(batch + k, "\r\n", 2);
                k += 2;
            }
            if (bench_write_all(fd, batch, k, 0) != 0 || resp_read_ints(fd, m) != 0)
                rc = -1;
        }
    }
    if (fd >= 0)
        close(fd);
    free(batch);
    bench_free(val);
    return rc;
}

/*
 * Resident memory a fresh server gains by storing total bytes as items of size bytes, one bin
 * (Redis: key) per item when per_bin <= 1, else per_bin items appended to each bin (Redis: list).
 * With peak set, the rise of its peak while one item of size bytes is stored. -1 on failure.
 * *records (when not NULL) gets the bytes the clients sent as stored records (tensord: from LIST,
 * read after the resident size; Redis: the values).
 */
static double mem_measure(int redis, size_t size, size_t total, size_t per_bin, int peak,
                          double *records)
{
    server s = {0};
    double rec = NAN;
    if ((redis ? start_redis(&s) : start_tensord(&s)) != 0)
        return -1;
    usleep(200000);
    long long rss0 = bench_rss(s.pid);
    double out = -1;
    int rc;
    if (peak) {
        if (bench_reset_hwm(s.pid) != 0)
            fprintf(stderr, "tsbench: cannot reset VmHWM; the peak includes start-up\n");
        rc = redis ? redis_set_one(&s.t, "peak", size) : ts_bench_put_one(&s.t, "peak", size);
    } else if (redis) {
        rc = per_bin > 1 ? redis_store_binned(&s.t, size, total, per_bin)
                         : redis_store(&s.t, size, total);
    } else {
        rc = ts_bench_store(&s.t, size, total, per_bin);
    }
    usleep(200000);
    long long after = peak ? bench_hwm(s.pid) : bench_rss(s.pid);
    if (rc == 0 && rss0 > 0 && after > 0) {
        out = (double)(after - rss0);
        rec = redis ? (peak ? (double)size : (double)(total / size * size))
                    : ts_bench_held_records(&s.t);
    } else {
        fprintf(stderr, "tsbench: memory case (%s, %zu bytes) failed\n", s.name, size);
    }
    stop_server(&s);
    if (records != NULL)
        *records = rec;
    return out;
}

/*
 * One row: the growth, its ratio to the tensor bytes (the payload; the target applies to it)
 * and to the record bytes the clients sent (tensor plus its record header).
 */
static void case_memory(int have_redis, size_t size, size_t total, size_t per_bin, int peak,
                        double max_ratio)
{
    char sz[32], tot[32], what[128];
    size_name(size, sz, sizeof(sz));
    size_name(total, tot, sizeof(tot));
    if (peak)
        snprintf(what, sizeof(what), "peak while one %s item is put", sz);
    else if (per_bin > 1)
        snprintf(what, sizeof(what), "resident after storing %s as %s items, %zu per bin", tot, sz,
                 per_bin);
    else
        snprintf(what, sizeof(what), "resident after storing %s as %s items", tot, sz);
    double payload = peak ? (double)size : (double)(total / size * size);
    double ra = NAN;
    double a = mem_measure(0, size, total, per_bin, peak, &ra);
    double c = have_redis ? mem_measure(1, size, total, per_bin, peak, NULL) : NAN;
    if (a < 0)
        g.failures++;
    /* The target allows 1 MiB of fixed overhead for stored bytes, none for the peak. */
    double allow = peak ? payload * max_ratio : payload * max_ratio + (double)(1 << 20);
    char s[5][32];
    line("| %s | %s MiB (%sx) | %sx | %s MiB (%sx) | %s |", what,
         fmt_num(s[0], 32, a / 1048576.0, "%.1f"), fmt_num(s[1], 32, a / payload, "%.3f"),
         fmt_num(s[2], 32, a / ra, "%.3f"), fmt_num(s[3], 32, c / 1048576.0, "%.1f"),
         fmt_num(s[4], 32, c / payload, "%.3f"), a < 0 ? "-" : (a <= allow ? "pass" : "MISS"));
}

static void case_lz4(server *ts, size_t size, int compressible)
{
    char sz[32], what[96];
    size_name(size, sz, sizeof(sz));
    snprintf(what, sizeof(what), "put+get %s %s, tcp", sz,
             compressible ? "compressible" : "random");
    runs off = {0}, on = {0};
    int it = iters_for(size);
    for (int r = 0; r < g.repeats; r++) {
        if (r % 2 == 0)
            add_run(&off, ts_bench_putget(&ts->t, 0, size, it, 0, compressible), what, "lz4 off");
        add_run(&on, ts_bench_putget(&ts->t, 0, size, it, 1, compressible), what, "lz4 on");
        if (r % 2 == 1)
            add_run(&off, ts_bench_putget(&ts->t, 0, size, it, 0, compressible), what, "lz4 off");
    }
    g.failures += off.failed + on.failed;
    double a = med(&off, 0), b = med(&on, 0);
    char s[3][32];
    line("| %s | %s ms | %s ms | %s |", what, fmt_num(s[0], 32, a * 1e3, "%.3f"),
         fmt_num(s[1], 32, b * 1e3, "%.3f"), fmt_num(s[2], 32, a / b, "%.2fx"));
}

/* ---------------------------------------------------------------------------------------------
 * Main
 */

static void machine_info(void)
{
    bench_print_machine();
    printf("servers pinned to cpu0, clients to cpu1: %s; %d repeats, medians\n",
           bench_pinning() ? "yes" : "no (fewer than 2 CPUs or --no-pin)", g.repeats);
}

/* The first executable named name on PATH, or NULL. */
static const char *find_in_path(const char *name)
{
    static char found[512];
    const char *path = getenv("PATH");
    if (path == NULL)
        path = "/usr/bin:/bin";
    while (*path) {
        size_t n = strcspn(path, ":");
        snprintf(found, sizeof(found), "%.*s/%s", (int)n, path, name);
        if (access(found, X_OK) == 0)
            return found;
        path += n;
        if (*path == ':')
            path++;
    }
    /* Debian installs it here, outside a normal user's PATH on some systems. */
    snprintf(found, sizeof(found), "/usr/bin/%s", name);
    return access(found, X_OK) == 0 ? found : NULL;
}

static void usage(void)
{
    fprintf(stderr, "usage: tsbench [--smoke] [--repeats N] [--tensord PATH] [--redis PATH | "
                    "--no-redis] [--no-pin] [--skip putget,small,notify,memory,lz4] [--raw]\n");
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "ceiling-server") == 0)
        return ceiling_serve(argv[2], argv[3]) == 0 ? 0 : 1;
    g.tensord = getenv("TS_TENSORD") != NULL ? getenv("TS_TENSORD") : TS_TENSORD_PATH;
    int no_redis = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--smoke") == 0) {
            g.smoke = 1;
        } else if (strcmp(a, "--repeats") == 0 && val != NULL) {
            g.repeats = (int)strtol(val, NULL, 10);
            i++;
        } else if (strcmp(a, "--tensord") == 0 && val != NULL) {
            g.tensord = val;
            i++;
        } else if (strcmp(a, "--redis") == 0 && val != NULL) {
            g.redis = val;
            i++;
        } else if (strcmp(a, "--no-redis") == 0) {
            no_redis = 1;
        } else if (strcmp(a, "--no-pin") == 0) {
            bench_set_pinning(0);
        } else if (strcmp(a, "--skip") == 0 && val != NULL) {
            g.skip = val;
            i++;
        } else if (strcmp(a, "--raw") == 0) {
            g.raw = 1;
        } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage();
            return 0;
        } else {
            usage();
            return 2;
        }
    }
    if (g.smoke && g.repeats == 5)
        g.repeats = 1;
    if (g.repeats < 1 || g.repeats > MAX_REPEATS) {
        fprintf(stderr, "tsbench: --repeats must be 1..%d\n", MAX_REPEATS);
        return 2;
    }
    if (no_redis)
        g.redis = NULL;
    else if (g.redis == NULL)
        g.redis = find_in_path("redis-server");
    if (sysconf(_SC_NPROCESSORS_ONLN) < 2)
        bench_set_pinning(0);
    ssize_t sl = readlink("/proc/self/exe", g.self, sizeof(g.self) - 1);
    if (sl <= 0)
        return 1;
    g.self[sl] = '\0';
    snprintf(g.dir, sizeof(g.dir), "/tmp/tsbench.XXXXXX");
    if (mkdtemp(g.dir) == NULL) {
        perror("tsbench: mkdtemp");
        return 1;
    }

    machine_info();
    server ts = {0}, ce = {0}, rd = {0};
    rd.pid = -1;
    if (start_tensord(&ts) != 0 || start_ceiling(&ce) != 0) {
        stop_server(&ts);
        stop_server(&ce);
        return 1;
    }
    if (g.redis != NULL && start_redis(&rd) != 0 && !g.smoke)
        g.failures++;
    if (rd.pid <= 0)
        printf("redis: not measured%s\n", g.redis == NULL ? " (redis-server not found)" : "");
    bench_pin_self(1);
    fflush(stdout);

    size_t sizes_full[] = {4096, (size_t)1 << 20, (size_t)64 << 20};
    size_t sizes_smoke[] = {4096, 64 * 1024};
    double targets_full[] = {0, 0.8, 0.85};
    size_t *sizes = g.smoke ? sizes_smoke : sizes_full;
    size_t nsizes = g.smoke ? 2 : 3;

    if (!skipped("putget")) {
        line("### Put then get of one float32 tensor (time per round trip, lower is better)");
        line("%s", "");
        line("| case | tensord | tensord rate | ceiling | redis | vs ceiling | vs redis | "
             "target |");
        line("|---|---|---|---|---|---|---|---|");
        for (int u = 0; u < 2; u++)
            for (size_t i = 0; i < nsizes; i++)
                case_putget(&ts, &ce, &rd, sizes[i], u, g.smoke ? 0 : targets_full[i]);
        line("%s", "");
    }
    if (!skipped("small")) {
        line("### Small operations (64 B float32 tensor; higher is better)");
        line("%s", "");
        line("| case | tensord | redis | vs redis | target |");
        line("|---|---|---|---|---|");
        case_small(&ts, &rd, 1, 1, 0);
        case_small(&ts, &rd, 8, 16, 0);
        if (!g.smoke) {
            case_small(&ts, &rd, 1, 1, 1);
            case_small(&ts, &rd, 8, 16, 1);
        }
        line("%s", "");
    }
    if (!skipped("notify")) {
        line("### Notification latency, paced 1 per ms (Redis: PUBLISH to a subscriber)");
        line("%s", "");
        line("| case | tensord | redis | vs redis | target |");
        line("|---|---|---|---|---|");
        case_notify(&ts, &rd, 0);
        if (!g.smoke)
            case_notify(&ts, &rd, 1);
        line("%s", "");
    }
    if (!skipped("lz4")) {
        line("### lz4 (client compresses puts when compress_min > 0; tensord, tcp)");
        line("%s", "");
        line("| case | lz4 off | lz4 on | on vs off |");
        line("|---|---|---|---|");
        size_t lsz[] = {(size_t)1 << 20, (size_t)64 << 20};
        for (int i = 0; i < (g.smoke ? 1 : 2); i++) {
            size_t s = g.smoke ? 64 * 1024 : lsz[i];
            case_lz4(&ts, s, 1);
            case_lz4(&ts, s, 0);
        }
        line("%s", "");
    }
    /* The long-lived servers are not needed any more; memory cases start fresh ones. */
    stop_server(&ts);
    stop_server(&ce);
    int have_redis = rd.pid > 0;
    stop_server(&rd);
    if (!skipped("memory")) {
        line("### Server memory (growth of VmRSS, or of VmHWM for the peak; a fresh server each)");
        line("%s", "");
        line("| case | tensord (vs tensor bytes) | tensord vs record bytes | redis | target |");
        line("|---|---|---|---|---|");
        size_t total = g.smoke ? (size_t)16 << 20 : (size_t)1 << 30;
        case_memory(have_redis, g.smoke ? (size_t)1 << 20 : (size_t)64 << 20, total, 1, 0, 1.02);
        case_memory(have_redis, 4096, total, 1, 0, 1.02);
        case_memory(have_redis, 4096, total, 1024, 0, 1.02);
        case_memory(have_redis, g.smoke ? (size_t)8 << 20 : (size_t)256 << 20, 0, 1, 1, 1.1);
        line("%s", "");
    }
    printf("\n");
    for (int i = 0; i < n_lines; i++)
        printf("%s\n", table[i]);
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g.dir);
    if (system(cmd) != 0)
        fprintf(stderr, "tsbench: could not remove %s\n", g.dir);
    if (g.failures > 0) {
        fprintf(stderr, "tsbench: %d runs failed\n", g.failures);
        return 1;
    }
    return 0;
}
