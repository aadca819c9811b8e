/*
 * tensord's HTTP side (--http-port): /healthz, /readyz and /metrics against a real daemon over
 * raw sockets, the refusals (404, 405, 400, 413, 431, 505), the connection limit, the idle and
 * request deadlines, /readyz during the shutdown, and metrics that follow real operations.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test_server_util.h"

/* The daemon's limits (server/http.h), as docs/METRICS.md states them. */
#define MAX_HEAD  8192
#define MAX_CONNS 64
#define IDLE_MS   10000

typedef struct fixture {
    tsh_server s;
    int http; /* the HTTP port */
    char port_file[300];
} fixture;

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

static int start(void **state)
{
    fixture *fx = calloc(1, sizeof(*fx));
    assert_non_null(fx);
    /* The port file goes beside the harness's directory: it does not exist before the start. */
    snprintf(fx->port_file, sizeof(fx->port_file), "/tmp/test_http.%d.port", (int)getpid());
    unlink(fx->port_file);
    const char *args[] = {"--http-port", "0", "--http-port-file", fx->port_file, NULL};
    assert_int_equal(tsh_server_start(&fx->s, args), 0);
    /* tensord writes the HTTP port file before the binary one the harness waited for. */
    FILE *f = fopen(fx->port_file, "r");
    assert_non_null(f);
    assert_int_equal(fscanf(f, "%d", &fx->http), 1);
    fclose(f);
    assert_true(fx->http > 0 && fx->http < 65536);
    *state = fx;
    return 0;
}

static int stop(void **state)
{
    fixture *fx = *state;
    if (fx->s.pid > 0)
        assert_int_equal(tsh_server_stop(&fx->s), 0);
    tsh_server_cleanup(&fx->s);
    unlink(fx->port_file);
    free(fx);
    return 0;
}

/* A parsed response. */
typedef struct resp {
    int code;
    char head[4096]; /* status line and headers, NUL-terminated */
    char *body;      /* malloc'd, NUL-terminated; Content-Length bytes (none for HEAD) */
    size_t body_len;
    size_t content_length;
} resp;

static void resp_free(resp *r)
{
    free(r->body);
    r->body = NULL;
}

/* The value of header name (case-insensitive) in r's head, or NULL. */
static const char *header(const resp *r, const char *name, char *out, size_t cap)
{
    const char *p = strstr(r->head, "\r\n");
    size_t n = strlen(name);
    while (p != NULL && p[2] != '\0' && p[2] != '\r') {
        p += 2;
        if (strncasecmp(p, name, n) == 0 && p[n] == ':') {
            const char *v = p + n + 1;
            while (*v == ' ')
                v++;
            const char *e = strstr(v, "\r\n");
            size_t len = e != NULL ? (size_t)(e - v) : strlen(v);
            if (len >= cap)
                len = cap - 1;
            memcpy(out, v, len);
            out[len] = '\0';
            return out;
        }
        p = strstr(p, "\r\n");
    }
    return NULL;
}

/* Read one response from fd (no body when head_only). 0, or -1 when the connection ended. */
static int read_resp(int fd, resp *r, int head_only)
{
    memset(r, 0, sizeof(*r));
    size_t n = 0;
    while (n < 4 || memcmp(r->head + n - 4, "\r\n\r\n", 4) != 0) {
        if (n + 1 >= sizeof(r->head))
            return -1;
        ssize_t k = recv(fd, r->head + n, 1, 0);
        if (k <= 0)
            return -1;
        n++;
    }
    r->head[n] = '\0';
    if (sscanf(r->head, "HTTP/1.1 %d ", &r->code) != 1)
        return -1;
    char v[64];
    assert_non_null(header(r, "Content-Length", v, sizeof(v)));
    r->content_length = strtoul(v, NULL, 10);
    size_t want = head_only ? 0 : r->content_length;
    r->body = malloc(want + 1);
    assert_non_null(r->body);
    if (want > 0 && tsh_read_all(fd, r->body, want) != 0)
        return -1;
    r->body[want] = '\0';
    r->body_len = want;
    return 0;
}

