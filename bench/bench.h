/*
 * tsbench: tensord measured against a plain socket client/server (the ceiling) and Redis, in one
 * run. This header is shared by the benchmark's files:
 *   tsbench.c        the driver: servers, alternation, medians, the table
 *   bench_util.c     clocks, sockets, pinning, child processes, /proc readings
 *   bench_ceiling.c  the ceiling: a plain blocking client/server doing the same transfers
 *   bench_redis.c    a minimal RESP client (no hiredis) doing the same operations on Redis
 *   bench_ts.c       the same operations through libtensorshare on tensord
 * Nothing here is a test: the numbers are only meaningful as ratios taken in the same run.
 */
#ifndef TS_BENCH_H
#define TS_BENCH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Where a system under test listens. */
typedef struct bench_target {
    int port;            /* TCP port on 127.0.0.1 */
    char unix_path[256]; /* unix socket path */
} bench_target;

/* What one run of a case measured. */
typedef struct bench_result {
    int ok;        /* 1 when the run completed */
    double value;  /* the case's main figure: seconds per round, ops/s, or microseconds */
    double value2; /* a second figure where the case has one (p99 latency), else 0 */
} bench_result;

/* ---------------------------------------------------------------------------------------------
 * bench_util.c
 */
/* Monotonic clock in seconds. */
double bench_now(void);
/* Monotonic clock in nanoseconds. */
uint64_t bench_now_ns(void);
/* Sleep until the monotonic clock reaches t_ns. */
void bench_sleep_until_ns(uint64_t t_ns);
/* Pin the calling thread to one CPU (ignored when pinning is off or the CPU is missing). */
void bench_pin_self(int cpu);
/* Turn pinning off (machines with one CPU, or --no-pin). */
void bench_set_pinning(int on);
int bench_pinning(void);
/* A blocking TCP connection to 127.0.0.1:port with TCP_NODELAY, or -1. */
int bench_connect_tcp(int port);
/* A blocking unix-socket connection, or -1. */
int bench_connect_unix(const char *path);
/* Connect to t over TCP (use_unix == 0) or its unix socket. -1 on failure. */
int bench_connect(const bench_target *t, int use_unix);
/* Write or read exactly len bytes, in pieces of at most chunk bytes (0 = no limit). 0 or -1. */
int bench_write_all(int fd, const void *buf, size_t len, size_t chunk);
int bench_read_all(int fd, void *buf, size_t len);
/* A TCP port that was free a moment ago (for servers that cannot report the one they took). */
int bench_free_port(void);
/*
 * Start argv[0] (a path) with its arguments, pinned to cpu (when pinning), stdout and stderr to
 * log_path (or inherited when NULL). Returns the pid or -1.
 */
pid_t bench_spawn(char *const argv[], int cpu, const char *log_path);
/* SIGTERM, wait up to 10 s, then SIGKILL; reaps the child. */
void bench_stop(pid_t pid);
/* Wait up to timeout_s for a connection to succeed (TCP port, or unix path when non-NULL). */
int bench_wait_listening(int port, const char *unix_path, double timeout_s);
/* s; how long a started server may take to listen */
#define BENCH_START_S 15.0
/* How often and how many times a port file is looked at: every 10 ms for 15 s. */
#define BENCH_PORT_FILE_POLL_US 10000
#define BENCH_PORT_FILE_TRIES   1500
/* Wait up to 15 s for a file holding a port number. Returns the port or -1. */
int bench_read_port_file(const char *path);
/*
 * Start tensord (path) pinned to cpu 0 on an ephemeral TCP port, with its port file
 * dir/<tag>.port and, when with_unix, the unix socket dir/<tag>.sock; it logs to
 * dir/tensord.log. Fills t once it listens and returns its pid; -1 (a line on stderr that starts
 * with who) when it did not start within BENCH_START_S. Stop it with bench_stop.
 */
pid_t bench_start_tensord(const char *who, const char *path, const char *dir, const char *tag,
                          int with_unix, bench_target *t);
/*
 * Start redis-server (path) the same way, without persistence: a free TCP port on 127.0.0.1
 * and, when with_unix, the unix socket dir/<tag>.sock; it logs to dir/redis.log.
 */
