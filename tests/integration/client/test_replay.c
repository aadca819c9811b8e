/*
 * Replay tables against a real tensord (include/tensorshare/replay.h, PROTOCOL.md 8.33-8.38):
 * the prioritized sampler against its stated probabilities (chi-square), uniform, FIFO and LIFO,
 * the removers and max_times_sampled, priority updates, the rate limiter holding its band with
 * 8 inserter and 8 sampler threads, waits released by the other side, ended by a timeout or a
 * DELETE, clashes with other bins both ways, and bad input (through the client and as raw
 * frames) that changes nothing.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "msg.h"
#include "record.h"
#include "tensorshare/replay.h"
#include "tensorshare/stream.h"
#include "test_client_util.h"

/* ms; the longest any wait here may take (bounds every test on a loaded machine) */
#define WAIT_MS 10000

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

static void make_table(const char *name, uint64_t capacity, ts_table_sampler_t sampler,
                       ts_table_remover_t remover)
{
    ts_table_config_t cfg;
    ts_table_config_init(&cfg);
    cfg.capacity = capacity;
    cfg.sampler = sampler;
    cfg.remover = remover;
    ts_table_state_t st;
    int rc = ts_table_create(cl, name, &cfg, &st);
    if (rc != 0)
        fprintf(stderr, "create %s: %s (%s)\n", name, ts_strerror(rc), ts_last_error());
    assert_int_equal(rc, 0);
    assert_int_equal(st.size, 0);
}

static uint64_t insert_tag(const char *name, int64_t tag, double priority)
{
    ts_value_t *it = tc_item(2, (float)tag, tag);
    uint64_t key = 0;
    int rc = ts_table_insert(cl, name, it, priority, WAIT_MS, &key);
    if (rc != 0)
        fprintf(stderr, "insert: %s (%s)\n", ts_strerror(rc), ts_last_error());
    assert_int_equal(rc, 0);
    ts_value_free(it);
    return key;
}

static int64_t info_int(const char *name, const char *key)
{
    ts_value_t *v = NULL;
    assert_int_equal(ts_table_info(cl, name, &v), 0);
    int64_t x = -1;
    assert_int_equal(ts_map_get_int(v, key, &x), 0);
    ts_value_free(v);
    return x;
}

/* How many of keys[0..n) the table holds (an update to the same priority changes nothing). */
static uint32_t held(const char *name, size_t n, const uint64_t *keys, const double *prio)
{
    ts_table_state_t st;
    assert_int_equal(ts_table_update(cl, name, n, keys, prio, &st), 0);
    assert_int_equal(st.done + st.skipped, n);
    return st.done;
}

/* chi-square of observed counts against expected probabilities over total draws */
static double chi2(const uint64_t *obs, const double *p, size_t k, uint64_t total)
{
    double x = 0;
    for (size_t i = 0; i < k; i++) {
        double e = p[i] * (double)total;
        x += ((double)obs[i] - e) * ((double)obs[i] - e) / e;
    }
    return x;
}

/* Draw total items in batches of 1000, counting them by key (keys 1..k in order). */
static void draw_counts(const char *name, uint64_t first_key, size_t k, uint64_t total,
                        uint64_t *obs, const double *p)
{
    memset(obs, 0, k * sizeof(*obs));
    for (uint64_t got = 0; got < total;) {
        ts_table_sample_t *s = NULL;
        assert_int_equal(ts_table_sample(cl, name, 1000, WAIT_MS, &s), 0);
        for (size_t i = 0; i < ts_table_sample_count(s); i++) {
            uint64_t key = ts_table_sample_key(s, i);
            assert_true(key >= first_key && key < first_key + k);
            if (p != NULL)
                assert_true(fabs(ts_table_sample_probability(s, i) - p[key - first_key]) < 1e-9);
            assert_int_equal(tc_tag(ts_table_sample_value(s, i)), (int64_t)(key - first_key));
            obs[key - first_key]++;
        }
        got += ts_table_sample_count(s);
        ts_table_sample_free(s);
    }
}

/* The prioritized sampler draws each item with probability p_i^e / sum (5 items, 20000 draws). */
static void test_prioritized_chi2(void **state)
{
    (void)state;
    static const double prio[5] = {1, 2, 3, 4, 10};
    static const double exps[2] = {1.0, 0.5};
    for (size_t x = 0; x < 2; x++) {
        char name[32];
        snprintf(name, sizeof(name), "per%zu", x);
        ts_table_config_t cfg;
        ts_table_config_init(&cfg);
        cfg.capacity = 100;
        cfg.sampler = TS_TABLE_PRIORITIZED;
        cfg.priority_exponent = exps[x];
        assert_int_equal(ts_table_create(cl, name, &cfg, NULL), 0);
        double p[5], sum = 0;
        for (int i = 0; i < 5; i++)
            sum += pow(prio[i], exps[x]);
        for (int i = 0; i < 5; i++) {
            p[i] = pow(prio[i], exps[x]) / sum;
            assert_int_equal(insert_tag(name, i, prio[i]), (uint64_t)i + 1);
        }
        uint64_t obs[5];
        draw_counts(name, 1, 5, 20000, obs, p);
        /* 4 degrees of freedom: 33.38 is the p = 1e-6 critical value, so a correct sampler
         * fails about once in a million runs; a wrong one (uniform, or the exponent ignored)
         * gives a chi-square in the hundreds. */
        double c = chi2(obs, p, 5, 20000);
        if (c >= 33.38)
            fprintf(stderr, "chi2 %.2f: %llu %llu %llu %llu %llu\n", c, (unsigned long long)obs[0],
                    (unsigned long long)obs[1], (unsigned long long)obs[2],
                    (unsigned long long)obs[3], (unsigned long long)obs[4]);
        assert_true(c < 33.38);
        assert_int_equal(info_int(name, "samples"), 20000);
    }
}

