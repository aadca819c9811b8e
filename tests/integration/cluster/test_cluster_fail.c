/*
 * A cluster of three tensords (--shard i/3 on 127.0.0.1, ephemeral ports) when one shard fails,
 * seen by cluster clients ("A0,A1,A2" and "cluster:/path/map") and checked with plain clients on
 * each shard (LIST is local to a shard: it shows where the data really is).
 *
 * - kill: SIGKILL one shard under a mixed load of four threads; the other shards never fail, the
 *   dead shard's bins fail fast (TS_ENOTCONN, each call bounded) and never land elsewhere; a new
 *   cluster client opens meanwhile; restarted from its snapshot on the same port, the shard
 *   answers again within a bound, its listeners get DISCONNECTED, RESUBSCRIBED, then new changes,
 *   its versions are above the old ones, its snapshot's data is back.
 * - freeze: SIGSTOP one shard (hung, not dead): its calls time out at the request timeout while
 *   the others keep answering; SIGCONT recovers it.
 * - stale maps: a list in the wrong order, a map file with an old epoch, and a map changed under a
 *   running client: WRONG_SHARD and SHARD_MAP put every bin on its owner.
 * - wrong index: a shard restarted as another shard's index: clients get WRONG_SHARD, never data
 *   on the wrong daemon; restarted right, it works again.
 *
 * Every loop is bounded in count and time; every daemon is stopped by its PID. The numbers the
 * tests print ("cluster: ...") are the record of what clients saw.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "ct_cluster.h"
#include "test_client_util.h"

#define CF_SHARDS 3
/* load threads of the kill test */
#define CF_THREADS 4
/* bins per shard the load spreads over */
#define CF_BINS 12
/* bins per shard written before the snapshot, checked after the restart */
#define CF_SNAP_BINS 4
/* ms; the cluster client's request timeout in the kill test: far above the fail-fast bound */
#define CF_REQ_TIMEOUT_MS 10000
/* ms; the bound on each failing call to a dead shard ("fails at once"), generous for sanitizers */
#define CF_FAST_MS 2000
/* ms; the longest a restarted or thawed shard may take to answer the cluster client again */
#define CF_RECOVER_MS 15000
/* ms; the request timeout of the freeze test's client */
#define CF_FREEZE_TIMEOUT_MS 500
/* ms; slack on top of a request timeout on a loaded machine */
#define CF_SLACK_MS 2500
/* calls; the most one load thread makes, whatever the clock says */
#define CF_MAX_CALLS 100000
/* ms; the longest the load runs, whatever the phases say */
#define CF_LOAD_MAX_MS 60000
/* ms; how long each phase of the kill test lets the load run */
#define CF_PHASE_MS 1500

/* Bin names: load bins, snapshot bins, per-thread listen bins, per shard. */
static char g_load[CF_SHARDS][CF_BINS][48];
static char g_snap[CF_SHARDS][CF_SNAP_BINS][48];
static char g_lbin[CF_THREADS][CF_SHARDS][48];
/* The cluster of the running test: a global, so that teardown stops it when an assertion fails. */
static ct_cluster g_cl;

static void make_names(void)
{
    for (int s = 0; s < CF_SHARDS; s++) {
        for (int b = 0; b < CF_BINS; b++)
            assert_int_equal(ct_name_for_shard(g_load[s][b], 48, "load", b, s, CF_SHARDS), 0);
        for (int b = 0; b < CF_SNAP_BINS; b++)
            assert_int_equal(ct_name_for_shard(g_snap[s][b], 48, "snap", b, s, CF_SHARDS), 0);
        for (int t = 0; t < CF_THREADS; t++) {
            char prefix[16];
            snprintf(prefix, sizeof(prefix), "lis%d", t);
            assert_int_equal(ct_name_for_shard(g_lbin[t][s], 48, prefix, 0, s, CF_SHARDS), 0);
        }
    }
}

static ts_client_t *open_cluster(const char *address, int request_timeout_ms)
{
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.connect_timeout_ms = 2000;
    o.request_timeout_ms = request_timeout_ms;
    o.reconnect_min_ms = 50;
    o.reconnect_max_ms = 500;
    ts_client_t *c = NULL;
    int rc = ts_client_open(&c, address, &o);
    if (rc != 0)
        printf("cluster: open %s: %s (%s)\n", address, ts_err_name(rc), ts_last_error());
    assert_int_equal(rc, 0);
    return c;
}

static ts_client_t *open_plain(const tsh_server *s)
{
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, s->addr, NULL), 0);
    return c;
}

/*
 * Every bin the daemon lists is owned by line `line` of the map it runs (default split). Returns
 * the number of bins listed; fails the test on a bin that is not the daemon's.
 */
static size_t check_owned(ts_client_t *plain, int line, const char *what)
{
    ts_bin_list_t *list = NULL;
    int rc = ts_list(plain, &list);
    assert_int_equal(rc, 0);
    size_t n = list->count;
    for (size_t i = 0; i < list->count; i++) {
        int owner = ct_default_owner(ct_slot(list->bins[i].name), CF_SHARDS);
        if (owner != line)
            printf("cluster: %s: bin %s is on the daemon of line %d, owner %d\n", what,
                   list->bins[i].name, line, owner);
        assert_int_equal(owner, line);
    }
    ts_bin_list_free(list);
    return n;
}

/*
 * Checks made while load threads run: a failed assert would leave this frame under them, so the
 * failure is printed and counted, and asserted once the threads are joined.
 */
static int g_soft_failures;
#define SOFT(cond)                                                                                 \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            printf("cluster: check failed at line %d: %s\n", __LINE__, #cond);                     \
            g_soft_failures++;                                                                     \
        }                                                                                          \
    } while (0)

