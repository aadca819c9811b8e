/*
 * bench_stall: how long one heavy request stops tensord from serving everybody else.
 *
 *   bench_stall [--tensord PATH] [--bins N] [--record-mb M] [--wait-conns C] [--waits W]
 *               [--skip list,save,validate,wake] [--no-pin]
 *
 * It starts tensord (pinned to cpu0 like tsbench, this process to cpu1) with --save into a
 * temporary directory, fills N small bins (1M by default), and then, for each case, runs one
 * heavy operation on one connection while a second connection sends PINGs one after the other.
 * It prints the worst PING round trip seen during the operation (the stall) and how long the
 * operation itself took; for LIST and SAVE also what tensord itself reports (STATS): the longest
 * loop turn spent walking views since start (view_turn_max_us), how many turns the walk took
 * (view_turns_last) and, for SAVE, the loop time of the whole walk (snapshot_loop_us). The
 * cases:
 *   list      one LIST of every bin
 *   save      one SAVE (a snapshot of every bin)
 *   validate  one PUT of a record holding one M MiB tensor (512 by default)
 *   wake      one PUT that answers C x W pending WAITs (100 x 1000 by default)
 * Every wait is bounded (socket timeouts, a deadline per case); tensord is stopped by pid.
 */
#define _GNU_SOURCE
#include "bench.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include "common.h"
#include "proto.h"
#include "record.h"
#include "tensorshare/tensorshare.h"

#ifndef TS_TENSORD_PATH
#define TS_TENSORD_PATH "tensord"
#endif

#define STALL_RCV_TIMEOUT_S 120   /* s; no reply takes longer, even for 1M-bin requests */
#define STALL_FILL_WINDOW   4096  /* PUTs in flight while filling */
#define STALL_PING_GAP_US   200   /* us between PINGs, so the pinger does not hog its CPU */
#define STALL_SETTLE_US     50000 /* us of PINGs before and after each operation */

static struct {
    const char *tensord;
    unsigned long bins;
    unsigned long record_mb;
    unsigned wait_conns;
    unsigned waits;
    const char *skip;
    char dir[64];
    int port;
    pid_t pid;
} g = {TS_TENSORD_PATH, 1000000ul, 512ul, 100u, 1000u, "", "", -1, -1};

static void die(const char *what)
{
    fprintf(stderr, "bench_stall: %s\n", what);
    if (g.pid > 0)
        bench_stop(g.pid);
    exit(1);
}

static int connect_hello(void)
{
    int fd = bench_connect_tcp(g.port);
    if (fd < 0)
        die("cannot connect");
    struct timeval tv = {.tv_sec = STALL_RCV_TIMEOUT_S};
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    return fd;
}

/* Append one request frame (header and body parts) to buf at *off; buf has room. */
static void frame(uint8_t *buf, size_t *off, uint8_t op, uint32_t rid, const void *a, size_t alen,
                  const void *b, size_t blen)
{
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .request_id = rid,
                 .body_len = alen + blen};
    ts__hdr_encode(&h, buf + *off);
    *off += TS_HDR_SIZE;
    if (alen > 0)
        memcpy(buf + *off, a, alen);
    *off += alen;
    if (blen > 0)
        memcpy(buf + *off, b, blen);
    *off += blen;
}

static void send_all(int fd, const void *p, size_t n)
{
    if (bench_write_all(fd, p, n, (size_t)4 << 20) != 0)
        die("write failed");
}

/* Read one reply; its body goes to *body (malloc'd, the caller frees) when body is not NULL. */
static void recv_reply(int fd, ts__hdr *h, uint8_t **body)
{
    uint8_t hb[TS_HDR_SIZE];
    if (bench_read_all(fd, hb, sizeof(hb)) != 0 || ts__hdr_decode(hb, TS_MAGIC_REP, h) != 0)
        die("bad or missing reply");
    if (h->body_len > ((uint64_t)1 << 34))
        die("reply too large");
    uint8_t *b = malloc(h->body_len > 0 ? (size_t)h->body_len : 1);
    if (b == NULL || bench_read_all(fd, b, (size_t)h->body_len) != 0)
        die("reply body missing");
    if (body != NULL)
        *body = b;
    else
        free(b);
}

static void request(int fd, uint8_t op, uint32_t rid, const void *body, size_t len, uint16_t want)
{
    uint8_t *buf = malloc(TS_HDR_SIZE + len);
    if (buf == NULL)
        die("out of memory");
    size_t off = 0;
    frame(buf, &off, op, rid, body, len, NULL, 0);
    send_all(fd, buf, off);
    free(buf);
    ts__hdr h;
    recv_reply(fd, &h, NULL);
    if (h.opcode != op || h.request_id != rid || h.status != want) {
        fprintf(stderr, "bench_stall: %s answered %s\n", ts__op_name(op),
                ts__status_name(h.status));
        die("unexpected reply");
    }
}

