/*
 * The connection (I/O thread): connecting (a unix socket, a numeric address, or a host name
 * resolved on libuv's thread pool), the HELLO handshake, failing a connection and reconnecting
 * with exponential backoff, resubscribing after a reconnect, and parsing the address given to
 * ts_client_open.
 */
#include "internal.h"

#include "auth.h"
#include "msg.h"
#include "sha256.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------------
 * Connections
 */

/* One of the connection's handles has closed; the last one frees it. */
static void conn_release(ts__conn *conn)
{
    if (--conn->handles > 0)
        return;
    if (conn->body != NULL)
        ts__body_free(conn->body, (size_t)conn->hdr.body_len);
    ts__free(conn->stage);
    ts__free(conn);
}

static void conn_close_cb(uv_handle_t *h)
{
    conn_release(h->data);
}

static void hup_close_cb(uv_handle_t *h)
{
    ts__conn *conn = h->data;
    close(conn->hup_fd);
    conn->hup_fd = -1;
    conn_release(conn);
}

/* Close a connection; its memory goes in the close callbacks. */
void ts__conn_close(ts__conn *conn)
{
    if (conn->closing)
        return;
    conn->closing = 1;
    if (conn->hup_fd >= 0)
        uv_close((uv_handle_t *)&conn->hup, hup_close_cb);
    ts__conn_close_stream(conn, conn_close_cb);
}

static ts__conn *conn_new(ts_client_t *c)
{
    ts__conn *conn = ts__calloc(1, sizeof(*conn));
    if (conn == NULL)
        return NULL;
    conn->stage = ts__malloc(TS__STAGE_SIZE);
    if (conn->stage == NULL) {
        ts__free(conn);
        return NULL;
    }
    conn->c = c;
    conn->max_body = TS_MAX_PREAUTH_BODY;
    conn->hup_fd = -1;
    conn->handles = 1;
    return conn;
}

/* What a failed connect means to the caller. */
static int map_connect_err(int uverr)
{
    switch (uverr) {
    case UV_ECONNREFUSED:
    case UV_ENOENT: /* no socket file: nothing listens there */
        return TS_ECONNREFUSED;
    case UV_ETIMEDOUT:
        return TS_ETIMEDOUT;
    case UV_ENOMEM:
        return TS_ENOMEM;
    case UV_EACCES:
        return TS_EACCES;
    default:
        return TS_ENOTCONN;
    }
}

/* Record why opening failed and end the I/O thread (first connection only). */
static void open_failed(ts_client_t *c, int err, const char *msg)
{
    pthread_mutex_lock(&c->mu);
    c->open_done = 1;
    c->open_status = err;
    snprintf(c->open_msg, sizeof(c->open_msg), "%s: %s", c->address,
             msg != NULL ? msg : ts_strerror(err));
    pthread_cond_broadcast(&c->open_cond);
    pthread_mutex_unlock(&c->mu);
    ts__io_shutdown(c);
}

static void retry_cb(uv_timer_t *t);

/*
 * The connection (or the attempt to make one) failed: fail what is in flight, tell the
 * subscriptions, and schedule the next attempt. conn may be NULL while resolving.
 */
void ts__conn_fail(ts_client_t *c, ts__conn *conn, int err, const char *msg)
{
    ts__conn_fail_reason(c, conn, err, msg, 0);
}

/*
 * ts__conn_fail, where server_reason says that err and msg are the server's own reason for closing
 * (its connection-level error frame): the requests in flight then fail with err and carry msg,
 * instead of the TS_ECONNRESET of a connection that was merely lost.
 */
