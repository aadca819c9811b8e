/*
 * A small, strict HTTP/1.1 server for health checks and Prometheus scrapes (--http-port), on
 * tensord's loop thread and on a listener of its own. It answers GET and HEAD of /healthz,
 * /readyz and /metrics; any other path 404, any other method on those paths 405, anything
 * malformed 400, a head past TSD_HTTP_MAX_HEAD 431, a request with a body 413, an HTTP version
 * other than 1.0 or 1.1 505 (those four close the connection, after a FIN and a bounded drain
 * of the client's input, see drain_start). Keep-alive works as HTTP/1.1
 * says; requests on one connection are answered one at a time, in order (input is not read
 * while a response is being written), so a connection holds at most one head and one response.
 *
 * It accepts by itself (a uv_poll_t on the listening socket), as server.c does: connections
 * past TSD_HTTP_MAX_CONNS are closed as soon as they are accepted, and running out of
 * descriptors pauses accepting instead of spinning. Nothing here allocates in proportion to
 * what tensord holds: a response is a fixed text or the metrics page (metrics.c).
 */
#define _GNU_SOURCE /* accept4 */
#include "http.h"
#include "httpparse.h"

#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>

typedef struct tsd_http_conn tsd_http_conn;

struct tsd_http {
    tsd_server *srv;
    uv_poll_t poll; /* the listening socket */
    int fd;
    int poll_open;
    int port;
    uv_timer_t sweep; /* idle deadlines, and resuming a paused accept */
    int sweep_open;
    uint64_t accept_resume; /* uv_now ms when accepting resumes; 0 = not paused */
    int stopping;           /* the shutdown began: /readyz answers 503 */
    int closed;             /* tsd_http_close ran: freed once the last handle is closed */
    size_t handles;         /* handles open or closing (the struct is freed with the last) */
    tsd_http_conn *conns;
    size_t n_conns;
    uint64_t requests;
    uint64_t rejected;
};

struct tsd_http_conn {
    uv_tcp_t tcp;
    tsd_http *h;
    tsd_http_conn *prev, *next;
    uint64_t deadline; /* uv_now ms: the next request (or this response) must be done by then */
    int closing;
    int writing;      /* a response is being written: input is not read meanwhile */
    int close_after;  /* close once the response is written */
    int draining;     /* that response is written: input is read and dropped until the close */
    uint64_t drained; /* bytes dropped so far */
    uv_write_t wreq;
    uv_shutdown_t shut;
    char status[256]; /* the status line and headers of the response being written */
    tsd_text body;    /* the metrics page being written (other bodies are fixed text) */
    size_t len;       /* bytes of head buffered */
    char head[TSD_HTTP_MAX_HEAD];
};

/* The response of a request: a status, its reason, a fixed body or the metrics page. */
typedef struct http_reply {
    int code;
    const char *reason;
    const char *text; /* fixed body; NULL: the metrics page */
    const char *type; /* Content-Type */
    int head_only;    /* HEAD: the headers GET would get, no body */
    int close;        /* Connection: close, and close once written */
    int allow;        /* 405: name the methods allowed */
} http_reply;

static const char k_text[] = "text/plain; charset=utf-8";
/* The exposition format's own content type, version 0.0.4, which Prometheus asks for. */
static const char k_metrics[] = "text/plain; version=0.0.4; charset=utf-8";

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf);
static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);
static void process(tsd_http_conn *c);

/* ---------------------------------------------------------------------------------------------
 * Lifetimes
 */

/* A handle of h was closed: free h with the last one once tsd_http_close has run. */
static void handle_gone(tsd_http *h)
{
    h->handles--;
    if (h->closed && h->handles == 0)
        ts__free(h);
}

static void on_conn_closed(uv_handle_t *handle)
{
    tsd_http_conn *c = handle->data;
    tsd_http *h = c->h;
    tsd_text_free(&c->body);
    ts__free(c);
    handle_gone(h);
}