/* The server's STATS counter key (-1 when it has none). */
static long long server_stat(int fd, const char *key)
{
    uint8_t req[TS_HDR_SIZE];
    size_t off = 0;
    frame(req, &off, TS_OP_STATS, 99, NULL, 0, NULL, 0);
    send_all(fd, req, off);
    ts__hdr h;
    uint8_t *body = NULL;
    recv_reply(fd, &h, &body);
    long long v = -1;
    size_t len = (size_t)h.body_len;
    /* The decoder reads from an aligned buffer, which the rbuf owns and frees. */
    uint8_t *copy = h.status == TS_ST_OK && len > 0 ? ts__malloc_aligned(len) : NULL;
    ts__rbuf *rb = NULL;
    if (copy != NULL) {
        memcpy(copy, body, len);
        rb = ts__rbuf_new(copy, len, NULL);
        if (rb == NULL)
            ts__free_aligned(copy, len);
    }
    ts_value_t *root = rb != NULL ? ts__record_decode(rb, 0, len, TS_MAX_DEPTH, TS_MAX_NDIM) : NULL;
    int64_t x;
    if (root != NULL && ts_map_get_int(root, key, &x) == 0)
        v = (long long)x;
    if (root != NULL)
        ts__record_tree_free(root);
    if (rb != NULL)
        ts__rbuf_unref(rb);
    free(body);
    return v;
}

/* What tensord says of the views it walked: the longest loop turn and the last walk's turns. */
static void report_views(int fd, int save)
{
    printf("          tensord: longest loop turn walking views %lld us, last walk %lld turns",
           server_stat(fd, "view_turn_max_us"), server_stat(fd, "view_turns_last"));
    if (save)
        printf(", snapshot walk %lld us of loop time in all", server_stat(fd, "snapshot_loop_us"));
    printf("\n");
    fflush(stdout);
}

static int hello(int fd)
{
    uint8_t body[4] = {TS_PROTO_VERSION, 0, 0, 0};
    request(fd, TS_OP_HELLO, 1, body, sizeof(body), TS_ST_OK);
    return fd;
}

/* ---------------------------------------------------------------------------------------------
 * The pinger: PINGs one after the other on its own connection, keeping the worst round trip.
 */
static struct {
    pthread_t thr;
    int fd;
    atomic_int stop;
    double worst_ms;
    unsigned long n;
} pg;

static void *pinger(void *arg)
{
    (void)arg;
    bench_pin_self(1);
    uint8_t req[TS_HDR_SIZE];
    uint32_t rid = 1000;
    while (!atomic_load(&pg.stop)) {
        size_t off = 0;
        frame(req, &off, TS_OP_PING, ++rid, NULL, 0, NULL, 0);
        double t0 = bench_now();
        send_all(pg.fd, req, off);
        ts__hdr h;
        recv_reply(pg.fd, &h, NULL);
        double ms = (bench_now() - t0) * 1e3;
        if (ms > pg.worst_ms)
            pg.worst_ms = ms;
        pg.n++;
        usleep(STALL_PING_GAP_US);
    }
    return NULL;
}

static void pinger_start(void)
{
    pg.worst_ms = 0;
    pg.n = 0;
    atomic_store(&pg.stop, 0);
    if (pthread_create(&pg.thr, NULL, pinger, NULL) != 0)
        die("pthread_create");
    usleep(STALL_SETTLE_US);
}

static double pinger_stop(void)
{
    usleep(STALL_SETTLE_US);
    atomic_store(&pg.stop, 1);
    pthread_join(pg.thr, NULL);
    return pg.worst_ms;
}

static int skipped(const char *name)
{
    const char *p = strstr(g.skip, name);
    return p != NULL && (p == g.skip || p[-1] == ',');
}

static void report(const char *name, double op_ms, double worst)
{
    printf("%-9s worst PING round trip %9.1f ms   (operation %9.1f ms, %lu pings)\n", name, worst,
           op_ms, pg.n);
    fflush(stdout);
}

/* ---------------------------------------------------------------------------------------------
 * Setup and the cases
 */
static uint8_t *small_record(size_t *len)
{
    ts_value_t *v = ts_int_new(42);
    uint8_t *rec = NULL;
    if (v == NULL || ts__record_encode(v, &rec, len) != 0)
        die("cannot encode a record");
    ts_value_free(v);
    return rec;
}

