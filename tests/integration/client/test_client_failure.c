/*
 * libtensorshare when things go wrong: nothing listening, a server that never answers, a stopped
 * server (timeouts, late replies), and a server killed and restarted under load (pending
 * requests fail, none hang, the client reconnects and resubscribes on its own).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "test_client_util.h"

/* A TCP port on 127.0.0.1 where nothing listens (bound, then released). */
static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0)
        return -1;
    close(fd);
    return ntohs(a.sin_port);
}

static void test_connect_refused(void **state)
{
    (void)state;
    int port = free_port();
    assert_true(port > 0);
    char addr[64];
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.connect_timeout_ms = 3000;
    ts_client_t *c = NULL;
    uint64_t t0 = tc_now_ms();
    assert_int_equal(ts_client_open(&c, addr, &o), TS_ECONNREFUSED);
    uint64_t el = tc_now_ms() - t0;
    printf("connect to a closed port failed in %llu ms: %s\n", (unsigned long long)el,
           ts_last_error());
    assert_null(c);
    assert_true(el < 3000);
    assert_non_null(strstr(ts_last_error(), addr));
    assert_int_equal(ts_client_open(&c, "unix:/nonexistent/tensord.sock", &o), TS_ECONNREFUSED);
    assert_int_equal(ts_client_open(&c, "no-such-host.invalid:8000", &o), TS_ENOTCONN);
}

/* Open addr and check it fails with TS_EACCES and a message that says so; 0 when it does. */
static int open_denied(const char *addr)
{
    ts_client_t *c = NULL;
    int rc = ts_client_open(&c, addr, NULL);
    printf("connect to a unix socket without permission: %s: %s\n", ts_err_name(rc),
           ts_last_error());
    fflush(stdout);
    return rc == TS_EACCES && c == NULL &&
                   strstr(ts_last_error(), "permission denied connecting to") != NULL &&
                   strstr(ts_last_error(), addr) != NULL
               ? 0
               : 1;
}

/*
 * A unix socket this user may not connect to (its mode is 0) gives TS_EACCES at once, with a
 * message that names the socket. As root, the check runs in a child that became nobody and ran
 * this program again (main's --open-denied): a forked copy of a process with threads must not
 * start threads of its own (ThreadSanitizer refuses it), and opening a client does.
 */
static void test_connect_permission_denied(void **state)
{
    (void)state;
    char dir[] = "/tmp/ts-eacces.XXXXXX";
    assert_non_null(mkdtemp(dir));
    assert_int_equal(chmod(dir, 0755), 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof(a.sun_path), "%s/s.sock", dir);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    assert_int_equal(listen(fd, 4), 0);
    assert_int_equal(chmod(a.sun_path, 0), 0);
    char addr[sizeof(a.sun_path) + 8];
    snprintf(addr, sizeof(addr), "unix:%s", a.sun_path);
    int result;
    if (geteuid() != 0) {
        result = open_denied(addr);
    } else {
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            if (setgid(65534) != 0 || setuid(65534) != 0)
                _exit(2);
            /*
             * No environment: nobody may not be able to read what it names (a sanitizer's
             * suppressions file in a directory only root may enter).
             */
            char *args[] = {"test_client_failure", "--open-denied", addr, NULL};
            char *no_env[] = {NULL};
            execve("/proc/self/exe", args, no_env);
            _exit(4);
        }
        int status;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        result = WIFEXITED(status) ? WEXITSTATUS(status) : 3;
    }
    close(fd);
    unlink(a.sun_path);
    rmdir(dir);
    assert_int_equal(result, 0);
}

