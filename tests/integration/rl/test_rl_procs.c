/*
 * RL helpers across processes: a trainer in this process and worker processes
 * (rl/rl_test_worker.c) against one real tensord. Every item a worker adds is received exactly
 * once or counted as filtered; versions never go backwards in any worker; a worker killed with
 * SIGKILL mid-run and a worker started late leave the others unaffected; the trainer restarts
 * mid-run and versions continue.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "tensorshare/rl.h"
#include "tensorshare/tensorshare.h"

#ifndef RL_TEST_WORKER
#error "RL_TEST_WORKER (the worker program's path) must be defined by the build"
#endif

#define MAX_WORKERS 4
#define MAX_SEQ     100000 /* items tracked per worker */
#define RUN_MS      45000  /* the whole run's bound; the test's own timeout is larger */

typedef struct proc {
    pid_t pid;
    int exited;
    int status; /* exit code, or 128 + signal */
    long long n_items;
} proc;

/* What the trainer saw of one worker's items. */
typedef struct seen {
    unsigned char got[MAX_SEQ];
    long long count;
    long long max_seq;
    long long dups;
} seen;

static seen g_seen[MAX_WORKERS];

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Start a worker process (fork + exec: the child runs nothing of this process). */
static void spawn_worker(proc *p, const char *addr, int id, long long n, int delay_ms,
                         int64_t min_version)
{
    char ids[16], ns[24], ds[16], vs[24];
    snprintf(ids, sizeof(ids), "%d", id);
    snprintf(ns, sizeof(ns), "%lld", n);
    snprintf(ds, sizeof(ds), "%d", delay_ms);
    snprintf(vs, sizeof(vs), "%lld", (long long)min_version);
    memset(p, 0, sizeof(*p));
    p->n_items = n;
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        execl(RL_TEST_WORKER, RL_TEST_WORKER, addr, ids, ns, ds, vs, (char *)NULL);
        _exit(127);
    }
    p->pid = pid;
}

