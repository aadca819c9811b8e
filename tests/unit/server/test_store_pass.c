/*
 * Point-in-time passes over the bin store (store.c), driven directly: every pass must hand its
 * owner each bin that existed when it began exactly once, in that moment's state, while bins
 * are added, appended to, replaced, popped and removed between its steps, the name table
 * doubles under its cursor and other passes overlap it. Each pass is checked against a copy of
 * the store taken when it began (a whole walk at once). Also: the 32-bit pass counter running
 * out and starting again, the store freed under a pass, and the memory counters coming back to
 * where they were once the passes let their items go.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "server.h"

#define P_NAMES   3000u  /* names the random test picks from (the table doubles 64 -> 4096) */
#define P_OPS     60000u /* random operations in the random test */
#define P_PASSES  4u     /* passes overlapping at most */
#define P_MAX_BIN 4u     /* items a bin holds at most in the random test */

/* One bin as a pass saw it: its name and counters, and a reference to each of its items. */
typedef struct seen {
    uint8_t name[TS_MAX_NAME_LEN];
    size_t name_len;
    uint32_t n_items;
    uint64_t bytes, version;
    tsd_item **items;
} seen;

/* A pass that records what it is handed (the pass first: emit gets it back). */
typedef struct rec {
    tsd_pass pass;
    seen *s;
    size_t n, cap;
    int active;
    struct rec *truth; /* the store when the pass began */
} rec;

static int rec_emit(tsd_pass *p, const tsd_bin *b)
{
    rec *r = (rec *)(void *)p;
    if (r->n == r->cap) {
        r->cap = r->cap ? r->cap * 2 : 64;
        r->s = realloc(r->s, r->cap * sizeof(*r->s));
        assert_non_null(r->s);
    }
    seen *e = &r->s[r->n++];
    memcpy(e->name, b->node.name, b->node.name_len);
    e->name_len = b->node.name_len;
    e->n_items = b->n_items;
    e->bytes = b->bytes;
    e->version = b->version;
    e->items = calloc(b->n_items + 1, sizeof(*e->items));
    assert_non_null(e->items);
    uint32_t k = 0;
    for (tsd_item *it = b->head; it != NULL; it = it->next) {
        assert_true(k < b->n_items);
        tsd_item_ref(it);
        e->items[k++] = it;
    }
    assert_int_equal(k, b->n_items);
    return 0;
}

static void rec_done(tsd_pass *p, int status)
{
    (void)p;
    (void)status;
}

static void rec_init(rec *r)
{
    memset(r, 0, sizeof(*r));
    r->pass.emit = rec_emit;
    r->pass.done = rec_done;
}

/* Drop what r holds (references included). */
static void rec_clear(rec *r)
{
    for (size_t i = 0; i < r->n; i++) {
        for (uint32_t k = 0; k < r->s[i].n_items; k++)
            tsd_item_unref(r->s[i].items[k]);
        free(r->s[i].items);
    }
    free(r->s);
    r->s = NULL;
    r->n = r->cap = 0;
}

static int seen_cmp(const void *a, const void *b)
{
    const seen *x = a, *y = b;
    size_t n = x->name_len < y->name_len ? x->name_len : y->name_len;
    int c = memcmp(x->name, y->name, n);
    if (c != 0)
        return c;
    return (x->name_len > y->name_len) - (x->name_len < y->name_len);
}

/* What a pass saw must equal the truth: the same bins once each, the same counters and items. */
static void rec_check(rec *got, rec *want)
{
    qsort(got->s, got->n, sizeof(*got->s), seen_cmp);
    qsort(want->s, want->n, sizeof(*want->s), seen_cmp);
    assert_int_equal(got->n, want->n);
    assert_int_equal(got->pass.emitted, want->n);
    for (size_t i = 0; i < got->n; i++) {
        const seen *g = &got->s[i], *w = &want->s[i];
        assert_int_equal(g->name_len, w->name_len);
        assert_memory_equal(g->name, w->name, g->name_len);
        assert_int_equal(g->n_items, w->n_items);
        assert_int_equal(g->bytes, w->bytes);
        assert_int_equal(g->version, w->version);
        for (uint32_t k = 0; k < g->n_items; k++)
            assert_ptr_equal(g->items[k], w->items[k]);
    }
}

