/* tensord's slabs: size classes, slot reuse, returning empty slabs, allocation failures. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "server.h"

#if defined(__SANITIZE_ADDRESS__)
#define TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TEST_ASAN 1
#endif
#endif
#ifdef TEST_ASAN
#include <sanitizer/asan_interface.h>
#endif

static tsd_slab_stats stats(void)
{
    tsd_slab_stats st;
    tsd_slab_stats_get(&st);
    return st;
}

/* Every test starts and ends with no slab at all. */
static int setup(void **state)
{
    (void)state;
    tsd_slab_drain();
    return stats().slabs == 0 ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    tsd_slab_drain();
    tsd_slab_stats st = stats();
    return st.slabs == 0 && st.mapped == 0 && st.meta == 0 && st.slots_used == 0 ? 0 : -1;
}

/* The number of slots a slab of slot size size has (the first item of a fresh class tells). */
static size_t slots_per_slab(size_t size)
{
    size_t per64 = 64 * size;
    return 64 * ((TSD_SLAB_MIN_MAP + per64 - 1) / per64);
}

static void test_size_classes(void **state)
{
    (void)state;
    static const size_t lens[] = {1, 63, 64, 65, 100, 4160, 4161, TSD_SLAB_MAX - 1, TSD_SLAB_MAX};
    static const size_t want[] = {64, 64, 64, 128, 128, 4160, 4224, TSD_SLAB_MAX, TSD_SLAB_MAX};
    tsd_item *its[TS__ARRAY_SIZE(lens)];
    for (size_t i = 0; i < TS__ARRAY_SIZE(lens); i++) {
        its[i] = tsd_slab_alloc(lens[i]);
        assert_non_null(its[i]);
        assert_int_equal(tsd_slab_slot_size(its[i]), want[i]);
        assert_int_equal((uintptr_t)tsd_item_data(its[i]) % TS__ALIGN, 0);
        assert_null(its[i]->next);
        memset(tsd_item_data(its[i]), (int)i, want[i]);
    }
    tsd_slab_stats st = stats();
    assert_int_equal(st.slots_used, TS__ARRAY_SIZE(lens));
    /* Every mapping is a whole number of pages and at least TSD_SLAB_MIN_MAP bytes. */
    assert_int_equal(st.mapped % 4096, 0);
    for (size_t i = 0; i < TS__ARRAY_SIZE(lens); i++) {
        for (size_t k = 0; k < want[i]; k++)
            assert_int_equal(tsd_item_data(its[i])[k], (uint8_t)i);
        tsd_slab_free(its[i]);
    }
    assert_int_equal(stats().slots_used, 0);
}

static void test_slots_do_not_overlap(void **state)
{
    (void)state;
    const size_t size = 4160;
    size_t n = 2 * slots_per_slab(size) + 5;
    tsd_item **its = calloc(n, sizeof(*its));
    assert_non_null(its);
    for (size_t i = 0; i < n; i++) {
        its[i] = tsd_slab_alloc(size);
        assert_non_null(its[i]);
        memset(tsd_item_data(its[i]), (int)(i & 0xff), size);
    }
    tsd_slab_stats st = stats();
    assert_int_equal(st.slabs, 3);
    assert_int_equal(st.mapped, 3 * slots_per_slab(size) * size);
    /* The bookkeeping is a header per slot and a little more. */
    assert_true(st.meta < 3 * slots_per_slab(size) * (sizeof(tsd_item) + 2));
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(tsd_item_data(its[i])[0], (uint8_t)(i & 0xff));
        assert_int_equal(tsd_item_data(its[i])[size - 1], (uint8_t)(i & 0xff));
    }
    for (size_t i = 0; i < n; i++)
        tsd_slab_free(its[i]);
    free(its);
}

static void test_freed_slots_are_reused(void **state)
{
    (void)state;
    const size_t size = 1024;
    size_t per = slots_per_slab(size), n = 3 * per;
    tsd_item **its = calloc(n, sizeof(*its));
    assert_non_null(its);
    for (size_t i = 0; i < n; i++)
        assert_non_null(its[i] = tsd_slab_alloc(size));
    assert_int_equal(stats().slabs, 3);
    /* The last freed slot is the next one handed out. */
    uint8_t *d = tsd_item_data(its[7]);
    tsd_slab_free(its[7]);
#ifdef TEST_ASAN
    /* A free slot is poisoned: touching it after the last unref is reported. */
    assert_true(__asan_address_is_poisoned(d));
    assert_true(__asan_address_is_poisoned(d + size - 1));
    assert_false(__asan_address_is_poisoned(tsd_item_data(its[8])));
#endif
    its[7] = tsd_slab_alloc(size);
    assert_ptr_equal(tsd_item_data(its[7]), d);
    /* Free every other item: the same number again fits without a new slab. */
    for (size_t i = 0; i < n; i += 2)
        tsd_slab_free(its[i]);
    assert_int_equal(stats().slots_used, n / 2);
    for (size_t i = 0; i < n; i += 2)
        assert_non_null(its[i] = tsd_slab_alloc(size));
    assert_int_equal(stats().slabs, 3);
    for (size_t i = 0; i < n; i++)
        tsd_slab_free(its[i]);
    free(its);
}

