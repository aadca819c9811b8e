/* tensord's name hash: keyed, so that clients cannot choose names that collide. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <string.h>

#include "server.h"

/* The same names hash differently under two keys, and the same under one key. */
static void test_seed_changes_hash(void **state)
{
    (void)state;
    uint8_t k1[16], k2[16];
    memset(k1, 0x11, sizeof(k1));
    memset(k2, 0x11, sizeof(k2));
    k2[15] ^= 1;
    static const char *const names[] = {"", "a", "weights", "a-name-of-exactly-23-b",
                                        "model/layer.0/attention/query/weight"};
    int differ = 0;
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        const uint8_t *p = (const uint8_t *)names[i];
        size_t n = strlen(names[i]);
        tsd_hash_seed(k1);
        uint32_t a = tsd_hash(p, n);
        assert_int_equal(tsd_hash(p, n), a);
        tsd_hash_seed(k2);
        uint32_t b = tsd_hash(p, n);
        differ += a != b;
    }
    assert_int_equal(differ, 5);
}

/* A store seeds the hash from the kernel: two processes' keys differ, a store's lookups work. */
static void test_store_seeds_and_finds(void **state)
{
    (void)state;
    tsd_store st;
    assert_int_equal(tsd_store_init(&st, 0), 0);
    tsd_item *it = tsd_item_new(64);
    assert_non_null(it);
    memset(tsd_item_data(it), 0, 64);
    assert_int_equal(tsd_store_reserve(&st, 64), 0);
    assert_non_null(tsd_store_add(&st, (const uint8_t *)"x", 1, it, 1, 1));
    assert_non_null(tsd_store_find(&st, (const uint8_t *)"x", 1));
    /* The bin and the item header count against the limit beside the record bytes. */
    assert_true(st.overhead > 64);
    assert_int_equal(tsd_store_used(&st), st.held + st.overhead);
    tsd_store_free(&st);
    assert_int_equal(st.overhead, 0);
    tsd_slab_drain();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_seed_changes_hash),
        cmocka_unit_test(test_store_seeds_and_finds),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