/* A socket that completes TCP handshakes (the kernel's backlog) but never answers. */
static void test_connect_timeout(void **state)
{
    (void)state;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    assert_int_equal(listen(fd, 4), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    char addr[64];
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", ntohs(a.sin_port));
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.connect_timeout_ms = 300;
    ts_client_t *c = NULL;
    uint64_t t0 = tc_now_ms();
    assert_int_equal(ts_client_open(&c, addr, &o), TS_ETIMEDOUT);
    uint64_t el = tc_now_ms() - t0;
    printf("handshake with a silent server timed out in %llu ms\n", (unsigned long long)el);
    assert_true(el >= 250 && el < 10000);
    close(fd);
}

/* An asynchronous request's status, message and no-reply mark, as its callback saw them. */
typedef struct msg_cb {
    tc_latch done;
    int status;
    int no_reply;
    char msg[TS_MAX_ERROR_LEN + 1];
} msg_cb;

static void msg_cb_init(msg_cb *m)
{
    memset(m, 0, sizeof(*m));
    tc_latch_init(&m->done);
}

static void msg_status_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    (void)res;
    msg_cb *m = arg;
    m->status = status;
    m->no_reply = ts_last_error_no_reply();
    snprintf(m->msg, sizeof(m->msg), "%s", ts_last_error());
    tc_latch_add(&m->done, 1);
}

/* A stopped server: requests time out; the replies that come later are dropped safely. */
static void test_request_timeouts_and_late_replies(void **state)
{
    (void)state;
    tsh_server s;
    assert_int_equal(tsh_server_start(&s, NULL), 0);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = 400;
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, s.addr, &o), 0);
    ts_value_t *it = tc_item(1000, 0, 1);
    assert_int_equal(ts_put(c, "late", it, NULL), 0);

    kill(s.pid, SIGSTOP);
    uint64_t t0 = tc_now_ms();
    assert_int_equal(ts_ping(c), TS_ETIMEDOUT);
    uint64_t el = tc_now_ms() - t0;
    assert_true(el >= 350 && el < 10000);
    /* The client's own timeout says that the server did not answer, and is marked so. */
    assert_string_equal(ts_last_error(), "no reply within the request timeout");
    assert_int_equal(ts_last_error_no_reply(), 1);
    ts_items_t *items = NULL;
    assert_int_equal(ts_get(c, "late", 0, &items), TS_ETIMEDOUT); /* the server will do it */
    assert_null(items);
    uint64_t v = 5;
    assert_int_equal(ts_wait(c, "late", 0, 100, &v, NULL), TS_ETIMEDOUT);
    assert_int_equal(v, 5); /* no answer at all: untouched */
    assert_int_equal(ts_last_error_no_reply(), 1);
    /* An asynchronous request's callback reads the same message. */
    msg_cb m;
    msg_cb_init(&m);
    assert_int_equal(ts_ping_async(c, msg_status_cb, &m), 0);
    assert_int_equal(tc_latch_wait(&m.done, 1, TC_WAIT_MS), 1);
    assert_int_equal(m.status, TS_ETIMEDOUT);
    assert_string_equal(m.msg, "no reply within the request timeout");
    assert_int_equal(m.no_reply, 1);
    tc_latch_destroy(&m.done);
    ts_set_last_error("something else"); /* a new message clears the mark */
    assert_int_equal(ts_last_error_no_reply(), 0);
    kill(s.pid, SIGCONT);

    /* The late replies (ping, get, wait) arrive now and must not confuse later requests. */
    assert_int_equal(ts_ping(c), 0);
    ts_value_t *it2 = tc_item(3, 7, 2);
    assert_int_equal(ts_put(c, "late", it2, NULL), 0);
    assert_int_equal(ts_peek(c, "late", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 1);
    assert_int_equal(tc_tag(ts_items_at(items, 0)), 2);
    assert_true(tc_check_vec(ts_items_at(items, 0), 3, 7));
    ts_items_free(items);
    assert_int_equal(ts_client_connected(c), 1);
    /* A TIMEOUT that the server answered is not the client's own. */
    assert_int_equal(ts_wait(c, "late", UINT64_MAX - 1, 50, &v, NULL), TS_ETIMEDOUT);
    assert_int_equal(ts_last_error_no_reply(), 0);
    ts_client_free(c);
    ts_value_free(it);
    ts_value_free(it2);
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
}

