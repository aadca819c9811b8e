/*
 * The server object: listeners (TCP and a unix socket), accepting, signals, the housekeeping
 * cron, flushing of pending output, and the graceful shutdown.
 *
 * tensord accepts connections itself (a uv_poll_t on each listening socket) instead of through
 * uv_listen: when it runs out of file descriptors or memory it can then stop accepting for a
 * while and leave new connections waiting in the kernel's queue. libuv's own accept loop would
 * accept them and drop them at once to make room.
 */
#include "server.h"
#include "coord.h"
#include "http.h"
#include "ps.h"
#include "service.h"
#include "stream.h"
#include "table.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
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
        if (c->close_after_flush && !c->let_go && !c->closing) {
            /*
             * It is closing (an error, a slow reader, its peer's end): it holds nothing from
             * now on, as if closed already. Its waits and subscriptions go, and the calls it
             * held as a service's server are answered SERVICE_GONE now, not when the grace
             * period ends. Here, outside every walk of those lists; what this answers on other
             * connections marks them dirty, and this loop flushes them too.
             */
            c->let_go = 1;
            tsd_notify_conn_gone(srv, c);
        }
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

/* The shutdown's grace timer is no longer needed: close it (once). */
static void stop_timer_close(tsd_server *srv)
{
    if (!srv->stop_timer_open)
        return;
    srv->stop_timer_open = 0;
    uv_close((uv_handle_t *)&srv->stop_timer, NULL);
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
    /* Stopping, and the last connection is closed: nothing is left for the grace to end. */
    if (srv->stopping && srv->conns == NULL)
        stop_timer_close(srv);
}

void tsd_server_conn_freed(tsd_server *srv)
{
    srv->n_alive--;
}

static void on_retry(uv_timer_t *t);
static void on_accept_resume(uv_timer_t *t);

void tsd_server_starve(tsd_server *srv, tsd_conn *c)
{
    if (c->starved)
        return;
    c->starved = 1;
    c->starved_next = srv->starved;
    srv->starved = c;
    if (!uv_is_active((uv_handle_t *)&srv->retry_timer))
        uv_timer_start(&srv->retry_timer, on_retry, TSD_RETRY_MS, 0);
}

static void on_fd_retry(uv_timer_t *t);

void tsd_server_fd_blocked(tsd_server *srv, tsd_conn *c)
{
    if (c->fd_blocked)
        return;
    /* A first full socket starts the back-off afresh; one still full after a retry goes on. */
    if (srv->fd_blocked == NULL && !srv->fd_retrying)
        srv->fd_retry_ms = TSD_FD_RETRY_MS;
    c->fd_blocked = 1;
    c->fd_blocked_next = srv->fd_blocked;
    srv->fd_blocked = c;
    if (srv->handles_init && !uv_is_active((uv_handle_t *)&srv->fd_timer))
        uv_timer_start(&srv->fd_timer, on_fd_retry, srv->fd_retry_ms, 0);
}

void tsd_server_fd_unblock(tsd_server *srv, tsd_conn *c)
{
    if (!c->fd_blocked)
        return;
    for (tsd_conn **p = &srv->fd_blocked; *p != NULL; p = &(*p)->fd_blocked_next) {
        if (*p == c) {
            *p = c->fd_blocked_next;
            break;
        }
    }
    c->fd_blocked = 0;
    c->fd_blocked_next = NULL;
    if (srv->fd_blocked == NULL && srv->handles_init)
        uv_timer_stop(&srv->fd_timer);
}

/*
 * Descriptor frames that met a full socket are tried again (a full socket gives no other sign
 * that would reach us: libuv watches it only while its own write queue holds something).
 */
