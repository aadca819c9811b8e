/*
 * The cluster client against three real tensord started with "--shard i/3": every named call
 * goes to the shard that owns the name (checked with a plain client on each shard), hash tags,
 * LIST and STATS merged, a stale map (wrong order, higher epoch) corrected by WRONG_SHARD
 * redirects and learned, a map file, and a shard killed and restarted on its port: its bins fail
 * fast with TS_ENOTCONN while the others keep working, then work again, and a listener on one of
 * them gets TS_EV_RESUBSCRIBED and newer versions. Every loop is bounded; daemons stop by PID.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdatomic.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cluster.h"
#include "harness.h"
#include "slot.h"
#include "test_client_util.h"
#include "tensorshare/coord.h"
#include "tensorshare/replay.h"
#include "tensorshare/stream.h"

#define N 3
/* ms; a request to a shard that is down fails well before this */
#define FAIL_FAST_MS 1000

static tsc_cluster cc;
static ts_client_t *plain[N]; /* one ordinary client per shard */

static int group_setup(void **state)
{
    (void)state;
    if (tsc_start(&cc, N, NULL) != 0)
        return -1;
    for (int i = 0; i < N; i++) {
        if (ts_client_open(&plain[i], cc.srv[i].addr, NULL) != 0)
            return -1;
    }
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    for (int i = 0; i < N; i++)
        ts_client_free(plain[i]);
    tsc_stop(&cc);
    return 0;
}

static ts_client_t *open_list(const char *list)
{
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.connect_timeout_ms = 2000;
    o.request_timeout_ms = 5000;
    o.reconnect_min_ms = 20;
    o.reconnect_max_ms = 100;
    ts_client_t *c = NULL;
    int rc = ts_client_open(&c, list, &o);
    if (rc != 0)
        fprintf(stderr, "open %s: %s (%s)\n", list, ts_strerror(rc), ts_last_error());
    assert_int_equal(rc, 0);
    return c;
}

/* 1 when shard i's plain LIST has a bin of that name. */
static int shard_has(int i, const char *name)
{
    ts_bin_list_t *l = NULL;
    assert_int_equal(ts_list(plain[i], &l), 0);
    int found = 0;
    for (size_t k = 0; k < l->count; k++)
        found |= strcmp(l->bins[k].name, name) == 0;
    ts_bin_list_free(l);
    return found;
}

/* The bin lives on shard want and on no other shard. */
static void assert_on_shard(const char *name, int want)
{
    for (int i = 0; i < N; i++) {
        if (shard_has(i, name) != (i == want))
            fail_msg("bin '%s' on shard %d: %d (it belongs to shard %d)", name, i,
                     shard_has(i, name), want);
    }
}

static void put_tag(ts_client_t *c, const char *name, int64_t tag, uint64_t *version)
{
    ts_value_t *it = tc_item(4, (float)tag, tag);
    int rc = ts_put(c, name, it, version);
    if (rc != 0)
        fail_msg("put %s: %s (%s)", name, ts_strerror(rc), ts_last_error());
    ts_value_free(it);
}

static int64_t get_tag(ts_client_t *c, const char *name)
{
    ts_items_t *items = NULL;
    int rc = ts_peek(c, name, 0, &items);
    if (rc != 0)
        fail_msg("peek %s: %s (%s)", name, ts_strerror(rc), ts_last_error());
    int64_t tag =
        ts_items_count(items) > 0 ? tc_tag(ts_items_at(items, ts_items_count(items) - 1)) : -1;
    ts_items_free(items);
    return tag;
}

/* ---------------------------------------------------------------------------------------------
 * Routing
 */

static void test_bins_land_on_their_shard(void **state)
{
    (void)state;
    ts_client_t *c = open_list(cc.list);
    for (int s = 0; s < N; s++) {
        for (int k = 0; k < 4; k++) {
            char name[64];
            assert_int_equal(tsc_name_for(name, sizeof(name), "land", k, s, N), 0);
            put_tag(c, name, s * 10 + k, NULL);
            assert_int_equal(get_tag(c, name), s * 10 + k);
            assert_on_shard(name, s);
        }
    }
    /* Hash tags: every name with {run7} lives where "run7" does. */
    const char *tagged[] = {"{run7}.params", "{run7}.grads", "{run7}", "x{run7}y"};
    int owner = tsc_owner("run7", N);
    for (size_t i = 0; i < 4; i++) {
        put_tag(c, tagged[i], (int64_t)i, NULL);
        assert_on_shard(tagged[i], owner);
    }
    ts_client_free(c);
}

/* Callbacks receive the handle the user opened. */
typedef struct seen {
    tc_latch done;
    _Atomic(ts_client_t *) client;
    atomic_int status;
    atomic_long events[8]; /* PUT, DISCONNECTED, RESUBSCRIBED, other */
    atomic_ullong version;
} seen;

static void result_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)res;
    seen *s = arg;
    atomic_store(&s->client, c);
    atomic_store(&s->status, status);
    tc_latch_add(&s->done, 1);
}

