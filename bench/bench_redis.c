/*
 * A minimal Redis client for the comparison: hand-written RESP over a blocking socket (no
 * hiredis), as lean as a client can be. Commands are built into one buffer; large values go out
 * in 4 MiB writes straight from the caller's memory, and large replies are read straight into a
 * reused buffer, so Redis is measured at its best.
 */
#define _GNU_SOURCE
#include "bench.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define RCHUNK ((size_t)4 << 20) /* bytes; the largest single write */
#define RBUF   (64 * 1024)       /* bytes; the reply read buffer */

typedef struct rconn {
    int fd;
    uint8_t in[RBUF];
    size_t pos, len;
} rconn;

static rconn *rconn_open(const bench_target *t, int use_unix)
{
    rconn *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return NULL;
    r->fd = bench_connect(t, use_unix);
    if (r->fd < 0) {
        free(r);
        return NULL;
    }
    return r;
}

static void rconn_close(rconn *r)
{
    if (r == NULL)
        return;
    close(r->fd);
    free(r);
}

/* Make at least one unread byte available. 0 or -1. */
static int fill(rconn *r)
{
    if (r->pos < r->len)
        return 0;
    ssize_t n = read(r->fd, r->in, sizeof(r->in));
    if (n <= 0)
        return -1;
    r->pos = 0;
    r->len = (size_t)n;
    return 0;
}

/* Read one CRLF-terminated line into line (without CRLF, NUL-terminated). 0 or -1. */
static int read_line(rconn *r, char *line, size_t cap)
{
    size_t n = 0;
    for (;;) {
        if (fill(r) != 0)
            return -1;
        uint8_t ch = r->in[r->pos++];
        if (ch == '\n') {
            if (n > 0 && line[n - 1] == '\r')
                n--;
            line[n] = '\0';
            return 0;
        }
        if (n + 1 >= cap)
            return -1;
        line[n++] = (char)ch;
    }
}

/* Read exactly len bytes into dst (NULL: drop them): buffered bytes first, then the socket. */
static int read_bytes(rconn *r, uint8_t *dst, size_t len)
{
    size_t have = r->len - r->pos;
    size_t n = have < len ? have : len;
    if (dst != NULL && n > 0)
        memcpy(dst, r->in + r->pos, n);
    r->pos += n;
    len -= n;
    if (dst != NULL)
        return len > 0 ? bench_read_all(r->fd, dst + n, len) : 0;
    while (len > 0) {
        if (fill(r) != 0)
            return -1;
        size_t k = r->len - r->pos < len ? r->len - r->pos : len;
        r->pos += k;
        len -= k;
    }
    return 0;
}

/*
 * Read one reply. A bulk string goes to dst when it fits dst_cap (else it is dropped); *blen is
 * its length (-1 for nil). Arrays are read whole (their elements dropped, the last bulk kept in
 * dst). Returns the reply's type character, or -1 (also for an error reply).
 */
static int read_reply(rconn *r, uint8_t *dst, size_t dst_cap, long long *blen)
{
    char line[128];
    if (read_line(r, line, sizeof(line)) != 0)
        return -1;
    switch (line[0]) {
    case '+':
    case ':':
        return line[0];
    case '$': {
        long long n = strtoll(line + 1, NULL, 10);
        if (blen != NULL)
            *blen = n;
        if (n < 0)
            return '$';
        uint8_t crlf[2];
        int keep = dst != NULL && (size_t)n <= dst_cap;
        if (read_bytes(r, keep ? dst : NULL, (size_t)n) != 0 || read_bytes(r, crlf, 2) != 0)
            return -1;
        return '$';
    }
    case '*': {
        long long n = strtoll(line + 1, NULL, 10);
        for (long long i = 0; i < n; i++)
            if (read_reply(r, dst, dst_cap, blen) < 0)
                return -1;
        return '*';
    }
    default:
        fprintf(stderr, "tsbench: redis: %s\n", line);
        return -1;
    }
}