static void on_fd_retry(uv_timer_t *t)
{
    tsd_server *srv = t->data;
    tsd_conn *c = srv->fd_blocked;
    srv->fd_blocked = NULL;
    srv->fd_retry_ms =
        srv->fd_retry_ms * 2 > TSD_FD_RETRY_MAX_MS ? TSD_FD_RETRY_MAX_MS : srv->fd_retry_ms * 2;
    srv->fd_retrying = 1;
    while (c != NULL) {
        tsd_conn *next = c->fd_blocked_next;
        c->fd_blocked_next = NULL;
        c->fd_blocked = 0;
        tsd_out_fd_retry(c);
        c = next;
    }
    srv->fd_retrying = 0;
    tsd_server_flush(srv);
}

/* Starved connections get another chance to allocate their input buffer. */
static void on_retry(uv_timer_t *t)
{
    tsd_server *srv = t->data;
    tsd_conn *c = srv->starved;
    srv->starved = NULL;
    while (c != NULL) {
        tsd_conn *next = c->starved_next;
        c->starved_next = NULL;
        c->starved = 0;
        tsd_conn_resume_read(c);
        c = next;
    }
    tsd_server_flush(srv);
}

static void on_listener_io(uv_poll_t *h, int status, int events);

/*
 * Stop accepting for delay_ms. Pending connections wait in the kernel's listen queue instead
 * of being accepted and dropped, and the loop does not spin on a listener it cannot serve.
 */
static void accept_pause(tsd_server *srv, uint64_t delay_ms)
{
    if (srv->accept_paused || srv->stopping)
        return;
    srv->accept_paused = 1;
    srv->stats.accept_pauses++;
    for (int i = 0; i < 2; i++)
        if (srv->lis[i].active)
            uv_poll_stop(&srv->lis[i].poll);
    uv_timer_start(&srv->accept_timer, on_accept_resume, delay_ms, 0);
}

static void on_accept_resume(uv_timer_t *t)
{
    tsd_server *srv = t->data;
    srv->accept_paused = 0;
    if (srv->stopping)
        return;
    for (int i = 0; i < 2; i++)
        if (srv->lis[i].active)
            uv_poll_start(&srv->lis[i].poll, UV_READABLE, on_listener_io);
}

#define TSD_ACCEPT_BATCH 64 /* connections accepted per wake-up, so one listener cannot hog */

/*
 * Accept what the listener holds. Out of file descriptors (EMFILE, ENFILE): log once per
 * episode, pause accepting for TSD_ACCEPT_PAUSE_MS and try again then. Out of memory for a
 * connection object (allocated before accepting): pause briefly and retry. Either way the
 * clients wait in the kernel's listen queue rather than being accepted and dropped.
 */
static void on_listener_io(uv_poll_t *h, int status, int events)
{
    tsd_listener *l = h->data;
    tsd_server *srv = h->loop->data;
    (void)events;
    if (status < 0) {
        tsd_log(TSD_LOG_WARN, "listener: %s", uv_strerror(status));
        return;
    }
    for (int n = 0; n < TSD_ACCEPT_BATCH && !srv->stopping && !srv->accept_paused; n++) {
        if (srv->spare == NULL)
            srv->spare = tsd_conn_alloc();
        if (srv->spare == NULL) {
            srv->stats.out_of_memory++;
            tsd_log(TSD_LOG_ERROR, "out of memory for a new connection; pausing accepts");
            accept_pause(srv, TSD_RETRY_MS);
            break;
        }
        /* uv_tcp_open and uv_pipe_open make the socket non-blocking. */
        int fd = accept(l->fd, NULL, NULL);
        if (fd < 0) {
            int e = errno;
            if (e == EINTR || e == ECONNABORTED)
                continue;
            if (e == EMFILE || e == ENFILE) {
                srv->fd_refused++;
                if (!srv->fd_exhausted) {
                    srv->fd_exhausted = 1;
                    tsd_log(TSD_LOG_WARN,
                            "out of file descriptors (%s) with %zu clients: pausing accepts for "
                            "%d ms at a time until some are free",
                            strerror(e), srv->n_conns, TSD_ACCEPT_PAUSE_MS);
                }
                accept_pause(srv, TSD_ACCEPT_PAUSE_MS);
            } else if (e != EAGAIN && e != EWOULDBLOCK) {
                tsd_log(TSD_LOG_WARN, "accept: %s", strerror(e));
            }
            break;
        }
        if (srv->fd_exhausted) {
            srv->fd_exhausted = 0;
            tsd_log(TSD_LOG_WARN, "accepting connections again (%llu attempts waited for a fd)",
                    (unsigned long long)srv->fd_refused);
            srv->fd_refused = 0;
        }
        tsd_conn *c = srv->spare;
        srv->spare = NULL;
        tsd_conn_accept(srv, c, fd, l->is_unix);
    }
    tsd_server_flush(srv);
}

