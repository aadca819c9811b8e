/* Unit tests for the record codec, validator and value trees (src/record.c, src/value.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdlib.h>

#include "record.h"

static ts_value_t *decode_copy(const uint8_t *rec, size_t len, ts__rbuf **out_buf)
{
    uint8_t *copy = ts__malloc_aligned(len);
    assert_non_null(copy);
    memcpy(copy, rec, len);
    ts__rbuf *b = ts__rbuf_new(copy, len, NULL);
    assert_non_null(b);
    ts_value_t *root = ts__record_decode(b, 0, len, TS_MAX_DEPTH, TS_MAX_NDIM);
    *out_buf = b;
    return root;
}

static void test_round_trip_every_dtype(void **state)
{
    (void)state;
    for (int dt = TS_BOOL; dt <= TS_COMPLEX128; dt++) {
        int64_t shape[3] = {2, 3, 5};
        size_t n = 30 * ts_dtype_size((ts_dtype_t)dt);
        uint8_t *data = malloc(n);
        for (size_t i = 0; i < n; i++)
            data[i] = (uint8_t)(i * 7 + (size_t)dt);
        ts_value_t *m = ts_map_new();
        assert_int_equal(ts_map_set(m, "t", ts_tensor_new((ts_dtype_t)dt, 3, shape, data, 0)), 0);
        assert_int_equal(ts_map_set(m, "v", ts_int_new(-7)), 0);
        uint8_t *rec;
        size_t len;
        assert_int_equal(ts__record_encode(m, &rec, &len), 0);
        assert_int_equal(len, ts_value_encoded_size(m));
        assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), 0);
        ts__rbuf *b;
        ts_value_t *root = decode_copy(rec, len, &b);
        assert_non_null(root);
        const ts_tensor_t *t = ts_map_get_tensor(root, "t");
        assert_non_null(t);
        assert_int_equal(t->dtype, dt);
        assert_int_equal(t->ndim, 3);
        assert_int_equal(t->shape[2], 5);
        assert_int_equal(((uintptr_t)t->data) % 64, 0);
        assert_memory_equal(t->data, data, n);
        int64_t v;
        assert_int_equal(ts_map_get_int(root, "v", &v), 0);
        assert_int_equal(v, -7);
        ts_value_free(root);
        ts__rbuf_unref(b);
        ts__free_aligned(rec, len);
        ts_value_free(m);
        free(data);
    }
}

static void test_round_trip_nested(void **state)
{
    (void)state;
    float w[4] = {1, 2, 3, 4};
    int64_t shape[1] = {4};
    ts_value_t *root = ts_map_new();
    ts_value_t *params = ts_map_new();
    ts_value_t *list = ts_list_new();
    assert_int_equal(ts_map_set(params, "w", ts_tensor_new(TS_FLOAT32, 1, shape, w, TS_COPY)), 0);
    assert_int_equal(ts_map_set(params, "scalar", ts_tensor_new(TS_FLOAT64, 0, NULL,
                                                                 &(double){2.5}, TS_COPY)),
                     0);
    assert_int_equal(ts_list_push(list, ts_string_new("hello", 5)), 0);
    assert_int_equal(ts_list_push(list, ts_float_new(0.25)), 0);
    assert_int_equal(ts_list_push(list, ts_bytes_new("\x00\x01\x02", 3, TS_COPY)), 0);
    assert_int_equal(ts_list_push(list, ts_list_new()), 0);
    assert_int_equal(ts_map_set(root, "params", params), 0);
    assert_int_equal(ts_map_set(root, "misc", list), 0);
    assert_int_equal(ts_map_set(root, "version", ts_int_new(7)), 0);

    uint8_t *rec;
    size_t len;
    assert_int_equal(ts__record_encode(root, &rec, &len), 0);
    ts__rbuf *b;
    ts_value_t *d = decode_copy(rec, len, &b);
    assert_non_null(d);
    assert_int_equal(ts_value_len(d), 3);
    assert_string_equal(ts_map_key_at(d, 0), "params");
    const ts_value_t *p = ts_map_get(d, "params");
    const ts_tensor_t *t = ts_map_get_tensor(p, "w");
    assert_memory_equal(t->data, w, sizeof(w));
    const ts_tensor_t *s = ts_map_get_tensor(p, "scalar");
    assert_int_equal(s->ndim, 0);
    assert_true(*(double *)s->data == 2.5);
    const ts_value_t *l = ts_map_get(d, "misc");
    const char *str;
    size_t sl;
    assert_int_equal(ts_value_string(ts_list_at(l, 0), &str, &sl), 0);
    assert_string_equal(str, "hello");
    double f;
    assert_int_equal(ts_value_float(ts_list_at(l, 1), &f), 0);
    assert_true(f == 0.25);
    const void *bytes;
    size_t bl;
    assert_int_equal(ts_value_bytes(ts_list_at(l, 2), &bytes, &bl), 0);
    assert_int_equal(bl, 3);
    assert_memory_equal(bytes, "\x00\x01\x02", 3);
    assert_int_equal(ts_value_type(ts_list_at(l, 3)), TS_TYPE_LIST);
    assert_int_equal(ts_value_len(ts_list_at(l, 3)), 0);
    assert_int_equal(ts_value_int(ts_list_at(l, 0), &(int64_t){0}), TS_ETYPE);

    /* A clone of a received tree is independent of its buffer. */
    ts_value_t *c = ts_value_clone(d);
    ts_value_free(d);
    ts__rbuf_unref(b);
    assert_memory_equal(ts_map_get_tensor(ts_map_get(c, "params"), "w")->data, w, sizeof(w));
    ts_value_free(c);
    ts__free_aligned(rec, len);
    ts_value_free(root);
}