void ts__conn_fail_reason(ts_client_t *c, ts__conn *conn, int err, const char *msg,
                          int server_reason)
{
    if (conn != c->conn || c->state == TS__ST_CLOSED) {
        if (conn != NULL)
            ts__conn_close(conn);
        return;
    }
    snprintf(c->down_msg, sizeof(c->down_msg), "%s: %s", c->address,
             msg != NULL ? msg : ts_strerror(err));
    ts__req *dlist = ts__direct_stop(c); /* before the descriptor closes */
    if (conn != NULL)
        ts__conn_close(conn);
    int was_ready = c->state == TS__ST_READY;
    c->conn = NULL;
    c->reading = 0;
    c->gen++;
    c->state = TS__ST_BACKOFF;
    atomic_store(&c->connected, 0);
    uv_timer_stop(&c->retry);
    /* After a protocol violation any reply in flight may be the broken one: say so, and how. */
    int ferr = server_reason || err == TS_EPROTO ? err : TS_ECONNRESET;
    const char *fmsg = server_reason || err == TS_EPROTO ? msg : NULL;
    ts__fail_inflight(c, ferr, fmsg);
    ts__fail_list(c, dlist, ferr, fmsg);
    if (server_reason && c->waitq_head != NULL) {
        /*
         * The server turned the client away (a refused handshake on a reconnection, or its
         * reason for closing): the calls waiting for a connection learn why now, rather than
         * at their deadlines, with the address in front as ts_client_open's message has it.
         */
        char why[TS_MAX_ERROR_LEN + 1];
        snprintf(why, sizeof(why), "%s: %s", c->address, msg != NULL ? msg : ts_strerror(err));
        ts__req *w = c->waitq_head;
        c->waitq_head = c->waitq_tail = NULL;
        ts__fail_list(c, w, err, why);
    }
    if (was_ready) {
        /* Collect first: callbacks may unlisten (which unlinks) while we walk. */
        ts__sub *chain = NULL;
        pthread_mutex_lock(&c->mu);
        for (ts__sub *s = c->subs; s != NULL; s = s->next) {
            if (!s->live || !s->on_conn)
                continue;
            s->on_conn = 0;
            atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
            s->io_next = chain;
            chain = s;
        }
        pthread_mutex_unlock(&c->mu);
        chain = ts__sub_chain_reverse(chain);
        while (chain != NULL) {
            ts__sub *s = chain;
            chain = s->io_next;
            ts__sub_event(c, s, TS_EV_DISCONNECTED, 0);
            ts__sub_unref(s);
        }
    }
    if (c->shard != NULL) {
        /* A cluster's shard keeps trying (open too), and fails its requests at once meanwhile. */
        ts__cluster_shard_failed(c, err, msg);
    } else if (!c->ever_ready) {
        open_failed(c, err, msg);
        return;
    }
    if (c->state == TS__ST_BACKOFF) {
        uv_timer_start(&c->retry, retry_cb, (uint64_t)c->backoff_ms, 0);
        c->backoff_ms = c->backoff_ms * 2 > c->opts.reconnect_max_ms ? c->opts.reconnect_max_ms
                                                                     : c->backoff_ms * 2;
    }
}

/* Re-send LISTEN for every subscription on a fresh connection. */
static void resubscribe(ts_client_t *c)
{
    ts__req *list = NULL;
    int oom = 0;
    pthread_mutex_lock(&c->mu);
    for (ts__sub *s = c->subs; s != NULL; s = s->next) {
        if (!s->live)
            continue;
        ts__req *r = ts__calloc(1, sizeof(*r));
        if (r == NULL) {
            oom = 1;
            break;
        }
        r->c = c;
        r->kind = TS__K_RESUB;
        r->op = TS_OP_LISTEN;
        ts__msg_name_req m = {.name = (const uint8_t *)s->bin, .name_len = s->bin_len};
        ts__req_body(r, &m); /* cannot fail: ts_listen took a name the encoder takes */
        atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
        r->sub = s;
        r->next = list;
        list = r;
    }
    pthread_mutex_unlock(&c->mu);
    if (oom) {
        /*
         * A subscription left out would miss its changes for as long as this connection lasts:
         * drop it and try again after the backoff instead.
         */
        while (list != NULL) {
            ts__req *r = list;
            list = r->next;
            ts__req_free(r);
        }
        ts__conn_fail(c, c->conn, TS_ENOMEM, "out of memory while resubscribing");
        return;
    }
    while (list != NULL && c->state == TS__ST_READY) {
        ts__req *r = list;
        list = r->next;
        r->next = NULL;
        ts__req_send(c, r);
    }
    while (list != NULL) {
        ts__req *r = list;
        list = r->next;
        ts__req_free(r);
    }
}

