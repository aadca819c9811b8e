/*
 * RL helpers benchmark (not a test): experience throughput from worker processes to one
 * trainer, and the latency from a publish to a worker holding the new parameters.
 *
 *   rl_bench [--tensord PATH] [--smoke] [--workers N] [--tcp] [--no-pin]
 *
 * It starts its own tensord (PATH, else $TS_TENSORD, else the one built alongside), pins it to
 * cpu0 and itself and its workers to cpu1 when the machine has two CPUs or more, and prints a
 * table. Workers are separate processes (this program re-executed with --role). --smoke runs
 * tiny counts so the build can check that the benchmark still works.
 */
#define _GNU_SOURCE /* sched_setaffinity, CPU_SET */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tensorshare/rl.h"
#include "tensorshare/tensorshare.h"

#ifndef TS_TENSORD_PATH
#define TS_TENSORD_PATH ""
#endif

#define MAX_WORKERS   64
#define MAX_ROUNDS    1000  /* latency samples per size */
#define START_WAIT_MS 15000 /* for tensord to listen and for workers to get going */

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int parse_ll(const char *s, long long *out)
{
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0')
        return -1;
    *out = v;
    return 0;
}

static void pin_to(pid_t pid, int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(pid, sizeof(set), &set) != 0)
        fprintf(stderr, "rl_bench: cannot pin pid %d to cpu%d: %s\n", (int)pid, cpu,
                strerror(errno));
}