/* Begin r on s, and take the truth it must match (the whole store, now). */
static void rec_begin(tsd_store *s, rec *r)
{
    rec_init(r);
    r->truth = calloc(1, sizeof(*r->truth));
    assert_non_null(r->truth);
    rec_init(r->truth);
    assert_int_equal(tsd_store_pass_run(s, &r->truth->pass), 0);
    assert_int_equal(tsd_store_pass_begin(s, &r->pass), 0);
    r->active = 1;
}

/* r's walk is over: unlink it, check it and let go of everything. */
static void rec_finish(tsd_store *s, rec *r)
{
    tsd_store_pass_end(s, &r->pass);
    assert_int_equal(r->pass.err, 0);
    rec_check(r, r->truth);
    rec_clear(r);
    rec_clear(r->truth);
    free(r->truth);
    r->truth = NULL;
    r->active = 0;
}

/* Walk r to its end in steps of budget. */
static void rec_walk(tsd_store *s, rec *r, size_t budget)
{
    for (int guard = 0; guard < 100000000; guard++) {
        size_t b = budget;
        if (tsd_store_pass_step(s, &r->pass, &b))
            return;
    }
    fail_msg("a pass never ended");
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint32_t rnd(uint32_t n)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state % n);
}

static uint64_t version;

static void name_of(uint32_t i, char *buf, size_t cap)
{
    snprintf(buf, cap, "bin-%u", i);
}

/* PUT (replace) or APPEND an item of a length chosen from i into the bin named i. */
static void put(tsd_store *s, uint32_t i, int replace, size_t len)
{
    char nm[32];
    name_of(i, nm, sizeof(nm));
    tsd_item *it = tsd_item_new(len);
    assert_non_null(it);
    memset(tsd_item_data(it), (int)(i & 0xff), len);
    assert_int_equal(tsd_store_reserve(s, len), 0);
    assert_non_null(tsd_store_add(s, (const uint8_t *)nm, strlen(nm), it, replace, ++version));
}

static tsd_bin *find(tsd_store *s, uint32_t i)
{
    char nm[32];
    name_of(i, nm, sizeof(nm));
    return tsd_store_find(s, (const uint8_t *)nm, strlen(nm));
}

/* GET of one item, as ops.c does it: pop, then remove the bin once empty. */
static void get_one(tsd_store *s, tsd_bin *b)
{
    tsd_item_unref(tsd_store_pop(s, b));
    if (b->n_items == 0)
        tsd_store_remove(s, b);
    else
        b->version = ++version;
}

/* One random change of the store. */
static void random_op(tsd_store *s)
{
    uint32_t i = rnd(P_NAMES);
    tsd_bin *b = find(s, i);
    uint32_t op = rnd(10);
    size_t len = 1 + rnd(200);
    if (b == NULL || op < 3) {
        put(s, i, 1, len);
    } else if (op < 6) {
        if (b->n_items < P_MAX_BIN)
            put(s, i, 0, len);
        else
            get_one(s, b);
    } else if (op < 9) {
        get_one(s, b);
    } else {
        tsd_store_remove(s, b);
    }
}

/*
 * Random changes between the steps of up to P_PASSES overlapping passes, begun at random times
 * and walked with random budgets, while the bins grow from none to about P_NAMES (the table
 * doubles several times under the passes' cursors).
 */
static void test_passes_random(void **state)
{
    (void)state;
    tsd_store s;
    assert_int_equal(tsd_store_init(&s, 0), 0);
    rec r[P_PASSES];
    memset(r, 0, sizeof(r));
    size_t done = 0;
    for (uint32_t op = 0; op < P_OPS; op++) {
        random_op(&s);
        uint32_t k = rnd(P_PASSES);
        if (!r[k].active) {
            if (rnd(50) == 0)
                rec_begin(&s, &r[k]);
            continue;
        }
        size_t budget = 1 + rnd(40);
        if (tsd_store_pass_step(&s, &r[k].pass, &budget)) {
            rec_finish(&s, &r[k]);
            done++;
        }
    }
    for (uint32_t k = 0; k < P_PASSES; k++)
        if (r[k].active) {
            rec_walk(&s, &r[k], 7);
            rec_finish(&s, &r[k]);
            done++;
        }
    assert_true(done > 20);
    assert_true(s.captures > 0);
    assert_null(s.passes);
    assert_int_equal(s.n_passes, 0);
    /* Every reference the passes took is gone: nothing counts as orphaned any more. */
    assert_int_equal(s.orphaned_bytes, 0);
    assert_int_equal(s.reserved, 0);
    tsd_store_free(&s);
}