static void conn_close(tsd_http_conn *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    tsd_http *h = c->h;
    if (c->prev != NULL)
        c->prev->next = c->next;
    else
        h->conns = c->next;
    if (c->next != NULL)
        c->next->prev = c->prev;
    c->prev = c->next = NULL;
    h->n_conns--;
    /* A write in flight is cancelled: its callback runs first and sees closing. */
    uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
}

static void on_listener_closed(uv_handle_t *handle)
{
    tsd_http *h = handle->data;
    (void)close(h->fd);
    h->fd = -1;
    handle_gone(h);
}

static void on_timer_closed(uv_handle_t *handle)
{
    handle_gone(handle->data);
}

/* ---------------------------------------------------------------------------------------------
 * Accepting
 */

static void on_listener_io(uv_poll_t *p, int status, int events);

/* Out of descriptors: stop polling the listener until the sweep resumes it. */
static void accept_pause(tsd_http *h)
{
    if (h->accept_resume != 0)
        return;
    tsd_log(TSD_LOG_WARN, "HTTP: out of file descriptors, accepting pauses for %u ms",
            TSD_HTTP_ACCEPT_PAUSE_MS);
    uv_poll_stop(&h->poll);
    h->accept_resume = uv_now(h->srv->loop) + TSD_HTTP_ACCEPT_PAUSE_MS;
}

/* Serve accepted socket fd, or close it (limit reached, no memory, libuv refused it). */
static void serve(tsd_http *h, int fd)
{
    if (h->n_conns >= TSD_HTTP_MAX_CONNS) {
        h->rejected++;
        (void)close(fd);
        return;
    }
    tsd_http_conn *c = ts__calloc(1, sizeof(*c));
    if (c == NULL) {
        (void)close(fd);
        return;
    }
    c->h = h;
    if (uv_tcp_init(h->srv->loop, &c->tcp) != 0) {
        ts__free(c);
        (void)close(fd);
        return;
    }
    c->tcp.data = c;
    h->handles++;
    c->next = h->conns;
    if (h->conns != NULL)
        h->conns->prev = c;
    h->conns = c;
    h->n_conns++;
    c->deadline = uv_now(h->srv->loop) + TSD_HTTP_IDLE_MS;
    if (uv_tcp_open(&c->tcp, fd) != 0) {
        (void)close(fd);
        conn_close(c);
        return;
    }
    (void)uv_tcp_nodelay(&c->tcp, 1);
    if (h->stopping)
        uv_unref((uv_handle_t *)&c->tcp);
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0)
        conn_close(c);
}

static void on_listener_io(uv_poll_t *p, int status, int events)
{
    tsd_http *h = p->data;
    (void)events;
    if (status < 0)
        return;
    for (unsigned i = 0; i < TSD_HTTP_ACCEPT_BATCH; i++) {
        int fd = accept4(h->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
                accept_pause(h);
            return; /* EAGAIN, or an aborted connection: nothing more now */
        }
        serve(h, fd);
    }
}

