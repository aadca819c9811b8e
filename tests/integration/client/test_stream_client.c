/*
 * The C client's streams against a real tensord (include/tensorshare/stream.h): fan-out groups
 * that each get every entry once and in order, late joiners (OLDEST replays the window, NEWEST
 * gets only what comes after), a member that comes back after a crash (its unacknowledged
 * entries first, flagged), credits holding the producer back (TS_EAGAIN, and a producer thread
 * released by a consumer's acknowledgement), a dead consumer that stops holding it back, a work
 * queue of two members whose abandoned entries the other claims, batches re-sliced to the
 * consumer's row count with exact resumption in the middle of an entry, markers as ends of
 * epochs, and bad input refused locally or by the server with nothing changed.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "harness.h"
#include "tensorshare/stream.h"
#include "test_client_util.h"

/* ms; how long a consumer waits for an entry that is on its way */
#define WAIT_MS 5000
/*
 * ms; the consumers' timeout where every entry they take is in the stream before they ask: it
 * bounds the checks that nothing more comes
 */
#define QUICK_MS 200
/* ms; the lease of the members that are meant to die */
#define SHORT_LEASE_MS 500
/* columns of the re-slicing tests' tensors */
#define COLS 2

static tsh_server srv;
static ts_client_t *cl;

static int group_setup(void **state)
{
    (void)state;
    if (tsh_server_start(&srv, NULL) != 0)
        return -1;
    return ts_client_open(&cl, srv.addr, NULL) == 0 ? 0 : -1;
}

static int group_teardown(void **state)
{
    (void)state;
    ts_client_free(cl);
    int rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    return rc == 0 ? 0 : -1;
}

/* A stream of max_entries with window (0: none). */
static void make_stream(const char *name, uint64_t max_entries, uint32_t window)
{
    ts_stream_config_t cfg;
    ts_stream_config_init(&cfg);
    cfg.max_entries = max_entries;
    cfg.window = window;
    ts_stream_state_t st;
    assert_int_equal(ts_stream_create(cl, name, &cfg, &st), 0);
    assert_int_equal(st.window, window);
}

/* Append tc_item(1, tag, tag); returns its id. */
static uint64_t push_tag(const char *name, int64_t tag)
{
    ts_value_t *it = tc_item(1, (float)tag, tag);
    ts_stream_append_t res;
    assert_int_equal(ts_stream_append(cl, name, it, &res), 0);
    ts_value_free(it);
    return res.id;
}

static ts_stream_consumer_t *consumer(const char *name, const char *group, const char *member,
                                      ts_stream_start_t start, uint32_t prefetch,
                                      uint32_t batch_rows, int timeout_ms)
{
    ts_stream_consumer_options_t o;
    ts_stream_consumer_options_init(&o);
    o.start = start;
    o.prefetch = prefetch;
    o.batch_rows = batch_rows;
    o.timeout_ms = timeout_ms;
    ts_stream_consumer_t *s = NULL;
    assert_int_equal(ts_stream_consumer_open(&s, cl, name, group, member, &o), 0);
    return s;
}

/* The next entry of s must be the item tagged tag. */
static void expect_tag(ts_stream_consumer_t *s, int64_t tag)
{
    ts_value_t *v = NULL;
    ts_stream_item_t info;
    int rc = ts_stream_consumer_next(s, &v, &info);
    if (rc != 0)
        fprintf(stderr, "next: %s (%s)\n", ts_strerror(rc), ts_last_error());
    assert_int_equal(rc, 0);
    assert_int_equal(info.end_of_epoch, 0);
    assert_int_equal(tc_tag(v), tag);
    assert_true(tc_check_vec(v, 1, (float)tag));
    ts_value_free(v);
}

/* s has nothing more right now. */
static void expect_nothing(ts_stream_consumer_t *s)
{
    ts_value_t *v = NULL;
    assert_int_equal(ts_stream_consumer_next(s, &v, NULL), TS_ETIMEDOUT);
    assert_null(v);
}

/* Four fan-out groups (one consumer each) get every entry exactly once, in order. */
static void test_fanout(void **state)
{
    (void)state;
    const char *name = "st/fan";
    make_stream(name, 64, 0);
    const uint32_t prefetch[4] = {1, 3, 4, 16};
    ts_stream_consumer_t *s[4];
    char group[16];
    for (int k = 0; k < 4; k++) {
        snprintf(group, sizeof(group), "c%d", k);
        s[k] = consumer(name, group, "m", TS_STREAM_OLDEST, prefetch[k], 0, QUICK_MS);
    }
    for (int i = 1; i <= 20; i++)
        assert_int_equal(push_tag(name, i), (uint64_t)i);
    /* Interleaved, so that the groups' reads and acknowledgements mix. */
    for (int i = 1; i <= 20; i++)
        for (int k = 0; k < 4; k++)
            expect_tag(s[k], i);
    for (int k = 0; k < 4; k++) {
        expect_nothing(s[k]);
        ts_stream_consumer_close(s[k], 0);
    }
    /* Every group acknowledged everything: the floors are past the last entry. */
    ts_value_t *info = NULL;
    assert_int_equal(ts_stream_info(cl, name, &info), 0);
    int64_t last = 0;
    assert_int_equal(ts_map_get_int(info, "last_id", &last), 0);
    assert_int_equal(last, 20);
    const ts_value_t *groups = ts_map_get(info, "groups");
    assert_int_equal(ts_value_len(groups), 4);
    for (size_t k = 0; k < 4; k++) {
        int64_t floor = 0, pending = -1;
        assert_int_equal(ts_map_get_int(ts_list_at(groups, k), "floor", &floor), 0);
        assert_int_equal(ts_map_get_int(ts_list_at(groups, k), "pending", &pending), 0);
        assert_int_equal(floor, 21);
        assert_int_equal(pending, 0);
    }
    ts_value_free(info);
}