/*
 * Fill the store with exactly 64 bins (the smallest table, full: the next new bin doubles it),
 * walk a pass to each bucket position, then double the table there, change bins on both sides
 * of the cursor and finish the walk: exact at every position, the first and last buckets
 * included. Twice at each position: once one bucket per step, once with a budget that ends
 * mid-way.
 */
static void test_doubling_at_every_cursor(void **state)
{
    (void)state;
    for (uint32_t at = 0; at <= 64; at++) {
        tsd_store s;
        assert_int_equal(tsd_store_init(&s, 0), 0);
        for (uint32_t i = 0; i < 64; i++)
            put(&s, i, 1, 8);
        assert_int_equal(s.bins.mask, 63);
        rec r;
        rec_begin(&s, &r);
        int over = 0;
        for (uint32_t k = 0; k < at && !over; k++) {
            size_t one = 1;
            over = tsd_store_pass_step(&s, &r.pass, &one);
        }
        assert_int_equal(over, at == 64);
        assert_int_equal(r.pass.cur, (uint64_t)at << 26);
        /* Double the table (and again), change every old bin, remove some. */
        for (uint32_t i = 64; i < 200; i++)
            put(&s, i, 1, 8);
        assert_int_equal(s.bins.mask, 255);
        for (uint32_t i = 0; i < 64; i++) {
            tsd_bin *b = find(&s, i);
            if (i % 3 == 0)
                tsd_store_remove(&s, b);
            else if (i % 3 == 1)
                put(&s, i, 0, 16);
            else
                put(&s, i, 1, 24);
        }
        if (!over)
            rec_walk(&s, &r, 1 + at % 5);
        rec_finish(&s, &r);
        assert_int_equal(s.orphaned_bytes, 0);
        tsd_store_free(&s);
    }
}

/*
 * The pass counter is 32 bits. Near its end, passes begin, overlap and end as ever; the pass
 * that would need a number past 2^32 - 1 while another runs is refused (TS_EAGAIN: the caller
 * walks it whole at once); once none runs, the numbers start again and the next passes are
 * exact, bins created or captured under the last numbers included.
 */
static void test_pass_counter_wraps(void **state)
{
    (void)state;
    tsd_store s;
    assert_int_equal(tsd_store_init(&s, 0), 0);
    for (uint32_t i = 0; i < 300; i++)
        put(&s, i, 1, 8);
    s.pass_gen = UINT32_MAX - 4;
    /* Overlapping passes take the last four numbers. */
    rec a, b, c;
    rec_begin(&s, &a);
    for (uint32_t i = 0; i < 100; i++)
        random_op(&s);
    rec_begin(&s, &b);
    size_t one = 50;
    (void)tsd_store_pass_step(&s, &b.pass, &one);
    for (uint32_t i = 0; i < 100; i++)
        random_op(&s);
    rec_begin(&s, &c);
    assert_int_equal(c.pass.gen, UINT32_MAX - 1);
    /* Bins created now carry the last number but one; changed ones get captured. */
    for (uint32_t i = 300; i < 400; i++)
        put(&s, i, 1, 8);
    for (uint32_t i = 0; i < 200; i++)
        random_op(&s);
    rec_walk(&s, &a, 13);
    rec_finish(&s, &a);
    rec d;
    rec_begin(&s, &d);
    assert_int_equal(d.pass.gen, UINT32_MAX);
    for (uint32_t i = 0; i < 200; i++)
        random_op(&s);
    /* No number is left while passes run: refused. */
    rec e;
    rec_init(&e);
    assert_int_equal(tsd_store_pass_begin(&s, &e.pass), TS_EAGAIN);
    assert_int_equal(s.n_passes, 3);
    rec_walk(&s, &b, 3);
    rec_finish(&s, &b);
    for (uint32_t i = 400; i < 450; i++)
        put(&s, i, 1, 8);
    rec_walk(&s, &c, 17);
    rec_finish(&s, &c);
    rec_walk(&s, &d, 1);
    rec_finish(&s, &d);
    /* None runs: the numbers start again. */
    for (int round = 0; round < 4; round++) {
        rec f, g;
        rec_begin(&s, &f);
        assert_int_equal(f.pass.gen, (uint32_t)(2 * round + 1));
        for (uint32_t i = 0; i < 150; i++)
            random_op(&s);
        rec_begin(&s, &g);
        for (uint32_t i = 0; i < 150; i++)
            random_op(&s);
        rec_walk(&s, &f, 5);
        rec_finish(&s, &f);
        for (uint32_t i = 0; i < 150; i++)
            random_op(&s);
        rec_walk(&s, &g, 9);
        rec_finish(&s, &g);
    }
    assert_int_equal(s.orphaned_bytes, 0);
    tsd_store_free(&s);
}