/* How many bins the daemon lists that line `line` does not own (each printed); -1 on error. */
static long misplaced(ts_client_t *plain, int line, const char *what)
{
    ts_bin_list_t *list = NULL;
    if (ts_list(plain, &list) != 0)
        return -1;
    long bad = 0;
    for (size_t i = 0; i < list->count; i++) {
        int owner = ct_default_owner(ct_slot(list->bins[i].name), CF_SHARDS);
        if (owner != line) {
            printf("cluster: %s: bin %s is on the daemon of line %d, owner %d\n", what,
                   list->bins[i].name, line, owner);
            bad++;
        }
    }
    ts_bin_list_free(list);
    return bad;
}

/* 1 when the daemon's LIST holds name. */
static int lists(ts_client_t *plain, const char *name)
{
    ts_bin_list_t *list = NULL;
    assert_int_equal(ts_list(plain, &list), 0);
    int found = 0;
    for (size_t i = 0; i < list->count && !found; i++)
        found = strcmp(list->bins[i].name, name) == 0;
    ts_bin_list_free(list);
    return found;
}

static int put_int(ts_client_t *c, const char *bin, int64_t v, uint64_t *version)
{
    ts_value_t *it = ts_int_new(v);
    int rc = ts_put(c, bin, it, version);
    ts_value_free(it);
    return rc;
}

/* An integer of the cluster client's merged STATS (-1 when missing). */
static int64_t cluster_stat(ts_client_t *c, const char *key)
{
    ts_value_t *st = NULL;
    assert_int_equal(ts_stats(c, &st), 0);
    int64_t v = -1;
    if (ts_map_get_int(st, key, &v) != 0)
        v = -1;
    ts_value_free(st);
    return v;
}

/* Retry op on bin until it succeeds, at most bound_ms. The time it took, or -1. */
static long until_ok(ts_client_t *c, const char *bin, int bound_ms, int *last_rc)
{
    uint64_t t0 = tc_now_ms();
    for (int k = 0; k < 100000 && tc_now_ms() - t0 < (uint64_t)bound_ms; k++) {
        int rc = put_int(c, bin, k, NULL);
        *last_rc = rc;
        if (rc == 0)
            return (long)(tc_now_ms() - t0);
        tc_sleep_ms(20);
    }
    return -1;
}

/* ------------------------------------------------------------------------------------------
 * Listeners: the events one subscription saw, in order.
 */
#define CF_MAX_EVENTS 256
typedef struct cf_listener {
    pthread_mutex_t mu;
    int n;
    int events[CF_MAX_EVENTS];
    uint64_t versions[CF_MAX_EVENTS];
} cf_listener;

static void cf_listener_init(cf_listener *l)
{
    memset(l, 0, sizeof(*l));
    pthread_mutex_init(&l->mu, NULL);
}

static void on_note(ts_client_t *c, int status, const ts_notification_t *n, void *arg)
{
    (void)c;
    cf_listener *l = arg;
    if (status < 0 || n == NULL)
        return;
    pthread_mutex_lock(&l->mu);
    if (l->n < CF_MAX_EVENTS) {
        l->events[l->n] = (int)n->event;
        l->versions[l->n] = n->version;
        l->n++;
    }
    pthread_mutex_unlock(&l->mu);
}

/* The index of the first event ev at or after from, or -1. */
static int find_event(cf_listener *l, int from, int ev)
{
    int at = -1;
    pthread_mutex_lock(&l->mu);
    for (int k = from; k < l->n && at < 0; k++)
        if (l->events[k] == ev)
            at = k;
    pthread_mutex_unlock(&l->mu);
    return at;
}

/* Wait (bounded) for event ev at or after from; its index or -1. */
static int wait_event(cf_listener *l, int from, int ev, int bound_ms)
{
    uint64_t t0 = tc_now_ms();
    int at;
    while ((at = find_event(l, from, ev)) < 0 && tc_now_ms() - t0 < (uint64_t)bound_ms)
        tc_sleep_ms(10);
    return at;
}

static void print_events(cf_listener *l, const char *what)
{
    char buf[1024];
    size_t off = 0;
    buf[0] = '\0';
    pthread_mutex_lock(&l->mu);
    for (int k = 0; k < l->n && off + 16 < sizeof(buf); k++)
        off +=
            (size_t)snprintf(buf + off, sizeof(buf) - off, "%s%d", k > 0 ? " " : "", l->events[k]);
    pthread_mutex_unlock(&l->mu);
    printf("cluster: %s: events [%s] (1 PUT 2 APPEND 3 GET 100 DISCONNECTED 101 RESUBSCRIBED)\n",
           what, buf);
}

static void noop_note(ts_client_t *c, int status, const ts_notification_t *n, void *arg)
{
    (void)c;
    (void)status;
    (void)n;
    (void)arg;
}

/* ------------------------------------------------------------------------------------------
 * The kill test's load: phases, and calls attributed to the phase they ran in.
 */
enum { PH_UP = 0, PH_DEAD = 1, PH_RESTARTING = 2, PH_BACK = 3, PH_N = 4 };
static const char *const ph_name[PH_N] = {"all up", "shard dead", "restarting", "back"};

typedef struct cf_load {
    ts_client_t *c;
    int victim;
    atomic_int phase;
    atomic_int stop;
    ct_tally tally[PH_N];
    /* the highest version a change of the victim's bins got before it was killed */
    atomic_uint_fast64_t victim_max_version;
} cf_load;

typedef struct cf_thread {
    cf_load *ld;
    int id;
    uint32_t rng;
} cf_thread;

static uint32_t next_rand(uint32_t *s)
{
    *s = *s * 1103515245u + 12345u;
    return *s >> 8;
}

static void note_version(cf_load *ld, int shard, int phase, uint64_t v)
{
    if (shard != ld->victim || phase != PH_UP)
        return;
    uint64_t cur = atomic_load(&ld->victim_max_version);
    while (v > cur && !atomic_compare_exchange_weak(&ld->victim_max_version, &cur, v))
        ;
}