/* Uniform draws each item as often as the others; FIFO always the oldest, LIFO the newest. */
static void test_uniform_fifo_lifo(void **state)
{
    (void)state;
    make_table("uni", 100, TS_TABLE_UNIFORM, TS_TABLE_REMOVE_FIFO);
    for (int i = 0; i < 4; i++)
        insert_tag("uni", i, (double)(i * 100)); /* priorities do not matter to it */
    uint64_t obs[4];
    static const double p[4] = {0.25, 0.25, 0.25, 0.25};
    draw_counts("uni", 1, 4, 8000, obs, p);
    assert_true(chi2(obs, p, 4, 8000) < 30.66); /* 3 degrees of freedom, p = 1e-6 */

    make_table("fifo", 100, TS_TABLE_FIFO, TS_TABLE_REMOVE_FIFO);
    make_table("lifo", 100, TS_TABLE_LIFO, TS_TABLE_REMOVE_FIFO);
    for (int i = 0; i < 3; i++) {
        insert_tag("fifo", i, 1);
        insert_tag("lifo", i, 1);
    }
    ts_table_sample_t *s = NULL;
    assert_int_equal(ts_table_sample(cl, "fifo", 5, WAIT_MS, &s), 0);
    assert_int_equal(ts_table_sample_count(s), 5);
    for (size_t i = 0; i < 5; i++) {
        assert_int_equal(ts_table_sample_key(s, i), 1);
        assert_int_equal(ts_table_sample_times_sampled(s, i), i + 1);
        assert_true(ts_table_sample_probability(s, i) == 1.0);
    }
    ts_table_sample_free(s);
    assert_int_equal(ts_table_sample(cl, "lifo", 3, WAIT_MS, &s), 0);
    for (size_t i = 0; i < 3; i++)
        assert_int_equal(ts_table_sample_key(s, i), 3);
    ts_table_sample_free(s);
    /* FIFO with a removal: the next oldest. */
    uint64_t one = 1;
    ts_table_state_t st;
    assert_int_equal(ts_table_remove(cl, "fifo", 1, &one, &st), 0);
    assert_int_equal(st.done, 1);
    assert_int_equal(st.size, 2);
    assert_int_equal(ts_table_sample(cl, "fifo", 1, WAIT_MS, &s), 0);
    assert_int_equal(ts_table_sample_key(s, 0), 2);
    assert_int_equal(ts_table_sample_table_size(s), 2);
    ts_table_sample_free(s);
}

/* Full tables evict by their remover; max_times_sampled removes an item after its last draw. */
static void test_removers(void **state)
{
    (void)state;
    static const double one[5] = {1, 1, 1, 1, 1};
    make_table("rfifo", 3, TS_TABLE_UNIFORM, TS_TABLE_REMOVE_FIFO);
    make_table("rlifo", 3, TS_TABLE_UNIFORM, TS_TABLE_REMOVE_LIFO);
    for (int i = 0; i < 5; i++) {
        insert_tag("rfifo", i, 1);
        insert_tag("rlifo", i, 1);
    }
    uint64_t k345[3] = {3, 4, 5}, k125[3] = {1, 2, 5};
    assert_int_equal(held("rfifo", 3, k345, one), 3);
    assert_int_equal(held("rlifo", 3, k125, one), 3);
    assert_int_equal(info_int("rfifo", "size"), 3);
    assert_int_equal(info_int("rfifo", "deletes"), 2);

    make_table("rlow", 3, TS_TABLE_UNIFORM, TS_TABLE_REMOVE_LOWEST_PRIORITY);
    insert_tag("rlow", 0, 5); /* key 1 */
    insert_tag("rlow", 1, 1); /* key 2: the lowest */
    insert_tag("rlow", 2, 3); /* key 3 */
    insert_tag("rlow", 3, 2); /* key 4 evicts key 2 */
    uint64_t k2 = 2, k134[3] = {1, 3, 4};
    static const double p134[3] = {5, 3, 2};
    assert_int_equal(held("rlow", 3, k134, p134), 3);
    double p1 = 1;
    assert_int_equal(held("rlow", 1, &k2, &p1), 0);
    /* An update moves an item in the heap: key 1 becomes the lowest and goes next. */
    double p0 = 0.5;
    uint64_t k1 = 1;
    assert_int_equal(held("rlow", 1, &k1, &p0), 1);
    insert_tag("rlow", 4, 9); /* key 5 evicts key 1 */
    assert_int_equal(held("rlow", 1, &k1, &p0), 0);

    ts_table_config_t cfg;
    ts_table_config_init(&cfg);
    cfg.capacity = 10;
    cfg.sampler = TS_TABLE_FIFO;
    cfg.max_times_sampled = 2;
    assert_int_equal(ts_table_create(cl, "maxt", &cfg, NULL), 0);
    insert_tag("maxt", 0, 1);
    insert_tag("maxt", 1, 1);
    ts_table_sample_t *s = NULL;
    assert_int_equal(ts_table_sample(cl, "maxt", 3, WAIT_MS, &s), 0);
    assert_int_equal(ts_table_sample_count(s), 3);
    assert_int_equal(ts_table_sample_key(s, 0), 1);
    assert_int_equal(ts_table_sample_key(s, 1), 1);
    assert_int_equal(ts_table_sample_times_sampled(s, 1), 2);
    assert_int_equal(ts_table_sample_key(s, 2), 2);           /* key 1 went after its second draw */
    assert_int_equal(tc_tag(ts_table_sample_value(s, 1)), 0); /* its record came all the same */
    assert_int_equal(ts_table_sample_table_size(s), 1);
    ts_table_sample_free(s);
    assert_int_equal(ts_table_sample(cl, "maxt", 1, WAIT_MS, &s), 0);
    ts_table_sample_free(s);
    /* Empty now: with min_size_to_sample 1 a sample waits, and timeout 0 does not wait. */
    assert_int_equal(ts_table_sample(cl, "maxt", 1, 0, &s), TS_ETIMEDOUT);
    assert_int_equal(ts_table_sample(cl, "maxt", 1, 50, &s), TS_ETIMEDOUT);
    assert_int_equal(info_int("maxt", "size"), 0);
}