/* A late joiner: OLDEST replays the kept window, NEWEST gets only what comes after it. */
static void test_late_joiner(void **state)
{
    (void)state;
    const char *name = "st/late";
    make_stream(name, 8, 0);
    for (int i = 1; i <= 12; i++)
        push_tag(name, i);
    ts_stream_consumer_t *old = consumer(name, "old", "m", TS_STREAM_OLDEST, 4, 0, QUICK_MS);
    ts_stream_consumer_t *neu = consumer(name, "new", "m", TS_STREAM_NEWEST, 4, 0, QUICK_MS);
    ts_stream_consumer_t *behind = consumer(name, "behind", "m", TS_STREAM_OLDEST, 4, 0, QUICK_MS);
    expect_nothing(neu);
    /* The window keeps the newest 8: 5..12. */
    for (int i = 5; i <= 12; i++)
        expect_tag(old, i);
    push_tag(name, 13);
    expect_tag(old, 13);
    expect_tag(neu, 13);
    expect_nothing(old);
    expect_nothing(neu);
    /* 13 pushed 5 out of the window before the group behind took it: it counts as lost. */
    ts_value_t *v = NULL;
    ts_stream_item_t info;
    assert_int_equal(ts_stream_consumer_next(behind, &v, &info), 0);
    assert_int_equal(tc_tag(v), 6);
    assert_int_equal(info.lost, 1);
    assert_int_equal(info.first_id, 6);
    ts_value_free(v);
    ts_stream_consumer_close(behind, 1);
    ts_stream_consumer_close(old, 1);
    ts_stream_consumer_close(neu, 1);
    /* A range sees the same window without a cursor. */
    ts_stream_batch_t *b = NULL;
    assert_int_equal(ts_stream_range(cl, name, 0, 100, 0, &b), 0);
    assert_int_equal(ts_stream_batch_count(b), 8);
    assert_int_equal(ts_stream_batch_id(b, 0), 6);
    assert_int_equal(ts_stream_batch_first_id(b), 6);
    assert_int_equal(ts_stream_batch_last_id(b), 13);
    assert_int_equal(ts_stream_batch_lost(b), 0);
    assert_int_equal(tc_tag(ts_stream_batch_value(b, 7)), 13);
    assert_int_equal(ts_stream_batch_deliveries(b, 0), 0);
    ts_stream_batch_free(b);
}

/*
 * A member that stops without acknowledging (a crash) and joins again gets what it had been
 * given first, flagged as redelivered, then what is new; the consumer helper resumes after its
 * last acknowledgement.
 */
static void test_resume(void **state)
{
    (void)state;
    const char *name = "st/resume";
    make_stream(name, 64, 0);
    for (int i = 1; i <= 8; i++)
        push_tag(name, i);
    ts_stream_join_t j;
    assert_int_equal(ts_stream_join(cl, name, "g", "m", TS_STREAM_OLDEST, 0, &j), 0);
    assert_int_equal(j.next_id, 1);
    assert_int_equal(j.pending, 0);
    ts_stream_batch_t *b = NULL;
    assert_int_equal(ts_stream_read(cl, name, "g", "m", 0, 5, 0, &b), 0);
    assert_int_equal(ts_stream_batch_count(b), 5);
    for (size_t i = 0; i < 5; i++) {
        assert_int_equal(ts_stream_batch_id(b, i), i + 1);
        assert_int_equal(ts_stream_batch_deliveries(b, i), 1);
        assert_int_equal(ts_stream_batch_redelivered(b, i), 0);
        assert_int_equal(ts_stream_batch_is_marker(b, i), 0);
    }
    ts_stream_batch_free(b);
    ts_stream_ack_t a;
    assert_int_equal(ts_stream_ack(cl, name, "g", "m", 1, 2, 0, &a), 0);
    assert_int_equal(a.acked, 2);
    assert_int_equal(a.floor, 3);
    assert_int_equal(a.pending, 3);
    /* The crash: join again. */
    assert_int_equal(ts_stream_join(cl, name, "g", "m", TS_STREAM_OLDEST, 0, &j), 0);
    assert_int_equal(j.pending, 3);
    assert_int_equal(j.floor, 3);
    assert_int_equal(ts_stream_read(cl, name, "g", "m", 0, 4, 0, &b), 0);
    assert_int_equal(ts_stream_batch_count(b), 4);
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(ts_stream_batch_id(b, i), i + 3);
        assert_int_equal(ts_stream_batch_redelivered(b, i), 1);
        assert_int_equal(ts_stream_batch_deliveries(b, i), 2);
    }
    assert_int_equal(ts_stream_batch_id(b, 3), 6);
    assert_int_equal(ts_stream_batch_redelivered(b, 3), 0);
    ts_stream_batch_free(b);
    /* Acknowledged 3..4 only; then the helper takes over as the same member. */
    assert_int_equal(ts_stream_ack(cl, name, "g", "m", 3, 4, 0, NULL), 0);
    ts_stream_consumer_t *s = consumer(name, "g", "m", TS_STREAM_OLDEST, 2, 0, QUICK_MS);
    expect_tag(s, 5);
    expect_tag(s, 6);
    expect_tag(s, 7);
    assert_int_equal(ts_stream_consumer_commit(s), 0);
    expect_tag(s, 8);
    /* A second helper as the same member (the restarted process) starts after the commit. */
    ts_stream_consumer_t *again = consumer(name, "g", "m", TS_STREAM_OLDEST, 2, 0, QUICK_MS);
    expect_tag(again, 8);
    expect_nothing(again);
    ts_stream_consumer_close(again, 0);
    ts_stream_consumer_close(s, 0);
    assert_int_equal(ts_stream_join(cl, name, "g", "m", TS_STREAM_OLDEST, 0, &j), 0);
    assert_int_equal(j.pending, 0);
    assert_int_equal(j.floor, 9);
}