/* One call of the mixed load; TS_ENOENT (a bin emptied by a get) counts as an answer. */
static int load_call(cf_thread *t, int shard, int op, int phase)
{
    cf_load *ld = t->ld;
    const char *bin = g_load[shard][next_rand(&t->rng) % CF_BINS];
    uint64_t v = 0;
    int rc;
    switch (op) {
    case 0: {
        ts_value_t *it = tc_item(8, (float)t->id, t->id);
        rc = ts_put(ld->c, bin, it, &v);
        ts_value_free(it);
        if (rc == 0)
            note_version(ld, shard, phase, v);
        break;
    }
    case 1: {
        ts_value_t *it = ts_int_new(t->id);
        rc = ts_append(ld->c, bin, it, &v);
        ts_value_free(it);
        if (rc == 0)
            note_version(ld, shard, phase, v);
        break;
    }
    case 2: {
        ts_items_t *items = NULL;
        rc = ts_get(ld->c, bin, 1, &items);
        ts_items_free(items);
        if (rc == TS_ENOENT)
            rc = 0;
        break;
    }
    case 3: {
        /* A wait that never waits: the server answers at once with the bin's state. */
        uint64_t cur = UINT64_MAX;
        rc = ts_wait(ld->c, bin, 0, 0, &cur, NULL);
        if (rc == TS_ETIMEDOUT && cur != UINT64_MAX)
            rc = 0;
        break;
    }
    default: {
        rc = ts_listen(ld->c, g_lbin[t->id][shard], noop_note, NULL);
        if (rc == 0)
            rc = ts_unlisten(ld->c, g_lbin[t->id][shard]);
        break;
    }
    }
    return rc;
}

static void *load_main(void *arg)
{
    cf_thread *t = arg;
    cf_load *ld = t->ld;
    uint64_t t_end = tc_now_ms() + CF_LOAD_MAX_MS;
    for (int k = 0; k < CF_MAX_CALLS && !atomic_load(&ld->stop) && tc_now_ms() < t_end; k++) {
        int shard = (int)(next_rand(&t->rng) % CF_SHARDS);
        int op = (int)(next_rand(&t->rng) % 5);
        int p0 = atomic_load(&ld->phase);
        uint64_t t0 = tc_now_ms();
        int rc = load_call(t, shard, op, p0);
        uint64_t el = tc_now_ms() - t0;
        int p1 = atomic_load(&ld->phase);
        /* A call that spans a change of phase belongs to the unsettled phase it touched. */
        int ph = p0;
        if (p1 != p0)
            ph = p0 == PH_UP ? PH_DEAD : PH_RESTARTING;
        if (rc != 0 && (shard != ld->victim || ph == PH_UP || ph == PH_BACK))
            printf("cluster: load: shard %d op %d in phase '%s' failed: %s (%s) after %llu ms\n",
                   shard, op, ph_name[ph], ts_err_name(rc), ts_last_error(),
                   (unsigned long long)el);
        if (rc != 0 && shard == ld->victim && ph == PH_DEAD && el > CF_FAST_MS)
            printf("cluster: load: a call to the dead shard failed only after %llu ms: %s\n",
                   (unsigned long long)el, ts_last_error());
        ct_tally_add(&ld->tally[ph], shard, rc, el);
        tc_sleep_ms(1);
    }
    return NULL;
}

/* ------------------------------------------------------------------------------------------
 * SIGKILL under load, then restart from the snapshot.
 */