/*
 * SIGINT and SIGTERM start the graceful shutdown. Their handles stay open until the process
 * exits (tsd_server_release_signals): were they closed while stopping, the default action of a
 * second signal would end the process in the middle of the final snapshot, losing every change
 * since the last one. SIGHUP is ignored, as a closed terminal or a stray kill -HUP must not
 * lose data; it only logs a line.
 */
static void on_signal(uv_signal_t *h, int signum)
{
    tsd_server *srv = h->data;
    if (signum == SIGHUP) {
        tsd_log(TSD_LOG_WARN, "SIGHUP ignored (SIGINT or SIGTERM stop tensord)");
        return;
    }
    if (srv->stopping) {
        tsd_log(TSD_LOG_WARN, "signal %d: a shutdown is already in progress%s", signum,
                srv->snap_job != NULL ? " (writing the final snapshot)" : "");
        return;
    }
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
        tsd_conn_cron(c, now);
        c = next;
    }
    /* Streams: age retention, and lease checks a timer could not be had for. */
    tsd_streams_cron(srv);
    tsd_coord_cron(srv); /* TAKE and BARRIER deadlines */
    tsd_server_flush(srv);
}

static void on_save_timer(uv_timer_t *t)
{
    tsd_snapshot_tick(t->data);
}

int tsd_flag_string(const char *flag, const char *val, int argc, char **argv, int *i,
                    const char **dst)
{
    if (val == NULL) {
        if (*i + 1 >= argc) {
            fprintf(stderr, "tensord: %s needs a value (see --help)\n", flag);
            return -1;
        }
        val = argv[++*i];
    }
    if (val[0] == '\0') {
        fprintf(stderr, "tensord: bad value for %s: ''\n", flag);
        return -1;
    }
    *dst = val;
    return 1;
}

int tsd_write_port_file(const char *path, int port)
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

/* Start polling a bound, listening socket fd. 0 or a libuv code (fd then closed). */
static int listener_start(tsd_server *srv, tsd_listener *l, int fd, int is_unix)
{
    l->fd = fd;
    l->is_unix = is_unix;
    int rc = uv_poll_init(srv->loop, &l->poll, fd);
    if (rc != 0) {
        close(fd);
        return rc;
    }
    l->poll.data = l;
    l->active = 1;
    return uv_poll_start(&l->poll, UV_READABLE, on_listener_io);
}