typedef struct pusher {
    ts_stream_producer_t *p;
    int64_t tag;
    int rc;
    uint64_t id;
    tc_latch done;
} pusher;

static void *pusher_main(void *arg)
{
    pusher *w = arg;
    ts_value_t *it = tc_item(1, (float)w->tag, w->tag);
    w->rc = ts_stream_producer_push(w->p, it, &w->id);
    ts_value_free(it);
    tc_latch_add(&w->done, 1);
    return NULL;
}

/*
 * Credits: at the window an append is refused (TS_EAGAIN, nothing stored); a producer blocks
 * until a consumer on another thread acknowledges; block_ms 0 fails at once.
 */
static void test_credits(void **state)
{
    (void)state;
    const char *name = "st/credit";
    make_stream(name, 16, 4);
    ts_stream_consumer_t *s = consumer(name, "g", "m", TS_STREAM_OLDEST, 2, 0, WAIT_MS);
    for (int i = 1; i <= 4; i++)
        push_tag(name, i);
    ts_value_t *it = tc_item(1, 5.0f, 5);
    ts_stream_append_t res;
    assert_int_equal(ts_stream_append(cl, name, it, &res), TS_EAGAIN);
    assert_non_null(strstr(ts_last_error(), "is full"));
    ts_stream_state_t st;
    assert_int_equal(ts_stream_credit(cl, name, 0, &st), TS_ETIMEDOUT);
    assert_int_equal(st.credit, 0);
    assert_int_equal(st.last_id, 4);
    assert_int_equal(st.n_entries, 4);
    /* A mark always goes in. */
    ts_stream_append_t mk;
    assert_int_equal(ts_stream_mark(cl, name, 77, &mk), 0);
    assert_int_equal(mk.id, 5);
    ts_stream_producer_t *now = NULL;
    assert_int_equal(ts_stream_producer_open(&now, cl, name, NULL, 0), 0);
    assert_int_equal(ts_stream_producer_push(now, it, NULL), TS_EAGAIN);
    ts_stream_producer_free(now);
    ts_value_free(it);

    pusher w = {.tag = 6, .rc = 1};
    tc_latch_init(&w.done);
    assert_int_equal(ts_stream_producer_open(&w.p, cl, name, NULL, TC_WAIT_MS), 0);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, pusher_main, &w), 0);
    /* The push waits: nothing is acknowledged yet. */
    tc_sleep_ms(100);
    assert_int_equal(tc_latch_get(&w.done), 0);
    /*
     * The marker counts in the window too (lag 5 of 4): two entries handed out and committed
     * give one credit.
     */
    expect_tag(s, 1);
    expect_tag(s, 2);
    assert_int_equal(ts_stream_consumer_commit(s), 0);
    assert_int_equal(tc_latch_wait(&w.done, 1, TC_WAIT_MS), 1);
    pthread_join(th, NULL);
    assert_int_equal(w.rc, 0);
    assert_int_equal(w.id, 6);
    assert_true(ts_stream_producer_waits(w.p) >= 1);
    ts_stream_producer_free(w.p);
    tc_latch_destroy(&w.done);
    for (int i = 3; i <= 4; i++)
        expect_tag(s, i);
    ts_value_t *v = NULL;
    ts_stream_item_t info;
    assert_int_equal(ts_stream_consumer_next(s, &v, &info), 0);
    assert_null(v);
    assert_int_equal(info.end_of_epoch, 1);
    assert_int_equal(info.tag, 77);
    expect_tag(s, 6);
    ts_stream_consumer_close(s, 1);
}

/* A consumer that stops reading stops holding the producer back once its lease has passed. */
static void test_dead_consumer(void **state)
{
    (void)state;
    const char *name = "st/dead";
    make_stream(name, 16, 2);
    ts_stream_join_t j;
    assert_int_equal(ts_stream_join(cl, name, "g", "m", TS_STREAM_OLDEST, SHORT_LEASE_MS, &j), 0);
    push_tag(name, 1);
    push_tag(name, 2);
    ts_stream_batch_t *b = NULL;
    assert_int_equal(ts_stream_read(cl, name, "g", "m", 0, 2, 0, &b), 0);
    assert_int_equal(ts_stream_batch_count(b), 2);
    ts_stream_batch_free(b);
    ts_value_t *it = tc_item(1, 3.0f, 3);
    assert_int_equal(ts_stream_append(cl, name, it, NULL), TS_EAGAIN);
    /* The member is silent now: credit comes back when its lease ends. */
    ts_stream_state_t st;
    assert_int_equal(ts_stream_credit(cl, name, TC_WAIT_MS, &st), 0);
    assert_true(st.credit >= 1);
    assert_int_equal(st.n_stale, 1);
    ts_stream_append_t res;
    assert_int_equal(ts_stream_append(cl, name, it, &res), 0);
    assert_int_equal(res.id, 3);
    ts_value_free(it);
    /* It comes back: its entries are there for it, and it holds the producer back again. */
    assert_int_equal(ts_stream_read(cl, name, "g", "m", 0, 8, 0, &b), 0);
    assert_int_equal(ts_stream_batch_count(b), 1);
    assert_int_equal(ts_stream_batch_id(b, 0), 3);
    ts_stream_batch_free(b);
    /* A producer's push waits for the lease to pass again, then goes in. */
    ts_stream_producer_t *p = NULL;
    assert_int_equal(ts_stream_producer_open(&p, cl, name, NULL, TC_WAIT_MS), 0);
    it = tc_item(1, 4.0f, 4);
    uint64_t id = 0;
    assert_int_equal(ts_stream_producer_push(p, it, &id), 0);
    assert_int_equal(id, 4);
    assert_int_equal(ts_stream_producer_waits(p), 1);
    ts_value_free(it);
    ts_stream_producer_free(p);
    assert_int_equal(ts_stream_leave(cl, name, "g", NULL, &st), 0);
    assert_int_equal(st.n_groups, 0);
}