static void test_kill_restart_under_load(void **state)
{
    (void)state;
    const int victim = 1;
    /* Shards 0 and 1 save snapshots (only on SAVE and at a clean stop); shard 2 does not. */
    assert_int_equal(ct_cluster_start(&g_cl, CF_SHARDS, 0x3u), 0);
    printf("cluster: shards at %s\n", g_cl.list);
    ts_client_t *plain[CF_SHARDS];
    for (int s = 0; s < CF_SHARDS; s++)
        plain[s] = open_plain(&g_cl.srv[s]);
    cf_load ld;
    memset(&ld, 0, sizeof(ld));
    ld.c = open_cluster(g_cl.list, CF_REQ_TIMEOUT_MS);
    ld.victim = victim;
    atomic_init(&ld.phase, PH_UP);
    atomic_init(&ld.stop, 0);
    atomic_init(&ld.victim_max_version, 0);
    for (int p = 0; p < PH_N; p++)
        ct_tally_init(&ld.tally[p]);

    /* The snapshot's content: written through the cluster client, saved on the victim. */
    uint64_t snap_version[CF_SHARDS][CF_SNAP_BINS];
    for (int s = 0; s < CF_SHARDS; s++)
        for (int b = 0; b < CF_SNAP_BINS; b++) {
            ts_value_t *it = tc_item(16, (float)(100 * s + b), 1000 + b);
            assert_int_equal(ts_put(ld.c, g_snap[s][b], it, &snap_version[s][b]), 0);
            ts_value_free(it);
            assert_true(lists(plain[s], g_snap[s][b]));
        }
    assert_int_equal(ts_save(plain[victim]), 0);
    uint64_t max_before = 0;
    for (int b = 0; b < CF_SNAP_BINS; b++)
        if (snap_version[victim][b] > max_before)
            max_before = snap_version[victim][b];

    /* Listeners on a bin of the victim and on a bin of another shard. */
    /* Static: a failed assertion leaves the client (and its callbacks) behind, not this frame. */
    static cf_listener lv, lo;
    cf_listener_init(&lv);
    cf_listener_init(&lo);
    assert_int_equal(ts_listen(ld.c, g_load[victim][0], on_note, &lv), 0);
    assert_int_equal(ts_listen(ld.c, g_load[0][0], on_note, &lo), 0);

    cf_thread th[CF_THREADS];
    pthread_t tid[CF_THREADS];
    for (int t = 0; t < CF_THREADS; t++) {
        th[t] = (cf_thread){.ld = &ld, .id = t, .rng = 7u + 31u * (uint32_t)t};
        assert_int_equal(pthread_create(&tid[t], NULL, load_main, &th[t]), 0);
    }
    tc_sleep_ms(CF_PHASE_MS);

    /* Kill the victim. */
    atomic_store(&ld.phase, PH_DEAD);
    ct_shard_kill(&g_cl, victim);
    uint64_t killed_at = tc_now_ms();
    tc_sleep_ms(CF_PHASE_MS);

    /* While it is dead: direct calls fail fast; a new cluster client opens; LIST and STATS. */
    int rc_direct[4];
    uint64_t ms_direct[4];
    for (int k = 0; k < 4; k++) {
        uint64_t t0 = tc_now_ms();
        rc_direct[k] = put_int(ld.c, g_load[victim][k], k, NULL);
        ms_direct[k] = tc_now_ms() - t0;
        printf("cluster: dead shard: put %s: %s in %llu ms (%s)\n", g_load[victim][k],
               ts_err_name(rc_direct[k]), (unsigned long long)ms_direct[k], ts_last_error());
        SOFT(rc_direct[k] == TS_ENOTCONN);
        SOFT(ms_direct[k] < CF_FAST_MS);
    }
    {
        uint64_t t0 = tc_now_ms();
        ts_client_t *c2 = NULL;
        ts_client_options_t o;
        ts_client_options_init(&o);
        o.request_timeout_ms = CF_REQ_TIMEOUT_MS;
        int rc = ts_client_open(&c2, g_cl.list, &o);
        printf("cluster: open with shard %d dead: %s in %llu ms (%s)\n", victim, ts_err_name(rc),
               (unsigned long long)(tc_now_ms() - t0), rc != 0 ? ts_last_error() : "");
        SOFT(rc == 0);
        t0 = tc_now_ms();
        rc = c2 == NULL ? TS_EINVAL : put_int(c2, g_load[victim][0], 1, NULL);
        printf("cluster: new client, dead shard's bin: %s in %llu ms (%s)\n", ts_err_name(rc),
               (unsigned long long)(tc_now_ms() - t0), ts_last_error());
        SOFT(rc == TS_ENOTCONN);
        SOFT(tc_now_ms() - t0 < CF_FAST_MS);
        SOFT(c2 != NULL && put_int(c2, g_load[0][1], 1, NULL) == 0);
        SOFT(c2 != NULL && put_int(c2, g_load[2][1], 1, NULL) == 0);
        ts_client_free(c2);

        ts_bin_list_t *bl = NULL;
        t0 = tc_now_ms();
        rc = ts_list(ld.c, &bl);
        printf("cluster: LIST with shard %d dead: %s in %llu ms, %zu bins (%s)\n", victim,
               ts_err_name(rc), (unsigned long long)(tc_now_ms() - t0),
               bl != NULL ? bl->count : (size_t)0, rc != 0 ? ts_last_error() : "");
        SOFT(tc_now_ms() - t0 < CF_FAST_MS);
        /* docs/CLUSTER.md: a LIST without a shard's bins would look as if they were deleted. */
        SOFT(rc == TS_ENOTCONN && bl == NULL);
        ts_bin_list_free(bl);
        ts_value_t *st = NULL;
        t0 = tc_now_ms();
        rc = ts_stats(ld.c, &st);
        printf("cluster: STATS with shard %d dead: %s in %llu ms (%s)\n", victim, ts_err_name(rc),
               (unsigned long long)(tc_now_ms() - t0), rc != 0 ? ts_last_error() : "");
        SOFT(tc_now_ms() - t0 < CF_FAST_MS);
        /* docs/CLUSTER.md: STATS fails only when no shard answers, and counts those that did not.
         */
        int64_t down = -1;
        SOFT(rc == 0 && ts_map_get_int(st, "shards_down", &down) == 0 && down == 1);
        ts_value_free(st);
    }
    /* Nothing of the dead shard landed on the living ones. */
    for (int s = 0; s < CF_SHARDS; s++)
        if (s != victim)
            SOFT(misplaced(plain[s], s, "while the shard is dead") == 0);
    int lv_disc = wait_event(&lv, 0, TS_EV_DISCONNECTED, CF_RECOVER_MS);
    SOFT(lv_disc >= 0);
    printf("cluster: listener on the dead shard got DISCONNECTED (%d events before it); dead for "
           "%llu ms\n",
           lv_disc, (unsigned long long)(tc_now_ms() - killed_at));
    SOFT(find_event(&lo, 0, TS_EV_DISCONNECTED) == -1);

    /* Restart it on the same port from its snapshot. */
    atomic_store(&ld.phase, PH_RESTARTING);
    char arg[16];
    snprintf(arg, sizeof(arg), "%d/%d", victim, CF_SHARDS);
    SOFT(ct_shard_restart(&g_cl, victim, arg, NULL) == 0);
    int last_rc = 0;
    long back_ms = until_ok(ld.c, g_load[victim][1], CF_RECOVER_MS, &last_rc);
    printf("cluster: restarted shard answered the cluster client %ld ms after it listened "
           "(last error %s)\n",
           back_ms, ts_err_name(last_rc));
    SOFT(back_ms >= 0);
    atomic_store(&ld.phase, PH_BACK);
    tc_sleep_ms(CF_PHASE_MS);
    atomic_store(&ld.stop, 1);
    for (int t = 0; t < CF_THREADS; t++)
        pthread_join(tid[t], NULL);
    /* The checks made while the load ran, now that no thread uses this frame. */
    assert_int_equal(g_soft_failures, 0);

    /* What the load saw, phase by phase. */
    for (int p = 0; p < PH_N; p++) {
        char label[64];
        snprintf(label, sizeof(label), "cluster: load, %s:", ph_name[p]);
        ct_tally_print(&ld.tally[p], label, CF_SHARDS);
    }
    for (int p = 0; p < PH_N; p++)
        for (int s = 0; s < CF_SHARDS; s++) {
            if (s != victim || p == PH_UP || p == PH_BACK)
                assert_int_equal(ld.tally[p].failed[s], 0);
        }
    for (int s = 0; s < CF_SHARDS; s++)
        if (s != victim)
            assert_true(ld.tally[PH_DEAD].ok[s] > 0);
    ct_tally *dead = &ld.tally[PH_DEAD];
    assert_true(dead->failed[victim] > 0);
    assert_true(ct_tally_code(dead, victim, TS_ENOTCONN) > 0);
    /* Calls in flight at the kill may end with the reset connection; nothing else. */
    assert_int_equal(dead->failed[victim], ct_tally_code(dead, victim, TS_ENOTCONN) +
                                               ct_tally_code(dead, victim, TS_ECONNRESET));
    assert_true(dead->max_fail_ms[victim] < CF_FAST_MS);
    assert_true(ld.tally[PH_RESTARTING].max_fail_ms[victim] < CF_FAST_MS);
    assert_true(ld.tally[PH_BACK].ok[victim] > 0);

    /* The listener on the restarted shard: DISCONNECTED, RESUBSCRIBED, then new changes. */
    int lv_resub = wait_event(&lv, lv_disc + 1, TS_EV_RESUBSCRIBED, CF_RECOVER_MS);
    assert_true(lv_resub > lv_disc);
    uint64_t v_new = 0;
    assert_int_equal(put_int(ld.c, g_load[victim][0], 77, &v_new), 0);
    int lv_put = wait_event(&lv, lv_resub + 1, TS_EV_PUT, CF_RECOVER_MS);
    assert_true(lv_put > lv_resub);
    print_events(&lv, "listener on the restarted shard");
    print_events(&lo, "listener on a living shard");
    assert_int_equal(find_event(&lo, 0, TS_EV_DISCONNECTED), -1);

    /* Versions grow across the restart: above every version the shard gave before the kill. */
    uint64_t vmax = atomic_load(&ld.victim_max_version);
    if (max_before > vmax)
        vmax = max_before;
    printf("cluster: victim's highest version before the kill %llu, after the restart %llu "
           "(+%llu)\n",
           (unsigned long long)vmax, (unsigned long long)v_new, (unsigned long long)(v_new - vmax));
    assert_true(v_new > vmax);
    pthread_mutex_lock(&lv.mu);
    uint64_t note_v = lv.versions[lv_put];
    pthread_mutex_unlock(&lv.mu);
    assert_true(note_v > vmax);

    /* The snapshot's data is back, with its versions. */
    for (int b = 0; b < CF_SNAP_BINS; b++) {
        ts_items_t *items = NULL;
        assert_int_equal(ts_peek(ld.c, g_snap[victim][b], 0, &items), 0);
        assert_int_equal(ts_items_count(items), 1);
        assert_true(tc_check_vec(ts_items_at(items, 0), 16, (float)(100 * victim + b)));
        assert_int_equal(tc_tag(ts_items_at(items, 0)), 1000 + b);
        assert_int_equal(ts_items_version(items), snap_version[victim][b]);
        ts_items_free(items);
    }
    for (int s = 0; s < CF_SHARDS; s++)
        check_owned(plain[s], s, "after the restart");

    ts_unlisten(ld.c, g_load[victim][0]);
    ts_unlisten(ld.c, g_load[0][0]);
    ts_client_free(ld.c);
    for (int s = 0; s < CF_SHARDS; s++)
        ts_client_free(plain[s]);
    for (int p = 0; p < PH_N; p++)
        ct_tally_destroy(&ld.tally[p]);
    ct_cluster_free(&g_cl);
}