static int listen_tcp(tsd_server *srv)
{
    const tsd_config *cfg = &srv->cfg;
    struct sockaddr_storage addr;
    socklen_t alen;
    int rc;
    memset(&addr, 0, sizeof(addr));
    if (strchr(cfg->host, ':') != NULL) {
        rc = uv_ip6_addr(cfg->host, cfg->port, (struct sockaddr_in6 *)&addr);
        alen = sizeof(struct sockaddr_in6);
    } else {
        rc = uv_ip4_addr(cfg->host, cfg->port, (struct sockaddr_in *)&addr);
        alen = sizeof(struct sockaddr_in);
    }
    if (rc != 0) {
        tsd_log(TSD_LOG_ERROR, "bad --host address '%s': %s", cfg->host, uv_strerror(rc));
        return rc;
    }
    int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        rc = -errno;
        tsd_log(TSD_LOG_ERROR, "socket: %s", strerror(errno));
        return rc;
    }
    /* A restart must not wait for the old connections' TIME_WAIT to end. */
    int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, (struct sockaddr *)&addr, alen) != 0 || listen(fd, TSD_BACKLOG) != 0) {
        rc = -errno;
        tsd_log(TSD_LOG_ERROR, "cannot listen on %s:%d: %s", cfg->host, cfg->port, strerror(errno));
        close(fd);
        return rc;
    }
    struct sockaddr_storage bound;
    socklen_t blen = sizeof(bound);
    if (getsockname(fd, (struct sockaddr *)&bound, &blen) != 0) {
        rc = -errno;
        close(fd);
        return rc;
    }
    if (bound.ss_family == AF_INET6)
        srv->bound_port = ntohs(((struct sockaddr_in6 *)&bound)->sin6_port);
    else
        srv->bound_port = ntohs(((struct sockaddr_in *)&bound)->sin_port);
    rc = listener_start(srv, &srv->lis[0], fd, 0);
    if (rc != 0)
        return rc;
    tsd_log(TSD_LOG_INFO, "listening on %s:%d", cfg->host, srv->bound_port);
    return 0;
}

/*
 * Whether a server answers on the unix socket at addr: 1 when a connection is accepted or
 * queued (a full backlog still means a listener), 0 when refused (a stale socket file), or a
 * negative errno when it cannot be told.
 */
static int unix_socket_in_use(const struct sockaddr_un *addr)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    int rc = connect(fd, (const struct sockaddr *)addr, sizeof(*addr));
    int e = rc == 0 ? 0 : errno;
    close(fd);
    if (rc == 0 || e == EAGAIN || e == EINPROGRESS)
        return 1;
    if (e == ECONNREFUSED)
        return 0;
    return -e;
}

/* How long start-up waits for another daemon's check-and-bind in the same directory, in ms. */
#define UNIX_DIR_LOCK_WAIT_MS 5000
/* The pause between two tries for that lock, in ms. */
#define UNIX_DIR_LOCK_RETRY_MS 10

/*
 * Lock (flock, exclusive) the directory that holds the --unix socket for the few system calls
 * from the probe to listen(): two daemons started at the same moment on one path could
 * otherwise both find the socket stale, both remove it and both bind, and the first would
 * silently lose its clients. Once one listens, the other's probe (under the lock) sees it.
 * The directory, not a file beside the socket, so that nothing is left behind. Returns the
 * locked directory's fd, or a libuv error (logged, srv->exit_code set).
 */
static int lock_unix_dir(tsd_server *srv, const char *path)
{
    char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
    const char *slash = strrchr(path, '/');
    if (slash == NULL) {
        memcpy(dir, ".", 2);
    } else if (slash == path) {
        memcpy(dir, "/", 2);
    } else {
        size_t n = (size_t)(slash - path); /* below sizeof(dir): listen_unix checked path */
        memcpy(dir, path, n);
        dir[n] = '\0';
    }
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        tsd_log(TSD_LOG_ERROR,
                "--unix %s: cannot open its directory %s to lock it: %s; "
                "refusing to start",
                path, dir, strerror(e));
        srv->exit_code = TSD_EXIT_USAGE;
        return -e;
    }
    for (int waited = 0;; waited += UNIX_DIR_LOCK_RETRY_MS) {
        if (flock(fd, LOCK_EX | LOCK_NB) == 0)
            return fd;
        int e = errno;
        if ((e != EWOULDBLOCK && e != EINTR) || waited >= UNIX_DIR_LOCK_WAIT_MS) {
            tsd_log(TSD_LOG_ERROR,
                    "--unix %s: cannot lock its directory %s: %s; refusing to "
                    "start",
                    path, dir, e == EWOULDBLOCK ? "held by another process" : strerror(e));
            close(fd);
            srv->exit_code = TSD_EXIT_USAGE;
            return e == EWOULDBLOCK ? UV_EBUSY : -e;
        }
        struct timespec ts = {0, UNIX_DIR_LOCK_RETRY_MS * 1000000L};
        nanosleep(&ts, NULL);
    }
}