/*
 * A work queue of two members: each entry goes to exactly one; the entries of a member that
 * stops go to the other once its lease has passed.
 */
static void test_work_queue(void **state)
{
    (void)state;
    const char *name = "st/wq";
    make_stream(name, 64, 0);
    assert_int_equal(ts_stream_join(cl, name, "wq", "a", TS_STREAM_OLDEST, SHORT_LEASE_MS, NULL),
                     0);
    assert_int_equal(ts_stream_join(cl, name, "wq", "b", TS_STREAM_OLDEST, 0, NULL), 0);
    for (int i = 1; i <= 6; i++)
        push_tag(name, i);
    /* first[id]: deliveries to a first member; claimed[id]: to a second one. */
    int first[7] = {0}, claimed[7] = {0};
    ts_stream_batch_t *b = NULL;
    assert_int_equal(ts_stream_read(cl, name, "wq", "a", 0, 2, 0, &b), 0);
    assert_int_equal(ts_stream_batch_count(b), 2);
    for (size_t i = 0; i < 2; i++)
        first[ts_stream_batch_id(b, i)]++;
    assert_int_equal(ts_stream_ack(cl, name, "wq", "a", ts_stream_batch_id(b, 0),
                                   ts_stream_batch_id(b, 1), 0, NULL),
                     0);
    ts_stream_batch_free(b);
    assert_int_equal(ts_stream_read(cl, name, "wq", "b", 0, 2, 0, &b), 0);
    assert_int_equal(ts_stream_batch_count(b), 2);
    uint64_t b_ids[2];
    for (size_t i = 0; i < 2; i++) {
        b_ids[i] = ts_stream_batch_id(b, i);
        first[b_ids[i]]++;
    }
    ts_stream_batch_free(b);
    /*
     * b stops here. a takes the new entries and, once b's lease (the group's, set by a's join)
     * has passed, b's two.
     */
    uint64_t t0 = tc_now_ms();
    while (!(claimed[b_ids[0]] && claimed[b_ids[1]]) && tc_now_ms() - t0 < TC_WAIT_MS) {
        assert_int_equal(ts_stream_read(cl, name, "wq", "a", 0, 8, 100, &b), 0);
        for (size_t i = 0; i < ts_stream_batch_count(b); i++) {
            uint64_t id = ts_stream_batch_id(b, i);
            assert_true(id >= 1 && id <= 6);
            if (ts_stream_batch_deliveries(b, i) == 1) {
                assert_int_equal(ts_stream_batch_redelivered(b, i), 0);
                first[id]++;
            } else {
                assert_int_equal(ts_stream_batch_deliveries(b, i), 2);
                assert_int_equal(ts_stream_batch_redelivered(b, i), 1);
                claimed[id]++;
            }
        }
        ts_stream_batch_free(b);
    }
    for (int i = 1; i <= 6; i++) {
        assert_int_equal(first[i], 1);
        assert_int_equal(claimed[i], (uint64_t)i == b_ids[0] || (uint64_t)i == b_ids[1]);
    }
}

/*
 * The same through the consumer helper: two members share the entries; one that closes with an
 * entry read ahead and never handed out leaves it pending, and the other takes it after the
 * lease.
 */
static void test_work_queue_helpers(void **state)
{
    (void)state;
    const char *name = "st/wq2";
    make_stream(name, 64, 0);
    ts_stream_consumer_options_t o;
    ts_stream_consumer_options_init(&o);
    o.prefetch = 2;
    o.lease_ms = SHORT_LEASE_MS;
    o.timeout_ms = QUICK_MS;
    ts_stream_consumer_t *a = NULL, *b = NULL;
    assert_int_equal(ts_stream_consumer_open(&a, cl, name, "wq", "a", &o), 0);
    assert_int_equal(ts_stream_consumer_open(&b, cl, name, "wq", "b", &o), 0);
    for (int i = 1; i <= 9; i++)
        push_tag(name, i);
    int seen[10] = {0};
    ts_value_t *v = NULL;
    /* b takes one entry (and reads a second ahead), a takes everything else. */
    assert_int_equal(ts_stream_consumer_next(b, &v, NULL), 0);
    seen[tc_tag(v)]++;
    ts_value_free(v);
    ts_stream_consumer_close(b, 0);
    int from_a = 0;
    /* b's read-ahead entry comes to a once b's lease has passed: a retries until then. */
    uint64_t t0 = tc_now_ms();
    while (from_a < 8 && tc_now_ms() - t0 < TC_WAIT_MS) {
        int rc = ts_stream_consumer_next(a, &v, NULL);
        if (rc == TS_ETIMEDOUT)
            continue;
        assert_int_equal(rc, 0);
        int64_t tag = tc_tag(v);
        assert_true(tag >= 1 && tag <= 9);
        seen[tag]++;
        from_a++;
        ts_value_free(v);
    }
    assert_int_equal(from_a, 8);
    for (int i = 1; i <= 9; i++)
        assert_int_equal(seen[i], 1);
    expect_nothing(a);
    ts_stream_consumer_close(a, 1);
}