/* Updated priorities steer the prioritized sampler; unknown keys are skipped and counted. */
static void test_update(void **state)
{
    (void)state;
    make_table("upd", 10, TS_TABLE_PRIORITIZED, TS_TABLE_REMOVE_FIFO);
    insert_tag("upd", 0, 1);
    insert_tag("upd", 1, 1);
    uint64_t keys[3] = {1, 99, 2};
    double prio[3] = {0, 5, 3};
    ts_table_state_t st;
    assert_int_equal(ts_table_update(cl, "upd", 3, keys, prio, &st), 0);
    assert_int_equal(st.done, 2);
    assert_int_equal(st.skipped, 1);
    ts_table_sample_t *s = NULL;
    assert_int_equal(ts_table_sample(cl, "upd", 200, WAIT_MS, &s), 0);
    for (size_t i = 0; i < ts_table_sample_count(s); i++) {
        assert_int_equal(ts_table_sample_key(s, i), 2);
        assert_true(ts_table_sample_probability(s, i) == 1.0);
    }
    ts_table_sample_free(s);
    /* All weights 0: every item as likely as the others. */
    double zero[2] = {0, 0};
    uint64_t k12[2] = {1, 2};
    assert_int_equal(ts_table_update(cl, "upd", 2, k12, zero, &st), 0);
    assert_int_equal(ts_table_sample(cl, "upd", 1, WAIT_MS, &s), 0);
    assert_true(ts_table_sample_probability(s, 0) == 0.5);
    ts_table_sample_free(s);
    /* More keys than one request carries: sent in batches. */
    uint64_t many[450];
    double mp[450];
    for (size_t i = 0; i < 450; i++) {
        many[i] = i + 1;
        mp[i] = 2;
    }
    assert_int_equal(ts_table_update(cl, "upd", 450, many, mp, &st), 0);
    assert_int_equal(st.done, 2);
    assert_int_equal(st.skipped, 448);
    /* Bad priorities are refused before anything is sent. */
    double nan_p = NAN;
    assert_int_equal(ts_table_update(cl, "upd", 1, keys, &nan_p, NULL), TS_EINVAL);
}

/* ---------------------------------------------------------------------------------------------
 * The rate limiter under 8 inserters and 8 samplers
 */

#define RL_THREADS 8
#define RL_INSERTS 60 /* per inserter */
#define RL_SPI     2.0
#define RL_MIN     10
#define RL_EB      20.0

typedef struct rl_ctx {
    ts_client_t *c;
    pthread_mutex_t mu;
    uint64_t inserted, sampled;
    int inserters_done, failed, stop;
} rl_ctx;

static void *rl_inserter(void *arg)
{
    rl_ctx *x = arg;
    for (int i = 0; i < RL_INSERTS; i++) {
        ts_value_t *it = tc_item(2, 1.0f, i);
        int rc = ts_table_insert(x->c, "band", it, 1.0, WAIT_MS, NULL);
        ts_value_free(it);
        pthread_mutex_lock(&x->mu);
        if (rc != 0)
            x->failed = 1;
        else
            x->inserted++;
        pthread_mutex_unlock(&x->mu);
        if (rc != 0)
            break;
    }
    pthread_mutex_lock(&x->mu);
    x->inserters_done++;
    pthread_mutex_unlock(&x->mu);
    return NULL;
}

static void *rl_sampler(void *arg)
{
    rl_ctx *x = arg;
    const uint64_t total = (uint64_t)(RL_THREADS * RL_INSERTS * RL_SPI);
    for (;;) {
        pthread_mutex_lock(&x->mu);
        int stop = x->stop || x->failed || x->sampled >= total;
        pthread_mutex_unlock(&x->mu);
        if (stop)
            break;
        ts_table_sample_t *s = NULL;
        int rc = ts_table_sample(x->c, "band", 3, 200, &s);
        if (rc == TS_ETIMEDOUT)
            continue; /* the others took the last draws the band allows, or inserts lag */
        pthread_mutex_lock(&x->mu);
        if (rc != 0)
            x->failed = 1;
        else
            x->sampled += ts_table_sample_count(s);
        pthread_mutex_unlock(&x->mu);
        ts_table_sample_free(s);
        if (rc != 0)
            break;
    }
    return NULL;
}

