/* The benchmark's plumbing: clocks, sockets, CPU pinning, child processes, /proc readings. */
#define _GNU_SOURCE
#include "bench.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int pinning = 1;

double bench_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

uint64_t bench_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void bench_sleep_until_ns(uint64_t t_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(t_ns / 1000000000u),
                          .tv_nsec = (long)(t_ns % 1000000000u)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

void bench_set_pinning(int on)
{
    pinning = on;
}

int bench_pinning(void)
{
    return pinning;
}

void bench_pin_self(int cpu)
{
    if (!pinning)
        return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    (void)sched_setaffinity(0, sizeof(set), &set);
}

int bench_connect_tcp(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        return -1;
    }
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return fd;
}

int bench_connect_unix(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(a.sun_path)) {
        close(fd);
        return -1;
    }
    memcpy(a.sun_path, path, strlen(path) + 1);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

int bench_connect(const bench_target *t, int use_unix)
{
    return use_unix ? bench_connect_unix(t->unix_path) : bench_connect_tcp(t->port);
}

int bench_write_all(int fd, const void *buf, size_t len, size_t chunk)
{
    const uint8_t *p = buf;
    while (len > 0) {
        size_t n = chunk > 0 && len > chunk ? chunk : len;
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

int bench_read_all(int fd, void *buf, size_t len)
{
    uint8_t *p = buf;
    while (len > 0) {
        ssize_t r = read(fd, p, len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r;
        len -= (size_t)r;
    }
    return 0;
}

int bench_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof(a);
    int port = -1;
    if (bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &al) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

pid_t bench_spawn(char *const argv[], int cpu, const char *log_path)
{
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    /* The child: only system calls until exec. */
    if (pinning) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        (void)sched_setaffinity(0, sizeof(set), &set);
    }
    if (log_path != NULL) {
        int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            (void)dup2(fd, 1);
            (void)dup2(fd, 2);
            close(fd);
        }
    }
    execv(argv[0], argv);
    _exit(127);
}

void bench_stop(pid_t pid)
{
    if (pid <= 0)
        return;
    (void)kill(pid, SIGTERM);
    for (int i = 0; i < 1000; i++) {
        if (waitpid(pid, NULL, WNOHANG) == pid)
            return;
        usleep(10000);
    }
    (void)kill(pid, SIGKILL);
    (void)waitpid(pid, NULL, 0);
}

int bench_wait_listening(int port, const char *unix_path, double timeout_s)
{
    double end = bench_now() + timeout_s;
    while (bench_now() < end) {
        int fd = unix_path != NULL ? bench_connect_unix(unix_path) : bench_connect_tcp(port);
        if (fd >= 0) {
            close(fd);
            return 0;
        }
        usleep(20000);
    }
    return -1;
}

int bench_read_port_file(const char *path)
{
    for (int i = 0; i < BENCH_PORT_FILE_TRIES; i++) {
        FILE *f = fopen(path, "r");
        if (f != NULL) {
            int port = -1;
            int n = fscanf(f, "%d", &port);
            fclose(f);
            if (n == 1 && port > 0)
                return port;
        }
        usleep(BENCH_PORT_FILE_POLL_US);
    }
    return -1;
}

pid_t bench_start_tensord(const char *who, const char *path, const char *dir, const char *tag,
                          int with_unix, bench_target *t)
{
    char port_file[256], log[256];
    snprintf(port_file, sizeof(port_file), "%s/%s.port", dir, tag);
    snprintf(log, sizeof(log), "%s/tensord.log", dir);
    t->unix_path[0] = '\0';
    if (with_unix)
        snprintf(t->unix_path, sizeof(t->unix_path), "%s/%s.sock", dir, tag);
    char *argv[] = {(char *)path,  "--port", "0",  "--port-file", port_file,
                    "--log-level", "warn",   NULL, NULL,          NULL};
    if (with_unix) {
        argv[7] = "--unix";
        argv[8] = t->unix_path;
    }
    pid_t pid = bench_spawn(argv, 0, log);
    t->port = pid > 0 ? bench_read_port_file(port_file) : -1;
    int up = t->port > 0 && (with_unix ? bench_wait_listening(0, t->unix_path, BENCH_START_S)
                                       : bench_wait_listening(t->port, NULL, BENCH_START_S)) == 0;
    if (!up) {
        fprintf(stderr, "%s: tensord (%s) did not start; see %s\n", who, path, log);
        bench_stop(pid);
        return -1;
    }
    return pid;
}

pid_t bench_start_redis(const char *who, const char *path, const char *dir, const char *tag,
                        int with_unix, bench_target *t)
{
    char port[16], log[256];
    t->port = bench_free_port();
    snprintf(port, sizeof(port), "%d", t->port);
    snprintf(log, sizeof(log), "%s/redis.log", dir);
    t->unix_path[0] = '\0';
    if (with_unix)
        snprintf(t->unix_path, sizeof(t->unix_path), "%s/%s.sock", dir, tag);
    /* No persistence: both daemons hold everything in memory only. */
    char *argv[] = {(char *)path, "--port",      port, "--bind",
                    "127.0.0.1",  "--save",      "",   "--appendonly",
                    "no",         "--daemonize", "no", "--protected-mode",
                    "no",         NULL,          NULL, NULL};
    if (with_unix) {
        argv[13] = "--unixsocket";
        argv[14] = t->unix_path;
    }
    pid_t pid = bench_spawn(argv, 0, log);
    if (pid < 0 || bench_wait_listening(t->port, NULL, BENCH_START_S) != 0 ||
        (with_unix && bench_wait_listening(0, t->unix_path, BENCH_START_S) != 0)) {
        fprintf(stderr, "%s: redis-server (%s) did not start; see %s\n", who, path, log);
        bench_stop(pid);
        return -1;
    }
    return pid;
}

/* A "Name:   123 kB" line of /proc/pid/status, in bytes, or -1. */
static long long status_field(pid_t pid, const char *name)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    char line[256];
    long long v = -1;
    size_t nl = strlen(name);
    while (fgets(line, sizeof(line), f) != NULL) {
        if (strncmp(line, name, nl) == 0 && line[nl] == ':') {
            v = strtoll(line + nl + 1, NULL, 10) * 1024;
            break;
        }
    }
    fclose(f);
    return v;
}

