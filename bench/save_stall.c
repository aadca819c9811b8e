/*
 * save_stall: how long SAVE stalls every other client of a tensord holding many small bins.
 *
 * It starts tensord (with --save in a temporary directory), fills N one-item bins (default
 * 1000000) over one pipelined connection, then, for each of a few rounds, changes one bin and
 * sends SAVE on a second connection while a third one does PING round trips back to back. It
 * prints the longest PING round trip before SAVE (the baseline) and while the snapshot is taken,
 * written and released (from SAVE until 500 ms after its reply).
 *
 *   save_stall [N_BINS] [ROUNDS]        (TS_TENSORD overrides the daemon's path)
 */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "proto.h"
#include "record.h"
#include "tensorshare/tensorshare.h"

#define PIPELINE   4096 /* PUTs in flight while filling */
#define TAIL_MS    500  /* ms of PINGs measured after the SAVE reply (reference drops) */
#define BASE_MS    1000 /* ms of PINGs measured before SAVE */
#define START_WAIT 15000

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void die(const char *what)
{
    fprintf(stderr, "save_stall: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void write_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n > 0) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            die("write");
        b += w;
        n -= (size_t)w;
    }
}

static void read_all(int fd, void *p, size_t n)
{
    uint8_t *b = p;
    while (n > 0) {
        ssize_t r = read(fd, b, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            die("read");
        b += r;
        n -= (size_t)r;
    }
}

static void send_frame(int fd, uint8_t op, uint32_t rid, const void *body, size_t len)
{
    ts__hdr h = {.magic = TS_MAGIC_REQ, .version = TS_PROTO_VERSION, .opcode = op,
                 .request_id = rid, .body_len = len};
    uint8_t hb[TS_HDR_SIZE];
    ts__hdr_encode(&h, hb);
    write_all(fd, hb, sizeof(hb));
    if (len > 0)
        write_all(fd, body, len);
}

/* Read one reply, drop its body; returns its status. */
static uint16_t recv_reply(int fd)
{
    uint8_t hb[TS_HDR_SIZE];
    read_all(fd, hb, sizeof(hb));
    ts__hdr h;
    if (ts__hdr_decode(hb, TS_MAGIC_REP, &h) != 0) {
        fprintf(stderr, "save_stall: bad reply header\n");
        exit(1);
    }
    uint8_t buf[4096];
    uint64_t left = h.body_len;
    while (left > 0) {
        size_t k = left > sizeof(buf) ? sizeof(buf) : (size_t)left;
        read_all(fd, buf, k);
        left -= k;
    }
    return h.status;
}

static int client(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        die("socket");
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0)
        die("connect");
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    uint8_t hello[4] = {TS_PROTO_VERSION, 0, 0, 0};
    send_frame(fd, TS_OP_HELLO, 1, hello, sizeof(hello));
    if (recv_reply(fd) != TS_ST_OK) {
        fprintf(stderr, "save_stall: HELLO refused\n");
        exit(1);
    }
    return fd;
}

/* A PUT body: u8 name length, name, the record of int v. */
static size_t put_body(uint8_t *out, size_t cap, const char *name, int64_t v)
{
    ts_value_t *x = ts_int_new(v);
    uint8_t *rec = NULL;
    size_t len = 0;
    if (x == NULL || ts__record_encode(x, &rec, &len) != 0)
        die("encode");
    ts_value_free(x);
    size_t nl = strlen(name);
    if (1 + nl + len > cap)
        die("body");
    out[0] = (uint8_t)nl;
    memcpy(out + 1, name, nl);
    memcpy(out + 1 + nl, rec, len);
    ts__free_aligned(rec, len);
    return 1 + nl + len;
}

typedef struct pinger {
    int fd;
    atomic_int stop;
    atomic_uint_fast64_t max_ns; /* longest round trip since the last reset */
    atomic_uint_fast64_t count;
} pinger;