/* Every TSD_HTTP_SWEEP_MS: close connections past their deadline, resume a paused accept. */
static void on_sweep(uv_timer_t *t)
{
    tsd_http *h = t->data;
    uint64_t now = uv_now(h->srv->loop);
    for (tsd_http_conn *c = h->conns, *next; c != NULL; c = next) {
        next = c->next;
        if (now >= c->deadline)
            conn_close(c);
    }
    if (h->accept_resume != 0 && now >= h->accept_resume && h->poll_open) {
        h->accept_resume = 0;
        (void)uv_poll_start(&h->poll, UV_READABLE, on_listener_io);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Responses
 */

static void on_shutdown(uv_shutdown_t *req, int status)
{
    tsd_http_conn *c = req->data;
    /* Cancelled by conn_close (the connection is not freed before this runs), or failed. */
    if (!c->closing && status < 0)
        conn_close(c);
}

/*
 * The response that ends c is written: send FIN, then read and drop the client's input until it
 * closes, TSD_HTTP_DRAIN_MAX bytes have come or TSD_HTTP_DRAIN_MS have passed (the sweep), so
 * that the close does not reset the connection with input unread (the binary protocol drains
 * the same way).
 */
static void drain_start(tsd_http_conn *c)
{
    c->draining = 1;
    c->deadline = uv_now(c->h->srv->loop) + TSD_HTTP_DRAIN_MS;
    c->shut.data = c;
    if (uv_shutdown(&c->shut, (uv_stream_t *)&c->tcp, on_shutdown) != 0 ||
        uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0)
        conn_close(c);
}

static void on_written(uv_write_t *req, int status)
{
    tsd_http_conn *c = req->data;
    c->writing = 0;
    tsd_text_free(&c->body);
    if (c->closing)
        return;
    if (status < 0) {
        conn_close(c);
        return;
    }
    if (c->close_after) {
        drain_start(c);
        return;
    }
    /* The next request has a full idle period from now. */
    c->deadline = uv_now(c->h->srv->loop) + TSD_HTTP_IDLE_MS;
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0) {
        conn_close(c);
        return;
    }
    process(c); /* a pipelined request may be buffered already */
}

/* Queue the response r; input is not read until it is written. */
static void respond(tsd_http_conn *c, const http_reply *r)
{
    tsd_http *h = c->h;
    static const http_reply oom = {
        503, "Service Unavailable", "out of memory building the page\n", NULL, 0, 1, 0};
    if (r->text == NULL && tsd_metrics_render(h->srv, &c->body) != 0) {
        tsd_text_free(&c->body);
        c->body.failed = 0;
        r = &oom;
    }
    h->requests++;
    const char *body = r->text != NULL ? r->text : c->body.p;
    size_t body_len = r->text != NULL ? strlen(r->text) : c->body.len;
    const char *type = r->text == NULL ? k_metrics : r->type != NULL ? r->type : k_text;
    int n = snprintf(c->status, sizeof(c->status),
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                     "Cache-Control: no-store\r\n%s%s\r\n",
                     r->code, r->reason, type, body_len, r->allow ? "Allow: GET, HEAD\r\n" : "",
                     r->close ? "Connection: close\r\n" : "");
    if (n < 0 || (size_t)n >= sizeof(c->status)) {
        conn_close(c); /* cannot happen: the fields above are short and fixed */
        return;
    }
    uv_buf_t bufs[2];
    bufs[0] = uv_buf_init(c->status, (unsigned)n);
    bufs[1] = uv_buf_init((char *)(uintptr_t)body, (unsigned)body_len);
    unsigned nbufs = r->head_only || body_len == 0 ? 1u : 2u;
    c->close_after = r->close;
    uv_read_stop((uv_stream_t *)&c->tcp);
    c->wreq.data = c;
    c->deadline = uv_now(h->srv->loop) + TSD_HTTP_IDLE_MS;
    if (uv_write(&c->wreq, (uv_stream_t *)&c->tcp, bufs, nbufs, on_written) != 0) {
        tsd_text_free(&c->body);
        conn_close(c);
        return;
    }
    c->writing = 1;
}

/* A response that ends the connection: the request could not be read as HTTP/1.1 allows. */
static void refuse(tsd_http_conn *c, int code, const char *reason, const char *text)
{
    http_reply r = {code, reason, text, NULL, 0, 1, 0};
    respond(c, &r);
}

/* Answer the request whose head is p[0..n). */
static void answer(tsd_http_conn *c, const char *p, size_t n)
{
    tsd_http *h = c->h;
    tsd_http_req q;
    int rc = tsd_http_parse_head(p, n, &q);
    if (rc == TSD_HTTP_VERSION) {
        refuse(c, 505, "HTTP Version Not Supported", "only HTTP/1.0 and HTTP/1.1\n");
        return;
    }
    if (rc != 0) {
        refuse(c, 400, "Bad Request", "bad request\n");
        return;
    }
    /* No request here has a body, and skipping one would only cost time: refused, closed. */
    if (q.chunked || q.length > 0) {
        refuse(c, 413, "Content Too Large", "requests take no body\n");
        return;
    }
    http_reply r = {200, "OK", NULL, NULL, 0, 0, 0};
    /* HTTP/1.1 keeps the connection unless told to close; HTTP/1.0 only when told to keep it. */
    r.close = q.conn_close || (q.minor == 0 && !q.keep_alive);
    int get = q.method_len == 3 && memcmp(q.method, "GET", 3) == 0;
    int head = q.method_len == 4 && memcmp(q.method, "HEAD", 4) == 0;
    r.head_only = head;
    enum { P_NONE, P_HEALTH, P_READY, P_METRICS } path = P_NONE;
    if (q.path_len == 8 && memcmp(q.path, "/healthz", 8) == 0)
        path = P_HEALTH;
    else if (q.path_len == 7 && memcmp(q.path, "/readyz", 7) == 0)
        path = P_READY;
    else if (q.path_len == 8 && memcmp(q.path, "/metrics", 8) == 0)
        path = P_METRICS;
    if (path == P_NONE) {
        r.code = 404;
        r.reason = "Not Found";
        r.text = "not found: try /healthz, /readyz or /metrics\n";
    } else if (!get && !head) {
        r.code = 405;
        r.reason = "Method Not Allowed";
        r.text = "method not allowed\n";
        r.allow = 1;
    } else if (path == P_HEALTH) {
        /* Answered at all: the loop runs. */
        r.text = "ok\n";
    } else if (path == P_READY) {
        if (h->stopping || h->srv->stopping) {
            r.code = 503;
            r.reason = "Service Unavailable";
            r.text = "shutting down\n";
        } else {
            r.text = "ready\n";
        }
    }
    respond(c, &r);
}

/* Answer the next request in the buffer when its head is whole (one at a time). */
static void process(tsd_http_conn *c)
{
    if (c->writing || c->closing)
        return;
    size_t n = tsd_http_head_end(c->head, c->len);
    if (n == 0) {
        if (c->len >= TSD_HTTP_MAX_HEAD)
            refuse(c, 431, "Request Header Fields Too Large", "request head too large\n");
        return;
    }
    /*
     * The response is built before the head leaves the buffer: nothing it returns points into
     * the head, so the bytes after it can move down at once.
     */
    answer(c, c->head, n);
    if (c->closing)
        return;
    memmove(c->head, c->head + n, c->len - n);
    c->len -= n;
}

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf)
{
    /* Input being drained is read here and dropped (one loop thread: one buffer serves all). */
    static char discard[16384];
    tsd_http_conn *c = handle->data;
    (void)suggested;
    if (c->draining)
        *buf = uv_buf_init(discard, sizeof(discard));
    else
        *buf = uv_buf_init(c->head + c->len, (unsigned)(TSD_HTTP_MAX_HEAD - c->len));
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    tsd_http_conn *c = s->data;
    (void)buf;
    if (c->closing)
        return;
    if (nread < 0) {
        conn_close(c); /* the client closed (after our FIN, when draining), or an error */
        return;
    }
    if (c->draining) {
        c->drained += (uint64_t)nread;
        if (c->drained > TSD_HTTP_DRAIN_MAX)
            conn_close(c);
        return;
    }
    c->len += (size_t)nread;
    process(c);
}