/* ------------------------------------------------------------------------------------------
 * SIGSTOP: a hung shard. Its calls time out; the others answer meanwhile; SIGCONT recovers.
 */
typedef struct cf_others {
    ts_client_t *c;
    int victim;
    atomic_int stop;
    ct_tally tally;
} cf_others;

static void *others_main(void *arg)
{
    cf_others *o = arg;
    uint64_t t_end = tc_now_ms() + CF_LOAD_MAX_MS;
    for (int k = 0; k < CF_MAX_CALLS && !atomic_load(&o->stop) && tc_now_ms() < t_end; k++) {
        int s = (o->victim + 1 + k % (CF_SHARDS - 1)) % CF_SHARDS;
        uint64_t t0 = tc_now_ms();
        int rc = put_int(o->c, g_load[s][k % CF_BINS], k, NULL);
        ct_tally_add(&o->tally, s, rc, tc_now_ms() - t0);
        tc_sleep_ms(2);
    }
    return NULL;
}

static void test_frozen_shard(void **state)
{
    (void)state;
    const int victim = 2;
    assert_int_equal(ct_cluster_start(&g_cl, CF_SHARDS, 0), 0);
    ts_client_t *c = open_cluster(g_cl.list, CF_FREEZE_TIMEOUT_MS);
    for (int s = 0; s < CF_SHARDS; s++)
        for (int b = 0; b < CF_BINS; b++)
            assert_int_equal(put_int(c, g_load[s][b], b, NULL), 0);
    static cf_listener lv; /* static: see test_kill_restart_under_load */
    cf_listener_init(&lv);
    assert_int_equal(ts_listen(c, g_load[victim][0], on_note, &lv), 0);

    ct_shard_freeze(&g_cl, victim);
    cf_others o = {.c = c, .victim = victim};
    atomic_init(&o.stop, 0);
    ct_tally_init(&o.tally);
    pthread_t tid;
    assert_int_equal(pthread_create(&tid, NULL, others_main, &o), 0);
    ct_tally frozen;
    ct_tally_init(&frozen);
    /* Six calls to the hung shard, one after the other: each ends at the request timeout. */
    for (int k = 0; k < 6; k++) {
        uint64_t t0 = tc_now_ms();
        int rc = put_int(c, g_load[victim][k], 100 + k, NULL);
        uint64_t el = tc_now_ms() - t0;
        printf("cluster: frozen shard: call %d: %s in %llu ms (%s)\n", k, ts_err_name(rc),
               (unsigned long long)el, ts_last_error());
        ct_tally_add(&frozen, victim, rc, el);
        SOFT(rc != 0);
        SOFT(el < CF_FREEZE_TIMEOUT_MS + CF_SLACK_MS);
    }
    atomic_store(&o.stop, 1);
    pthread_join(tid, NULL);
    assert_int_equal(g_soft_failures, 0);
    ct_tally_print(&frozen, "cluster: frozen shard's calls:", CF_SHARDS);
    ct_tally_print(&o.tally, "cluster: other shards while one is frozen:", CF_SHARDS);
    assert_true(ct_tally_code(&frozen, victim, TS_ETIMEDOUT) > 0);
    for (int s = 0; s < CF_SHARDS; s++)
        if (s != victim) {
            assert_int_equal(o.tally.failed[s], 0);
            assert_true(o.tally.ok[s] > 0);
        }

    ct_shard_thaw(&g_cl, victim);
    int last_rc = 0;
    long back_ms = until_ok(c, g_load[victim][1], CF_RECOVER_MS, &last_rc);
    printf("cluster: thawed shard answered again after %ld ms\n", back_ms);
    assert_true(back_ms >= 0);
    /* The late replies of the timed-out calls must not answer later requests. */
    ts_value_t *it = tc_item(5, 3, 42);
    assert_int_equal(ts_put(c, g_load[victim][2], it, NULL), 0);
    ts_value_free(it);
    ts_items_t *items = NULL;
    assert_int_equal(ts_peek(c, g_load[victim][2], 0, &items), 0);
    assert_int_equal(ts_items_count(items), 1);
    assert_int_equal(tc_tag(ts_items_at(items, 0)), 42);
    assert_true(tc_check_vec(ts_items_at(items, 0), 5, 3));
    ts_items_free(items);
    tc_sleep_ms(200);
    print_events(&lv, "listener on the frozen shard");

    ts_client_free(c);
    ct_tally_destroy(&frozen);
    ct_tally_destroy(&o.tally);
    ct_cluster_free(&g_cl);
}

