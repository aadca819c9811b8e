/*
 * tensord's process life: signals during the shutdown never cut the final snapshot short, and
 * every request still waiting is answered SHUTTING_DOWN (the C client's ts_wait reports
 * TS_ESHUTDOWN);
 * SIGHUP is ignored (logged) rather than ending the daemon; --unix never takes over a socket
 * another process still answers on, removes only a stale one, and refuses a path that is not
 * a socket.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tensorshare/tensorshare.h"
#include "test_harden_util.h"

static tsh_server s;
static char snap[400], errfile[400], other[400];
/* Where start_saving's daemon writes its log (its stderr). */
static char logfile[400];

static int kill_leftover(void **state)
{
    (void)state;
    if (s.pid > 0)
        tsh_server_kill(&s);
    if (s.dir[0] != '\0') {
        char p[450];
        snprintf(p, sizeof(p), "%s.tmp", snap);
        unlink(p);
        snprintf(p, sizeof(p), "%s.lock", snap);
        unlink(p);
        unlink(snap);
        unlink(errfile);
        unlink(other);
        unlink(logfile);
        tsh_server_cleanup(&s);
    }
    memset(&s, 0, sizeof(s));
    snap[0] = errfile[0] = other[0] = logfile[0] = '\0';
    return 0;
}

/* Start tensord with --save in its own directory. */
static void start_saving(void)
{
    assert_int_equal(tsh_server_start(&s, NULL), 0);
    assert_int_equal(tsh_server_stop(&s), 0);
    snprintf(snap, sizeof(snap), "%s/snap", s.dir);
    snprintf(errfile, sizeof(errfile), "%s/stderr", s.dir);
    snprintf(other, sizeof(other), "%s/other.sock", s.dir);
    snprintf(logfile, sizeof(logfile), "%s/tensord.log", s.dir);
    /*
     * The harness lets the daemon inherit this process's stderr: point that at logfile just
     * while the daemon is forked, so that the tests can read what it logs.
     */
    fflush(stderr);
    int saved = dup(2);
    assert_true(saved >= 0);
    int lfd = open(logfile, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    assert_true(lfd >= 0);
    assert_int_equal(dup2(lfd, 2), 2);
    close(lfd);
    int rc = tsh_server_restart(&s, (const char *const[]){"--save", snap, NULL});
    assert_int_equal(dup2(saved, 2), 2);
    close(saved);
    assert_int_equal(rc, 0);
}

#define BIG_BINS 48
#define BIG_LEN  ((size_t)2 << 20) /* bytes per item: the final snapshot takes a moment */

static void test_signals_during_final_snapshot(void **state)
{
    (void)state;
    start_saving();
    int fd = tsu_client(&s);
    uint64_t ver[BIG_BINS];
    for (int i = 0; i < BIG_BINS; i++) {
        char name[16];
        snprintf(name, sizeof(name), "big%02d", i);
        size_t len;
        uint8_t *rec = tsu_rec_bytes(BIG_LEN, (unsigned)i, &len);
        ver[i] = tsu_store(fd, TS_OP_PUT, name, rec, len, NULL);
        tsu_rec_free(rec, len);
    }
    close(fd);
    /* SIGTERM starts the shutdown; more SIGTERMs and SIGINTs keep coming while it runs. */
    assert_int_equal(kill(s.pid, SIGTERM), 0);
    int st = -1;
    for (int i = 0; i < 3000; i++) { /* 15 s */
        if (waitpid(s.pid, &st, WNOHANG) == s.pid) {
            s.pid = 0;
            break;
        }
        kill(s.pid, i % 2 == 0 ? SIGTERM : SIGINT);
        th_sleep_ms(5);
    }
    if (s.pid != 0)
        tsh_server_kill(&s);
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0))
        print_error("tensord ended with wait status 0x%x (%s %d)\n", st,
                    WIFSIGNALED(st) ? "signal" : "exit",
                    WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);

    /* Every acknowledged item is back. */
    assert_int_equal(tsh_server_restart(&s, (const char *const[]){"--save", snap, NULL}), 0);
    fd = tsu_client(&s);
    assert_int_equal(tsu_stat(fd, "bins"), BIG_BINS);
    for (int i = 0; i < BIG_BINS; i += 7) {
        char name[16];
        snprintf(name, sizeof(name), "big%02d", i);
        tsu_items it;
        tsu_get(fd, TS_OP_PEEK, name, 0, &it);
        assert_int_equal(it.n, 1);
        assert_int_equal(it.version, ver[i]);
        size_t len;
        uint8_t *rec = tsu_rec_bytes(BIG_LEN, (unsigned)i, &len);
        assert_int_equal(it.item_len[0], len);
        assert_memory_equal(it.item[0], rec, len);
        tsu_rec_free(rec, len);
        tsu_frame_free(&it.f);
    }
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
}