/* The handshake succeeded: the connection is ready for requests. */
static void go_ready(ts_client_t *c)
{
    c->state = TS__ST_READY;
    uv_timer_stop(&c->retry);
    c->backoff_ms = c->opts.reconnect_min_ms;
    c->down_msg[0] = '\0';
    atomic_store(&c->connected, 1);
    if (!c->ever_ready) {
        c->ever_ready = 1;
        pthread_mutex_lock(&c->mu);
        c->open_done = 1;
        c->open_status = 0;
        pthread_cond_broadcast(&c->open_cond);
        pthread_mutex_unlock(&c->mu);
    }
    resubscribe(c);
    ts__svc_reregister(c); /* service.c */
    /* Requests that waited for the connection go out in the order they were made. */
    while (c->state == TS__ST_READY && c->waitq_head != NULL) {
        ts__req *r = c->waitq_head;
        c->waitq_head = r->next;
        if (c->waitq_head == NULL)
            c->waitq_tail = NULL;
        r->next = NULL;
        ts__req_send(c, r);
    }
    uv_os_fd_t fd;
    ts__conn *conn = c->conn;
    if (c->state == TS__ST_READY && c->direct_allowed && uv_fileno(&conn->u.handle, &fd) == 0) {
        /* The hang-up watcher lets the I/O thread stop reading while nothing is awaited. */
        int dup_fd = c->pb != NULL ? dup(fd) : -1;
        if (dup_fd >= 0 && uv_poll_init(&c->loop, &conn->hup, dup_fd) == 0) {
            conn->hup.data = conn;
            conn->hup_fd = dup_fd;
            conn->handles++;
        } else if (dup_fd >= 0) {
            close(dup_fd);
        }
        pthread_mutex_lock(&c->mu);
        c->d_ready = 1;
        c->d_fd = fd;
        c->d_lz4 = conn->lz4;
        c->d_max_body = conn->max_body;
        pthread_mutex_unlock(&c->mu);
    }
    if (c->shard != NULL && c->state == TS__ST_READY)
        ts__cluster_shard_ready(c); /* asks the daemon for its shard map */
}

static void send_hello_proof(ts_client_t *c, ts__conn *conn, int proof);

void ts__hello_done(ts_client_t *c, ts__req *r, int status)
{
    ts__conn *conn = c->conn;
    if (r->op == TS_OP_AUTH_CHALLENGE && status != 0) {
        char msg[TS_MAX_ERRMSG + 160];
        snprintf(msg, sizeof(msg),
                 "handshake refused: AUTH_CHALLENGE failed (%s%s%s); a server older than 0.5.0 "
                 "takes the token only in clear, which this client never sends",
                 ts_strerror(status), r->msg != NULL ? ": " : "", r->msg != NULL ? r->msg : "");
        ts__conn_fail_reason(c, conn, status == TS_EPROTO ? TS_EAUTH : status, msg, 1);
        return;
    }
    if (r->op == TS_OP_AUTH_CHALLENGE) {
        memcpy(conn->auth_nonces + TS_MSG_AUTH_NONCE_SIZE, r->hello_proof, TS_MSG_AUTH_NONCE_SIZE);
        send_hello_proof(c, conn, 1);
        return;
    }
    if (status != 0) {
        char msg[TS_MAX_ERRMSG + 64];
        /* The server's message alone when it already begins with what the status says. */
        const char *what = ts_strerror(status);
        if (r->msg != NULL && strncmp(r->msg, what, strlen(what)) == 0)
            snprintf(msg, sizeof(msg), "handshake refused: %s", r->msg);
        else
            snprintf(msg, sizeof(msg), "handshake refused: %s%s%s", what,
                     r->msg != NULL ? ": " : "", r->msg != NULL ? r->msg : "");
        /* The server's own verdict (not a lost or broken connection) reaches the callers. */
        int verdict = status != TS_EPROTO && status != TS_ETIMEDOUT && status != TS_ENOMEM &&
                      status != TS_ECONNRESET;
        ts__conn_fail_reason(c, conn, status, msg, verdict);
        return;
    }
    if (r->hello_flags & TS_HELLO_TOKEN_PROOF) {
        /*
         * The server proves that it knows the token too. (One that did not grant the flag has no
         * token: it checked nothing, and this client sent only a proof, never the token.)
         */
        uint8_t want[TS_MSG_TOKEN_PROOF_SIZE];
        ts__auth_proof(c->token, c->token_len, TS_AUTH_SERVER, conn->auth_nonces,
                       conn->auth_nonces + TS_MSG_AUTH_NONCE_SIZE, want);
        int ok = c->token_len > 0 && ts__ct_equal(want, r->hello_proof, sizeof(want));
        ts__wipe(want, sizeof(want));
        if (!ok) {
            ts__conn_fail_reason(c, conn, TS_EAUTH,
                                 "handshake refused: the server's token proof is wrong (it does "
                                 "not know the token)",
                                 1);
            return;
        }
    }
    conn->lz4 = (r->hello_flags & TS_HELLO_LZ4) != 0 && c->opts.compress_min > 0;
    conn->max_body = r->hello_max_body != 0 ? r->hello_max_body : TS_DEFAULT_MAX_FRAME;
    atomic_store(&c->lz4, conn->lz4);
    go_ready(c);
}