/* Every truncation and every single-byte corruption of a record is rejected or decodes safely. */
static void test_reject_truncated_and_corrupt(void **state)
{
    (void)state;
    int64_t shape[2] = {4, 4};
    ts_value_t *m = ts_map_new();
    assert_int_equal(ts_map_set(m, "a", ts_tensor_alloc(TS_FLOAT32, 2, shape)), 0);
    assert_int_equal(ts_map_set(m, "b", ts_tensor_alloc(TS_INT64, 1, shape)), 0);
    uint8_t *rec;
    size_t len;
    assert_int_equal(ts__record_encode(m, &rec, &len), 0);
    for (size_t cut = 0; cut < len; cut++)
        assert_int_equal(ts__record_validate(rec, cut, TS_MAX_DEPTH, TS_MAX_NDIM, NULL),
                         TS_EBADRECORD);
    /* Flip every byte of the header and meta; the validator must never read out of bounds. */
    size_t meta_end = TS_REC_HDR_SIZE + ts__get_u32le(rec + 4);
    for (size_t i = 0; i < meta_end; i++) {
        for (int bit = 0; bit < 8; bit++) {
            rec[i] ^= (uint8_t)(1u << bit);
            ts__rec_info info;
            if (ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, &info) == 0) {
                ts__rbuf *b;
                ts_value_t *d = decode_copy(rec, len, &b);
                assert_non_null(d);
                ts_value_free(d);
                ts__rbuf_unref(b);
            }
            rec[i] ^= (uint8_t)(1u << bit);
        }
    }
    ts__free_aligned(rec, len);
    ts_value_free(m);
}

static void test_reject_inconsistent(void **state)
{
    (void)state;
    int64_t shape[1] = {16};
    ts_value_t *t = ts_tensor_alloc(TS_FLOAT32, 1, shape);
    uint8_t *rec;
    size_t len;
    assert_int_equal(ts__record_encode(t, &rec, &len), 0);
    /* meta: type(1) dtype(1) ndim(1) rsvd(2) dim(8) off(8) len(8) */
    uint8_t *meta = rec + TS_REC_HDR_SIZE;
    uint8_t saved[64];
    memcpy(saved, rec, 64);
    /* shape x dtype != data length */
    ts__put_u64le(meta + 5, 17);
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL),
                     TS_EBADRECORD);
    memcpy(rec, saved, 64);
    /* misaligned data offset */
    ts__put_u64le(meta + 13, 4);
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL),
                     TS_EBADRECORD);
    memcpy(rec, saved, 64);
    /* ndim beyond the configured limit, dtype unknown, reserved set */
    meta[2] = 9;
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL),
                     TS_EBADRECORD);
    memcpy(rec, saved, 64);
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, 0, NULL), TS_EBADRECORD);
    meta[1] = 99;
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL),
                     TS_EBADRECORD);
    memcpy(rec, saved, 64);
    meta[3] = 1;
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL),
                     TS_EBADRECORD);
    memcpy(rec, saved, 64);
    /* overflowing dimension */
    ts__put_u64le(meta + 5, UINT64_MAX / 2);
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL),
                     TS_EBADRECORD);
    memcpy(rec, saved, 64);
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), 0);
    ts__free_aligned(rec, len);
    ts_value_free(t);
}