static int listen_unix_locked(tsd_server *srv, const struct sockaddr_un *addr);

static int listen_unix(tsd_server *srv)
{
    const char *path = srv->cfg.unix_path;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(addr.sun_path)) {
        tsd_log(TSD_LOG_ERROR, "--unix %s: path too long (at most %zu bytes)", path,
                sizeof(addr.sun_path) - 1);
        return UV_ENAMETOOLONG;
    }
    memcpy(addr.sun_path, path, strlen(path) + 1);
    int dfd = lock_unix_dir(srv, path);
    if (dfd < 0)
        return dfd;
    int rc = listen_unix_locked(srv, &addr);
    close(dfd); /* releases the lock: the socket listens now, or start-up fails */
    return rc;
}

/* The probe, the removal of a stale socket, bind and listen, under the directory's lock. */
static int listen_unix_locked(tsd_server *srv, const struct sockaddr_un *paddr)
{
    const char *path = srv->cfg.unix_path;
    struct sockaddr_un addr = *paddr;
    struct stat st;
    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) {
            tsd_log(TSD_LOG_ERROR, "--unix %s exists and is not a socket: refusing to start", path);
            srv->exit_code = TSD_EXIT_USAGE;
            return UV_EEXIST;
        }
        /*
         * Remove only a stale socket, one left by a process that did not exit cleanly: if
         * anything answers on it, another server owns it and would silently lose its clients.
         */
        int in_use = unix_socket_in_use(&addr);
        if (in_use != 0) {
            if (in_use > 0)
                tsd_log(TSD_LOG_ERROR,
                        "--unix %s is in use: another process is listening on it; refusing to "
                        "start",
                        path);
            else
                tsd_log(TSD_LOG_ERROR,
                        "--unix %s: cannot tell whether it is in use (%s); "
                        "refusing to start",
                        path, strerror(-in_use));
            srv->exit_code = TSD_EXIT_USAGE;
            return UV_EADDRINUSE;
        }
        if (unlink(path) != 0) {
            tsd_log(TSD_LOG_ERROR, "cannot remove stale socket %s: %s", path, strerror(errno));
            return UV_EEXIST;
        }
        tsd_log(TSD_LOG_INFO, "removed the stale socket %s", path);
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    if (bind(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0 || listen(fd, TSD_BACKLOG) != 0) {
        int rc = -errno;
        tsd_log(TSD_LOG_ERROR, "cannot listen on unix socket %s: %s", path, strerror(errno));
        close(fd);
        return rc;
    }
    int rc = listener_start(srv, &srv->lis[1], fd, 1);
    if (rc != 0)
        return rc;
    tsd_log(TSD_LOG_INFO, "listening on unix:%s", path);
    return 0;
}

static void pool_noop(uv_work_t *req)
{
    (void)req;
}

static void pool_noop_done(uv_work_t *req, int status)
{
    (void)req;
    (void)status;
}

void tsd_signals_block(sigset_t *old)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &set, old);
}

/*
 * Start libuv's thread pool now, with SIGINT, SIGTERM and SIGHUP blocked, so that its threads
 * inherit that mask and those signals only ever reach the loop thread. At exit the signal
 * handles are closed (which restores the default action) before the signals are ignored; the
 * loop thread blocks them meanwhile (tsd_server_release_signals), and so must every other
 * thread, or one of them could take the default action in that moment.
 */