static void notify_cb(ts_client_t *c, int status, const ts_notification_t *n, void *arg)
{
    seen *s = arg;
    atomic_store(&s->client, c);
    if (status != 0) {
        tc_latch_add(&s->done, 1000);
        return;
    }
    int k = n->event == TS_EV_PUT            ? 0
            : n->event == TS_EV_DISCONNECTED ? 1
            : n->event == TS_EV_RESUBSCRIBED ? 2
                                             : 3;
    if (n->event == TS_EV_PUT)
        atomic_store(&s->version, n->version);
    atomic_fetch_add(&s->events[k], 1);
    tc_latch_add(&s->done, 1);
}

static void seen_init(seen *s)
{
    memset(s, 0, sizeof(*s));
    tc_latch_init(&s->done);
}

/* The object named name is visible to shard want's plain client only (WRONG_SHARD elsewhere). */
static void assert_info_on(const char *name, int want, int table)
{
    for (int i = 0; i < N; i++) {
        ts_value_t *v = NULL;
        int rc = table ? ts_table_info(plain[i], name, &v) : ts_stream_info(plain[i], name, &v);
        ts_value_free(v);
        if (i == want)
            assert_int_equal(rc, 0);
        else
            assert_int_equal(rc, TS_EWRONGSHARD);
    }
}

static void test_every_named_call_routes(void **state)
{
    (void)state;
    ts_client_t *c = open_list(cc.list);
    for (int s = 0; s < N; s++) {
        char b[64], st[64], tb[64], ctr[64], rows[64], other[64], putif[64], bar[64];
        tsc_name_for(b, sizeof(b), "api", 0, s, N);
        tsc_name_for(st, sizeof(st), "stream", 0, s, N);
        tsc_name_for(tb, sizeof(tb), "table", 0, s, N);
        tsc_name_for(ctr, sizeof(ctr), "counter", 0, s, N);
        tsc_name_for(rows, sizeof(rows), "rows", 0, s, N);
        tsc_name_for(other, sizeof(other), "async", 0, s, N);
        tsc_name_for(putif, sizeof(putif), "putif", 0, s, N);
        tsc_name_for(bar, sizeof(bar), "barrier", 0, s, N);

        /* put, append, peek, get, wait, delete; the listener sees the handle. */
        seen ls;
        seen_init(&ls);
        assert_int_equal(ts_listen(c, b, notify_cb, &ls), 0);
        uint64_t v1;
        put_tag(c, b, 1, &v1);
        ts_value_t *it = tc_item(2, 0, 2);
        uint64_t v2;
        assert_int_equal(ts_append(c, b, it, &v2), 0);
        ts_value_free(it);
        assert_true(v2 > v1);
        uint64_t wv = 0;
        uint32_t wn = 0;
        assert_int_equal(ts_wait(c, b, v1, 1000, &wv, &wn), 0);
        assert_int_equal(wv, v2);
        assert_int_equal(wn, 2);
        assert_int_equal(get_tag(c, b), 2);
        assert_true(tc_latch_wait(&ls.done, 2, TC_WAIT_MS) >= 2);
        assert_ptr_equal(atomic_load(&ls.client), c);
        assert_on_shard(b, s);
        ts_items_t *items = NULL;
        assert_int_equal(ts_get(c, b, 0, &items), 0);
        assert_int_equal(ts_items_count(items), 2);
        ts_items_free(items);
        put_tag(c, b, 3, NULL);
        uint32_t removed = 0;
        assert_int_equal(ts_delete(c, b, &removed), 0);
        assert_int_equal(removed, 1);
        assert_int_equal(ts_unlisten(c, b), 0);

        /* Asynchronous calls: the callback gets the handle. */
        seen as;
        seen_init(&as);
        it = tc_item(4, 1, 7);
        assert_int_equal(ts_put_async(c, other, it, TS_COPY, result_cb, &as), 0);
        ts_value_free(it);
        assert_int_equal(tc_latch_wait(&as.done, 1, TC_WAIT_MS), 1);
        assert_int_equal(atomic_load(&as.status), 0);
        assert_ptr_equal(atomic_load(&as.client), c);
        assert_on_shard(other, s);
        assert_int_equal(ts_get_async(c, other, 0, result_cb, &as), 0);
        assert_int_equal(tc_latch_wait(&as.done, 2, TC_WAIT_MS), 2);
        assert_int_equal(atomic_load(&as.status), 0);
        assert_int_equal(ts_wait_async(c, other, 0, 0, result_cb, &as), 0);
        assert_int_equal(tc_latch_wait(&as.done, 3, TC_WAIT_MS), 3);
        tc_latch_destroy(&as.done);

        /* Tensor bins and rows. */
        int64_t shape[2] = {8, 4};
        assert_int_equal(ts_tensor_bin_create(c, rows, TS_FLOAT32, 2, shape, NULL), 0);
        int64_t rshape[2] = {2, 4};
        float rv[8] = {1, 2, 3, 4, 5, 6, 7, 8};
        ts_value_t *r2 = ts_tensor_new(TS_FLOAT32, 2, rshape, rv, TS_COPY);
        assert_int_equal(ts_rows_write(c, rows, 3, r2, NULL), 0);
        ts_value_free(r2);
        assert_int_equal(ts_rows_read(c, rows, -1, NULL, 3, 5, &items), 0);
        ts_items_free(items);
        assert_on_shard(rows, s);

        /* Streams. */
        ts_stream_config_t scfg;
        ts_stream_config_init(&scfg);
        assert_int_equal(ts_stream_create(c, st, &scfg, NULL), 0);
        it = tc_item(2, 0, 5);
        assert_int_equal(ts_stream_append(c, st, it, NULL), 0);
        ts_value_free(it);
        assert_int_equal(ts_stream_join(c, st, "g", "m", TS_STREAM_OLDEST, 0, NULL), 0);
        ts_stream_batch_t *batch = NULL;
        assert_int_equal(ts_stream_read(c, st, "g", "m", 0, 4, 1000, &batch), 0);
        assert_int_equal(ts_stream_batch_count(batch), 1);
        ts_stream_batch_free(batch);
        assert_info_on(st, s, 0);

        /* Coordination: counters, PUT_IF, TAKE, a barrier of one. */
        int64_t value = 0;
        uint64_t cver = 0;
        assert_int_equal(ts_add(c, ctr, 5, &value, &cver), 0);
        assert_int_equal(ts_add(c, ctr, 2, &value, &cver), 0);
        assert_int_equal(value, 7);
        assert_on_shard(ctr, s);
        it = tc_item(1, 0, 9);
        uint64_t pv = 0;
        assert_int_equal(ts_put_if(c, putif, 0, it, &pv), 0);
        assert_int_equal(ts_put_if(c, putif, 0, it, &pv), TS_ECONFLICT);
        ts_value_free(it);
        assert_on_shard(putif, s);
        assert_int_equal(ts_take(c, putif, 0, 0, &items), 0);
        assert_int_equal(ts_items_count(items), 1);
        ts_items_free(items);
        uint64_t gen = 0;
        assert_int_equal(ts_barrier(c, bar, 1, 1000, &gen), 0);
        assert_int_equal(gen, 1);

        /* Replay tables. */
        ts_table_config_t tcfg;
        ts_table_config_init(&tcfg);
        assert_int_equal(ts_table_create(c, tb, &tcfg, NULL), 0);
        it = tc_item(2, 0, 4);
        assert_int_equal(ts_table_insert(c, tb, it, 1.0, 1000, NULL), 0);
        ts_value_free(it);
        ts_table_sample_t *sample = NULL;
        assert_int_equal(ts_table_sample(c, tb, 1, 1000, &sample), 0);
        assert_int_equal(ts_table_sample_count(sample), 1);
        ts_table_sample_free(sample);
        assert_info_on(tb, s, 1);
        tc_latch_destroy(&ls.done);
    }

    /* MGET across the shards, answered in the order of the names. */
    char names[6][64];
    const char *ptrs[6];
    for (int k = 0; k < 6; k++) {
        tsc_name_for(names[k], sizeof(names[k]), "mget", k, (k * 2) % N, N);
        ptrs[k] = names[k];
        if (k != 4) /* one missing bin */
            put_tag(c, names[k], 100 + k, NULL);
    }
    ts_items_t *res[6];
    assert_int_equal(ts_mget(c, ptrs, 6, 0, res), 0);
    for (int k = 0; k < 6; k++) {
        if (k == 4) {
            assert_null(res[k]);
            continue;
        }
        assert_non_null(res[k]);
        assert_int_equal(tc_tag(ts_items_at(res[k], 0)), 100 + k);
        ts_items_free(res[k]);
    }
    ts_client_free(c);
}