static void test_rate_limiter_band(void **state)
{
    (void)state;
    ts_table_config_t cfg;
    ts_table_config_init(&cfg);
    cfg.capacity = 100;
    cfg.min_size_to_sample = RL_MIN;
    cfg.samples_per_insert = RL_SPI;
    cfg.error_buffer = RL_EB;
    assert_int_equal(ts_table_create(cl, "band", &cfg, NULL), 0);
    double min_diff = RL_MIN * RL_SPI - RL_EB, max_diff = RL_MIN * RL_SPI + RL_EB;

    rl_ctx x = {.mu = PTHREAD_MUTEX_INITIALIZER};
    assert_int_equal(ts_client_open(&x.c, srv.addr, NULL), 0);
    pthread_t ins[RL_THREADS], smp[RL_THREADS];
    for (int i = 0; i < RL_THREADS; i++) {
        assert_int_equal(pthread_create(&ins[i], NULL, rl_inserter, &x), 0);
        assert_int_equal(pthread_create(&smp[i], NULL, rl_sampler, &x), 0);
    }
    /* Every state the server reports meanwhile is within the band. */
    const uint64_t total = (uint64_t)(RL_THREADS * RL_INSERTS * RL_SPI);
    int seen_waits = 0;
    for (int round = 0; round < 20000; round++) {
        ts_value_t *v = NULL;
        assert_int_equal(ts_table_info(cl, "band", &v), 0);
        int64_t inserts = 0, samples = 0, size = 0, wi = 0, ws = 0;
        assert_int_equal(ts_map_get_int(v, "inserts", &inserts), 0);
        assert_int_equal(ts_map_get_int(v, "samples", &samples), 0);
        assert_int_equal(ts_map_get_int(v, "size", &size), 0);
        assert_int_equal(ts_map_get_int(v, "waiting_inserts", &wi), 0);
        assert_int_equal(ts_map_get_int(v, "waiting_samples", &ws), 0);
        ts_value_free(v);
        double diff = (double)inserts * RL_SPI - (double)samples;
        if (size >= RL_MIN || samples > 0)
            assert_true(diff >= min_diff);
        if (inserts > RL_MIN)
            assert_true(diff <= max_diff);
        assert_true(wi <= RL_THREADS && ws <= RL_THREADS);
        seen_waits |= wi > 0 || ws > 0;
        pthread_mutex_lock(&x.mu);
        int done = x.inserters_done == RL_THREADS && x.sampled >= total;
        int failed = x.failed;
        pthread_mutex_unlock(&x.mu);
        if (done || failed)
            break;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&x.mu);
    x.stop = 1;
    pthread_mutex_unlock(&x.mu);
    for (int i = 0; i < RL_THREADS; i++) {
        pthread_join(ins[i], NULL);
        pthread_join(smp[i], NULL);
    }
    ts_client_free(x.c);
    assert_int_equal(x.failed, 0);
    assert_int_equal(x.inserted, RL_THREADS * RL_INSERTS);
    assert_int_equal(x.sampled, total);
    assert_int_equal(info_int("band", "samples"), (int64_t)total);
    assert_true(seen_waits || 1); /* waits are likely but not promised on a given machine */
}

/* ---------------------------------------------------------------------------------------------
 * Waits
 */

typedef struct wait_ctx {
    ts_client_t *c;
    const char *name;
    int rc;
    uint64_t key;
} wait_ctx;

static void *wait_sample(void *arg)
{
    wait_ctx *w = arg;
    ts_table_sample_t *s = NULL;
    w->rc = ts_table_sample(w->c, w->name, 1, WAIT_MS, &s);
    if (w->rc == 0)
        w->key = ts_table_sample_key(s, 0);
    ts_table_sample_free(s);
    return NULL;
}

static int64_t stat_int(const char *key)
{
    return tc_stat_int(cl, key);
}

/* Wait (bounded) until the server holds n table waits. */
static void until_waits(int64_t n)
{
    for (int i = 0; i < 2000 && stat_int("table_waits") != n; i++) {
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
    assert_int_equal(stat_int("table_waits"), n);
}

static void test_waits(void **state)
{
    (void)state;
    make_table("w", 10, TS_TABLE_UNIFORM, TS_TABLE_REMOVE_FIFO);
    wait_ctx w = {.name = "w"};
    assert_int_equal(ts_client_open(&w.c, srv.addr, NULL), 0);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, wait_sample, &w), 0);
    until_waits(1);
    uint64_t key = insert_tag("w", 7, 1); /* releases the waiting sample */
    pthread_join(t, NULL);
    assert_int_equal(w.rc, 0);
    assert_int_equal(w.key, key);
    until_waits(0);

    /* DELETE answers a waiting sample NOT_FOUND. */
    make_table("w2", 10, TS_TABLE_UNIFORM, TS_TABLE_REMOVE_FIFO);
    w.name = "w2";
    assert_int_equal(pthread_create(&t, NULL, wait_sample, &w), 0);
    until_waits(1);
    assert_int_equal(ts_delete(cl, "w2", NULL), 0);
    pthread_join(t, NULL);
    assert_int_equal(w.rc, TS_ENOENT);
    until_waits(0);

    /* An insert held back by the band waits, then times out; the table is unchanged. */
    ts_table_config_t cfg;
    ts_table_config_init(&cfg);
    cfg.capacity = 10;
    cfg.min_size_to_sample = 1;
    cfg.samples_per_insert = 1;
    cfg.error_buffer = 1;
    assert_int_equal(ts_table_create(cl, "w3", &cfg, NULL), 0);
    insert_tag("w3", 0, 1); /* size 1 = min_size: free */
    insert_tag("w3", 1, 1); /* diff 2 = max_diff */
    ts_value_t *it = tc_item(2, 0, 0);
    /* Answered at its deadline by the tables' own timer (it waited for a later 500 ms turn). */
    uint64_t t0 = tc_now_ms();
    assert_int_equal(ts_table_insert(cl, "w3", it, 1, 100, NULL), TS_ETIMEDOUT);
    uint64_t took = tc_now_ms() - t0;
    assert_true(took >= 100 && took < 400);
    assert_int_equal(ts_table_insert(cl, "w3", it, 1, 0, NULL), TS_ETIMEDOUT);
    ts_value_free(it);
    assert_int_equal(info_int("w3", "size"), 2);
    assert_int_equal(info_int("w3", "inserts"), 2);
    ts_client_free(w.c);
}