/* Append a RESP bulk string header and, when data is given, its bytes and CRLF. */
static size_t put_bulk(char *out, size_t cap, const void *data, size_t len)
{
    int n = snprintf(out, cap, "$%zu\r\n", len);
    size_t k = (size_t)n;
    if (data != NULL) {
        memcpy(out + k, data, len);
        k += len;
        memcpy(out + k, "\r\n", 2);
        k += 2;
    }
    return k;
}

/* A whole command with small arguments into out (at least 256 + sum of lengths). */
static size_t cmd(char *out, size_t cap, int argc, const char *const *argv, const size_t *lens)
{
    size_t k = (size_t)snprintf(out, cap, "*%d\r\n", argc);
    for (int i = 0; i < argc; i++)
        k += put_bulk(out + k, cap - k, argv[i], lens[i]);
    return k;
}

/* SET key value where the value may be large: a small prefix, then the value in 4 MiB writes. */
static int set_large(rconn *r, const char *key, const void *val, size_t len)
{
    char pre[256];
    size_t kl = strlen(key);
    size_t k = (size_t)snprintf(pre, sizeof(pre), "*3\r\n$3\r\nSET\r\n");
    k += put_bulk(pre + k, sizeof(pre) - k, key, kl);
    k += put_bulk(pre + k, sizeof(pre) - k, NULL, len);
    if (bench_write_all(r->fd, pre, k, 0) != 0 || bench_write_all(r->fd, val, len, RCHUNK) != 0 ||
        bench_write_all(r->fd, "\r\n", 2, 0) != 0)
        return -1;
    return read_reply(r, NULL, 0, NULL) == '+' ? 0 : -1;
}

static int get_large(rconn *r, const char *key, uint8_t *dst, size_t cap)
{
    char c[256];
    const char *argv[2] = {"GET", key};
    size_t lens[2] = {3, strlen(key)};
    size_t k = cmd(c, sizeof(c), 2, argv, lens);
    long long blen = -1;
    if (bench_write_all(r->fd, c, k, 0) != 0 || read_reply(r, dst, cap, &blen) != '$')
        return -1;
    return blen == (long long)cap ? 0 : -1;
}

bench_result redis_putget(const bench_target *t, int use_unix, size_t size, int iters)
{
    bench_result res = {0};
    rconn *r = rconn_open(t, use_unix);
    uint8_t *src = bench_alloc(size);
    uint8_t *dst = bench_alloc(size);
    if (r == NULL || src == NULL || dst == NULL)
        goto out;
    bench_fill(src, size, 0, 2);
    if (set_large(r, "bench:big", src, size) != 0 || get_large(r, "bench:big", dst, size) != 0)
        goto out;
    double t0 = bench_now();
    for (int i = 0; i < iters; i++)
        if (set_large(r, "bench:big", src, size) != 0 || get_large(r, "bench:big", dst, size) != 0)
            goto out;
    res.value = (bench_now() - t0) / iters;
    res.ok = memcmp(src, dst, size) == 0;
    /* Leave no big value behind for the next case. */
    const char *argv[2] = {"DEL", "bench:big"};
    size_t lens[2] = {3, 9};
    char c[128];
    size_t k = cmd(c, sizeof(c), 2, argv, lens);
    if (bench_write_all(r->fd, c, k, 0) != 0 || read_reply(r, NULL, 0, NULL) < 0)
        res.ok = 0;
out:
    rconn_close(r);
    bench_free(src);
    bench_free(dst);
    return res;
}

/* ---------------------------------------------------------------------------------------------
 * Small operations
 */
typedef struct small_job {
    const bench_target *t;
    int use_unix;
    int idx;
    int depth;
    double secs;
    pthread_barrier_t *start;
    long long ops;
    int ok;
} small_job;