/* A ts_wait that blocks until the daemon stops; its result. */
typedef struct stop_waiter {
    ts_client_t *c;
    int rc;
} stop_waiter;

static void *wait_thread(void *arg)
{
    stop_waiter *w = arg;
    w->rc = ts_wait(w->c, "never", 0, 60000, NULL, NULL);
    return NULL;
}

/*
 * SIGTERM while a C client waits in ts_wait and a SAVE of a large store is under way: ts_wait
 * returns TS_ESHUTDOWN, the SAVE gets exactly one reply (SHUTTING_DOWN, or OK when it was done
 * first), the raw connection then sees the connection-level SHUTTING_DOWN frame before its end,
 * tensord exits 0, and every acknowledged write is in the final snapshot.
 */
static void test_stop_answers_waiting_requests(void **state)
{
    (void)state;
    start_saving();
    int fd = tsu_client(&s);
    uint64_t ver[BIG_BINS];
    for (int i = 0; i < BIG_BINS; i++) {
        char name[16];
        snprintf(name, sizeof(name), "big%02d", i);
        size_t len;
        uint8_t *rec = tsu_rec_bytes(BIG_LEN, (unsigned)i, &len);
        ver[i] = tsu_store(fd, TS_OP_PUT, name, rec, len, NULL);
        tsu_rec_free(rec, len);
    }
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.connect_timeout_ms = 3000;
    stop_waiter w = {.rc = 1};
    assert_int_equal(ts_client_open(&w.c, s.addr, &o), 0);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, wait_thread, &w), 0);
    int64_t waiters = 0;
    for (int i = 0; i < 500 && waiters == 0; i++) {
        waiters = tsu_stat(fd, "waiters");
        if (waiters == 0)
            th_sleep_ms(10);
    }
    assert_int_equal(waiters, 1);
    assert_int_equal(tsh_send(fd, TS_OP_SAVE, 9, NULL, 0), 0);
    assert_int_equal(kill(s.pid, SIGTERM), 0);
    tsu_frame f;
    assert_int_equal(tsu_recv(fd, &f), 0);
    assert_int_equal(f.h.opcode, TS_OP_SAVE);
    assert_int_equal(f.h.request_id, 9);
    assert_true(f.h.status == TS_ST_SHUTTING_DOWN || f.h.status == TS_ST_OK);
    tsu_frame_free(&f);
    tsu_expect(fd, &f, 0, 0, TS_ST_SHUTTING_DOWN);
    tsu_frame_free(&f);
    assert_true(tsh_wait_closed(fd, 10000 * th_slow()));
    close(fd);
    assert_int_equal(pthread_join(th, NULL), 0);
    if (w.rc != TS_ESHUTDOWN)
        print_error("ts_wait returned %d (%s), want TS_ESHUTDOWN\n", w.rc, ts_strerror(w.rc));
    assert_int_equal(w.rc, TS_ESHUTDOWN);
    ts_client_free(w.c);
    assert_int_equal(tsh_server_stop(&s), 0);

    assert_int_equal(tsh_server_restart(&s, (const char *const[]){"--save", snap, NULL}), 0);
    fd = tsu_client(&s);
    assert_int_equal(tsu_stat(fd, "bins"), BIG_BINS);
    for (int i = 0; i < BIG_BINS; i += 11) {
        char name[16];
        snprintf(name, sizeof(name), "big%02d", i);
        tsu_items it;
        tsu_get(fd, TS_OP_PEEK, name, 0, &it);
        assert_int_equal(it.n, 1);
        assert_int_equal(it.version, ver[i]);
        tsu_frame_free(&it.f);
    }
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
}