/* Requests made while the server is down wait for the reconnection, until their deadline. */
typedef struct put_args {
    ts_client_t *c;
    const ts_value_t *item;
    int rc;
} put_args;

static void *put_main(void *arg)
{
    put_args *pa = arg;
    pa->rc = ts_put(pa->c, "waited", pa->item, NULL);
    return NULL;
}

static void async_status_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    (void)res;
    tc_latch *l = arg;
    /* Encode the status in the count: 1000 + -status, so the test can read it back. */
    tc_latch_add(l, 1000 - status);
}

static void test_requests_wait_for_reconnect(void **state)
{
    (void)state;
    tsh_server s;
    assert_int_equal(tsh_server_start(&s, NULL), 0);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = 15000;
    o.reconnect_min_ms = 20;
    o.reconnect_max_ms = 200;
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, s.addr, &o), 0);
    tsh_server_kill(&s);
    for (int i = 0; i < 500 && ts_client_connected(c); i++)
        tc_sleep_ms(10);
    assert_int_equal(ts_client_connected(c), 0);

    /* While it is down: a blocking put on another thread and an async ping. */
    ts_value_t *it = tc_item(4, 1, 3);
    put_args pa = {c, it, -1};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, put_main, &pa), 0);
    tc_latch ping;
    tc_latch_init(&ping);
    assert_int_equal(ts_ping_async(c, async_status_cb, &ping), 0);
    tc_sleep_ms(300);
    assert_int_equal(tc_latch_get(&ping), 0); /* still waiting, not failed */

    uint64_t t0 = tc_now_ms();
    assert_int_equal(tsh_server_restart(&s, NULL), 0);
    pthread_join(th, NULL);
    assert_int_equal(pa.rc, 0);
    assert_int_equal(tc_latch_wait(&ping, 1000, TC_WAIT_MS), 1000); /* status 0 */
    printf("requests made while down completed %llu ms after the restart\n",
           (unsigned long long)(tc_now_ms() - t0));
    ts_items_t *items;
    assert_int_equal(ts_get(c, "waited", 0, &items), 0);
    assert_int_equal(tc_tag(ts_items_at(items, 0)), 3);
    ts_items_free(items);
    ts_client_free(c);

    /* With a short request timeout, requests made while down fail in time instead. */
    o.request_timeout_ms = 300;
    assert_int_equal(ts_client_open(&c, s.addr, &o), 0);
    tsh_server_kill(&s);
    for (int i = 0; i < 500 && ts_client_connected(c); i++)
        tc_sleep_ms(10);
    t0 = tc_now_ms();
    assert_int_equal(ts_ping(c), TS_ETIMEDOUT);
    uint64_t el = tc_now_ms() - t0;
    assert_true(el >= 250 && el < 10000);
    /* They say why there is no connection: the last attempt's failure, with the address. */
    char want[TS_MAX_ERROR_LEN + 1];
    snprintf(want, sizeof(want),
             "no connection to tensord (%s: connection refused) within the request timeout",
             s.addr);
    assert_string_equal(ts_last_error(), want);
    assert_int_equal(ts_last_error_no_reply(), 1);
    msg_cb m;
    msg_cb_init(&m);
    assert_int_equal(ts_ping_async(c, msg_status_cb, &m), 0);
    assert_int_equal(tc_latch_wait(&m.done, 1, TC_WAIT_MS), 1);
    assert_int_equal(m.status, TS_ETIMEDOUT);
    assert_string_equal(m.msg, want);
    assert_int_equal(m.no_reply, 1);
    tc_latch_destroy(&m.done);
    ts_client_free(c);
    tc_latch_destroy(&ping);
    ts_value_free(it);
    tsh_server_cleanup(&s);
}

/* ---------------------------------------------------------------------------------------------
 * The server killed under load
 */
#define KR_THREADS 4