/*
 * With a token: send AUTH_CHALLENGE with a fresh nonce; HELLO follows its reply (ts__hello_done)
 * and carries a proof of the token, never the token itself (docs/PROTOCOL.md section 4).
 */
static void send_challenge(ts_client_t *c, ts__conn *conn)
{
    ts__req *r = ts__calloc(1, sizeof(*r));
    if (r == NULL) {
        ts__conn_fail(c, conn, TS_ENOMEM, "out of memory");
        return;
    }
    if (ts__auth_nonce(conn->auth_nonces) != 0) {
        ts__free(r);
        ts__conn_fail(c, conn, TS_EAGAIN, "no random bytes for the token proof's nonce");
        return;
    }
    r->c = c;
    r->kind = TS__K_HELLO;
    r->op = TS_OP_AUTH_CHALLENGE;
    memcpy(r->small + TS_HDR_SIZE, conn->auth_nonces, TS_MSG_AUTH_NONCE_SIZE);
    r->small_len = TS_MSG_AUTH_NONCE_SIZE;
    r->body_len = TS_MSG_AUTH_NONCE_SIZE;
    c->state = TS__ST_HELLO;
    ts__req_send(c, r);
}

/* Connected: start reading and send HELLO (after AUTH_CHALLENGE when there is a token). */
static void send_hello(ts_client_t *c, ts__conn *conn)
{
    if (c->token_len > 0)
        send_challenge(c, conn);
    else
        send_hello_proof(c, conn, 0);
}

/* Send HELLO; proof: its token field is the proof of the token (the nonces are in conn). */
static void send_hello_proof(ts_client_t *c, ts__conn *conn, int proof)
{
    ts__req *r = ts__calloc(1, sizeof(*r));
    if (r == NULL) {
        ts__conn_fail(c, conn, TS_ENOMEM, "out of memory");
        return;
    }
    r->c = c;
    r->kind = TS__K_HELLO;
    r->op = TS_OP_HELLO;
    uint8_t tag[TS_MSG_TOKEN_PROOF_SIZE];
    if (proof)
        ts__auth_proof(c->token, c->token_len, TS_AUTH_CLIENT, conn->auth_nonces,
                       conn->auth_nonces + TS_MSG_AUTH_NONCE_SIZE, tag);
    uint8_t flags = c->opts.compress_min > 0 ? TS_HELLO_LZ4 : 0;
    ts__msg_hello_req m = {.max_version = TS_PROTO_VERSION,
                           .flags = (uint8_t)(flags | (proof ? TS_HELLO_TOKEN_PROOF : 0)),
                           .token_len = proof ? (uint16_t)sizeof(tag) : 0,
                           .token = proof ? tag : NULL};
    /* The body goes in the frame's small buffer when it fits, else in a buffer of its own. */
    size_t need = ts__msg_hello_req_size(m.token_len);
    uint8_t *out = r->small + TS_HDR_SIZE;
    size_t cap = sizeof(r->small) - TS_HDR_SIZE;
    if (need > cap) {
        out = r->flat = ts__malloc_aligned(need);
        cap = r->flat_cap = need;
    }
    size_t len = 0;
    int rc = out == NULL ? TS_ENOMEM : ts__msg_hello_req_encode(out, cap, &m, &len);
    if (rc != 0) { /* setup_options refused a longer token, so only memory can be missing */
        ts__req_free(r);
        ts__conn_fail(c, conn, rc, "out of memory");
        return;
    }
    if (r->flat != NULL)
        r->flat_len = len;
    else
        r->small_len = len;
    r->body_len = len;
    c->state = TS__ST_HELLO;
    ts__req_send(c, r);
}