/* ---------------------------------------------------------------------------------------------
 * Fan-outs
 */

static void test_list_and_stats_merged(void **state)
{
    (void)state;
    ts_client_t *c = open_list(cc.list);
    char names[N][64];
    for (int s = 0; s < N; s++) {
        tsc_name_for(names[s], sizeof(names[s]), "merged", 0, s, N);
        put_tag(c, names[s], s, NULL);
    }
    ts_bin_list_t *l = NULL;
    assert_int_equal(ts_list(c, &l), 0);
    size_t total = 0;
    for (int i = 0; i < N; i++) {
        ts_bin_list_t *one = NULL;
        assert_int_equal(ts_list(plain[i], &one), 0);
        total += one->count;
        ts_bin_list_free(one);
    }
    assert_int_equal(l->count, total);
    int found = 0;
    for (size_t k = 0; k < l->count; k++) {
        if (k > 0)
            assert_true(strcmp(l->bins[k - 1].name, l->bins[k].name) < 0);
        for (int s = 0; s < N; s++)
            found += strcmp(l->bins[k].name, names[s]) == 0;
    }
    assert_int_equal(found, N);
    ts_bin_list_free(l);

    ts_value_t *st = NULL;
    assert_int_equal(ts_stats(c, &st), 0);
    const ts_value_t *shards = ts_map_get(st, "shards");
    assert_non_null(shards);
    assert_int_equal(ts_value_len(shards), N);
    int64_t down = -1, bins = -1, sum = 0;
    assert_int_equal(ts_map_get_int(st, "shards_down", &down), 0);
    assert_int_equal(down, 0);
    assert_int_equal(ts_map_get_int(st, "bins", &bins), 0);
    for (int i = 0; i < N; i++) {
        int64_t b = 0;
        assert_int_equal(ts_map_get_int(ts_list_at(shards, (size_t)i), "bins", &b), 0);
        sum += b;
    }
    assert_int_equal(bins, sum);
    /*
     * Only counters and gauges that add up are summed (docs/CLUSTER.md lists them); limits,
     * identities, flags and times are the first shard's.
     */
    static const char *const summed[] = {"ops_stats", "ops_list", "items", "bytes_sent"};
    static const char *const first[] = {"server_id", "version",    "shard",        "map_epoch",
                                        "max_frame", "max_memory", "last_save_ok", "uptime_ms"};
    for (size_t k = 0; k < TS__ARRAY_SIZE(summed); k++) {
        int64_t all = -1, added = 0;
        assert_int_equal(ts_map_get_int(st, summed[k], &all), 0);
        for (int i = 0; i < N; i++) {
            int64_t one = 0;
            assert_int_equal(ts_map_get_int(ts_list_at(shards, (size_t)i), summed[k], &one), 0);
            added += one;
        }
        if (all != added)
            fail_msg("%s: %lld, the shards sum to %lld", summed[k], (long long)all,
                     (long long)added);
    }
    for (size_t k = 0; k < TS__ARRAY_SIZE(first); k++) {
        int64_t all = -1, one = -2;
        assert_int_equal(ts_map_get_int(st, first[k], &all), 0);
        assert_int_equal(ts_map_get_int(ts_list_at(shards, 0), first[k], &one), 0);
        if (all != one)
            fail_msg("%s: %lld, the first shard's is %lld", first[k], (long long)all,
                     (long long)one);
    }
    int64_t maps = -1, epoch = -1;
    assert_int_equal(ts_map_get_int(st, "cluster_maps", &maps), 0);
    assert_int_equal(ts_map_get_int(st, "cluster_epoch", &epoch), 0);
    assert_true(maps >= 1); /* the daemons' map (epoch 1) replaced the list's (epoch 0) */
    assert_int_equal(epoch, 1);
    ts_value_free(st);

    /* The asynchronous forms merge the same way. */
    seen as;
    seen_init(&as);
    assert_int_equal(ts_list_async(c, result_cb, &as), 0);
    assert_int_equal(ts_ping_async(c, result_cb, &as), 0);
    assert_int_equal(tc_latch_wait(&as.done, 2, TC_WAIT_MS), 2);
    assert_int_equal(atomic_load(&as.status), 0);
    assert_ptr_equal(atomic_load(&as.client), c);
    tc_latch_destroy(&as.done);
    assert_int_equal(ts_ping(c), 0);
    assert_int_equal(ts_client_connected(c), 1);
    ts_client_free(c);
}