typedef struct kr_state {
    ts_client_t *c;
    atomic_int stop;
    atomic_long ok, ok_after_restart, lost_by_restart;
    atomic_long failed_reset, failed_timeout, failed_other, bad_content;
    atomic_int restarted;
    /* The listener. */
    pthread_mutex_t mu;
    int disconnected, resubscribed, changes_after_resub;
    uint64_t t_disconnected, t_resubscribed;
    int final_calls;
} kr_state;

static void kr_note(ts_client_t *c, int status, const ts_notification_t *n, void *arg)
{
    (void)c;
    kr_state *k = arg;
    pthread_mutex_lock(&k->mu);
    if (status != 0) {
        k->final_calls++;
    } else if (n->event == TS_EV_DISCONNECTED) {
        if (k->disconnected++ == 0)
            k->t_disconnected = tc_now_ms();
    } else if (n->event == TS_EV_RESUBSCRIBED) {
        if (k->resubscribed++ == 0)
            k->t_resubscribed = tc_now_ms();
    } else if (k->resubscribed > 0) {
        k->changes_after_resub++;
    }
    pthread_mutex_unlock(&k->mu);
}

/* Classify a failed call; only connection loss, timeouts and restart losses are allowed. */
static void kr_fail(kr_state *k, int rc)
{
    if (rc == TS_ECONNRESET)
        atomic_fetch_add(&k->failed_reset, 1);
    else if (rc == TS_ETIMEDOUT)
        atomic_fetch_add(&k->failed_timeout, 1);
    else if (rc == TS_ENOENT)
        atomic_fetch_add(&k->lost_by_restart, 1); /* the restarted server starts empty */
    else
        atomic_fetch_add(&k->failed_other, 1);
}

static void kr_ok(kr_state *k)
{
    atomic_fetch_add(&k->ok, 1);
    if (atomic_load(&k->restarted))
        atomic_fetch_add(&k->ok_after_restart, 1);
}

typedef struct kr_worker {
    kr_state *k;
    int id;
} kr_worker;

static void *kr_main(void *arg)
{
    kr_worker *w = arg;
    kr_state *k = w->k;
    char bin[32];
    snprintf(bin, sizeof(bin), "kr/%d", w->id);
    for (int64_t i = 0; !atomic_load(&k->stop) && i < 1000000; i++) {
        ts_value_t *it = tc_item(64, (float)i, i);
        int rc = ts_put(k->c, bin, it, NULL);
        ts_value_free(it);
        if (rc != 0) {
            kr_fail(k, rc);
            continue;
        }
        kr_ok(k);
        ts_items_t *items;
        rc = ts_peek(k->c, bin, 0, &items);
        if (rc != 0) {
            kr_fail(k, rc);
            continue;
        }
        kr_ok(k);
        /* Whatever comes back is exactly what this thread put last. */
        if (ts_items_count(items) != 1 || tc_tag(ts_items_at(items, 0)) != i ||
            !tc_check_vec(ts_items_at(items, 0), 64, (float)i))
            atomic_fetch_add(&k->bad_content, 1);
        ts_items_free(items);
        if (i % 8 == 0) {
            ts_value_t *n = ts_int_new(i);
            rc = ts_append(k->c, "kr/watch", n, NULL);
            ts_value_free(n);
            if (rc != 0)
                kr_fail(k, rc);
            else
                kr_ok(k);
        }
    }
    return NULL;
}

/* A pipelining writer: keeps up to KR_PIPELINE async appends in flight at all times. */
#define KR_PIPELINE 64

typedef struct kr_pump {
    kr_state *k;
    tc_latch inflight_done; /* callbacks seen */
    long submitted;
} kr_pump;

static void kr_pump_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    kr_pump *p = arg;
    if (status == 0 && res->n_items == 0)
        atomic_fetch_add(&p->k->bad_content, 1);
    if (status == 0)
        kr_ok(p->k);
    else
        kr_fail(p->k, status);
    tc_latch_add(&p->inflight_done, 1);
}

