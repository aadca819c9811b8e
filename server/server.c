/*
 * The server object: listeners (TCP and a unix socket), accepting, signals, the housekeeping
 * cron, flushing of pending output, and the graceful shutdown.
 */
#include "server.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define TSD_BACKLOG 511 /* connections; the listen queue */

static int g_log_level = TSD_LOG_INFO;

void tsd_log_set_level(int level)
{
    g_log_level = level;
}

void tsd_log(int level, const char *fmt, ...)
{
    static const char *const names[] = {"error", "warn", "info", "debug"};
    if (level > g_log_level)
        return;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char when[32];
    strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &tm);
    char line[1200];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    fprintf(stderr, "%s.%03ldZ tensord[%d] %s: %s\n", when, ts.tv_nsec / 1000000L, (int)getpid(),
            names[level], line);
}

uint64_t tsd_server_next_version(tsd_server *srv)
{
    return ++srv->version;
}

void tsd_server_mark_dirty(tsd_server *srv, tsd_conn *c)
{
    if (c->dirty || c->closing)
        return;
    c->dirty = 1;
    c->dirty_next = srv->dirty;
    srv->dirty = c;
}

void tsd_server_flush(tsd_server *srv)
{
    while (srv->dirty != NULL) {
        tsd_conn *c = srv->dirty;
        srv->dirty = c->dirty_next;
        c->dirty_next = NULL;
        c->dirty = 0;
        tsd_conn_flush(c);
    }
}

void tsd_server_link_conn(tsd_server *srv, tsd_conn *c)
{
    c->prev = NULL;
    c->next = srv->conns;
    if (srv->conns != NULL)
        srv->conns->prev = c;
    srv->conns = c;
    srv->n_conns++;
}

void tsd_server_unlink_conn(tsd_server *srv, tsd_conn *c)
{
    if (c->prev != NULL)
        c->prev->next = c->next;
    else if (srv->conns == c)
        srv->conns = c->next;
    else
        return; /* not linked */
    if (c->next != NULL)
        c->next->prev = c->prev;
    c->prev = c->next = NULL;
    if (!c->uncounted)
        srv->n_conns--;
}

void tsd_server_conn_freed(tsd_server *srv)
{
    srv->n_alive--;
}

static void on_connection(uv_stream_t *server, int status, int is_unix)
{
    tsd_server *srv = server->data;
    if (status < 0) {
        tsd_log(TSD_LOG_WARN, "listener: %s", uv_strerror(status));
        return;
    }
    if (srv->stopping)
        return;
    tsd_conn_accept(srv, server, is_unix);
    tsd_server_flush(srv);
}

static void on_tcp_connection(uv_stream_t *server, int status)
{
    on_connection(server, status, 0);
}

static void on_unix_connection(uv_stream_t *server, int status)
{
    on_connection(server, status, 1);
}

static void on_signal(uv_signal_t *h, int signum)
{
    tsd_server *srv = h->data;
    tsd_log(TSD_LOG_INFO, "signal %d: shutting down", signum);
    tsd_server_stop(srv);
}

/*
 * Housekeeping: connections that were told to go (protocol error, slow reader) but whose
 * client does not read the last reply are dropped once their grace period ends.
 */
static void on_cron(uv_timer_t *t)
{
    tsd_server *srv = t->data;
    uint64_t now = uv_now(srv->loop);
    tsd_conn *c = srv->conns;
    while (c != NULL) {
        tsd_conn *next = c->next;
        if (c->close_after_flush && now >= c->close_deadline)
            tsd_conn_close(c);
        c = next;
    }
    tsd_server_flush(srv);
}

/* Write the bound port to path atomically (temporary file + rename). 0 or -1. */
static int write_port_file(const char *path, int port)
{
    char tmp[4096];
    int n = snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid());
    if (n < 0 || (size_t)n >= sizeof(tmp))
        return -1;
    FILE *f = fopen(tmp, "w");
    if (f == NULL)
        return -1;
    int ok = fprintf(f, "%d\n", port) > 0;
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

static int listen_tcp(tsd_server *srv)
{
    const tsd_config *cfg = &srv->cfg;
    struct sockaddr_storage addr;
    int rc;
    if (strchr(cfg->host, ':') != NULL)
        rc = uv_ip6_addr(cfg->host, cfg->port, (struct sockaddr_in6 *)&addr);
    else
        rc = uv_ip4_addr(cfg->host, cfg->port, (struct sockaddr_in *)&addr);
    if (rc != 0) {
        tsd_log(TSD_LOG_ERROR, "bad --host address '%s': %s", cfg->host, uv_strerror(rc));
        return rc;
    }
    uv_tcp_init(srv->loop, &srv->tcp);
    srv->tcp.data = srv;
    srv->have_tcp = 1;
    rc = uv_tcp_bind(&srv->tcp, (const struct sockaddr *)&addr, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&srv->tcp, TSD_BACKLOG, on_tcp_connection);
    if (rc != 0) {
        tsd_log(TSD_LOG_ERROR, "cannot listen on %s:%d: %s", cfg->host, cfg->port, uv_strerror(rc));
        return rc;
    }
    struct sockaddr_storage bound;
    int blen = sizeof(bound);
    rc = uv_tcp_getsockname(&srv->tcp, (struct sockaddr *)&bound, &blen);
    if (rc != 0)
        return rc;
    if (bound.ss_family == AF_INET6)
        srv->bound_port = ntohs(((struct sockaddr_in6 *)&bound)->sin6_port);
    else
        srv->bound_port = ntohs(((struct sockaddr_in *)&bound)->sin_port);
    tsd_log(TSD_LOG_INFO, "listening on %s:%d", cfg->host, srv->bound_port);
    return 0;
}