/*
 * The store freed while a pass is linked: the pass ends at its next step with TS_ECANCELED,
 * and the items it took stay valid until it lets them go (freed then, not counted anywhere).
 */
static void test_store_freed_under_pass(void **state)
{
    (void)state;
    tsd_store s;
    assert_int_equal(tsd_store_init(&s, 0), 0);
    for (uint32_t i = 0; i < 500; i++)
        put(&s, i, 1, 100 + i);
    rec r;
    rec_init(&r);
    assert_int_equal(tsd_store_pass_begin(&s, &r.pass), 0);
    size_t budget = 100;
    assert_int_equal(tsd_store_pass_step(&s, &r.pass, &budget), 0);
    for (uint32_t i = 0; i < 500; i += 2)
        put(&s, i, 1, 7);
    size_t taken = r.n;
    assert_true(taken > 0);
    tsd_store_free(&s);
    budget = 100;
    assert_int_equal(tsd_store_pass_step(&s, &r.pass, &budget), 1);
    assert_int_equal(r.pass.err, TS_ECANCELED);
    assert_int_equal(r.n, taken);
    for (size_t i = 0; i < r.n; i++)
        for (uint32_t k = 0; k < r.s[i].n_items; k++)
            assert_true(tsd_item_len(r.s[i].items[k]) >= 7);
    rec_clear(&r);
}

/*
 * A pass whose emit visits every item (per_item 1, a snapshot) counts them against its budget:
 * a step stops at the first bucket whose bins use the budget up, and a bin is never split.
 */
static void test_budget_counts_items(void **state)
{
    (void)state;
    tsd_store s;
    assert_int_equal(tsd_store_init(&s, 0), 0);
    for (uint32_t i = 0; i < 8; i++)
        for (uint32_t k = 0; k < 100; k++)
            put(&s, i, 0, 8);
    rec r;
    rec_begin(&s, &r);
    r.pass.per_item = 1;
    uint64_t steps = 0;
    for (int over = 0; !over; steps++) {
        size_t budget = 50;
        uint64_t before = r.pass.emitted, work = r.pass.work;
        over = tsd_store_pass_step(&s, &r.pass, &budget);
        if (r.pass.emitted > before) {
            assert_int_equal(budget, 0);
            assert_true(r.pass.work - work >= 101);
        }
    }
    /* One step per bucket holding bins at least (a bucket's bins are walked together). */
    uint64_t filled = 0;
    for (size_t i = 0; i <= s.bins.mask; i++)
        filled += s.bins.buckets[i] != NULL;
    assert_true(filled >= 2);
    assert_true(steps >= filled);
    rec_finish(&s, &r);
    /* Without per_item the same budget walks several bins a step. */
    rec_begin(&s, &r);
    size_t budget = 64 + 8;
    assert_int_equal(tsd_store_pass_step(&s, &r.pass, &budget), 1);
    assert_int_equal(r.pass.emitted, 8);
    rec_finish(&s, &r);
    tsd_store_free(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_passes_random),       cmocka_unit_test(test_doubling_at_every_cursor),
        cmocka_unit_test(test_pass_counter_wraps),  cmocka_unit_test(test_store_freed_under_pass),
        cmocka_unit_test(test_budget_counts_items),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