static void connect_cb(uv_connect_t *req, int status)
{
    ts__conn *conn = req->data;
    ts_client_t *c = conn->c;
    if (conn->closing)
        return;
    if (status < 0) {
        /* On a unix socket, EACCES is the file system's word: say which permission is missing. */
        const char *msg = status == UV_EACCES && c->unix_path != NULL
                              ? "permission denied connecting to the socket (its file's mode, or "
                                "a directory's on its path, refuses this user)"
                              : uv_strerror(status);
        ts__conn_fail(c, conn, map_connect_err(status), msg);
        return;
    }
    if (c->tls_ctx != NULL && conn->tls == NULL && ts__conn_tls_start(c, conn) != 0) {
        ts__conn_fail(c, conn, TS_ENOMEM, "out of memory for a TLS session");
        return;
    }
    if (ts__read_start(c, conn) == 0)
        send_hello(c, conn); /* queued behind the TLS handshake, which runs first */
}

/* Connect a new TCP handle to addr. */
static void connect_tcp(ts_client_t *c, const struct sockaddr *addr)
{
    ts__conn *conn = conn_new(c);
    if (conn == NULL) {
        ts__conn_fail(c, NULL, TS_ENOMEM, "out of memory");
        return;
    }
    uv_tcp_init(&c->loop, &conn->u.tcp);
    conn->u.handle.data = conn;
    conn->connect.data = conn;
    /* Small requests must not wait for Nagle's algorithm. */
    uv_tcp_nodelay(&conn->u.tcp, 1);
    c->conn = conn;
    int rc = uv_tcp_connect(&conn->connect, &conn->u.tcp, addr, connect_cb);
    if (rc != 0)
        ts__conn_fail(c, conn, map_connect_err(rc), uv_strerror(rc));
}

typedef struct resolve_req {
    uv_getaddrinfo_t req;
    ts_client_t *c;
    unsigned gen;
} resolve_req;

static void resolve_cb(uv_getaddrinfo_t *req, int status, struct addrinfo *res)
{
    resolve_req *rr = (resolve_req *)req;
    ts_client_t *c = rr->c;
    int current = rr->gen == c->gen && c->state == TS__ST_CONNECTING;
    ts__free(rr);
    if (!current) {
        uv_freeaddrinfo(res);
        return;
    }
    if (status < 0 || res == NULL) {
        char msg[128];
        snprintf(msg, sizeof(msg), "cannot resolve %s: %s", c->host, uv_strerror(status));
        uv_freeaddrinfo(res);
        ts__conn_fail(c, NULL, TS_ENOTCONN, msg);
        return;
    }
    /* tensord binds 127.0.0.1 by default, while "localhost" often lists ::1 first. */
    const struct addrinfo *pick = res;
    for (const struct addrinfo *ai = res; ai != NULL; ai = ai->ai_next) {
        if (ai->ai_family == AF_INET) {
            pick = ai;
            break;
        }
    }
    connect_tcp(c, pick->ai_addr);
    uv_freeaddrinfo(res);
}