static void *small_thread(void *arg)
{
    small_job *j = arg;
    bench_pin_self(1);
    rconn *r = rconn_open(j->t, j->use_unix);
    pthread_barrier_wait(j->start);
    if (r == NULL)
        return NULL;
    char key[32];
    int kl = snprintf(key, sizeof(key), "bench:s%d", j->idx);
    uint8_t val[64];
    memset(val, 'v', sizeof(val));
    /* One pipeline: depth commands alternating SET and GET of the client's own key. */
    static const char *const names[2] = {"SET", "GET"};
    char *batch = malloc((size_t)j->depth * 256);
    if (batch == NULL) {
        rconn_close(r);
        return NULL;
    }
    size_t blen = 0;
    for (int i = 0; i < j->depth; i++) {
        const char *argv[3] = {names[i & 1], key, (const char *)val};
        size_t lens[3] = {3, (size_t)kl, sizeof(val)};
        blen += cmd(batch + blen, 256, (i & 1) ? 2 : 3, argv, lens);
    }
    /* With depth 1 the single command is a SET; pair it with a GET for the blocking case. */
    char get1[128];
    const char *gargv[2] = {"GET", key};
    size_t glens[2] = {3, (size_t)kl};
    size_t g1 = cmd(get1, sizeof(get1), 2, gargv, glens);
    uint8_t got[64];
    double end = bench_now() + j->secs;
    long long ops = 0;
    int ok = 1;
    while (ok && bench_now() < end) {
        for (int rep = 0; rep < 16 && ok; rep++) {
            if (bench_write_all(r->fd, batch, blen, 0) != 0) {
                ok = 0;
                break;
            }
            for (int i = 0; i < j->depth; i++)
                if (read_reply(r, got, sizeof(got), NULL) < 0)
                    ok = 0;
            ops += j->depth;
            if (j->depth == 1) {
                if (bench_write_all(r->fd, get1, g1, 0) != 0 ||
                    read_reply(r, got, sizeof(got), NULL) != '$')
                    ok = 0;
                ops++;
            }
        }
    }
    j->ops = ops;
    j->ok = ok;
    free(batch);
    rconn_close(r);
    return NULL;
}

bench_result redis_small(const bench_target *t, int use_unix, int nclients, int depth, double secs)
{
    bench_result res = {0};
    small_job jobs[64];
    pthread_t th[64];
    pthread_barrier_t start;
    if (nclients > 64)
        return res;
    pthread_barrier_init(&start, NULL, (unsigned)nclients + 1);
    for (int i = 0; i < nclients; i++) {
        jobs[i] = (small_job){
            .t = t, .use_unix = use_unix, .idx = i, .depth = depth, .secs = secs, .start = &start};
        pthread_create(&th[i], NULL, small_thread, &jobs[i]);
    }
    pthread_barrier_wait(&start);
    double t0 = bench_now();
    long long ops = 0;
    int ok = 1;
    for (int i = 0; i < nclients; i++) {
        pthread_join(th[i], NULL);
        ops += jobs[i].ops;
        ok &= jobs[i].ok;
    }
    double el = bench_now() - t0;
    pthread_barrier_destroy(&start);
    res.ok = ok;
    res.value = (double)ops / el;
    return res;
}

/* ---------------------------------------------------------------------------------------------
 * Pub/sub latency
 */
typedef struct sub_job {
    rconn *r;
    int n;
    _Atomic uint64_t *t0;
    double *lat;
    int got;
    int ok;
} sub_job;

static void *sub_thread(void *arg)
{
    sub_job *j = arg;
    bench_pin_self(1);
    uint8_t payload[64];
    j->ok = 1;
    for (j->got = 0; j->got < j->n; j->got++) {
        if (read_reply(j->r, payload, sizeof(payload), NULL) != '*') {
            j->ok = 0;
            return NULL;
        }
        uint64_t now = bench_now_ns();
        uint64_t t0 = atomic_load(&j->t0[j->got]);
        j->lat[j->got] = (double)(now - t0) / 1e3;
    }
    return NULL;
}