static void test_sighup_ignored(void **state)
{
    (void)state;
    start_saving();
    int fd = tsu_client(&s);
    uint64_t v = tsu_put_int(fd, TS_OP_PUT, "kept", 42, NULL);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kill(s.pid, SIGHUP), 0);
        th_sleep_ms(50);
    }
    assert_true(tsh_server_alive(&s));
    /* Each one is logged, so that an operator sees why the daemon did not stop. */
    assert_true(th_file_contains(logfile, "SIGHUP ignored"));
    /* The same connection goes on. */
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "kept", 0, &it);
    assert_int_equal(it.version, v);
    tsu_frame_free(&it.f);
    close(fd);
    tsu_check_healthy(&s);
    assert_int_equal(tsh_server_stop(&s), 0);
    assert_int_equal(tsh_server_restart(&s, (const char *const[]){"--save", snap, NULL}), 0);
    fd = tsu_client(&s);
    tsu_get(fd, TS_OP_PEEK, "kept", 0, &it);
    assert_int_equal(tsu_item_int(it.item[0], it.item_len[0]), 42);
    tsu_frame_free(&it.f);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
}

/* Rounds of the two-daemon race: each has a stale socket to remove, the widest window. */
#define RACE_ROUNDS 8

/*
 * Fork a tensord on --unix path with its stderr in errpath; it blocks on gate until the parent
 * closes the gate's write end (the child closes its own copy), so that both daemons of a round
 * start at the same instant.
 */
static pid_t spawn_gated(const char *path, const char *errpath, const int gate[2])
{
    const char *bin = getenv("TS_TENSORD");
    assert_non_null(bin);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(errpath, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) {
            dup2(fd, 2);
            close(fd);
        }
        close(gate[1]);
        char c;
        while (read(gate[0], &c, 1) > 0) {
        }
        execl(bin, bin, "--port", "0", "--unix", path, (char *)NULL);
        _exit(127);
    }
    return pid;
}

