/*
 * Unit tests of the public value accessors that the modules on the public API (rl/, batcher/)
 * use instead of the value internals: ts_value_borrow, ts_tensor_new_external and
 * ts_value_tensor_set_rows.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdint.h>
#include <string.h>

#include "tensorshare/tensorshare.h"

static void test_borrow_shares_tensor_memory(void **state)
{
    (void)state;
    float data[6] = {1, 2, 3, 4, 5, 6};
    int64_t shape[2] = {2, 3};
    ts_value_t *root = ts_map_new();
    ts_value_t *inner = ts_map_new();
    assert_int_equal(ts_map_set(inner, "w", ts_tensor_new(TS_FLOAT32, 2, shape, data, TS_COPY)), 0);
    assert_int_equal(ts_map_set(inner, "raw", ts_bytes_new("abc", 3, TS_COPY)), 0);
    assert_int_equal(ts_map_set(root, "params", inner), 0);
    assert_int_equal(ts_map_set(root, "version", ts_int_new(7)), 0);
    assert_int_equal(ts_map_set(root, "name", ts_string_new("x", 1)), 0);

    ts_value_t *b = ts_value_borrow(root);
    assert_non_null(b);
    const ts_tensor_t *orig = ts_map_get_tensor(ts_map_get(root, "params"), "w");
    const ts_tensor_t *mine = ts_map_get_tensor(ts_map_get(b, "params"), "w");
    assert_ptr_equal(orig->data, mine->data); /* shared, not copied */
    assert_int_equal(mine->shape[1], 3);
    const void *ob, *mb;
    size_t on, mn;
    assert_int_equal(ts_value_bytes(ts_map_get(ts_map_get(root, "params"), "raw"), &ob, &on), 0);
    assert_int_equal(ts_value_bytes(ts_map_get(ts_map_get(b, "params"), "raw"), &mb, &mn), 0);
    assert_ptr_equal(ob, mb);
    int64_t v = 0;
    assert_int_equal(ts_map_get_int(b, "version", &v), 0);
    assert_int_equal(v, 7);
    assert_int_equal(ts_value_encoded_size(b), ts_value_encoded_size(root));
    ts_value_free(b); /* must not free root's memory: root is still readable below */
    assert_true(((const float *)orig->data)[5] == 6.0f);
    ts_value_free(root);
    assert_null(ts_value_borrow(NULL));
}

static void test_borrow_depth_limit(void **state)
{
    (void)state;
    /* TS_MAX_DEPTH levels borrow; one more does not (as it would not encode). */
    ts_value_t *root = ts_list_new();
    ts_value_t *leaf = root;
    for (int d = 1; d < TS_MAX_DEPTH; d++) {
        ts_value_t *c = ts_list_new();
        assert_int_equal(ts_list_push(leaf, c), 0);
        leaf = c;
    }
    ts_value_t *b = ts_value_borrow(root);
    assert_non_null(b);
    ts_value_free(b);
    assert_int_equal(ts_list_push(leaf, ts_list_new()), 0);
    assert_null(ts_value_borrow(root));
    ts_value_free(root);
}

static int released;
static void count_release(void *owner)
{
    released += *(int *)owner;
}

static void test_external_release_once(void **state)
{
    (void)state;
    int one = 1;
    int32_t data[4] = {0};
    int64_t shape[1] = {4};
    released = 0;
    ts_value_t *v = ts_tensor_new_external(TS_INT32, 1, shape, data, count_release, &one);
    assert_non_null(v);
    assert_ptr_equal(ts_value_tensor(v)->data, data);
    assert_int_equal(released, 0);
    ts_value_free(v);
    assert_int_equal(released, 1);
    /* Bad arguments: NULL, and release is not called. */
    int64_t bad[1] = {-1};
    assert_null(ts_tensor_new_external(TS_INT32, 1, bad, data, count_release, &one));
    assert_int_equal(released, 1);
}

static void test_set_rows(void **state)
{
    (void)state;
    int64_t shape[2] = {8, 3};
    ts_value_t *v = ts_tensor_alloc(TS_FLOAT64, 2, shape);
    assert_non_null(v);
    void *data = ts_value_tensor(v)->data;
    assert_int_equal(ts_value_tensor_set_rows(v, 5), 0);
    assert_int_equal(ts_value_tensor(v)->shape[0], 5);
    assert_int_equal(ts_tensor_nbytes(ts_value_tensor(v)), 5 * 3 * sizeof(double));
    assert_ptr_equal(ts_value_tensor(v)->data, data);
    assert_int_equal(ts_value_tensor_set_rows(v, 0), 0);
    assert_int_equal(ts_value_tensor_set_rows(v, 8), 0);         /* back to what it was made for */
    assert_int_equal(ts_value_tensor_set_rows(v, 9), TS_EINVAL); /* past its memory */
    assert_int_equal(ts_value_tensor_set_rows(v, -1), TS_EINVAL);
    assert_int_equal(ts_value_tensor_set_rows(v, INT64_MAX), TS_EINVAL); /* overflows */
    assert_int_equal(ts_value_tensor(v)->shape[0], 8);
    assert_int_equal(ts_value_tensor_set_rows(v, 2), 0);
    ts_value_free(v); /* frees the memory as allocated (8 rows), whatever the rows now */

    /* Not a tensor, or a scalar tensor: refused. */
    ts_value_t *m = ts_map_new();
    assert_int_equal(ts_value_tensor_set_rows(m, 1), TS_EINVAL);
    ts_value_free(m);
    double x = 1;
    ts_value_t *s = ts_tensor_new(TS_FLOAT64, 0, NULL, &x, TS_COPY);
    assert_int_equal(ts_value_tensor_set_rows(s, 1), TS_EINVAL);
    ts_value_free(s);
    assert_int_equal(ts_value_tensor_set_rows(NULL, 1), TS_EINVAL);

    /* A borrowed tensor covers only the memory it was made over. */
    float buf[6] = {0};
    int64_t bshape[2] = {2, 3};
    ts_value_t *bv = ts_tensor_new(TS_FLOAT32, 2, bshape, buf, TS_BORROW);
    assert_int_equal(ts_value_tensor_set_rows(bv, 1), 0);
    assert_int_equal(ts_value_tensor_set_rows(bv, 3), TS_EINVAL);
    ts_value_free(bv);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_borrow_shares_tensor_memory),
        cmocka_unit_test(test_borrow_depth_limit),
        cmocka_unit_test(test_external_release_once),
        cmocka_unit_test(test_set_rows),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