/* ---------------------------------------------------------------------------------------------
 * Stale maps
 */

static int64_t redirects(ts_client_t *c)
{
    ts_value_t *st = NULL;
    assert_int_equal(ts_stats(c, &st), 0);
    int64_t r = -1;
    assert_int_equal(ts_map_get_int(st, "cluster_redirects", &r), 0);
    ts_value_free(st);
    return r;
}

static void check_round(ts_client_t *c, const char *prefix, int put)
{
    for (int s = 0; s < N; s++) {
        for (int k = 0; k < 3; k++) {
            char name[64];
            tsc_name_for(name, sizeof(name), prefix, k, s, N);
            if (put)
                put_tag(c, name, s * 10 + k, NULL);
            assert_int_equal(get_tag(c, name), s * 10 + k);
        }
    }
}

static void test_stale_map_redirects_and_learns(void **state)
{
    (void)state;
    /*
     * A map file in the wrong order with an epoch above the daemons' own: the client keeps it
     * (a newer epoch wins), so every misplaced name is answered WRONG_SHARD and redirected.
     */
    const int order[N] = {2, 0, 1};
    char path[512];
    snprintf(path, sizeof(path), "%s/stale.map", cc.srv[0].dir);
    assert_int_equal(tsc_write_map(&cc, path, 9, order), 0);
    char addr[600];
    snprintf(addr, sizeof(addr), "cluster:%s", path);
    ts_client_t *c = open_list(addr);
    int64_t before = redirects(c);
    check_round(c, "stale", 1);
    int64_t after = redirects(c);
    assert_true(after > before);
    for (int s = 0; s < N; s++) {
        char name[64];
        tsc_name_for(name, sizeof(name), "stale", 0, s, N);
        assert_on_shard(name, s);
    }
    /* Learned: the same names go straight to their owners now. */
    check_round(c, "stale", 0);
    assert_int_equal(redirects(c), after);

    /* The asynchronous path redirects too, sending the caller's retained memory again. */
    char name[64];
    tsc_name_for(name, sizeof(name), "stale-async", 0, 1, N);
    float data[4] = {1, 2, 3, 4};
    int64_t n4 = 4;
    ts_value_t *t = ts_tensor_new(TS_FLOAT32, 1, &n4, data, TS_BORROW);
    seen as;
    seen_init(&as);
    assert_int_equal(ts_put_async(c, name, t, 0, result_cb, &as), 0);
    assert_int_equal(tc_latch_wait(&as.done, 1, TC_WAIT_MS), 1);
    assert_int_equal(atomic_load(&as.status), 0);
    assert_ptr_equal(atomic_load(&as.client), c);
    ts_value_free(t);
    tc_latch_destroy(&as.done);
    assert_on_shard(name, 1);
    ts_client_free(c);

    /* A list in the wrong order (epoch 0): the daemons' maps replace it at open. */
    char list[TSC_LIST_MAX];
    assert_int_equal(tsc_list(&cc, order, list, sizeof(list)), 0);
    c = open_list(list);
    check_round(c, "wrong-order", 1);
    for (int s = 0; s < N; s++) {
        tsc_name_for(name, sizeof(name), "wrong-order", 1, s, N);
        assert_on_shard(name, s);
    }
    ts_client_free(c);

    /* A map file in the right order. */
    snprintf(path, sizeof(path), "%s/good.map", cc.srv[0].dir);
    assert_int_equal(tsc_write_map(&cc, path, 1, NULL), 0);
    snprintf(addr, sizeof(addr), "cluster:%s", path);
    c = open_list(addr);
    check_round(c, "mapfile", 1);
    assert_int_equal(redirects(c), 0);
    ts_client_free(c);

    /* A map file of unix: lines (docs/PROTOCOL.md 14.2). */
    snprintf(path, sizeof(path), "%s/unix.map", cc.srv[0].dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    for (int s = 0; s < N; s++)
        fprintf(f, "%s\n", cc.srv[s].unix_addr);
    fclose(f);
    snprintf(addr, sizeof(addr), "cluster:%s", path);
    c = open_list(addr);
    check_round(c, "unixmap", 1);
    for (int s = 0; s < N; s++) {
        tsc_name_for(name, sizeof(name), "unixmap", 0, s, N);
        assert_on_shard(name, s);
    }
    assert_int_equal(redirects(c), 0);
    ts_client_free(c);
    unlink(path);
}

/* A slot ping-ponged between two daemons with contradictory maps ends after 3 redirects. */
static void test_redirects_counted_exactly(void **state)
{
    (void)state;
    tsc_cluster pp;
    assert_int_equal(tsc_start(&pp, 2, NULL), 0);
    /*
     * Each daemon's map gives it the lower slots and the upper ones to the other: a name in
     * the upper slots is answered WRONG_SHARD by both, back and forth.
     */
    char maps[2][512];
    unsigned split = (unsigned)ts__slot_split_first(1, 2);
    for (int i = 0; i < 2; i++) {
        snprintf(maps[i], sizeof(maps[i]), "%s/pingpong.map", pp.srv[i].dir);
        FILE *f = fopen(maps[i], "w");
        assert_non_null(f);
        fprintf(f, "epoch 2\n%s %u-%u\n%s %u-%u\n", pp.srv[0].addr, i == 0 ? 0 : split,
                i == 0 ? split - 1 : TS_SLOTS - 1, pp.srv[1].addr, i == 0 ? split : 0,
                i == 0 ? TS_SLOTS - 1 : split - 1);
        assert_int_equal(fclose(f), 0);
        tsc_kill(&pp, i);
        const char *extra[] = {"--cluster-map", maps[i], NULL};
        assert_int_equal(tsc_restart(&pp, i, extra), 0);
    }
    ts_client_t *c = open_list(pp.list);
    char name[64];
    tsc_name_for(name, sizeof(name), "pingpong", 0, 1, 2);
    /*
     * Every WRONG_SHARD answer counts, the one that ends the request included: the first
     * answer and 3 redirects' answers, 4 in all, as the daemons' wrong_shard counters say.
     */
    int64_t before = redirects(c);
    ts_value_t *it = tc_item(1, 0, 0);
    assert_int_equal(ts_put(c, name, it, NULL), TS_EWRONGSHARD);
    assert_int_equal(redirects(c) - before, 4);
    before = redirects(c);
    seen as;
    seen_init(&as);
    assert_int_equal(ts_put_async(c, name, it, TS_COPY, result_cb, &as), 0);
    assert_int_equal(tc_latch_wait(&as.done, 1, TC_WAIT_MS), 1);
    assert_int_equal(atomic_load(&as.status), TS_EWRONGSHARD);
    tc_latch_destroy(&as.done);
    assert_int_equal(redirects(c) - before, 4);
    ts_value_free(it);
    int64_t answered = 0;
    for (int i = 0; i < 2; i++) {
        ts_value_t *st = NULL;
        ts_client_t *one = NULL;
        assert_int_equal(ts_client_open(&one, pp.srv[i].addr, NULL), 0);
        assert_int_equal(ts_stats(one, &st), 0);
        int64_t w = 0;
        assert_int_equal(ts_map_get_int(st, "wrong_shard", &w), 0);
        answered += w;
        ts_value_free(st);
        ts_client_free(one);
    }
    assert_int_equal(answered, redirects(c));
    ts_client_free(c);
    tsc_stop(&pp);
}

static void test_bad_addresses(void **state)
{
    (void)state;
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, "127.0.0.1:1,,127.0.0.1:2", NULL), TS_EINVAL);
    /* A list entry that is no address is TS_EINVAL, naming it, before anything connects. */
    static const char *const bad[] = {"[x,y]:1", "[127.0.0.1:1,127.0.0.1:2]:8000",
                                      "127.0.0.1:1,http://127.0.0.1:2", "127.0.0.1:1,nohost"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int rc = ts_client_open(&c, bad[i], NULL);
        if (rc != TS_EINVAL)
            fail_msg("'%s': %s (%s), expected TS_EINVAL", bad[i], ts_err_name(rc), ts_last_error());
        assert_non_null(strstr(ts_last_error(), "malformed address"));
        assert_non_null(strstr(ts_last_error(), bad[i]));
    }
    assert_int_equal(ts_client_open(&c, "cluster:/nonexistent/map", NULL), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "/nonexistent/map"));
    /* An address twice (with or without "tcp://") is refused, naming both shards. */
    char dup[256];
    snprintf(dup, sizeof(dup), "%s,%s", cc.srv[0].addr, cc.srv[0].addr);
    assert_int_equal(ts_client_open(&c, dup, NULL), TS_EINVAL);
    char want[256];
    snprintf(want, sizeof(want), "shard 1's address '%s' is also shard 0's ('%s')", cc.srv[0].addr,
             cc.srv[0].addr);
    assert_non_null(strstr(ts_last_error(), want));
    snprintf(dup, sizeof(dup), "%s,%s,tcp://%s", cc.srv[0].addr, cc.srv[1].addr, cc.srv[0].addr);
    assert_int_equal(ts_client_open(&c, dup, NULL), TS_EINVAL);
    snprintf(want, sizeof(want), "shard 2's address 'tcp://%s' is also shard 0's ('%s')",
             cc.srv[0].addr, cc.srv[0].addr);
    assert_non_null(strstr(ts_last_error(), want));
    assert_non_null(strstr(ts_last_error(), dup));
    /* So is a map file's: lines that differ only in "tcp://" name one daemon. */
    char path[400], addr[420];
    snprintf(path, sizeof(path), "%s/dup.map", cc.srv[0].dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "%s\n%s\ntcp://%s\n", cc.srv[0].addr, cc.srv[1].addr, cc.srv[1].addr);
    fclose(f);
    snprintf(addr, sizeof(addr), "cluster:%s", path);
    int dup_rc = ts_client_open(&c, addr, NULL);
    unlink(path);
    assert_int_equal(dup_rc, TS_EINVAL);
    snprintf(want, sizeof(want), "line 3: address tcp://%s is also on line 2", cc.srv[1].addr);
    if (strstr(ts_last_error(), want) == NULL)
        print_error("message: %s\n", ts_last_error());
    assert_non_null(strstr(ts_last_error(), want));
    /* No shard answers: the open fails as a single client's does. */
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.connect_timeout_ms = 1000;
    int rc = ts_client_open(&c, "127.0.0.1:1,127.0.0.1:2", &o);
    assert_true(rc < 0);
    assert_non_null(strstr(ts_last_error(), "127.0.0.1:2"));
}