static void fill(int fd)
{
    size_t rlen;
    uint8_t *rec = small_record(&rlen);
    size_t cap = STALL_FILL_WINDOW * (TS_HDR_SIZE + 1 + 16 + rlen);
    uint8_t *buf = malloc(cap);
    if (buf == NULL)
        die("out of memory");
    double t0 = bench_now();
    for (unsigned long i = 0; i < g.bins;) {
        size_t off = 0;
        unsigned long n = 0;
        for (; n < STALL_FILL_WINDOW && i < g.bins; n++, i++) {
            uint8_t name[17];
            int nl = snprintf((char *)name + 1, 16, "b%09lu", i);
            name[0] = (uint8_t)nl;
            frame(buf, &off, TS_OP_PUT, (uint32_t)(i + 1), name, (size_t)nl + 1, rec, rlen);
        }
        send_all(fd, buf, off);
        for (unsigned long k = 0; k < n; k++) {
            ts__hdr h;
            recv_reply(fd, &h, NULL);
            if (h.status != TS_ST_OK)
                die("a PUT while filling failed");
        }
    }
    printf("filled %lu bins in %.1f s\n", g.bins, bench_now() - t0);
    free(buf);
    ts__free_aligned(rec, rlen);
}

static void case_list(int fd)
{
    pinger_start();
    double t0 = bench_now();
    uint8_t *body = NULL;
    size_t off = 0;
    uint8_t req[TS_HDR_SIZE];
    frame(req, &off, TS_OP_LIST, 7, NULL, 0, NULL, 0);
    send_all(fd, req, off);
    ts__hdr h;
    recv_reply(fd, &h, &body);
    double op = (bench_now() - t0) * 1e3;
    double worst = pinger_stop();
    if (h.status != TS_ST_OK || h.body_len < 8 || ts__get_u32le(body) != g.bins)
        die("LIST did not list every bin");
    free(body);
    report("list", op, worst);
    report_views(fd, 0);
}

static void case_save(int fd)
{
    pinger_start();
    double t0 = bench_now();
    request(fd, TS_OP_SAVE, 8, NULL, 0, TS_ST_OK);
    double op = (bench_now() - t0) * 1e3;
    report("save", op, pinger_stop());
    report_views(fd, 1);
}

static void case_validate(int fd)
{
    size_t n = (size_t)g.record_mb << 20;
    uint8_t *data = calloc(1, n);
    int64_t shape[1] = {(int64_t)n};
    ts_value_t *m = ts_map_new();
    if (data == NULL || m == NULL ||
        ts_map_set(m, "t", ts_tensor_new(TS_UINT8, 1, shape, data, TS_BORROW)) != 0)
        die("cannot build the large record");
    uint8_t *rec = NULL;
    size_t rlen = 0;
    if (ts__record_encode(m, &rec, &rlen) != 0)
        die("cannot encode the large record");
    ts_value_free(m);
    free(data);
    uint8_t name[4] = {3, 'b', 'i', 'g'};
    uint8_t hb[TS_HDR_SIZE];
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = TS_OP_PUT,
                 .request_id = 9,
                 .body_len = sizeof(name) + rlen};
    ts__hdr_encode(&h, hb);
    pinger_start();
    double t0 = bench_now();
    send_all(fd, hb, sizeof(hb));
    send_all(fd, name, sizeof(name));
    send_all(fd, rec, rlen);
    recv_reply(fd, &h, NULL);
    double op = (bench_now() - t0) * 1e3;
    double worst = pinger_stop();
    if (h.status != TS_ST_OK)
        die("the large PUT failed");
    ts__free_aligned(rec, rlen);
    report("validate", op, worst);
    request(fd, TS_OP_DELETE, 10, name, sizeof(name), TS_ST_OK);
}