static int listen_unix(tsd_server *srv)
{
    const char *path = srv->cfg.unix_path;
    struct stat st;
    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) {
            tsd_log(TSD_LOG_ERROR, "--unix %s exists and is not a socket", path);
            return UV_EEXIST;
        }
        /* A socket file left by a previous run that did not exit cleanly. */
        if (unlink(path) != 0) {
            tsd_log(TSD_LOG_ERROR, "cannot remove stale socket %s: %s", path, strerror(errno));
            return UV_EEXIST;
        }
    }
    uv_pipe_init(srv->loop, &srv->pipe, 0);
    srv->pipe.data = srv;
    srv->have_pipe = 1;
    int rc = uv_pipe_bind(&srv->pipe, path);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&srv->pipe, TSD_BACKLOG, on_unix_connection);
    if (rc != 0) {
        tsd_log(TSD_LOG_ERROR, "cannot listen on unix socket %s: %s", path, uv_strerror(rc));
        return rc;
    }
    tsd_log(TSD_LOG_INFO, "listening on unix:%s", path);
    return 0;
}

int tsd_server_init(tsd_server *srv, uv_loop_t *loop, const tsd_config *cfg)
{
    memset(srv, 0, sizeof(*srv));
    srv->loop = loop;
    srv->cfg = *cfg;
    loop->data = srv;
    tsd_log_set_level(cfg->log_level);
    srv->start_ns = ts__now_ns();
    /* Versions start at the wall clock in microseconds, so they keep growing across restarts. */
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    srv->version = (uint64_t)now.tv_sec * 1000000u + (uint64_t)now.tv_nsec / 1000u;
    if (uv_random(NULL, NULL, &srv->server_id, sizeof(srv->server_id), 0, NULL) != 0)
        srv->server_id = srv->version ^ ((uint64_t)getpid() << 32);

    int rc = tsd_store_init(&srv->store, cfg->max_memory);
    if (rc == 0)
        rc = tsd_htab_init(&srv->watches);
    if (rc != 0)
        return rc;

    uv_signal_init(loop, &srv->sigint);
    uv_signal_init(loop, &srv->sigterm);
    srv->sigint.data = srv->sigterm.data = srv;
    uv_signal_start(&srv->sigint, on_signal, SIGINT);
    uv_signal_start(&srv->sigterm, on_signal, SIGTERM);
    uv_timer_init(loop, &srv->cron);
    srv->cron.data = srv;
    uv_timer_start(&srv->cron, on_cron, TSD_CRON_MS, TSD_CRON_MS);

    rc = listen_tcp(srv);
    if (rc == 0 && cfg->unix_path != NULL)
        rc = listen_unix(srv);
    if (rc != 0)
        return rc;
    if (cfg->port_file != NULL && write_port_file(cfg->port_file, srv->bound_port) != 0) {
        tsd_log(TSD_LOG_ERROR, "cannot write --port-file %s", cfg->port_file);
        return UV_EIO;
    }
    tsd_log(TSD_LOG_INFO,
            "tensord %s ready: max-frame %llu, max-memory %llu, max-clients %u, max-output %llu",
            TS_VERSION_STRING, (unsigned long long)cfg->max_frame,
            (unsigned long long)cfg->max_memory, cfg->max_clients,
            (unsigned long long)cfg->max_output);
    return 0;
}

void tsd_server_stop(tsd_server *srv)
{
    if (srv->stopping)
        return;
    srv->stopping = 1;
    if (srv->have_tcp)
        uv_close((uv_handle_t *)&srv->tcp, NULL);
    if (srv->have_pipe) {
        uv_close((uv_handle_t *)&srv->pipe, NULL);
        (void)unlink(srv->cfg.unix_path);
    }
    if (srv->sigint.loop != NULL) {
        uv_close((uv_handle_t *)&srv->sigint, NULL);
        uv_close((uv_handle_t *)&srv->sigterm, NULL);
        uv_close((uv_handle_t *)&srv->cron, NULL);
    }
    while (srv->conns != NULL)
        tsd_conn_close(srv->conns);
    /* The bins go now; items still being written are freed by their write callbacks. */
    tsd_store_free(&srv->store);
}

void tsd_server_free(tsd_server *srv)
{
    tsd_store_free(&srv->store);
    tsd_htab_free(&srv->watches);
    tsd_pool_drain();
}