/* A root tensor re-sliced: int32 [3] entries in batches of 2. */
static void test_reslice_tensor(void **state)
{
    (void)state;
    const char *name = "st/slicetensor";
    make_stream(name, 64, 0);
    for (int e = 0; e < 3; e++) {
        int32_t d[3] = {3 * e, 3 * e + 1, 3 * e + 2};
        int64_t n = 3;
        ts_value_t *t = ts_tensor_new(TS_INT32, 1, &n, d, TS_BORROW);
        assert_int_equal(ts_stream_append(cl, name, t, NULL), 0);
        ts_value_free(t);
    }
    ts_stream_consumer_t *s = consumer(name, "g", "m", TS_STREAM_OLDEST, 2, 2, QUICK_MS);
    for (int32_t r = 0; r < 8; r += 2) {
        ts_value_t *v = NULL;
        ts_stream_item_t info;
        assert_int_equal(ts_stream_consumer_next(s, &v, &info), 0);
        const ts_tensor_t *t = ts_value_tensor(v);
        assert_non_null(t);
        assert_int_equal(t->shape[0], 2);
        assert_int_equal(((const int32_t *)t->data)[0], r);
        assert_int_equal(((const int32_t *)t->data)[1], r + 1);
        assert_int_equal(info.first_id, (uint64_t)(r / 3 + 1));
        assert_int_equal(info.last_id, (uint64_t)((r + 1) / 3 + 1));
        ts_value_free(v);
    }
    /* The last row waits for more (no marker): nothing is handed out yet. */
    expect_nothing(s);
    ts_stream_consumer_close(s, 1);
}

/*
 * A read whose answer never comes back (the server stopped past the client's request timeout)
 * may still have handed entries to the member: the consumer joins again before its next read,
 * so those entries come to it again instead of staying pending with nobody to see them.
 */
static void test_lost_read(void **state)
{
    (void)state;
    const char *name = "st/lostread";
    make_stream(name, 64, 0);
    for (int i = 1; i <= 6; i++)
        push_tag(name, i);
    ts_client_options_t co;
    ts_client_options_init(&co);
    co.request_timeout_ms = 200;
    ts_client_t *c2 = NULL;
    assert_int_equal(ts_client_open(&c2, srv.addr, &co), 0);
    ts_stream_consumer_options_t o;
    ts_stream_consumer_options_init(&o);
    o.prefetch = 2;
    o.timeout_ms = QUICK_MS;
    ts_stream_consumer_t *s = NULL;
    assert_int_equal(ts_stream_consumer_open(&s, c2, name, "g", "m", &o), 0);
    assert_int_equal(kill(srv.pid, SIGSTOP), 0);
    ts_value_t *v = NULL;
    int rc = ts_stream_consumer_next(s, &v, NULL);
    assert_int_equal(kill(srv.pid, SIGCONT), 0);
    assert_int_equal(rc, TS_ETIMEDOUT);
    /* The server answers the read now (to nobody): entries 1 and 2 are pending with m. */
    uint64_t t0 = tc_now_ms();
    for (;;) {
        rc = ts_stream_consumer_next(s, &v, NULL);
        if (rc != TS_ETIMEDOUT && rc != TS_ECONNRESET && rc != TS_ENOTCONN)
            break;
        assert_true(tc_now_ms() - t0 < TC_WAIT_MS);
    }
    assert_int_equal(rc, 0);
    assert_int_equal(tc_tag(v), 1);
    ts_value_free(v);
    for (int i = 2; i <= 6; i++) {
        assert_int_equal(ts_stream_consumer_next(s, &v, NULL), 0);
        assert_int_equal(tc_tag(v), i);
        ts_value_free(v);
    }
    ts_stream_consumer_close(s, 1);
    ts_client_free(c2);
}

/*
 * A producer against a server that does not answer (stopped) says so: opening one finds out
 * nothing about the stream (it took the unanswered look for "exists, full window"), and a push
 * that waits for credit ends with the client's "no reply" instead of blaming the window.
 */
static void test_producer_when_the_server_does_not_answer(void **state)
{
    (void)state;
    const char *name = "st/stalled";
    make_stream(name, 16, 2);
    ts_stream_consumer_t *s = consumer(name, "g", "m", TS_STREAM_OLDEST, 2, 0, WAIT_MS);
    push_tag(name, 1);
    push_tag(name, 2); /* the window is full: the group is 2 entries behind */
    ts_client_options_t co;
    ts_client_options_init(&co);
    co.request_timeout_ms = 300;
    ts_client_t *c2 = NULL;
    assert_int_equal(ts_client_open(&c2, srv.addr, &co), 0);
    ts_stream_producer_t *p = NULL;
    assert_int_equal(ts_stream_producer_open(&p, c2, name, NULL, 1000), 0);
    ts_stream_producer_t *p2 = NULL;
    ts_value_t *it = tc_item(1, 3.0f, 3);
    assert_int_equal(kill(srv.pid, SIGSTOP), 0);
    uint64_t t0 = tc_now_ms();
    int rc = ts_stream_producer_push(p, it, NULL);
    uint64_t took = tc_now_ms() - t0;
    char msg[TS_MAX_ERROR_LEN + 1];
    snprintf(msg, sizeof(msg), "%s", ts_last_error());
    int rc_open = ts_stream_producer_open(&p2, c2, name, NULL, 0);
    char msg_open[TS_MAX_ERROR_LEN + 1];
    snprintf(msg_open, sizeof(msg_open), "%s", ts_last_error());
    assert_int_equal(kill(srv.pid, SIGCONT), 0);
    assert_int_equal(rc, TS_ETIMEDOUT);
    assert_string_equal(msg, "no reply within the request timeout");
    assert_true(took < 300 + 300 + 250); /* one credit wait of 300 ms and its reply time */
    assert_int_equal(rc_open, TS_ETIMEDOUT);
    assert_null(p2);
    assert_string_equal(msg_open, "no reply within the request timeout");
    /* Answering again: the push's message is the window's. */
    assert_int_equal(ts_stream_producer_push(p, it, NULL), TS_ETIMEDOUT);
    assert_non_null(strstr(ts_last_error(), "had no credit within the producer's 1000 ms"));
    ts_value_free(it);
    ts_stream_producer_free(p);
    ts_stream_consumer_close(s, 1);
    ts_client_free(c2);
}