/* Zeroed memory straight from the kernel (big buffers; the benchmark keeps off the heap). */
static void *map_bytes(size_t n)
{
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void unmap_bytes(void *p, size_t n)
{
    if (p != NULL)
        munmap(p, n);
}

/* ---------------------------------------------------------------------------------------------
 * Worker roles (run in child processes)
 */

/* Every measurement uses its own bins (a prefix), so none sees another's parameters. */
static int open_worker(const char *addr, const char *prefix, ts_client_t **c, ts_rl_worker_t **w)
{
    ts_rl_options_t o;
    ts_rl_options_init(&o);
    o.prefix = prefix;
    int rc = ts_client_open(c, addr, NULL);
    if (rc != 0) {
        fprintf(stderr, "rl_bench worker: connect %s: %s\n", addr, ts_strerror(rc));
        return rc;
    }
    rc = ts_rl_worker_new(w, *c, &o);
    if (rc != 0) {
        fprintf(stderr, "rl_bench worker: %s\n", ts_strerror(rc));
        ts_client_free(*c);
    }
    return rc;
}

/*
 * Throughput worker: say it is ready on fd, wait for the trainer's first publish (the start
 * signal), then add n items of size bytes each (one uint8 tensor, borrowed: the buffer never
 * changes) and flush.
 */
static int role_adder(const char *addr, const char *prefix, long long n, long long size, int fd)
{
    ts_client_t *c;
    ts_rl_worker_t *w;
    if (open_worker(addr, prefix, &c, &w) != 0)
        return 1;
    int code = 0;
    unsigned char *buf = map_bytes((size_t)size);
    char one = 1;
    if (write(fd, &one, 1) != 1)
        code = 1;
    close(fd);
    ts_rl_params_t *p = NULL;
    int rc = ts_rl_worker_params(w, &p);
    if (rc == TS_ENOENT)
        rc = ts_rl_worker_await(w, START_WAIT_MS, &p);
    if (buf == NULL || rc != 0 || code != 0) {
        fprintf(stderr, "rl_bench adder: no start: %s\n", ts_strerror(rc));
        code = 1;
    }
    const int64_t shape[1] = {size};
    for (long long i = 0; code == 0 && i < n; i++) {
        ts_value_t *item = ts_map_new();
        if (ts_map_set(item, "x", ts_tensor_new(TS_UINT8, 1, shape, buf, TS_BORROW)) != 0) {
            ts_value_free(item);
            code = 1;
            break;
        }
        rc = ts_rl_worker_add(w, item, TS_BORROW);
        ts_value_free(item);
        if (rc != 0) {
            fprintf(stderr, "rl_bench adder: add: %s\n", ts_strerror(rc));
            code = 1;
        }
    }
    rc = ts_rl_worker_flush(w, 120000);
    if (rc != 0) {
        fprintf(stderr, "rl_bench adder: flush: %s\n", ts_strerror(rc));
        code = 1;
    }
    ts_rl_params_release(p);
    ts_rl_worker_free(w);
    ts_client_free(c);
    unmap_bytes(buf, (size_t)size);
    return code;
}

/*
 * Latency worker: for each of rounds publishes, wait for it and write one int64 to fd, the
 * nanoseconds from the trainer's clock reading before publish ("t_ns" in the parameters, a
 * CLOCK_MONOTONIC value, which is system-wide) to this worker holding the snapshot.
 */
static int role_awaiter(const char *addr, const char *prefix, long long rounds, int fd)
{
    ts_client_t *c;
    ts_rl_worker_t *w;
    if (open_worker(addr, prefix, &c, &w) != 0)
        return 1;
    /* Whatever is published already does not count: only what comes after "ready". */
    ts_rl_params_t *old = NULL;
    if (ts_rl_worker_params(w, &old) == 0)
        ts_rl_params_release(old);
    /* Ready: the trainer publishes only after this. */
    int64_t ready = -1;
    int code = write(fd, &ready, sizeof(ready)) == (ssize_t)sizeof(ready) ? 0 : 1;
    for (long long r = 0; code == 0 && r < rounds; r++) {
        ts_rl_params_t *p = NULL;
        int rc = ts_rl_worker_await(w, 60000, &p);
        int64_t t1 = now_ns();
        if (rc != 0) {
            fprintf(stderr, "rl_bench awaiter: round %lld: %s\n", r, ts_strerror(rc));
            code = 1;
            break;
        }
        int64_t t0 = 0;
        if (ts_map_get_int(ts_rl_params_value(p), "t_ns", &t0) != 0)
            code = 1;
        int64_t lat = t1 - t0;
        ts_rl_params_release(p);
        if (write(fd, &lat, sizeof(lat)) != (ssize_t)sizeof(lat))
            code = 1;
    }
    ts_rl_worker_free(w);
    ts_client_free(c);
    return code;
}

/* ---------------------------------------------------------------------------------------------
 * The daemon and the worker processes
 */

typedef struct server {
    pid_t pid;
    char dir[128];
    char sock[192];
    char port_file[192];
    char addr[256];
} server;

static int server_start(server *s, const char *bin, int use_tcp)
{
    memset(s, 0, sizeof(*s));
    const char *tmp = getenv("TMPDIR");
    snprintf(s->dir, sizeof(s->dir), "%s/rlbench.XXXXXX", tmp != NULL ? tmp : "/tmp");
    if (mkdtemp(s->dir) == NULL)
        return -1;
    snprintf(s->sock, sizeof(s->sock), "%s/tensord.sock", s->dir);
    snprintf(s->port_file, sizeof(s->port_file), "%s/port", s->dir);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        /* Quiet: the table is the output (warnings and errors still reach stderr). */
        int devnull = open("/dev/null", O_WRONLY);
        if (devnull >= 0)
            dup2(devnull, STDOUT_FILENO);
        execl(bin, bin, "--port", "0", "--unix", s->sock, "--port-file", s->port_file,
              "--log-level", "warn", (char *)NULL);
        _exit(127);
    }
    s->pid = pid;
    for (int i = 0; i < START_WAIT_MS / 10; i++) {
        FILE *f = fopen(s->port_file, "r");
        if (f != NULL) {
            int port = 0;
            int ok = fscanf(f, "%d", &port) == 1 && port > 0;
            fclose(f);
            if (ok) {
                if (use_tcp)
                    snprintf(s->addr, sizeof(s->addr), "127.0.0.1:%d", port);
                else
                    snprintf(s->addr, sizeof(s->addr), "unix:%s", s->sock);
                return 0;
            }
        }
        if (waitpid(pid, NULL, WNOHANG) == pid) {
            s->pid = 0;
            return -1;
        }
        sleep_ms(10);
    }
    return -1;
}

static void server_stop(server *s)
{
    if (s->pid > 0) {
        kill(s->pid, SIGTERM);
        int st;
        for (int i = 0; i < 1500 && waitpid(s->pid, &st, WNOHANG) != s->pid; i++)
            sleep_ms(10);
        if (kill(s->pid, 0) == 0) {
            kill(s->pid, SIGKILL);
            waitpid(s->pid, &st, 0);
        }
    }
    unlink(s->port_file);
    unlink(s->sock);
    rmdir(s->dir);
}