bench_result redis_notify(const bench_target *t, int use_unix, int n, int period_us)
{
    bench_result res = {0};
    rconn *pub = rconn_open(t, use_unix);
    rconn *sub = rconn_open(t, use_unix);
    _Atomic uint64_t *t0 = calloc((size_t)n, sizeof(*t0));
    double *lat = calloc((size_t)n, sizeof(*lat));
    if (pub == NULL || sub == NULL || t0 == NULL || lat == NULL)
        goto out;
    char c[256];
    const char *sargv[2] = {"SUBSCRIBE", "bench:ch"};
    size_t slens[2] = {9, 8};
    size_t k = cmd(c, sizeof(c), 2, sargv, slens);
    /* The subscription is live once its confirmation arrives. */
    if (bench_write_all(sub->fd, c, k, 0) != 0 || read_reply(sub, NULL, 0, NULL) != '*')
        goto out;
    sub_job j = {.r = sub, .n = n, .t0 = t0, .lat = lat};
    pthread_t th;
    pthread_create(&th, NULL, sub_thread, &j);
    uint64_t next = bench_now_ns();
    int ok = 1;
    for (int i = 0; i < n && ok; i++) {
        char msg[64];
        int ml = snprintf(msg, sizeof(msg), "%d", i);
        const char *pargv[3] = {"PUBLISH", "bench:ch", msg};
        size_t plens[3] = {7, 8, (size_t)ml};
        k = cmd(c, sizeof(c), 3, pargv, plens);
        atomic_store(&t0[i], bench_now_ns());
        if (bench_write_all(pub->fd, c, k, 0) != 0 || read_reply(pub, NULL, 0, NULL) != ':')
            ok = 0;
        next += (uint64_t)period_us * 1000u;
        bench_sleep_until_ns(next);
    }
    if (!ok)
        shutdown(sub->fd, SHUT_RDWR);
    pthread_join(th, NULL);
    if (ok && j.ok && j.got == n) {
        res.ok = 1;
        res.value = bench_percentile(lat, (size_t)n, 50);
        res.value2 = bench_percentile(lat, (size_t)n, 99);
    }
out:
    rconn_close(pub);
    rconn_close(sub);
    free(t0);
    free(lat);
    return res;
}

/* ---------------------------------------------------------------------------------------------
 * Memory
 */
int redis_store(const bench_target *t, size_t size, size_t total)
{
    rconn *r = rconn_open(t, 0);
    uint8_t *val = bench_alloc(size);
    if (r == NULL || val == NULL) {
        rconn_close(r);
        bench_free(val);
        return -1;
    }
    bench_fill(val, size, 0, 3);
    size_t n = total / size;
    int rc = 0;
    if (size >= ((size_t)1 << 20)) {
        for (size_t i = 0; i < n && rc == 0; i++) {
            char key[32];
            snprintf(key, sizeof(key), "m:%zu", i);
            rc = set_large(r, key, val, size);
        }
    } else {
        /* Small values: pipelines of 64 SETs. */
        size_t per = 64, cap = per * (size + 128);
        char *batch = malloc(cap);
        for (size_t i = 0; i < n && rc == 0 && batch != NULL; i += per) {
            size_t m = n - i < per ? n - i : per, k = 0;
            for (size_t q = 0; q < m; q++) {
                char key[32];
                int kl = snprintf(key, sizeof(key), "m:%zu", i + q);
                const char *argv[3] = {"SET", key, (const char *)val};
                size_t lens[3] = {3, (size_t)kl, size};
                k += cmd(batch + k, cap - k, 3, argv, lens);
            }
            if (bench_write_all(r->fd, batch, k, 0) != 0)
                rc = -1;
            for (size_t q = 0; q < m && rc == 0; q++)
                if (read_reply(r, NULL, 0, NULL) != '+')
                    rc = -1;
        }
        if (batch == NULL)
            rc = -1;
        free(batch);
    }
    rconn_close(r);
    bench_free(val);
    return rc;
}

int redis_set_one(const bench_target *t, const char *key, size_t size)
{
    rconn *r = rconn_open(t, 0);
    uint8_t *val = bench_alloc(size);
    int rc = -1;
    if (r != NULL && val != NULL) {
        bench_fill(val, size, 0, 4);
        rc = set_large(r, key, val, size);
    }
    rconn_close(r);
    bench_free(val);
    return rc;
}