/* Reap p if it exited. Returns 1 when it has exited. */
static int reap(proc *p)
{
    if (p->pid <= 0 || p->exited)
        return p->exited;
    int st;
    pid_t r = waitpid(p->pid, &st, WNOHANG);
    if (r == p->pid) {
        p->exited = 1;
        p->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    return p->exited;
}

/* Kill a worker that is still running (end of a failed test), and reap it. */
static void kill_worker(proc *p)
{
    if (p->pid > 0 && !p->exited) {
        kill(p->pid, SIGKILL);
        int st;
        waitpid(p->pid, &st, 0);
        p->exited = 1;
        p->status = 128 + SIGKILL;
    }
}

/*
 * Account one batch: each item {wid, seq, payload: int32[64] of seq} is checked and marked.
 * Returns the items in the batch.
 */
static size_t account(const ts_rl_batch_t *b, int64_t oldest_ok)
{
    size_t n = ts_rl_batch_count(b);
    for (size_t i = 0; i < n; i++) {
        const ts_value_t *d = ts_rl_batch_data(b, i);
        int64_t wid = -1, seq = -1;
        assert_int_equal(ts_map_get_int(d, "wid", &wid), 0);
        assert_int_equal(ts_map_get_int(d, "seq", &seq), 0);
        assert_true(wid >= 0 && wid < MAX_WORKERS);
        assert_true(seq >= 0 && seq < MAX_SEQ);
        assert_true(ts_rl_batch_version(b, i) >= oldest_ok);
        const ts_tensor_t *t = ts_map_get_tensor(d, "payload");
        assert_non_null(t);
        assert_int_equal(t->dtype, TS_INT32);
        assert_int_equal(ts_tensor_numel(t), 64);
        const int32_t *x = t->data;
        assert_int_equal(x[0], seq);
        assert_int_equal(x[63], seq);
        seen *s = &g_seen[wid];
        if (s->got[seq])
            s->dups++;
        s->got[seq] = 1;
        s->count++;
        if (seq > s->max_seq)
            s->max_seq = seq;
    }
    return n;
}

static ts_value_t *make_params(int64_t version)
{
    static float w[256];
    for (int i = 0; i < 256; i++)
        w[i] = (float)version;
    const int64_t shape[1] = {256};
    ts_value_t *p = ts_map_new();
    assert_int_equal(ts_map_set(p, "w", ts_tensor_new(TS_FLOAT32, 1, shape, w, TS_COPY)), 0);
    assert_int_equal(ts_map_set(p, "version_copy", ts_int_new(version)), 0);
    return p;
}

static int64_t publish(ts_rl_trainer_t *t)
{
    int64_t expect = ts_rl_trainer_version(t) + 1;
    ts_value_t *p = make_params(expect);
    int64_t v = -1;
    assert_int_equal(ts_rl_trainer_publish(t, p, &v), 0);
    ts_value_free(p);
    assert_int_equal(v, expect);
    return v;
}

static int setup(void **state)
{
    static tsh_server srv;
    if (tsh_server_start(&srv, NULL) != 0)
        return -1;
    memset(g_seen, 0, sizeof(g_seen));
    for (int i = 0; i < MAX_WORKERS; i++)
        g_seen[i].max_seq = -1;
    *state = &srv;
    return 0;
}

static int teardown(void **state)
{
    tsh_server *srv = *state;
    int rc = tsh_server_stop(srv);
    tsh_server_cleanup(srv);
    return rc == 0 ? 0 : -1;
}

/*
 * No filtering: workers 0 and 1 run from the start, worker 2 is killed mid-run, worker 3
 * starts late; the trainer restarts mid-run. Every item of the finished workers arrives
 * exactly once; the killed worker's items arrive as a gap-free prefix.
 */
static void test_workers_join_crash_and_trainer_restart(void **state)
{
    tsh_server *srv = *state;
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, srv->unix_addr, NULL), 0);
    ts_rl_options_t o;
    ts_rl_options_init(&o);
    o.staleness_tolerance = TS_RL_NO_FILTER;
    ts_rl_trainer_t *t = NULL;
    assert_int_equal(ts_rl_trainer_new(&t, c, &o), 0);
    int64_t last = publish(t);

    proc w[MAX_WORKERS];
    memset(w, 0, sizeof(w));
    spawn_worker(&w[0], srv->unix_addr, 0, 300, 3, -1);
    spawn_worker(&w[1], srv->addr, 1, 300, 3, -1);
    spawn_worker(&w[2], srv->unix_addr, 2, MAX_SEQ - 1, 3, -1); /* runs until killed */

    int killed = 0, restarted = 0, late = 0;
    size_t total = 0, since_publish = 0;
    int64_t late_min = -1;
    int64_t end = now_ms() + RUN_MS;
    for (;;) {
        ts_rl_batch_t *b = NULL;
        int rc = ts_rl_trainer_collect(t, 64, 200, &b);
        if (rc == 0) {
            size_t n = account(b, INT64_MIN);
            ts_rl_batch_free(b);
            total += n;
            since_publish += n;
        } else {
            assert_int_equal(rc, TS_ETIMEDOUT);
        }
        if (since_publish >= 25) {
            int64_t v = publish(t);
            assert_true(v == last + 1);
            last = v;
            since_publish = 0;
        }
        if (!killed && g_seen[2].count >= 40) {
            /* Crash one worker mid-run: nobody else may notice. */
            assert_false(reap(&w[2]));
            kill_worker(&w[2]);
            killed = 1;
        }
        if (!restarted && total >= 150) {
            /* Restart the trainer on a new connection: it resumes after the last version. */
            ts_rl_trainer_free(t);
            ts_client_free(c);
            assert_int_equal(ts_client_open(&c, srv->addr, NULL), 0);
            assert_int_equal(ts_rl_trainer_new(&t, c, &o), 0);
            assert_int_equal(ts_rl_trainer_version(t), last);
            last = publish(t);
            restarted = 1;
        }
        if (restarted && killed && !late) {
            late_min = last;
            spawn_worker(&w[3], srv->unix_addr, 3, 150, 2, late_min);
            late = 1;
        }
        int done = late;
        for (int i = 0; i < MAX_WORKERS; i++) {
            if (i == 2)
                continue;
            if (w[i].pid > 0)
                reap(&w[i]);
            if (!w[i].exited || g_seen[i].count < w[i].n_items)
                done = 0;
        }
        if (done || now_ms() > end)
            break;
    }
    for (int i = 0; i < MAX_WORKERS; i++)
        kill_worker(&w[i]);

    assert_true(killed);
    assert_true(restarted);
    assert_true(late);
    for (int i = 0; i < MAX_WORKERS; i++) {
        if (i == 2) {
            assert_int_equal(w[i].status, 128 + SIGKILL);
            /* Appends from one connection are stored in order: a prefix, no gaps, no dups. */
            assert_int_equal(g_seen[i].dups, 0);
            assert_int_equal(g_seen[i].count, g_seen[i].max_seq + 1);
            continue;
        }
        if (w[i].status != 0)
            fail_msg("worker %d exited with %d", i, w[i].status);
        assert_int_equal(g_seen[i].dups, 0);
        assert_int_equal(g_seen[i].count, w[i].n_items);
        for (long long s = 0; s < w[i].n_items; s++)
            assert_true(g_seen[i].got[s]);
    }
    /* Nothing is left behind. */
    ts_rl_batch_t *b = NULL;
    assert_int_equal(ts_rl_trainer_collect(t, 0, 0, &b), TS_ETIMEDOUT);
    ts_rl_trainer_stats_t st;
    ts_rl_trainer_stats(t, &st);
    assert_int_equal(st.dropped_stale, 0);
    assert_int_equal(st.dropped_malformed, 0);
    assert_true(st.version > late_min);
    print_message("items: worker0 %lld, worker1 %lld, killed worker2 %lld, late worker3 %lld; "
                  "last version %lld, late worker started at %lld\n",
                  g_seen[0].count, g_seen[1].count, g_seen[2].count, g_seen[3].count,
                  (long long)st.version, (long long)late_min);
    ts_rl_trainer_free(t);
    ts_client_free(c);
}