/* ---------------------------------------------------------------------------------------------
 * Start and stop
 */

/* A listening TCP socket on host:port; the bound port in *bound. fd, or a negative code. */
static int listen_on(const char *host, int port, int *bound)
{
    struct sockaddr_storage addr;
    socklen_t alen;
    int rc;
    memset(&addr, 0, sizeof(addr));
    if (strchr(host, ':') != NULL) {
        rc = uv_ip6_addr(host, port, (struct sockaddr_in6 *)&addr);
        alen = sizeof(struct sockaddr_in6);
    } else {
        rc = uv_ip4_addr(host, port, (struct sockaddr_in *)&addr);
        alen = sizeof(struct sockaddr_in);
    }
    if (rc != 0) {
        tsd_log(TSD_LOG_ERROR, "bad --http-host address '%s': %s", host, uv_strerror(rc));
        return rc;
    }
    int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_storage got;
    socklen_t glen = sizeof(got);
    if (bind(fd, (struct sockaddr *)&addr, alen) != 0 || listen(fd, TSD_HTTP_BACKLOG) != 0 ||
        getsockname(fd, (struct sockaddr *)&got, &glen) != 0) {
        rc = -errno;
        tsd_log(TSD_LOG_ERROR, "cannot listen for HTTP on %s:%d: %s", host, port, strerror(errno));
        (void)close(fd);
        return rc;
    }
    if (got.ss_family == AF_INET6)
        *bound = ntohs(((struct sockaddr_in6 *)&got)->sin6_port);
    else
        *bound = ntohs(((struct sockaddr_in *)&got)->sin_port);
    return fd;
}