static const char *g_self; /* this program, re-executed for the workers */

/* Start this program with the given role arguments (NULL-terminated). */
static pid_t spawn_role(char *const *args)
{
    pid_t pid = fork();
    if (pid == 0) {
        execv(g_self, args);
        _exit(127);
    }
    return pid;
}

/* Wait for the children; returns the number that did not exit with 0. */
static int reap_all(const pid_t *pids, int n)
{
    int bad = 0;
    for (int i = 0; i < n; i++) {
        int st = 0;
        if (pids[i] <= 0 || waitpid(pids[i], &st, 0) != pids[i] || !WIFEXITED(st) ||
            WEXITSTATUS(st) != 0)
            bad++;
    }
    return bad;
}

/* ---------------------------------------------------------------------------------------------
 * The two measurements (trainer side, in this process)
 */

typedef struct tput {
    long long items;
    double seconds;
} tput;

/* Parameters {t_ns: int, w: uint8[bytes]} over buf (borrowed). */
static ts_value_t *params_value(void *buf, long long bytes, int64_t t_ns)
{
    const int64_t shape[1] = {bytes};
    ts_value_t *p = ts_map_new();
    if (ts_map_set(p, "t_ns", ts_int_new(t_ns)) != 0 ||
        ts_map_set(p, "w", ts_tensor_new(TS_UINT8, 1, shape, buf, TS_BORROW)) != 0) {
        ts_value_free(p);
        return NULL;
    }
    return p;
}

static int publish_small(ts_rl_trainer_t *t)
{
    static unsigned char one[64];
    ts_value_t *p = params_value(one, sizeof(one), now_ns());
    int rc = p != NULL ? ts_rl_trainer_publish(t, p, NULL) : TS_ENOMEM;
    ts_value_free(p);
    return rc;
}