long long bench_rss(pid_t pid)
{
    return status_field(pid, "VmRSS");
}

long long bench_hwm(pid_t pid)
{
    return status_field(pid, "VmHWM");
}

int bench_reset_hwm(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/clear_refs", (int)pid);
    int fd = open(path, O_WRONLY);
    if (fd < 0)
        return -1;
    /* "5" resets the peak resident set size to the current one (Linux 4.0 and later). */
    int rc = write(fd, "5", 1) == 1 ? 0 : -1;
    close(fd);
    return rc;
}

void *bench_alloc(size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64) != 0)
        return NULL;
    memset(p, 0, n);
    return p;
}

void bench_free(void *p)
{
    free(p);
}

void bench_fill(void *buf, size_t len, int compressible, uint64_t seed)
{
    float *f = buf;
    size_t n = len / sizeof(float);
    uint64_t x = seed * 0x9E3779B97F4A7C15u + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if (compressible) {
            /*
             * Like a ReLU activation or a sparse gradient: three quarters zeros, the rest a few
             * distinct values.
             */
            f[i] = (x & 3) == 0 ? (float)((x >> 8) & 7) * 0.25f : 0.0f;
        } else {
            uint32_t bits = (uint32_t)(x >> 32);
            memcpy(&f[i], &bits, sizeof(bits));
        }
    }
    uint8_t *tail = (uint8_t *)buf + n * sizeof(float);
    for (size_t i = n * sizeof(float); i < len; i++)
        *tail++ = 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y ? 1 : 0;
}

double bench_percentile(double *v, size_t n, double pct)
{
    if (n == 0)
        return NAN;
    qsort(v, n, sizeof(*v), cmp_double);
    double pos = pct / 100.0 * (double)(n - 1);
    size_t lo = (size_t)pos;
    size_t hi = lo + 1 < n ? lo + 1 : lo;
    double frac = pos - (double)lo;
    return v[lo] + (v[hi] - v[lo]) * frac;
}

double bench_median(double *v, size_t n)
{
    return bench_percentile(v, n, 50.0);
}

double bench_cpu_self(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0)
        return 0;
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

double bench_ctxsw_self(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0)
        return 0;
    return (double)ru.ru_nvcsw + (double)ru.ru_nivcsw;
}

double bench_cpu_pid(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    /* Fields 14 and 15 (utime, stime) follow the command name, which ends at the last ')'. */
    char *p = strrchr(buf, ')');
    if (p == NULL)
        return 0;
    unsigned long long ut = 0, st = 0;
    if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return 0;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

void bench_print_machine(void)
{
    char model[256] = "unknown";
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f != NULL) {
        char buf[512];
        while (fgets(buf, sizeof(buf), f) != NULL) {
            if (strncmp(buf, "model name", 10) == 0) {
                char *p = strchr(buf, ':');
                if (p != NULL) {
                    p += 2;
                    p[strcspn(p, "\n")] = '\0';
                    snprintf(model, sizeof(model), "%s", p);
                }
                break;
            }
        }
        fclose(f);
    }
    struct utsname u;
    uname(&u);
    double load[3] = {0, 0, 0};
    if (getloadavg(load, 3) < 0)
        load[0] = -1;
    printf("machine: %ld CPUs, %s, Linux %s; load before the run %.2f %.2f %.2f\n",
           sysconf(_SC_NPROCESSORS_ONLN), model, u.release, load[0], load[1], load[2]);
}