int tsd_http_start(tsd_server *srv)
{
    const tsd_config *cfg = &srv->cfg;
    const char *host = cfg->http_host != NULL ? cfg->http_host : cfg->host;
    tsd_http *h = ts__calloc(1, sizeof(*h));
    if (h == NULL)
        return UV_ENOMEM;
    h->srv = srv;
    h->fd = listen_on(host, cfg->http_port, &h->port);
    if (h->fd < 0) {
        int rc = h->fd;
        ts__free(h);
        return rc;
    }
    srv->http = h;
    /* From here on the handles own h: tsd_http_close frees it with the last of them. */
    int rc = uv_poll_init(srv->loop, &h->poll, h->fd);
    if (rc != 0) {
        (void)close(h->fd);
        h->fd = -1;
        return rc;
    }
    h->poll.data = h;
    h->poll_open = 1;
    h->handles++;
    uv_timer_init(srv->loop, &h->sweep);
    h->sweep.data = h;
    h->sweep_open = 1;
    h->handles++;
    rc = uv_poll_start(&h->poll, UV_READABLE, on_listener_io);
    if (rc == 0)
        rc = uv_timer_start(&h->sweep, on_sweep, TSD_HTTP_SWEEP_MS, TSD_HTTP_SWEEP_MS);
    if (rc != 0)
        return rc;
    if (cfg->http_port_file != NULL && tsd_write_port_file(cfg->http_port_file, h->port) != 0) {
        tsd_log(TSD_LOG_ERROR, "cannot write --http-port-file %s", cfg->http_port_file);
        return UV_EIO;
    }
    /* The latency histograms are kept from now on: someone can read them. */
    srv->stats.timing = 1;
    tsd_log(TSD_LOG_INFO, "HTTP health and metrics on %s:%d", host, h->port);
    return 0;
}

void tsd_http_stopping(tsd_server *srv)
{
    tsd_http *h = srv->http;
    if (h == NULL || h->stopping)
        return;
    h->stopping = 1;
    if (h->poll_open)
        uv_unref((uv_handle_t *)&h->poll);
    if (h->sweep_open)
        uv_unref((uv_handle_t *)&h->sweep);
    for (tsd_http_conn *c = h->conns; c != NULL; c = c->next)
        uv_unref((uv_handle_t *)&c->tcp);
}

void tsd_http_close(tsd_server *srv)
{
    tsd_http *h = srv->http;
    if (h == NULL)
        return;
    srv->http = NULL;
    srv->stats.timing = 0;
    h->stopping = 1;
    h->closed = 1;
    while (h->conns != NULL)
        conn_close(h->conns);
    if (h->sweep_open) {
        h->sweep_open = 0;
        uv_close((uv_handle_t *)&h->sweep, on_timer_closed);
    }
    if (h->poll_open) {
        h->poll_open = 0;
        uv_close((uv_handle_t *)&h->poll, on_listener_closed);
    } else if (h->fd >= 0) {
        (void)close(h->fd);
        h->fd = -1;
    }
    if (h->handles == 0)
        ts__free(h);
}

void tsd_http_stats_get(const tsd_server *srv, tsd_http_stats *st)
{
    memset(st, 0, sizeof(*st));
    const tsd_http *h = srv->http;
    if (h == NULL)
        return;
    st->requests = h->requests;
    st->rejected = h->rejected;
    st->connections = h->n_conns;
}