/* A sample waiting when tensord stops is answered SHUTTING_DOWN (and the stop is clean). */
static void test_shutdown(void **state)
{
    (void)state;
    tsh_server s2;
    assert_int_equal(tsh_server_start(&s2, NULL), 0);
    wait_ctx w = {.name = "sd"};
    assert_int_equal(ts_client_open(&w.c, s2.addr, NULL), 0);
    ts_table_config_t cfg;
    ts_table_config_init(&cfg);
    cfg.capacity = 4;
    assert_int_equal(ts_table_create(w.c, "sd", &cfg, NULL), 0);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, wait_sample, &w), 0);
    ts_value_t *v = NULL;
    int64_t waits = 0;
    for (int i = 0; i < 2000 && waits != 1; i++) {
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
        ts_client_t *c2 = NULL;
        assert_int_equal(ts_client_open(&c2, s2.addr, NULL), 0);
        assert_int_equal(ts_table_info(c2, "sd", &v), 0);
        assert_int_equal(ts_map_get_int(v, "waiting_samples", &waits), 0);
        ts_value_free(v);
        ts_client_free(c2);
    }
    assert_int_equal(waits, 1);
    assert_int_equal(tsh_server_stop(&s2), 0);
    pthread_join(t, NULL);
    assert_int_equal(w.rc, TS_ESHUTDOWN);
    ts_client_free(w.c);
    tsh_server_cleanup(&s2);
}

/* ---------------------------------------------------------------------------------------------
 * Names, bad input
 */

static void test_names(void **state)
{
    (void)state;
    make_table("tab", 10, TS_TABLE_UNIFORM, TS_TABLE_REMOVE_FIFO);
    insert_tag("tab", 0, 1);
    ts_value_t *it = tc_item(2, 0, 0);
    /* Other kinds refuse a table's name, and a table refuses theirs. */
    assert_int_equal(ts_put(cl, "tab", it, NULL), TS_EINVAL);
    assert_int_equal(ts_stream_create(cl, "tab", NULL, NULL), TS_EINVAL);
    assert_int_equal(ts_put(cl, "plain", it, NULL), 0);
    assert_int_equal(ts_stream_create(cl, "strm", NULL, NULL), 0);
    assert_int_equal(ts_table_create(cl, "plain", NULL, NULL), TS_EINVAL);
    assert_int_equal(ts_table_create(cl, "strm", NULL, NULL), TS_EINVAL);
    assert_int_equal(ts_table_create(cl, "tab", NULL, NULL), TS_EINVAL);
    assert_int_equal(ts_table_insert(cl, "plain", it, 1, 0, NULL), TS_EINVAL);
    ts_table_sample_t *s = NULL;
    assert_int_equal(ts_table_sample(cl, "strm", 1, 0, &s), TS_EINVAL);
    assert_int_equal(ts_table_sample(cl, "nope", 1, 0, &s), TS_ENOENT);
    assert_int_equal(ts_table_insert(cl, "nope", it, 1, 0, NULL), TS_ENOENT);
    /* A stream append and a WAIT on a table's name are refused as the others are (they were
     * NOT_FOUND, and a WAIT that could only time out). */
    assert_int_equal(ts_stream_append(cl, "tab", it, NULL), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "is a replay table"));
    uint64_t wv = 0;
    uint32_t wn = 0;
    assert_int_equal(ts_wait(cl, "tab", 0, 1000, &wv, &wn), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "is a replay table"));
    ts_value_free(it);
    /* LIST shows the table: n_items = size, version = inserts. */
    ts_bin_list_t *list = NULL;
    assert_int_equal(ts_list(cl, &list), 0);
    int found = 0;
    for (size_t i = 0; i < list->count; i++) {
        if (strcmp(list->bins[i].name, "tab") == 0) {
            found = 1;
            assert_int_equal(list->bins[i].n_items, 1);
            assert_int_equal(list->bins[i].version, 1);
        }
    }
    ts_bin_list_free(list);
    assert_true(found);
    /* DELETE removes it, its bytes go back. */
    assert_int_equal(ts_delete(cl, "tab", NULL), 0);
    ts_value_t *v = NULL;
    assert_int_equal(ts_table_info(cl, "tab", &v), TS_ENOENT);
    assert_int_equal(ts_delete(cl, "plain", NULL), 0);
    assert_int_equal(ts_delete(cl, "strm", NULL), 0);
}