static void *kr_pump_main(void *arg)
{
    kr_pump *p = arg;
    ts_value_t *it = tc_item(256, 0, 0);
    while (!atomic_load(&p->k->stop) && p->submitted < 10000000) {
        /* Wait for room in the pipeline (bounded: every request completes or times out). */
        if (tc_latch_wait(&p->inflight_done, p->submitted - KR_PIPELINE + 1, TC_WAIT_MS) <
            p->submitted - KR_PIPELINE + 1)
            break;
        if (ts_append_async(p->k->c, "kr/pump", it, TS_COPY, kr_pump_cb, p) != 0)
            break;
        p->submitted++;
        if (p->submitted % 256 == 0) { /* keep the bin small */
            ts_value_t *one = ts_int_new(0);
            ts_put_async(p->k->c, "kr/pump", one, 0, NULL, NULL);
            ts_value_free(one);
        }
    }
    tc_latch_wait(&p->inflight_done, p->submitted, TC_WAIT_MS * 2);
    ts_value_free(it);
    return NULL;
}

static void test_kill_restart_under_load(void **state)
{
    (void)state;
    tsh_server s;
    assert_int_equal(tsh_server_start(&s, NULL), 0);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = 10000;
    o.reconnect_min_ms = 50;
    o.reconnect_max_ms = 500;
    kr_state k;
    memset(&k, 0, sizeof(k));
    pthread_mutex_init(&k.mu, NULL);
    assert_int_equal(ts_client_open(&k.c, s.addr, &o), 0);
    assert_int_equal(ts_listen(k.c, "kr/watch", kr_note, &k), 0);

    pthread_t th[KR_THREADS];
    kr_worker w[KR_THREADS];
    for (int i = 0; i < KR_THREADS; i++) {
        w[i].k = &k;
        w[i].id = i;
        assert_int_equal(pthread_create(&th[i], NULL, kr_main, &w[i]), 0);
    }
    kr_pump pump;
    memset(&pump, 0, sizeof(pump));
    pump.k = &k;
    tc_latch_init(&pump.inflight_done);
    pthread_t pump_th;
    assert_int_equal(pthread_create(&pump_th, NULL, kr_pump_main, &pump), 0);
    for (int i = 0; i < 500 && atomic_load(&k.ok) < 1000; i++)
        tc_sleep_ms(10);
    long ok_before = atomic_load(&k.ok);
    assert_true(ok_before > 0);

    uint64_t t_kill = tc_now_ms();
    tsh_server_kill(&s);
    tc_sleep_ms(300); /* down for a while: requests queue up, the client retries */
    uint64_t t_restart = tc_now_ms();
    assert_int_equal(tsh_server_restart(&s, NULL), 0);
    atomic_store(&k.restarted, 1);
    uint64_t t_up = tc_now_ms();
    int connected = 0;
    for (int i = 0; i < 2000 && !connected; i++) {
        connected = ts_client_connected(k.c);
        if (!connected)
            tc_sleep_ms(5);
    }
    uint64_t t_conn = tc_now_ms();
    assert_true(connected);
    int resub = 0;
    for (int i = 0; i < 2000 && !resub; i++) {
        pthread_mutex_lock(&k.mu);
        resub = k.resubscribed > 0;
        pthread_mutex_unlock(&k.mu);
        if (!resub)
            tc_sleep_ms(5);
    }
    assert_true(resub);
    /* Work continues on the new connection. */
    for (int i = 0; i < 1000 && atomic_load(&k.ok_after_restart) < 1000; i++)
        tc_sleep_ms(10);
    atomic_store(&k.stop, 1);
    for (int i = 0; i < KR_THREADS; i++)
        pthread_join(th[i], NULL); /* no request hangs: every worker returns */
    pthread_join(pump_th, NULL);
    assert_int_equal(tc_latch_get(&pump.inflight_done), pump.submitted); /* all called back */
    tc_latch_destroy(&pump.inflight_done);

    pthread_mutex_lock(&k.mu);
    int disconnected = k.disconnected, resubscribed = k.resubscribed;
    int changes = k.changes_after_resub;
    uint64_t t_resub = k.t_resubscribed;
    pthread_mutex_unlock(&k.mu);
    long failed = atomic_load(&k.failed_reset) + atomic_load(&k.failed_timeout) +
                  atomic_load(&k.failed_other);
    printf("server killed under load (%d blocking threads + %d pipelined async requests): "
           "%ld requests ok (%ld after the restart), "
           "%ld failed (%ld ECONNRESET, %ld ETIMEDOUT, %ld other), %ld found the restarted "
           "server empty\n",
           KR_THREADS, KR_PIPELINE, atomic_load(&k.ok), atomic_load(&k.ok_after_restart), failed,
           atomic_load(&k.failed_reset), atomic_load(&k.failed_timeout),
           atomic_load(&k.failed_other), atomic_load(&k.lost_by_restart));
    printf("server down %llu ms (kill to restart); tensord listening %llu ms after the restart "
           "call; client reconnected %llu ms after that; RESUBSCRIBED %llu ms after the server "
           "was back\n",
           (unsigned long long)(t_restart - t_kill), (unsigned long long)(t_up - t_restart),
           (unsigned long long)(t_conn - t_up), (unsigned long long)(t_resub - t_up));
    assert_int_equal(atomic_load(&k.failed_other), 0);
    assert_int_equal(atomic_load(&k.failed_timeout), 0);
    assert_int_equal(atomic_load(&k.bad_content), 0);
    assert_true(atomic_load(&k.ok_after_restart) > 0);
    assert_int_equal(disconnected, 1);
    assert_int_equal(resubscribed, 1);
    assert_true(changes > 0); /* the resubscribed listener hears the workers' appends */
    /* Reconnecting takes at most the largest backoff plus a connect, with room for load. */
    assert_true(t_conn - t_up < 5000);

    ts_client_free(k.c);
    pthread_mutex_lock(&k.mu);
    assert_int_equal(k.final_calls, 1);
    pthread_mutex_unlock(&k.mu);
    pthread_mutex_destroy(&k.mu);
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
}