/* ---------------------------------------------------------------------------------------------
 * A shard down and back
 */

static void test_shard_down_and_back(void **state)
{
    (void)state;
    ts_client_t *c = open_list(cc.list);
    char lost[64], kept0[64], kept2[64];
    tsc_name_for(lost, sizeof(lost), "down", 0, 1, N);
    tsc_name_for(kept0, sizeof(kept0), "down", 0, 0, N);
    tsc_name_for(kept2, sizeof(kept2), "down", 0, 2, N);
    uint64_t v_before = 0;
    put_tag(c, lost, 1, &v_before);
    seen ls;
    seen_init(&ls);
    assert_int_equal(ts_listen(c, lost, notify_cb, &ls), 0);

    tsc_kill(&cc, 1);
    /* Bounded: the client notices the loss at once (the socket closes). */
    int rc = 0;
    for (int i = 0; i < 200; i++) {
        ts_value_t *it = tc_item(1, 0, 0);
        rc = ts_put(c, lost, it, NULL);
        ts_value_free(it);
        if (rc == TS_ENOTCONN)
            break;
        tc_sleep_ms(10);
    }
    assert_int_equal(rc, TS_ENOTCONN);
    assert_non_null(strstr(ts_last_error(), cc.srv[1].addr));
    assert_true(atomic_load(&ls.events[1]) >= 1); /* DISCONNECTED */
    for (int i = 0; i < 20; i++) {
        uint64_t t0 = tc_now_ms();
        ts_value_t *it = tc_item(1, 0, 0);
        assert_int_equal(ts_put(c, lost, it, NULL), TS_ENOTCONN);
        ts_items_t *items = NULL;
        assert_int_equal(ts_get(c, lost, 0, &items), TS_ENOTCONN);
        seen as;
        seen_init(&as);
        assert_int_equal(ts_put_async(c, lost, it, TS_COPY, result_cb, &as), 0);
        assert_int_equal(tc_latch_wait(&as.done, 1, TC_WAIT_MS), 1);
        assert_int_equal(atomic_load(&as.status), TS_ENOTCONN);
        tc_latch_destroy(&as.done);
        ts_value_free(it);
        assert_true(tc_now_ms() - t0 < FAIL_FAST_MS);
        /* The other shards keep working. */
        put_tag(c, kept0, i, NULL);
        put_tag(c, kept2, i, NULL);
    }
    assert_int_equal(ts_client_connected(c), 0);
    ts_bin_list_t *l = NULL;
    assert_int_equal(ts_list(c, &l), TS_ENOTCONN);
    ts_value_t *st = NULL;
    assert_int_equal(ts_stats(c, &st), 0);
    int64_t down = 0;
    assert_int_equal(ts_map_get_int(st, "shards_down", &down), 0);
    assert_int_equal(down, 1);
    ts_value_free(st);

    /* Back on the same port: the shard's bins work again, the listener is resubscribed. */
    assert_int_equal(tsc_restart(&cc, 1, NULL), 0);
    rc = -1;
    for (int i = 0; i < 500 && rc != 0; i++) {
        ts_value_t *it = tc_item(1, 0, 0);
        rc = ts_put(c, kept0, it, NULL) == 0 ? ts_ping(c) : -1;
        ts_value_free(it);
        if (rc != 0)
            tc_sleep_ms(20);
    }
    assert_int_equal(rc, 0);
    for (int i = 0; i < 500 && atomic_load(&ls.events[2]) == 0; i++)
        tc_sleep_ms(10);
    assert_true(atomic_load(&ls.events[2]) >= 1); /* RESUBSCRIBED */
    long puts = atomic_load(&ls.events[0]);
    uint64_t v_after = 0;
    put_tag(c, lost, 42, &v_after);
    /* Versions are clock-based: a restarted shard's versions are above the old ones. */
    assert_true(v_after > v_before);
    for (int i = 0; i < 500 && atomic_load(&ls.events[0]) == puts; i++)
        tc_sleep_ms(10);
    assert_true(atomic_load(&ls.events[0]) > puts);
    assert_int_equal(atomic_load(&ls.version), v_after);
    assert_int_equal(get_tag(c, lost), 42);
    assert_on_shard(lost, 1);
    assert_int_equal(ts_client_connected(c), 1);
    ts_client_free(c);
    tc_latch_destroy(&ls.done);
    /* The plain client of shard 1 reconnects too. */
    for (int i = 0; i < 500 && ts_ping(plain[1]) != 0; i++)
        tc_sleep_ms(10);
}