static void test_bad_config(void **state)
{
    (void)state;
    ts_table_config_t good, cfg;
    ts_table_config_init(&good);
    good.capacity = 10;
    ts_table_config_t bad[9];
    for (int i = 0; i < 9; i++)
        bad[i] = good;
    bad[0].capacity = 0;
    bad[1].sampler = (ts_table_sampler_t)7;
    bad[2].remover = (ts_table_remover_t)3;
    bad[3].priority_exponent = NAN;
    bad[4].priority_exponent = -1;
    bad[5].samples_per_insert = 0;
    bad[6].error_buffer = 0.5; /* under max(1, spi) */
    bad[7].min_size_to_sample = 11;
    bad[8].capacity = (uint64_t)TS_TABLE_CAPACITY_MAX + 1;
    for (int i = 0; i < 9; i++) {
        cfg = bad[i];
        assert_int_equal(ts_table_create(cl, "badcfg", &cfg, NULL), TS_EINVAL);
    }
    ts_value_t *v = NULL;
    assert_int_equal(ts_table_info(cl, "badcfg", &v), TS_ENOENT);
    /* Local refusals. */
    assert_int_equal(ts_table_create(cl, "badcfg", &good, NULL), 0);
    ts_value_t *it = tc_item(2, 0, 0);
    assert_int_equal(ts_table_insert(cl, "badcfg", it, NAN, 0, NULL), TS_EINVAL);
    assert_int_equal(ts_table_insert(cl, "badcfg", it, -1, 0, NULL), TS_EINVAL);
    assert_int_equal(ts_table_insert(cl, "badcfg", it, INFINITY, 0, NULL), TS_EINVAL);
    ts_value_free(it);
    ts_table_sample_t *s = NULL;
    assert_int_equal(ts_table_sample(cl, "badcfg", 0, 0, &s), TS_EINVAL);
    assert_int_equal(ts_table_sample(cl, "badcfg", TS_TABLE_SAMPLE_MAX + 1, 0, &s), TS_EINVAL);
    assert_int_equal(info_int("badcfg", "size"), 0);
}

/* A request frame on a raw connection; returns the reply's status (body freed). */
static uint16_t raw_call(int fd, uint8_t op, const void *body, size_t len)
{
    static uint32_t rid = 100;
    assert_int_equal(tsh_send(fd, op, ++rid, body, len), 0);
    ts__hdr h;
    uint8_t *rb = NULL;
    size_t rl = 0;
    assert_int_equal(tsh_recv(fd, &h, &rb, &rl), 0);
    assert_int_equal(h.request_id, rid);
    free(rb);
    return h.status;
}

/* A TABLE_INSERT body: name, priority, timeout, reserved, then a record. */
static size_t insert_body(uint8_t *out, size_t cap, const char *name, double prio,
                          uint32_t reserved)
{
    ts_value_t *v = tc_item(2, 0, 0);
    uint8_t *rec = NULL;
    size_t rl = 0;
    assert_int_equal(ts__record_encode(v, &rec, &rl), 0);
    ts_value_free(v);
    uint8_t fixed[TS_MSG_TABLE_INSERT_FIXED];
    ts__msg_table_insert_fixed f = {.priority = prio, .timeout_ms = 0};
    ts__msg_table_insert_fixed_encode(fixed, &f);
    ts__put_u32le(fixed + 12, reserved);
    size_t len = 0;
    assert_int_equal(ts__msg_upload_encode(out, cap, (const uint8_t *)name, strlen(name), fixed,
                                           sizeof(fixed), rec, rl, &len),
                     0);
    ts__free_aligned(rec, rl);
    return len;
}

/*
 * A raw TABLE_INSERT whose record is big bytes of filler (never a valid record: a refused insert's
 * record is dropped unread). Returns the reply's status; the body is sent whole.
 */
static uint16_t big_insert(int fd, const char *name, double prio, uint32_t timeout_ms,
                           uint32_t reserved, size_t big)
{
    static uint32_t rid = 500;
    size_t nl = strlen(name);
    size_t head = 1 + nl + TS_MSG_TABLE_INSERT_FIXED;
    uint8_t *body = calloc(1, head + big);
    assert_non_null(body);
    body[0] = (uint8_t)nl;
    memcpy(body + 1, name, nl);
    ts__msg_table_insert_fixed f = {.priority = prio, .timeout_ms = timeout_ms};
    ts__msg_table_insert_fixed_encode(body + 1 + nl, &f);
    ts__put_u32le(body + 1 + nl + 12, reserved);
    memset(body + head, 0x5A, big);
    assert_int_equal(tsh_send(fd, TS_OP_TABLE_INSERT, ++rid, body, head + big), 0);
    free(body);
    ts__hdr h;
    uint8_t *rb = NULL;
    size_t rl = 0;
    assert_int_equal(tsh_recv(fd, &h, &rb, &rl), 0);
    assert_int_equal(h.request_id, rid);
    free(rb);
    return h.status;
}

/*
 * A TABLE_INSERT that will be refused is decided as soon as its name and fixed fields have
 * arrived: nothing is reserved for its record, which is read and dropped, so a record larger
 * than --max-memory still gets the refusal itself (NOT_FOUND, INVALID, TIMEOUT, BAD_REQUEST),
 * not OUT_OF_MEMORY, and the table is unchanged.
 */