static void test_empty_slabs_are_returned(void **state)
{
    (void)state;
    /* Fill slabs of the largest class well past what may be kept empty, then free them all. */
    const size_t size = TSD_SLAB_MAX;
    size_t per = slots_per_slab(size);
    size_t nslabs = (size_t)(TSD_SLAB_KEEP / (per * size)) + 3;
    size_t n = nslabs * per;
    tsd_item **its = calloc(n, sizeof(*its));
    assert_non_null(its);
    for (size_t i = 0; i < n; i++) {
        assert_non_null(its[i] = tsd_slab_alloc(size));
        tsd_item_data(its[i])[0] = 1;
    }
    assert_int_equal(stats().slabs, nslabs);
    for (size_t i = 0; i < n; i++)
        tsd_slab_free(its[i]);
    tsd_slab_stats st = stats();
    assert_int_equal(st.slots_used, 0);
    assert_true(st.empty_kept <= TSD_SLAB_KEEP);
    assert_int_equal(st.mapped, st.empty_kept);
    assert_true(st.slabs < nslabs);
    /* A kept slab serves the next record of its class without a new mapping. */
    uint64_t mapped = st.mapped;
    tsd_item *it = tsd_slab_alloc(size);
    assert_non_null(it);
    assert_int_equal(stats().mapped, mapped);
    assert_int_equal(stats().empty_kept, st.empty_kept - per * size);
    tsd_slab_free(it);
    assert_int_equal(stats().empty_kept, st.empty_kept);
    /* Draining unmaps them. */
    tsd_slab_drain();
    assert_int_equal(stats().slabs, 0);
    assert_int_equal(stats().empty_kept, 0);
    free(its);
}

static void test_allocation_failures(void **state)
{
    (void)state;
    /* The bookkeeping allocation fails, then the mapping: nothing is left behind. */
    for (long n = 1; n <= 2; n++) {
        ts__alloc_fail_after(n);
        assert_null(tsd_slab_alloc(300));
        ts__alloc_fail_after(-1);
        tsd_slab_stats st = stats();
        assert_int_equal(st.slabs, 0);
        assert_int_equal(st.mapped, 0);
        assert_int_equal(st.meta, 0);
    }
    /* Once the slab exists, its free slots need no allocation. */
    tsd_item *a = tsd_slab_alloc(300);
    assert_non_null(a);
    unsigned long before = ts__alloc_count();
    tsd_item *b = tsd_slab_alloc(300);
    assert_non_null(b);
    assert_int_equal(ts__alloc_count(), before);
    tsd_slab_free(a);
    tsd_slab_free(b);
}

static void test_items_use_slabs(void **state)
{
    (void)state;
    /* Small records are slab items; a record above TSD_SLAB_MAX has a buffer of its own. */
    tsd_item *s = tsd_item_new(4160);
    tsd_item *l = tsd_item_new(TSD_SLAB_MAX + 1);
    assert_non_null(s);
    assert_non_null(l);
    assert_int_not_equal(s->slot, TSD_ITEM_OWN);
    assert_int_equal(l->slot, TSD_ITEM_OWN);
    assert_int_equal(tsd_item_len(s), 4160);
    assert_int_equal(atomic_load(&s->refs), 1);
    assert_int_equal((uintptr_t)tsd_item_data(l) % TS__ALIGN, 0);
    memset(tsd_item_data(s), 1, tsd_item_len(s));
    memset(tsd_item_data(l), 2, tsd_item_len(l));
    assert_int_equal(stats().slots_used, 1);
    /* A shared item goes back to its slab with its last reference. */
    tsd_item_ref(s);
    tsd_item_unref(s);
    assert_int_equal(stats().slots_used, 1);
    /* The lz4 path shortens the record after allocating; the slot is still returned whole. */
    tsd_item_set_len(s, 100);
    assert_int_equal(tsd_item_len(s), 100);
    tsd_item_unref(s);
    tsd_item_unref(l);
    assert_int_equal(stats().slots_used, 0);
    /* A failed slab allocation fails the item cleanly. */
    ts__alloc_fail_after(1);
    assert_null(tsd_item_new(5000));
    ts__alloc_fail_after(-1);
    tsd_pool_drain();
}

/*
 * The header keeps no record address and only 16 bits of length: both must read back as stored
 * at every size class boundary, for slab items and own buffers, and after the length is lowered.
 */
