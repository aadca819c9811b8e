/*
 * Embedding tables on a cluster client (docs/PS.md "Several daemons"): three sharded tensord and
 * one plain tensord. The rows a cluster handle pulls are those one daemon makes for the same
 * seed, bit for bit; each row lives on the shard owning the slot of its id's 8 little-endian
 * bytes (checked by asking every shard directly); duplicate ids are merged and the caller's order
 * restored; Adam pushes through the cluster give the values they give on one daemon; the
 * versions come per shard.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cluster.h"
#include "harness.h"
#include "slot.h"
#include "tensorshare/ps.h"

#define N_SHARDS 3
/* floats per row */
#define DIM 5
/* ids of the table the tests use (0..IDS-1) */
#define IDS 300

static tsc_cluster cc;
static tsh_server one;
static ts_client_t *plain[N_SHARDS]; /* one ordinary client per shard */
static ts_client_t *single;          /* the plain daemon */
static ts_client_t *h;               /* the cluster handle */

static ts_client_t *open_at(const char *addr)
{
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.connect_timeout_ms = 2000;
    o.request_timeout_ms = 5000;
    ts_client_t *c = NULL;
    int rc = ts_client_open(&c, addr, &o);
    if (rc != 0)
        fprintf(stderr, "open %s: %s (%s)\n", addr, ts_strerror(rc), ts_last_error());
    return rc == 0 ? c : NULL;
}

static int group_setup(void **state)
{
    (void)state;
    if (tsc_start(&cc, N_SHARDS, NULL) != 0 || tsh_server_start(&one, NULL) != 0)
        return -1;
    for (int i = 0; i < N_SHARDS; i++) {
        if ((plain[i] = open_at(cc.srv[i].addr)) == NULL)
            return -1;
    }
    single = open_at(one.addr);
    h = open_at(cc.list);
    return single != NULL && h != NULL ? 0 : -1;
}

static int group_teardown(void **state)
{
    (void)state;
    ts_client_free(h);
    ts_client_free(single);
    for (int i = 0; i < N_SHARDS; i++)
        ts_client_free(plain[i]);
    tsc_stop(&cc);
    return tsh_server_stop(&one) == 0 ? 0 : -1;
}

/* The shard of N_SHARDS that owns id under the default split. */
static int id_owner(int64_t id)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)((uint64_t)id >> (8 * i));
    uint16_t slot = ts__slot(b, sizeof(b));
    for (int i = N_SHARDS - 1; i >= 0; i--) {
        if (slot >= ts__slot_split_first((uint32_t)i, N_SHARDS))
            return i;
    }
    return 0;
}

static void make_table(const char *name, ts_ps_optimizer_t opt)
{
    ts_emb_options_t o;
    ts_emb_options_init(&o, DIM);
    o.optimizer = opt;
    o.lr = 0.05;
    o.seed = 77;
    o.num_ids = IDS;
    o.init = TS_PS_INIT_NORMAL;
    o.init_scale = 0.5;
    assert_int_equal(ts_emb_create(h, name, &o), 0);
    assert_int_equal(ts_emb_create(single, name, &o), 0);
    /* Created on every shard: each answers it directly, and other settings are refused. */
    for (int i = 0; i < N_SHARDS; i++)
        assert_int_equal(ts_emb_create(plain[i], name, &o), 0);
    o.seed = 78;
    assert_int_equal(ts_emb_create(h, name, &o), TS_EINVAL);
    /* The message names the shard by its address. */
    char want[160];
    int named = 0;
    for (int i = 0; i < N_SHARDS; i++) {
        snprintf(want, sizeof(want), "the cluster's shard at %s (", cc.srv[i].addr);
        named |= strstr(ts_last_error(), want) != NULL;
    }
    assert_true(named);
}

/* ids in a scrambled order with duplicates: every id of 0..IDS-1 at least once. */
static size_t scrambled(int64_t *ids, size_t cap)
{
    size_t n = 0;
    for (int64_t i = 0; i < IDS && n < cap; i++)
        ids[n++] = (i * 7919) % IDS;
    for (int64_t i = 0; i < IDS / 3 && n < cap; i++)
        ids[n++] = (i * 31) % IDS;
    return n;
}