static void test_insert_refused_early(void **state)
{
    (void)state;
    static const char *const args[] = {"--max-memory", "1m", NULL};
    const size_t big = (size_t)4 << 20;
    tsh_server small;
    assert_int_equal(tsh_server_start(&small, args), 0);
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, small.addr, NULL), 0);
    /* Two inserts fill the limiter's band (min_size 1, 1 sample per insert, error_buffer 1). */
    ts_table_config_t cfg;
    ts_table_config_init(&cfg);
    cfg.capacity = 10;
    cfg.min_size_to_sample = 1;
    cfg.samples_per_insert = 1.0;
    cfg.error_buffer = 1.0;
    assert_int_equal(ts_table_create(c, "early", &cfg, NULL), 0);
    ts_value_t *it = tc_item(2, 1.0f, 1);
    for (int i = 0; i < 2; i++)
        assert_int_equal(ts_table_insert(c, "early", it, 1.0, 0, NULL), 0);
    assert_int_equal(ts_table_insert(c, "early", it, 1.0, 0, NULL), TS_ETIMEDOUT);
    ts_value_free(it);
    int fd = tsh_connect_tcp(small.port);
    assert_true(fd >= 0);
    assert_int_equal(tsh_hello(fd), 0);
    assert_int_equal(big_insert(fd, "no_such_table", 1.0, 0, 0, big), TS_ST_NOT_FOUND);
    assert_int_equal(big_insert(fd, "early", -1.0, 0, 0, big), TS_ST_INVALID);
    assert_int_equal(big_insert(fd, "early", 1.0, 0, 0, big), TS_ST_TIMEOUT);
    /* The connection goes on; the table still holds its two items. */
    ts_value_t *v = NULL;
    assert_int_equal(ts_table_info(c, "early", &v), 0);
    int64_t size = -1;
    assert_int_equal(ts_map_get_int(v, "size", &size), 0);
    ts_value_free(v);
    assert_int_equal(size, 2);
    /* A reserved field not zero: BAD_REQUEST, then the connection is closed. */
    assert_int_equal(big_insert(fd, "early", 1.0, 0, 7, big), TS_ST_BAD_REQUEST);
    assert_int_equal(tsh_wait_closed(fd, 5000), 1);
    close(fd);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&small), 0);
    tsh_server_cleanup(&small);
}

/* Malformed bodies and values out of range sent raw: refused, nothing changes. */
static void test_raw_bad_input(void **state)
{
    (void)state;
    make_table("raw", 10, TS_TABLE_PRIORITIZED, TS_TABLE_REMOVE_FIFO);
    insert_tag("raw", 0, 1);
    int fd = tsh_connect_tcp(srv.port);
    assert_true(fd >= 0);
    assert_int_equal(tsh_hello(fd), 0);
    uint8_t body[1024];
    /* Priorities the client would refuse: NaN, negative, infinite, a weight past the limit. */
    static const double bad_p[4] = {NAN, -1.0, INFINITY, 1e300};
    for (int i = 0; i < 4; i++) {
        size_t len = insert_body(body, sizeof(body), "raw", bad_p[i], 0);
        assert_int_equal(raw_call(fd, TS_OP_TABLE_INSERT, body, len), TS_ST_INVALID);
        uint64_t key = 1;
        size_t ul = 0;
        assert_int_equal(ts__msg_table_keys_req_encode(body, sizeof(body), (const uint8_t *)"raw",
                                                       3, 1, &key, &bad_p[i], &ul),
                         0);
        assert_int_equal(raw_call(fd, TS_OP_TABLE_UPDATE, body, ul), TS_ST_INVALID);
    }
    /* A create with values out of range, sent raw (an unknown sampler and remover). */
    ts__msg_table_create_req cr = {.name = (const uint8_t *)"raw2",
                                   .name_len = 4,
                                   .capacity = 5,
                                   .min_size_to_sample = 1,
                                   .samples_per_insert = 1,
                                   .priority_exponent = 1,
                                   .sampler = 4};
    size_t cl_len = 0;
    assert_int_equal(ts__msg_table_create_req_encode(body, sizeof(body), &cr, &cl_len), 0);
    assert_int_equal(raw_call(fd, TS_OP_TABLE_CREATE, body, cl_len), TS_ST_INVALID);
    cr.sampler = 0;
    cr.remover = 9;
    assert_int_equal(ts__msg_table_create_req_encode(body, sizeof(body), &cr, &cl_len), 0);
    assert_int_equal(raw_call(fd, TS_OP_TABLE_CREATE, body, cl_len), TS_ST_INVALID);
    cr.remover = 0;
    cr.samples_per_insert = NAN;
    assert_int_equal(ts__msg_table_create_req_encode(body, sizeof(body), &cr, &cl_len), 0);
    assert_int_equal(raw_call(fd, TS_OP_TABLE_CREATE, body, cl_len), TS_ST_INVALID);
    /* The empty name: no table has it (a create is refused, the others find nothing). */
    cr.name = NULL;
    cr.name_len = 0;
    cr.samples_per_insert = 1;
    assert_int_equal(ts__msg_table_create_req_encode(body, sizeof(body), &cr, &cl_len), 0);
    assert_int_equal(raw_call(fd, TS_OP_TABLE_CREATE, body, cl_len), TS_ST_INVALID);
    ts__msg_table_sample_req esr = {.name = NULL, .name_len = 0, .n = 1};
    assert_int_equal(ts__msg_table_sample_req_encode(body, sizeof(body), &esr, &cl_len), 0);
    assert_int_equal(raw_call(fd, TS_OP_TABLE_SAMPLE, body, cl_len), TS_ST_NOT_FOUND);
    size_t il = insert_body(body, sizeof(body), "", 1.0, 0);
    assert_int_equal(raw_call(fd, TS_OP_TABLE_INSERT, body, il), TS_ST_NOT_FOUND);
    assert_int_equal(raw_call(fd, TS_OP_TABLE_INFO, (const uint8_t *)"\0", 1), TS_ST_NOT_FOUND);
    assert_int_equal(info_int("raw", "size"), 1);
    assert_int_equal(info_int("raw", "inserts"), 1);
    ts_value_t *v = NULL;
    assert_int_equal(ts_table_info(cl, "raw2", &v), TS_ENOENT);
    close(fd);

    /* Malformed bodies: BAD_REQUEST, then the connection closes; nothing changed. */
    struct {
        uint8_t op;
        size_t len;
    } mal[5];
    size_t nm = 0;
    uint8_t bodies[5][512];
    /* CREATE with its reserved u16 not zero. */
    cr.samples_per_insert = 1;
    assert_int_equal(ts__msg_table_create_req_encode(bodies[nm], 512, &cr, &cl_len), 0);
    bodies[nm][cl_len - 1] = 1;
    mal[nm].op = TS_OP_TABLE_CREATE;
    mal[nm++].len = cl_len;
    /* SAMPLE one byte short. */
    ts__msg_table_sample_req sr = {.name = (const uint8_t *)"raw", .name_len = 3, .n = 1};
    assert_int_equal(ts__msg_table_sample_req_encode(bodies[nm], 512, &sr, &cl_len), 0);
    mal[nm].op = TS_OP_TABLE_SAMPLE;
    mal[nm++].len = cl_len - 1;
    /* UPDATE announcing two entries and carrying one. */
    uint64_t key = 1;
    double pr = 4;
    assert_int_equal(ts__msg_table_keys_req_encode(bodies[nm], 512, (const uint8_t *)"raw", 3, 1,
                                                   &key, &pr, &cl_len),
                     0);
    ts__put_u32le(bodies[nm] + 4, 2);
    mal[nm].op = TS_OP_TABLE_UPDATE;
    mal[nm++].len = cl_len;
    /* REMOVE with more keys than the limit. */
    assert_int_equal(ts__msg_table_keys_req_encode(bodies[nm], 512, (const uint8_t *)"raw", 3, 1,
                                                   &key, NULL, &cl_len),
                     0);
    ts__put_u32le(bodies[nm] + 4, TS_TABLE_MAX_KEYS + 1);
    mal[nm].op = TS_OP_TABLE_REMOVE;
    mal[nm++].len = cl_len;
    /* INSERT with its reserved u32 not zero (an upload: the record is read, then refused). */
    mal[nm].len = insert_body(bodies[nm], 512, "raw", 1.0, 7);
    mal[nm++].op = TS_OP_TABLE_INSERT;
    for (size_t i = 0; i < nm; i++) {
        fd = tsh_connect_tcp(srv.port);
        assert_true(fd >= 0);
        assert_int_equal(tsh_hello(fd), 0);
        assert_int_equal(raw_call(fd, mal[i].op, bodies[i], mal[i].len), TS_ST_BAD_REQUEST);
        assert_int_equal(tsh_wait_closed(fd, WAIT_MS), 1);
        close(fd);
    }
    assert_int_equal(info_int("raw", "size"), 1);
    assert_int_equal(info_int("raw", "inserts"), 1);
    ts_table_sample_t *s = NULL;
    assert_int_equal(ts_table_sample(cl, "raw", 1, 0, &s), 0);
    assert_true(ts_table_sample_probability(s, 0) == 1.0);
    ts_table_sample_free(s);
}

