/* The bin store of tensord: items, the name table, bins, ordering and memory accounting. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "server.h"

/* A new item of len bytes filled with tag. */
static tsd_item *item(size_t len, uint8_t tag)
{
    tsd_item *it = tsd_item_new(len);
    assert_non_null(it);
    assert_int_equal((uintptr_t)tsd_item_data(it) % TS__ALIGN, 0);
    memset(tsd_item_data(it), tag, len);
    return it;
}

static tsd_bin *add(tsd_store *s, const char *name, size_t len, uint8_t tag, int replace,
                    uint64_t version)
{
    assert_int_equal(tsd_store_reserve(s, len), 0);
    tsd_bin *b =
        tsd_store_add(s, (const uint8_t *)name, strlen(name), item(len, tag), replace, version);
    assert_non_null(b);
    return b;
}

static void test_item_refcount(void **state)
{
    (void)state;
    tsd_item *it = item(100, 1);
    tsd_item_ref(it);
    tsd_item_unref(it);
    assert_int_equal(atomic_load(&it->refs), 1);
    tsd_item_unref(it); /* freed; ASan reports a leak or double free otherwise */
    tsd_item_unref(NULL);
    /* Large items come from the huge-page path and are freed with their size. */
    tsd_item *big = item((size_t)5 << 20, 2);
    tsd_item_unref(big);
}

static void test_buffer_pool(void **state)
{
    (void)state;
    tsd_pool_drain();
    tsd_item *a = tsd_item_new((size_t)5 << 20);
    assert_non_null(a);
    assert_int_equal(tsd_item_len(a), (size_t)5 << 20);
    assert_int_equal(a->slot, TSD_ITEM_OWN);
    uint8_t *data = tsd_item_data(a);
    memset(data, 7, tsd_item_len(a));
    tsd_item_unref(a);
    assert_int_equal(tsd_pool_bytes(), (uint64_t)6 << 20);
    /* A similar size reuses the buffer. */
    tsd_item *b = tsd_item_new(((size_t)5 << 20) + 12345);
    assert_ptr_equal(tsd_item_data(b), data);
    assert_int_equal(tsd_pool_bytes(), 0);
    /* A different size class does not. */
    tsd_item *c = tsd_item_new((size_t)9 << 20);
    assert_ptr_not_equal(tsd_item_data(c), data);
    tsd_item_unref(b);
    tsd_item_unref(c);
    assert_int_equal(tsd_pool_bytes(), (uint64_t)16 << 20);
    /* The pool is bounded in count. */
    tsd_item *many[TSD_POOL_MAX_BUFS + 3];
    for (size_t i = 0; i < TS__ARRAY_SIZE(many); i++)
        many[i] = tsd_item_new((size_t)(12 + 2 * i) << 20);
    for (size_t i = 0; i < TS__ARRAY_SIZE(many); i++)
        tsd_item_unref(many[i]);
    assert_true(tsd_pool_bytes() <= TSD_POOL_MAX_BYTES);
    /* Small items never enter the pool. */
    tsd_pool_drain();
    tsd_item_unref(item(1000, 1));
    assert_int_equal(tsd_pool_bytes(), 0);
}

static void test_put_append_pop(void **state)
{
    (void)state;
    tsd_store s;
    assert_int_equal(tsd_store_init(&s, 0), 0);
    tsd_bin *b = add(&s, "x", 10, 1, 0, 5);
    assert_int_equal(b->n_items, 1);
    assert_int_equal(b->version, 5);
    add(&s, "x", 20, 2, 0, 6);
    add(&s, "x", 30, 3, 0, 7);
    assert_int_equal(b->n_items, 3);
    assert_int_equal(b->bytes, 60);
    assert_int_equal(s.held, 60);
    assert_int_equal(s.n_items, 3);
    assert_int_equal(s.reserved, 0);

    /* Oldest first. */
    tsd_item *it = tsd_store_pop(&s, b);
    assert_int_equal(tsd_item_len(it), 10);
    assert_int_equal(tsd_item_data(it)[0], 1);
    tsd_item_unref(it);
    assert_int_equal(b->n_items, 2);
    assert_int_equal(s.held, 50);

    /* Replace drops every item. */
    tsd_bin *b2 = add(&s, "x", 7, 9, 1, 8);
    assert_ptr_equal(b2, b);
    assert_int_equal(b->n_items, 1);
    assert_int_equal(b->bytes, 7);
    assert_int_equal(s.held, 7);
    assert_int_equal(tsd_item_data(b->head)[0], 9);

    tsd_store_remove(&s, b);
    assert_null(tsd_store_find(&s, (const uint8_t *)"x", 1));
    assert_int_equal(s.held, 0);
    assert_int_equal(s.n_items, 0);
    assert_int_equal(s.bins.count, 0);
    tsd_store_free(&s);
}