/* Start one connection attempt, bounded by the connect timeout. */
void ts__start_attempt(ts_client_t *c)
{
    c->gen++;
    c->state = TS__ST_CONNECTING;
    uv_timer_start(&c->retry, retry_cb, (uint64_t)c->opts.connect_timeout_ms, 0);
    if (c->unix_path != NULL) {
        ts__conn *conn = conn_new(c);
        if (conn == NULL) {
            ts__conn_fail(c, NULL, TS_ENOMEM, "out of memory");
            return;
        }
        uv_pipe_init(&c->loop, &conn->u.pipe, 0);
        conn->u.handle.data = conn;
        conn->connect.data = conn;
        c->conn = conn;
        uv_pipe_connect(&conn->connect, &conn->u.pipe, c->unix_path, connect_cb);
        return;
    }
    /* Numeric addresses need no resolver (and no thread pool). */
    struct sockaddr_storage ss;
    if (uv_ip4_addr(c->host, c->port, (struct sockaddr_in *)&ss) == 0 ||
        uv_ip6_addr(c->host, c->port, (struct sockaddr_in6 *)&ss) == 0) {
        connect_tcp(c, (const struct sockaddr *)&ss);
        return;
    }
    resolve_req *rr = ts__calloc(1, sizeof(*rr));
    if (rr == NULL) {
        ts__conn_fail(c, NULL, TS_ENOMEM, "out of memory");
        return;
    }
    rr->c = c;
    rr->gen = c->gen;
    char port[16];
    snprintf(port, sizeof(port), "%d", c->port);
    struct addrinfo hints;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int rc = uv_getaddrinfo(&c->loop, &rr->req, resolve_cb, c->host, port, &hints);
    if (rc != 0) {
        ts__free(rr);
        ts__conn_fail(c, NULL, TS_ENOTCONN, uv_strerror(rc));
    }
}

/* The one timer of the connection: the connect timeout while connecting, else the backoff. */
static void retry_cb(uv_timer_t *t)
{
    ts_client_t *c = t->data;
    if (c->state == TS__ST_BACKOFF)
        ts__start_attempt(c);
    else if (c->state == TS__ST_CONNECTING || c->state == TS__ST_HELLO)
        ts__conn_fail(c, c->conn, TS_ETIMEDOUT, "connect timed out");
}

/* Split address into host/port or a unix path. 0 or TS_EINVAL. */
int ts__parse_address(ts_client_t *c, const char *address)
{
    const char *a = address;
    if (strncmp(a, "unix://", 7) == 0 || strncmp(a, "unix:", 5) == 0) {
        a += strncmp(a, "unix://", 7) == 0 ? 7 : 5;
        if (a[0] == '\0')
            return TS_EINVAL;
        c->unix_path = ts__strndup(a, strlen(a));
        return c->unix_path != NULL ? 0 : TS_ENOMEM;
    }
    if (strncmp(a, "tls://", 6) == 0)
        c->tls = 1; /* the tls options apply (ts__client_tls_setup) */
    if (strncmp(a, "tcp://", 6) == 0 || strncmp(a, "tls://", 6) == 0)
        a += 6;
    else if (strstr(a, "://") != NULL)
        return TS_EINVAL; /* another scheme ("http://..."), not a host to resolve */
    const char *colon = strrchr(a, ':');
    if (colon == NULL || colon == a || colon[1] == '\0')
        return TS_EINVAL;
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (*end != '\0' || port <= 0 || port > 65535)
        return TS_EINVAL;
    const char *h = a;
    size_t hl = (size_t)(colon - a);
    if (h[0] == '[') { /* [v6-address]:port */
        if (hl < 3 || h[hl - 1] != ']')
            return TS_EINVAL;
        h++;
        hl -= 2;
    }
    /* No host name or IP address holds these; "[h1:p1,h2:p2]:8000" is not one address. */
    for (size_t i = 0; i < hl; i++)
        if ((unsigned char)h[i] <= 0x20 || strchr("/[],", h[i]) != NULL)
            return TS_EINVAL;
    c->host = ts__strndup(h, hl);
    c->port = (int)port;
    return c->host != NULL ? 0 : TS_ENOMEM;
}