/* Send raw request bytes on fd and read the response; fails the test when none comes. */
static void exchange(int fd, const char *req, resp *r)
{
    assert_int_equal(tsh_write_all(fd, req, strlen(req)), 0);
    int head_only = strncmp(req, "HEAD ", 5) == 0;
    assert_int_equal(read_resp(fd, r, head_only), 0);
}

/* A GET of path on a fresh connection, closed afterwards. */
static void get(int port, const char *path, resp *r)
{
    int fd = tsh_connect_tcp(port);
    assert_true(fd >= 0);
    char req[512];
    snprintf(req, sizeof(req), "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
             path);
    exchange(fd, req, r);
    close(fd);
}

/* The value of the sample key ("name" or "name{labels}") on the metrics page, or -1. */
static double metric(const char *page, const char *key)
{
    size_t n = strlen(key);
    const char *p = page;
    while ((p = strstr(p, key)) != NULL) {
        if ((p == page || p[-1] == '\n') && p[n] == ' ')
            return strtod(p + n + 1, NULL);
        p += n;
    }
    return -1;
}

static double scrape(const fixture *fx, const char *key)
{
    resp r;
    get(fx->http, "/metrics", &r);
    assert_int_equal(r.code, 200);
    double v = metric(r.body, key);
    resp_free(&r);
    return v;
}