/* A thread blocked in ts_wait on bin "never" until the client is closed. */
typedef struct wait_args {
    ts_client_t *c;
    int rc;
    tc_latch *started;
} wait_args;

static void *wait_main(void *arg)
{
    wait_args *wa = arg;
    tc_latch_add(wa->started, 1);
    wa->rc = ts_wait(wa->c, "never", 0, 60000, NULL, NULL);
    return NULL;
}

/*
 * ts_client_free while other threads wait in blocking calls (ts_wait on a live server, ts_put
 * while the server is down): they return TS_ECANCELED, and the client is freed only after the
 * last of them has let go of it (ASan and TSan would see a use after free otherwise).
 */
static void test_free_while_threads_block(void **state)
{
    (void)state;
    tsh_server s;
    assert_int_equal(tsh_server_start(&s, NULL), 0);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = 60000;
    for (int round = 0; round < 2; round++) {
        ts_client_t *c;
        assert_int_equal(ts_client_open(&c, s.addr, &o), 0);
        if (round == 1) { /* the blocked calls wait for a reconnection instead */
            tsh_server_kill(&s);
            for (int i = 0; i < 500 && ts_client_connected(c); i++)
                tc_sleep_ms(10);
        }
        enum { N = 6 };
        tc_latch started;
        tc_latch_init(&started);
        wait_args wa[N];
        put_args pa[N];
        pthread_t th[2 * N];
        ts_value_t *it = tc_item(16, 0, 1);
        for (int i = 0; i < N; i++) {
            wa[i] = (wait_args){c, 1, &started};
            pa[i] = (put_args){c, it, 1};
            assert_int_equal(pthread_create(&th[i], NULL, wait_main, &wa[i]), 0);
            assert_int_equal(pthread_create(&th[N + i], NULL, put_main, &pa[i]), 0);
        }
        assert_int_equal(tc_latch_wait(&started, N, TC_WAIT_MS), N);
        if (round == 0) { /* a live server answers the puts */
            for (int i = 0; i < N; i++) {
                pthread_join(th[N + i], NULL);
                assert_int_equal(pa[i].rc, 0);
            }
        }
        tc_sleep_ms(500); /* let every thread reach its wait (no call may start after the free) */
        uint64_t t0 = tc_now_ms();
        ts_client_free(c);
        uint64_t el = tc_now_ms() - t0;
        for (int i = 0; i < (round == 0 ? N : 2 * N); i++)
            pthread_join(th[i], NULL);
        for (int i = 0; i < N; i++) {
            assert_int_equal(wa[i].rc, TS_ECANCELED);
            /* On a live server the puts were done before the free; else they were cancelled. */
            assert_int_equal(pa[i].rc, round == 0 ? 0 : TS_ECANCELED);
        }
        printf("round %d: ts_client_free with %d blocked threads took %llu ms\n", round,
               round == 0 ? N : 2 * N, (unsigned long long)el);
        assert_true(el < 10000);
        ts_value_free(it);
        tc_latch_destroy(&started);
        if (round == 1)
            assert_int_equal(tsh_server_restart(&s, NULL), 0);
    }
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
}