static void pool_start(tsd_server *srv)
{
    sigset_t old;
    tsd_signals_block(&old);
    if (uv_queue_work(srv->loop, &srv->pool_warm, pool_noop, pool_noop_done) != 0)
        tsd_log(TSD_LOG_WARN, "cannot start the thread pool yet");
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

int tsd_server_init(tsd_server *srv, uv_loop_t *loop, const tsd_config *cfg)
{
    memset(srv, 0, sizeof(*srv));
    srv->save_lock_fd = -1;
    srv->loop = loop;
    srv->cfg = *cfg;
    srv->exit_code = 1;
    loop->data = srv;
    tsd_log_set_level(cfg->log_level);
    srv->start_ns = ts__now_ns();
    /* Versions start at the wall clock in microseconds, so they keep growing across restarts. */
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    srv->version = (uint64_t)now.tv_sec * 1000000u + (uint64_t)now.tv_nsec / 1000u;
    if (uv_random(NULL, NULL, &srv->server_id, sizeof(srv->server_id), 0, NULL) != 0)
        srv->server_id = srv->version ^ ((uint64_t)getpid() << 32);

    tsd_shm_init(srv);
    (void)tsd_reclaim_start(); /* without it, releases happen on the loop thread */
    int rc = tsd_store_init(&srv->store, cfg->max_memory);
    if (rc == 0)
        rc = tsd_htab_init(&srv->watches);
    if (rc == 0)
        rc = tsd_streams_init(srv);
    if (rc == 0)
        rc = tsd_tables_init(srv);
    if (rc != 0)
        return rc;

    if (cfg->save_path != NULL) {
        char err[1024];
        if (tsd_snapshot_prepare(srv, err, sizeof(err)) != 0) {
            tsd_log(TSD_LOG_ERROR, "%s", err);
            srv->exit_code = TSD_EXIT_USAGE;
            return UV_EINVAL;
        }
        uint64_t counter = 0;
        int lr = tsd_snapshot_load(&srv->store, cfg->save_path, &counter, err, sizeof(err));
        if (lr < 0) {
            tsd_log(TSD_LOG_ERROR, "%s", err);
            tsd_log(TSD_LOG_ERROR, "refusing to start: move the file away to start empty, or "
                                   "restore a good copy");
            srv->exit_code = TSD_EXIT_SNAPSHOT;
            return TS_EPROTO;
        }
        if (lr == 0) {
            srv->have_snapshot = 1;
            if (counter > srv->version)
                srv->version = counter;
            tsd_log(TSD_LOG_INFO, "loaded snapshot %s: %zu bins, %llu items, %llu bytes",
                    cfg->save_path, srv->store.bins.count, (unsigned long long)srv->store.n_items,
                    (unsigned long long)srv->store.held);
            uint64_t used = tsd_store_used(&srv->store);
            if (srv->store.max_memory != 0 && used > srv->store.max_memory)
                tsd_log(TSD_LOG_WARN,
                        "the snapshot takes more than --max-memory (%llu of %llu bytes, with "
                        "streams, tables and the parameter server's state): requests that need "
                        "memory are refused until data is removed",
                        (unsigned long long)used, (unsigned long long)srv->store.max_memory);
        } else {
            tsd_log(TSD_LOG_INFO, "no snapshot at %s yet: starting empty", cfg->save_path);
        }
        srv->saved_version = srv->version;
    }
    /* The data directory's files hold the bins (exclusive with --save: main.c). */
    rc = tsd_datadir_start(srv);
    if (rc != 0)
        return rc;

    uv_signal_init(loop, &srv->sigint);
    uv_signal_init(loop, &srv->sigterm);
    uv_signal_init(loop, &srv->sighup);
    srv->sigint.data = srv->sigterm.data = srv->sighup.data = srv;
    uv_signal_start(&srv->sigint, on_signal, SIGINT);
    uv_signal_start(&srv->sigterm, on_signal, SIGTERM);
    uv_signal_start(&srv->sighup, on_signal, SIGHUP);
    pool_start(srv);
    /* Dropping a finished snapshot's references, a slice per loop turn (snapshot.c). */
    uv_idle_init(loop, &srv->drain_idle);
    srv->drain_idle.data = srv;
    uv_timer_init(loop, &srv->cron);
    srv->cron.data = srv;
    uv_timer_start(&srv->cron, on_cron, TSD_CRON_MS, TSD_CRON_MS);
    uv_timer_init(loop, &srv->accept_timer);
    srv->accept_timer.data = srv;
    uv_timer_init(loop, &srv->retry_timer);
    srv->retry_timer.data = srv;
    uv_timer_init(loop, &srv->fd_timer);
    srv->fd_timer.data = srv;
    uv_timer_init(loop, &srv->save_timer);
    srv->save_timer.data = srv;
    uv_timer_init(loop, &srv->stop_timer);
    srv->stop_timer.data = srv;
    srv->stop_timer_open = 1;
    srv->handles_init = 1;
    if (cfg->save_path != NULL && cfg->save_interval_s > 0)
        uv_timer_start(&srv->save_timer, on_save_timer, (uint64_t)cfg->save_interval_s * 1000u,
                       (uint64_t)cfg->save_interval_s * 1000u);

    rc = listen_tcp(srv);
    if (rc == 0 && cfg->unix_path != NULL)
        rc = listen_unix(srv);
    if (rc != 0)
        return rc;
    /*
     * Health and metrics over HTTP: the bins are loaded and the listeners up, so it is ready.
     * Before the --port-file, so that whoever waits for that file finds the HTTP port up too.
     */
    if (cfg->http_port >= 0) {
        rc = tsd_http_start(srv);
        if (rc != 0)
            return rc;
    }
    if (cfg->port_file != NULL && tsd_write_port_file(cfg->port_file, srv->bound_port) != 0) {
        tsd_log(TSD_LOG_ERROR, "cannot write --port-file %s", cfg->port_file);
        return UV_EIO;
    }
    tsd_log(TSD_LOG_INFO,
            "tensord %s ready: max-frame %llu, max-memory %llu, max-clients %u, max-output %llu, "
            "output-soft %llu for %u s, auth %s, snapshots %s",
            TS_VERSION_STRING, (unsigned long long)cfg->max_frame,
            (unsigned long long)cfg->max_memory, cfg->max_clients,
            (unsigned long long)cfg->max_output, (unsigned long long)cfg->output_soft,
            cfg->output_soft_seconds, cfg->auth_token != NULL ? "on" : "off",
            cfg->save_path != NULL ? cfg->save_path : "off");
    srv->exit_code = 0;
    return 0;
}

static void on_listener_closed(uv_handle_t *h)
{
    tsd_listener *l = h->data;
    close(l->fd);
    l->fd = -1;
}

void tsd_server_free_store(tsd_server *srv)
{
    if (srv->store_freed)
        return;
    srv->store_freed = 1;
    tsd_streams_free(srv);
    tsd_coord_free(srv);
    tsd_ps_free(srv);
    tsd_svc_free(srv);
    tsd_tables_free(srv);
    tsd_store_free(&srv->store);
}

/*
 * The shutdown's grace is over: the connections still open (a client that neither read its
 * last frames nor closed) are closed now; what they did not read is lost with them.
 */
static void on_stop_grace(uv_timer_t *t)
{
    tsd_server *srv = t->data;
    size_t n = 0;
    while (srv->conns != NULL) {
        tsd_conn_close(srv->conns);
        n++;
    }
    if (n > 0)
        tsd_log(TSD_LOG_INFO, "closed %zu connections still open %d ms after the shutdown began", n,
                TSD_CLOSE_GRACE_MS);
    stop_timer_close(srv);
}

void tsd_server_stop(tsd_server *srv)
{
    if (srv->stopping)
        return;
    srv->stopping = 1;
    tsd_http_stopping(srv); /* /readyz says 503 until the loop has run out */
    int had_unix = srv->lis[1].active;
    for (int i = 0; i < 2; i++) {
        if (srv->lis[i].active) {
            srv->lis[i].active = 0;
            uv_close((uv_handle_t *)&srv->lis[i].poll, on_listener_closed);
        }
    }
    if (had_unix)
        (void)unlink(srv->cfg.unix_path);
    if (srv->handles_init) {
        /*
         * The signal handles stay open (on_signal says why) but no longer keep the loop
         * running; tsd_server_release_signals closes them once it has run out.
         */
        uv_unref((uv_handle_t *)&srv->sigint);
        uv_unref((uv_handle_t *)&srv->sigterm);
        uv_unref((uv_handle_t *)&srv->sighup);
        uv_close((uv_handle_t *)&srv->cron, NULL);
        uv_close((uv_handle_t *)&srv->accept_timer, NULL);
        uv_close((uv_handle_t *)&srv->retry_timer, NULL);
        uv_close((uv_handle_t *)&srv->save_timer, NULL);
    }
    /* Connections waiting for an input buffer drain their input from now on instead. */
    while (srv->starved != NULL) {
        tsd_conn *c = srv->starved;
        srv->starved = c->starved_next;
        c->starved_next = NULL;
        c->starved = 0;
    }
    /*
     * Every request still waiting for its reply is answered SHUTTING_DOWN (SAVEs first, then
     * each connection's), every connection gets the connection-level SHUTTING_DOWN frame after
     * its replies, and each closes once it has read them and closed its side, or when the grace
     * ends. The final snapshot is written meanwhile: a slow reader never delays it.
     */
    size_t answered = tsd_snapshot_stop(srv), told = 0;
    if (srv->stop_timer_open && srv->conns != NULL)
        uv_timer_start(&srv->stop_timer, on_stop_grace, TSD_CLOSE_GRACE_MS, 0);
    for (tsd_conn *c = srv->conns, *next; c != NULL; c = next) {
        next = c->next;
        if (!c->close_after_flush)
            told++;
        answered += tsd_conn_stop(c);
    }
    tsd_server_flush(srv);
    /* Their waits were answered with the connections': the streams' timers go now. */
    tsd_streams_stop(srv);
    tsd_tables_stop(srv);
    if (srv->conns == NULL)
        stop_timer_close(srv);
    if (told > 0 || answered > 0)
        tsd_log(TSD_LOG_INFO,
                "told %zu connections that tensord is shutting down (%zu requests "
                "answered SHUTTING_DOWN)",
                told, answered);
    /*
     * The bins go now, or once the final snapshot holds its references; items still being
     * written are freed by their write callbacks.
     */
    if (srv->cfg.save_path != NULL && srv->exit_code == 0)
        tsd_snapshot_final(srv);
    else
        tsd_server_free_store(srv);
}

void tsd_server_release_signals(tsd_server *srv)
{
    if (!srv->handles_init || srv->signals_released)
        return;
    srv->signals_released = 1;
    /*
     * Closing a handle restores the default action; block the signals meanwhile and ignore
     * them from then on, so that nothing ends the process on its way out.
     */
    static const int sigs[] = {SIGINT, SIGTERM, SIGHUP};
    sigset_t set, old;
    sigemptyset(&set);
    for (size_t i = 0; i < TS__ARRAY_SIZE(sigs); i++)
        sigaddset(&set, sigs[i]);
    pthread_sigmask(SIG_BLOCK, &set, &old);
    uv_close((uv_handle_t *)&srv->sigint, NULL);
    uv_close((uv_handle_t *)&srv->sigterm, NULL);
    uv_close((uv_handle_t *)&srv->sighup, NULL);
    uv_close((uv_handle_t *)&srv->drain_idle, NULL);
    uv_close((uv_handle_t *)&srv->fd_timer, NULL);
    stop_timer_close(srv);
    for (size_t i = 0; i < TS__ARRAY_SIZE(sigs); i++)
        signal(sigs[i], SIG_IGN);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

void tsd_server_free(tsd_server *srv)
{
    ts__free(srv->spare);
    srv->spare = NULL;
    while (srv->save_waiters != NULL) {
        tsd_save_waiter *w = srv->save_waiters;
        srv->save_waiters = w->next;
        ts__free(w);
    }
    tsd_server_free_store(srv);
    tsd_datadir_free(srv);
    tsd_htab_free(&srv->watches);
    tsd_snapshot_free(srv);
    tsd_pool_drain();
    tsd_reclaim_stop(); /* after the last release: the queue ends empty */
}
