/*
 * Fuzz target: a real ts_client_t reading what a hostile server sends, on both of its read
 * paths (a blocking caller reading its own reply, and the I/O thread; docs/THREADING.md). An
 * in-process fake server on a unix socket completes HELLO, reads the client's one request and
 * answers it with the fuzz input, then closes the connection, so that every input ends (with a
 * result, TS_EPROTO or TS_ECONNRESET) without waiting for a deadline.
 *
 * Input: byte 0 picks the call and how it is answered, the rest is the server's bytes:
 *   bits 0-2  the blocking call (see ops below)
 *   bit 3     the I/O thread reads (TS_CLIENT_DIRECT=0), else the caller may read itself
 *   bit 4     write the request's own id over bytes 8..11 of the answer (a frame header's id),
 *             so that inputs reach the reply parsers whatever ids the client picks
 *   bit 5     HELLO grants lz4 (compressed replies are allowed)
 *   bit 6     the answer goes out in two writes, 1 ms apart (a reply split across reads)
 * Properties: no crash, leak or sanitizer report; results only on success; the call returns
 * within its request timeout.
 */
#include "fuzz.h"

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* ms; every wait of one input is bounded by these (the answer itself needs no waiting) */
#define FZC_REQUEST_MS 2000
#define FZC_IO_MS      1000
#define FZC_MAX_BODY   4096 /* bytes; the requests here have small bodies */

enum { OP_PING, OP_GET, OP_PEEK, OP_PUT, OP_DELETE, OP_LIST, OP_STATS, OP_WAIT };

/* The fake server: one connection per input, served by a thread that lives for the process. */
typedef struct fzc_server {
    int lfd;
    char path[108];
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cond;
    const uint8_t *data; /* the answer of the current input (under mu) */
    size_t size;
    int flags;  /* the selector byte */
    int served; /* connections served (under mu) */
} fzc_server;

static fzc_server srv;
static ts_value_t *put_item;