static int run_throughput(const server *s, const char *prefix, int workers, long long per_worker,
                          long long size, tput *out)
{
    int fds[2];
    if (pipe(fds) != 0)
        return TS_ENOMEM;
    char ns[32], ss[32], fs[16];
    snprintf(ns, sizeof(ns), "%lld", per_worker);
    snprintf(ss, sizeof(ss), "%lld", size);
    snprintf(fs, sizeof(fs), "%d", fds[1]);
    pid_t pids[MAX_WORKERS];
    char *args[] = {
        (char *)g_self, "--role", "adder", (char *)s->addr, (char *)prefix, ns, ss, fs, NULL};
    for (int i = 0; i < workers; i++)
        pids[i] = spawn_role(args);
    close(fds[1]);

    ts_client_t *c = NULL;
    ts_rl_trainer_t *t = NULL;
    int rc = ts_client_open(&c, s->addr, NULL);
    ts_rl_options_t o;
    ts_rl_options_init(&o);
    o.prefix = prefix;
    o.staleness_tolerance = TS_RL_NO_FILTER;
    if (rc == 0)
        rc = ts_rl_trainer_new(&t, c, &o);
    /* Every worker connected and subscribed: only the adds are timed. */
    for (int i = 0; rc == 0 && i < workers; i++) {
        struct pollfd pfd = {fds[0], POLLIN, 0};
        char one;
        if (poll(&pfd, 1, START_WAIT_MS) != 1 || read(fds[0], &one, 1) != 1)
            rc = TS_ETIMEDOUT;
    }
    close(fds[0]);
    long long want = per_worker * workers, got = 0;
    int64_t t0 = now_ns();
    if (rc == 0)
        rc = publish_small(t);
    while (rc == 0 && got < want) {
        ts_rl_batch_t *b = NULL;
        rc = ts_rl_trainer_collect(t, 0, 60000, &b);
        if (rc == 0) {
            got += (long long)ts_rl_batch_count(b);
            ts_rl_batch_free(b);
        }
    }
    int64_t t1 = now_ns();
    if (rc != 0)
        fprintf(stderr, "rl_bench: throughput %lld B: %s after %lld of %lld items\n", size,
                ts_strerror(rc), got, want);
    ts_rl_trainer_free(t);
    ts_client_free(c);
    if (reap_all(pids, workers) != 0 && rc == 0)
        rc = TS_ESERVER;
    out->items = got;
    out->seconds = (double)(t1 - t0) / 1e9;
    return rc;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Read one int64 from fd within timeout_ms. 0 or -1. */
static int read_i64(int fd, int64_t *v, int timeout_ms)
{
    struct pollfd pfd = {fd, POLLIN, 0};
    if (poll(&pfd, 1, timeout_ms) != 1)
        return -1;
    return read(fd, v, sizeof(*v)) == (ssize_t)sizeof(*v) ? 0 : -1;
}

static int run_latency(const server *s, const char *prefix, long long bytes, long long rounds,
                       int64_t *lat, int64_t *put)
{
    int fds[2];
    if (pipe(fds) != 0)
        return TS_ENOMEM;
    char rs[32], fs[16];
    snprintf(rs, sizeof(rs), "%lld", rounds);
    snprintf(fs, sizeof(fs), "%d", fds[1]);
    char *args[] = {(char *)g_self, "--role", "awaiter", (char *)s->addr,
                    (char *)prefix, rs,       fs,        NULL};
    pid_t pid = spawn_role(args);
    close(fds[1]);

    ts_client_t *c = NULL;
    ts_rl_trainer_t *t = NULL;
    unsigned char *buf = map_bytes((size_t)bytes);
    int rc = buf == NULL ? TS_ENOMEM : ts_client_open(&c, s->addr, NULL);
    ts_rl_options_t o;
    ts_rl_options_init(&o);
    o.prefix = prefix;
    if (rc == 0)
        rc = ts_rl_trainer_new(&t, c, &o);
    int64_t ready;
    if (rc == 0 && read_i64(fds[0], &ready, START_WAIT_MS) != 0)
        rc = TS_ETIMEDOUT;
    if (buf != NULL)
        memset(buf, 1, (size_t)bytes); /* fault the pages in before timing */
    for (long long r = 0; rc == 0 && r < rounds; r++) {
        int64_t t0 = now_ns();
        ts_value_t *p = params_value(buf, bytes, t0);
        rc = p != NULL ? ts_rl_trainer_publish(t, p, NULL) : TS_ENOMEM;
        put[r] = now_ns() - t0;
        ts_value_free(p);
        /* One round at a time, so no publish is merged into the next. */
        if (rc == 0 && read_i64(fds[0], &lat[r], 60000) != 0)
            rc = TS_ETIMEDOUT;
    }
    if (rc != 0)
        fprintf(stderr, "rl_bench: latency %lld B: %s\n", bytes, ts_strerror(rc));
    ts_rl_trainer_free(t);
    ts_client_free(c);
    unmap_bytes(buf, (size_t)bytes);
    close(fds[0]);
    if (rc != 0)
        kill(pid, SIGKILL);
    if (reap_all(&pid, 1) != 0 && rc == 0)
        rc = TS_ESERVER;
    return rc;
}

static const char *size_name(long long bytes, char *buf, size_t cap)
{
    if (bytes >= (1 << 20))
        snprintf(buf, cap, "%lld MiB", bytes >> 20);
    else
        snprintf(buf, cap, "%lld KiB", bytes >> 10);
    return buf;
}

int main(int argc, char **argv)
{
    g_self = "/proc/self/exe";
    if (argc >= 2 && strcmp(argv[1], "--role") == 0) {
        long long a = 0, b = 0;
        long long fd = -1;
        if (argc == 8 && strcmp(argv[2], "adder") == 0 && parse_ll(argv[5], &a) == 0 &&
            parse_ll(argv[6], &b) == 0 && parse_ll(argv[7], &fd) == 0)
            return role_adder(argv[3], argv[4], a, b, (int)fd);
        if (argc == 7 && strcmp(argv[2], "awaiter") == 0 && parse_ll(argv[5], &a) == 0 &&
            parse_ll(argv[6], &b) == 0)
            return role_awaiter(argv[3], argv[4], a, (int)b);
        fprintf(stderr, "rl_bench: bad role arguments\n");
        return 2;
    }

    const char *tensord = getenv("TS_TENSORD");
    if (tensord == NULL || tensord[0] == '\0')
        tensord = TS_TENSORD_PATH;
    int smoke = 0, use_tcp = 0, pin = 1;
    long long workers = 8;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--smoke") == 0)
            smoke = 1;
        else if (strcmp(argv[i], "--tcp") == 0)
            use_tcp = 1;
        else if (strcmp(argv[i], "--no-pin") == 0)
            pin = 0;
        else if (strcmp(argv[i], "--tensord") == 0 && i + 1 < argc)
            tensord = argv[++i];
        else if (strcmp(argv[i], "--workers") == 0 && i + 1 < argc &&
                 parse_ll(argv[i + 1], &workers) == 0 && workers >= 1 && workers <= MAX_WORKERS)
            i++;
        else {
            fprintf(stderr, "usage: rl_bench [--tensord PATH] [--smoke] [--workers N] [--tcp] "
                            "[--no-pin]\n");
            return 2;
        }
    }
    if (tensord[0] == '\0') {
        fprintf(stderr, "rl_bench: no tensord (use --tensord or TS_TENSORD)\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);

    server s;
    if (server_start(&s, tensord, use_tcp) != 0) {
        fprintf(stderr, "rl_bench: cannot start %s\n", tensord);
        return 1;
    }
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    pin = pin && ncpu >= 2;
    if (pin) {
        pin_to(s.pid, 0);
        pin_to(0, 1); /* this process; the workers inherit it */
    }

    struct {
        long long size, per_worker;
    } tp[2] = {{4 << 10, smoke ? 20 : 2000}, {1 << 20, smoke ? 4 : 64}};
    struct {
        long long bytes, rounds;
    } lt[2] = {{1 << 20, smoke ? 3 : 200}, {smoke ? 4 << 20 : 64 << 20, smoke ? 2 : 30}};

    int rc = 0;
    char nb[32];
    printf("rl_bench: tensord on cpu%s, trainer and workers on cpu%s, %s socket\n", pin ? "0" : "*",
           pin ? "1" : "*", use_tcp ? "TCP loopback" : "unix");
    printf("\nexperience throughput: %lld worker processes -> 1 trainer\n", workers);
    printf("  %-10s %10s %9s %12s %10s\n", "item", "items", "seconds", "items/s", "MB/s");
    for (int i = 0; i < 2 && rc == 0; i++) {
        tput r;
        char prefix[32];
        snprintf(prefix, sizeof(prefix), "tput%d/", i);
        rc = run_throughput(&s, prefix, (int)workers, tp[i].per_worker, tp[i].size, &r);
        if (rc == 0)
            printf("  %-10s %10lld %9.3f %12.0f %10.1f\n", size_name(tp[i].size, nb, sizeof(nb)),
                   r.items, r.seconds, (double)r.items / r.seconds,
                   (double)r.items * (double)tp[i].size / r.seconds / 1e6);
    }
    printf("\npublish -> worker holds the new parameters (1 worker process)\n");
    printf("  %-10s %7s %9s %9s %9s %13s\n", "state dict", "rounds", "p50 ms", "p99 ms", "max ms",
           "publish p50");
    for (int i = 0; i < 2 && rc == 0; i++) {
        static int64_t lat[MAX_ROUNDS], put[MAX_ROUNDS];
        char prefix[32];
        snprintf(prefix, sizeof(prefix), "latency%d/", i);
        rc = run_latency(&s, prefix, lt[i].bytes, lt[i].rounds, lat, put);
        if (rc == 0) {
            long long n = lt[i].rounds;
            qsort(lat, (size_t)n, sizeof(int64_t), cmp_i64);
            qsort(put, (size_t)n, sizeof(int64_t), cmp_i64);
            long long i50 = (n - 1) * 50 / 100, i99 = (n - 1) * 99 / 100;
            printf("  %-10s %7lld %9.2f %9.2f %9.2f %10.2f ms\n",
                   size_name(lt[i].bytes, nb, sizeof(nb)), n, (double)lat[i50] / 1e6,
                   (double)lat[i99] / 1e6, (double)lat[n - 1] / 1e6, (double)put[i50] / 1e6);
        }
    }
    fflush(stdout);
    server_stop(&s);
    return rc == 0 ? 0 : 1;
}