static void test_item_len_and_data(void **state)
{
    (void)state;
    static const size_t lens[] = {
        1, 63, 64, 65, 4160, TSD_SLAB_MAX, TSD_SLAB_MAX + 1, (size_t)5 << 20};
    tsd_item *its[TS__ARRAY_SIZE(lens)];
    for (size_t i = 0; i < TS__ARRAY_SIZE(lens); i++) {
        its[i] = tsd_item_new(lens[i]);
        assert_non_null(its[i]);
        assert_int_equal(its[i]->slot == TSD_ITEM_OWN, lens[i] > TSD_SLAB_MAX);
        assert_int_equal(tsd_item_len(its[i]), lens[i]);
        assert_int_equal((uintptr_t)tsd_item_data(its[i]) % TS__ALIGN, 0);
        memset(tsd_item_data(its[i]), (int)i + 1, lens[i]);
    }
    for (size_t i = 0; i < TS__ARRAY_SIZE(lens); i++) {
        uint8_t *d = tsd_item_data(its[i]);
        assert_int_equal(tsd_item_len(its[i]), lens[i]);
        assert_int_equal(d[0], (uint8_t)(i + 1));
        assert_int_equal(d[lens[i] - 1], (uint8_t)(i + 1));
        /* Lowering the length (the lz4 path) keeps the record where it is. */
        size_t lower = lens[i] / 2;
        tsd_item_set_len(its[i], lower);
        assert_int_equal(tsd_item_len(its[i]), lower);
        assert_ptr_equal(tsd_item_data(its[i]), d);
        tsd_item_set_len(its[i], lens[i] - 1);
        assert_int_equal(tsd_item_len(its[i]), lens[i] - 1);
    }
    for (size_t i = 0; i < TS__ARRAY_SIZE(lens); i++)
        tsd_item_unref(its[i]);
    assert_int_equal(stats().slots_used, 0);
    tsd_pool_drain();
}

/*
 * Every slot of a full slab of the smallest class (the most slots, so the largest slot indexes)
 * has its own record address inside the mapping and its own length.
 */
static void test_slot_addresses(void **state)
{
    (void)state;
    size_t n = slots_per_slab(TSD_SLAB_GRAIN);
    assert_true(n < TSD_ITEM_OWN);
    tsd_item **its = calloc(n, sizeof(*its));
    assert_non_null(its);
    for (size_t i = 0; i < n; i++) {
        size_t len = 1 + i % TSD_SLAB_GRAIN;
        its[i] = tsd_item_new(len);
        assert_non_null(its[i]);
        assert_int_equal(its[i]->slot, i);
        memset(tsd_item_data(its[i]), (int)(i & 0xff), len);
    }
    assert_int_equal(stats().slabs, 1);
    uint8_t *base = tsd_item_data(its[0]);
    for (size_t i = 0; i < n; i++) {
        size_t len = 1 + i % TSD_SLAB_GRAIN;
        assert_ptr_equal(tsd_item_data(its[i]), base + i * TSD_SLAB_GRAIN);
        assert_int_equal(tsd_item_len(its[i]), len);
        assert_int_equal(tsd_item_data(its[i])[len - 1], (uint8_t)(i & 0xff));
    }
    for (size_t i = 0; i < n; i++)
        tsd_item_unref(its[i]);
    free(its);
}

/* A bin store of many small items in a few bins costs little beyond the records. */
static void test_store_overhead(void **state)
{
    (void)state;
    tsd_store st;
    assert_int_equal(tsd_store_init(&st, 0), 0);
    const size_t n = 4096, len = 4160;
    for (size_t i = 0; i < n; i++) {
        char name[16];
        int nl = snprintf(name, sizeof(name), "b%zu", i / 1024);
        tsd_item *it = tsd_item_new(len);
        assert_non_null(it);
        memset(tsd_item_data(it), 3, len);
        assert_int_equal(tsd_store_reserve(&st, len), 0);
        assert_non_null(tsd_store_add(&st, (const uint8_t *)name, (size_t)nl, it, 0, i + 1));
    }
    tsd_slab_stats ss = stats();
    assert_int_equal(ss.slots_used, n);
    assert_int_equal(st.held, n * len);
    /* Slots of exactly the record size, and 16 bytes of header (plus a little) per item. */
    assert_int_equal(ss.mapped, n * len);
    assert_true(ss.meta <= n * (sizeof(tsd_item) + 1));
    assert_int_equal(sizeof(tsd_item), 16);
    tsd_store_free(&st);
    assert_int_equal(stats().slots_used, 0);
}

int main(void)
{
    ts__alloc_count_enable(); /* test_allocation_failures counts allocations */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_size_classes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_slots_do_not_overlap, setup, teardown),
        cmocka_unit_test_setup_teardown(test_freed_slots_are_reused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_empty_slabs_are_returned, setup, teardown),
        cmocka_unit_test_setup_teardown(test_allocation_failures, setup, teardown),
        cmocka_unit_test_setup_teardown(test_items_use_slabs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_item_len_and_data, setup, teardown),
        cmocka_unit_test_setup_teardown(test_slot_addresses, setup, teardown),
        cmocka_unit_test_setup_teardown(test_store_overhead, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