static int write_all(int fd, const uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k <= 0)
            return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static int read_all(int fd, uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t k = recv(fd, p, n, 0);
        if (k <= 0)
            return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Read one request frame; 0 and its header, or -1. */
static int read_request(int fd, ts__hdr *h)
{
    uint8_t hb[TS_HDR_SIZE];
    static uint8_t body[FZC_MAX_BODY];
    if (read_all(fd, hb, sizeof(hb)) != 0 || ts__hdr_decode(hb, TS_MAGIC_REQ, h) != 0 ||
        h->body_len > FZC_MAX_BODY)
        return -1;
    return read_all(fd, body, (size_t)h->body_len);
}

static void serve(int fd, const uint8_t *data, size_t size, int flags)
{
    struct timeval tv = {0, FZC_IO_MS * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    ts__hdr h;
    if (read_request(fd, &h) != 0 || h.opcode != TS_OP_HELLO)
        return;
    uint8_t hb[TS_HDR_SIZE + TS_MSG_HELLO_REP_SIZE];
    ts__hdr rh = {.magic = TS_MAGIC_REP,
                  .version = TS_PROTO_VERSION,
                  .opcode = TS_OP_HELLO,
                  .request_id = h.request_id,
                  .body_len = TS_MSG_HELLO_REP_SIZE};
    ts__hdr_encode(&rh, hb);
    ts__msg_hello_rep rep = {.version = TS_PROTO_VERSION,
                             .flags = (flags & 0x20) ? TS_HELLO_LZ4 : 0,
                             .max_body = 1u << 20};
    size_t n;
    if (ts__msg_hello_rep_encode(hb + TS_HDR_SIZE, TS_MSG_HELLO_REP_SIZE, &rep, &n) != 0)
        abort();
    if (write_all(fd, hb, sizeof(hb)) != 0 || read_request(fd, &h) != 0)
        return;
    uint8_t *out = malloc(size > 0 ? size : 1);
    if (out == NULL)
        abort();
    memcpy(out, data, size);
    if ((flags & 0x10) && size >= 12)
        ts__put_u32le(out + 8, h.request_id);
    size_t first = (flags & 0x40) ? size / 2 : size;
    if (write_all(fd, out, first) == 0 && first < size) {
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
        write_all(fd, out + first, size - first);
    }
    free(out);
}

static void *server_main(void *arg)
{
    (void)arg;
    for (;;) {
        int fd = accept(srv.lfd, NULL, NULL);
        if (fd < 0)
            continue;
        pthread_mutex_lock(&srv.mu);
        const uint8_t *data = srv.data;
        size_t size = srv.size;
        int flags = srv.flags;
        pthread_mutex_unlock(&srv.mu);
        if (data != NULL)
            serve(fd, data, size, flags);
        close(fd); /* the end of the answer: the client stops waiting */
        pthread_mutex_lock(&srv.mu);
        srv.served++;
        pthread_cond_broadcast(&srv.cond);
        pthread_mutex_unlock(&srv.mu);
    }
    return NULL;
}

static void setup(void)
{
    signal(SIGPIPE, SIG_IGN);
    snprintf(srv.path, sizeof(srv.path), "/tmp/ts-fuzz-client-%d.sock", (int)getpid());
    unlink(srv.path);
    srv.lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    memcpy(a.sun_path, srv.path, strlen(srv.path) + 1);
    if (srv.lfd < 0 || bind(srv.lfd, (struct sockaddr *)&a, sizeof(a)) != 0 ||
        listen(srv.lfd, 4) != 0) {
        perror("fuzz_client_read: listen");
        abort();
    }
    pthread_mutex_init(&srv.mu, NULL);
    pthread_cond_init(&srv.cond, NULL);
    if (pthread_create(&srv.thread, NULL, server_main, NULL) != 0)
        abort();
    pthread_detach(srv.thread);
    put_item = ts_int_new(7);
    if (put_item == NULL)
        abort();
}

/* Until the caller-side path holds the socket free (bounded): then the call reads itself. */
static void wait_reading_free(ts_client_t *c)
{
    for (int i = 0; i < 200; i++) {
        pthread_mutex_lock(&c->mu);
        int free_side = c->rd_owner == TS__RD_FREE;
        pthread_mutex_unlock(&c->mu);
        if (free_side)
            return;
        struct timespec t = {0, 100000};
        nanosleep(&t, NULL);
    }
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static int call(ts_client_t *c, int op)
{
    ts_items_t *items = NULL;
    ts_bin_list_t *bins = NULL;
    ts_value_t *stats = NULL;
    int rc;
    switch (op) {
    case OP_GET:
        rc = ts_get(c, "b", 0, &items);
        break;
    case OP_PEEK:
        rc = ts_peek(c, "b", 3, &items);
        break;
    case OP_PUT:
        rc = ts_put(c, "b", put_item, NULL);
        break;
    case OP_DELETE:
        rc = ts_delete(c, "b", NULL);
        break;
    case OP_LIST:
        rc = ts_list(c, &bins);
        break;
    case OP_STATS:
        rc = ts_stats(c, &stats);
        break;
    case OP_WAIT:
        rc = ts_wait(c, "b", 0, 100, NULL, NULL);
        break;
    default:
        rc = ts_ping(c);
        break;
    }
    if (rc != 0)
        FZ_CHECK(items == NULL && bins == NULL && stats == NULL);
    /* Touch what the results hold. */
    for (size_t i = 0; i < ts_items_count(items); i++)
        FZ_CHECK(ts_items_at(items, i) != NULL);
    for (size_t i = 0; bins != NULL && i < bins->count; i++)
        FZ_CHECK(strlen(bins->bins[i].name) <= TS_MAX_NAME_LEN);
    ts_items_free(items);
    ts_bin_list_free(bins);
    ts_value_free(stats);
    return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int ready;
    if (!ready) {
        setup();
        ready = 1;
    }
    if (size < 1)
        return 0;
    int flags = data[0];
    /* No client lives now: no I/O thread reads the environment while it changes. */
    setenv("TS_CLIENT_DIRECT", (flags & 0x08) ? "0" : "1", 1);
    pthread_mutex_lock(&srv.mu);
    srv.data = data + 1;
    srv.size = size - 1;
    srv.flags = flags;
    int served = srv.served;
    pthread_mutex_unlock(&srv.mu);

    ts_client_options_t o;
    ts_client_options_init(&o);
    o.connect_timeout_ms = FZC_IO_MS;
    o.request_timeout_ms = FZC_REQUEST_MS;
    o.reconnect_min_ms = 60000; /* no second connection during the input */
    o.reconnect_max_ms = 60000;
    o.compress_min = (flags & 0x20) ? 64 : 0; /* asks for lz4 */
    o.max_reply_bytes = 1 << 20;
    char addr[128];
    snprintf(addr, sizeof(addr), "unix:%s", srv.path);
    ts_client_t *c = NULL;
    if (ts_client_open(&c, addr, &o) == 0) {
        if (!(flags & 0x08))
            wait_reading_free(c);
        uint64_t t0 = now_ms();
        (void)call(c, flags & 7);
        FZ_CHECK(now_ms() - t0 < FZC_REQUEST_MS + TS__BLOCK_GRACE_MS + 1000);
        ts_client_free(c);
    }
    /* The server is done with this input before the next one replaces it. */
    pthread_mutex_lock(&srv.mu);
    uint64_t until = now_ms() + 5000;
    while (srv.served == served && now_ms() < until) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 10000000;
        if (ts.tv_nsec >= 1000000000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&srv.cond, &srv.mu, &ts);
    }
    srv.data = NULL;
    pthread_mutex_unlock(&srv.mu);
    return 0;
}