/* {"x": float32 [n, COLS] with row r = (first + r) * 10 + column, "k": 7}. */
static ts_value_t *rows_item(int64_t first, int64_t n)
{
    int64_t shape[2] = {n, COLS};
    ts_value_t *t = ts_tensor_alloc(TS_FLOAT32, 2, shape);
    float *d = ts_value_tensor(t)->data;
    for (int64_t r = 0; r < n; r++)
        for (int c = 0; c < COLS; c++)
            d[r * COLS + c] = (float)((first + r) * 10 + c);
    ts_value_t *m = ts_map_new();
    assert_int_equal(ts_map_set(m, "x", t), 0);
    assert_int_equal(ts_map_set(m, "k", ts_int_new(7)), 0);
    return m;
}

/* The next batch of s holds rows [first, first + n) of the producer's. */
static void expect_rows(ts_stream_consumer_t *s, int64_t first, int64_t n)
{
    ts_value_t *v = NULL;
    ts_stream_item_t info;
    int rc = ts_stream_consumer_next(s, &v, &info);
    if (rc != 0)
        fprintf(stderr, "next: %s (%s)\n", ts_strerror(rc), ts_last_error());
    assert_int_equal(rc, 0);
    assert_int_equal(info.end_of_epoch, 0);
    const ts_tensor_t *t = ts_map_get_tensor(v, "x");
    assert_non_null(t);
    assert_int_equal(t->ndim, 2);
    if (t->shape[0] != n)
        fprintf(stderr, "batch of %lld rows from row %lld, expected %lld\n", (long long)t->shape[0],
                (long long)(((const float *)t->data)[0] / 10), (long long)n);
    assert_int_equal(t->shape[0], n);
    assert_int_equal(t->shape[1], COLS);
    const float *d = t->data;
    for (int64_t r = 0; r < n; r++)
        for (int c = 0; c < COLS; c++)
            assert_true(d[r * COLS + c] == (float)((first + r) * 10 + c));
    int64_t k = 0;
    assert_int_equal(ts_map_get_int(v, "k", &k), 0);
    assert_int_equal(k, 7);
    ts_value_free(v);
}

static void expect_marker(ts_stream_consumer_t *s, uint64_t tag)
{
    ts_value_t *v = NULL;
    ts_stream_item_t info;
    assert_int_equal(ts_stream_consumer_next(s, &v, &info), 0);
    assert_null(v);
    assert_int_equal(info.end_of_epoch, 1);
    assert_int_equal(info.tag, tag);
}

/*
 * Producer batches of 3 rows (5 entries, a marker, 2 entries, a marker) read as batches of 4, 2
 * and 3 rows: exactly the producer's rows in order, a short batch before each marker.
 */
static void test_reslice(void **state)
{
    (void)state;
    const char *name = "st/slice";
    make_stream(name, 64, 0);
    ts_stream_producer_t *p = NULL;
    assert_int_equal(ts_stream_producer_open(&p, cl, name, NULL, TS_TIMEOUT_DEFAULT), 0);
    int64_t row = 0;
    for (int e = 0; e < 7; e++) {
        ts_value_t *v = rows_item(row, 3);
        assert_int_equal(ts_stream_producer_push(p, v, NULL), 0);
        ts_value_free(v);
        row += 3;
        if (e == 4)
            assert_int_equal(ts_stream_producer_end_epoch(p, 1, NULL), 0);
    }
    uint64_t id = 0;
    assert_int_equal(ts_stream_producer_end_epoch(p, 2, &id), 0);
    assert_int_equal(id, 9);
    assert_int_equal(ts_stream_producer_waits(p), 0);
    ts_stream_producer_free(p);

    /* 15 rows, then 6. */
    ts_stream_consumer_t *s4 = consumer(name, "b4", "m", TS_STREAM_OLDEST, 2, 4, QUICK_MS);
    expect_rows(s4, 0, 4);
    expect_rows(s4, 4, 4);
    expect_rows(s4, 8, 4);
    expect_rows(s4, 12, 3);
    expect_marker(s4, 1);
    expect_rows(s4, 15, 4);
    expect_rows(s4, 19, 2);
    expect_marker(s4, 2);
    expect_nothing(s4);
    ts_stream_consumer_close(s4, 1);

    ts_stream_consumer_t *s2 = consumer(name, "b2", "m", TS_STREAM_OLDEST, 3, 2, QUICK_MS);
    for (int64_t r = 0; r < 14; r += 2)
        expect_rows(s2, r, 2);
    expect_rows(s2, 14, 1);
    expect_marker(s2, 1);
    for (int64_t r = 15; r < 21; r += 2)
        expect_rows(s2, r, 2);
    expect_marker(s2, 2);
    expect_nothing(s2);
    ts_stream_consumer_close(s2, 1);

    /* The producer's own size: whole entries. */
    ts_stream_consumer_t *s3 = consumer(name, "b3", "m", TS_STREAM_OLDEST, 4, 3, QUICK_MS);
    for (int64_t r = 0; r < 15; r += 3)
        expect_rows(s3, r, 3);
    expect_marker(s3, 1);
    expect_rows(s3, 15, 3);
    expect_rows(s3, 18, 3);
    expect_marker(s3, 2);
    ts_stream_consumer_close(s3, 1);
}