pid_t bench_start_redis(const char *who, const char *path, const char *dir, const char *tag,
                        int with_unix, bench_target *t);
/* VmRSS / VmHWM of a process in bytes, or -1. */
long long bench_rss(pid_t pid);
long long bench_hwm(pid_t pid);
/* Reset a process's peak resident size (VmHWM) to its current size. 0 or -1. */
int bench_reset_hwm(pid_t pid);
/* 64-byte aligned, touched (pre-faulted) memory; free with bench_free. NULL on failure. */
void *bench_alloc(size_t n);
void bench_free(void *p);
/* Fill buf with float32 values: random bits (incompressible) or a compressible pattern. */
void bench_fill(void *buf, size_t len, int compressible, uint64_t seed);
/* CPU time (user + system) in seconds used so far by this process, or by process pid. */
double bench_cpu_self(void);
double bench_cpu_pid(pid_t pid);
/* Context switches (voluntary and not) of this process so far, all threads. */
double bench_ctxsw_self(void);
/* Print "machine: CPUs, model, kernel, load" on stdout, the first line of a bench's report. */
void bench_print_machine(void);
/* Median and percentile of v[0..n) (sorts v). */
double bench_median(double *v, size_t n);
double bench_percentile(double *v, size_t n, double pct);

/* ---------------------------------------------------------------------------------------------
 * bench_ceiling.c
 *
 * Wire (both directions raw): 'P' u64 len, then len bytes; the server answers one byte.
 * 'G' u64 len: the server sends len bytes of its buffer back. 'Q': the server ends the
 * connection. The server reads into one 64-byte aligned buffer it reuses, writes in 4 MiB pieces.
 */
/*
 * Run the ceiling server until killed: TCP on an ephemeral port (written to port_file once
 * listening) and unix_path; one thread per connection. Returns only on a setup error.
 */
int ceiling_serve(const char *port_file, const char *unix_path);
/* One run: iters rounds of put-then-get of size bytes; value = seconds per round. */
bench_result ceiling_putget(const bench_target *t, int use_unix, size_t size, int iters);

/* ---------------------------------------------------------------------------------------------
 * bench_redis.c
 */
/* One run of SET then GET of size bytes: value = seconds per round. */
bench_result redis_putget(const bench_target *t, int use_unix, size_t size, int iters);
/* 64-byte SET/GET pairs for secs seconds: nclients connections, pipeline depth (1 = blocking). */
bench_result redis_small(const bench_target *t, int use_unix, int nclients, int depth, double secs);
/* PUBLISH to a subscriber, n messages paced every period_us: value p50 us, value2 p99 us. */
bench_result redis_notify(const bench_target *t, int use_unix, int n, int period_us);
/* Store total bytes as items of size bytes (distinct keys). 0 or -1. */
int redis_store(const bench_target *t, size_t size, size_t total);
/* SET one key of size bytes. 0 or -1. */
int redis_set_one(const bench_target *t, const char *key, size_t size);

/* ---------------------------------------------------------------------------------------------
 * bench_ts.c
 */
/* One run of ts_put then ts_get of one float32 tensor of size bytes: seconds per round. */
bench_result ts_bench_putget(const bench_target *t, int use_unix, size_t size, int iters,
                             size_t compress_min, int compressible);
/* 64-byte put/get pairs for secs seconds: nclients clients, depth requests in flight each. */
bench_result ts_bench_small(const bench_target *t, int use_unix, int nclients, int depth,
                            double secs);
/* Put to listener callback latency, n puts paced every period_us: p50 us, p99 us. */
bench_result ts_bench_notify(const bench_target *t, int use_unix, int n, int period_us);
/*
 * Store total bytes as tensors of size bytes: one bin each ("m:0", "m:1", ...) when per_bin <= 1,
 * else appended per_bin to a bin. 0 or -1.
 */
int ts_bench_store(const bench_target *t, size_t size, size_t total, size_t per_bin);
/* The record bytes tensord holds, from its LIST (tensors with their record headers); -1. */
double ts_bench_held_records(const bench_target *t);
/* Put one tensor of size bytes into bin name. 0 or -1. */
int ts_bench_put_one(const bench_target *t, const char *name, size_t size);

#endif /* TS_BENCH_H */