/*
 * A server that turns a client away says why, and the caller learns it: the status's own code
 * (not a lost connection) and the server's message, without the same words twice.
 */
static void test_server_reasons(void **state)
{
    (void)state;
    char dir[] = "/tmp/ts-reasons-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char token_file[64];
    snprintf(token_file, sizeof(token_file), "%s/token", dir);
    FILE *fp = fopen(token_file, "w");
    assert_non_null(fp);
    fputs("the-right-token\n", fp);
    fclose(fp);
    const char *args[] = {"--max-clients", "1", "--auth-token-file", token_file, NULL};
    tsh_server s;
    assert_int_equal(tsh_server_start(&s, args), 0);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.connect_timeout_ms = 5000;
    o.auth_token = "the-right-token";
    ts_client_t *c1 = NULL;
    assert_int_equal(ts_client_open(&c1, s.addr, &o), 0);
    assert_int_equal(ts_ping(c1), 0);

    /* The one place is taken. */
    ts_client_t *c2 = NULL;
    int rc = ts_client_open(&c2, s.addr, &o);
    printf("second client: %s: %s\n", ts_err_name(rc), ts_last_error());
    assert_int_equal(rc, TS_ETOOMANY);
    assert_null(c2);
    assert_non_null(strstr(ts_last_error(), "too many clients (limit 1)"));
    assert_null(strstr(ts_last_error(), "too many clients: too many clients"));
    ts_client_free(c1);

    /* A wrong token. */
    o.auth_token = "a-wrong-token";
    rc = TS_ETIMEDOUT;
    for (int i = 0; i < 50 && rc != TS_EAUTH; i++) { /* c1's place is freed asynchronously */
        rc = ts_client_open(&c2, s.addr, &o);
        if (rc != TS_EAUTH)
            tc_sleep_ms(20);
    }
    printf("wrong token: %s: %s\n", ts_err_name(rc), ts_last_error());
    assert_int_equal(rc, TS_EAUTH);
    assert_non_null(strstr(ts_last_error(), "wrong token"));
    assert_null(strstr(ts_last_error(), "authentication failed: authentication failed"));

    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
    unlink(token_file);
    rmdir(dir);
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--open-denied") == 0)
        return open_denied(argv[2]); /* test_connect_permission_denied's child */
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_connect_refused),
        cmocka_unit_test(test_connect_permission_denied),
        cmocka_unit_test(test_connect_timeout),
        cmocka_unit_test(test_request_timeouts_and_late_replies),
        cmocka_unit_test(test_requests_wait_for_reconnect),
        cmocka_unit_test(test_kill_restart_under_load),
        cmocka_unit_test(test_free_while_threads_block),
        cmocka_unit_test(test_server_reasons),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