/* A consumer that commits in the middle of an entry resumes at exactly the next row. */
static void test_reslice_resume(void **state)
{
    (void)state;
    const char *name = "st/sliceresume";
    make_stream(name, 64, 0);
    for (int e = 0; e < 4; e++) {
        ts_value_t *v = rows_item(3 * e, 3);
        assert_int_equal(ts_stream_append(cl, name, v, NULL), 0);
        ts_value_free(v);
    }
    ts_stream_consumer_t *s = consumer(name, "g", "m", TS_STREAM_OLDEST, 1, 2, QUICK_MS);
    expect_rows(s, 0, 2);
    expect_rows(s, 2, 2); /* entry 1's last row and entry 2's first */
    assert_int_equal(ts_stream_consumer_commit(s), 0);
    ts_stream_join_t j;
    assert_int_equal(ts_stream_join(cl, name, "g", "m", TS_STREAM_OLDEST, 0, &j), 0);
    assert_int_equal(j.floor, 2);
    assert_int_equal(j.rows_done, 1);
    ts_stream_consumer_close(s, 0);
    s = consumer(name, "g", "m", TS_STREAM_OLDEST, 1, 2, QUICK_MS);
    expect_rows(s, 4, 2); /* entry 2's rows 1 and 2 */
    expect_rows(s, 6, 2);
    expect_rows(s, 8, 2);
    expect_rows(s, 10, 2);
    expect_nothing(s);
    ts_stream_consumer_close(s, 0);
    /* The same with batches as produced (B = 0): the rest of a partly used entry. */
    assert_int_equal(ts_stream_join(cl, name, "h", "m", TS_STREAM_OLDEST, 0, NULL), 0);
    ts_stream_batch_t *b = NULL;
    assert_int_equal(ts_stream_read(cl, name, "h", "m", 0, 1, 0, &b), 0);
    ts_stream_batch_free(b);
    assert_int_equal(ts_stream_ack(cl, name, "h", "m", 1, 1, 2, NULL), 0);
    s = consumer(name, "h", "m", TS_STREAM_OLDEST, 4, 0, QUICK_MS);
    expect_rows(s, 2, 1);
    expect_rows(s, 3, 3);
    ts_stream_consumer_close(s, 1);
}

/* Entries that cannot be cut into rows, or whose tensors disagree, are refused with a reason. */
static void test_reslice_errors(void **state)
{
    (void)state;
    const char *name = "st/slicebad";
    make_stream(name, 64, 0);
    ts_value_t *v = rows_item(0, 3);
    assert_int_equal(ts_stream_append(cl, name, v, NULL), 0);
    ts_value_free(v);
    /* Another dtype under "x". */
    int64_t shape[2] = {3, COLS};
    v = ts_map_new();
    assert_int_equal(ts_map_set(v, "x", ts_tensor_alloc(TS_FLOAT64, 2, shape)), 0);
    assert_int_equal(ts_stream_append(cl, name, v, NULL), 0);
    ts_value_free(v);
    ts_stream_consumer_t *s = consumer(name, "g", "m", TS_STREAM_OLDEST, 4, 4, QUICK_MS);
    ts_value_t *out = NULL;
    assert_int_equal(ts_stream_consumer_next(s, &out, NULL), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "differs"));
    assert_null(out);
    ts_stream_consumer_close(s, 1);
    /* Tensors of one entry with different row counts. */
    const char *name2 = "st/slicebad2";
    make_stream(name2, 64, 0);
    v = ts_map_new();
    int64_t s3[1] = {3}, s2[1] = {2};
    assert_int_equal(ts_map_set(v, "a", ts_tensor_alloc(TS_INT32, 1, s3)), 0);
    assert_int_equal(ts_map_set(v, "b", ts_tensor_alloc(TS_INT32, 1, s2)), 0);
    assert_int_equal(ts_stream_append(cl, name2, v, NULL), 0);
    ts_value_free(v);
    s = consumer(name2, "g", "m", TS_STREAM_OLDEST, 4, 2, QUICK_MS);
    assert_int_equal(ts_stream_consumer_next(s, &out, NULL), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "rows"));
    ts_stream_consumer_close(s, 1);
    /* With B = 0 the same entry goes as it was appended. */
    s = consumer(name2, "g0", "m", TS_STREAM_OLDEST, 4, 0, QUICK_MS);
    assert_int_equal(ts_stream_consumer_next(s, &out, NULL), 0);
    assert_int_equal(ts_value_len(out), 2);
    ts_value_free(out);
    ts_stream_consumer_close(s, 1);
}