static void test_depth_limit(void **state)
{
    (void)state;
    ts_value_t *root = ts_list_new();
    ts_value_t *cur = root;
    for (int i = 0; i < 10; i++) {
        ts_value_t *l = ts_list_new();
        assert_int_equal(ts_list_push(cur, l), 0);
        cur = l;
    }
    uint8_t *rec;
    size_t len;
    assert_int_equal(ts__record_encode(root, &rec, &len), 0);
    assert_int_equal(ts__record_validate(rec, len, 11, TS_MAX_NDIM, NULL), 0);
    assert_int_equal(ts__record_validate(rec, len, 10, TS_MAX_NDIM, NULL), TS_EBADRECORD);
    ts__free_aligned(rec, len);
    for (int i = 0; i < 40; i++) {
        ts_value_t *l = ts_list_new();
        assert_int_equal(ts_list_push(cur, l), 0);
        cur = l;
    }
    assert_int_equal(ts__record_encode(root, &rec, &len), TS_EINVAL);
    ts_value_free(root);
}

static void test_builder_errors(void **state)
{
    (void)state;
    int64_t neg[1] = {-1};
    assert_null(ts_tensor_new(TS_FLOAT32, 1, neg, "x", 0));
    assert_null(ts_tensor_new(TS_DTYPE_INVALID, 0, NULL, "x", 0));
    int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    assert_null(ts_tensor_alloc(TS_FLOAT32, 9, nine));
    ts_value_t *m = ts_map_new();
    assert_int_equal(ts_map_set(m, "k", NULL), TS_ENOMEM);
    assert_int_equal(ts_map_set(m, "k", ts_int_new(1)), 0);
    assert_int_equal(ts_map_set(m, "k", ts_int_new(2)), 0); /* replaces */
    assert_int_equal(ts_value_len(m), 1);
    int64_t v;
    assert_int_equal(ts_map_get_int(m, "k", &v), 0);
    assert_int_equal(v, 2);
    assert_int_equal(ts_list_push(m, ts_int_new(3)), TS_EINVAL); /* not a list: child freed */
    ts_value_free(m);
    ts_value_free(NULL);
    assert_int_equal(ts_dtype_from_name("bfloat16"), TS_BFLOAT16);
    assert_string_equal(ts_dtype_name(TS_COMPLEX64), "complex64");
    assert_int_equal(ts_dtype_size(TS_COMPLEX128), 16);
}

/* Fail every allocation of an encode and a decode in turn: errors, never crashes or leaks. */
static void test_allocation_failures(void **state)
{
    (void)state;
    int64_t shape[1] = {8};
    for (long n = 1; n < 64; n++) {
        ts__alloc_fail_after(n);
        ts_value_t *m = ts_map_new();
        int rc = m == NULL ? TS_ENOMEM : ts_map_set(m, "t", ts_tensor_alloc(TS_INT32, 1, shape));
        uint8_t *rec = NULL;
        size_t len = 0;
        if (rc == 0)
            rc = ts__record_encode(m, &rec, &len);
        if (rc == 0) {
            uint8_t *copy = ts__malloc_aligned(len);
            ts__rbuf *b = copy != NULL ? ts__rbuf_new(copy, len, NULL) : NULL;
            if (b != NULL) {
                memcpy(copy, rec, len);
                ts_value_t *d = ts__record_decode(b, 0, len, TS_MAX_DEPTH, TS_MAX_NDIM);
                ts_value_free(d);
                ts__rbuf_unref(b);
            } else if (copy != NULL) {
                ts__free_aligned(copy, len);
            }
            ts__free_aligned(rec, len);
        }
        ts_value_free(m);
        ts__alloc_fail_after(-1);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip_every_dtype),
        cmocka_unit_test(test_round_trip_nested),
        cmocka_unit_test(test_reject_truncated_and_corrupt),
        cmocka_unit_test(test_reject_inconsistent),
        cmocka_unit_test(test_depth_limit),
        cmocka_unit_test(test_builder_errors),
        cmocka_unit_test(test_allocation_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