static void *ping_loop(void *arg)
{
    pinger *p = arg;
    uint32_t rid = 100;
    while (!atomic_load(&p->stop)) {
        uint64_t t0 = now_ns();
        send_frame(p->fd, TS_OP_PING, rid++, NULL, 0);
        (void)recv_reply(p->fd);
        uint64_t dt = now_ns() - t0;
        uint64_t m = atomic_load(&p->max_ns);
        while (dt > m && !atomic_compare_exchange_weak(&p->max_ns, &m, dt))
            ;
        atomic_fetch_add(&p->count, 1);
    }
    return NULL;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

int main(int argc, char **argv)
{
    long n_bins = argc > 1 ? strtol(argv[1], NULL, 10) : 1000000;
    int rounds = argc > 2 ? (int)strtol(argv[2], NULL, 10) : 3;
    if (n_bins < 1 || rounds < 1) {
        fprintf(stderr, "usage: save_stall [N_BINS] [ROUNDS]\n");
        return 2;
    }
    const char *bin = getenv("TS_TENSORD");
    if (bin == NULL || bin[0] == '\0')
        bin = TS_TENSORD_PATH;
    char dir[] = "/tmp/save_stall.XXXXXX";
    if (mkdtemp(dir) == NULL)
        die("mkdtemp");
    char snap[64], portf[64];
    snprintf(snap, sizeof(snap), "%s/snap", dir);
    snprintf(portf, sizeof(portf), "%s/port", dir);
    pid_t pid = fork();
    if (pid < 0)
        die("fork");
    if (pid == 0) {
        execl(bin, bin, "--port", "0", "--port-file", portf, "--save", snap, "--save-interval", "0",
              "--max-memory", "0", "--log-level", "warn", (char *)NULL);
        _exit(127);
    }
    int port = 0;
    for (int i = 0; i < START_WAIT / 10 && port == 0; i++) {
        FILE *f = fopen(portf, "r");
        if (f != NULL) {
            if (fscanf(f, "%d", &port) != 1)
                port = 0;
            fclose(f);
        }
        if (port == 0)
            sleep_ms(10);
    }
    if (port == 0) {
        fprintf(stderr, "save_stall: tensord did not start\n");
        kill(pid, SIGKILL);
        return 1;
    }

    /* Fill. */
    int wfd = client(port);
    uint64_t t0 = now_ns();
    long sent = 0, got = 0;
    uint8_t body[256];
    while (got < n_bins) {
        while (sent < n_bins && sent - got < PIPELINE) {
            char name[32];
            snprintf(name, sizeof(name), "bin/%07ld", sent);
            size_t len = put_body(body, sizeof(body), name, sent);
            send_frame(wfd, TS_OP_PUT, (uint32_t)sent, body, len);
            sent++;
        }
        if (recv_reply(wfd) != TS_ST_OK) {
            fprintf(stderr, "save_stall: a PUT failed\n");
            kill(pid, SIGKILL);
            return 1;
        }
        got++;
    }
    printf("filled %ld one-item bins in %.2f s\n", n_bins, (double)(now_ns() - t0) / 1e9);

    int sfd = client(port);
    char addr[32];
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);
    ts_client_t *sc = NULL;
    if (ts_client_open(&sc, addr, NULL) != 0)
        die("ts_client_open");
    pinger p = {.fd = client(port)};
    pthread_t th;
    if (pthread_create(&th, NULL, ping_loop, &p) != 0)
        die("pthread_create");
    uint64_t worst = 0;
    for (int r = 0; r < rounds; r++) {
        /* A change, so that SAVE really writes. */
        size_t len = put_body(body, sizeof(body), "changed", r);
        send_frame(wfd, TS_OP_PUT, 1, body, len);
        (void)recv_reply(wfd);
        atomic_store(&p.max_ns, 0);
        sleep_ms(BASE_MS);
        uint64_t base = atomic_load(&p.max_ns);
        atomic_store(&p.max_ns, 0);
        uint64_t pings0 = atomic_load(&p.count);
        uint64_t s0 = now_ns();
        send_frame(sfd, TS_OP_SAVE, 2, NULL, 0);
        uint16_t st = recv_reply(sfd);
        uint64_t save_ns = now_ns() - s0;
        sleep_ms(TAIL_MS);
        uint64_t during = atomic_load(&p.max_ns);
        uint64_t pings = atomic_load(&p.count) - pings0;
        if (during > worst)
            worst = during;
        /* The loop's own share: the time it spent taking the snapshot's references. */
        int64_t loop_us = -1;
        ts_value_t *stats = NULL;
        if (ts_stats(sc, &stats) == 0)
            (void)ts_map_get_int(stats, "snapshot_loop_us", &loop_us);
        ts_value_free(stats);
        printf("round %d: SAVE %s in %.0f ms; longest PING round trip: %.2f ms before SAVE, "
               "%.2f ms during it (%llu PINGs); the loop's snapshot pass: %.2f ms\n",
               r + 1, st == TS_ST_OK ? "ok" : ts__status_name(st), (double)save_ns / 1e6,
               (double)base / 1e6, (double)during / 1e6, (unsigned long long)pings,
               (double)loop_us / 1e3);
    }
    atomic_store(&p.stop, 1);
    pthread_join(th, NULL);
    printf("worst PING round trip during SAVE with %ld bins: %.2f ms\n", n_bins,
           (double)worst / 1e6);
    ts_client_free(sc);
    close(p.fd);
    close(sfd);
    close(wfd);
    kill(pid, SIGTERM);
    int status = 0;
    waitpid(pid, &status, 0);
    char lock[80];
    snprintf(lock, sizeof(lock), "%s.lock", snap);
    unlink(lock);
    unlink(snap);
    unlink(portf);
    rmdir(dir);
    return 0;
}