/* Bad input: refused locally or by the server, with nothing changed. */
static void test_bad_input(void **state)
{
    (void)state;
    const char *name = "st/bad";
    make_stream(name, 16, 0);
    push_tag(name, 1);
    push_tag(name, 2);
    ts_stream_batch_t *b = NULL;
    ts_value_t *it = tc_item(1, 1.0f, 1);
    /* Unknown stream. */
    assert_int_equal(ts_stream_append(cl, "st/none", it, NULL), TS_ENOENT);
    assert_int_equal(ts_stream_join(cl, "st/none", "g", "m", TS_STREAM_OLDEST, 0, NULL), TS_ENOENT);
    assert_int_equal(ts_stream_credit(cl, "st/none", 0, NULL), TS_ENOENT);
    ts_stream_producer_t *p = NULL;
    assert_int_equal(ts_stream_producer_open(&p, cl, "st/none", NULL, 0), TS_ENOENT);
    ts_stream_consumer_t *s = NULL;
    assert_int_equal(ts_stream_consumer_open(&s, cl, "st/none", "g", "m", NULL), TS_ENOENT);
    /* A member that never joined. */
    assert_int_equal(ts_stream_read(cl, name, "g", "nobody", 0, 1, 0, &b), TS_ENOENT);
    /* Ids from the future: refused, nothing changed. */
    assert_int_equal(ts_stream_join(cl, name, "g", "m", TS_STREAM_OLDEST, 0, NULL), 0);
    assert_int_equal(ts_stream_read(cl, name, "g", "m", 0, 1, 0, &b), 0);
    ts_stream_batch_free(b);
    assert_int_equal(ts_stream_read(cl, name, "g", "m", 3, 1, 0, &b), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "past the newest"));
    assert_int_equal(ts_stream_ack(cl, name, "g", "m", 1, 9, 0, NULL), TS_EINVAL);
    assert_int_equal(ts_stream_ack(cl, name, "g", "m", 2, 1, 0, NULL), TS_EINVAL);
    assert_int_equal(ts_stream_range(cl, name, 3, 1, 0, &b), TS_EINVAL);
    ts_stream_join_t j;
    assert_int_equal(ts_stream_join(cl, name, "g", "m", TS_STREAM_OLDEST, 0, &j), 0);
    assert_int_equal(j.pending, 1);
    assert_int_equal(j.floor, 1);
    assert_int_equal(j.next_id, 2);
    /* Counts: 1..TS_STREAM_READ_MAX. */
    assert_int_equal(ts_stream_read(cl, name, "g", "m", 0, 0, 0, &b), TS_EINVAL);
    assert_int_equal(ts_stream_read(cl, name, "g", "m", 0, TS_STREAM_READ_MAX + 1, 0, &b),
                     TS_EINVAL);
    assert_int_equal(ts_stream_range(cl, name, 0, 0, 0, &b), TS_EINVAL);
    ts_stream_consumer_options_t o;
    ts_stream_consumer_options_init(&o);
    o.prefetch = 0;
    assert_int_equal(ts_stream_consumer_open(&s, cl, name, "g", "m", &o), TS_EINVAL);
    o.prefetch = TS_STREAM_READ_MAX + 1;
    assert_int_equal(ts_stream_consumer_open(&s, cl, name, "g", "m", &o), TS_EINVAL);
    assert_int_equal(ts_stream_read(cl, name, "g", "m", 0, 1, -5, &b), TS_EINVAL);
    /* Names: 1 to 255 bytes. */
    char longname[300];
    memset(longname, 'n', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = '\0';
    assert_int_equal(ts_stream_create(cl, longname, NULL, NULL), TS_ENAMETOOLONG);
    assert_int_equal(ts_stream_append(cl, longname, it, NULL), TS_ENAMETOOLONG);
    assert_int_equal(ts_stream_join(cl, name, longname, "m", TS_STREAM_OLDEST, 0, NULL),
                     TS_ENAMETOOLONG);
    assert_int_equal(ts_stream_join(cl, name, "g", longname, TS_STREAM_OLDEST, 0, NULL),
                     TS_ENAMETOOLONG);
    assert_int_equal(ts_stream_join(cl, name, "", "m", TS_STREAM_OLDEST, 0, NULL), TS_EINVAL);
    assert_int_equal(ts_stream_join(cl, name, "g", NULL, TS_STREAM_OLDEST, 0, NULL), TS_EINVAL);
    assert_int_equal(ts_stream_join(cl, name, "g", "m", (ts_stream_start_t)2, 0, NULL), TS_EINVAL);
    /* Settings the server refuses. */
    ts_stream_config_t cfg;
    ts_stream_config_init(&cfg);
    cfg.max_entries = 0;
    assert_int_equal(ts_stream_create(cl, "st/bad2", &cfg, NULL), TS_EINVAL);
    cfg.max_entries = 4;
    cfg.window = 5;
    assert_int_equal(ts_stream_create(cl, "st/bad2", &cfg, NULL), TS_EINVAL);
    /* A plain bin is not a stream, and a stream is not a plain bin. */
    assert_int_equal(ts_put(cl, "st/plain", it, NULL), 0);
    assert_int_equal(ts_stream_append(cl, "st/plain", it, NULL), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "not a stream"));
    assert_int_equal(ts_stream_create(cl, "st/plain", NULL, NULL), TS_EINVAL);
    assert_int_equal(ts_put(cl, name, it, NULL), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "is a stream"));
    ts_value_free(it);
    /* Nothing changed, and the connection is fine. */
    ts_stream_state_t st;
    assert_int_equal(ts_stream_credit(cl, name, 0, &st), 0);
    assert_int_equal(st.last_id, 2);
    assert_int_equal(st.n_entries, 2);
    assert_int_equal(ts_ping(cl), 0);
    /* Batch accessors out of range, and NULL. */
    assert_int_equal(ts_stream_range(cl, name, 0, 8, 0, &b), 0);
    assert_int_equal(ts_stream_batch_count(b), 2);
    assert_null(ts_stream_batch_value(b, 2));
    assert_int_equal(ts_stream_batch_id(b, 2), 0);
    ts_stream_batch_free(b);
    assert_int_equal(ts_stream_batch_count(NULL), 0);
    ts_stream_batch_free(NULL);
    ts_stream_consumer_close(NULL, 0);
    ts_stream_producer_free(NULL);
    /* A stream's delete removes it with its groups. */
    uint32_t n = 0;
    assert_int_equal(ts_delete(cl, name, &n), 0);
    assert_int_equal(n, 2);
    assert_int_equal(ts_stream_read(cl, name, "g", "m", 0, 1, 0, &b), TS_ENOENT);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fanout),
        cmocka_unit_test(test_late_joiner),
        cmocka_unit_test(test_resume),
        cmocka_unit_test(test_credits),
        cmocka_unit_test(test_dead_consumer),
        cmocka_unit_test(test_work_queue),
        cmocka_unit_test(test_reslice),
        cmocka_unit_test(test_reslice_resume),
        cmocka_unit_test(test_reslice_errors),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_work_queue_helpers),
        cmocka_unit_test(test_reslice_tensor),
        cmocka_unit_test(test_lost_read),
        cmocka_unit_test(test_producer_when_the_server_does_not_answer),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