/* Leave a socket file at path that nothing listens on, as a killed daemon does. */
static void make_stale_socket(const char *path)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    assert_true(strlen(path) < sizeof(a.sun_path));
    memcpy(a.sun_path, path, strlen(path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    close(fd);
}

/*
 * Two daemons started at the same instant on one --unix path: exactly one runs and serves on
 * it, the other refuses (exit 2, "in use"). Without the lock both could find the stale socket,
 * both remove it and both bind, and the first would silently lose its clients.
 */
static void race_round(const char *path, const char *err0, const char *err1)
{
    unlink(path);
    make_stale_socket(path);
    int gate[2];
    assert_int_equal(pipe(gate), 0);
    pid_t pid[2] = {spawn_gated(path, err0, gate), spawn_gated(path, err1, gate)};
    close(gate[0]);
    close(gate[1]);
    int exited[2] = {0, 0}, status[2] = {-1, -1};
    /* The loser exits within moments; the winner keeps running until stopped. */
    uint64_t end = th_now_ms() + 5000u * (unsigned)th_slow();
    while (!exited[0] && !exited[1] && th_now_ms() < end) {
        for (int i = 0; i < 2; i++) {
            int st;
            if (!exited[i] && waitpid(pid[i], &st, WNOHANG) == pid[i]) {
                exited[i] = 1;
                status[i] = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
            }
        }
        th_sleep_ms(10);
    }
    /* Give the other one time to exit too, if it is going to. */
    th_sleep_ms(300);
    for (int i = 0; i < 2; i++) {
        int st;
        if (!exited[i] && waitpid(pid[i], &st, WNOHANG) == pid[i]) {
            exited[i] = 1;
            status[i] = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        }
    }
    int ok = exited[0] + exited[1] == 1;
    int winner = exited[0] ? 1 : 0;
    if (ok) {
        const char *lerr = winner == 0 ? err1 : err0;
        ok = status[1 - winner] == 2 && th_file_contains(lerr, "in use");
        int fd = tsh_connect_unix(path);
        ok = ok && fd >= 0 && tsh_hello(fd) == 0;
        if (fd >= 0)
            close(fd);
    }
    for (int i = 0; i < 2; i++) {
        if (!exited[i]) {
            kill(pid[i], SIGKILL);
            waitpid(pid[i], NULL, 0);
        }
    }
    if (!ok) {
        print_error("two tensord on one --unix: exited %d/%d (status %d/%d); want exactly one "
                    "running and serving, the other exit 2 \"in use\"\n",
                    exited[0], exited[1], status[0], status[1]);
        fail();
    }
}

static void test_unix_socket_in_use(void **state)
{
    (void)state;
    assert_int_equal(tsh_server_start(&s, NULL), 0);
    snprintf(errfile, sizeof(errfile), "%s/stderr", s.dir);
    snprintf(other, sizeof(other), "%s/other.sock", s.dir);
    int fd = tsh_connect_unix(s.unix_path);
    assert_true(fd >= 0);
    assert_int_equal(tsh_hello(fd), 0);

    /* A second daemon on the same path refuses to start and leaves the first one's socket. */
    const char *args[] = {"--port", "0", "--unix", s.unix_path, NULL};
    int st = th_run_tensord(args, errfile, 5000 * th_slow());
    if (st != 2 || !th_file_contains(errfile, s.unix_path) ||
        !th_file_contains(errfile, "in use")) {
        print_error("second tensord on the same --unix: exit %d, want 2 and \"in use\"\n", st);
        fail();
    }
    struct stat sb;
    assert_int_equal(lstat(s.unix_path, &sb), 0);
    assert_true(S_ISSOCK(sb.st_mode));
    /* The first daemon still serves the old connection and new ones on that path. */
    assert_int_equal(tsh_send(fd, TS_OP_PING, 7, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_PING, 7, TS_ST_OK);
    tsu_frame_free(&f);
    close(fd);
    fd = tsh_connect_unix(s.unix_path);
    assert_true(fd >= 0);
    assert_int_equal(tsh_hello(fd), 0);
    close(fd);

    /* A path that is not a socket is refused, and left alone. */
    assert_int_equal(th_write_file(other, "data", 4), 0);
    const char *args2[] = {"--port", "0", "--unix", other, NULL};
    st = th_run_tensord(args2, errfile, 5000 * th_slow());
    assert_int_equal(st, 2);
    assert_true(th_file_contains(errfile, "not a socket"));
    assert_int_equal(lstat(other, &sb), 0);
    assert_true(S_ISREG(sb.st_mode));
    unlink(other);

    /* A stale socket (its daemon killed) is replaced. */
    tsh_server_kill(&s);
    assert_int_equal(lstat(s.unix_path, &sb), 0);
    assert_int_equal(tsh_server_restart(&s, NULL), 0);
    fd = tsh_connect_unix(s.unix_path);
    assert_true(fd >= 0);
    assert_int_equal(tsh_hello(fd), 0);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);

    /* Two daemons started at the same instant on one path (other.sock): exactly one runs. */
    char err1[450], lock[450];
    snprintf(err1, sizeof(err1), "%s.1", errfile);
    snprintf(lock, sizeof(lock), "%s.lock", other);
    for (int r = 0; r < RACE_ROUNDS; r++)
        race_round(other, errfile, err1);
    unlink(other);
    unlink(lock);
    unlink(err1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_signals_during_final_snapshot, kill_leftover),
        cmocka_unit_test_teardown(test_stop_answers_waiting_requests, kill_leftover),
        cmocka_unit_test_teardown(test_sighup_ignored, kill_leftover),
        cmocka_unit_test_teardown(test_unix_socket_in_use, kill_leftover),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