/*
 * Staleness tolerance 0 with 4 workers and frequent publishes: what the trainer keeps plus
 * what it drops is exactly what the workers added, nothing kept is stale, nothing twice.
 */
static void test_filtered_accounting(void **state)
{
    tsh_server *srv = *state;
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, srv->unix_addr, NULL), 0);
    ts_rl_trainer_t *t = NULL;
    assert_int_equal(ts_rl_trainer_new(&t, c, NULL), 0); /* tolerance 0 */
    publish(t);

    proc w[MAX_WORKERS];
    const long long n = 200;
    for (int i = 0; i < MAX_WORKERS; i++)
        spawn_worker(&w[i], i % 2 ? srv->addr : srv->unix_addr, i, n, 2, 0);

    long long kept = 0;
    size_t since_publish = 0;
    int64_t end = now_ms() + RUN_MS;
    for (;;) {
        ts_rl_batch_t *b = NULL;
        int64_t oldest_ok = ts_rl_trainer_version(t);
        int rc = ts_rl_trainer_collect(t, 32, 200, &b);
        if (rc == 0) {
            size_t k = account(b, oldest_ok);
            kept += (long long)k;
            since_publish += k + ts_rl_batch_dropped(b);
            ts_rl_batch_free(b);
        } else {
            assert_int_equal(rc, TS_ETIMEDOUT);
        }
        if (since_publish >= 40) {
            publish(t);
            since_publish = 0;
        }
        int done = 1;
        for (int i = 0; i < MAX_WORKERS; i++)
            done &= reap(&w[i]);
        ts_rl_trainer_stats_t st;
        ts_rl_trainer_stats(t, &st);
        if (done && (long long)(st.received + st.dropped_stale) >= MAX_WORKERS * n)
            break;
        if (now_ms() > end)
            break;
    }
    for (int i = 0; i < MAX_WORKERS; i++) {
        kill_worker(&w[i]);
        if (w[i].status != 0)
            fail_msg("worker %d exited with %d", i, w[i].status);
        assert_int_equal(g_seen[i].dups, 0);
    }
    ts_rl_trainer_stats_t st;
    ts_rl_trainer_stats(t, &st);
    assert_int_equal((long long)st.received, kept);
    assert_int_equal((long long)(st.received + st.dropped_stale), MAX_WORKERS * n);
    assert_int_equal(st.dropped_malformed, 0);
    print_message("kept %llu, dropped as stale %llu, last version %lld\n",
                  (unsigned long long)st.received, (unsigned long long)st.dropped_stale,
                  (long long)st.version);
    ts_rl_batch_t *b = NULL;
    assert_int_equal(ts_rl_trainer_collect(t, 0, 0, &b), TS_ETIMEDOUT);
    ts_rl_trainer_free(t);
    ts_client_free(c);
}

int main(void)
{
    /* A worker killed mid-write must not take this process down with SIGPIPE. */
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_workers_join_crash_and_trainer_restart, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_filtered_accounting, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