/* ------------------------------------------------------------------------------------------
 * Stale maps: a list in the wrong order, an old map file, and a map changed under a client.
 */

/* Restart every shard with --cluster-map path, daemon d as line line_of[d]. */
static void restart_with_map(ct_cluster *clu, const char *path, const int *line_of)
{
    for (int d = 0; d < clu->n; d++)
        if (clu->srv[d].pid > 0)
            assert_true(ct_shard_stop(clu, d) >= 0);
    for (int d = 0; d < clu->n; d++) {
        char arg[16];
        snprintf(arg, sizeof(arg), "%d", line_of[d]);
        const char *extra[] = {"--cluster-map", path, NULL};
        assert_int_equal(ct_shard_restart(clu, d, arg, extra), 0);
    }
}

/* Put every load bin of every line through c; then every daemon holds only its own. */
static void put_all_and_check(ts_client_t *c, ct_cluster *clu, const int *line_of, const char *what)
{
    for (int s = 0; s < CF_SHARDS; s++)
        for (int b = 0; b < CF_BINS; b++) {
            int rc = put_int(c, g_load[s][b], b, NULL);
            if (rc != 0)
                printf("cluster: %s: put %s: %s (%s)\n", what, g_load[s][b], ts_err_name(rc),
                       ts_last_error());
            assert_int_equal(rc, 0);
        }
    size_t total = 0;
    for (int d = 0; d < CF_SHARDS; d++) {
        ts_client_t *p = open_plain(&clu->srv[d]);
        total += check_owned(p, line_of[d], what);
        ts_client_free(p);
    }
    assert_int_equal(total, (size_t)(CF_SHARDS * CF_BINS));
}