/*
 * A shard that is down is named by its index in the map, as STATS names it, not by its place in
 * the list given to ts_client_open.
 */
static void test_down_shard_named_by_index(void **state)
{
    (void)state;
    const int order[N] = {2, 0, 1};
    char list[TSC_LIST_MAX];
    assert_int_equal(tsc_list(&cc, order, list, sizeof(list)), 0);
    ts_client_t *c = open_list(list);
    char lost[64];
    tsc_name_for(lost, sizeof(lost), "index", 0, 1, N);
    put_tag(c, lost, 1, NULL);
    tsc_kill(&cc, 1); /* third in the list, shard 1 in the map */
    int rc = 0;
    for (int i = 0; i < 200 && rc != TS_ENOTCONN; i++) {
        ts_value_t *it = tc_item(1, 0, 0);
        rc = ts_put(c, lost, it, NULL);
        ts_value_free(it);
        if (rc != TS_ENOTCONN)
            tc_sleep_ms(10);
    }
    assert_int_equal(rc, TS_ENOTCONN);
    char want[128];
    snprintf(want, sizeof(want), "shard 1 (%s) is down", cc.srv[1].addr);
    if (strstr(ts_last_error(), want) == NULL)
        fail_msg("'%s' does not say '%s'", ts_last_error(), want);
    ts_value_t *st = NULL;
    assert_int_equal(ts_stats(c, &st), 0);
    const ts_value_t *shards = ts_map_get(st, "shards");
    assert_non_null(shards);
    int found = 0;
    for (size_t k = 0; k < ts_value_len(shards); k++) {
        const ts_value_t *one = ts_list_at(shards, k);
        const char *a = NULL;
        size_t alen = 0;
        int64_t index = -1;
        assert_int_equal(ts_value_string(ts_map_get(one, "address"), &a, &alen), 0);
        assert_int_equal(ts_map_get_int(one, "shard", &index), 0);
        if (alen == strlen(cc.srv[1].addr) && memcmp(a, cc.srv[1].addr, alen) == 0) {
            assert_int_equal(index, 1);
            found = 1;
        }
    }
    assert_true(found);
    ts_value_free(st);
    ts_client_free(c);
    assert_int_equal(tsc_restart(&cc, 1, NULL), 0);
    for (int i = 0; i < 500 && ts_ping(plain[1]) != 0; i++)
        tc_sleep_ms(10);
}