/* The three endpoints, GET and HEAD, on one keep-alive connection. */
static void test_endpoints(void **state)
{
    fixture *fx = *state;
    int fd = tsh_connect_tcp(fx->http);
    assert_true(fd >= 0);
    resp r;
    char v[128];
    exchange(fd, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", &r);
    assert_int_equal(r.code, 200);
    assert_string_equal(r.body, "ok\n");
    assert_null(header(&r, "Connection", v, sizeof(v)));
    resp_free(&r);
    exchange(fd, "GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n", &r);
    assert_int_equal(r.code, 200);
    resp_free(&r);
    /* A query string is ignored. */
    exchange(fd, "GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\nAccept: text/plain\r\n\r\n", &r);
    assert_int_equal(r.code, 200);
    assert_non_null(header(&r, "Content-Type", v, sizeof(v)));
    assert_string_equal(v, "text/plain; version=0.0.4; charset=utf-8");
    assert_non_null(strstr(r.body, "# TYPE tensord_operations_total counter\n"));
    assert_true(metric(r.body, "tensord_build_info{version=\"" TS_VERSION_STRING "\"}") == 1);
    size_t page_len = r.body_len;
    resp_free(&r);
    /* HEAD: the headers GET gets, no body (the next response starts right after them). */
    exchange(fd, "HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n", &r);
    assert_int_equal(r.code, 200);
    assert_true(r.content_length > page_len / 2);
    resp_free(&r);
    exchange(fd, "HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n", &r);
    assert_int_equal(r.code, 200);
    assert_int_equal(r.content_length, 3);
    resp_free(&r);
    /* Two requests in one write are answered in order. */
    exchange(fd, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /nope HTTP/1.1\r\nHost: x\r\n\r\n",
             &r);
    assert_int_equal(r.code, 200);
    resp_free(&r);
    assert_int_equal(read_resp(fd, &r, 0), 0);
    assert_int_equal(r.code, 404);
    resp_free(&r);
    /* Connection: close is honoured. */
    exchange(fd, "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", &r);
    assert_int_equal(r.code, 200);
    assert_non_null(header(&r, "Connection", v, sizeof(v)));
    assert_string_equal(v, "close");
    resp_free(&r);
    assert_int_equal(tsh_wait_closed(fd, 3000), 1);
    close(fd);
    /* HTTP/1.0 closes unless asked to keep the connection; no Host needed. */
    fd = tsh_connect_tcp(fx->http);
    exchange(fd, "GET /healthz HTTP/1.0\r\n\r\n", &r);
    assert_int_equal(r.code, 200);
    resp_free(&r);
    assert_int_equal(tsh_wait_closed(fd, 3000), 1);
    close(fd);
    fd = tsh_connect_tcp(fx->http);
    exchange(fd, "GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", &r);
    resp_free(&r);
    exchange(fd, "GET /readyz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", &r);
    assert_int_equal(r.code, 200);
    resp_free(&r);
    close(fd);
}

/* A request that is answered with code, keeping the connection (keep = 1) or closing it. */
static void expect(const fixture *fx, const char *req, size_t len, int code, int keep)
{
    int fd = tsh_connect_tcp(fx->http);
    assert_true(fd >= 0);
    assert_int_equal(tsh_write_all(fd, req, len), 0);
    resp r;
    if (read_resp(fd, &r, 0) != 0)
        fail_msg("no response to %.40s", req);
    if (r.code != code)
        fail_msg("%.40s: %d, expected %d", req, r.code, code);
    char v[64];
    if (!keep) {
        assert_non_null(header(&r, "Connection", v, sizeof(v)));
        assert_string_equal(v, "close");
        assert_int_equal(tsh_wait_closed(fd, 3000), 1);
    } else {
        /* Still served: the next request gets its answer. */
        resp r2;
        exchange(fd, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", &r2);
        assert_int_equal(r2.code, 200);
        resp_free(&r2);
    }
    resp_free(&r);
    close(fd);
}

#define EXPECT(fx, req, code, keep) expect(fx, req, strlen(req), code, keep)

static void test_refusals(void **state)
{
    fixture *fx = *state;
    EXPECT(fx, "GET / HTTP/1.1\r\nHost: x\r\n\r\n", 404, 1);
    EXPECT(fx, "GET /metrics/ HTTP/1.1\r\nHost: x\r\n\r\n", 404, 1);
    EXPECT(fx, "GET /healthzz HTTP/1.1\r\nHost: x\r\n\r\n", 404, 1);
    EXPECT(fx, "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405, 1);
    EXPECT(fx, "DELETE /readyz HTTP/1.1\r\nHost: x\r\n\r\n", 405, 1);
    EXPECT(fx, "get /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 405, 1); /* methods are cased */
    /* The 405 names what is allowed. */
    {
        int fd = tsh_connect_tcp(fx->http);
        resp r;
        char v[64];
        exchange(fd, "PUT /healthz HTTP/1.1\r\nHost: x\r\n\r\n", &r);
        assert_int_equal(r.code, 405);
        assert_non_null(header(&r, "Allow", v, sizeof(v)));
        assert_string_equal(v, "GET, HEAD");
        resp_free(&r);
        close(fd);
    }
    /* Malformed heads: 400, and the connection closes. */
    static const char *const bad[] = {
        "GARBAGE\r\n\r\n",
        "GET /healthz\r\n\r\n",
        "GET  /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
        "GET /healthz HTTP/1.1 \r\nHost: x\r\n\r\n",
        "GET healthz HTTP/1.1\r\nHost: x\r\n\r\n",
        "GET http://x/healthz HTTP/1.1\r\nHost: x\r\n\r\n",
        "GET /healthz HTTP/1.1\r\n\r\n",                         /* no Host */
        "GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",   /* two */
        "GET /healthz HTTP/1.1\nHost: x\n\n\r\n\r\n",            /* bare LF */
        "GET /healthz HTTP/1.1\r\nHost : x\r\n\r\n",             /* space before the colon */
        "GET /healthz HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n",   /* obsolete folding */
        "GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\x01z\r\n\r\n", /* a control byte */
        "GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n",
        "GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nContent-Length: 1\r\n\r\n",
        "GET /healthz HTTP/x.1\r\nHost: x\r\n\r\n",
        "GET /healthz HTTP/1.11\r\nHost: x\r\n\r\n",
    };
    for (size_t i = 0; i < TS__ARRAY_SIZE(bad); i++)
        EXPECT(fx, bad[i], 400, 0);
    /*
     * Bare LFs or CRs without any CRLF CRLF: refused at the first one, not left waiting for a
     * blank line that never comes.
     */
    static const char *const bare[] = {
        "GET /healthz HTTP/1.1\nHost: x\n\n",
        "GET /healthz HTTP/1.1\r\nHost: x\n\n",
        "GET /healthz HTTP/1.1\rHost: x\r\r",
        "GET /healthz HTTP/1.1\r\nHost: x\r\n\n",
    };
    for (size_t i = 0; i < TS__ARRAY_SIZE(bare); i++) {
        long t0 = now_ms();
        EXPECT(fx, bare[i], 400, 0);
        assert_true(now_ms() - t0 < 2000);
    }
    /* A NUL inside the head. */
    static const char nul[] = "GET /healthz HTTP/1.1\r\nHost: x\0y\r\n\r\n";
    expect(fx, nul, sizeof(nul) - 1, 400, 0);
    /* Other versions: 505. */
    EXPECT(fx, "GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n", 505, 0);
    EXPECT(fx, "GET /healthz HTTP/0.9\r\nHost: x\r\n\r\n", 505, 0);
    /* A body is never taken: 413, closed. */
    EXPECT(fx, "GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello", 413, 0);
    EXPECT(fx, "POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
           413, 0);
    /* A head of exactly the limit is read; one byte more is 431. */
    char *big = malloc(MAX_HEAD + 64);
    assert_non_null(big);
    const char *pre = "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: ";
    size_t fill = MAX_HEAD - strlen(pre) - 4;
    memcpy(big, pre, strlen(pre));
    memset(big + strlen(pre), 'a', fill);
    memcpy(big + strlen(pre) + fill, "\r\n\r\n", 4);
    expect(fx, big, MAX_HEAD, 200, 1);
    memset(big + strlen(pre), 'a', fill + 1);
    memcpy(big + strlen(pre) + fill + 1, "\r\n\r\n", 4);
    expect(fx, big, MAX_HEAD + 1, 431, 0);
    /* Endless header bytes without the blank line: 431 at the limit, not a wait. */
    memset(big, 'a', MAX_HEAD + 64);
    memcpy(big, pre, strlen(pre));
    expect(fx, big, MAX_HEAD + 64, 431, 0);
    free(big);
    /*
     * A head far past the limit in one go, and more bytes after the refusal: the client reads
     * the 431 and then the end of the stream, never a reset (tensord sends FIN and drains what
     * is left before it closes; a close with input unread would reset the connection).
     */
    size_t flood_len = 4 * MAX_HEAD;
    char *flood = malloc(flood_len);
    assert_non_null(flood);
    memset(flood, 'a', flood_len);
    memcpy(flood, pre, strlen(pre));
    for (int round = 0; round < 3; round++) {
        int fd = tsh_connect_tcp(fx->http);
        assert_true(fd >= 0);
        assert_int_equal(tsh_write_all(fd, flood, flood_len), 0);
        sleep_ms(100);
        assert_int_equal(tsh_write_all(fd, flood, 4096), 0);
        resp r;
        assert_int_equal(read_resp(fd, &r, 0), 0);
        assert_int_equal(r.code, 431);
        resp_free(&r);
        char rest;
        errno = 0;
        ssize_t k = recv(fd, &rest, 1, 0);
        if (k != 0)
            fail_msg("after the 431: recv %zd (%s), expected the end of the stream", k,
                     strerror(errno));
        close(fd);
    }
    free(flood);
    /* tensord itself is unharmed. */
    tsu_check_healthy(&fx->s);
}

/* Past 64 connections, new ones are closed at once; a freed place is taken again. */
static void test_connection_limit(void **state)
{
    fixture *fx = *state;
    /* Earlier connections of this test are gone from tensord's count (bounded wait). */
    for (int i = 0; i < 100 && scrape(fx, "tensord_http_connections") != 1; i++)
        sleep_ms(20);
    double rejected0 = scrape(fx, "tensord_http_connections_rejected_total");
    int fds[MAX_CONNS];
    resp r;
    for (int i = 0; i < MAX_CONNS; i++) {
        fds[i] = tsh_connect_tcp(fx->http);
        assert_true(fds[i] >= 0);
        /* A request on each: the server holds them all now. */
        exchange(fds[i], "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", &r);
        assert_int_equal(r.code, 200);
        resp_free(&r);
    }
    int extra = tsh_connect_tcp(fx->http);
    assert_true(extra >= 0); /* the kernel completes it; tensord closes it unanswered */
    assert_int_equal(tsh_write_all(extra, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 35), 0);
    assert_int_equal(tsh_wait_closed(extra, 5000), 1);
    close(extra);
    /* The binary protocol does not notice. */
    tsu_check_healthy(&fx->s);
    close(fds[0]);
    /* The place is free once tensord has seen the close: bounded retries. */
    int served = 0;
    for (int tries = 0; tries < 100 && !served; tries++) {
        int fd = tsh_connect_tcp(fx->http);
        assert_true(fd >= 0);
        if (tsh_write_all(fd, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 35) == 0 &&
            read_resp(fd, &r, 0) == 0) {
            assert_int_equal(r.code, 200);
            assert_true(metric(r.body, "tensord_http_connections_rejected_total") >= rejected0 + 1);
            assert_true(metric(r.body, "tensord_http_connections") == MAX_CONNS);
            resp_free(&r);
            served = 1;
        }
        close(fd);
        if (!served)
            sleep_ms(50);
    }
    assert_true(served);
    for (int i = 1; i < MAX_CONNS; i++)
        close(fds[i]);
}

/*
 * The deadline: a silent connection, an idle keep-alive one and one that trickles its head a
 * byte at a time are all closed about 10 s after their last response (or their start), and
 * not much earlier. One wait covers the three.
 */
static void test_idle_timeout(void **state)
{
    fixture *fx = *state;
    long t0 = now_ms();
    int silent = tsh_connect_tcp(fx->http);
    int idle = tsh_connect_tcp(fx->http);
    int trickle = tsh_connect_tcp(fx->http);
    assert_true(silent >= 0 && idle >= 0 && trickle >= 0);
    resp r;
    exchange(idle, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", &r);
    resp_free(&r);
    const char *head = "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    assert_int_equal(tsh_write_all(trickle, head, strlen(head)), 0);
    int fds[3] = {silent, idle, trickle};
    long closed_at[3] = {0, 0, 0};
    int open = 3;
    /* Bounded: the deadline plus two sweeps and slack for a loaded machine. */
    while (open > 0 && now_ms() - t0 < IDLE_MS + 8000) {
        /* The trickling client sends a byte every 200 ms: activity that must not help it. */
        if (closed_at[2] == 0)
            (void)send(trickle, "a", 1, MSG_NOSIGNAL);
        for (int i = 0; i < 3; i++) {
            if (closed_at[i] != 0)
                continue;
            struct pollfd p = {.fd = fds[i], .events = POLLIN};
            if (poll(&p, 1, 0) == 1) {
                char b[64];
                ssize_t k = recv(fds[i], b, sizeof(b), MSG_DONTWAIT);
                if (k == 0 || (k < 0 && errno != EAGAIN)) {
                    closed_at[i] = now_ms() - t0;
                    open--;
                }
            }
        }
        sleep_ms(200);
    }
    for (int i = 0; i < 3; i++) {
        if (closed_at[i] == 0)
            fail_msg("connection %d still open after %d ms", i, IDLE_MS + 8000);
        /* Not before the deadline (less the clock's grain), not much after. */
        assert_true(closed_at[i] >= IDLE_MS - 500);
        close(fds[i]);
    }
    /* New connections are served as ever. */
    get(fx->http, "/healthz", &r);
    assert_int_equal(r.code, 200);
    resp_free(&r);
}

/* Counters and histograms move with real operations on the binary protocol. */
static void test_counters(void **state)
{
    fixture *fx = *state;
    const char *puts = "tensord_operations_total{op=\"PUT\"}";
    const char *put_count = "tensord_operation_duration_seconds_count{op=\"PUT\"}";
    const char *nf = "tensord_errors_total{status=\"NOT_FOUND\"}";
    double p0 = scrape(fx, puts), e0 = scrape(fx, nf),
           in0 = scrape(fx, "tensord_received_bytes_total");
    double c0 = scrape(fx, put_count);
    if (c0 < 0)
        c0 = 0; /* no PUT measured yet: no series */
    int fd = tsu_client(&fx->s);
    for (int i = 0; i < 3; i++)
        tsu_put_int(fd, TS_OP_PUT, "http.counted", i, NULL);
    tsu_put_int(fd, TS_OP_PUT, "http.other", 1, NULL);
    assert_int_equal(tsu_send_get(fd, TS_OP_GET, 9, "http.missing", 1), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_GET, 9, TS_ST_NOT_FOUND);
    tsu_frame_free(&f);
    resp r;
    get(fx->http, "/metrics", &r);
    assert_int_equal(r.code, 200);
    assert_true(metric(r.body, puts) == p0 + 4);
    assert_true(metric(r.body, put_count) == c0 + 4);
    assert_true(metric(r.body, nf) == e0 + 1);
    assert_true(metric(r.body, "tensord_received_bytes_total") > in0);
    assert_true(metric(r.body, "tensord_bins") >= 2);
    assert_true(metric(r.body, "tensord_items") >= 2);
    assert_true(metric(r.body, "tensord_connections") >= 1);
    assert_true(
        metric(r.body, "tensord_operation_duration_seconds_bucket{op=\"PUT\",le=\"+Inf\"}") ==
        c0 + 4);
    assert_true(metric(r.body, "tensord_operation_duration_seconds_sum{op=\"PUT\"}") > 0);
    assert_true(metric(r.body, "tensord_memory_used_bytes") > 0);
    assert_true(metric(r.body, "tensord_memory_limit_bytes") > 0);
    resp_free(&r);
    /* STATS reads the same bookkeeping. */
    double ops = scrape(fx, puts);
    assert_true((double)tsu_stat(fd, "ops_put") == ops);
    close(fd);
}

/*
 * While tensord stops (a client that has not closed holds the shutdown's grace), /readyz says
 * 503 and /healthz 200, on an open connection and on new ones; then tensord exits cleanly.
 */
static void test_readyz_shutdown(void **state)
{
    fixture *fx = *state;
    int client = tsu_client(&fx->s);
    int keep = tsh_connect_tcp(fx->http);
    assert_true(keep >= 0);
    resp r;
    exchange(keep, "GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n", &r);
    assert_int_equal(r.code, 200);
    resp_free(&r);
    assert_int_equal(kill(fx->s.pid, SIGTERM), 0);
    /* The client is told SHUTTING_DOWN; it does not close yet, so the shutdown lasts. */
    tsu_frame f;
    assert_int_equal(tsu_recv(client, &f), 0);
    assert_int_equal(f.h.status, TS_ST_SHUTTING_DOWN);
    tsu_frame_free(&f);
    exchange(keep, "GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n", &r);
    assert_int_equal(r.code, 503);
    resp_free(&r);
    exchange(keep, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", &r);
    assert_int_equal(r.code, 200);
    resp_free(&r);
    get(fx->http, "/readyz", &r);
    assert_int_equal(r.code, 503);
    resp_free(&r);
    get(fx->http, "/metrics", &r);
    assert_int_equal(r.code, 200);
    resp_free(&r);
    /* The open HTTP connection does not hold the exit. */
    close(client);
    int st = 0;
    pid_t got = 0;
    for (int i = 0; i < 1000 && got == 0; i++) {
        got = waitpid(fx->s.pid, &st, WNOHANG);
        if (got == 0)
            sleep_ms(10);
    }
    assert_int_equal(got, fx->s.pid);
    fx->s.pid = 0;
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    assert_int_equal(tsh_wait_closed(keep, 3000), 1);
    close(keep);
}

/* Flags: a bad --http-port is a usage error; --help names the three flags. */
static void test_flags(void **state)
{
    (void)state;
    const char *td = getenv("TS_TENSORD");
    assert_non_null(td);
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "%s --http-port 70000 >/dev/null 2>&1", td);
    int st = system(cmd);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 2);
    snprintf(cmd, sizeof(cmd), "%s --help", td);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    static char out[16384];
    size_t n = fread(out, 1, sizeof(out) - 1, p);
    out[n] = '\0';
    pclose(p);
    assert_non_null(strstr(out, "--http-port N"));
    assert_non_null(strstr(out, "--http-host ADDR"));
    assert_non_null(strstr(out, "--http-port-file PATH"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_endpoints, start, stop),
        cmocka_unit_test_setup_teardown(test_refusals, start, stop),
        cmocka_unit_test_setup_teardown(test_connection_limit, start, stop),
        cmocka_unit_test_setup_teardown(test_counters, start, stop),
        cmocka_unit_test_setup_teardown(test_readyz_shutdown, start, stop),
        cmocka_unit_test_setup_teardown(test_idle_timeout, start, stop),
        cmocka_unit_test(test_flags),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