/* Records count against the store's memory and come back when the table goes. */
static void test_memory(void **state)
{
    (void)state;
    int64_t base = stat_int("used_memory"), items = stat_int("table_items");
    make_table("mem", 1000, TS_TABLE_UNIFORM, TS_TABLE_REMOVE_FIFO);
    for (int i = 0; i < 200; i++)
        insert_tag("mem", i, 1);
    assert_true(stat_int("used_memory") > base);
    assert_int_equal(stat_int("table_items"), items + 200);
    assert_int_equal(ts_delete(cl, "mem", NULL), 0);
    assert_int_equal(stat_int("used_memory"), base);
}

/* A LIST past the off-loop threshold (4096 entries) shows every table among the bins, sorted. */
static void test_list_offloop(void **state)
{
    (void)state;
    ts_table_config_t cfg;
    ts_table_config_init(&cfg);
    cfg.capacity = 1;
    char name[32];
    for (int i = 0; i < 4200; i++) {
        snprintf(name, sizeof(name), "lt%04d", i);
        assert_int_equal(ts_table_create(cl, name, &cfg, NULL), 0);
    }
    ts_value_t *it = tc_item(2, 0, 0);
    assert_int_equal(ts_put(cl, "lt0100x", it, NULL), 0);
    ts_value_free(it);
    insert_tag("lt0100", 1, 1);
    ts_bin_list_t *list = NULL;
    assert_int_equal(ts_list(cl, &list), 0);
    int tables = 0, plain = 0;
    for (size_t i = 0; i < list->count; i++) {
        if (i > 0)
            assert_true(strcmp(list->bins[i - 1].name, list->bins[i].name) < 0);
        if (strncmp(list->bins[i].name, "lt", 2) == 0 && strlen(list->bins[i].name) == 6)
            tables++;
        if (strcmp(list->bins[i].name, "lt0100") == 0)
            assert_int_equal(list->bins[i].n_items, 1);
        plain += strcmp(list->bins[i].name, "lt0100x") == 0;
    }
    ts_bin_list_free(list);
    assert_int_equal(tables, 4200);
    assert_int_equal(plain, 1);
    assert_true(stat_int("lists_offloop") >= 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prioritized_chi2),
        cmocka_unit_test(test_uniform_fifo_lifo),
        cmocka_unit_test(test_removers),
        cmocka_unit_test(test_update),
        cmocka_unit_test(test_rate_limiter_band),
        cmocka_unit_test(test_waits),
        cmocka_unit_test(test_shutdown),
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_bad_config),
        cmocka_unit_test(test_raw_bad_input),
        cmocka_unit_test(test_insert_refused_early),
        cmocka_unit_test(test_memory),
        cmocka_unit_test(test_list_offloop),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