/*
 * A shard that accepts TCP but never answers: ts_client_open waits for its first attempt to end
 * (the connect timeout), succeeds with the others, and the silent shard is down from then on.
 */
static void test_open_waits_for_a_silent_shard(void **state)
{
    (void)state;
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(lfd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof(a);
    assert_int_equal(bind(lfd, (struct sockaddr *)&a, sizeof(a)), 0);
    assert_int_equal(listen(lfd, 16), 0); /* the kernel completes connections; nobody reads */
    assert_int_equal(getsockname(lfd, (struct sockaddr *)&a, &alen), 0);
    char list[256];
    snprintf(list, sizeof(list), "%s,%s,127.0.0.1:%d", cc.srv[0].addr, cc.srv[1].addr,
             ntohs(a.sin_port));
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.connect_timeout_ms = 1000;
    ts_client_t *c = NULL;
    uint64_t t0 = tc_now_ms();
    int rc = ts_client_open(&c, list, &o);
    uint64_t open_ms = tc_now_ms() - t0;
    printf("open with a silent shard: %s in %llu ms\n", ts_err_name(rc),
           (unsigned long long)open_ms);
    char silent[64];
    tsc_name_for(silent, sizeof(silent), "silent", 0, 2, N);
    ts_value_t *it = tc_item(1, 0, 0);
    t0 = tc_now_ms();
    int put_rc = rc == 0 ? ts_put(c, silent, it, NULL) : rc;
    uint64_t put_ms = tc_now_ms() - t0;
    int timed_out = strstr(ts_last_error(), "connect timed out") != NULL;
    ts_value_free(it);
    ts_client_free(c);
    close(lfd);
    assert_int_equal(rc, 0);
    assert_true(open_ms >= 900 && open_ms < 3000);
    assert_int_equal(put_rc, TS_ENOTCONN);
    assert_true(put_ms < FAIL_FAST_MS);
    assert_true(timed_out);
}

static void test_open_with_a_shard_down(void **state)
{
    (void)state;
    tsc_kill(&cc, 2);
    ts_client_t *c = open_list(cc.list);
    char lost[64], kept[64];
    tsc_name_for(lost, sizeof(lost), "opendown", 0, 2, N);
    tsc_name_for(kept, sizeof(kept), "opendown", 0, 0, N);
    put_tag(c, kept, 1, NULL);
    ts_value_t *it = tc_item(1, 0, 0);
    uint64_t t0 = tc_now_ms();
    assert_int_equal(ts_put(c, lost, it, NULL), TS_ENOTCONN);
    assert_true(tc_now_ms() - t0 < FAIL_FAST_MS);
    ts_value_free(it);
    assert_int_equal(tsc_restart(&cc, 2, NULL), 0);
    int rc = -1;
    for (int i = 0; i < 500 && rc != 0; i++) {
        it = tc_item(1, 0, 3);
        rc = ts_put(c, lost, it, NULL);
        ts_value_free(it);
        if (rc != 0)
            tc_sleep_ms(20);
    }
    assert_int_equal(rc, 0);
    assert_on_shard(lost, 2);
    ts_client_free(c);
    for (int i = 0; i < 500 && ts_ping(plain[2]) != 0; i++)
        tc_sleep_ms(10);
}

/* ts_client_free from a callback frees every shard client once the callback returns. */
static void free_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)status;
    (void)res;
    ts_client_free(c);
    tc_latch_add(arg, 1);
}

static void test_free_from_callback(void **state)
{
    (void)state;
    ts_client_t *c = open_list(cc.list);
    tc_latch l;
    tc_latch_init(&l);
    char name[64];
    tsc_name_for(name, sizeof(name), "free", 0, 1, N);
    assert_int_equal(ts_get_async(c, name, 0, free_cb, &l), 0);
    assert_int_equal(tc_latch_wait(&l, 1, TC_WAIT_MS), 1);
    tc_sleep_ms(100); /* the shard's thread frees the cluster after the callback */
    tc_latch_destroy(&l);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bins_land_on_their_shard),
        cmocka_unit_test(test_every_named_call_routes),
        cmocka_unit_test(test_list_and_stats_merged),
        cmocka_unit_test(test_stale_map_redirects_and_learns),
        cmocka_unit_test(test_redirects_counted_exactly),
        cmocka_unit_test(test_bad_addresses),
        cmocka_unit_test(test_shard_down_and_back),
        cmocka_unit_test(test_down_shard_named_by_index),
        cmocka_unit_test(test_open_waits_for_a_silent_shard),
        cmocka_unit_test(test_open_with_a_shard_down),
        cmocka_unit_test(test_free_from_callback),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