static void test_names_are_bytes(void **state)
{
    (void)state;
    tsd_store s;
    assert_int_equal(tsd_store_init(&s, 0), 0);
    /* The empty name, names with NUL bytes and prefixes are all distinct bins. */
    const uint8_t a[] = {'a'}, a0[] = {'a', 0}, a0b[] = {'a', 0, 'b'};
    assert_int_equal(tsd_store_reserve(&s, 48), 0);
    assert_non_null(tsd_store_add(&s, (const uint8_t *)"", 0, item(16, 0), 0, 1));
    assert_non_null(tsd_store_add(&s, a, 1, item(16, 1), 0, 2));
    assert_non_null(tsd_store_add(&s, a0, 2, item(16, 2), 0, 3));
    assert_int_equal(tsd_store_reserve(&s, 16), 0);
    assert_non_null(tsd_store_add(&s, a0b, 3, item(16, 3), 0, 4));
    assert_int_equal(s.bins.count, 4);
    assert_int_equal(tsd_item_data(tsd_store_find(&s, a0, 2)->head)[0], 2);
    assert_int_equal(tsd_item_data(tsd_store_find(&s, (const uint8_t *)"", 0)->head)[0], 0);
    assert_null(tsd_store_find(&s, (const uint8_t *)"b", 1));

    tsd_bin **arr;
    size_t n;
    assert_int_equal(tsd_store_sorted(&s, &arr, &n), 0);
    assert_int_equal(n, 4);
    assert_int_equal(arr[0]->node.name_len, 0);
    assert_int_equal(arr[1]->node.name_len, 1);
    assert_int_equal(arr[2]->node.name_len, 2);
    assert_int_equal(arr[3]->node.name_len, 3);
    ts__free(arr);
    tsd_store_free(&s);
}

static void test_many_bins_grow_table(void **state)
{
    (void)state;
    tsd_store s;
    assert_int_equal(tsd_store_init(&s, 0), 0);
    char name[32];
    for (int i = 0; i < 5000; i++) {
        snprintf(name, sizeof(name), "bin-%05d", 4999 - i);
        add(&s, name, 16, (uint8_t)i, 0, (uint64_t)i + 1);
    }
    assert_int_equal(s.bins.count, 5000);
    assert_true(s.bins.mask + 1 >= 4096);
    for (int i = 0; i < 5000; i += 97) {
        snprintf(name, sizeof(name), "bin-%05d", i);
        tsd_bin *b = tsd_store_find(&s, (const uint8_t *)name, strlen(name));
        assert_non_null(b);
        assert_int_equal(b->version, (uint64_t)(4999 - i) + 1);
    }
    tsd_bin **arr;
    size_t n;
    assert_int_equal(tsd_store_sorted(&s, &arr, &n), 0);
    assert_int_equal(n, 5000);
    for (size_t i = 1; i < n; i++)
        assert_true(memcmp(arr[i - 1]->node.name, arr[i]->node.name, 9) < 0);
    ts__free(arr);
    /* Remove half, the rest stays findable. */
    for (int i = 0; i < 5000; i += 2) {
        snprintf(name, sizeof(name), "bin-%05d", i);
        tsd_store_remove(&s, tsd_store_find(&s, (const uint8_t *)name, strlen(name)));
    }
    assert_int_equal(s.bins.count, 2500);
    assert_non_null(tsd_store_find(&s, (const uint8_t *)"bin-00001", 9));
    assert_null(tsd_store_find(&s, (const uint8_t *)"bin-00002", 9));
    assert_int_equal(s.held, 2500 * 16);
    tsd_store_free(&s);
}

static void test_memory_limit(void **state)
{
    (void)state;
    tsd_store s;
    assert_int_equal(tsd_store_init(&s, 1000), 0);
    assert_int_equal(tsd_store_reserve(&s, 600), 0);
    /* A second upload in flight counts against the limit too. */
    assert_int_equal(tsd_store_reserve(&s, 500), TS_EOOM);
    assert_int_equal(tsd_store_reserve(&s, 400), 0);
    assert_int_equal(s.reserved, 1000);
    tsd_store_unreserve(&s, 400);
    tsd_bin *b = tsd_store_add(&s, (const uint8_t *)"m", 1, item(600, 1), 0, 1);
    assert_non_null(b);
    assert_int_equal(s.reserved, 0);
    assert_int_equal(s.held, 600);
    assert_int_equal(tsd_store_reserve(&s, 401), TS_EOOM);
    assert_int_equal(tsd_store_reserve(&s, UINT64_MAX), TS_EOOM);
    /* Popping frees the budget (the empty bin itself still costs its overhead). */
    tsd_item_unref(tsd_store_pop(&s, b));
    assert_int_equal(s.held, 0);
    assert_true(s.overhead > 0);
    assert_int_equal(tsd_store_reserve(&s, 1000 - s.overhead + 1), TS_EOOM);
    assert_int_equal(tsd_store_reserve(&s, 1000 - s.overhead), 0);
    tsd_store_unreserve(&s, 1000 - s.overhead);
    tsd_store_remove(&s, b);
    tsd_store_free(&s);

    /* 0 = unlimited. */
    assert_int_equal(tsd_store_init(&s, 0), 0);
    assert_int_equal(tsd_store_reserve(&s, (uint64_t)1 << 62), 0);
    tsd_store_unreserve(&s, (uint64_t)1 << 62);
    tsd_store_free(&s);
}

static void test_add_fails_cleanly(void **state)
{
    (void)state;
    tsd_store s;
    assert_int_equal(tsd_store_init(&s, 0), 0);
    tsd_item *it = item(32, 1);
    assert_int_equal(tsd_store_reserve(&s, 32), 0);
    /* The bin allocation fails: the item and the reservation stay the caller's. */
    ts__alloc_fail_after(1);
    assert_null(tsd_store_add(&s, (const uint8_t *)"f", 1, it, 0, 1));
    ts__alloc_fail_after(-1);
    assert_int_equal(s.reserved, 32);
    assert_int_equal(s.held, 0);
    assert_non_null(tsd_store_add(&s, (const uint8_t *)"f", 1, it, 0, 1));
    tsd_store_free(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_item_refcount),        cmocka_unit_test(test_buffer_pool),
        cmocka_unit_test(test_put_append_pop),       cmocka_unit_test(test_names_are_bytes),
        cmocka_unit_test(test_many_bins_grow_table), cmocka_unit_test(test_memory_limit),
        cmocka_unit_test(test_add_fails_cleanly),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    tsd_pool_drain();
    return rc;
}