static void test_stale_maps(void **state)
{
    (void)state;
    assert_int_equal(ct_cluster_start(&g_cl, CF_SHARDS, 0), 0);
    char map2[320], map1[320], map3[320], addr[340];
    ct_cluster_path(&g_cl, map2, sizeof(map2), "map2");
    ct_cluster_path(&g_cl, map1, sizeof(map1), "map1");
    ct_cluster_path(&g_cl, map3, sizeof(map3), "map3");
    const int ident[CF_SHARDS] = {0, 1, 2};
    char wrong[3 * sizeof(g_cl.srv[0].addr) + 4];
    snprintf(wrong, sizeof(wrong), "%s,%s,%s", g_cl.srv[2].addr, g_cl.srv[0].addr,
             g_cl.srv[1].addr);

    /*
     * A list in the wrong order (epoch 0) while the daemons run --shard i/3 alone (epoch 1, no
     * addresses): each daemon's SHARD_MAP says which index it is.
     */
    ts_client_t *c = open_cluster(wrong, CF_REQ_TIMEOUT_MS);
    put_all_and_check(c, &g_cl, ident, "list in the wrong order, --shard i/3");
    printf("cluster: list in the wrong order, --shard i/3: epoch %lld, %lld redirects\n",
           (long long)cluster_stat(c, "cluster_epoch"),
           (long long)cluster_stat(c, "cluster_redirects"));
    ts_client_free(c);

    /* The daemons run epoch 2 (restarted empty), daemon d as line d. */
    assert_int_equal(ct_write_map(&g_cl, map2, 2, NULL), 0);
    restart_with_map(&g_cl, map2, ident);

    /* The same list in the wrong order: the daemons' epoch-2 map replaces it. */
    c = open_cluster(wrong, CF_REQ_TIMEOUT_MS);
    put_all_and_check(c, &g_cl, ident, "list in the wrong order, map epoch 2");
    printf("cluster: list in the wrong order, map epoch 2: epoch %lld, %lld redirects\n",
           (long long)cluster_stat(c, "cluster_epoch"),
           (long long)cluster_stat(c, "cluster_redirects"));
    assert_int_equal(cluster_stat(c, "cluster_epoch"), 2);
    ts_client_free(c);

    /* A map file of epoch 1 in the wrong order. */
    const int rot[CF_SHARDS] = {1, 2, 0};
    assert_int_equal(ct_write_map(&g_cl, map1, 1, rot), 0);
    snprintf(addr, sizeof(addr), "cluster:%s", map1);
    c = open_cluster(addr, CF_REQ_TIMEOUT_MS);
    put_all_and_check(c, &g_cl, ident, "map file of an old epoch");
    assert_int_equal(cluster_stat(c, "cluster_epoch"), 2);
    int64_t redirects2 = cluster_stat(c, "cluster_redirects");

    /*
     * The map changes under the running client: epoch 3 gives line k to daemon rot[k], so
     * daemon d is line (d + 2) % 3. The client still holds epoch 2; WRONG_SHARD redirects it.
     * The daemons restart empty (no --save), so every bin checked is one written now.
     */
    assert_int_equal(ct_write_map(&g_cl, map3, 3, rot), 0);
    const int line3[CF_SHARDS] = {2, 0, 1};
    restart_with_map(&g_cl, map3, line3);
    /* Each per-shard connection reconnects first (bounded), then puts go where map 3 says. */
    int last_rc = 0;
    for (int s = 0; s < CF_SHARDS; s++) {
        long ms = until_ok(c, g_snap[s][0], CF_RECOVER_MS, &last_rc);
        printf("cluster: map changed (epoch 3): bin of line %d answered after %ld ms (last %s)\n",
               s, ms, ts_err_name(last_rc));
        assert_true(ms >= 0);
    }
    /* Line s of map 3 is daemon rot[s]: the bin is there. */
    for (int s = 0; s < CF_SHARDS; s++) {
        ts_client_t *p = open_plain(&g_cl.srv[rot[s]]);
        assert_true(lists(p, g_snap[s][0]));
        ts_client_free(p);
    }
    /* Remove those bins, then the full check counts the load bins alone. */
    for (int s = 0; s < CF_SHARDS; s++)
        assert_int_equal(ts_delete(c, g_snap[s][0], NULL), 0);
    put_all_and_check(c, &g_cl, line3, "map changed under the client");
    int64_t redirects3 = cluster_stat(c, "cluster_redirects");
    printf("cluster: map changed under the client: epoch %lld, redirects %lld -> %lld\n",
           (long long)cluster_stat(c, "cluster_epoch"), (long long)redirects2,
           (long long)redirects3);
    /* It follows the new map (asked again when each shard reconnected, or after WRONG_SHARD). */
    assert_int_equal(cluster_stat(c, "cluster_epoch"), 3);
    ts_client_free(c);

    /*
     * A client map newer than the daemons' (an operator wrote epoch 5 before restarting the
     * daemons): the client keeps its map and goes where it says; the daemons, still on epoch
     * 3, answer WRONG_SHARD with the owner's address, and the client follows.
     */
    char map5[320];
    ct_cluster_path(&g_cl, map5, sizeof(map5), "map5");
    assert_int_equal(ct_write_map(&g_cl, map5, 5, NULL), 0);
    snprintf(addr, sizeof(addr), "cluster:%s", map5);
    c = open_cluster(addr, CF_REQ_TIMEOUT_MS);
    put_all_and_check(c, &g_cl, line3, "client map newer than the daemons'");
    int64_t redirects5 = cluster_stat(c, "cluster_redirects");
    printf("cluster: client map newer than the daemons': epoch %lld, %lld redirects\n",
           (long long)cluster_stat(c, "cluster_epoch"), (long long)redirects5);
    assert_true(redirects5 > 0);
    /* Once learned, a slot goes straight to its owner: the same puts again, no new redirect. */
    put_all_and_check(c, &g_cl, line3, "client map newer than the daemons', again");
    assert_int_equal(cluster_stat(c, "cluster_redirects"), redirects5);
    ts_client_free(c);
    ct_cluster_free(&g_cl);
}

/* ------------------------------------------------------------------------------------------
 * A shard restarted with another shard's index: WRONG_SHARD, never data on the wrong daemon.
 */
