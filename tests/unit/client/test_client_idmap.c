/*
 * The client's in-flight map (client/idmap.c) against a plain array model: random inserts and
 * deletes, wrapping ids, growth, and the backward-shift deletion that keeps probe runs intact.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdlib.h>

#include "internal.h"

#define MODEL 4096

static void test_random_against_model(void **state)
{
    (void)state;
    static void *model[MODEL];
    static uint32_t ids[MODEL];
    ts__idmap m;
    memset(&m, 0, sizeof(m));
    memset(model, 0, sizeof(model));
    uint32_t seed = 7;
    size_t live = 0;
    for (int step = 0; step < 200000; step++) {
        seed = seed * 1103515245u + 12345u;
        size_t k = (seed >> 8) % MODEL;
        /* ids near the u32 wrap and clustered ones collide in the table on purpose */
        uint32_t id = k < MODEL / 2 ? 0xFFFFF000u + (uint32_t)k : (uint32_t)k * 64u + 1u;
        if (model[k] == NULL) {
            void *val = &ids[k];
            assert_null(ts__idmap_get(&m, id));
            assert_int_equal(ts__idmap_put(&m, id, val), 0);
            model[k] = val;
            ids[k] = id;
            live++;
        } else {
            assert_ptr_equal(ts__idmap_get(&m, id), model[k]);
            assert_ptr_equal(ts__idmap_del(&m, id), model[k]);
            assert_null(ts__idmap_get(&m, id));
            model[k] = NULL;
            live--;
        }
        assert_int_equal(m.n, live);
        if (step % 10000 == 0)
            for (size_t j = 0; j < MODEL; j++)
                if (model[j] != NULL)
                    assert_ptr_equal(ts__idmap_get(&m, ids[j]), model[j]);
    }
    assert_null(ts__idmap_del(&m, 0));
    assert_null(ts__idmap_get(&m, 0));
    ts__idmap_free(&m);
    assert_null(ts__idmap_get(&m, 5));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_against_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