static void case_wake(int fd)
{
    int *w = calloc(g.wait_conns, sizeof(int));
    uint8_t body[1 + 4 + 8 + 4] = {4, 'w', 'a', 'k', 'e'};
    ts__put_u64le(body + 5, 0);
    ts__put_u32le(body + 13, 60000);
    size_t cap = (size_t)g.waits * (TS_HDR_SIZE + sizeof(body)) + TS_HDR_SIZE;
    uint8_t *buf = malloc(cap);
    if (w == NULL || buf == NULL)
        die("out of memory");
    for (unsigned k = 0; k < g.wait_conns; k++) {
        w[k] = hello(connect_hello());
        size_t off = 0;
        for (unsigned i = 0; i < g.waits; i++)
            frame(buf, &off, TS_OP_WAIT, 10 + i, body, sizeof(body), NULL, 0);
        send_all(w[k], buf, off);
        request(w[k], TS_OP_PING, 5, NULL, 0, TS_ST_OK); /* every WAIT is parked now */
    }
    size_t rlen;
    uint8_t *rec = small_record(&rlen);
    size_t off = 0;
    uint8_t *put = malloc(TS_HDR_SIZE + sizeof(body) + rlen);
    if (put == NULL)
        die("out of memory");
    frame(put, &off, TS_OP_PUT, 11, body, 5, rec, rlen);
    pinger_start();
    double t0 = bench_now();
    send_all(fd, put, off);
    ts__hdr h;
    recv_reply(fd, &h, NULL);
    for (unsigned k = 0; k < g.wait_conns; k++) {
        for (unsigned i = 0; i < g.waits; i++) {
            recv_reply(w[k], &h, NULL);
            if (h.opcode != TS_OP_WAIT || h.status != TS_ST_OK)
                die("a WAIT was not answered OK");
        }
    }
    double op = (bench_now() - t0) * 1e3;
    report("wake", op, pinger_stop());
    for (unsigned k = 0; k < g.wait_conns; k++)
        close(w[k]);
    free(w);
    free(buf);
    free(put);
    ts__free_aligned(rec, rlen);
}

/* Remove the files tensord left in the temporary directory (one level), then the directory. */
static void remove_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (d != NULL) {
        struct dirent *e;
        char path[512];
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
                continue;
            snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
            (void)unlink(path);
        }
        closedir(d);
    }
    if (rmdir(dir) != 0)
        fprintf(stderr, "bench_stall: could not remove %s\n", dir);
}

static unsigned long arg_num(const char *s)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno != 0 || *end != '\0' || v == 0)
        die("bad number");
    return v;
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--no-pin") == 0) {
            bench_set_pinning(0);
            continue;
        }
        if (v == NULL) {
            fprintf(stderr, "usage: bench_stall [--tensord PATH] [--bins N] [--record-mb M] "
                            "[--wait-conns C] [--waits W] [--skip list,save,validate,wake] "
                            "[--no-pin]\n");
            return 2;
        }
        i++;
        if (strcmp(a, "--tensord") == 0)
            g.tensord = v;
        else if (strcmp(a, "--bins") == 0)
            g.bins = arg_num(v);
        else if (strcmp(a, "--record-mb") == 0)
            g.record_mb = arg_num(v);
        else if (strcmp(a, "--wait-conns") == 0)
            g.wait_conns = (unsigned)arg_num(v);
        else if (strcmp(a, "--waits") == 0)
            g.waits = (unsigned)arg_num(v);
        else if (strcmp(a, "--skip") == 0)
            g.skip = v;
        else
            die("unknown flag");
    }
    snprintf(g.dir, sizeof(g.dir), "/tmp/bench_stall.XXXXXX");
    if (mkdtemp(g.dir) == NULL)
        die("mkdtemp");
    char port_file[128], snap[128], log[128];
    snprintf(port_file, sizeof(port_file), "%s/port", g.dir);
    snprintf(snap, sizeof(snap), "%s/snap.tsd", g.dir);
    snprintf(log, sizeof(log), "%s/tensord.log", g.dir);
    char *targv[] = {
        (char *)g.tensord, "--port", "0",           "--port-file", port_file, "--save", snap,
        "--save-interval", "0",      "--log-level", "warn",        NULL};
    g.pid = bench_spawn(targv, 0, log);
    for (int i = 0; i < 1500 && g.port < 0 && g.pid > 0; i++) {
        FILE *f = fopen(port_file, "r");
        if (f != NULL) {
            if (fscanf(f, "%d", &g.port) != 1)
                g.port = -1;
            fclose(f);
        }
        if (g.port < 0)
            usleep(10000);
    }
    if (g.port <= 0 || bench_wait_listening(g.port, NULL, 15) != 0)
        die("tensord did not start");
    bench_pin_self(1);
    printf("bench_stall: tensord %s, %lu bins, pinned: %s\n", g.tensord, g.bins,
           bench_pinning() ? "yes" : "no");
    int fd = hello(connect_hello());
    pg.fd = hello(connect_hello());
    fill(fd);
    if (!skipped("list"))
        case_list(fd);
    if (!skipped("save"))
        case_save(fd);
    if (!skipped("validate"))
        case_validate(fd);
    if (!skipped("wake"))
        case_wake(fd);
    close(fd);
    close(pg.fd);
    bench_stop(g.pid);
    remove_dir(g.dir);
    return 0;
}