static void test_wrong_index(void **state)
{
    (void)state;
    const int victim = 1;
    assert_int_equal(ct_cluster_start(&g_cl, CF_SHARDS, 0), 0);
    ts_client_t *c = open_cluster(g_cl.list, CF_FREEZE_TIMEOUT_MS * 4);
    for (int s = 0; s < CF_SHARDS; s++)
        assert_int_equal(put_int(c, g_load[s][0], s, NULL), 0);

    assert_true(ct_shard_stop(&g_cl, victim) >= 0);
    char arg[16];
    snprintf(arg, sizeof(arg), "%d/%d", 2, CF_SHARDS);
    assert_int_equal(ct_shard_restart(&g_cl, victim, arg, NULL), 0);

    /* Bounded: until the cluster client has reconnected (no more TS_ENOTCONN). */
    ct_tally t;
    ct_tally_init(&t);
    int rc = TS_ENOTCONN;
    uint64_t t0 = tc_now_ms();
    for (int k = 0; k < 1000 && rc == TS_ENOTCONN && tc_now_ms() - t0 < CF_RECOVER_MS; k++) {
        rc = put_int(c, g_load[victim][1], k, NULL);
        if (rc == TS_ENOTCONN)
            tc_sleep_ms(20);
    }
    printf("cluster: shard restarted as 2/3: put of a line-1 bin: %s (%s)\n", ts_err_name(rc),
           ts_last_error());
    for (int b = 0; b < CF_BINS; b++) {
        uint64_t t1 = tc_now_ms();
        rc = put_int(c, g_load[victim][b], b, NULL);
        ct_tally_add(&t, victim, rc, tc_now_ms() - t1);
        ts_items_t *items = NULL;
        t1 = tc_now_ms();
        rc = ts_peek(c, g_load[victim][b], 0, &items);
        ts_items_free(items);
        ct_tally_add(&t, victim, rc, tc_now_ms() - t1);
        for (int s = 0; s < CF_SHARDS; s++)
            if (s != victim) {
                t1 = tc_now_ms();
                ct_tally_add(&t, s, put_int(c, g_load[s][b], b, NULL), tc_now_ms() - t1);
            }
    }
    ct_tally_print(&t, "cluster: shard restarted as 2/3:", CF_SHARDS);
    assert_int_equal(t.ok[victim], 0);
    assert_int_equal(t.failed[victim], ct_tally_code(&t, victim, TS_EWRONGSHARD));
    assert_int_equal(t.failed[0], 0);
    assert_int_equal(t.failed[2], 0);
    /* The misconfigured daemon holds no bin of line 1 (it was restarted empty), the others
     * only theirs. */
    ts_client_t *p = open_plain(&g_cl.srv[victim]);
    ts_bin_list_t *bl = NULL;
    assert_int_equal(ts_list(p, &bl), 0);
    printf("cluster: the misconfigured daemon lists %zu bins\n", bl->count);
    assert_int_equal(bl->count, 0);
    ts_bin_list_free(bl);

    ts_client_free(p);
    for (int s = 0; s < CF_SHARDS; s++)
        if (s != victim) {
            p = open_plain(&g_cl.srv[s]);
            check_owned(p, s, "with a misconfigured shard");
            ts_client_free(p);
        }

    /* Restarted with the right index, it serves its bins again. */
    assert_true(ct_shard_stop(&g_cl, victim) >= 0);
    snprintf(arg, sizeof(arg), "%d/%d", victim, CF_SHARDS);
    assert_int_equal(ct_shard_restart(&g_cl, victim, arg, NULL), 0);
    int last_rc = 0;
    long ms = until_ok(c, g_load[victim][1], CF_RECOVER_MS, &last_rc);
    printf("cluster: shard restarted as 1/3 answered after %ld ms\n", ms);
    assert_true(ms >= 0);
    ts_client_free(c);
    ct_tally_destroy(&t);
    ct_cluster_free(&g_cl);
}

/*
 * A client opened while a shard runs with another shard's index: two daemons say they are shard
 * 2 (SHARD_MAP's self), none says 1. Its list says which address is which shard; nothing may
 * land on the misconfigured daemon (it answers WRONG_SHARD for line 1's bins, and line 2's
 * belong to the daemon at position 2 of the list, where every older client puts them).
 */
static void test_wrong_index_new_client(void **state)
{
    (void)state;
    const int victim = 1;
    assert_int_equal(ct_cluster_start(&g_cl, CF_SHARDS, 0), 0);
    assert_true(ct_shard_stop(&g_cl, victim) >= 0);
    assert_int_equal(ct_shard_restart(&g_cl, victim, "2/3", NULL), 0);
    ts_client_t *c = open_cluster(g_cl.list, CF_FREEZE_TIMEOUT_MS * 4);
    ct_tally t;
    ct_tally_init(&t);
    for (int s = 0; s < CF_SHARDS; s++)
        for (int b = 0; b < CF_BINS; b++) {
            uint64_t t1 = tc_now_ms();
            int rc = put_int(c, g_load[s][b], 1000 + b, NULL);
            ct_tally_add(&t, s, rc, tc_now_ms() - t1);
            if (rc != 0 && b == 0)
                printf("cluster: new client, line-%d bin: %s (%s)\n", s, ts_err_name(rc),
                       ts_last_error());
        }
    ct_tally_print(&t, "cluster: client opened with a misconfigured shard:", CF_SHARDS);
    ts_client_t *p = open_plain(&g_cl.srv[victim]);
    ts_bin_list_t *bl = NULL;
    assert_int_equal(ts_list(p, &bl), 0);
    printf("cluster: the misconfigured daemon lists %zu bins\n", bl->count);
    size_t on_wrong = bl->count;
    ts_bin_list_free(bl);
    ts_client_free(p);
    assert_int_equal(t.ok[victim], 0);
    assert_int_equal(t.failed[victim], ct_tally_code(&t, victim, TS_EWRONGSHARD));
    assert_int_equal(t.failed[0], 0);
    assert_int_equal(on_wrong, 0);
    assert_int_equal(t.failed[2], 0);
    p = open_plain(&g_cl.srv[2]);
    assert_int_equal(check_owned(p, 2, "the daemon at position 2"), (size_t)CF_BINS);
    ts_client_free(p);
    ts_client_free(c);
    ct_tally_destroy(&t);
    ct_cluster_free(&g_cl);
}

/* Stop every daemon of the test by PID, also after a failed assertion. */
static int teardown(void **state)
{
    (void)state;
    ct_cluster_free(&g_cl);
    g_soft_failures = 0;
    return 0;
}

static int setup(void **state)
{
    (void)state;
    make_names();
    return 0;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_kill_restart_under_load, teardown),
        cmocka_unit_test_teardown(test_frozen_shard, teardown),
        cmocka_unit_test_teardown(test_stale_maps, teardown),
        cmocka_unit_test_teardown(test_wrong_index, teardown),
        cmocka_unit_test_teardown(test_wrong_index_new_client, teardown),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