static void test_rows_as_one_daemon(void **state)
{
    (void)state;
    make_table("emb.rows", TS_PS_SGD);
    int64_t ids[2 * IDS];
    size_t n = scrambled(ids, 2 * IDS);
    float *a = calloc(n * DIM, sizeof(float)), *b = calloc(n * DIM, sizeof(float));
    assert_non_null(a);
    assert_non_null(b);
    uint64_t v = 0;
    assert_int_equal(ts_emb_pull(h, "emb.rows", ids, n, DIM, a, &v), 0);
    assert_int_equal(ts_emb_pull(single, "emb.rows", ids, n, DIM, b, NULL), 0);
    assert_memory_equal(a, b, n * DIM * sizeof(float));
    /* Every shard made the rows of its own ids only: its version moved, the pull was split. */
    uint64_t vs[N_SHARDS + 1];
    size_t nv = 0;
    assert_int_equal(ts_emb_versions(h, "emb.rows", vs, N_SHARDS + 1, &nv), 0);
    assert_int_equal(nv, N_SHARDS);
    assert_int_equal(ts_emb_versions(single, "emb.rows", vs, 1, &nv), 0);
    assert_int_equal(nv, 1);
    /* An empty pull is fine, and out-of-range ids are refused with nothing made. */
    assert_int_equal(ts_emb_pull(h, "emb.rows", ids, 0, DIM, a, NULL), 0);
    int64_t bad[2] = {1, IDS};
    assert_int_equal(ts_emb_pull(h, "emb.rows", bad, 2, DIM, a, NULL), TS_EINVAL);
    assert_int_equal(ts_emb_pull(h, "emb.missing", ids, 3, DIM, a, NULL), TS_ENOENT);
    free(a);
    free(b);
}

static void test_push_lands_on_owner(void **state)
{
    (void)state;
    make_table("emb.adam", TS_PS_ADAM);
    int64_t ids[2 * IDS];
    size_t n = scrambled(ids, 2 * IDS);
    float *g = malloc(n * DIM * sizeof(float));
    assert_non_null(g);
    for (size_t i = 0; i < n * DIM; i++)
        g[i] = (float)((int)(i % 13) - 6) * 0.125f;
    uint64_t before[N_SHARDS], after[N_SHARDS];
    size_t nv = 0;
    assert_int_equal(ts_emb_versions(h, "emb.adam", before, N_SHARDS, &nv), 0);
    for (int step = 0; step < 3; step++) {
        assert_int_equal(ts_emb_push(h, "emb.adam", ids, n, DIM, g, 0.5, NULL), 0);
        assert_int_equal(ts_emb_push(single, "emb.adam", ids, n, DIM, g, 0.5, NULL), 0);
    }
    assert_int_equal(ts_emb_versions(h, "emb.adam", after, N_SHARDS, &nv), 0);
    for (int i = 0; i < N_SHARDS; i++)
        assert_true(after[i] > before[i]);

    /* Every row equals one daemon's, duplicates merged into one step each, order restored. */
    float *a = calloc(n * DIM, sizeof(float)), *b = calloc(n * DIM, sizeof(float));
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(ts_emb_pull(h, "emb.adam", ids, n, DIM, a, NULL), 0);
    assert_int_equal(ts_emb_pull(single, "emb.adam", ids, n, DIM, b, NULL), 0);
    assert_memory_equal(a, b, n * DIM * sizeof(float));

    /*
     * Asked directly, the owner of each id holds the pushed row; the other shards, which never
     * saw it, make the untouched initial row (as a fresh table of the same seed does).
     */
    make_table("emb.fresh", TS_PS_ADAM);
    for (int64_t id = 0; id < IDS; id += 7) {
        float fresh[DIM], row[DIM], want[DIM];
        assert_int_equal(ts_emb_pull(single, "emb.adam", &id, 1, DIM, want, NULL), 0);
        assert_int_equal(ts_emb_pull(single, "emb.fresh", &id, 1, DIM, fresh, NULL), 0);
        assert_memory_not_equal(want, fresh, sizeof(want));
        for (int s = 0; s < N_SHARDS; s++) {
            assert_int_equal(ts_emb_pull(plain[s], "emb.adam", &id, 1, DIM, row, NULL), 0);
            assert_memory_equal(row, s == id_owner(id) ? want : fresh, sizeof(row));
        }
    }

    /* A push of one shard's ids moves that shard's version only. */
    int64_t only[4];
    size_t k = 0;
    for (int64_t id = 0; id < IDS && k < 4; id++)
        if (id_owner(id) == 1)
            only[k++] = id;
    assert_int_equal(ts_emb_versions(h, "emb.adam", before, N_SHARDS, &nv), 0);
    uint64_t top = 0;
    assert_int_equal(ts_emb_push(h, "emb.adam", only, k, DIM, g, 1.0, &top), 0);
    assert_int_equal(ts_emb_versions(h, "emb.adam", after, N_SHARDS, &nv), 0);
    assert_int_equal(after[0], before[0]);
    assert_true(after[1] > before[1]);
    assert_int_equal(after[2], before[2]);
    assert_int_equal(top, after[1]);

    /* Bad input is refused before anything changes: a NaN on one shard's row. */
    g[DIM * 3] = 0.0f / 0.0f;
    assert_int_equal(ts_emb_push(h, "emb.adam", ids, n, DIM, g, 1.0, NULL), TS_EINVAL);
    free(a);
    free(b);
    free(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows_as_one_daemon),
        cmocka_unit_test(test_push_lands_on_owner),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
